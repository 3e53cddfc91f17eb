"""The warp-specialized fp8_block GEMM over token rows gathered by its producer, for Hopper, in Gluon:
the fp8_block gate/up GEMM of `gate_up.py`, and the product of `dgrad.py`'s fp8_block down dgrad, with
a producer warp group copying the token rows' e4m3 bytes into the ring (cp.async: Hopper's TMA cannot
gather) and the weights' tiles by TMA, ahead of two consumer warp groups (the pipeline, its cooperative
schedule and the ring protocol: `hopper_common.py`).

    fp8_block gate/up: h[r] = SwiGLU(x[src(r) // topk] · Wg[e]ᵀ, x[…] · Wu[e]ᵀ), quantized in 1×128
                   blocks (`gate_up.gate_up_swiglu_fp8_block`); x's e4m3 token rows gathered
                   by the producer, h_q, g, u stored by TMA
    fp8_block down dgrad's product: a[r] = dOut[src(r) // topk] · Wd[e] in bf16 (or fp32), stored at
                   the sorted row r (the gate/up's kernel, dOut's token rows gathered, bf16 stored by
                   TMA; over its sorted rows, `hopper_scatter.py`'s kernel without the scatter); `dgrad.py`
                   runs the SwiGLU backward on it

Legend: r a row of the expert-sorted layout of `routing/schedule.py`, src(r) = row_source[r]
(−1: padding), e = tile_expert[r // BLOCK_M], H hidden, I intermediate size, E_l local experts. A
tile whose e is −1 is skipped by every partition alike (another launch's, as in `gate_up.py`).

Each tile's K loop is the Triton kernel's, so the result is bitwise the Triton kernel's; fixed order,
no atomics: deterministic. Caller contract: as for `gate_up.gate_up_swiglu_fp8_block` and
`dgrad.down_dgrad_swiglu_fp8_block`; cooperative only, BLOCK_M the schedule's block_m.
"""

from __future__ import annotations

import torch
import triton

from mok.fp8_block import FP8_BLOCK
from mok.kernels.common import gate_up_parts, num_sms, round_to_bf16, tile_coordinates
from mok.kernels.gemm.hopper_common import (
    _allocate_b_tiles,
    _allocate_barriers,
    _check_device,
    _check_fp8_block_tile,
    _claim_slot,
    _consumer_rows,
    _descriptor,
    _fp8_shared_layout,
    _mma_layout,
    _row_runs_layout,
    _scaled_mma_steps,
    _store_tile_async,
)
from mok.kernels.gemm.hopper_scatter import _launch_scatter, _scatter_store
from mok.kernels.gluon_api import async_copy, cp_async_load, gl, gluon, tma, tma_load
from mok.kernels.plan import kernel_plan
from mok.kernels.quant.fp8_block import quantize_row_blocks
from mok.kernels.routing.gather import sorted_row_routes
from mok.kernels.routing.schedule import RoutingSchedule
from mok.kernels.swiglu import fast_sigmoid_here, swiglu_forward

@gluon.jit
def _gathered_rows(row_source_ptr, num_rows, first_row, topk, ROWS: gl.constexpr, layout: gl.constexpr):
    """(token of each sorted row [first_row, first_row + ROWS), whether it has one) in the row
    layout of `layout`: padding rows and rows past num_rows have none."""
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    _, tokens, valid = sorted_row_routes(rows, rows < num_rows, row_source_ptr, topk)
    return tokens, valid


@gluon.jit
def _gathered_row_offsets(row_source_ptr, num_rows, first_row, topk, hidden, ROWS: gl.constexpr,
                          BYTE_VECTOR: gl.constexpr):
    """Producer: (byte offsets of x's token rows [T, H] e4m3 for the sorted rows [first_row,
    first_row + ROWS), whether each has one), in the rows of `_copy_gathered_rows`' layout."""
    layout: gl.constexpr = _row_runs_layout(BYTE_VECTOR)
    tokens, valid = _gathered_rows(row_source_ptr, num_rows, first_row, topk, ROWS, layout)
    return gl.multiple_of(tokens.to(gl.int64) * hidden, 128), valid  # H: a multiple of 128 in fp8_block


