"""The SwiGLU helpers of `mok.kernels.swiglu` against float64 torch, with the sigmoid as
`tl.sigmoid` and (on the GPU) as the flushed hardware approximations of FAST_SIGMOID."""

import pytest
import torch
import triton
import triton.language as tl

from mok import reference
from mok.kernels.common import interpreting
from mok.kernels.swiglu import fast_sigmoid_here, swiglu_backward, swiglu_forward

_BLOCK = 256


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, d_h_ptr, h_ptr, h_again_ptr, d_gate_ptr, d_up_ptr, n, limit,
                   HAS_LIMIT: tl.constexpr, FAST_SIGMOID: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask)
    up = tl.load(up_ptr + offs, mask=mask)
    d_h = tl.load(d_h_ptr + offs, mask=mask)
    tl.store(h_ptr + offs, swiglu_forward(gate, up, limit, HAS_LIMIT, FAST_SIGMOID), mask=mask)
    d_gate, d_up, h_again = swiglu_backward(d_h, gate, up, limit, HAS_LIMIT, FAST_SIGMOID)
    tl.store(h_again_ptr + offs, h_again, mask=mask)
    tl.store(d_gate_ptr + offs, d_gate, mask=mask)
    tl.store(d_up_ptr + offs, d_up, mask=mask)


def _run(gate, up, d_h, limit, fast):
    outs = [torch.empty_like(gate) for _ in range(4)]  # h, h again, d_gate, d_up: [n] fp32
    n = gate.numel()
    _swiglu_kernel[(triton.cdiv(n, _BLOCK),)](gate, up, d_h, *outs, n, 0.0 if limit is None else limit,
                                              HAS_LIMIT=limit is not None, FAST_SIGMOID=fast, BLOCK=_BLOCK)
    return [t.cpu() for t in outs]


def _forms(kernel_device):
    """The sigmoids that run here: the interpreter has no PTX, so only `tl.sigmoid` on the CPU."""
    return [False, True] if kernel_device == "cuda" else [False]


def test_fast_sigmoid_only_on_a_gpu():
    assert fast_sigmoid_here() is (not interpreting())


@pytest.mark.parametrize("limit", [None, 3.0])
def test_swiglu_matches_float64(kernel_device, limit):
    """Every element within 2^-17 of float64 (relative to its own size; for d_gate, to the size
    of its factors, as 1 + g(1 − σ) cancels near g = −1.28), for |g| up to 80 and both forms."""
    gen = torch.Generator().manual_seed(5)
    n = 5000
    gate = torch.cat([torch.randn(n - 1000, generator=gen) * 4, torch.linspace(-80, 80, 1000)])  # [n] fp32
    up = torch.randn(n, generator=gen) * 2
    d_h = torch.randn(n, generator=gen)
    g64, u64, d64 = gate.double(), up.double(), d_h.double()
    g_c, u_c = (g64, u64) if limit is None else (g64.clamp(max=limit), u64.clamp(-limit, limit))
    sig = torch.sigmoid(g_c)
    h_ref = g_c * sig * u_c
    d_gate_ref, d_up_ref = reference.swiglu_backward(d64, g64, u64, limit)
    gate_scale = (d64 * u_c * sig).abs() * (1 + g_c.abs())
    for fast in _forms(kernel_device):
        ctx = f"{kernel_device=} {limit=} {fast=}"
        h, h_again, d_gate, d_up = _run(*(t.to(kernel_device) for t in (gate, up, d_h)), limit, fast)
        assert torch.equal(h, h_again), f"forward and backward disagree on h {ctx}"
        for name, got, want, scale in (("h", h, h_ref, h_ref.abs()), ("d_up", d_up, d_up_ref, d_up_ref.abs()),
                                       ("d_gate", d_gate, d_gate_ref, gate_scale)):
            excess = (got.double() - want).abs() - 2.0**-17 * scale
            worst = int(excess.argmax())
            assert excess.max() <= 0, (
                f"{name} at g={gate[worst].item()}: {got[worst].item()} vs {want[worst].item()} {ctx}"
            )


def test_swiglu_special_values(kernel_device):
    """NaN stays NaN, σ(+inf) = 1, σ(−inf) = 0 (so h = −inf · 0 = NaN, as torch's silu), and
    where σ underflows (g ≤ −87.5) h is zero or torch's value."""
    specials = [float("nan"), float("inf"), float("-inf"), -100.0, -88.0, -87.5, 100.0, 0.0, 1e-40, -1e-40]
    gate = torch.tensor(specials)
    up = torch.full_like(gate, 1.5)
    d_h = torch.full_like(gate, -0.75)
    want = torch.nn.functional.silu(gate.double()) * 1.5
    for fast in _forms(kernel_device):
        ctx = f"{kernel_device=} {fast=}"
        h, _, d_gate, d_up = _run(*(t.to(kernel_device) for t in (gate, up, d_h)), None, fast)
        assert h[0].isnan() and d_gate[0].isnan() and d_up[0].isnan(), f"NaN g {ctx}: {h[0]}, {d_gate[0]}, {d_up[0]}"
        assert h[1] == float("inf") and d_up[1] == float("-inf"), f"g = +inf {ctx}: {h[1]}, {d_up[1]}"
        assert h[2].isnan(), f"g = -inf gives h {h[2]}, torch's silu NaN {ctx}"
        tail = h[3:6].double()  # g = -100, -88, -87.5: zero, or torch's number
        assert ((tail == 0) | ((tail - want[3:6]).abs() <= 1e-3 * want[3:6].abs())).all(), f"{tail} {ctx}"
        assert torch.allclose(h[6:].double(), want[6:], rtol=2.0**-20, atol=2.0**-148), (
            f"g = 100, 0, ±1e-40 {ctx}: {h[6:]}"
        )
