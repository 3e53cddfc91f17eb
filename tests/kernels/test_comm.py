"""Peer-pointer row pushes and the bounded arrival wait (`mok/kernels/comm/push.py`), as the
symmetric transport uses them.

P ranks are simulated in one process: each "rank" owns plain tensors standing in for its
symmetric-memory regions, and the peer-pointer tables hold their addresses (the kernels
only see addresses, so they cannot tell). Receive buffers are poisoned with NaN, so a
row written where it should not be, or left out, shows. The multi-GPU run of the whole
transport is in tests/dist/test_ep_symmetric.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mok.kernels.comm.push import push_rows, wait_arrivals
from mok.kernels.common import ERROR_CAPACITY_OVERFLOW, ERROR_PEER_TIMEOUT, num_sms, sms_left_free
from mok.kernels.gemm.common import routing_block_m
from mok.testing import make_topk_ids
from mok.transport.common import token_plan, token_receiver_schedule
from mok.transport.symmetric import SymmetricDispatch

KINDS = 3  # 0: dispatch, 1: return, 2: never pushed


def _peer_ptrs(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=tensors[0].device)


def _symmetric_dispatch(rank: int, P: int, C: int, topk: int, k_l: int, plans, flags, block_m: int):
    """The symmetric transport's dispatch of `rank`, its receiver side built from every
    source's sent ids as the plan's exchange would deliver them (no symmetric memory: the
    dispatch only reads the transport's rank and size here)."""
    recv_ids = torch.stack([torch.cat([plans[src][2].view(P, C * k_l)[rank].cpu(), flags[src].cpu()])
                            for src in range(P)]).to(flags[rank].device)  # [P, C·k_l + 1]
    _, received_routes = token_receiver_schedule(recv_ids, flags[rank], k_l, k_l, block_m, rank)
    stub = SimpleNamespace(world_size=P, rank=rank)
    token_slot, route_place, _ = plans[rank]
    return SymmetricDispatch(stub, C, topk, k_l, token_slot, route_place, received_routes)


@pytest.mark.parametrize("P, E_l, topk, C, H, num_programs, overflows, own_first",
                         [(3, 2, 3, 5, 40, 2, True, False), (2, 3, 2, 30, 1100, 1, False, False),
                          (3, 2, 3, 5, 40, 2, True, True)])
def test_push_rows_once_per_token_and_rank_out_and_back(kernel_device, P, E_l, topk, C, H, num_programs, overflows,
                                                        own_first):
    """The symmetric transport's moves, P ranks in one process: each token row lands once at
    every rank holding one of its experts (BY_SLOT, the pair's send row as the slot), its
    routes' router weights beside it; each received row's partial row and each received
    route's value come back to the source's row / route (BY_RETURN), nothing else is written.
    `own_first`: the token rows go as a push to "self" (checked alone: only each rank's own rows
    landed), then one to "peers", with the same programs: received as one push; the partial rows
    back the other way round, "peers" first."""
    ctx = f"{P=} {E_l=} {topk=} {C=} {H=} {num_programs=} {own_first=}"
    gen = torch.Generator().manual_seed(P * C + H)
    tokens = [9 + 3 * r for r in range(P)]  # T differs per rank
    k_l = min(topk, E_l)
    dev = kernel_device
    nan = float("nan")
    recv_x = [torch.full((P * C, H), nan, dtype=torch.bfloat16, device=dev) for _ in range(P)]
    recv_w = [torch.full((P * C * k_l,), nan, device=dev) for _ in range(P)]
    parts = [torch.full((P * C, H), nan, dtype=torch.bfloat16, device=dev) for _ in range(P)]
    d_w = [torch.full((P * C * k_l,), nan, device=dev) for _ in range(P)]
    arrivals = [torch.zeros(KINDS, P, dtype=torch.int32, device=dev) for _ in range(P)]
    expected = [torch.zeros(KINDS, P, dtype=torch.int32, device=dev) for _ in range(P)]
    flags = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(P)]
    arrival_ptrs = _peer_ptrs(arrivals)

    x, w, ids, plans = [], [], [], []
    for rank in range(P):
        ids.append(make_topk_ids(tokens[rank], E_l * P, topk, gen))
        plans.append(token_plan(ids[rank].to(dev), E_l, P, C, flags[rank]))
        x.append(torch.randn(tokens[rank], H, generator=gen).bfloat16().to(dev))
        w.append(torch.randn(tokens[rank], topk, generator=gen).to(dev))
    assert any(int(f) == ERROR_CAPACITY_OVERFLOW for f in flags) == overflows, ctx
    for flag in flags:
        flag.zero_()
    dispatches = [_symmetric_dispatch(r, P, C, topk, k_l, plans, flags, routing_block_m()) for r in range(P)]

    def push(rank, src, index, dst, kind, by_slot, capacity, routes_per_row=1, destinations="all"):
        push_rows(src, index, _peer_ptrs(dst), dst[0].stride(0) if dst[0].dim() == 2 else 1, arrival_ptrs, kind,
                  flags[rank], num_dst_rows=dst[0].shape[0], my_rank=rank, capacity=capacity, by_slot=by_slot,
                  num_programs=num_programs, routes_per_row=routes_per_row, destinations=destinations)

    def wait_all(kind):
        for rank in range(P):
            wait_arrivals(arrivals[rank], expected[rank], flags[rank], kind, 2 * num_programs, timeout_s=5.0)
            assert int(flags[rank]) & ERROR_PEER_TIMEOUT == 0, ctx

    # out: token rows once per (token, rank), router weights per route
    if own_first:
        for rank, d in enumerate(dispatches):
            push(rank, x[rank], d.token_slot, recv_x, 0, True, C, routes_per_row=P, destinations="self")
        for p in range(P):
            sources = torch.arange(P * C, device=dev) // C
            assert recv_x[p][sources != p].isnan().all(), f"{ctx} {p=}: a peer's row landed from a self push"
            own = dispatches[p].token_slot.view(-1, P)[:, p].long()
            own = own[own >= 0]
            assert not recv_x[p][p * C + own % C].isnan().any(), f"{ctx} {p=}: own rows missing after the self push"
        assert all(int(a.sum()) == num_programs for a in arrivals), f"{ctx}: a self push signalled another rank"
    for rank, d in enumerate(dispatches):
        push(rank, x[rank], d.token_slot, recv_x, 0, True, C, routes_per_row=P,
             destinations="peers" if own_first else "all")
        push(rank, w[rank].view(-1, 1), d.route_place, recv_w, 0, True, C * k_l)
    wait_all(0)
    for src in range(P):
        dest = ids[src] // E_l  # [T, topk]
        for t in range(tokens[src]):
            for p in range(P):
                slot = int(dispatches[src].token_slot[t * P + p])
                assert (slot >= 0) == bool((dest[t] == p).any()) or overflows, f"{ctx} {src=} {t=} {p=}"
                if slot < 0:
                    continue
                row = src * C + slot % C
                assert slot // C == p and torch.equal(recv_x[p][row].cpu(), x[src][t].cpu()), f"{ctx} {src=} {t=}"
                local = [j for j in range(topk) if int(dest[t, j]) == p]
                got = recv_w[p][row * k_l: row * k_l + len(local)].cpu()
                assert torch.equal(got, w[src][t, local].cpu()), f"{ctx} {src=} {t=} {p=}: weights"
    for p in range(P):  # rows and routes no source filled stay untouched
        filled = (dispatches[p].return_row >= 0).cpu()
        assert recv_x[p][~filled.to(dev)].isnan().all(), f"{ctx} {p=}"
        assert recv_w[p][(dispatches[p].received_routes < 0)].isnan().all(), f"{ctx} {p=}"

    # back: each received row's partial row to its pair's row, each received route's value to its route
    y_rows = [torch.randn(P * C, H, generator=gen).bfloat16().to(dev) for _ in range(P)]
    route_values = [torch.randn(P * C * k_l, 1, generator=gen).to(dev) for _ in range(P)]
    for rank, d in enumerate(dispatches):
        push(rank, y_rows[rank], d.return_row, parts, 1, False, C, destinations="peers" if own_first else "all")
        push(rank, route_values[rank], d.return_route, d_w, 1, False, C * k_l)
    if own_first:  # the partial rows to the peers first (checked alone), then each rank's own to itself
        for p in range(P):
            assert parts[p][p * C: (p + 1) * C].isnan().all(), f"{ctx} {p=}: an own partial row came from a peer push"
        for rank, d in enumerate(dispatches):
            push(rank, y_rows[rank], d.return_row, parts, 1, False, C, destinations="self")
    wait_all(1)
    for src, d in enumerate(dispatches):
        token_slot = d.token_slot.cpu().long()
        for pair in (token_slot >= 0).nonzero().flatten().tolist():
            slot = int(token_slot[pair])
            p, c = slot // C, slot % C
            assert torch.equal(parts[src][slot].cpu(), y_rows[p][src * C + c].cpu()), f"{ctx} {src=} {pair=}"
        unused = torch.isin(torch.arange(P * C), token_slot, invert=True)  # [P·C]: rows of no pair
        assert parts[src][unused.to(dev)].isnan().all(), f"{ctx} {src=}: rows of no pair written"
        place = d.route_place.cpu().long()
        for r in (place >= 0).nonzero().flatten().tolist():
            p, within = int(place[r]) // (C * k_l), int(place[r]) % (C * k_l)
            assert torch.equal(d_w[src][place[r]].cpu(), route_values[p][src * C * k_l + within, 0].cpu()), ctx


