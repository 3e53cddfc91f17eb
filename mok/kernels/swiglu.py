"""SwiGLU and its derivative as `@triton.jit` helpers, in fp32, for GEMM epilogues.

    h = silu(min(g, L)) · clamp(u, −L, L)        (the clamp only with a swiglu_limit L)

The backward helper zeroes the gradient where a clamp was active (g > L, |u| > L), as
`mok.reference.swiglu_backward` defines. `swiglu_backward_tile` is the down dgrad's epilogue
(the Triton kernel's in `dgrad.py` and the warp-specialized one's in `warp_specialized.py`).
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
def swiglu_backward_tile(
    d_out_wd, w, row_valid, rows64, n_offs, gate_up_ptr, d_gate_up_ptr, inter, swiglu_limit, stride_gu_r,
    stride_dgu_r, HAS_LIMIT: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """The down dgrad's epilogue on columns `n_offs` of a tile of sorted rows `rows64`:
    d_g, d_u from w·a (a = d_out_wd, fp32) and the saved g, u, stored in bf16 (exact zeros
    where not row_valid); returns the router-weight partials ⟨a, h⟩ over these columns
    (columns past I are zero on both sides)."""
    out_mask = (n_offs < inter)[None, :]
    gu_ptrs = gate_up_ptr + rows64[:, None] * stride_gu_r + n_offs[None, :]
    gate = tl.load(gu_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptrs + inter, mask=out_mask, other=0.0).to(tl.float32)
    d_gate, d_up, h = swiglu_backward(w[:, None] * d_out_wd, gate, up, swiglu_limit, HAS_LIMIT)
    # Padding rows: exact zeros whatever the saved g, u hold there.
    valid = row_valid[:, None]
    dgu_ptrs = d_gate_up_ptr + rows64[:, None] * stride_dgu_r + n_offs[None, :]
    tl.store(dgu_ptrs, round_to_bf16(tl.where(valid, d_gate, 0.0), INTERPRETER), mask=out_mask)
    tl.store(dgu_ptrs + inter, round_to_bf16(tl.where(valid, d_up, 0.0), INTERPRETER), mask=out_mask)
    return tl.sum(d_out_wd * h, axis=1)
