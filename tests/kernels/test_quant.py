"""The Triton MXFP8 quantizer against mok.mxfp8 (the reference): bit-exact bytes, same errors;
and its rounding (`mxfp8_round`, the mxfp8 GEMM operands) against quantize -> dequantize."""

import re

import pytest
import torch

import mok
from mok import mxfp8, ops
from mok.kernels.common import interpreting
from mok.kernels.quant.mxfp8 import mxfp8_quantize_triton, mxfp8_round

NAMES = ("q", "scale", "q_t", "scale_t")


def _assert_bit_exact(t, rowwise, colwise, context, quantize=mxfp8_quantize_triton):
    got = quantize(t, rowwise, colwise)
    want = mxfp8.mxfp8_quantize(t.cpu(), rowwise, colwise)
    for name, g, w in zip(NAMES, got, want):
        if w is None:
            assert g is None, f"{name} should be None; {context}"
            continue
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous(), (
            f"{name}: {g.dtype} {tuple(g.shape)} vs {w.dtype} {tuple(w.shape)}; {context}"
        )
        gb, wb = g.cpu().view(torch.uint8), w.view(torch.uint8)
        bad = (gb != wb).nonzero()
        assert bad.numel() == 0, (
            f"{name}: {bad.shape[0]} of {wb.numel()} bytes differ, first at {bad[0].tolist()}: "
            f"got {gb[tuple(bad[0])].item():#04x}, want {wb[tuple(bad[0])].item():#04x}; {context}"
        )
    return got


def _random(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    # A wide dynamic range per block, so block exponents vary and some elements underflow.
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(96, 160), (3, 64, 96), (32, 32), (160, 288)])
@pytest.mark.parametrize("rowwise, colwise", [(True, False), (False, True), (True, True)])
def test_random_bit_exact(kernel_device, shape, dtype, rowwise, colwise):
    t = _random(shape, dtype, seed=sum(shape), device=kernel_device)
    _assert_bit_exact(t, rowwise, colwise, f"{shape=} {dtype=} {rowwise=} {colwise=}")


@pytest.mark.parametrize(
    "rowwise, colwise, shape", [(True, False, (40, 64)), (False, True, (64, 40)), (True, False, (2, 7, 32))]
)
def test_undivided_other_dim(kernel_device, rowwise, colwise, shape):
    """Only the blocked dim must be a multiple of 32; the other one is masked in the tiles."""
    t = _random(shape, torch.bfloat16, seed=7, device=kernel_device)
    _assert_bit_exact(t, rowwise, colwise, f"{shape=} {rowwise=} {colwise=}")


def test_strided_and_empty_inputs(kernel_device):
    base = _random((2, 96, 64), torch.float32, seed=3, device=kernel_device)
    _assert_bit_exact(base.transpose(-2, -1), True, True, "transposed view [2, 64, 96]")
    _assert_bit_exact(base[:, ::3, :], True, False, "row-strided view [2, 32, 64]")
    for shape in [(0, 64), (2, 0, 32)]:
        _assert_bit_exact(torch.zeros(shape, device=kernel_device), True, shape[-2] % 32 == 0, f"empty {shape=}")


# --------------------------------------------------------------------------- edge cases


def _e4m3_positive_values():
    return torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, increasing


