"""Token rows into the expert-sorted layout: the backward's prologue, and the forward's gate/up operand.

    x_sorted[r]     = x[t]                         (0 for padding rows)
    d_out_sorted[r] = dOut[t]                      (0 for padding rows)
    dy_sorted[r]    = bf16(w[t,j] · dOut[t])       (0 for padding rows; only with router weights)

Legend: r a row of the sorted layout of `schedule.py`, src(r) = row_source[r] =
t·topk + j (−1: padding), T tokens, H hidden.

Why materialise what the forward gathers inside its loads: the weight-gradient GEMMs
reduce over rows, so a gathered operand needs a new index vector every K step; that
chain of loads held them at ~360 TFLOPS on H200, while over sorted operands read through
TMA they reach 590–640 (BENCHMARKS.md). The copy runs at HBM speed, and the down dgrad
reads d_out_sorted through TMA too.

The forward's gate/up GEMM reads x through TMA from the same copy (x alone, `d_out=None`)
where its intermediate size makes that pay (`grouped_gemm.gemm_config`): per row copied, that
GEMM does 4·I FLOPs per element of x, so at large I the copy is cheap against what TMA saves.

Why two copies of dOut: the down dgrad needs dOut unweighted (its epilogue forms the
router-weight gradient ⟨dOut·Wd, h⟩ and applies w in fp32), the down wgrad needs w·dOut
as a plain TMA operand. Forming w·h in the down dgrad's epilogue instead measured 1.5×
slower there; the extra copy costs ~0.13 ms on qwen3-30b and no activation memory.
dy carries one bf16 rounding of w·dOut (relative 2^-9 per element, far inside SPEC's
bf16 bar).

mxfp8 (`mxfp8=True`): each copy comes out rounded to the MXFP8 grid of the GEMM that reads it
(`quant.mxfp8_round`): d_out_sorted in blocks of 32 along H (the down dgrad reduces over H),
x_sorted and dy_sorted in blocks of 32 rows (the wgrads reduce over rows), dy from the fp32
product w·dOut. A program then copies 32 rows, one block: the schedule pads every expert
to a multiple of BLOCK_M (a multiple of 32), so the block is one expert's, padding zeros.

Caller contract: rows at or past the schedule's `num_rows` are not written (no kernel
reads them). Padding rows get exact zeros, which the GEMMs reading these operands
without masks rely on. A copy: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.common import interpreting, round_to_bf16
from mok.kernels.quant import mxfp8_round_tile
from mok.kernels.schedule import RoutingSchedule
from mok.mxfp8 import MX_BLOCK

ROWS_PER_PROGRAM = 16  # 16 rows × H columns per program: ~8K programs for 131K rows


@triton.jit
def _gather_sorted_rows_kernel(
    # pointers
    x_ptr, d_out_ptr, topk_weights_ptr, x_sorted_ptr, d_out_sorted_ptr, dy_sorted_ptr,
    # schedule
    row_source_ptr, num_rows_ptr,
    # sizes
    hidden, topk,
    # strides
    stride_x_t, stride_dout_t, stride_sorted_r,
    # meta
    HAS_D_OUT: tl.constexpr, HAS_WEIGHTS: tl.constexpr, MXFP8: tl.constexpr, INTERPRETER: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    num_rows = tl.load(num_rows_ptr)
    if tl.program_id(0) * ROWS >= num_rows:
        return
    in_schedule = rows < num_rows
    source = tl.load(row_source_ptr + rows, mask=in_schedule, other=-1)
    valid = source >= 0
    slot = tl.where(valid, source, 0)
    token = (slot // topk).to(tl.int64)[:, None]
    if HAS_WEIGHTS:  # the launcher passes weights only with dOut
        w = tl.load(topk_weights_ptr + slot, mask=valid, other=0.0)[:, None]
    sorted_offs = rows.to(tl.int64)[:, None] * stride_sorted_r
    cols = tl.arange(0, BLOCK_H)
    for h0 in range(0, hidden, BLOCK_H):
        in_row = (h0 + cols < hidden)[None, :]
        load_mask = valid[:, None] & in_row
        store_mask = in_schedule[:, None] & in_row
        offs = h0 + cols[None, :]
        x = tl.load(x_ptr + token * stride_x_t + offs, mask=load_mask, other=0.0)
        if MXFP8:  # each operand on the grid of the GEMM that reads it
            x = round_to_bf16(mxfp8_round_tile(x.to(tl.float32), ROWS, BLOCK_H, True), INTERPRETER)
        tl.store(x_sorted_ptr + sorted_offs + offs, x, mask=store_mask)
        if HAS_D_OUT:
            d_out = tl.load(d_out_ptr + token * stride_dout_t + offs, mask=load_mask, other=0.0)
            if HAS_WEIGHTS:
                dy = w * d_out.to(tl.float32)
            if MXFP8:
                d_out = round_to_bf16(mxfp8_round_tile(d_out.to(tl.float32), ROWS, BLOCK_H, False), INTERPRETER)
                if HAS_WEIGHTS:
                    dy = mxfp8_round_tile(dy, ROWS, BLOCK_H, True)
            tl.store(d_out_sorted_ptr + sorted_offs + offs, d_out, mask=store_mask)
            if HAS_WEIGHTS:
                tl.store(dy_sorted_ptr + sorted_offs + offs, round_to_bf16(dy, INTERPRETER), mask=store_mask)


def check_sorted_rows(name: str, t: torch.Tensor, width: int, schedule: RoutingSchedule) -> None:
    """A sorted-layout operand of the GEMMs: bf16 [R, width] with unit column stride and
    R ≤ capacity_rows (TMA reads rows past R as zeros)."""
    if (t.dtype != torch.bfloat16 or t.dim() != 2 or t.shape[1] != width or t.shape[0] > schedule.capacity_rows
            or t.stride(1) != 1 or t.device != schedule.row_source.device):
        raise ValueError(
            f"{name}: expected a bf16 [rows <= {schedule.capacity_rows}, {width}] tensor with unit column stride "
            f"on {schedule.row_source.device}, got {t.dtype} {list(t.shape)} on {t.device}"
        )


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, device) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or t.stride(-1) != 1 or t.device != device:
        raise ValueError(f"{name}: expected a {str(dtype).removeprefix('torch.')} {list(shape)} tensor with unit "
                         f"last stride on {device}, got {t.dtype} {list(t.shape)} on {t.device}")


def gather_sorted_rows(
    x: torch.Tensor,  # [T, H] bf16
    d_out: torch.Tensor | None,  # [T, H] bf16; None: x alone (the forward's gate/up operand)
    topk_weights: torch.Tensor | None,  # [T, topk] fp32; None: no dy_sorted
    schedule: RoutingSchedule,
    topk: int,
    mxfp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x_sorted, d_out_sorted, dy_sorted) [capacity_rows, H] bf16 in the schedule's sorted
    layout; d_out_sorted only with d_out and dy_sorted = w·dOut only with both d_out and
    topk_weights (else None); with `mxfp8`, each rounded to its GEMM's MXFP8 grid."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"x: expected a bf16 [T, H] tensor with unit column stride, got {x.dtype} {list(x.shape)}")
    num_tokens, hidden = x.shape
    device = x.device
    if d_out is not None:
        _check_rows("d_out", d_out, (num_tokens, hidden), torch.bfloat16, device)
    elif topk_weights is not None:
        raise ValueError("topk_weights: expected None without d_out (dy_sorted = w·dOut needs dOut)")
    if topk_weights is not None:
        _check_rows("topk_weights", topk_weights, (num_tokens, topk), torch.float32, device)
        if not topk_weights.is_contiguous():
            raise ValueError("topk_weights: expected a contiguous tensor")
    if schedule.row_source.device != device:
        raise ValueError(f"schedule: expected tensors on {device}, got {schedule.row_source.device}")
    if mxfp8 and (hidden % MX_BLOCK or schedule.block_m % MX_BLOCK):
        raise ValueError(f"x: mxfp8 needs H and the schedule's BLOCK_M multiples of {MX_BLOCK}, got H = {hidden}, "
                         f"BLOCK_M = {schedule.block_m}")
    # mxfp8: one block of rows, 64 columns: three tiles and the rounding's temporaries stay in
    # registers (32 x 256 columns spilled and took 9.9 ms instead of 0.7 on qwen3-30b, H200).
    # 8 warps measured slower than 4 (1.57 vs 1.13 ms).
    rows_per_program = MX_BLOCK if mxfp8 else ROWS_PER_PROGRAM
    x_sorted = torch.empty(schedule.capacity_rows, hidden, dtype=x.dtype, device=device)  # [capacity_rows, H]
    d_out_sorted = None if d_out is None else torch.empty_like(x_sorted)  # [capacity_rows, H]
    dy_sorted = None if topk_weights is None else torch.empty_like(x_sorted)  # [capacity_rows, H]
    grid = (triton.cdiv(schedule.capacity_rows, rows_per_program),)
    _gather_sorted_rows_kernel[grid](
        x, x if d_out is None else d_out, x if topk_weights is None else topk_weights,  # x: an unread stand-in
        x_sorted, x_sorted if d_out_sorted is None else d_out_sorted, x_sorted if dy_sorted is None else dy_sorted,
        schedule.row_source, schedule.num_rows,
        hidden, topk,
        x.stride(0), x.stride(0) if d_out is None else d_out.stride(0), x_sorted.stride(0),
        HAS_D_OUT=d_out is not None, HAS_WEIGHTS=topk_weights is not None, MXFP8=mxfp8, INTERPRETER=interpreting(),
        ROWS=rows_per_program, BLOCK_H=min(64 if mxfp8 else 256, triton.next_power_of_2(hidden)), num_warps=4,
    )
    return x_sorted, d_out_sorted, dy_sorted
