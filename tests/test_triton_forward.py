"""The triton backend's forward through the functional API and the module, against the
reference on the odd cases: T = 1, ragged T, experts with no tokens, all tokens to one
expert, topk = 1 and topk = E, a shared expert, the SwiGLU clamp, signed router weights."""

import pytest
import torch

import mok
from mok import reference
from mok.testing import ODD_CASES, assert_close_to_reference, make_inputs, saved_tensors


@pytest.mark.parametrize("case", ODD_CASES)
def test_triton_forward_matches_reference(kernel_device, case):
    odd = ODD_CASES[case]
    inp = odd.inputs(seed=len(case), device=kernel_device)
    T, H, I, E, topk, I_s, limit = (odd.num_tokens, odd.hidden_size, odd.intermediate_size, odd.num_experts,
                                    odd.topk, odd.shared_intermediate_size, odd.swiglu_limit)
    config = mok.MoKConfig(backend="triton", strict=True)
    out = mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=config, swiglu_limit=limit)
    ref = reference.moe_forward(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, swiglu_limit=limit)
    assert out.dtype == torch.bfloat16 and out.device.type == kernel_device
    assert_close_to_reference(out, ref, name="out", context=f"{case}: {T=} {H=} {I=} {E=} {topk=} {I_s=} {limit=}")


def test_triton_forward_run_twice_bitwise(kernel_device):
    inp = make_inputs(45, 64, 32, 6, 2, 32, seed=7, device=kernel_device)
    config = mok.MoKConfig(backend="triton")
    runs = [mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=config) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def test_triton_context_and_recompute(kernel_device):
    inp = make_inputs(33, 32, 32, 4, 2, 16, seed=3, device=kernel_device)
    config = mok.MoKConfig(backend="triton")
    ws = mok.get_workspace(config, None, device=inp.x.device, num_local_tokens=33, hidden_size=32, topk=2)
    sched = mok.build_schedule(ws, config, inp.topk_ids, num_local_experts=4)
    args = (inp.x, inp.topk_weights, inp.ws_gate, inp.ws_up, inp.ws_down, inp.w_gate, inp.w_up, inp.w_down)
    _, ctx = mok.forward(config, ws, sched, *args)
    again = mok.recompute_forward_context(config, ws, sched, *args)
    saved, saved_again = saved_tensors(ctx), saved_tensors(again)
    assert saved.keys() == saved_again.keys() == {"routed.gate_up", "routed.h", "shared.gate_up", "shared.h"}
    # Rows past the schedule's num_rows are never written: compare the rows in use.
    rows = int(sched.routing.num_rows)
    for name in saved:
        a, b = saved[name], saved_again[name]
        if name in ("routed.h", "routed.gate_up"):
            a, b = a[:rows], b[:rows]
        if name in ("shared.h", "shared.gate_up"):
            a, b = a[:33], b[:33]
        assert torch.equal(a, b), name


def test_bad_ids_raise_in_strict_mode(kernel_device):
    inp = make_inputs(10, 32, 16, 4, 2, device=kernel_device)
    ids = inp.topk_ids.clone()
    ids[4, 0] = 9
    with pytest.raises(mok.MoKError, match="out of range or repeated"):
        mok.moe(inp.x, ids, inp.topk_weights, *inp.weights, config=mok.MoKConfig(backend="triton", strict=True))
    # Without strict mode the flag waits for check_errors.
    config = mok.MoKConfig(backend="triton")
    mok.moe(inp.x, ids, inp.topk_weights, *inp.weights, config=config)
    ws = mok.get_workspace(config, None, device=inp.x.device, num_local_tokens=10, hidden_size=32, topk=2)
    with pytest.raises(mok.MoKError):
        mok.check_errors(ws)


def test_triton_backend_refuses_what_it_cannot_run(monkeypatch):
    """CPU tensors without the interpreter: backend="triton" says why; "auto" takes the reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inp = make_inputs(8, 64, 64, 4, 2)
    args = (inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    expected = r"backend='triton' cannot run this call: it runs on CUDA devices \(or under TRITON_INTERPRET=1\), not cpu"
    with pytest.raises(NotImplementedError, match=expected):
        mok.moe(*args, config=mok.MoKConfig(backend="triton", precision="mxfp8"))
    out = mok.moe(*args, config=mok.MoKConfig(precision="mxfp8"))
    assert out.shape == inp.x.shape and torch.isfinite(out).all()
