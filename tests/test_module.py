"""MoKMoE: parameters, init, autograd against the reference, shapes, errors."""

import math

import pytest
import torch

import mok
from mok import reference
from mok.testing import assert_close_to_reference, make_topk_ids


def test_parameters_named_and_shaped_as_spec():
    layer = mok.MoKMoE(64, 32, 6, 2, shared_intermediate_size=48)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {
        "w_gate": (6, 32, 64), "w_up": (6, 32, 64), "w_down": (6, 64, 32),
        "ws_gate": (48, 64), "ws_up": (48, 64), "ws_down": (64, 48),
    }
    for name, p in layer.named_parameters():
        bound = 1 / math.sqrt(p.shape[-1])
        assert p.dtype == torch.bfloat16
        assert p.abs().max() <= bound * 1.01 and p.abs().max() > bound * 0.5, name
    assert [n for n, _ in mok.MoKMoE(64, 32, 6, 2).named_parameters()] == ["w_gate", "w_up", "w_down"]


def test_gate_up_pairs_stay_packed():
    """Each gate/up pair shares one allocation (what the fast gate/up GEMM reads), also after
    a move and after materializing from the meta device; packing keeps the values."""
    from mok.kernels.gemm.gate_up import gate_up_packed

    layer = mok.MoKMoE(64, 32, 6, 2, shared_intermediate_size=48)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    layer.to(torch.float32).to(torch.bfloat16)
    for name, p in layer.named_parameters():
        assert torch.equal(p, before[name]) and p.is_contiguous(), name
    assert gate_up_packed(layer.w_gate, layer.w_up) and gate_up_packed(layer.ws_gate, layer.ws_up)
    meta = mok.MoKMoE(64, 32, 6, 2, device="meta").to_empty(device="cpu")
    assert gate_up_packed(meta.w_gate, meta.w_up)
    separate = mok.MoKMoE(64, 32, 6, 2)
    separate.w_up.data = separate.w_up.data.clone()
    assert not gate_up_packed(separate.w_gate, separate.w_up)
    with pytest.raises(ValueError, match=r"^w_up: expected the shape, dtype and device of w_gate"):
        mok.pack_gate_up(layer.w_gate, layer.w_down)


def test_module_autograd_matches_reference():
    torch.manual_seed(0)
    B, S, H, I, E, topk = 2, 9, 64, 32, 8, 2
    layer = mok.MoKMoE(H, I, E, topk, shared_intermediate_size=32, swiglu_limit=1.0)
    x = torch.randn(B, S, H).bfloat16().requires_grad_()
    ids = make_topk_ids(B * S, E, topk).view(B, S, topk)
    w = torch.randn(B, S, topk).requires_grad_()
    out = layer(x, ids, w)
    assert out.shape == (B, S, H) and out.dtype == torch.bfloat16
    d_out = torch.randn_like(out)
    out.backward(d_out)
    params = [layer.w_gate, layer.w_up, layer.w_down, layer.ws_gate, layer.ws_up, layer.ws_down]
    args = (x.detach().view(-1, H), ids.view(-1, topk), w.detach().view(-1, topk), *[p.detach() for p in params])
    ref_out = reference.moe_forward(*args, swiglu_limit=1.0)
    ref = reference.moe_backward(d_out.view(-1, H), *args, swiglu_limit=1.0)
    assert_close_to_reference(out.view(-1, H), ref_out, name="out")
    assert_close_to_reference(x.grad.view(-1, H), ref.d_x, name="d_x", check_cosine=True)
    assert_close_to_reference(w.grad.view(-1, topk), ref.d_topk_weights, name="d_topk_weights", check_cosine=True)
    for p, r, name in zip(params, ref[2:], ref._fields[2:]):
        assert p.grad is not None and p.grad.dtype == torch.bfloat16, name
        assert_close_to_reference(p.grad, r, name=name, check_cosine=True)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(hidden_size=0), ValueError, r"^hidden_size: expected a positive int"),
        (dict(topk=9), ValueError, r"^topk: expected at most num_experts \(8\)"),
        (dict(shared_intermediate_size=-1), ValueError, r"^shared_intermediate_size"),
        (dict(precision="int8"), ValueError, r"^precision: expected one of"),
        (dict(swiglu_limit=-1.0), ValueError, r"^swiglu_limit"),
        (dict(dtype=torch.float32), TypeError, r"^dtype: expected torch.bfloat16"),
        (dict(num_experts=0, topk=1), ValueError, r"^num_experts: expected a positive int"),
        (dict(topk=0), ValueError, r"^topk: expected a positive int"),
        (dict(hidden_size=60), ValueError, r"^hidden_size: expected a multiple of 8 in bf16 mode, got 60"),
        (dict(intermediate_size=20), ValueError, r"^intermediate_size: expected a multiple of 8 in bf16 mode"),
        (dict(intermediate_size=48, precision="mxfp8"), ValueError, r"^intermediate_size: expected a multiple of 32"),
        (dict(hidden_size=80, precision="mxfp8"), ValueError, r"^hidden_size: expected a multiple of 32 in mxfp8"),
        (dict(hidden_size=64, precision="fp8_block"), ValueError, r"^hidden_size: expected a multiple of 128"),
        (dict(shared_intermediate_size=12), ValueError, r"^shared_intermediate_size: expected a multiple of 8"),
    ],
)
def test_constructor_errors(kwargs, error, match):
    args = dict(hidden_size=64, intermediate_size=32, num_experts=8, topk=2)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        mok.MoKMoE(**args)