def _edge_tensor():
    """[128, 128] fp32, one edge case per row block of 32 elements (rowwise blocks = (row, col//32))."""
    t = torch.randn(128, 128, generator=torch.Generator().manual_seed(1))
    blocks = t.view(128, 4, 32)
    blocks[0, 0] = 0.0  # all-zero block -> scale 0
    blocks[0, 1] = -0.0
    nxt = lambda v: torch.nextafter(torch.tensor(v), torch.tensor(float("inf"))).item()  # noqa: E731
    b = 4  # flat block index: rows 1..3
    for n in (-20, -1, 0, 1, 7, 100):  # amax exactly 448·2^n, and the next float above
        for amax in (448.0 * 2.0**n, nxt(448.0 * 2.0**n)):
            blocks[b // 4, b % 4].mul_(amax * 1e-3)[5] = -amax  # others ≪ amax
            b += 1
    # Subnormals: fp32 subnormals alone (2^-127 scaled by 2^127 is 1.0), and mixed with normals.
    sub = torch.tensor([2.0**-127, 2.0**-149, 3 * 2.0**-140, -(2.0**-126) * 0.75, 2.0**-130]).repeat(7)[:32]
    blocks[4, 0] = sub
    blocks[4, 1] = sub * 2.0**100
    blocks[4, 2] = torch.cat([sub[:31], torch.tensor([2.0**-120])])
    # Huge: fp32 max, within 3% of it (rounds up to 2^128 in dequant), and -huge.
    blocks[5, 0, :4] = torch.tensor([3.4028235e38, -3.3e38, 1.9375 * 2.0**127, 1e30])
    blocks[5, 1] = torch.full((32,), -3.0e38)
    # RNE on E4M3's grid: every midpoint between consecutive positive values, ±, with 448 in
    # each block so the scale is 2^0 and the midpoints are exact ties.
    vals = _e4m3_positive_values()
    mids = (vals[:-1] + vals[1:]) / 2  # 126 ties
    ties = torch.cat([mids, -mids, mids[:4] + 2.0**-20, mids[:4] - 2.0**-20])  # 260 values
    ties = torch.nn.functional.pad(ties, (0, 31 * 9 - ties.numel()), value=0.0).view(9, 31)
    tie_blocks = torch.cat([torch.full((9, 1), 448.0), ties], dim=1)  # [9, 32]
    blocks.view(-1, 32)[24:33] = tie_blocks  # rows 6..8
    # NaN and Inf, one block each: only that block (rowwise) may become NaN.
    blocks[10, 1, 3] = float("nan")
    blocks[11, 2, 31] = float("inf")
    blocks[12, 3, 0] = float("-inf")
    blocks[13, 0, 7] = -float("nan")
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rowwise, colwise", [(True, False), (False, True), (True, True)])
def test_edge_cases_bit_exact(kernel_device, dtype, rowwise, colwise):
    t = _edge_tensor().to(dtype)
    _assert_bit_exact(t.to(kernel_device), rowwise, colwise, f"edge cases {dtype=} {rowwise=} {colwise=}")


def test_edge_case_bytes(kernel_device):
    """Spot checks of what the rules say, beyond agreeing with the reference."""
    t = _edge_tensor()
    q, scale, q_t, scale_t = mxfp8_quantize_triton(t.to(kernel_device), True, True)
    q, scale, q_t, scale_t = (x.cpu().view(torch.uint8) for x in (q, scale, q_t, scale_t))
    assert scale[0, 0] == 0 and scale[0, 1] == 0 and (q[0, :64] & 0x7F == 0).all(), "all-zero block"
    assert scale[1, 0] == 127 - 20 and q[1, 5] == 0xFE, "amax = 448·2^-20 -> exp -20, element -448"
    assert scale[1, 1] == 127 - 20 + 1 and q[1, 32 + 5] == 0xF6, "next float above -> exp -19, -224"
    assert scale[4, 0] == 0 and q[4, 0] == 0x38, "2^-127 alone scales by 2^127 to 1.0"
    nan_blocks = (scale == 255).nonzero().tolist()
    assert nan_blocks == [[10, 1], [11, 2], [12, 3], [13, 0]], f"rowwise NaN/Inf blocks: {nan_blocks}"
    for r, b in nan_blocks:
        assert (q[r, b * 32 : (b + 1) * 32] == 0x7F).all(), f"NaN block {r, b} elements"
    assert (q[(scale != 255).repeat_interleave(32, dim=1)] & 0x7F != 0x7F).all(), "NaN outside NaN blocks"
    nan_t = (scale_t == 255).nonzero().tolist()
    assert nan_t == [[7, 0], [35, 0], [95, 0], [96, 0]], f"colwise NaN/Inf blocks: {nan_t}"
    # Ties to even: midpoint between bytes b and b+1 goes to the even byte.
    vals = _e4m3_positive_values()
    want = torch.arange(126, dtype=torch.uint8)
    want = want + (want & 1)  # (b, b+1) -> the even of the two
    got = q.view(-1, 32)[24:33, 1:].reshape(-1)[:126]
    assert torch.equal(got, want), f"ties: {(got != want).nonzero().flatten().tolist()} ({vals[:3].tolist()}...)"


# --------------------------------------------------------------------------- errors, op


def _bad_inputs(device):
    bf = lambda *s: torch.zeros(*s, dtype=torch.bfloat16, device=device)  # noqa: E731
    return [
        ("not a tensor", [[1.0] * 32], True, False),
        ("fp16", torch.zeros(32, 32, dtype=torch.float16, device=device), True, False),
        ("1-D", bf(64), True, False),
        ("4-D", bf(2, 2, 32, 32), True, False),
        ("N = 48", bf(32, 48), True, False),
        ("M = 48", bf(48, 32), False, True),
        ("M = 40 both", bf(40, 64), True, True),
        ("neither", bf(32, 32), False, False),
    ]


@pytest.mark.parametrize("case", range(8))
def test_errors_match_reference(kernel_device, case):
    what, t, rowwise, colwise = _bad_inputs(kernel_device)[case]
    with pytest.raises((TypeError, ValueError)) as ref:
        mxfp8.mxfp8_quantize(t, rowwise, colwise)
    for fn in (mxfp8_quantize_triton, ops.mxfp8_quantize):
        with pytest.raises(ref.type, match=f"^{re.escape(str(ref.value))}$"):
            fn(t, rowwise, colwise)
    assert str(ref.value).startswith(("t: ", "mxfp8_quantize: ")), f"{what}: {ref.value}"


def test_custom_op(kernel_device):
    assert mok.mxfp8_quantize is mxfp8.mxfp8_quantize, "mok.mxfp8_quantize must stay the reference"
    t = _random((2, 64, 96), torch.bfloat16, seed=11, device=kernel_device)
    for rowwise, colwise in [(True, False), (False, True), (True, True)]:
        ctx = f"mok::mxfp8_quantize {rowwise=} {colwise=}"
        _assert_bit_exact(t, rowwise, colwise, ctx, quantize=ops.mxfp8_quantize)
    # test_schema is left out: it costs ~13 s on CPU and the op mutates nothing (mutates_args=()).
    torch.library.opcheck(
        ops._mxfp8_quantize.op,
        (t[:1, :32, :64], True, True),
        test_utils=("test_autograd_registration", "test_faketensor"),
    )
    fake_q_t = ops._mxfp8_quantize.op(t[:, :32], False, True)
    assert fake_q_t[0].shape == (0,) and fake_q_t[2].shape == (2, 96, 32), "placeholder for the pair not asked"


# --------------------------------------------------------------------------- rounding (mxfp8_round)


def _assert_round_matches_dequantized(t, context, schedule=None):
    """mxfp8_round's rows and cols against the reference's quantize -> dequantize, as bf16, bit
    for bit (NaN blocks as NaN); and the dequantized values are exact in bf16 where they are
    at least bf16's smallest normal (the rounding loses nothing a bf16 GEMM needs)."""
    rows, cols = mxfp8_round(t, True, True, schedule)
    q, scale, q_t, scale_t = mxfp8.mxfp8_quantize(t.cpu(), rowwise=True, colwise=True)
    for name, got, exact in (("rows", rows, mxfp8.mxfp8_dequantize(q, scale)),
                             ("cols", cols, mxfp8.mxfp8_dequantize(q_t, scale_t).transpose(-2, -1))):
        want = exact.bfloat16()
        got = got.cpu()
        assert got.shape == t.shape and got.dtype == torch.bfloat16, f"{name}: {got.dtype} {list(got.shape)}; {context}"
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), f"{name}: NaN blocks differ; {context}"
        checked = ~nan
        if interpreting():  # triton 3.6's interpreter converts fp32 subnormals to bf16 wrongly (seen on CPU)
            checked &= want.float().abs() >= 2.0**-126
        bad = (got.view(torch.int16) != want.view(torch.int16)) & checked
        assert not bad.any(), (
            f"{name}: {int(bad.sum())} values differ, first at {bad.nonzero()[0].tolist()}: "
            f"got {got[bad][0].item()}, want {want[bad][0].item()}; {context}"
        )
        normal = exact.abs() >= 2.0**-126
        assert torch.equal(want.float()[normal], exact[normal]), f"{name}: not exact in bf16; {context}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(96, 160), (3, 64, 96), (32, 32)])
