"""The warp-specialized scatter GEMM over sorted rows, for Hopper, in Gluon: the Triton kernels of
`down.py` and `dgrad.py`'s gate/up dgrad, with a producer warp running TMA loads ahead of two
consumer warp groups (the pipeline, its two schedules and the ring protocol: `hopper_common.py`).

    down:          y[src(r)] = h[r] · Wd[e]ᵀ                      (unweighted, bf16; `down.py`)
    gate/up dgrad: dx[src(r)] = d_g[r] · Wg[e] + d_u[r] · Wu[e]      (two K segments; `dgrad.py`)
    fp8_block down and gate/up dgrad: the scatter GEMMs over e4m3 rows quantized in 1×128 blocks
                   and the weights' 128×128 blocks (`down.py`'s and `dgrad.py`'s fp8_block)
    fp8_block down dgrad's product over dOut's sorted rows: the kernel without the scatter, each
                   row's product stored at its sorted row (`hopper_gathered.launch_down_dgrad_product_fp8_block`)

Legend: r a row of the expert-sorted layout of `routing/schedule.py`, src(r) = row_source[r]
(−1: padding), e = tile_expert[r // BLOCK_M], H hidden, I intermediate size, E_l local experts. A
down GEMM's tile whose e is −1 is skipped by every partition alike (another launch's, as in `down.py`).

Each tile's K loop is the Triton kernel's, so the result is bitwise the Triton kernel's; fixed order,
no atomics: deterministic. Caller contract: as for `down.down_scatter`, `dgrad.gate_up_dgrad_scatter`
and their `*_fp8_block` (fp8_block: cooperative only); BLOCK_M is the schedule's block_m.
"""

from __future__ import annotations

import torch

from mok.fp8_block import FP8_BLOCK
from mok.kernels.common import num_sms, tile_coordinates
from mok.kernels.gemm.hopper_common import (
    _accumulator_rows,
    _allocate_ring,
    _check_device,
    _check_fp8_block_tile,
    _consumer_rows,
    _descriptor,
    _load_step,
    _mma_layout,
    _mma_n,
    _mma_steps,
    _row_runs_layout,
    _scaled_mma_steps,
    _store_tile_async,
    _takes_turns,
)
from mok.kernels.gluon_api import gl, gluon, tma
from mok.kernels.plan import kernel_plan
from mok.kernels.routing.schedule import RoutingSchedule


@gluon.jit
def _load_segment(step, a_desc, b_desc, m0, expert, n0, n_dim, reduce_dim, a_bufs, b_bufs, ready, empty,
                  B_K_MAJOR: gl.constexpr, COOPERATIVE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                  STAGES: gl.constexpr):
    """Producer: the K steps of one segment (A [rows, K] · B[e]) of an output tile; returns the
    next step. A weight viewed as [E_l·n_dim, K] (B_K_MAJOR) or [E_l·K, n_dim] lets a box past
    this expert's end read the next expert's rows: they land only in columns the epilogue does
    not store (K-major), or meet A's zero fill past K (TMA) and add nothing."""
    ROWS: gl.constexpr = _consumer_rows(BLOCK_M, COOPERATIVE)
    for k0 in range(0, reduce_dim, BLOCK_K):
        if B_K_MAJOR:
            b_coords = [expert * n_dim + n0, k0]
        else:
            b_coords = [expert * reduce_dim + k0, n0]
        _load_step(step, a_desc, [m0, k0], a_desc, [m0 + ROWS, k0], b_desc, b_coords, a_bufs, b_bufs, ready, empty, 0,
                   COOPERATIVE, STAGES)
        step += 1
    return step


@gluon.jit
def _tile_runs(tile_expert_ptr, m_tile, TWO_SEGMENTS: gl.constexpr):
    """Whether every partition runs M tile `m_tile`: not a down GEMM's tile of expert −1, another
    launch's (`transport.common.own_tiles_split`). The gate/up dgrad runs every tile untested: the
    test costs its wide fp8_block tile 4 more bytes of spills under Triton 3.6."""
    if TWO_SEGMENTS:
        return True
    else:
        return gl.load(tile_expert_ptr + m_tile) >= 0


