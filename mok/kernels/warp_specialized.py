"""Warp-specialized grouped GEMMs over the sorted layout, for Hopper, in Gluon.

    down:          y[src(r)] = h[r] · Wd[e]ᵀ                      (unweighted, bf16; `grouped_gemm.py`)
    down wgrad:    d_w_down[e] = Σ_{r of e} dy_sorted[r]ᵀ · h[r]  (fp32 sum, stored bf16; `wgrad.py`)
    gate/up wgrad: d_w_gate[e] = Σ_{r of e} d_g[r]ᵀ · x_sorted[r], d_w_up[e] likewise with d_u
    gate/up dgrad: dx[src(r)] = d_g[r] · Wg[e] + d_u[r] · Wu[e]      (two K segments; `dgrad.py`)
    fp8_block wgrads: both wgrads over e4m3 operands quantized in 128-row blocks, each step's
                   product scaled by its block's row and column scales (`wgrad.py`'s fp8_block)
    fp8_block down and gate/up dgrad: the scatter GEMMs over e4m3 rows quantized in 1×128 blocks
                   and the weights' 128×128 blocks (`grouped_gemm.py`'s and `dgrad.py`'s fp8_block)
    fp8_block gate/up: h[r] = SwiGLU(x[src(r) // topk] · Wg[e]ᵀ, x[…] · Wu[e]ᵀ), quantized in 1×128
                   blocks (`grouped_gemm.gate_up_swiglu_fp8_block`); x's e4m3 token rows gathered
                   by the producer (cp.async: Hopper's TMA cannot gather), h_q, g, u stored by TMA
    fp8_block down dgrad's product: a[r] = dOut[src(r) // topk] · Wd[e] in bf16 (or fp32), stored at
                   the sorted row r (the gate/up's kernel, dOut's token rows gathered, bf16 stored by
                   TMA; over its sorted rows, the scatter kernel without the scatter); `dgrad.py`
                   runs the SwiGLU backward on it

Legend: r a row of the expert-sorted layout of `schedule.py`, src(r) = row_source[r]
(−1: padding), e = tile_expert[r // BLOCK_M], H hidden, I intermediate size, E_l local experts.

Why: the Triton kernels of `grouped_gemm.py`, `dgrad.py` and `wgrad.py` run one warp group's MMAs, its
epilogue (layout change, bf16 conversion, scattered stores) and the next tile's pipeline
fill one after the other, and their loads are issued by the same warps that multiply. Here
each program (one per SM) splits into three partitions over one ring of STAGES shared-memory
slots: a producer warp issues the TMA loads of every tile of the program, in tile order, and
runs ahead across tile boundaries; two consumer warp groups multiply. Two schedules (the
tile-config flag COOPERATIVE):

- ping-pong: the consumers take the program's tiles in turns (0, 2, 4… and 1, 3, 5…), each
  with a 128×128 accumulator, so one's epilogue runs while the other's MMAs do. It wins
  where the K loop is short and the epilogue weighs (qwen3-30b's I = 768);
- cooperative: both consumers work on every 128×256 tile, consumer c on its rows
  [64c, 64c + 64) (one wgmma m64n256 per K step, as the Triton kernel's two warp groups),
  so each stage's B tile serves 128 rows. At large K, where 128×128 tiles lose to 128×256's
  operand reuse, this keeps the reuse and adds the producer running ahead. For the gate/up
  wgrad, consumer 0 computes d_w_gate's 64 rows and consumer 1 d_w_up's, sharing the x tile.
  fp8_block runs it on 128×256 tiles too, each consumer's 64×256 as two 128-column halves
  (`_scaled_mma_steps`: each half's product scaled into its accumulator before the next MMA).

Every kernel walks its tiles GROUP_M row tiles per column sweep (tile-config key GROUP_M;
without it 1, each row tile's columns in turn; the wgrads within each expert), as the Triton
kernels' `tile_coordinates`: where the column operand is wide and there are many row tiles
(mixtral-8x7b's I = 14336), 1 streams the whole column operand (an expert's weight, or h[e]
for the down wgrad) through L2 for every few row tiles.

Ring protocol (mbarriers): `ready[s]` completes when slot s's loads land, `empty[s]` when
its consumers' MMAs have read it (one arrival, or two cooperative); the program's step counter
gives slot and phase (slot = step % STAGES, phase = step // STAGES). A wait on a phase
parity cannot tell a phase from the one two before it, so a consumer must never wait on a
slot two fills ahead. Cooperative consumers walk every step, and the producer refills a slot
only after both released it, so no wait can run ahead. Ping-pong: `turn[c]` makes consumer c
start its tile's waits only after the other consumer has passed all of its own (it arrives
on `turn[1 − c]` after its last `ready` wait), which keeps every wait within one phase.

Each tile's K loop is the Triton kernel's (the same BLOCK_K steps in the same order, fp32
accumulation in one wgmma chain), so the result is bitwise the Triton kernel's (tested on
the GPU); fixed order, no atomics: deterministic. Gluon has no interpreter: the CPU tests
compile these kernels for sm_90a and check ptxas's register and spill counts, and the
Triton kernels stay the reference path (and the only one under `TRITON_INTERPRET=1`, on
GPUs other than Hopper, under expert parallelism and with main_grad).

Caller contract: as for the Triton kernels (`grouped_gemm.down_scatter`, `wgrad.down_wgrad`,
`wgrad.gate_up_wgrad`, `dgrad.gate_up_dgrad_scatter`, and their `*_fp8_block`, and
`grouped_gemm.gate_up_swiglu_fp8_block`); bf16, and fp8_block for the wgrads, the scatter
GEMMs and the forward's gate/up (cooperative only); BLOCK_M is the schedule's
block_m. Worker partitions of one `warp_specialize` share one signature (Gluon's rule), so
each kernel's producer takes its consumers' arguments.
"""

from __future__ import annotations

import functools

import torch
import triton