def test_round_random_matches_dequantized_quantization(kernel_device, shape, dtype):
    t = _random(shape, dtype, seed=sum(shape) + 1, device=kernel_device)
    _assert_round_matches_dequantized(t, f"{shape=} {dtype=}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_edge_cases(kernel_device, dtype):
    """Zero blocks, amax at the exponent steps, subnormals, huge values, E4M3 ties, NaN and Inf."""
    _assert_round_matches_dequantized(_edge_tensor().to(dtype).to(kernel_device), f"edge cases {dtype=}")


def test_round_sorted_layout_masks_padding_and_skips_unused_rows(kernel_device):
    """A sorted-layout operand: padding rows (row_source -1) hold garbage that must neither
    reach their block's scale nor survive (they come out zero); rows past num_rows stay as
    they were in the output (unwritten), which the comparison below leaves out."""
    from mok.kernels.gemm.common import routing_block_m
    from mok.kernels.routing.schedule import build_routing_schedule

    T, E, topk, W = 37, 5, 2, 64
    ids = torch.randint(0, E, (T, topk), generator=torch.Generator().manual_seed(2)).to(kernel_device)
    sched = build_routing_schedule(ids, E, routing_block_m(), torch.zeros(1, dtype=torch.int32, device=kernel_device))
    a = _random((sched.capacity_rows, W), torch.bfloat16, seed=5, device=kernel_device)
    source = sched.row_source.cpu()
    num_rows = int(sched.num_rows)
    pad = (source[:num_rows] < 0).nonzero().flatten()
    assert pad.numel() > 0, "the test wants padding rows"
    a[pad.to(kernel_device)] = 3.0e4  # garbage far above the real rows' scale
    rows, cols = mxfp8_round(a, True, True, sched)
    clean = a.clone()
    clean[pad.to(kernel_device)] = 0
    want_rows, want_cols = mxfp8_round(clean[:num_rows], True, True)  # num_rows is a multiple of BLOCK_M
    assert torch.equal(rows[:num_rows], want_rows) and torch.equal(cols[:num_rows], want_cols)
    assert not torch.equal(mxfp8_round(a[:num_rows], False, True)[1], want_cols), "the garbage must matter unmasked"


def test_round_errors(kernel_device):
    t = torch.randn(64, 40, device=kernel_device)
    with pytest.raises(ValueError, match=r"dim N \(last\) = 40 must be a multiple of 32"):
        mxfp8_round(t, True, False)
    with pytest.raises(TypeError, match=r"^t: expected dtype torch.bfloat16 or torch.float32, got torch.float16"):
        mxfp8_round(t[:, :32].half(), True, False)
