"""Every bad input raises a ValueError/TypeError that names the argument."""

import pytest
import torch

import mok
from mok.testing import make_inputs

T, H, I, E, TOPK, I_S = 12, 32, 16, 4, 2, 16


def _inputs():
    return make_inputs(T, H, I, E, TOPK, I_S, seed=3)


def _call(**overrides):
    inp = _inputs()
    args = dict(
        x=inp.x, topk_ids=inp.topk_ids, topk_weights=inp.topk_weights, w_gate=inp.w_gate, w_up=inp.w_up,
        w_down=inp.w_down, ws_gate=inp.ws_gate, ws_up=inp.ws_up, ws_down=inp.ws_down,
    )
    config = overrides.pop("config", None)
    args.update(overrides)
    return mok.moe(**args, config=config)


def test_valid_call_runs():
    out = _call()
    assert out.shape == (T, H) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "name, make_bad, error, match",
    [
        ("x dtype", lambda i: dict(x=i.x.float()), TypeError, r"^x: expected dtype bfloat16"),
        ("x leading dims", lambda i: dict(x=i.x[None]), ValueError, r"^topk_ids: expected shape \[1, 12, topk\] \(x's leading dims\)"),
        ("x scalar", lambda i: dict(x=i.x[0, 0]), ValueError, r"^x: expected a tensor with at least one dim"),
        ("x empty", lambda i: dict(x=i.x[:0], topk_ids=i.topk_ids[:0], topk_weights=i.topk_weights[:0]), ValueError, r"^x: expected at least one token"),
        ("x non-contiguous", lambda i: dict(x=torch.cat([i.x, i.x], 1)[:, ::2]), ValueError, r"^x: expected a contiguous"),
        ("x not a tensor", lambda i: dict(x=[1.0]), TypeError, r"^x: expected a torch.Tensor"),
        ("ids dtype", lambda i: dict(topk_ids=i.topk_ids.float()), TypeError, r"^topk_ids: expected dtype int32 or int64"),
        ("ids rows", lambda i: dict(topk_ids=i.topk_ids[:-1]), ValueError, r"^topk_ids: expected shape \[12, topk\] \(x's leading dims\), got \(11, 2\)"),
        ("ids out of range", lambda i: dict(topk_ids=torch.where(i.topk_ids == 0, E, i.topk_ids)), ValueError, r"^topk_ids: expected expert ids in \[0, 4\), got 4"),
        ("ids negative", lambda i: dict(topk_ids=torch.where(i.topk_ids == 0, -1, i.topk_ids)), ValueError, r"^topk_ids: expected expert ids in \[0, 4\), got -1"),
        ("ids repeated", lambda i: dict(topk_ids=i.topk_ids[:, :1].repeat(1, 2).contiguous()), ValueError, r"^topk_ids: expected distinct expert ids within each row"),
        ("topk > E", lambda i: dict(topk_ids=torch.arange(5).repeat(T, 1), topk_weights=torch.rand(T, 5)), ValueError, r"^topk_ids: expected topk <= num_experts \(4\)"),
        ("weights dtype", lambda i: dict(topk_weights=i.topk_weights.bfloat16()), TypeError, r"^topk_weights: expected dtype float32"),
        ("weights shape", lambda i: dict(topk_weights=i.topk_weights[:, :1].contiguous()), ValueError, r"^topk_weights: expected shape \[12, 2\]"),
        ("w_gate dtype", lambda i: dict(w_gate=i.w_gate.float()), TypeError, r"^w_gate: expected dtype bfloat16"),
        ("w_up shape", lambda i: dict(w_up=i.w_up[:, :8].contiguous()), ValueError, r"^w_up: expected shape \[4, 16, 32\]"),
        ("w_down shape", lambda i: dict(w_down=i.w_down.transpose(1, 2).contiguous()), ValueError, r"^w_down: expected shape \[4, 32, 16\]"),
        ("w_down layout", lambda i: dict(w_down=i.w_down.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, r"^w_down: expected a contiguous"),
        ("shared partial", lambda i: dict(ws_down=None), ValueError, r"^ws_down: expected all three shared-expert weights or none"),
        ("shared shape", lambda i: dict(ws_up=i.ws_up[:8].contiguous()), ValueError, r"^ws_up: expected shape \[16, 32\]"),
        ("hidden alignment", lambda i: dict(x=i.x[:, :12].contiguous(), w_gate=i.w_gate[..., :12].contiguous(), w_up=i.w_up[..., :12].contiguous(), w_down=i.w_down[:, :12].contiguous(), ws_gate=None, ws_up=None, ws_down=None), ValueError, r"^hidden_size \(x.shape\[1\]\): expected a multiple of 8 in bf16 mode, got 12"),
    ],
)
def test_bad_input_names_the_argument(name, make_bad, error, match):
    with pytest.raises(error, match=match):
        _call(**make_bad(_inputs()))


