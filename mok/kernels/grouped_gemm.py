"""Grouped GEMMs of the expert MLPs over the expert-sorted row layout of `schedule.py`.

    gate/up:  h[r] = silu(x[src(r) // topk] · Wg[e]ᵀ) · (x[src(r) // topk] · Wu[e]ᵀ)   (fp32, stored bf16)
    down:     y[src(r)] = h[r] · Wd[e]ᵀ                                              (unweighted, bf16)

Legend: r a row of the sorted layout, src(r) = row_source[r] = t·topk + j (−1: padding),
e = tile_expert[r // BLOCK_M], H hidden, I intermediate size, E_l local experts.

The gate/up kernel gathers token rows by index inside its loads (no permuted copy of x),
or, where the tile config says `X_SORTED` (large I, see `gemm_config`), reads a copy of x
in the sorted layout through TMA (`gather.py`); g and u never leave registers before
SwiGLU: two accumulators, or (`PACKED`, gate and up weights in one allocation, see
`gate_up_packed`) one 2·BLOCK_N-wide accumulator split in the epilogue; with
`swiglu_limit` L it applies g ← min(g, L),
u ← clamp(u, −L, L) in fp32. When the backward needs them it also stores the
pre-activations g and u ([rows, 2, I] bf16), so the backward recomputes h from them
instead of redoing the gate/up GEMM.
The down kernel scatters each row's y straight into its combine slot src(r), so no
un-permute pass exists. Padding rows compute zeros and store nothing.
The down GEMM (and `dgrad.py`'s gate/up dgrad) may run persistent (tile-config flag
`PERSISTENT`): one program per SM walks the real tiles, so no program exits idle and a
tile's epilogue overlaps the next tile's loads; each tile's sum is unchanged. Launched one
program per tile instead, they split a last wave of at most half the SMs' tiles into column
halves (`SPLIT_LAST_WAVE`, `common.last_wave_tile_coordinates`): the number of M tiles
follows the routing, and a last wave of a few tiles would otherwise cost a whole tile's time
with most SMs idle. Each element keeps its K order, so the output is bitwise the same.

fp8_block (the constexpr PRECISION, launchers `*_fp8_block`): the same kernels
on E4M3 operands aq, wq with fp32 block scales, one per 1×128 block of an activation row
(sa: x's or h's) and one per 128×128 block of a weight (sw), applied per 128-wide K step:

    acc[r, n] = Σ_kb  sa[r, kb] · sw[e, n // 128, kb] · Σ_{k in block kb} aq[r, k] · wq[e, n, k]     (fp32)

BLOCK_K = 128, so each K step is one fresh FP8 `tl.dot` followed by one scaled fp32 add:
the DeepSeek-V3 recipe, which also bounds what Hopper's FP8 MMA loses to its narrow
internal accumulator to 128 terms. The gate/up A operand is x quantized once per token
(`quantize_fp8_block_activations`), gathered by index as in bf16. Its epilogue quantizes h
for the down GEMM with the quantizers' own device function (`quantize_row_blocks`, the
bit-exact rule of `mok.fp8_block`): BLOCK_N = 128, so each row of a tile is exactly one
1×128 block of h. h_q [rows, I] e4m3 and h_scale [rows, I/128] fp32 replace the bf16 h;
the down GEMM reads h_q through TMA. Hopper's FP8 MMA needs both operands K-major in
shared memory: gathered x rows, h rows and the [N, K] weight tiles all have K contiguous.
H and I must be multiples of 128, so no K step or h block is ragged.

What the fp8_block backward needs from this forward: g and u (`store_gate_up`, bf16, as in
bf16 mode) to recompute h and the SwiGLU derivative; h_q is not kept (the down wgrad
reduces over rows, so it needs h quantized along rows, not along I). Its dgrad GEMMs reduce
over I (gate/up) and H (down), so they read the weights' transposed copies (`q_t`,
`scale_t` of `mok.fp8_block_quantize`), K-major again; its wgrads reduce over rows, so a
separate quantizer (`quant.fp8_block.quantize_fp8_block_sorted_t`) re-quantizes their
operands along the rows (x_q's blocks run along H).

Every output element is computed by one program with a fixed K loop: deterministic.
Caller contract: the schedule was built for these tensors with the same BLOCK_M.
Tile configs are chosen per shape class by `gemm_config` (measured on H200, see
benchmarks/LOG.md); the key never includes per-expert counts, which change every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.fp8_block import FP8_BLOCK
from mok.kernels import warp_specialized
from mok.kernels.common import (
    column_halves,
    gate_up_parts,
    interpreting,
    last_wave_tile_coordinates,
    launch_programs,
    num_sms,
    round_to_bf16,
    tile_coordinates,
    tma_descriptor,
    tma_descriptor_pair,
)
from mok.kernels.routing.gather import gather_sorted_rows
from mok.kernels.plan import kernel_plan
from mok.kernels.quant.fp8_block import quantize_row_blocks
from mok.kernels.routing.schedule import RoutingSchedule
from mok.kernels.swiglu import fast_sigmoid_here, swiglu_forward

_SCALE_BLOCK = tl.constexpr(FP8_BLOCK)  # kernels read only constexpr globals


@triton.jit
def load_weight_tile(w_desc, expert, n0, k0, n_dim):
    """[BLOCK_K, BLOCK_N] tile of W[expert]ᵀ through a TMA descriptor over all experts' rows
    ([E·n_dim, k_dim], block [BLOCK_N, BLOCK_K]). Rows past this expert's n_dim belong to
    the next expert (zeros past the last): callers mask those columns at the store."""
    return w_desc.load([expert * n_dim + n0, k0]).T


@triton.jit
def weight_block_scale(w_scale_ptr, expert, n0, k0, n_dim, reduce_dim):
    """fp32 scale of the 128×128 block of W[expert] holding row n0 and column k0, from the
    contiguous [E, n_dim/128, reduce_dim/128] scales of `mok.fp8_block_quantize`."""
    block_row = expert.to(tl.int64) * (n_dim // _SCALE_BLOCK) + n0 // _SCALE_BLOCK
    return tl.load(w_scale_ptr + block_row * (reduce_dim // _SCALE_BLOCK) + k0 // _SCALE_BLOCK)


@triton.jit
def gather_gate_up_tile(
    x_ptr, x_scale_ptr, w_gate_desc, w_gate_scale_ptr, w_up_desc, w_up_scale_ptr,
    token, row_valid, m0, expert, n0, hidden, inter, stride_x_t,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr,
    X_SORTED: tl.constexpr, PACKED: tl.constexpr,
):
    """g, u [BLOCK_M, BLOCK_N] fp32 for token rows `token` (gathered from x inside the
    loads; X_SORTED: x_ptr is a TMA descriptor of x in the sorted layout, read at rows
    m0..) against rows n0.. of expert `expert`'s gate and up weights, reducing over H.
    PACKED (bf16): w_gate_desc covers both weights as one [2, E_l, I, H] tensor, and a K
    step is one [BLOCK_M, 2·BLOCK_N] dot over a box holding the gate and the up tile.
    fp8_block: x, weights e4m3 with their block scales (x_scale [T, H/128]); else bf16
    and the scale pointers unused."""
    if PACKED:
        acc_gate_up = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    else:
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_offs = tl.arange(0, BLOCK_K)
    if not X_SORTED:
        a_ptrs = x_ptr + token.to(tl.int64)[:, None] * stride_x_t + k_offs[None, :]
    for k0 in range(0, hidden, BLOCK_K):
        if X_SORTED:
            a = x_ptr.load([m0, k0])
        else:
            a = tl.load(a_ptrs + k0, mask=row_valid[:, None] & (k0 + k_offs < hidden)[None, :], other=0.0)
        if PACKED:
            b = w_gate_desc.load([0, expert, n0, k0]).reshape(2 * BLOCK_N, BLOCK_K).T  # [BLOCK_K, gate | up]
            if INTERPRETER:  # the interpreter's bf16 tl.dot is wrong (Triton 3.6-3.9); fp32 is exact
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc_gate_up = tl.dot(a, b, acc_gate_up)
        else:
            b_gate = load_weight_tile(w_gate_desc, expert, n0, k0, inter)
            b_up = load_weight_tile(w_up_desc, expert, n0, k0, inter)
            if PRECISION == "fp8_block":
                # No upcast: the interpreter's fp8 tl.dot is right (it reads the NaN byte as 480, but
                # a NaN block's scale is NaN too). Padding rows get scale 0, not token 0's, so their
                # h is exactly 0 even if x holds NaN.
                a_scale_ptrs = x_scale_ptr + token.to(tl.int64) * (hidden // _SCALE_BLOCK) + k0 // _SCALE_BLOCK
                a_scale = tl.load(a_scale_ptrs, mask=row_valid, other=0.0)  # [BLOCK_M] fp32
                gate_scale = weight_block_scale(w_gate_scale_ptr, expert, n0, k0, inter, hidden)
                up_scale = weight_block_scale(w_up_scale_ptr, expert, n0, k0, inter, hidden)
                acc_gate += tl.dot(a, b_gate) * (a_scale[:, None] * gate_scale)
                acc_up += tl.dot(a, b_up) * (a_scale[:, None] * up_scale)
            else:
                if INTERPRETER:
                    a, b_gate, b_up = a.to(tl.float32), b_gate.to(tl.float32), b_up.to(tl.float32)
                acc_gate = tl.dot(a, b_gate, acc_gate)
                acc_up = tl.dot(a, b_up, acc_up)
    if PACKED:
        acc_gate, acc_up = column_halves(acc_gate_up)
    return acc_gate, acc_up


@triton.jit
def _gate_up_swiglu_kernel(
    # pointers (h: bf16, or e4m3 bytes with h_scale in fp8_block; gate_up [rows, 2, I]: bf16, or e4m3
    # bytes with GATE_UP_E4M3)
    x_ptr, w_gate_desc, w_up_desc, h_ptr, gate_up_ptr,
    # fp8_block scales (unused in bf16): x [T, H/128], weights [E_l, I/128, H/128], h [rows, I/128];
    # GATE_UP_E4M3: g's and u's, written [rows, 2, I/128]
    x_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr, h_scale_ptr, gate_up_scale_ptr,
    # schedule
    row_source_ptr, tile_expert_ptr, num_rows_ptr,
    # sizes
    hidden, inter, topk, max_m_tiles, swiglu_limit,
    # strides
    stride_x_t, stride_h_r, stride_gu_r,
    # meta
    PRECISION: tl.constexpr, HAS_LIMIT: tl.constexpr, STORE_GATE_UP: tl.constexpr, GATE_UP_E4M3: tl.constexpr,
    INTERPRETER: tl.constexpr, FAST_SIGMOID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, X_SORTED: tl.constexpr, PACKED: tl.constexpr,
):
    m_tile, n_tile = tile_coordinates(tl.program_id(0), max_m_tiles, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if m_tile * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(tile_expert_ptr + m_tile)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    source = tl.load(row_source_ptr + rows)
    row_valid = source >= 0
    token = tl.where(row_valid, source // topk, 0)
    n_offs = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    gate, up = gather_gate_up_tile(
        x_ptr, x_scale_ptr, w_gate_desc, w_gate_scale_ptr, w_up_desc, w_up_scale_ptr,
        token, row_valid, m_tile * BLOCK_M, expert, n_tile * BLOCK_N, hidden, inter, stride_x_t,
        PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETER, X_SORTED, PACKED,
    )
    out_mask = n_offs[None, :] < inter
    rows64 = rows.to(tl.int64)[:, None]
    h = swiglu_forward(gate, up, swiglu_limit, HAS_LIMIT, FAST_SIGMOID)
    if PRECISION == "fp8_block":  # BLOCK_N == 128: each tile row is one 1×128 block of h
        h_q, h_scale = quantize_row_blocks(h, INTERPRETER)  # [BLOCK_M, 128] uint8, [BLOCK_M, 1] fp32
        tl.store(h_ptr + rows64 * stride_h_r + n_offs[None, :], h_q, mask=out_mask)
        tl.store(h_scale_ptr + rows64 * (inter // _SCALE_BLOCK) + n_tile, h_scale)
    else:
        tl.store(h_ptr + rows64 * stride_h_r + n_offs[None, :], round_to_bf16(h, INTERPRETER), mask=out_mask)
    if STORE_GATE_UP:
        gu_ptrs = gate_up_ptr + rows64 * stride_gu_r + n_offs[None, :]
        if GATE_UP_E4M3:  # as h: each tile row one 1×128 block of g and one of u
            gate_q, gate_scale = quantize_row_blocks(gate, INTERPRETER)
            up_q, up_scale = quantize_row_blocks(up, INTERPRETER)
            tl.store(gu_ptrs, gate_q, mask=out_mask)
            tl.store(gu_ptrs + inter, up_q, mask=out_mask)
            gu_scale_ptrs = gate_up_scale_ptr + rows64 * (2 * inter // _SCALE_BLOCK) + n_tile
            tl.store(gu_scale_ptrs, gate_scale)
            tl.store(gu_scale_ptrs + inter // _SCALE_BLOCK, up_scale)
        else:
            tl.store(gu_ptrs, round_to_bf16(gate, INTERPRETER), mask=out_mask)
            tl.store(gu_ptrs + inter, round_to_bf16(up, INTERPRETER), mask=out_mask)


@triton.jit
def sorted_rows_tile(
    a_desc, a_scale_ptr, w_desc, w_scale_ptr, m0, expert, n0, reduce_dim, n_dim, stride_a_scale_r, acc,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """acc + a[m0 : m0+BLOCK_M] · W[expert][n0 : n0+BLOCK_N]ᵀ, [BLOCK_M, BLOCK_N] fp32, over
    contiguous sorted rows; both operands through TMA descriptors, W[expert] [n_dim,
    reduce_dim] (K-major). fp8_block: both e4m3 with their block scales (a_scale [rows,
    reduce_dim/128] with rows `stride_a_scale_r` apart; BLOCK_N divides 128, so one weight scale
    per step); else bf16 and the scale pointers unused. Also the fp8_block dgrad GEMMs' main
    loop (`dgrad.py`)."""
    for k0 in range(0, reduce_dim, BLOCK_K):
        a = a_desc.load([m0, k0])
        b = load_weight_tile(w_desc, expert, n0, k0, n_dim)
        if PRECISION == "fp8_block":
            rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
            a_scale = tl.load(a_scale_ptr + rows * stride_a_scale_r + k0 // _SCALE_BLOCK)  # [BLOCK_M] fp32
            w_scale = weight_block_scale(w_scale_ptr, expert, n0, k0, n_dim, reduce_dim)
            acc += tl.dot(a, b) * (a_scale[:, None] * w_scale)
        else:
            if INTERPRETER:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def gathered_rows_tile_fp8(
    a_ptr, a_scale_ptr, token, row_valid, w_desc, w_scale_ptr, expert, n0, reduce_dim, n_dim, stride_a_t, acc,
    BLOCK_K: tl.constexpr,
):
    """acc + Σ_kb (a[token] · W[expert][n0 : n0+BLOCK_N]ᵀ) with the fp8_block scales applied per
    K step: a's rows gathered by token from e4m3 token rows [T, reduce_dim] (scales [T,
    reduce_dim/128]), W[expert] [n_dim, reduce_dim] (K-major) through `w_desc`. Rows not
    `row_valid` (padding) read zeros with scale 0, so they add exactly nothing. `sorted_rows_tile`
    with a's rows gathered by index instead of through TMA: the fp8_block down dgrad's main loop
    where it reads dOut's token rows (`dgrad.py`)."""
    k_offs = tl.arange(0, BLOCK_K)
    token64 = token.to(tl.int64)
    a_ptrs = a_ptr + token64[:, None] * stride_a_t + k_offs[None, :]
    a_scale_ptrs = a_scale_ptr + token64 * (reduce_dim // _SCALE_BLOCK)
    for k0 in range(0, reduce_dim, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=row_valid[:, None], other=0.0)
        b = load_weight_tile(w_desc, expert, n0, k0, n_dim)
        a_scale = tl.load(a_scale_ptrs + k0 // _SCALE_BLOCK, mask=row_valid, other=0.0)  # [BLOCK_M] fp32
        w_scale = weight_block_scale(w_scale_ptr, expert, n0, k0, n_dim, reduce_dim)
        acc += tl.dot(a, b) * (a_scale[:, None] * w_scale)
    return acc


@triton.jit
def scatter_rows_to_slots(
    out_ptr, tile, row_source_ptr, rows, n_offs, n_dim, stride_out_s,
    SORTED: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """out[row_source[r], n_offs] = bf16(tile[r]) for each sorted row r of the tile; padding
    rows (source −1) and columns past n_dim store nothing. SORTED: every row to out[r] instead
    (padding rows too), the sorted layout that `combine` gathers."""
    values = round_to_bf16(tile, INTERPRETER)
    col_ok = (n_offs < n_dim)[None, :]
    if SORTED:
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out_s + n_offs[None, :], values, mask=col_ok)
        return
    source = tl.load(row_source_ptr + rows)
    slot = tl.where(source >= 0, source, 0).to(tl.int64)
    tl.store(out_ptr + slot[:, None] * stride_out_s + n_offs[None, :], values, mask=(source >= 0)[:, None] & col_ok)


@triton.jit
def _down_tile(
    h_desc, w_down_desc, y_ptr, h_scale_ptr, w_down_scale_ptr, row_source_ptr, tile_expert_ptr, m_tile, n_tile,
    hidden, inter, stride_y_s,
    PRECISION: tl.constexpr, INTERPRETER: tl.constexpr, SORTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of the down GEMM, scattered to its rows' slots (SORTED: stored
    at its rows)."""
    expert = tl.load(tile_expert_ptr + m_tile)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    n_offs = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    y = sorted_rows_tile(
        h_desc, h_scale_ptr, w_down_desc, w_down_scale_ptr, m_tile * BLOCK_M, expert, n_tile * BLOCK_N, inter, hidden,
        inter // _SCALE_BLOCK, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        INTERPRETER,
    )
    scatter_rows_to_slots(y_ptr, y, row_source_ptr, rows, n_offs, hidden, stride_y_s, SORTED, INTERPRETER)


@triton.jit
def _down_scatter_kernel(
    # pointers (h, w_down: bf16, or e4m3 with their scales in fp8_block; w_down_half_desc: blocks
    # of BLOCK_N // 2 rows, read by the last wave's half tiles with SPLIT_LAST_WAVE)
    h_desc, w_down_desc, w_down_half_desc, y_ptr,
    # fp8_block scales (unused in bf16): h [rows, I/128], w_down [E_l, H/128, I/128]
    h_scale_ptr, w_down_scale_ptr,
    # schedule
    row_source_ptr, tile_expert_ptr, num_rows_ptr,
    # sizes (num_programs: the grid)
    hidden, inter, num_sms, num_programs,
    # strides
    stride_y_s,
    # meta
    PRECISION: tl.constexpr, INTERPRETER: tl.constexpr,
    SORTED: tl.constexpr,  # y in the sorted layout [capacity_rows, H] instead of route slots
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, SPLIT_LAST_WAVE: tl.constexpr,
):
    num_n_tiles = tl.cdiv(hidden, BLOCK_N)
    num_m_tiles = tl.cdiv(tl.load(num_rows_ptr), BLOCK_M)
    # Two call sites, not one loop over a one-tile range in the per-tile case: that form
    # compiled (sm_90a, triton 3.6) to 254 registers and 472 B of spills against 194 and none.
    if PERSISTENT:  # num_programs programs walk the real tiles; the flattened loop overlaps a
        # tile's epilogue with the next tile's first loads
        for tile in tl.range(tl.program_id(0), num_m_tiles * num_n_tiles, num_programs, flatten=True):
            m_tile, n_tile = tile_coordinates(tile, num_m_tiles, num_n_tiles, GROUP_M)
            _down_tile(h_desc, w_down_desc, y_ptr, h_scale_ptr, w_down_scale_ptr, row_source_ptr, tile_expert_ptr,
                       m_tile, n_tile, hidden, inter, stride_y_s, PRECISION, INTERPRETER, SORTED, BLOCK_M, BLOCK_N,
                       BLOCK_K)
    else:
        m_tile, n_tile, half = last_wave_tile_coordinates(
            tl.program_id(0), num_m_tiles, num_n_tiles, num_sms, GROUP_M, SPLIT_LAST_WAVE)
        if (m_tile >= 0) & (half < 0):
            _down_tile(h_desc, w_down_desc, y_ptr, h_scale_ptr, w_down_scale_ptr, row_source_ptr, tile_expert_ptr,
                       m_tile, n_tile, hidden, inter, stride_y_s, PRECISION, INTERPRETER, SORTED, BLOCK_M, BLOCK_N,
                       BLOCK_K)
        if SPLIT_LAST_WAVE:
            if half >= 0:
                _down_tile(h_desc, w_down_half_desc, y_ptr, h_scale_ptr, w_down_scale_ptr, row_source_ptr,
                           tile_expert_ptr, m_tile, 2 * n_tile + half, hidden, inter, stride_y_s, PRECISION,
                           INTERPRETER, SORTED, BLOCK_M, BLOCK_N // 2, BLOCK_K)


# --------------------------------------------------------------------------- configs

# Tile sizes, thresholds and variant flags are the kernel plan's (`plan.KernelPlan`, with each
# choice's reasons and records).


def gemm_config(
    kind: str, n_dim: int, reduce_dim: int, precision: str = "bf16", packed_gate_up: bool = False,
    allow_warp_specialized: bool = True,
) -> dict:
    """Tile config for a GEMM of output width n_dim and reduction reduce_dim (gate/up:
    `packed_gate_up` when its weights are one tensor, `gate_up_packed`; down:
    `allow_warp_specialized` False keeps the Triton kernel).

    H200, bf16, chosen by `benchmarks/tune_gemm.py` on the three GPU presets (records
    h200-20261130-gemm-tiles.json, -tiles-v2.json): 128×128 tiles with two accumulators
    for gate/up and 128×256 for the single-accumulator down GEMM at 8 warps, 4 stages;
    TMA loads of the weights beat pointer loads; 128×64 / 64×128 tiles at 4 warps lose;
    gate/up reads x copied to the sorted layout from
    `sorted_x_min_inter` on, unless it takes packed weights (`packed_max_inter`); the
    down GEMM runs persistent up to `persistent_down_max_inter` (record
    h200-20261130-persistent.json), and per tile above it, its last wave in column halves
    with `split_last_wave`. Under the interpreter, small tiles keep the CPU tests
    fast (BLOCK_M 32, a whole MXFP8 block of rows).
    On Hopper the bf16 down GEMM into local slots runs warp-specialized (ping-pong) up to
    `ping_pong_down_max_inter`, and cooperative above it with `cooperative_down`.
    fp8_block: the plan's `fp8_block_*_tile`, the same for every shape until measured; on Hopper the down
    GEMM into local slots warp-specialized with `warp_specialized_fp8_block_down`, the gate/up
    GEMM with `warp_specialized_fp8_block_gate_up`. Every threshold and flag named here is a
    field of the kernel plan (`plan.kernel_plan`).
    """
    plan = kernel_plan()
    if precision == "fp8_block":
        measured_faster = {"down": plan.warp_specialized_fp8_block_down,
                           "gate_up": plan.warp_specialized_fp8_block_gate_up}[kind]
        if measured_faster and allow_warp_specialized and plan.warp_specialized:
            return warp_specialized.fp8_block_tile_config()
        return dict(plan.fp8_block_interpreter_tile if interpreting() else
                    {"down": plan.fp8_block_down_tile, "gate_up": plan.fp8_block_gate_up_tile}[kind])
    if interpreting():
        split = dict(SPLIT_LAST_WAVE=plan.split_last_wave) if kind == "down" else {}
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1, **split)
    if kind == "gate_up":
        packed = packed_gate_up and n_dim < plan.packed_max_inter
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=plan.gemm_group_m, num_warps=8, num_stages=4,
                    PACKED=packed, X_SORTED=not packed and n_dim >= plan.sorted_x_min_inter)
    cooperative = reduce_dim > plan.ping_pong_down_max_inter
    if allow_warp_specialized and (plan.cooperative_down or not cooperative) and plan.warp_specialized:
        return warp_specialized.tile_config(cooperative)
    persistent = reduce_dim <= plan.persistent_down_max_inter
    return dict(BLOCK_M=128, BLOCK_N=256 if n_dim >= 2048 else 128, BLOCK_K=64, GROUP_M=plan.gemm_group_m, num_warps=8,
                num_stages=3 if persistent else 4, PERSISTENT=persistent, SPLIT_LAST_WAVE=plan.split_last_wave)


def routing_block_m() -> int:
    """The M tile every grouped GEMM of a schedule uses (the schedule pads experts to it)."""
    return gemm_config("gate_up", 0, 0)["BLOCK_M"]


def checked_tile_config(
    tile_config: dict | None, default: dict, schedule: RoutingSchedule, precision: str, what: str, whole_block_n: bool
) -> dict:
    """`tile_config` or `default`, checked against the schedule's M tile and, in fp8_block,
    the scale block (`what` names the GEMM in errors; `whole_block_n`: BLOCK_N must be 128).
    The warp-specialized kernels check their fp8_block tiles themselves."""
    cfg = tile_config or default
    if cfg["BLOCK_M"] != schedule.block_m:
        raise ValueError(f"schedule: expected block_m {cfg['BLOCK_M']}, got {schedule.block_m}")
    if precision == "fp8_block" and not cfg.get("WARP_SPECIALIZED", False):
        check_fp8_block_tiles(cfg, what, whole_block_n)
    return cfg


def _tile_config(
    kind: str, n_dim: int, reduce_dim: int, precision: str, tile_config: dict | None, schedule: RoutingSchedule,
    packed_gate_up: bool = False, allow_warp_specialized: bool = True,
) -> dict:
    default = gemm_config(kind, n_dim, reduce_dim, precision, packed_gate_up, allow_warp_specialized)
    return checked_tile_config(tile_config, default, schedule, precision, kind, kind == "gate_up")


def check_fp8_block_tiles(cfg: dict, gemm: str, whole_block_n: bool) -> None:
    """fp8_block tiles: BLOCK_K is the scale block; BLOCK_N is it too when an epilogue
    quantizes each tile row as one 1×128 block (`whole_block_n`), else a divisor of it (one
    weight scale per K step)."""
    n_ok = cfg["BLOCK_N"] == FP8_BLOCK if whole_block_n else FP8_BLOCK % cfg["BLOCK_N"] == 0
    if cfg["BLOCK_K"] != FP8_BLOCK or not n_ok:
        want_n = f"{FP8_BLOCK}" if whole_block_n else f"a divisor of {FP8_BLOCK}"
        raise ValueError(
            f"tile_config: expected BLOCK_K {FP8_BLOCK} and BLOCK_N {want_n} for the fp8_block {gemm} GEMM, "
            f"got BLOCK_K {cfg['BLOCK_K']} BLOCK_N {cfg['BLOCK_N']}"
        )


# --------------------------------------------------------------------------- launchers


def _check_weights(name: str, w: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if w.dtype != torch.bfloat16 or tuple(w.shape) != shape or not w.is_contiguous() or w.device != device:
        raise ValueError(
            f"{name}: expected a contiguous bf16 tensor of shape {list(shape)} on {device}, "
            f"got {w.dtype} {list(w.shape)} on {w.device}"
        )


def _rows_strided(t: torch.Tensor, alignment: int) -> bool:
    """A 2-D tensor whose rows are contiguous and `alignment` bytes apart or a multiple of that."""
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % alignment == 0


def check_fp8_block_pair(
    q_name: str, q: torch.Tensor, scale_name: str, scale: torch.Tensor, shape: tuple[int, ...],
    block: tuple[int, int], device: torch.device, strided_rows: bool = False,
) -> None:
    """q: contiguous e4m3 of `shape` on `device`; scale: contiguous fp32, one per `block` of q's
    last two dims. With `strided_rows` (2-D pairs) each may also have rows further apart, as
    views of a wider tensor's column range are: q's a multiple of 16 bytes (its TMA descriptor)."""
    *lead, rows, cols = shape
    scale_shape = (*lead, rows // block[0], cols // block[1])
    checks = ((q_name, q, torch.float8_e4m3fn, shape), (scale_name, scale, torch.float32, scale_shape))
    for name, t, dtype, want in checks:
        laid_out = t.is_contiguous() or (strided_rows and _rows_strided(t, 16 if name == q_name else 4))
        if t.dtype != dtype or tuple(t.shape) != want or not laid_out or t.device != device:
            layout = "" if laid_out else " non-contiguous"
            expected = "a row-contiguous" if strided_rows else "a contiguous"
            raise ValueError(
                f"{name}: expected {expected} {str(dtype).removeprefix('torch.')} tensor of shape {list(want)} "
                f"on {device}, got {t.dtype} {list(t.shape)}{layout} on {t.device}"
            )


def fp8_block_weight_shape(name: str, w: torch.Tensor, layout: str, num_local_experts: int) -> tuple[int, int, int]:
    """[E_l, N, K] of a quantized weight whose N and K are multiples of the scale block."""
    if w.dim() != 3 or w.shape[0] != num_local_experts or w.shape[1] % FP8_BLOCK or w.shape[2] % FP8_BLOCK:
        raise ValueError(
            f"{name}: expected a 3-D {layout} tensor with E_l = {num_local_experts} (the schedule's) and "
            f"both other sizes multiples of {FP8_BLOCK} (fp8_block), got shape {list(w.shape)}"
        )
    return tuple(w.shape)


def gate_up_packed(w_gate: torch.Tensor, w_up: torch.Tensor) -> bool:
    """Whether w_up starts where w_gate ends, both contiguous and alike: one [2, E_l, I, H]
    tensor, as `MoKMoE` and `mok.pack_gate_up` store them. The gate/up GEMM can then load a
    gate tile and an up tile as one TMA box and multiply them in one 2·BLOCK_N-wide dot,
    which reads the x tile from shared memory once per K step instead of twice (tile-config
    flag PACKED, where the plan's `packed_max_inter` says it measured faster); two dots, as for
    separate tensors, give bitwise the same result."""
    return (
        w_gate.is_contiguous() and w_up.is_contiguous() and w_up.shape == w_gate.shape
        and w_up.dtype == w_gate.dtype and w_up.device == w_gate.device
        and w_up.data_ptr() == w_gate.data_ptr() + w_gate.numel() * w_gate.element_size()
    )


def _launch_gate_up_swiglu(
    precision: str, x, x_scale, w_gate, w_gate_scale, w_up, w_up_scale, h, h_scale, gate_up,
    schedule: RoutingSchedule, topk: int, swiglu_limit: float | None, cfg: dict,
) -> None:
    """One launch of `_gate_up_swiglu_kernel`; the scales are None in bf16. gate_up: None, bf16
    [rows, 2, I], or (fp8_block) the pair (e4m3 bytes [rows, 2, I], scales [rows, 2, I/128]). bf16 only:
    cfg["X_SORTED"]: x is first copied to the sorted layout and read through TMA;
    cfg["PACKED"]: the weights, one [2, E_l, I, H] tensor (`gate_up_packed`), are read as such."""
    inter, hidden = w_gate.shape[1], w_gate.shape[2]
    cfg = dict(cfg)
    x_sorted = cfg.pop("X_SORTED", False)
    packed = cfg.pop("PACKED", False)
    if packed and not gate_up_packed(w_gate, w_up):
        raise ValueError("tile_config: PACKED needs w_gate and w_up stored as one tensor (mok.pack_gate_up)")
    x_operand = x
    if x_sorted:  # [capacity_rows, H], zeros at padding rows
        x_copy = gather_sorted_rows(x, None, None, schedule, topk)[0]
        x_operand = tma_descriptor(x_copy, (cfg["BLOCK_M"], cfg["BLOCK_K"]))
    grid = (schedule.max_tiles * triton.cdiv(inter, cfg["BLOCK_N"]),)
    if packed:
        w_gate_desc = w_up_desc = tma_descriptor_pair(w_gate, (2, 1, cfg["BLOCK_N"], cfg["BLOCK_K"]))
    else:
        w_gate_desc, w_up_desc = (tma_descriptor(w, (cfg["BLOCK_N"], cfg["BLOCK_K"])) for w in (w_gate, w_up))
    gate_up, gate_up_scale = gate_up_parts(gate_up)
    gate_up_e4m3 = gate_up_scale is not None
    scales = (x if s is None else s for s in (x_scale, w_gate_scale, w_up_scale, h_scale, gate_up_scale))  # x: unread
    _gate_up_swiglu_kernel[grid](
        x_operand, w_gate_desc, w_up_desc, h, h if gate_up is None else gate_up,
        *scales,
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        hidden, inter, topk, schedule.max_tiles, 0.0 if swiglu_limit is None else float(swiglu_limit),
        x.stride(0), h.stride(0), 2 * inter,
        PRECISION=precision, HAS_LIMIT=swiglu_limit is not None, STORE_GATE_UP=gate_up is not None,
        GATE_UP_E4M3=gate_up_e4m3,
        INTERPRETER=interpreting(), FAST_SIGMOID=fast_sigmoid_here(), X_SORTED=x_sorted, PACKED=packed, **cfg,
    )


def gate_up_swiglu(
    x: torch.Tensor,  # [T, H] bf16
    w_gate: torch.Tensor,  # [E_l, I, H] bf16
    w_up: torch.Tensor,  # [E_l, I, H] bf16
    schedule: RoutingSchedule,
    topk: int,
    swiglu_limit: float | None = None,
    store_gate_up: bool = False,
    tile_config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [capacity_rows, I] bf16 in the schedule's sorted layout, and g,u [capacity_rows, 2, I]
    bf16 when `store_gate_up`. Rows past the schedule's `num_rows` are left unwritten.
    `tile_config` overrides `gemm_config` (for tuning)."""
    num_experts, inter, hidden = w_gate.shape
    if x.dim() != 2 or x.shape[1] != hidden or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous bf16 [T, {hidden}] tensor, got {x.dtype} {list(x.shape)}")
    _check_weights("w_gate", w_gate, (schedule.num_local_experts, inter, hidden), x.device)
    _check_weights("w_up", w_up, tuple(w_gate.shape), x.device)
    cfg = _tile_config("gate_up", inter, hidden, "bf16", tile_config, schedule, gate_up_packed(w_gate, w_up))
    rows = schedule.capacity_rows
    h = torch.empty(rows, inter, dtype=torch.bfloat16, device=x.device)  # [capacity_rows, I]
    gate_up = torch.empty(rows, 2, inter, dtype=torch.bfloat16, device=x.device) if store_gate_up else None
    _launch_gate_up_swiglu(
        "bf16", x, None, w_gate, None, w_up, None, h, None, gate_up, schedule, topk, swiglu_limit, cfg
    )
    return h, gate_up


def gate_up_swiglu_fp8_block(
    x_q: torch.Tensor,  # [T, H] float8_e4m3fn
    x_scale: torch.Tensor,  # [T, H/128] fp32
    w_gate_q: torch.Tensor,  # [E_l, I, H] float8_e4m3fn
    w_gate_scale: torch.Tensor,  # [E_l, I/128, H/128] fp32
    w_up_q: torch.Tensor,  # [E_l, I, H] float8_e4m3fn
    w_up_scale: torch.Tensor,  # [E_l, I/128, H/128] fp32
    schedule: RoutingSchedule,
    topk: int,
    swiglu_limit: float | None = None,
    store_gate_up: bool = False,
    tile_config: dict | None = None,
    gate_up_e4m3: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None]:
    """The fp8_block gate/up GEMM: (h_q [capacity_rows, I] float8_e4m3fn, h_scale
    [capacity_rows, I/128] fp32), h quantized in 1×128 blocks for `down_scatter_fp8_block`,
    and g,u [capacity_rows, 2, I] bf16 when `store_gate_up`; with `gate_up_e4m3` too, g,u in
    1×128 blocks along I as h is, the pair (float8_e4m3fn [capacity_rows, 2, I], fp32
    [capacity_rows, 2, I/128]): DeepSeek-V3's SwiGLU input cached in FP8 for the backward, half
    the bytes (without a swiglu_limit: its clamps' zero gradients need g, u exactly). x_q, x_scale come from
    `quantize_fp8_block_activations(x)`, each weight pair from `mok.fp8_block_quantize`
    (its q, scale). Rows past the schedule's `num_rows` are left unwritten."""
    _, inter, hidden = fp8_block_weight_shape("w_gate_q", w_gate_q, "[E_l, I, H]", schedule.num_local_experts)
    device = w_gate_q.device
    if x_q.dim() != 2:
        raise ValueError(f"x_q: expected a 2-D [T, {hidden}] float8_e4m3fn tensor, got shape {list(x_q.shape)}")
    check_fp8_block_pair("x_q", x_q, "x_scale", x_scale, (x_q.shape[0], hidden), (1, FP8_BLOCK), device)
    for name, q, scale in (("w_gate", w_gate_q, w_gate_scale), ("w_up", w_up_q, w_up_scale)):
        check_fp8_block_pair(
            f"{name}_q", q, f"{name}_scale", scale, tuple(w_gate_q.shape), (FP8_BLOCK, FP8_BLOCK), device
        )
    if gate_up_e4m3 and (not store_gate_up or swiglu_limit is not None):
        raise ValueError(f"gate_up_e4m3: expected store_gate_up=True and no swiglu_limit, got store_gate_up="
                         f"{store_gate_up}, swiglu_limit={swiglu_limit}")
    cfg = _tile_config("gate_up", inter, hidden, "fp8_block", tile_config, schedule)
    rows = schedule.capacity_rows
    h_q = torch.empty(rows, inter, dtype=torch.uint8, device=device)  # [capacity_rows, I] e4m3 bytes
    h_scale = torch.empty(rows, inter // FP8_BLOCK, dtype=torch.float32, device=device)  # [capacity_rows, I/128]
    gate_up = None
    if gate_up_e4m3:  # [capacity_rows, 2, I] e4m3 bytes, [capacity_rows, 2, I/128] fp32
        gate_up = (torch.empty(rows, 2, inter, dtype=torch.uint8, device=device),
                   torch.empty(rows, 2, inter // FP8_BLOCK, dtype=torch.float32, device=device))
    elif store_gate_up:  # [capacity_rows, 2, I] bf16
        gate_up = torch.empty(rows, 2, inter, dtype=torch.bfloat16, device=device)
    if cfg.get("WARP_SPECIALIZED", False):
        warp_specialized.launch_gate_up_swiglu_fp8_block(x_q, x_scale, w_gate_q, w_gate_scale, w_up_q, w_up_scale, h_q,
                                                         h_scale, gate_up, schedule, topk, swiglu_limit, cfg)
    else:
        _launch_gate_up_swiglu(
            "fp8_block", x_q, x_scale, w_gate_q, w_gate_scale, w_up_q, w_up_scale, h_q, h_scale, gate_up,
            schedule, topk, swiglu_limit, cfg,
        )
    if gate_up_e4m3:
        gate_up = (gate_up[0].view(torch.float8_e4m3fn), gate_up[1])
    return h_q.view(torch.float8_e4m3fn), h_scale, gate_up


def scatter_grid(schedule: RoutingSchedule, hidden: int, cfg: dict) -> int:
    """Programs of a launch whose tiles cover [schedule rows, hidden] (the down GEMM, the
    gate/up dgrad): one per tile, or with cfg["PERSISTENT"] one per SM (at most one per
    tile); one per tile with cfg["SPLIT_LAST_WAVE"], num_sms // 2 more for the last wave's
    half tiles (`common.last_wave_tile_coordinates`; persistent launches keep whole tiles)."""
    device = schedule.row_source.device
    programs = launch_programs(schedule.max_tiles * triton.cdiv(hidden, cfg["BLOCK_N"]), cfg, device)
    return programs + (num_sms(device) // 2 if splits_last_wave(cfg) else 0)


def splits_last_wave(cfg: dict) -> bool:
    """Whether a launch with tile config `cfg` computes its last wave's tiles as column halves:
    SPLIT_LAST_WAVE on a per-tile (not persistent) launch."""
    return cfg.get("SPLIT_LAST_WAVE", False) and not cfg.get("PERSISTENT", False)


def last_wave_config(cfg: dict) -> dict:
    """The tile config of the last wave's half tiles (SPLIT_LAST_WAVE): BLOCK_N halved, for
    their weights' TMA blocks; `cfg` itself when it does not split."""
    return dict(cfg, BLOCK_N=cfg["BLOCK_N"] // 2) if splits_last_wave(cfg) else cfg


def _launch_down_scatter(
    precision: str, h, h_scale, w_down, w_down_scale, y, schedule: RoutingSchedule, cfg: dict,
    sorted_rows: bool = False,
) -> None:
    """One launch of `_down_scatter_kernel` (the scales are None in bf16), or, for a tile config
    with WARP_SPECIALIZED, of `warp_specialized`'s kernel. `sorted_rows`: y [capacity_rows, H],
    each row at its own index."""
    if cfg.get("WARP_SPECIALIZED", False):
        scales = None if h_scale is None else (h_scale, w_down_scale)
        warp_specialized.launch_down_scatter(h, w_down, y, schedule, cfg, scales, scatter=not sorted_rows)
        return
    hidden, inter = w_down.shape[1], w_down.shape[2]
    programs = scatter_grid(schedule, hidden, cfg)
    cfg = {"PERSISTENT": False, "SPLIT_LAST_WAVE": False, **cfg}
    half = last_wave_config(cfg)
    _down_scatter_kernel[(programs,)](
        tma_descriptor(h, (cfg["BLOCK_M"], cfg["BLOCK_K"])),
        tma_descriptor(w_down, (cfg["BLOCK_N"], cfg["BLOCK_K"])),
        tma_descriptor(w_down, (half["BLOCK_N"], cfg["BLOCK_K"])),
        y,
        y if h_scale is None else h_scale, y if w_down_scale is None else w_down_scale,
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        hidden, inter, num_sms(y.device), programs,
        y.stride(0),
        PRECISION=precision, INTERPRETER=interpreting(), SORTED=sorted_rows, **cfg,
    )


def down_scatter(
    h: torch.Tensor,  # [capacity_rows, I] bf16
    w_down: torch.Tensor,  # [E_l, H, I] bf16
    schedule: RoutingSchedule,
    num_slots: int,
    tile_config: dict | None = None,
) -> torch.Tensor:
    """y [num_slots, H] bf16: each sorted row's unweighted output stored at its slot
    row_source[r]. Slots no route points to are left unwritten."""
    num_experts, hidden, inter = w_down.shape
    if h.dim() != 2 or h.shape != (schedule.capacity_rows, inter) or h.dtype != torch.bfloat16:
        raise ValueError(f"h: expected a bf16 [{schedule.capacity_rows}, {inter}] tensor, got {h.dtype} {list(h.shape)}")
    _check_weights("w_down", w_down, (schedule.num_local_experts, hidden, inter), h.device)
    cfg = _tile_config("down", hidden, inter, "bf16", tile_config, schedule)
    y = torch.empty(num_slots, hidden, dtype=torch.bfloat16, device=h.device)  # [T·topk, H]
    _launch_down_scatter("bf16", h, None, w_down, None, y, schedule, cfg)
    return y


def down_scatter_fp8_block(
    h_q: torch.Tensor,  # [capacity_rows, I] float8_e4m3fn
    h_scale: torch.Tensor,  # [capacity_rows, I/128] fp32
    w_down_q: torch.Tensor,  # [E_l, H, I] float8_e4m3fn
    w_down_scale: torch.Tensor,  # [E_l, H/128, I/128] fp32
    schedule: RoutingSchedule,
    num_slots: int,
    tile_config: dict | None = None,
    sorted_rows: bool = False,
) -> torch.Tensor:
    """The fp8_block down GEMM: y [num_slots, H] bf16, each sorted row's unweighted output
    at its slot row_source[r], from `gate_up_swiglu_fp8_block`'s h_q, h_scale and
    `mok.fp8_block_quantize(w_down)`'s q, scale. Slots no route points to are left unwritten.
    `sorted_rows`: y [capacity_rows, H] in the sorted layout instead, row r's output at row r
    (padding rows too; rows at or past num_rows unwritten), for `combine` with
    the schedule's `route_row`."""
    _, hidden, inter = fp8_block_weight_shape("w_down_q", w_down_q, "[E_l, H, I]", schedule.num_local_experts)
    device = w_down_q.device
    check_fp8_block_pair("h_q", h_q, "h_scale", h_scale, (schedule.capacity_rows, inter), (1, FP8_BLOCK), device)
    check_fp8_block_pair(
        "w_down_q", w_down_q, "w_down_scale", w_down_scale, tuple(w_down_q.shape), (FP8_BLOCK, FP8_BLOCK), device
    )
    cfg = _tile_config("down", hidden, inter, "fp8_block", tile_config, schedule)
    rows = schedule.capacity_rows if sorted_rows else num_slots
    y = torch.empty(rows, hidden, dtype=torch.bfloat16, device=device)  # [T·topk or capacity_rows, H]
    _launch_down_scatter("fp8_block", h_q, h_scale, w_down_q, w_down_scale, y, schedule, cfg, sorted_rows=sorted_rows)
    return y
