"""Down dgrad + SwiGLU backward + router-weight gradient, and the gate/up dgrad scatter
(bf16 and fp8_block), against mok.reference pieces. Inputs are built directly in the schedule's sorted layout
(independent of the forward kernels); rows the kernels must not trust (padding, past
num_rows) are poisoned with NaN."""

import pytest
import torch

from mok import reference
from mok.fp8_block import fp8_block_dequantize, fp8_block_quantize, fp8_block_quantize_activations
from mok.kernels.gemm import dgrad, hopper_common
from mok.kernels.gemm.dgrad import (
    dgrad_config,
    down_dgrad_swiglu,
    down_dgrad_swiglu_epilogue,
    down_dgrad_swiglu_fp8_block,
    gate_up_dgrad_scatter,
    gate_up_dgrad_scatter_fp8_block,
)
from mok.kernels.gemm.common import routing_block_m
from mok.kernels.plan import kernel_plan
from mok.kernels.quant.fp8_block import quantize_fp8_block_activations, quantize_fp8_block_gathered
from mok.kernels.routing.schedule import build_routing_schedule
from mok.testing import assert_close_to_reference, make_inputs, make_topk_ids


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


def _sorted_e4m3(rows, gate_up_rows, capacity):
    """g, u [n, 2, I] as the fp8_block forward saves them with gate_up_e4m3: the pair (e4m3
    [capacity, 2, I], scales [capacity, 2, I/128]) of their 1×128 blocks along I at `rows`, NaN
    everywhere else; and the values the pair holds, [n, 2, I] fp32."""
    n, _, inter = gate_up_rows.shape
    q, scale = fp8_block_quantize_activations(gate_up_rows.reshape(2 * n, inter))
    out_q = torch.full((capacity, 2, inter), 0x7F, dtype=torch.uint8)
    out_q[rows] = q.view(torch.uint8).view(n, 2, inter)
    out_scale = torch.full((capacity, 2, inter // 128), float("nan"))
    out_scale[rows] = scale.view(n, 2, inter // 128)
    return (out_q.view(torch.float8_e4m3fn), out_scale), fp8_block_dequantize(q, scale).view(n, 2, inter)


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
    # The same call storing w·h for the down wgrad: NaN where it must not write (past num_rows).
    weighted_h = torch.full((sched.capacity_rows, I), float("nan"), dtype=torch.bfloat16, device=kernel_device)
    with_h = down_dgrad_swiglu(d_out_sorted, inp.topk_weights, gate_up, inp.w_down, sched, limit, weighted_h=weighted_h)
    assert torch.equal(with_h[0][rows], d_gate_up[rows]) and torch.equal(with_h[1], d_topk_weights), ctx

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

    # Router-weight gradient, the layer's definition: ⟨dOut[t], y⟩ with y = h · Wdᵀ.
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    h = torch.nn.functional.silu(g) * u  # [n, I] from the bf16 g, u, clamped
    y = torch.einsum("ni,nhi->nh", h, w_down)  # [n, H]
    assert_close_to_reference(weighted_h[rows].cpu(), w[:, None] * h, name="weighted_h", context=ctx, check_cosine=True)
    num_rows = int(sched.num_rows)
    assert torch.equal(weighted_h[pad].cpu(), torch.zeros(pad.numel(), I, dtype=torch.bfloat16)), ctx
    assert weighted_h[num_rows:].isnan().all(), f"rows past num_rows were written {ctx}"
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the L2 prefetch is PTX: GPU only")
@pytest.mark.parametrize("T, H, I, E, topk", [(300, 128, 328, 5, 2), (1, 64, 64, 3, 1)])
def test_down_dgrad_prefetch_leaves_the_outputs_bitwise(T, H, I, E, topk):
    """The L2 prefetch of g, u (on by default on a GPU) is a hint only: outputs bitwise the same
    without it, on a ragged last column tile (I not a multiple of the tile) and padding rows."""
    inp = make_inputs(T, H, I, E, topk, seed=T, device="cuda", signed_weights=True)
    sched, rows, *_ = _schedule(inp, E)
    gen = torch.Generator().manual_seed(3)
    gate_up = _sorted(rows, torch.randn(rows.numel(), 2, I, generator=gen), sched.capacity_rows).cuda()
    d_out_sorted = _sorted_tokens(torch.randn(T, H, generator=gen).bfloat16().cuda(), sched, topk)
    default = dgrad_config("down", I, H)
    assert default["PREFETCH_GATE_UP"] is kernel_plan().down_dgrad_prefetch_gate_up, default
    outs = [down_dgrad_swiglu(d_out_sorted, inp.topk_weights, gate_up, inp.w_down, sched,
                              tile_config={**default, "PREFETCH_GATE_UP": prefetch}) for prefetch in (True, False)]
    ctx = f"{T=} {H=} {I=} {E=} {topk=}"
    assert torch.equal(outs[0][0][rows], outs[1][0][rows]), ctx
    assert torch.equal(outs[0][1], outs[1][1]) and outs[0][1].abs().sum() > 0, ctx


@pytest.mark.parametrize("T, H, I, E, topk", [(29, 72, 48, 4, 2), (1, 32, 16, 3, 1)])
def test_gate_up_dgrad_scatter_matches_reference(kernel_device, T, H, I, E, topk):
    """Also PERSISTENT (a few programs walking every tile): bitwise the per-tile launch."""
    inp = make_inputs(T, H, I, E, topk, seed=T, device=kernel_device)
    sched, rows, slots, experts, pad = _schedule(inp, E)
    gen = torch.Generator().manual_seed(3)
    d_gate_up = _sorted(rows, torch.randn(rows.numel(), 2, I, generator=gen) * 0.1, sched.capacity_rows)
    d_gate_up[pad] = 0  # what the down dgrad leaves in padding rows
    dx, dx_persistent = (
        gate_up_dgrad_scatter(d_gate_up.to(kernel_device), inp.w_gate, inp.w_up, sched, T * topk,
                              tile_config={**dgrad_config("gate_up", H, I, allow_warp_specialized=False),
                                           "PERSISTENT": persistent})
        for persistent in (False, True)
    )
    assert torch.equal(dx, dx_persistent), f"persistent launch differs: {T=} {H=} {I=} {E=} {topk=}"
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
    weighted_h = torch.empty(sched.capacity_rows, 16, dtype=torch.bfloat16, device=kernel_device)
    with pytest.raises(ValueError, match=r"^weighted_h: expected None without topk_weights"):
        down_dgrad_swiglu(d_out, None, gate_up, inp.w_down, sched, weighted_h=weighted_h)
    with pytest.raises(ValueError, match=r"^weighted_h: expected a contiguous bf16 tensor of shape \[\d+, 16\]"):
        down_dgrad_swiglu(d_out, inp.topk_weights, gate_up, inp.w_down, sched, weighted_h=weighted_h[:, :8])
    with pytest.raises(ValueError, match=r"^schedule: expected block_m"):
        cfg = dict(BLOCK_M=2 * sched.block_m, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)
        gate_up_dgrad_scatter(gate_up, inp.w_gate, inp.w_up, sched, 16, tile_config=cfg)
    with pytest.raises(ValueError, match=r"^w_up: expected a contiguous bf16 tensor of shape \[4, 16, 32\]"):
        gate_up_dgrad_scatter(gate_up, inp.w_gate, inp.w_up.float(), sched, 16)


# --------------------------------------------------------------------------- fp8_block

# Slack for fp32 accumulation order, relative to a tensor's largest value (as in
# test_grouped_gemm.py): NumPy's fp32 matmul under the interpreter is near exact; Hopper's FP8
# MMA keeps fewer accumulator bits inside each 128-wide step.
_FP8_ORDER_SLACK = {"cpu": 2.0**-18, "cuda": 2.0**-11}


def _assert_order_close(actual, expected, slack, name, ctx):
    """bf16 output rounding (2^-8 relative, twice RNE's bound) plus accumulation-order slack."""
    atol = slack * expected.abs().max().item()
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=2.0**-8, atol=atol, msg=lambda m: f"{name} {ctx}: {m}"
    )


def _fp8_block_case(kernel_device, T, H, I, E, topk, used_experts):
    """Inputs whose routes use only the first `used_experts` experts (the rest get no token)."""
    ids = make_topk_ids(T, used_experts, topk, torch.Generator().manual_seed(T))
    inp = make_inputs(T, H, I, E, topk, seed=T, device=kernel_device, signed_weights=True, topk_ids=ids)
    return inp, *_schedule(inp, E)


_FP8_DGRAD_CASES = [(37, 256, 128, 4, 2, None, 3), (19, 128, 256, 3, 1, 0.5, 3)]


@pytest.mark.parametrize(
    "T, H, I, E, topk, limit, used_experts, path, saved",
    # g, u in e4m3 only without a limit, as the forward saves them (near the limit their rounding
    # would move the clamps' zero gradients)
    [(*case, path, "bf16") for case in _FP8_DGRAD_CASES for path in ("fused", "product given", "bf16 product given")]
    + [(*_FP8_DGRAD_CASES[0], path, "e4m3") for path in ("fused", "bf16 product given")],
)
def test_fp8_block_down_dgrad_swiglu(kernel_device, T, H, I, E, topk, limit, used_experts, path, saved):
    """Against the same quantized math in torch (fp32 accumulation-order tolerance) and against
    the fp32 reference on the unquantized operands (the fp8_block accuracy bars). "product given": the
    epilogue alone (`down_dgrad_swiglu_epilogue`) on that math's product, NaN in every row no
    route uses; "bf16 product given": on that product rounded to bf16 (the torch math then starts
    from the rounded product too). saved "e4m3": g, u read as the forward saves them with
    gate_up_e4m3 (the torch math on the values they hold, the reference on g, u themselves)."""
    inp, sched, rows, slots, experts, pad = _fp8_block_case(kernel_device, T, H, I, E, topk, used_experts)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {limit=} {used_experts=} {path=} {saved=}"
    assert dgrad.fp8_block_down_dgrad_gathers(H), f"the test wants the gathering path {ctx}"
    slack = _FP8_ORDER_SLACK[kernel_device]
    gen = torch.Generator().manual_seed(1)
    gate_up_rows = (torch.randn(rows.numel(), 2, I, generator=gen) * 1.5).bfloat16().float()  # [n, 2, I]
    if saved == "e4m3":
        gate_up, read_rows = _sorted_e4m3(rows, gate_up_rows, sched.capacity_rows)
        gate_up = tuple(t.to(kernel_device) for t in gate_up)
    else:
        gate_up, read_rows = _sorted(rows, gate_up_rows, sched.capacity_rows).to(kernel_device), gate_up_rows
    d_out = torch.randn(T, H, generator=gen).bfloat16().to(kernel_device)
    d_out_q, d_out_scale = quantize_fp8_block_activations(d_out)  # token rows: the kernel gathers them
    _, _, w_down_t_q, w_down_t_scale = fp8_block_quantize(inp.w_down)  # [E, I, H], [E, I/128, H/128]
    tokens = slots // topk
    d_out_deq = fp8_block_dequantize(d_out_q.cpu(), d_out_scale.cpu())[tokens]  # [n, H] fp32
    w_down_deq = fp8_block_dequantize(w_down_t_q.cpu(), w_down_t_scale.cpu(), (128, 128))[experts]  # [n, I, H]
    if path == "fused":  # the Triton kernel (on Hopper the default is the warp-specialized product, bf16)
        fused = dgrad.dgrad_config("down", I, H, "fp8_block", allow_warp_specialized=False)
        d_gate_up, d_topk_weights = down_dgrad_swiglu_fp8_block(
            d_out_q, d_out_scale, inp.topk_weights, gate_up, w_down_t_q, w_down_t_scale, sched, limit, fused,
        )
    else:
        product = torch.full((sched.capacity_rows, I), float("nan"))
        product[rows] = torch.einsum("nh,nih->ni", d_out_deq, w_down_deq)
        if path == "bf16 product given":
            product = product.bfloat16()
        d_gate_up, d_topk_weights = down_dgrad_swiglu_epilogue(
            product.to(kernel_device), inp.topk_weights, gate_up, sched, limit
        )
    assert d_gate_up.dtype == torch.bfloat16 and d_gate_up.shape == (sched.capacity_rows, 2, I), ctx
    assert pad.numel() > 0, f"the test wants padding rows {ctx}"
    assert torch.equal(d_gate_up[pad].cpu(), torch.zeros(pad.numel(), 2, I, dtype=torch.bfloat16)), ctx

    w = inp.topk_weights.cpu().view(-1)[slots]  # [n]
    operands = {
        "statement": (d_out_deq, w_down_deq, read_rows),  # the kernel's quantized math
        "reference": (d_out.cpu().float()[tokens], inp.w_down.cpu().float()[experts].mT, gate_up_rows),  # unquantized
    }
    for kind, (d_out_rows, w_down_rows, g_u) in operands.items():
        g, u = g_u.unbind(1)  # [n, I] each
        g_c, u_c = (g, u) if limit is None else (g.clamp(max=limit), u.clamp(-limit, limit))
        h = torch.nn.functional.silu(g_c) * u_c  # [n, I]
        d_out_wd = torch.einsum("nh,nih->ni", d_out_rows, w_down_rows)  # [n, I], unweighted
        if kind == "statement" and path == "bf16 product given":
            d_out_wd = d_out_wd.bfloat16().float()
        d_g, d_u = reference.swiglu_backward(w[:, None] * d_out_wd, g, u, limit)
        expected_w = torch.zeros(T * topk)
        expected_w[slots] = (d_out_wd * h).sum(-1)
        actual = {"d_gate": d_gate_up[rows, 0].cpu(), "d_up": d_gate_up[rows, 1].cpu(),
                  "d_topk_weights": d_topk_weights.cpu().view(-1)}
        expected = {"d_gate": d_g, "d_up": d_u, "d_topk_weights": expected_w}
        for name in actual:
            if kind == "statement":
                _assert_order_close(actual[name], expected[name], slack, name, ctx)
            else:
                assert_close_to_reference(
                    actual[name], expected[name], "fp8_block", name=name, context=ctx, check_cosine=True
                )


_QUANTIZING_CASES = [(37, 256, 128, 4, 2, None), (45, 128, 384, 5, 3, 0.5)]
_QUANTIZING_PATHS = ("fused", "product given", "bf16 product given", "bf16 product given, 4-row chunks")


@pytest.mark.parametrize(
    "T, H, I, E, topk, limit, path, saved",
    [(*case, path, "bf16") for case in _QUANTIZING_CASES for path in _QUANTIZING_PATHS]
    + [(*_QUANTIZING_CASES[0], path, "e4m3") for path in ("fused", "bf16 product given, 4-row chunks")],
)
def test_fp8_block_down_dgrad_quantizes_d_gate_up(kernel_device, set_plan, T, H, I, E, topk, limit, path, saved):
    """With `quantize_d_gate_up` the epilogue's e4m3 d_g, d_u and their scales are bitwise what
    `quantize_fp8_block_activations` makes of the bf16 output of the same call without it (rows
    below num_rows; padding rows included), d_topk_weights to fp32 rounding: rows of very different
    magnitudes, a NaN in one route's g (its block's scale NaN, its bytes 0x7F), and the gate/up
    dgrad reading the column views (rows 2·I bytes apart) bitwise as from contiguous copies. The
    epilogue on a given product also in chunks of 4 rows (several per tile wherever block_m > 4,
    each chunk's loads issued a chunk ahead). saved "e4m3": g, u read as the forward saves them with
    gate_up_e4m3 (the NaN then fills its whole 128-column block of g)."""
    if "4-row chunks" in path:
        set_plan(fp8_block_quantized_epilogue_rows=4)
    inp, sched, rows, slots, experts, pad = _fp8_block_case(kernel_device, T, H, I, E, topk, E - 1)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {limit=} {path=} {saved=}"
    gen = torch.Generator().manual_seed(2)
    magnitudes = torch.logspace(-3, 3, rows.numel())[torch.randperm(rows.numel(), generator=gen)]
    gate_up_rows = torch.randn(rows.numel(), 2, I, generator=gen) * magnitudes[:, None, None].sqrt()
    gate_up_rows[5, 0, I - 3] = float("nan")
    if saved == "e4m3":
        gate_up = tuple(t.to(kernel_device) for t in _sorted_e4m3(rows, gate_up_rows, sched.capacity_rows)[0])
    else:
        gate_up = _sorted(rows, gate_up_rows, sched.capacity_rows).to(kernel_device)
    d_out = (torch.randn(T, H, generator=gen) * torch.logspace(-2, 2, T)[:, None]).bfloat16().to(kernel_device)
    d_out_pair = quantize_fp8_block_activations(d_out)
    w_down_t = fp8_block_quantize(inp.w_down)[2:]
    if path == "fused":
        def run(**kw):
            return down_dgrad_swiglu_fp8_block(*d_out_pair, inp.topk_weights, gate_up, *w_down_t, sched, limit, **kw)
    else:
        product = torch.randn(sched.capacity_rows, I, generator=gen) * 4
        product = product.bfloat16() if path.startswith("bf16") else product
        product = product.to(kernel_device)

        def run(**kw):
            return down_dgrad_swiglu_epilogue(product, inp.topk_weights, gate_up, sched, limit, **kw)
    d_gate_up, d_topk_weights = run()
    (q, scale), quantized_d_topk_weights = run(quantize_d_gate_up=True)
    num_rows = int(sched.num_rows)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (sched.capacity_rows, 2, I), ctx
    assert scale.dtype == torch.float32 and scale.shape == (sched.capacity_rows, 2, I // 128), ctx
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)  # noqa: E731
    for j, name in enumerate(("d_gate", "d_up")):
        want_q, want_scale = quantize_fp8_block_activations(d_gate_up[:, j])
        assert torch.equal(bits(q[:num_rows, j]).cpu(), bits(want_q[:num_rows]).cpu()), f"{name} bytes {ctx}"
        assert torch.equal(bits(scale[:num_rows, j]).cpu(), bits(want_scale[:num_rows]).cpu()), f"{name} scales {ctx}"
    scale_w = d_topk_weights.nan_to_num(0.0).abs().max().item()  # row sums of 128 columns at once, not by quarters
    torch.testing.assert_close(quantized_d_topk_weights, d_topk_weights, rtol=2.0**-16, atol=2.0**-16 * scale_w,
                               equal_nan=True, msg=lambda m: f"d_topk_weights {ctx}: {m}")
    if limit is None:  # (a limit's clamp mask zeroes d_g where g is NaN)
        assert scale[rows[5], 0, -1].isnan() and (bits(q[rows[5], 0, -128:]) == 0x7F).all(), f"the NaN block {ctx}"
    assert pad.numel() > 0 and (bits(q[pad]) == 0).all(), f"padding rows quantize to zeros {ctx}"

    weights = [x for w in (inp.w_gate, inp.w_up) for x in fp8_block_quantize(w)[2:]]
    views = (q[:, 0], scale[:, 0], q[:, 1], scale[:, 1])
    copies = [t.contiguous() for t in views]
    dx = gate_up_dgrad_scatter_fp8_block(*views, *weights, sched, T * topk)
    want_dx = gate_up_dgrad_scatter_fp8_block(*copies, *weights, sched, T * topk)
    assert torch.equal(dx[slots].view(torch.int16).cpu(), want_dx[slots].view(torch.int16).cpu()), \
        f"dx_slots from the views {ctx}"


def test_fp8_block_down_dgrad_gathering_is_bitwise_the_sorted_copy(kernel_device, set_plan):
    """The two ways the fp8_block down dgrad reads dOut (its token rows quantized per token and
    gathered inside the loads, or its sorted rows quantized by the gathering quantizer and read
    through TMA) give the same bits: a route's row is its token's, and the products and their
    order are the same; a NaN in one token reaches its routes' rows in both. On Hopper the default
    either way, the warp-specialized GEMM into an fp32 product and the epilogue on it, gives
    d_gate_up's bits too, and d_topk_weights to fp32 rounding (its row sums reduce in another order)
    (a bf16 product: `test_fp8_block_down_dgrad_product_is_the_triton_kernel`)."""
    T, H, I, E, topk = 37, 256, 128, 4, 2
    inp, sched, rows, slots, experts, pad = _fp8_block_case(kernel_device, T, H, I, E, topk, 3)
    gen = torch.Generator().manual_seed(5)
    gate_up = _sorted(rows, torch.randn(rows.numel(), 2, I, generator=gen), sched.capacity_rows).to(kernel_device)
    d_out = torch.randn(T, H, generator=gen).bfloat16()
    d_out[3, 200] = float("nan")
    d_out = d_out.to(kernel_device)
    w_down_t = fp8_block_quantize(inp.w_down)[2:]
    triton_tiles = dgrad_config("down", I, H, "fp8_block", allow_warp_specialized=False)
    runs = {"gathered": (True, triton_tiles), "sorted": (False, triton_tiles)}
    if hopper_common.available_here():
        for gathers, name in ((True, "gathered"), (False, "sorted")):
            runs[f"{name}, warp-specialized product"] = (gathers, hopper_common.fp8_block_tile_config())
    outputs = {}
    set_plan(warp_specialized_fp8_block_down_dgrad_product=False,  # H alone picks the rows
             fp8_block_down_dgrad_product_bf16=False)
    for run, (gathers, tiles) in runs.items():
        set_plan(gathered_fp8_block_down_dgrad_max_hidden=H if gathers else H - 1)
        d_out_pair = quantize_fp8_block_activations(d_out) if gathers else quantize_fp8_block_gathered(d_out, sched, topk)
        d_gate_up, d_topk_weights = down_dgrad_swiglu_fp8_block(*d_out_pair, inp.topk_weights, gate_up, *w_down_t,
                                                                sched, tile_config=tiles)
        outputs[run] = (d_gate_up[:int(sched.num_rows)].cpu(), d_topk_weights.cpu())
    nan_rows = rows[(slots // topk) == 3]
    assert nan_rows.numel() == topk and outputs["gathered"][0][nan_rows].isnan().any(), "the NaN token's rows"
    for run, (d_gate_up, d_topk_weights) in outputs.items():
        want_d_gate_up, want_d_topk_weights = outputs["gathered"]
        bits = lambda t: t.view(torch.uint8)  # noqa: E731  by bits: NaN equals NaN
        assert torch.equal(bits(d_gate_up), bits(want_d_gate_up)), f"d_gate_up {run}"
        if run == "sorted":
            assert torch.equal(bits(d_topk_weights), bits(want_d_topk_weights)), f"d_topk_weights {run}"
        else:
            scale = want_d_topk_weights.nan_to_num(0.0).abs().max().item()  # fp32 sums of 128 products, reordered
            torch.testing.assert_close(d_topk_weights, want_d_topk_weights, rtol=2.0**-16, atol=2.0**-16 * scale,
                                       equal_nan=True, msg=lambda m: f"d_topk_weights {run}: {m}")  # noqa: B023


@pytest.mark.parametrize("T, H, I, E, topk, used_experts", [(37, 128, 256, 4, 2, 3), (19, 256, 128, 3, 1, 3)])
def test_fp8_block_gate_up_dgrad_scatter(kernel_device, T, H, I, E, topk, used_experts):
    """Against the same quantized math in torch and against the fp32 reference."""
    inp, sched, rows, slots, experts, pad = _fp8_block_case(kernel_device, T, H, I, E, topk, used_experts)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {used_experts=}"
    gen = torch.Generator().manual_seed(3)
    d_gate_up = _sorted(rows, torch.randn(rows.numel(), 2, I, generator=gen) * 0.1, sched.capacity_rows)
    d_gate_up[pad] = 0  # what the down dgrad leaves in padding rows
    d_gate_up = d_gate_up.to(kernel_device)
    grads = [quantize_fp8_block_activations(d_gate_up[:, j]) for j in (0, 1)]  # (q, scale) of d_g, d_u
    weights = [fp8_block_quantize(w)[2:] for w in (inp.w_gate, inp.w_up)]  # (q_t [E, H, I], scale_t)
    dx = gate_up_dgrad_scatter_fp8_block(*grads[0], *grads[1], *weights[0], *weights[1], sched, T * topk)
    assert dx.dtype == torch.bfloat16 and dx.shape == (T * topk, H), ctx

    statement = torch.zeros(T * topk, H)
    for (q, scale), (w_q, w_scale) in zip(grads, weights):
        grad = fp8_block_dequantize(q.cpu(), scale.cpu())[rows]  # [n, I] fp32
        w_t = fp8_block_dequantize(w_q.cpu(), w_scale.cpu(), (128, 128))[experts]  # [n, H, I] fp32
        statement[slots] += torch.einsum("ni,nhi->nh", grad, w_t)
    d_g, d_u = d_gate_up[rows].cpu().float().unbind(1)
    reference_dx = torch.zeros(T * topk, H)
    reference_dx[slots] = (torch.einsum("ni,nih->nh", d_g, inp.w_gate.cpu().float()[experts])
                           + torch.einsum("ni,nih->nh", d_u, inp.w_up.cpu().float()[experts]))
    _assert_order_close(dx.cpu()[slots], statement[slots], _FP8_ORDER_SLACK[kernel_device], "dx_slots", ctx)
    assert_close_to_reference(dx.cpu()[slots], reference_dx[slots], "fp8_block", name="dx_slots", context=ctx,
                              check_cosine=True)


def test_fp8_block_dgrad_ops_and_run_twice(kernel_device):
    """The custom ops' fake shapes, and the op (a second run) bitwise equal to the launcher."""
    from mok import ops

    T, H, I, E, topk = 5, 128, 128, 2, 2
    inp = make_inputs(T, H, I, E, topk, seed=6, device=kernel_device)
    block_m = routing_block_m()
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    sched = ops.routing_schedule(inp.topk_ids, flag, E, block_m)
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(sched.capacity_rows, 2, I, generator=gen).bfloat16().to(kernel_device)
    d_out = torch.randn(T, H, generator=gen).bfloat16().to(kernel_device)
    d_out_pair = quantize_fp8_block_activations(d_out)
    w_down_t = fp8_block_quantize(inp.w_down)[2:]
    down_args = (*d_out_pair, inp.topk_weights, gate_up, *w_down_t, sched, 0.5)
    d_gate_up, no_scale, d_topk_weights = ops.down_dgrad_swiglu_fp8_block(*down_args)
    again = down_dgrad_swiglu_fp8_block(*d_out_pair, inp.topk_weights, gate_up, *w_down_t, sched, 0.5)
    rows = int(sched.num_rows)
    assert torch.equal(d_gate_up[:rows], again[0][:rows]) and torch.equal(d_topk_weights, again[1])
    assert no_scale.shape == (0,)
    quantized_args = (*down_args, True)
    d_gate_up_q, d_gate_up_scale, _ = ops.down_dgrad_swiglu_fp8_block(*quantized_args)
    (again_q, again_scale), _ = down_dgrad_swiglu_fp8_block(*d_out_pair, inp.topk_weights, gate_up, *w_down_t, sched,
                                                            0.5, quantize_d_gate_up=True)
    assert torch.equal(d_gate_up_q[:rows].view(torch.uint8), again_q[:rows].view(torch.uint8))
    assert torch.equal(d_gate_up_scale[:rows], again_scale[:rows])
    # g, u saved in e4m3 (the forward's gate_up_e4m3; no limit)
    saved_q, saved_scale = quantize_fp8_block_activations(gate_up.view(-1, I))
    saved_pair = (saved_q.view(gate_up.shape), saved_scale.view(sched.capacity_rows, 2, I // 128))
    e4m3_args = (*d_out_pair, inp.topk_weights, saved_pair[0], *w_down_t, sched, None, True, saved_pair[1])
    e4m3_q, e4m3_scale, e4m3_d_topk_weights = ops.down_dgrad_swiglu_fp8_block(*e4m3_args)
    (again_q, again_scale), again_d_topk_weights = down_dgrad_swiglu_fp8_block(
        *d_out_pair, inp.topk_weights, saved_pair, *w_down_t, sched, None, quantize_d_gate_up=True)
    assert torch.equal(e4m3_q[:rows].view(torch.uint8), again_q[:rows].view(torch.uint8))
    assert torch.equal(e4m3_scale[:rows], again_scale[:rows]) and torch.equal(e4m3_d_topk_weights, again_d_topk_weights)

    grads = [x for j in (0, 1) for x in quantize_fp8_block_activations(d_gate_up[:, j])]
    weights = [x for w in (inp.w_gate, inp.w_up) for x in fp8_block_quantize(w)[2:]]
    gate_up_args = (*grads, *weights, sched, T * topk)
    dx = ops.gate_up_dgrad_scatter_fp8_block(*gate_up_args)
    assert torch.equal(dx, gate_up_dgrad_scatter_fp8_block(*grads, *weights, sched, T * topk))
    route_row = sched.route_row
    dx_sorted = ops.gate_up_dgrad_scatter_fp8_block(*gate_up_args, True)  # sorted_rows
    assert dx_sorted.shape == (sched.capacity_rows, H) and torch.equal(dx_sorted[route_row.long()], dx)
    down_op, gate_up_op = ops.down_dgrad_swiglu_fp8_block, ops.gate_up_dgrad_scatter_fp8_block
    for args in (down_args, quantized_args, e4m3_args, e4m3_args[:-2] + (False, saved_pair[1])):
        torch.library.opcheck(down_op.op, down_op.op_args(*args), test_utils=("test_faketensor",))
    for args in (gate_up_args, (*gate_up_args, True)):
        torch.library.opcheck(gate_up_op.op, gate_up_op.op_args(*args), test_utils=("test_faketensor",))


def test_fp8_block_dgrad_launchers_reject_mismatches(kernel_device):
    T, H, I, E, topk = 8, 256, 128, 4, 2
    inp = make_inputs(T, H, I, E, topk, device=kernel_device)
    sched, *_ = _schedule(inp, E)
    rows = sched.capacity_rows
    d_out_q, d_out_s = quantize_fp8_block_activations(torch.zeros(T, H, dtype=torch.bfloat16, device=kernel_device))
    d_q, d_s = quantize_fp8_block_activations(torch.zeros(rows, I, dtype=torch.bfloat16, device=kernel_device))
    gate_up = torch.zeros(rows, 2, I, dtype=torch.bfloat16, device=kernel_device)
    wd_q, wd_s, wd_t_q, wd_t_s = fp8_block_quantize(inp.w_down)
    _, _, wg_t_q, wg_t_s = fp8_block_quantize(inp.w_gate)
    down = lambda *args, **kw: down_dgrad_swiglu_fp8_block(*args, sched, **kw)  # noqa: E731
    gate_up_dgrad = lambda *args, **kw: gate_up_dgrad_scatter_fp8_block(*args, sched, T * topk, **kw)  # noqa: E731
    bad_tiles = {**dgrad_config("down", I, H, "fp8_block", allow_warp_specialized=False), "BLOCK_N": 256}
    narrow_tiles = {**bad_tiles, "BLOCK_N": 64}
    misaligned_q = torch.zeros(rows, I + 8, dtype=torch.float8_e4m3fn, device=kernel_device)[:, :I]  # rows 136 B apart
    wide_s = torch.zeros(rows, 2, I // 128, device=kernel_device)  # [:, 0]: rows 2 apart
    cases = [
        (lambda: down(d_out_q, d_out_s, inp.topk_weights, gate_up, wd_t_q[:3], wd_t_s[:3]),
         r"^w_down_t_q: expected a 3-D \[E_l, I, H\] tensor with E_l = 4 .*, got shape \[3, 128, 256\]"),
        # w_down's own copy [E_l, H, I] reads as I = 256, H = 128: dOut's width no longer matches.
        (lambda: down(d_out_q, d_out_s, inp.topk_weights, gate_up, wd_q, wd_s),
         rf"^d_out_q: expected a contiguous float8_e4m3fn tensor of shape \[{T}, 128\]"),
        # token rows, one per token of the router weights
        (lambda: down(d_out_q[:-1], d_out_s, inp.topk_weights, gate_up, wd_t_q, wd_t_s),
         rf"^d_out_q: expected a contiguous float8_e4m3fn tensor of shape \[{T}, 256\]"),
        (lambda: down(d_out_q, d_out_s[:, :1], inp.topk_weights, gate_up, wd_t_q, wd_t_s),
         rf"^d_out_scale: expected a contiguous float32 tensor of shape \[{T}, 2\]"),
        (lambda: down(d_out_q, d_out_s, inp.topk_weights, gate_up, wd_t_q, wd_t_s.double()),
         r"^w_down_t_scale: expected a contiguous float32 tensor of shape \[4, 1, 2\]"),
        (lambda: down(d_out_q, d_out_s, inp.topk_weights.double(), gate_up, wd_t_q, wd_t_s),
         r"^topk_weights: expected a contiguous fp32 \[T, topk\] tensor"),
        (lambda: down(d_out_q, d_out_s, inp.topk_weights, gate_up.float(), wd_t_q, wd_t_s),
         rf"^gate_up: expected a contiguous bf16 tensor of shape \[{rows}, 2, 128\]"),
        (lambda: down(d_out_q, d_out_s, inp.topk_weights, (gate_up.to(torch.float8_e4m3fn), d_out_s), wd_t_q, wd_t_s),
         rf"^gate_up\[1\]: expected a contiguous float32 tensor of shape \[{rows}, 2, 1\]"),
        (lambda: down(d_out_q, d_out_s, inp.topk_weights, gate_up, wd_t_q, wd_t_s, tile_config=bad_tiles),
         r"^tile_config: expected BLOCK_K 128 and BLOCK_N a divisor of 128 for the fp8_block down dgrad GEMM"),
        (lambda: gate_up_dgrad(d_q, d_s, d_q.float(), d_s, wg_t_q, wg_t_s, wg_t_q, wg_t_s),
         rf"^d_up_q: expected a row-contiguous float8_e4m3fn tensor of shape \[{rows}, 128\]"),
        (lambda: gate_up_dgrad(d_q, d_s, misaligned_q, d_s, wg_t_q, wg_t_s, wg_t_q, wg_t_s),
         rf"^d_up_q: expected a row-contiguous float8_e4m3fn tensor of shape \[{rows}, 128\] .* non-contiguous"),
        (lambda: gate_up_dgrad(d_q, d_s, d_q, wide_s[:, 0], wg_t_q, wg_t_s, wg_t_q, wg_t_s),
         r"^d_up_scale: expected d_gate_scale's row stride 1, got 2"),
        (lambda: down(d_out_q, d_out_s, inp.topk_weights, gate_up, wd_t_q, wd_t_s, tile_config=narrow_tiles,
                      quantize_d_gate_up=True),
         r"^tile_config: quantizing d_gate_up needs BLOCK_N 128 \(one scale block\), got 64"),
        (lambda: gate_up_dgrad(d_q, d_s, d_q, d_s, wg_t_q, wg_t_s, wg_t_q.mT.contiguous().mT, wg_t_s),
         r"^w_up_t_q: expected a contiguous float8_e4m3fn tensor .* non-contiguous"),
        (lambda: gate_up_dgrad(d_q, d_s, d_q, d_s, wg_t_q, wg_t_s[:, :1], wg_t_q, wg_t_s),
         r"^w_gate_t_scale: expected a contiguous float32 tensor of shape \[4, 2, 1\]"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
