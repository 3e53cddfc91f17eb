"""The expert-parallel dispatch kernels against PyTorch statements of the same order, bit for bit."""

import pytest
import torch

from mok.kernels.common import ERROR_BAD_EXPERT_ID, ERROR_CAPACITY_OVERFLOW
from mok import ops
from mok.kernels.dispatch import pack_rows, receive_expert_ids, route_slots, unpack_rows
from mok.kernels.grouped_gemm import routing_block_m
from mok.testing import make_topk_ids


def route_slots_in_torch(topk_ids: torch.Tensor, num_local_experts: int, world_size: int, capacity: int):
    """Per destination rank, its routes ordered by (local expert, t·topk+j); the c-th gets
    slot p·C + c while c < C, else −1; each filled send row carries its local expert id."""
    flat = topk_ids.reshape(-1).long()
    route_slot = torch.full((flat.numel(),), -1, dtype=torch.int32)
    send_expert = torch.full((world_size * capacity,), -1, dtype=torch.int32)
    for dest in range(world_size):
        to_dest = ((flat // num_local_experts) == dest).nonzero().flatten()
        ordered = to_dest[torch.argsort(flat[to_dest] % num_local_experts, stable=True)]
        for place, route in enumerate(ordered[:capacity].tolist()):
            route_slot[route] = dest * capacity + place
            send_expert[dest * capacity + place] = flat[route] % num_local_experts
    return route_slot, send_expert


CASES = [
    # (T, E_l, P, topk, C, routing)
    (9, 2, 2, 2, 18, "random"),  # the exact worst case: never overflows
    (40, 3, 3, 2, 12, "random"),  # overflow on busy pairs
    (13, 2, 4, 3, 39, "random"),
    (20, 4, 2, 1, 20, "one rank"),  # every route to rank 1
    (1, 1, 3, 1, 1, "random"),
]


def _ids(T, E_l, P, topk, routing, gen):
    if routing == "one rank":
        return make_topk_ids(T, E_l, topk, gen) + E_l
    return make_topk_ids(T, E_l * P, topk, gen)


@pytest.mark.parametrize("T, E_l, P, topk, C, routing", CASES)
def test_route_slots_bit_exact(kernel_device, T, E_l, P, topk, C, routing):
    ids = _ids(T, E_l, P, topk, routing, torch.Generator().manual_seed(T * P))
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    route_slot, send_expert, send_route = route_slots(ids.int().to(kernel_device), E_l, P, C, flag)
    expected_slot, expected_expert = route_slots_in_torch(ids, E_l, P, C)
    ctx = f"{T=} {E_l=} {P=} {topk=} {C=} {routing=}"
    assert torch.equal(route_slot.cpu(), expected_slot), ctx
    assert torch.equal(send_expert.cpu(), expected_expert), ctx
    sent = expected_slot >= 0
    expected_route = torch.full_like(expected_expert, -1)
    expected_route[expected_slot[sent].long()] = torch.arange(T * topk, dtype=torch.int32)[sent]
    assert torch.equal(send_route.cpu(), expected_route), ctx
    overflowed = bool((expected_slot < 0).any())
    assert int(flag) == (ERROR_CAPACITY_OVERFLOW if overflowed else 0), ctx
    if C == T * min(topk, E_l):
        assert not overflowed, ctx


def test_route_slots_bad_ids_get_no_slot(kernel_device):
    T, E_l, P, topk = 10, 2, 2, 2
    ids = make_topk_ids(T, E_l * P, topk, torch.Generator().manual_seed(1))
    ids[4, 1] = ids[4, 0]  # repeated within a row
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    route_slot, send_expert, send_route = route_slots(ids.to(kernel_device), E_l, P, T * topk, flag)
    assert int(flag) == ERROR_BAD_EXPERT_ID
    slots = route_slot.cpu().view(T, topk)
    assert (slots[4] == -1).all() and (slots[torch.arange(T) != 4] >= 0).all()
    assert int((send_expert >= 0).sum()) == (T - 1) * topk


@pytest.mark.parametrize("width, dtype", [(48, torch.bfloat16), (1, torch.float32), (1000, torch.bfloat16)])
def test_pack_and_unpack_rows_bit_exact(kernel_device, width, dtype):
    T, E_l, P, topk, C = 23, 2, 3, 2, 9  # some routes overflow
    gen = torch.Generator().manual_seed(width)
    ids = make_topk_ids(T, E_l * P, topk, gen)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    route_slot, send_expert, send_route = route_slots(ids.to(kernel_device), E_l, P, C, flag)
    slots = route_slot.cpu().long()
    sent = slots >= 0
    assert int(flag) == ERROR_CAPACITY_OVERFLOW and not sent.all(), "the case should overflow"

    # pack token rows (one per token, topk routes each) and per-route rows alike
    for routes_per_row in (topk, 1):
        src = torch.randn(T * topk // routes_per_row, width, generator=gen).to(dtype)
        send = pack_rows(src.to(kernel_device), route_slot, routes_per_row, P * C).cpu()
        expected = src[torch.arange(T * topk)[sent] // routes_per_row]
        ctx = f"{width=} {dtype=} {routes_per_row=}"
        assert send.shape == (P * C, width) and send.dtype == dtype, ctx
        assert torch.equal(send[slots[sent]], expected), ctx
        assert torch.equal((send_expert.cpu() >= 0).nonzero().flatten(), slots[sent].sort().values), ctx

    recv = torch.randn(P * C, width, generator=gen).to(dtype)
    recv[send_expert.cpu() < 0] = float("nan")  # unused rows must not leak
    out = unpack_rows(recv.to(kernel_device), route_slot).cpu()
    expected = torch.zeros(T * topk, width, dtype=dtype)
    expected[sent] = recv[slots[sent]]
    assert torch.equal(out, expected), f"{width=} {dtype=}"


@pytest.mark.parametrize("P, C, extra_columns", [(1, 5, 0), (3, 7, 7), (5, 1, 0)])
def test_receive_expert_ids_interleave_sources_and_or_their_flags(kernel_device, P, C, extra_columns):
    """extra_columns: the ids are the first C + 1 columns of wider rows (a strided view)."""
    gen = torch.Generator().manual_seed(P * C)
    rows = torch.randint(-1, 4, (P, C + 1 + extra_columns), generator=gen, dtype=torch.int32)
    recv_ids = rows[:, : C + 1]
    recv_ids[:, C] = 0
    recv_ids[P // 2, C] = ERROR_CAPACITY_OVERFLOW  # one source overflowed
    flag = torch.full((1,), ERROR_BAD_EXPERT_ID, dtype=torch.int32, device=kernel_device)  # set before
    expert_ids = receive_expert_ids(rows.to(kernel_device)[:, : C + 1], flag)
    assert torch.equal(expert_ids.cpu(), recv_ids[:, :C].t().reshape(C * P, 1)), f"{P=} {C=}"
    assert int(flag) == ERROR_BAD_EXPERT_ID | ERROR_CAPACITY_OVERFLOW, f"{P=} {C=}"


def test_dispatch_ops_schema_and_fake_impls(kernel_device):
    """The dispatch ops declare their mutations and their fake impls give the real shapes
    and dtypes (what torch.compile and CUDA graphs rely on)."""
    T, E_l, P, topk, C, H = 9, 2, 3, 2, 6, 32
    gen = torch.Generator().manual_seed(0)
    ids = make_topk_ids(T, E_l * P, topk, gen).to(kernel_device)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    route_slot, send_expert, send_route = ops.route_slots(ids, flag, E_l, P, C)
    x = torch.randn(T, H, generator=gen).bfloat16().to(kernel_device)
    recv = torch.randn(P * C, H, generator=gen).bfloat16().to(kernel_device)
    recv_ids = torch.cat([send_expert.view(P, C), flag.expand(P, 1)], dim=1)
    expert_ids = ops.receive_expert_ids(recv_ids, flag)
    mutating = [
        (ops.route_slots, (ids, flag, E_l, P, C)),
        (ops.receive_expert_ids, (recv_ids, flag)),
        (ops.routing_schedule, (expert_ids, flag, E_l, routing_block_m(), True)),
    ]
    pure = [(ops.pack_rows, (x, route_slot, topk, P * C)), (ops.unpack_rows, (recv, route_slot))]
    for op, args in mutating:
        torch.library.opcheck(op.op, args, test_utils=("test_schema", "test_faketensor"))
    for op, args in pure:
        torch.library.opcheck(op.op, args, test_utils=("test_faketensor",))


def test_dispatch_launchers_reject_bad_arguments():
    ids = torch.zeros(4, 2, dtype=torch.int64)
    flag = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="^send_capacity: expected a positive int"):
        route_slots(ids, 2, 2, 0, flag)
    with pytest.raises(ValueError, match="^error_flag: expected a"):
        route_slots(ids, 2, 2, 8, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="^route_slot: expected a contiguous 1-D int32"):
        pack_rows(torch.zeros(4, 8), torch.zeros(8, dtype=torch.int64), 2, 8)
    with pytest.raises(ValueError, match=r"^src: expected 8 / routes_per_row=1 rows"):
        pack_rows(torch.zeros(4, 8), torch.zeros(8, dtype=torch.int32), 1, 8)
    with pytest.raises(ValueError, match="^recv: expected a 2-D tensor"):
        unpack_rows(torch.zeros(8), torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^recv_ids: expected a \[P, C \+ 1\] int32"):
        receive_expert_ids(torch.zeros(2, 1, dtype=torch.int32), flag)
