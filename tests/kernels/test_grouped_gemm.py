"""Gate/up + SwiGLU and down grouped GEMMs (bf16 and fp8_block), and the combine, against mok.reference."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from mok import ops, reference
from mok.fp8_block import fp8_block_dequantize, fp8_block_quantize
from mok.kernels.routing.combine import combine
from mok.kernels.common import last_wave_tile_coordinates, num_sms
from mok.kernels.gemm.common import gemm_config, routing_block_m, scatter_grid
from mok.kernels.gemm.down import down_scatter, down_scatter_fp8_block
from mok.kernels.gemm.gate_up import gate_up_packed, gate_up_swiglu, gate_up_swiglu_fp8_block
from mok.kernels.gemm.dgrad import dgrad_config, gate_up_dgrad_scatter
from mok.kernels.quant.fp8_block import quantize_fp8_block_activations
from mok.kernels.routing.schedule import build_routing_schedule
from mok.testing import assert_close_to_reference, make_inputs, make_topk_ids


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


def _apart(w_gate, w_up):
    """Copies of a gate/up pair that are certainly not packed: a gap between them."""
    spaced = torch.stack([w_gate, torch.empty_like(w_gate), w_up])
    return spaced[0], spaced[2]


@pytest.mark.parametrize("T, H, I, E, topk, limit", [(37, 64, 48, 5, 2, None), (9, 40, 24, 3, 3, 0.5)])
def test_gate_up_paths_are_bitwise_the_same(kernel_device, T, H, I, E, topk, limit):
    """X_SORTED (x copied to the sorted layout, read through TMA) and packed weights (one
    2·BLOCK_N-wide dot per K step) change where the operands come from, not the sum: h and
    g, u are bitwise those of gathered loads and separate weights."""
    inp = make_inputs(T, H, I, E, topk, seed=T + 1, device=kernel_device)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    sched = build_routing_schedule(inp.topk_ids, E, routing_block_m(), flag)
    num_rows = int(sched.num_rows)
    separate = _apart(inp.w_gate, inp.w_up)
    assert gate_up_packed(inp.w_gate, inp.w_up) and not gate_up_packed(*separate)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {limit=}"
    first = None
    for x_sorted in (False, True):
        for weights, packed in ((separate, False), ((inp.w_gate, inp.w_up), True)):
            cfg = {**gemm_config("gate_up", I, H), "X_SORTED": x_sorted, "PACKED": packed}
            h, gate_up = gate_up_swiglu(inp.x, *weights, sched, topk, limit, True, tile_config=cfg)
            outputs = (h[:num_rows], gate_up[:num_rows])
            first = outputs if first is None else first
            for name, got, want in zip(("h", "gate_up"), outputs, first):
                assert torch.equal(got, want), f"{name}: {x_sorted=} {packed=} differs from gathered, separate; {ctx}"


@pytest.mark.parametrize("T, H, I, E, topk", [(37, 64, 48, 5, 2), (1, 32, 32, 4, 1)])
def test_persistent_down_is_bitwise_the_per_tile_one(kernel_device, T, H, I, E, topk):
    """PERSISTENT: a few programs walk every tile (the interpreter runs 3, the GPU one per
    SM); each tile's sum is the same, so y is bitwise that of one program per tile."""
    inp = make_inputs(T, H, I, E, topk, seed=T + 2, device=kernel_device)
    sched = build_routing_schedule(inp.topk_ids, E, routing_block_m(), torch.zeros(1, dtype=torch.int32, device=kernel_device))
    h, _ = gate_up_swiglu(inp.x, inp.w_gate, inp.w_up, sched, topk)
    h[sched.row_source < 0] = 0  # padding rows as the forward leaves them
    per_tile, persistent = (
        down_scatter(h, inp.w_down, sched, T * topk, tile_config={**gemm_config("down", H, I, allow_warp_specialized=False),
                                                                  "PERSISTENT": flag})
        for flag in (False, True)
    )
    assert torch.equal(per_tile, persistent), f"{T=} {H=} {I=} {E=} {topk=}"
    assert per_tile.abs().sum() > 0, f"{T=} {H=} {I=} {E=} {topk=}"