def test_wait_without_arrivals_times_out_and_later_waits_return_at_once(kernel_device):
    P = 3
    arrivals = torch.zeros(KINDS, P, dtype=torch.int32, device=kernel_device)
    expected = torch.zeros_like(arrivals)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    arrivals[2] = torch.tensor([4, 0, 4], dtype=torch.int32)  # rank 1 never signals
    wait_arrivals(arrivals, expected, flag, 2, 4, timeout_s=0.2)
    assert int(flag) == ERROR_PEER_TIMEOUT
    assert expected[2].tolist() == [4, 4, 4] and expected[:2].eq(0).all()
    wait_arrivals(arrivals, expected, flag, 0, 4, timeout_s=60.0)  # must not spin: the flag says out of step
    assert int(flag) == ERROR_PEER_TIMEOUT and expected[0].tolist() == [4, 4, 4]


def test_wait_counts_wrap_around(kernel_device):
    """Counters only grow; near the int32 limit the comparison must still hold."""
    big = 2**31 - 2
    arrivals = torch.full((1, 2), big, dtype=torch.int32, device=kernel_device)
    expected = arrivals.clone()
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    wait_arrivals(arrivals, expected, flag, 0, 4, timeout_s=0.2)  # no new arrivals yet
    assert int(flag) == ERROR_PEER_TIMEOUT
    expected.fill_(big)
    flag.zero_()
    arrivals.fill_(big + 4 - 2**32)  # what an int32 counter holds after 4 more arrivals
    wait_arrivals(arrivals, expected, flag, 0, 4, timeout_s=5.0)
    assert int(flag) == 0 and expected.tolist() == arrivals.tolist()