@gluon.jit
def _scatter_producer(a_desc, a2_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, a_scale_ptr,
                      a2_scale_ptr, b_scale_ptr, b2_scale_ptr, row_source_ptr, tile_expert_ptr, num_rows_ptr, m_dim,
                      n_dim, reduce_dim, stride_y, stride_a_scale, y_desc, out_bufs, CONSUMER: gl.constexpr,
                      SCATTER: gl.constexpr, TMA_STORE: gl.constexpr, TWO_SEGMENTS: gl.constexpr,
                      B_K_MAJOR: gl.constexpr, COOPERATIVE: gl.constexpr, FP8: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                      STORE_VECTOR: gl.constexpr):
    num_m_tiles = gl.cdiv(gl.load(num_rows_ptr), BLOCK_M)
    num_n_tiles = gl.cdiv(n_dim, BLOCK_N)
    step = 0
    for tile in range(gl.program_id(0), num_m_tiles * num_n_tiles, gl.num_programs(0)):
        m_tile, n_tile = tile_coordinates(tile, num_m_tiles, num_n_tiles, GROUP_M)
        m0, n0 = m_tile * BLOCK_M, n_tile * BLOCK_N
        if _tile_runs(tile_expert_ptr, m_tile, TWO_SEGMENTS):
            expert = gl.load(tile_expert_ptr + m_tile)
            step = _load_segment(step, a_desc, b_desc, m0, expert, n0, n_dim, reduce_dim, a_bufs, b_bufs, ready,
                                 empty, B_K_MAJOR, COOPERATIVE, BLOCK_M, BLOCK_K, STAGES)
            if TWO_SEGMENTS:
                step = _load_segment(step, a2_desc, b2_desc, m0, expert, n0, n_dim, reduce_dim, a_bufs, b_bufs, ready,
                                     empty, B_K_MAJOR, COOPERATIVE, BLOCK_M, BLOCK_K, STAGES)


