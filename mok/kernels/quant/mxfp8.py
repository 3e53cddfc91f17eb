"""MXFP8 quantization (OCP MX v1.0), rowwise and colwise from one read, bit-exact with `mok.mxfp8`;
and rounding to the MXFP8 grid in bf16 (`mxfp8_round`), what the mxfp8 GEMMs read on Hopper.

    per block b of 32:  exp_b = clamp(ceil(log2(amax_b / 448)), -127, 127),
                        q[i] = e4m3_rne_saturate(x[i] · 2^-exp_b),   scale_b = exp_b + 127

Legend: `t` is `[M, N]` or `[E, M, N]` (E experts, optional); rowwise blocks run along N
(`q [.., M, N]`, `scale [.., M, N/32]`), colwise blocks along M, stored as the quantization
of the transpose (`q_t [.., N, M]`, `scale_t [.., N, M/32]`). A NaN/Inf block gets scale 255
and every element the E4M3 NaN byte 0x7F. `mok.mxfp8` is the definition and its docstring
the argument for exactness; this kernel takes the same steps on the same bits:
- amax is an integer max over `|x|`'s fp32 bits (NaN's bits exceed Inf's, so NaN wins);
- the exponent comes from amax's exponent field, plus 1 when its mantissa field exceeds
  0.75 · 2^23 (i.e. 1.m > 1.75 = 448 / 2^8); no log2;
- 2^-exp is assembled from bits, so x · 2^-exp is exact (except below fp32's normal range,
  where E4M3 gives ±0 either way);
- fp32 -> E4M3 rounds to nearest even and saturates at ±448.

Design: one program per (BLOCK_M x BLOCK_N tile, expert). The tile is loaded once, as raw
bits (bf16 widened by a shift, so no float conversion is involved), and both orientations
are made from the registers: rowwise reduces the tile viewed as [BLOCK_M, BLOCK_N/32, 32],
colwise as [BLOCK_M/32, 32, BLOCK_N], and the colwise bytes are stored through `tl.trans`
into `q_t`. Tiles start at multiples of BLOCK_M/BLOCK_N (both multiples of 32), so a
32-block never straddles tiles; masked-off elements load as 0 bits, which no amax notices,
and only the dim being blocked must be a multiple of 32.

Rounding (`mxfp8_round`, the triton backend's mxfp8 GEMM operands on Hopper): the same blocks,
exponents and bytes, decoded back to values, `e4m3(q) · 2^exp`, and stored as bf16 in the
input's own layout. bf16 holds every such value exactly (E4M3's 3 mantissa bits and
E8M0's exponents fit in bf16's 7 and fp32's range; only values below bf16's smallest
subnormal, 2^-133, in blocks whose amax is under ~2^-118, are lost). So a bf16 tensor-core
GEMM over rounded operands, accumulating in fp32, computes the MX GEMM exactly: each
product of two rounded values is exact in fp32. Hopper has no MX MMA instruction; this is
the "dequantize into bf16 MMA" way, with the dequantization done by the operand's
producer. For an operand in the expert-sorted layout (`schedule`), padding rows count
as zeros and are written as zeros, and rows past the schedule's `num_rows` are skipped:
the schedule pads every expert to a multiple of its BLOCK_M (a multiple of 32), so a
block of 32 rows never mixes experts.

Caller contract: reads `t` (any strides), writes the four outputs in full. No atomics, no
reductions across programs: the bytes are a pure function of the input (deterministic).

Interpreter workaround: triton 3.6's interpreter converts fp32 -> fp8 wrongly (seen on CPU:
ties round away from zero, 500 becomes 256 instead of saturating, E4M3 subnormals off by
one), so under INTERPRETER we round to E4M3 with integer arithmetic; the GPU path uses the
hardware's RNE saturating conversion (`cvt.rn.satfinite`).
GPU caveat: the scaling multiply must not flush fp32 subnormal inputs to zero (a block of
fp32 subnormals is scaled by 2^127 into E4M3's range); Triton does not enable FTZ by default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.common import interpreting, round_to_bf16
from mok.kernels.plan import kernel_plan
from mok.kernels.routing.schedule import RoutingSchedule
from mok.mxfp8 import E4M3_NAN_BYTE, E8M0_NAN, MX_BLOCK, _check_block_dim, _check_input

__all__ = ["mxfp8_quantize_triton", "validate_mxfp8_quantize_args", "mxfp8_round", "mxfp8_round_tile"]


# --------------------------------------------------------------------------- helpers


@triton.jit
def _load_fp32_bits(x_ptr, offs, mask, IS_BF16: tl.constexpr):
    """The fp32 bit patterns (int32) of the elements at offs; bf16 widened exactly by a shift."""
    raw = tl.load(x_ptr + offs, mask=mask, other=0)
    if IS_BF16:
        bits = (raw.to(tl.int32) & 0xFFFF) << 16  # int16 -> int32 sign-extends; keep 16 bits
    else:
        bits = raw
    return bits


@triton.jit
def _block_exponent(amax_bits):
    """(exp clamped to [-127, 127], non_finite) from the int32 bits of a block's amax (≥ 0).

    amax = 1.m · 2^k  ->  ceil(log2(amax / 448)) = k - 8 + (1.m > 1.75). Zero and fp32
    subnormals come out ≤ -134 and clamp to -127, the all-zero block rule.
    """
    exp_field = amax_bits >> 23
    non_finite = exp_field == 255
    exp = exp_field - (127 + 8) + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    exp = tl.minimum(tl.maximum(exp, -127), 127)
    return exp, non_finite


@triton.jit
def _pow2_neg(exp):
    """2^-exp as fp32, exactly, for -127 ≤ exp ≤ 127 (2^-127 is the subnormal 1 << 22)."""
    e = -exp
    bits = tl.where(e >= -126, (tl.maximum(e, -126) + 127) << 23, 1 << 22)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_rne_saturate_bits(x, INTEGER_PATH: tl.constexpr):
    """fp32 -> E4M3 byte (uint8), round to nearest even, finite values saturating to ±448;
    INTEGER_PATH rounds with integer arithmetic instead of the hardware conversion.

    NaN blocks are overwritten by the caller, so NaN handling here does not matter."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if INTEGER_PATH:
        # The interpreter's fp8 cast is wrong (module docstring): round the bits ourselves.
        bits = x.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF  # ≤ bits of 448
        exp_field = mag >> 23
        # Normal E4M3 (|x| ≥ 2^-6, fp32 exponent field ≥ 121): keep 3 of 23 mantissa bits,
        # RNE; a carry moves into the exponent, and |x| ≤ 448 cannot round past 448.
        rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20
        normal = rounded - ((127 - 7) << 3)
        # Subnormal E4M3 (steps of 2^-9): round(m24 · 2^(k-23) / 2^-9) = m24 >> (14 - k), RNE;
        # the shift is capped at 25, past which m24 < 2^24 rounds to 0 anyway (and kept ≥ 1
        # where the normal branch wins, so no lane shifts out of range).
        m24 = (mag & 0x7FFFFF) | tl.where(exp_field > 0, 0x800000, 0).to(tl.uint32)
        shift = tl.minimum(tl.maximum(127 + 14 - exp_field.to(tl.int32), 1), 25).to(tl.uint32)
        half_minus_one = (tl.full(shift.shape, 1, tl.uint32) << (shift - 1)) - 1
        sub = (m24 + half_minus_one + ((m24 >> shift) & 1)) >> shift
        byte = sign | tl.where(exp_field >= 121, normal, sub)
        out = byte.to(tl.uint8)
    else:
        out = x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    return out


