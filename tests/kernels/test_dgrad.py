"""Down dgrad + SwiGLU backward + router-weight gradient, and the gate/up dgrad scatter,
against mok.reference pieces. Inputs are built directly in the schedule's sorted layout
(independent of the forward kernels); rows the kernels must not trust (padding, past
num_rows) are poisoned with NaN."""

import pytest
import torch

from mok import reference
from mok.kernels.dgrad import down_dgrad_swiglu, gate_up_dgrad_scatter
from mok.kernels.grouped_gemm import routing_block_m
from mok.kernels.schedule import build_routing_schedule
from mok.testing import assert_close_to_reference, make_inputs


def _schedule(inp, E):
    flag = torch.zeros(1, dtype=torch.int32, device=inp.x.device)
    sched = build_routing_schedule(inp.topk_ids, E, routing_block_m(), flag)
    num_rows = int(sched.num_rows)
    source = sched.row_source.cpu().long()[:num_rows]
    rows = (source >= 0).nonzero().flatten()
    pad = (source < 0).nonzero().flatten()
    experts = sched.tile_expert.cpu().long()[rows // sched.block_m]
    return sched, rows, source[rows], experts, pad


def _sorted_tokens(d_out, sched, topk):
    """dOut rows in the sorted layout, from torch: zeros at padding, NaN past num_rows (never read)."""
    num_rows = int(sched.num_rows)
    source = sched.row_source.cpu().long()[:num_rows]
    out = torch.full((sched.capacity_rows, d_out.shape[1]), float("nan"), dtype=torch.bfloat16)
    out[:num_rows] = 0
    real = (source >= 0).nonzero().flatten()
    out[real] = d_out.cpu()[source[real] // topk]
    return out.to(d_out.device)


def _sorted(rows, values, capacity):
    """A [capacity, ...] bf16 tensor holding `values` at `rows`, NaN everywhere else."""
    out = torch.full((capacity, *values.shape[1:]), float("nan"), dtype=torch.bfloat16)
    out[rows] = values.bfloat16()
    return out


@pytest.mark.parametrize("T, H, I, E, topk, limit", [(37, 64, 48, 5, 2, None), (11, 40, 72, 3, 3, 0.5)])
def test_down_dgrad_swiglu_matches_reference(kernel_device, T, H, I, E, topk, limit):
    inp = make_inputs(T, H, I, E, topk, seed=T, device=kernel_device, signed_weights=True)
    sched, rows, slots, experts, pad = _schedule(inp, E)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {limit=}"
    gen = torch.Generator().manual_seed(1)
    gate_up_rows = torch.randn(rows.numel(), 2, I, generator=gen) * 1.5  # beyond the clamp at times
    gate_up = _sorted(rows, gate_up_rows, sched.capacity_rows).to(kernel_device)
    d_out = torch.randn(T, H, generator=gen).bfloat16().to(kernel_device)

    d_out_sorted = _sorted_tokens(d_out, sched, topk)
    d_gate_up, d_topk_weights = down_dgrad_swiglu(d_out_sorted, inp.topk_weights, gate_up, inp.w_down, sched, limit)

    # Reference per sorted row, from the same bf16 g, u the kernel reads.
    g, u = gate_up[rows].cpu().float().unbind(1)  # [n, I] each
    tokens = slots // topk
    w_down = inp.w_down.cpu().float()[experts]  # [n, H, I]
    d_out_wd = torch.einsum("nh,nhi->ni", d_out.cpu().float()[tokens], w_down)  # [n, I], unweighted
    w = inp.topk_weights.cpu().view(-1)[slots]  # [n]
    d_g, d_u = reference.swiglu_backward(w[:, None] * d_out_wd, g, u, limit)
    assert_close_to_reference(d_gate_up[rows, 0].cpu(), d_g, name="d_gate", context=ctx, check_cosine=True)
    assert_close_to_reference(d_gate_up[rows, 1].cpu(), d_u, name="d_up", context=ctx, check_cosine=True)
    if limit is not None:  # the clamp masks: zero gradient exactly where a clamp was active
        assert torch.all(d_gate_up[rows, 0].cpu()[g > limit] == 0), ctx
        assert torch.all(d_gate_up[rows, 1].cpu()[u.abs() > limit] == 0), ctx
    # Padding rows: exact zeros, although their g, u are NaN.
    assert pad.numel() > 0, f"the test wants padding rows {ctx}"
    assert torch.equal(d_gate_up[pad].cpu(), torch.zeros(pad.numel(), 2, I, dtype=torch.bfloat16)), ctx

    # Router-weight gradient, SPEC's definition: ⟨dOut[t], y⟩ with y = h · Wdᵀ.
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    y = torch.einsum("ni,nhi->nh", torch.nn.functional.silu(g) * u, w_down)  # [n, H]
    expected = torch.zeros(T * topk)
    expected[slots] = (d_out.cpu().float()[tokens] * y).sum(-1)
    assert d_topk_weights.dtype == torch.float32 and d_topk_weights.shape == (T, topk)
    assert_close_to_reference(d_topk_weights.cpu().view(-1), expected, name="d_topk_weights", context=ctx, check_cosine=True)
    # Same bf16 inputs on both sides: only fp32 summation order differs.
    assert torch.allclose(d_topk_weights.cpu().view(-1), expected, rtol=1e-4, atol=1e-4), ctx


def test_router_weight_gradient_does_not_depend_on_w(kernel_device):
    """⟨dOut, y⟩ never divides by w: negated and zero weights give bit-identical results,
    and d_gate_up is exactly linear in w (negating w negates it)."""
    T, H, I, E, topk = 21, 32, 48, 4, 2
    inp = make_inputs(T, H, I, E, topk, seed=5, device=kernel_device, signed_weights=True)
    sched, rows, *_ = _schedule(inp, E)
    gen = torch.Generator().manual_seed(2)
    gate_up = _sorted(rows, torch.randn(rows.numel(), 2, I, generator=gen), sched.capacity_rows).to(kernel_device)
    d_out = torch.randn(T, H, generator=gen).bfloat16().to(kernel_device)
    ctx = f"{T=} {H=} {I=} {E=} {topk=}"
    d_out_sorted = _sorted_tokens(d_out, sched, topk)
    runs = [down_dgrad_swiglu(d_out_sorted, w, gate_up, inp.w_down, sched)
            for w in (inp.topk_weights, -inp.topk_weights, torch.zeros_like(inp.topk_weights))]
    assert (inp.topk_weights < 0).any() and runs[0][1].abs().min() > 0, ctx
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][1], runs[2][1]), ctx
    assert torch.equal(runs[1][0][rows], -runs[0][0][rows]), ctx
    assert torch.all(runs[2][0][rows] == 0), ctx


