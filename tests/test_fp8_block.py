"""mok.fp8_block (the reference) against checks written here independently.

Scales are checked against amax computed in fp64 on a plain per-block loop of slices and
divided by 448 in fp64 (then rounded once to fp32: exact for a quotient of fp32 values, as
fp64 holds > 2·24+2 bits). Elements are checked against the nearest value of a decode table
of all 256 E4M3 bytes (ties to the even byte) of the fp32 product of the element and the
scale's fp32 reciprocal (taken the same way in fp64; the fp64 product of two fp32 values is
exact, so one rounding to fp32 follows), not against torch's float8 cast.
"""

from __future__ import annotations

import math

import pytest
import torch

from mok.fp8_block import (
    FP8_BLOCK,
    FP8_BLOCK_MIN_SCALE,
    fp8_block_dequantize,
    fp8_block_quantize,
    fp8_block_quantize_activations,
    fp8_block_round,
)
from mok.testing.fp8 import E4M3_POSITIVE_VALUES

_POS = E4M3_POSITIVE_VALUES  # bytes 0..126, increasing


def _ref_e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    """fp64 finite values -> E4M3 bytes: nearest grid value, ties to the even byte, saturate to 448."""
    a = v.abs().clamp(max=448.0)
    hi = torch.searchsorted(_POS, a).clamp(max=0x7E)  # first grid value ≥ a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - _POS[lo], _POS[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    byte = torch.where(pick_hi, hi, lo)
    return (byte | torch.where(v < 0, 0x80, 0)).to(torch.uint8)


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _check_against_independent(t: torch.Tensor, q, scale, br, bc, ctx):
    """Per block: scale == fp32(amax/448 in fp64) (floored at 2^-126); bytes == nearest E4M3 of
    x · fp32(1/scale)."""
    x = t.double()
    R, C = x.shape
    for i in range(0, R, br):
        for j in range(0, C, bc):
            blk = x[i : i + br, j : j + bc]
            amax = max(blk.abs().max().item(), 448.0 * 2.0**-126)
            s = scale[i // br, j // bc].item()
            assert s == torch.tensor(amax / 448.0).float().item(), f"{ctx} block ({i},{j}): scale {s}, amax {amax}"
            # The rule multiplies in fp32 and then rounds to E4M3: round the exact fp64 product to
            # fp32 first. Rounding it straight to E4M3 would differ where the fp32 product lands
            # on a tie.
            inverse = torch.tensor(1.0 / s).float().double()
            want = _ref_e4m3_bytes((blk * inverse).float().double())
            got = _bytes(q)[i : i + br, j : j + bc]
            assert torch.equal(got, want), f"{ctx} block ({i},{j}): {(got != want).sum()} bytes differ"


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().sum() / b.abs().sum()).item()


# ------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N, K", [(256, 384), (200, 130)])
def test_weight_scales_and_elements_exact(dtype, N, K):
    gen = torch.Generator().manual_seed(N + K)
    w = (torch.randn(N, K, generator=gen) * torch.logspace(-4, 4, K)).to(dtype)
    q, scale, q_t, scale_t = fp8_block_quantize(w)
    ctx = f"{dtype=} {N=} {K=}"
    assert q.shape == (N, K) and q_t.shape == (K, N) and q.dtype == q_t.dtype == torch.float8_e4m3fn, ctx
    assert scale.shape == (math.ceil(N / 128), math.ceil(K / 128)) == scale_t.shape[::-1], ctx
    assert scale.dtype == scale_t.dtype == torch.float32 and q.is_contiguous() and q_t.is_contiguous(), ctx
    _check_against_independent(w, q, scale, 128, 128, ctx)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M, K", [(9, 256), (5, 300)])
