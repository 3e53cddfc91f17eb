"""FP8 block quantization kernels (`fp8_block`), bit-exact with `mok.fp8_block`.

    scale_b = max(amax_b, 448 · 2^-126) / 448,    q[i] = e4m3_rne_saturate(x[i] · (1 / scale_b))

with amax over a 1×128 block (activations, `quantize_fp8_block_activations`) or a 128×128
block (weights, `quantize_fp8_block_weights`, both orientations from one read). NaN/Inf
blocks: scale NaN, elements the E4M3 NaN byte 0x7F. Ragged edge blocks use their valid
elements only (masked loads with 0, which never raises an amax). See `mok.fp8_block` for
why each rule.

Legend: M activation rows, K the GEMM's reduction dim (last), N a weight's output dim,
E experts (the grid's third axis for a 3-D weight), W the width of a sorted-layout operand,
S = gcd(block_m, 128) the row granularity of the sorted layout's scale slots.

Caller contract: inputs bf16/fp32 with unit last-dim stride; outputs are allocated here and
every element a consumer reads is written (no zeroing needed): all of them, except an
activation's rows past a given `num_rows` and the sorted-layout cases below. Reads nothing
else, no sync.
Determinism: each output element is a pure function of its block; no atomics.

Blocks along the rows of the sorted layout (`quantize_fp8_block_sorted_t`,
`quantize_fp8_block_swiglu_sorted_t`): the weight-gradient GEMMs reduce over each expert's
rows of `routing/schedule.py`'s sorted layout, so their operands (x_sorted, w·dOut, d_g|d_u, and h,
recomputed from the saved g, u) are quantized in 1×128 blocks *down each column*: block j
of expert e covers rows [off_e + 128·j, min(off_e + 128·(j+1), off_{e+1})) of one column,
so no block mixes two experts and the last one of an expert may be ragged (its valid rows
only). They are written transposed, as Hopper's FP8 MMA wants both operands K-major:

    q_t     [W, capacity_rows]        e4m3, rows contiguous (the GEMM's K)
    scale_t [capacity_rows / S, W]    fp32, the block starting at row r in row r / S

With the GPU's block_m = 128, S = 128 and scale_t is the plain [rows/128, W]; a smaller
block_m (the interpreter's 16) gives experts that start between multiples of 128, and
scale_t rows that start no block are neither written nor read. The scale layout puts one
K step's W scales side by side, so the GEMM reads them as one contiguous vector. Columns of
q_t past the schedule's `num_rows` are not written (no expert reads them); rows of the
input past its end (an operand shorter than the capacity) read as zeros.

Gathering: the fp8_block backward's operands from the token rows themselves. Blocks down the
sorted rows (`quantize_fp8_block_gathered_t`, the constexpr GATHER): sorted row r reads token
row_source[r] // topk (zeros for padding), optionally times its router weight with one bf16
rounding, exactly as `routing.gather.gather_sorted_rows` copies it, so the bytes and scales are
bitwise those of quantizing that bf16 copy, which is never written (on qwen3-30b, 1.6 GB of
bf16 copies and three reads of them per backward). Blocks along a row
(`quantize_fp8_block_gathered`): a route's row is its token's, so the token rows are
quantized once and the e4m3 rows and their scales copied into the sorted layout; where the
down dgrad gathers dOut's rows itself (`gemm.dgrad.fp8_block_down_dgrad_gathers`), not even that.

Requantizing (the constexpr SCALED): the transposing quantizers also take an operand already
quantized in 1×128 blocks along its rows (e4m3 bytes and their [rows, ⌈W/128⌉] scales: the
forward's per-token x_q and h_q, dOut's per-token copy), each element q · s in fp32 (q · (w · s)
with router weights, not rounded to bf16), then quantized down the columns as above. A program's
columns then lie in one 128-column block, so each row's scale is loaded once.

Exactness on each path:
- amax on the integer bits of |x| (NaN wins; `tl.max` on floats may drop NaN on the GPU), or, in the
  Gluon transposing quantizer, as the bits of a NaN-propagating max of |x| (`_abs_max_bits`): the same
  bits, with fewer instructions.
- the scale is `tl.div_rn(amax, 448)` (correctly rounded; plain `/` lowers to an approximate
  division on NVIDIA), ≥ 2^-126, a normal number, so no denormal flush can touch it, and its
  reciprocal `tl.div_rn(1, scale)`, once per block. Each element is one fp32 multiply, which
  keeps subnormal inputs (a subnormal element times the 2^126 reciprocal of the floor scale is
  where a flush to zero would differ; the tests include such a block).
- fp32 -> E4M3: the GPU's cast is RNE with satfinite, which saturates to ±448 as the
  reference's clamp does. The interpreter of triton 3.6 does not round to nearest even (it
  rounds half up, lets the carry corrupt the exponent, never saturates and truncates
  subnormals: see `_convert_float` in triton/runtime/interpreter.py), so under it the value
  is clamped and the bytes are built from the fp32 bits by `_e4m3_rne_bytes`, selected by the
  constexpr INTERPRETER flag. The same function mangles bf16 subnormals on the way up to
  fp32: `_to_fp32` widens by bits.
- NaN/Inf blocks: the scale is NaN, so are its reciprocal and every product, and both casts
  give NaN the byte 0x7F.

On an NVIDIA GPU the transposing quantizers run as a Gluon kernel
(`_quantize_sorted_t_gluon_kernel`, the same device functions, so the same bytes: tested
bitwise against the Triton kernel on the GPU). Triton lays a tile out for its loads (8
columns per thread) and again for the transposed stores (rows per thread), and moves the
e4m3 bytes between the two through shared memory one byte at a time; there each thread holds
16 rows × 8 columns in both, so the transpose moves no data, and each column's scale and each
row's route are computed once rather than by every thread that holds them. The weights'
quantizer runs the same way (`_quantize_weight_128x128_gluon_kernel`, 16 rows × 8 columns of
a 128×128 block per thread). The Triton kernels stay the interpreter's path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mok.fp8_block import FP8_BLOCK
from mok.kernels.common import interpreting, round_to_bf16
from mok.kernels import gluon_api
from mok.kernels.routing.gather import gather_sorted_rows, sorted_row_routes
from mok.kernels.gluon_api import gl, gluon
from mok.kernels.plan import kernel_plan
from mok.kernels.routing.schedule import RoutingSchedule
from mok.kernels.swiglu import fast_sigmoid_here, swiglu_forward
from mok.mxfp8 import check_float_input

__all__ = [
    "quantize_fp8_block_activations",
    "quantize_fp8_block_gathered",
    "quantize_fp8_block_gathered_t",
    "quantize_fp8_block_sorted_t",
    "quantize_fp8_block_swiglu_sorted_t",
    "quantize_fp8_block_weights",
    "quantize_row_blocks",
    "sorted_scale_rows",
]

# Kernels may read only constexpr globals (the GPU compiler rejects plain Python globals).
_E4M3_MAX = tl.constexpr(448.0)
_AMAX_FLOOR = tl.constexpr(448.0 * 2.0**-126)  # / 448 == 2^-126, the zero-block scale
_FP32_ABS_MASK = tl.constexpr(0x7FFFFFFF)
_FP32_INF_BITS = tl.constexpr(0x7F800000)
_E4M3_NAN_BYTE = tl.constexpr(0x7F)
_BLOCK = tl.constexpr(FP8_BLOCK)

# Tile configs. Untuned: the quantizers are memory bound and read each element once.
# Activations: the plan's `fp8_block_activation_block_m` rows × one 128-wide K block per program.
# Weights: one 128×128 block per program (the scale's granularity; the transposed store
# needs the whole block's amax first).
_WEIGHT_BLOCK = FP8_BLOCK
# On an NVIDIA GPU the Gluon kernel instead (the plan's `weights_gluon`, `weight_gluon_num_warps`,
# `weight_gluon_rows_per_thread`): one block per program in `_sorted_t_layouts`.
# Sorted-layout operands: column widths and warps per program, the Gluon kernel or the Triton one,
# are the plan's (`sorted_*`, `gathered_narrow_*`, with their reasons and records).


# --------------------------------------------------------------------------- helpers


@triton.jit
def _e4m3_rne_bytes(x):
    """fp32 with |x| ≤ 448 (NaN allowed) -> E4M3 bytes (uint8), round to nearest even, from bits.

    Normal results (|x| ≥ 2^-6): RNE of the 23-bit mantissa to 3 bits by integer add (the
    carry runs into the exponent, correctly), then rebias 127 -> 7. Subnormal results: RNE of
    |x| · 2^9 to an integer 0..8 with the 2^23 magic number (byte 8 is 2^-6, the smallest
    normal, which is the right carry). Sign copied; NaN -> 0x7F.
    """
    bits = x.to(tl.uint32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint32)
    mag_bits = bits & _FP32_ABS_MASK
    is_nan = mag_bits > _FP32_INF_BITS
    mag = tl.where(is_nan, 0.0, mag_bits.to(tl.float32, bitcast=True))  # keeps NaN out of the int cast
    rounded = mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)  # RNE at bit 20
    normal_byte = (rounded >> 20) - ((127 - 7) << 3)
    sub_byte = ((mag * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)  # exact in fp32 (NumPy here)
    byte = tl.where(mag >= 0.015625, normal_byte, sub_byte) | sign
    byte = tl.where(is_nan, _E4M3_NAN_BYTE, byte)
    return byte.to(tl.uint8)


@triton.jit
def _to_fp32(x, INTERPRETER: tl.constexpr):
    """bf16/fp32 -> fp32, exactly. The GPU's upcast is exact; the interpreter of triton 3.6
    mangles bf16 subnormals (seen on CPU: 1e-39 -> 4.4e-39), so under it a bf16 is widened
    by its bits: the fp32 with the same top 16 bits."""
    if INTERPRETER and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _e4m3_to_fp32(byte, INTERPRETER: tl.constexpr):
    """E4M3 bytes (uint8) -> fp32, exactly; the NaN byte 0x7F (either sign) gives NaN. The GPU
    converts in hardware. The interpreter of triton 3.6 reads the NaN byte as 480 and cannot be
    trusted with fp8 conversions (above), so under it the value is built from the bits: a normal
    byte's exponent rebiased 7 -> 127, a subnormal's 3-bit mantissa times 2^-9."""
    if INTERPRETER:
        bits = byte.to(tl.uint32)
        exponent = (bits >> 3) & 0xF
        mantissa = bits & 0x7
        sign = (bits & 0x80) << 24
        normal = (sign | ((exponent + (127 - 7)) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        subnormal = ((mantissa.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True) | sign).to(tl.float32,
                                                                                                    bitcast=True)
        value = tl.where(exponent == 0, subnormal, normal)
        return tl.where((bits & 0x7F) == 0x7F, float("nan"), value)
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _max_propagating_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _abs_max_bits(x, axis):
    """The int32 bits of max |x| along `axis` of an fp32 tile, as `quantize_row_blocks`' amax on the
    integer bits gives them (any NaN wins: `tl.max` on floats may drop it on the GPU; a block with
    NaN or Inf has bits >= the Inf's), in one max with |·| operands per element (FMNMX.NAN) where
    the integer bits take a mask and a max: fewer instructions and faster transposing quantizers
    (log h200-20261204-sorted-t-float-amax.log)."""
    return tl.reduce(tl.abs(x), axis, _max_propagating_nan).to(tl.int32, bitcast=True)


@triton.jit
def _block_scales(amax_bits):
    """(scale, its reciprocal) of blocks with these int32 |x|-bit amaxes; NaN for a NaN/Inf
    block, so that each of its elements times the reciprocal is NaN too."""
    amax = tl.maximum(amax_bits.to(tl.float32, bitcast=True), _AMAX_FLOOR)
    scale = tl.div_rn(amax, _E4M3_MAX)
    scale = tl.where(amax_bits >= _FP32_INF_BITS, float("nan"), scale)
    return scale, tl.div_rn(1.0, scale)


@triton.jit
def _quantize_elements(x, reciprocal, INTERPRETER: tl.constexpr):
    """fp32 tile times its blocks' reciprocal scales (broadcastable) -> uint8 E4M3 tile; a
    NaN product (a NaN/Inf block's) gives the NaN byte 0x7F."""
    scaled = x * reciprocal
    if INTERPRETER:  # its fp8 conversion is wrong
        # Saturate like the reference's clamp; `where` keeps NaN a NaN.
        scaled = tl.where(scaled > _E4M3_MAX, _E4M3_MAX, tl.where(scaled < -_E4M3_MAX, -_E4M3_MAX, scaled))
        return _e4m3_rne_bytes(scaled)
    # cvt.rn.satfinite saturates to ±448 as the reference's clamp does, and turns NaN into 0x7F
    return scaled.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)


@triton.jit
def _quantize_tile(x, amax_bits, INTERPRETER: tl.constexpr):
    """(fp32 tile, int32 |x|-bit amax broadcastable to it) -> (uint8 E4M3 tile, fp32 scale)."""
    scale, reciprocal = _block_scales(amax_bits)
    return _quantize_elements(x, reciprocal, INTERPRETER), scale


@triton.jit
def quantize_row_blocks(x, INTERPRETER: tl.constexpr):
    """fp32 or bf16 tile [R, 128] whose rows are 1×128 blocks -> (uint8 E4M3 tile, fp32 scales
    [R, 1]). Columns past a ragged edge must hold 0. Also the h epilogue of the fp8_block gate/up
    GEMM and the d_g, d_u epilogue of the down dgrad."""
    x = _to_fp32(x, INTERPRETER)
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & _FP32_ABS_MASK, axis=1)  # [R] int32
    return _quantize_tile(x, amax_bits[:, None], INTERPRETER)


