"""Token rows into the expert-sorted layout: the backward's prologue, and the forward's gate/up operand.

    x_sorted[r]     = x[t]                         (0 for padding rows)
    d_out_sorted[r] = dOut[t]                      (0 for padding rows)
    dy_sorted[r]    = bf16(w[t,j] · dOut[t])       (0 for padding rows; only with router weights)

Legend: r a row of the sorted layout of `schedule.py`, src(r) = row_source[r] =
t·topk + j (−1: padding), T tokens, H hidden.

Why materialise what the forward gathers inside its loads: the weight-gradient GEMMs
reduce over rows, so a gathered operand needs a new index vector every K step; that
chain of loads held them far below the rate they reach over sorted operands read through
TMA (benchmarks/LOG.md, "The backward rewrite"). The copy runs at HBM speed, and the down dgrad
reads d_out_sorted through TMA too.

x's copy and dOut's can also be made apart (`d_out=None`, `x=None`), each bitwise what the joint
launch writes: under expert parallelism x's copy runs while the dOut rows travel.

The forward's gate/up GEMM reads x through TMA from the same copy (x alone, `d_out=None`)
where its intermediate size makes that pay (`gemm.common.gemm_config`): per row copied, that
GEMM does 4·I FLOPs per element of x, so at large I the copy is cheap against what TMA saves.

Why a second copy of dOut, where I ≥ H: the down dgrad needs dOut unweighted (its epilogue
forms the router-weight gradient ⟨dOut·Wd, h⟩ and applies w in fp32), the down wgrad needs
w·dOut as a plain TMA operand. Where I < H the down dgrad's epilogue writes w·h instead
(`gemm.dgrad.down_wgrad_reads_weighted_h`, 2·I bytes per route against w·dOut's 2·H), and the
caller asks for no dy (`topk_weights=None`). dy carries one bf16 rounding of w·dOut
(relative 2^-9 per element, far inside the bf16 accuracy bar).

mxfp8 (`mxfp8=True`): each copy comes out rounded to the MXFP8 grid of the GEMM that reads it
(`quant.mxfp8.mxfp8_round`): d_out_sorted in blocks of 32 along H (the down dgrad reduces over H),
x_sorted and dy_sorted in blocks of 32 rows (the wgrads reduce over rows), dy from the fp32
product w·dOut. A program then copies 32 rows, one block: the schedule pads every expert
to a multiple of BLOCK_M (a multiple of 32), so the block is one expert's, padding zeros.

fp8_block makes no bf16 copy: its quantizers read the token rows through row_source
themselves (`quant.fp8_block.quantize_fp8_block_gathered_t`), or quantize the token rows once
and copy the e4m3 rows and their scales here as bf16 pairs
(`quant.fp8_block.quantize_fp8_block_gathered`), or its down dgrad gathers dOut's quantized
token rows; each bitwise as if from these copies.

Two orders of the same copy. Row-major (`_gather_sorted_rows_kernel`): a program per block
of sorted rows loads each row's token. Consecutive sorted rows belong to one expert and to
tokens far apart, so with topk routes per token every token row is read topk times, mostly
from HBM (x and dOut together outgrow the L2). Token-major (`_scatter_token_rows_kernel`,
bf16 and topk ≥ the plan's `token_major_min_topk`): a program per block of tokens reads each token
once and stores it to its topk rows (the schedule's route_row, the inverse of row_source);
further programs, one per expert, zero its padding rows. mxfp8 keeps the row-major order:
its copies round blocks of 32 consecutive sorted rows together.

Caller contract: rows at or past the schedule's `num_rows` are not written (no kernel
reads them). Padding rows get exact zeros, which the GEMMs reading these operands
without masks rely on. A copy: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.common import interpreting, round_to_bf16
from mok.kernels.plan import kernel_plan
from mok.kernels.quant.mxfp8 import mxfp8_round_tile
from mok.kernels.routing.schedule import RoutingSchedule
from mok.mxfp8 import MX_BLOCK


@triton.jit
def sorted_row_routes(rows, row_ok, row_source_ptr, topk):
    """(slot, token, valid) of sorted rows: slot = row_source[r], the route t·topk + j (0 where
    none), its token t = slot // topk, and whether the row has a route (padding rows, −1,
    and rows not `row_ok` have none and read nothing). Also the fp8_block quantizers'
    gathering loads (`quant/fp8_block.py`)."""
    source = tl.load(row_source_ptr + rows, mask=row_ok, other=-1)
    valid = source >= 0
    slot = tl.where(valid, source, 0)
    return slot, slot // topk, valid


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
    HAS_X: tl.constexpr, HAS_D_OUT: tl.constexpr, HAS_WEIGHTS: tl.constexpr, MXFP8: tl.constexpr,
    INTERPRETER: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    num_rows = tl.load(num_rows_ptr)
    if tl.program_id(0) * ROWS >= num_rows:
        return
    in_schedule = rows < num_rows
    slot, token, valid = sorted_row_routes(rows, in_schedule, row_source_ptr, topk)
    token = token.to(tl.int64)[:, None]
    if HAS_WEIGHTS:  # the launcher passes weights only with dOut
        w = tl.load(topk_weights_ptr + slot, mask=valid, other=0.0)[:, None]
    sorted_offs = rows.to(tl.int64)[:, None] * stride_sorted_r
    cols = tl.arange(0, BLOCK_H)
    for h0 in range(0, hidden, BLOCK_H):
        in_row = (h0 + cols < hidden)[None, :]
        load_mask = valid[:, None] & in_row
        store_mask = in_schedule[:, None] & in_row
        offs = h0 + cols[None, :]
        if HAS_X:
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


@triton.jit
def _scatter_token_rows_kernel(
    # pointers
    x_ptr, d_out_ptr, topk_weights_ptr, x_sorted_ptr, d_out_sorted_ptr, dy_sorted_ptr,
    # schedule: each route's row (−1: not placed), each expert's first row and routes
    route_row_ptr, expert_offsets_ptr, expert_counts_ptr,
    # sizes (token_programs: the programs that copy tokens; the rest zero one expert's padding each)
    num_tokens, hidden, topk, token_programs,
    # strides
    stride_x_t, stride_dout_t, stride_sorted_r,
    # meta
    HAS_X: tl.constexpr, HAS_D_OUT: tl.constexpr, HAS_WEIGHTS: tl.constexpr, INTERPRETER: tl.constexpr,
    TOKENS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    if pid < token_programs:  # TOKENS tokens, each read once and stored to its topk rows
        tokens = pid * TOKENS + tl.arange(0, TOKENS)
        is_token = tokens < num_tokens
        tokens64 = tokens.to(tl.int64)[:, None]
        for h0 in range(0, hidden, BLOCK_H):
            offs = h0 + cols[None, :]
            load_mask = is_token[:, None] & (offs < hidden)
            if HAS_X:
                x = tl.load(x_ptr + tokens64 * stride_x_t + offs, mask=load_mask)
            if HAS_D_OUT:
                d_out = tl.load(d_out_ptr + tokens64 * stride_dout_t + offs, mask=load_mask)
            for j in range(topk):
                slot = tokens * topk + j
                row = tl.load(route_row_ptr + slot, mask=is_token, other=-1)
                store_mask = (row >= 0)[:, None] & (offs < hidden)
                sorted_offs = row.to(tl.int64)[:, None] * stride_sorted_r + offs
                if HAS_X:
                    tl.store(x_sorted_ptr + sorted_offs, x, mask=store_mask)
                if HAS_D_OUT:
                    tl.store(d_out_sorted_ptr + sorted_offs, d_out, mask=store_mask)
                if HAS_WEIGHTS:  # the launcher passes weights only with dOut
                    w = tl.load(topk_weights_ptr + slot, mask=is_token, other=0.0)[:, None]
                    tl.store(dy_sorted_ptr + sorted_offs, round_to_bf16(w * d_out.to(tl.float32), INTERPRETER),
                             mask=store_mask)
    else:  # zeros in one expert's padding rows (fewer than BLOCK_M, after its routes)
        expert = pid - token_programs
        start = tl.load(expert_offsets_ptr + expert) + tl.load(expert_counts_ptr + expert)
        end = tl.load(expert_offsets_ptr + expert + 1)
        zeros = tl.zeros((TOKENS, BLOCK_H), dtype=tl.bfloat16)
        for r0 in range(start, end, TOKENS):
            rows = r0 + tl.arange(0, TOKENS)
            for h0 in range(0, hidden, BLOCK_H):
                offs = h0 + cols[None, :]
                mask = (rows < end)[:, None] & (offs < hidden)
                sorted_offs = rows.to(tl.int64)[:, None] * stride_sorted_r + offs
                if HAS_X:
                    tl.store(x_sorted_ptr + sorted_offs, zeros, mask=mask)
                if HAS_D_OUT:
                    tl.store(d_out_sorted_ptr + sorted_offs, zeros, mask=mask)
                if HAS_WEIGHTS:
                    tl.store(dy_sorted_ptr + sorted_offs, zeros, mask=mask)


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
    x: torch.Tensor | None,  # [T, H] bf16; None: dOut's copies alone (x's made earlier)
    d_out: torch.Tensor | None,  # [T, H] bf16; None: x alone (the forward's gate/up operand)
    topk_weights: torch.Tensor | None,  # [T, topk] fp32; None: no dy_sorted
    schedule: RoutingSchedule,
    topk: int,
    mxfp8: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(x_sorted, d_out_sorted, dy_sorted) [capacity_rows, H] bf16 in the schedule's sorted
    layout; x_sorted only with x, d_out_sorted only with d_out and dy_sorted = w·dOut only with
    both d_out and topk_weights (else None); with `mxfp8`, each rounded to its GEMM's MXFP8 grid.
    Each copy is the same whether it is made alone or beside the others."""
    if x is None and d_out is None:
        raise ValueError("x, d_out: expected at least one of them, got None for both")
    rows = x if x is not None else d_out  # [T, H]: the token rows that size the copies
    name = "x" if x is not None else "d_out"
    if rows.dim() != 2 or rows.dtype != torch.bfloat16 or rows.stride(1) != 1:
        raise ValueError(f"{name}: expected a bf16 [T, H] tensor with unit column stride, got {rows.dtype} "
                         f"{list(rows.shape)}")
    num_tokens, hidden = rows.shape
    device = rows.device
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
    if schedule.route_row.shape != (num_tokens * topk,):
        raise ValueError(f"schedule: expected the schedule of {name}'s {num_tokens} tokens × topk {topk} routes, got "
                         f"one of {schedule.route_row.shape[0]} routes")
    if mxfp8 and (hidden % MX_BLOCK or schedule.block_m % MX_BLOCK):
        raise ValueError(f"{name}: mxfp8 needs H and the schedule's BLOCK_M multiples of {MX_BLOCK}, got H = {hidden}, "
                         f"BLOCK_M = {schedule.block_m}")

    def copy() -> torch.Tensor:
        return torch.empty(schedule.capacity_rows, hidden, dtype=torch.bfloat16, device=device)  # [capacity_rows, H]

    x_sorted, d_out_sorted, dy_sorted = (None if t is None else copy() for t in (x, d_out, topk_weights))
    # what is absent gets a stand-in, unread and unwritten: the token rows, the first copy
    sources = tuple(rows if t is None else t for t in (x, d_out, topk_weights))
    first = x_sorted if x_sorted is not None else d_out_sorted
    copies = tuple(first if t is None else t for t in (x_sorted, d_out_sorted, dy_sorted))
    strides = (sources[0].stride(0), sources[1].stride(0), first.stride(0))
    meta = dict(HAS_X=x is not None, HAS_D_OUT=d_out is not None, HAS_WEIGHTS=topk_weights is not None,
                INTERPRETER=interpreting(), num_warps=4)
    plan = kernel_plan(device)
    if topk >= plan.token_major_min_topk and not mxfp8:
        token_programs = triton.cdiv(num_tokens, plan.gather_tokens_per_program)
        _scatter_token_rows_kernel[(token_programs + schedule.num_local_experts,)](
            *sources, *copies, schedule.route_row, schedule.expert_offsets, schedule.expert_counts,
            num_tokens, hidden, topk, token_programs, *strides,
            TOKENS=plan.gather_tokens_per_program, BLOCK_H=min(256, triton.next_power_of_2(hidden)), **meta,
        )
    else:
        # mxfp8: one block of rows, 64 columns: three tiles and the rounding's temporaries stay in
        # registers (32 x 256 columns spilled, over ten times slower on H200); 8 warps measured
        # slower than 4 (benchmarks/LOG.md, "mxfp8, the whole layer").
        rows_per_program = MX_BLOCK if mxfp8 else plan.gather_rows_per_program
        _gather_sorted_rows_kernel[(triton.cdiv(schedule.capacity_rows, rows_per_program),)](
            *sources, *copies, schedule.row_source, schedule.num_rows, hidden, topk, *strides,
            MXFP8=mxfp8, ROWS=rows_per_program, BLOCK_H=min(64 if mxfp8 else 256, triton.next_power_of_2(hidden)),
            **meta,
        )
    return x_sorted, d_out_sorted, dy_sorted
