"""The single-process reference (`moe_forward`, `moe_backward`) checked three independent ways.

1. Forward against a per-token loop written plainly here, in fp64.
2. The hand-written backward against fp64 autograd through that loop.
3. The backward against fp64 central differences of that loop's loss, element by element.

The reference computes in fp32, so the fp64 comparisons allow fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from mok.reference import Gradients, moe_backward, moe_forward, swiglu_backward, swiglu_mlp_forward
from mok.testing import make_inputs, make_topk_ids, mismatch_report

ROUTED_GRADS = ("d_w_gate", "d_w_up", "d_w_down")
SHARED_GRADS = ("d_ws_gate", "d_ws_up", "d_ws_down")
INPUT_OF_GRAD = {  # gradient field -> the argument it differentiates (MoEInputs field)
    "d_x": "x",
    "d_topk_weights": "topk_weights",
    "d_w_gate": "w_gate",
    "d_w_up": "w_up",
    "d_w_down": "w_down",
    "d_ws_gate": "ws_gate",
    "d_ws_up": "ws_up",
    "d_ws_down": "ws_down",
}


@dataclass(frozen=True)
class Case:
    name: str
    T: int = 6
    H: int = 16
    I: int = 8  # noqa: E741 -- the layer's name for the expert intermediate size
    E: int = 4
    topk: int = 2
    shared: int = 0  # I_s
    signed: bool = False
    swiglu_limit: float | None = None
    empty_expert: int | None = None  # route no token to this expert

    def __str__(self) -> str:
        return (
            f"case={self.name} T={self.T} H={self.H} I={self.I} E={self.E} topk={self.topk} "
            f"I_s={self.shared} signed={self.signed} swiglu_limit={self.swiglu_limit}"
        )


CASES = [
    Case("plain"),
    Case("shared", shared=8),
    Case("swiglu_limit", shared=8, swiglu_limit=0.5),
    Case("signed", shared=8, signed=True),
    Case("topk1", topk=1, signed=True),
    Case("topk=E", E=3, topk=3, shared=8),
    Case("empty_expert", E=5, topk=2, empty_expert=2, signed=True),
]


def _inputs(case: Case, seed: int = 0):
    ids = None
    if case.empty_expert is not None:
        gen = torch.Generator().manual_seed(seed + 1)
        others = torch.tensor([e for e in range(case.E) if e != case.empty_expert])
        ids = others[make_topk_ids(case.T, case.E - 1, case.topk, gen)]
    inp = make_inputs(
        case.T, case.H, case.I, case.E, case.topk, case.shared, seed=seed, signed_weights=case.signed, topk_ids=ids
    )
    d_out = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(seed + 2))
    return inp, d_out


def _fp64(inp) -> dict[str, torch.Tensor | None]:
    """The float inputs as fp64 leaves that require grad (None stays None)."""
    out = {}
    for name in INPUT_OF_GRAD.values():
        t = getattr(inp, name)
        out[name] = None if t is None else t.double().requires_grad_(True)
    return out


def plain_moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None, limit=None):
    """out[t] = y_shared(x_t) + Σ_j w[t,j]·y_{e(t,j)}(x_t), one token and one route at a time."""

    def expert(xt, wg, wu, wd):  # xt [H]
        g, u = wg @ xt, wu @ xt  # [I]
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return wd @ (F.silu(g) * u)  # [H]

    rows = []
    for t in range(x.shape[0]):
        acc = expert(x[t], ws_gate, ws_up, ws_down) if ws_gate is not None else torch.zeros_like(x[t])
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            acc = acc + topk_weights[t, j] * expert(x[t], w_gate[e], w_up[e], w_down[e])
        rows.append(acc)
    return torch.stack(rows)  # [T, H]


def _plain_loss(case: Case, inp, d_out, leaves) -> torch.Tensor:
    """⟨d_out, out⟩ in fp64, whose gradient is the layer's backward for d_out."""
    out = plain_moe(
        leaves["x"], inp.topk_ids, leaves["topk_weights"], leaves["w_gate"], leaves["w_up"], leaves["w_down"],
        leaves["ws_gate"], leaves["ws_up"], leaves["ws_down"], limit=case.swiglu_limit,
    )  # fmt: skip
    return (out * d_out.double()).sum()


def _reference_grads(case: Case, inp, d_out) -> Gradients:
    return moe_backward(d_out, inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, swiglu_limit=case.swiglu_limit)


