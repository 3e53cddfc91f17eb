"""FP8 block quantization kernels, bit for bit against the reference `mok.fp8_block`.

Scales compare by bits, except that any NaN equals any NaN (a payload carries no meaning).
Edge cases: zero, subnormal, NaN/±Inf blocks, ragged edges, values at E4M3 rounding ties
and its subnormal range (rows anchored by 448 have scale exactly 1, so the cast sees them
unchanged), values near fp32's max, a strided input, and no rows at all. The sorted-layout
quantizers (1×128 blocks down the columns, per expert) against the reference applied to
each block's transpose, with rows past the schedule poisoned with NaN (never read); the
gathering quantizers against quantizing `gather_sorted_rows`' bf16 copies.
"""

import pytest
import torch
import triton
import triton.language as tl

from mok.fp8_block import fp8_block_quantize, fp8_block_quantize_activations
from mok.kernels.quant import fp8_block as qf
from mok.kernels.common import interpreting
from mok.kernels.routing.gather import gather_sorted_rows
from mok.kernels.gemm.common import routing_block_m
from mok.kernels.plan import HOPPER, override
from mok.kernels.quant.fp8_block import (
    _abs_max_bits,
    quantize_fp8_block_activations,
    quantize_fp8_block_gathered,
    quantize_fp8_block_gathered_t,
    quantize_fp8_block_sorted_t,
    quantize_fp8_block_swiglu_sorted_t,
    quantize_fp8_block_weights,
    sorted_scale_rows,
)
from mok.kernels.routing.schedule import build_routing_schedule
from mok.testing import make_topk_ids
from mok.testing.fp8 import dequantize_sorted_t, sorted_column_blocks
from mok.testing.sm90 import gluon_ptxas_report


def _assert_same(got, want, ctx):
    assert len(got) == len(want), ctx
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = g.cpu(), w.cpu()
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous(), f"{ctx} output {i}: {g.dtype} {g.shape}"
        if g.dtype == torch.float32:
            both_nan = g.isnan() & w.isnan()
            diff = (g.view(torch.int32) != w.view(torch.int32)) & ~both_nan
        else:
            diff = g.view(torch.uint8) != w.view(torch.uint8)
        if diff.any():
            where = diff.nonzero()[:5].tolist()
            raise AssertionError(f"{ctx} output {i}: {int(diff.sum())} differ, first at {where}")