@gluon.jit
def _copy_gathered_rows(x_ptr, row_offsets, rows_valid, k0, buf, BLOCK_K: gl.constexpr, BYTE_VECTOR: gl.constexpr):
    """Producer: cp.async x's bytes [k0, k0 + BLOCK_K) of the rows at `row_offsets` (zeros where
    not rows_valid) into the A tile `buf`, BYTE_VECTOR bytes per copy. Hopper's TMA cannot gather rows."""
    layout: gl.constexpr = _row_runs_layout(BYTE_VECTOR)
    cols = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    # whole BYTE_VECTOR-byte copies: the row offsets and k0 are multiples of 128 (H is, in fp8_block)
    cols = gl.max_contiguous(gl.multiple_of(cols, BLOCK_K), BLOCK_K)
    cp_async_load(buf, x_ptr + row_offsets[:, None] + cols[None, :], mask=rows_valid[:, None])


@gluon.jit
def _gathered_producer(x_ptr, w_gate_desc, w_up_desc, a_bufs, b_bufs, ready, empty, h_ptr, h_scale_ptr, gate_up_ptr,
                       gate_up_scale_ptr, x_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr, row_source_ptr,
                       tile_expert_ptr, num_rows_ptr, topk, hidden, inter, swiglu_limit, h_desc, gate_up_desc,
                       out_bufs, h_bufs, CONSUMER: gl.constexpr,
                       HAS_LIMIT: gl.constexpr, FAST_SIGMOID: gl.constexpr, STORE_GATE_UP: gl.constexpr,
                       GATE_UP_E4M3: gl.constexpr, PRODUCT: gl.constexpr, TMA_STORE: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, STORE_VECTOR: gl.constexpr,
                       BYTE_VECTOR: gl.constexpr):
    """Each step: the two A halves gathered from x's token rows (every producer thread's
    cp.async copies arrive on the slot's `ready` once landed), the gate and up tiles by TMA
    (PRODUCT: w_downᵀ's tiles of the tile's two column halves)."""
    HALF_N: gl.constexpr = w_gate_desc.block_type.shape[0]
    TILE_N: gl.constexpr = 2 * HALF_N if PRODUCT else HALF_N
    ROWS: gl.constexpr = BLOCK_M // 2
    num_rows = gl.load(num_rows_ptr)
    num_m_tiles = gl.cdiv(num_rows, BLOCK_M)
    num_n_tiles = gl.cdiv(inter, TILE_N)
    step = 0
    for tile in range(gl.program_id(0), num_m_tiles * num_n_tiles, gl.num_programs(0)):
        m_tile, n_tile = tile_coordinates(tile, num_m_tiles, num_n_tiles, GROUP_M)
        expert = gl.load(tile_expert_ptr + m_tile)
        if expert >= 0:  # −1: another launch's tile (`transport.common.own_tiles_split`)
            m0 = m_tile * BLOCK_M
            w_row = expert * inter + n_tile * TILE_N  # weights read as [E_l·I, H]
            # PRODUCT: past I (the last tile of an odd I / 128) the second half reads the next expert's
            # rows, or zeros past the last: its columns are not stored
            w_hi_row = w_row + HALF_N if PRODUCT else w_row
            offsets, valid = _gathered_row_offsets(row_source_ptr, num_rows, m0, topk, hidden, ROWS, BYTE_VECTOR)
            offsets_2, valid_2 = _gathered_row_offsets(row_source_ptr, num_rows, m0 + ROWS, topk, hidden, ROWS,
                                                       BYTE_VECTOR)
            for k0 in range(0, hidden, BLOCK_K):
                slot, bar = _claim_slot(step, ready, empty, 2 * w_gate_desc.block_type.nbytes, STAGES)
                _copy_gathered_rows(x_ptr, offsets, valid, k0, a_bufs.index(2 * slot), BLOCK_K, BYTE_VECTOR)
                _copy_gathered_rows(x_ptr, offsets_2, valid_2, k0, a_bufs.index(2 * slot + 1), BLOCK_K, BYTE_VECTOR)
                async_copy.mbarrier_arrive(bar, increment_count=False)
                b = b_bufs.index(slot)  # the gate tile in its first HALF_N rows, the up tile in the rest
                tma_load(w_gate_desc, [w_row, k0], bar, b.slice(0, HALF_N))
                tma_load(w_up_desc, [w_hi_row, k0], bar, b.slice(HALF_N, HALF_N))
                step += 1


