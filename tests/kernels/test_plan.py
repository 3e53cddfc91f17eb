"""The kernel plan chooses what the module constants chose before it: every chooser's configs on the
interpreter, a CUDA GPU and (simulated) Hopper, as recorded in `kernel_configs.json`. Every choice of
the plan (a flag, a threshold) is run both ways: the layer under each variant, other kernels launched,
within the accuracy bars and bitwise where the two sides are documented to agree."""

import ast
import dataclasses
import json
import pathlib
from dataclasses import dataclass

import pytest
import torch

import mok
from mok import reference
from mok.kernels.common import interpreting
from mok.kernels.gemm import hopper_common
from mok.kernels.plan import GENERIC, HOPPER, KernelPlan, check_fields, kernel_plan, override
from mok.testing import assert_close_to_reference, make_inputs
from mok.testing.launches import recorded_launches
from tests.kernels.kernel_configs import FIXTURE, plan_constants, recorded

RECORDED = json.loads(FIXTURE.read_text())


def test_choosers_give_the_recorded_configs():
    got = recorded()
    want = {key: value for key, value in RECORDED.items() if not key.startswith("constant|")}
    assert set(got) == set(want)
    changed = {key: (want[key], got[key]) for key in want if json.loads(json.dumps(got[key])) != want[key]}
    assert not changed, f"{len(changed)} configs changed, e.g. {next(iter(changed.items()))}"


@pytest.mark.parametrize("plan", [HOPPER, GENERIC], ids=["hopper", "generic"])
@pytest.mark.parametrize("key", sorted(key for key in RECORDED if key.startswith("constant|")))
def test_plans_hold_the_old_constants(key, plan):
    """Both plans: what the other GPUs and the interpreter took from the same constants."""
    assert json.loads(json.dumps(plan_constants(plan)[key])) == RECORDED[key]


def test_hopper_and_generic_differ_only_in_the_warp_specialized_gemms():
    assert dataclasses.replace(HOPPER, warp_specialized=False) == GENERIC


def test_interpreter_and_cpu_get_the_generic_plan():
    assert kernel_plan(torch.device("cpu")) is GENERIC
    if interpreting():
        assert kernel_plan() is GENERIC


def test_override_replaces_fields_and_restores_them():
    before = kernel_plan()
    with override(gemm_group_m=16):
        with override(split_last_wave=False):
            assert (kernel_plan().gemm_group_m, kernel_plan().split_last_wave) == (16, False)
        assert (kernel_plan().gemm_group_m, kernel_plan().split_last_wave) == (16, before.split_last_wave)
    assert kernel_plan() == before
    with pytest.raises(ValueError, match="KernelPlan has no field 'nope'"):
        with override(nope=1):
            pass
    assert kernel_plan() == before


# --------------------------------------------------------------------------- both sides of every choice

# The layer's outputs, in `_layer_step`'s order: out, then every gradient.
_OUTPUTS = ("out", *reference.Gradients._fields)
# (T, H, I, E, topk, I_s) per kernel device: small under the interpreter; on a GPU enough tiles that
# every program of a persistent or warp-specialized launch takes several. H, I multiples of 128 (fp8_block).
_SHAPES = {"cpu": (37, 256, 128, 4, 2, 128), "cuda": (1001, 1024, 384, 8, 4, 256)}


@dataclass(frozen=True)
class Variant:
    """A kernel-plan field set to the side the plan does not take at `_SHAPES` (`value`), with `base`
    set on both sides (what reaches the choice: a threshold elsewhere, the warp-specialized kernels
    off); `bitwise` names the outputs documented to come out bitwise the same either way. `machine`:
    where the plan reads the field, "any" (the interpreter's configs too), "gpu" (a CUDA GPU's
    configs), "hopper" (the warp-specialized kernels')."""

    field: str
    value: object
    precision: str = "bf16"
    machine: str = "any"
    bitwise: tuple[str, ...] = _OUTPUTS
    base: dict = dataclasses.field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.field}={self.value!r}-{self.precision}"