def _tie_row(gen):
    """448 then values at E4M3 ties, near ties, in its subnormal range, and beyond ±448."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2  # exact ties, representable in fp32
    vals = torch.cat([mids, torch.nextafter(mids, torch.zeros(1)), torch.nextafter(mids, torch.full((1,), 500.0))])
    vals = vals[torch.randperm(vals.numel(), generator=gen)][:110]
    extra = torch.tensor([2.0**-10, 3 * 2.0**-11, 2.0**-6 - 2.0**-12, 1e-30, 1e-42, 450.0, 464.0, 500.0, 1e30, -0.0,
                          0.0, 2.0**-9, 5 * 2.0**-11, 7 * 2.0**-10, 2.0**-6, 15 * 2.0**-10, 448.0])
    row = torch.cat([torch.tensor([448.0]), vals, extra])[:128]
    signs = torch.where(torch.rand(128, generator=gen) < 0.5, -1.0, 1.0)
    signs[0] = 1.0
    return row * signs  # [128] fp32; |row| ≤ 448 except the saturating ones (scale stays 1 only if ≤ 448)


def test_activations_over_a_wide_range_of_scales(kernel_device):
    """Half a million values, each 1×128 block of its own magnitude (2^-40 … 2^40) and each
    value down to 2^-20 of its block's largest: the quotients by the blocks' scales land on
    E4M3 steps and ties across its whole range, the subnormals included."""
    gen = torch.Generator().manual_seed(5)
    block_scale = 2.0 ** torch.randint(-40, 41, (512, 8, 1), generator=gen).float()
    x = torch.randn(512, 8, 128, generator=gen) * 2.0 ** -torch.randint(0, 21, (512, 8, 128), generator=gen).float()
    x = (x * block_scale).reshape(512, 1024)
    got = quantize_fp8_block_activations(x.to(kernel_device))
    _assert_same(got, fp8_block_quantize_activations(x), f"{kernel_device=}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M, K", [(70, 300), (1, 128), (33, 256)])
def test_activations_random(kernel_device, dtype, M, K):
    gen = torch.Generator().manual_seed(M + K)
    x = (torch.randn(M, K, generator=gen) * torch.logspace(-3, 3, K)).to(dtype)
    got = quantize_fp8_block_activations(x.to(kernel_device))
    _assert_same(got, fp8_block_quantize_activations(x), f"{kernel_device=} {dtype=} {M=} {K=}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (2, 128, 256)])
def test_weights_random(kernel_device, dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(*shape, generator=gen) * 10.0 ** torch.randint(-4, 4, shape[-1:], generator=gen)).to(dtype)
    got = quantize_fp8_block_weights(w.to(kernel_device))
    _assert_same(got, fp8_block_quantize(w), f"{kernel_device=} {dtype=} {shape=}")


def test_activation_edge_cases(kernel_device):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(12, 384, generator=gen)
    x[0, :128] = 0.0
    x[1, :128] = -0.0
    x[2, :128] = torch.randn(128, generator=gen) * 1e-39  # fp32 subnormals: floor scale 2^-126
    x[3, 5], x[4, 200], x[5, 300] = float("nan"), float("inf"), float("-inf")
    x[6, 256:] = 3e38  # near fp32 max
    x[6, 300] = -3.4e38
    for r in range(7, 12):
        x[r, :128] = _tie_row(gen)  # scale exactly 1 where |row| ≤ 448
        x[r, 128:256] = _tie_row(gen) * 2.0**-20  # same pattern, scale 2^-20
    want = fp8_block_quantize_activations(x)
    _assert_same(quantize_fp8_block_activations(x.to(kernel_device)), want, f"{kernel_device=} fp32 edges")
    xb = x.bfloat16()
    _assert_same(quantize_fp8_block_activations(xb.to(kernel_device)), fp8_block_quantize_activations(xb), "bf16 edges")


@triton.jit
def _abs_max_bits_kernel(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    offsets = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(out_ptr + tl.arange(0, ROWS), _abs_max_bits(tl.load(x_ptr + offsets), 1))


def test_abs_max_bits_is_the_integer_amax(kernel_device):
    """The float amax (a NaN-propagating max of |x|) gives the bits the integer amax gives: max |x|
    exactly, subnormals and −0 included, the Inf's bits for an Inf row and NaN bits, above them,
    wherever a NaN is, whatever else the row holds."""
    rows, cols = 16, 128
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-30, 30, rows)[:, None]
    x[1], x[2] = 0.0, -0.0
    x[3] = torch.randn(cols, generator=gen) * 1e-40  # subnormals only
    x[4, 7], x[5, 100], x[6, 0] = float("inf"), float("-inf"), float("nan")
    x[7, 3], x[7, 90] = float("nan"), float("inf")
    x[8, 127] = -3.4e38
    out = torch.empty(rows, dtype=torch.int32, device=kernel_device)
    _abs_max_bits_kernel[(1,)](x.to(kernel_device), out, ROWS=rows, COLS=cols)
    got, want = out.cpu(), (x.view(torch.int32) & 0x7FFFFFFF).amax(1)  # the integer amax
    nan_rows = x.isnan().any(1)
    ctx = f"{kernel_device=} rows with NaN: {nan_rows.nonzero().flatten().tolist()}"
    assert torch.equal(got[~nan_rows], want[~nan_rows]), f"{ctx}: {got.tolist()} against {want.tolist()}"
    assert (got[nan_rows] > 0x7F800000).all(), f"{ctx}: {got[nan_rows].tolist()}"
    assert got[3] > 0 and got[4] == got[5] == 0x7F800000, f"{ctx}: subnormal {got[3]}, Inf {got[4]} {got[5]}"


def test_e4m3_ties_at_unit_scale(kernel_device):
    """Rows whose amax is exactly 448: scale 1, so the kernel's cast sees the values themselves."""
    gen = torch.Generator().manual_seed(8)
    rows = torch.stack([_tie_row(gen).clamp(-448, 448) for _ in range(8)])
    q, scale = fp8_block_quantize_activations(rows)
    assert torch.all(scale == 1.0)
    _assert_same(quantize_fp8_block_activations(rows.to(kernel_device)), (q, scale), f"{kernel_device=} ties")


def test_weight_edge_cases(kernel_device):
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(2, 256, 200, generator=gen)
    w[0, :128, :128] = 0.0
    w[0, :128, 128:] = torch.randn(128, 72, generator=gen) * 1e-40
    w[1, 3, 4] = float("nan")
    w[1, 200, 150] = float("-inf")
    w[1, 128:, :128] = 3e38
    _assert_same(quantize_fp8_block_weights(w.to(kernel_device)), fp8_block_quantize(w), f"{kernel_device=} edges")
    wb = w.bfloat16()  # bf16 subnormals in the tiny block
    _assert_same(quantize_fp8_block_weights(wb.to(kernel_device)), fp8_block_quantize(wb), f"{kernel_device=} bf16 edges")


