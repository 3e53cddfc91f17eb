"""Data-gradient (dgrad) grouped GEMMs of the expert MLPs, with fused epilogues.

    down dgrad:   a[r]   = dOut[t] · Wd[e]                         [I]   fp32, unweighted
                  d_h[r] = w[t,j] · a[r]                                 (w applied in fp32, here)
                  d_g[r], d_u[r] = swiglu_backward(d_h[r], g[r], u[r])   (clamp masks with a limit L)
                  route_partials[t·topk+j, n] = Σ_{i in N tile n} a[r,i] · h[r,i]
    router-weight gradient:
                  d_topk_weights[t,j] = Σ_n route_partials[t·topk+j, n]   (ascending n, fp32)
                                      = ⟨dOut[t], y[t·topk+j]⟩ = ⟨dOut[t]·Wd[e], h[r]⟩
    gate/up dgrad: dx_slots[t·topk+j] = d_g[r] · Wg[e] + d_u[r] · Wu[e]  [H]  one fp32 accumulator

Legend: r a row of the expert-sorted layout of `routing/schedule.py`, src(r) = row_source[r] =
t·topk + j (−1: padding), e = tile_expert[r // BLOCK_M], T tokens, H hidden, I
intermediate size, topk routes per token, E_l local experts. g, u are the pre-activations
the forward stored ([rows, 2, I] bf16); h = silu(min(g, L)) · clamp(u, −L, L) is
recomputed from them in fp32.

The down dgrad reads dOut rows already in the sorted layout (`routing/gather.py`'s d_out_sorted,
zeros in padding rows) and applies the router weight to the fp32 accumulator: d_h never
exists in bf16, and d_g, d_u carry a single bf16 rounding (at the d_gate_up store). The
router-weight gradient is the row-dot ⟨dOut[t]·Wd[e], h[r]⟩ over I, which equals
⟨dOut[t], y⟩: each program writes the partial dot of its N tile, a second tiny launch
sums them in ascending tile order. It never divides by w, so it is exact for any sign
of w, and it needs neither the forward's `y` nor a pass over [T·topk, H].
The shared expert runs the same kernels on its own schedule (every token to one expert,
topk = 1) with HAS_WEIGHTS = False: no weight, no partials.

For the down wgrad the epilogue can also store wh[r] = bf16(w[t,j] · h[r]) (STORE_WEIGHTED_H,
bf16 only; zeros in padding rows): the down wgrad then reduces dOutᵀ · wh over the rows it
already has (d_out_sorted) instead of (w·dOut)ᵀ · h, which spares the backward its copy of
w·dOut (2·H bytes per route) and the forward its saved h (2·I bytes per route) for one store
of 2·I bytes per route here. `down_wgrad_reads_weighted_h` says where (I < H). h here is
recomputed from the saved bf16 g, u, as the router-weight partials use it; the forward's h
came from the fp32 accumulators, so wh differs from bf16(w · h_forward) by about one bf16
rounding, inside the bf16 accuracy bar.

Padding rows (src = −1) get exact zeros in d_gate_up: the wgrad kernels read it through
TMA without masks and rely on it. Rows past the schedule's
`num_rows` are not written. dx_slots rows no route points to are not written.

Every GEMM operand is read through a TMA descriptor (but fp8_block's dOut, below): the
sorted rows (d_out_sorted, d_gate_up) and the weights. A weight viewed as [E·K, N] lets
the last K step of an expert read the next expert's first rows when K is not a multiple
of BLOCK_K; the sorted operand is zero there (TMA fills past its last column), so they add
nothing (for finite weights). A sorted operand with fewer rows than the schedule's capacity
reads zeros past its end: the shared expert's sorted layout is the token order itself, so
it passes x and dOut as they are.

fp8_block (the constexpr PRECISION, launchers `*_fp8_block`): the same kernels and
epilogues on E4M3 operands with fp32 block scales, one per 1×128 block of a sorted row along
the reduction dim (dOut's along H, d_g's and d_u's along I) and one per 128×128 block of a
weight, applied per 128-wide K step by the forward's main loop (`common.sorted_rows_tile`):

    acc[r, n] = Σ_kb  sa[r, kb] · sw[e, n // 128, kb] · Σ_{k in block kb} aq[r, k] · wqᵀ[e, n, k]     (fp32)

Hopper's FP8 MMA needs both operands K-major in shared memory, so the B operand is the
weight's transposed copy (`q_t`, `scale_t` of `mok.fp8_block_quantize`: w_downᵀ [E_l, I, H],
w_gateᵀ and w_upᵀ [E_l, H, I]), read as [N, K] tiles. Up to
the plan's `gathered_fp8_block_down_dgrad_max_hidden`, dOut is quantized once per token
(`quantize_fp8_block_activations` of the token rows) and the down dgrad gathers each sorted
row's token row inside its loads (`common.gathered_rows_tile_fp8`: a route's row of the
sorted copy would be the same bytes, so dOut costs a T-row quantization, not T·topk rows);
above it, dOut's sorted rows are quantized straight from the token rows
(`quantize_fp8_block_gathered`) and read through TMA. On Hopper the GEMM runs in
`hopper_gathered.py` into a product [capacity_rows, I] (bf16, the plan's `fp8_block_down_dgrad_product_bf16`),
gathering the token rows at every H, and `_down_dgrad_swiglu_kernel` runs only its epilogue on it (PRODUCT_GIVEN,
`down_dgrad_swiglu_epilogue`). d_gate_up[:, 0] and d_gate_up[:, 1]
are quantized separately by `quantize_fp8_block_activations` (strided views, no copy), so
each scale tensor is a plain [rows, K/128]; or, with `quantize_d_gate_up`, by the epilogue
itself into e4m3 [rows, 2, I] and scales [rows, 2, I/128] (the same bytes: its bf16 values
through the quantizers' own `quantize_row_blocks`), which the gate/up dgrad reads as column
views, rows 2·I bytes apart. The product's epilogue then takes EPILOGUE_ROWS rows at a time,
each row's 128 columns together. Padding rows quantize to zeros and stay exact zeros. The
gate/up wgrad reduces over rows, so it needs its own quantization, of the bf16 d_gate_up or
of the e4m3 copy (`quant/fp8_block.py`'s SCALED transposing quantizer).

Caller contract: the schedule was built with the same BLOCK_M as these kernels' tiles
(checked); `gate_up` holds the forward's pre-activations for every row below `num_rows`.
Every output element is computed by one program with a fixed K loop, the partial sums
are added in a fixed order, and nothing uses atomics: deterministic run to run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.fp8_block import FP8_BLOCK
from mok.kernels.common import (
    column_halves,
    gate_up_parts,
    interpreting,
    last_wave_tile_coordinates,
    num_sms,
    prefetch_to_l2,
    round_to_bf16,
    tile_coordinates,
    tma_descriptor,
)
from mok.kernels.gemm import hopper_common, hopper_gathered, hopper_scatter
from mok.kernels.gemm.common import (
    _check_weights,
    check_fp8_block_pair,
    checked_tile_config,
    fp8_block_weight_shape,
    gathered_rows_tile_fp8,
    last_wave_config,
    routing_block_m,
    scatter_grid,
    scatter_rows_to_slots,
    sorted_rows_tile,
)
from mok.kernels.plan import kernel_plan
from mok.kernels.quant.fp8_block import dequantize_row_blocks, quantize_row_blocks
from mok.kernels.routing.gather import check_sorted_rows
from mok.kernels.routing.schedule import RoutingSchedule
from mok.kernels.swiglu import fast_sigmoid_here, swiglu_backward

_SCALE_BLOCK = tl.constexpr(FP8_BLOCK)  # kernels read only constexpr globals

# --------------------------------------------------------------------------- configs

# Tile sizes, thresholds and variant flags are the kernel plan's (`plan.KernelPlan`, with each
# choice's reasons and records).


def down_wgrad_reads_weighted_h(hidden: int, inter: int) -> bool:
    """Whether a bf16 down wgrad of these sizes reads dOut's sorted rows and the down dgrad's w·h
    (`down_dgrad_swiglu(..., weighted_h=...)`) rather than w·dOut's sorted rows and the forward's
    h: where w·h is the smaller operand, I < H (the plan's `down_wgrad_reads_weighted_h`)."""
    return kernel_plan().down_wgrad_reads_weighted_h and inter < hidden


def fp8_block_down_dgrad_gathers(hidden: int) -> bool:
    """Whether `down_dgrad_swiglu_fp8_block` takes dOut's token rows [T, H] (and gathers them)
    rather than its sorted rows [capacity_rows, H], for this H: always where the
    warp-specialized product runs (Hopper), else up to the plan's `gathered_fp8_block_down_dgrad_max_hidden`."""
    return _fp8_block_warp_specialized("down") or hidden <= kernel_plan().gathered_fp8_block_down_dgrad_max_hidden


def _fp8_block_warp_specialized(kind: str, allow_warp_specialized: bool = True) -> bool:
    """Whether the fp8_block dgrad `kind` runs warp-specialized by default here: on Hopper, where
    its plan flag says it measured faster."""
    plan = kernel_plan()
    measured_faster = {"gate_up": plan.warp_specialized_fp8_block_gate_up_dgrad,
                       "down": plan.warp_specialized_fp8_block_down_dgrad_product}[kind]
    return measured_faster and allow_warp_specialized and plan.warp_specialized


def fp8_block_tiles(kind: str) -> dict:
    """The fp8_block Triton dgrad `kind`'s tiles (less BLOCK_M, the schedule's) from the plan."""
    plan = kernel_plan()
    if interpreting():
        return dict(plan.dgrad_fp8_block_interpreter_tile)
    return dict({"down": plan.dgrad_fp8_block_down_tile, "gate_up": plan.dgrad_fp8_block_gate_up_tile}[kind])


def dgrad_config(
    kind: str, n_dim: int, reduce_dim: int, precision: str = "bf16", allow_warp_specialized: bool = True
) -> dict:
    """Tile config of a dgrad GEMM (`kind` "down" or "gate_up") of output width n_dim.

    BLOCK_M is the schedule's M tile (`routing_block_m`): the rows of an M tile must
    belong to one expert. "gate_up" runs its two K loops (d_g·Wg, then d_u·Wu) one A and one
    B tile at a time, so 128×256×64 at 3 stages fits (48 KiB per stage) and measured faster
    than 128×128; "down" takes the same tiles, its epilogue running on 64-column slices of
    the accumulator, faster on every preset than 128×128 at 4 stages (record
    h200-20261130-tiles-v2.json). The gate/up dgrad runs persistent at 4 stages for wide
    outputs (H ≥ `persistent_gate_up_dgrad_min_hidden`), where it measured faster and elsewhere
    level (record h200-20261130-persistent.json); per tile, its last wave runs in column halves
    with `split_last_wave`; the down dgrad prefetches its epilogue's g, u into L2
    with `down_dgrad_prefetch_gate_up`. On Hopper the gate/up dgrad runs the
    cooperative warp-specialized kernel up to `cooperative_gate_up_dgrad_max_inter` unless
    `allow_warp_specialized` is False. Under the interpreter, small
    tiles keep the CPU tests fast. The key never includes per-expert counts (they change every step).
    fp8_block: `fp8_block_tiles`, the same for every shape until measured; on Hopper the gate/up
    dgrad into local slots warp-specialized with `warp_specialized_fp8_block_gate_up_dgrad`, and
    the down dgrad's GEMM (into a product) with `warp_specialized_fp8_block_down_dgrad_product`.
    Every threshold and flag named here is a field of the kernel plan (`plan.kernel_plan`).
    """
    plan = kernel_plan()
    if precision == "fp8_block":
        if _fp8_block_warp_specialized(kind, allow_warp_specialized):
            return hopper_common.fp8_block_tile_config()
        return dict(BLOCK_M=routing_block_m(), **fp8_block_tiles(kind))
    split = dict(SPLIT_LAST_WAVE=plan.split_last_wave) if kind == "gate_up" else {}
    if interpreting():
        return dict(BLOCK_M=routing_block_m(), BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1, **split)
    gate_up_warp_specialized = kind == "gate_up" and allow_warp_specialized and plan.warp_specialized
    if gate_up_warp_specialized and reduce_dim <= plan.cooperative_gate_up_dgrad_max_inter:
        return hopper_common.tile_config(cooperative=True)
    cfg = dict(BLOCK_M=routing_block_m(), BLOCK_N=256, BLOCK_K=64, GROUP_M=plan.gemm_group_m, num_warps=8,
               num_stages=3, **split)
    if kind == "down":
        cfg.update(PREFETCH_GATE_UP=plan.down_dgrad_prefetch_gate_up)
    if kind == "gate_up" and n_dim >= plan.persistent_gate_up_dgrad_min_hidden:
        cfg.update(num_stages=4, PERSISTENT=True)
    return cfg


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def sorted_rows_times_weight(
    a_desc, m0, w_desc, expert, n0, reduce_dim, acc,
    BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """acc + a[m0 : m0+BLOCK_M] · W[expert][:, n0 : n0+BLOCK_N] in fp32, where a is read
    through `a_desc` (blocks [BLOCK_M, BLOCK_K] of sorted rows) and W[expert] is a
    row-major [reduce_dim, n_dim] matrix read through `w_desc` (blocks [BLOCK_K, BLOCK_N]
    over [E·reduce_dim, n_dim]): the "nn" product of a dgrad."""
    w_row = expert * reduce_dim
    for k0 in range(0, reduce_dim, BLOCK_K):
        a = a_desc.load([m0, k0])
        b = w_desc.load([w_row + k0, n0])
        if INTERPRETER:  # the interpreter's bf16 tl.dot is wrong (Triton 3.6-3.9); fp32 is exact
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _store_row_blocks(values, q_ptrs, scale_ptrs, mask, INTERPRETER: tl.constexpr):
    """bf16 rows [R, 128], one 1×128 block each, stored as E4M3 bytes and their fp32 scales: the
    bytes and scales `quantize_fp8_block_activations` makes of the same bf16 rows."""
    q, scale = quantize_row_blocks(values, INTERPRETER)  # [R, 128] uint8, [R, 1] fp32
    tl.store(q_ptrs, q, mask=mask)
    tl.store(scale_ptrs, scale)


@triton.jit
def _load_gate_up(gate_up_ptr, gate_up_scale_ptr, rows64, n0, inter, stride_gu_r, GATE_UP_E4M3: tl.constexpr,
                  INTERPRETER: tl.constexpr, BLOCK_N: tl.constexpr):
    """The saved g, u [rows, BLOCK_N] of columns [n0, n0 + BLOCK_N), zeros past I: bf16, or with
    GATE_UP_E4M3 fp32 from e4m3 bytes in 1×128 blocks along I (scales [rows, 2, I/128]; the
    columns within one block)."""
    n_offs = n0 + tl.arange(0, BLOCK_N)
    gu_ptrs = gate_up_ptr + rows64[:, None] * stride_gu_r + n_offs[None, :]
    out_mask = (n_offs < inter)[None, :]
    gate, up = tl.load(gu_ptrs, mask=out_mask, other=0), tl.load(gu_ptrs + inter, mask=out_mask, other=0)
    if GATE_UP_E4M3:
        tl.static_assert(BLOCK_N <= _SCALE_BLOCK)
        scale_ptrs = gate_up_scale_ptr + rows64 * (2 * inter // _SCALE_BLOCK) + n0 // _SCALE_BLOCK
        gate = dequantize_row_blocks(gate, tl.load(scale_ptrs), INTERPRETER)
        up = dequantize_row_blocks(up, tl.load(scale_ptrs + inter // _SCALE_BLOCK), INTERPRETER)
    return gate, up


@triton.jit
def _down_dgrad_epilogue(
    d_out_wd, w, row_valid, rows64, n0, gate, up, d_gate_up_ptr, d_gate_up_scale_ptr, weighted_h_ptr, inter,
    swiglu_limit, stride_dgu_r, stride_dgu_scale_r, stride_wh_r,
    HAS_LIMIT: tl.constexpr, STORE_WEIGHTED_H: tl.constexpr, QUANTIZED: tl.constexpr, INTERPRETER: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The down dgrad's epilogue on columns [n0, n0 + BLOCK_N) of some rows: d_g, d_u from w·a
    and the saved g, u (`_load_gate_up`'s), stored in bf16 (exact zeros in padding rows), or with
    QUANTIZED (BLOCK_N is one 128-column scale block) those bf16 values quantized along I; w·h
    with STORE_WEIGHTED_H; returns the router-weight partials ⟨a, h⟩ over these columns (columns
    past I are zero on both sides)."""
    n_offs = n0 + tl.arange(0, BLOCK_N)
    out_mask = (n_offs < inter)[None, :]
    d_out_wd = d_out_wd.to(tl.float32)
    d_gate, d_up, h = swiglu_backward(w[:, None] * d_out_wd, gate.to(tl.float32), up.to(tl.float32), swiglu_limit,
                                      HAS_LIMIT, FAST_SIGMOID)
    # Padding rows: exact zeros whatever the saved g, u hold there.
    valid = row_valid[:, None]
    d_gate = round_to_bf16(tl.where(valid, d_gate, 0.0), INTERPRETER)
    d_up = round_to_bf16(tl.where(valid, d_up, 0.0), INTERPRETER)
    dgu_ptrs = d_gate_up_ptr + rows64[:, None] * stride_dgu_r + n_offs[None, :]
    if QUANTIZED:
        scale_ptrs = d_gate_up_scale_ptr + rows64[:, None] * stride_dgu_scale_r + n0 // BLOCK_N
        _store_row_blocks(d_gate, dgu_ptrs, scale_ptrs, out_mask, INTERPRETER)
        _store_row_blocks(d_up, dgu_ptrs + inter, scale_ptrs + inter // BLOCK_N, out_mask, INTERPRETER)
    else:
        tl.store(dgu_ptrs, d_gate, mask=out_mask)
        tl.store(dgu_ptrs + inter, d_up, mask=out_mask)
    if STORE_WEIGHTED_H:
        wh_ptrs = weighted_h_ptr + rows64[:, None] * stride_wh_r + n_offs[None, :]
        tl.store(wh_ptrs, round_to_bf16(tl.where(valid, w[:, None] * h, 0.0), INTERPRETER), mask=out_mask)
    return tl.sum(d_out_wd * h, axis=1)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _slots_of(source):
    """From sorted rows' row_source entries: (whether each row holds a route, its slot t·topk + j;
    0 for padding)."""
    row_valid = source >= 0
    return row_valid, tl.where(row_valid, source, 0)


@triton.jit
def _load_product(product_ptr, rows64, columns, inter, stride_r):
    """PRODUCT_GIVEN: the product's [rows, columns] as stored (fp32 or bf16), zeros past I."""
    return tl.load(product_ptr + rows64[:, None] * stride_r + columns[None, :], mask=(columns < inter)[None, :],
                   other=0.0)


@triton.jit
def _product_chunk_loads(source, rows, n0, product_ptr, topk_weights_ptr, gate_up_ptr, gate_up_scale_ptr, inter,
                         stride_r, stride_gu_r, HAS_WEIGHTS: tl.constexpr, GATE_UP_E4M3: tl.constexpr,
                         INTERPRETER: tl.constexpr, BLOCK_N: tl.constexpr):
    """The loads of one chunk of rows of the epilogue on a given product, from its rows'
    row_source entries: (row_valid, slot, router weight, product, g, u)."""
    row_valid, slot = _slots_of(source)
    rows64 = rows.to(tl.int64)
    product = _load_product(product_ptr, rows64, n0 + tl.arange(0, BLOCK_N), inter, stride_r)
    gate, up = _load_gate_up(gate_up_ptr, gate_up_scale_ptr, rows64, n0, inter, stride_gu_r, GATE_UP_E4M3,
                             INTERPRETER, BLOCK_N)
    return row_valid, slot, _router_weights(slot, row_valid, topk_weights_ptr, HAS_WEIGHTS), product, gate, up


@triton.jit
def _router_weights(slot, row_valid, topk_weights_ptr, HAS_WEIGHTS: tl.constexpr):
    """Each row's router weight: 1 without HAS_WEIGHTS, 0 for padding."""
    if HAS_WEIGHTS:
        return tl.load(topk_weights_ptr + slot, mask=row_valid, other=0.0)
    return tl.full(slot.shape, 1.0, tl.float32)


@triton.jit
def _down_dgrad_swiglu_kernel(
    # pointers (d_out's sorted rows through a TMA descriptor, GATHER_D_OUT: its token rows [T, H],
    # PRODUCT_GIVEN: the product a itself, fp32 or bf16 [capacity_rows, I], w_down unread; bf16: w_down
    # [E_l, H, I]; fp8_block: e4m3, w_down as its transposed copy [E_l, I, H]; d_gate_up [capacity_rows, 2, I]
    # bf16, QUANTIZED: uint8 e4m3 bytes; weighted_h: bf16 [capacity_rows, I], written with STORE_WEIGHTED_H;
    # gate_up [capacity_rows, 2, I] bf16, GATE_UP_E4M3: uint8 e4m3 bytes)
    d_out, topk_weights_ptr, gate_up_ptr, w_down_desc, d_gate_up_ptr, route_partials_ptr, weighted_h_ptr,
    # fp8_block scales (unused in bf16): d_out [rows or T, H/128], w_downᵀ [E_l, I/128, H/128]; QUANTIZED:
    # d_gate_up's, written [capacity_rows, 2, I/128]; GATE_UP_E4M3: g's and u's [capacity_rows, 2, I/128]
    d_out_scale_ptr, w_down_scale_ptr, d_gate_up_scale_ptr, gate_up_scale_ptr,
    # schedule
    row_source_ptr, tile_expert_ptr, num_rows_ptr,
    # sizes
    hidden, inter, max_m_tiles, swiglu_limit, topk,
    # strides
    stride_gu_r, stride_dgu_r, stride_dgu_scale_r, stride_d_out_t, stride_wh_r,
    # meta
    PRECISION: tl.constexpr, GATHER_D_OUT: tl.constexpr, PRODUCT_GIVEN: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    HAS_LIMIT: tl.constexpr, STORE_WEIGHTED_H: tl.constexpr, QUANTIZED: tl.constexpr, GATE_UP_E4M3: tl.constexpr,
    INTERPRETER: tl.constexpr, FAST_SIGMOID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PREFETCH_GATE_UP: tl.constexpr, EPILOGUE_ROWS: tl.constexpr,
):
    num_n_tiles = tl.cdiv(inter, BLOCK_N)
    m_tile, n_tile = tile_coordinates(tl.program_id(0), max_m_tiles, num_n_tiles, GROUP_M)
    if m_tile * BLOCK_M >= tl.load(num_rows_ptr):
        return
    n0 = n_tile * BLOCK_N
    columns = n0 + tl.arange(0, BLOCK_N)
    if PRODUCT_GIVEN and QUANTIZED:
        # The product comes from memory, so the tile is taken EPILOGUE_ROWS rows at a time, each
        # row's 128 columns (its scale block) together: only a chunk's d_g, d_u are live at once.
        # Each chunk's loads are issued before the chunk ahead of it is worked (its rows'
        # row_source two chunks ahead: the router weights' addresses wait on them), so that they
        # are in flight during that work, not after it.
        CHUNKS: tl.constexpr = BLOCK_M // EPILOGUE_ROWS
        chunk_rows = m_tile * BLOCK_M + tl.arange(0, EPILOGUE_ROWS)
        loads_next = _product_chunk_loads(tl.load(row_source_ptr + chunk_rows), chunk_rows, n0, d_out,
                                          topk_weights_ptr, gate_up_ptr, gate_up_scale_ptr, inter, stride_d_out_t,
                                          stride_gu_r, HAS_WEIGHTS, GATE_UP_E4M3, INTERPRETER, BLOCK_N)
        if CHUNKS > 1:
            sources_next = tl.load(row_source_ptr + chunk_rows + EPILOGUE_ROWS)
        for chunk in tl.static_range(CHUNKS):
            rows = chunk_rows + chunk * EPILOGUE_ROWS
            row_valid, slot, w, d_out_wd, gate, up = loads_next
            if chunk + 1 < CHUNKS:
                loads_next = _product_chunk_loads(sources_next, rows + EPILOGUE_ROWS, n0, d_out, topk_weights_ptr,
                                                  gate_up_ptr, gate_up_scale_ptr, inter, stride_d_out_t, stride_gu_r,
                                                  HAS_WEIGHTS, GATE_UP_E4M3, INTERPRETER, BLOCK_N)
            if chunk + 2 < CHUNKS:
                sources_next = tl.load(row_source_ptr + rows + 2 * EPILOGUE_ROWS)
            partial = _down_dgrad_epilogue(
                d_out_wd, w, row_valid, rows.to(tl.int64), n0, gate, up, d_gate_up_ptr, d_gate_up_scale_ptr,
                weighted_h_ptr, inter, swiglu_limit, stride_dgu_r, stride_dgu_scale_r, stride_wh_r,
                HAS_LIMIT, STORE_WEIGHTED_H, True, INTERPRETER, FAST_SIGMOID, BLOCK_N,
            )
            if HAS_WEIGHTS:
                tl.store(route_partials_ptr + slot.to(tl.int64) * num_n_tiles + n_tile, partial, mask=row_valid)
        return
    expert = tl.load(tile_expert_ptr + m_tile)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid, slot = _slots_of(tl.load(row_source_ptr + rows))
    # a = dOut[t] · Wd[e] over H, unweighted.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PRODUCT_GIVEN:  # columns past I read as zeros: h is zero there too (g = u = 0)
        d_out_wd = _load_product(d_out, rows.to(tl.int64), columns, inter, stride_d_out_t)
    elif GATHER_D_OUT:  # fp8_block; Wd[e]ᵀ is [I, H]: K-major, its rows the N dim
        d_out_wd = gathered_rows_tile_fp8(
            d_out, d_out_scale_ptr, slot // topk, row_valid, w_down_desc, w_down_scale_ptr, expert,
            n0, hidden, inter, stride_d_out_t, acc, BLOCK_K,
        )
    elif PRECISION == "fp8_block":
        d_out_wd = sorted_rows_tile(  # dOut's scales: [rows, H/128], BLOCK_K the scale block
            d_out, d_out_scale_ptr, w_down_desc, w_down_scale_ptr, m_tile * BLOCK_M, expert, n0,
            hidden, inter, hidden // BLOCK_K, acc, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETER,
        )
    else:  # Wd[e] is [H, I], so its rows are the K dim
        d_out_wd = sorted_rows_times_weight(
            d_out, m_tile * BLOCK_M, w_down_desc, expert, n0, hidden, acc, BLOCK_K, INTERPRETER,
        )
    LINE: tl.constexpr = 128 if GATE_UP_E4M3 else 64  # columns of g per 128-byte line
    if PREFETCH_GATE_UP and BLOCK_N >= LINE and not INTERPRETER:  # whole lines of g, u
        # The epilogue waits on its g, u loads a quarter at a time; asked for at once here, every
        # quarter but the first finds its lines in L2 (the plan's `down_dgrad_prefetch_gate_up`).
        line_cols = n0 + tl.arange(0, BLOCK_N // LINE) * LINE  # one per line of g
        line_ptrs = gate_up_ptr + rows.to(tl.int64)[:, None] * stride_gu_r + line_cols[None, :]
        line_ok = (line_cols < inter)[None, :] & row_valid[:, None]
        prefetch_to_l2(tl.join(line_ptrs, line_ptrs + inter), tl.join(line_ok, line_ok))
    w = _router_weights(slot, row_valid, topk_weights_ptr, HAS_WEIGHTS)
    rows64 = rows.to(tl.int64)
    if QUANTIZED:  # the whole tile at once: a row's 128 columns are its scale block
        gate, up = _load_gate_up(gate_up_ptr, gate_up_scale_ptr, rows64, n0, inter, stride_gu_r, GATE_UP_E4M3,
                                 INTERPRETER, BLOCK_N)
        partial = _down_dgrad_epilogue(
            d_out_wd, w, row_valid, rows64, n0, gate, up, d_gate_up_ptr, d_gate_up_scale_ptr, weighted_h_ptr,
            inter, swiglu_limit, stride_dgu_r, stride_dgu_scale_r, stride_wh_r,
            HAS_LIMIT, STORE_WEIGHTED_H, True, INTERPRETER, FAST_SIGMOID, BLOCK_N,
        )
    else:
        # The epilogue takes the tile a quarter of its columns at a time: with the whole tile, the
        # accumulator, g, u, d_g and d_u live at once spilled 2.7 KB per thread at 128×128 and
        # 8 warps (ptxas, sm_90a, triton 3.6); by quarters, 0.2 KB. At the 128×256 default ptxas
        # reports 2.8 KB again, yet the wider tile measured faster (half the dOut re-reads), and
        # eighths (1.7 KB) slower than quarters (record h200-20261130-down-dgrad-eighths.json).
        partial = tl.zeros((BLOCK_M,), dtype=tl.float32)
        halves = column_halves(d_out_wd)
        for half in tl.static_range(2):
            quarters = column_halves(halves[half])
            for quarter in tl.static_range(2):
                quarter_n0 = n0 + (2 * half + quarter) * (BLOCK_N // 4)
                gate, up = _load_gate_up(gate_up_ptr, gate_up_scale_ptr, rows64, quarter_n0, inter, stride_gu_r,
                                         GATE_UP_E4M3, INTERPRETER, BLOCK_N // 4)
                partial += _down_dgrad_epilogue(
                    quarters[quarter], w, row_valid, rows64, quarter_n0, gate, up, d_gate_up_ptr,
                    d_gate_up_scale_ptr, weighted_h_ptr, inter, swiglu_limit, stride_dgu_r, stride_dgu_scale_r,
                    stride_wh_r, HAS_LIMIT, STORE_WEIGHTED_H, False, INTERPRETER, FAST_SIGMOID, BLOCK_N // 4,
                )
    if HAS_WEIGHTS:
        tl.store(route_partials_ptr + slot.to(tl.int64) * num_n_tiles + n_tile, partial, mask=row_valid)


@triton.jit
def _sum_route_partials_kernel(
    route_partials_ptr, d_topk_weights_ptr, num_slots, num_parts,
    BLOCK_S: tl.constexpr,
):
    """d_topk_weights[s] = Σ_p route_partials[s, p], ascending p, fp32."""
    slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    valid = slots < num_slots
    acc = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for p in range(num_parts):
        acc += tl.load(route_partials_ptr + slots.to(tl.int64) * num_parts + p, mask=valid, other=0.0)
    tl.store(d_topk_weights_ptr + slots, acc, mask=valid)


@triton.jit
def _gate_up_dgrad_tile(
    d_gate_desc, d_up_desc, w_gate_desc, w_up_desc, dx_ptr,
    d_gate_scale_ptr, d_up_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr,
    row_source_ptr, tile_expert_ptr, m_tile, n_tile, hidden, inter, stride_dx_s, stride_d_gu_scale_r,
    PRECISION: tl.constexpr, INTERPRETER: tl.constexpr, SORTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of the gate/up dgrad, scattered to its rows' slots (SORTED:
    stored at its rows). Each output row depends only on its own d_gate_up row: padding rows
    cannot leak."""
    expert = tl.load(tile_expert_ptr + m_tile)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    n_offs = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    # d_g · Wg[e] + d_u · Wu[e]: one accumulator through two K loops over I.
    m0, n0 = m_tile * BLOCK_M, n_tile * BLOCK_N
    dx = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PRECISION == "fp8_block":  # the weights' transposed copies [H, I]: K-major
        dx = sorted_rows_tile(
            d_gate_desc, d_gate_scale_ptr, w_gate_desc, w_gate_scale_ptr, m0, expert, n0, inter, hidden,
            stride_d_gu_scale_r, dx, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETER,
        )
        dx = sorted_rows_tile(
            d_up_desc, d_up_scale_ptr, w_up_desc, w_up_scale_ptr, m0, expert, n0, inter, hidden,
            stride_d_gu_scale_r, dx, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETER,
        )
    else:
        dx = sorted_rows_times_weight(d_gate_desc, m0, w_gate_desc, expert, n0, inter, dx, BLOCK_K, INTERPRETER)
        dx = sorted_rows_times_weight(d_up_desc, m0, w_up_desc, expert, n0, inter, dx, BLOCK_K, INTERPRETER)
    scatter_rows_to_slots(dx_ptr, dx, row_source_ptr, rows, n_offs, hidden, stride_dx_s, SORTED, INTERPRETER)


@triton.jit
def _gate_up_dgrad_scatter_kernel(
    # pointers (d_g, d_u, weights: bf16; fp8_block: e4m3, the weights as their transposed copies [E_l, H, I];
    # the *_half_desc: blocks BLOCK_N // 2 wide, read by the last wave's half tiles with SPLIT_LAST_WAVE)
    d_gate_desc, d_up_desc, w_gate_desc, w_up_desc, w_gate_half_desc, w_up_half_desc, dx_ptr,
    # fp8_block scales (unused in bf16): d_g, d_u [rows, I/128], w_gateᵀ, w_upᵀ [E_l, H/128, I/128]
    d_gate_scale_ptr, d_up_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr,
    # schedule
    row_source_ptr, tile_expert_ptr, num_rows_ptr,
    # sizes (num_programs: the grid)
    hidden, inter, num_sms, num_programs,
    # strides (fp8_block: one row stride for d_g's and d_u's scales)
    stride_dx_s, stride_d_gu_scale_r,
    # meta
    PRECISION: tl.constexpr, INTERPRETER: tl.constexpr,
    SORTED: tl.constexpr,  # dx in the sorted layout [capacity_rows, H] instead of route slots
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, SPLIT_LAST_WAVE: tl.constexpr,
):
    num_n_tiles = tl.cdiv(hidden, BLOCK_N)
    num_m_tiles = tl.cdiv(tl.load(num_rows_ptr), BLOCK_M)
    if PERSISTENT:  # as the forward's down GEMM (`down._down_scatter_kernel`)
        for tile in tl.range(tl.program_id(0), num_m_tiles * num_n_tiles, num_programs, flatten=True):
            m_tile, n_tile = tile_coordinates(tile, num_m_tiles, num_n_tiles, GROUP_M)
            _gate_up_dgrad_tile(
                d_gate_desc, d_up_desc, w_gate_desc, w_up_desc, dx_ptr,
                d_gate_scale_ptr, d_up_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr,
                row_source_ptr, tile_expert_ptr, m_tile, n_tile, hidden, inter, stride_dx_s, stride_d_gu_scale_r,
                PRECISION, INTERPRETER, SORTED, BLOCK_M, BLOCK_N, BLOCK_K,
            )
    else:  # as the forward's down GEMM, the last wave in column halves with SPLIT_LAST_WAVE
        m_tile, n_tile, half = last_wave_tile_coordinates(
            tl.program_id(0), num_m_tiles, num_n_tiles, num_sms, GROUP_M, SPLIT_LAST_WAVE)
        if (m_tile >= 0) & (half < 0):
            _gate_up_dgrad_tile(
                d_gate_desc, d_up_desc, w_gate_desc, w_up_desc, dx_ptr,
                d_gate_scale_ptr, d_up_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr,
                row_source_ptr, tile_expert_ptr, m_tile, n_tile, hidden, inter, stride_dx_s, stride_d_gu_scale_r,
                PRECISION, INTERPRETER, SORTED, BLOCK_M, BLOCK_N, BLOCK_K,
            )
        if SPLIT_LAST_WAVE:
            if half >= 0:
                _gate_up_dgrad_tile(
                    d_gate_desc, d_up_desc, w_gate_half_desc, w_up_half_desc, dx_ptr,
                    d_gate_scale_ptr, d_up_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr,
                    row_source_ptr, tile_expert_ptr, m_tile, 2 * n_tile + half, hidden, inter, stride_dx_s,
                    stride_d_gu_scale_r,
                    PRECISION, INTERPRETER, SORTED, BLOCK_M, BLOCK_N // 2, BLOCK_K,
                )


# --------------------------------------------------------------------------- launchers


def _check_gate_up(gate_up, capacity_rows: int, inter: int, device: torch.device) -> None:
    """The forward's g, u: bf16 [capacity_rows, 2, I], or in fp8_block the pair (e4m3 [capacity_rows,
    2, I], fp32 scales [capacity_rows, 2, I/128]) of `gate_up_swiglu_fp8_block(..., gate_up_e4m3=True)`."""
    data, scales = gate_up_parts(gate_up)
    if scales is None:
        _check_weights("gate_up", data, (capacity_rows, 2, inter), device)
    else:
        check_fp8_block_pair("gate_up[0]", data, "gate_up[1]", scales, (capacity_rows, 2, inter), (1, FP8_BLOCK),
                             device)


def _check_topk_weights(topk_weights: torch.Tensor | None, device: torch.device) -> None:
    if topk_weights is not None and (
        topk_weights.dtype != torch.float32 or topk_weights.dim() != 2 or not topk_weights.is_contiguous()
        or topk_weights.device != device
    ):
        raise ValueError(
            f"topk_weights: expected a contiguous fp32 [T, topk] tensor on {device}, "
            f"got {topk_weights.dtype} {list(topk_weights.shape)} on {topk_weights.device}"
        )


def _dgrad_tiles(
    kind: str, n_dim: int, reduce_dim: int, precision: str, tile_config: dict | None, schedule: RoutingSchedule,
    allow_warp_specialized: bool = True,
) -> dict:
    default = dgrad_config(kind, n_dim, reduce_dim, precision, allow_warp_specialized)
    return checked_tile_config(tile_config, default, schedule, precision, f"{kind} dgrad", False)


def _weight_block(precision: str, cfg: dict) -> tuple[int, int]:
    """TMA block of a weight: bf16 reads W as [K, N] ("nn"), fp8_block its transposed copy as [N, K]."""
    return (cfg["BLOCK_N"], cfg["BLOCK_K"]) if precision == "fp8_block" else (cfg["BLOCK_K"], cfg["BLOCK_N"])


def _launch_down_dgrad_swiglu(
    precision: str, d_out, d_out_scale, topk_weights, gate_up, w_down, w_down_scale,
    schedule: RoutingSchedule, hidden: int, inter: int, swiglu_limit: float | None, cfg: dict,
    gathered: bool = False, product_given: bool = False, weighted_h: torch.Tensor | None = None,
    quantize: bool = False,
) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """`_down_dgrad_swiglu_kernel`, then the router-weight sum; the scales are None in bf16.
    `gathered` (fp8_block): d_out is dOut's token rows, gathered by the loads. With
    `product_given`, d_out is the product a [capacity_rows, I] fp32 and the weight unread.
    `weighted_h`: checked by the caller, receives w·h. With `quantize` (fp8_block, tiles of
    128 columns) d_gate_up is the pair (e4m3, scales) of `down_dgrad_swiglu_fp8_block`'s. gate_up:
    as `_check_gate_up` takes it."""
    gate_up, gate_up_scale = gate_up_parts(gate_up)
    gate_up_e4m3 = gate_up_scale is not None
    if gate_up_e4m3:
        gate_up = gate_up.view(torch.uint8)  # the kernel reads bytes
    device = gate_up.device
    num_n_tiles = triton.cdiv(inter, cfg["BLOCK_N"])
    if quantize:
        if cfg["BLOCK_N"] != FP8_BLOCK:
            raise ValueError(f"tile_config: quantizing d_gate_up needs BLOCK_N {FP8_BLOCK} (one scale block), "
                             f"got {cfg['BLOCK_N']}")
        d_gate_up = torch.empty(gate_up.shape, dtype=torch.uint8, device=device)  # [capacity_rows, 2, I] e4m3
        # [capacity_rows, 2, I/128] fp32: flattened, each row's 1×128 blocks along [2·I]
        d_gate_up_scale = torch.empty(*gate_up.shape[:2], inter // FP8_BLOCK, dtype=torch.float32, device=device)
    else:
        d_gate_up = torch.empty(gate_up.shape, dtype=torch.bfloat16, device=device)  # [capacity_rows, 2, I]
        d_gate_up_scale = d_gate_up  # unwritten stand-in
    epilogue_rows = min(kernel_plan(device).fp8_block_quantized_epilogue_rows, cfg["BLOCK_M"])
    weighted = topk_weights is not None
    num_slots = topk_weights.numel() if weighted else 0
    # [T·topk, I / BLOCK_N] fp32: every slot a placed route points to is fully written.
    route_partials = torch.empty(num_slots, num_n_tiles, dtype=torch.float32, device=device)
    grid = (schedule.max_tiles * num_n_tiles,)
    _down_dgrad_swiglu_kernel[grid](
        d_out if gathered or product_given else tma_descriptor(d_out, (cfg["BLOCK_M"], cfg["BLOCK_K"])),
        topk_weights if weighted else d_gate_up,
        gate_up, d_out if product_given else tma_descriptor(w_down, _weight_block(precision, cfg)), d_gate_up,
        route_partials if weighted else d_gate_up,  # unused without weights (HAS_WEIGHTS=False)
        d_gate_up if weighted_h is None else weighted_h,  # d_gate_up: unwritten without STORE_WEIGHTED_H
        *(d_gate_up if s is None else s for s in (d_out_scale, w_down_scale)),  # d_gate_up: an unread stand-in
        d_gate_up_scale, d_gate_up if gate_up_scale is None else gate_up_scale,  # d_gate_up: an unread stand-in
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        hidden, inter, schedule.max_tiles, 0.0 if swiglu_limit is None else float(swiglu_limit),
        topk_weights.shape[1] if weighted else 1,
        gate_up.stride(0), d_gate_up.stride(0), d_gate_up_scale.stride(0), d_out.stride(0),
        0 if weighted_h is None else weighted_h.stride(0),
        PRECISION=precision, GATHER_D_OUT=gathered, PRODUCT_GIVEN=product_given, HAS_WEIGHTS=weighted,
        HAS_LIMIT=swiglu_limit is not None, STORE_WEIGHTED_H=weighted_h is not None, QUANTIZED=quantize,
        GATE_UP_E4M3=gate_up_e4m3, INTERPRETER=interpreting(), FAST_SIGMOID=fast_sigmoid_here(),
        EPILOGUE_ROWS=epilogue_rows,
        **{"PREFETCH_GATE_UP": False, **cfg},
    )
    if quantize:
        d_gate_up = (d_gate_up.view(torch.float8_e4m3fn), d_gate_up_scale)
    if not weighted:
        return d_gate_up, None
    d_topk_weights = torch.empty_like(topk_weights)  # [T, topk] fp32
    block_s = 128
    _sum_route_partials_kernel[(triton.cdiv(num_slots, block_s),)](
        route_partials, d_topk_weights, num_slots, num_n_tiles, BLOCK_S=block_s, num_warps=4,
    )
    return d_gate_up, d_topk_weights


def down_dgrad_swiglu(
    d_out_sorted: torch.Tensor,  # [<= capacity_rows, H] bf16, dOut in the sorted layout (zeros at padding)
    topk_weights: torch.Tensor | None,  # [T, topk] fp32; None: unweighted (the shared expert)
    gate_up: torch.Tensor,  # [capacity_rows, 2, I] bf16, the forward's g, u
    w_down: torch.Tensor,  # [E_l, H, I] bf16
    schedule: RoutingSchedule,
    swiglu_limit: float | None = None,
    tile_config: dict | None = None,
    weighted_h: torch.Tensor | None = None,  # [capacity_rows, I] bf16, written when given
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d_gate_up [capacity_rows, 2, I] bf16, d_topk_weights [T, topk] fp32 or None).

    d_gate_up holds (d_g, d_u) per sorted row, exact zeros in padding rows; rows past the
    schedule's `num_rows` are left unwritten. d_topk_weights is returned when `topk_weights` is given (routed
    experts) and None otherwise (shared expert). Rows of d_out_sorted past its end read
    as zeros. With `weighted_h` (routed experts only) the epilogue also writes bf16(w · h) of
    every sorted row there, h recomputed from g, u, zeros in padding rows, rows past
    `num_rows` unwritten: the down wgrad's operand beside dOut's sorted rows."""
    num_experts, hidden, inter = w_down.shape
    device = gate_up.device
    check_sorted_rows("d_out_sorted", d_out_sorted, hidden, schedule)
    _check_topk_weights(topk_weights, device)
    _check_weights("w_down", w_down, (schedule.num_local_experts, hidden, inter), device)
    _check_weights("gate_up", gate_up, (schedule.capacity_rows, 2, inter), device)
    if weighted_h is not None:
        if topk_weights is None:
            raise ValueError("weighted_h: expected None without topk_weights (w·h needs the router weights)")
        _check_weights("weighted_h", weighted_h, (schedule.capacity_rows, inter), device)
    cfg = _dgrad_tiles("down", inter, hidden, "bf16", tile_config, schedule)
    if cfg.get("WARP_SPECIALIZED", False):  # a warp-specialized bf16 down dgrad measured slower (benchmarks/LOG.md)
        raise ValueError("tile_config: the down dgrad runs the Triton kernel only, got WARP_SPECIALIZED")
    return _launch_down_dgrad_swiglu(
        "bf16", d_out_sorted, None, topk_weights, gate_up, w_down, None, schedule, hidden, inter, swiglu_limit, cfg,
        weighted_h=weighted_h,
    )


def down_dgrad_swiglu_fp8_block(
    d_out_q: torch.Tensor,  # float8_e4m3fn, dOut in 1×128 blocks: [T, H] token rows where
    #                         `fp8_block_down_dgrad_gathers(H)`, else [capacity_rows, H] sorted rows
    d_out_scale: torch.Tensor,  # [T or capacity_rows, H/128] fp32
    topk_weights: torch.Tensor | None,  # [T, topk] fp32; None: unweighted, one route per token
    gate_up,  # the forward's g, u: [capacity_rows, 2, I] bf16, or its e4m3 pair (`_check_gate_up`)
    w_down_t_q: torch.Tensor,  # [E_l, I, H] float8_e4m3fn, w_down's transposed copy
    w_down_t_scale: torch.Tensor,  # [E_l, I/128, H/128] fp32
    schedule: RoutingSchedule,
    swiglu_limit: float | None = None,
    tile_config: dict | None = None,
    quantize_d_gate_up: bool = False,
) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """The fp8_block down dgrad: (d_gate_up [capacity_rows, 2, I] bf16, d_topk_weights
    [T, topk] fp32 or None), as `down_dgrad_swiglu`. With `quantize_d_gate_up`, d_gate_up is
    the pair (float8_e4m3fn [capacity_rows, 2, I], fp32 [capacity_rows, 2, I/128]): the bf16
    d_g, d_u quantized in 1×128 blocks along I by the epilogue, bitwise what
    `quantize_fp8_block_activations(d_gate_up[:, j])` makes of the bf16 output (the gate/up
    dgrad's operands, `d_gate_up[0][:, j]` and `d_gate_up[1][:, j]`). Where `fp8_block_down_dgrad_gathers(H)`,
    d_out_q, d_out_scale are `quantize_fp8_block_activations(d_out)` of the token rows and
    each sorted row r reads token row_source[r] // topk inside the GEMM's loads (dOut is
    quantized once per token, not once per route; a route's row is its token's, so the
    products are bitwise those of the quantized sorted copy's rows). Elsewhere they are the
    sorted rows, `quantize_fp8_block_gathered(d_out)`. The weight pair is `q_t, scale_t` of
    `mok.fp8_block_quantize(w_down)`. Rows past the schedule's `num_rows` are left unwritten.
    A tile config with WARP_SPECIALIZED (the default on Hopper, see
    the plan's `warp_specialized_fp8_block_down_dgrad_product`) runs the GEMM in `hopper_gathered.py` into
    a product (gathering the token rows in its producer, or reading the sorted rows
    through TMA in `hopper_scatter.py`), then `down_dgrad_swiglu_epilogue` on it: with an fp32 product
    (the plan's `fp8_block_down_dgrad_product_bf16` off) d_gate_up bitwise the fused kernel's, d_topk_weights to
    fp32 rounding (its row sums reduce in another order); with a bf16 one, both from the product
    rounded to bf16."""
    _, inter, hidden = fp8_block_weight_shape("w_down_t_q", w_down_t_q, "[E_l, I, H]", schedule.num_local_experts)
    device = w_down_t_q.device
    _check_topk_weights(topk_weights, device)
    gathers = fp8_block_down_dgrad_gathers(hidden)
    if not gathers:
        rows = schedule.capacity_rows
    elif topk_weights is not None:
        rows = topk_weights.shape[0]  # T
    else:  # one route per token: d_out_q's own T
        rows = d_out_q.shape[0] if d_out_q.dim() else 0
    check_fp8_block_pair("d_out_q", d_out_q, "d_out_scale", d_out_scale, (rows, hidden), (1, FP8_BLOCK), device)
    check_fp8_block_pair(
        "w_down_t_q", w_down_t_q, "w_down_t_scale", w_down_t_scale, tuple(w_down_t_q.shape),
        (FP8_BLOCK, FP8_BLOCK), device,
    )
    _check_gate_up(gate_up, schedule.capacity_rows, inter, device)
    cfg = _dgrad_tiles("down", inter, hidden, "fp8_block", tile_config, schedule)
    if cfg.get("WARP_SPECIALIZED", False):
        dtype = torch.bfloat16 if kernel_plan().fp8_block_down_dgrad_product_bf16 else torch.float32
        product = torch.empty(schedule.capacity_rows, inter, dtype=dtype, device=device)  # [capacity_rows, I]
        topk = 1 if topk_weights is None else topk_weights.shape[1]
        hopper_gathered.launch_down_dgrad_product_fp8_block(
            d_out_q, d_out_scale, w_down_t_q, w_down_t_scale, product, schedule, cfg, topk if gathers else None
        )
        return _launch_down_dgrad_epilogue(product, topk_weights, gate_up, schedule, swiglu_limit, quantize_d_gate_up)
    return _launch_down_dgrad_swiglu(
        "fp8_block", d_out_q, d_out_scale, topk_weights, gate_up, w_down_t_q, w_down_t_scale,
        schedule, hidden, inter, swiglu_limit, cfg, gathered=gathers, quantize=quantize_d_gate_up,
    )


def down_dgrad_swiglu_epilogue(
    product: torch.Tensor,  # [capacity_rows, I] fp32 or bf16, a[r] = dOut[src(r) // topk] · Wd[e], unweighted
    topk_weights: torch.Tensor | None,  # [T, topk] fp32; None: unweighted
    gate_up,  # the forward's g, u: [capacity_rows, 2, I] bf16, or its e4m3 pair (`_check_gate_up`)
    schedule: RoutingSchedule,
    swiglu_limit: float | None = None,
    quantize_d_gate_up: bool = False,
) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """The down dgrad's epilogue on a product computed elsewhere: (d_gate_up, d_topk_weights) as
    `down_dgrad_swiglu` from a, in the fp8_block tiles (BLOCK_N 128: the router-weight partials
    per 128 columns, as the fused kernel's). Only the rows of M tiles below `num_rows` are read.
    `quantize_d_gate_up`: as `down_dgrad_swiglu_fp8_block`'s."""
    saved = gate_up_parts(gate_up)[0]  # [capacity_rows, 2, I]
    device, inter = saved.device, saved.shape[-1]
    if product.dtype not in (torch.float32, torch.bfloat16) or tuple(product.shape) != (
        schedule.capacity_rows, inter
    ) or product.stride(1) != 1 or product.device != device:
        raise ValueError(f"product: expected an fp32 or bf16 tensor of shape {[schedule.capacity_rows, inter]} with "
                         f"unit column stride on {device}, got {product.dtype} {list(product.shape)} on "
                         f"{product.device}")
    _check_topk_weights(topk_weights, device)
    _check_gate_up(gate_up, schedule.capacity_rows, inter, device)
    return _launch_down_dgrad_epilogue(product, topk_weights, gate_up, schedule, swiglu_limit, quantize_d_gate_up)


def _launch_down_dgrad_epilogue(
    product, topk_weights, gate_up, schedule: RoutingSchedule, swiglu_limit: float | None, quantize: bool
) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """`down_dgrad_swiglu_epilogue` on checked operands."""
    cfg = dict(BLOCK_M=schedule.block_m, **fp8_block_tiles("down"))
    return _launch_down_dgrad_swiglu(
        "fp8_block", product, None, topk_weights, gate_up, None, None, schedule, 0, product.shape[-1], swiglu_limit,
        cfg, product_given=True, quantize=quantize,
    )


def _launch_gate_up_dgrad_scatter(
    precision: str, d_gate, d_gate_scale, d_up, d_up_scale, w_gate, w_gate_scale, w_up, w_up_scale,
    schedule: RoutingSchedule, num_slots: int, hidden: int, inter: int, cfg: dict, sorted_rows: bool = False,
) -> torch.Tensor:
    """One launch of `_gate_up_dgrad_scatter_kernel` (the scales are None in bf16), or, for a tile
    config with WARP_SPECIALIZED, of `hopper_scatter`'s kernel. `sorted_rows`: dx
    [capacity_rows, H], each row at its own index."""
    rows = schedule.capacity_rows if sorted_rows else num_slots
    dx = torch.empty(rows, hidden, dtype=torch.bfloat16, device=d_gate.device)  # [T·topk or capacity_rows, H]
    if cfg.get("WARP_SPECIALIZED", False):
        scales = None if d_gate_scale is None else (d_gate_scale, d_up_scale, w_gate_scale, w_up_scale)
        hopper_scatter.launch_gate_up_dgrad_scatter(d_gate, d_up, w_gate, w_up, dx, schedule, cfg, scales,
                                                    scatter=not sorted_rows)
        return dx
    programs = scatter_grid(schedule, hidden, cfg)
    cfg = {"PERSISTENT": False, "SPLIT_LAST_WAVE": False, **cfg}
    a_block = (cfg["BLOCK_M"], cfg["BLOCK_K"])
    b_block, b_half_block = _weight_block(precision, cfg), _weight_block(precision, last_wave_config(cfg))
    scales = (dx if s is None else s for s in (d_gate_scale, d_up_scale, w_gate_scale, w_up_scale))  # dx: unread
    _gate_up_dgrad_scatter_kernel[(programs,)](
        tma_descriptor(d_gate, a_block), tma_descriptor(d_up, a_block),
        tma_descriptor(w_gate, b_block), tma_descriptor(w_up, b_block),
        tma_descriptor(w_gate, b_half_block), tma_descriptor(w_up, b_half_block), dx,
        *scales,
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        hidden, inter, num_sms(dx.device), programs,
        dx.stride(0), 0 if d_gate_scale is None else d_gate_scale.stride(0),
        PRECISION=precision, INTERPRETER=interpreting(), SORTED=sorted_rows, **cfg,
    )
    return dx


def gate_up_dgrad_scatter(
    d_gate_up: torch.Tensor,  # [capacity_rows, 2, I] bf16
    w_gate: torch.Tensor,  # [E_l, I, H] bf16
    w_up: torch.Tensor,  # [E_l, I, H] bf16
    schedule: RoutingSchedule,
    num_slots: int,
    tile_config: dict | None = None,
) -> torch.Tensor:
    """dx_slots [num_slots, H] bf16: each sorted row's d_g·Wg[e] + d_u·Wu[e] stored at its
    slot row_source[r]. Slots no route points to are left unwritten."""
    num_experts, inter, hidden = w_gate.shape
    device = d_gate_up.device
    _check_weights("d_gate_up", d_gate_up, (schedule.capacity_rows, 2, inter), device)
    _check_weights("w_gate", w_gate, (schedule.num_local_experts, inter, hidden), device)
    _check_weights("w_up", w_up, tuple(w_gate.shape), device)
    cfg = _dgrad_tiles("gate_up", hidden, inter, "bf16", tile_config, schedule)
    return _launch_gate_up_dgrad_scatter(
        "bf16", d_gate_up[:, 0], None, d_gate_up[:, 1], None, w_gate, None, w_up, None,
        schedule, num_slots, hidden, inter, cfg,
    )


def gate_up_dgrad_scatter_fp8_block(
    d_gate_q: torch.Tensor,  # [capacity_rows, I] float8_e4m3fn, d_gate_up[:, 0] in 1×128 blocks
    d_gate_scale: torch.Tensor,  # [capacity_rows, I/128] fp32
    d_up_q: torch.Tensor,  # [capacity_rows, I] float8_e4m3fn, d_gate_up[:, 1] in 1×128 blocks
    d_up_scale: torch.Tensor,  # [capacity_rows, I/128] fp32
    w_gate_t_q: torch.Tensor,  # [E_l, H, I] float8_e4m3fn, w_gate's transposed copy
    w_gate_t_scale: torch.Tensor,  # [E_l, H/128, I/128] fp32
    w_up_t_q: torch.Tensor,  # [E_l, H, I] float8_e4m3fn, w_up's transposed copy
    w_up_t_scale: torch.Tensor,  # [E_l, H/128, I/128] fp32
    schedule: RoutingSchedule,
    num_slots: int,
    tile_config: dict | None = None,
    sorted_rows: bool = False,
) -> torch.Tensor:
    """The fp8_block gate/up dgrad: dx_slots [num_slots, H] bf16, as `gate_up_dgrad_scatter`
    (`sorted_rows`: dx [capacity_rows, H] in the sorted layout, as `down_scatter_fp8_block`'s).
    Each (q, scale) pair of d_g, d_u comes from `quantize_fp8_block_activations(d_gate_up[:, j])`,
    or is a column range of `down_dgrad_swiglu_fp8_block(..., quantize_d_gate_up=True)`'s pair
    (rows further apart; d_g's and d_u's scales with one row stride). Each weight pair is `q_t,
    scale_t` of `mok.fp8_block_quantize(w)`. Slots no route points to are left unwritten."""
    _, hidden, inter = fp8_block_weight_shape("w_gate_t_q", w_gate_t_q, "[E_l, H, I]", schedule.num_local_experts)
    device = w_gate_t_q.device
    for name, q, scale in (("d_gate", d_gate_q, d_gate_scale), ("d_up", d_up_q, d_up_scale)):
        check_fp8_block_pair(
            f"{name}_q", q, f"{name}_scale", scale, (schedule.capacity_rows, inter), (1, FP8_BLOCK), device,
            strided_rows=True,
        )
    if d_gate_scale.stride(0) != d_up_scale.stride(0):
        raise ValueError(f"d_up_scale: expected d_gate_scale's row stride {d_gate_scale.stride(0)}, got "
                         f"{d_up_scale.stride(0)}")
    for name, q, scale in (("w_gate_t", w_gate_t_q, w_gate_t_scale), ("w_up_t", w_up_t_q, w_up_t_scale)):
        check_fp8_block_pair(
            f"{name}_q", q, f"{name}_scale", scale, tuple(w_gate_t_q.shape), (FP8_BLOCK, FP8_BLOCK), device
        )
    cfg = _dgrad_tiles("gate_up", hidden, inter, "fp8_block", tile_config, schedule)
    return _launch_gate_up_dgrad_scatter(
        "fp8_block", d_gate_q, d_gate_scale, d_up_q, d_up_scale, w_gate_t_q, w_gate_t_scale, w_up_t_q, w_up_t_scale,
        schedule, num_slots, hidden, inter, cfg, sorted_rows=sorted_rows,
    )
