"""SwiGLU and its derivative as `@triton.jit` helpers, in fp32, for GEMM epilogues.

    h = silu(min(g, L)) · clamp(u, −L, L)        (the clamp only with a swiglu_limit L)

The backward helper zeroes the gradient where a clamp was active (g > L, |u| > L), as
`mok.reference.swiglu_backward` defines. The clamps keep NaN a NaN, as torch's clamp does:
a plain `tl.minimum` lowers to PTX `min.f32`, which returns the other operand, so a NaN
pre-activation would come out as ±L (and a NaN token as a finite output) on the GPU, while
the interpreter's NumPy kept it.

The sigmoid, σ(x) = 1 / (1 + 2^(−x·log2 e)), is most of an epilogue's arithmetic. With
`fast_sigmoid` (the kernel plan's; kernels take it as a constexpr, from `fast_sigmoid_here()`) it runs as the
hardware's approximate exp2 and reciprocal with subnormals flushed to zero: 4 instructions,
2 of them on the special-function unit. `tl.sigmoid` lowers to the same approximations plus a
rescaling around each for subnormal inputs and outputs, about 12 instructions (ptxas, sm_90a).
The two agree to a few fp32 ulps; they differ where σ(x) or 1 + e^(−x) is subnormal or
infinite, that is for x < −87, where the fast form gives σ = 0 instead of a number below
1e−38. NaN stays NaN, σ(+inf) = 1, σ(−inf) = 0 in both.
"""

import triton
import triton.language as tl

from mok.kernels.common import interpreting
from mok.kernels.plan import kernel_plan

def fast_sigmoid_here() -> bool:
    """The FAST_SIGMOID constexpr for a launch (the plan's `fast_sigmoid`): the interpreter has no
    PTX, so always False there."""
    return kernel_plan().fast_sigmoid and not interpreting()


@triton.jit
def _sigmoid(x, FAST_SIGMOID: tl.constexpr):
    if FAST_SIGMOID:
        # −log2 e = 0xBFB8AA3B, 1 = 0x3F800000
        return tl.inline_asm_elementwise(
            "{ .reg .f32 t; mul.ftz.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; "
            "add.ftz.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }",
            "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1,
        )
    return tl.sigmoid(x)


@triton.jit
def _clamp(gate, up, limit):
    """(min(g, L), clamp(u, −L, L)), NaN kept."""
    gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
    up = tl.minimum(tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL)
    return gate, up


@triton.jit
def swiglu_forward(gate, up, limit, HAS_LIMIT: tl.constexpr, FAST_SIGMOID: tl.constexpr):
    """h from fp32 g, u."""
    if HAS_LIMIT:
        gate, up = _clamp(gate, up, limit)
    return gate * _sigmoid(gate, FAST_SIGMOID) * up


@triton.jit
def swiglu_backward(d_h, gate, up, limit, HAS_LIMIT: tl.constexpr, FAST_SIGMOID: tl.constexpr):
    """(d_gate, d_up, h) from fp32 dL/dh and the pre-activations g, u."""
    gate_c = gate
    up_c = up
    if HAS_LIMIT:
        gate_c, up_c = _clamp(gate, up, limit)
    sig = _sigmoid(gate_c, FAST_SIGMOID)
    silu = gate_c * sig
    d_up = d_h * silu
    d_gate = d_h * up_c * sig * (1.0 + gate_c * (1.0 - sig))
    if HAS_LIMIT:
        d_gate = tl.where(gate <= limit, d_gate, 0.0)
        d_up = tl.where((up >= -limit) & (up <= limit), d_up, 0.0)
    return d_gate, d_up, silu * up_c
