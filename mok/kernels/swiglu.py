"""SwiGLU and its derivative as `@triton.jit` helpers, in fp32, for GEMM epilogues.

    h = silu(min(g, L)) · clamp(u, −L, L)        (the clamp only with a swiglu_limit L)

The backward helper zeroes the gradient where a clamp was active (g > L, |u| > L), as
`mok.reference.swiglu_backward` defines.
"""

import triton
import triton.language as tl


@triton.jit
def swiglu_forward(gate, up, limit, HAS_LIMIT: tl.constexpr):
    """h from fp32 g, u."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def swiglu_backward(d_h, gate, up, limit, HAS_LIMIT: tl.constexpr):
    """(d_gate, d_up, h) from fp32 dL/dh and the pre-activations g, u."""
    gate_c = gate
    up_c = up
    if HAS_LIMIT:
        gate_c = tl.minimum(gate, limit)
        up_c = tl.minimum(tl.maximum(up, -limit), limit)
    sig = tl.sigmoid(gate_c)
    silu = gate_c * sig
    d_up = d_h * silu
    d_gate = d_h * up_c * sig * (1.0 + gate_c * (1.0 - sig))
    if HAS_LIMIT:
        d_gate = tl.where(gate <= limit, d_gate, 0.0)
        d_up = tl.where((up >= -limit) & (up <= limit), d_up, 0.0)
    return d_gate, d_up, silu * up_c