from mok.fp8_block import FP8_BLOCK
from mok.kernels.common import (
    expert_tile_coordinates,
    gate_up_parts,
    interpreting,
    num_sms,
    round_to_bf16,
    tile_coordinates,
    tma_descriptor,
)
from mok.kernels.routing.gather import sorted_row_routes
from mok.kernels import gluon_api
from mok.kernels.gluon_api import (
    async_copy,
    cp_async_load,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    tma_load,
    tma_store,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from mok.kernels.plan import kernel_plan
from mok.kernels.quant.fp8_block import quantize_row_blocks
from mok.kernels.routing.schedule import RoutingSchedule
from mok.kernels.swiglu import fast_sigmoid_here, swiglu_forward

# Tiles and TMA-store flags are the kernel plan's (`plan.KernelPlan`: `ping_pong_tile`,
# `cooperative_tile`, `fp8_block_warp_specialized_tile`, `*_tma_store`, with their reasons and records).
# Registers per thread of the consumer warp groups and of the producer warp (setmaxnreg);
# the default partition (consumer 0) gets what is left of the launch's 168 × 384 threads.
_CONSUMER_REGISTERS = gl.constexpr(232)
_PRODUCER_REGISTERS = gl.constexpr(40)
# The fp8_block gate/up's producer: a warp group, whose threads gather x's rows into the A
# tiles by cp.async, 16 bytes each (a 64×128 e4m3 half tile: four per thread).
_GATHER_THREADS = gl.constexpr(128)
# A warp group's [rows, 128] byte tile as rows of 16-byte runs (a row's 128 bytes over 8 lanes):
# the gathered A tiles' copies and the stores of h's e4m3 bytes.
_BYTE_ROWS_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def warp_specialized_available(device: torch.device) -> bool:
    """These kernels need Hopper's wgmma and TMA, a real GPU (no interpreter) and a Triton
    whose Gluon builds them (`gluon_api.usable`; else the Triton GEMMs run)."""
    if device.type != "cuda" or interpreting():
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return _hopper(index) and gluon_api.usable(device, "the warp-specialized Hopper GEMMs", hopper_kernels=True)


def available_here() -> bool:
    """`warp_specialized_available` for the current CUDA device (False without one)."""
    return torch.cuda.is_available() and warp_specialized_available(torch.device("cuda"))


def tile_config(cooperative: bool) -> dict:
    """The tile config that selects these kernels (flag WARP_SPECIALIZED) with either schedule."""
    plan = kernel_plan()
    return dict(plan.cooperative_tile if cooperative else plan.ping_pong_tile, WARP_SPECIALIZED=True,
                COOPERATIVE=cooperative)


def wgrad_tile_config(cooperative: bool) -> dict:
    """`tile_config` for the bf16 wgrads: cooperative with the plan's `bf16_wgrad_tma_store`, 3 stages,
    which leave room for the store buffers (4 measured the same within 3%: `cooperative_tile`)."""
    cfg = tile_config(cooperative)
    if cooperative and kernel_plan().bf16_wgrad_tma_store:
        cfg["num_stages"] = 3
    return cfg


def fp8_block_tile_config(stacked: bool = False) -> dict:
    """The tile config that selects the fp8_block GEMMs here (cooperative), `stacked` for the
    gate/up wgrad (its A operand the stacked [d_g | d_u]ᵀ)."""
    return dict(kernel_plan().fp8_block_warp_specialized_tile, WARP_SPECIALIZED=True, COOPERATIVE=True, STACKED=stacked)


def _check_device(device: torch.device) -> None:
    """A tile config with WARP_SPECIALIZED can run on this device."""
    if not warp_specialized_available(device):
        raise ValueError(
            f"tile_config: WARP_SPECIALIZED needs a Hopper GPU (compute capability 9.x) outside the interpreter, "
            f"got device {device}" + (" under TRITON_INTERPRET=1" if interpreting() else "")
        )


# --------------------------------------------------------------------------- ring helpers


@gluon.jit
def _claim_slot(step, ready, empty, nbytes, STAGES: gl.constexpr):
    """Producer: wait until the slot of `step` is free, then arm its `ready` barrier for the
    `nbytes` the caller's TMA loads into it will bring. Returns (slot, ready barrier)."""
    slot = step % STAGES
    mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
    bar = ready.index(slot)
    mbarrier.expect(bar, nbytes)
    return slot, bar


@gluon.jit
def _load_step(step, a_desc, a_coords, a2_desc, a2_coords, b_desc, b_coords, a_bufs, b_bufs, ready, empty,
               extra_bytes, COOPERATIVE: gl.constexpr, STAGES: gl.constexpr):
    """Producer: claim the slot of `step`, then TMA-load its tiles: A and B, or, cooperative,
    consumer 0's A (a_desc), consumer 1's A (a2_desc) and the shared B. The slot's `ready`
    also waits for `extra_bytes` more, which the caller loads into it after this.
    Returns (slot, its ready barrier)."""
    A_TILES: gl.constexpr = 2 if COOPERATIVE else 1
    slot, bar = _claim_slot(step, ready, empty,
                            A_TILES * a_desc.block_type.nbytes + b_desc.block_type.nbytes + extra_bytes, STAGES)
    if COOPERATIVE:
        tma_load(a_desc, a_coords, bar, a_bufs.index(2 * slot))
        tma_load(a2_desc, a2_coords, bar, a_bufs.index(2 * slot + 1))
    else:
        tma_load(a_desc, a_coords, bar, a_bufs.index(slot))
    tma_load(b_desc, b_coords, bar, b_bufs.index(slot))
    return slot, bar


@gluon.jit
def _mma_steps(acc, first_step, steps, tile_count, a_bufs, b_bufs, ready, empty, turn, CONSUMER: gl.constexpr,
               A_K_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr, COOPERATIVE: gl.constexpr, STAGES: gl.constexpr):
    """Consumer: acc += Σ over the ring steps [first_step, first_step + steps) of A·B, one
    wgmma in flight; each slot is released once the next wgmma has retired its reader.
    A tiles are [M, K] (A_K_MAJOR) or [K, M] in shared memory, B tiles [N, K] (B_K_MAJOR) or
    [K, N]. Ping-pong: `tile_count`, this program's tiles so far (both consumers'), for `turn`."""
    if not COOPERATIVE:
        mbarrier.wait(turn.index(CONSUMER), ((tile_count // 2) & 1) ^ (1 - CONSUMER))
    for k in range(steps):
        step = first_step + k
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        if COOPERATIVE:
            a = a_bufs.index(2 * slot + CONSUMER)
        else:
            a = a_bufs.index(slot)
        if not A_K_MAJOR:
            a = a.permute((1, 0))
        b = b_bufs.index(slot)
        if B_K_MAJOR:
            b = b.permute((1, 0))
        acc = warpgroup_mma(a, b, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if k > 0:
            mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
    if not COOPERATIVE:
        mbarrier.arrive(turn.index(1 - CONSUMER), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if steps > 0:
        mbarrier.arrive(empty.index((first_step + steps - 1) % STAGES), count=1)
    return acc


@gluon.jit
def _block_scales(a_scale_ptr, b_scale_ptr, b_hi_scale_ptr, hi_valid, scale_strides, block, valid, scale_rows,
                  rows_valid, PER_COLUMN: gl.constexpr, SPLIT_N: gl.constexpr):
    """Scales of the K block `block` (zeros unless `valid`), `scale_strides` = (sa_block, sa_row,
    sb_block): the accumulator's row i's at a_scale_ptr + block · sa_block + scale_rows[i] · sa_row
    (zero where not rows_valid[i]), loaded in the layout of `scale_rows` (the accumulator's rows:
    two per thread); unless PER_COLUMN (those ride in the ring:
    `_ring_column_scales`), the one weight-block scale of the accumulator's columns at b_scale_ptr +
    block · sb_block, and with SPLIT_N acc_hi's at b_hi_scale_ptr + block · sb_block (zero unless
    `hi_valid`; else the first again). Returns (row scales, acc's column scale, acc_hi's)."""
    sa_block, sa_row, sb_block = scale_strides
    # block · stride stays below the scale tensor's size: int32 holds it
    a_scale = gl.load(a_scale_ptr + scale_rows.to(gl.int64) * sa_row + block * sa_block, mask=valid & rows_valid,
                      other=0.0)
    if PER_COLUMN:
        b_scale = a_scale  # unread
        b_scale_hi = a_scale
    else:
        b_scale = gl.load(b_scale_ptr + block * sb_block, mask=valid, other=0.0)
        if SPLIT_N:
            b_scale_hi = gl.load(b_hi_scale_ptr + block * sb_block, mask=valid & hi_valid, other=0.0)
        else:
            b_scale_hi = b_scale
    return a_scale, b_scale, b_scale_hi


@gluon.jit
def _ring_column_scales(b_scale_bufs, slot, first_column, COLUMNS: gl.constexpr, layout: gl.constexpr):
    """[1, COLUMNS] scales of the B tile's columns from first_column on, in `layout` (the
    accumulator's), from the ring slot the producer loaded them into with the tiles (TMA:
    columns past the operand read as zeros)."""
    return b_scale_bufs.index(slot).slice(first_column, COLUMNS, dim=1).load(layout)


@gluon.jit
def _add_scaled(acc, product, a_scale, b_scale, PER_COLUMN: gl.constexpr):
    """acc + product · (sa[m] · sb) with one weight-block scale sb (`grouped_gemm.sorted_rows_tile`'s
    arithmetic), or with PER_COLUMN scales acc + (product · sa[m]) · sb[n] (`wgrad._wgrad_tile`'s):
    a_scale [rows] in the accumulator's row layout, b_scale a scalar or [1, columns] in the
    accumulator's layout. Per column, the rows' products need only registers, so they run while the
    column scales' shared-memory loads are in flight; sa[m] · sb[n] first made each product wait on a
    load; faster in every round at the power cap (log h200-20261204-wgrad-row-scales-first.log,
    record h200-20261204-ab-wgrad-row-scales-first.json)."""
    if PER_COLUMN:
        return acc + (product * a_scale[:, None]) * b_scale
    return acc + product * (a_scale[:, None] * b_scale)


@gluon.jit
def _scaled_mma_steps(acc, acc_hi, first_step, steps, first_block, a_bufs, b_bufs, ready, empty, a_scale_ptr,
                      b_scales, b_hi_scales, hi_valid, scale_strides, scale_rows, rows_valid, CONSUMER: gl.constexpr,
                      PER_COLUMN: gl.constexpr, A_COPIED: gl.constexpr, STAGES: gl.constexpr):
    """Consumer, cooperative, fp8_block: acc += Σ over the ring steps [first_step, first_step +
    steps) of (A·B) · sa[m] · sb[n], each step's FP8 product fresh in fp32 and then scaled by
    the scales of its K block (`first_block + k`; the rows' at `scale_rows`, where `rows_valid`:
    `_accumulator_rows`), in step order, as the Triton kernels do (`wgrad._wgrad_tile`,
    `grouped_gemm.sorted_rows_tile`). A tiles [rows, K], B tiles [N, K]: FP8 wgmma reads both
    K-major. The row scales and the weight blocks' scales (`b_scales`, `b_hi_scales`, `hi_valid`:
    `_block_scales`) are loaded a step ahead; per-column scales (PER_COLUMN, the wgrads:
    `b_scales` the ring's column-scale slots) come with the step's tiles. The product is waited
    for before it is scaled (ptxas serializes every wgmma of a loop that reads one product while
    the next MMA runs: C7514), so the scaling overlaps only the other consumer's MMAs. A B tile
    twice the accumulator's width (SPLIT_N) is multiplied a half at a time, its first half into
    acc and its second into acc_hi, so that only one product is in registers at a time; each
    stage's A tile then serves twice the columns. A_COPIED: the producer's threads wrote the A
    tiles (`_copy_gathered_rows`), so a proxy fence orders their writes before the wgmma's reads.
    Returns (acc, acc_hi)."""
    HALF_N: gl.constexpr = acc.shape[1]
    SPLIT_N: gl.constexpr = b_bufs.shape[1] > HALF_N
    layout: gl.constexpr = acc.type.layout
    scales = _block_scales(a_scale_ptr, b_scales, b_hi_scales, hi_valid, scale_strides, first_block, steps > 0,
                           scale_rows, rows_valid, PER_COLUMN, SPLIT_N)
    # Each MMA writes its product over the registers of the previous one (wgmma's accumulator
    # is read and written in place), which is dead by then: given acc or acc_hi there, a copy of
    # them would have to stay live beside it.
    product = gl.zeros_like(acc)
    for k in range(steps):
        step = first_step + k
        slot = step % STAGES
        next_scales = _block_scales(a_scale_ptr, b_scales, b_hi_scales, hi_valid, scale_strides, first_block + k + 1,
                                    k + 1 < steps, scale_rows, rows_valid, PER_COLUMN, SPLIT_N)
        a_scale, b_scale, b_scale_hi = scales
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        if A_COPIED:
            fence_async_shared()
        a = a_bufs.index(2 * slot + CONSUMER)
        b = b_bufs.index(slot)
        product = warpgroup_mma(a, b.slice(0, HALF_N).permute((1, 0)), product, use_acc=False, is_async=True)
        product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
        if PER_COLUMN:
            b_scale = _ring_column_scales(b_scales, slot, 0, HALF_N, layout)
        if SPLIT_N:
            acc = _add_scaled(acc, product, a_scale, b_scale, PER_COLUMN)
            # A wait on nothing that takes acc: its scaling stays before the next MMA's issue, so
            # that the compiler does not keep this product live beside the next one.
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            product = warpgroup_mma(a, b.slice(HALF_N, HALF_N).permute((1, 0)), product, use_acc=False,
                                    is_async=True)
            product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
            if PER_COLUMN:
                b_scale_hi = _ring_column_scales(b_scales, slot, HALF_N, HALF_N, layout)
            mbarrier.arrive(empty.index(slot), count=1)
            acc_hi = _add_scaled(acc_hi, product, a_scale, b_scale_hi, PER_COLUMN)
        else:
            mbarrier.arrive(empty.index(slot), count=1)
            acc = _add_scaled(acc, product, a_scale, b_scale, PER_COLUMN)
        scales = next_scales
    return acc, acc_hi


@gluon.constexpr_function
def _fp8_shared_layout(block_shape):
    """The wgmma operand layout of an e4m3 tile in shared memory (as its TMA descriptor's)."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), gl.float8e4nv)


@gluon.jit
def _accumulator_rows(first_row, m_dim, ROWS: gl.constexpr, layout: gl.constexpr):
    """(rows [first_row, first_row + ROWS) in the row layout of an accumulator of `layout`,
    which of them are below m_dim): `_scaled_mma_steps`' scale rows of A's own rows."""
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    return rows, rows < m_dim


@gluon.constexpr_function
def _mma_layout(block_n, fp8=False):
    """The wgmma accumulator layout of one warp group's [rows, block_n] tile (rows: 64 or 128);
    an instruction's K is 32 bytes of operand: 16 bf16 or 32 FP8 values."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 32 if fp8 else 16])


@gluon.constexpr_function
def _mma_n(block_n, fp8):
    """Columns of one consumer's accumulator: the tile's, or for fp8_block at most 128 (its
    accumulator and a step's fresh product would not both fit at 64×256; `_scaled_mma_steps`
    splits a wider tile in two accumulators)."""
    return min(block_n, 128) if fp8 else block_n


# Row-major layout of the epilogue's stores: 8 consecutive columns (16 bytes of bf16) per thread.
_STORE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


@gluon.jit
def _allocate_ring(a_desc, b_desc, COOPERATIVE: gl.constexpr, STAGES: gl.constexpr, B_TILES: gl.constexpr):
    """STAGES slots of A (two per slot, cooperative) and B tiles (B_TILES of b_desc's boxes
    stacked along the rows) and the ring's barriers (ready, empty, turn)."""
    A_TILES: gl.constexpr = 2 * STAGES if COOPERATIVE else STAGES
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [A_TILES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = _allocate_b_tiles(b_desc, STAGES, B_TILES)
    ready, empty, turn = _allocate_barriers(2 if COOPERATIVE else 1, 0, STAGES)
    return a_bufs, b_bufs, ready, empty, turn


@gluon.jit
def _allocate_b_tiles(b_desc, STAGES: gl.constexpr, B_TILES: gl.constexpr):
    B_ROWS: gl.constexpr = B_TILES * b_desc.block_type.shape[0]
    return gl.allocate_shared_memory(b_desc.dtype, [STAGES, B_ROWS, b_desc.block_type.shape[1]], b_desc.layout)


@gluon.jit
def _allocate_barriers(READERS: gl.constexpr, COPIERS: gl.constexpr, STAGES: gl.constexpr):
    """The ring's barriers (ready, empty, turn): READERS consumers release each slot; `ready`
    completes on the producer's TMA bytes and, with COPIERS, once each of its COPIERS threads'
    cp.async copies into the slot have landed (`_copy_gathered_rows`)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1 + COPIERS)
        mbarrier.init(empty.index(s), count=READERS)
    for c in gl.static_range(2):
        mbarrier.init(turn.index(c), count=1)
    fence_async_shared()
    return ready, empty, turn


@gluon.constexpr_function
def _consumer_rows(block_m, cooperative):
    """Rows of one consumer's accumulator: half the tile's (cooperative) or all of them."""
    return block_m // 2 if cooperative else block_m


@gluon.constexpr_function
def _takes_turns(cooperative):
    """2: the consumers take tiles in turns (ping-pong); 1: both take every tile."""
    return 1 if cooperative else 2


# --------------------------------------------------------------------------- scatter GEMMs


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
def _scatter_producer(a_desc, a2_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, a_scale_ptr,
                      a2_scale_ptr, b_scale_ptr, b2_scale_ptr, row_source_ptr, tile_expert_ptr, num_rows_ptr, m_dim,
                      n_dim, reduce_dim, stride_y, stride_a_scale, y_desc, out_bufs, CONSUMER: gl.constexpr,
                      SCATTER: gl.constexpr, TMA_STORE: gl.constexpr, TWO_SEGMENTS: gl.constexpr,
                      B_K_MAJOR: gl.constexpr, COOPERATIVE: gl.constexpr, FP8: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    num_m_tiles = gl.cdiv(gl.load(num_rows_ptr), BLOCK_M)
    num_n_tiles = gl.cdiv(n_dim, BLOCK_N)
    step = 0
    for tile in range(gl.program_id(0), num_m_tiles * num_n_tiles, gl.num_programs(0)):
        m_tile, n_tile = tile_coordinates(tile, num_m_tiles, num_n_tiles, GROUP_M)
        m0, n0 = m_tile * BLOCK_M, n_tile * BLOCK_N
        expert = gl.load(tile_expert_ptr + m_tile)
        step = _load_segment(step, a_desc, b_desc, m0, expert, n0, n_dim, reduce_dim, a_bufs, b_bufs, ready, empty,
                             B_K_MAJOR, COOPERATIVE, BLOCK_M, BLOCK_K, STAGES)
        if TWO_SEGMENTS:
            step = _load_segment(step, a2_desc, b2_desc, m0, expert, n0, n_dim, reduce_dim, a_bufs, b_bufs, ready,
                                 empty, B_K_MAJOR, COOPERATIVE, BLOCK_M, BLOCK_K, STAGES)


@gluon.jit
def _scatter_consumer(a_desc, a2_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, a_scale_ptr,
                      a2_scale_ptr, b_scale_ptr, b2_scale_ptr, row_source_ptr, tile_expert_ptr, num_rows_ptr, m_dim,
                      n_dim, reduce_dim, stride_y, stride_a_scale, y_desc, out_bufs, CONSUMER: gl.constexpr,
                      SCATTER: gl.constexpr, TMA_STORE: gl.constexpr, TWO_SEGMENTS: gl.constexpr,
                      B_K_MAJOR: gl.constexpr, COOPERATIVE: gl.constexpr, FP8: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = _consumer_rows(BLOCK_M, COOPERATIVE)
    TURNS: gl.constexpr = _takes_turns(COOPERATIVE)
    MMA_N: gl.constexpr = _mma_n(BLOCK_N, FP8)
    mma_layout: gl.constexpr = _mma_layout(MMA_N, FP8)
    num_m_tiles = gl.cdiv(gl.load(num_rows_ptr), BLOCK_M)
    num_n_tiles = gl.cdiv(n_dim, BLOCK_N)
    k_blocks = gl.cdiv(reduce_dim, BLOCK_K)
    k_steps = k_blocks * (2 if TWO_SEGMENTS else 1)
    tile_count = 0
    for tile in range(gl.program_id(0), num_m_tiles * num_n_tiles, gl.num_programs(0)):
        if tile_count % TURNS == CONSUMER % TURNS:
            m_tile, n_tile = tile_coordinates(tile, num_m_tiles, num_n_tiles, GROUP_M)
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
                acc, acc_hi = _scaled_mma_steps(acc, acc_hi, tile_count * k_steps, k_blocks, 0, a_bufs, b_bufs, ready,
                                                empty, a_scale_ptr, b_scale_ptr + weight_scales,
                                                b_scale_ptr + weight_scales + k_blocks, hi_valid, strides, rows,
                                                rows_valid, CONSUMER, False, False, STAGES)
                if TWO_SEGMENTS:
                    acc, acc_hi = _scaled_mma_steps(acc, acc_hi, tile_count * k_steps + k_blocks, k_blocks, 0, a_bufs,
                                                    b_bufs, ready, empty, a2_scale_ptr, b2_scale_ptr + weight_scales,
                                                    b2_scale_ptr + weight_scales + k_blocks, hi_valid, strides, rows,
                                                    rows_valid, CONSUMER, False, False, STAGES)
            else:
                acc = _mma_steps(acc, tile_count * k_steps, k_steps, tile_count, a_bufs, b_bufs, ready, empty, turn,
                                 CONSUMER, True, B_K_MAJOR, COOPERATIVE, STAGES)
            if TMA_STORE:  # columns past n_dim clipped by TMA
                tma.store_wait(0)  # the last tile's stores have read this consumer's buffers
                _store_tile_async(acc.to(y_desc.dtype), out_bufs.index(2 * CONSUMER), y_desc, first_row, n0)
                if MMA_N < BLOCK_N:
                    _store_tile_async(acc_hi.to(y_desc.dtype), out_bufs.index(2 * CONSUMER + 1), y_desc, first_row,
                                      n0 + MMA_N)
            else:
                _scatter_store(acc, y_ptr, row_source_ptr, first_row, n0, m_dim, n_dim, stride_y, SCATTER)
                if MMA_N < BLOCK_N:
                    _scatter_store(acc_hi, y_ptr, row_source_ptr, first_row, n0 + MMA_N, m_dim, n_dim, stride_y,
                                   SCATTER)
        tile_count += 1
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _scatter_store(acc, y_ptr, row_source_ptr, first_row, n0, m_dim, n_dim, stride_y, SCATTER: gl.constexpr):
    """y[row_source[r], n0 : n0 + acc's columns] = acc's rows r from first_row on (padding rows
    not stored), or without SCATTER y[r, …] for r below m_dim; in y's dtype."""
    ROWS: gl.constexpr = acc.shape[0]
    COLUMNS: gl.constexpr = acc.shape[1]
    y = gl.convert_layout(acc.to(y_ptr.dtype.element_ty), _STORE_LAYOUT)
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, _STORE_LAYOUT))
    cols = n0 + gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, _STORE_LAYOUT))
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
                             STAGES)),
        (_scatter_consumer, (a_desc, a2_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, a_scale_ptr,
                             a2_scale_ptr, b_scale_ptr, b2_scale_ptr, row_source_ptr, tile_expert_ptr, num_rows_ptr,
                             m_dim, n_dim, reduce_dim, stride_y, stride_a_scale, y_desc, out_bufs, 1, SCATTER,
                             TMA_STORE, TWO_SEGMENTS, B_K_MAJOR, COOPERATIVE, FP8, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                             STAGES)),
        (_scatter_producer, (a_desc, a2_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, turn, y_ptr, a_scale_ptr,
                             a2_scale_ptr, b_scale_ptr, b2_scale_ptr, row_source_ptr, tile_expert_ptr, num_rows_ptr,
                             m_dim, n_dim, reduce_dim, stride_y, stride_a_scale, y_desc, out_bufs, 0, SCATTER,
                             TMA_STORE, TWO_SEGMENTS, B_K_MAJOR, COOPERATIVE, FP8, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                             STAGES)),
    ], [4, 1], [_CONSUMER_REGISTERS, _PRODUCER_REGISTERS])