_TRITON_GEMMS = {"warp_specialized": False}  # on Hopper: the choices among the Triton kernels
VARIANTS = [
    # Per-tile launches (a short last wave in column halves), the forward's down GEMM and the gate/up dgrad.
    Variant("split_last_wave", False, base={**_TRITON_GEMMS, "persistent_down_max_inter": 0}),
    # The gate/up GEMM: x through its sorted copy (TMA) with separate weights, and packed weights.
    Variant("sorted_x_min_inter", 0, machine="gpu", base={"packed_max_inter": 0}),
    Variant("packed_max_inter", 0, machine="gpu"),
    # Persistent launches against one program per tile.
    Variant("persistent_down_max_inter", 0, machine="gpu", base=_TRITON_GEMMS),
    Variant("persistent_gate_up_dgrad_min_hidden", 0, machine="gpu", base=_TRITON_GEMMS),
    Variant("persistent_down_wgrad_max_inter", 0, machine="gpu", base=_TRITON_GEMMS),
    # The hardware's sigmoid approximation against tl.sigmoid: a few fp32 ulps apart, not bitwise.
    Variant("fast_sigmoid", False, machine="gpu", bitwise=()),
    # Hopper: the warp-specialized bf16 GEMMs (ping-pong, cooperative) and the Triton ones, bitwise alike.
    Variant("ping_pong_down_max_inter", 0, machine="hopper"),
    Variant("cooperative_down", True, machine="hopper", base={"ping_pong_down_max_inter": 0}),
    Variant("cooperative_gate_up_dgrad_max_inter", 0, machine="hopper"),
    Variant("ping_pong_down_wgrad_max_inter", 0, machine="hopper"),
    Variant("cooperative_down_wgrad", False, machine="hopper", base={"ping_pong_down_wgrad_max_inter": 0}),
    Variant("cooperative_gate_up_wgrad", False, machine="hopper"),
    Variant("bf16_wgrad_tma_store", False, machine="hopper"),
    # The whole plan: every precision through the plain Triton kernels on Hopper. bf16 and mxfp8 (bf16
    # GEMMs on rounded operands) bitwise; fp8_block's down dgrad then fuses its GEMM (an fp32 product).
    Variant("warp_specialized", False, machine="hopper"),
    Variant("warp_specialized", False, "mxfp8", machine="hopper"),
    Variant("warp_specialized", False, "fp8_block", machine="hopper", bitwise=()),
    # Hopper, fp8_block: each GEMM warp-specialized or Triton, stores by TMA or from registers, the
    # weights quantized by the Gluon or the Triton kernel: bitwise alike.
    Variant("warp_specialized_fp8_block_down", False, "fp8_block", machine="hopper"),
    Variant("warp_specialized_fp8_block_gate_up_dgrad", False, "fp8_block", machine="hopper"),
    Variant("warp_specialized_fp8_block_wgrad", False, "fp8_block", machine="hopper"),
    Variant("gathered_tma_store", False, "fp8_block", machine="hopper"),
    Variant("sorted_tma_store", False, "fp8_block", machine="hopper"),
    Variant("weights_gluon", False, "fp8_block", machine="hopper"),
    # The down dgrad as the fused Triton kernel: its product in fp32, not the bf16 one.
    Variant("warp_specialized_fp8_block_down_dgrad_product", False, "fp8_block", machine="hopper", bitwise=()),
    # The Triton sorted-layout quantizer's narrow programs on gathered operands (x's requantized rows).
    Variant("gathered_narrow_min_width", 0, "fp8_block", machine="gpu", base={"sorted_gluon": False}),
    # The down dgrad reads dOut's sorted copy rather than gathering its token rows: the same bits, but
    # the down wgrad's w·dOut is then quantized from bf16 dOut, not requantized from the per-token copy.
    Variant("gathered_fp8_block_down_dgrad_max_hidden", 0, "fp8_block",
            bitwise=tuple(name for name in _OUTPUTS if name != "d_w_down"),
            base={"warp_specialized_fp8_block_down_dgrad_product": False}),
]
_MARKS = {"any": (), "gpu": (pytest.mark.gpu,),
          "hopper": (pytest.mark.gpu, pytest.mark.skipif(not hopper_common.available_here(),
                                                         reason="needs a Hopper GPU"))}


