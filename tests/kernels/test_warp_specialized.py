"""The warp-specialized (Gluon, Hopper) down GEMM and down wgrad: bitwise the Triton kernels'
output on a Hopper GPU (odd sizes, empty experts, one tile per program and many, where the two
consumer warp groups take turns), compiled for sm_90a without spills on any machine, and
clear errors where they cannot run."""

import os
import re
import subprocess
import tempfile

import pytest
import torch
import triton

from mok.kernels import warp_specialized as ws
from mok.kernels.gather import gather_sorted_rows
from mok.kernels.grouped_gemm import down_scatter, gate_up_swiglu, gemm_config, routing_block_m
from mok.kernels.schedule import build_routing_schedule
from mok.kernels.wgrad import down_wgrad, wgrad_config
from mok.testing import make_inputs

_WS_CONFIG = dict(ws.WS_TILE, WARP_SPECIALIZED=True)

hopper = pytest.mark.skipif(not ws.available_here(), reason="needs a Hopper GPU")


def _ptxas_report(kernel, signature: dict, constants: dict) -> tuple[int, int]:
    """(registers per thread, spilled bytes) of a kernel compiled for sm_90a, without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    compiled = triton.compile(GluonASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True,
                                check=True).stderr
    return int(re.search(r"Used (\d+) registers", report)[1]), int(re.search(r"(\d+) bytes spill stores", report)[1])


def _descriptor_type(block_shape) -> str:
    return f"tensordesc<bf16[{block_shape[0]},{block_shape[1]}],{ws._shared_layout(block_shape)!r}>"


def test_kernels_compile_for_sm90a_without_spills():
    """The shipped tiles fit: 3 warp groups at 168 registers each at launch, nothing spilled."""
    block_m, block_n, block_k = ws.WS_TILE["BLOCK_M"], ws.WS_TILE["BLOCK_N"], ws.WS_TILE["BLOCK_K"]
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=ws.WS_TILE["num_stages"])
    constexprs = {name: "constexpr" for name in meta}
    down = _ptxas_report(ws._down_scatter_ws_kernel, {
        "h_desc": _descriptor_type((block_m, block_k)), "w_desc": _descriptor_type((block_n, block_k)),
        "y_ptr": "*bf16", "row_source_ptr": "*i32", "tile_expert_ptr": "*i32", "num_rows_ptr": "*i32",
        "hidden": "i32", "inter": "i32", "stride_y": "i32", **constexprs}, meta)
    wgrad = _ptxas_report(ws._down_wgrad_ws_kernel, {
        "a_desc": _descriptor_type((block_k, block_m)), "b_desc": _descriptor_type((block_k, block_n)),
        "out_ptr": "*bf16", "expert_offsets_ptr": "*i32", "num_tiles": "i32", "m_dim": "i32", "n_dim": "i32",
        "stride_out_e": "i32", **constexprs}, meta)
    assert down == (168, 0), f"down GEMM: (registers, spilled bytes) {down}"
    assert wgrad == (168, 0), f"down wgrad: (registers, spilled bytes) {wgrad}"


def test_defaults_choose_it_only_where_it_runs():
    """No Hopper GPU here (or the interpreter): the default tile configs keep the Triton kernels."""
    if ws.available_here():
        pytest.skip("a Hopper GPU is present")
    assert "WARP_SPECIALIZED" not in gemm_config("down", 2048, 768)
    assert "WARP_SPECIALIZED" not in wgrad_config("down", 2048, 768)


def test_errors_name_the_tile_config(kernel_device):
    """An explicit WARP_SPECIALIZED config is refused, naming it, where the kernels cannot run
    (not a Hopper GPU, or the interpreter) and with main_grad."""
    inp = make_inputs(8, 64, 64, 4, 2, seed=0, device=kernel_device)
    flag = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    sched = build_routing_schedule(inp.topk_ids, 4, routing_block_m(), flag)
    h = torch.randn(sched.capacity_rows, 64).bfloat16().to(kernel_device)
    config = dict(_WS_CONFIG, BLOCK_M=sched.block_m, BLOCK_K=min(sched.block_m, ws.WS_TILE["BLOCK_K"]))
    if not ws.warp_specialized_available(h.device):
        with pytest.raises(ValueError, match="tile_config: WARP_SPECIALIZED needs a Hopper GPU"):
            down_scatter(h, inp.w_down, sched, 16, tile_config=config)
    main_grad = torch.zeros(4, 64, 64, device=kernel_device)
    with pytest.raises(ValueError, match="tile_config: WARP_SPECIALIZED is for the bf16 down wgrad into a new"):
        down_wgrad(torch.randn_like(h), h, sched, main_grad=main_grad, tile_config=config)


# (T, H, I, E, topk, skewed): odd H and I (ragged N and K tiles), one token, experts with no
# token, and enough tiles that every program runs several, so both consumers take turns.
_CASES = [
    (37, 136, 200, 5, 2, False),
    (1, 64, 64, 4, 1, False),
    (300, 256, 768, 8, 8, True),
    (4096, 2048, 256, 8, 2, False),
    (2048, 512, 768, 16, 4, True),
]


def _inputs(T, H, I, E, topk, skewed, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(topk + 2, generator=gen)[:topk] for _ in range(T)]) if skewed else None
    inp = make_inputs(T, H, I, E, topk, seed=seed, device="cuda", signed_weights=True, topk_ids=ids)
    sched = build_routing_schedule(inp.topk_ids, E, routing_block_m(), torch.zeros(1, dtype=torch.int32, device="cuda"))
    return inp, sched


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("T, H, I, E, topk, skewed", _CASES)
def test_down_gemm_is_bitwise_the_triton_kernel(T, H, I, E, topk, skewed):
    inp, sched = _inputs(T, H, I, E, topk, skewed)
    h, _ = gate_up_swiglu(inp.x, inp.w_gate, inp.w_up, sched, topk)
    triton_config = gemm_config("down", H, I, allow_warp_specialized=False)
    expected = down_scatter(h, inp.w_down, sched, T * topk, tile_config=triton_config)
    got = down_scatter(h, inp.w_down, sched, T * topk, tile_config=_WS_CONFIG)
    params = f"{T=} {H=} {I=} {E=} {topk=} {skewed=}"
    assert torch.equal(got, expected), f"{params}: max |diff| {(got.float() - expected.float()).abs().max()}"
    assert expected.abs().sum() > 0, params


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("T, H, I, E, topk, skewed", _CASES)
def test_down_wgrad_is_bitwise_the_triton_kernel(T, H, I, E, topk, skewed):
    """Including exact zeros for experts with no rows (skewed cases)."""
    inp, sched = _inputs(T, H, I, E, topk, skewed, seed=1)
    d_out = torch.randn_like(inp.x)
    _, _, dy_sorted = gather_sorted_rows(inp.x, d_out, inp.topk_weights, sched, topk)
    h, _ = gate_up_swiglu(inp.x, inp.w_gate, inp.w_up, sched, topk)
    triton_config = wgrad_config("down", H, I, allow_warp_specialized=False)
    expected = down_wgrad(dy_sorted, h, sched, tile_config=triton_config)
    got = down_wgrad(dy_sorted, h, sched, tile_config=_WS_CONFIG)
    params = f"{T=} {H=} {I=} {E=} {topk=} {skewed=}"
    assert torch.equal(got, expected), f"{params}: max |diff| {(got.float() - expected.float()).abs().max()}"
    if skewed:
        assert got[topk + 2:].eq(0).all(), params
    assert expected.abs().sum() > 0, params


@hopper
@pytest.mark.gpu
def test_defaults_choose_it_on_hopper_for_short_reductions():
    assert gemm_config("down", 2048, 768).get("WARP_SPECIALIZED") is True
    assert wgrad_config("down", 2048, 768).get("WARP_SPECIALIZED") is True
    assert "WARP_SPECIALIZED" not in wgrad_config("down", 2048, 768, allow_warp_specialized=False)
    assert "WARP_SPECIALIZED" not in gemm_config("down", 7168, 2048)
