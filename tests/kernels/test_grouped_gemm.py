"""Gate/up + SwiGLU and down grouped GEMMs, and the combine, against mok.reference."""

import pytest
import torch

from mok import reference
from mok.kernels.combine import combine
from mok.kernels.grouped_gemm import down_scatter, gate_up_swiglu, routing_block_m
from mok.kernels.schedule import build_routing_schedule
from mok.testing import assert_close_to_reference, make_inputs


def _routes(inp, schedule):
    """For every placed row r: (row, slot t·topk+j, local expert)."""
    num_rows = int(schedule.num_rows)
    source = schedule.row_source[:num_rows].cpu().long()
    rows = (source >= 0).nonzero().flatten()
    experts = schedule.tile_expert.cpu().long()[rows // schedule.block_m]
    return rows, source[rows], experts


@pytest.mark.parametrize("T, H, I, E, topk, limit", [(37, 64, 48, 5, 2, None), (9, 40, 24, 3, 3, 0.5), (1, 32, 32, 4, 1, None)])
def test_gate_up_and_down_match_reference(kernel_device, T, H, I, E, topk, limit):
    inp = make_inputs(T, H, I, E, topk, seed=T, device=kernel_device)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    sched = build_routing_schedule(inp.topk_ids, E, routing_block_m(), flag)
    h, gate_up = gate_up_swiglu(inp.x, inp.w_gate, inp.w_up, sched, topk, limit, store_gate_up=True)
    y = down_scatter(h, inp.w_down, sched, T * topk)
    rows, slots, experts = _routes(inp, sched)
    assert rows.numel() == T * topk and sorted(slots.tolist()) == list(range(T * topk))
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {limit=}"
    x_rows = inp.x.cpu().float()[slots // topk]
    for e in range(E):
        mine = experts == e
        if not mine.any():
            continue
        acts = reference.swiglu_mlp_forward(x_rows[mine], inp.w_gate[e].cpu(), inp.w_up[e].cpu(), inp.w_down[e].cpu(), limit)
        r = rows[mine]
        assert_close_to_reference(gate_up[r, 0].cpu(), acts.gate, name="gate", context=ctx)
        assert_close_to_reference(gate_up[r, 1].cpu(), acts.up, name="up", context=ctx)
        assert_close_to_reference(h[r].cpu(), acts.h, name="h", context=ctx)
        # The down GEMM against its own bf16 input h, so only its output rounding counts.
        y_ref = h[r].cpu().float() @ inp.w_down[e].cpu().float().T
        assert_close_to_reference(y[slots[mine]].cpu(), y_ref, name="y", context=ctx)


def test_launchers_reject_mismatches(kernel_device):
    inp = make_inputs(8, 32, 16, 4, 2, device=kernel_device)
    sched = build_routing_schedule(inp.topk_ids, 4, routing_block_m(), torch.zeros(1, dtype=torch.int32, device=kernel_device))
    with pytest.raises(ValueError, match=r"^w_up: expected a contiguous bf16 tensor of shape \[4, 16, 32\]"):
        gate_up_swiglu(inp.x, inp.w_gate, inp.w_up.float(), sched, 2)
    with pytest.raises(ValueError, match=r"^w_gate: expected a contiguous bf16 tensor of shape \[4, 16, 32\]"):
        gate_up_swiglu(inp.x, inp.w_gate[:3].contiguous(), inp.w_up[:3].contiguous(), sched, 2)
    with pytest.raises(ValueError, match=r"^h: expected a bf16"):
        down_scatter(torch.zeros(3, 16, dtype=torch.bfloat16, device=kernel_device), inp.w_down, sched, 16)


@pytest.mark.parametrize("shared", [False, True])
def test_combine_is_the_fixed_order_sum(kernel_device, shared):
    T, H, topk = 29, 72, 3
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(T * topk, H, generator=gen).bfloat16().to(kernel_device)
    w = torch.randn(T, topk, generator=gen).to(kernel_device)
    y_shared = torch.randn(T, H, generator=gen).bfloat16().to(kernel_device) if shared else None
    out = combine(y, w, y_shared)
    acc = y_shared.float() if shared else torch.zeros(T, H, device=kernel_device)
    for j in range(topk):
        acc = acc + w[:, j, None] * y.view(T, topk, H)[:, j].float()
    if kernel_device == "cpu":
        assert torch.equal(out, acc.bfloat16()), "interpreted combine must equal the fp32 sum bit for bit"
    else:  # the GPU may contract w·y + acc into one FMA: at most one bf16 ulp apart
        assert_close_to_reference(out, acc, name="out", context=f"{shared=}")
    with pytest.raises(ValueError, match=r"^y: expected a \[87, H\]"):
        combine(y[:-1], w, y_shared)
