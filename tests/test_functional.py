"""The functional API on the reference backend: the four steps, recompute, caching, precision."""

import pytest
import torch

import mok
from mok import reference
from mok.fp8_block import FP8_BLOCK, fp8_block_quantize_activations
from mok.testing import assert_close_to_reference, make_inputs, saved_tensors


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
    saved, saved_again = saved_tensors(ctx), saved_tensors(again)
    assert saved_again.keys() == saved.keys()
    for name in saved:
        assert torch.equal(saved_again[name], saved[name]), name


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


# H spans two 128-blocks and the weights several 128×128 tiles, so a wrong block shape shows.
LOW_PRECISION_SHAPE = dict(T=33, H=256, I=128, E=4, topk=2, shared=64)


def _low_precision_inputs(seed):
    T, H, I, E, topk, shared = LOW_PRECISION_SHAPE.values()
    inp = make_inputs(T, H, I, E, topk, shared, seed=seed, signed_weights=True)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    return inp, d_out


@pytest.mark.parametrize("precision", ["mxfp8", "fp8_block"])
def test_low_precision_reference_backend_within_its_bar(precision):
    inp, d_out = _low_precision_inputs(seed=2)
    out, ctx, grads, (_, sched) = _steps(inp, mok.MoKConfig(precision=precision), None, d_out)
    assert sched.backend == "reference" and ctx.precision == precision
    ref_out = reference.moe_forward(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    ref_grads = reference.moe_backward(d_out, inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    context = f"{precision=} {LOW_PRECISION_SHAPE}"
    assert_close_to_reference(out, ref_out, precision, name="out", context=context)
    for name, g, r in zip(ref_grads._fields, grads, ref_grads):
        assert_close_to_reference(g, r, precision, name=name, context=context, check_cosine=True)


def _mxfp8_round_trip(t):
    q, scale, _, _ = mok.mxfp8_quantize(t)
    return mok.mxfp8_dequantize(q, scale)


def _rounded_operands(precision, inp):
    """x and the routed weights through the format, by the quantizers' public functions."""
    routed = (inp.w_gate, inp.w_up, inp.w_down)
    if precision == "mxfp8":
        return _mxfp8_round_trip(inp.x), *(_mxfp8_round_trip(w) for w in routed)
    weights = (mok.fp8_block_dequantize(*mok.fp8_block_quantize(w)[:2], (FP8_BLOCK, FP8_BLOCK)) for w in routed)
    return mok.fp8_block_dequantize(*fp8_block_quantize_activations(inp.x), (1, FP8_BLOCK)), *weights


@pytest.mark.parametrize("precision", ["mxfp8", "fp8_block"])
def test_low_precision_emulation_rounds_routed_operands_only(precision):
    """Bitwise: the routed experts read x and their weights rounded through the format; the
    shared expert reads x and its weights as given; gradients flow straight through."""
    inp, d_out = _low_precision_inputs(seed=4)
    out, _, grads, _ = _steps(inp, mok.MoKConfig(precision=precision), None, d_out)
    x_q, *routed_q = _rounded_operands(precision, inp)
    shared = (inp.ws_gate, inp.ws_up, inp.ws_down)
    args = (inp.x, inp.topk_ids, inp.topk_weights, *routed_q, *shared)
    assert torch.equal(out, reference.moe_forward(*args, routed_x=x_q).bfloat16())
    want = reference.moe_backward(d_out, *args, routed_x=x_q)
    for name, g, w in zip(want._fields, grads, want):
        assert torch.equal(g, w if name == "d_topk_weights" else w.bfloat16()), f"{precision=} {name}"
    # Skipping the rounding would give the bf16 results.
    bf16_out, _, bf16_grads, _ = _steps(inp, mok.MoKConfig(), None, d_out)
    assert not torch.equal(out, bf16_out), f"{precision} mode must round its operands"
    for name in ("d_x", "d_topk_weights", "d_w_gate", "d_w_down"):
        assert not torch.equal(getattr(grads, name), getattr(bf16_grads, name)), f"{precision=} {name}"


def test_fp8_block_and_mxfp8_round_differently():
    inp, _ = _low_precision_inputs(seed=6)
    outs = [_steps(inp, mok.MoKConfig(precision=p), None, None)[0] for p in ("mxfp8", "fp8_block")]
    assert not torch.equal(*outs)


@pytest.mark.parametrize("precision", ["mxfp8", "fp8_block"])
def test_low_precision_run_twice_is_bitwise_identical(precision):
    inp, d_out = _low_precision_inputs(seed=8)
    a = _steps(inp, mok.MoKConfig(precision=precision), None, d_out)
    b = _steps(inp, mok.MoKConfig(precision=precision), None, d_out)
    assert torch.equal(a[0], b[0])
    for name, ga, gb in zip(a[2]._fields, a[2], b[2]):
        assert torch.equal(ga, gb), f"{precision=} {name}"


def test_fp8_block_needs_sizes_multiple_of_128():
    inp = make_inputs(8, 128, 64, 4, 2, seed=1)
    expected = r"^intermediate_size \(w_gate.shape\[1\]\): expected a multiple of 128 in fp8_block mode, got 64"
    with pytest.raises(ValueError, match=expected):
        mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=mok.MoKConfig(precision="fp8_block"))


def test_fp8_block_backend_choice(kernel_device):
    """fp8_block runs on the triton backend: backend="triton" takes it, "auto" does on CUDA."""
    inp = make_inputs(8, 128, 128, 4, 2, seed=1, device=kernel_device)
    ws = mok.get_workspace(mok.MoKConfig(), None, device=kernel_device, num_local_tokens=8, hidden_size=128, topk=2)
    for backend, expected in (("triton", "triton"), ("auto", "triton" if kernel_device == "cuda" else "reference")):
        config = mok.MoKConfig(precision="fp8_block", backend=backend)
        sched = mok.build_schedule(ws, config, inp.topk_ids, num_local_experts=4)
        assert sched.backend == expected, f"{backend=} {kernel_device=}"


def test_error_flag_raises_once():
    ws = mok.create_workspace(mok.MoKConfig(), None, device="cpu", num_local_tokens=4, hidden_size=32, topk=1)
    mok.check_errors(ws)  # clean
    ws.error_flag.fill_(2)
    with pytest.raises(mok.MoKError, match="schedule capacity"):
        mok.check_errors(ws)
    mok.check_errors(ws)  # cleared


def test_reference_backend_under_autocast_is_the_plain_result():
    """A caller's torch.autocast (common in training loops) must not turn the reference's
    fp32 math into bf16: forward and every gradient equal the run without autocast."""
    inp = make_inputs(16, 64, 32, 4, 2, 32, seed=3, device="cpu")
    config = mok.MoKConfig(backend="reference")

    def run(autocast: bool):
        leaves = [t.detach().clone().requires_grad_() for t in (inp.x, inp.topk_weights, *inp.weights)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = mok.moe(leaves[0], inp.topk_ids, leaves[1], *leaves[2:], config=config)
            out.float().square().sum().backward()
        return [out] + [t.grad for t in leaves]

    for name, plain, under_autocast in zip(("out", "d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down",
                                            "d_ws_gate", "d_ws_up", "d_ws_down"), run(False), run(True)):
        assert plain.dtype == under_autocast.dtype and torch.equal(plain, under_autocast), name
