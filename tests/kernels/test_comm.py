"""Peer-pointer row pushes, the bounded arrival wait (`mok/kernels/comm.py`), and the GEMM
epilogues that store rows on the peers (`PeerRows`).

P ranks are simulated in one process: each "rank" owns plain tensors standing in for its
symmetric-memory regions, and the peer-pointer tables hold their addresses (the kernels
only see addresses, so they cannot tell). Receive buffers are poisoned with NaN, so a
row written where it should not be, or left out, shows. The multi-GPU run of the whole
transport is in tests/dist/test_ep_symmetric.py.
"""

from __future__ import annotations

import pytest
import torch

from mok.kernels.comm import PeerRows, push_rows, wait_arrivals
from mok.kernels.common import ERROR_CAPACITY_OVERFLOW, ERROR_PEER_TIMEOUT
from mok.kernels.dgrad import dgrad_config, gate_up_dgrad_scatter
from mok.kernels.dispatch import route_slots
from mok.kernels.grouped_gemm import down_scatter, gate_up_swiglu, gemm_config, routing_block_m, scatter_grid
from mok.kernels.schedule import build_routing_schedule
from mok.testing import make_inputs, make_topk_ids

KINDS = 3  # 0: dispatch, 1: return, 2: never pushed


def _peer_ptrs(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=tensors[0].device)


@pytest.mark.parametrize("P, E_l, topk, C, H, num_programs, overflows",
                         [(3, 2, 2, 7, 40, 2, True), (2, 3, 3, 30, 1100, 1, False)])
