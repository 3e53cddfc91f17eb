"""FP8 block-scaled quantize / dequantize in plain PyTorch (`fp8_block`): the reference.

    per block b:  amax_b  = max |x| over the block's valid elements
                  scale_b = max(amax_b, 448 · 2^-126) / 448          fp32, correctly rounded
                  q[i]    = e4m3_rne_saturate(x[i] · (1 / scale_b))  fp32, each op correctly rounded

This is the DeepSeek-V3 training recipe Hopper runs fast: elements FP8 E4M3
(`torch.float8_e4m3fn`, max ±448), scales plain fp32 (not powers of two), applied per
128-wide K step of an fp32-accumulating GEMM. The elements are multiplied by the scale's
reciprocal, one per block, as DeepGEMM's and Transformer Engine's quantizers do: x · (1/s)
lies within two fp32 ulps of x / s, far below E4M3's step, and costs a kernel one multiply per
element where an exactly rounded quotient costs four operations. Two block shapes:

    activations / activation gradients   1 × 128   one scale per row per 128 columns of K
    weights                            128 × 128   one scale per 128×128 tile

Legend: M rows of an activation, K the GEMM's reduction dim (always the last dim here),
N a weight's output dim, E an optional leading expert dim (`...` below).

Layout: `fp8_block_quantize(w)` for `w [..., N, K]` gives `q [..., N, K]` with
`scale [..., ceil(N/128), ceil(K/128)]`, and the same for the transpose, `q_t [..., K, N]` with
`scale_t [..., ceil(K/128), ceil(N/128)]` (the backward's transposed GEMMs). A 128×128 block
of wᵀ is the transpose of a block of w with the same amax, so `q_t == q.mT` and
`scale_t == scale.mT` bit for bit. `fp8_block_quantize_activations(x)` for `x [M, K]` gives
`q [M, K]` with `scale [M, ceil(K/128)]`. All outputs contiguous, scales row-major.

Rules at the edges (chosen here; the one requirement is that none be silently wrong):
- **Zero and tiny blocks.** The scale is floored at 2^-126, fp32's smallest *normal*: an
  all-zero block gets scale 2^-126 (and q = +0/-0 as the input's signs), never 0 (whose
  reciprocal, ∞, would give 0 · ∞ = NaN). One floor serves both zero blocks and blocks whose
  amax/448 would be an fp32 subnormal or 0: the scale stays a normal number, so its reciprocal
  is exact-rounded on every path (no denormal flush can change it) and dequantization
  `q · scale` of a zero block is 0.
  A floor of 1.0 would work for zero blocks but would round tiny non-zero blocks to 0. (Blocks
  with amax < 448 · 2^-126 keep only E4M3's subnormal resolution relative to 2^-126: coarse,
  but never turned into 0 while representable, and far below any real tensor's range.) The
  floor also keeps the reciprocal finite (at most 2^126).
- **NaN / ±Inf.** A block whose amax is NaN or ±Inf gets scale NaN and every one of its
  elements becomes the E4M3 NaN byte 0x7F (as in `mok.mxfp8`): dequantization gives NaN for
  the whole block whether the consumer reads the scale, the elements, or both (an FP8 MMA that
  applies scales afterwards still sees NaN). Other blocks are unaffected.
- **Ragged edges.** N or K not a multiple of 128 is accepted (the layer requires multiples of 128
  for H and I in this mode, but the quantizer need not): the last block along a dim covers
  the remaining valid elements only, with the same rule over them; its scale occupies a full
  slot of the `ceil(·/128)` grid. Padding never enters an amax.

Bit-exactness: the Triton kernels in `mok.kernels.quant.fp8_block` reproduce these bytes. So
amax is taken on the integer bits of |x| (exact, and NaN's bits win over Inf's and over every
finite value), the scale is one correctly rounded fp32 division of a normal number by 448, its
reciprocal one correctly rounded fp32 division, and each element one correctly rounded fp32
product (subnormal inputs kept) followed by the saturating RNE cast
`mok.mxfp8.e4m3_rne_saturate`. All ops are elementwise or reductions on the tensor's device:
no `.item()`, no host sync, CPU and CUDA alike. Deterministic.
"""