@pytest.mark.parametrize("T, H, I, E, topk", [(29, 72, 48, 4, 2), (1, 32, 16, 3, 1)])
def test_gate_up_dgrad_scatter_matches_reference(kernel_device, T, H, I, E, topk):
    inp = make_inputs(T, H, I, E, topk, seed=T, device=kernel_device)
    sched, rows, slots, experts, pad = _schedule(inp, E)
    gen = torch.Generator().manual_seed(3)
    d_gate_up = _sorted(rows, torch.randn(rows.numel(), 2, I, generator=gen) * 0.1, sched.capacity_rows)
    d_gate_up[pad] = 0  # what the down dgrad leaves in padding rows
    dx = gate_up_dgrad_scatter(d_gate_up.to(kernel_device), inp.w_gate, inp.w_up, sched, T * topk)
    d_g, d_u = d_gate_up[rows].float().unbind(1)
    expected = torch.empty(T * topk, H)
    expected[slots] = (torch.einsum("ni,nih->nh", d_g, inp.w_gate.cpu().float()[experts])
                       + torch.einsum("ni,nih->nh", d_u, inp.w_up.cpu().float()[experts]))
    assert dx.dtype == torch.bfloat16 and dx.shape == (T * topk, H)
    assert_close_to_reference(dx.cpu(), expected, name="dx_slots", context=f"{T=} {H=} {I=} {E=} {topk=}", check_cosine=True)


def test_dgrad_launchers_reject_mismatches(kernel_device):
    inp = make_inputs(8, 32, 16, 4, 2, device=kernel_device)
    sched, *_ = _schedule(inp, 4)
    gate_up = torch.zeros(sched.capacity_rows, 2, 16, dtype=torch.bfloat16, device=kernel_device)
    d_out = torch.zeros(8, 32, dtype=torch.bfloat16, device=kernel_device)
    with pytest.raises(ValueError, match=r"^d_out_sorted: expected a bf16 \[rows <= \d+, 32\] tensor"):
        down_dgrad_swiglu(d_out.float(), inp.topk_weights, gate_up, inp.w_down, sched)
    with pytest.raises(ValueError, match=r"^d_out_sorted: expected a bf16 \[rows <= \d+, 32\] tensor"):
        down_dgrad_swiglu(torch.zeros(sched.capacity_rows + 1, 32, dtype=torch.bfloat16, device=kernel_device),
                          inp.topk_weights, gate_up, inp.w_down, sched)
    with pytest.raises(ValueError, match=r"^topk_weights: expected a contiguous fp32 \[T, topk\] tensor"):
        down_dgrad_swiglu(d_out, inp.topk_weights.double(), gate_up, inp.w_down, sched)
    with pytest.raises(ValueError, match=r"^gate_up: expected a contiguous bf16 tensor of shape"):
        down_dgrad_swiglu(d_out, inp.topk_weights, gate_up[:-1], inp.w_down, sched)
    with pytest.raises(ValueError, match=r"^schedule: expected block_m"):
        cfg = dict(BLOCK_M=2 * sched.block_m, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)
        gate_up_dgrad_scatter(gate_up, inp.w_gate, inp.w_up, sched, 16, tile_config=cfg)
    with pytest.raises(ValueError, match=r"^w_up: expected a contiguous bf16 tensor of shape \[4, 16, 32\]"):
        gate_up_dgrad_scatter(gate_up, inp.w_gate, inp.w_up.float(), sched, 16)
