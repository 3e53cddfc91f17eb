"""The triton backend's backward through autograd and the functional API, against
`reference.moe_backward` on the forward's odd cases (T = 1, ragged T + shared expert, the
SwiGLU clamp, topk = 1, topk = E, all tokens to one expert, empty experts), with signed
router weights; run-twice and recompute-then-backward bitwise identical."""

import pytest
import torch

import mok
from mok import reference
from mok.testing import ODD_CASES, assert_close_to_reference, make_inputs


def _leaves(inp):
    """The layer's differentiable inputs as fresh leaves (shared ones may be None)."""
    tensors = (inp.x, inp.topk_weights, *inp.weights)
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("case", ODD_CASES)
def test_triton_backward_matches_reference(kernel_device, case):
    odd = ODD_CASES[case]
    inp = odd.inputs(seed=len(case), device=kernel_device)
    T, H, I, E, topk, I_s, limit = (odd.num_tokens, odd.hidden_size, odd.intermediate_size, odd.num_experts,
                                    odd.topk, odd.shared_intermediate_size, odd.swiglu_limit)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).bfloat16().to(kernel_device)
    x, topk_weights, *weights = _leaves(inp)
    out = mok.moe(x, inp.topk_ids, topk_weights, *weights, config=mok.MoKConfig(backend="triton", strict=True), swiglu_limit=limit)
    out.backward(d_out)
    ref = reference.moe_backward(d_out, inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, swiglu_limit=limit)
    ctx = f"{case}: {T=} {H=} {I=} {E=} {topk=} {I_s=} {limit=}"
    got = [x.grad, topk_weights.grad] + [None if w is None else w.grad for w in weights]
    for name, g, r in zip(ref._fields, got, ref):
        if r is not None:
            expected_dtype = torch.float32 if name == "d_topk_weights" else torch.bfloat16
            assert g is not None and g.dtype == expected_dtype and g.device.type == kernel_device, f"{name} {ctx}"
        assert_close_to_reference(g, r, name=name, context=ctx, check_cosine=True)
    if odd.routing != "random":  # experts that got no token: exact zeros
        used = set(inp.topk_ids.flatten().tolist())
        for e in set(range(E)) - used:
            for w in weights[:3]:
                assert torch.equal(w.grad[e], torch.zeros_like(w.grad[e])), f"expert {e} {ctx}"


def test_triton_backward_run_twice_and_recompute_bitwise(kernel_device):
    T, H, I, E, topk, I_s = 33, 32, 32, 4, 2, 16
    inp = make_inputs(T, H, I, E, topk, I_s, seed=3, device=kernel_device, signed_weights=True)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(8)).bfloat16().to(kernel_device)
    config = mok.MoKConfig(backend="triton")
    ws = mok.get_workspace(config, None, device=inp.x.device, num_local_tokens=T, hidden_size=H, topk=topk)
    sched = mok.build_schedule(ws, config, inp.topk_ids, num_local_experts=E)
    args = (inp.x, inp.topk_weights, inp.ws_gate, inp.ws_up, inp.ws_down, inp.w_gate, inp.w_up, inp.w_down)
    _, ctx = mok.forward(config, ws, sched, *args)
    first = mok.backward(config, ws, sched, ctx, d_out, *args)
    again = mok.backward(config, ws, sched, ctx, d_out, *args)
    recomputed = mok.backward(config, ws, sched, mok.recompute_forward_context(config, ws, sched, *args), d_out.float(), *args)
    for name, a, b, c in zip(first._fields, first, again, recomputed):
        assert torch.equal(a, b), f"{name}: run twice differs {T=} {H=} {I=} {E=} {topk=} {I_s=}"
        assert torch.equal(a, c), f"{name}: recompute (+ fp32 d_out) differs {T=} {H=} {I=} {E=} {topk=} {I_s=}"
    mok.check_errors(ws)
    # A context saved without the pre-activations cannot drive the backward.
    _, light = mok.forward(config, ws, sched, *args, needs_backward=False)
    with pytest.raises(ValueError, match="^context: expected the pre-activations"):
        mok.backward(config, ws, sched, light, d_out, *args)


def test_backward_ops_schema_and_fake_impls(kernel_device):
    """The backward's custom ops declare their mutations and their fake impls give the real
    shapes and dtypes (what torch.compile and CUDA graphs rely on)."""
    from mok import ops
    from mok.kernels.grouped_gemm import routing_block_m

    T, H, I, E, topk = 9, 32, 16, 3, 2
    inp = make_inputs(T, H, I, E, topk, seed=1, device=kernel_device, signed_weights=True)
    block_m = routing_block_m()
    routing = ops.routing_schedule(inp.topk_ids, torch.zeros(1, dtype=torch.int32, device=kernel_device), E, block_m)
    gen = torch.Generator().manual_seed(0)
    rows = routing[0].shape[0]
    h = torch.randn(rows, I, generator=gen).bfloat16().to(kernel_device)
    gate_up = torch.randn(rows, 2, I, generator=gen).bfloat16().to(kernel_device)
    d_out = torch.randn(T, H, generator=gen).bfloat16().to(kernel_device)
    zeros = lambda *shape: torch.zeros(*shape, device=kernel_device)  # noqa: E731
    sorted_rows = torch.randn(rows, H, generator=gen).bfloat16().to(kernel_device)
    cases = [
        (ops.gather_sorted_rows, (inp.x, d_out, inp.topk_weights, list(routing), block_m, topk)),
        (ops.gather_sorted_rows, (inp.x, d_out, None, list(routing), block_m, topk)),
        (ops.down_dgrad_swiglu, (sorted_rows, inp.topk_weights, gate_up, inp.w_down, list(routing), block_m, 0.5)),
        (ops.down_dgrad_swiglu, (sorted_rows, None, gate_up, inp.w_down, list(routing), block_m, None)),
        (ops.gate_up_dgrad_scatter, (gate_up, inp.w_gate, inp.w_up, list(routing), block_m, T * topk)),
        (ops.down_wgrad, (sorted_rows, h, list(routing), block_m)),
        (ops.down_wgrad_accumulate, (zeros(E, H, I), sorted_rows, h, list(routing), block_m)),
        (ops.gate_up_wgrad, (gate_up, sorted_rows, list(routing), block_m)),
        (ops.gate_up_wgrad_accumulate, (zeros(E, I, H), zeros(E, I, H), gate_up, sorted_rows, list(routing), block_m)),
    ]
    for op, args in cases:
        # The schema check (declared mutations) reruns the op: only for the ops that mutate.
        checks = ("test_schema", "test_faketensor") if op in (ops.down_wgrad_accumulate, ops.gate_up_wgrad_accumulate) else ("test_faketensor",)
        torch.library.opcheck(op.op, args, test_utils=checks)