def test_strided_and_empty(kernel_device):
    base = torch.randn(20, 512, generator=torch.Generator().manual_seed(10)).bfloat16()
    x = base[::2, :256]  # row stride 1024, unit column stride
    _assert_same(quantize_fp8_block_activations(x.to(kernel_device)), fp8_block_quantize_activations(x), "strided")
    w = base[:, 100:400]  # [20, 300] with row stride 512
    _assert_same(quantize_fp8_block_weights(w.to(kernel_device)), fp8_block_quantize(w), "strided weight")
    q, scale = quantize_fp8_block_activations(torch.empty(0, 256, dtype=torch.bfloat16, device=kernel_device))
    assert q.shape == (0, 256) and scale.shape == (0, 2)


def test_activations_stop_at_num_rows(kernel_device):
    """Rows at or past num_rows[0] are neither read (NaN there changes nothing) nor written."""
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(12)).bfloat16()
    x[37:] = float("nan")
    num_rows = torch.tensor([37], dtype=torch.int32, device=kernel_device)
    q, scale = quantize_fp8_block_activations(x.to(kernel_device), num_rows)
    _assert_same((q[:37].contiguous(), scale[:37].contiguous()), fp8_block_quantize_activations(x[:37]), "num_rows")
    with pytest.raises(ValueError, match=r"^num_rows: expected a \[1\] int32 tensor"):
        quantize_fp8_block_activations(x.to(kernel_device), num_rows.long())


def test_launcher_errors(kernel_device):
    with pytest.raises(TypeError, match="x: expected dtype torch.bfloat16 or torch.float32, got torch.float16"):
        quantize_fp8_block_activations(torch.zeros(2, 128, dtype=torch.float16, device=kernel_device))
    with pytest.raises(ValueError, match=r"x: expected a 2-D \[M, K\] tensor"):
        quantize_fp8_block_activations(torch.zeros(128, device=kernel_device))
    with pytest.raises(ValueError, match="x: expected unit stride along the last dim"):
        quantize_fp8_block_activations(torch.zeros(128, 4, device=kernel_device).T)
    with pytest.raises(ValueError, match=r"w: expected a 2-D \[N, K\] or 3-D \[E, N, K\] tensor"):
        quantize_fp8_block_weights(torch.zeros(1, 1, 128, 128, device=kernel_device))
    with pytest.raises(TypeError, match="w: expected a torch.Tensor"):
        quantize_fp8_block_weights(None)


# --------------------------------------------------------------------------- sorted layout, blocks along rows


def _sorted_case(kernel_device, T, E, topk, used_experts, seed):
    """A schedule whose routes use experts 0..used_experts-1 only (the rest get no rows), its
    (first row, end row, scale row) column blocks, and a [capacity_rows, ...] tensor maker:
    random values in the schedule's rows, NaN past num_rows."""
    ids = make_topk_ids(T, used_experts, topk, torch.Generator().manual_seed(seed))
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    sched = build_routing_schedule(ids.to(kernel_device), E, routing_block_m(), flag)
    num_rows = int(sched.num_rows)
    gen = torch.Generator().manual_seed(seed + 1)

    def rows(*shape, scale=1.0):
        out = torch.full((sched.capacity_rows, *shape), float("nan"))
        out[:num_rows] = torch.randn(num_rows, *shape, generator=gen) * scale
        return out

    return sched, sorted_column_blocks(sched.expert_offsets.cpu(), sched.block_m), rows


