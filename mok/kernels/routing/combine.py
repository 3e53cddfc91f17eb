"""Combine: each token's output from its routes' unweighted expert outputs.

    out[t] = bf16( y_shared[t] + Σ_j w[t,j] · y[t·topk + j] )     fp32, ascending j

Legend: T tokens, H hidden, topk routes per token. `y` holds one bf16 row per route
slot (written by the down GEMM), or with `route_row` its rows in the schedule's sorted
layout, route t·topk + j's at row route_row[t·topk + j] (none where −1); `y_shared` the
shared expert's bf16 output or nothing.
The sum runs in one program per (token block, hidden block) in a fixed order: the
result is deterministic and equals the layer's definition bit for bit at fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.common import interpreting, round_to_bf16
from mok.kernels.plan import kernel_plan

# Tokens × hidden columns per program and its warps: the plan's `combine_*`, with their record.


@triton.jit
def weighted_route_sum(y_ptr, w_ptr, route_row_ptr, tokens, h_offs, mask, stride_y_s, acc,
                       TOPK: tl.constexpr, SORTED: tl.constexpr):
    """acc + Σ_j w[t,j]·y[t·TOPK+j] over ascending j, for a [tokens, h_offs] block; SORTED: y's
    row route_row[t·TOPK+j] instead (a route without one adds nothing). Unrolled over j, so that
    every route's loads can be in flight at once (SORTED: each a load behind its route_row's)."""
    for j in tl.static_range(TOPK):
        w = tl.load(w_ptr + tokens * TOPK + j, mask=tokens >= 0, other=0.0)
        row = tokens.to(tl.int64) * TOPK + j
        row_mask = mask
        if SORTED:
            row = tl.load(route_row_ptr + row, mask=tokens >= 0, other=-1).to(tl.int64)
            row_mask = mask & (row >= 0)[:, None]
        y = tl.load(y_ptr + row[:, None] * stride_y_s + h_offs[None, :], mask=row_mask, other=0.0)
        acc += w[:, None] * y.to(tl.float32)
    return acc


@triton.jit
def _combine_kernel(
    y_ptr, topk_weights_ptr, y_shared_ptr, route_row_ptr, out_ptr,
    num_tokens, hidden,
    stride_y_s, stride_shared_t, stride_out_t,
    TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, SORTED: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h_offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (tokens < num_tokens)[:, None] & (h_offs < hidden)[None, :]
    tokens = tl.where(tokens < num_tokens, tokens, -1)
    rows = tl.where(tokens >= 0, tokens, 0).to(tl.int64)[:, None]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    if HAS_SHARED:
        acc += tl.load(y_shared_ptr + rows * stride_shared_t + h_offs[None, :], mask=mask, other=0.0).to(tl.float32)
    acc = weighted_route_sum(y_ptr, topk_weights_ptr, route_row_ptr, tokens, h_offs, mask, stride_y_s, acc, TOPK,
                             SORTED)
    tl.store(out_ptr + rows * stride_out_t + h_offs[None, :], round_to_bf16(acc, INTERPRETER), mask=mask)


def combine(
    y: torch.Tensor,  # [T·topk, H] bf16, or [rows, H] with route_row
    topk_weights: torch.Tensor,  # [T, topk] fp32
    y_shared: torch.Tensor | None = None,  # [T, H] bf16
    route_row: torch.Tensor | None = None,  # [T·topk] int32: y's row of each route, −1 for none
    out: torch.Tensor | None = None,  # [T, H] bf16
) -> torch.Tensor:
    """out [T, H] bf16: a new tensor, or `out`'s rows written (a view into a larger buffer, e.g.
    one rank's block of the rows that travel back under expert parallelism)."""
    num_tokens, topk = topk_weights.shape
    hidden = y.shape[1]
    if route_row is None and (y.shape != (num_tokens * topk, hidden) or y.stride(1) != 1):
        raise ValueError(f"y: expected a [{num_tokens * topk}, H] tensor with unit column stride, got {list(y.shape)}")
    if route_row is not None and (y.dim() != 2 or y.stride(1) != 1):
        raise ValueError(f"y: expected a 2-D [rows, H] tensor with unit column stride, got {list(y.shape)}")
    if route_row is not None and (
        route_row.shape != (num_tokens * topk,) or route_row.dtype != torch.int32 or route_row.device != y.device
    ):
        raise ValueError(f"route_row: expected a [{num_tokens * topk}] int32 tensor on {y.device}, got "
                         f"{route_row.dtype} {list(route_row.shape)} on {route_row.device}")
    if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights: expected a contiguous fp32 tensor, got {topk_weights.dtype}")
    if y_shared is not None and (y_shared.shape != (num_tokens, hidden) or y_shared.stride(1) != 1):
        raise ValueError(f"y_shared: expected a [{num_tokens}, {hidden}] tensor, got {list(y_shared.shape)}")
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=y.device)  # [T, H]
    elif (out.shape != (num_tokens, hidden) or out.dtype != torch.bfloat16 or out.stride(1) != 1
          or out.device != y.device):
        raise ValueError(f"out: expected a bf16 [{num_tokens}, {hidden}] tensor with unit column stride on {y.device}, "
                         f"got {out.dtype} {list(out.shape)} on {out.device}")
    plan = kernel_plan(y.device)
    block_t, block_h = plan.combine_block_t, min(plan.combine_block_h, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block_h))
    _combine_kernel[grid](
        y, topk_weights, y if y_shared is None else y_shared, topk_weights if route_row is None else route_row, out,
        num_tokens, hidden,
        y.stride(0), 0 if y_shared is None else y_shared.stride(0), out.stride(0),
        TOPK=topk, HAS_SHARED=y_shared is not None, SORTED=route_row is not None, INTERPRETER=interpreting(),
        BLOCK_T=block_t, BLOCK_H=block_h, num_warps=plan.combine_num_warps,
    )
    return out