@triton.jit
def _record_last_wave_tiles(out_ptr, num_m_tiles, num_n_tiles, num_sms, GROUP_M: tl.constexpr, SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    m_tile, n_tile, half = last_wave_tile_coordinates(pid, num_m_tiles, num_n_tiles, num_sms, GROUP_M, SPLIT)
    tl.store(out_ptr + 3 * pid, m_tile)
    tl.store(out_ptr + 3 * pid + 1, n_tile)
    tl.store(out_ptr + 3 * pid + 2, half)


@pytest.mark.parametrize("num_m_tiles, num_n_tiles, sms", [(5, 2, 3), (4, 2, 3), (33, 4, 132), (133, 16, 132),
                                                           (1, 1, 132), (7, 3, 8), (0, 4, 132)])
@pytest.mark.parametrize("split", [True, False])
def test_last_wave_tile_coordinates_cover_every_tile_once(kernel_device, num_m_tiles, num_n_tiles, sms, split):
    """Over a launch of tiles + sms // 2 programs: every tile whole once, or (its last wave at
    most half the SMs, and SPLIT) as its two column halves, each once, by the last programs."""
    tiles = num_m_tiles * num_n_tiles
    programs = tiles + sms // 2
    out = torch.full((programs, 3), -7, dtype=torch.int32, device=kernel_device)
    _record_last_wave_tiles[(programs,)](out, num_m_tiles, num_n_tiles, sms, GROUP_M=2, SPLIT=split)
    m_tile, n_tile, half = out.cpu().long().unbind(1)
    last = tiles % sms
    halved = last if split and 2 * last <= sms else 0
    ctx = f"{num_m_tiles=} {num_n_tiles=} {sms=} {split=}"
    whole_programs = tiles - halved
    assert (half[:whole_programs] == -1).all() and (m_tile[:whole_programs] >= 0).all(), ctx
    assert (half[whole_programs : whole_programs + 2 * halved] == torch.tensor([0, 1]).repeat(halved)).all(), ctx
    idle = slice(whole_programs + 2 * halved, None)
    assert (m_tile[idle] == -1).all() and (half[idle] == -1).all(), ctx
    work = m_tile >= 0
    assert ((m_tile[work] < num_m_tiles) & (n_tile[work] >= 0) & (n_tile[work] < num_n_tiles)).all(), ctx
    seen = torch.zeros(num_m_tiles, num_n_tiles, dtype=torch.long)
    seen.index_put_((m_tile[work], n_tile[work]), torch.where(half[work] < 0, 2, 1), accumulate=True)
    assert (seen == 2).all(), f"each tile whole once or both halves once: {ctx}"
    halves = half[work] >= 0
    pairs = set(zip(m_tile[work][halves].tolist(), n_tile[work][halves].tolist(), half[work][halves].tolist()))
    assert len(pairs) == 2 * halved, ctx


@pytest.mark.parametrize("T, H, I, E, topk", [(37, 64, 48, 5, 2), (1, 32, 32, 4, 1)])
def test_last_wave_halves_are_bitwise_the_whole_tiles(kernel_device, T, H, I, E, topk):
    """SPLIT_LAST_WAVE (the default for per-tile launches of these GEMMs) computes the last
    wave's tiles as column halves: the same K order per element, so the down GEMM's y and
    the gate/up dgrad's dx are bitwise those of whole tiles. The shapes are chosen so that
    halves run (checked), on the interpreter's 3 programs per wave and on a GPU's SMs alike;
    the launches are per tile here even where the defaults would be persistent (small I)."""
    inp = make_inputs(T, H, I, E, topk, seed=T + 3, device=kernel_device)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    sched = build_routing_schedule(inp.topk_ids, E, routing_block_m(), flag)
    h, gate_up = gate_up_swiglu(inp.x, inp.w_gate, inp.w_up, sched, topk, store_gate_up=True)
    h[sched.row_source < 0] = 0  # padding rows as the forward leaves them
    gate_up[sched.row_source < 0] = 0
    ctx = f"{T=} {H=} {I=} {E=} {topk=}"
    launches = {
        "down": (gemm_config("down", H, I, allow_warp_specialized=False),
                 lambda cfg: down_scatter(h, inp.w_down, sched, T * topk, tile_config=cfg)),
        "gate/up dgrad": (dgrad_config("gate_up", H, I, allow_warp_specialized=False),
                          lambda cfg: gate_up_dgrad_scatter(gate_up, inp.w_gate, inp.w_up, sched, T * topk,
                                                            tile_config=cfg)),
    }
    m_tiles = int(sched.num_rows) // sched.block_m
    for what, (default, launch) in launches.items():
        assert "SPLIT_LAST_WAVE" in default, f"{what}: {default}"
        cfg = {**default, "PERSISTENT": False, "SPLIT_LAST_WAVE": True}
        last = m_tiles * triton.cdiv(H, cfg["BLOCK_N"]) % num_sms(torch.device(kernel_device))
        assert 0 < 2 * last <= num_sms(torch.device(kernel_device)), f"{what}: no half tiles here; {ctx}"
        whole = {**cfg, "SPLIT_LAST_WAVE": False}
        assert scatter_grid(sched, H, cfg) == scatter_grid(sched, H, whole) + num_sms(torch.device(kernel_device)) // 2
        persistent = {**cfg, "PERSISTENT": True}  # walks whole tiles: no programs for halves
        assert scatter_grid(sched, H, persistent) == scatter_grid(sched, H, {**persistent, "SPLIT_LAST_WAVE": False})
        split_out, whole_out = launch(cfg), launch(whole)
        assert torch.equal(split_out, whole_out), f"{what}: the half tiles differ from whole ones; {ctx}"
        assert split_out.float().abs().sum() > 0, f"{what}: {ctx}"


def test_launchers_reject_mismatches(kernel_device):
    inp = make_inputs(8, 32, 16, 4, 2, device=kernel_device)
    sched = build_routing_schedule(inp.topk_ids, 4, routing_block_m(), torch.zeros(1, dtype=torch.int32, device=kernel_device))
    with pytest.raises(ValueError, match=r"^tile_config: PACKED needs w_gate and w_up stored as one tensor"):
        cfg = {**gemm_config("gate_up", 16, 32), "PACKED": True}
        gate_up_swiglu(inp.x, *_apart(inp.w_gate, inp.w_up), sched, 2, tile_config=cfg)
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
    # y's rows in another order, gathered by route_row: bitwise the same sum; a route without a row adds nothing
    gen_perm = torch.Generator().manual_seed(5)
    route_row = torch.randperm(T * topk + 7, generator=gen_perm)[: T * topk].int()
    y_rows = torch.randn(T * topk + 7, H, generator=gen).bfloat16().to(kernel_device)
    y_rows[route_row.long().to(kernel_device)] = y
    route_row = route_row.to(kernel_device)
    assert torch.equal(combine(y_rows, w, y_shared, route_row), out), f"{shared=}"
    route_row[topk] = -1  # token 1's first route
    dropped = combine(y_rows, w, y_shared, route_row)
    w_dropped = w.clone()
    w_dropped[1, 0] = 0.0
    assert torch.equal(dropped, combine(y, w_dropped, y_shared)), f"{shared=}"
    with pytest.raises(ValueError, match=r"^route_row: expected a \[87\] int32 tensor"):
        combine(y_rows, w, y_shared, route_row.long())


def test_combine_into_blocks_of_a_buffer_is_bitwise_combine(kernel_device):
    """`combine_into` over blocks of the tokens, each into its rows of one buffer (as the expert's
    rank sums the rows that go back to each rank): bitwise one `combine` over all, the rest of the
    buffer untouched; the mutated output as the op declares it; a wrong output rejected by name."""
    T, H, topk = 23, 40, 3
    gen = torch.Generator().manual_seed(6)
    route_row = torch.randperm(T * topk + 5, generator=gen)[: T * topk].int().to(kernel_device)
    route_row[4] = -1
    y = torch.randn(T * topk + 5, H, generator=gen).bfloat16().to(kernel_device)
    w = torch.randn(T, topk, generator=gen).to(kernel_device)
    whole = combine(y, w, None, route_row)
    out = torch.full((T + 2, H), float("nan"), dtype=torch.bfloat16, device=kernel_device)
    for rows in (slice(0, 9), slice(9, 10), slice(10, T)):
        ops.combine_into(y, w[rows], route_row[rows.start * topk: rows.stop * topk], out[rows])
    assert torch.equal(out[:T], whole), f"{T=} {H=} {topk=}"
    assert out[T:].isnan().all(), "rows past the blocks were written"
    args = (y, w[:9], route_row[: 9 * topk], out[:9])
    torch.library.opcheck(ops.combine_into.op, ops.combine_into.op_args(*args), test_utils=("test_faketensor",))
    with pytest.raises(ValueError, match=r"^out: expected a bf16 \[9, 40\] tensor"):
        ops.combine_into(y, w[:9], route_row[: 9 * topk], out[:8])


# --------------------------------------------------------------------------- fp8_block

# Slack for fp32 accumulation order, relative to a tensor's (or an h block's) largest value:
# NumPy's fp32 matmul under the interpreter is near exact; Hopper's FP8 MMA keeps fewer
# accumulator bits inside each 128-wide step.
_FP8_ORDER_SLACK = {"cpu": 2.0**-18, "cuda": 2.0**-11}


def _schedule(inp, num_experts):
    flag = torch.zeros(1, dtype=torch.int32, device=inp.x.device)
    return build_routing_schedule(inp.topk_ids, num_experts, routing_block_m(), flag)


def _fp8_block_operands(inp):
    """x quantized by the kernel (as a caller does); the weights by `mok.fp8_block_quantize`
    (bit-exact with its kernel, and quicker under the interpreter). Returns (q, scale) pairs."""
    x_pair = quantize_fp8_block_activations(inp.x)
    return x_pair, *(fp8_block_quantize(w)[:2] for w in (inp.w_gate, inp.w_up, inp.w_down))


def _fp8_block_forward(inp, sched, topk, limit, gate_up_e4m3=False):
    """(the quantized operands, (h_q, h_scale, gate_up, y)) of the two fp8_block GEMMs."""
    operands = _fp8_block_operands(inp)
    (x_q, x_scale), w_gate, w_up, w_down = operands
    h_q, h_scale, gate_up = gate_up_swiglu_fp8_block(x_q, x_scale, *w_gate, *w_up, sched, topk, limit, True,
                                                     gate_up_e4m3=gate_up_e4m3)
    y = down_scatter_fp8_block(h_q, h_scale, *w_down, sched, inp.x.shape[0] * topk)
    return operands, (h_q, h_scale, gate_up, y)


def _assert_order_close(actual, expected, slack, name, ctx):
    """bf16 output rounding (2^-8 relative, twice RNE's bound) plus accumulation-order slack."""
    atol = slack * expected.abs().max().item()
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=2.0**-8, atol=atol, msg=lambda m: f"{name} {ctx}: {m}"
    )


