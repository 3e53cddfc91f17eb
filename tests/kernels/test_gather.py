"""Gathering token rows into the sorted layout: every real row equals its token's row and
padding rows are exact zeros."""

import pytest
import torch

from mok.kernels.gather import gather_sorted_rows
from mok.kernels.grouped_gemm import routing_block_m
from mok.kernels.schedule import build_routing_schedule
from mok.testing import make_inputs


@pytest.mark.parametrize("T, H, E, topk", [(37, 40, 5, 2), (1, 16, 3, 3), (50, 600, 4, 1)])
def test_gather_sorted_rows(kernel_device, T, H, E, topk):
    inp = make_inputs(T, H, 16, E, topk, seed=T, device=kernel_device)
    sched = build_routing_schedule(inp.topk_ids, E, routing_block_m(), torch.zeros(1, dtype=torch.int32, device=kernel_device))
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).bfloat16().to(kernel_device)
    x_sorted, d_out_sorted = gather_sorted_rows(inp.x, d_out, sched, topk)
    only_x, none = gather_sorted_rows(inp.x, None, sched, topk)
    ctx = f"{T=} {H=} {E=} {topk=}"
    assert none is None and x_sorted.shape == (sched.capacity_rows, H), ctx
    num_rows = int(sched.num_rows)
    source = sched.row_source.cpu().long()[:num_rows]
    real, pad = (source >= 0).nonzero().flatten(), (source < 0).nonzero().flatten()
    assert pad.numel() > 0, f"the test wants padding rows {ctx}"
    for name, got, src in (("x_sorted", x_sorted, inp.x), ("d_out_sorted", d_out_sorted, d_out), ("x only", only_x, inp.x)):
        got = got.cpu()[:num_rows]
        assert torch.equal(got[real], src.cpu()[source[real] // topk]), f"{name} {ctx}"
        assert torch.equal(got[pad], torch.zeros(pad.numel(), H, dtype=torch.bfloat16)), f"{name} {ctx}"


def test_gather_rejects_bad_inputs(kernel_device):
    inp = make_inputs(8, 32, 16, 4, 2, device=kernel_device)
    sched = build_routing_schedule(inp.topk_ids, 4, routing_block_m(), torch.zeros(1, dtype=torch.int32, device=kernel_device))
    with pytest.raises(ValueError, match=r"^a: expected a bf16 \[T, H\] tensor"):
        gather_sorted_rows(inp.x.float(), None, sched, 2)
    with pytest.raises(ValueError, match=r"^b: expected a bf16 \[8, 32\] tensor"):
        gather_sorted_rows(inp.x, inp.x[:4], sched, 2)
