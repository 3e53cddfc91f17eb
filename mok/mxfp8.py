"""MXFP8 (OCP Microscaling v1.0) quantize / dequantize in plain PyTorch: the reference.

    per block b of 32:  exp_b = clamp(ceil(log2(amax_b / 448)), -127, 127),
                        q[i] = e4m3_rne_saturate(x[i] · 2^-exp_b),   scale_b = exp_b + 127

Format: elements are FP8 E4M3 (`torch.float8_e4m3fn`: bias 7, max ±448, no infinities,
NaN = S.1111.111); each block of `MX_BLOCK = 32` consecutive elements shares one E8M0 scale,
a bare biased power-of-two exponent stored as `uint8` (value 2^(scale-127); 255 is NaN).
The exponent is rounded *up*, so x · 2^-exp ≤ 448 and no element overflows; an all-zero
block gets the smallest exponent, -127 (stored 0).

Layout: for `t` of shape `[..., M, N]`, rowwise gives `q [..., M, N]` with
`scale [..., M, N/32]` (blocks along N, row-major); colwise gives the quantization of the
transpose, `q_t [..., N, M]` with `scale_t [..., N, M/32]` (blocks along M). Both pairs share
one layout, blocks along the last dim, so `mxfp8_dequantize` serves either. `...` is an
optional leading expert dim E.

NaN/Inf rule (never turn them into silently wrong finite numbers): a block whose
amax is NaN or ±Inf gets the E8M0 NaN scale 0xFF and every one of its 32 elements becomes
the E4M3 NaN byte 0x7F. Dequantization gives NaN for the whole block, both when reading the
scale (255 -> NaN, as OCP decodes it) and for a consumer that only looks at the elements
(e.g. an FP8 MMA that applies scales afterwards). Other blocks are unaffected.

Bit-exactness: later Triton kernels must reproduce these bytes, so nothing here goes through
float log2/exp2. The exponent comes from the integer bits of amax, and 2^-exp is assembled
from bits, so the scaling x · 2^-exp is an exact multiplication by a power of two (it can
only lose bits when the product falls below fp32's normal range, < 2^-126, where E4M3's
rounding, with steps of 2^-9, gives ±0 either way). All ops are elementwise or reductions
on the tensor's device: no `.item()`, no host sync, CPU and CUDA alike.
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3_MAX",
    "E4M3_NAN_BYTE",
    "E8M0_BIAS",
    "E8M0_NAN",
    "MX_BLOCK",
    "e4m3_rne_saturate",
    "e8m0_to_fp32",
    "mxfp8_dequantize",
    "mxfp8_quantize",
]

E4M3_MAX = 448.0  # largest finite float8_e4m3fn, 1.75 · 2^8
MX_BLOCK = 32  # elements sharing one E8M0 scale (OCP MX v1.0)
E8M0_BIAS = 127  # stored scale = exp + 127; exp in [-127, 127]
E8M0_NAN = 255  # E8M0's only special value
E4M3_NAN_BYTE = 0x7F  # S.1111.111 with S = 0

_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127
_INPUT_DTYPES = (torch.bfloat16, torch.float32)

# fp32 bit fields, for reading amax's exponent exactly.
_FP32_ABS_MASK = 0x7FFFFFFF
_FP32_MANT_BITS = 23
_FP32_MANT_MASK = 0x7FFFFF
_FP32_BIAS = 127
_FP32_EXP_INF_NAN = 255
# 448 = 1.75 · 2^8: amax = 1.m · 2^k fits under 448 · 2^(k-8) iff 1.m ≤ 1.75,
# i.e. iff its 23-bit mantissa field is ≤ 0.75 · 2^23.
_E4M3_MAX_EXP = 8
_E4M3_MAX_MANT_FIELD = 0x600000


# --------------------------------------------------------------------------- helpers


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32, exactly, for an int32 tensor with -149 ≤ e ≤ 127 (subnormals included).

    Built from bits rather than with exp2/ldexp, whose precision is a library's choice.
    """
    normal = e >= 1 - _FP32_BIAS  # e ≥ -126: biased exponent field, zero mantissa
    normal_bits = (e + _FP32_BIAS).clamp(min=1) << _FP32_MANT_BITS
    subnormal_bits = torch.ones_like(e) << (e + 149).clamp(0, _FP32_MANT_BITS - 1)  # 2^-149 · 2^(e+149)
    return torch.where(normal, normal_bits, subnormal_bits).view(torch.float32)


