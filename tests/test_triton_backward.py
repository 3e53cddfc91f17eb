"""The triton backend's backward through autograd and the functional API, against
`reference.moe_backward` on the forward's odd cases (T = 1, ragged T + shared expert, the
SwiGLU clamp, topk = 1, topk = E, all tokens to one expert, empty experts), with signed
router weights; run-twice and recompute-then-backward bitwise identical. fp8_block and mxfp8:
the whole layer (forward and backward) within the low-precision accuracy bars, the shared expert
within bf16's, and the weight copies made once per version of each weight."""

import pytest
import torch

import mok
from mok import ops, reference
from mok.precision import base as precision_base
from mok.precision import bf16 as bf16_recipe
from mok.precision import recipe, routed_weight_copies
from mok.testing import ODD_CASES, TOLERANCES, OddCase, assert_close_to_reference, make_inputs, saved_tensors
from mok.testing.memory import poison_free_memory
from mok.testing.timing import capture_cuda_graph


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


@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("precision", ["bf16", "fp8_block", "mxfp8"])
def test_nan_token_propagates_as_in_the_reference(kernel_device, precision, limit):
    """A NaN in one token's x makes that token's output NaN, as in the reference, in
    every precision and through the SwiGLU clamp (a clamp that drops NaN gives a finite output);
    the other tokens stay finite and within the bar. bf16: every gradient NaN exactly where the
    reference's is (the low-precision modes spread a NaN over its quantization block)."""
    T, H, I, E, topk, nan_token = 40, 128, 128, 4, 2, 5
    ctx = f"{precision=} {limit=}"
    inp = make_inputs(T, H, I, E, topk, seed=11, device=kernel_device, signed_weights=True)
    x = inp.x.clone()
    x[nan_token, 17] = float("nan")
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(12)).bfloat16().to(kernel_device)
    routed = inp.weights[:3]  # w_gate, w_up, w_down; no shared expert
    leaves = [t.detach().clone().requires_grad_() for t in (x, inp.topk_weights, *routed)]
    config = mok.MoKConfig(backend="triton", strict=True, precision=precision)
    out = mok.moe(leaves[0], inp.topk_ids, leaves[1], *leaves[2:], config=config, swiglu_limit=limit)
    ref = reference.moe_forward(x, inp.topk_ids, inp.topk_weights, *routed, swiglu_limit=limit)
    assert ref[nan_token].isnan().all(), f"the reference's NaN token {ctx}"
    assert out[nan_token].isnan().all(), f"the NaN token's output: {out[nan_token].isnan().sum()} of {H} NaN {ctx}"
    others = torch.arange(T, device=kernel_device) != nan_token
    assert torch.isfinite(out[others]).all(), f"other tokens {ctx}"
    bar = "bf16" if precision == "bf16" else "fp8_block"
    assert_close_to_reference(out[others], ref[others], bar, name="out", context=ctx)
    if precision != "bf16":
        return
    grads = torch.autograd.grad(out, leaves, d_out)
    ref_grads = reference.moe_backward(d_out, x, inp.topk_ids, inp.topk_weights, *routed, swiglu_limit=limit)
    for name, g, r in zip(ref_grads._fields, grads, ref_grads[:5], strict=False):
        assert r.isnan().any() or name == "d_x", f"{name}: the reference has no NaN {ctx}"
        assert torch.equal(g.isnan().cpu(), r.isnan().cpu()), (
            f"{name}: {int(g.isnan().sum())} NaN against the reference's {int(r.isnan().sum())} {ctx}")


def test_down_wgrad_goes_last_where_its_operands_are_smaller_than_its_gradient():
    """The backward's order rule (sizes only: meta tensors of the presets' shapes)."""
    def operands(rows, hidden, inter):  # [w·dOut sorted, h]
        return [torch.empty(rows, hidden, dtype=torch.bfloat16, device="meta"),
                torch.empty(rows, inter, dtype=torch.bfloat16, device="meta")]

    def w_down(experts, hidden, inter):
        return torch.empty(experts, hidden, inter, dtype=torch.bfloat16, device="meta")

    mixtral = (operands(17408, 4096, 14336), w_down(8, 4096, 14336))
    assert bf16_recipe._down_wgrad_last(*mixtral, None)
    assert not bf16_recipe._down_wgrad_last(*mixtral, torch.empty(8, 4096, 14336, device="meta")), "main_grad: early"
    assert not bf16_recipe._down_wgrad_last(operands(147456, 2048, 768), w_down(128, 2048, 768), None)  # qwen3-30b
    assert not bf16_recipe._down_wgrad_last(operands(69632, 7168, 2048), w_down(32, 7168, 2048), None)  # deepseek


