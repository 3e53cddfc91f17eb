"""Warp-specialized ("ping-pong") grouped GEMMs over the sorted layout, for Hopper, in Gluon.

    down:        y[src(r)] = h[r] · Wd[e]ᵀ                     (unweighted, bf16; `grouped_gemm.py`)
    down wgrad:  d_w_down[e] = Σ_{r of e} dy_sorted[r]ᵀ · h[r]  (fp32 sum, stored bf16; `wgrad.py`)

Legend: r a row of the expert-sorted layout of `schedule.py`, src(r) = row_source[r]
(−1: padding), e = tile_expert[r // BLOCK_M], H hidden, I intermediate size, E_l local experts.

Why: the Triton kernels of `grouped_gemm.py` and `wgrad.py` run one warp group's MMAs and
its epilogue (layout change, bf16 conversion, scattered or read-modify-write stores) one
after the other, so the tensor cores idle during every epilogue. Where the K loop is short
(qwen3-30b: I = 768 for the down GEMM, ~1K rows per expert for its wgrad) that idle share is
large. Here each program (one per SM) splits into three partitions over one ring of
STAGES shared-memory slots:

- a producer warp issues the TMA loads of every tile of the program, in tile order;
- two consumer warp groups take the program's tiles in turns (0, 2, 4… and 1, 3, 5…), so
  one's epilogue runs while the other's MMAs do.

Ring protocol (mbarriers, all counting one arrival): `ready[s]` completes when slot s's
loads land, `empty[s]` when its consumer's MMA has read it; the step counter of the program
gives slot and phase (slot = step % STAGES, phase = step // STAGES). A wait on a phase
parity cannot tell a phase from the one two before it, so a consumer must never wait on a
slot two fills ahead: `turn[c]` makes consumer c start its tile's waits only after the other
consumer has passed all of its own (it arrives on `turn[1 − c]` after its last `ready`
wait), which keeps every wait within one phase.

Each tile's K loop is the Triton kernel's (the same BLOCK_K steps in the same order, fp32
accumulation in one wgmma chain), so the result is bitwise the Triton kernel's (tested on
the GPU); fixed order, no atomics: deterministic. Gluon has no interpreter: the CPU tests
compile these kernels for sm_90a and check ptxas's register and spill counts, and the
Triton kernels stay the reference path (and the only one under `TRITON_INTERPRET=1`, on
GPUs other than Hopper, and under expert parallelism).

Caller contract: as for the Triton kernels (`grouped_gemm.down_scatter`, `wgrad.down_wgrad`);
bf16 only; BLOCK_M is the schedule's block_m. Worker partitions of one `warp_specialize` share
one signature (Gluon's rule), so each kernel's producer takes its consumers' arguments.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mok.kernels.common import interpreting, num_sms, tma_descriptor
from mok.kernels.schedule import RoutingSchedule

# Tile of one consumer: a 128×128 fp32 accumulator is 128 registers per thread of its warp
# group; 128×256 spilled (ptxas, sm_90a: 3.7 KB per thread). Six stages of 128×64 A and B
# tiles (32 KiB each, 192 KiB) measured faster than four on qwen3-30b: down GEMM 0.652
# against 0.678 ms, down wgrad 0.637 against 0.646 (record h200-20261130-ping-pong-probe.log).
WS_TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=6)
# Registers per thread of the consumer warp groups and of the producer warp (setmaxnreg);
# the default partition (consumer 0) gets what is left of the launch's 168 × 384 threads.
_CONSUMER_REGISTERS = gl.constexpr(232)
_PRODUCER_REGISTERS = gl.constexpr(40)


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def warp_specialized_available(device: torch.device) -> bool:
    """These kernels need Hopper's wgmma and TMA and a real GPU (no interpreter)."""
    if device.type != "cuda" or interpreting():
        return False
    return _hopper(torch.cuda.current_device() if device.index is None else device.index)


def available_here() -> bool:
    """`warp_specialized_available` for the current CUDA device (False without one)."""
    return torch.cuda.is_available() and warp_specialized_available(torch.device("cuda"))


