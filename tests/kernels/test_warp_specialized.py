"""The warp-specialized (Gluon, Hopper) GEMMs: bitwise the Triton kernels'
output on a Hopper GPU (odd sizes, empty experts, one tile per program and many, where the two
consumer warp groups take turns), compiled for sm_90a on any machine (no spills), and clear
errors where they cannot run."""

import pytest
import torch
import triton

from mok.fp8_block import fp8_block_dequantize, fp8_block_quantize
from mok.kernels.gemm import dgrad, hopper_wgrad
from mok.kernels.gemm import hopper_common as ws
from mok.kernels.gemm.dgrad import (
    dgrad_config,
    down_dgrad_swiglu,
    down_dgrad_swiglu_fp8_block,
    gate_up_dgrad_scatter,
    gate_up_dgrad_scatter_fp8_block,
)
from mok.kernels.routing.gather import gather_sorted_rows
from mok.kernels.gemm.common import gemm_config, routing_block_m
from mok.kernels.gemm.down import down_scatter, down_scatter_fp8_block
from mok.kernels.gemm.gate_up import gate_up_swiglu, gate_up_swiglu_fp8_block
from mok.kernels.plan import HOPPER, kernel_plan, override
from mok.kernels.quant.fp8_block import (
    quantize_fp8_block_activations,
    quantize_fp8_block_gathered,
    quantize_fp8_block_sorted_t,
    quantize_fp8_block_swiglu_sorted_t,
)
from mok.kernels.routing.schedule import build_routing_schedule
from mok.kernels.gemm.wgrad import (
    down_wgrad,
    down_wgrad_fp8_block,
    gate_up_wgrad,
    gate_up_wgrad_fp8_block,
    wgrad_config,
)
from mok.reference import Gradients
from mok.testing import make_inputs
from mok.testing.sm90 import gluon_ptxas_report

_WS_CONFIG = ws.tile_config(cooperative=False)
# The constexprs every launcher takes from the plan, as on a Hopper GPU.
_PLAN_META = dict(STORE_VECTOR=HOPPER.warp_specialized_store_vector,
                  CONSUMER_REGISTERS=HOPPER.warp_specialized_consumer_registers,
                  PRODUCER_REGISTERS=HOPPER.warp_specialized_producer_registers)

# Bytes per thread that ptxas spills (at 168 registers) in the fp8_block kernels that do not fit
# their registers exactly, by Triton release: each release brings its own ptxas (3.9 compiles
# sm_90a with CUDA 13.4's), which allocates differently. Every other kernel spills nothing under
# each. The spills hold per-tile values, reloaded once per tile: none lies in a K loop under 3.6;
# under 3.9 one value of the wide gate/up dgrad's second consumer is reloaded once per K step
# (SASS). The layer's speed under 3.9 against 3.6 is in record h100-20261205-triton-versions.
_TRITON_RELEASE = tuple(int(part) for part in triton.__version__.split(".")[:2])
_FP8_SPILLS = {
    "gate/up dgrad": {(3, 6): 56, (3, 7): 60, (3, 8): 64, (3, 9): 84},
    "gate/up dgrad, sorted rows": {(3, 6): 112, (3, 7): 112, (3, 8): 112, (3, 9): 112},
    "gathered gate/up": {(3, 6): 12, (3, 7): 16, (3, 8): 28, (3, 9): 12},
}


def _allowed_spill(kernel: str) -> int:
    """`_FP8_SPILLS[kernel]` under this Triton: a release newer than the table gets the largest."""
    by_release = _FP8_SPILLS[kernel]
    return by_release.get(_TRITON_RELEASE, max(by_release.values()))

hopper = pytest.mark.skipif(not ws.available_here(), reason="needs a Hopper GPU")


def _ptxas_report(kernel_name: str, signature: dict, constants: dict, aligned: tuple[str, ...] = ()) -> tuple[int, int]:
    module = {"_scatter_ws_kernel": "hopper_scatter", "_gathered_ws_kernel": "hopper_gathered",
              "_wgrad_ws_kernel": "hopper_wgrad"}[kernel_name]
    return gluon_ptxas_report(f"mok.kernels.gemm.{module}", kernel_name, signature, constants, aligned)


def _descriptor_type(block_shape, dtype: torch.dtype = torch.bfloat16) -> str:
    name = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv", torch.float32: "fp32"}[dtype]
    return f"tensordesc<{name}[{block_shape[0]},{block_shape[1]}],{ws._shared_layout(tuple(block_shape), dtype)!r}>"


def _scatter_signature(a_block, b_block, dtype: torch.dtype, meta: dict, y_type: str = "*bf16") -> dict:
    y_desc = _descriptor_type((a_block[0], 128)) if meta["TMA_STORE"] else _descriptor_type(a_block, dtype)
    return {
        "a_desc": _descriptor_type(a_block, dtype), "a2_desc": _descriptor_type(a_block, dtype),
        "b_desc": _descriptor_type(b_block, dtype), "b2_desc": _descriptor_type(b_block, dtype), "y_ptr": y_type,
        "a_scale_ptr": "*fp32", "a2_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "b2_scale_ptr": "*fp32",
        "row_source_ptr": "*i32", "tile_expert_ptr": "*i32", "num_rows_ptr": "*i32", "m_dim": "i32", "n_dim": "i32",
        "reduce_dim": "i32", "stride_y": "i32", "stride_a_scale": "i32", "y_desc": y_desc,
        **{name: "constexpr" for name in meta},
    }