def _layer_step(inp, precision: str, d_out: torch.Tensor) -> dict:
    """{name: tensor} of `_OUTPUTS` from one forward and backward of `mok.moe` (autograd) on fresh
    leaves: fresh weights, which fp8_block and mxfp8 quantize anew under the plan in force."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (inp.x, inp.topk_weights,
                                                                                    *inp.weights)]
    x, topk_weights, *weights = leaves
    config = mok.MoKConfig(backend="triton", strict=True, precision=precision)
    out = mok.moe(x, inp.topk_ids, topk_weights, *weights, config=config)
    out.backward(d_out)
    return dict(zip(_OUTPUTS, (out.detach(), *(None if t is None else t.grad for t in leaves)), strict=True))


@pytest.mark.parametrize("variant", [pytest.param(v, id=v.id, marks=_MARKS[v.machine]) for v in VARIANTS])
def test_plan_variant_runs_other_kernels_within_the_bars(kernel_device, variant):
    """The layer (forward and backward) under the plan and under the variant: other kernels ran (or the
    same ones otherwise), both within the accuracy bars of the reference, and the outputs the variant
    documents as unchanged bitwise the same."""
    if variant.machine != "any" and kernel_device != "cuda":
        pytest.skip("the interpreter's configs do not read this field")
    T, H, I, E, topk, I_s = _SHAPES[kernel_device]
    precision, base = variant.precision, variant.base
    ctx = f"{variant.field}={variant.value!r} {precision=} {base=} {T=} {H=} {I=} {E=} {topk=} {I_s=}"
    inp = make_inputs(T, H, I, E, topk, I_s, seed=T, device=kernel_device, signed_weights=True)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).bfloat16().to(kernel_device)
    runs, launches = {}, {}
    for side, fields in (("plan", base), ("variant", {**base, variant.field: variant.value})):
        with override(**fields), recorded_launches() as launched:
            runs[side] = _layer_step(inp, precision, d_out)
        launches[side] = launched
    changed = (launches["plan"] - launches["variant"]) + (launches["variant"] - launches["plan"])
    assert changed, f"the same kernels ran the same way on both sides: the field is not reached {ctx}"
    args = (inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    expected = dict(zip(_OUTPUTS, (reference.moe_forward(*args), *reference.moe_backward(d_out, *args)), strict=True))
    for side, got in runs.items():
        for name, want in expected.items():
            bar = "bf16" if name.startswith("d_ws_") else precision  # the shared expert stays bf16
            assert_close_to_reference(got[name], want, bar, name=name, context=f"{side} {ctx}", check_cosine=True)
    for name in variant.bitwise:
        plan, other = runs["plan"][name], runs["variant"][name]
        assert torch.equal(plan, other), f"{name}: max |diff| {(plan.float() - other.float()).abs().max()} {ctx}"


def test_recorded_launches_repeat_run_to_run(kernel_device):
    """The same layer call twice records the same launches (so a difference above is the plan's), and
    records what chooses how a kernel runs: the variant's constexpr, its grid."""
    T, H, I, E, topk = 21, 64, 32, 4, 2
    inp = make_inputs(T, H, I, E, topk, seed=T, device=kernel_device)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).bfloat16().to(kernel_device)
    ctx = f"{T=} {H=} {I=} {E=} {topk=}"
    per_tile = dict(_TRITON_GEMMS, persistent_down_max_inter=0)  # where split_last_wave is read, GPUs included
    runs = []
    for _ in range(2):
        with override(**per_tile), recorded_launches() as launched:
            _layer_step(inp, "bf16", d_out)
        runs.append(launched)
    assert runs[0] == runs[1] and sum(runs[0].values()) > 5, f"{runs} {ctx}"
    with override(**per_tile, split_last_wave=not kernel_plan().split_last_wave), recorded_launches() as launched:
        _layer_step(inp, "bf16", d_out)
    moved = {launch.kernel for launch in (runs[0] - launched) + (launched - runs[0])}
    assert {"_down_scatter_kernel", "_gate_up_dgrad_scatter_kernel"} <= moved, f"{moved} {ctx}"


