"""`mok.expert_counts` and `MoKMoE(..., expert_counts_out=)`: routes per global expert, on
the device, equal to a plain count of topk_ids (summed over the ranks under EP)."""

import pytest
import torch
import torch.distributed as dist

import mok
from mok.testing import make_topk_ids
from mok.testing.distributed import run_distributed


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("T, E, topk", [(1, 1, 1), (37, 8, 2), (256, 128, 8)])
def test_counts_equal_bincount(device, T, E, topk):
    ids = make_topk_ids(T, E, topk, device=device)
    counts = mok.expert_counts(ids, E)
    expected = torch.bincount(ids.flatten().long(), minlength=E)
    assert counts.dtype == torch.int32 and counts.device == ids.device, f"{T=} {E=} {topk=}"
    assert torch.equal(counts.long(), expected), f"{T=} {E=} {topk=}: {counts.tolist()} vs {expected.tolist()}"


def test_counts_into_a_buffer_and_bad_ids_count_nowhere():
    ids = torch.tensor([[0, 3], [3, 1], [9, -1]])
    out = torch.full((4,), 7, dtype=torch.int64)
    assert mok.expert_counts(ids, 4, out=out) is out
    assert out.tolist() == [1, 1, 0, 2]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(topk_ids=torch.zeros(2, 2)), TypeError, "topk_ids"),
        (dict(num_experts=0), ValueError, "num_experts"),
        (dict(out=torch.zeros(3, dtype=torch.int32)), ValueError, "out"),
        (dict(out=torch.zeros(4)), TypeError, "out"),
    ],
)
def test_counts_argument_errors(kwargs, error, match):
    args = {"topk_ids": torch.zeros(2, 2, dtype=torch.int64), "num_experts": 4, **kwargs}
    with pytest.raises(error, match=match):
        mok.expert_counts(args.pop("topk_ids"), args.pop("num_experts"), **args)


def test_module_writes_counts():
    layer = mok.MoKMoE(32, 16, num_experts=6, topk=2)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    ids = make_topk_ids(10, 6, 2).view(2, 5, 2)
    counts = torch.zeros(6, dtype=torch.int64)
    layer(x, ids, torch.rand(2, 5, 2), expert_counts_out=counts)
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=6))


@pytest.mark.gpu
def test_counts_need_no_host_sync():
    ids = make_topk_ids(512, 64, 4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mok.expert_counts(ids, 64)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _ep_counts(rank: int, world_size: int) -> bool:
    E = 8
    torch.manual_seed(rank)
    ids = make_topk_ids(5 + rank, E, 3)
    counts = mok.expert_counts(ids, E, group=dist.group.WORLD)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, ids)
    return torch.equal(counts.long(), torch.bincount(torch.cat(gathered).flatten().long(), minlength=E))


def test_counts_sum_over_the_ep_group():
    assert run_distributed(_ep_counts, 2, timeout_s=120) == [True, True]
