"""The routing schedule kernel against a PyTorch statement of the same order, bit for bit."""

import pytest
import torch

from mok.kernels.common import ERROR_BAD_EXPERT_ID
from mok.kernels.routing.schedule import build_routing_schedule, capacity_rows, sorted_route_rows
from mok.testing import make_topk_ids


def schedule_in_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Experts ascending, each expert's routes by ascending t·topk+j, padded to block_m
    (ids of −1, empty entries, are left out); route_row the row of each route, −1 for none."""
    flat = topk_ids.reshape(-1).long().cpu()
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)])
    rows = int(offsets[-1])
    row_source = torch.full((rows,), -1, dtype=torch.int32)
    route_row = torch.full((flat.numel(),), -1, dtype=torch.int32)
    for e in range(num_experts):
        routes = (flat == e).nonzero().flatten()
        row_source[offsets[e] : offsets[e] + routes.numel()] = routes.int()
        route_row[routes] = torch.arange(int(offsets[e]), int(offsets[e]) + routes.numel(), dtype=torch.int32)
    tile_expert = torch.repeat_interleave(torch.arange(num_experts), padded // block_m).int()
    return counts.int(), offsets.int(), row_source, tile_expert, route_row


CASES = [
    # (T, E, topk, skew, block_m)
    (1, 4, 1, 0.0, 16),
    (37, 5, 2, 0.0, 16),
    (300, 6, 3, 3.0, 16),  # skewed: late experts get nothing
    (129, 8, 8, 0.0, 32),  # topk = E
    (1000, 128, 8, 0.0, 128),
    (257, 3, 1, 0.0, 64),
]


@pytest.mark.parametrize("T, E, topk, skew, block_m", CASES)
def test_schedule_bit_exact(kernel_device, T, E, topk, skew, block_m):
    gen = torch.Generator().manual_seed(T + E)
    ids = make_topk_ids(T, E, topk, gen, skew=skew).to(kernel_device)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    s = build_routing_schedule(ids.int() if T % 2 else ids, E, block_m, flag)
    counts, offsets, row_source, tile_expert, route_row = schedule_in_torch(ids, E, block_m)
    ctx = f"{T=} {E=} {topk=} {skew=} {block_m=}"
    num_rows = int(s.num_rows)
    assert int(flag) == 0, ctx
    assert s.capacity_rows == capacity_rows(T * topk, E, block_m) and s.capacity_rows >= num_rows, ctx
    assert torch.equal(s.expert_counts.cpu(), counts), ctx
    assert torch.equal(s.expert_offsets.cpu(), offsets), ctx
    assert num_rows == int(offsets[-1]), ctx
    assert torch.equal(s.row_source[:num_rows].cpu(), row_source), ctx
    assert torch.equal(s.tile_expert[: num_rows // block_m].cpu(), tile_expert), ctx
    assert (s.tile_expert[num_rows // block_m :] == -1).all(), ctx
    assert torch.equal(s.route_row.cpu(), route_row), ctx


def test_all_tokens_to_one_expert(kernel_device):
    T, E = 70, 4
    ids = torch.full((T, 1), 2, dtype=torch.int64, device=kernel_device)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    s = build_routing_schedule(ids, E, 16, flag)
    assert s.expert_counts.tolist() == [0, 0, 70, 0]
    assert s.expert_offsets.tolist() == [0, 0, 0, 80, 80]
    assert s.row_source[:70].tolist() == list(range(70)) and s.row_source[70:80].tolist() == [-1] * 10
    assert s.tile_expert[:5].tolist() == [2] * 5


@pytest.mark.parametrize("bad", ["out_of_range", "negative", "minus_one", "repeated"])
def test_bad_ids_set_the_error_flag(kernel_device, bad):
    T, E = 40, 6
    ids = make_topk_ids(T, E, 2, torch.Generator().manual_seed(0))
    if bad == "out_of_range":
        ids[17, 1] = E
    elif bad == "negative":
        ids[3, 0] = -2
    elif bad == "minus_one":  # an empty entry only where the caller says so (skip_empty_ids)
        ids[3, 0] = -1
    else:
        ids[25, 1] = ids[25, 0]
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    s = build_routing_schedule(ids.to(kernel_device), E, 16, flag)
    assert int(flag) & ERROR_BAD_EXPERT_ID, bad
    # The bad row is left out; every other route is placed exactly once.
    placed = s.row_source[: int(s.num_rows)].cpu()
    placed = placed[placed >= 0]
    assert placed.numel() == T * 2 - 2 and placed.unique().numel() == placed.numel(), bad


@pytest.mark.parametrize("T, E, topk", [(50, 5, 1), (37, 4, 3), (8, 3, 1)])
def test_empty_ids_are_skipped_bit_exact(kernel_device, T, E, topk):
    """skip_empty_ids: −1 entries (the expert-parallel receiver's unused rows) get no row
    and no error; the rest is the schedule of the remaining routes, bit for bit."""
    gen = torch.Generator().manual_seed(T)
    ids = make_topk_ids(T, E, topk, gen)
    ids[torch.rand(T, topk, generator=gen) < 0.4] = -1
    ids[-1] = -1  # a whole row empty, at the end
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    s = build_routing_schedule(ids.int().to(kernel_device), E, 16, flag, skip_empty_ids=True)
    counts, offsets, row_source, tile_expert, route_row = schedule_in_torch(ids, E, 16)
    ctx = f"{T=} {E=} {topk=}"
    num_rows = int(s.num_rows)
    assert int(flag) == 0, ctx
    assert torch.equal(s.expert_counts.cpu(), counts) and torch.equal(s.expert_offsets.cpu(), offsets), ctx
    assert torch.equal(s.row_source[:num_rows].cpu(), row_source), ctx
    assert torch.equal(s.tile_expert[: num_rows // 16].cpu(), tile_expert), ctx
    assert torch.equal(s.route_row.cpu(), route_row), ctx  # −1 for the empty entries


@pytest.mark.parametrize("T, E, topk", [(1, 4, 1), (37, 5, 2), (300, 12, 3)])
def test_sorted_route_rows_bit_exact(kernel_device, T, E, topk):
    """Each route's row in the unpadded expert-sorted order: a stable sort by expert."""
    ids = make_topk_ids(T, E, topk, torch.Generator().manual_seed(T), skew=1.0)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    route_row, offsets = sorted_route_rows(ids.to(kernel_device), E, flag)
    flat = ids.reshape(-1)
    expected = torch.empty(T * topk, dtype=torch.int32)
    expected[torch.argsort(flat, stable=True)] = torch.arange(T * topk, dtype=torch.int32)
    counts = torch.bincount(flat, minlength=E)
    ctx = f"{T=} {E=} {topk=}"
    assert int(flag) == 0, ctx
    assert torch.equal(route_row.cpu(), expected), ctx
    assert torch.equal(offsets.cpu(), torch.cat([torch.zeros(1), counts.cumsum(0)]).int()), ctx
    # A token with a bad id gets no rows and sets the flag.
    ids[T // 2, 0] = E
    route_row, _ = sorted_route_rows(ids.to(kernel_device), E, flag)
    assert int(flag) & ERROR_BAD_EXPERT_ID, ctx
    bad = route_row.cpu().view(T, topk)[T // 2]
    assert (bad == -1).all(), ctx


@pytest.mark.parametrize("T, E, topk, block_m", [(1, 4, 1, 16), (37, 5, 2, 16), (300, 12, 3, 128)])
def test_route_row_inverts_row_source(kernel_device, T, E, topk, block_m):
    """route_row: each route slot's row of the padded sorted layout, so that
    row_source[route_row[s]] = s for every slot; −1 for the slots of a token with a bad id."""
    ids = make_topk_ids(T, E, topk, torch.Generator().manual_seed(T + 1), skew=1.0)
    ids[T // 2, 0] = E  # a bad id: the token's routes get no row
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    s = build_routing_schedule(ids.to(kernel_device), E, block_m, flag)
    route_row = s.route_row.cpu()
    row_source = s.row_source.cpu()
    ctx = f"{T=} {E=} {topk=} {block_m=}"
    bad = torch.zeros(T, topk, dtype=torch.bool)
    bad[T // 2] = True
    bad = bad.flatten()
    assert (route_row[bad] == -1).all(), ctx
    slots = torch.arange(T * topk, dtype=torch.int32)
    assert (route_row[~bad] >= 0).all() and (route_row[~bad] < int(s.num_rows)).all(), ctx
    assert torch.equal(row_source[route_row[~bad].long()], slots[~bad]), ctx


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="^topk_ids: expected a contiguous"):
        build_routing_schedule(torch.zeros(4, 2), 4, 16, torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="^block_m: expected a power of two"):
        build_routing_schedule(torch.zeros(4, 2, dtype=torch.long), 4, 24, torch.zeros(1, dtype=torch.int32))