@gluon.jit
def _scatter_consumer(a_desc, a2_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, a_scale_ptr,
                      a2_scale_ptr, b_scale_ptr, b2_scale_ptr, row_source_ptr, tile_expert_ptr, num_rows_ptr, m_dim,
                      n_dim, reduce_dim, stride_y, stride_a_scale, y_desc, out_bufs, CONSUMER: gl.constexpr,
                      SCATTER: gl.constexpr, TMA_STORE: gl.constexpr, TWO_SEGMENTS: gl.constexpr,
                      B_K_MAJOR: gl.constexpr, COOPERATIVE: gl.constexpr, FP8: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                      STORE_VECTOR: gl.constexpr):
    ROWS: gl.constexpr = _consumer_rows(BLOCK_M, COOPERATIVE)
    TURNS: gl.constexpr = _takes_turns(COOPERATIVE)
    MMA_N: gl.constexpr = _mma_n(BLOCK_N, FP8)
    mma_layout: gl.constexpr = _mma_layout(MMA_N, FP8)
    num_m_tiles = gl.cdiv(gl.load(num_rows_ptr), BLOCK_M)
    num_n_tiles = gl.cdiv(n_dim, BLOCK_N)
    k_blocks = gl.cdiv(reduce_dim, BLOCK_K)
    k_steps = k_blocks * (2 if TWO_SEGMENTS else 1)
    tile_count = 0  # tiles of this program that run (both consumers', for the turns)
    for tile in range(gl.program_id(0), num_m_tiles * num_n_tiles, gl.num_programs(0)):
        m_tile, n_tile = tile_coordinates(tile, num_m_tiles, num_n_tiles, GROUP_M)
        if _tile_runs(tile_expert_ptr, m_tile, TWO_SEGMENTS):
            if tile_count % TURNS == CONSUMER % TURNS:
                first_row = m_tile * BLOCK_M + (CONSUMER * ROWS if COOPERATIVE else 0)
                n0 = n_tile * BLOCK_N
                acc = gl.zeros((ROWS, MMA_N), gl.float32, mma_layout)
                acc_hi = acc  # fp8_block at BLOCK_N = 2 · MMA_N: columns [n0 + MMA_N, n0 + BLOCK_N)
                if FP8:  # each segment: rows' 1×128 scales [rows, K/128], the weight's [E_l, n_dim/128, K/128]
                    # the weight block of columns [n0, n0 + 128) and of the next 128, if any
                    weight_scales = (gl.load(tile_expert_ptr + m_tile).to(gl.int64) * gl.cdiv(n_dim, BLOCK_K)
                                     + n0 // BLOCK_K) * k_blocks
                    hi_valid = n0 + MMA_N < n_dim
                    strides = (1, stride_a_scale, 1)
                    rows, rows_valid = _accumulator_rows(first_row, m_dim, ROWS, mma_layout)
                    acc, acc_hi = _scaled_mma_steps(acc, acc_hi, tile_count * k_steps, k_blocks, 0, a_bufs, b_bufs,
                                                    ready, empty, a_scale_ptr, b_scale_ptr + weight_scales,
                                                    b_scale_ptr + weight_scales + k_blocks, hi_valid, strides, rows,
                                                    rows_valid, CONSUMER, False, False, STAGES)
                    if TWO_SEGMENTS:
                        acc, acc_hi = _scaled_mma_steps(acc, acc_hi, tile_count * k_steps + k_blocks, k_blocks, 0,
                                                        a_bufs, b_bufs, ready, empty, a2_scale_ptr,
                                                        b2_scale_ptr + weight_scales,
                                                        b2_scale_ptr + weight_scales + k_blocks, hi_valid, strides,
                                                        rows, rows_valid, CONSUMER, False, False, STAGES)
                else:
                    acc = _mma_steps(acc, tile_count * k_steps, k_steps, tile_count, a_bufs, b_bufs, ready, empty,
                                     turn, CONSUMER, True, B_K_MAJOR, COOPERATIVE, STAGES)
                if TMA_STORE:  # columns past n_dim clipped by TMA
                    tma.store_wait(0)  # the last tile's stores have read this consumer's buffers
                    _store_tile_async(acc.to(y_desc.dtype), out_bufs.index(2 * CONSUMER), y_desc, first_row, n0)
                    if MMA_N < BLOCK_N:
                        _store_tile_async(acc_hi.to(y_desc.dtype), out_bufs.index(2 * CONSUMER + 1), y_desc,
                                          first_row, n0 + MMA_N)
                else:
                    _scatter_store(acc, y_ptr, row_source_ptr, first_row, n0, m_dim, n_dim, stride_y, SCATTER,
                                   STORE_VECTOR)
                    if MMA_N < BLOCK_N:
                        _scatter_store(acc_hi, y_ptr, row_source_ptr, first_row, n0 + MMA_N, m_dim, n_dim, stride_y,
                                       SCATTER, STORE_VECTOR)
            tile_count += 1
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _scatter_store(acc, y_ptr, row_source_ptr, first_row, n0, m_dim, n_dim, stride_y, SCATTER: gl.constexpr,
                   STORE_VECTOR: gl.constexpr):
    """y[row_source[r], n0 : n0 + acc's columns] = acc's rows r from first_row on (padding rows
    not stored), or without SCATTER y[r, …] for r below m_dim; in y's dtype, STORE_VECTOR
    columns per thread and store."""
    ROWS: gl.constexpr = acc.shape[0]
    COLUMNS: gl.constexpr = acc.shape[1]
    layout: gl.constexpr = _row_runs_layout(STORE_VECTOR)
    y = gl.convert_layout(acc.to(y_ptr.dtype.element_ty), layout)
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = n0 + gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, layout))
    if SCATTER:
        source = gl.load(row_source_ptr + rows)
        out_rows = gl.where(source >= 0, source, 0).to(gl.int64)
        rows_valid = source >= 0
    else:
        out_rows = rows.to(gl.int64)
        rows_valid = rows < m_dim
    mask = rows_valid[:, None] & (cols < n_dim)[None, :]
    gl.store(y_ptr + out_rows[:, None] * stride_y + cols[None, :], y, mask=mask)