def _wgrad_signature(a_block, b_block, dtype: torch.dtype, meta: dict) -> dict:
    fp8 = dtype == torch.float8_e4m3fn  # B's column scales through TMA, [1, BLOCK_N] per step
    b_scale_desc = _descriptor_type((1, b_block[0]), torch.float32) if fp8 else _descriptor_type(b_block, dtype)
    out_desc = (_descriptor_type(hopper_wgrad._wgrad_store_box(meta, fp8)) if meta["TMA_STORE"]
                else _descriptor_type(b_block, dtype))
    return {
        "a_desc": _descriptor_type(a_block, dtype), "a2_desc": _descriptor_type(a_block, dtype),
        "b_desc": _descriptor_type(b_block, dtype), "b_scale_desc": b_scale_desc, "out_ptr": "*bf16",
        "out2_ptr": "*bf16", "out_desc": out_desc, "out2_desc": out_desc, "a_scale_ptr": "*fp32",
        "expert_offsets_ptr": "*i32", "expert_counts_ptr": "*i32", "num_tiles": "i32",
        "m_dim": "i32", "n_dim": "i32", "split_m": "i32", "stride_out_e": "i32", "stride_a_scale": "i32",
        **{name: "constexpr" for name in meta},
    }


@pytest.mark.parametrize("cooperative, two_operands", [(False, False), (True, False), (True, True)])
def test_kernels_compile_for_sm90a_without_spills(cooperative, two_operands):
    """The shipped tiles fit: 3 warp groups at 168 registers each at launch, nothing spilled,
    for both schedules: the down GEMM and down wgrad, and with two operand pairs the gate/up
    dgrad (two K segments, N-major weights) and the gate/up wgrad (two outputs); the cooperative
    wgrads with their TMA stores."""
    cfg = ws.tile_config(cooperative)
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    rows = ws._consumer_rows(block_m, cooperative)
    meta = dict(COOPERATIVE=cooperative, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=cfg["num_stages"],
                **_PLAN_META)
    b_block = (block_k, block_n) if two_operands else (block_n, block_k)
    scatter_meta = dict(meta, SCATTER=True, TMA_STORE=False, TWO_SEGMENTS=two_operands, B_K_MAJOR=not two_operands,
                        FP8=False, GROUP_M=8)
    # the wgrad at its own stages, cooperative with its TMA stores
    wgrad_meta = dict(meta, TWO_OUTPUTS=two_operands, FP8=False, TMA_STORE=cooperative and HOPPER.bf16_wgrad_tma_store,
                      GROUP_M=8, STAGES=ws.wgrad_tile_config(cooperative)["num_stages"])
    report = {
        "scatter GEMM": _ptxas_report("_scatter_ws_kernel", _scatter_signature((rows, block_k), b_block,
                                                                               torch.bfloat16, scatter_meta),
                                      scatter_meta),
        "wgrad": _ptxas_report("_wgrad_ws_kernel", _wgrad_signature((block_k, rows), (block_k, block_n),
                                                                     torch.bfloat16, wgrad_meta), wgrad_meta),
    }
    for kernel, counts in report.items():
        assert counts == (168, 0), f"{kernel}, {cooperative=} {two_operands=}: (registers, spilled bytes) {counts}"


def _fp8_tile(cfg: dict, wide: bool) -> dict:
    """The fp8_block tile config (128×256) or its 128×128 form."""
    return cfg if wide else dict(cfg, BLOCK_N=128, num_stages=6)


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("kernel", ["wgrad", "down", "down dgrad product", "gate/up dgrad", "down, sorted rows",
                                    "gate/up dgrad, sorted rows"])
