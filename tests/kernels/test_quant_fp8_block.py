"""FP8 block quantization kernels, bit for bit against the reference `mok.fp8_block`.

Scales compare by bits, except that any NaN equals any NaN (a payload carries no meaning).
Edge cases: zero, subnormal, NaN/±Inf blocks, ragged edges, values at E4M3 rounding ties
and its subnormal range (rows anchored by 448 have scale exactly 1, so the cast sees them
unchanged), values near fp32's max, a strided input, and no rows at all.
"""

import pytest
import torch

from mok.fp8_block import fp8_block_quantize, fp8_block_quantize_activations
from mok.kernels.quant_fp8_block import quantize_fp8_block_activations, quantize_fp8_block_weights


def _assert_same(got, want, ctx):
    assert len(got) == len(want), ctx
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = g.cpu(), w.cpu()
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous(), f"{ctx} output {i}: {g.dtype} {g.shape}"
        if g.dtype == torch.float32:
            both_nan = g.isnan() & w.isnan()
            diff = (g.view(torch.int32) != w.view(torch.int32)) & ~both_nan
        else:
            diff = g.view(torch.uint8) != w.view(torch.uint8)
        if diff.any():
            where = diff.nonzero()[:5].tolist()
            raise AssertionError(f"{ctx} output {i}: {int(diff.sum())} differ, first at {where}")


def _tie_row(gen):
    """448 then values at E4M3 ties, near ties, in its subnormal range, and beyond ±448."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2  # exact ties, representable in fp32
    vals = torch.cat([mids, torch.nextafter(mids, torch.zeros(1)), torch.nextafter(mids, torch.full((1,), 500.0))])
    vals = vals[torch.randperm(vals.numel(), generator=gen)][:110]
    extra = torch.tensor([2.0**-10, 3 * 2.0**-11, 2.0**-6 - 2.0**-12, 1e-30, 1e-42, 450.0, 464.0, 500.0, 1e30, -0.0,
                          0.0, 2.0**-9, 5 * 2.0**-11, 7 * 2.0**-10, 2.0**-6, 15 * 2.0**-10, 448.0])
    row = torch.cat([torch.tensor([448.0]), vals, extra])[:128]
    signs = torch.where(torch.rand(128, generator=gen) < 0.5, -1.0, 1.0)
    signs[0] = 1.0
    return row * signs  # [128] fp32; |row| ≤ 448 except the saturating ones (scale stays 1 only if ≤ 448)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M, K", [(70, 300), (1, 128), (33, 256)])
def test_activations_random(kernel_device, dtype, M, K):
    gen = torch.Generator().manual_seed(M + K)
    x = (torch.randn(M, K, generator=gen) * torch.logspace(-3, 3, K)).to(dtype)
    got = quantize_fp8_block_activations(x.to(kernel_device))
    _assert_same(got, fp8_block_quantize_activations(x), f"{kernel_device=} {dtype=} {M=} {K=}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (2, 128, 256)])
def test_weights_random(kernel_device, dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(*shape, generator=gen) * 10.0 ** torch.randint(-4, 4, shape[-1:], generator=gen)).to(dtype)
    got = quantize_fp8_block_weights(w.to(kernel_device))
    _assert_same(got, fp8_block_quantize(w), f"{kernel_device=} {dtype=} {shape=}")


def test_activation_edge_cases(kernel_device):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(12, 384, generator=gen)
    x[0, :128] = 0.0
    x[1, :128] = -0.0
    x[2, :128] = torch.randn(128, generator=gen) * 1e-39  # fp32 subnormals: floor scale 2^-126
    x[3, 5], x[4, 200], x[5, 300] = float("nan"), float("inf"), float("-inf")
    x[6, 256:] = 3e38  # near fp32 max
    x[6, 300] = -3.4e38
    for r in range(7, 12):
        x[r, :128] = _tie_row(gen)  # scale exactly 1 where |row| ≤ 448
        x[r, 128:256] = _tie_row(gen) * 2.0**-20  # same pattern, scale 2^-20
    want = fp8_block_quantize_activations(x)
    _assert_same(quantize_fp8_block_activations(x.to(kernel_device)), want, f"{kernel_device=} fp32 edges")
    xb = x.bfloat16()
    _assert_same(quantize_fp8_block_activations(xb.to(kernel_device)), fp8_block_quantize_activations(xb), "bf16 edges")


def test_e4m3_ties_at_unit_scale(kernel_device):
    """Rows whose amax is exactly 448: scale 1, so the kernel's cast sees the values themselves."""
    gen = torch.Generator().manual_seed(8)
    rows = torch.stack([_tie_row(gen).clamp(-448, 448) for _ in range(8)])
    q, scale = fp8_block_quantize_activations(rows)
    assert torch.all(scale == 1.0)
    _assert_same(quantize_fp8_block_activations(rows.to(kernel_device)), (q, scale), f"{kernel_device=} ties")


def test_weight_edge_cases(kernel_device):
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(2, 256, 200, generator=gen)
    w[0, :128, :128] = 0.0
    w[0, :128, 128:] = torch.randn(128, 72, generator=gen) * 1e-40
    w[1, 3, 4] = float("nan")
    w[1, 200, 150] = float("-inf")
    w[1, 128:, :128] = 3e38
    _assert_same(quantize_fp8_block_weights(w.to(kernel_device)), fp8_block_quantize(w), f"{kernel_device=} edges")
    wb = w.bfloat16()  # bf16 subnormals in the tiny block
    _assert_same(quantize_fp8_block_weights(wb.to(kernel_device)), fp8_block_quantize(wb), f"{kernel_device=} bf16 edges")


def test_strided_and_empty(kernel_device):
    base = torch.randn(20, 512, generator=torch.Generator().manual_seed(10)).bfloat16()
    x = base[::2, :256]  # row stride 1024, unit column stride
    _assert_same(quantize_fp8_block_activations(x.to(kernel_device)), fp8_block_quantize_activations(x), "strided")
    w = base[:, 100:400]  # [20, 300] with row stride 512
    _assert_same(quantize_fp8_block_weights(w.to(kernel_device)), fp8_block_quantize(w), "strided weight")
    q, scale = quantize_fp8_block_activations(torch.empty(0, 256, dtype=torch.bfloat16, device=kernel_device))
    assert q.shape == (0, 256) and scale.shape == (0, 2)


def test_launcher_errors(kernel_device):
    with pytest.raises(TypeError, match="x: expected dtype torch.bfloat16 or torch.float32, got torch.float16"):
        quantize_fp8_block_activations(torch.zeros(2, 128, dtype=torch.float16, device=kernel_device))
    with pytest.raises(ValueError, match=r"x: expected a 2-D \[M, K\] tensor"):
        quantize_fp8_block_activations(torch.zeros(128, device=kernel_device))
    with pytest.raises(ValueError, match="x: expected unit stride along the last dim"):
        quantize_fp8_block_activations(torch.zeros(128, 4, device=kernel_device).T)
    with pytest.raises(ValueError, match=r"w: expected a 2-D \[N, K\] or 3-D \[E, N, K\] tensor"):
        quantize_fp8_block_weights(torch.zeros(1, 1, 128, 128, device=kernel_device))
    with pytest.raises(TypeError, match="w: expected a torch.Tensor"):
        quantize_fp8_block_weights(None)