def test_push_rows_out_and_back_match_the_routes(kernel_device, P, E_l, topk, C, H, num_programs, overflows):
    ctx = f"{P=} {E_l=} {topk=} {C=} {H=} {num_programs=}"
    gen = torch.Generator().manual_seed(P * C + H)
    tokens = [9 + 3 * r for r in range(P)]  # T differs per rank
    max_slots = max(tokens) * topk
    dev = kernel_device
    nan = float("nan")
    recv_x = [torch.full((P * C, H), nan, dtype=torch.bfloat16, device=dev) for _ in range(P)]
    recv_w = [torch.full((P * C,), nan, device=dev) for _ in range(P)]
    y_slots = [torch.full((max_slots, H), nan, dtype=torch.bfloat16, device=dev) for _ in range(P)]
    w_slots = [torch.full((max_slots,), nan, device=dev) for _ in range(P)]
    arrivals = [torch.zeros(KINDS, P, dtype=torch.int32, device=dev) for _ in range(P)]
    expected = [torch.zeros(KINDS, P, dtype=torch.int32, device=dev) for _ in range(P)]
    flags = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(P)]
    arrival_ptrs = _peer_ptrs(arrivals)

    x, w, slots, routes = [], [], [], []
    for rank in range(P):
        ids = make_topk_ids(tokens[rank], E_l * P, topk, gen).to(dev)
        slot, _, route = route_slots(ids, E_l, P, C, flags[rank])
        x.append(torch.randn(tokens[rank], H, generator=gen).bfloat16().to(dev))
        w.append(torch.randn(tokens[rank], topk, generator=gen).to(dev))
        slots.append(slot.cpu().long())
        routes.append(route)
    assert any(int(f) == ERROR_CAPACITY_OVERFLOW for f in flags) == overflows, ctx
    for flag in flags:
        flag.zero_()

    # out: token rows and one fp32 per route to the experts' ranks; unsent routes zero their own slots
    for rank in range(P):
        num_routes = tokens[rank] * topk
        push_rows(x[rank], slots[rank].int().to(dev), _peer_ptrs(recv_x), H, arrival_ptrs, 0, flags[rank],
                  num_dst_rows=P * C, my_rank=rank, capacity=C, by_slot=True, num_programs=num_programs, routes_per_row=topk,
                  zero_rows=y_slots[rank][:num_routes],
                  scalars=(w[rank].view(-1), _peer_ptrs(recv_w), w_slots[rank][:num_routes]))
    for rank in range(P):
        wait_arrivals(arrivals[rank], expected[rank], flags[rank], 0, num_programs, timeout_s=5.0)
        assert int(flags[rank]) & ERROR_PEER_TIMEOUT == 0, ctx
        assert expected[rank][0].tolist() == [num_programs] * P, ctx
    for dest in range(P):
        for src in range(P):
            for c in range(C):
                route = int(routes[src][dest * C + c])
                got_x, got_w = recv_x[dest][src * C + c].cpu(), recv_w[dest][src * C + c].cpu()
                if route < 0:
                    assert got_x.isnan().all() and got_w.isnan(), f"{ctx}: empty row {src=} {c=} written at {dest=}"
                else:
                    assert torch.equal(got_x, x[src][route // topk].cpu()), f"{ctx} {src=} {dest=} {c=}"
                    assert torch.equal(got_w, w[src].view(-1)[route].cpu()), f"{ctx} {src=} {dest=} {c=}"

    # back: each received row to its source's slot t·topk + j
    y_rows = [torch.randn(P * C, H, generator=gen).bfloat16().to(dev) for _ in range(P)]
    d_w_rows = [torch.randn(P * C, generator=gen).to(dev) for _ in range(P)]
    for rank in range(P):
        return_route = torch.cat([routes[src][rank * C: (rank + 1) * C] for src in range(P)])
        push_rows(y_rows[rank], return_route, _peer_ptrs(y_slots), H, arrival_ptrs, 1, flags[rank],
                  num_dst_rows=max_slots, my_rank=rank, capacity=C,
                  by_slot=False, num_programs=num_programs, scalars=(d_w_rows[rank], _peer_ptrs(w_slots), None))
    for rank in range(P):
        wait_arrivals(arrivals[rank], expected[rank], flags[rank], 1, num_programs, timeout_s=5.0)
        num_routes = tokens[rank] * topk
        sent = slots[rank] >= 0
        dest, place = slots[rank] // C, slots[rank] % C
        expected_y = torch.zeros(num_routes, H, dtype=torch.bfloat16)
        expected_w = torch.zeros(num_routes)
        for r in sent.nonzero().flatten().tolist():
            expected_y[r] = y_rows[dest[r]][rank * C + place[r]].cpu()
            expected_w[r] = d_w_rows[dest[r]][rank * C + place[r]].cpu()
        assert torch.equal(y_slots[rank][:num_routes].cpu(), expected_y), f"{ctx} {rank=}"
        assert torch.equal(w_slots[rank][:num_routes].cpu(), expected_w), f"{ctx} {rank=}"
        assert y_slots[rank][num_routes:].isnan().all(), f"{ctx} {rank=}: rows past T·topk written"
        assert int(flags[rank]) & ERROR_PEER_TIMEOUT == 0, ctx


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
    with pytest.raises(ValueError, match="^zero_rows: expected by_slot"):
        push_rows(rows, index, ptrs, 8, ptrs, 0, flag, num_dst_rows=4, my_rank=0, capacity=1, by_slot=False, num_programs=1, zero_rows=rows)
    counters = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="^arrivals, expected"):
        wait_arrivals(counters, counters.long(), torch.zeros(1, dtype=torch.int32), 0, 1, 1.0)
    with pytest.raises(ValueError, match="kind"):
        wait_arrivals(counters, counters.clone(), torch.zeros(1, dtype=torch.int32), 2, 1, 1.0)


def test_gemm_epilogues_store_rows_in_their_sources_slots(kernel_device):
    """The down GEMM and the gate/up dgrad with `peer_rows`: every received row's output
    lands in its source's buffer at its route (the rows the plain launch stores at the
    received position), nothing else is written, and each program signals once."""
    P, C, E_l, H, I, me = 3, 6, 2, 64, 32, 1
    num_out_rows = 20  # the sources' T·topk slots
    dev = kernel_device
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, E_l, (P * C, 1), generator=gen, dtype=torch.int32)
    return_route = torch.full((P * C,), -1, dtype=torch.int32)
    for source in range(P):  # each source sent C - 1 or C - 2 rows, to distinct routes of its own
        sent = C - 1 - source % 2
        return_route[source * C: source * C + sent] = torch.randperm(num_out_rows, generator=gen)[:sent].int()
    ids[return_route < 0] = -1
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    schedule = build_routing_schedule(ids.to(dev), E_l, routing_block_m(), flag, skip_empty_ids=True)
    inp = make_inputs(P * C, H, I, E_l, 1, seed=5, device=dev)
    h, _ = gate_up_swiglu(inp.x, inp.w_gate, inp.w_up, schedule, 1)
    d_gate_up = torch.randn(schedule.capacity_rows, 2, I, generator=gen).bfloat16().to(dev)
    cases = (
        ("down", lambda peer: down_scatter(h, inp.w_down, schedule, P * C, peer_rows=peer),
         gemm_config("down", H, I, allow_warp_specialized=False)),
        ("gate/up dgrad", lambda peer: gate_up_dgrad_scatter(d_gate_up, inp.w_gate, inp.w_up, schedule, P * C,
                                                            peer_rows=peer),
         dgrad_config("gate_up", H, I, allow_warp_specialized=False)),
    )
    for name, launch, cfg in cases:
        plain = launch(None).cpu()
        out = [torch.full((num_out_rows, H), float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(P)]
        arrivals = [torch.zeros(2, P, dtype=torch.int32, device=dev) for _ in range(P)]
        peer = PeerRows(_peer_ptrs(out), return_route.to(dev), C, _peer_ptrs(arrivals), 1 * P + me, out[me])
        assert launch(peer) is out[me], name
        expected = [torch.full((num_out_rows, H), float("nan"), dtype=torch.bfloat16) for _ in range(P)]
        for row, route in enumerate(return_route.tolist()):
            if route >= 0:
                expected[row // C][route] = plain[row]
        for rank in range(P):
            torch.testing.assert_close(out[rank].cpu(), expected[rank], rtol=0, atol=0, equal_nan=True,
                                       msg=f"{name}: rank {rank}'s buffer")
            assert arrivals[rank][1].tolist() == [0] * me + [scatter_grid(schedule, H, cfg)] + [0] * (P - me - 1), name
            assert arrivals[rank][0].eq(0).all(), name