def test_activation_scales_and_elements_exact(dtype, M, K):
    gen = torch.Generator().manual_seed(M * K)
    x = (torch.randn(M, K, generator=gen) * torch.logspace(-3, 3, M)[:, None]).to(dtype)
    q, scale = fp8_block_quantize_activations(x)
    ctx = f"{dtype=} {M=} {K=}"
    assert q.shape == (M, K) and scale.shape == (M, math.ceil(K / 128)), ctx
    _check_against_independent(x, q, scale, 1, 128, ctx)
    # A 1×128 block is also what the weight quantizer makes of a single row.
    for i in range(M):
        qw, sw, _, _ = fp8_block_quantize(x[i : i + 1])
        assert torch.equal(_bytes(qw[0]), _bytes(q[i])) and torch.equal(sw[0], scale[i]), f"{ctx} row {i}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_error(dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2, 256, 384, generator=gen).to(dtype)
    q, scale, q_t, scale_t = fp8_block_quantize(w)
    ref = w.float()
    err = _rel_err(fp8_block_dequantize(q, scale, block=(128, 128)), ref)
    err_t = _rel_err(fp8_block_dequantize(q_t, scale_t, block=(128, 128)), ref.mT)
    assert 0.005 < err < 0.05 and err == pytest.approx(err_t, rel=1e-5), f"{dtype=} {err=} {err_t=}"
    x = torch.randn(64, 384, generator=gen).to(dtype)
    qa, sa = fp8_block_quantize_activations(x)
    err_a = _rel_err(fp8_block_dequantize(qa, sa), x.float())
    assert 0.005 < err_a < 0.05, f"{dtype=} {err_a=}"


def test_zero_and_tiny_blocks():
    w = torch.randn(256, 256)
    w[:128, :128] = 0.0
    w[:128, 5] = -0.0  # signs of zero are kept
    w[128:, :128] = 1e-40  # fp32 subnormal: amax/448 would underflow; floored to 2^-126
    q, scale, _, _ = fp8_block_quantize(w)
    assert scale[0, 0].item() == FP8_BLOCK_MIN_SCALE == 2.0**-126
    zero_bytes = _bytes(q)[:128, :128]
    assert torch.all(zero_bytes[:, 5] == 0x80) and (zero_bytes != 0).sum() == 128
    assert torch.equal(fp8_block_dequantize(q, scale, (128, 128))[:128, :128], torch.zeros(128, 128))
    assert scale[1, 0].item() == 2.0**-126
    tiny = fp8_block_dequantize(q, scale, (128, 128))[128:, :128]
    # 1e-40 / 2^-126 ≈ 0.0085 lands on E4M3's subnormal grid (steps 2^-9): 4 steps, kept
    # non-zero but coarse. Blocks this small are far below any real activation or weight.
    assert torch.all(tiny == 4 * 2.0**-9 * 2.0**-126)
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    qa, sa = fp8_block_quantize_activations(x)
    assert torch.all(sa == 2.0**-126) and torch.all(_bytes(qa) == 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_propagate_to_their_block_only(bad):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(256, 384, generator=gen)
    clean = fp8_block_quantize(w)
    w[130, 260] = bad  # block (1, 2)
    q, scale, q_t, scale_t = fp8_block_quantize(w)
    ctx = f"{bad=}"
    assert scale[1, 2].isnan() and scale_t[2, 1].isnan(), ctx
    assert torch.all(_bytes(q)[128:, 256:] == 0x7F) and torch.all(_bytes(q_t)[256:, 128:] == 0x7F), ctx
    assert torch.all(fp8_block_dequantize(q, scale, (128, 128))[128:, 256:].isnan()), ctx
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.equal(scale[keep], clean[1][keep]), ctx
    mask = keep.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(_bytes(q)[mask], _bytes(clean[0])[mask]), ctx

    x = torch.randn(4, 256, generator=gen)
    x[2, 7] = bad
    qa, sa = fp8_block_quantize_activations(x)
    assert sa[2, 0].isnan() and torch.all(_bytes(qa)[2, :128] == 0x7F), ctx
    assert sa.isnan().sum() == 1 and torch.all(fp8_block_dequantize(qa, sa)[2, :128].isnan()), ctx


def test_3d_equals_per_slice_2d():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3, 200, 260, generator=gen).bfloat16()
    outs = fp8_block_quantize(w)
    for e in range(3):
        for got, want in zip(outs, fp8_block_quantize(w[e])):
            assert torch.equal(got[e].view(torch.uint8) if got.dtype != torch.float32 else got[e],
                               want.view(torch.uint8) if want.dtype != torch.float32 else want), f"{e=}"


