"""The triton backend under expert parallelism, through the NCCL-fallback transport (here
on gloo, kernels interpreted on the CPU), against the EP reference at the bf16 accuracy bars (the
mxfp8 and fp8_block cases at their bars).

Each rank draws its own tokens (a different count per rank), global expert ids and its
local experts from a seed; both sides get the same local inputs over the same group.
The same comparison on GPUs, through both transports, is in test_ep_gpu.py.

One spawn of W gloo processes serves two P: P = W on WORLD and P = ⌈W/2⌉ on the even ranks
{0, 2, ...}, so group ranks differ from global ranks. CI spawns W = 3 (P = 3 and 2): the
interpreter takes about 5 s per rank for one forward + backward. Larger groups run the same
checks with `MOK_EP_CPU_WORLD`, e.g. W = 8 for P = 8 and 4:

    MOK_EP_CPU_WORLD=8 TRITON_INTERPRET=1 pytest tests/dist/test_ep_nccl.py -k matches_ep_reference
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import mok
from mok.kernels.common import interpreting
from mok.kernels.plan import override
from mok.reference import ep_moe_backward, ep_moe_forward
from mok.testing import assert_close_to_reference, make_inputs, make_topk_ids
from mok.testing.distributed import run_distributed
from mok.transport import nccl
from mok.transport.common import own_tiles_split

WORLD_SIZE = int(os.environ.get("MOK_EP_CPU_WORLD", "3"))
GROUP_RANKS = {WORLD_SIZE: None, (WORLD_SIZE + 1) // 2: list(range(0, WORLD_SIZE, 2))}  # P -> its global ranks (None = WORLD)
H, I = 32, 16


@dataclass(frozen=True)
class Case:
    name: str
    experts_per_rank: int  # E_l
    topk: int
    shared_size: int = 16  # I_s, 0 = no shared expert
    routing: str = "random"  # "random" | "empty expert" (global expert 1 unused) | "one rank" (all to rank 1)
    #                          | "skewed" (most routes to rank 0's experts)
    swiglu_limit: float | None = None
    int32_ids: bool = False
    min_tokens: int = 6  # rank r brings min_tokens + r tokens
    precision: str = "bf16"
    hidden_size: int = H  # fp8_block needs multiples of 128, mxfp8 of 32
    intermediate_size: int = I


# Few cases, each covering several edges: the interpreter is slow. The clamp's masks are
# decided on the bf16-stored pre-activations, so a value within half a bf16 ulp of ±L
# flips against the fp32 reference, which on rows this small misses the bar by itself:
# L = 2.5 clamps a few values (pre-activations are about N(0, 1)) and leaves none that close.
CASES = (
    Case("shared + empty expert + clamp", experts_per_rank=2, topk=2, routing="empty expert", swiglu_limit=2.5),
    Case("all to one rank + topk 1", experts_per_rank=2, topk=1, shared_size=0, routing="one rank", int32_ids=True,
         min_tokens=3),
    Case("mxfp8 + shared", experts_per_rank=2, topk=2, precision="mxfp8", intermediate_size=32, min_tokens=8),
    # No clamp in low precision: FP8 rounding of g, u flips clamp masks (test_triton_backward.py).
    # 32+ tokens per rank: d_topk_weights' relative error is about 0.07 per draw in fp8_block
    # (0.065 on the full presets), and with 8 tokens single draws reached the bar of 0.1.
    Case("fp8_block + shared", experts_per_rank=2, topk=2, precision="fp8_block", hidden_size=128,
         intermediate_size=128, min_tokens=32),
    # topk > E_l: a row carries up to E_l routes to one rank, which sums them
    Case("skewed + topk over E_l", experts_per_rank=2, topk=3, shared_size=0, routing="skewed", min_tokens=8),
    # Enough own routes per expert for whole M tiles of them: with overlap_comm_sms the gate/up GEMM
    # runs those before the peers' rows land and the down GEMM after the peers' partial rows have
    # left (`own_tiles_split`), bitwise each GEMM over all at once.
    Case("own tiles first + shared", experts_per_rank=2, topk=2, min_tokens=120),
    Case("own tiles first + fp8_block", experts_per_rank=2, topk=2, shared_size=0, precision="fp8_block",
         hidden_size=128, intermediate_size=128, min_tokens=120),
)


def _local_inputs(case: Case, num_ranks: int, rank: int, seed: int):
    """This rank's inputs: its tokens with global ids, its E_l experts (sliced from E)."""
    E_l, topk = case.experts_per_rank, case.topk
    E = E_l * num_ranks
    T = case.min_tokens + rank
    gen = torch.Generator().manual_seed(seed)
    if case.routing == "empty expert":
        allowed = torch.tensor([e for e in range(E) if e != 1])
        ids = allowed[make_topk_ids(T, E - 1, topk, gen)]
    elif case.routing == "skewed":
        ids = make_topk_ids(T, E, topk, gen, skew=4.0)
    elif case.routing == "one rank":
        ids = make_topk_ids(T, E_l, topk, gen) + E_l
    else:
        ids = make_topk_ids(T, E, topk, gen)
    g = make_inputs(T, case.hidden_size, case.intermediate_size, E, topk, case.shared_size, seed=seed,
                    signed_weights=True, topk_ids=ids)
    experts = slice(rank * E_l, (rank + 1) * E_l)
    ids = g.topk_ids.to(torch.int32 if case.int32_ids else torch.int64)
    d_out = torch.randn(T, case.hidden_size, generator=gen).bfloat16()
    weights = (g.w_gate[experts].contiguous(), g.w_up[experts].contiguous(), g.w_down[experts].contiguous())
    return g.x, ids, g.topk_weights, weights, (g.ws_gate, g.ws_up, g.ws_down), d_out