def _assert_row_blocks(q, scale, expected, slack, name, ctx):
    """E4M3 rows q [n, W] in 1×128 blocks with their scales [n, W/128] against the fp32 values they
    quantize: scale = amax / 448, so each block's largest element is exactly ±448; elements within
    E4M3 rounding (half an ulp: 2^-4 relative, 2^-10·scale in the subnormals) plus `slack` of the
    largest |expected| (the values themselves differ from `expected` by accumulation order, as
    `_assert_order_close` allows)."""
    blocks = lambda t: t.reshape(t.shape[0], -1, 128)  # noqa: E731
    amax = blocks(expected).abs().amax(-1)  # [n, W/128]
    order = slack * expected.abs().max().item()
    assert torch.all(blocks(q.float()).abs().amax(-1) == 448.0), f"{name} {ctx}"
    torch.testing.assert_close(scale, amax / 448.0, rtol=slack, atol=order / 448.0,
                               msg=lambda m: f"{name} scales {ctx}: {m}")
    dequantized = fp8_block_dequantize(q, scale)
    half_ulp = torch.maximum(2.0**-4 * expected.abs(), 2.0**-10 * scale.repeat_interleave(128, dim=1))
    excess = (dequantized - expected).abs() - half_ulp - order
    worst = divmod(int(excess.argmax()), q.shape[1])
    assert excess.max() <= 0, f"{name} off by more than E4M3 rounding at {worst} {ctx}"