@pytest.mark.parametrize("limit", [None, 0.6])
def test_down_wgrad_from_weighted_h_where_i_is_below_h(kernel_device, set_plan, limit):
    """Where I < H the forward keeps no h and the down wgrad reads dOut with the down dgrad's
    w·h: every other gradient bitwise what the w·dOut copy and the saved h give, d_w_down within
    the bf16 bar of the reference either way (one bf16 rounding moves from w·dOut to w·h)."""

    T, H, I, E, topk, I_s = 45, 64, 32, 5, 3, 16
    inp = make_inputs(T, H, I, E, topk, I_s, seed=4, device=kernel_device, signed_weights=True)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(6)).bfloat16().to(kernel_device)
    config = mok.MoKConfig(backend="triton", strict=True)
    ws, sched, args = _functional(inp, config)
    ref = reference.moe_backward(d_out, inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, swiglu_limit=limit)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {I_s=} {limit=}"
    grads, saved = {}, {}
    for reads_weighted_h in (True, False):
        set_plan(down_wgrad_reads_weighted_h=reads_weighted_h)
        _, context = mok.forward(config, ws, sched, *args, limit)
        saved[reads_weighted_h] = set(saved_tensors(context))
        grads[reads_weighted_h] = mok.backward(config, ws, sched, context, d_out, *args, limit)
    assert saved[True] == {"routed.gate_up", "shared.gate_up", "shared.h"}, f"{saved[True]} {ctx}"
    assert saved[False] == saved[True] | {"routed.h"}, f"{saved[False]} {ctx}"
    for name, on, off, r in zip(ref._fields, grads[True], grads[False], ref):
        if name != "d_w_down":
            assert torch.equal(on, off), f"{name}: moved by the down wgrad's operands {ctx}"
            continue
        assert not torch.equal(on, off), f"d_w_down: the same bits both ways, so one path did not run {ctx}"
        for got in (on, off):
            assert_close_to_reference(got, r, name=name, context=ctx, check_cosine=True)


def test_triton_backward_run_twice_and_recompute_bitwise(kernel_device, monkeypatch):
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
    moved = {}  # the down wgrad before or after the gate/up wgrad
    for last in (False, True):
        monkeypatch.setattr(bf16_recipe, "_down_wgrad_last", lambda operands, w_down, main_down, last=last: last)
        moved[last] = mok.backward(config, ws, sched, ctx, d_out, *args)
    monkeypatch.undo()
    released = mok.backward(config, ws, sched, ctx, d_out, *args, release_context=True)
    for name, a, b, c, d, e, f in zip(first._fields, first, again, recomputed, released, moved[False], moved[True]):
        assert torch.equal(a, e) and torch.equal(a, f), f"{name}: the down wgrad's place matters {T=} {H=} {I=} {E=} {topk=} {I_s=}"
        assert torch.equal(a, b), f"{name}: run twice differs {T=} {H=} {I=} {E=} {topk=} {I_s=}"
        assert torch.equal(a, c), f"{name}: recompute (+ fp32 d_out) differs {T=} {H=} {I=} {E=} {topk=} {I_s=}"
        assert torch.equal(a, d), f"{name}: release_context differs {T=} {H=} {I=} {E=} {topk=} {I_s=}"
    # A released context gave up its activations and serves no second backward.
    assert ctx.released and not {"routed.gate_up", "routed.h", "shared.gate_up", "shared.h"} & set(saved_tensors(ctx))
    with pytest.raises(ValueError, match="^context: its activations were released by an earlier backward"):
        mok.backward(config, ws, sched, ctx, d_out, *args)
    mok.check_errors(ws)
    # A context saved without the pre-activations cannot drive the backward.
    _, light = mok.forward(config, ws, sched, *args, needs_backward=False)
    with pytest.raises(ValueError, match="^context: expected the pre-activations"):
        mok.backward(config, ws, sched, light, d_out, *args)