def test_push_skips_rows_past_the_buffer_and_everything_after_a_timeout(kernel_device):
    P, C, H = 2, 4, 16
    gen = torch.Generator().manual_seed(7)
    dst = [torch.full((6, H), float("nan"), device=kernel_device) for _ in range(P)]
    arrivals = [torch.zeros(1, P, dtype=torch.int32, device=kernel_device) for _ in range(P)]
    src = torch.randn(P * C, H, generator=gen).to(kernel_device)
    back_to = torch.tensor([0, 6, -1, 5, 9, 1, 2, 3], dtype=torch.int32, device=kernel_device)  # 6, 9: past the 6 rows
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    push_rows(src, back_to, _peer_ptrs(dst), H, _peer_ptrs(arrivals), 0, flag, num_dst_rows=6, my_rank=1, capacity=C,
              by_slot=False, num_programs=1)
    for item, row in enumerate(back_to.tolist()):
        if 0 <= row < 6:
            assert torch.equal(dst[item // C][row], src[item]), f"{item=} {row=}"
    assert dst[0][[1, 2, 3, 4]].isnan().all() and dst[1][[0, 4]].isnan().all()
    assert [int(a[0, 1]) for a in arrivals] == [1, 1], "one program signals every rank once"
    flag.fill_(ERROR_PEER_TIMEOUT)
    before = [t.clone() for t in dst]
    push_rows(src * 2, back_to, _peer_ptrs(dst), H, _peer_ptrs(arrivals), 0, flag, num_dst_rows=6, my_rank=1,
              capacity=C, by_slot=False, num_programs=1)
    for now, then in zip(dst, before):
        torch.testing.assert_close(now, then, rtol=0, atol=0, equal_nan=True, msg="a push after a timeout wrote rows")
    assert [int(a[0, 1]) for a in arrivals] == [1, 1], "a push after a timeout signalled"


def test_comm_launchers_reject_bad_arguments():
    ptrs = torch.zeros(2, dtype=torch.int64)
    rows = torch.zeros(4, 8, dtype=torch.bfloat16)
    index = torch.zeros(4, dtype=torch.int32)
    flag = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^dst_peer_ptrs: expected a \[2\] int64"):
        push_rows(rows, index, ptrs.int(), 8, ptrs, 0, flag, num_dst_rows=4, my_rank=0, capacity=1, by_slot=True, num_programs=1)
    with pytest.raises(ValueError, match="^index: expected a contiguous 1-D int32"):
        push_rows(rows, index.long(), ptrs, 8, ptrs, 0, flag, num_dst_rows=4, my_rank=0, capacity=1, by_slot=True, num_programs=1)
    with pytest.raises(ValueError, match="my_rank"):
        push_rows(rows, index, ptrs, 8, ptrs, 0, flag, num_dst_rows=4, my_rank=2, capacity=1, by_slot=True, num_programs=1)
    with pytest.raises(ValueError, match="^destinations: expected one of"):
        push_rows(rows, index, ptrs, 8, ptrs, 0, flag, num_dst_rows=4, my_rank=0, capacity=1, by_slot=True, num_programs=1,
                  destinations="others")
    counters = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="^arrivals, expected"):
        wait_arrivals(counters, counters.long(), torch.zeros(1, dtype=torch.int32), 0, 1, 1.0)
    with pytest.raises(ValueError, match="kind"):
        wait_arrivals(counters, counters.clone(), torch.zeros(1, dtype=torch.int32), 2, 1, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_push_and_wait_need_no_host_sync_and_replay_in_a_cuda_graph():
    """P ranks in one process, every token to every rank: a round of pushes and waits runs
    under set_sync_debug_mode("error"), and captured in a CUDA graph each replay moves the
    rows its sources hold then (the counters keep counting across replays)."""
    P, C, T, H, num_programs = 3, 8, 7, 384, 2
    dev = torch.device("cuda")
    recv = [torch.full((P * C, H), float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(P)]
    arrivals = [torch.zeros(1, P, dtype=torch.int32, device=dev) for _ in range(P)]
    expected = [torch.zeros(1, P, dtype=torch.int32, device=dev) for _ in range(P)]
    flags = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(P)]
    src = [torch.empty(T, H, dtype=torch.bfloat16, device=dev) for _ in range(P)]
    # pair (t, p) at t·P + p: send row p·C + t
    slot = (torch.arange(P, device=dev) * C + torch.arange(T, device=dev)[:, None]).view(-1).to(torch.int32)

    recv_ptrs, arrival_ptrs = _peer_ptrs(recv), _peer_ptrs(arrivals)  # made once, as a transport does

    def exchange():
        for rank in range(P):
            push_rows(src[rank], slot, recv_ptrs, H, arrival_ptrs, 0, flags[rank], num_dst_rows=P * C,
                      my_rank=rank, capacity=C, by_slot=True, num_programs=num_programs, routes_per_row=P)
        for rank in range(P):
            wait_arrivals(arrivals[rank], expected[rank], flags[rank], 0, num_programs, timeout_s=10.0)

    def check(how: str):
        for p in range(P):
            for source in range(P):
                got = recv[p][source * C: source * C + T]
                assert torch.equal(got, src[source]), f"{how}: rows of {source=} at {p=} {P=} {C=} {T=} {H=}"
        assert all(int(f) == 0 for f in flags), f"{how}: error flags {[int(f) for f in flags]}"

    gen = torch.Generator(device=dev).manual_seed(3)
    for s in src:
        s.copy_(torch.randn(T, H, device=dev, generator=gen))
    exchange()  # compiles
    torch.cuda.synchronize()
    for s in src:
        s.copy_(torch.randn(T, H, device=dev, generator=gen))
    torch.cuda.set_sync_debug_mode("error")
    try:
        exchange()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    check("under sync debug mode")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        exchange()
    for replay in range(2):
        for s in src:
            s.copy_(torch.randn(T, H, device=dev, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        check(f"graph replay {replay}")


def test_persistent_launches_leave_the_held_sms_free(kernel_device):
    """Inside `sms_left_free` a persistent launch takes that many programs fewer (nested holds
    add up, and leaving the block gives them back); without SMs to count nothing changes."""
    device = torch.device(kernel_device)
    full = num_sms(device)
    with sms_left_free(device, 4):
        with sms_left_free(device, 2):
            inner = num_sms(device)
        outer = num_sms(device)
    expected = (full - 6, full - 4) if device.type == "cuda" else (full, full)
    assert (inner, outer) == expected and num_sms(device) == full, f"{full=} {inner=} {outer=} {device=}"
