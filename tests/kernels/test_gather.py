"""The backward's prologue: every real sorted row equals its token's row (and w·dOut its
router-weighted row, rounded once to bf16), padding rows are exact zeros."""

import pytest
import torch

from mok import ops
from mok.kernels.routing.gather import gather_sorted_rows
from mok.kernels.gemm.common import routing_block_m
from mok.kernels.quant.mxfp8 import mxfp8_round
from mok.kernels.routing.schedule import build_routing_schedule
from mok.testing import make_inputs


@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("T, H, E, topk", [(37, 40, 5, 2), (1, 16, 3, 3), (50, 600, 4, 1), (21, 72, 6, 4)])
def test_gather_sorted_rows(kernel_device, set_plan, T, H, E, topk, token_major):
    """Both orders of the copy (row-major, token-major) at every topk."""
    set_plan(token_major_min_topk=1 if token_major else topk + 1)
    inp = make_inputs(T, H, 16, E, topk, seed=T, device=kernel_device)
    sched = build_routing_schedule(inp.topk_ids, E, routing_block_m(), torch.zeros(1, dtype=torch.int32, device=kernel_device))
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).bfloat16().to(kernel_device)
    x_sorted, d_out_sorted, dy_sorted = gather_sorted_rows(inp.x, d_out, inp.topk_weights, sched, topk)
    unweighted = gather_sorted_rows(inp.x, d_out, None, sched, topk)
    ctx = f"{T=} {H=} {E=} {topk=} {token_major=}"
    assert unweighted[2] is None and x_sorted.shape == dy_sorted.shape == (sched.capacity_rows, H), ctx
    num_rows = int(sched.num_rows)
    source = sched.row_source.cpu().long()[:num_rows]
    real, pad = (source >= 0).nonzero().flatten(), (source < 0).nonzero().flatten()
    assert pad.numel() > 0, f"the test wants padding rows {ctx}"
    tokens = source[real] // topk
    w = inp.topk_weights.cpu().view(-1)[source[real]]
    expected = {
        "x_sorted": (x_sorted, inp.x.cpu()[tokens]),
        "d_out_sorted": (d_out_sorted, d_out.cpu()[tokens]),
        "dy_sorted": (dy_sorted, (w[:, None] * d_out.cpu().float()[tokens]).bfloat16()),
        "x_sorted (unweighted call)": (unweighted[0], inp.x.cpu()[tokens]),
        "d_out_sorted (unweighted call)": (unweighted[1], d_out.cpu()[tokens]),
    }
    for name, (got, want) in expected.items():
        got = got.cpu()[:num_rows]
        assert torch.equal(got[real], want), f"{name} {ctx}"
        assert torch.equal(got[pad], torch.zeros(pad.numel(), H, dtype=torch.bfloat16)), f"{name} {ctx}"
    _check_apart_is_together(inp.x, d_out, inp.topk_weights, sched, topk, False, ctx)


def _check_apart_is_together(x, d_out, topk_weights, sched, topk: int, mxfp8: bool, ctx: str) -> None:
    """x's copy alone, then dOut's alone (under expert parallelism x's runs while dOut travels):
    bitwise the copies made together; the absent ones None."""
    together = gather_sorted_rows(x, d_out, topk_weights, sched, topk, mxfp8)
    x_alone = gather_sorted_rows(x, None, None, sched, topk, mxfp8)
    d_out_alone = gather_sorted_rows(None, d_out, topk_weights, sched, topk, mxfp8)
    assert x_alone[1:] == (None, None) and d_out_alone[0] is None, ctx
    for args in ((x, None, None, sched, topk, mxfp8), (None, d_out, topk_weights, sched, topk, mxfp8)):
        torch.library.opcheck(ops.gather_sorted_rows.op, ops.gather_sorted_rows.op_args(*args),
                              test_utils=("test_faketensor",))
    num_rows = int(sched.num_rows)
    for name, a, b in zip(("x_sorted", "d_out_sorted", "dy_sorted"), together, (x_alone[0], *d_out_alone[1:])):
        assert torch.equal(a[:num_rows], b[:num_rows]), f"{name} apart differs {mxfp8=} {ctx}"


def test_gather_rejects_bad_inputs(kernel_device):
    inp = make_inputs(8, 32, 16, 4, 2, device=kernel_device)
    sched = build_routing_schedule(inp.topk_ids, 4, routing_block_m(), torch.zeros(1, dtype=torch.int32, device=kernel_device))
    with pytest.raises(ValueError, match=r"^x: expected a bf16 \[T, H\] tensor"):
        gather_sorted_rows(inp.x.float(), inp.x, None, sched, 2)
    with pytest.raises(ValueError, match=r"^d_out: expected a bfloat16 \[8, 32\] tensor"):
        gather_sorted_rows(inp.x, inp.x[:4], None, sched, 2)
    with pytest.raises(ValueError, match=r"^topk_weights: expected a float32 \[8, 2\] tensor"):
        gather_sorted_rows(inp.x, inp.x, inp.topk_weights[:, :1], sched, 2)
    with pytest.raises(ValueError, match=r"^x, d_out: expected at least one of them"):
        gather_sorted_rows(None, None, None, sched, 2)
    with pytest.raises(ValueError, match=r"^d_out: expected a bf16 \[T, H\] tensor"):
        gather_sorted_rows(None, inp.x.float(), None, sched, 2)


@pytest.mark.parametrize("T, H, E, topk", [(37, 64, 5, 2), (50, 608, 4, 1)])
def test_gather_mxfp8_rounds_each_copy_for_its_gemm(kernel_device, T, H, E, topk):
    """mxfp8: d_out_sorted on the grid along H, x_sorted and dy_sorted along the sorted rows (dy
    from the fp32 product w·dOut), each equal to `mxfp8_round` of the plain copy."""
    inp = make_inputs(T, H, 32, E, topk, seed=T + 1, device=kernel_device)
    sched = build_routing_schedule(inp.topk_ids, E, routing_block_m(), torch.zeros(1, dtype=torch.int32, device=kernel_device))
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).bfloat16().to(kernel_device)
    x_mx, d_out_mx, dy_mx = gather_sorted_rows(inp.x, d_out, inp.topk_weights, sched, topk, mxfp8=True)
    x_plain, d_out_plain, _ = gather_sorted_rows(inp.x, d_out, inp.topk_weights, sched, topk)
    num_rows = int(sched.num_rows)
    source = sched.row_source[:num_rows].long()
    real = source >= 0
    w = torch.where(real, inp.topk_weights.view(-1)[source.clamp(min=0)], 0.0)  # [num_rows] fp32
    dy_fp32 = w[:, None] * d_out_plain[:num_rows].float()
    expected = {
        "x_sorted": (x_mx, mxfp8_round(x_plain[:num_rows], False, True)[1]),
        "d_out_sorted": (d_out_mx, mxfp8_round(d_out_plain[:num_rows], True, False)[0]),
        "dy_sorted": (dy_mx, mxfp8_round(dy_fp32, False, True)[1]),
    }
    ctx = f"{T=} {H=} {E=} {topk=}"
    for name, (got, want) in expected.items():
        assert torch.equal(got[:num_rows], want), f"{name} {ctx}"
    assert not torch.equal(x_mx[:num_rows], x_plain[:num_rows]), f"x_sorted must be rounded {ctx}"
    _check_apart_is_together(inp.x, d_out, inp.topk_weights, sched, topk, True, ctx)