# --------------------------------------------------------------------------- fp8_block, token rows gathered


@gluon.jit
def _gathered_rows(row_source_ptr, num_rows, first_row, topk, ROWS: gl.constexpr, layout: gl.constexpr):
    """(token of each sorted row [first_row, first_row + ROWS), whether it has one) in the row
    layout of `layout`: padding rows and rows past num_rows have none."""
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    _, tokens, valid = sorted_row_routes(rows, rows < num_rows, row_source_ptr, topk)
    return tokens, valid


@gluon.jit
def _gathered_row_offsets(row_source_ptr, num_rows, first_row, topk, hidden, ROWS: gl.constexpr):
    """Producer: (byte offsets of x's token rows [T, H] e4m3 for the sorted rows [first_row,
    first_row + ROWS), whether each has one), in `_BYTE_ROWS_LAYOUT`'s rows, for `_copy_gathered_rows`."""
    tokens, valid = _gathered_rows(row_source_ptr, num_rows, first_row, topk, ROWS, _BYTE_ROWS_LAYOUT)
    return gl.multiple_of(tokens.to(gl.int64) * hidden, 128), valid  # H: a multiple of 128 in fp8_block


@gluon.jit
def _copy_gathered_rows(x_ptr, row_offsets, rows_valid, k0, buf, BLOCK_K: gl.constexpr):
    """Producer: cp.async x's bytes [k0, k0 + BLOCK_K) of the rows at `row_offsets` (zeros where
    not rows_valid) into the A tile `buf`. Hopper's TMA cannot gather rows."""
    cols = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, _BYTE_ROWS_LAYOUT))
    # 16-byte copies: the row offsets and k0 are multiples of 128 (H is, in fp8_block)
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
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr):
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
        m0 = m_tile * BLOCK_M
        w_row = gl.load(tile_expert_ptr + m_tile) * inter + n_tile * TILE_N  # weights read as [E_l·I, H]
        # PRODUCT: past I (the last tile of an odd I / 128) the second half reads the next expert's
        # rows, or zeros past the last: its columns are not stored
        w_hi_row = w_row + HALF_N if PRODUCT else w_row
        offsets, valid = _gathered_row_offsets(row_source_ptr, num_rows, m0, topk, hidden, ROWS)
        offsets_2, valid_2 = _gathered_row_offsets(row_source_ptr, num_rows, m0 + ROWS, topk, hidden, ROWS)
        for k0 in range(0, hidden, BLOCK_K):
            slot, bar = _claim_slot(step, ready, empty, 2 * w_gate_desc.block_type.nbytes, STAGES)
            _copy_gathered_rows(x_ptr, offsets, valid, k0, a_bufs.index(2 * slot), BLOCK_K)
            _copy_gathered_rows(x_ptr, offsets_2, valid_2, k0, a_bufs.index(2 * slot + 1), BLOCK_K)
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
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr):
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
        first_row = m_tile * BLOCK_M + CONSUMER * ROWS
        # the weights' scales [E_l, I/128, H/128]: the block row of columns [n0, n0 + 128), n0 the
        # first column of the accumulator; PRODUCT: acc_hi's the next one, if I has it
        n_block = n_tile * HALVES
        weight_scales = (gl.load(tile_expert_ptr + m_tile).to(gl.int64) * n_blocks + n_block) * k_blocks
        hi_scales = weight_scales + k_blocks if PRODUCT else weight_scales
        hi_valid = n_block + 1 < n_blocks if PRODUCT else True
        tokens, valid = _gathered_rows(row_source_ptr, num_rows, first_row, topk, ROWS, mma_layout)
        gate = gl.zeros((ROWS, HALF_N), gl.float32, mma_layout)
        gate, up = _scaled_mma_steps(gate, gate, tile_count * k_blocks, k_blocks, 0, a_bufs, b_bufs, ready, empty,
                                     x_scale_ptr, w_gate_scale_ptr + weight_scales, w_up_scale_ptr + hi_scales,
                                     hi_valid, (1, k_blocks, 1), tokens, valid, CONSUMER, False, True, STAGES)
        if TMA_STORE:
            tma.store_wait(0)  # the last tile's stores have read this consumer's buffers
        if PRODUCT:  # h_ptr: the product [capacity_rows, I], fp32 or bf16
            n0 = n_block * HALF_N
            if TMA_STORE:  # columns past I clipped by TMA
                _store_tile_async(gate.to(h_desc.dtype), out_bufs.index(2 * CONSUMER), h_desc, first_row, n0)
                _store_tile_async(up.to(h_desc.dtype), out_bufs.index(2 * CONSUMER + 1), h_desc, first_row,
                                  n0 + HALF_N)
            else:
                _scatter_store(gate, h_ptr, row_source_ptr, first_row, n0, num_rows, inter, inter, False)
                _scatter_store(up, h_ptr, row_source_ptr, first_row, n0 + HALF_N, num_rows, inter, inter, False)
        else:
            _gate_up_epilogue(gate, up, h_ptr, h_scale_ptr, gate_up_ptr, gate_up_scale_ptr, first_row, n_tile, inter,
                              swiglu_limit, h_desc, gate_up_desc, out_bufs, h_bufs, CONSUMER, HAS_LIMIT, FAST_SIGMOID,
                              STORE_GATE_UP, GATE_UP_E4M3, TMA_STORE)
        tile_count += 1
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _gate_up_epilogue(gate, up, h_ptr, h_scale_ptr, gate_up_ptr, gate_up_scale_ptr, first_row, n_tile, inter,
                      swiglu_limit, h_desc, gate_up_desc, out_bufs, h_bufs, CONSUMER: gl.constexpr,
                      HAS_LIMIT: gl.constexpr, FAST_SIGMOID: gl.constexpr, STORE_GATE_UP: gl.constexpr,
                      GATE_UP_E4M3: gl.constexpr, TMA_STORE: gl.constexpr):
    """`grouped_gemm._gate_up_swiglu_kernel`'s fp8_block epilogue on the consumer's rows from
    first_row and columns [n0, n0 + 128), n0 = n_tile · 128: h = SwiGLU(g, u) quantized as one
    1×128 block per row (h_q [rows, I] e4m3 bytes, h_scale [rows, I/128]), and with
    STORE_GATE_UP g, u in bf16 ([rows, 2, I]), or with GATE_UP_E4M3 quantized as h is (bytes, and
    scales [rows, 2, I/128]); the same device functions, so the same bits.
    The tiles leave the accumulator's layout, where a thread holds pairs of columns, for rows of
    16-byte runs (`_store_rows`): 20 stores per thread instead of 96 of 2 and 4 bytes; or with
    TMA_STORE through this consumer's buffers (h's in `h_bufs`, g's and u's in `out_bufs`) by
    TMA stores (h_desc over h_q's e4m3, gate_up_desc over g, u as [rows, 2·I]), left in flight."""
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
        _store_rows(h_q, h_ptr, first_row, n0, inter, _BYTE_ROWS_LAYOUT)
        if STORE_GATE_UP:
            layout: gl.constexpr = _BYTE_ROWS_LAYOUT if GATE_UP_E4M3 else _STORE_LAYOUT
            _store_rows(gate, gate_up_ptr, first_row, n0, 2 * inter, layout)
            _store_rows(up, gate_up_ptr + inter, first_row, n0, 2 * inter, layout)


