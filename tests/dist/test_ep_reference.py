"""The expert-parallel reference (`ep_moe_forward/backward`) against the single-process one.

Every case builds the global inputs from one seed on every rank (P·T tokens, E experts),
gives rank r tokens [r·T, (r+1)·T) and experts [r·E_l, (r+1)·E_l), and compares what the
EP reference returns with the rows / expert slices of `moe_forward` / `moe_backward` on the
global inputs; the replicated shared expert's gradients with the reference on this rank's
tokens alone. fp32 on both sides, so the tolerance is tight.

One spawn of 4 gloo processes serves every P (starting a process costs seconds of torch
import on CI): P = 4 runs on WORLD, P = 3 on ranks {1, 2, 3} and P = 2 on ranks {0, 2}, so
the group rank differs from the global rank, as the `group` argument allows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from mok.reference import ep_moe_backward, ep_moe_forward, moe_backward, moe_forward
from mok.testing import make_inputs, make_topk_ids, mismatch_report
from mok.testing.distributed import run_distributed

WORLD_SIZE = 4
GROUP_RANKS = {4: None, 3: [1, 2, 3], 2: [0, 2]}  # P -> global ranks of its group (None = WORLD)
GRAD_NAMES = ("d_w_gate", "d_w_up", "d_w_down")
SHARED_GRAD_NAMES = ("d_ws_gate", "d_ws_up", "d_ws_down")


@dataclass(frozen=True)
class Case:
    name: str
    experts_per_rank: int  # E_l; E = E_l * P
    topk: int
    shared_size: int = 16  # I_s, 0 = no shared expert
    signed_weights: bool = False
    swiglu_limit: float | None = None
    empty_experts: bool = False  # route nothing to the last rank's experts nor to expert 1
    skew: float = 0.0  # > 0: most routes go to the first rank's experts
    int32_ids: bool = False  # topk_ids may be int32 or int64
    tokens_per_rank: int = 8  # T
    hidden: int = 32  # H
    inter: int = 16  # I


CASES = (
    Case("softmax+shared", experts_per_rank=2, topk=2),
    Case("signed_weights", experts_per_rank=3, topk=3, signed_weights=True),
    Case("swiglu_limit_no_shared", experts_per_rank=2, topk=2, shared_size=0, swiglu_limit=0.5),
    Case("empty_experts", experts_per_rank=3, topk=2, signed_weights=True, empty_experts=True),
    Case("topk1_int32_ids", experts_per_rank=2, topk=1, tokens_per_rank=5, int32_ids=True),
    # topk > E_l: a token's row carries up to E_l routes to one rank, summed there
    Case("skewed_topk_over_local", experts_per_rank=2, topk=3, skew=4.0, signed_weights=True),
)


def _global_ids(case: Case, num_ranks: int, gen: torch.Generator) -> torch.Tensor | None:
    """Explicit ids for the empty-experts case (some experts and a whole rank get nothing)
    and the skewed one."""
    if case.skew:
        return make_topk_ids(case.tokens_per_rank * num_ranks, case.experts_per_rank * num_ranks, case.topk, gen,
                             skew=case.skew)
    if not case.empty_experts:
        return None
    E_l = case.experts_per_rank
    allowed = torch.tensor([e for e in range(E_l * num_ranks) if e // E_l != num_ranks - 1 and e != 1])
    picks = make_topk_ids(case.tokens_per_rank * num_ranks, allowed.numel(), case.topk, gen)
    return allowed[picks]  # [P*T, topk]


def _check_case(case: Case, num_ranks: int, rank: int, group, seed: int) -> None:
    """Runs one case on this rank (a collective over `group`); AssertionError on a mismatch."""
    T, H, I, topk, E_l = case.tokens_per_rank, case.hidden, case.inter, case.topk, case.experts_per_rank
    P, E = num_ranks, case.experts_per_rank * num_ranks
    ctx = (
        f"case={case.name} {P=} group_rank={rank} {T=} {H=} {I=} {E=} {topk=} I_s={case.shared_size} "
        f"signed={case.signed_weights} swiglu_limit={case.swiglu_limit}"
    )
    gen = torch.Generator().manual_seed(seed)
    g = make_inputs(
        P * T, H, I, E, topk, case.shared_size,
        seed=seed, signed_weights=case.signed_weights, topk_ids=_global_ids(case, P, gen),
    )  # fmt: skip
    d_out = torch.randn(P * T, H, generator=gen)
    tok, exp = slice(rank * T, (rank + 1) * T), slice(rank * E_l, (rank + 1) * E_l)
    shared = g.weights[3:]
    ids = g.topk_ids[tok].to(torch.int32 if case.int32_ids else torch.int64)
    local = (g.x[tok], ids, g.topk_weights[tok], g.w_gate[exp], g.w_up[exp], g.w_down[exp], *shared)
    out = ep_moe_forward(*local, swiglu_limit=case.swiglu_limit, group=group)
    grads = ep_moe_backward(d_out[tok], *local, swiglu_limit=case.swiglu_limit, group=group)
    out_again = ep_moe_forward(*local, swiglu_limit=case.swiglu_limit, group=group)

    def close(actual, expected, name):
        # Not torch.testing.assert_close: its first call imports DTensor, seconds per process.
        if actual.shape != expected.shape or not torch.allclose(actual, expected, rtol=1e-5, atol=1e-5):
            report = mismatch_report(actual, expected, name)
            raise AssertionError(f"{name} off by more than rtol=atol=1e-5 {ctx}\n{report}")

    ref_out = moe_forward(g.x, g.topk_ids, g.topk_weights, *g.weights, swiglu_limit=case.swiglu_limit)
    ref = moe_backward(d_out, g.x, g.topk_ids, g.topk_weights, *g.weights, swiglu_limit=case.swiglu_limit)
    # The shared expert is replicated: this rank's gradient is the one of its own tokens.
    ref_local = moe_backward(
        d_out[tok], g.x[tok], g.topk_ids[tok], g.topk_weights[tok], *g.weights, swiglu_limit=case.swiglu_limit
    )
    assert torch.equal(out, out_again), f"ep_moe_forward not bitwise reproducible {ctx}"
    close(out, ref_out[tok], "out")
    close(grads.d_x, ref.d_x[tok], "d_x")
    close(grads.d_topk_weights, ref.d_topk_weights[tok], "d_topk_weights")
    for name in GRAD_NAMES:
        close(getattr(grads, name), getattr(ref, name)[exp], name)
    for name in SHARED_GRAD_NAMES:
        if case.shared_size:
            close(getattr(grads, name), getattr(ref_local, name), name)
        else:
            assert getattr(grads, name) is None, f"{name} should be None without a shared expert {ctx}"
    # Experts that got no token: exact zeros.
    routed = torch.bincount(g.topk_ids.flatten(), minlength=E)[exp]
    for e in torch.nonzero(routed == 0).flatten().tolist():
        for name in GRAD_NAMES:
            assert (getattr(grads, name)[e] == 0).all(), f"{name}[{e}] not exactly 0 for an expert with no rows {ctx}"
    if case.empty_experts and rank in (0, P - 1):  # expert 1 lives on rank 0; rank P-1 gets no rows
        assert (routed == 0).any(), f"the case routed rows to every expert {ctx}"


def _check_bad_ids(num_ranks: int, rank: int, group) -> None:
    """An id ≥ E_l·P on group rank 0 only: every rank raises a ValueError naming topk_ids."""
    g = make_inputs(4, 32, 16, 2 * num_ranks, 2, seed=7)
    ids = g.topk_ids.clone()
    if rank == 0:
        ids[1, 0] = 2 * num_ranks
    try:
        ep_moe_forward(g.x, ids, g.topk_weights, g.w_gate[:2], g.w_up[:2], g.w_down[:2], group=group)
    except ValueError as err:
        assert "topk_ids" in str(err), f"ValueError does not name topk_ids: {err}"
    else:
        raise AssertionError(f"ep_moe_forward accepted out-of-range expert ids, P={num_ranks} group_rank={rank}")


def _ep_worker(rank: int, world_size: int) -> dict[int, list[str]]:
    """Every case for every P this rank belongs to; returns P -> mismatch reports (empty = pass)."""
    groups = {P: dist.new_group(ranks) if ranks else None for P, ranks in GROUP_RANKS.items()}  # all ranks, same order
    failures: dict[int, list[str]] = {P: [] for P in GROUP_RANKS}
    for P, ranks in GROUP_RANKS.items():
        if ranks is not None and rank not in ranks:
            continue
        group_rank = dist.get_rank(groups[P])
        for i, case in enumerate(CASES):
            try:
                _check_case(case, P, group_rank, groups[P], seed=100 * P + i)
            except AssertionError as err:  # a local comparison: the collectives already completed
                failures[P].append(str(err))
        try:
            _check_bad_ids(P, group_rank, groups[P])
        except AssertionError as err:
            failures[P].append(str(err))
    return failures


@pytest.fixture(scope="module")
def ep_failures() -> list[dict[int, list[str]]]:
    return run_distributed(_ep_worker, WORLD_SIZE, timeout_s=300)


@pytest.mark.parametrize("P", sorted(GROUP_RANKS))
def test_ep_reference_matches_single_process(ep_failures, P):
    reports = [f"[global rank {r}] {msg}" for r, by_p in enumerate(ep_failures) for msg in by_p[P]]
    assert not reports, f"{len(reports)} mismatch(es) at {P=}:\n" + "\n\n".join(reports)


def _fail_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 waits on the failed peer: must not hang the parent
    return rank


def test_run_distributed_reports_child_failure():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom from rank 1") as info:
        run_distributed(_fail_on_rank_1, 2, timeout_s=120)
    assert "rank 1" in str(info.value) and "ValueError" in str(info.value), str(info.value)
    assert time.monotonic() - start < 100, "run_distributed waited for the timeout instead of the failure"


def _hang_on_rank_0(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(600)
    return rank


def test_run_distributed_times_out_on_a_hung_rank():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) failed: \[0") as info:
        run_distributed(_hang_on_rank_0, 2, timeout_s=5)
    assert "no report within timeout_s=5" in str(info.value), str(info.value)
    assert time.monotonic() - start < 60, "run_distributed overran its timeout"