# For each flag and threshold of the plan, beside `VARIANTS`: the tests that run both of its sides,
# as "file::function" under tests/ (each names the field).
BOTH_SIDES_ELSEWHERE = {
    "warp_specialized_fp8_block_gate_up": [
        "kernels/test_warp_specialized.py::test_fp8_block_layer_with_the_warp_specialized_gate_up_is_bitwise_the_same"],
    "fp8_block_down_dgrad_product_bf16": [
        "kernels/test_warp_specialized.py::test_fp8_block_down_dgrad_product_is_the_triton_kernel"],
    "fp8_wgrad_tma_store": [
        "kernels/test_warp_specialized.py::test_fp8_block_wgrads_store_by_tma_bitwise_as_from_registers"],
    "gathered_fp8_block_down_dgrad_max_hidden": [
        "kernels/test_dgrad.py::test_fp8_block_down_dgrad_gathering_is_bitwise_the_sorted_copy"],
    "down_dgrad_prefetch_gate_up": ["kernels/test_dgrad.py::test_down_dgrad_prefetch_leaves_the_outputs_bitwise"],
    "sorted_gluon": ["kernels/test_quant_fp8_block.py::test_sorted_t_gluon_is_bitwise_the_triton_kernel"],
    "token_major_min_topk": ["kernels/test_gather.py::test_gather_sorted_rows"],
    "down_wgrad_reads_weighted_h": ["test_triton_backward.py::test_down_wgrad_from_weighted_h_where_i_is_below_h"],
    "fp8_block_wgrads_requantize": ["test_triton_backward.py::test_fp8_block_wgrads_requantize_the_forwards_copies"],
    "fp8_block_d_gate_up_quantized": ["test_triton_backward.py::test_fp8_block_d_gate_up_quantized_in_the_epilogue"],
    "fp8_block_sorted_outputs": ["test_triton_backward.py::test_fp8_block_sorted_outputs_are_bitwise_the_route_slots"],
    "fp8_block_gate_up_e4m3": ["test_triton_backward.py::test_fp8_block_gate_up_saved_in_e4m3"],
    # the helper of test_triton_ep_matches_ep_reference (two or more GPUs)
    "fp8_block_on_the_wire": ["dist/test_ep_nccl.py::_check_case"],
}
# Sizes (tiles, warps, registers, column widths, rows per step, tile groups): no two sides to run; every layer
# test runs the plan's, and the snapshot (`kernel_configs.json`) holds them.
SIZES = {
    "fp8_block_gate_up_tile", "fp8_block_down_tile", "fp8_block_interpreter_tile", "gemm_group_m",
    "dgrad_fp8_block_down_tile", "dgrad_fp8_block_gate_up_tile", "dgrad_fp8_block_interpreter_tile",
    "wgrad_fp8_block_gate_up_tile", "wgrad_fp8_block_down_tile", "wgrad_fp8_block_interpreter_sizes",
    "down_wgrad_group_m", "ping_pong_tile", "cooperative_tile", "fp8_block_warp_specialized_tile",
    "weight_gluon_num_warps", "sorted_block_w", "sorted_num_warps", "gathered_narrow_block_w",
    "gathered_narrow_num_warps", "sorted_block_w_interpreter", "sorted_gluon_rows_per_thread",
    "sorted_gluon_num_warps", "sorted_gluon_num_warps_e4m3", "fp8_block_quantized_epilogue_rows",
    "gather_rows_per_program", "gather_tokens_per_program", "combine_block_t", "combine_block_h", "combine_num_warps",
    "schedule_routes_per_chunk", "schedule_scan_tile_elements", "mxfp8_tile_m", "mxfp8_tile_n",
    "fp8_block_activation_block_m", "push_rows", "push_cols", "push_num_warps", "copy_elements",
    "warp_specialized_consumer_registers", "warp_specialized_producer_registers", "gathered_producer_threads",
    "warp_specialized_store_vector", "gathered_byte_vector", "weight_gluon_rows_per_thread", "interpreter_programs",
    "interpreter_polls",
}


def _function_source(test: str) -> str:
    """The source of the function `test` ("file::function", the file under tests/)."""
    path, name = test.split("::")
    source = (pathlib.Path(__file__).parents[1] / path).read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise AssertionError(f"{test}: no such function")


def test_every_choice_is_tested_both_ways():
    """Every KernelPlan field is a size or a choice (a flag, a threshold) whose both sides some test
    runs: a variant above, or a test elsewhere that names the field. A new field fails here until it is
    one or the other."""
    fields = [f.name for f in dataclasses.fields(KernelPlan)]
    choices = {v.field for v in VARIANTS} | set(BOTH_SIDES_ELSEWHERE)
    assert not choices & SIZES, f"both a size and a choice: {sorted(choices & SIZES)}"
    missing = [field for field in fields if field not in choices | SIZES]
    assert not missing, f"KernelPlan fields no test runs both ways: {missing}"
    unknown = sorted((choices | SIZES) - set(fields))
    assert not unknown, f"not KernelPlan fields: {unknown}"
    flags = sorted(field for field in SIZES if isinstance(getattr(HOPPER, field), bool))
    assert not flags, f"flags listed as sizes: {flags}"
    for variant in VARIANTS:
        check_fields({**variant.base, variant.field: variant.value})
        assert variant.field not in variant.base, variant.id
    for field, tests in BOTH_SIDES_ELSEWHERE.items():
        for test in tests:
            assert field in _function_source(test), f"{test} does not name {field}"
