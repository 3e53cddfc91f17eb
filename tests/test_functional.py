"""The functional API on the reference backend: the four steps, recompute, caching, precision."""

import pytest
import torch

import mok
from mok import reference
from mok.testing import assert_close_to_reference, make_inputs


def _steps(inp, config, swiglu_limit=None, d_out=None):
    T, H = inp.x.shape
    ws = mok.get_workspace(config, None, device=inp.x.device, num_local_tokens=T, hidden_size=H, topk=inp.topk_ids.shape[1])
    sched = mok.build_schedule(ws, config, inp.topk_ids, num_local_experts=inp.w_gate.shape[0])
    shared = (inp.ws_gate, inp.ws_up, inp.ws_down)
    routed = (inp.w_gate, inp.w_up, inp.w_down)
    out, ctx = mok.forward(config, ws, sched, inp.x, inp.topk_weights, *shared, *routed, swiglu_limit=swiglu_limit)
    grads = None
    if d_out is not None:
        grads = mok.backward(config, ws, sched, ctx, d_out, inp.x, inp.topk_weights, *shared, *routed, swiglu_limit=swiglu_limit)
    return out, ctx, grads, (ws, sched)


@pytest.mark.parametrize("shared", [0, 32])
@pytest.mark.parametrize("swiglu_limit", [None, 0.75])
def test_forward_backward_match_reference(shared, swiglu_limit):
    T, H, I, E, topk = 19, 64, 32, 5, 3
    inp = make_inputs(T, H, I, E, topk, shared, seed=11, signed_weights=True)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).bfloat16()
    out, _, grads, _ = _steps(inp, mok.MoKConfig(), swiglu_limit, d_out)
    ref_out = reference.moe_forward(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, swiglu_limit=swiglu_limit)
    ref_grads = reference.moe_backward(d_out, inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, swiglu_limit=swiglu_limit)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {shared=} {swiglu_limit=}"
    assert out.dtype == torch.bfloat16
    assert_close_to_reference(out, ref_out, name="out", context=ctx)
    for name, g, r in zip(ref_grads._fields, grads, ref_grads):
        assert_close_to_reference(g, r, name=name, context=ctx, check_cosine=True)
    assert grads.d_topk_weights.dtype == torch.float32 and grads.d_x.dtype == torch.bfloat16
    assert (grads.d_ws_gate is None) == (shared == 0)


def test_recompute_context_equals_forward_context():
    inp = make_inputs(10, 32, 16, 4, 2, 16, seed=5)
    config = mok.MoKConfig()
    _, ctx, _, (ws, sched) = _steps(inp, config)
    again = mok.recompute_forward_context(config, ws, sched, inp.x, inp.topk_weights, inp.ws_gate, inp.ws_up, inp.ws_down, inp.w_gate, inp.w_up, inp.w_down)
    assert again.backend == ctx.backend and again.precision == ctx.precision
    assert again.saved.keys() == ctx.saved.keys()
    for name in ctx.saved:
        assert torch.equal(again.saved[name], ctx.saved[name]), name


def test_run_twice_is_bitwise_identical():
    inp = make_inputs(23, 32, 16, 6, 2, 16, seed=9)
    d_out = torch.randn(23, 32).bfloat16()
    a = _steps(inp, mok.MoKConfig(), None, d_out)
    b = _steps(inp, mok.MoKConfig(), None, d_out)
    assert torch.equal(a[0], b[0])
    for name, ga, gb in zip(a[2]._fields, a[2], b[2]):
        assert (ga is None and gb is None) or torch.equal(ga, gb), name


def test_workspace_cache():
    config = mok.MoKConfig()
    a = mok.get_workspace(config, None, device="cpu", num_local_tokens=8, hidden_size=32, topk=2)
    assert mok.get_workspace(config, None, device="cpu", num_local_tokens=8, hidden_size=32, topk=2) is a
    assert mok.get_workspace(config, None, device="cpu", num_local_tokens=16, hidden_size=32, topk=2) is not a
    assert mok.create_workspace(config, None, device="cpu", num_local_tokens=8, hidden_size=32, topk=2) is not a
    mok.clear_workspace_cache()
    assert mok.get_workspace(config, None, device="cpu", num_local_tokens=8, hidden_size=32, topk=2) is not a


def test_schedule_and_call_checks():
    config = mok.MoKConfig()
    inp = make_inputs(8, 32, 16, 4, 2, seed=1)
    ws = mok.get_workspace(config, None, device="cpu", num_local_tokens=4, hidden_size=32, topk=2)
    with pytest.raises(ValueError, match=r"^topk_ids: expected at most num_local_tokens=4 rows, got 8"):
        mok.build_schedule(ws, config, inp.topk_ids, num_local_experts=4)
    ws = mok.get_workspace(config, None, device="cpu", num_local_tokens=8, hidden_size=32, topk=2)
    with pytest.raises(ValueError, match=r"^num_local_experts: expected a positive int"):
        mok.build_schedule(ws, config, inp.topk_ids, num_local_experts=0)
    sched = mok.build_schedule(ws, config, inp.topk_ids, num_local_experts=8)
    with pytest.raises(ValueError, match=r"^w_gate: expected 8 local experts \(the schedule's\), got 4"):
        mok.forward(config, ws, sched, inp.x, inp.topk_weights, None, None, None, inp.w_gate, inp.w_up, inp.w_down)
    with pytest.raises(ValueError, match=r"^num_local_tokens: expected a positive int"):
        mok.get_workspace(config, None, device="cpu", num_local_tokens=0, hidden_size=32, topk=2)
    with pytest.raises(TypeError, match=r"^config: expected a MoKConfig"):
        mok.create_workspace({}, None, device="cpu", num_local_tokens=8, hidden_size=32, topk=2)


def test_mxfp8_reference_backend_within_mxfp8_bar():
    T, H, I, E, topk = 33, 64, 64, 4, 2
    inp = make_inputs(T, H, I, E, topk, 32, seed=2)
    d_out = torch.randn(T, H).bfloat16()
    config = mok.MoKConfig(precision="mxfp8")
    out, ctx, grads, _ = _steps(inp, config, None, d_out)
    ref_out = reference.moe_forward(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    ref_grads = reference.moe_backward(d_out, inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    assert_close_to_reference(out, ref_out, "mxfp8", name="out")
    for name, g, r in zip(ref_grads._fields, grads, ref_grads):
        assert_close_to_reference(g, r, "mxfp8", name=name, check_cosine=True)
    bf16_out = _steps(inp, mok.MoKConfig(), None, None)[0]
    assert not torch.equal(out, bf16_out), "mxfp8 mode must round its operands"


def test_fp8_block_says_not_implemented():
    inp = make_inputs(8, 128, 128, 4, 2, seed=1)
    with pytest.raises(NotImplementedError, match="fp8_block"):
        mok.moe(inp.x, inp.topk_ids, inp.topk_weights, inp.w_gate, inp.w_up, inp.w_down, config=mok.MoKConfig(precision="fp8_block"))


def test_error_flag_raises_once():
    ws = mok.create_workspace(mok.MoKConfig(), None, device="cpu", num_local_tokens=4, hidden_size=32, topk=1)
    mok.check_errors(ws)  # clean
    ws.error_flag.fill_(2)
    with pytest.raises(mok.MoKError, match="schedule capacity"):
        mok.check_errors(ws)
    mok.check_errors(ws)  # cleared