@gluon.jit
def _store_tile_async(tile, buf, desc, row, column):
    """desc's [row, column] box = tile, through the shared-memory buffer `buf` and a TMA store
    left in flight: the caller waits (`tma.store_wait`) before it writes `buf` again."""
    buf.store(tile)
    fence_async_shared()
    tma_store(desc, [row, column], buf)


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
    ready, empty, _ = _allocate_barriers(2, _GATHER_THREADS, STAGES)
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
                              PRODUCT, TMA_STORE, BLOCK_M, BLOCK_K, GROUP_M, STAGES)),
        (_gathered_consumer, (x_ptr, w_gate_desc, w_up_desc, a_bufs, b_bufs, ready, empty, h_ptr, h_scale_ptr,
                              gate_up_ptr, gate_up_scale_ptr, x_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr,
                              row_source_ptr, tile_expert_ptr, num_rows_ptr, topk, hidden, inter, swiglu_limit, h_desc,
                              gate_up_desc, out_bufs, h_bufs, 1, HAS_LIMIT, FAST_SIGMOID, STORE_GATE_UP, GATE_UP_E4M3,
                              PRODUCT, TMA_STORE, BLOCK_M, BLOCK_K, GROUP_M, STAGES)),
        (_gathered_producer, (x_ptr, w_gate_desc, w_up_desc, a_bufs, b_bufs, ready, empty, h_ptr, h_scale_ptr,
                              gate_up_ptr, gate_up_scale_ptr, x_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr,
                              row_source_ptr, tile_expert_ptr, num_rows_ptr, topk, hidden, inter, swiglu_limit, h_desc,
                              gate_up_desc, out_bufs, h_bufs, 0, HAS_LIMIT, FAST_SIGMOID, STORE_GATE_UP, GATE_UP_E4M3,
                              PRODUCT, TMA_STORE, BLOCK_M, BLOCK_K, GROUP_M, STAGES)),
    ], [4, _GATHER_THREADS // 32], [_CONSUMER_REGISTERS, _PRODUCER_REGISTERS])


# --------------------------------------------------------------------------- wgrads


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
                    STAGES: gl.constexpr):
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
                    STAGES: gl.constexpr):
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
                _wgrad_store(acc, out, out2_ptr, expert, first_row, n0, m_dim, n_dim, split_m, stride_out_e)
                if MMA_N < BLOCK_N:
                    _wgrad_store(acc_hi, out, out2_ptr, expert, first_row, n0 + MMA_N, m_dim, n_dim, split_m,
                                 stride_out_e)
        step += steps
        tile_count += 1
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _wgrad_store(acc, out, out2_ptr, expert, first_row, n0, m_dim, n_dim, split_m, stride_out_e):
    """out[expert] (rows below split_m) or out2[expert] (the rest, less split_m), rows from
    first_row and columns from n0 on: acc in bf16."""
    ROWS: gl.constexpr = acc.shape[0]
    COLUMNS: gl.constexpr = acc.shape[1]
    grad = gl.convert_layout(acc.to(gl.bfloat16), _STORE_LAYOUT)
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, _STORE_LAYOUT))
    cols = n0 + gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, _STORE_LAYOUT))
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
                           COOPERATIVE, TWO_OUTPUTS, FP8, TMA_STORE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
        (_wgrad_consumer, (a_desc, a2_desc, b_desc, b_scale_desc, a_bufs, b_bufs, b_scale_bufs, ready, empty, turn,
                           out_ptr, out2_ptr, out_desc, out2_desc, out_bufs, a_scale_ptr, expert_offsets_ptr,
                           expert_counts_ptr, num_tiles, m_dim, n_dim, split_m, stride_out_e, stride_a_scale, 1,
                           COOPERATIVE, TWO_OUTPUTS, FP8, TMA_STORE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
        (_wgrad_producer, (a_desc, a2_desc, b_desc, b_scale_desc, a_bufs, b_bufs, b_scale_bufs, ready, empty, turn,
                           out_ptr, out2_ptr, out_desc, out2_desc, out_bufs, a_scale_ptr, expert_offsets_ptr,
                           expert_counts_ptr, num_tiles, m_dim, n_dim, split_m, stride_out_e, stride_a_scale, 0,
                           COOPERATIVE, TWO_OUTPUTS, FP8, TMA_STORE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
    ], [4, 1], [_CONSUMER_REGISTERS, _PRODUCER_REGISTERS])


# --------------------------------------------------------------------------- launchers


_GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv, torch.float32: gl.float32}


@functools.cache
def _shared_layout(block_shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> gl.NVMMASharedLayout:
    # Cached: a layout built anew runs Gluon's constexpr machinery on the host, about 25 times per
    # fp8_block step (host time only; the benchmark's GPU time did not move: record ab-layout-cache).
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), _GLUON_DTYPES[dtype])