def e4m3_rne_saturate(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round-to-nearest-even, finite values saturating to ±448.

    torch's own cast is not consistent about overflow (c10's scalar conversion turns |x| ≥ 480
    into NaN, while the CPU tensor cast of torch 2.13 saturates, even Inf to 448), so clamp
    first and the result is the same on every path; clamp keeps NaN a NaN. Ties go to even.
    """
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e8m0_to_fp32(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 scales -> the fp32 powers of two 2^(scale-127); 255 -> NaN. Exact (0 -> 2^-127)."""
    exp = scale.to(torch.int32) - E8M0_BIAS
    value = _pow2(exp.clamp(max=_E8M0_MAX_EXP))  # clamp: 255 would overflow the bit pattern
    return torch.where(scale == E8M0_NAN, torch.full_like(value, float("nan")), value)


def check_dtype(name: str, t: object, dtypes: tuple[torch.dtype, ...], note: str = "") -> None:
    """TypeError naming `name` unless `t` is a tensor of one of `dtypes` (shared by the
    quantizers of both low-precision formats)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}{note}, got {got}")


def check_float_input(name: str, t: object, dims: tuple[int, ...], layout: str) -> None:
    """A bf16/fp32 tensor with one of the ranks `dims` (`layout` names them in the error)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    check_dtype(name, t, _INPUT_DTYPES)
    if t.dim() not in dims:
        raise ValueError(f"{name}: expected a {layout} tensor, got shape {tuple(t.shape)}")


def _check_input(t: object) -> None:
    check_float_input("t", t, (2, 3), "2-D [M, N] or 3-D [E, M, N]")


def _check_block_dim(name: str, size: int, shape: tuple[int, ...]) -> None:
    if size % MX_BLOCK != 0:
        raise ValueError(
            f"t: dim {name} = {size} must be a multiple of {MX_BLOCK} (the MX block size) "
            f"to quantize along it, got shape {shape}"
        )