@pytest.mark.parametrize(
    "T, H, I, E, topk, limit, used_experts, gate_up_e4m3",
    [(37, 256, 128, 4, 2, None, 3, False), (19, 128, 256, 3, 1, 0.5, 3, False), (9, 128, 128, 4, 4, None, 4, False),
     (37, 256, 256, 4, 2, None, 3, True)],
)
def test_fp8_block_gate_up_and_down(kernel_device, T, H, I, E, topk, limit, used_experts, gate_up_e4m3):
    """Against the same quantized math in torch (fp32 accumulation-order tolerance) and against
    the fp32 reference (the fp8_block accuracy bars); h's quantization against its rule, and with
    gate_up_e4m3 g's and u's. used_experts < E leaves the last expert without tokens."""
    ids = make_topk_ids(T, used_experts, topk, torch.Generator().manual_seed(T))
    inp = make_inputs(T, H, I, E, topk, seed=T, device=kernel_device, topk_ids=ids)
    sched = _schedule(inp, E)
    operands, (h_q, h_scale, gate_up, y) = _fp8_block_forward(inp, sched, topk, limit, gate_up_e4m3)
    rows, slots, experts = _routes(inp, sched)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {limit=} {used_experts=} {gate_up_e4m3=}"
    slack = _FP8_ORDER_SLACK[kernel_device]
    assert h_q.dtype == torch.float8_e4m3fn and h_q.shape == (sched.capacity_rows, I), ctx
    assert h_scale.dtype == torch.float32 and h_scale.shape == (sched.capacity_rows, I // 128), ctx

    (x_q, x_scale), *weights = ((q.cpu(), scale.cpu()) for q, scale in operands)
    x_deq = fp8_block_dequantize(x_q, x_scale)[slots // topk]  # [routes, H] fp32
    w_gate, w_up, w_down = (fp8_block_dequantize(q, scale, (128, 128)) for q, scale in weights)  # [E, ·, ·] fp32
    h_deq = fp8_block_dequantize(h_q.cpu()[rows], h_scale.cpu()[rows])  # [routes, I] fp32
    routes = rows.numel()
    widths = {"gate": I, "up": I, "h": I, "y": H}
    stmt = {name: torch.zeros(routes, n) for name, n in widths.items()}  # the same quantized math in torch
    ref = {name: torch.zeros(routes, n) for name, n in widths.items()}  # fp32 on the unquantized inputs
    x_rows = inp.x.cpu().float()[slots // topk]
    for e in experts.unique().tolist():
        mine = experts == e
        acts_q = reference.swiglu_mlp_forward(x_deq[mine], w_gate[e], w_up[e], w_down[e], limit)
        acts = reference.swiglu_mlp_forward(
            x_rows[mine], inp.w_gate[e].cpu(), inp.w_up[e].cpu(), inp.w_down[e].cpu(), limit
        )
        for name in ("gate", "up", "h"):
            stmt[name][mine], ref[name][mine] = getattr(acts_q, name), getattr(acts, name)
        stmt["y"][mine] = h_deq[mine] @ w_down[e].T  # the down GEMM on the h the kernel quantized
        ref["y"][mine] = acts.y

    padding = (sched.row_source.cpu()[: int(sched.num_rows)] < 0).nonzero().flatten()
    if gate_up_e4m3:  # (bytes [rows, 2, I], scales [rows, 2, I/128]): each of g, u as h is
        gate_up_q, gate_up_scale = (t.cpu() for t in gate_up)
        assert gate_up_q.dtype == torch.float8_e4m3fn and gate_up_q.shape == (sched.capacity_rows, 2, I), ctx
        assert gate_up_scale.dtype == torch.float32 and gate_up_scale.shape == (sched.capacity_rows, 2, I // 128), ctx
        for j, name in enumerate(("gate", "up")):
            _assert_row_blocks(gate_up_q[rows, j], gate_up_scale[rows, j], stmt[name], slack, name, ctx)
        assert torch.all(gate_up_q[padding].float() == 0) and torch.all(gate_up_scale[padding] == 2.0**-126), ctx
        gate_up = fp8_block_dequantize(gate_up_q.flatten(0, 1), gate_up_scale.flatten(0, 1)).view(-1, 2, I)
    else:
        _assert_order_close(gate_up[rows, 0].cpu(), stmt["gate"], slack, "gate", ctx)
        _assert_order_close(gate_up[rows, 1].cpu(), stmt["up"], slack, "up", ctx)
    _assert_order_close(y[slots].cpu(), stmt["y"], slack, "y", ctx)
    _assert_row_blocks(h_q.cpu()[rows], h_scale.cpu()[rows], stmt["h"], slack, "h", ctx)
    assert torch.all(h_q.cpu()[padding].float() == 0) and torch.all(h_scale.cpu()[padding] == 2.0**-126), ctx

    for name, actual in (("gate", gate_up[rows, 0]), ("up", gate_up[rows, 1]), ("h", h_deq), ("y", y[slots])):
        assert_close_to_reference(actual.cpu(), ref[name], "fp8_block", name=name, context=ctx, check_cosine=True)


def test_fp8_block_nan_propagates(kernel_device):
    """A NaN in token 0's x makes its routes' h and y NaN; other rows (padding, which reads
    token 0's slot of x, included) stay finite."""
    T, H, I, E, topk = 6, 128, 128, 2, 1
    inp = make_inputs(T, H, I, E, topk, seed=5, device=kernel_device)
    inp.x[0, 7] = float("nan")
    sched = _schedule(inp, E)
    _, (h_q, h_scale, gate_up, y) = _fp8_block_forward(inp, sched, topk, None)
    num_rows = int(sched.num_rows)
    poisoned = (sched.row_source[:num_rows] == 0).cpu()  # the route slot t·topk + j = 0 is token 0's
    assert torch.all(h_scale[:num_rows].cpu()[poisoned].isnan()) and torch.all(y[0].isnan())
    assert torch.all(h_scale[:num_rows].cpu()[~poisoned].isfinite()) and torch.all(y[1:].isfinite())


def test_fp8_block_ops_and_run_twice(kernel_device):
    """The custom ops' fake shapes, and the op (a second run) bitwise equal to the launcher."""
    T, H, I, E, topk = 5, 128, 128, 2, 1
    inp = make_inputs(T, H, I, E, topk, seed=6, device=kernel_device)
    block_m = routing_block_m()
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    sched = ops.routing_schedule(inp.topk_ids, flag, E, block_m)
    (x_q, x_scale), w_gate, w_up, w_down = _fp8_block_operands(inp)
    gate_up_args = (x_q, x_scale, *w_gate, *w_up, sched, topk, 0.5, True)
    h_q, h_scale, gate_up, no_scale = ops.gate_up_swiglu_fp8_block(*gate_up_args)
    again = gate_up_swiglu_fp8_block(x_q, x_scale, *w_gate, *w_up, sched, topk, 0.5, True)
    rows = int(sched.num_rows)
    assert no_scale.shape == (0,)
    for a, b in zip((h_q, h_scale, gate_up), again):
        assert torch.equal(a[:rows].view(torch.uint8), b[:rows].view(torch.uint8))
    e4m3_args = (*gate_up_args[:-2], None, True, True)  # g, u in e4m3 (no swiglu_limit)
    *_, gate_up_q, gate_up_scale = ops.gate_up_swiglu_fp8_block(*e4m3_args)
    _, _, (again_q, again_scale) = gate_up_swiglu_fp8_block(x_q, x_scale, *w_gate, *w_up, sched, topk, None, True,
                                                            gate_up_e4m3=True)
    assert torch.equal(gate_up_q[:rows].view(torch.uint8), again_q[:rows].view(torch.uint8))
    assert torch.equal(gate_up_scale[:rows], again_scale[:rows])
    down_args = (h_q, h_scale, *w_down, sched, T * topk)
    y = ops.down_scatter_fp8_block(*down_args)
    assert torch.equal(y, down_scatter_fp8_block(h_q, h_scale, *w_down, sched, T * topk))
    # sorted_rows: each route's row at its sorted row, bitwise the slot's
    route_row = sched.route_row
    y_sorted = ops.down_scatter_fp8_block(*down_args, True)
    assert y_sorted.shape == (sched.capacity_rows, H) and torch.equal(y_sorted[route_row.long()], y)
    for op, args in ((ops.gate_up_swiglu_fp8_block, gate_up_args), (ops.gate_up_swiglu_fp8_block, e4m3_args),
                     (ops.down_scatter_fp8_block, down_args), (ops.down_scatter_fp8_block, (*down_args, True))):
        torch.library.opcheck(op.op, op.op_args(*args), test_utils=("test_faketensor",))
    torch.library.opcheck(ops.combine.op, (y_sorted, inp.topk_weights, None, route_row),
                          test_utils=("test_faketensor",))


def test_fp8_block_launchers_reject_mismatches(kernel_device):
    T, H, I, E, topk = 8, 256, 128, 4, 2
    inp = make_inputs(T, H, I, E, topk, device=kernel_device)
    sched = _schedule(inp, E)
    (x_q, x_scale), (wg_q, wg_s), (wu_q, wu_s), (wd_q, wd_s) = _fp8_block_operands(inp)
    h_q = torch.zeros(sched.capacity_rows, I, device=kernel_device).to(torch.float8_e4m3fn)
    h_scale = torch.ones(sched.capacity_rows, I // 128, device=kernel_device)
    gate_up = lambda *args, **kw: gate_up_swiglu_fp8_block(*args, sched, topk, **kw)  # noqa: E731
    down = lambda *args, **kw: down_scatter_fp8_block(*args, sched, T * topk, **kw)  # noqa: E731
    # The Triton kernel's tiles (on a Hopper GPU the default is the warp-specialized kernel's,
    # which test_warp_specialized.py checks)
    bad_tiles = {**gemm_config("gate_up", I, H, "fp8_block", allow_warp_specialized=False), "BLOCK_K": 64}
    cases = [
        (lambda: gate_up(inp.x, x_scale, wg_q, wg_s, wu_q, wu_s),
         r"^x_q: expected a contiguous float8_e4m3fn tensor of shape \[8, 256\] on .*, got torch.bfloat16"),
        (lambda: gate_up(x_q, x_scale[:, :1], wg_q, wg_s, wu_q, wu_s),
         r"^x_scale: expected a contiguous float32 tensor of shape \[8, 2\]"),
        (lambda: gate_up(x_q, x_scale, wg_q[:, :96], wg_s, wu_q, wu_s),
         r"^w_gate_q: expected a 3-D \[E_l, I, H\] tensor with E_l = 4 .* multiples of 128 \(fp8_block\), "
         r"got shape \[4, 96, 256\]"),
        (lambda: gate_up(x_q, x_scale, wg_q, wg_s, wu_q, wu_s.double()),
         r"^w_up_scale: expected a contiguous float32 tensor of shape \[4, 1, 2\]"),
        (lambda: gate_up(x_q, x_scale, wg_q, wg_s, wu_q.mT.contiguous().mT, wu_s),
         r"^w_up_q: expected a contiguous float8_e4m3fn tensor .* non-contiguous"),
        (lambda: gate_up(x_q, x_scale, wg_q, wg_s, wu_q, wu_s, tile_config=bad_tiles),
         r"^tile_config: expected BLOCK_K 128 and BLOCK_N 128 for the fp8_block gate_up GEMM"),
        (lambda: gate_up(x_q, x_scale, wg_q, wg_s, wu_q, wu_s, swiglu_limit=0.5, store_gate_up=True,
                         gate_up_e4m3=True),
         r"^gate_up_e4m3: expected store_gate_up=True and no swiglu_limit, got store_gate_up=True, swiglu_limit=0.5"),
        (lambda: down(h_q[:-1], h_scale, wd_q, wd_s),
         r"^h_q: expected a contiguous float8_e4m3fn tensor of shape"),
        (lambda: down(h_q, h_scale, wd_q, wd_s[:, :1]),
         r"^w_down_scale: expected a contiguous float32 tensor of shape \[4, 2, 1\]"),
        (lambda: down(h_q, h_scale, wd_q[:3], wd_s[:3]),
         r"^w_down_q: expected a 3-D \[E_l, H, I\] tensor with E_l = 4"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def _two_launch_schedules(sched):
    """The schedule's M tiles split in two (even tiles, odd tiles), each with the other's tile_expert −1:
    the two launches of a GEMM over one layout (as `transport.common.own_tiles_split` makes them)."""
    odd = torch.arange(sched.max_tiles, device=sched.tile_expert.device) % 2 == 1
    return (dataclasses.replace(sched, tile_expert=torch.where(odd, -1, sched.tile_expert)),
            dataclasses.replace(sched, tile_expert=torch.where(odd, sched.tile_expert, -1)))


_TWO_LAUNCH_SHAPE = dict(T=70, H=128, I=128, E=3, topk=2)


def _two_launch_case(device, seed: int):
    """(inputs, schedule, its two launches' schedules, rows in use) at `_TWO_LAUNCH_SHAPE`, with
    tiles for both launches."""
    T, H, I, E, topk = _TWO_LAUNCH_SHAPE.values()
    inp = make_inputs(T, H, I, E, topk, seed=seed, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    sched = ops.routing_schedule(inp.topk_ids, flag, E, routing_block_m())
    rows = int(sched.num_rows)
    assert rows // sched.block_m >= 2, "the case needs tiles for both launches"
    return inp, sched, *_two_launch_schedules(sched), rows


@pytest.mark.parametrize("precision", ["bf16", "fp8_block", "fp8_block e4m3 g,u"])
def test_gate_up_in_two_launches_over_one_layout_is_bitwise_one(kernel_device, precision):
    """The first launch over one set of tiles, the second (`*_into`) over the rest into its outputs:
    every row below num_rows bitwise what one launch writes; the fake impls and the mutated
    outputs as the ops declare them; outputs of the wrong shape rejected by name."""
    topk = _TWO_LAUNCH_SHAPE["topk"]
    inp, sched, first, rest, rows = _two_launch_case(kernel_device, seed=11)
    if precision == "bf16":
        operands = (inp.x, inp.w_gate, inp.w_up)
        whole = ops.gate_up_swiglu(*operands, sched, topk, 0.5, True)
        parts = ops.gate_up_swiglu(*operands, first, topk, 0.5, True)
        into, into_args = ops.gate_up_swiglu_into, (*operands, rest, topk, 0.5, *parts)
    else:
        e4m3 = precision.endswith("g,u")
        (x_q, x_scale), w_gate, w_up, _ = _fp8_block_operands(inp)
        operands = (x_q, x_scale, *w_gate, *w_up)
        limit = None if e4m3 else 0.5
        whole = ops.gate_up_swiglu_fp8_block(*operands, sched, topk, limit, True, e4m3)
        parts = ops.gate_up_swiglu_fp8_block(*operands, first, topk, limit, True, e4m3)
        into, into_args = ops.gate_up_swiglu_fp8_block_into, (*operands, rest, topk, limit, *parts)
    into(*into_args)
    for a, b in zip(whole, parts):
        assert torch.equal(a[:rows].view(torch.uint8), b[:rows].view(torch.uint8)), f"{precision=}"
    torch.library.opcheck(into.op, into.op_args(*into_args), test_utils=("test_faketensor",))
    bad = (*into_args[:-len(parts)], parts[0][:-1], *parts[1:])
    with pytest.raises(ValueError, match=r"^outputs\[0\] \(h(_q)?\): expected a contiguous"):
        into(*bad)


@pytest.mark.parametrize("precision", ["bf16", "fp8_block"])
def test_down_in_two_launches_over_one_layout_is_bitwise_one(kernel_device, precision):
    """The down GEMM's first launch over one set of tiles, the second (`*_into`) over the rest into
    its y: every slot a row writes bitwise what one launch writes, and the first launch alone
    writes only its tiles' slots; the fake impls and the mutated y as the ops declare them; a y
    of the wrong shape rejected by name."""
    T, H, I, E, topk = _TWO_LAUNCH_SHAPE.values()
    inp, sched, first, rest, rows = _two_launch_case(kernel_device, seed=12)
    h = torch.randn(sched.capacity_rows, I, generator=torch.Generator().manual_seed(3)).bfloat16().to(kernel_device)
    num_slots = T * topk
    if precision == "bf16":
        operands = (h, inp.w_down)
        whole = ops.down_scatter(*operands, sched, num_slots)
        y = ops.down_scatter(*operands, first, num_slots)
        into, into_args = ops.down_scatter_into, (*operands, rest, y)
    else:
        w_down = fp8_block_quantize(inp.w_down)[:2]
        operands = (*quantize_fp8_block_activations(h), *w_down)
        whole = ops.down_scatter_fp8_block(*operands, sched, num_slots)
        y = ops.down_scatter_fp8_block(*operands, first, num_slots)
        into, into_args = ops.down_scatter_fp8_block_into, (*operands, rest, False, y)
    source = sched.row_source[:rows]
    first_rows = (first.tile_expert[:rows // sched.block_m] >= 0).repeat_interleave(sched.block_m)
    first_slots, rest_slots = (source[(source >= 0) & part].long() for part in (first_rows, ~first_rows))
    assert torch.equal(y[first_slots], whole[first_slots]), f"first launch {precision=} {T=} {H=} {I=} {E=} {topk=}"
    y[rest_slots] = float("nan")  # the second launch must write every one
    into(*into_args)
    slots = source[source >= 0].long()
    assert torch.equal(y[slots], whole[slots]), f"{precision=} {T=} {H=} {I=} {E=} {topk=}"
    torch.library.opcheck(into.op, into.op_args(*into_args), test_utils=("test_faketensor",))
    with pytest.raises(ValueError, match=r"^out: expected a contiguous bfloat16 tensor of shape \[140, 128\]"):
        into(*into_args[:-1], y[:, :64].contiguous())


@pytest.mark.parametrize("precision, H, I", [("bf16", 7168, 2048), ("bf16", 4096, 14336), ("fp8_block", 2048, 768)])
def test_triton_down_kernel_compiles_for_sm90a_without_spills(monkeypatch, precision, H, I):
    """The Triton down GEMM as Hopper runs it where the warp-specialized one does not (bf16: from
    the plan's `ping_pong_down_max_inter` on, persistent at deepseek-v3-slice's I, per tile with
    the split last wave at mixtral-8x7b's; fp8_block: its Triton tile), with the test that skips
    another launch's tiles: nothing spilled at launch alignment (sm_90a, this Triton's ptxas)."""
    import mok.kernels.gemm.common as gemm_common
    from mok.kernels.plan import HOPPER
    from mok.testing.sm90 import triton_ptxas_report

    monkeypatch.setattr(gemm_common, "interpreting", lambda: False)
    monkeypatch.setattr(gemm_common, "kernel_plan", lambda *args: HOPPER)
    cfg = gemm_config("down", H, I, precision, allow_warp_specialized=False)
    assert precision == "fp8_block" or cfg["PERSISTENT"] == (I <= HOPPER.persistent_down_max_inter), cfg
    meta = {"PERSISTENT": False, "SPLIT_LAST_WAVE": False, **cfg}
    num_warps, num_stages = meta.pop("num_warps"), meta.pop("num_stages")
    element = "bf16" if precision == "bf16" else "fp8e4nv"
    block_m, block_n, block_k = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
    signature = {
        "h_desc": f"tensordesc<{element}[{block_m},{block_k}]>",
        "w_down_desc": f"tensordesc<{element}[{block_n},{block_k}]>",
        "w_down_half_desc": f"tensordesc<{element}[{block_n // 2},{block_k}]>", "y_ptr": "*bf16",
        "h_scale_ptr": "*fp32", "w_down_scale_ptr": "*fp32", "row_source_ptr": "*i32", "tile_expert_ptr": "*i32",
        "num_rows_ptr": "*i32", "hidden": "i32", "inter": "i32", "num_sms": "i32", "num_programs": "i32",
        "stride_y_s": "i32",
        **{name: "constexpr" for name in ("PRECISION", "INTERPRETER", "SORTED", *meta)},
    }
    constants = dict(meta, PRECISION=precision, INTERPRETER=False, SORTED=False)
    aligned = ("y_ptr", "h_scale_ptr", "w_down_scale_ptr", "row_source_ptr", "tile_expert_ptr", "num_rows_ptr",
               "hidden", "inter", "stride_y_s")
    registers, spilled = triton_ptxas_report("mok.kernels.gemm.down", "_down_scatter_kernel", signature, constants,
                                             aligned, num_warps, num_stages)
    assert spilled == 0, f"{precision=} {H=} {I=} {cfg=}: {registers} registers, {spilled} bytes spilled"
