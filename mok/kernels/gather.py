"""Gather token rows into the expert-sorted layout, for the backward's GEMMs.

    a_sorted[r] = a[src(r) // topk]      (0 for padding rows)      for each input a ∈ {x, dOut}

Legend: r a row of the sorted layout of `schedule.py`, src(r) = row_source[r] =
t·topk + j (−1: padding), T tokens, H hidden. One launch gathers up to two [T, H]
tensors with the same indices (x and dOut in the backward).

Why materialise what the forward gathers inside its loads: the weight-gradient GEMMs
reduce over rows, so a gathered operand needs a fresh index vector every K step; that
chain of loads held them at ~360 TFLOPS on H200, while the same GEMMs over sorted
operands read through TMA reach 570–660 (BENCHMARKS.md). The gather is a pure copy at
HBM speed. The down dgrad reads the sorted dOut through TMA as well.

Caller contract: rows at or past the schedule's `num_rows` are not written (no kernel
reads them). Padding rows get exact zeros, which the GEMMs reading these operands
without masks rely on. A plain copy: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.schedule import RoutingSchedule

ROWS_PER_PROGRAM = 16  # 16 rows × H columns per program: ~8K programs for 131K rows


@triton.jit
def gather_row_block(src_ptr, dst_ptr, token, valid, rows, num_rows, hidden, stride_src_t, stride_dst_r,
                     BLOCK_H: tl.constexpr):
    """dst[rows] = src[token] (zeros where not valid) for rows below num_rows, all H
    columns, BLOCK_H at a time."""
    cols = tl.arange(0, BLOCK_H)
    src_rows = src_ptr + token.to(tl.int64)[:, None] * stride_src_t
    dst_rows = dst_ptr + rows.to(tl.int64)[:, None] * stride_dst_r
    for h0 in range(0, hidden, BLOCK_H):
        in_row = (h0 + cols < hidden)[None, :]
        values = tl.load(src_rows + h0 + cols[None, :], mask=valid[:, None] & in_row, other=0.0)
        tl.store(dst_rows + h0 + cols[None, :], values, mask=(rows < num_rows)[:, None] & in_row)


@triton.jit
def _gather_sorted_rows_kernel(
    # pointers
    a_ptr, b_ptr, a_sorted_ptr, b_sorted_ptr,
    # schedule
    row_source_ptr, num_rows_ptr,
    # sizes
    hidden, topk,
    # strides
    stride_a_t, stride_b_t, stride_sorted_r,
    # meta
    HAS_B: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    num_rows = tl.load(num_rows_ptr)
    if tl.program_id(0) * ROWS >= num_rows:
        return
    source = tl.load(row_source_ptr + rows, mask=rows < num_rows, other=-1)
    valid = source >= 0
    token = tl.where(valid, source, 0) // topk
    gather_row_block(a_ptr, a_sorted_ptr, token, valid, rows, num_rows, hidden, stride_a_t, stride_sorted_r, BLOCK_H)
    if HAS_B:
        gather_row_block(b_ptr, b_sorted_ptr, token, valid, rows, num_rows, hidden, stride_b_t, stride_sorted_r, BLOCK_H)


def check_sorted_rows(name: str, t: torch.Tensor, width: int, schedule: RoutingSchedule) -> None:
    """A sorted-layout operand of the GEMMs: bf16 [R, width] with unit column stride and
    R ≤ capacity_rows (TMA reads rows past R as zeros)."""
    if (t.dtype != torch.bfloat16 or t.dim() != 2 or t.shape[1] != width or t.shape[0] > schedule.capacity_rows
            or t.stride(1) != 1 or t.device != schedule.row_source.device):
        raise ValueError(
            f"{name}: expected a bf16 [rows <= {schedule.capacity_rows}, {width}] tensor with unit column stride "
            f"on {schedule.row_source.device}, got {t.dtype} {list(t.shape)} on {t.device}"
        )


def gather_sorted_rows(
    a: torch.Tensor,  # [T, H] bf16
    b: torch.Tensor | None,  # [T, H] bf16, gathered with the same indices (optional)
    schedule: RoutingSchedule,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(a_sorted, b_sorted) [capacity_rows, H] bf16 in the schedule's sorted layout (b_sorted
    None without b)."""
    if a.dim() != 2 or a.dtype != torch.bfloat16 or a.stride(1) != 1:
        raise ValueError(f"a: expected a bf16 [T, H] tensor with unit column stride, got {a.dtype} {list(a.shape)}")
    if b is not None and (b.shape != a.shape or b.dtype != a.dtype or b.stride(1) != 1 or b.device != a.device):
        raise ValueError(f"b: expected a bf16 {list(a.shape)} tensor with unit column stride on {a.device}, "
                         f"got {b.dtype} {list(b.shape)} on {b.device}")
    num_tokens, hidden = a.shape
    if schedule.row_source.device != a.device:
        raise ValueError(f"schedule: expected tensors on {a.device}, got {schedule.row_source.device}")
    a_sorted = torch.empty(schedule.capacity_rows, hidden, dtype=a.dtype, device=a.device)  # [capacity_rows, H]
    b_sorted = None if b is None else torch.empty_like(a_sorted)  # [capacity_rows, H]
    grid = (triton.cdiv(schedule.capacity_rows, ROWS_PER_PROGRAM),)
    _gather_sorted_rows_kernel[grid](
        a, a if b is None else b, a_sorted, a_sorted if b_sorted is None else b_sorted,
        schedule.row_source, schedule.num_rows,
        hidden, topk,
        a.stride(0), a.stride(0) if b is None else b.stride(0), a_sorted.stride(0),
        HAS_B=b is not None, ROWS=ROWS_PER_PROGRAM, BLOCK_H=min(512, triton.next_power_of_2(hidden)), num_warps=4,
    )
    return a_sorted, b_sorted
