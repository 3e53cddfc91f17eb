"""The expert-parallel plan (`transport.common.token_plan`) and the row copies of
`mok/kernels/comm/dispatch.py` against plain PyTorch loops of the same order, bit for bit."""

import pytest
import torch

from mok import ops
from mok.kernels.common import ERROR_BAD_EXPERT_ID, ERROR_CAPACITY_OVERFLOW
from mok.kernels.comm.dispatch import pack_rows, unpack_rows
from mok.kernels.gemm.common import routing_block_m
from mok.testing import make_topk_ids
from mok.transport.common import own_tiles_split, token_plan, token_receiver_schedule


def token_plan_in_torch(topk_ids: torch.Tensor, num_local_experts: int, world_size: int, capacity: int):
    """Per destination rank p, the tokens with a route there in ascending t; the c-th gets
    send row p·C + c while c < C; its routes to p (ascending j) the places (p·C + c)·k_l + q,
    each carrying its local expert id."""
    num_tokens, topk = topk_ids.shape
    k_l = min(topk, num_local_experts)
    token_slot = torch.full((num_tokens * world_size,), -1, dtype=torch.int32)
    route_place = torch.full((num_tokens * topk,), -1, dtype=torch.int32)
    send_expert = torch.full((world_size * capacity * k_l,), -1, dtype=torch.int32)
    count = [0] * world_size
    for t in range(num_tokens):
        for p in range(world_size):
            routes = [j for j in range(topk) if int(topk_ids[t, j]) // num_local_experts == p]
            if not routes:
                continue
            c, count[p] = count[p], count[p] + 1
            if c >= capacity:
                continue
            token_slot[t * world_size + p] = p * capacity + c
            for q, j in enumerate(routes):
                route_place[t * topk + j] = (p * capacity + c) * k_l + q
                send_expert[(p * capacity + c) * k_l + q] = int(topk_ids[t, j]) % num_local_experts
    return token_slot, route_place, send_expert, max(count) > capacity


CASES = [
    # (T, E_l, P, topk, C, routing)
    (9, 2, 2, 2, 9, "random"),  # the exact worst case: never overflows
    (40, 3, 3, 2, 12, "random"),  # overflow on busy pairs
    (13, 2, 4, 3, 13, "random"),  # topk > E_l: up to 2 routes per row
    (20, 4, 2, 1, 20, "one rank"),  # every token to rank 1
    (30, 2, 3, 4, 30, "skewed"),
    (1, 1, 3, 1, 1, "random"),
]


def _ids(T, E_l, P, topk, routing, gen):
    if routing == "one rank":
        return make_topk_ids(T, E_l, topk, gen) + E_l
    return make_topk_ids(T, E_l * P, topk, gen, skew=4.0 if routing == "skewed" else 0.0)


@pytest.mark.parametrize("T, E_l, P, topk, C, routing", CASES)
def test_token_plan_bit_exact(kernel_device, T, E_l, P, topk, C, routing):
    gen = torch.Generator().manual_seed(T * P + C)
    ids = _ids(T, E_l, P, topk, routing, gen)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    token_slot, route_place, send_expert = token_plan(ids.int().to(kernel_device), E_l, P, C, flag)
    expected_slot, expected_place, expected_expert, overflows = token_plan_in_torch(ids, E_l, P, C)
    ctx = f"{T=} {E_l=} {P=} {topk=} {C=} {routing=}"
    assert torch.equal(token_slot.cpu(), expected_slot), ctx
    assert torch.equal(route_place.cpu(), expected_place), ctx
    assert torch.equal(send_expert.cpu(), expected_expert), ctx
    assert int(flag) == (ERROR_CAPACITY_OVERFLOW if overflows else 0), ctx


def test_token_plan_bad_ids_get_no_rows(kernel_device):
    T, E_l, P, topk = 5, 2, 2, 2
    ids = torch.tensor([[0, 3], [1, 1], [2, 0], [0, 9], [3, 2]], device=kernel_device)  # tokens 1, 3: bad
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    token_slot, route_place, _ = token_plan(ids, E_l, P, T, flag)
    assert int(flag) == ERROR_BAD_EXPERT_ID
    assert (token_slot.view(T, P)[[1, 3]] == -1).all() and (route_place.view(T, topk)[[1, 3]] == -1).all()
    assert torch.equal(token_slot.view(T, P)[[0, 2, 4]].cpu() >= 0, torch.tensor([[True, True]] * 2 + [[False, True]]))


@pytest.mark.parametrize("width, dtype", [(48, torch.bfloat16), (1, torch.float32), (5000, torch.float32)])
def test_pack_and_unpack_rows_by_the_plan(kernel_device, width, dtype):
    """Token rows by their pairs' send rows (routes_per_row = P), per-route values by their
    places (routes_per_row = 1), and back (zeros where nothing was sent)."""
    T, E_l, P, topk, C = 40, 3, 3, 2, 12  # overflows: some pairs get no row
    gen = torch.Generator().manual_seed(width)
    ids = _ids(T, E_l, P, topk, "random", gen)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    token_slot, route_place, _ = token_plan(ids.to(kernel_device), E_l, P, C, flag)
    assert int(flag) == ERROR_CAPACITY_OVERFLOW, "the case should overflow"
    k_l = min(topk, E_l)
    for index, per, rows in ((token_slot, P, P * C), (route_place, 1, P * C * k_l)):
        src = torch.randn(index.shape[0] // per, width, generator=gen).to(dtype)
        send = pack_rows(src.to(kernel_device), index, per, rows).cpu()
        sent = (index >= 0).cpu()
        slots = index.cpu().long()
        ctx = f"{width=} {dtype=} {per=}"
        assert send.shape == (rows, width) and send.dtype == dtype, ctx
        assert torch.equal(send[slots[sent]], src[torch.arange(index.shape[0])[sent] // per]), ctx
    recv = torch.randn(P * C * k_l, width, generator=gen).to(dtype)
    out = unpack_rows(recv.to(kernel_device), route_place).cpu()
    expected = torch.zeros(T * topk, width, dtype=dtype)
    sent = (route_place >= 0).cpu()
    expected[sent] = recv[route_place.cpu().long()[sent]]
    assert torch.equal(out, expected), f"{width=} {dtype=}"


@pytest.mark.parametrize("rank", [0, 2])
def test_receiver_schedule_places_every_received_route(kernel_device, rank):
    """Received rows are tokens with topk = k_l: each received route lands under its expert
    once, and received_routes marks exactly the filled places."""
    P, C, E_l, k_l = 3, 4, 2, 2
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(-1, E_l, (P, C, k_l), generator=gen, dtype=torch.int32)
    ids[..., 1] = torch.where(ids[..., 0] >= 0, 1 - ids[..., 0], -1)  # distinct within a row
    recv_ids = torch.cat([ids.view(P, C * k_l), torch.zeros(P, 1, dtype=torch.int32)], dim=1)
    recv_ids[1, -1] = ERROR_CAPACITY_OVERFLOW  # one source's flag
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    schedule, received = token_receiver_schedule(recv_ids.to(kernel_device), flag, E_l, k_l, routing_block_m(), rank)
    assert int(flag) == ERROR_CAPACITY_OVERFLOW
    flat = ids.view(-1)
    assert torch.equal(received.cpu(), torch.where(flat >= 0, torch.arange(flat.numel(), dtype=torch.int32), -1))
    placed = schedule.row_source[: int(schedule.num_rows)].cpu()
    placed = placed[placed >= 0].sort().values
    assert torch.equal(placed, (flat >= 0).nonzero().flatten().int())
    assert torch.equal((schedule.route_row.cpu() >= 0), flat >= 0)


@pytest.mark.parametrize("rank, P, C_per_tile, E_l, k_l", [(0, 2, 3.2, 3, 2), (1, 2, 3.2, 2, 2), (2, 4, 2.5, 2, 2)])
def test_receiver_schedule_puts_own_routes_first_and_own_tiles_split_parts_its_tiles(kernel_device, rank, P, C_per_tile,
                                                                                  E_l, k_l):
    """Inside each expert the routes of the receiver's own tokens come first, then the sources
    from rank + 1 on, each in ascending route order; `own_tiles_split` gives every tile below
    num_rows to exactly one of its schedules, first's only with own routes and its rows, and
    rest's with every tile holding a peer's route."""
    block_m = routing_block_m()
    C = int(C_per_tile * block_m)  # enough own routes per expert for a whole tile of them
    gen = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(-1, E_l, (P, C, k_l), generator=gen, dtype=torch.int32)
    ids[..., 1] = torch.where(ids[..., 0] >= 0, (ids[..., 0] + 1) % E_l, -1)  # distinct within a row
    recv_ids = torch.cat([ids.view(P, C * k_l), torch.zeros(P, 1, dtype=torch.int32)], dim=1).to(kernel_device)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    schedule, _ = token_receiver_schedule(recv_ids, flag, E_l, k_l, block_m, rank)
    first, rest = own_tiles_split(schedule, rank, C * k_l)
    num_rows = int(schedule.num_rows)
    row_source = schedule.row_source[:num_rows].cpu().long()
    tile_expert = schedule.tile_expert.cpu()
    ctx = f"{rank=} {P=} {C=} {E_l=} {k_l=}"
    routes_per_source = C * k_l
    for expert in range(E_l):
        rows = torch.arange(num_rows)[(tile_expert[torch.arange(num_rows) // block_m] == expert) & (row_source >= 0)]
        source = row_source[rows] // routes_per_source
        order = (source - rank) % P * routes_per_source + row_source[rows] % routes_per_source
        assert bool((order[1:] > order[:-1]).all()), f"expert {expert}'s routes out of own-first order {ctx}"
    tiles = num_rows // block_m
    first_tiles, rest_tiles = first.tile_expert[:tiles].cpu(), rest.tile_expert[:tiles].cpu()
    assert torch.equal(torch.where(first_tiles >= 0, first_tiles, rest_tiles), tile_expert[:tiles]), ctx
    assert not bool(((first_tiles >= 0) & (rest_tiles >= 0)).any()), f"a tile in both schedules {ctx}"
    tile_sources = row_source.view(tiles, block_m) // routes_per_source
    tile_valid = row_source.view(tiles, block_m) >= 0
    own_only = ((tile_sources == rank) | ~tile_valid).all(1)
    assert torch.equal(first_tiles >= 0, own_only), f"first's tiles are not the own-only ones {ctx}"
    assert 0 < int(own_only.sum()) < tiles, f"the case splits nothing {ctx}"
    first_rows = first.row_source[:num_rows].cpu().long()
    in_first = own_only[:, None].expand(-1, block_m).reshape(-1)
    assert torch.equal(first_rows, torch.where(in_first, row_source, -1)), f"first's rows {ctx}"
    assert rest.row_source is schedule.row_source


def test_dispatch_ops_fake_impls(kernel_device):
    """The dispatch ops' fake impls give the real shapes and dtypes (what torch.compile and
    CUDA graphs rely on)."""
    T, E_l, P, topk, C, H = 9, 2, 3, 2, 6, 32
    gen = torch.Generator().manual_seed(0)
    ids = make_topk_ids(T, E_l * P, topk, gen).to(kernel_device)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    token_slot, route_place, _ = token_plan(ids, E_l, P, C, flag)
    x = torch.randn(T, H, generator=gen).bfloat16().to(kernel_device)
    recv = torch.randn(P * C * topk, H, generator=gen).bfloat16().to(kernel_device)
    for op, args in [(ops.pack_rows, (x, token_slot, P, P * C)), (ops.unpack_rows, (recv, route_place))]:
        torch.library.opcheck(op.op, args, test_utils=("test_faketensor",))


def test_dispatch_launchers_reject_bad_arguments():
    with pytest.raises(ValueError, match="^route_slot: expected a contiguous 1-D int32"):
        pack_rows(torch.zeros(4, 8), torch.zeros(8, dtype=torch.int64), 2, 8)
    with pytest.raises(ValueError, match=r"^src: expected 8 / routes_per_row=1 rows"):
        pack_rows(torch.zeros(4, 8), torch.zeros(8, dtype=torch.int32), 1, 8)
    with pytest.raises(ValueError, match="^recv: expected a 2-D tensor"):
        unpack_rows(torch.zeros(8), torch.zeros(8, dtype=torch.int32))
