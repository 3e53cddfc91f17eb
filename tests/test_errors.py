"""Errors a caller can reach: argument types and shapes of `mok.moe`, and device errors raised
at the next call from the flag's host copy, without a sync."""

import numpy as np
import pytest
import torch

import mok
from mok import functional
from mok.testing import make_inputs


class _Event:
    """Stands in for the CUDA event behind the flag's host copy."""

    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_moe_takes_leading_dims_like_the_module():
    B, S, H, I, E, topk = 2, 3, 32, 16, 4, 2
    inp = make_inputs(B * S, H, I, E, topk, seed=2)
    flat = mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    out = mok.moe(inp.x.view(B, S, H), inp.topk_ids.view(B, S, topk), inp.topk_weights.view(B, S, topk), *inp.weights)
    assert out.shape == (B, S, H), f"{B=} {S=} {H=}"
    assert torch.equal(out.view(-1, H), flat), f"{B=} {S=} {H=} {I=} {E=} {topk=}"


def test_moe_rejects_routing_whose_leading_dims_differ_from_x():
    inp = make_inputs(6, 32, 16, 4, 2, seed=2)
    with pytest.raises(ValueError, match=r"^topk_weights: expected shape \[2, 3, topk\] \(x's leading dims\), got \(6, 2\)"):
        mok.moe(inp.x.view(2, 3, 32), inp.topk_ids.view(2, 3, 2), inp.topk_weights, *inp.weights)


@pytest.mark.parametrize("name", ["x", "topk_ids", "topk_weights", "w_gate", "w_down"])
@pytest.mark.parametrize("kind", ["list", "tuple", "ndarray"])
def test_moe_names_a_non_tensor_argument(name, kind):
    inp = make_inputs(4, 32, 16, 4, 2, seed=2)
    args = dict(x=inp.x, topk_ids=inp.topk_ids, topk_weights=inp.topk_weights,
                w_gate=inp.weights[0], w_up=inp.weights[1], w_down=inp.weights[2])
    value = args[name].float() if args[name].dtype == torch.bfloat16 else args[name]
    args[name] = {"list": value.tolist(), "tuple": tuple(value.tolist()), "ndarray": value.numpy()}[kind]
    expected = {"list": "list", "tuple": "tuple", "ndarray": "ndarray"}[kind]
    with pytest.raises(TypeError, match=rf"^{name}: expected a torch.Tensor, got {expected}"):
        mok.moe(**args)


def _landed(workspace, flags: int, done: bool, monkeypatch):
    """Makes the workspace's host copy read `flags`, landed or not, as a CUDA copy would."""
    monkeypatch.setattr(functional._ErrorCopy, "_skipped", staticmethod(lambda error_flag: False))
    # through monkeypatch, so that undo() gives the workspace back its real pinned copy and event
    monkeypatch.setattr(workspace.error_copy, "host", torch.tensor([flags], dtype=torch.int32))
    monkeypatch.setattr(workspace.error_copy, "copied", _Event(done))


def test_check_errors_without_blocking_reads_only_a_landed_copy(monkeypatch):
    ws = mok.create_workspace(mok.MoKConfig(), None, device="cpu", num_local_tokens=4, hidden_size=32, topk=1)
    mok.check_errors(ws, blocking=False)  # no copy yet
    _landed(ws, 1, done=False, monkeypatch=monkeypatch)
    mok.check_errors(ws, blocking=False)  # still in flight: nothing known yet
    ws.error_copy.copied.done = True
    with pytest.raises(mok.MoKError, match="out of range or repeated"):
        mok.check_errors(ws, blocking=False)
    mok.check_errors(ws, blocking=False)  # cleared
    assert int(ws.error_flag.item()) == 0
    with pytest.raises(TypeError, match="^blocking: expected a bool"):
        mok.check_errors(ws, blocking=None)


def test_next_call_raises_a_landed_error(kernel_device, monkeypatch):
    """On the triton backend a call raises what an earlier call's landed copy shows, and the
    call after that runs clean."""
    inp = make_inputs(8, 32, 16, 4, 2, seed=2, device=kernel_device)
    config = mok.MoKConfig(backend="triton")
    args = (inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    mok.moe(*args, config=config)
    ws = mok.get_workspace(config, None, device=kernel_device, num_local_tokens=8, hidden_size=32, topk=2)
    _landed(ws, 2, done=True, monkeypatch=monkeypatch)
    with pytest.raises(mok.MoKError, match="schedule capacity"):
        mok.moe(*args, config=config)
    assert int(ws.error_flag.item()) == 0 and int(ws.error_copy.host[0]) == 0, "raised once, then cleared"
    monkeypatch.undo()  # the next call would take a real CUDA copy
    mok.moe(*args, config=config)


def test_module_check_errors_reads_its_own_workspaces(monkeypatch):
    layer = mok.MoKMoE(32, 16, 4, 2)
    inp = make_inputs(5, 32, 16, 4, 2, seed=2)
    layer(inp.x, inp.topk_ids, inp.topk_weights)
    (ws,) = layer._workspaces.values()
    ws.error_flag.fill_(1)
    with pytest.raises(mok.MoKError, match="out of range or repeated"):
        layer.check_errors()
    layer.check_errors()


@pytest.mark.gpu
def test_bad_routing_raises_at_the_next_call_without_a_sync():
    inp = make_inputs(64, 64, 32, 4, 2, seed=2, device="cuda")
    bad = inp.topk_ids.clone()
    bad[5, 1] = 7
    config = mok.MoKConfig(backend="triton")
    mok.moe(inp.x, bad, inp.topk_weights, *inp.weights, config=config)  # queued; nothing known yet
    torch.cuda.synchronize()  # stands for the rest of a training step
    with pytest.raises(mok.MoKError, match="out of range or repeated"):
        mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=config)
    mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=config)
    torch.cuda.synchronize()
    ws = mok.get_workspace(config, None, device=inp.x.device, num_local_tokens=64, hidden_size=64, topk=2)
    mok.check_errors(ws)
    assert ws.error_copy.host.is_pinned()


@pytest.mark.gpu
def test_graph_capture_takes_no_host_copy():
    inp = make_inputs(64, 64, 32, 4, 2, seed=2, device="cuda")
    config = mok.MoKConfig(backend="triton")
    args = (inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    mok.moe(*args, config=config)  # warm-up: compiles the kernels, makes the workspace
    ws = mok.get_workspace(config, None, device=inp.x.device, num_local_tokens=64, hidden_size=64, topk=2)
    copied = ws.error_copy.copied
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mok.moe(*args, config=config)
    graph.replay()
    torch.cuda.synchronize()
    assert ws.error_copy.copied is copied and torch.isfinite(out.float()).all()
    mok.check_errors(ws)


@pytest.mark.gpu
def test_host_copy_of_the_flag_under_a_cuda_default_device():
    """Model code that builds under `with torch.device("cuda")` (torchtitan's does) still gets
    its flag copied into pinned host memory, not a CUDA tensor."""
    inp = make_inputs(16, 64, 32, 4, 2, device="cuda")
    with torch.device("cuda"):
        out = mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=mok.MoKConfig(backend="triton"))
    assert out.shape == inp.x.shape and torch.isfinite(out).all()
