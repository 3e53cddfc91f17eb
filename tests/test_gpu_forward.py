"""GPU-only properties of the triton forward: preset-sized accuracy, determinism over 10
runs, no host sync, CUDA-graph capture, torch.compile(fullgraph=True) (bf16, fp8_block, mxfp8),
and a whole training step captured in a CUDA graph."""

import pytest
import torch

import mok
from mok import reference
from mok.bench.presets import PRESETS
from mok.testing import assert_close_to_reference, make_inputs
from mok.testing.timing import capture_cuda_graph

pytestmark = pytest.mark.gpu


def _layer_and_inputs(T=2048, H=1024, I=512, E=32, topk=4, I_s=256, seed=0, precision="bf16"):
    torch.manual_seed(seed)
    layer = mok.MoKMoE(H, I, E, topk, shared_intermediate_size=I_s, precision=precision, device="cuda")
    inp = make_inputs(T, H, I, E, topk, seed=seed, device="cuda")
    return layer, inp


@pytest.mark.parametrize("preset", ["qwen3-30b", "deepseek-v3-slice", "mixtral-8x7b"])
def test_preset_forward_within_bf16_bar(preset):
    p = PRESETS[preset]
    inp = make_inputs(p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk, p.shared_intermediate_size, seed=1, device="cuda")
    with torch.no_grad():
        out = mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=mok.MoKConfig(backend="triton", strict=True))
        ref = reference.moe_forward(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    assert_close_to_reference(out, ref, name="out", context=preset)


def test_ten_runs_bitwise_identical():
    layer, inp = _layer_and_inputs()
    with torch.no_grad():
        outs = [layer(inp.x, inp.topk_ids, inp.topk_weights) for _ in range(10)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_forward_makes_no_host_sync():
    layer, inp = _layer_and_inputs()
    with torch.no_grad():
        layer(inp.x, inp.topk_ids, inp.topk_weights)  # compile kernels, build the workspace
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(inp.x, inp.topk_ids, inp.topk_weights)
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_cuda_graph_replay_equals_eager():
    layer, inp = _layer_and_inputs()
    with torch.no_grad():
        eager = layer(inp.x, inp.topk_ids, inp.topk_weights)
        graph, static_out = capture_cuda_graph(lambda: layer(inp.x, inp.topk_ids, inp.topk_weights))
        # New routing and tokens in the same buffers: the replay must follow them.
        fresh = make_inputs(2048, 1024, 512, 32, 4, seed=5, device="cuda")
        inp.x.copy_(fresh.x)
        inp.topk_ids.copy_(fresh.topk_ids)
        inp.topk_weights.copy_(fresh.topk_weights)
        graph.replay()
        expected = layer(inp.x, inp.topk_ids, inp.topk_weights)
    assert torch.equal(static_out, expected)
    assert not torch.equal(static_out, eager)


@pytest.mark.parametrize("precision", ["bf16", "fp8_block", "mxfp8"])
def test_torch_compile_fullgraph(precision):
    layer, inp = _layer_and_inputs(precision=precision)
    with torch.no_grad():
        eager = layer(inp.x, inp.topk_ids, inp.topk_weights)
        compiled = torch.compile(layer.forward, fullgraph=True)
        out = compiled(inp.x, inp.topk_ids, inp.topk_weights)
    assert torch.equal(out, eager)


@pytest.mark.parametrize("precision", ["bf16", "fp8_block", "mxfp8"])
def test_cuda_graph_of_a_training_step(precision):
    """Forward, backward and an optimizer step captured in one CUDA graph: two replays give
    the same parameters, bit for bit, as two eager steps from the same start (in fp8_block and mxfp8 the
    graph quantizes the weights each replay, so it reads what the optimizer wrote)."""
    layer, inp = _layer_and_inputs(precision=precision)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.05, momentum=0.9)
    d_out = torch.randn_like(inp.x)
    start = [p.detach().clone() for p in layer.parameters()]

    def restore():
        with torch.no_grad():
            for p, p0 in zip(layer.parameters(), start):
                p.copy_(p0)
                if p.grad is not None:
                    p.grad.zero_()
        optimizer.state.clear()

    def step():
        optimizer.zero_grad(set_to_none=False)
        layer(inp.x, inp.topk_ids, inp.topk_weights).backward(d_out)
        optimizer.step()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: kernels compiled, grads and momentum buffers allocated
            step()
    torch.cuda.current_stream().wait_stream(stream)
    restore()
    step()  # momentum buffers now exist; start the comparison from here
    after_one = [p.detach().clone() for p in layer.parameters()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    graph.replay()
    replayed = [p.detach().clone() for p in layer.parameters()]

    restore()
    for _ in range(3):
        step()
    for p, r, a in zip(layer.parameters(), replayed, after_one):
        assert torch.equal(p, r)
        assert not torch.equal(p, a)
