"""What the warp-specialized grouped GEMMs for Hopper (Gluon) share: where they run, their tile configs,
the ring of shared-memory stages between their producer and consumers, the consumers' MMA loops (bf16,
and fp8_block with each step's product scaled), the epilogues' TMA stores and the launchers' descriptors.
Three kernels, each in its own file beside the Triton GEMMs they stand in for:

  hopper_scatter.py, the scatter GEMMs over sorted rows (their output to the route slots, or kept sorted):
    down:          y[src(r)] = h[r] · Wd[e]ᵀ                      (unweighted, bf16; `down.py`)
    gate/up dgrad: dx[src(r)] = d_g[r] · Wg[e] + d_u[r] · Wu[e]      (two K segments; `dgrad.py`)
    fp8_block down and gate/up dgrad: over e4m3 rows quantized in 1×128 blocks and the weights'
                   128×128 blocks (`down.py`'s and `dgrad.py`'s fp8_block)
  hopper_gathered.py, fp8_block over token rows the producer gathers (cp.async: Hopper's TMA cannot gather):
    fp8_block gate/up: h[r] = SwiGLU(x[src(r) // topk] · Wg[e]ᵀ, x[…] · Wu[e]ᵀ), quantized in 1×128
                   blocks (`gate_up.gate_up_swiglu_fp8_block`), h_q, g, u stored by TMA
    fp8_block down dgrad's product: a[r] = dOut[src(r) // topk] · Wd[e] in bf16 (or fp32), stored at
                   the sorted row r (over its sorted rows instead: hopper_scatter.py's kernel without
                   the scatter); `dgrad.py` runs the SwiGLU backward on it
  hopper_wgrad.py, the weight gradients:
    down wgrad:    d_w_down[e] = Σ_{r of e} dy_sorted[r]ᵀ · h[r]  (fp32 sum, stored bf16; `wgrad.py`)
    gate/up wgrad: d_w_gate[e] = Σ_{r of e} d_g[r]ᵀ · x_sorted[r], d_w_up[e] likewise with d_u
    fp8_block wgrads: both wgrads over e4m3 operands quantized in 128-row blocks, each step's
                   product scaled by its block's row and column scales (`wgrad.py`'s fp8_block)

Legend: r a row of the expert-sorted layout of `routing/schedule.py`, src(r) = row_source[r]
(−1: padding), e = tile_expert[r // BLOCK_M], H hidden, I intermediate size, E_l local experts.

Why: the Triton kernels of `gate_up.py`, `down.py`, `dgrad.py` and `wgrad.py` run one warp group's MMAs, its
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

Every kernel walks its tiles GROUP_M row tiles per column sweep (tile-config key GROUP_M; at 1
each row tile's columns in turn; the wgrads within each expert), as the Triton kernels'
`tile_coordinates`: where the column operand is wide and there are many row tiles
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

Caller contract: as for the Triton kernels (`down.down_scatter`, `wgrad.down_wgrad`,
`wgrad.gate_up_wgrad`, `dgrad.gate_up_dgrad_scatter`, and their `*_fp8_block`, and
`gate_up.gate_up_swiglu_fp8_block`); bf16, and fp8_block for the wgrads, the scatter
GEMMs and the forward's gate/up (cooperative only); BLOCK_M is the schedule's
block_m. Worker partitions of one `warp_specialize` share one signature (Gluon's rule), so
each kernel's producer takes its consumers' arguments.
"""

from __future__ import annotations

import functools

import torch

from mok.fp8_block import FP8_BLOCK
from mok.kernels import gluon_api
from mok.kernels.common import interpreting, tma_descriptor
from mok.kernels.gluon_api import (
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma_load,
    tma_store,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from mok.kernels.plan import kernel_plan
from mok.kernels.routing.schedule import RoutingSchedule

# Tiles, TMA-store flags and the partitions' registers are the kernel plan's (`plan.KernelPlan`:
# `ping_pong_tile`, `cooperative_tile`, `fp8_block_warp_specialized_tile`, `*_tma_store`,
# `warp_specialized_*_registers`, with their reasons and records).


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
    """acc + product · (sa[m] · sb) with one weight-block scale sb (`common.sorted_rows_tile`'s
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
    `common.sorted_rows_tile`). A tiles [rows, K], B tiles [N, K]: FP8 wgmma reads both
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


@gluon.constexpr_function
def _row_runs_layout(vector):
    """A warp group's row-major layout with runs of `vector` consecutive elements of a row per
    thread, 8 lanes along a row: the epilogues' register stores (the plan's
    `warp_specialized_store_vector`) and the gathered kernel's byte tiles (`gathered_byte_vector`)."""
    return gl.BlockedLayout([1, vector], [4, 8], [4, 1], [1, 0])


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


# --------------------------------------------------------------------------- stores


@gluon.jit
def _store_tile_async(tile, buf, desc, row, column):
    """desc's [row, column] box = tile, through the shared-memory buffer `buf` and a TMA store
    left in flight: the caller waits (`tma.store_wait`) before it writes `buf` again."""
    buf.store(tile)
    fence_async_shared()
    tma_store(desc, [row, column], buf)


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