def test_fp8_block_kernels_compile_for_sm90a_without_spills(kernel, wide):
    """The fp8_block tiles (each consumer's accumulator, two of them in the wide tile, and its
    step's fresh product, both K-major e4m3 operands) fit in the wgrads and in the scatter GEMMs
    (the gate/up dgrad's two K segments; the down dgrad's product, stored in fp32 to its own
    rows; the down GEMM and the gate/up dgrad into the sorted layout, in the wide tile by TMA
    stores): 168 registers per thread at launch, nothing spilled but, in the wide gate/up dgrad,
    a few per-tile values (`_FP8_SPILLS`; under 3.6 in the SASS: stored before the first
    segment's K loop, reloaded between the segments and after the second; none in the loops;
    more with the TMA stores' descriptor and buffers beside them, the same way)."""
    cfg = _fp8_tile(ws.fp8_block_tile_config(stacked=kernel == "wgrad"), wide)
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    meta = dict(COOPERATIVE=True, FP8=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                GROUP_M=cfg["GROUP_M"], STAGES=cfg["num_stages"], **_PLAN_META)
    a_block, b_block = (block_m // 2, block_k), (block_n, block_k)
    if kernel == "wgrad":
        meta = dict(meta, TWO_OUTPUTS=False, TMA_STORE=HOPPER.fp8_wgrad_tma_store)
        report = _ptxas_report("_wgrad_ws_kernel", _wgrad_signature(a_block, b_block, torch.float8_e4m3fn, meta), meta)
    else:
        product, sorted_rows = kernel == "down dgrad product", kernel.endswith("sorted rows")
        meta = dict(meta, SCATTER=not (product or sorted_rows), TMA_STORE=sorted_rows and wide,
                    TWO_SEGMENTS=kernel.startswith("gate/up dgrad"), B_K_MAJOR=True)
        signature = _scatter_signature(a_block, b_block, torch.float8_e4m3fn, meta, "*fp32" if product else "*bf16")
        report = _ptxas_report("_scatter_ws_kernel", signature, meta)
    registers, spilled = report
    allowed_spill = _allowed_spill(kernel) if wide and kernel in _FP8_SPILLS else 0
    assert registers == 168 and spilled <= allowed_spill, f"{kernel}, {wide=}: (registers, spilled bytes) {report}"


@pytest.mark.parametrize(
    "product, tma_store, gate_up_e4m3",
    [(False, True, False), (False, False, False), ("fp32", False, False), ("bf16", True, False), (False, True, True),
     (False, False, True)],
)
def test_fp8_block_gate_up_compiles_for_sm90a_without_spills(product, tma_store, gate_up_e4m3):
    """The forward's fp8_block gate/up (x's rows gathered by cp.async, g and u as a consumer's two
    accumulators, the SwiGLU and h-quantizing epilogue on them): 168 registers per thread at
    launch, nothing spilled but `_FP8_SPILLS["gathered gate/up"]` (under 3.6 in the SASS: three
    values of consumer 0, stored once at the start and reloaded once per tile, before its K loop;
    none in the K loops). x and H
    aligned, as fp8_block's H is a multiple of 128: 16-byte copies. With PRODUCT, the down
    dgrad's product over dOut's gathered token rows (both accumulators stored in fp32 or bf16,
    without the h epilogue): no more than 8 bytes. TMA_STORE (the gate/up and the bf16 product):
    the same, and the shared memory within the H200's 227 KB. GATE_UP_E4M3 (g and u quantized as h
    is, no limit): the same."""
    cfg = ws.fp8_block_tile_config()
    meta = dict(HAS_LIMIT=not (product or gate_up_e4m3), FAST_SIGMOID=True, STORE_GATE_UP=not product,
                GATE_UP_E4M3=gate_up_e4m3, PRODUCT=bool(product),
                TMA_STORE=tma_store, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
                STAGES=cfg["num_stages"], BYTE_VECTOR=HOPPER.gathered_byte_vector,
                GATHER_THREADS=HOPPER.gathered_producer_threads, **_PLAN_META)
    fp8, half = torch.float8_e4m3fn, (cfg["BLOCK_N"] // 2, cfg["BLOCK_K"])
    box = (cfg["BLOCK_M"] // 2, 128)
    signature = {
        "x_ptr": "*u8", "w_gate_desc": _descriptor_type(half, fp8), "w_up_desc": _descriptor_type(half, fp8),
        "h_ptr": f"*{product}" if product else "*u8", "h_scale_ptr": "*fp32",
        "gate_up_ptr": "*u8" if gate_up_e4m3 else "*bf16",
        "h_desc": _descriptor_type(box, torch.bfloat16 if product else fp8),
        "gate_up_desc": _descriptor_type(box, fp8 if gate_up_e4m3 else torch.bfloat16), "gate_up_scale_ptr": "*fp32",
        "x_scale_ptr": "*fp32",
        "w_gate_scale_ptr": "*fp32", "w_up_scale_ptr": "*fp32", "row_source_ptr": "*i32", "tile_expert_ptr": "*i32",
        "num_rows_ptr": "*i32", "topk": "i32", "hidden": "i32", "inter": "i32", "swiglu_limit": "fp32",
        **{name: "constexpr" for name in meta},
    }
    registers, spilled = _ptxas_report("_gathered_ws_kernel", signature, meta, aligned=("x_ptr", "hidden"))
    report = f"{product=} {tma_store=} {gate_up_e4m3=}: (registers, spilled bytes) {(registers, spilled)}"
    assert registers == 168 and spilled <= (8 if product else _allowed_spill("gathered gate/up")), report


def test_defaults_choose_it_only_where_it_runs():
    """No Hopper GPU here (or the interpreter): the default tile configs keep the Triton kernels."""
    if ws.available_here():
        pytest.skip("a Hopper GPU is present")
    for config in (gemm_config("down", 2048, 768), gemm_config("down", 7168, 2048), wgrad_config("down", 2048, 768),
                   wgrad_config("gate_up", 768, 2048), dgrad_config("gate_up", 2048, 768),
                   gemm_config("down", 2048, 768, "fp8_block"), dgrad_config("gate_up", 2048, 768, "fp8_block"),
                   dgrad_config("down", 768, 7168, "fp8_block"),
                   wgrad_config("down", 2048, 768, "fp8_block"), wgrad_config("gate_up", 768, 2048, "fp8_block")):
        assert "WARP_SPECIALIZED" not in config


def test_errors_name_the_tile_config(kernel_device, set_plan):
    """An explicit WARP_SPECIALIZED config is refused, naming it, where the kernels cannot run
    (not a Hopper GPU, or the interpreter), with main_grad, and ping-pong for the gate/up wgrad
    and the fp8_block GEMMs."""
    inp = make_inputs(8, 64, 64, 4, 2, seed=0, device=kernel_device)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    sched = build_routing_schedule(inp.topk_ids, 4, routing_block_m(), flag)
    h = torch.randn(sched.capacity_rows, 64).bfloat16().to(kernel_device)
    config = dict(_WS_CONFIG, BLOCK_M=sched.block_m, BLOCK_K=min(sched.block_m, HOPPER.ping_pong_tile["BLOCK_K"]))
    if not ws.warp_specialized_available(h.device):
        with pytest.raises(ValueError, match="tile_config: WARP_SPECIALIZED needs a Hopper GPU"):
            down_scatter(h, inp.w_down, sched, 16, tile_config=config)
    main_grad = torch.zeros(4, 64, 64, device=kernel_device)
    with pytest.raises(ValueError, match="tile_config: WARP_SPECIALIZED is for the wgrads into a new gradient"):
        down_wgrad(torch.randn_like(h), h, sched, main_grad=main_grad, tile_config=config)
    d_gate_up = torch.randn(sched.capacity_rows, 2, 64).bfloat16().to(kernel_device)
    with pytest.raises(ValueError, match="tile_config: the gate/up wgrad .two outputs. needs COOPERATIVE"):
        gate_up_wgrad(d_gate_up, torch.randn_like(h), sched, tile_config=config)
    d_out_sorted = torch.randn(sched.capacity_rows, 64).bfloat16().to(kernel_device)
    with pytest.raises(ValueError, match="tile_config: the down dgrad runs the Triton kernel only"):
        down_dgrad_swiglu(d_out_sorted, inp.topk_weights, d_gate_up, inp.w_down, sched, tile_config=config)
    # fp8_block: a schedule of 128-row tiles (one scale block per K step)
    sched = build_routing_schedule(inp.topk_ids, 4, 128, flag)
    dy, h_t = (quantize_fp8_block_sorted_t(torch.randn(sched.capacity_rows, 64, device=kernel_device), sched)
               for _ in range(2))
    fp8_config = ws.fp8_block_tile_config(stacked=False)
    with pytest.raises(ValueError, match="tile_config: WARP_SPECIALIZED is for the wgrads into a new gradient"):
        down_wgrad_fp8_block(*dy, *h_t, sched, main_grad=torch.zeros(4, 64, 64, device=kernel_device),
                             tile_config=fp8_config)
    with pytest.raises(ValueError, match="tile_config: the fp8_block wgrad needs COOPERATIVE"):
        down_wgrad_fp8_block(*dy, *h_t, sched, tile_config=dict(fp8_config, COOPERATIVE=False))
    with pytest.raises(ValueError, match="tile_config: the fp8_block wgrad needs BLOCK_N 128 or 256"):
        down_wgrad_fp8_block(*dy, *h_t, sched, tile_config=dict(fp8_config, BLOCK_N=192))
    inp = make_inputs(8, 128, 128, 4, 2, seed=0, device=kernel_device)  # fp8_block: H, I multiples of 128
    sched = build_routing_schedule(inp.topk_ids, 4, 128, flag)
    rows = quantize_fp8_block_activations(torch.randn(sched.capacity_rows, 128, device=kernel_device))
    weight = fp8_block_quantize(inp.w_down)
    with pytest.raises(ValueError, match="tile_config: the fp8_block down GEMM needs COOPERATIVE"):
        down_scatter_fp8_block(*rows, *weight[:2], sched, 16, tile_config=dict(fp8_config, COOPERATIVE=False))
    with pytest.raises(ValueError, match="tile_config: the fp8_block gate/up dgrad needs COOPERATIVE"):
        gate_up_dgrad_scatter_fp8_block(*rows, *rows, *weight[2:], *weight[2:], sched, 16,
                                        tile_config=dict(fp8_config, COOPERATIVE=False))
    gate_up = torch.randn(sched.capacity_rows, 2, 128, device=kernel_device).bfloat16()
    token_rows = quantize_fp8_block_activations(torch.randn(8, 128, device=kernel_device))
    with pytest.raises(ValueError, match="tile_config: the fp8_block down dgrad gathering token rows needs "
                                         "BLOCK_N 256"):
        down_dgrad_swiglu_fp8_block(*token_rows, inp.topk_weights, gate_up, *weight[2:], sched,
                                    tile_config=dict(fp8_config, BLOCK_N=128))
    set_plan(warp_specialized_fp8_block_down_dgrad_product=False,  # H alone picks the rows
             gathered_fp8_block_down_dgrad_max_hidden=0)  # dOut's sorted rows
    with pytest.raises(ValueError, match="tile_config: the fp8_block down dgrad needs COOPERATIVE"):
        down_dgrad_swiglu_fp8_block(*rows, inp.topk_weights, gate_up, *weight[2:], sched,
                                    tile_config=dict(fp8_config, COOPERATIVE=False))
    with pytest.raises(ValueError, match="tile_config: the fp8_block gate/up GEMM gathering token rows needs BLOCK_N "
                                         "256"):
        gate_up_swiglu_fp8_block(*quantize_fp8_block_activations(inp.x), *weight[:2], *weight[:2], sched, 2,
                                 tile_config=dict(fp8_config, BLOCK_N=128))


# (T, H, I, E, topk, skewed): odd H and I (ragged N and K tiles), one token, experts with no
# token, and enough tiles that every program runs several (ping-pong: both consumers take turns).
_CASES = [
    (37, 136, 200, 5, 2, False),
    (1, 64, 64, 4, 1, False),
    (300, 256, 768, 10, 8, True),
    (4096, 2048, 256, 8, 2, False),
    (2048, 512, 768, 16, 4, True),
]


def _inputs(T, H, I, E, topk, skewed, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(topk + 2, generator=gen)[:topk] for _ in range(T)]) if skewed else None
    inp = make_inputs(T, H, I, E, topk, seed=seed, device="cuda", signed_weights=True, topk_ids=ids)
    sched = build_routing_schedule(inp.topk_ids, E, routing_block_m(), torch.zeros(1, dtype=torch.int32, device="cuda"))
    return inp, sched


def _check_bitwise(got, expected, params):
    assert torch.equal(got, expected), f"{params}: max |diff| {(got.float() - expected.float()).abs().max()}"
    assert expected.abs().sum() > 0, params


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("cooperative", [False, True])
@pytest.mark.parametrize("T, H, I, E, topk, skewed", _CASES)
def test_down_gemm_is_bitwise_the_triton_kernel(T, H, I, E, topk, skewed, cooperative):
    inp, sched = _inputs(T, H, I, E, topk, skewed)
    h, _ = gate_up_swiglu(inp.x, inp.w_gate, inp.w_up, sched, topk)
    triton_config = gemm_config("down", H, I, allow_warp_specialized=False)
    expected = down_scatter(h, inp.w_down, sched, T * topk, tile_config=triton_config)
    got = down_scatter(h, inp.w_down, sched, T * topk, tile_config=ws.tile_config(cooperative))
    _check_bitwise(got, expected, f"{T=} {H=} {I=} {E=} {topk=} {skewed=} {cooperative=}")


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("cooperative", [False, True])
@pytest.mark.parametrize("T, H, I, E, topk, skewed", _CASES)
def test_down_wgrad_is_bitwise_the_triton_kernel(T, H, I, E, topk, skewed, cooperative):
    """Including exact zeros for experts with no rows (skewed cases)."""
    inp, sched = _inputs(T, H, I, E, topk, skewed, seed=1)
    d_out = torch.randn_like(inp.x)
    _, _, dy_sorted = gather_sorted_rows(inp.x, d_out, inp.topk_weights, sched, topk)
    h, _ = gate_up_swiglu(inp.x, inp.w_gate, inp.w_up, sched, topk)
    triton_config = wgrad_config("down", H, I, allow_warp_specialized=False)
    expected = down_wgrad(dy_sorted, h, sched, tile_config=triton_config)
    got = down_wgrad(dy_sorted, h, sched, tile_config=ws.wgrad_tile_config(cooperative))
    params = f"{T=} {H=} {I=} {E=} {topk=} {skewed=} {cooperative=}"
    _check_bitwise(got, expected, params)
    if skewed:
        assert got[topk + 2:].eq(0).all(), params


def _d_gate_up(sched, inter):
    """Random (d_g, d_u) rows with the down dgrad's exact zeros in padding rows."""
    d_gate_up = torch.randn(sched.capacity_rows, 2, inter, device="cuda").bfloat16()
    d_gate_up[sched.row_source < 0] = 0
    return d_gate_up


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("cooperative", [False, True])
@pytest.mark.parametrize("T, H, I, E, topk, skewed", _CASES)
def test_gate_up_dgrad_is_bitwise_the_triton_kernel(T, H, I, E, topk, skewed, cooperative):
    """Two K segments (d_g·Wg, then d_u·Wu) over N-major weights, scattered to the slots."""
    inp, sched = _inputs(T, H, I, E, topk, skewed, seed=3)
    d_gate_up = _d_gate_up(sched, I)
    triton_config = dgrad_config("gate_up", H, I, allow_warp_specialized=False)
    expected = gate_up_dgrad_scatter(d_gate_up, inp.w_gate, inp.w_up, sched, T * topk, tile_config=triton_config)
    got = gate_up_dgrad_scatter(d_gate_up, inp.w_gate, inp.w_up, sched, T * topk,
                                tile_config=ws.tile_config(cooperative))
    _check_bitwise(got, expected, f"{T=} {H=} {I=} {E=} {topk=} {skewed=} {cooperative=}")


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("T, H, I, E, topk, skewed", _CASES)
def test_gate_up_wgrad_is_bitwise_the_triton_kernel(T, H, I, E, topk, skewed):
    """The cooperative kernel's two outputs (d_w_gate from consumer 0, d_w_up from consumer 1)."""
    inp, sched = _inputs(T, H, I, E, topk, skewed, seed=2)
    x_sorted, _, _ = gather_sorted_rows(inp.x, torch.randn_like(inp.x), inp.topk_weights, sched, topk)
    d_gate_up = _d_gate_up(sched, I)
    triton_config = wgrad_config("gate_up", I, H, allow_warp_specialized=False)
    expected = gate_up_wgrad(d_gate_up, x_sorted, sched, tile_config=triton_config)
    got = gate_up_wgrad(d_gate_up, x_sorted, sched, tile_config=ws.wgrad_tile_config(cooperative=True))
    params = f"{T=} {H=} {I=} {E=} {topk=} {skewed=}"
    for name, g, e in zip(("d_w_gate", "d_w_up"), got, expected):
        _check_bitwise(g, e, f"{name} {params}")
        if skewed:
            assert g[topk + 2:].eq(0).all(), f"{name} {params}"


# fp8_block's GEMMs that reduce over H or I need both multiples of 128: _CASES rounded up.
_FP8_CASES = [(T, -(-H // 128) * 128, -(-I // 128) * 128, E, topk, skewed) for T, H, I, E, topk, skewed in _CASES]


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("sorted_rows", [False, True])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("T, H, I, E, topk, skewed", _FP8_CASES)
def test_fp8_block_scatter_gemms_are_bitwise_the_triton_kernel(T, H, I, E, topk, skewed, wide, sorted_rows):
    """The fp8_block down GEMM and gate/up dgrad (two K segments over the weights' transposed
    copies, each with its own row and weight scales), scattered to the slots, or with
    `sorted_rows` stored in the sorted layout (by TMA stores, the plan's `sorted_tma_store`, at the wide
    tile): the rows in use bitwise the Triton kernel's, and each route's row bitwise its slot's."""
    inp, sched = _inputs(T, H, I, E, topk, skewed, seed=6)
    h, d_gate, d_up = (quantize_fp8_block_activations(torch.randn(sched.capacity_rows, I, device="cuda"))
                       for _ in range(3))
    w_down = fp8_block_quantize(inp.w_down)[:2]  # [E, H, I] and its scales
    w_gate_t, w_up_t = (fp8_block_quantize(w)[2:] for w in (inp.w_gate, inp.w_up))  # [E, H, I] and their scales
    runs = {
        "down": (lambda cfg, rows: down_scatter_fp8_block(*h, *w_down, sched, T * topk, tile_config=cfg,
                                                          sorted_rows=rows),
                 gemm_config("down", H, I, "fp8_block", allow_warp_specialized=False)),
        "gate/up dgrad": (lambda cfg, rows: gate_up_dgrad_scatter_fp8_block(
            *d_gate, *d_up, *w_gate_t, *w_up_t, sched, T * topk, tile_config=cfg, sorted_rows=rows),
                          dgrad_config("gate_up", H, I, "fp8_block", allow_warp_specialized=False)),
    }
    num_rows = int(sched.num_rows)
    route_row = sched.route_row.long()
    for kind, (run, triton_config) in runs.items():
        params = f"{kind} {T=} {H=} {I=} {E=} {topk=} {skewed=} {wide=} {sorted_rows=}"
        got = run(_fp8_tile(ws.fp8_block_tile_config(), wide), sorted_rows)
        if sorted_rows:  # rows past num_rows are left unwritten
            _check_bitwise(got[:num_rows], run(triton_config, True)[:num_rows], params)
            _check_bitwise(got[route_row], run(triton_config, False), params)
        else:
            _check_bitwise(got, run(triton_config, False), params)


def _route_term_sums(d_out, w_down_t, gate_up, sched, topk, swiglu_limit, gathers, num_slots):
    """Σ_i |a_i · h_i| of each route's router-weight gradient ⟨a, h⟩ (a = dOut · Wd, h from g, u),
    [num_slots] fp32: what bounds its rounding errors, where ⟨a, h⟩ itself may cancel to ~0."""
    rows = int(sched.num_rows.item())
    source = sched.row_source[:rows].long()
    placed = (source >= 0).nonzero().flatten()
    experts = sched.tile_expert.long()[placed // sched.block_m]
    d_rows = fp8_block_dequantize(*d_out)[source[placed] // topk if gathers else placed]  # [n, H]
    a = torch.einsum("nh,nih->ni", d_rows, fp8_block_dequantize(*w_down_t, (128, 128))[experts])  # [n, I]
    g, u = gate_up[placed].float().unbind(1)
    if swiglu_limit is not None:
        g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
    sums = torch.zeros(num_slots, device=a.device)
    sums[source[placed]] = (a * torch.nn.functional.silu(g) * u).abs().sum(-1)
    return sums.view(-1, topk)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("gathers", [False, True])
@pytest.mark.parametrize("swiglu_limit", [None, 1.5])
@pytest.mark.parametrize("T, H, I, E, topk, skewed", _FP8_CASES)
def test_fp8_block_down_dgrad_product_is_the_triton_kernel(T, H, I, E, topk, skewed, swiglu_limit, gathers,
                                                           set_plan):
    """The fp8_block down dgrad as the warp-specialized GEMM into an fp32 product (dOut's sorted
    rows through TMA, or its token rows gathered by the producer) and the epilogue on it:
    d_gate_up bitwise the fused Triton kernel's on every row in use (padding rows' zeros
    included), d_topk_weights to fp32 rounding (row sums in another order). Into a bf16 product
    (the default): each d_g, d_u within the product's and the output's bf16 roundings (2^-7
    relative), padding rows' zeros exact, each d_topk_weights within the product's bf16 rounding
    of its terms (2^-8 of Σ|a·h|: the sum itself may cancel)."""
    assert dgrad_config("down", I, H, "fp8_block").get("WARP_SPECIALIZED"), "the default on Hopper"
    set_plan(warp_specialized_fp8_block_down_dgrad_product=False,  # H alone picks the rows
             gathered_fp8_block_down_dgrad_max_hidden=1 << 20 if gathers else 0)
    inp, sched = _inputs(T, H, I, E, topk, skewed, seed=8)
    gen = torch.Generator().manual_seed(T)  # (this torch build seeds CUDA's generator anew in each process)
    gate_up = torch.randn(sched.capacity_rows, 2, I, generator=gen).bfloat16().cuda()
    d_out_rows = torch.randn(inp.x.shape, generator=gen).to(inp.x)
    d_out = quantize_fp8_block_activations(d_out_rows) if gathers else quantize_fp8_block_gathered(d_out_rows, sched,
                                                                                                    topk)
    w_down_t = fp8_block_quantize(inp.w_down)[2:]
    run = lambda cfg: down_dgrad_swiglu_fp8_block(*d_out, inp.topk_weights, gate_up, *w_down_t, sched,  # noqa: E731
                                                  swiglu_limit, tile_config=cfg)
    expected = run(dgrad_config("down", I, H, "fp8_block", allow_warp_specialized=False))
    rows = int(sched.num_rows.item())
    params = f"{T=} {H=} {I=} {E=} {topk=} {skewed=} {swiglu_limit=} {gathers=}"
    term_sums = _route_term_sums(d_out, w_down_t, gate_up, sched, topk, swiglu_limit, gathers, T * topk)

    def check_d_topk_weights(got, bound, what):
        excess = (got - expected[1]).abs() - bound * term_sums
        assert excess.max() <= 0, f"d_topk_weights, {what} {params}: off by {excess.max()} more than allowed"

    with override(fp8_block_down_dgrad_product_bf16=False):
        got = run(ws.fp8_block_tile_config())
    _check_bitwise(got[0][:rows], expected[0][:rows], f"d_gate_up {params}")
    check_d_topk_weights(got[1], 2.0**-16, "fp32 product")
    assert kernel_plan().fp8_block_down_dgrad_product_bf16, "the default"
    got = run(ws.fp8_block_tile_config())
    torch.testing.assert_close(got[0][:rows].float(), expected[0][:rows].float(), rtol=2.0**-7, atol=0.0,
                               msg=lambda m: f"d_gate_up, bf16 product {params}: {m}")
    check_d_topk_weights(got[1], 2.0**-8, "bf16 product")


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("swiglu_limit, gate_up_e4m3", [(None, False), (1.5, False), (None, True)])
@pytest.mark.parametrize("T, H, I, E, topk, skewed", _FP8_CASES)
def test_fp8_block_gate_up_is_bitwise_the_triton_kernel(T, H, I, E, topk, skewed, swiglu_limit, gate_up_e4m3):
    """The forward's fp8_block gate/up, x's rows gathered by the producer: h_q, h_scale and the
    saved g, u (bf16, or e4m3 with their scales) bitwise the Triton kernel's, on every row in use
    (padding rows included); h_q and h_scale again without g, u."""
    inp, sched = _inputs(T, H, I, E, topk, skewed, seed=7)
    (wg_q, wg_s, _, _), (wu_q, wu_s, _, _) = (fp8_block_quantize(w) for w in (inp.w_gate, inp.w_up))
    x_q = quantize_fp8_block_activations(inp.x)
    run = lambda cfg: gate_up_swiglu_fp8_block(*x_q, wg_q, wg_s, wu_q, wu_s, sched, topk,  # noqa: E731
                                               swiglu_limit=swiglu_limit, store_gate_up=True, tile_config=cfg,
                                               gate_up_e4m3=gate_up_e4m3)
    flat = lambda out: (out[0], out[1], *(out[2] if gate_up_e4m3 else out[2:]))  # noqa: E731
    got = flat(run(ws.fp8_block_tile_config()))
    expected = flat(run(gemm_config("gate_up", I, H, "fp8_block", allow_warp_specialized=False)))
    rows = int(sched.num_rows.item())
    params = f"{T=} {H=} {I=} {E=} {topk=} {skewed=} {swiglu_limit=} {gate_up_e4m3=}"
    names = ("h_q", "h_scale", "gate_up", "gate_up_scale")[:len(got)]
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    for name, g, e in zip(names, got, expected, strict=True):
        _check_bitwise(bits(g[:rows]), bits(e[:rows]), f"{name} {params}")
    # without g, u (a forward that needs no backward): h alone, through its own TMA store
    h_q, h_scale, gate_up = gate_up_swiglu_fp8_block(*x_q, wg_q, wg_s, wu_q, wu_s, sched, topk,
                                                     swiglu_limit=swiglu_limit, store_gate_up=False,
                                                     tile_config=ws.fp8_block_tile_config())
    assert gate_up is None, params
    _check_bitwise(h_q[:rows].view(torch.uint8), expected[0][:rows].view(torch.uint8), f"h_q alone {params}")
    _check_bitwise(h_scale[:rows], expected[1][:rows], f"h_scale alone {params}")


@hopper
@pytest.mark.gpu
def test_fp8_block_layer_with_the_warp_specialized_gate_up_is_bitwise_the_same(set_plan):
    """A forward and backward of the fp8_block layer through `mok.forward` / `mok.backward`
    with the warp-specialized gate/up on: every output and gradient bitwise the Triton kernel's run."""
    import mok

    inp = make_inputs(2048, 512, 384, 8, 4, 256, seed=8, device="cuda", signed_weights=True)
    d_out = torch.randn(2048, 512, device="cuda").bfloat16()
    config = mok.MoKConfig(precision="fp8_block", backend="triton")
    workspace = mok.get_workspace(config, None, device="cuda", num_local_tokens=2048, hidden_size=512, topk=4)
    schedule = mok.build_schedule(workspace, config, inp.topk_ids, num_local_experts=8)
    args = (inp.x, inp.topk_weights, inp.ws_gate, inp.ws_up, inp.ws_down, inp.w_gate, inp.w_up, inp.w_down)

    def step():
        out, ctx = mok.forward(config, workspace, schedule, *args)
        return (out, *mok.backward(config, workspace, schedule, ctx, d_out, *args))

    set_plan(warp_specialized_fp8_block_gate_up=False)
    assert "WARP_SPECIALIZED" not in gemm_config("gate_up", 384, 512, "fp8_block")
    expected = step()
    set_plan(warp_specialized_fp8_block_gate_up=True)
    assert gemm_config("gate_up", 384, 512, "fp8_block") == ws.fp8_block_tile_config()
    for name, got, want in zip(("out", *Gradients._fields), step(), expected, strict=True):
        assert (got is None and want is None) or torch.equal(got, want), name


def _fp8_wgrad_runs(T, H, I, E, topk, skewed):
    """The schedule, and per fp8_block wgrad (its operands quantized once) a call taking a tile
    config, with the wgrad's (m_dim, n_dim) per output."""
    inp, sched = _inputs(T, H, I, E, topk, skewed, seed=5)
    x_sorted, _, dy_sorted = gather_sorted_rows(inp.x, torch.randn_like(inp.x), inp.topk_weights, sched, topk)
    _, gate_up = gate_up_swiglu(inp.x, inp.w_gate, inp.w_up, sched, topk, store_gate_up=True)
    dy, h = quantize_fp8_block_sorted_t(dy_sorted, sched), quantize_fp8_block_swiglu_sorted_t(gate_up, sched)
    d_gate_up, x = quantize_fp8_block_sorted_t(_d_gate_up(sched, I).flatten(1), sched), quantize_fp8_block_sorted_t(
        x_sorted, sched)
    return sched, {
        "down": (lambda cfg: (down_wgrad_fp8_block(*dy, *h, sched, tile_config=cfg),), (H, I)),
        "gate_up": (lambda cfg: gate_up_wgrad_fp8_block(*d_gate_up, *x, sched, tile_config=cfg), (I, H)),
    }


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("T, H, I, E, topk, skewed", _CASES)
def test_fp8_block_wgrads_are_bitwise_the_triton_kernel(T, H, I, E, topk, skewed, wide):
    """Both fp8_block wgrads (the gate/up one over the stacked [d_g | d_u]ᵀ: with I not a
    multiple of 64 a consumer's rows straddle d_w_gate's and d_w_up's), experts with several
    128-row scale blocks, and exact zeros for experts with no rows (skewed cases)."""
    sched, runs = _fp8_wgrad_runs(T, H, I, E, topk, skewed)
    for kind, (run, (m_dim, n_dim)) in runs.items():
        params = f"{kind} {T=} {H=} {I=} {E=} {topk=} {skewed=} {wide=}"
        expected = run(wgrad_config(kind, m_dim, n_dim, "fp8_block", allow_warp_specialized=False))
        got = run(_fp8_tile(ws.fp8_block_tile_config(stacked=kind == "gate_up"), wide))
        for g, e in zip(got, expected, strict=True):
            _check_bitwise(g, e, params)
            if skewed:
                assert g[topk + 2:].eq(0).all(), params


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("T, H, I, E, topk, skewed", _CASES)
def test_fp8_block_wgrads_store_by_tma_bitwise_as_from_registers(set_plan, T, H, I, E, topk, skewed):
    """The TMA stores (the plan's `fp8_wgrad_tma_store`) write what the register stores do, and run exactly
    where every 64-row box lies in one output (H, and I for the gate/up wgrad's two outputs, in
    whole boxes): with the shipped tile, not at 128 columns and 6 stages (no room beside the ring)."""
    sched, runs = _fp8_wgrad_runs(T, H, I, E, topk, skewed)
    device = sched.row_source.device
    for kind, (run, (m_dim, n_dim)) in runs.items():
        params = f"{kind} {T=} {H=} {I=} {E=} {topk=} {skewed=}"
        cfg = ws.fp8_block_tile_config(stacked=kind == "gate_up")
        stacked_rows = 2 * m_dim if kind == "gate_up" else m_dim
        assert hopper_wgrad._wgrad_stores_by_tma(cfg, m_dim, stacked_rows, n_dim, True, device) == (m_dim % 64 == 0), params
        assert not hopper_wgrad._wgrad_stores_by_tma(_fp8_tile(cfg, wide=False), m_dim, stacked_rows, n_dim, True, device), \
            params
        set_plan(fp8_wgrad_tma_store=False)
        expected = run(cfg)
        set_plan(fp8_wgrad_tma_store=True)
        for g, e in zip(run(cfg), expected, strict=True):
            _check_bitwise(g, e, params)


@hopper
@pytest.mark.gpu
def test_bf16_wgrads_store_by_tma_where_the_buffers_fit():
    """The cooperative bf16 wgrads store by TMA (the plan's `bf16_wgrad_tma_store`) at their 3 stages with
    whole 64-row boxes; not at 4 stages (no room beside the ring), not ping-pong, not with rows
    that are no multiple of 64 (then the bitwise tests above run the register stores)."""
    device = torch.device("cuda")
    cfg = ws.wgrad_tile_config(cooperative=True)
    assert cfg["num_stages"] == 3 and hopper_wgrad._wgrad_stores_by_tma(cfg, 4096, 4096, 14336, False, device)
    assert not hopper_wgrad._wgrad_stores_by_tma(ws.tile_config(cooperative=True), 4096, 4096, 14336, False, device)
    assert not hopper_wgrad._wgrad_stores_by_tma(ws.wgrad_tile_config(cooperative=False), 2048, 2048, 768, False, device)
    assert not hopper_wgrad._wgrad_stores_by_tma(cfg, 136, 136, 200, False, device)


@hopper
@pytest.mark.gpu
def test_defaults_choose_the_schedule_by_reduction_on_hopper():
    """Ping-pong for short reductions, cooperative for the long down wgrad, the gate/up GEMMs
    of the backward, and every fp8_block GEMM (the down dgrad's GEMM into its product, dOut's
    token rows gathered); the
    Triton kernels for the long down GEMM, with main_grad and for peer stores
    (`allow_warp_specialized=False`)."""
    assert gemm_config("down", 2048, 768) == ws.tile_config(cooperative=False)
    group_m = dict(GROUP_M=HOPPER.down_wgrad_group_m)
    assert wgrad_config("down", 2048, 768) == dict(ws.wgrad_tile_config(cooperative=False), **group_m)
    assert "WARP_SPECIALIZED" not in gemm_config("down", 7168, 2048)
    assert wgrad_config("down", 4096, 14336) == dict(ws.wgrad_tile_config(cooperative=True), **group_m)
    assert wgrad_config("gate_up", 768, 2048) == ws.wgrad_tile_config(cooperative=True)
    assert dgrad_config("gate_up", 2048, 768) == ws.tile_config(cooperative=True)
    assert "WARP_SPECIALIZED" not in dgrad_config("gate_up", 7168, 2048)
    assert "WARP_SPECIALIZED" not in dgrad_config("down", 14336, 4096)
    assert wgrad_config("down", 2048, 768, "fp8_block") == ws.fp8_block_tile_config(stacked=False)
    assert wgrad_config("gate_up", 768, 2048, "fp8_block") == ws.fp8_block_tile_config(stacked=True)
    assert dgrad_config("gate_up", 2048, 768, "fp8_block") == ws.fp8_block_tile_config()
    assert dgrad_config("gate_up", 7168, 2048, "fp8_block") == ws.fp8_block_tile_config()
    assert gemm_config("down", 2048, 768, "fp8_block") == ws.fp8_block_tile_config()
    for hidden in (2048, 7168):
        assert gemm_config("gate_up", 768, hidden, "fp8_block") == ws.fp8_block_tile_config()
    for hidden in (2048, 7168):
        assert dgrad_config("down", 768, hidden, "fp8_block") == ws.fp8_block_tile_config()
        assert dgrad.fp8_block_down_dgrad_gathers(hidden)
    for config in (wgrad_config("down", 2048, 768, allow_warp_specialized=False),
                   wgrad_config("gate_up", 768, 2048, "fp8_block", allow_warp_specialized=False),
                   wgrad_config("gate_up", 768, 2048, allow_warp_specialized=False),
                   dgrad_config("gate_up", 2048, 768, allow_warp_specialized=False),
                   gemm_config("down", 7168, 2048, allow_warp_specialized=False),
                   gemm_config("down", 7168, 2048, "fp8_block", allow_warp_specialized=False),
                   dgrad_config("gate_up", 7168, 2048, "fp8_block", allow_warp_specialized=False)):
        assert "WARP_SPECIALIZED" not in config
