"""SwiGLU and its derivative as `@triton.jit` helpers, in fp32, for GEMM epilogues.

    h = silu(min(g, L)) · clamp(u, −L, L)        (the clamp only with a swiglu_limit L)

The backward helper zeroes the gradient where a clamp was active (g > L, |u| > L), as
`mok.reference.swiglu_backward` defines. The clamps keep NaN a NaN, as torch's clamp does:
a plain `tl.minimum` lowers to PTX `min.f32`, which returns the other operand, so a NaN
pre-activation would come out as ±L (and a NaN token as a finite output) on the GPU, while
the interpreter's NumPy kept it.
"""

import triton
import triton.language as tl


@triton.jit
def _clamp(gate, up, limit):
    """(min(g, L), clamp(u, −L, L)), NaN kept."""
    gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
    up = tl.minimum(tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL)
    return gate, up


@triton.jit
def swiglu_forward(gate, up, limit, HAS_LIMIT: tl.constexpr):
    """h from fp32 g, u."""
    if HAS_LIMIT:
        gate, up = _clamp(gate, up, limit)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def swiglu_backward(d_h, gate, up, limit, HAS_LIMIT: tl.constexpr):
    """(d_gate, d_up, h) from fp32 dL/dh and the pre-activations g, u."""
    gate_c = gate
    up_c = up
    if HAS_LIMIT:
        gate_c, up_c = _clamp(gate, up, limit)
    sig = tl.sigmoid(gate_c)
    silu = gate_c * sig
    d_up = d_h * silu
    d_gate = d_h * up_c * sig * (1.0 + gate_c * (1.0 - sig))
    if HAS_LIMIT:
        d_gate = tl.where(gate <= limit, d_gate, 0.0)
        d_up = tl.where((up >= -limit) & (up <= limit), d_up, 0.0)
    return d_gate, d_up, silu * up_c