def test_forward_rejects_wrong_hidden():
    layer = mok.MoKMoE(64, 32, 4, 2)
    with pytest.raises(ValueError, match=r"^x: expected a tensor of shape \[\.\.\., 64\]"):
        layer(torch.randn(3, 32).bfloat16(), torch.zeros(3, 2, dtype=torch.long), torch.rand(3, 2))


@pytest.mark.parametrize("precision", ["mxfp8", "fp8_block"])
def test_module_low_precision_within_its_bar(precision):
    torch.manual_seed(3)
    B, S, H, I, E, topk, I_s = 2, 13, 256, 128, 6, 2, 64
    layer = mok.MoKMoE(H, I, E, topk, shared_intermediate_size=I_s, precision=precision)
    x = torch.randn(B, S, H).bfloat16().requires_grad_()
    ids = make_topk_ids(B * S, E, topk).view(B, S, topk)
    w = torch.randn(B, S, topk).softmax(-1).requires_grad_()
    out = layer(x, ids, w)
    d_out = torch.randn_like(out)
    out.backward(d_out)
    params = list(layer.parameters())
    args = (x.detach().view(-1, H), ids.view(-1, topk), w.detach().view(-1, topk), *[p.detach() for p in params])
    ref_out = reference.moe_forward(*args)
    ref = reference.moe_backward(d_out.view(-1, H), *args)
    context = f"{precision=} {B=} {S=} {H=} {I=} {E=} {topk=} {I_s=}"
    assert_close_to_reference(out.view(-1, H), ref_out, precision, name="out", context=context)
    actual = (x.grad.view(-1, H), w.grad.view(-1, topk), *[p.grad for p in params])
    for name, a, r in zip(ref._fields, actual, ref):
        assert_close_to_reference(a, r, precision, name=name, context=context, check_cosine=True)


def test_precision_reaches_config():
    layer = mok.MoKMoE(64, 64, 4, 2, precision="mxfp8", config=mok.MoKConfig(fwd_num_comm_sms=16))
    assert layer.config.precision == "mxfp8" and layer.config.fwd_num_comm_sms == 16


def _routing(lead, topk, num_experts=4):
    ids = make_topk_ids(math.prod(lead), num_experts, topk).view(*lead, topk)
    return ids, torch.rand(*lead, topk)


def test_forward_enforces_the_layers_topk():
    layer = mok.MoKMoE(64, 32, 4, 2)
    ids, w = _routing((3,), 3)
    with pytest.raises(ValueError, match=r"^topk_ids: expected shape \[\.\.\., 2\] \(the layer's topk\), got \(3, 3\)"):
        layer(torch.randn(3, 64).bfloat16(), ids, w)


@pytest.mark.parametrize("name", ["x", "topk_ids", "topk_weights"])
def test_forward_names_a_list_given_for_a_tensor(name):
    layer = mok.MoKMoE(64, 32, 4, 2)
    ids, w = _routing((3,), 2)
    args = {"x": torch.randn(3, 64).bfloat16(), "topk_ids": ids, "topk_weights": w}
    args[name] = args[name].tolist()
    with pytest.raises(TypeError, match=rf"^{name}: expected a torch.Tensor, got list"):
        layer(**args)


def test_check_errors_is_clean_before_and_after_a_call():
    layer = mok.MoKMoE(64, 32, 4, 2)
    layer.check_errors()  # no call yet: nothing to check
    ids, w = _routing((2, 3), 2)
    layer(torch.randn(2, 3, 64).bfloat16(), ids, w)
    layer.check_errors()
    layer.check_errors(blocking=False)