@contextlib.contextmanager
def _count_peer_bytes(num_ranks: int):
    """[bytes]: what the transport's exchanges hand the other ranks (all blocks but the own)."""
    exchange, sent = nccl._start_exchange, [0]

    def counting_exchange(send, group, *args, **kwargs):
        sent[0] += send.numel() * send.element_size() // num_ranks * (num_ranks - 1)
        return exchange(send, group, *args, **kwargs)

    nccl._start_exchange = counting_exchange
    try:
        yield sent
    finally:
        nccl._start_exchange = exchange


def _run_triton(config, group, x, ids, topk_weights, routed, shared, d_out, swiglu_limit, spare_tokens=0):
    """(out, gradients, schedule, bytes sent to peers) of one forward + backward through the functional API,
    on a workspace sized for `spare_tokens` more tokens than x has (a larger capacity)."""
    ws = mok.get_workspace(config, group, device="cpu", num_local_tokens=x.shape[0] + spare_tokens,
                           hidden_size=x.shape[1], topk=ids.shape[1])
    with _count_peer_bytes(dist.get_world_size(group)) as peer_bytes:
        schedule = mok.build_schedule(ws, config, ids, num_local_experts=routed[0].shape[0],
                                      has_shared_expert=shared[0] is not None)
        args = (x, topk_weights, *shared, *routed)
        out, ctx = mok.forward(config, ws, schedule, *args, swiglu_limit)
        grads = mok.backward(config, ws, schedule, ctx, d_out, *args, swiglu_limit)
    mok.check_errors(ws)
    return out, grads, schedule, peer_bytes[0]


