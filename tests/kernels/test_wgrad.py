"""Weight-gradient grouped GEMMs against per-expert fp32 sums, including experts with no
rows (exact zeros), rows past the schedule's end poisoned with NaN (must never be read),
and in-place main_grad accumulation in fp32 and bf16."""

import pytest
import torch

from mok.kernels.grouped_gemm import routing_block_m
from mok.kernels.schedule import build_routing_schedule
from mok.kernels.gather import gather_sorted_rows
from mok.kernels.wgrad import down_wgrad, gate_up_wgrad
from mok.testing import assert_close_to_reference, make_inputs


def _low_ids(T, topk, gen):
    """Only experts 0..topk+1 get tokens: the others have no rows."""
    return torch.stack([torch.randperm(topk + 2, generator=gen)[:topk] for _ in range(T)])


def _setup(T, H, I, E, topk, kernel_device, seed):
    gen = torch.Generator().manual_seed(seed)
    inp = make_inputs(T, H, I, E, topk, seed=seed, device=kernel_device, signed_weights=True, topk_ids=_low_ids(T, topk, gen))
    sched = build_routing_schedule(inp.topk_ids, E, routing_block_m(), torch.zeros(1, dtype=torch.int32, device=kernel_device))
    source = sched.row_source.cpu().long()[: int(sched.num_rows)]
    rows = (source >= 0).nonzero().flatten()
    experts = sched.tile_expert.cpu().long()[rows // sched.block_m]

    def sorted_rows(*shape):  # random bf16 at the real rows, zeros in padding (the dgrad's), NaN past num_rows
        out = torch.full((sched.capacity_rows, *shape), float("nan"), dtype=torch.bfloat16)
        out[: source.numel()] = 0
        out[rows] = torch.randn(rows.numel(), *shape, generator=gen).bfloat16()
        return out.to(kernel_device)

    d_out = torch.randn(T, H, generator=gen).bfloat16().to(kernel_device)
    return inp, sched, rows, source[rows], experts, sorted_rows, d_out, gen


def _per_expert(E, experts, fn):
    return torch.stack([fn(experts == e) for e in range(E)])


@pytest.mark.parametrize("T, H, I, E, topk", [(37, 64, 48, 6, 2), (5, 40, 24, 4, 1)])
def test_wgrad_matches_per_expert_sums(kernel_device, T, H, I, E, topk):
    inp, sched, rows, slots, experts, sorted_rows, d_out, _ = _setup(T, H, I, E, topk, kernel_device, seed=T)
    ctx = f"{T=} {H=} {I=} {E=} {topk=}"
    h, d_gate_up = sorted_rows(I), sorted_rows(2, I)
    assert sched.num_rows.item() < sched.capacity_rows, f"the test wants NaN rows past the schedule's end {ctx}"
    tokens = slots // topk
    x_rows = inp.x.cpu().float()[tokens]  # [n, H]
    dy_rows = (inp.topk_weights.cpu().view(-1)[slots, None] * d_out.cpu().float()[tokens]).bfloat16().float()  # [n, H]
    h_rows, (dg_rows, du_rows) = h.cpu().float()[rows], d_gate_up.cpu().float()[rows].unbind(1)

    x_sorted, _, dy_sorted = gather_sorted_rows(inp.x, d_out, inp.topk_weights, sched, topk)
    d_w_down = down_wgrad(dy_sorted, h, sched)
    d_w_gate, d_w_up = gate_up_wgrad(d_gate_up, x_sorted, sched)
    expected = {
        "d_w_down": (d_w_down, _per_expert(E, experts, lambda m: dy_rows[m].T @ h_rows[m])),
        "d_w_gate": (d_w_gate, _per_expert(E, experts, lambda m: dg_rows[m].T @ x_rows[m])),
        "d_w_up": (d_w_up, _per_expert(E, experts, lambda m: du_rows[m].T @ x_rows[m])),
    }
    empty = [e for e in range(E) if not (experts == e).any()]
    assert empty, f"the test wants an expert with no rows {ctx}"
    for name, (got, ref) in expected.items():
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape, f"{name} {ctx}"
        for e in range(E):
            if e in empty:
                assert torch.equal(got[e].cpu(), torch.zeros_like(got[e].cpu())), f"{name}[{e}] must be exact zeros {ctx}"
            else:
                assert_close_to_reference(got[e].cpu(), ref[e], name=f"{name}[{e}]", context=ctx, check_cosine=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wgrad_accumulates_into_main_grad(kernel_device, dtype):
    T, H, I, E, topk = 19, 32, 48, 5, 2
    inp, sched, rows, slots, experts, sorted_rows, d_out, gen = _setup(T, H, I, E, topk, kernel_device, seed=4)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} main_grad {dtype}"
    h, d_gate_up = sorted_rows(I), sorted_rows(2, I)
    x_sorted, _, dy_sorted = gather_sorted_rows(inp.x, d_out, inp.topk_weights, sched, topk)
    fresh = {"down": down_wgrad(dy_sorted, h, sched)}
    fresh["gate"], fresh["up"] = gate_up_wgrad(d_gate_up, x_sorted, sched)
    start = {
        "down": torch.randn(E, H, I, generator=gen).to(kernel_device, dtype),
        "gate": torch.randn(E, I, H, generator=gen).to(kernel_device, dtype),
        "up": torch.randn(E, I, H, generator=gen).to(kernel_device, dtype),
    }
    main = {k: v.clone() for k, v in start.items()}
    returned = down_wgrad(dy_sorted, h, sched, main_grad=main["down"])
    assert returned is main["down"]
    gate_up_wgrad(d_gate_up, x_sorted, sched, main["gate"], main["up"])
    empty = [e for e in range(E) if not (experts == e).any()]
    for name in main:
        assert main[name].dtype == dtype
        # What was added is the fp32 sum (the fresh bf16 result is its rounding).
        added = main[name].float() - start[name].float()
        assert_close_to_reference(added, fresh[name].float(), name=name, context=ctx, check_cosine=dtype == torch.float32)
        for e in empty:  # no rows: main_grad left exactly as it was
            assert torch.equal(main[name][e], start[name][e]), f"{name}[{e}] {ctx}"
    with pytest.raises(ValueError, match=r"^main_grad: expected a contiguous float32/bfloat16 tensor of shape \[5, 32, 48\]"):
        down_wgrad(dy_sorted, h, sched, main_grad=start["gate"])
    with pytest.raises(ValueError, match=r"^main_grad_gate, main_grad_up: expected both or neither"):
        gate_up_wgrad(d_gate_up, x_sorted, sched, main["gate"])


def test_wgrad_rejects_a_k_step_that_crosses_experts(kernel_device):
    """BLOCK_K must divide the schedule's M tile, or a K step would read the next expert's rows."""
    T, H, I, E, topk = 8, 32, 16, 3, 2
    inp, sched, _, _, _, sorted_rows, d_out, _ = _setup(T, H, I, E, topk, kernel_device, seed=2)
    cfg = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=3 * sched.block_m // 2 if sched.block_m % 2 == 0 else sched.block_m + 1,
               num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match=r"^schedule: expected a block_m that BLOCK_K="):
        down_wgrad(sorted_rows(H), sorted_rows(I), sched, tile_config=cfg)
    with pytest.raises(ValueError, match=r"^schedule: expected a block_m that BLOCK_K="):
        gate_up_wgrad(sorted_rows(2, I), sorted_rows(H), sched, tile_config=cfg)