def _assert_close(actual, expected, name, ctx, rtol=1e-5, atol=1e-5):
    expected = expected.to(actual.dtype)
    if actual.shape != expected.shape or not torch.allclose(actual, expected, rtol=rtol, atol=atol):
        report = mismatch_report(actual, expected, name)
        raise AssertionError(f"{name} off by more than {rtol=} {atol=} {ctx}\n{report}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_matches_per_token_loop(case):
    inp, _ = _inputs(case)
    out = moe_forward(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, swiglu_limit=case.swiglu_limit)
    leaves = _fp64(inp)
    with torch.no_grad():
        expected = plain_moe(
            leaves["x"], inp.topk_ids, leaves["topk_weights"], leaves["w_gate"], leaves["w_up"], leaves["w_down"],
            leaves["ws_gate"], leaves["ws_up"], leaves["ws_down"], limit=case.swiglu_limit,
        )  # fmt: skip
    assert out.dtype == torch.float32, f"out dtype {out.dtype} {case}"
    _assert_close(out, expected, "out", case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_backward_matches_fp64_autograd(case):
    inp, d_out = _inputs(case)
    grads = _reference_grads(case, inp, d_out)
    leaves = _fp64(inp)
    _plain_loss(case, inp, d_out, leaves).backward()
    for field in Gradients._fields:
        leaf = leaves[INPUT_OF_GRAD[field]]
        actual = getattr(grads, field)
        if leaf is None:
            assert actual is None, f"{field} should be None without a shared expert {case}"
            continue
        assert actual.dtype == torch.float32, f"{field} dtype {actual.dtype} {case}"
        _assert_close(actual, leaf.grad, field, case)
    # Experts that got no token: exact zeros, not just small.
    routed = torch.bincount(inp.topk_ids.flatten(), minlength=case.E)
    if case.empty_expert is not None:
        assert routed[case.empty_expert] == 0, f"case routed a token to expert {case.empty_expert} {case}"
    for e in torch.nonzero(routed == 0).flatten().tolist():
        for field in ROUTED_GRADS:
            assert (getattr(grads, field)[e] == 0).all(), f"{field}[{e}] not exactly 0 for an empty expert {case}"


def test_routed_x_feeds_the_routed_experts_only():
    """With routed_x, the routed experts read it and the shared expert reads x; d_x sums the
    gradients of both (a rounding emulation passes the gradient straight through)."""
    case = Case("routed_x", shared=8, signed=True, swiglu_limit=0.8)
    inp, d_out = _inputs(case, seed=3)
    routed_x = inp.x.float() * 1.5 + 0.25  # [T, H] fp32, any rows differing from x
    out = moe_forward(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, swiglu_limit=0.8, routed_x=routed_x)
    grads = moe_backward(d_out, inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, swiglu_limit=0.8,
                         routed_x=routed_x)
    leaves = _fp64(inp)
    routed_leaf = routed_x.double().requires_grad_(True)
    no_routes = torch.zeros_like(leaves["topk_weights"])
    shared_part = plain_moe(leaves["x"], inp.topk_ids, no_routes, leaves["w_gate"], leaves["w_up"], leaves["w_down"],
                            leaves["ws_gate"], leaves["ws_up"], leaves["ws_down"], limit=0.8)
    routed_part = plain_moe(routed_leaf, inp.topk_ids, leaves["topk_weights"], leaves["w_gate"], leaves["w_up"],
                            leaves["w_down"], limit=0.8)
    expected = shared_part + routed_part
    (expected * d_out.double()).sum().backward()
    _assert_close(out, expected.detach(), "out", case)
    _assert_close(grads.d_x, leaves["x"].grad + routed_leaf.grad, "d_x", case)
    for field in Gradients._fields[1:]:
        _assert_close(getattr(grads, field), leaves[INPUT_OF_GRAD[field]].grad, field, case)
    with pytest.raises(ValueError, match=r"^routed_x: expected the shape of x \(6, 16\), got \(6, 8\)"):
        moe_forward(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, routed_x=routed_x[:, :8])


def test_router_weight_gradient_exact_for_any_sign():
    """d_topk_weights[t,j] = ⟨dOut[t], y_{e(t,j)}(x_t)⟩ also where w < 0 or w == 0 (no division by w)."""
    case = Case("signed", T=8, E=4, topk=3, shared=8, signed=True)
    inp, d_out = _inputs(case)
    inp.topk_weights[0, 1] = 0.0  # make_inputs returns a fresh tensor: safe to edit
    assert (inp.topk_weights < 0).any(), f"no negative router weight to test {case}"
    grads = _reference_grads(case, inp, d_out)
    x = inp.x.double()
    expected = torch.empty(case.T, case.topk, dtype=torch.float64)
    for t in range(case.T):
        for j in range(case.topk):
            e = int(inp.topk_ids[t, j])
            g, u = inp.w_gate[e].double() @ x[t], inp.w_up[e].double() @ x[t]
            expected[t, j] = d_out[t].double() @ (inp.w_down[e].double() @ (F.silu(g) * u))
    _assert_close(grads.d_topk_weights, expected, "d_topk_weights", case)
    assert (grads.d_topk_weights[inp.topk_weights <= 0] != 0).all(), f"zero router grad where w ≤ 0 {case}"


def test_swiglu_limit_zero_gradient_where_clamped():
    """With one token on one expert, a weight row gets exactly zero gradient iff its clamp was active."""
    L = 0.3
    case = Case("clamp", T=1, H=16, I=16, E=2, topk=1, shared=16, swiglu_limit=L)
    inp, d_out = _inputs(case, seed=3)
    grads = _reference_grads(case, inp, d_out)
    e = int(inp.topk_ids[0, 0])
    experts = {
        f"routed expert {e}": (inp.w_gate[e], inp.w_up[e], inp.w_down[e], grads.d_w_gate[e], grads.d_w_up[e]),
        "shared expert": (inp.ws_gate, inp.ws_up, inp.ws_down, grads.d_ws_gate, grads.d_ws_up),
    }
    for label, (wg, wu, wd, d_wg, d_wu) in experts.items():
        acts = swiglu_mlp_forward(inp.x, wg, wu, wd, L)
        gate_clamped, up_clamped = acts.gate[0] > L, acts.up[0].abs() > L  # [I]
        for name, clamped in (("gate", gate_clamped), ("up", up_clamped)):
            assert clamped.any() and not clamped.all(), f"{label}: want some but not all {name} clamps active {case}"
        ctx = f"{label} {case}"
        assert (d_wg[gate_clamped] == 0).all(), f"d_w_gate rows of clamped gates not zero, {ctx}"
        assert (d_wu[up_clamped] == 0).all(), f"d_w_up rows of clamped ups not zero, {ctx}"
        # An unclamped row is zero only if the other factor is: silu(min(g, L)) for up, clamp(u) for gate.
        assert (d_wg[~gate_clamped & ~up_clamped].abs().sum(-1) > 0).all(), f"d_w_gate rows unexpectedly zero, {ctx}"
        assert (d_wu[~up_clamped].abs().sum(-1) > 0).all(), f"d_w_up rows unexpectedly zero, {ctx}"
        # The same at the level of swiglu_backward.
        d_gate, d_up = swiglu_backward(torch.ones_like(acts.gate), acts.gate, acts.up, L)
        assert (d_gate[0, gate_clamped] == 0).all() and (d_up[0, up_clamped] == 0).all(), f"swiglu_backward {ctx}"
    assert (grads.d_w_gate[1 - e] == 0).all(), f"expert {1 - e} got no token but a nonzero gradient {case}"


@pytest.mark.parametrize(
    "case",
    [
        Case("fd_shared_signed", T=4, E=3, shared=8, signed=True),
        Case("fd_swiglu_limit", T=4, E=3, shared=8, swiglu_limit=0.5),
    ],
    ids=lambda c: c.name,
)
def test_backward_matches_finite_differences(case):
    """fp64 central differences of ⟨d_out, plain_moe⟩ on a few random elements of every input."""
    inp, d_out = _inputs(case, seed=5)
    grads = _reference_grads(case, inp, d_out)
    leaves = {k: (None if v is None else v.detach()) for k, v in _fp64(inp).items()}
    gen = torch.Generator().manual_seed(11)
    eps = 1e-6
    for field in Gradients._fields:
        name = INPUT_OF_GRAD[field]
        base = leaves[name]
        for flat in torch.randint(base.numel(), (3,), generator=gen).tolist():
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), base.shape))
            loss = []
            for step in (eps, -eps):
                bumped = dict(leaves)
                bumped[name] = base.clone()
                bumped[name][idx] += step
                loss.append(_plain_loss(case, inp, d_out, bumped).item())
            fd = (loss[0] - loss[1]) / (2 * eps)
            an = getattr(grads, field)[idx].item()
            assert abs(an - fd) <= 1e-3 * abs(fd) + 1e-5, f"{field}{list(idx)}: analytic {an:.8g} fd {fd:.8g} {case}"