def test_autograd_releases_activations_unless_the_graph_is_kept(kernel_device):
    """`moe`'s backward frees the forward's activations once read, unless autograd keeps the
    graph: with retain_graph=True a second backward runs and adds the same gradients."""
    T, H, I, E, topk = 21, 32, 32, 4, 2
    inp = make_inputs(T, H, I, E, topk, seed=5, device=kernel_device)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).bfloat16().to(kernel_device)
    config = mok.MoKConfig(backend="triton")
    x, topk_weights, *weights = _leaves(inp)
    out = mok.moe(x, inp.topk_ids, topk_weights, *weights, config=config)
    context = out.grad_fn.state[3]
    out.backward(d_out, retain_graph=True)
    assert not context.released and "routed.gate_up" in saved_tensors(context), "retain_graph=True: the context must stay whole"
    first = x.grad.clone()
    out.backward(d_out)
    assert context.released and not {"routed.gate_up", "routed.h"} & set(saved_tensors(context))
    assert torch.equal(x.grad, first * 2), "the second backward must add the same d_x (doubling is exact in bf16)"


def test_backward_ops_schema_and_fake_impls(kernel_device):
    """The backward's custom ops declare their mutations and their fake impls give the real
    shapes and dtypes (what torch.compile and CUDA graphs rely on)."""
    from mok import ops
    from mok.kernels.gemm.common import routing_block_m

    T, H, I, E, topk = 9, 32, 16, 3, 2
    inp = make_inputs(T, H, I, E, topk, seed=1, device=kernel_device, signed_weights=True)
    block_m = routing_block_m()
    routing = ops.routing_schedule(inp.topk_ids, torch.zeros(1, dtype=torch.int32, device=kernel_device), E, block_m)
    gen = torch.Generator().manual_seed(0)
    rows = routing.capacity_rows
    h = torch.randn(rows, I, generator=gen).bfloat16().to(kernel_device)
    gate_up = torch.randn(rows, 2, I, generator=gen).bfloat16().to(kernel_device)
    d_out = torch.randn(T, H, generator=gen).bfloat16().to(kernel_device)
    zeros = lambda *shape: torch.zeros(*shape, device=kernel_device)  # noqa: E731
    sorted_rows = torch.randn(rows, H, generator=gen).bfloat16().to(kernel_device)
    cases = [
        (ops.gather_sorted_rows, (inp.x, d_out, inp.topk_weights, routing, topk)),
        (ops.gather_sorted_rows, (inp.x, d_out, None, routing, topk)),
        (ops.down_dgrad_swiglu, (sorted_rows, inp.topk_weights, gate_up, inp.w_down, routing, 0.5)),
        (ops.down_dgrad_swiglu, (sorted_rows, None, gate_up, inp.w_down, routing, None)),
        (ops.down_dgrad_swiglu, (sorted_rows, inp.topk_weights, gate_up, inp.w_down, routing, None, True)),
        (ops.gate_up_dgrad_scatter, (gate_up, inp.w_gate, inp.w_up, routing, T * topk)),
        (ops.down_wgrad, (sorted_rows, h, routing)),
        (ops.down_wgrad_accumulate, (zeros(E, H, I), sorted_rows, h, routing)),
        (ops.gate_up_wgrad, (gate_up, sorted_rows, routing)),
        (ops.gate_up_wgrad_accumulate, (zeros(E, I, H), zeros(E, I, H), gate_up, sorted_rows, routing)),
    ]
    for op, args in cases:
        # The schema check (declared mutations) reruns the op: only for the ops that mutate.
        checks = ("test_schema", "test_faketensor") if op in (ops.down_wgrad_accumulate, ops.gate_up_wgrad_accumulate) else ("test_faketensor",)
        torch.library.opcheck(op.op, op.op_args(*args), test_utils=checks)


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
@pytest.mark.parametrize("precision", ["fp8_block", "mxfp8"])
@pytest.mark.parametrize("preset", ["qwen3-30b", "deepseek-v3-slice", "mixtral-8x7b"])
def test_gpu_preset_low_precision_within_its_bar(preset, precision):
    """fp8_block and mxfp8 forward and backward on the GPU presets: the routed outputs and
    gradients within the low-precision accuracy bar, the shared expert's weight gradients within bf16's."""
    from mok.bench.presets import PRESETS

    p = PRESETS[preset]
    inp = make_inputs(p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk,
                      p.shared_intermediate_size, seed=1, device="cuda", signed_weights=True)
    d_out = torch.randn(p.num_tokens, p.hidden_size, device="cuda").bfloat16()
    config = mok.MoKConfig(precision=precision, backend="triton", strict=True)
    ws, sched, args = _functional(inp, config)
    out, ctx = mok.forward(config, ws, sched, *args)
    grads = mok.backward(config, ws, sched, ctx, d_out, *args)
    ref_args = (inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    assert_close_to_reference(out, reference.moe_forward(*ref_args), precision, name="out", context=preset,
                              check_cosine=True)
    for name, g, r in zip(grads._fields, grads, reference.moe_backward(d_out, *ref_args)):
        bar = "bf16" if name.startswith("d_ws_") else precision
        assert_close_to_reference(g, r, bar, name=name, context=preset, check_cosine=True)


@pytest.mark.gpu
def test_poison_free_memory_fills_what_the_allocator_hands_out_next():
    stale = torch.randn(3 << 20, device="cuda")  # a block the allocator keeps cached once freed
    del stale
    poison_free_memory(float("nan"))
    # all allocated before any is checked: the checks' own temporaries reuse freed memory
    fresh = {numel: torch.empty(numel, device="cuda") for numel in (3 << 20, 1000, 5 << 24, 10)}
    for numel, tensor in fresh.items():
        assert tensor.isnan().all(), f"{numel=}"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8_block", "mxfp8"])
def test_gpu_ten_steps_bitwise_identical(precision):
    """Forward and backward ten times on the same inputs: every output and gradient equal bit
    for bit to the first step's, with the allocator's free memory filled with NaN before some
    steps and with a large finite value before the others (a kernel that reads memory no one
    wrote would otherwise see the previous step's bytes, the same each time)."""
    inp = make_inputs(4096, 1024, 512, 32, 4, 256, seed=2, device="cuda", signed_weights=True)
    d_out = torch.randn(4096, 1024, device="cuda").bfloat16()
    config = mok.MoKConfig(precision=precision, backend="triton")
    ws, sched, args = _functional(inp, config)
    first = None
    for step in range(10):
        poison_free_memory(float("nan") if step % 2 else 3e38)
        out, ctx = mok.forward(config, ws, sched, *args)
        result = (out, *mok.backward(config, ws, sched, ctx, d_out, *args))
        if first is None:
            first = result
        for name, a, b in zip(("out", *reference.Gradients._fields), first, result):
            assert (a is None and b is None) or torch.equal(a, b), f"{name}: step {step} differs ({precision})"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8_block", "mxfp8"])
def test_gpu_backward_no_host_sync_and_cuda_graph(precision):
    """No host sync in a step (in fp8_block and mxfp8: with the weight copies cached), and a
    captured step replays bitwise; there the graph quantizes the weights itself, so a replay after
    an in-place update reads the updated weights."""
    inp = make_inputs(2048, 1024, 512, 32, 4, 256, seed=0, device="cuda", signed_weights=True)
    d_out = torch.randn(2048, 1024, device="cuda").bfloat16()
    config = mok.MoKConfig(precision=precision, backend="triton")
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
    graph, captured = capture_cuda_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(eager._fields, eager, captured):
        assert torch.equal(a, b), f"{name}: graph replay differs from eager"
    with torch.no_grad():
        inp.w_gate.mul_(0.5)  # an optimizer's in-place update
    updated = step()
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(updated._fields, updated, captured):
        assert torch.equal(a, b), f"{name}: replay after a weight update differs from eager ({precision})"
    assert not torch.equal(updated.d_x, eager.d_x)


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


# --------------------------------------------------------------------------- fp8_block and mxfp8

# No clamp in the comparisons with the reference: a swiglu_limit inside the bulk of g, u lets
# FP8 rounding flip clamp masks, and then the format itself misses the accuracy bars (so does the
# reference backend's fp8_block emulation, which rounds only x and the weights: d_x's cosine
# < 0.996 for a third of the seeds at L = 2). The clamp's fp8_block kernels are checked against
# the same quantized math (tests/kernels).


def _assert_low_precision_within_bars(precision, out, grads, inp, d_out, ctx, expect_empty=True):
    """out and every routed gradient within the accuracy bar for `precision` against the fp32 reference
    on the unquantized inputs, the shared expert's weight gradients (bf16 GEMMs on dOut and x)
    within bf16's; exact zeros for experts without tokens."""
    args = (inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    assert_close_to_reference(out, reference.moe_forward(*args), precision, name="out", context=ctx,
                              check_cosine=True)
    ref = reference.moe_backward(d_out, *args)
    for name, g, r in zip(ref._fields, grads, ref):
        if r is not None:
            expected_dtype = torch.float32 if name == "d_topk_weights" else torch.bfloat16
            assert g is not None and g.dtype == expected_dtype and g.device == d_out.device, f"{name} {ctx}"
        if name == "d_topk_weights" and inp.topk_ids.numel() < 4:
            _assert_router_gradient_within_bar(precision, g, inp, d_out, ctx)
        else:
            bar = "bf16" if name.startswith("d_ws_") else precision
            assert_close_to_reference(g, r, bar, name=name, context=ctx, check_cosine=True)
    empty = set(range(inp.w_gate.shape[0])) - set(inp.topk_ids.flatten().tolist())
    assert bool(empty) == expect_empty, f"the test wants {'' if expect_empty else 'no '}experts without tokens {ctx}"
    for e in empty:
        for name in ("d_w_gate", "d_w_up", "d_w_down"):
            grad = getattr(grads, name)[e]
            assert torch.equal(grad, torch.zeros_like(grad)), f"{name}[{e}] {ctx}"


def _assert_router_gradient_within_bar(precision, d_topk_weights, inp, d_out, ctx):
    """A handful of router-weight gradients: each is one dot product ⟨dOut[t], y⟩, whose own
    relative error is unbounded under cancellation, so the ratio of sums over so few values
    says nothing. Each error is held to the precision's bar relative to the dot's Σ|terms| instead,
    the scale on which a rounded dot product's error is bounded."""
    max_err = TOLERANCES[precision][0]
    num_tokens, topk = inp.topk_ids.shape
    for t in range(num_tokens):
        for j in range(topk):
            e = int(inp.topk_ids[t, j])
            y = reference.swiglu_mlp_forward(inp.x[t : t + 1], inp.w_gate[e], inp.w_up[e], inp.w_down[e]).y[0]  # [H]
            terms = (d_out[t].float() * y).cpu()
            err = (d_topk_weights[t, j].cpu() - terms.sum()).abs()
            assert err <= max_err * terms.abs().sum(), (
                f"d_topk_weights[{t}, {j}]: error {err:.3g} against Σ|terms| {terms.abs().sum():.3g} {ctx}"
            )


@pytest.mark.parametrize("precision", ["fp8_block", "mxfp8"])
def test_low_precision_layer_one_token_matches_reference(kernel_device, precision):
    """mok.moe (autograd) in a low precision on the triton backend: T = 1, topk = 1, a shared
    expert, experts without tokens."""
    T, H, I, E, topk, I_s = 1, 256, 128, 3, 1, 16
    inp = OddCase(T, H, I, E, topk, I_s).inputs(seed=1, device=kernel_device)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {I_s=}"
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).bfloat16().to(kernel_device)
    x, topk_weights, *weights = _leaves(inp)
    config = mok.MoKConfig(precision=precision, backend="triton")
    out = mok.moe(x, inp.topk_ids, topk_weights, *weights, config=config)
    out.backward(d_out)
    grads = reference.Gradients(x.grad, topk_weights.grad, *(None if w is None else w.grad for w in weights))
    _assert_low_precision_within_bars(precision, out, grads, inp, d_out, ctx)


@pytest.mark.parametrize(
    "case", [OddCase(13, 32, 32, 4, 4), OddCase(23, 32, 64, 4, 1, routing="one expert"), OddCase(37, 64, 96, 5, 2, 32)],
    ids=["topk = E", "all to one expert", "ragged T + shared"],
)
def test_mxfp8_layer_odd_cases_match_reference(kernel_device, case):
    """mxfp8 (sizes multiples of 32 only) on the forward's odd cases: every expert busy, one
    expert taking every token, T off every tile with a shared expert."""
    inp = case.inputs(seed=case.num_tokens, device=kernel_device)
    ctx = f"mxfp8 {case}"
    d_out = torch.randn(case.num_tokens, case.hidden_size, generator=torch.Generator().manual_seed(3))
    d_out = d_out.bfloat16().to(kernel_device)
    x, topk_weights, *weights = _leaves(inp)
    out = mok.moe(x, inp.topk_ids, topk_weights, *weights, config=mok.MoKConfig(precision="mxfp8", backend="triton"))
    out.backward(d_out)
    grads = reference.Gradients(x.grad, topk_weights.grad, *(None if w is None else w.grad for w in weights))
    _assert_low_precision_within_bars("mxfp8", out, grads, inp, d_out, ctx, expect_empty=case.routing == "one expert")
    with torch.no_grad():
        bf16_out = mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=mok.MoKConfig(backend="triton"))
    assert not torch.equal(out, bf16_out), f"mxfp8 must round the routed operands {ctx}"