@triton.jit
def _e4m3_round_value(x):
    """x (fp32, |x| ≤ 448 or NaN) rounded to the nearest E4M3 value, ties to even, as fp32:
    the value of `_e4m3_rne_saturate_bits(x)`'s byte, without making the byte. About a third
    of the integer path's work, which bounds the rounding kernels (H200's integer ALUs).

    Normal range (|x| ≥ 2^-6): keep 3 of fp32's 23 mantissa bits, RNE on the bits (a carry
    moves into the exponent; |x| ≤ 448 cannot round past 448). Subnormal range: steps of
    2^-9, which is fp32's ulp at 2^14, so adding and subtracting 2^14 rounds |x| to them
    (RNE, exact); 2^-6 itself may come out, the smallest normal, as the byte path gives."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000
    magnitude = mag.to(tl.float32, bitcast=True)
    subnormal = ((magnitude + 16384.0) - 16384.0).to(tl.uint32, bitcast=True)
    rounded = tl.where(mag >= (121 << 23), normal, subnormal)
    return (sign | rounded).to(tl.float32, bitcast=True)


@triton.jit
def _round_blocks(x, AXIS: tl.constexpr):
    """x (fp32, 3-D, blocks of 32 along AXIS) rounded to the MXFP8 grid: the values of the
    quantizer's bytes and exponents, NaN for a block holding NaN or Inf. The E4M3 rounding is
    done on the fp32 bits (`_e4m3_round_value`): with the hardware conversion here, H200
    (triton 3.6) gave wrong values for some tile shapes, while the quantizer kernel's 2-D
    conversion is right."""
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=AXIS)
    exp, non_finite = _block_exponent(amax)
    exp = tl.expand_dims(exp, AXIS)
    value = _e4m3_round_value(x * _pow2_neg(exp)) * _pow2_neg(-exp)  # exact: 2^k times ≤ 4 significant bits
    return tl.where(tl.expand_dims(non_finite, AXIS), float("nan"), value)


@triton.jit
def mxfp8_round_tile(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ALONG_M: tl.constexpr):
    """A [BLOCK_M, BLOCK_N] fp32 tile rounded to the MXFP8 grid in blocks of 32 along N (a
    GEMM operand reduced over N), or along M with ALONG_M (reduced over M). The tile must
    hold whole blocks (it starts at a multiple of 32 on the blocked axis)."""
    if ALONG_M:
        rounded = _round_blocks(tl.reshape(x, (BLOCK_M // 32, 32, BLOCK_N)), 1)
    else:
        rounded = _round_blocks(tl.reshape(x, (BLOCK_M, BLOCK_N // 32, 32)), 2)
    return tl.reshape(rounded, (BLOCK_M, BLOCK_N))


@triton.jit
def _tile_indices(M, N, stride_x_e, stride_x_m, stride_x_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile of an [E, M, N] input (programs: m tile, n tile, expert): (expert,
    rows [BLOCK_M], cols [BLOCK_N], both int64, their in-bounds masks, and the input's
    element offsets [BLOCK_M, BLOCK_N])."""
    expert = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = expert * stride_x_e + rows[:, None] * stride_x_m + cols[None, :] * stride_x_n
    return expert, rows, cols, rows < M, cols < N, offs