@triton.jit
def dequantize_row_blocks(q, scale, INTERPRETER: tl.constexpr):
    """uint8 E4M3 tile [R, C] of 1×128 row blocks and each row's scale [R] (a tile within one
    block column) -> fp32 [R, C], exactly (`quantize_row_blocks`' inverse up to its rounding).
    The fp8_block down dgrad's read of the forward's g, u."""
    return _e4m3_to_fp32(q, INTERPRETER) * scale[:, None]


# --------------------------------------------------------------------------- kernels


@triton.jit
def _quantize_act_1x128_kernel(
    # pointers
    x_ptr, q_ptr, scale_ptr,  # [M, K] bf16/fp32, [M, K] uint8 (e4m3 bytes), [M, ⌈K/128⌉] fp32
    num_rows_ptr,  # [1] int32: rows in use (with HAS_NUM_ROWS)
    # sizes
    M, K, num_k_blocks,
    # strides
    stride_x_m, stride_q_m,
    # meta
    HAS_NUM_ROWS: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < M
    if HAS_NUM_ROWS:
        num_rows = tl.load(num_rows_ptr)
        if tl.program_id(0) * BLOCK_M >= num_rows:
            return
        row_ok = row_ok & (rows < num_rows)
    mask = row_ok[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_x_m + cols[None, :], mask=mask, other=0.0)
    q, scale = quantize_row_blocks(x, INTERPRETER)  # [BM, BK] uint8, [BM, 1] fp32
    tl.store(q_ptr + rows64 * stride_q_m + cols[None, :], q, mask=mask)
    tl.store(scale_ptr + rows.to(tl.int64) * num_k_blocks + kb, tl.reshape(scale, (BLOCK_M,)), mask=row_ok)


@triton.jit
def _quantize_weight_128x128_kernel(
    # pointers
    w_ptr, q_ptr, scale_ptr, q_t_ptr, scale_t_ptr,  # w [E, N, K]; q [E, N, K], q_t [E, K, N] uint8;
    #                                                 scale [E, ⌈N/128⌉, ⌈K/128⌉], scale_t transposed, fp32
    # sizes
    N, K, num_n_blocks, num_k_blocks,
    # strides
    stride_w_e, stride_w_n,
    # meta
    INTERPRETER: tl.constexpr, BLOCK: tl.constexpr,
):
    nb, kb, e = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_offs = nb * BLOCK + tl.arange(0, BLOCK)
    k_offs = kb * BLOCK + tl.arange(0, BLOCK)
    mask = (n_offs < N)[:, None] & (k_offs < K)[None, :]
    w = tl.load(
        w_ptr + e * stride_w_e + n_offs.to(tl.int64)[:, None] * stride_w_n + k_offs[None, :], mask=mask, other=0.0
    )
    w = _to_fp32(w, INTERPRETER)  # [BLOCK(n), BLOCK(k)] fp32
    amax_bits = tl.max(tl.max(w.to(tl.int32, bitcast=True) & _FP32_ABS_MASK, axis=1), axis=0)  # scalar int32
    q, scale = _quantize_tile(w, amax_bits, INTERPRETER)  # [BLOCK(n), BLOCK(k)] uint8, scalar fp32
    # A no-op select (a NaN/Inf block's bytes are already 0x7F) that keeps the transposed store
    # right: without it, transposing the cast's bytes stored wrong bytes for fp32 weights on
    # H200 (triton 3.6), also when the transposed tile was cast on its own.
    q = tl.where(amax_bits >= _FP32_INF_BITS, _E4M3_NAN_BYTE, q).to(tl.uint8)

    nk = N.to(tl.int64) * K
    tl.store(q_ptr + e * nk + n_offs.to(tl.int64)[:, None] * K + k_offs[None, :], q, mask=mask)
    # The transpose's block is this block transposed: same amax, same bytes. Transposing the
    # tile in registers keeps the q_t store contiguous along its last dim (N).
    mask_t = (k_offs < K)[:, None] & (n_offs < N)[None, :]
    tl.store(q_t_ptr + e * nk + k_offs.to(tl.int64)[:, None] * N + n_offs[None, :], tl.trans(q), mask=mask_t)
    num_blocks = num_n_blocks * num_k_blocks
    tl.store(scale_ptr + e * num_blocks + nb * num_k_blocks + kb, scale)
    tl.store(scale_t_ptr + e * num_blocks + kb * num_n_blocks + nb, scale)


@triton.jit
def _sorted_block(tile_expert_ptr, expert_offsets_ptr, num_rows_ptr,
                  TILE_M: tl.constexpr, SCALE_ROWS: tl.constexpr, BLOCK_R: tl.constexpr):
    """(row0, the end of its expert's rows, whether this program owns a block): program (p, c)
    owns the block that starts at row p·S of its expert, if one does."""
    row0 = tl.program_id(0) * SCALE_ROWS
    # Tiles past num_rows hold expert −1; such a program owns nothing, and expert 0 keeps its loads in bounds.
    expert = tl.maximum(tl.load(tile_expert_ptr + row0 // TILE_M), 0)
    expert_start = tl.load(expert_offsets_ptr + expert)
    owns = (row0 < tl.load(num_rows_ptr)) & ((row0 - expert_start) % BLOCK_R == 0)  # else: inside another's block
    return row0, tl.load(expert_offsets_ptr + expert + 1), owns


@triton.jit
def _row_sources(rows, in_expert, num_a_rows, row_source_ptr, topk_weights_ptr, a_scale_ptr, scale_column,
                 stride_a_scale_r, topk, GATHER: tl.constexpr, HAS_WEIGHTS: tl.constexpr, SCALED: tl.constexpr):
    """(row of a, whether it is read, its factor) of each sorted row in `rows`: the row itself,
    or with GATHER the token row of gather.py's copy (none for padding). The factor: with
    HAS_WEIGHTS the route's router weight, with SCALED (a holds e4m3 quantized along its rows)
    the row's scale of the 128-column block `scale_column`, with both their product w · s; with
    neither it is not meant to be read."""
    sources, valid = rows, in_expert & (rows < num_a_rows)
    factor = valid.to(tl.float32)
    if GATHER:
        slot, sources, valid = sorted_row_routes(rows, in_expert, row_source_ptr, topk)
        if HAS_WEIGHTS:
            factor = tl.load(topk_weights_ptr + slot, mask=valid, other=0.0)
    if SCALED:
        scale = tl.load(a_scale_ptr + sources.to(tl.int64) * stride_a_scale_r + scale_column, mask=valid, other=0.0)
        factor = factor * scale if HAS_WEIGHTS else scale
    return sources, valid, factor


@triton.jit
def _load_sorted_tile(a_ptr, sources, valid, cols, col_ok, width, stride_a_r, SWIGLU: tl.constexpr):
    """a's tile [rows, cols] of `_quantize_sorted_t_kernel` from `_row_sources`' rows, as stored
    (zeros where a row or column is not read), in the layout of `sources[:, None] + cols[None, :]`;
    with SWIGLU also u's beside it (else a again): (a, u)."""
    mask = valid[:, None] & col_ok[None, :]
    ptrs = a_ptr + sources.to(tl.int64)[:, None] * stride_a_r + cols[None, :]
    a = tl.load(ptrs, mask=mask, other=0)
    if SWIGLU:
        up = tl.load(ptrs + width, mask=mask, other=0)
    else:
        up = a
    return a, up


@triton.jit
def _sorted_tile_values(a, up, factor, swiglu_limit, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
                        HAS_WEIGHTS: tl.constexpr, SCALED: tl.constexpr, FAST_SIGMOID: tl.constexpr,
                        INTERPRETER: tl.constexpr):
    """The fp32 operand tile from `_load_sorted_tile`'s (a, u) and each row's factor
    (`_row_sources`). SCALED: e4m3 bytes times their row's factor (scale, or w · scale)."""
    if SCALED:
        return _e4m3_to_fp32(a, INTERPRETER) * factor[:, None]
    if HAS_WEIGHTS:  # as gather.py's dy_sorted: one bf16 rounding of the fp32 product
        a = round_to_bf16(factor[:, None] * a.to(tl.float32), INTERPRETER)
    a = _to_fp32(a, INTERPRETER)
    if SWIGLU:  # h = swiglu(g, u) from the forward's pre-activations; masked entries give h = 0
        a = swiglu_forward(a, _to_fp32(up, INTERPRETER), swiglu_limit, HAS_LIMIT, FAST_SIGMOID)
    return a


@triton.jit
def _store_sorted_t(q_t_ptr, scale_t_ptr, q, rows, in_expert, cols, col_ok, scale, scale_cols, row0, width,
                    capacity_rows, SCALE_ROWS: tl.constexpr, BLOCK_R: tl.constexpr):
    """Stores one column block's bytes q [cols, rows] into q_t (`rows`, `cols` in the slices of
    q's layout) and its scales [scale_cols] into scale_t's row for row0."""
    q_ptrs = q_t_ptr + cols.to(tl.int64)[:, None] * capacity_rows + rows[None, :]
    if SCALE_ROWS == BLOCK_R:
        # Whole blocks (the GPU's schedule pads experts to 128 rows): no block crosses an
        # expert's end, and a mask that is constant along the rows lets the bytes go out as
        # 16-byte vectors (a per-row mask made them single-byte stores).
        tl.store(q_ptrs, q, mask=col_ok[:, None])
    else:
        tl.store(q_ptrs, q, mask=col_ok[:, None] & in_expert[None, :])
    slot = (row0 // SCALE_ROWS).to(tl.int64)
    tl.store(scale_t_ptr + slot * width + scale_cols, scale, mask=scale_cols < width)


@triton.jit
def _quantize_sorted_t_kernel(
    # pointers
    a_ptr, q_t_ptr, scale_t_ptr,  # a [R, W] bf16/fp32 (SWIGLU: g, u [R, 2, W] bf16; GATHER: token rows
    #                               [T, W] bf16; SCALED: uint8 e4m3 bytes); q_t [W, capacity_rows] uint8
    #                               (e4m3 bytes); scale_t [capacity_rows / S, W] fp32
    topk_weights_ptr,  # [T·topk] fp32 (GATHER with HAS_WEIGHTS): row r holds bf16(w[row_source[r]] · a[t])
    a_scale_ptr,  # SCALED: a's 1×128 row scales [R or T, ⌈W/128⌉] fp32
    # schedule
    tile_expert_ptr, expert_offsets_ptr, num_rows_ptr, row_source_ptr,
    # sizes
    num_a_rows, width, capacity_rows, swiglu_limit, topk,
    # strides
    stride_a_r, stride_a_scale_r,
    # meta
    SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, GATHER: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    SCALED: tl.constexpr, FAST_SIGMOID: tl.constexpr, INTERPRETER: tl.constexpr,
    TILE_M: tl.constexpr,  # the schedule's block_m (tile_expert has one entry per TILE_M rows)
    SCALE_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,  # S, 128, columns per program
):
    """One column block of 128 rows per program (`_sorted_block`), columns c·BLOCK_W... of it
    (SCALED: BLOCK_W divides 128, so that a row's columns here share one scale)."""
    row0, expert_end, owns = _sorted_block(tile_expert_ptr, expert_offsets_ptr, num_rows_ptr, TILE_M, SCALE_ROWS,
                                           BLOCK_R)
    if not owns:
        return
    rows = row0 + tl.arange(0, BLOCK_R)
    in_expert = rows < expert_end  # past it: the next expert's rows
    col0 = tl.program_id(1) * BLOCK_W
    cols = col0 + tl.arange(0, BLOCK_W)
    col_ok = cols < width
    sources, valid, factor = _row_sources(rows, in_expert, num_a_rows, row_source_ptr, topk_weights_ptr, a_scale_ptr,
                                          col0 // _BLOCK, stride_a_scale_r, topk, GATHER, HAS_WEIGHTS, SCALED)
    a, up = _load_sorted_tile(a_ptr, sources, valid, cols, col_ok, width, stride_a_r, SWIGLU)
    a = _sorted_tile_values(a, up, factor, swiglu_limit, SWIGLU, HAS_LIMIT, HAS_WEIGHTS, SCALED, FAST_SIGMOID,
                            INTERPRETER)  # [BLOCK_R, BLOCK_W] fp32
    # Each row of the transposed tile is one column block: the activations' rule applies as is.
    q, scale = quantize_row_blocks(tl.trans(a), INTERPRETER)  # [BLOCK_W, BLOCK_R] uint8, [BLOCK_W, 1] fp32
    _store_sorted_t(q_t_ptr, scale_t_ptr, q, rows, in_expert, cols, col_ok, tl.reshape(scale, (BLOCK_W,)), cols, row0,
                    width, capacity_rows, SCALE_ROWS, BLOCK_R)


@gluon.constexpr_function
def _sorted_t_layouts(rows_per_thread, num_warps):
    """(load, store) layouts of the Gluon transposing quantizer's [128 rows, BLOCK_W] tile and
    of its transpose [BLOCK_W, 128]: each thread holds the same rows_per_thread × 8 elements in
    both, 8 columns contiguous in the first (16-byte loads of bf16 rows), its rows contiguous in
    the second (rows_per_thread-byte stores of e4m3 down a column), so the transpose moves no
    data. A warp's lanes span all 128 rows (the amax down a column stays within the warp) and
    2 · rows_per_thread columns; its warps sit side by side along the columns."""
    block_w = _sorted_t_gluon_block_w(rows_per_thread, num_warps)
    row_lanes = FP8_BLOCK // rows_per_thread
    col_lanes = 32 // row_lanes
    row_bits = [1 << i for i in range(rows_per_thread.bit_length() - 1)]
    col_bits = [1, 2, 4]
    lane_rows = [rows_per_thread << i for i in range(row_lanes.bit_length() - 1)]
    lane_cols = [8 << i for i in range(col_lanes.bit_length() - 1)]
    warp_cols = [8 * col_lanes << i for i in range(num_warps.bit_length() - 1)]
    load = gl.DistributedLinearLayout(
        reg_bases=[[0, c] for c in col_bits] + [[r, 0] for r in row_bits],
        lane_bases=[[0, c] for c in lane_cols] + [[r, 0] for r in lane_rows],
        warp_bases=[[0, c] for c in warp_cols], block_bases=[], shape=[FP8_BLOCK, block_w])
    store = gl.DistributedLinearLayout(
        reg_bases=[[0, r] for r in row_bits] + [[c, 0] for c in col_bits],
        lane_bases=[[c, 0] for c in lane_cols] + [[0, r] for r in lane_rows],
        warp_bases=[[c, 0] for c in warp_cols], block_bases=[], shape=[block_w, FP8_BLOCK])
    return load, store


@gluon.jit
def _quantize_sorted_t_gluon_kernel(
    a_ptr, q_t_ptr, scale_t_ptr, topk_weights_ptr, a_scale_ptr,  # as `_quantize_sorted_t_kernel`'s
    num_rows_ptr, row_source_ptr,
    num_a_rows, width, capacity_rows, swiglu_limit, topk,
    stride_a_r, stride_a_scale_r,
    SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr, GATHER: gl.constexpr, HAS_WEIGHTS: gl.constexpr,
    SCALED: gl.constexpr, FAST_SIGMOID: gl.constexpr, ROWS_PER_THREAD: gl.constexpr,
):
    """`_quantize_sorted_t_kernel` on the GPU with the layouts of `_sorted_t_layouts`: the same
    device functions, so the same bytes, without the shared-memory round trip that Triton's own
    layouts need to turn column-contiguous loads into row-contiguous byte stores. For a schedule
    of block_m % 128 == 0, one tile per program over the tiles below num_rows, row blocks first
    (programs that run together read the same column block). There every 128-row block lies in
    one expert, so a tile needs no lookup of its expert's rows: its loads wait only on num_rows
    and, gathering, on its rows' routes, which measured faster than with the lookup (logs
    h200-20261203-sorted-t-prefetch.log, h200-20261203-epilogue-loads-ahead.log). Each program
    prefetching its next tile by cp.async over a persistent grid measured level with this (same
    logs; branch fp8-sorted-t-prefetch)."""
    LOAD: gl.constexpr = _sorted_t_layouts(ROWS_PER_THREAD, gl.num_warps())[0]
    STORE: gl.constexpr = _sorted_t_layouts(ROWS_PER_THREAD, gl.num_warps())[1]
    SPREAD: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    BLOCK_W: gl.constexpr = LOAD.shape[1]
    num_row_blocks = gl.cdiv(gl.load(num_rows_ptr), _BLOCK)
    tile = gl.program_id(0)
    if tile >= num_row_blocks * gl.cdiv(width, BLOCK_W):
        return
    row0, col0 = tile % num_row_blocks * _BLOCK, tile // num_row_blocks * BLOCK_W
    # Each row's source (a division by topk where gathering) and each column's scale once, in
    # a layout that spreads the vector over the threads: in the tile's, every thread would
    # compute them for each of its rows and columns.
    rows = row0 + gl.arange(0, _BLOCK, layout=SPREAD)
    in_expert = rows >= 0  # every row of the block
    sources, valid, factor = _row_sources(rows, in_expert, num_a_rows, row_source_ptr, topk_weights_ptr, a_scale_ptr,
                                          col0 // _BLOCK, stride_a_scale_r, topk, GATHER, HAS_WEIGHTS, SCALED)
    cols = col0 + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(0, LOAD))
    # The factors change layout after the tile's loads are issued, which need only the rows.
    a, up = _load_sorted_tile(a_ptr, gl.convert_layout(sources, gl.SliceLayout(1, LOAD)),
                              gl.convert_layout(valid, gl.SliceLayout(1, LOAD)), cols, cols < width, width, stride_a_r,
                              SWIGLU)
    a = _sorted_tile_values(a, up, gl.convert_layout(factor, gl.SliceLayout(1, LOAD)), swiglu_limit, SWIGLU, HAS_LIMIT,
                            HAS_WEIGHTS, SCALED, FAST_SIGMOID, False)  # [128, BLOCK_W] fp32
    a_t = gl.convert_layout(gl.permute(a, (1, 0)), STORE, assert_trivial=True)  # [BLOCK_W, 128]
    amax_bits = _abs_max_bits(a_t, 1)  # [BLOCK_W] int32
    scale_cols = col0 + gl.arange(0, BLOCK_W, layout=SPREAD)
    scale, reciprocal = _block_scales(gl.convert_layout(amax_bits, SPREAD))
    reciprocal = gl.convert_layout(reciprocal, gl.SliceLayout(1, STORE))
    q = _quantize_elements(a_t, reciprocal[:, None], False)  # [BLOCK_W, 128] uint8
    rows_t = row0 + gl.arange(0, _BLOCK, layout=gl.SliceLayout(0, STORE))
    cols_t = col0 + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, STORE))
    _store_sorted_t(q_t_ptr, scale_t_ptr, q, rows_t, rows_t >= 0, cols_t, cols_t < width, scale, scale_cols, row0,
                    width, capacity_rows, _BLOCK, _BLOCK)


@gluon.jit
def _quantize_weight_128x128_gluon_kernel(
    w_ptr, q_ptr, scale_ptr, q_t_ptr, scale_t_ptr,  # as `_quantize_weight_128x128_kernel`'s
    N, K, num_n_blocks, num_k_blocks,
    stride_w_e, stride_w_n,
    ROWS_PER_THREAD: gl.constexpr,
):
    """`_quantize_weight_128x128_kernel` on the GPU, one 128×128 block per program, in the
    layouts of `_sorted_t_layouts` at ROWS_PER_THREAD rows per thread (the plan's 16, at 4 warps):
    each thread holds the same 16 × 8 elements of the block and of its transpose, so q goes out in
    8-byte runs of its rows and q_t in 16-byte runs of its rows, without Triton's byte-wise round
    trip through shared memory for the transpose. The same device functions, so the same bytes."""
    LOAD: gl.constexpr = _sorted_t_layouts(ROWS_PER_THREAD, gl.num_warps())[0]  # [128 (N), 128 (K)]
    STORE: gl.constexpr = _sorted_t_layouts(ROWS_PER_THREAD, gl.num_warps())[1]  # [128 (K), 128 (N)]
    nb, kb, e = gl.program_id(0), gl.program_id(1), gl.program_id(2).to(gl.int64)
    n_offs = nb * _BLOCK + gl.arange(0, _BLOCK, layout=gl.SliceLayout(1, LOAD))
    k_offs = kb * _BLOCK + gl.arange(0, _BLOCK, layout=gl.SliceLayout(0, LOAD))
    mask = (n_offs < N)[:, None] & (k_offs < K)[None, :]
    w = gl.load(w_ptr + e * stride_w_e + n_offs.to(gl.int64)[:, None] * stride_w_n + k_offs[None, :], mask=mask,
                other=0.0).to(gl.float32)
    amax_bits = gl.max(gl.max(w.to(gl.int32, bitcast=True) & _FP32_ABS_MASK, axis=1), axis=0)  # scalar int32
    scale, reciprocal = _block_scales(amax_bits)
    q = _quantize_elements(w, reciprocal, False)  # [128 (N), 128 (K)] uint8
    nk = N.to(gl.int64) * K
    gl.store(q_ptr + e * nk + n_offs.to(gl.int64)[:, None] * K + k_offs[None, :], q, mask=mask)
    # The transpose's bytes are cast again from the transposed fp32 tile, as the transposing
    # quantizer does: permuting the cast's packed bytes instead stored wrong bytes for whole
    # blocks on H200 (triton 3.6; ragged blocks came out right).
    w_t = gl.convert_layout(gl.permute(w, (1, 0)), STORE, assert_trivial=True)  # [128 (K), 128 (N)]
    q_t = _quantize_elements(w_t, reciprocal, False)
    k_rows = kb * _BLOCK + gl.arange(0, _BLOCK, layout=gl.SliceLayout(1, STORE))
    n_cols = nb * _BLOCK + gl.arange(0, _BLOCK, layout=gl.SliceLayout(0, STORE))
    gl.store(q_t_ptr + e * nk + k_rows.to(gl.int64)[:, None] * N + n_cols[None, :], q_t,
             mask=(k_rows < K)[:, None] & (n_cols < N)[None, :])
    num_blocks = num_n_blocks * num_k_blocks
    gl.store(scale_ptr + e * num_blocks + nb * num_k_blocks + kb, scale)
    gl.store(scale_t_ptr + e * num_blocks + kb * num_n_blocks + nb, scale)


# --------------------------------------------------------------------------- launchers


def _check_input(name: str, t: object, dims: tuple[int, ...], layout: str) -> None:
    """The reference's checks, plus unit stride along the last dim (the kernels assume it)."""
    check_float_input(name, t, dims, layout)
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected unit stride along the last dim, got strides {t.stride()}")


def quantize_fp8_block_activations(
    x: torch.Tensor, num_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16/fp32 -> (q [M, K] float8_e4m3fn, scale [M, ⌈K/128⌉] fp32); 1×128 blocks.
    With `num_rows` ([1] int32 on x's device, e.g. a schedule's rows in use), rows at or past
    num_rows[0] are left unwritten and unread: a sorted-layout operand costs its rows in use,
    not its capacity."""
    _check_input("x", x, (2,), "2-D [M, K]")
    if num_rows is not None and (
        num_rows.shape != (1,) or num_rows.dtype != torch.int32 or num_rows.device != x.device
    ):
        raise ValueError(f"num_rows: expected a [1] int32 tensor on {x.device}, got {num_rows.dtype} "
                         f"{list(num_rows.shape)} on {num_rows.device}")
    K = x.shape[1]
    num_k_blocks = triton.cdiv(K, FP8_BLOCK)
    q = torch.empty(x.shape[0], K, dtype=torch.uint8, device=x.device)  # [M, K] e4m3 bytes
    scale = torch.empty(x.shape[0], num_k_blocks, dtype=torch.float32, device=x.device)  # [M, ⌈K/128⌉]
    if x.shape[0] > 0 and K > 0:
        block_m = kernel_plan(x.device).fp8_block_activation_block_m
        grid = (triton.cdiv(x.shape[0], block_m), num_k_blocks)
        _quantize_act_1x128_kernel[grid](
            x, q, scale, scale if num_rows is None else num_rows,  # scale: unread
            x.shape[0], K, num_k_blocks,
            x.stride(0), q.stride(0),
            HAS_NUM_ROWS=num_rows is not None, INTERPRETER=interpreting(),
            BLOCK_M=block_m, BLOCK_K=FP8_BLOCK, num_warps=4,
        )
    return q.view(torch.float8_e4m3fn), scale


def _check_token_rows(name: str, x: torch.Tensor, schedule: RoutingSchedule, topk: int,
                      x_scale: torch.Tensor | None = None) -> None:
    """x: bf16 token rows [T, W] on the schedule's device (the schedule's routes are T·topk), or
    with `x_scale` e4m3 ones and their 1×128 row scales (`_check_row_scaled`)."""
    if x_scale is None:
        _check_input(name, x, (2,), "2-D [T, W]")
        if x.dtype != torch.bfloat16 or x.device != schedule.row_source.device:
            raise ValueError(f"{name}: expected bf16 token rows [T, W] on {schedule.row_source.device}, "
                             f"got {x.dtype} {list(x.shape)} on {x.device}")
    else:
        _check_row_scaled(name, x, x_scale, "2-D [T, W]")
        if x.device != schedule.row_source.device:
            raise ValueError(f"{name}: expected token rows on {schedule.row_source.device}, got {x.device}")
    if topk < 1:
        raise ValueError(f"topk: expected at least 1, got {topk}")


def quantize_fp8_block_gathered(
    x: torch.Tensor,  # [T, K] bf16 token rows
    schedule: RoutingSchedule,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows in the schedule's sorted layout (row r: token row_source[r] // topk), quantized
    in 1×128 blocks along K: (q [capacity_rows, K] float8_e4m3fn, scale [capacity_rows,
    ⌈K/128⌉] fp32). A route's row is its token's, so the T token rows are quantized once and
    their bytes and scales copied to the routes' rows (`routing.gather.gather_sorted_rows`, on bf16
    views): every route's row bitwise `quantize_fp8_block_activations` of the gathered bf16
    copy, at the cost of T rows quantized instead of T·topk. Padding rows get zero bytes and
    scale 0 (no GEMM output of theirs is read); rows at or past num_rows are left unwritten."""
    _check_token_rows("x", x, schedule, topk)
    if x.shape[1] % 2:
        raise ValueError(f"x: expected an even number of columns (copied as bf16 pairs), got {x.shape[1]}")
    q, scale = quantize_fp8_block_activations(x)  # [T, K] e4m3, [T, ⌈K/128⌉] fp32
    q_sorted = gather_sorted_rows(q.view(torch.bfloat16), None, None, schedule, topk)[0]  # [capacity_rows, K/2]
    scale_sorted = gather_sorted_rows(scale.view(torch.bfloat16), None, None, schedule, topk)[0]
    return q_sorted.view(torch.float8_e4m3fn), scale_sorted.view(torch.float32)


def quantize_fp8_block_weights(
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] or [E, N, K] bf16/fp32 -> (q, scale, q_t, scale_t) as `mok.fp8_block_quantize`."""
    _check_input("w", w, (2, 3), "2-D [N, K] or 3-D [E, N, K]")
    squeeze = w.dim() == 2
    w3 = w.unsqueeze(0) if squeeze else w  # [E, N, K]
    E, N, K = w3.shape
    nb, kb = triton.cdiv(N, FP8_BLOCK), triton.cdiv(K, FP8_BLOCK)
    q = torch.empty(E, N, K, dtype=torch.uint8, device=w.device)  # [E, N, K] e4m3 bytes
    q_t = torch.empty(E, K, N, dtype=torch.uint8, device=w.device)  # [E, K, N] e4m3 bytes
    scale = torch.empty(E, nb, kb, dtype=torch.float32, device=w.device)  # [E, ⌈N/128⌉, ⌈K/128⌉]
    scale_t = torch.empty(E, kb, nb, dtype=torch.float32, device=w.device)  # [E, ⌈K/128⌉, ⌈N/128⌉]
    args = (w3, q, scale, q_t, scale_t, N, K, nb, kb, w3.stride(0), w3.stride(1))
    if E > 0 and N > 0 and K > 0:
        plan = kernel_plan(w.device)
        if plan.weights_gluon and _gluon_here(w.device, "the fp8_block weight quantizer"):
            rows_per_thread, num_warps = plan.weight_gluon_rows_per_thread, plan.weight_gluon_num_warps
            if _sorted_t_gluon_block_w(rows_per_thread, num_warps) != FP8_BLOCK:
                raise ValueError(f"weight_gluon_rows_per_thread, weight_gluon_num_warps: a program's columns must be "
                                 f"the block's {FP8_BLOCK}, got {rows_per_thread}, {num_warps}")
            _quantize_weight_128x128_gluon_kernel[(nb, kb, E)](*args, ROWS_PER_THREAD=rows_per_thread,
                                                               num_warps=num_warps)
        else:
            _quantize_weight_128x128_kernel[(nb, kb, E)](*args, INTERPRETER=interpreting(), BLOCK=_WEIGHT_BLOCK,
                                                         num_warps=8)
    outs = (q.view(torch.float8_e4m3fn), scale, q_t.view(torch.float8_e4m3fn), scale_t)
    return tuple(t.squeeze(0) for t in outs) if squeeze else outs


def _gluon_here(device: torch.device, what: str) -> bool:
    """The Gluon quantizers run on NVIDIA GPUs (no interpreter) where this Triton builds Gluon."""
    return device.type == "cuda" and not interpreting() and gluon_api.usable(device, what)


def sorted_scale_rows(block_m: int) -> int:
    """S: the row granularity of a sorted-layout scale_t for a schedule of this block_m. Every
    expert starts at a multiple of block_m and its blocks 128 rows apart, so each block starts
    at a multiple of gcd(block_m, 128), and two blocks never share one."""
    return math.gcd(block_m, FP8_BLOCK)


def _launch_quantize_sorted_t(
    a: torch.Tensor, width: int, schedule: RoutingSchedule, swiglu: bool, swiglu_limit: float | None,
    gathered_topk: int | None = None, topk_weights: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of `_quantize_sorted_t_kernel` (or on an NVIDIA GPU its Gluon twin) over a
    [R, W] (swiglu: g, u [R, 2, W]), or with `gathered_topk` over token rows a [T, W] gathered
    into the sorted layout (times topk_weights); with `a_scale`, a is e4m3 quantized along its
    rows and is dequantized first."""
    device = a.device
    scale_rows = sorted_scale_rows(schedule.block_m)
    rows = schedule.capacity_rows
    q_t = torch.empty(width, rows, dtype=torch.uint8, device=device)  # [W, capacity_rows] e4m3 bytes
    scale_t = torch.empty(rows // scale_rows, width, dtype=torch.float32, device=device)  # [capacity_rows / S, W]
    if rows == 0 or width == 0:
        return q_t.view(torch.float8_e4m3fn), scale_t
    scaled = a_scale is not None
    pointers = (a.view(torch.uint8) if scaled else a, q_t, scale_t,
                scale_t if topk_weights is None else topk_weights, a_scale if scaled else scale_t)  # scale_t: unread
    sizes = (a.shape[0], width, rows, 0.0 if swiglu_limit is None else float(swiglu_limit), gathered_topk or 1,
             a.stride(0), a_scale.stride(0) if scaled else 0)
    flags = dict(SWIGLU=swiglu, HAS_LIMIT=swiglu_limit is not None, GATHER=gathered_topk is not None,
                 HAS_WEIGHTS=topk_weights is not None, SCALED=scaled, FAST_SIGMOID=fast_sigmoid_here())
    plan = kernel_plan(device)
    if plan.sorted_gluon and scale_rows == FP8_BLOCK and _gluon_here(device, "the fp8_block transposing quantizer"):
        rows_per_thread = plan.sorted_gluon_rows_per_thread
        num_warps = plan.sorted_gluon_num_warps_e4m3 if scaled else plan.sorted_gluon_num_warps
        block_w = _sorted_t_gluon_block_w(rows_per_thread, num_warps)
        if scaled and FP8_BLOCK % block_w:
            raise ValueError(f"sorted_gluon_rows_per_thread, sorted_gluon_num_warps_e4m3: with a_scale a program's "
                             f"{block_w} columns must lie within one 128-column scale block")
        tiles = rows // FP8_BLOCK * triton.cdiv(width, block_w)  # at most: the kernel reads num_rows
        _quantize_sorted_t_gluon_kernel[(tiles,)](*pointers, schedule.num_rows, schedule.row_source, *sizes, **flags,
                                                  ROWS_PER_THREAD=rows_per_thread, num_warps=num_warps)
        return q_t.view(torch.float8_e4m3fn), scale_t
    block_w, num_warps = plan.sorted_block_w, plan.sorted_num_warps
    if interpreting():
        block_w = plan.sorted_block_w_interpreter
    elif gathered_topk is not None and width >= plan.gathered_narrow_min_width:
        block_w, num_warps = plan.gathered_narrow_block_w, plan.gathered_narrow_num_warps
    if scaled:  # a program's columns within one of a's 128-column scale blocks
        block_w = min(block_w, FP8_BLOCK)
    grid = (rows // scale_rows, triton.cdiv(width, block_w))
    _quantize_sorted_t_kernel[grid](*pointers, schedule.tile_expert, schedule.expert_offsets, schedule.num_rows,
                                    schedule.row_source, *sizes, **flags, INTERPRETER=interpreting(),
                                    TILE_M=schedule.block_m, SCALE_ROWS=scale_rows, BLOCK_R=FP8_BLOCK,
                                    BLOCK_W=block_w, num_warps=num_warps)
    return q_t.view(torch.float8_e4m3fn), scale_t


@gluon.constexpr_function
def _sorted_t_gluon_block_w(rows_per_thread: int, num_warps: int) -> int:
    """Columns per program of the Gluon transposing quantizer (`_sorted_t_layouts`): a warp
    spans 128 rows, rows_per_thread per lane, and 8 columns per lane."""
    if rows_per_thread not in (4, 8, 16, 32) or num_warps not in (1, 2, 4, 8):
        raise ValueError(f"rows_per_thread, num_warps: expected one of 4, 8, 16, 32 and of 1, 2, 4, 8, "
                         f"got {rows_per_thread}, {num_warps}")
    return 8 * (32 // (FP8_BLOCK // rows_per_thread)) * num_warps


def _check_row_scaled(name: str, a: torch.Tensor, a_scale: object, layout: str) -> None:
    """a: 2-D float8_e4m3fn with unit last-dim stride; a_scale: its contiguous fp32 1×128 row
    scales [rows, ⌈W/128⌉] on a's device (`quantize_fp8_block_activations`' pair)."""
    if not isinstance(a, torch.Tensor) or a.dtype != torch.float8_e4m3fn or a.dim() != 2 or (
        a.shape[1] > 1 and a.stride(1) != 1
    ):
        raise ValueError(f"{name}: expected a {layout} float8_e4m3fn tensor with unit last-dim stride beside "
                         f"{name}_scale, got {getattr(a, 'dtype', type(a))} {list(getattr(a, 'shape', []))}")
    want = (a.shape[0], triton.cdiv(a.shape[1], FP8_BLOCK))
    if not isinstance(a_scale, torch.Tensor) or a_scale.dtype != torch.float32 or tuple(a_scale.shape) != want or (
        not a_scale.is_contiguous() or a_scale.device != a.device
    ):
        raise ValueError(f"{name}_scale: expected a contiguous fp32 {list(want)} tensor on {a.device} ({name}'s 1×128 "
                         f"row scales), got {getattr(a_scale, 'dtype', type(a_scale))} "
                         f"{list(getattr(a_scale, 'shape', []))}")


def _check_sorted_operand(name: str, a: torch.Tensor, dims: int, layout: str, schedule: RoutingSchedule,
                          a_scale: torch.Tensor | None = None) -> None:
    if a_scale is None:
        _check_input(name, a, (dims,), layout)
    else:
        _check_row_scaled(name, a, a_scale, layout)
    if a.shape[0] > schedule.capacity_rows or a.device != schedule.row_source.device:
        raise ValueError(
            f"{name}: expected at most {schedule.capacity_rows} rows (the schedule's capacity) on "
            f"{schedule.row_source.device}, got {list(a.shape)} on {a.device}"
        )


def quantize_fp8_block_sorted_t(
    a: torch.Tensor,  # [R <= capacity_rows, W] bf16/fp32 in the schedule's sorted layout, or e4m3 with a_scale
    schedule: RoutingSchedule,
    a_scale: torch.Tensor | None = None,  # [R, ⌈W/128⌉] fp32: a's 1×128 row scales
) -> tuple[torch.Tensor, torch.Tensor]:
    """a quantized in 1×128 blocks down each column, per expert (module docstring), transposed:
    (q_t [W, capacity_rows] float8_e4m3fn, scale_t [capacity_rows / S, W] fp32), S =
    `sorted_scale_rows(schedule.block_m)`. Rows past R read as zeros; any row stride. With
    `a_scale`, a is e4m3 quantized along its rows (the forward's h_q): each element q · s in
    fp32, then quantized down the columns."""
    _check_sorted_operand("a", a, 2, "2-D [rows, W]", schedule, a_scale)
    return _launch_quantize_sorted_t(a, a.shape[1], schedule, False, None, a_scale=a_scale)


def quantize_fp8_block_gathered_t(
    a: torch.Tensor,  # [T, W] bf16 token rows, or e4m3 with a_scale
    schedule: RoutingSchedule,
    topk: int,
    topk_weights: torch.Tensor | None = None,  # [T, topk] fp32
    a_scale: torch.Tensor | None = None,  # [T, ⌈W/128⌉] fp32: a's 1×128 row scales
) -> tuple[torch.Tensor, torch.Tensor]:
    """a's rows in the schedule's sorted layout (row r: token row_source[r] // topk, zeros for
    padding; with topk_weights, bf16(w · a[t]) as `routing.gather.gather_sorted_rows`' dy_sorted),
    quantized as `quantize_fp8_block_sorted_t`: (q_t [W, capacity_rows] float8_e4m3fn,
    scale_t [capacity_rows / S, W] fp32), bitwise that of the gathered copy, without the copy.
    With `a_scale`, a is e4m3 quantized along its rows (the per-token x_q or dOut's pair), and
    row r's element is q · (w · s) in fp32 (q · s without router weights), not rounded to bf16:
    the wgrad's operand is quantized twice, along H and then down the rows, as DeepSeek-V3's
    recipe does with the activations it caches in FP8."""
    _check_token_rows("a", a, schedule, topk, a_scale)
    if topk_weights is not None and (
        topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (a.shape[0], topk)
        or not topk_weights.is_contiguous() or topk_weights.device != a.device
    ):
        raise ValueError(f"topk_weights: expected a contiguous fp32 [{a.shape[0]}, {topk}] tensor on {a.device}, "
                         f"got {topk_weights.dtype} {list(topk_weights.shape)} on {topk_weights.device}")
    return _launch_quantize_sorted_t(a, a.shape[1], schedule, False, None, topk, topk_weights, a_scale)


def quantize_fp8_block_swiglu_sorted_t(
    gate_up: torch.Tensor,  # [R <= capacity_rows, 2, I] bf16, the forward's g, u in the sorted layout
    schedule: RoutingSchedule,
    swiglu_limit: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = silu(min(g, L)) · clamp(u, −L, L), recomputed in fp32 from the saved pre-activations
    and quantized as `quantize_fp8_block_sorted_t`: (q_t [I, capacity_rows] float8_e4m3fn,
    scale_t [capacity_rows / S, I] fp32). Zero g, u (padding rows) give h = 0."""
    _check_sorted_operand("gate_up", gate_up, 3, "3-D [rows, 2, I]", schedule)
    if gate_up.shape[1] != 2 or gate_up.stride(1) != gate_up.shape[2]:
        raise ValueError(f"gate_up: expected [rows, 2, I] with g and u adjacent in each row, got shape "
                         f"{list(gate_up.shape)} strides {gate_up.stride()}")
    return _launch_quantize_sorted_t(gate_up, gate_up.shape[2], schedule, True, swiglu_limit)