# The op that makes each precision's weight copies, and how to compare two copies bit for bit.
_WEIGHT_COPY_OP = {"fp8_block": "quantize_fp8_block_weights", "mxfp8": "mxfp8_round"}


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class _RecordedLayer:
    """A small low-precision layer through the functional API (19 tokens, H = I = 128, 5
    experts, topk 2, no shared expert) whose routed weights' quantizations are recorded in
    `quantized` (`quantize` the op itself)."""

    def __init__(self, kernel_device, monkeypatch, precision, seed):
        T, H, I, E, topk = 19, 128, 128, 5, 2
        self.inp = inp = OddCase(T, H, I, E, topk, routing="few experts").inputs(seed=seed, device=kernel_device)
        self.ctx = f"{precision} {T=} {H=} {I=} {E=} {topk=}"
        self.d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).bfloat16().to(kernel_device)
        self.routed = (inp.w_gate, inp.w_up, inp.w_down)
        self.quantized = []
        self.quantize = quantize = getattr(ops, _WEIGHT_COPY_OP[precision])

        def recording(t, *args):  # mxfp8_round also rounds activations: record the weights only
            if any(t is w for w in self.routed):
                self.quantized.append(t)
            return quantize(t, *args)

        monkeypatch.setattr(ops, _WEIGHT_COPY_OP[precision], recording)
        self.config = mok.MoKConfig(precision=precision, backend="triton")
        self.ws = mok.get_workspace(self.config, None, device=inp.x.device, num_local_tokens=T, hidden_size=H,
                                    topk=topk)
        self.sched = mok.build_schedule(self.ws, self.config, inp.topk_ids, num_local_experts=E,
                                        has_shared_expert=False)
        self.args = (inp.x, inp.topk_weights, None, None, None, inp.w_gate, inp.w_up, inp.w_down)

    def forward(self, **kwargs):
        return mok.forward(self.config, self.ws, self.sched, *self.args, **kwargs)

    def backward(self, context, **kwargs):
        return mok.backward(self.config, self.ws, self.sched, context, self.d_out, *self.args, **kwargs)