@gluon.jit
def _scatter_ws_kernel(
    # TMA descriptors: segment 1 A [capacity_rows, K] and B, segment 2's (TWO_SEGMENTS; else
    # segment 1's again); y [slots, n_dim]
    a_desc, a2_desc, b_desc, b2_desc, y_ptr,
    # FP8: the scales of A [capacity_rows, K/128] and B [E_l, n_dim/128, K/128] fp32, segment 2's
    a_scale_ptr, a2_scale_ptr, b_scale_ptr, b2_scale_ptr,
    # schedule
    row_source_ptr, tile_expert_ptr, num_rows_ptr,
    # sizes (m_dim: capacity_rows; K per segment), strides (FP8: the row stride of A's and A2's scales)
    m_dim, n_dim, reduce_dim, stride_y, stride_a_scale,
    # TMA_STORE: y's TMA descriptor, in boxes of a consumer's rows × 128 (else unread)
    y_desc,
    # meta
    SCATTER: gl.constexpr, TMA_STORE: gl.constexpr, TWO_SEGMENTS: gl.constexpr, B_K_MAJOR: gl.constexpr,
    COOPERATIVE: gl.constexpr, FP8: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    # columns per thread of the register stores (the plan's `warp_specialized_store_vector`)
    STORE_VECTOR: gl.constexpr,
    # registers per thread of the consumers and the producer (the plan's `warp_specialized_*_registers`)
    CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr,
):
    """down: a = h, b = w_down as [E_l·H, I] (K-major); fp8_block down dgrad's product (not
    SCATTER, y fp32): a = dOut's sorted rows, b = w_downᵀ as [E_l·I, H]; gate/up dgrad (TWO_SEGMENTS): a, a2 = d_g,
    d_u, b, b2 = w_gate, w_up as [E_l·I, H], or (FP8, cooperative) their transposed copies as
    [E_l·H, I] (K-major, as FP8 wgmma needs). TMA_STORE (FP8, not SCATTER, bf16 y): each
    consumer's two tiles leave through buffers of its own by TMA stores, left in flight under
    the next tile's MMAs."""
    a_bufs, b_bufs, ready, empty, turn = _allocate_ring(a_desc, b_desc, COOPERATIVE, STAGES, 1)
    out_bufs = b_bufs  # unread without TMA_STORE
    if TMA_STORE:
        out_bufs = gl.allocate_shared_memory(y_desc.dtype, [4] + y_desc.block_type.shape, y_desc.layout)
    gl.warp_specialize([
        (_scatter_consumer, (a_desc, a2_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, a_scale_ptr,
                             a2_scale_ptr, b_scale_ptr, b2_scale_ptr, row_source_ptr, tile_expert_ptr, num_rows_ptr,
                             m_dim, n_dim, reduce_dim, stride_y, stride_a_scale, y_desc, out_bufs, 0, SCATTER,
                             TMA_STORE, TWO_SEGMENTS, B_K_MAJOR, COOPERATIVE, FP8, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                             STAGES, STORE_VECTOR)),
        (_scatter_consumer, (a_desc, a2_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, a_scale_ptr,
                             a2_scale_ptr, b_scale_ptr, b2_scale_ptr, row_source_ptr, tile_expert_ptr, num_rows_ptr,
                             m_dim, n_dim, reduce_dim, stride_y, stride_a_scale, y_desc, out_bufs, 1, SCATTER,
                             TMA_STORE, TWO_SEGMENTS, B_K_MAJOR, COOPERATIVE, FP8, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                             STAGES, STORE_VECTOR)),
        (_scatter_producer, (a_desc, a2_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, a_scale_ptr,
                             a2_scale_ptr, b_scale_ptr, b2_scale_ptr, row_source_ptr, tile_expert_ptr, num_rows_ptr,
                             m_dim, n_dim, reduce_dim, stride_y, stride_a_scale, y_desc, out_bufs, 0, SCATTER,
                             TMA_STORE, TWO_SEGMENTS, B_K_MAJOR, COOPERATIVE, FP8, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                             STAGES, STORE_VECTOR)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


# --------------------------------------------------------------------------- launchers


def _launch_scatter(a, a2, b, b2, y, schedule: RoutingSchedule, cfg: dict, b_k_major: bool,
                    scales: tuple[torch.Tensor, ...] | None, what: str, scatter: bool = True) -> None:
    """`scales` (fp8_block): A's and B's, or with a2 A's, A2's, B's and B2's (A's and A2's with one
    row stride: the caller has checked). Without `scatter` row r of the product goes to y's row r."""
    cooperative, two_segments, fp8 = cfg.get("COOPERATIVE", False), a2 is not None, scales is not None
    if fp8:
        _check_fp8_block_tile(cfg, schedule, what)
        a_scale, a2_scale, b_scale, b2_scale = scales if two_segments else (scales[0], scales[0], scales[1], scales[1])
    else:
        a_scale = a2_scale = b_scale = b2_scale = y  # unread
    _check_device(y.device)
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_block = (_consumer_rows(block_m, cooperative), block_k)
    b_block = (block_n, block_k) if b_k_major else (block_k, block_n)
    a_desc, b_desc = _descriptor(a, a_block), _descriptor(b, b_block)
    n_dim = y.shape[1]
    plan = kernel_plan(y.device)
    # the wide tile only: the 128-column one's six stages leave no room for the buffers
    tma_store = plan.sorted_tma_store and fp8 and not scatter and y.dtype == torch.bfloat16 and block_n == 2 * FP8_BLOCK
    y_desc = _descriptor(y, (a_block[0], _mma_n(block_n, True))) if tma_store else a_desc  # else unread
    _scatter_ws_kernel[(num_sms(y.device),)](
        a_desc, _descriptor(a2, a_block) if two_segments else a_desc,
        b_desc, _descriptor(b2, b_block) if two_segments else b_desc, y,
        a_scale, a2_scale, b_scale, b2_scale,
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        a.shape[0], n_dim, a.shape[1], y.stride(0), a_scale.stride(0) if fp8 else 0, y_desc,
        scatter, tma_store, two_segments, b_k_major, cooperative, fp8, block_m, block_n, block_k,
        cfg["GROUP_M"], cfg["num_stages"], plan.warp_specialized_store_vector,
        plan.warp_specialized_consumer_registers, plan.warp_specialized_producer_registers, num_warps=4,
    )


def launch_down_scatter(h: torch.Tensor, w_down: torch.Tensor, y: torch.Tensor, schedule: RoutingSchedule,
                        cfg: dict, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                        scatter: bool = True) -> None:
    """y[row_source[r]] = h[r] · w_down[e]ᵀ (`down.down_scatter`'s local case); with
    `scales` (h's, w_down's) the fp8_block one (`down.down_scatter_fp8_block`: h, w_down
    e4m3). Without `scatter`, y[r] (the sorted layout). The caller has checked the operands."""
    _launch_scatter(h, None, w_down, None, y, schedule, cfg, True, scales, "down GEMM",  # w_down as [E_l·H, I]
                    scatter=scatter)


def launch_gate_up_dgrad_scatter(d_gate: torch.Tensor, d_up: torch.Tensor, w_gate: torch.Tensor,
                                 w_up: torch.Tensor, dx: torch.Tensor, schedule: RoutingSchedule, cfg: dict,
                                 scales: tuple[torch.Tensor, ...] | None = None, scatter: bool = True) -> None:
    """dx[row_source[r]] = d_g[r] · w_gate[e] + d_u[r] · w_up[e] (`dgrad.gate_up_dgrad_scatter`'s
    local case: d_g, d_u the [rows, I] columns of d_gate_up, weights [E_l, I, H]). With `scales`
    (d_g's, d_u's, w_gate's, w_up's) the fp8_block one (`dgrad.gate_up_dgrad_scatter_fp8_block`:
    e4m3 d_g, d_u and the weights' transposed copies [E_l, H, I]). Without `scatter`, dx[r] (the
    sorted layout). The caller has checked the operands."""
    # bf16 weights read as [E_l·I, H]; the fp8 transposed copies as [E_l·H, I] (K-major)
    _launch_scatter(d_gate, d_up, w_gate, w_up, dx, schedule, cfg, scales is not None, scales, "gate/up dgrad",
                    scatter=scatter)