@pytest.mark.parametrize(
    "dtype, T, E, topk, used_experts, W", [(torch.bfloat16, 200, 4, 2, 3, 200), (torch.float32, 1, 3, 1, 3, 128)]
)
def test_sorted_t_blocks_bit_exact(kernel_device, dtype, T, E, topk, used_experts, W):
    sched, blocks, rows = _sorted_case(kernel_device, T, E, topk, used_experts, seed=T + W)
    ctx = f"{kernel_device=} {dtype=} {T=} {E=} {topk=} {used_experts=} {W=} block_m={sched.block_m}"
    sizes = {r1 - r0 for r0, r1, _ in blocks}
    if sched.block_m < 128:  # the interpreter's schedule pads experts to 16 rows: an expert's last block is short
        assert min(sizes) < 128 and (T == 1 or 128 in sizes), f"the test wants ragged and whole blocks {ctx}"
    else:  # experts padded to whole 128-row blocks
        assert sizes == {128}, f"expected whole 128-row blocks {ctx}"
    a = rows(W, scale=torch.logspace(-3, 3, W)).to(dtype)
    a[blocks[0][0], 7] = float("nan")  # one column block of the first expert turns NaN, nothing else
    # An operand shorter than the capacity reads zeros past its end (stopping inside the last block).
    short = blocks[-1][1] - 3
    for name, operand in (("full", a), ("short", a[:short])):
        q_t, scale_t = quantize_fp8_block_sorted_t(operand.to(kernel_device), sched)
        assert q_t.shape == (W, sched.capacity_rows) and q_t.dtype == torch.float8_e4m3fn, f"{name} {ctx}"
        assert scale_t.shape == (sched.capacity_rows // sorted_scale_rows(sched.block_m), W), f"{name} {ctx}"
        padded = torch.zeros_like(a)
        padded[: operand.shape[0]] = operand
        for r0, r1, slot in blocks:
            want = fp8_block_quantize_activations(padded[r0:r1].T.contiguous())  # [W, n], [W, 1]
            got = (q_t.cpu()[:, r0:r1].contiguous(), scale_t.cpu()[slot : slot + 1].T.contiguous())
            _assert_same(got, want, f"{name} rows [{r0}, {r1}) {ctx}")
    assert scale_t.cpu()[blocks[0][2]].isnan().sum() == 1, ctx


@pytest.mark.parametrize("limit", [0.7])
def test_swiglu_sorted_t_quantizes_h(kernel_device, limit):
    """h recomputed from g, u: each block's scale is amax(h)/448 and its elements within E4M3's
    rounding (half an ulp: 2^-4 relative, 2^-10·scale in the subnormals); zero g, u give zeros."""
    sched, blocks, rows = _sorted_case(kernel_device, 150, 4, 2, 3, seed=11)
    ctx = f"{kernel_device=} {limit=} block_m={sched.block_m}"
    gate_up = rows(2, 256, scale=1.5).bfloat16()
    padding = (sched.row_source.cpu()[: int(sched.num_rows)] < 0).nonzero().flatten()
    gate_up[padding] = 0  # what the forward stores there
    q_t, scale_t = quantize_fp8_block_swiglu_sorted_t(gate_up.to(kernel_device), sched, limit)
    g, u = gate_up.float().unbind(1)
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    h = torch.nn.functional.silu(g) * u  # [rows, I] fp32
    h_deq = dequantize_sorted_t(q_t, scale_t, sched.expert_offsets, sched.block_m)
    for r0, r1, slot in blocks:
        block, scale = h[r0:r1], scale_t.cpu()[slot]  # [n, I], [I]
        amax = block.abs().amax(0)
        torch.testing.assert_close(scale, amax / 448.0, rtol=2.0**-18, atol=0.0,
                                   msg=lambda m: f"[{r0}, {r1}) {ctx}: {m}")
        excess = (h_deq[r0:r1] - block).abs() - torch.maximum(2.0**-4 * block.abs(), 2.0**-10 * scale) - 2.0**-18 * amax
        assert excess.max() <= 0, f"rows [{r0}, {r1}) off by more than E4M3 rounding {ctx}"
    assert padding.numel() > 0 and torch.all(q_t.cpu()[:, padding].float() == 0), ctx


def test_sorted_t_launcher_errors(kernel_device):
    sched, _, rows = _sorted_case(kernel_device, 8, 3, 2, 3, seed=3)
    a = rows(128).bfloat16().to(kernel_device)
    too_many = rf"^a: expected at most {sched.capacity_rows} rows \(the schedule's capacity\)"
    with pytest.raises(ValueError, match=too_many):
        quantize_fp8_block_sorted_t(torch.cat([a, a]), sched)
    with pytest.raises(TypeError, match="a: expected dtype torch.bfloat16 or torch.float32, got torch.float16"):
        quantize_fp8_block_sorted_t(a.half(), sched)
    with pytest.raises(ValueError, match="a: expected unit stride along the last dim"):
        quantize_fp8_block_sorted_t(a.T.contiguous().T, sched)
    gate_up = torch.zeros(sched.capacity_rows, 2, 128, dtype=torch.bfloat16, device=kernel_device)
    with pytest.raises(ValueError, match=r"^gate_up: expected \[rows, 2, I\] with g and u adjacent"):
        quantize_fp8_block_swiglu_sorted_t(gate_up[:, :, :64], sched)
    with pytest.raises(ValueError, match=r"gate_up: expected a 3-D \[rows, 2, I\] tensor"):
        quantize_fp8_block_swiglu_sorted_t(gate_up[:, 0], sched)


@pytest.mark.parametrize("T, H, E, topk, used_experts", [(200, 384, 5, 3, 4), (1, 128, 3, 1, 3)])
def test_gathered_quantizers_are_bitwise_the_copy_quantized(kernel_device, T, H, E, topk, used_experts):
    """Token rows quantized straight into the sorted layout (no bf16 copy): dOut in 1×128 blocks
    along H, x and w·dOut (signed router weights) in blocks down the sorted rows, bit for bit
    the quantizers applied to `gather_sorted_rows`' copies; a NaN in one token reaches exactly
    the blocks of its rows; an expert with no rows; padding rows hold zeros (dOut's scale 0)."""
    gen = torch.Generator().manual_seed(T + H)
    sched, blocks, _ = _sorted_case(kernel_device, T, E, topk, used_experts, seed=T)
    ctx = f"{kernel_device=} {T=} {H=} {E=} {topk=} block_m={sched.block_m}"
    x = torch.randn(T, H, generator=gen).bfloat16()
    d_out = (torch.randn(T, H, generator=gen) * torch.logspace(-2, 2, H)).bfloat16()
    x[T // 2, 5] = float("nan")
    w = torch.randn(T, topk, generator=gen)  # any sign
    x, d_out, w = x.to(kernel_device), d_out.to(kernel_device), w.to(kernel_device)
    x_sorted, d_out_sorted, dy_sorted = gather_sorted_rows(x, d_out, w, sched, topk)
    num_rows = int(sched.num_rows)
    slots = [slot for _, _, slot in blocks]

    got = quantize_fp8_block_gathered(d_out, sched, topk)
    want = quantize_fp8_block_activations(d_out_sorted, sched.num_rows)
    assert got[0].shape == (sched.capacity_rows, H) and got[1].shape == (sched.capacity_rows, H // 128), ctx
    routed = (sched.row_source[:num_rows] >= 0).nonzero().flatten()
    _assert_same([t[routed] for t in got], [t[routed] for t in want], f"dOut rows {ctx}")
    unrouted = (sched.row_source[:num_rows] < 0).nonzero().flatten()
    assert unrouted.numel() > 0, ctx
    assert torch.all(got[0][unrouted].float() == 0) and torch.all(got[1][unrouted] == 0), f"dOut padding {ctx}"
    for name, token_rows, weights, copy in (("x", x, None, x_sorted), ("w·dOut", d_out, w, dy_sorted)):
        q_t, scale_t = quantize_fp8_block_gathered_t(token_rows, sched, topk, weights)
        want_q, want_scale = quantize_fp8_block_sorted_t(copy, sched)
        _assert_same([q_t[:, :num_rows].contiguous(), scale_t[slots]],
                     [want_q[:, :num_rows].contiguous(), want_scale[slots]], f"{name} {ctx}")
    source = sched.row_source.cpu()[:num_rows]
    padding = (source < 0).nonzero().flatten()
    assert padding.numel() > 0 and torch.all(q_t.cpu()[:, padding].float() == 0), f"padding {ctx}"
    # x's NaN token has topk routes, each in another expert's block: that many NaN scales, all in column 5
    x_scales = quantize_fp8_block_gathered_t(x, sched, topk)[1].cpu()[slots]
    assert x_scales.isnan().sum() == x_scales[:, 5].isnan().sum() == topk, f"NaN blocks {ctx}"


def _dequantized(q, scale):
    """fp32 q · s of e4m3 rows [R, W] with their 1×128 scales [R, W/128], as the kernels form it."""
    return q.float() * scale.repeat_interleave(128, dim=1)[:, : q.shape[1]]


@pytest.mark.parametrize("T, H, I, E, topk, used_experts", [(200, 384, 256, 5, 3, 4), (1, 256, 128, 3, 1, 3)])
def test_requantized_operands_are_the_dequantized_copies_quantized(kernel_device, T, H, I, E, topk, used_experts):
    """e4m3 operands quantized along their rows, requantized down the sorted rows: x's token rows,
    w·dOut's (signed router weights: each element q · (w · s) in fp32) and h's sorted rows, bit
    for bit the quantizers applied to the fp32 copies dequantized in torch; subnormal E4M3 bytes
    among them (decoded from the bits under the interpreter); a NaN token's blocks NaN; padding
    rows zero (past the NaN token's block of columns, whose blocks down the rows are NaN)."""
    gen = torch.Generator().manual_seed(T + H + 1)
    sched, blocks, rows = _sorted_case(kernel_device, T, E, topk, used_experts, seed=T + 1)
    ctx = f"{kernel_device=} {T=} {H=} {I=} {E=} {topk=} block_m={sched.block_m}"
    num_rows, slots = int(sched.num_rows), [slot for _, _, slot in blocks]
    x = (torch.randn(T, H, generator=gen) * torch.logspace(-4, 1, H)).bfloat16()
    x[T // 2, 5] = float("nan")
    x[T - 1, 128:131] = torch.tensor([448.0, 3 * 2.0**-9, -(2.0**-8)])  # scale 1: two subnormal bytes
    x_q, x_scale = quantize_fp8_block_activations(x.to(kernel_device))  # [T, H], [T, H/128]
    x_bytes = x_q.cpu().view(torch.uint8)
    assert (((x_bytes & 0x78) == 0) & ((x_bytes & 0x7) != 0)).any(), f"no subnormal E4M3 byte {ctx}"
    w = torch.randn(T, topk, generator=gen)
    source = sched.row_source.cpu()
    routed = source[:num_rows] >= 0
    slot, token = source[:num_rows].clamp(min=0), source[:num_rows].clamp(min=0) // topk
    x_deq = _dequantized(x_q.cpu(), x_scale.cpu())  # [T, H] fp32
    for name, weights in (("x", None), ("w·dOut", w)):
        copy = torch.zeros(sched.capacity_rows, H)  # the sorted rows' fp32 operand
        if weights is None:
            copy[:num_rows][routed] = x_deq[token][routed]
        else:
            factor = weights.flatten()[slot][:, None] * x_scale.cpu().repeat_interleave(128, dim=1)[token]
            copy[:num_rows][routed] = (x_q.cpu()[token].float() * factor)[routed]
        got_q, got_scale = quantize_fp8_block_gathered_t(
            x_q, sched, topk, None if weights is None else weights.to(kernel_device), x_scale
        )
        want_q, want_scale = quantize_fp8_block_sorted_t(copy.to(kernel_device), sched)
        _assert_same([got_q[:, :num_rows].contiguous(), got_scale[slots]],
                     [want_q[:, :num_rows].contiguous(), want_scale[slots]], f"{name} {ctx}")
        assert got_scale.cpu()[slots][:, 5].isnan().sum() == topk, f"{name}: the NaN token's blocks {ctx}"
        padding = got_q.cpu()[128:, :num_rows][:, ~routed]  # past the NaN token's block along H (NaN blocks here)
        assert padding.numel() > 0 and torch.all(padding.float() == 0), f"{name}: padding rows {ctx}"
    h = rows(I, scale=torch.logspace(-3, 2, I)).bfloat16()
    h[:num_rows][~routed] = 0  # what the forward's gate/up stores in padding rows
    h_q, h_scale = quantize_fp8_block_activations(h.to(kernel_device), sched.num_rows)
    h_deq = torch.zeros(sched.capacity_rows, I)
    h_deq[:num_rows] = _dequantized(h_q.cpu()[:num_rows], h_scale.cpu()[:num_rows])
    got_q, got_scale = quantize_fp8_block_sorted_t(h_q, sched, h_scale)  # rows past num_rows: never read
    want_q, want_scale = quantize_fp8_block_sorted_t(h_deq.to(kernel_device), sched)
    _assert_same([got_q[:, :num_rows].contiguous(), got_scale[slots]],
                 [want_q[:, :num_rows].contiguous(), want_scale[slots]], f"h {ctx}")


def test_requantized_operand_errors(kernel_device):
    sched, _, _ = _sorted_case(kernel_device, 8, 3, 2, 3, seed=3)
    x_q, x_scale = quantize_fp8_block_activations(torch.randn(8, 256, device=kernel_device))
    with pytest.raises(ValueError, match=r"^a_scale: expected a contiguous fp32 \[8, 2\] tensor"):
        quantize_fp8_block_gathered_t(x_q, sched, 2, None, x_scale[:, :1])
    with pytest.raises(ValueError, match=r"^a: expected a 2-D \[T, W\] float8_e4m3fn tensor"):
        quantize_fp8_block_gathered_t(x_q.float(), sched, 2, None, x_scale)
    with pytest.raises(ValueError, match=r"^a: expected a 2-D \[rows, W\] float8_e4m3fn tensor"):
        quantize_fp8_block_sorted_t(x_q.view(torch.uint8), sched, x_scale)
    with pytest.raises(ValueError, match=r"^a_scale: expected a contiguous fp32 \[8, 2\] tensor"):
        quantize_fp8_block_sorted_t(x_q, sched, x_scale.double())


def test_gathered_quantizer_errors(kernel_device):
    sched, _, _ = _sorted_case(kernel_device, 8, 3, 2, 3, seed=3)
    x = torch.zeros(8, 128, dtype=torch.bfloat16, device=kernel_device)
    with pytest.raises(ValueError, match=r"^x: expected bf16 token rows \[T, W\]"):
        quantize_fp8_block_gathered(x.float(), sched, 2)
    with pytest.raises(ValueError, match=r"^x: expected an even number of columns"):
        quantize_fp8_block_gathered(x[:, :127], sched, 2)
    with pytest.raises(ValueError, match=r"^topk: expected at least 1, got 0"):
        quantize_fp8_block_gathered_t(x, sched, 0)
    with pytest.raises(ValueError, match=r"^topk_weights: expected a contiguous fp32 \[8, 2\] tensor"):
        quantize_fp8_block_gathered_t(x, sched, 2, torch.zeros(8, 3, device=kernel_device))


# --------------------------------------------------------------------------- the Gluon transposing quantizer


_GLUON_VARIANTS = {  # name: (a's element type, flags)
    "sorted bf16": ("bf16", dict(SWIGLU=False, HAS_LIMIT=False, GATHER=False, HAS_WEIGHTS=False, SCALED=False)),
    "sorted fp32": ("fp32", dict(SWIGLU=False, HAS_LIMIT=False, GATHER=False, HAS_WEIGHTS=False, SCALED=False)),
    "h from g, u": ("bf16", dict(SWIGLU=True, HAS_LIMIT=True, GATHER=False, HAS_WEIGHTS=False, SCALED=False)),
    "x gathered": ("bf16", dict(SWIGLU=False, HAS_LIMIT=False, GATHER=True, HAS_WEIGHTS=False, SCALED=False)),
    "w·dOut gathered": ("bf16", dict(SWIGLU=False, HAS_LIMIT=False, GATHER=True, HAS_WEIGHTS=True, SCALED=False)),
    "h requantized": ("u8", dict(SWIGLU=False, HAS_LIMIT=False, GATHER=False, HAS_WEIGHTS=False, SCALED=True)),
    "x requantized": ("u8", dict(SWIGLU=False, HAS_LIMIT=False, GATHER=True, HAS_WEIGHTS=False, SCALED=True)),
    "w·dOut requantized": ("u8", dict(SWIGLU=False, HAS_LIMIT=False, GATHER=True, HAS_WEIGHTS=True, SCALED=True)),
}


@pytest.mark.parametrize("variant", list(_GLUON_VARIANTS))
def test_sorted_t_gluon_compiles_for_sm90a_without_spills(variant):
    """Any machine: the Gluon kernel compiles for Hopper (its layout change from the loads' to
    the stores' is asserted to move no data), spills nothing, and keeps 3 programs of 4 warps
    resident per SM (≤ 168 registers)."""
    element, flags = _GLUON_VARIANTS[variant]
    kernel = qf._quantize_sorted_t_gluon_kernel
    constants = dict(flags, FAST_SIGMOID=True, ROWS_PER_THREAD=HOPPER.sorted_gluon_rows_per_thread)
    pointer_types = {"a_ptr": f"*{element}", "q_t_ptr": "*u8", "scale_t_ptr": "*fp32", "topk_weights_ptr": "*fp32",
                     "a_scale_ptr": "*fp32"}
    signature = {name: "constexpr" if name in constants else pointer_types.get(name, "*i32") if name.endswith("_ptr")
                 else "fp32" if name == "swiglu_limit" else "i32" for name in kernel.arg_names}
    aligned = tuple(name for name in signature if name.endswith("_ptr")) + ("width", "capacity_rows", "stride_a_r")
    registers, spilled = gluon_ptxas_report("mok.kernels.quant.fp8_block", "_quantize_sorted_t_gluon_kernel",
                                            signature, constants, aligned,
                                            num_warps=HOPPER.sorted_gluon_num_warps_e4m3 if flags["SCALED"]
                                            else HOPPER.sorted_gluon_num_warps)
    assert spilled == 0 and registers <= 168, f"{variant}: {registers} registers, {spilled} bytes spilled"


@pytest.mark.parametrize("element", ["bf16", "fp32"])
def test_weights_gluon_compiles_for_sm90a_without_spills(element):
    """Any machine: the Gluon weight quantizer compiles for Hopper (its transpose is asserted to
    move no data) and spills nothing (ptxas, sm_90a: 254 registers for bf16, 201 for fp32). On a
    GPU, `test_weights_random` and `test_weight_edge_cases` check its bytes against the reference."""
    kernel = qf._quantize_weight_128x128_gluon_kernel
    constants = dict(ROWS_PER_THREAD=HOPPER.weight_gluon_rows_per_thread)
    pointer_types = {"w_ptr": f"*{element}", "q_ptr": "*u8", "q_t_ptr": "*u8"}
    signature = {name: "constexpr" if name in constants else pointer_types.get(name, "*fp32")
                 if name.endswith("_ptr") else "i32" for name in kernel.arg_names}
    aligned = tuple(name for name in signature if name.endswith("_ptr")) + ("N", "K", "stride_w_e", "stride_w_n")
    registers, spilled = gluon_ptxas_report("mok.kernels.quant.fp8_block", "_quantize_weight_128x128_gluon_kernel",
                                            signature, constants, aligned, num_warps=HOPPER.weight_gluon_num_warps)
    assert spilled == 0, f"{element}: {registers} registers, {spilled} bytes spilled"


@pytest.mark.skipif(not torch.cuda.is_available() or interpreting(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows_per_thread, num_warps", [(16, 4), (8, 4), (16, 2)])
def test_sorted_t_gluon_is_bitwise_the_triton_kernel(monkeypatch, rows_per_thread, num_warps):
    """The Gluon kernel against the Triton one on every operand kind: widths that are no multiple
    of a program's columns, NaN and Inf blocks, an expert with no rows, an fp32 operand shorter
    than the capacity, signed router weights, the swiglu limit."""
    T, E, topk, W, I = 700, 9, 4, 328, 200
    sched, blocks, rows = _sorted_case("cuda", T, E, topk, E - 1, seed=5)  # the last expert gets no rows
    ctx = f"{T=} {E=} {topk=} {W=} {I=} {rows_per_thread=} {num_warps=}"
    gen = torch.Generator().manual_seed(6)
    a = rows(W, scale=torch.logspace(-3, 3, W))
    a[blocks[1][0] + 5, 9], a[blocks[2][0], 300] = float("nan"), float("-inf")
    gate_up = rows(2, I, scale=1.5).bfloat16()
    gate_up[(sched.row_source.cpu() < 0).nonzero().flatten()] = 0  # padding rows, as the forward stores them
    x = (torch.randn(T, W, generator=gen) * torch.logspace(-2, 2, W)).bfloat16().cuda()
    d_out = x.flip(0).contiguous()
    weights = torch.randn(T, topk, generator=gen).cuda()
    short = blocks[-1][1] - 3
    calls = {
        "sorted bf16": lambda: qf.quantize_fp8_block_sorted_t(a.bfloat16().cuda(), sched),
        "sorted fp32, short": lambda: qf.quantize_fp8_block_sorted_t(a[:short].cuda(), sched),
        "h from g, u": lambda: qf.quantize_fp8_block_swiglu_sorted_t(gate_up.cuda(), sched, 0.7),
        "x gathered": lambda: qf.quantize_fp8_block_gathered_t(x, sched, topk),
        "w·dOut gathered": lambda: qf.quantize_fp8_block_gathered_t(d_out, sched, topk, weights),
        "h requantized": lambda: qf.quantize_fp8_block_sorted_t(*h_pair[:1], sched, h_pair[1]),
        "x requantized": lambda: qf.quantize_fp8_block_gathered_t(x_pair[0], sched, topk, None, x_pair[1]),
        "w·dOut requantized": lambda: qf.quantize_fp8_block_gathered_t(x_pair[0], sched, topk, weights, x_pair[1]),
    }
    x_pair = quantize_fp8_block_activations(x)  # [T, W] e4m3 with a ragged last block, [T, 3]
    h_pair = quantize_fp8_block_activations(a.bfloat16().cuda(), sched.num_rows)
    num_rows, slots = int(sched.num_rows), [slot for _, _, slot in blocks]
    for name, call in calls.items():
        with override(sorted_gluon=False):
            want_q, want_scale = call()
        with override(sorted_gluon=True, sorted_gluon_rows_per_thread=rows_per_thread,
                      sorted_gluon_num_warps=num_warps, sorted_gluon_num_warps_e4m3=num_warps):
            monkeypatch.setattr(qf, "_quantize_sorted_t_kernel", None)  # the Triton kernel must not run
            got_q, got_scale = call()
            monkeypatch.undo()
        _assert_same([got_q[:, :num_rows].contiguous(), got_scale[slots]],
                     [want_q[:, :num_rows].contiguous(), want_scale[slots]], f"{name} {ctx}")
        if name == "sorted bf16":
            assert want_scale[slots].isnan().sum() == 2, f"the NaN and -Inf blocks {ctx}"