def test_alignment_depends_on_precision():
    # H = 32, I = 16: fine for bf16, I is not a multiple of 32 for mxfp8.
    with pytest.raises(ValueError, match=r"^intermediate_size \(w_gate.shape\[1\]\): expected a multiple of 32 in mxfp8 mode, got 16"):
        _call(config=mok.MoKConfig(precision="mxfp8"))


def test_device_mismatch_is_named():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device type")
    inp = _inputs()
    with pytest.raises(ValueError, match=r"^w_gate: expected a tensor on"):
        _call(x=inp.x.cuda(), topk_ids=inp.topk_ids.cuda(), topk_weights=inp.topk_weights.cuda())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(precision="fp4"), r"^precision: expected one of"),
        (dict(backend="cuda"), r"^backend: expected one of"),
        (dict(bwd_num_comm_sms=0), r"^bwd_num_comm_sms: expected a positive int"),
        (dict(fwd_num_comm_sms=2.5), r"^fwd_num_comm_sms: expected a positive int"),
        (dict(overlap_comm_sms=-1), r"^overlap_comm_sms: expected an int >= 0, got -1"),
        (dict(overlap_return_sms=True), r"^overlap_return_sms: expected an int >= 0, got True"),
        (dict(overlap_dispatch_sms=1.5), r"^overlap_dispatch_sms: expected an int >= 0, got 1.5"),
        (dict(schedule_capacity_multiplier=0.5), r"^schedule_capacity_multiplier: expected None or a number >= 1"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mok.MoKConfig(**kwargs)


def test_config_capacity():
    assert mok.MoKConfig().receive_capacity(100, 8, 4) == 3200
    assert mok.MoKConfig(schedule_capacity_multiplier=1.5).receive_capacity(100, 8, 4) == 1200


def test_reference_backend_reads_fused_gate_up_halves():
    """The halves of one [E, 2·I, H] gate/up weight (transformers' layout) are views the
    reference backend reads as they are; `moe` and the triton kernels want contiguous ones."""
    inp = _inputs()
    fused = torch.cat([inp.w_gate, inp.w_up], dim=1)  # [E, 2I, H]
    w_gate, w_up = fused[:, :I], fused[:, I:]
    config = mok.MoKConfig()
    workspace = mok.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=inp.topk_ids.shape[1])
    schedule = mok.build_schedule(workspace, config, inp.topk_ids, num_local_experts=E)
    args = (inp.x, inp.topk_weights, inp.ws_gate, inp.ws_up, inp.ws_down)
    out, _ = mok.forward(config, workspace, schedule, *args, w_gate, w_up, inp.w_down)
    expected, _ = mok.forward(config, workspace, schedule, *args, inp.w_gate, inp.w_up, inp.w_down)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match=r"^w_gate: expected a contiguous"):
        _call(w_gate=w_gate, w_up=w_up)