def _quantize_last_dim(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `[..., R, K]` (K % 32 == 0) in blocks of 32 along K -> (q [..., R, K], scale [..., R, K/32])."""
    *lead, K = t.shape
    x = t.float().contiguous().reshape(*lead, K // MX_BLOCK, MX_BLOCK)  # [..., R, K/32, 32] fp32 (bf16 -> fp32 exact)

    # |x| as int32 bits: for non-negative floats integer order is float order, and NaN's bits
    # exceed Inf's, so an integer amax is exact and lets NaN win over everything.
    amax_bits = (x.view(torch.int32) & _FP32_ABS_MASK).amax(dim=-1)  # [..., R, K/32] int32
    amax_exp_field = amax_bits >> _FP32_MANT_BITS
    non_finite = amax_exp_field == _FP32_EXP_INF_NAN  # [..., R, K/32] bool

    # ceil(log2(amax / 448)) exactly: amax = 1.m · 2^k gives k - 8, plus 1 when 1.m > 1.75.
    # Zero and fp32 subnormals come out ≤ -134 and clamp to -127, the all-zero block rule.
    exp = amax_exp_field - (_FP32_BIAS + _E4M3_MAX_EXP)
    exp = exp + ((amax_bits & _FP32_MANT_MASK) > _E4M3_MAX_MANT_FIELD).to(torch.int32)
    exp = exp.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)  # [..., R, K/32] int32

    scale = torch.where(non_finite, E8M0_NAN, exp + E8M0_BIAS).to(torch.uint8)  # [..., R, K/32] uint8

    # 2^-exp lies in [2^-127, 2^127]: a normal fp32 or, for exp = 127, the subnormal 2^-127;
    # both exact, so the multiplication is exact (see the module docstring).
    scaled = x * _pow2(-exp).unsqueeze(-1)  # [..., R, K/32, 32] fp32, |scaled| ≤ 448
    # The saturation only matters if exp were clamped at 127, which needs amax > 448·2^127 >
    # fp32 max: unreachable for finite inputs, kept so the rule holds whatever feeds it.
    q_bytes = e4m3_rne_saturate(scaled).view(torch.uint8)
    # A NaN/Inf block: every element NaN (Inf has no E4M3 encoding, and NaN elements keep a
    # consumer that ignores the scale from producing finite numbers).
    q_bytes = torch.where(non_finite.unsqueeze(-1), E4M3_NAN_BYTE, q_bytes).to(torch.uint8)
    q = q_bytes.reshape(*lead, K).view(torch.float8_e4m3fn)  # [..., R, K] e4m3
    return q, scale


# --------------------------------------------------------------------------- public API


def mxfp8_quantize(
    t: torch.Tensor, rowwise: bool = True, colwise: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Quantize a bf16/fp32 `[M, N]` or `[E, M, N]` tensor to MXFP8.

    Returns `(q, scale, q_t, scale_t)`, all contiguous:
      q       [..., M, N]    float8_e4m3fn   (rowwise; blocks of 32 along N)
      scale   [..., M, N/32] uint8 E8M0
      q_t     [..., N, M]    float8_e4m3fn   (colwise: the quantization of t's transpose,
      scale_t [..., N, M/32] uint8 E8M0       blocks of 32 along M)
    The pair not asked for is None. NaN/Inf in a block: scale 255, elements NaN (module docstring).
    """
    _check_input(t)
    if not (rowwise or colwise):
        raise ValueError("mxfp8_quantize: nothing to do, rowwise and colwise are both False")
    shape = tuple(t.shape)
    M, N = shape[-2], shape[-1]
    if rowwise:
        _check_block_dim("N (last)", N, shape)
    if colwise:
        _check_block_dim("M (second to last)", M, shape)

    q = scale = q_t = scale_t = None
    if rowwise:
        q, scale = _quantize_last_dim(t)  # [..., M, N], [..., M, N/32]
    if colwise:
        q_t, scale_t = _quantize_last_dim(t.transpose(-2, -1))  # [..., N, M], [..., N, M/32]
    return q, scale, q_t, scale_t


def mxfp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Invert `mxfp8_quantize` for one pair: `q.float() · 2^(scale-127)` per 32-block of the last dim.

    `q` float8_e4m3fn `[..., R, K]`, `scale` uint8 `[..., R, K/32]` (either the rowwise pair or
    the colwise `(q_t, scale_t)`). Returns fp32 `[..., R, K]`; blocks with scale 255 are NaN.
    Exact: an E4M3 value times a power of two ≥ 2^-127 is representable in fp32 — except at
    the very top, where an input |x| ≥ 1.9375 · 2^127 (within 3% of fp32 max) was rounded up
    to 256 · 2^120 = 2^128 and so dequantizes to ±Inf, the correctly rounded fp32 result.
    """
    check_dtype("q", q, (torch.float8_e4m3fn,))
    check_dtype("scale", scale, (torch.uint8,), " (E8M0)")
    if q.dim() not in (2, 3):
        raise ValueError(f"q: expected a 2-D [R, K] or 3-D [E, R, K] tensor, got shape {tuple(q.shape)}")
    *lead, K = q.shape
    if K % MX_BLOCK != 0:
        raise ValueError(f"q: last dim K = {K} must be a multiple of {MX_BLOCK}, got shape {tuple(q.shape)}")
    expected = (*lead, K // MX_BLOCK)
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale: expected shape {expected} for q of shape {tuple(q.shape)}, got {tuple(scale.shape)}")

    x = q.float().reshape(*lead, K // MX_BLOCK, MX_BLOCK)  # [..., R, K/32, 32] fp32
    out = x * e8m0_to_fp32(scale).unsqueeze(-1)  # NaN scale -> NaN block
    return out.reshape(*lead, K)  # [..., R, K] fp32