def _descriptor(t: torch.Tensor, block_shape):
    return tma_descriptor(t, block_shape, _shared_layout(tuple(block_shape), t.dtype))


def _check_fp8_block_tile(cfg: dict, schedule: RoutingSchedule, what: str) -> None:
    """The fp8_block kernels here: cooperative, BLOCK_K the scale block, 128-row tiles."""
    if not cfg.get("COOPERATIVE", False):
        raise ValueError(f"tile_config: the fp8_block {what} needs COOPERATIVE with WARP_SPECIALIZED")
    if cfg["BLOCK_K"] != FP8_BLOCK or schedule.block_m != FP8_BLOCK:
        raise ValueError(f"tile_config: the fp8_block {what} needs BLOCK_K {FP8_BLOCK} and a schedule of block_m "
                         f"{FP8_BLOCK}, got BLOCK_K {cfg['BLOCK_K']} and block_m {schedule.block_m}")
    if cfg["BLOCK_N"] not in (FP8_BLOCK, 2 * FP8_BLOCK):
        raise ValueError(f"tile_config: the fp8_block {what} needs BLOCK_N {FP8_BLOCK} or {2 * FP8_BLOCK} (one or two "
                         f"accumulators of {FP8_BLOCK} columns), got {cfg['BLOCK_N']}")


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
    # the wide tile only: the 128-column one's six stages leave no room for the buffers
    tma_store = (kernel_plan(y.device).sorted_tma_store and fp8 and not scatter and y.dtype == torch.bfloat16
                 and block_n == 2 * FP8_BLOCK)
    y_desc = _descriptor(y, (a_block[0], _mma_n(block_n, True))) if tma_store else a_desc  # else unread
    _scatter_ws_kernel[(num_sms(y.device),)](
        a_desc, _descriptor(a2, a_block) if two_segments else a_desc,
        b_desc, _descriptor(b2, b_block) if two_segments else b_desc, y,
        a_scale, a2_scale, b_scale, b2_scale,
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        a.shape[0], n_dim, a.shape[1], y.stride(0), a_scale.stride(0) if fp8 else 0, y_desc,
        scatter, tma_store, two_segments, b_k_major, cooperative, fp8, block_m, block_n, block_k,
        cfg.get("GROUP_M", 1), cfg["num_stages"], num_warps=4,
    )