def _check_case(case: Case, num_ranks: int, rank: int, group, seed: int, run_twice: bool, overlap: bool) -> None:
    """Runs every collective first and compares afterwards, so a failed comparison on one
    rank cannot leave its peers waiting in a collective it skipped."""
    x, ids, topk_weights, routed, shared, d_out = _local_inputs(case, num_ranks, rank, seed)
    config = mok.MoKConfig(backend="triton", strict=True, precision=case.precision)
    # run twice, then on a larger capacity: all bitwise equal
    runs = [_run_triton(config, group, x, ids, topk_weights, routed, shared, d_out, case.swiglu_limit, spare)
            for spare in ((0, 0, 7) if run_twice else (0,))]
    # the exchanges beside the shared expert and the weight gradients, the GEMMs' own tiles beside
    # the peers' x rows and partial rows (on CPU in order): bitwise the same
    overlapped = dataclasses.replace(config, overlap_comm_sms=4, overlap_dispatch_sms=3, overlap_return_sms=5)
    overlap = _run_triton(overlapped, group, x, ids, topk_weights, routed, shared, d_out,
                          case.swiglu_limit) if overlap else None
    if case.precision == "fp8_block":  # quantized after the exchange instead of before: bitwise the same
        with override(fp8_block_on_the_wire=False):
            bf16_wire = _run_triton(config, group, x, ids, topk_weights, routed, shared, d_out, case.swiglu_limit)
    ref_args = (x, ids, topk_weights, *routed, *shared)
    ref_out = ep_moe_forward(*ref_args, swiglu_limit=case.swiglu_limit, group=group)
    ref = ep_moe_backward(d_out, *ref_args, swiglu_limit=case.swiglu_limit, group=group)

    ctx = (f"case={case.name!r} P={num_ranks} group_rank={rank} T={x.shape[0]} H={case.hidden_size} "
           f"I={case.intermediate_size} E_l={case.experts_per_rank} topk={case.topk} I_s={case.shared_size} "
           f"limit={case.swiglu_limit}")
    out, grads, schedule, peer_bytes = runs[0]
    assert schedule.dispatch is not None and schedule.dispatch.world_size == num_ranks, ctx
    # What the benchmark reports as bytes per rank and pass is what the exchanges moved.
    assert schedule.dispatch.peer_bytes(case.hidden_size, with_backward=True) == peer_bytes, f"{peer_bytes=} {ctx}"
    # Each token row goes once to each other rank holding one of its experts (counted here from the ids).
    reaches = torch.zeros(x.shape[0], num_ranks, dtype=torch.bool).scatter_(1, ids.long() // case.experts_per_rank, True)
    pairs = int(reaches.sum()) - int(reaches[:, rank].sum())
    assert schedule.dispatch.peer_rows() == pairs, f"{schedule.dispatch.peer_rows()=} {pairs=} {ctx}"
    assert out.dtype == torch.bfloat16, ctx
    assert_close_to_reference(out, ref_out, case.precision, name="out", context=ctx)
    for name, got, expected in zip(ref._fields, grads, ref):
        bar = "bf16" if name.startswith("d_ws_") else case.precision  # the shared expert stays bf16
        assert_close_to_reference(got, expected, bar, name=name, context=ctx, check_cosine=True)
    # Experts that got no row from any rank: exact zeros.
    for name in ("d_w_gate", "d_w_up", "d_w_down"):
        for e in range(case.experts_per_rank):
            if (getattr(ref, name)[e] == 0).all():
                assert (getattr(grads, name)[e] == 0).all(), f"{name}[{e}] not exactly 0 {ctx}"
    if case.precision == "fp8_block":
        assert schedule.dispatch.fp8_wire and not bf16_wire[2].dispatch.fp8_wire, ctx
        # the x and dOut exchanges moved H + H/32 bytes a row instead of 2·H (≤ 0.53×), the rest alike
        H_, C_ = case.hidden_size, schedule.dispatch.send_capacity
        saved = (num_ranks - 1) * C_ * 2 * (2 * H_ - (H_ + H_ // 32))
        assert bf16_wire[3] - peer_bytes == saved and (H_ + H_ // 32) <= 0.53 * 2 * H_, f"{peer_bytes=} {ctx}"
        assert torch.equal(out, bf16_wire[0]), f"out differs with x quantized after the exchange {ctx}"
        for name, a, b in zip(grads._fields, grads, bf16_wire[1]):
            assert (a is None and b is None) or torch.equal(a, b), f"{name} differs with fp8 off the wire {ctx}"
    again = [(how, run) for how, run in zip(("run to run", "with a larger capacity"), runs[1:])]
    if overlap is not None:
        assert overlap[3] == peer_bytes, f"the overlap moved {overlap[3]} bytes, not {peer_bytes} {ctx}"
        again.append(("with the overlaps (4, 3, 5)", overlap))
    # both launches of the split GEMMs have tiles (an expert gets about T·topk / (E_l·P) = 120 / P own
    # routes: whole 32-row tiles of them up to P = 3)
    if case.name.startswith("own tiles first") and num_ranks <= 3:
        dispatch, routing = schedule.dispatch, schedule.routing
        first, rest = own_tiles_split(routing, dispatch.rank, dispatch.send_capacity * dispatch.routes_per_row)
        tiles = int(routing.num_rows) // routing.block_m
        counts = [int((part.tile_expert[:tiles] >= 0).sum()) for part in (first, rest)]
        assert min(counts) > 0, f"own-only and other tiles: {counts} {ctx}"
    for how, (out_again, grads_again, *_) in again:
        assert torch.equal(out, out_again), f"out differs {how} {ctx}"
        for name, a, b in zip(grads._fields, grads, grads_again):
            assert (a is None and b is None) or torch.equal(a, b), f"{name} differs {how} {ctx}"


def _check_capacity_overflow(num_ranks: int, rank: int, group) -> None:
    """Every token to rank 0 (topk 1) with the capacity of an even split: the sources
    overflow and every rank raises (strict: in build_schedule; otherwise in check_errors),
    and the routes that were sent still give the reference's numbers (dropped ones
    contribute 0). Collectives first, comparisons after (as in `_check_case`)."""
    case = Case("overflow", experts_per_rank=2, topk=1, shared_size=0)
    x, _, topk_weights, routed, shared, _ = _local_inputs(case, num_ranks, rank, seed=5 + rank)
    ids = make_topk_ids(x.shape[0], 2, 1, torch.Generator().manual_seed(rank))  # experts 0, 1: rank 0
    strict = mok.MoKConfig(backend="triton", strict=True, schedule_capacity_multiplier=1.0)
    ws = mok.get_workspace(strict, group, device="cpu", num_local_tokens=x.shape[0], hidden_size=H, topk=1)
    strict_error = None
    try:
        mok.build_schedule(ws, strict, ids, num_local_experts=2, has_shared_expert=False)
    except mok.MoKError as err:
        strict_error = err
    lenient = mok.MoKConfig(backend="triton", schedule_capacity_multiplier=1.0)
    ws = mok.get_workspace(lenient, group, device="cpu", num_local_tokens=x.shape[0], hidden_size=H, topk=1)
    schedule = mok.build_schedule(ws, lenient, ids, num_local_experts=2, has_shared_expert=False)
    out, _ = mok.forward(lenient, ws, schedule, x, topk_weights, *shared, *routed, needs_backward=False)
    sent = (schedule.dispatch.route_place >= 0).view_as(topk_weights)
    ref_out = ep_moe_forward(x, ids, topk_weights * sent, *routed, *shared, group=group)

    ctx = f"overflow P={num_ranks} group_rank={rank} T={x.shape[0]} {H=} {I=}"
    assert strict_error is not None and "exceeded the schedule capacity" in str(strict_error), f"{strict_error=} {ctx}"
    with pytest.raises(mok.MoKError, match="exceeded the schedule capacity"):
        mok.check_errors(ws)
    assert not sent.all(), f"no route was dropped {ctx}"
    assert_close_to_reference(out, ref_out, name="out (routes sent)", context=ctx)


def _ep_worker(rank: int, world_size: int) -> dict[int, list[str]]:
    """Every case for every P this rank belongs to; returns P -> failure reports (empty = pass)."""
    # mok reads group=None as "no expert parallelism": WORLD is passed explicitly.
    groups = {P: dist.new_group(ranks) if ranks else dist.group.WORLD for P, ranks in GROUP_RANKS.items()}
    failures: dict[int, list[str]] = {P: [] for P in GROUP_RANKS}
    for P, ranks in GROUP_RANKS.items():
        if ranks is not None and rank not in ranks:
            continue
        group_rank = dist.get_rank(groups[P])
        checks = [lambda c=c, i=i: _check_case(c, P, group_rank, groups[P], seed=100 * P + 10 * i + group_rank,
                                               run_twice=i == 0 and P == WORLD_SIZE,
                                               overlap=(i == 0 or c.precision == "mxfp8" or c.shared_size == 0)
                                               and P == WORLD_SIZE or c.name.startswith("own tiles"))
                  for i, c in enumerate(CASES)]
        checks.append(lambda: _check_capacity_overflow(P, group_rank, groups[P]))
        for check in checks:
            try:
                check()
            except AssertionError as err:  # a local comparison: every rank ran the same collectives
                failures[P].append(str(err))
        mok.clear_workspace_cache()
    return failures


@pytest.fixture(scope="module")
def ep_failures() -> list[dict[int, list[str]]]:
    return run_distributed(_ep_worker, WORLD_SIZE, timeout_s=400 * max(1, WORLD_SIZE // 3))


@pytest.mark.skipif(not interpreting(), reason="the CPU ranks run the kernels under TRITON_INTERPRET=1")
@pytest.mark.parametrize("P", sorted(GROUP_RANKS))
def test_triton_ep_matches_ep_reference(ep_failures, P):
    reports = [f"[global rank {r}] {msg}" for r, by_p in enumerate(ep_failures) for msg in by_p[P]]
    assert not reports, f"{len(reports)} failure(s) at {P=}:\n" + "\n\n".join(reports)


def test_config_transport_is_validated():
    assert mok.MoKConfig().transport == "auto" and mok.MoKConfig(transport="nccl").transport == "nccl"
    with pytest.raises(ValueError, match=r"^transport: expected one of \('auto', 'symmetric', 'nccl'\), got 'nvshmem'"):
        mok.MoKConfig(transport="nvshmem")
    for bad in (0, -1.0, True, "30"):
        with pytest.raises(ValueError, match=r"^peer_timeout_s: expected a number of seconds"):
            mok.MoKConfig(peer_timeout_s=bad)


# --------------------------------------------------------------------------- P = 4: plan and row moves only


def _plan_worker(rank: int, world_size: int) -> list[str]:
    """The NCCL transport's plan and row moves at P = 4 (no GEMMs, so the interpreter stays
    quick): every token row reaches each rank holding one of its experts once, with its
    routes' weights, and comes back to its pair's row; the receiver's schedule places each
    received route under its expert, and inside each expert takes this rank's own tokens first,
    then the sources from rank + 1 on (received row p·C + c in ascending ((p − rank) mod P)·C + c)."""
    group = dist.group.WORLD
    E_l, topk, T = 2, 3, 5 + 2 * rank
    gen = torch.Generator().manual_seed(100 + rank)
    ids = make_topk_ids(T, E_l * world_size, topk, gen)
    x = torch.randn(T, H, generator=gen).bfloat16()
    weights = torch.randn(T, topk, generator=gen)
    config = mok.MoKConfig(backend="triton", transport="nccl")
    ws = mok.create_workspace(config, group, device="cpu", num_local_tokens=T, hidden_size=H, topk=topk)
    schedule = mok.build_schedule(ws, config, ids, num_local_experts=E_l)
    dispatch = schedule.dispatch
    k_l = dispatch.routes_per_row
    received, received_weights = dispatch.dispatch(x, weights)
    back = dispatch.combine(received)
    failures, ctx = [], f"P={world_size} {rank=} {T=} {E_l=} {topk=}"
    dest = ids // E_l
    pairs = [(t, p) for t in range(T) for p in range(world_size) if bool((dest[t] == p).any())]
    token_slot = dispatch.token_slot.view(T, world_size)
    if int((token_slot >= 0).sum()) != len(pairs):
        failures.append(f"{int((token_slot >= 0).sum())} (token, rank) rows for {len(pairs)} pairs {ctx}")
    for t, p in pairs:
        if not torch.equal(back[int(token_slot[t, p])], x[t]):
            failures.append(f"token {t}'s row to rank {p} did not come back to its row {ctx}")
    # the weights travel with their routes: sending the weights back by route gives them again
    d_weights = dispatch.combine_grad(received, received_weights)[1]
    if not torch.equal(d_weights, weights):
        failures.append(f"router weights did not travel with their routes {ctx}")
    if int(ws.error_flag) != 0:
        failures.append(f"error flag {int(ws.error_flag)} {ctx}")
    routing = schedule.routing
    row_source, tile_expert, expert_counts, route_row = (routing.row_source, routing.tile_expert,
                                                         routing.expert_counts, routing.route_row)
    capacity, block_m = dispatch.send_capacity, routing.block_m
    row_source = row_source[: int(routing.num_rows)]
    placed = (row_source >= 0).nonzero().flatten()
    if placed.numel() != int(expert_counts.sum()) or placed.numel() != int((dispatch.received_routes >= 0).sum()):
        failures.append(f"{placed.numel()} rows placed for {int(expert_counts.sum())} received routes {ctx}")
    inverse = torch.full((world_size * capacity * k_l,), -1, dtype=torch.int32)  # each received route's sorted row
    inverse[row_source[placed].long()] = placed.int()
    if not torch.equal(route_row, inverse):
        failures.append(f"route_row is not the inverse of row_source over the received routes {ctx}")
    for expert in range(E_l):
        rows = placed[tile_expert[placed // block_m] == expert]
        sources = row_source[rows].long() // k_l
        own_first = (sources // capacity - rank) % world_size * capacity + sources % capacity
        if not bool((own_first[1:] > own_first[:-1]).all()):
            failures.append(f"expert {expert}'s rows are not in own-first source order {ctx}")
    return failures


@pytest.mark.skipif(not interpreting(), reason="the CPU ranks run the kernels under TRITON_INTERPRET=1")
def test_nccl_transport_plan_and_row_moves_at_four_ranks():
    failures = run_distributed(_plan_worker, 4, timeout_s=300)
    reports = [f"[rank {r}] {msg}" for r, msgs in enumerate(failures) for msg in msgs]
    assert not reports, "\n".join(reports)