@pytest.mark.parametrize("precision", ["fp8_block", "mxfp8"])
def test_low_precision_layer_run_twice_and_weight_cache(kernel_device, monkeypatch, precision):
    """Through the functional API, twice: bitwise run to run, within the bars against the
    reference, each routed weight quantized once per version (forward, backward and the second
    step share the copies); an in-place update (an optimizer step) then makes only that weight
    quantize again."""
    layer = _RecordedLayer(kernel_device, monkeypatch, precision, seed=9)
    inp, ctx, d_out, quantized, quantize, routed = (layer.inp, layer.ctx, layer.d_out, layer.quantized,
                                                    layer.quantize, layer.routed)

    def step():
        out, context = layer.forward()
        return out, layer.backward(context)

    (out, grads), (out_again, grads_again) = step(), step()
    assert torch.equal(out, out_again), f"out: run twice differs {ctx}"
    for name, a, b in zip(grads._fields, grads, grads_again):
        assert (a is None and b is None) or torch.equal(a, b), f"{name}: run twice differs {ctx}"
    assert [id(w) for w in quantized] == [id(inp.w_gate), id(inp.w_up), id(inp.w_down)], ctx
    mok.check_errors(layer.ws)
    _assert_low_precision_within_bars(precision, out, grads, inp, d_out, ctx)

    with torch.no_grad():
        inp.w_down.mul_(-1)  # an optimizer's in-place update: a new version of w_down
    copies = recipe(precision).prepare_weights(*routed)
    assert [id(w) for w in quantized[3:]] == [id(inp.w_down)], f"only the updated weight is quantized again {ctx}"
    want = quantize(inp.w_down, True, True) if precision == "mxfp8" else quantize(inp.w_down)
    for got, expected in zip(copies[2], want):
        assert torch.equal(_bits(got), _bits(expected)), ctx


