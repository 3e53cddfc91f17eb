"""SwiGLU and its derivative as `@triton.jit` helpers, in fp32, for GEMM epilogues.

    h = silu(min(g, L)) · clamp(u, −L, L)        (the clamp only with a swiglu_limit L)

The backward helper zeroes the gradient where a clamp was active (g > L, |u| > L), as
`mok.reference.swiglu_backward` defines. `swiglu_backward_epilogue` is the down dgrad's
epilogue on one column slice of a tile, shared by its Triton kernel (`dgrad.py`) and its
warp-specialized one (`warp_specialized.py`; Gluon calls it with the layouts of its tiles).
"""

import triton
import triton.language as tl

from mok.kernels.common import round_to_bf16


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


@triton.jit
def swiglu_backward_epilogue(
    d_out_wd, w, row_valid, rows64, n_offs, gate, up, d_gate_up_ptr, inter, swiglu_limit, stride_dgu_r,
    HAS_LIMIT: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """The down dgrad's epilogue on columns `n_offs` of an M tile: d_g, d_u from w·a (a =
    `d_out_wd`, fp32) and the saved g, u (fp32, zero past I), stored to the [rows, 2, I]
    d_gate_up (exact zeros in padding rows, whatever g, u hold there); returns the
    router-weight partials ⟨a, h⟩ over these columns (columns past I are zero on both sides)."""
    d_gate, d_up, h = swiglu_backward(w[:, None] * d_out_wd, gate, up, swiglu_limit, HAS_LIMIT)
    valid = row_valid[:, None]
    out_mask = (n_offs < inter)[None, :]
    dgu_ptrs = d_gate_up_ptr + rows64[:, None] * stride_dgu_r + n_offs[None, :]
    tl.store(dgu_ptrs, round_to_bf16(tl.where(valid, d_gate, 0.0), INTERPRETER), mask=out_mask)
    tl.store(dgu_ptrs + inter, round_to_bf16(tl.where(valid, d_up, 0.0), INTERPRETER), mask=out_mask)
    return tl.sum(d_out_wd * h, axis=1)