# --------------------------------------------------------------------------- kernel


@triton.jit
def _mxfp8_quantize_kernel(
    # pointers: input bits (int16 view of bf16, int32 view of fp32), uint8 outputs
    x_ptr, q_ptr, scale_ptr, q_t_ptr, scale_t_ptr,
    # sizes
    M, N,
    # strides (elements); outputs are contiguous
    stride_x_e, stride_x_m, stride_x_n,
    # constexpr meta
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, IS_BF16: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    expert, rows64, cols64, row_ok, col_ok, offs = _tile_indices(
        M, N, stride_x_e, stride_x_m, stride_x_n, BLOCK_M, BLOCK_N)
    mask = row_ok[:, None] & col_ok[None, :]  # [BLOCK_M, BLOCK_N]

    bits = _load_fp32_bits(x_ptr, offs, mask, IS_BF16)  # [BLOCK_M, BLOCK_N] int32, read once
    x = bits.to(tl.float32, bitcast=True)
    abs_bits = bits & 0x7FFFFFFF  # integer order = float order, NaN above Inf
    plane = expert * M * N  # elements per expert in every output

    if ROWWISE:  # blocks of 32 along N
        amax = tl.max(tl.reshape(abs_bits, (BLOCK_M, BLOCK_N // 32, 32)), axis=2)  # [BLOCK_M, BLOCK_N/32]
        exp, non_finite = _block_exponent(amax)
        scaled = tl.reshape(x, (BLOCK_M, BLOCK_N // 32, 32)) * _pow2_neg(exp)[:, :, None]  # exact
        scaled = tl.reshape(scaled, (BLOCK_M, BLOCK_N))
        q = _e4m3_rne_saturate_bits(scaled, INTERPRETER)  # [BLOCK_M, BLOCK_N] uint8
        nan_block = tl.broadcast_to(non_finite[:, :, None], (BLOCK_M, BLOCK_N // 32, 32))
        nan_block = tl.reshape(nan_block, (BLOCK_M, BLOCK_N))
        q = tl.where(nan_block, 0x7F, q).to(tl.uint8)  # E4M3_NAN_BYTE
        tl.store(q_ptr + plane + rows64[:, None] * N + cols64[None, :], q, mask=mask)

        sblocks = tl.program_id(1) * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)  # [BLOCK_N/32]
        scale = tl.where(non_finite, 255, exp + 127).to(tl.uint8)  # E8M0_NAN
        s_offs = plane // 32 + rows64[:, None] * (N // 32) + sblocks[None, :]
        tl.store(scale_ptr + s_offs, scale, mask=row_ok[:, None] & (sblocks < N // 32)[None, :])

    if COLWISE:  # blocks of 32 along M, stored transposed
        amax_t = tl.max(tl.reshape(abs_bits, (BLOCK_M // 32, 32, BLOCK_N)), axis=1)  # [BLOCK_M/32, BLOCK_N]
        exp_t, non_finite_t = _block_exponent(amax_t)
        scaled_t = tl.reshape(x, (BLOCK_M // 32, 32, BLOCK_N)) * _pow2_neg(exp_t)[:, None, :]  # exact
        scaled_t = tl.reshape(scaled_t, (BLOCK_M, BLOCK_N))
        q_t = _e4m3_rne_saturate_bits(scaled_t, INTERPRETER)  # [BLOCK_M, BLOCK_N] uint8
        nan_block_t = tl.broadcast_to(non_finite_t[:, None, :], (BLOCK_M // 32, 32, BLOCK_N))
        nan_block_t = tl.reshape(nan_block_t, (BLOCK_M, BLOCK_N))
        q_t = tl.trans(tl.where(nan_block_t, 0x7F, q_t).to(tl.uint8))  # [BLOCK_N, BLOCK_M]
        tl.store(q_t_ptr + plane + cols64[:, None] * M + rows64[None, :], q_t, mask=tl.trans(mask))

        sblocks_t = tl.program_id(0) * (BLOCK_M // 32) + tl.arange(0, BLOCK_M // 32)  # [BLOCK_M/32]
        scale_t = tl.trans(tl.where(non_finite_t, 255, exp_t + 127).to(tl.uint8))  # [BLOCK_N, BLOCK_M/32]
        st_offs = plane // 32 + cols64[:, None] * (M // 32) + sblocks_t[None, :]
        tl.store(scale_t_ptr + st_offs, scale_t, mask=col_ok[:, None] & (sblocks_t < M // 32)[None, :])


@triton.jit
def _mxfp8_round_kernel(
    # pointers: input (bf16 or fp32), bf16 outputs in the input's layout (contiguous)
    x_ptr, rows_out_ptr, cols_out_ptr,
    # schedule of a sorted-layout input (SORTED only)
    row_source_ptr, num_rows_ptr,
    # sizes, strides (elements)
    M, N, stride_x_e, stride_x_m, stride_x_n,
    # constexpr meta
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, SORTED: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    expert, rows, cols, row_ok, col_ok, offs = _tile_indices(
        M, N, stride_x_e, stride_x_m, stride_x_n, BLOCK_M, BLOCK_N)
    load_rows = row_ok
    if SORTED:  # rows past num_rows: nobody reads them; padding rows: zeros
        num_rows = tl.load(num_rows_ptr)
        if tl.program_id(0) * BLOCK_M >= num_rows:
            return
        row_ok = row_ok & (rows < num_rows)
        load_rows = row_ok & (tl.load(row_source_ptr + rows, mask=row_ok, other=-1) >= 0)
    x = tl.load(x_ptr + offs, mask=load_rows[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    out_offs = expert * M * N + rows[:, None] * N + cols[None, :]
    store_mask = row_ok[:, None] & col_ok[None, :]
    if ROWWISE:
        rounded = mxfp8_round_tile(x, BLOCK_M, BLOCK_N, False)
        tl.store(rows_out_ptr + out_offs, round_to_bf16(rounded, INTERPRETER), mask=store_mask)
    if COLWISE:
        rounded = mxfp8_round_tile(x, BLOCK_M, BLOCK_N, True)
        tl.store(cols_out_ptr + out_offs, round_to_bf16(rounded, INTERPRETER), mask=store_mask)


# --------------------------------------------------------------------------- launcher


def validate_mxfp8_quantize_args(t: object, rowwise: bool, colwise: bool) -> None:
    """The reference's checks, in its order, through its own helpers (one definition of each
    message); also used by the fake implementation in `mok.ops`."""
    _check_input(t)
    if not (rowwise or colwise):
        # The one message mok.mxfp8 writes inline; a test compares the two texts.
        raise ValueError("mxfp8_quantize: nothing to do, rowwise and colwise are both False")
    shape = tuple(t.shape)
    if rowwise:
        _check_block_dim("N (last)", shape[-1], shape)
    if colwise:
        _check_block_dim("M (second to last)", shape[-2], shape)


def _tile(M: int, N: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of a launch over [M, N]: the plan's `mxfp8_tile_m`, `mxfp8_tile_n`, or less for a
    smaller operand, both multiples of MX_BLOCK so that blocks never straddle tiles."""
    plan = kernel_plan(device)
    return (min(plan.mxfp8_tile_m, max(MX_BLOCK, triton.next_power_of_2(M))),
            min(plan.mxfp8_tile_n, max(MX_BLOCK, triton.next_power_of_2(N))))


def mxfp8_quantize_triton(
    t: torch.Tensor, rowwise: bool = True, colwise: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`mok.mxfp8.mxfp8_quantize` as one Triton launch; same arguments, outputs, errors and bytes.

    Returns `(q, scale, q_t, scale_t)`, all contiguous, the pair not asked for None:
      q [..., M, N] e4m3, scale [..., M, N/32] uint8; q_t [..., N, M] e4m3, scale_t [..., N, M/32] uint8.
    """
    validate_mxfp8_quantize_args(t, rowwise, colwise)
    shape = tuple(t.shape)
    M, N = shape[-2], shape[-1]
    assert E4M3_NAN_BYTE == 0x7F and E8M0_NAN == 255 and MX_BLOCK == 32  # literals in the kernel

    x3 = t if t.dim() == 3 else t.unsqueeze(0)  # [E, M, N]
    E = x3.shape[0]
    lead = shape[:-2]
    new = lambda *s: torch.empty(*s, dtype=torch.uint8, device=t.device)  # noqa: E731
    q = new(*lead, M, N) if rowwise else None  # [..., M, N] e4m3 bytes
    scale = new(*lead, M, N // MX_BLOCK) if rowwise else None  # [..., M, N/32] uint8
    q_t = new(*lead, N, M) if colwise else None  # [..., N, M] e4m3 bytes
    scale_t = new(*lead, N, M // MX_BLOCK) if colwise else None  # [..., N, M/32] uint8

    if t.numel() > 0:
        bits = x3.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)  # same strides
        block_m, block_n = _tile(M, N, t.device)
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), E)
        dummy = q if q is not None else q_t  # unused pointer slots get any uint8 tensor
        _mxfp8_quantize_kernel[grid](
            bits, dummy if q is None else q, dummy if scale is None else scale,
            dummy if q_t is None else q_t, dummy if scale_t is None else scale_t,
            M, N,
            bits.stride(0), bits.stride(1), bits.stride(2),
            ROWWISE=rowwise, COLWISE=colwise, IS_BF16=t.dtype == torch.bfloat16, INTERPRETER=interpreting(),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
        )
    as_e4m3 = lambda b: None if b is None else b.view(torch.float8_e4m3fn)  # noqa: E731
    return as_e4m3(q), scale, as_e4m3(q_t), scale_t


def mxfp8_round(
    t: torch.Tensor, rowwise: bool = True, colwise: bool = False, schedule: RoutingSchedule | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """t [..., M, N] (bf16 or fp32) rounded to the MXFP8 grid, as bf16 in t's shape (contiguous):
    `(rows, cols)`, rows with blocks of 32 along N (for a GEMM reducing over N), cols along M;
    the one not asked for is None. Equal to `mxfp8_dequantize(*mxfp8_quantize(t)[:2])` (rows)
    and to the transpose of the colwise pair's dequantization (cols), rounded to bf16 (exact).
    With `schedule`, t [rows ≤ capacity_rows, N] is an operand in its sorted layout: padding
    rows count and come out as zeros, rows past its `num_rows` are left unwritten."""
    validate_mxfp8_quantize_args(t, rowwise, colwise)
    if schedule is not None and (t.dim() != 2 or t.shape[0] > schedule.capacity_rows or schedule.block_m % MX_BLOCK
                                 or t.device != schedule.row_source.device):
        raise ValueError(
            f"t: expected a [rows <= {schedule.capacity_rows}, N] tensor on {schedule.row_source.device} in the "
            f"schedule's sorted layout (BLOCK_M {schedule.block_m}, a multiple of {MX_BLOCK}), got "
            f"{list(t.shape)} on {t.device}"
        )
    x3 = t if t.dim() == 3 else t.unsqueeze(0)  # [E, M, N]
    E, M, N = x3.shape
    rows_out = torch.empty(t.shape, dtype=torch.bfloat16, device=t.device) if rowwise else None
    cols_out = torch.empty(t.shape, dtype=torch.bfloat16, device=t.device) if colwise else None
    if t.numel() > 0:
        block_m, block_n = _tile(M, N, t.device)
        out = rows_out if rows_out is not None else cols_out
        sched = (schedule.row_source, schedule.num_rows) if schedule is not None else (out, out)  # unused without it
        _mxfp8_round_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n), E)](
            x3, out if rows_out is None else rows_out, out if cols_out is None else cols_out, *sched,
            M, N, x3.stride(0), x3.stride(1), x3.stride(2),
            ROWWISE=rowwise, COLWISE=colwise, SORTED=schedule is not None, INTERPRETER=interpreting(),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
        )
    return rows_out, cols_out
