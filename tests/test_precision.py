"""The precision recipes on their own: the lookup, each recipe's forward, backward_data and
backward_weights on one schedule against the fp32 reference at its precision's accuracy bar, and
the rule that the shared flow in `mok/functional.py` never branches on a precision."""

import ast
from pathlib import Path

import pytest
import torch

import mok.functional
from mok import ops, reference
from mok.config import PRECISIONS
from mok.kernels.gemm.common import routing_block_m
from mok.precision import recipe
from mok.testing import assert_close_to_reference, make_inputs


def test_recipe_lookup():
    assert sorted(recipe(name).name for name in PRECISIONS) == sorted(PRECISIONS)
    with pytest.raises(ValueError, match=r"^precision: expected one of \['bf16', 'fp8_block', 'mxfp8'\], got 'fp16'"):
        recipe("fp16")


@pytest.mark.parametrize("main_grads", [False, True], ids=["fresh", "main_grads"])
@pytest.mark.parametrize(("precision", "hidden", "inter"), [
    ("bf16", 64, 32),  # I < H: the down wgrad reads the down dgrad's w·h
    ("bf16", 32, 64),
    ("mxfp8", 64, 96),
    ("fp8_block", 128, 256),
])
def test_recipe_forward_and_backward_match_reference(kernel_device, precision, hidden, inter, main_grads):
    """One schedule of 45 tokens (odd, off every tile), 5 experts, topk 2, signed router weights:
    y combined into out, dx summed over the routes, the router-weight and weight gradients, each
    within the precision's bar; backward_data takes every saved tensor, and with `main_grads`
    backward_weights adds into the buffers and returns them."""
    T, E, topk = 45, 5, 2
    inp = make_inputs(T, hidden, inter, E, topk, seed=hidden + inter, device=kernel_device, signed_weights=True)
    d_out = torch.randn(T, hidden, generator=torch.Generator().manual_seed(inter)).bfloat16().to(kernel_device)
    ctx = f"{precision} {T=} H={hidden} I={inter} {E=} {topk=} {main_grads=}"
    r = recipe(precision)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    routing = ops.routing_schedule(inp.topk_ids, flag, E, routing_block_m())
    sorted_rows = r.sorted_outputs()
    route_row = routing.route_row if sorted_rows else None
    weights = r.prepare_weights(inp.w_gate, inp.w_up, inp.w_down)
    routed = (inp.x, inp.topk_ids, inp.topk_weights, inp.w_gate, inp.w_up, inp.w_down)

    y, saved = r.forward(inp.x, weights, routing, topk, T * topk, None, True, sorted_rows=sorted_rows)
    out = ops.combine(y, inp.topk_weights, None, route_row)
    assert_close_to_reference(out, reference.moe_forward(*routed), precision, name="out", context=ctx,
                              check_cosine=True)

    dx, d_topk_weights, state = r.backward_data(d_out, inp.x, inp.topk_weights, weights, saved, routing, topk, T * topk,
                                                None, sorted_rows=sorted_rows)
    assert all(value is None for value in vars(saved).values()), f"backward_data left {vars(saved)} {ctx}"
    buffers = tuple(torch.zeros_like(w, dtype=torch.float32) for w in routed[3:]) if main_grads else (None,) * 3
    grads = r.backward_weights(state, buffers)
    if main_grads:
        assert all(g is b for g, b in zip(grads, buffers)), f"the buffers stand in the gradients' places {ctx}"
    d_x = ops.combine(dx, torch.ones(T, topk, device=kernel_device), None, route_row)
    ref = reference.moe_backward(d_out, *routed)
    for name, got in zip(ref._fields, (d_x, d_topk_weights, *grads)):
        assert_close_to_reference(got, getattr(ref, name), precision, name=name, context=ctx, check_cosine=True)


def _functional_tree() -> ast.Module:
    return ast.parse(Path(mok.functional.__file__).read_text())


def test_functional_has_no_precision_branch():
    """The shared flow names no precision's types, ops or plan fields, compares no precision to a
    name, and names a precision only to look its recipe up (the shared expert's bf16)."""
    tree = _functional_tree()
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    specific = sorted(n for n in names if any(p in n.lower() for p in ("mxfp8", "fp8_block", "fp8block")))
    assert not specific, f"mok/functional.py names precision-specific code: {specific}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in PRECISIONS:
            call = parents[node]
            assert isinstance(call, ast.Call) and getattr(call.func, "id", None) == "recipe", (
                f"mok/functional.py line {node.lineno}: {node.value!r} outside a recipe lookup")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            kinds = ast.unparse(node.args[1])
            assert "Weight" not in kinds and "Recipe" not in kinds, f"line {node.lineno}: isinstance(…, {kinds})"