def test_fp8_block_wgrads_requantize_the_forwards_copies(kernel_device, monkeypatch, set_plan):
    """fp8_block with the plan's `fp8_block_wgrads_requantize` (the default): the forward's
    context holds x's and h's e4m3 copies and the backward takes them out; against the flag off,
    out, d_x and d_topk_weights are bitwise the same and every routed weight gradient differs
    (their operands are quantized twice), both ways within the accuracy bars."""
    layer = _RecordedLayer(kernel_device, monkeypatch, "fp8_block", seed=4)
    copies = {"routed.x_q", "routed.x_scale", "routed.h_q", "routed.h_scale"}
    out, context = layer.forward()
    assert copies <= set(saved_tensors(context)), f"{set(saved_tensors(context))} {layer.ctx}"
    grads = layer.backward(context, release_context=True)
    assert not copies & set(saved_tensors(context)), f"the backward leaves {set(saved_tensors(context))} {layer.ctx}"
    set_plan(fp8_block_wgrads_requantize=False)
    out_off, context_off = layer.forward()
    assert not copies & set(saved_tensors(context_off)), f"{set(saved_tensors(context_off))} {layer.ctx}"
    grads_off = layer.backward(context_off)
    assert torch.equal(out, out_off), layer.ctx
    for name in ("d_x", "d_topk_weights"):
        assert torch.equal(getattr(grads, name), getattr(grads_off, name)), f"{name} {layer.ctx}"
    for name in ("d_w_gate", "d_w_up", "d_w_down"):
        assert not torch.equal(getattr(grads, name), getattr(grads_off, name)), f"{name}: the same {layer.ctx}"
    for g in (grads, grads_off):
        _assert_low_precision_within_bars("fp8_block", out, g, layer.inp, layer.d_out, layer.ctx)


