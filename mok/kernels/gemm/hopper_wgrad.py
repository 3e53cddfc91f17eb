"""The warp-specialized weight-gradient GEMMs, for Hopper, in Gluon: the Triton kernel of `wgrad.py` with a
producer warp running TMA loads ahead of two consumer warp groups (the pipeline, its two schedules and the
ring protocol: `hopper_common.py`).

    down wgrad:    d_w_down[e] = Σ_{r of e} dy_sorted[r]ᵀ · h[r]  (fp32 sum, stored bf16; `wgrad.py`)
    gate/up wgrad: d_w_gate[e] = Σ_{r of e} d_g[r]ᵀ · x_sorted[r], d_w_up[e] likewise with d_u
    fp8_block wgrads: both wgrads over e4m3 operands quantized in 128-row blocks, each step's
                   product scaled by its block's row and column scales (`wgrad.py`'s fp8_block)

Legend: r a row of the expert-sorted layout of `routing/schedule.py`, e an expert, E_l local experts.

Each tile's K loop is the Triton kernel's, so the result is bitwise the Triton kernel's; fixed order,
no atomics: deterministic. Caller contract: as for `wgrad.down_wgrad`, `wgrad.gate_up_wgrad` and their
`*_fp8_block`, without main_grad; the gate/up and fp8_block wgrads cooperative only.
"""

from __future__ import annotations

import torch
import triton

from mok.fp8_block import FP8_BLOCK
from mok.kernels.common import expert_tile_coordinates, num_sms
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
from mok.kernels.gluon_api import gl, gluon, tma, tma_load
from mok.kernels.plan import kernel_plan
from mok.kernels.routing.schedule import RoutingSchedule


@gluon.jit
def _wgrad_tile(tile, expert_offsets_ptr, expert_counts_ptr, m_dim, n_dim, TILE_M: gl.constexpr,
                BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr):
    """(expert, m0, n0, first row, K steps) of an output tile, in `wgrad.expert_tile_coordinates`'s
    order; the steps cover the expert's routes, as the Triton kernel's (`wgrad.py`)."""
    expert, m0, n0 = expert_tile_coordinates(tile, m_dim, n_dim, TILE_M, BLOCK_N, GROUP_M)
    row_start = gl.load(expert_offsets_ptr + expert)
    steps = gl.cdiv(gl.load(expert_counts_ptr + expert), BLOCK_K)
    return expert, m0, n0, row_start, steps


@gluon.constexpr_function
def _wgrad_tile_m(block_m, two_outputs):
    """Rows of one output in a tile: two outputs split the tile's BLOCK_M rows between them."""
    return block_m // 2 if two_outputs else block_m