@gluon.jit
def _gathered_consumer(x_ptr, w_gate_desc, w_up_desc, a_bufs, b_bufs, ready, empty, h_ptr, h_scale_ptr, gate_up_ptr,
                       gate_up_scale_ptr, x_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr, row_source_ptr,
                       tile_expert_ptr, num_rows_ptr, topk, hidden, inter, swiglu_limit, h_desc, gate_up_desc,
                       out_bufs, h_bufs, CONSUMER: gl.constexpr,
                       HAS_LIMIT: gl.constexpr, FAST_SIGMOID: gl.constexpr, STORE_GATE_UP: gl.constexpr,
                       GATE_UP_E4M3: gl.constexpr, PRODUCT: gl.constexpr, TMA_STORE: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, STORE_VECTOR: gl.constexpr,
                       BYTE_VECTOR: gl.constexpr):
    HALF_N: gl.constexpr = w_gate_desc.block_type.shape[0]
    HALVES: gl.constexpr = 2 if PRODUCT else 1  # the weight's 128-column blocks per tile
    ROWS: gl.constexpr = BLOCK_M // 2
    mma_layout: gl.constexpr = _mma_layout(HALF_N, True)
    num_rows = gl.load(num_rows_ptr)
    num_m_tiles = gl.cdiv(num_rows, BLOCK_M)
    n_blocks = gl.cdiv(inter, HALF_N)
    num_n_tiles = gl.cdiv(n_blocks, HALVES)
    k_blocks = gl.cdiv(hidden, BLOCK_K)
    tile_count = 0
    for tile in range(gl.program_id(0), num_m_tiles * num_n_tiles, gl.num_programs(0)):
        m_tile, n_tile = tile_coordinates(tile, num_m_tiles, num_n_tiles, GROUP_M)
        expert = gl.load(tile_expert_ptr + m_tile)
        if expert >= 0:  # −1: another launch's tile (`transport.common.own_tiles_split`)
            first_row = m_tile * BLOCK_M + CONSUMER * ROWS
            # the weights' scales [E_l, I/128, H/128]: the block row of columns [n0, n0 + 128), n0 the
            # first column of the accumulator; PRODUCT: acc_hi's the next one, if I has it
            n_block = n_tile * HALVES
            weight_scales = (expert.to(gl.int64) * n_blocks + n_block) * k_blocks
            hi_scales = weight_scales + k_blocks if PRODUCT else weight_scales
            hi_valid = n_block + 1 < n_blocks if PRODUCT else True
            tokens, valid = _gathered_rows(row_source_ptr, num_rows, first_row, topk, ROWS, mma_layout)
            gate = gl.zeros((ROWS, HALF_N), gl.float32, mma_layout)
            gate, up = _scaled_mma_steps(gate, gate, tile_count * k_blocks, k_blocks, 0, a_bufs, b_bufs, ready,
                                         empty, x_scale_ptr, w_gate_scale_ptr + weight_scales,
                                         w_up_scale_ptr + hi_scales, hi_valid, (1, k_blocks, 1), tokens, valid,
                                         CONSUMER, False, True, STAGES)
            if TMA_STORE:
                tma.store_wait(0)  # the last tile's stores have read this consumer's buffers
            if PRODUCT:  # h_ptr: the product [capacity_rows, I], fp32 or bf16
                n0 = n_block * HALF_N
                if TMA_STORE:  # columns past I clipped by TMA
                    _store_tile_async(gate.to(h_desc.dtype), out_bufs.index(2 * CONSUMER), h_desc, first_row, n0)
                    _store_tile_async(up.to(h_desc.dtype), out_bufs.index(2 * CONSUMER + 1), h_desc, first_row,
                                      n0 + HALF_N)
                else:
                    _scatter_store(gate, h_ptr, row_source_ptr, first_row, n0, num_rows, inter, inter, False,
                                   STORE_VECTOR)
                    _scatter_store(up, h_ptr, row_source_ptr, first_row, n0 + HALF_N, num_rows, inter, inter,
                                   False, STORE_VECTOR)
            else:
                _gate_up_epilogue(gate, up, h_ptr, h_scale_ptr, gate_up_ptr, gate_up_scale_ptr, first_row, n_tile,
                                  inter, swiglu_limit, h_desc, gate_up_desc, out_bufs, h_bufs, CONSUMER, HAS_LIMIT,
                                  FAST_SIGMOID, STORE_GATE_UP, GATE_UP_E4M3, TMA_STORE, STORE_VECTOR, BYTE_VECTOR)
            tile_count += 1
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _gate_up_epilogue(gate, up, h_ptr, h_scale_ptr, gate_up_ptr, gate_up_scale_ptr, first_row, n_tile, inter,
                      swiglu_limit, h_desc, gate_up_desc, out_bufs, h_bufs, CONSUMER: gl.constexpr,
                      HAS_LIMIT: gl.constexpr, FAST_SIGMOID: gl.constexpr, STORE_GATE_UP: gl.constexpr,
                      GATE_UP_E4M3: gl.constexpr, TMA_STORE: gl.constexpr, STORE_VECTOR: gl.constexpr,
                      BYTE_VECTOR: gl.constexpr):
    """`gate_up._gate_up_swiglu_kernel`'s fp8_block epilogue on the consumer's rows from
    first_row and columns [n0, n0 + 128), n0 = n_tile · 128: h = SwiGLU(g, u) quantized as one
    1×128 block per row (h_q [rows, I] e4m3 bytes, h_scale [rows, I/128]), and with
    STORE_GATE_UP g, u in bf16 ([rows, 2, I]), or with GATE_UP_E4M3 quantized as h is (bytes, and
    scales [rows, 2, I/128]); the same device functions, so the same bits.
    The tiles leave the accumulator's layout, where a thread holds pairs of columns, for rows of
    16-byte runs (`_store_rows`: BYTE_VECTOR e4m3 bytes, STORE_VECTOR bf16 values): 20 stores per
    thread instead of 96 of 2 and 4 bytes; or with TMA_STORE through this consumer's buffers (h's
    in `h_bufs`, g's and u's in `out_bufs`) by TMA stores (h_desc over h_q's e4m3, gate_up_desc
    over g, u as [rows, 2·I]), left in flight."""
    ROWS: gl.constexpr = gate.shape[0]
    COLUMNS: gl.constexpr = gate.shape[1]
    h = swiglu_forward(gate, up, swiglu_limit, HAS_LIMIT, FAST_SIGMOID)
    h_q, h_scale = quantize_row_blocks(h, False)  # [rows, 128] uint8, [rows, 1] fp32
    scale_rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gate.type.layout))
    scale_offsets = scale_rows.to(gl.int64) * (inter // COLUMNS) + n_tile
    # one scale per row: reduced over the tile's single column, not stored once per held column
    gl.store(h_scale_ptr + scale_offsets, gl.max(h_scale, axis=1))
    if STORE_GATE_UP:
        if GATE_UP_E4M3:
            gate, gate_scale = quantize_row_blocks(gate, False)
            up, up_scale = quantize_row_blocks(up, False)
            # [rows, 2, I/128]: h's offsets plus rows · I/128 (rows · 2·I/128 + n_tile spilled 40 bytes, sm_90a)
            gate_up_scales = gate_up_scale_ptr + scale_offsets + scale_rows.to(gl.int64) * (inter // COLUMNS)
            gl.store(gate_up_scales, gl.max(gate_scale, axis=1))
            gl.store(gate_up_scales + inter // COLUMNS, gl.max(up_scale, axis=1))
        else:
            gate, up = round_to_bf16(gate, False), round_to_bf16(up, False)
    n0 = n_tile * COLUMNS
    if TMA_STORE:
        _store_tile_async(h_q.to(h_desc.dtype, bitcast=True), h_bufs.index(CONSUMER), h_desc, first_row, n0)
        if STORE_GATE_UP:
            _store_tile_async(gate.to(gate_up_desc.dtype, bitcast=True), out_bufs.index(2 * CONSUMER), gate_up_desc,
                              first_row, n0)
            _store_tile_async(up.to(gate_up_desc.dtype, bitcast=True), out_bufs.index(2 * CONSUMER + 1), gate_up_desc,
                              first_row, inter + n0)
    else:
        byte_rows: gl.constexpr = _row_runs_layout(BYTE_VECTOR)
        _store_rows(h_q, h_ptr, first_row, n0, inter, byte_rows)
        if STORE_GATE_UP:
            layout: gl.constexpr = byte_rows if GATE_UP_E4M3 else _row_runs_layout(STORE_VECTOR)
            _store_rows(gate, gate_up_ptr, first_row, n0, 2 * inter, layout)
            _store_rows(up, gate_up_ptr + inter, first_row, n0, 2 * inter, layout)


@gluon.jit
def _store_rows(tile, ptr, first_row, first_column, stride, layout: gl.constexpr):
    """ptr[r · stride + c] = tile for its rows r from first_row and columns c from first_column,
    the tile moved into `layout` first (through shared memory), whose threads each hold a
    16-byte run of a row."""
    ROWS: gl.constexpr = tile.shape[0]
    COLUMNS: gl.constexpr = tile.shape[1]
    tile = gl.convert_layout(tile, layout)
    rows = (first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))).to(gl.int64)
    cols = first_column + gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, layout))
    gl.store(ptr + rows[:, None] * stride + cols[None, :], tile)