def _check_device(device: torch.device) -> None:
    """A tile config with WARP_SPECIALIZED can run on this device."""
    if not warp_specialized_available(device):
        raise ValueError(
            f"tile_config: WARP_SPECIALIZED needs a Hopper GPU (compute capability 9.x) outside the interpreter, "
            f"got device {device}" + (" under TRITON_INTERPRET=1" if interpreting() else "")
        )


# --------------------------------------------------------------------------- ring helpers


@gluon.jit
def _load_step(step, a_desc, a_coords, b_desc, b_coords, a_bufs, b_bufs, ready, empty, STAGES: gl.constexpr):
    """Producer: wait until the slot of `step` is free, then TMA-load its A and B tiles."""
    slot = step % STAGES
    mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
    bar = ready.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, a_coords, bar, a_bufs.index(slot))
    tma.async_copy_global_to_shared(b_desc, b_coords, bar, b_bufs.index(slot))


@gluon.jit
def _mma_steps(acc, first_step, steps, tile_count, a_bufs, b_bufs, ready, empty, turn,
               CONSUMER: gl.constexpr, A_K_MAJOR: gl.constexpr, STAGES: gl.constexpr):
    """Consumer: acc += Σ over the ring steps [first_step, first_step + steps) of A·B, one
    wgmma in flight; each slot is released once the next wgmma has retired its reader.
    A tiles are [M, K] (A_K_MAJOR) or [K, M] in shared memory; B tiles are [N, K] (A_K_MAJOR)
    or [K, N]. `tile_count`: this program's tiles so far (both consumers'), for `turn`."""
    mbarrier.wait(turn.index(CONSUMER), ((tile_count // 2) & 1) ^ (1 - CONSUMER))
    for k in range(steps):
        step = first_step + k
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        if A_K_MAJOR:
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
        else:
            acc = warpgroup_mma(a_bufs.index(slot).permute((1, 0)), b_bufs.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if k > 0:
            mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
    mbarrier.arrive(turn.index(1 - CONSUMER), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if steps > 0:
        mbarrier.arrive(empty.index((first_step + steps - 1) % STAGES), count=1)
    return acc


@gluon.constexpr_function
def _mma_layout(block_n):
    """The wgmma accumulator layout of one warp group's [BLOCK_M, block_n] tile."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16])


# Row-major layout of the epilogue's stores: 8 consecutive columns (16 bytes of bf16) per thread.
_STORE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


@gluon.jit
def _allocate_ring(a_desc, b_desc, STAGES: gl.constexpr):
    """STAGES slots of A and B tiles and the ring's barriers (ready, empty, turn)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for c in gl.static_range(2):
        mbarrier.init(turn.index(c), count=1)
    fence_async_shared()
    return a_bufs, b_bufs, ready, empty, turn


# --------------------------------------------------------------------------- down GEMM


@gluon.jit
def _down_producer(h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, row_source_ptr, tile_expert_ptr,
                   num_rows_ptr, hidden, inter, stride_y, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    num_n_tiles = gl.cdiv(hidden, BLOCK_N)
    num_tiles = gl.cdiv(gl.load(num_rows_ptr), BLOCK_M) * num_n_tiles
    step = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        m0 = (tile // num_n_tiles) * BLOCK_M
        # w_down viewed as [E_l·H, I]: a box past this expert's last row reads the next
        # expert's rows, which land only in columns the epilogue does not store
        w_row = gl.load(tile_expert_ptr + tile // num_n_tiles) * hidden + (tile % num_n_tiles) * BLOCK_N
        for k0 in range(0, inter, BLOCK_K):
            _load_step(step, h_desc, [m0, k0], w_desc, [w_row, k0], a_bufs, b_bufs, ready, empty, STAGES)
            step += 1


@gluon.jit
def _down_consumer(h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, row_source_ptr, tile_expert_ptr,
                   num_rows_ptr, hidden, inter, stride_y, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    mma_layout: gl.constexpr = _mma_layout(BLOCK_N)
    num_n_tiles = gl.cdiv(hidden, BLOCK_N)
    num_tiles = gl.cdiv(gl.load(num_rows_ptr), BLOCK_M) * num_n_tiles
    k_steps = gl.cdiv(inter, BLOCK_K)
    tile_count = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        if tile_count % 2 == CONSUMER:
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma_layout)
            acc = _mma_steps(acc, tile_count * k_steps, k_steps, tile_count, a_bufs, b_bufs, ready, empty, turn,
                             CONSUMER, True, STAGES)
            y = gl.convert_layout(acc.to(gl.bfloat16), _STORE_LAYOUT)
            rows = (tile // num_n_tiles) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, _STORE_LAYOUT))
            cols = (tile % num_n_tiles) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, _STORE_LAYOUT))
            source = gl.load(row_source_ptr + rows)
            slot = gl.where(source >= 0, source, 0).to(gl.int64)
            mask = (source >= 0)[:, None] & (cols < hidden)[None, :]
            gl.store(y_ptr + slot[:, None] * stride_y + cols[None, :], y, mask=mask)
        tile_count += 1


@gluon.jit
def _down_scatter_ws_kernel(
    # TMA descriptors (h [capacity_rows, I], w_down [E_l·H, I]) and y [slots, H]
    h_desc, w_desc, y_ptr,
    # schedule
    row_source_ptr, tile_expert_ptr, num_rows_ptr,
    # sizes, strides
    hidden, inter, stride_y,
    # meta
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
):
    a_bufs, b_bufs, ready, empty, turn = _allocate_ring(h_desc, w_desc, STAGES)
    gl.warp_specialize([
        (_down_consumer, (h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, row_source_ptr, tile_expert_ptr,
                          num_rows_ptr, hidden, inter, stride_y, 0, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
        (_down_consumer, (h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, row_source_ptr, tile_expert_ptr,
                          num_rows_ptr, hidden, inter, stride_y, 1, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
        (_down_producer, (h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, row_source_ptr, tile_expert_ptr,
                          num_rows_ptr, hidden, inter, stride_y, 0, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
    ], [4, 1], [_CONSUMER_REGISTERS, _PRODUCER_REGISTERS])


# --------------------------------------------------------------------------- down wgrad


@gluon.jit
def _wgrad_tile(tile, expert_offsets_ptr, m_dim, n_dim, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                BLOCK_K: gl.constexpr):
    """(expert, m0, n0, first row, K steps) of an output tile, expert outermost (as `wgrad.py`)."""
    num_m = gl.cdiv(m_dim, BLOCK_M)
    num_n = gl.cdiv(n_dim, BLOCK_N)
    expert = tile // (num_m * num_n)
    rest = tile % (num_m * num_n)
    row_start = gl.load(expert_offsets_ptr + expert)
    steps = (gl.load(expert_offsets_ptr + expert + 1) - row_start) // BLOCK_K
    return expert, (rest // num_n) * BLOCK_M, (rest % num_n) * BLOCK_N, row_start, steps


@gluon.jit
def _wgrad_producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, turn, out_ptr, expert_offsets_ptr, num_tiles,
                    m_dim, n_dim, stride_out_e, CONSUMER: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    step = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        expert, m0, n0, row_start, steps = _wgrad_tile(tile, expert_offsets_ptr, m_dim, n_dim, BLOCK_M, BLOCK_N,
                                                       BLOCK_K)
        for k in range(steps):
            r0 = row_start + k * BLOCK_K
            _load_step(step, a_desc, [r0, m0], b_desc, [r0, n0], a_bufs, b_bufs, ready, empty, STAGES)
            step += 1


@gluon.jit
def _wgrad_consumer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, turn, out_ptr, expert_offsets_ptr, num_tiles,
                    m_dim, n_dim, stride_out_e, CONSUMER: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    mma_layout: gl.constexpr = _mma_layout(BLOCK_N)
    step = 0  # the ring's step count: every partition walks all of the program's tiles
    tile_count = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        expert, m0, n0, row_start, steps = _wgrad_tile(tile, expert_offsets_ptr, m_dim, n_dim, BLOCK_M, BLOCK_N,
                                                       BLOCK_K)
        if tile_count % 2 == CONSUMER:
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma_layout)
            acc = _mma_steps(acc, step, steps, tile_count, a_bufs, b_bufs, ready, empty, turn, CONSUMER, False,
                             STAGES)
            grad = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), _STORE_LAYOUT)
            rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, _STORE_LAYOUT))
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, _STORE_LAYOUT))
            offs = expert.to(gl.int64) * stride_out_e + rows.to(gl.int64)[:, None] * n_dim + cols[None, :]
            gl.store(out_ptr + offs, grad, mask=(rows < m_dim)[:, None] & (cols < n_dim)[None, :])
        step += steps
        tile_count += 1


@gluon.jit
def _down_wgrad_ws_kernel(
    # TMA descriptors (dy_sorted [rows, H], h [rows, I]) and out [E_l, H, I] bf16
    a_desc, b_desc, out_ptr,
    # schedule
    expert_offsets_ptr,
    # sizes (out is [E_l, m_dim, n_dim] in num_tiles tiles), strides
    num_tiles, m_dim, n_dim, stride_out_e,
    # meta
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
):
    a_bufs, b_bufs, ready, empty, turn = _allocate_ring(a_desc, b_desc, STAGES)
    gl.warp_specialize([
        (_wgrad_consumer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, turn, out_ptr, expert_offsets_ptr, num_tiles,
                           m_dim, n_dim, stride_out_e, 0, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
        (_wgrad_consumer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, turn, out_ptr, expert_offsets_ptr, num_tiles,
                           m_dim, n_dim, stride_out_e, 1, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
        (_wgrad_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, turn, out_ptr, expert_offsets_ptr, num_tiles,
                           m_dim, n_dim, stride_out_e, 0, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
    ], [4, 1], [_CONSUMER_REGISTERS, _PRODUCER_REGISTERS])


# --------------------------------------------------------------------------- launchers


def _shared_layout(block_shape) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), gl.bfloat16)


def _descriptor(t: torch.Tensor, block_shape):
    return tma_descriptor(t, block_shape, _shared_layout(block_shape))


def launch_down_scatter(h: torch.Tensor, w_down: torch.Tensor, y: torch.Tensor, schedule: RoutingSchedule,
                        cfg: dict) -> None:
    """y[row_source[r]] = h[r] · w_down[e]ᵀ (`grouped_gemm.down_scatter`'s bf16 local case);
    the caller has checked the operands."""
    _check_device(h.device)
    _, hidden, inter = w_down.shape
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    _down_scatter_ws_kernel[(num_sms(h.device),)](
        _descriptor(h, (block_m, block_k)), _descriptor(w_down, (block_n, block_k)), y,
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        hidden, inter, y.stride(0),
        block_m, block_n, block_k, cfg["num_stages"], num_warps=4,
    )


def launch_down_wgrad(dy_sorted: torch.Tensor, h: torch.Tensor, out: torch.Tensor, schedule: RoutingSchedule,
                      cfg: dict) -> None:
    """out[e] = Σ_r dy_sorted[r]ᵀ · h[r] (`wgrad.down_wgrad`'s bf16 case without main_grad);
    the caller has checked the operands and out (a new contiguous bf16 [E_l, H, I])."""
    _check_device(h.device)
    experts, m_dim, n_dim = out.shape
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    num_tiles = experts * triton.cdiv(m_dim, block_m) * triton.cdiv(n_dim, block_n)
    _down_wgrad_ws_kernel[(min(num_tiles, num_sms(h.device)),)](
        _descriptor(dy_sorted, (block_k, block_m)), _descriptor(h, (block_k, block_n)), out,
        schedule.expert_offsets,
        num_tiles, m_dim, n_dim, out.stride(0),
        block_m, block_n, block_k, cfg["num_stages"], num_warps=4,
    )