# --------------------------------------------------------------------------- GPU only


def _functional(inp, config):
    T, H = inp.x.shape
    ws = mok.get_workspace(config, None, device=inp.x.device, num_local_tokens=T, hidden_size=H, topk=inp.topk_ids.shape[1])
    sched = mok.build_schedule(ws, config, inp.topk_ids, num_local_experts=inp.w_gate.shape[0])
    args = (inp.x, inp.topk_weights, inp.ws_gate, inp.ws_up, inp.ws_down, inp.w_gate, inp.w_up, inp.w_down)
    return ws, sched, args


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3-30b", "deepseek-v3-slice"])
def test_gpu_preset_backward_within_bf16_bar(preset):
    from mok.bench.presets import PRESETS

    p = PRESETS[preset]
    inp = make_inputs(p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk, p.shared_intermediate_size,
                      seed=1, device="cuda", signed_weights=True)
    d_out = torch.randn(p.num_tokens, p.hidden_size, device="cuda").bfloat16()
    config = mok.MoKConfig(backend="triton", strict=True)
    ws, sched, args = _functional(inp, config)
    _, ctx = mok.forward(config, ws, sched, *args)
    grads = mok.backward(config, ws, sched, ctx, d_out, *args)
    ref = reference.moe_backward(d_out, inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    for name, g, r in zip(ref._fields, grads, ref):
        assert_close_to_reference(g, r, name=name, context=preset, check_cosine=True)


@pytest.mark.gpu
def test_gpu_backward_no_host_sync_and_cuda_graph():
    inp = make_inputs(2048, 1024, 512, 32, 4, 256, seed=0, device="cuda", signed_weights=True)
    d_out = torch.randn(2048, 1024, device="cuda").bfloat16()
    config = mok.MoKConfig(backend="triton")
    ws, sched, args = _functional(inp, config)

    def step():
        _, ctx = mok.forward(config, ws, sched, *args)
        return mok.backward(config, ws, sched, ctx, d_out, *args)

    eager = step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(eager._fields, eager, captured):
        assert torch.equal(a, b), f"{name}: graph replay differs from eager"


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_main_grads_accumulate_in_place(kernel_device, backend, dtype):
    T, H, I, E, topk, I_s = 17, 32, 32, 4, 2, 16
    inp = make_inputs(T, H, I, E, topk, I_s, seed=2, device=kernel_device)
    config = mok.MoKConfig(backend=backend)
    ws = mok.get_workspace(config, None, device=inp.x.device, num_local_tokens=T, hidden_size=H, topk=topk)
    sched = mok.build_schedule(ws, config, inp.topk_ids, num_local_experts=E)
    args = (inp.x, inp.topk_weights, inp.ws_gate, inp.ws_up, inp.ws_down, inp.w_gate, inp.w_up, inp.w_down)
    _, ctx = mok.forward(config, ws, sched, *args)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(0)).bfloat16().to(kernel_device)
    plain = mok.backward(config, ws, sched, ctx, d_out, *args)
    names = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up")
    start = {n: (torch.randn_like(getattr(plain, "d_" + n), dtype=torch.float32) * getattr(plain, "d_" + n).float().std()).to(dtype) for n in names}
    buffers = {n: t.clone() for n, t in start.items()}
    grads = mok.backward(config, ws, sched, ctx, d_out, *args, main_grads=buffers)
    ctx_msg = f"{backend=} {dtype=} {T=} {H=} {I=} {E=} {topk=} {I_s=}"
    for n in names:
        got = getattr(grads, "d_" + n)
        assert got.data_ptr() == buffers[n].data_ptr() and got.dtype == dtype, f"{n} {ctx_msg}"
        assert_close_to_reference(buffers[n].float() - start[n].float(), getattr(plain, "d_" + n), name=n, context=ctx_msg)
    assert torch.equal(grads.d_x, plain.d_x) and grads.d_ws_down.data_ptr() != plain.d_ws_down.data_ptr()
    with pytest.raises(ValueError, match=r"^main_grads: expected 'w_gate' and 'w_up' together"):
        mok.backward(config, ws, sched, ctx, d_out, *args, main_grads={"w_gate": buffers["w_gate"]})
    with pytest.raises(ValueError, match=r"^main_grads: expected keys among"):
        mok.backward(config, ws, sched, ctx, d_out, *args, main_grads={"router": buffers["w_gate"]})
    with pytest.raises(ValueError, match=r"^main_grads\['w_down'\]: expected shape \[4, 32, 32\]"):
        mok.backward(config, ws, sched, ctx, d_out, *args, main_grads={"w_down": buffers["w_gate"][:, :16]})
