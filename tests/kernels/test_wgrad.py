"""Weight-gradient grouped GEMMs (bf16 and fp8_block) against per-expert fp32 sums, including
experts with no rows (exact zeros), rows past the schedule's end poisoned with NaN (must never
be read), and in-place main_grad accumulation in fp32 and bf16."""

import pytest
import torch

from mok.kernels.gemm import hopper_common as ws
from mok.kernels.common import num_sms
from mok.kernels.gemm.common import routing_block_m
from mok.kernels.quant.fp8_block import (
    quantize_fp8_block_sorted_t,
    quantize_fp8_block_swiglu_sorted_t,
    sorted_scale_rows,
)
from mok.kernels.routing.schedule import build_routing_schedule
from mok.kernels.routing.gather import gather_sorted_rows
from mok.kernels.gemm.wgrad import (
    down_wgrad,
    down_wgrad_fp8_block,
    gate_up_wgrad,
    gate_up_wgrad_fp8_block,
    wgrad_config,
)
from mok.testing import assert_close_to_reference, make_inputs
from mok.testing.fp8 import dequantize_sorted_t


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


# Slack for another fp32 order inside one MMA step, relative to a tensor's largest value.
_FP32_ORDER_SLACK = 2.0**-20


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


def test_wgrad_persistent_launch_is_bitwise_the_same(kernel_device):
    """A persistent launch (fewer programs than tiles, each walking several, empty experts
    among them) gives both wgrads bit for bit, fresh and accumulating into main_grad."""
    # the GPU launches one program per SM: enough tiles that each program walks several
    T, H, I, E, topk = (37, 64, 48, 6, 2) if kernel_device == "cpu" else (301, 2048, 1024, 6, 2)
    inp, sched, rows, slots, experts, sorted_rows, d_out, gen = _setup(T, H, I, E, topk, kernel_device, seed=T + 7)
    ctx = f"{T=} {H=} {I=} {E=} {topk=}"
    h, d_gate_up = sorted_rows(I), sorted_rows(2, I)
    x_sorted, _, dy_sorted = gather_sorted_rows(inp.x, d_out, inp.topk_weights, sched, topk)
    down_cfg = dict(wgrad_config("down", H, I, allow_warp_specialized=False), PERSISTENT=True)
    gate_up_cfg = dict(wgrad_config("gate_up", I, H), PERSISTENT=True)
    tiles = E * -(-H // down_cfg["BLOCK_M"]) * -(-I // down_cfg["BLOCK_N"])
    assert tiles > 2 * num_sms(torch.device(kernel_device)), f"the test wants programs that walk several tiles {ctx}"
    assert torch.equal(down_wgrad(dy_sorted, h, sched, tile_config=down_cfg), down_wgrad(dy_sorted, h, sched)), ctx
    d_w_gate, d_w_up = gate_up_wgrad(d_gate_up, x_sorted, sched)
    persistent = gate_up_wgrad(d_gate_up, x_sorted, sched, tile_config=gate_up_cfg)
    assert torch.equal(persistent[0], d_w_gate) and torch.equal(persistent[1], d_w_up), ctx
    start = torch.randn(E, H, I, generator=gen).to(kernel_device)
    main, main_persistent = start.clone(), start.clone()
    down_wgrad(dy_sorted, h, sched, main_grad=main)
    down_wgrad(dy_sorted, h, sched, main_grad=main_persistent, tile_config=down_cfg)
    assert torch.equal(main, main_persistent) and not torch.equal(main, start), f"accumulated {ctx}"


@pytest.mark.parametrize("group_m", [2, 3])
def test_wgrad_tile_order_is_bitwise_the_same(kernel_device, group_m):
    """GROUP_M row tiles per column sweep within each expert (per tile and persistent) only
    reorders the tiles: both wgrads bit for bit, row-tile counts not multiples of GROUP_M
    (5 and 7 row tiles at the interpreter's BLOCK_M of 32, 5 and 5 at the GPU's 128)."""
    T, H, I, E, topk = (37, 136, 200, 6, 2) if kernel_device == "cpu" else (301, 632, 600, 6, 2)
    inp, sched, _, _, _, sorted_rows, d_out, _ = _setup(T, H, I, E, topk, kernel_device, seed=T + 11)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {group_m=}"
    h, d_gate_up = sorted_rows(I), sorted_rows(2, I)
    x_sorted, _, dy_sorted = gather_sorted_rows(inp.x, d_out, inp.topk_weights, sched, topk)
    down_cfg = wgrad_config("down", H, I, allow_warp_specialized=False)
    gate_up_cfg = wgrad_config("gate_up", I, H, allow_warp_specialized=False)
    assert -(-H // down_cfg["BLOCK_M"]) % group_m and -(-I // gate_up_cfg["BLOCK_M"]) % group_m, ctx
    d_w_down = down_wgrad(dy_sorted, h, sched, tile_config=down_cfg)
    d_w_gate, d_w_up = gate_up_wgrad(d_gate_up, x_sorted, sched, tile_config=gate_up_cfg)
    for persistent in (False, True):
        order = dict(GROUP_M=group_m, PERSISTENT=persistent)
        assert torch.equal(down_wgrad(dy_sorted, h, sched, tile_config={**down_cfg, **order}), d_w_down), ctx
        reordered = gate_up_wgrad(d_gate_up, x_sorted, sched, tile_config={**gate_up_cfg, **order})
        assert torch.equal(reordered[0], d_w_gate) and torch.equal(reordered[1], d_w_up), f"{persistent=} {ctx}"


@pytest.mark.parametrize("persistent", [False, True])
def test_gate_up_wgrad_stacked_equals_the_two_output_launch(kernel_device, persistent):
    """The gate/up wgrad as one [2·I, H] output (tile-config flag STACKED: one accumulator,
    its rows split between d_w_gate and d_w_up) gives both gradients as the two-accumulator
    launch, with M tiles that straddle the gate/up boundary, fresh and accumulating into
    main_grad: equal up to the fp32 order inside an MMA step (the interpreter's NumPy matmul
    sums a step in an order that depends on the tile's shape), far below any misplaced row."""
    # I is not a multiple of BLOCK_M (32 under the interpreter, 128 on the GPU)
    T, H, I, E, topk = (37, 64, 48, 6, 2) if kernel_device == "cpu" else (301, 1024, 200, 6, 2)
    inp, sched, _, _, _, sorted_rows, d_out, gen = _setup(T, H, I, E, topk, kernel_device, seed=T + 3)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {persistent=}"
    d_gate_up = sorted_rows(2, I)
    x_sorted, _, _ = gather_sorted_rows(inp.x, d_out, inp.topk_weights, sched, topk)
    base = wgrad_config("gate_up", I, H, allow_warp_specialized=False)
    two = dict(base, STACKED=False, PERSISTENT=persistent)
    stacked = dict(base, STACKED=True, PERSISTENT=persistent)
    assert I % stacked["BLOCK_M"], f"the test wants an M tile across the gate/up boundary {ctx}"
    expected = gate_up_wgrad(d_gate_up, x_sorted, sched, tile_config=two)
    got = gate_up_wgrad(d_gate_up, x_sorted, sched, tile_config=stacked)
    for name, g, e in zip(("d_w_gate", "d_w_up"), got, expected):
        _assert_order_close(g, e, _FP32_ORDER_SLACK, name, ctx)
    start = torch.randn(2, E, I, H, generator=gen).to(kernel_device)
    main_two, main_stacked = start.clone(), start.clone()
    gate_up_wgrad(d_gate_up, x_sorted, sched, *main_two, tile_config=two)
    gate_up_wgrad(d_gate_up, x_sorted, sched, *main_stacked, tile_config=stacked)
    assert not torch.equal(main_two, start), f"accumulated {ctx}"
    _assert_order_close(main_stacked - start, main_two - start, _FP32_ORDER_SLACK, "main_grad", ctx)
    with pytest.raises(ValueError, match=r"^tile_config: STACKED is for the gate/up wgrad"):
        down_wgrad(sorted_rows(H), sorted_rows(I), sched, tile_config=stacked)


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


@pytest.mark.parametrize("warp_specialized", [False, True])
def test_wgrad_steps_stop_at_the_routes(kernel_device, warp_specialized):
    """The K loop covers each expert's routes rounded up to BLOCK_K, not the padding rows past
    that: NaN there changes no gradient, bit for bit (the Triton kernels at a BLOCK_K under the
    schedule's M tile, and on Hopper the warp-specialized ones)."""
    if warp_specialized and not ws.available_here():
        pytest.skip("the warp-specialized kernels need a Hopper GPU")
    T, H, I, E, topk = (37, 64, 48, 6, 2) if kernel_device == "cpu" else (301, 256, 384, 6, 2)
    inp, sched, _, _, _, sorted_rows, d_out, _ = _setup(T, H, I, E, topk, kernel_device, seed=T + 6)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {warp_specialized=}"
    h, d_gate_up = sorted_rows(I), sorted_rows(2, I)
    x_sorted, _, dy_sorted = gather_sorted_rows(inp.x, d_out, inp.topk_weights, sched, topk)
    block_k = sched.block_m // 2
    down_cfg = wgrad_config("down", H, I, allow_warp_specialized=warp_specialized)
    gate_up_cfg = wgrad_config("gate_up", I, H, allow_warp_specialized=warp_specialized)
    if not warp_specialized:
        down_cfg, gate_up_cfg = dict(down_cfg, BLOCK_K=block_k), dict(gate_up_cfg, BLOCK_K=block_k)
    assert down_cfg["BLOCK_K"] == gate_up_cfg["BLOCK_K"] == block_k, ctx
    clean = (down_wgrad(dy_sorted, h, sched, tile_config=down_cfg),
             *gate_up_wgrad(d_gate_up, x_sorted, sched, tile_config=gate_up_cfg))
    offsets, counts = sched.expert_offsets.cpu(), sched.expert_counts.cpu()
    skipped = torch.cat([torch.arange(int(offsets[e]) + -(-int(counts[e]) // block_k) * block_k, int(offsets[e + 1]))
                         for e in range(E)])
    assert skipped.numel() > 0, f"the test wants an expert with a whole step of padding {ctx}"
    for operand in (h, d_gate_up, x_sorted, dy_sorted):
        operand[skipped.to(kernel_device)] = float("nan")
    poisoned = (down_wgrad(dy_sorted, h, sched, tile_config=down_cfg),
                *gate_up_wgrad(d_gate_up, x_sorted, sched, tile_config=gate_up_cfg))
    for name, got, want in zip(("d_w_down", "d_w_gate", "d_w_up"), poisoned, clean):
        assert not want.isnan().any() and torch.equal(got, want), f"{name} {ctx}"


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


# --------------------------------------------------------------------------- fp8_block

# Slack for fp32 accumulation order, relative to a tensor's largest value (as in
# test_grouped_gemm.py): NumPy's fp32 matmul under the interpreter is near exact; Hopper's FP8
# MMA keeps fewer accumulator bits inside each 128-wide step.
_FP8_ORDER_SLACK = {"cpu": 2.0**-18, "cuda": 2.0**-11}


def _assert_order_close(actual, expected, slack, name, ctx):
    """bf16 output rounding (2^-8 relative, twice RNE's bound) plus accumulation-order slack."""
    atol = slack * expected.abs().max().item()
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=2.0**-8, atol=atol, msg=lambda m: f"{name} {ctx}: {m}"
    )


@pytest.mark.parametrize(
    "T, H, I, E, topk, limit, main_grad", [(270, 128, 128, 5, 2, 0.5, False), (1, 256, 128, 3, 1, None, True)]
)
def test_fp8_block_wgrad(kernel_device, T, H, I, E, topk, limit, main_grad):
    """Operands quantized along the sorted rows (x, w·dOut, d_g|d_u, and h from g, u), then the
    fp8_block wgrads against the same quantized math in torch (fp32 accumulation-order tolerance)
    and against fp32 sums of the unquantized operands (the fp8_block accuracy bars); experts without
    rows give exact zeros, and (`main_grad`) accumulation into fp32 buffers adds the same sums.
    T = 270 gives experts more than 128 rows (several scale blocks each, the last ragged)."""
    _, sched, rows, _, experts, sorted_rows, _, gen = _setup(T, H, I, E, topk, kernel_device, seed=T + 1)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {limit=} block_m={sched.block_m}"
    assert T == 1 or experts.bincount().max() > 128, f"the test wants experts with several row blocks {ctx}"
    slack = _FP8_ORDER_SLACK[kernel_device]
    # Random rows stand in for gather.py's x_sorted and w·dOut (zeros at padding, NaN past num_rows).
    gate_up, d_gate_up, x_sorted, dy_sorted = sorted_rows(2, I), sorted_rows(2, I), sorted_rows(H), sorted_rows(H)
    operands = {
        "x": quantize_fp8_block_sorted_t(x_sorted, sched),  # [H, rows], [rows / S, H]
        "dy": quantize_fp8_block_sorted_t(dy_sorted, sched),
        "d_gate_up": quantize_fp8_block_sorted_t(d_gate_up.flatten(1), sched),  # [2·I, rows]
        "h": quantize_fp8_block_swiglu_sorted_t(gate_up, sched, limit),  # [I, rows]
    }
    d_w_down = down_wgrad_fp8_block(*operands["dy"], *operands["h"], sched)
    d_w_gate, d_w_up = gate_up_wgrad_fp8_block(*operands["d_gate_up"], *operands["x"], sched)

    deq = {name: dequantize_sorted_t(*pair, sched.expert_offsets, sched.block_m)[rows]
           for name, pair in operands.items()}
    g, u = gate_up.cpu().float()[rows].unbind(1)
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    unquantized = {
        "x": x_sorted.cpu().float()[rows],
        "dy": dy_sorted.cpu().float()[rows],
        "d_gate_up": d_gate_up.cpu().float()[rows].flatten(1),
        "h": torch.nn.functional.silu(g) * u,
    }
    expected = {}
    for kind, ops in (("statement", deq), ("reference", unquantized)):
        expected[kind] = {
            "d_w_down": _per_expert(E, experts, lambda m: ops["dy"][m].T @ ops["h"][m]),
            "d_w_gate": _per_expert(E, experts, lambda m: ops["d_gate_up"][m, :I].T @ ops["x"][m]),
            "d_w_up": _per_expert(E, experts, lambda m: ops["d_gate_up"][m, I:].T @ ops["x"][m]),
        }
    empty = [e for e in range(E) if not (experts == e).any()]
    assert empty, f"the test wants an expert with no rows {ctx}"
    for name, got in (("d_w_down", d_w_down), ("d_w_gate", d_w_gate), ("d_w_up", d_w_up)):
        assert got.dtype == torch.bfloat16 and got.shape == expected["statement"][name].shape, f"{name} {ctx}"
        used = [e for e in range(E) if e not in empty]
        _assert_order_close(got.cpu()[used], expected["statement"][name][used], slack, name, ctx)
        assert_close_to_reference(got.cpu()[used], expected["reference"][name][used], "fp8_block", name=name,
                                  context=ctx, check_cosine=True)
        assert torch.equal(got.cpu()[empty], torch.zeros_like(got.cpu()[empty])), f"{name}: empty experts {ctx}"
    if not main_grad:
        return
    main = {name: torch.randn(t.shape, generator=gen).to(kernel_device) for name, t in
            (("down", d_w_down), ("gate", d_w_gate), ("up", d_w_up))}
    start = {name: t.clone() for name, t in main.items()}
    assert down_wgrad_fp8_block(*operands["dy"], *operands["h"], sched, main_grad=main["down"]) is main["down"]
    gate_up_wgrad_fp8_block(*operands["d_gate_up"], *operands["x"], sched, main["gate"], main["up"])
    for name, fresh in (("down", d_w_down), ("gate", d_w_gate), ("up", d_w_up)):
        assert_close_to_reference(main[name] - start[name], fresh.float(), name=f"main_grad {name}", context=ctx)
        assert torch.equal(main[name][empty], start[name][empty]), f"main_grad {name}: empty experts {ctx}"


def test_fp8_block_gate_up_wgrad_stacked_equals_the_two_output_launch(kernel_device):
    """fp8_block: d_g|d_u's transposed copy as one stacked A operand (STACKED), its scales read
    across both halves, gives both gradients as the two-accumulator launch."""
    T, H, I, E, topk = 270, 256, 128, 5, 2
    _, sched, _, _, _, sorted_rows, _, _ = _setup(T, H, I, E, topk, kernel_device, seed=T + 2)
    ctx = f"{T=} {H=} {I=} {E=} {topk=}"
    d_gate_up = quantize_fp8_block_sorted_t(sorted_rows(2 * I), sched)  # [2·I, rows], [rows / S, 2·I]
    x = quantize_fp8_block_sorted_t(sorted_rows(H), sched)
    base = wgrad_config("gate_up", I, H, "fp8_block", allow_warp_specialized=False)
    expected = gate_up_wgrad_fp8_block(*d_gate_up, *x, sched, tile_config=dict(base, STACKED=False))
    got = gate_up_wgrad_fp8_block(*d_gate_up, *x, sched, tile_config=dict(base, STACKED=True))
    assert got[0].abs().sum() > 0 and got[1].abs().sum() > 0, ctx
    for name, g, e in zip(("d_w_gate", "d_w_up"), got, expected):
        _assert_order_close(g, e, _FP32_ORDER_SLACK, name, ctx)


def test_fp8_block_wgrad_rejects_mismatches(kernel_device):
    T, H, I, E, topk = 8, 128, 128, 3, 2
    inp, sched, _, _, _, sorted_rows, _, _ = _setup(T, H, I, E, topk, kernel_device, seed=5)
    dy, h = (quantize_fp8_block_sorted_t(sorted_rows(w), sched) for w in (H, I))
    d_gate_up = quantize_fp8_block_sorted_t(sorted_rows(2 * I), sched)
    rows = sched.capacity_rows
    tiles = wgrad_config("down", H, I, "fp8_block")
    # A schedule of 256-row tiles lets a 256-row K step stay inside one expert, but not inside one scale block.
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    wide = build_routing_schedule(inp.topk_ids, E, 256, flag)
    wide_dy, wide_h = (quantize_fp8_block_sorted_t(torch.zeros(wide.capacity_rows, w, device=kernel_device), wide)
                       for w in (H, I))
    cases = [
        (lambda: down_wgrad_fp8_block(dy[0][:, :-16], dy[1], *h, sched),
         rf"^dy_t_q: expected a contiguous float8_e4m3fn tensor of shape \[128, {rows}\] "
         rf"on .*, got .* \[128, {rows - 16}\]"),
        (lambda: down_wgrad_fp8_block(*dy, h[0], h[1][:, :64], sched),
         r"^h_t_scale: expected a contiguous float32 tensor of shape \[\d+, 128\]"),
        (lambda: down_wgrad_fp8_block(*dy, *h, sched, main_grad=torch.zeros(E, I, H + 128, device=kernel_device)),
         r"^main_grad: expected a contiguous float32/bfloat16 tensor of shape \[3, 128, 128\]"),
        (lambda: gate_up_wgrad_fp8_block(d_gate_up[0][1:], d_gate_up[1], *dy, sched),
         r"^d_gate_up_t_q: expected a 2-D \[2·I, capacity_rows\] tensor"),
        (lambda: gate_up_wgrad_fp8_block(*d_gate_up, dy[0].float(), dy[1], sched),
         r"^x_t_q: expected a contiguous float8_e4m3fn tensor"),
        (lambda: down_wgrad_fp8_block(*dy, *h, sched, tile_config={**tiles, "BLOCK_K": 3 * sched.block_m}),
         r"^schedule: expected a block_m that BLOCK_K="),
        (lambda: down_wgrad_fp8_block(*wide_dy, *wide_h, wide, tile_config={**tiles, "BLOCK_K": 256}),
         r"^tile_config: expected a BLOCK_K that divides 128 \(the scale block\) for the fp8_block wgrad, got 256"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_fp8_block_backward_ops_and_fake_impls(kernel_device):
    """The fp8_block quantizer and wgrad custom ops: fake impls with the real shapes and dtypes
    (what torch.compile and CUDA graphs rely on). The layer tests run them for real."""
    from mok import ops

    T, H, I, E, topk = 6, 128, 128, 2, 2
    inp = make_inputs(T, H, I, E, topk, seed=7, device=kernel_device)
    block_m = routing_block_m()
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    routing = ops.routing_schedule(inp.topk_ids, flag, E, block_m)
    rows = routing.capacity_rows
    gen = torch.Generator().manual_seed(7)
    gate_up = torch.randn(rows, 2, I, generator=gen).bfloat16().to(kernel_device)
    x_sorted = torch.randn(rows, H, generator=gen).bfloat16().to(kernel_device)
    scale_rows = rows // sorted_scale_rows(block_m)
    fp8 = lambda *shape: torch.randn(*shape, generator=gen).to(kernel_device, torch.float8_e4m3fn)  # noqa: E731
    scales = lambda width: torch.rand(scale_rows, width, generator=gen).to(kernel_device)  # noqa: E731
    x_t, h_t, d_gate_up_t = (fp8(H, rows), scales(H)), (fp8(I, rows), scales(I)), (fp8(2 * I, rows), scales(2 * I))
    zeros = lambda *shape: torch.zeros(*shape, device=kernel_device)  # noqa: E731
    cases = [
        (ops.quantize_fp8_block_activations, (x_sorted, routing.num_rows)),
        (ops.quantize_fp8_block_weights, (inp.w_gate,)),
        (ops.quantize_fp8_block_sorted_t, (x_sorted, routing)),
        (ops.quantize_fp8_block_swiglu_sorted_t, (gate_up, routing, 0.5)),
        (ops.down_wgrad, (x_t[0], h_t[0], routing, x_t[1], h_t[1])),
        (ops.gate_up_wgrad, (d_gate_up_t[0], x_t[0], routing, d_gate_up_t[1], x_t[1])),
        (ops.down_wgrad_accumulate, (zeros(E, H, I), x_t[0], h_t[0], routing, x_t[1], h_t[1])),
        (ops.gate_up_wgrad_accumulate,
         (zeros(E, I, H), zeros(E, I, H), d_gate_up_t[0], x_t[0], routing, d_gate_up_t[1], x_t[1])),
    ]
    # Fake impls only: opcheck's schema test compares inputs with float ops that float8 lacks on the
    # CPU; the accumulating ops declare their mutations as the bf16 ones, whose schema is checked.
    for op, args in cases:
        torch.library.opcheck(op.op, op.op_args(*args), test_utils=("test_faketensor",))