@gluon.jit
def _wgrad_producer(a_desc, a2_desc, b_desc, b_scale_desc, a_bufs, b_bufs, b_scale_bufs, ready, empty, turn, out_ptr,
                    out2_ptr, out_desc, out2_desc, out_bufs, a_scale_ptr, expert_offsets_ptr, expert_counts_ptr,
                    num_tiles, m_dim, n_dim, split_m, stride_out_e, stride_a_scale, CONSUMER: gl.constexpr,
                    COOPERATIVE: gl.constexpr, TWO_OUTPUTS: gl.constexpr, FP8: gl.constexpr, TMA_STORE: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                    STAGES: gl.constexpr, STORE_VECTOR: gl.constexpr):
    TILE_M: gl.constexpr = _wgrad_tile_m(BLOCK_M, TWO_OUTPUTS)
    # consumer 1's A columns: the same as consumer 0's in a2 (two outputs), or the tile's second half
    A2_OFFSET: gl.constexpr = 0 if TWO_OUTPUTS else _consumer_rows(BLOCK_M, COOPERATIVE)
    step = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        expert, m0, n0, row_start, steps = _wgrad_tile(tile, expert_offsets_ptr, expert_counts_ptr, m_dim, n_dim,
                                                       TILE_M, BLOCK_N, BLOCK_K, GROUP_M)
        for k in range(steps):
            r0 = row_start + k * BLOCK_K
            if FP8:  # transposed copies [m_dim or n_dim, rows]: K-major tiles; B's column scales with them
                slot, bar = _load_step(step, a_desc, [m0, r0], a2_desc, [m0 + A2_OFFSET, r0], b_desc, [n0, r0],
                                       a_bufs, b_bufs, ready, empty, b_scale_desc.block_type.nbytes, COOPERATIVE,
                                       STAGES)
                tma_load(b_scale_desc, [r0 // BLOCK_K, n0], bar, b_scale_bufs.index(slot))
            else:
                _load_step(step, a_desc, [r0, m0], a2_desc, [r0, m0 + A2_OFFSET], b_desc, [r0, n0], a_bufs, b_bufs,
                           ready, empty, 0, COOPERATIVE, STAGES)
            step += 1


@gluon.jit
def _wgrad_consumer(a_desc, a2_desc, b_desc, b_scale_desc, a_bufs, b_bufs, b_scale_bufs, ready, empty, turn, out_ptr,
                    out2_ptr, out_desc, out2_desc, out_bufs, a_scale_ptr, expert_offsets_ptr, expert_counts_ptr,
                    num_tiles, m_dim, n_dim, split_m, stride_out_e, stride_a_scale, CONSUMER: gl.constexpr,
                    COOPERATIVE: gl.constexpr, TWO_OUTPUTS: gl.constexpr, FP8: gl.constexpr, TMA_STORE: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                    STAGES: gl.constexpr, STORE_VECTOR: gl.constexpr):
    TILE_M: gl.constexpr = _wgrad_tile_m(BLOCK_M, TWO_OUTPUTS)
    ROWS: gl.constexpr = _consumer_rows(BLOCK_M, COOPERATIVE)
    TURNS: gl.constexpr = _takes_turns(COOPERATIVE)
    MMA_N: gl.constexpr = _mma_n(BLOCK_N, FP8)
    mma_layout: gl.constexpr = _mma_layout(MMA_N, FP8)
    step = 0  # the ring's step count: every partition walks all of the program's tiles
    tile_count = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        expert, m0, n0, row_start, steps = _wgrad_tile(tile, expert_offsets_ptr, expert_counts_ptr, m_dim, n_dim,
                                                       TILE_M, BLOCK_N, BLOCK_K, GROUP_M)
        if TWO_OUTPUTS:  # consumer c's rows are out_c's (d_w_gate, d_w_up)
            out = out2_ptr if CONSUMER == 1 else out_ptr
            first_row = m0
        else:
            out = out_ptr
            first_row = m0 + (CONSUMER * ROWS if COOPERATIVE else 0)
        if tile_count % TURNS == CONSUMER % TURNS:
            acc = gl.zeros((ROWS, MMA_N), gl.float32, mma_layout)
            acc_hi = acc  # fp8_block at BLOCK_N = 2 · MMA_N: columns [n0 + MMA_N, n0 + BLOCK_N)
            if FP8:
                rows, rows_valid = _accumulator_rows(first_row, m_dim, ROWS, mma_layout)
                acc, acc_hi = _scaled_mma_steps(acc, acc_hi, step, steps, row_start // BLOCK_K, a_bufs, b_bufs, ready,
                                                empty, a_scale_ptr, b_scale_bufs, b_scale_bufs, False,
                                                (stride_a_scale, 1, 0), rows, rows_valid, CONSUMER, True, False,
                                                STAGES)
            else:
                acc = _mma_steps(acc, step, steps, tile_count, a_bufs, b_bufs, ready, empty, turn, CONSUMER, False,
                                 False, COOPERATIVE, STAGES)
            if TMA_STORE:
                first_buf: gl.constexpr = CONSUMER * (out_bufs.shape[0] // 2)
                # two outputs: consumer 1's rows are out2's at the same place (split_m = m_dim)
                desc = out2_desc if TWO_OUTPUTS and CONSUMER == 1 else out_desc
                tma.store_wait(0)  # the last tile's stores have read this consumer's buffers
                _wgrad_store_async(acc, out_bufs.index(first_buf), desc, out2_desc, expert, first_row, n0, m_dim,
                                   split_m)
                if MMA_N < BLOCK_N:
                    _wgrad_store_async(acc_hi, out_bufs.index(first_buf + 1), desc, out2_desc, expert, first_row,
                                       n0 + MMA_N, m_dim, split_m)
            else:
                _wgrad_store(acc, out, out2_ptr, expert, first_row, n0, m_dim, n_dim, split_m, stride_out_e,
                             STORE_VECTOR)
                if MMA_N < BLOCK_N:
                    _wgrad_store(acc_hi, out, out2_ptr, expert, first_row, n0 + MMA_N, m_dim, n_dim, split_m,
                                 stride_out_e, STORE_VECTOR)
        step += steps
        tile_count += 1
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _wgrad_store(acc, out, out2_ptr, expert, first_row, n0, m_dim, n_dim, split_m, stride_out_e,
                 STORE_VECTOR: gl.constexpr):
    """out[expert] (rows below split_m) or out2[expert] (the rest, less split_m), rows from
    first_row and columns from n0 on: acc in bf16, STORE_VECTOR columns per thread and store."""
    ROWS: gl.constexpr = acc.shape[0]
    COLUMNS: gl.constexpr = acc.shape[1]
    layout: gl.constexpr = _row_runs_layout(STORE_VECTOR)
    grad = gl.convert_layout(acc.to(gl.bfloat16), layout)
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = n0 + gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, layout))
    in_out2 = rows >= split_m  # stacked rows: [0, split_m) are out's, the rest out2's
    out_rows = gl.where(in_out2, rows - split_m, rows).to(gl.int64)
    offs = expert.to(gl.int64) * stride_out_e + out_rows[:, None] * n_dim + cols[None, :]
    ptrs = gl.where(in_out2[:, None], out2_ptr + offs, out + offs)
    gl.store(ptrs, grad, mask=(rows < m_dim)[:, None] & (cols < n_dim)[None, :])


@gluon.jit
def _wgrad_store_async(acc, buf, out_desc, out2_desc, expert, first_row, n0, m_dim, split_m):
    """As `_wgrad_store` (out's and out2's rows in whole boxes, so that a box lies in one of them
    and one expert: `_wgrad_stores_by_tma`), through `buf` and a TMA store of out or out2 viewed as
    [E_l · rows, n_dim]; the store is left in flight, and the caller waits for it
    (`tma.store_wait`) before it writes `buf` again. TMA clips the columns past n_dim."""
    if first_row < split_m:
        _store_tile_async(acc.to(gl.bfloat16), buf, out_desc, expert * split_m + first_row, n0)
    else:
        _store_tile_async(acc.to(gl.bfloat16), buf, out2_desc, expert * (m_dim - split_m) + first_row - split_m, n0)


@gluon.jit
def _wgrad_ws_kernel(
    # TMA descriptors (bf16: a, a2 [rows, m_dim], b [rows, n_dim]; FP8: e4m3 aᵀ [m_dim, rows],
    # bᵀ [n_dim, rows], and bᵀ's scales [rows / 128, n_dim] fp32; bf16: b again, unread) and
    # out, out2 [E_l, ·, n_dim] bf16; with TMA_STORE, out's and out2's TMA descriptors as
    # [E_l · rows, n_dim] in `_wgrad_store_box`es (else any descriptor, unread)
    a_desc, a2_desc, b_desc, b_scale_desc, out_ptr, out2_ptr, out_desc, out2_desc,
    # FP8: the scales of aᵀ, [rows / 128, m_dim] fp32
    a_scale_ptr,
    # schedule
    expert_offsets_ptr, expert_counts_ptr,
    # sizes (num_tiles tiles over m_dim × n_dim per expert; rows from split_m on are out2's), strides
    num_tiles, m_dim, n_dim, split_m, stride_out_e, stride_a_scale,
    # meta
    COOPERATIVE: gl.constexpr, TWO_OUTPUTS: gl.constexpr, FP8: gl.constexpr, TMA_STORE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    # columns per thread of the register stores (the plan's `warp_specialized_store_vector`)
    STORE_VECTOR: gl.constexpr,
    # registers per thread of the consumers and the producer (the plan's `warp_specialized_*_registers`)
    CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr,
):
    """down: a = dy_sorted, b = h; gate/up (TWO_OUTPUTS, cooperative): a, a2 = d_g, d_u, b = x_sorted;
    FP8 (cooperative): a = dyᵀ or the stacked [d_g | d_u]ᵀ (out's rows, then out2's), b = hᵀ or xᵀ,
    each step's B column scales loaded into the ring beside its tiles. TMA_STORE (cooperative):
    each consumer's rows of the tile leave through shared-memory buffers of its own by TMA."""
    a_bufs, b_bufs, ready, empty, turn = _allocate_ring(a_desc, b_desc, COOPERATIVE, STAGES, 1)
    if FP8:
        b_scale_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + b_scale_desc.block_type.shape,
                                                 b_scale_desc.layout)
    else:
        b_scale_bufs = b_bufs  # unread
    if TMA_STORE:  # per consumer, one buffer per accumulator (fp8_block: two of 128 columns)
        parts: gl.constexpr = BLOCK_N // out_desc.block_type.shape[1]
        out_bufs = gl.allocate_shared_memory(gl.bfloat16, [2 * parts] + out_desc.block_type.shape, out_desc.layout)
    else:
        out_bufs = b_bufs  # unread
    gl.warp_specialize([
        (_wgrad_consumer, (a_desc, a2_desc, b_desc, b_scale_desc, a_bufs, b_bufs, b_scale_bufs, ready, empty, turn,
                           out_ptr, out2_ptr, out_desc, out2_desc, out_bufs, a_scale_ptr, expert_offsets_ptr,
                           expert_counts_ptr, num_tiles, m_dim, n_dim, split_m, stride_out_e, stride_a_scale, 0,
                           COOPERATIVE, TWO_OUTPUTS, FP8, TMA_STORE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                           STORE_VECTOR)),
        (_wgrad_consumer, (a_desc, a2_desc, b_desc, b_scale_desc, a_bufs, b_bufs, b_scale_bufs, ready, empty, turn,
                           out_ptr, out2_ptr, out_desc, out2_desc, out_bufs, a_scale_ptr, expert_offsets_ptr,
                           expert_counts_ptr, num_tiles, m_dim, n_dim, split_m, stride_out_e, stride_a_scale, 1,
                           COOPERATIVE, TWO_OUTPUTS, FP8, TMA_STORE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                           STORE_VECTOR)),
        (_wgrad_producer, (a_desc, a2_desc, b_desc, b_scale_desc, a_bufs, b_bufs, b_scale_bufs, ready, empty, turn,
                           out_ptr, out2_ptr, out_desc, out2_desc, out_bufs, a_scale_ptr, expert_offsets_ptr,
                           expert_counts_ptr, num_tiles, m_dim, n_dim, split_m, stride_out_e, stride_a_scale, 0,
                           COOPERATIVE, TWO_OUTPUTS, FP8, TMA_STORE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                           STORE_VECTOR)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


# --------------------------------------------------------------------------- launchers


def _wgrad_store_box(cfg: dict, fp8: bool) -> tuple[int, int]:
    """The TMA store's box: a consumer's rows by one accumulator's columns (fp8_block: 128)."""
    return _consumer_rows(cfg["BLOCK_M"], True), FP8_BLOCK if fp8 else cfg["BLOCK_N"]


def _wgrad_stores_by_tma(cfg: dict, split_m: int, m_dim: int, n_dim: int, fp8: bool, device: torch.device) -> bool:
    """Whether a cooperative wgrad stores its tiles by TMA (the plan's `fp8_wgrad_tma_store`,
    `bf16_wgrad_tma_store`): where each output's rows (out's split_m, out2's the rest) are whole
    boxes, so that no box crosses into the other output or the next expert, the rows are 16-byte
    aligned, and the store buffers fit in shared memory beside the ring (not in fp8_block at 128
    columns and 6 stages, nor in bf16 at 4 stages)."""
    plan = kernel_plan(device)
    if not (plan.fp8_wgrad_tma_store if fp8 else plan.bf16_wgrad_tma_store) or not cfg.get("COOPERATIVE", False):
        return False
    box_rows = _wgrad_store_box(cfg, fp8)[0]
    stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * (1 if fp8 else 2)  # bytes of A's and B's tiles
    if fp8:
        stage += 4 * cfg["BLOCK_N"]  # B's column scales, fp32
    ring = cfg["num_stages"] * stage
    buffers = 2 * cfg["BLOCK_N"] * box_rows * 2  # bf16, both consumers' rows of the tile
    barriers = 1024
    return (split_m % box_rows == 0 and (m_dim - split_m) % box_rows == 0 and n_dim % 8 == 0
            and ring + buffers + barriers <= torch.cuda.get_device_properties(device).shared_memory_per_block_optin)


def launch_wgrad(a: torch.Tensor, a2: torch.Tensor | None, b: torch.Tensor, out: torch.Tensor,
                 out2: torch.Tensor | None, schedule: RoutingSchedule, cfg: dict,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """out[e] = Σ_r a[r]ᵀ · b[r] and, with a2 and out2 (cooperative only), out2[e] = Σ_r a2[r]ᵀ · b[r]
    (`wgrad.down_wgrad` and `wgrad.gate_up_wgrad` without main_grad). With `scales` (aᵀ's, bᵀ's),
    the fp8_block wgrads (`wgrad.down_wgrad_fp8_block`, `wgrad.gate_up_wgrad_fp8_block` with
    STACKED, cooperative only): a, b their e4m3 transposed copies, and with out2, a the stacked
    [d_g | d_u]ᵀ whose second half of rows is out2's. The caller has checked the operands and the
    outputs (new contiguous bf16 [E_l, m_dim, n_dim])."""
    cooperative, fp8 = cfg.get("COOPERATIVE", False), scales is not None
    two_outputs = out2 is not None and not fp8
    if two_outputs and not cooperative:
        raise ValueError("tile_config: the gate/up wgrad (two outputs) needs COOPERATIVE with WARP_SPECIALIZED")
    if fp8:
        _check_fp8_block_tile(cfg, schedule, "wgrad")
    _check_device(b.device)
    experts, m_dim, n_dim = out.shape
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    split_m = m_dim
    if fp8:
        m_dim = a.shape[0]  # out's rows, then out2's
        a_block, b_block = (_consumer_rows(block_m, True), block_k), (block_n, block_k)
        a_scale, b_scale = scales
        if n_dim % 4:  # TMA reads the column scales' rows: 16-byte aligned
            raise ValueError(f"the warp-specialized fp8_block wgrad needs an output width that is a multiple of 4, "
                             f"got {n_dim}")
    else:
        a_block, b_block = (block_k, _consumer_rows(block_m, cooperative)), (block_k, block_n)
        a_scale = out  # unread
    num_tiles = experts * triton.cdiv(m_dim, _wgrad_tile_m(block_m, two_outputs)) * triton.cdiv(n_dim, block_n)
    a_desc, b_desc = _descriptor(a, a_block), _descriptor(b, b_block)
    out2 = out if out2 is None else out2
    tma_store = _wgrad_stores_by_tma(cfg, split_m, m_dim, n_dim, fp8, b.device)
    if tma_store:  # [E_l · rows, n_dim]
        out_desc, out2_desc = (_descriptor(t.view(-1, n_dim), _wgrad_store_box(cfg, fp8)) for t in (out, out2))
    else:
        out_desc = out2_desc = b_desc  # unread
    plan = kernel_plan(b.device)
    _wgrad_ws_kernel[(min(num_tiles, num_sms(b.device)),)](
        a_desc, _descriptor(a2, a_block) if two_outputs else a_desc, b_desc,
        _descriptor(b_scale, (1, block_n)) if fp8 else b_desc,
        out, out2, out_desc, out2_desc, a_scale,
        schedule.expert_offsets, schedule.expert_counts,
        num_tiles, m_dim, n_dim, split_m, out.stride(0), a_scale.stride(0),
        cooperative, two_outputs, fp8, tma_store, block_m, block_n, block_k, cfg["GROUP_M"],
        cfg["num_stages"], plan.warp_specialized_store_vector, plan.warp_specialized_consumer_registers,
        plan.warp_specialized_producer_registers, num_warps=4,
    )