from __future__ import annotations

import torch

from mok.mxfp8 import E4M3_MAX, E4M3_NAN_BYTE, check_dtype, check_float_input, e4m3_rne_saturate

__all__ = [
    "FP8_BLOCK",
    "FP8_BLOCK_MIN_SCALE",
    "fp8_block_dequantize",
    "fp8_block_quantize",
    "fp8_block_quantize_activations",
    "fp8_block_round",
]

FP8_BLOCK = 128  # block edge along K (and along N for weights)
FP8_BLOCK_MIN_SCALE = 2.0**-126  # fp32's smallest normal: the scale of an all-zero block
# Floor applied to amax before the division: (448 · 2^-126) / 448 == 2^-126 exactly.
_AMAX_FLOOR = E4M3_MAX * FP8_BLOCK_MIN_SCALE

_FP32_ABS_MASK = 0x7FFFFFFF
_FP32_INF_BITS = 0x7F800000  # |x| bits ≥ this: ±Inf or NaN
_BLOCK_SHAPES = ((1, FP8_BLOCK), (FP8_BLOCK, FP8_BLOCK))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _quantize_blocks(t: torch.Tensor, block_r: int, block_c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `[..., R, C]` in `block_r × block_c` blocks -> (q [..., R, C] e4m3, scale [..., ⌈R/br⌉, ⌈C/bc⌉] fp32)."""
    *lead, R, C = t.shape
    Rb, Cb = _cdiv(R, block_r), _cdiv(C, block_c)
    x = t.float()  # [..., R, C] fp32 (bf16 -> fp32 exact)
    # Zero padding to whole blocks: |0| never raises an amax, and the padded outputs are cut off.
    x = torch.nn.functional.pad(x, (0, Cb * block_c - C, 0, Rb * block_r - R))  # [..., Rb·br, Cb·bc]
    x = x.reshape(*lead, Rb, block_r, Cb, block_c)  # [..., Rb, br, Cb, bc] fp32

    # |x| as int32 bits: for non-negative floats integer order is float order and NaN's bits
    # exceed Inf's, so the integer amax is exact and NaN wins over everything.
    amax_bits = (x.view(torch.int32) & _FP32_ABS_MASK).amax(dim=(-3, -1))  # [..., Rb, Cb] int32
    non_finite = amax_bits >= _FP32_INF_BITS  # [..., Rb, Cb] bool
    amax = amax_bits.view(torch.float32)  # [..., Rb, Cb] fp32 (garbage where non_finite)

    scale = amax.clamp(min=_AMAX_FLOOR) / E4M3_MAX  # [..., Rb, Cb] fp32, ≥ 2^-126
    scale = torch.where(non_finite, torch.full_like(scale, float("nan")), scale)

    inverse = 1.0 / scale  # [..., Rb, Cb] fp32, ≤ 2^126
    scaled = x * inverse[..., :, None, :, None]  # [..., Rb, br, Cb, bc] fp32, |·| ≤ 448 (+2 ulp)
    q_bytes = e4m3_rne_saturate(scaled).view(torch.uint8)
    # NaN/Inf block: every element the NaN byte (Inf has no E4M3 encoding).
    q_bytes = torch.where(non_finite[..., :, None, :, None], E4M3_NAN_BYTE, q_bytes).to(torch.uint8)
    q_bytes = q_bytes.reshape(*lead, Rb * block_r, Cb * block_c)[..., :R, :C]  # [..., R, C] uint8
    return q_bytes.contiguous().view(torch.float8_e4m3fn), scale


def _check_block(block) -> tuple[int, int]:
    block = tuple(block) if isinstance(block, (tuple, list)) else block
    if block not in _BLOCK_SHAPES:
        raise ValueError(f"block: expected (1, {FP8_BLOCK}) or ({FP8_BLOCK}, {FP8_BLOCK}), got {block}")
    return block


# --------------------------------------------------------------------------- public API


def fp8_block_quantize(
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a bf16/fp32 weight `[N, K]` or `[E, N, K]` in 128×128 blocks, both orientations.

    Returns `(q, scale, q_t, scale_t)`, all contiguous:
      q       [..., N, K]                  float8_e4m3fn
      scale   [..., ⌈N/128⌉, ⌈K/128⌉]     fp32
      q_t     [..., K, N]                  float8_e4m3fn  (the quantization of w's transpose)
      scale_t [..., ⌈K/128⌉, ⌈N/128⌉]     fp32
    Zero blocks get scale 2^-126; NaN/Inf blocks scale NaN and NaN elements (module docstring).
    """
    check_float_input("w", w, (2, 3), "2-D [N, K] or 3-D [E, N, K]")
    q, scale = _quantize_blocks(w, FP8_BLOCK, FP8_BLOCK)  # [..., N, K], [..., ⌈N/128⌉, ⌈K/128⌉]
    # Same blocks, same amax, same per-element products: the transpose's quantization is the
    # transpose of this one, bit for bit.
    q_t = q.view(torch.uint8).mT.contiguous().view(torch.float8_e4m3fn)  # [..., K, N]
    scale_t = scale.mT.contiguous()  # [..., ⌈K/128⌉, ⌈N/128⌉]
    return q, scale, q_t, scale_t


def fp8_block_quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a bf16/fp32 activation `[M, K]` in 1×128 blocks along K.

    Returns `(q [M, K] float8_e4m3fn, scale [M, ⌈K/128⌉] fp32)`, contiguous.
    """
    check_float_input("x", x, (2,), "2-D [M, K]")
    return _quantize_blocks(x, 1, FP8_BLOCK)


def fp8_block_dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (1, FP8_BLOCK)
) -> torch.Tensor:
    """Invert a quantization: `q.float() · scale` per `block` (`(1, 128)` or `(128, 128)`) -> fp32.

    `q` float8_e4m3fn `[..., R, C]` (2-D or 3-D), `scale` fp32 `[..., ⌈R/br⌉, ⌈C/bc⌉]`. Serves
    the activation pair with `block=(1, 128)` and either weight pair with `block=(128, 128)`.
    NaN scales give NaN blocks.
    """
    check_dtype("q", q, (torch.float8_e4m3fn,))
    check_dtype("scale", scale, (torch.float32,))
    block = _check_block(block)
    if q.dim() not in (2, 3):
        raise ValueError(f"q: expected a 2-D [R, C] or 3-D [E, R, C] tensor, got shape {tuple(q.shape)}")
    *lead, R, C = q.shape
    block_r, block_c = block
    expected = (*lead, _cdiv(R, block_r), _cdiv(C, block_c))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale: expected shape {expected} for q of shape {tuple(q.shape)} and block {block}, "
            f"got {tuple(scale.shape)}"
        )
    s = scale.repeat_interleave(block_r, dim=-2)[..., :R, :]  # [..., R, ⌈C/bc⌉]
    s = s.repeat_interleave(block_c, dim=-1)[..., :C]  # [..., R, C] fp32
    return q.float() * s  # [..., R, C] fp32


def fp8_block_round(t: torch.Tensor, block: tuple[int, int] = (1, FP8_BLOCK)) -> torch.Tensor:
    """`t` `[R, C]` or `[E, R, C]` (bf16/fp32) rounded through FP8 in `block`s -> fp32 of t's shape.

    The value a GEMM on the quantized operand sees: `fp8_block_dequantize` of the quantization
    with one scale per `block` (`(1, 128)` for an activation, `(128, 128)` for a weight), C the
    reduction dim. What the reference backend computes with in fp8_block mode.
    """
    check_float_input("t", t, (2, 3), "2-D [R, C] or 3-D [E, R, C]")
    block = _check_block(block)
    q, scale = _quantize_blocks(t, *block)
    return fp8_block_dequantize(q, scale, block)