def test_fp8_block_gate_up_saved_in_e4m3(kernel_device, monkeypatch, set_plan):
    """fp8_block with the plan's `fp8_block_gate_up_e4m3` (off by default): the forward's context
    holds g, u in e4m3 with their 1×128 scales, half the bytes of bf16; against the flag off, out
    and d_w_down are bitwise the same (neither reads g, u), d_x, d_topk_weights and the gate/up
    weight gradients differ, both ways within the accuracy bars. With a swiglu_limit g, u stay bf16."""
    layer = _RecordedLayer(kernel_device, monkeypatch, "fp8_block", seed=14)
    set_plan(fp8_block_gate_up_e4m3=True)
    out, context = layer.forward()
    gate_up, gate_up_scale = context.saved.routed.gate_up, context.saved.routed.gate_up_scale
    rows, _, inter = gate_up.shape
    assert gate_up.dtype == torch.float8_e4m3fn and gate_up_scale.shape == (rows, 2, inter // 128), layer.ctx
    grads = layer.backward(context)
    set_plan(fp8_block_gate_up_e4m3=False)
    out_off, context_off = layer.forward()
    saved_off = context_off.saved.routed
    assert saved_off.gate_up.dtype == torch.bfloat16 and saved_off.gate_up_scale is None, layer.ctx
    assert saved_off.gate_up.nbytes == 2 * gate_up.nbytes, layer.ctx
    grads_off = layer.backward(context_off)
    assert torch.equal(out, out_off) and torch.equal(grads.d_w_down, grads_off.d_w_down), layer.ctx
    for name in ("d_x", "d_topk_weights", "d_w_gate", "d_w_up"):
        assert not torch.equal(getattr(grads, name), getattr(grads_off, name)), f"{name}: the same {layer.ctx}"
    for g in (grads, grads_off):
        _assert_low_precision_within_bars("fp8_block", out, g, layer.inp, layer.d_out, layer.ctx)
    set_plan(fp8_block_gate_up_e4m3=True)
    _, context_limit = layer.forward(swiglu_limit=0.5)
    saved_limit = context_limit.saved.routed
    assert saved_limit.gate_up.dtype == torch.bfloat16 and saved_limit.gate_up_scale is None, layer.ctx


def test_fp8_block_d_gate_up_quantized_in_the_epilogue(kernel_device, monkeypatch, set_plan):
    """fp8_block with the plan's `fp8_block_d_gate_up_quantized` (the default): against the flag
    off, d_x is bitwise the same (the gate/up dgrad reads the same bytes), d_topk_weights equal
    to fp32 rounding (its row sums in another order), d_w_down bitwise the same, and d_w_gate,
    d_w_up differ (d_gᵀ, d_uᵀ quantized twice), both ways within the accuracy bars."""
    layer = _RecordedLayer(kernel_device, monkeypatch, "fp8_block", seed=12)
    out, context = layer.forward()
    grads = layer.backward(context)
    set_plan(fp8_block_d_gate_up_quantized=False)
    grads_off = layer.backward(context)
    assert torch.equal(grads.d_x, grads_off.d_x) and torch.equal(grads.d_w_down, grads_off.d_w_down), layer.ctx
    torch.testing.assert_close(grads.d_topk_weights, grads_off.d_topk_weights, rtol=2.0**-16, atol=2.0**-20,
                               msg=lambda m: f"d_topk_weights {layer.ctx}: {m}")
    for name in ("d_w_gate", "d_w_up"):
        assert not torch.equal(getattr(grads, name), getattr(grads_off, name)), f"{name}: the same {layer.ctx}"
    for g in (grads, grads_off):
        _assert_low_precision_within_bars("fp8_block", out, g, layer.inp, layer.d_out, layer.ctx)


def test_fp8_block_sorted_outputs_are_bitwise_the_route_slots(kernel_device, monkeypatch, set_plan):
    """fp8_block with the plan's `fp8_block_sorted_outputs` (the default): the down GEMM and the
    gate/up dgrad leave y and dx in the sorted layout and the combines gather them by route_row.
    Against the flag off (route slots), out and every gradient are bitwise the same; the forward
    keeps route_row (the inverse of row_source) for the backward, which consumes it."""
    layer = _RecordedLayer(kernel_device, monkeypatch, "fp8_block", seed=13)
    out, context = layer.forward()
    route_row = context.saved.route_row
    slots = torch.arange(route_row.numel(), device=route_row.device, dtype=torch.int32)
    row_source = layer.sched.routing.row_source
    assert torch.equal(row_source[route_row.long()], slots), f"route_row is not row_source's inverse {layer.ctx}"
    grads = layer.backward(context, release_context=True)
    assert context.saved.route_row is None, f"the backward leaves {set(saved_tensors(context))} {layer.ctx}"
    set_plan(fp8_block_sorted_outputs=False)
    out_off, context_off = layer.forward()
    assert context_off.saved.route_row is None, layer.ctx
    grads_off = layer.backward(context_off)
    assert torch.equal(out, out_off), layer.ctx
    for name, g in grads._asdict().items():
        g_off = getattr(grads_off, name)
        assert (g is None and g_off is None) or torch.equal(g, g_off), f"{name} {layer.ctx}"
    _assert_low_precision_within_bars("fp8_block", out, grads, layer.inp, layer.d_out, layer.ctx)


@pytest.mark.parametrize("precision", ["fp8_block", "mxfp8"])
def test_backward_reads_the_forwards_weight_copies(kernel_device, monkeypatch, precision):
    """Where no copy is cached between forward and backward (a step captured in a CUDA graph or
    traced by torch.compile quantizes on every call; here the cache is emptied in between), the
    backward reads the copies the forward made: each routed weight quantized once per step, and
    the gradients bitwise those of a step that found them cached. A backward with
    release_context=True drops them with the activations."""
    layer = _RecordedLayer(kernel_device, monkeypatch, precision, seed=10)
    quantized, routed, ctx = layer.quantized, layer.routed, layer.ctx

    def step(cached: bool):
        precision_base._WEIGHT_COPY_CACHE.clear()
        quantized.clear()
        _, context = layer.forward()
        assert [id(w) for w in quantized] == [id(w) for w in routed], ctx
        if not cached:
            precision_base._WEIGHT_COPY_CACHE.clear()
        grads = layer.backward(context, release_context=True)
        assert [id(w) for w in quantized] == [id(w) for w in routed], f"the backward quantized again {ctx}"
        assert context.released and context.routed_weights == (), ctx
        return grads

    for name, a, b in zip(reference.Gradients._fields, step(cached=True), step(cached=False), strict=True):
        assert (a is None and b is None) or torch.equal(a, b), f"{name} {ctx}"


@pytest.mark.parametrize("precision", ["fp8_block", "mxfp8"])
def test_routed_weight_copies_are_fresh_and_the_layers_own(kernel_device, monkeypatch, precision):
    """`precision.routed_weight_copies` (what the benchmark times as a weight update's cost)
    quantizes every weight on each call, cache or not, into the same bits as the copies the
    layer's forward reads; a precision without copies is refused by name."""
    layer = _RecordedLayer(kernel_device, monkeypatch, precision, seed=11)
    _, context = layer.forward()
    layer.quantized.clear()
    copies = routed_weight_copies(layer.routed, precision)
    assert [id(w) for w in layer.quantized] == [id(w) for w in layer.routed], layer.ctx
    for fresh, used in zip(copies, context.routed_weights, strict=True):
        for a, b in zip(fresh, used, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), layer.ctx
    with pytest.raises(ValueError, match=r"^precision: expected one of \['fp8_block', 'mxfp8'\], got 'bf16'"):
        routed_weight_copies(layer.routed, "bf16")