@gluon.jit
def _gathered_ws_kernel(
    # x's e4m3 token rows [T, H] (bytes); TMA descriptors of the weights' e4m3 [E_l·I, H]
    x_ptr, w_gate_desc, w_up_desc,
    # outputs: h_q [capacity_rows, I] e4m3 bytes, h_scale [capacity_rows, I/128] fp32, g, u
    # [capacity_rows, 2, I] bf16 (STORE_GATE_UP); with TMA_STORE, TMA descriptors of h_q's e4m3 (or
    # the bf16 product) and of g, u as [capacity_rows, 2·I], in boxes of a consumer's rows × 128
    h_ptr, h_scale_ptr, gate_up_ptr, h_desc, gate_up_desc,
    # GATE_UP_E4M3: g, u as e4m3 bytes (gate_up_ptr) with their scales [capacity_rows, 2, I/128]
    gate_up_scale_ptr,
    # scales: x's [T, H/128], the weights' [E_l, I/128, H/128]
    x_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr,
    # schedule
    row_source_ptr, tile_expert_ptr, num_rows_ptr,
    # sizes
    topk, hidden, inter, swiglu_limit,
    # meta
    HAS_LIMIT: gl.constexpr, FAST_SIGMOID: gl.constexpr, STORE_GATE_UP: gl.constexpr, GATE_UP_E4M3: gl.constexpr,
    PRODUCT: gl.constexpr, TMA_STORE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    # elements per thread along a row of the bf16 register stores and of the e4m3 byte tiles (the plan's
    # `warp_specialized_store_vector`, `gathered_byte_vector`); the producer's threads (`gathered_producer_threads`)
    STORE_VECTOR: gl.constexpr, BYTE_VECTOR: gl.constexpr, GATHER_THREADS: gl.constexpr,
    # registers per thread of the consumers and the producer (the plan's `warp_specialized_*_registers`)
    CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr,
):
    """h = SwiGLU(x·Wgᵀ, x·Wuᵀ) of each sorted row, cooperative: a tile is 128 rows × 128
    columns of h, its A tiles gathered from x's token rows by the producer warp group, its B
    slot the gate tile over the up tile, so a consumer's two 128-column accumulators
    (`_scaled_mma_steps`) are its rows' g and u. PRODUCT: the fp8_block down dgrad's product
    a[r] = dOut[src(r) // topk] · Wd[e] instead (x_ptr dOut's token rows, w_gate_desc and
    w_up_desc both w_downᵀ [E_l·I, H], h_ptr the product [capacity_rows, I], fp32 or bf16): a tile is 128
    rows × 256 columns, the B slot w_downᵀ's two 128-row tiles, stored as computed. TMA_STORE:
    each consumer's outputs leave through shared-memory buffers of its own by TMA stores, left in
    flight under the next tile's MMAs (PRODUCT: two bf16 tiles; else h's e4m3 tile and g's and
    u's bf16 ones)."""
    A_TILE: gl.constexpr = [BLOCK_M // 2, BLOCK_K]
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES] + A_TILE, _fp8_shared_layout(A_TILE))
    b_bufs = _allocate_b_tiles(w_gate_desc, STAGES, 2)
    ready, empty, _ = _allocate_barriers(2, GATHER_THREADS, STAGES)
    out_bufs = b_bufs  # unread without TMA_STORE
    h_bufs = b_bufs
    if TMA_STORE and PRODUCT:  # per consumer: the product's two tiles
        out_bufs = gl.allocate_shared_memory(h_desc.dtype, [4] + h_desc.block_type.shape, h_desc.layout)
    elif TMA_STORE:  # per consumer: h's tile, and g's and u's
        h_bufs = gl.allocate_shared_memory(h_desc.dtype, [2] + h_desc.block_type.shape, h_desc.layout)
        if STORE_GATE_UP:
            out_bufs = gl.allocate_shared_memory(gate_up_desc.dtype, [4] + gate_up_desc.block_type.shape,
                                                 gate_up_desc.layout)
    gl.warp_specialize([
        (_gathered_consumer, (x_ptr, w_gate_desc, w_up_desc, a_bufs, b_bufs, ready, empty, h_ptr, h_scale_ptr,
                              gate_up_ptr, gate_up_scale_ptr, x_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr,
                              row_source_ptr, tile_expert_ptr, num_rows_ptr, topk, hidden, inter, swiglu_limit, h_desc,
                              gate_up_desc, out_bufs, h_bufs, 0, HAS_LIMIT, FAST_SIGMOID, STORE_GATE_UP, GATE_UP_E4M3,
                              PRODUCT, TMA_STORE, BLOCK_M, BLOCK_K, GROUP_M, STAGES, STORE_VECTOR,
                              BYTE_VECTOR)),
        (_gathered_consumer, (x_ptr, w_gate_desc, w_up_desc, a_bufs, b_bufs, ready, empty, h_ptr, h_scale_ptr,
                              gate_up_ptr, gate_up_scale_ptr, x_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr,
                              row_source_ptr, tile_expert_ptr, num_rows_ptr, topk, hidden, inter, swiglu_limit, h_desc,
                              gate_up_desc, out_bufs, h_bufs, 1, HAS_LIMIT, FAST_SIGMOID, STORE_GATE_UP, GATE_UP_E4M3,
                              PRODUCT, TMA_STORE, BLOCK_M, BLOCK_K, GROUP_M, STAGES, STORE_VECTOR,
                              BYTE_VECTOR)),
        (_gathered_producer, (x_ptr, w_gate_desc, w_up_desc, a_bufs, b_bufs, ready, empty, h_ptr, h_scale_ptr,
                              gate_up_ptr, gate_up_scale_ptr, x_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr,
                              row_source_ptr, tile_expert_ptr, num_rows_ptr, topk, hidden, inter, swiglu_limit, h_desc,
                              gate_up_desc, out_bufs, h_bufs, 0, HAS_LIMIT, FAST_SIGMOID, STORE_GATE_UP, GATE_UP_E4M3,
                              PRODUCT, TMA_STORE, BLOCK_M, BLOCK_K, GROUP_M, STAGES, STORE_VECTOR,
                              BYTE_VECTOR)),
    ], [4, GATHER_THREADS // 32], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


# --------------------------------------------------------------------------- launchers


def launch_down_dgrad_product_fp8_block(d_out_q: torch.Tensor, d_out_scale: torch.Tensor, w_down_t_q: torch.Tensor,
                                        w_down_t_scale: torch.Tensor, product: torch.Tensor,
                                        schedule: RoutingSchedule, cfg: dict, topk: int | None = None) -> None:
    """product[r] = dOut[r] · w_down[e] for the sorted rows r of every M tile below the schedule's
    num_rows, in product's dtype (`dgrad.down_dgrad_swiglu_fp8_block`'s GEMM, before its epilogue): d_out_q
    the sorted rows [capacity_rows, H] e4m3 read through TMA, or with `topk` the token rows
    [T, H] gathered by the producer (row r reads token row_source[r] // topk); w_down_t_q the
    transposed copy [E_l, I, H] (read as [E_l·I, H], K-major), product [capacity_rows, I]. The
    caller has checked the operands."""
    if topk is None:
        _launch_scatter(d_out_q, None, w_down_t_q, None, product, schedule, cfg, True, (d_out_scale, w_down_t_scale),
                        "down dgrad", scatter=False)
        return
    w_down_t = (w_down_t_q, w_down_t_scale)
    _launch_gathered(d_out_q, d_out_scale, w_down_t, w_down_t, product, None, None, schedule, topk, None, cfg,
                     product=True)


def launch_gate_up_swiglu_fp8_block(x_q: torch.Tensor, x_scale: torch.Tensor, w_gate_q: torch.Tensor,
                                    w_gate_scale: torch.Tensor, w_up_q: torch.Tensor, w_up_scale: torch.Tensor,
                                    h_q: torch.Tensor, h_scale: torch.Tensor,
                                    gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
                                    schedule: RoutingSchedule, topk: int, swiglu_limit: float | None,
                                    cfg: dict) -> None:
    """`gate_up.gate_up_swiglu_fp8_block`'s kernel here: x_q, x_scale per token ([T, H]
    e4m3 and [T, H/128], `quantize_fp8_block_activations`), h_q (uint8 bytes), h_scale and,
    unless None, gate_up (bf16, or the pair of e4m3 bytes and scales) written for every row below
    the schedule's num_rows. The caller has
    checked the operands and the outputs."""
    _launch_gathered(x_q, x_scale, (w_gate_q, w_gate_scale), (w_up_q, w_up_scale), h_q, h_scale, gate_up, schedule,
                     topk, swiglu_limit, cfg, product=False)


def _launch_gathered(x_q, x_scale, w_gate: tuple[torch.Tensor, torch.Tensor], w_up: tuple[torch.Tensor, torch.Tensor],
                     out, h_scale, gate_up, schedule: RoutingSchedule, topk: int, swiglu_limit: float | None,
                     cfg: dict, product: bool) -> None:
    """`_gathered_ws_kernel`: the gate/up GEMM (out = h_q), or with `product` the down dgrad's
    product (out fp32, w_gate and w_up both w_downᵀ's pair, h_scale and gate_up None)."""
    what = "down dgrad" if product else "gate/up GEMM"
    _check_fp8_block_tile(cfg, schedule, what)
    if cfg["BLOCK_N"] != 2 * FP8_BLOCK:
        raise ValueError(f"tile_config: the fp8_block {what} gathering token rows needs BLOCK_N {2 * FP8_BLOCK} (two "
                         f"tiles of {FP8_BLOCK} columns), got {cfg['BLOCK_N']}")
    _check_device(x_q.device)
    hidden, inter = x_q.shape[1], w_gate[0].shape[1]
    half = (FP8_BLOCK, cfg["BLOCK_K"])
    tile_n = cfg["BLOCK_N"] if product else FP8_BLOCK  # the gate/up's tile: 128 columns of h
    num_tiles = (schedule.capacity_rows // cfg["BLOCK_M"]) * triton.cdiv(inter, tile_n)
    w_gate_desc = _descriptor(w_gate[0], half)
    plan = kernel_plan(out.device)
    # TMA stores (the plan's `gathered_tma_store`): an fp32 product's buffers would not fit beside the ring
    tma_store = plan.gathered_tma_store and out.dtype != torch.float32
    h_desc = gate_up_desc = w_gate_desc  # unread without tma_store
    gate_up, gate_up_scale = gate_up_parts(gate_up)
    gate_up_e4m3 = gate_up_scale is not None
    if tma_store:
        box = (_consumer_rows(cfg["BLOCK_M"], True), FP8_BLOCK)
        h_desc = _descriptor(out if product else out.view(torch.float8_e4m3fn), box)  # [capacity_rows, I]
        if gate_up is not None:  # g, u as [capacity_rows, 2·I], bf16 or e4m3
            stored = gate_up.view(torch.float8_e4m3fn) if gate_up_e4m3 else gate_up
            gate_up_desc = _descriptor(stored.view(gate_up.shape[0], -1), box)
    _gathered_ws_kernel[(min(num_tiles, num_sms(x_q.device)),)](
        x_q, w_gate_desc, _descriptor(w_up[0], half),
        out, out if h_scale is None else h_scale, out if gate_up is None else gate_up,  # out: an unread stand-in
        h_desc, gate_up_desc, out if gate_up_scale is None else gate_up_scale,
        x_scale, w_gate[1], w_up[1],
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        topk, hidden, inter, 0.0 if swiglu_limit is None else float(swiglu_limit),
        swiglu_limit is not None, fast_sigmoid_here(), gate_up is not None, gate_up_e4m3, product, tma_store,
        cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["GROUP_M"], cfg["num_stages"], plan.warp_specialized_store_vector,
        plan.gathered_byte_vector, plan.gathered_producer_threads, plan.warp_specialized_consumer_registers,
        plan.warp_specialized_producer_registers, num_warps=4,
    )