@pytest.mark.parametrize("shape", [(256, 384), (2, 200, 130)])
def test_transpose_orientation_equals_quantizing_the_transpose(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    _, _, q_t, scale_t = fp8_block_quantize(w)
    q_ref, s_ref, _, _ = fp8_block_quantize(w.mT)  # non-contiguous input works too
    assert torch.equal(_bytes(q_t), _bytes(q_ref)) and torch.equal(scale_t, s_ref), f"{shape=}"


def test_ragged_edges_use_valid_elements_only():
    w = torch.randn(200, 130, generator=torch.Generator().manual_seed(4)) * 5
    w[128:, 128:] = 0.25  # the 72×2 corner block
    q, scale, _, _ = fp8_block_quantize(w)
    assert scale.shape == (2, 2) and scale[1, 1].item() == torch.tensor(0.25 / 448).item()
    padded = torch.zeros(256, 256)
    padded[:200, :130] = w
    qp, sp, _, _ = fp8_block_quantize(padded)
    assert torch.equal(scale, sp) and torch.equal(_bytes(q), _bytes(qp)[:200, :130])


def test_empty_rows():
    q, scale = fp8_block_quantize_activations(torch.empty(0, 256, dtype=torch.bfloat16))
    assert q.shape == (0, 256) and scale.shape == (0, 2)


def test_round_is_dequantize_of_quantize():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 300, generator=gen).bfloat16()
    w = torch.randn(2, 200, 260, generator=gen).bfloat16()
    assert torch.equal(fp8_block_round(x), fp8_block_dequantize(*fp8_block_quantize_activations(x)))
    weight_round = fp8_block_round(w, (FP8_BLOCK, FP8_BLOCK))
    assert weight_round.dtype == torch.float32 and weight_round.shape == w.shape
    assert torch.equal(weight_round, fp8_block_dequantize(*fp8_block_quantize(w)[:2], (FP8_BLOCK, FP8_BLOCK)))
    assert not torch.equal(fp8_block_round(w[0]), weight_round[0])  # 1×128 and 128×128 blocks differ
    with pytest.raises(ValueError, match=r"block: expected \(1, 128\) or \(128, 128\), got \(32, 32\)"):
        fp8_block_round(x, (32, 32))
    with pytest.raises(ValueError, match=r"t: expected a 2-D \[R, C\] or 3-D \[E, R, C\] tensor"):
        fp8_block_round(x[0])


def test_errors():
    with pytest.raises(TypeError, match="w: expected a torch.Tensor"):
        fp8_block_quantize([[1.0]])
    with pytest.raises(TypeError, match="w: expected dtype torch.bfloat16 or torch.float32, got torch.float16"):
        fp8_block_quantize(torch.zeros(128, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"w: expected a 2-D \[N, K\] or 3-D \[E, N, K\] tensor, got shape \(128,\)"):
        fp8_block_quantize(torch.zeros(128))
    with pytest.raises(ValueError, match=r"x: expected a 2-D \[M, K\] tensor"):
        fp8_block_quantize_activations(torch.zeros(2, 3, 128))
    with pytest.raises(TypeError, match="x: expected dtype"):
        fp8_block_quantize_activations(torch.zeros(2, 128, dtype=torch.int32))
    q, s = fp8_block_quantize_activations(torch.ones(2, 256))
    with pytest.raises(TypeError, match="q: expected dtype torch.float8_e4m3fn"):
        fp8_block_dequantize(q.float(), s)
    with pytest.raises(TypeError, match="scale: expected dtype torch.float32"):
        fp8_block_dequantize(q, s.double())
    with pytest.raises(ValueError, match=r"block: expected \(1, 128\) or \(128, 128\), got \(1, 32\)"):
        fp8_block_dequantize(q, s, block=(1, 32))
    with pytest.raises(ValueError, match=r"scale: expected shape \(1, 2\) .* got \(2, 2\)"):
        fp8_block_dequantize(q, s, block=(128, 128))
    assert FP8_BLOCK == 128