def launch_down_scatter(h: torch.Tensor, w_down: torch.Tensor, y: torch.Tensor, schedule: RoutingSchedule,
                        cfg: dict, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                        scatter: bool = True) -> None:
    """y[row_source[r]] = h[r] · w_down[e]ᵀ (`grouped_gemm.down_scatter`'s local case); with
    `scales` (h's, w_down's) the fp8_block one (`grouped_gemm.down_scatter_fp8_block`: h, w_down
    e4m3). Without `scatter`, y[r] (the sorted layout). The caller has checked the operands."""
    _launch_scatter(h, None, w_down, None, y, schedule, cfg, True, scales, "down GEMM",  # w_down as [E_l·H, I]
                    scatter=scatter)


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


def launch_gate_up_swiglu_fp8_block(x_q: torch.Tensor, x_scale: torch.Tensor, w_gate_q: torch.Tensor,
                                    w_gate_scale: torch.Tensor, w_up_q: torch.Tensor, w_up_scale: torch.Tensor,
                                    h_q: torch.Tensor, h_scale: torch.Tensor,
                                    gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
                                    schedule: RoutingSchedule, topk: int, swiglu_limit: float | None,
                                    cfg: dict) -> None:
    """`grouped_gemm.gate_up_swiglu_fp8_block`'s kernel here: x_q, x_scale per token ([T, H]
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
    # TMA stores (the plan's `gathered_tma_store`): an fp32 product's buffers would not fit beside the ring
    tma_store = kernel_plan(out.device).gathered_tma_store and out.dtype != torch.float32
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
        cfg["BLOCK_M"], cfg["BLOCK_K"], cfg.get("GROUP_M", 1), cfg["num_stages"], num_warps=4,
    )


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
    _wgrad_ws_kernel[(min(num_tiles, num_sms(b.device)),)](
        a_desc, _descriptor(a2, a_block) if two_outputs else a_desc, b_desc,
        _descriptor(b_scale, (1, block_n)) if fp8 else b_desc,
        out, out2, out_desc, out2_desc, a_scale,
        schedule.expert_offsets, schedule.expert_counts,
        num_tiles, m_dim, n_dim, split_m, out.stride(0), a_scale.stride(0),
        cooperative, two_outputs, fp8, tma_store, block_m, block_n, block_k, cfg.get("GROUP_M", 1),
        cfg["num_stages"], num_warps=4,
    )
