"""The kernel choices of every config-choosing function, recorded over presets and odd shapes on
three machines: the interpreter, a CUDA GPU without the warp-specialized kernels, and Hopper
(simulated: the availability checks patched), first from the module constants the kernel plan
replaced. `python -m tests.kernels.kernel_configs` rewrites
`kernel_configs.json`, which `test_plan.py` holds the choosers to."""

import contextlib
import json
import pathlib
import sys
from unittest import mock

FIXTURE = pathlib.Path(__file__).with_name("kernel_configs.json")

# (H, I) of the presets (qwen3-30b, deepseek-v3-slice routed and shared, mixtral-8x7b, tiny) and odd shapes
# around each threshold.
SHAPES = [(2048, 768), (7168, 2048), (4096, 14336), (64, 32), (256, 128), (128, 256), (6144, 1024),
          (6143, 1025), (2049, 2047), (1024, 8192), (1024, 8191), (8192, 1024), (384, 640), (96, 4096)]
MACHINES = ("interpreter", "gpu", "hopper")
# The module constants that chose kernels before the plan (recorded from them under "constant|"
# keys), by their old names, and the plan fields now holding them: values the choosers above do
# not show (quantizers, gather, the layer's fp8_block flags, TMA stores; the launch sizes of the combine,
# the gathers, the schedule, the activation quantizers and the copies, moved in later). A dict: the old
# dict's entries, each a field.
CONSTANTS = {
    "dgrad.FP8_BLOCK_DOWN_DGRAD_PRODUCT_BF16": "fp8_block_down_dgrad_product_bf16",
    "dgrad._FP8_BLOCK_TILES": {"down": "dgrad_fp8_block_down_tile", "gate_up": "dgrad_fp8_block_gate_up_tile",
                               "interpreter": "dgrad_fp8_block_interpreter_tile"},
    "grouped_gemm._FP8_BLOCK_TILES": {"down": "fp8_block_down_tile", "gate_up": "fp8_block_gate_up_tile",
                                      "interpreter": "fp8_block_interpreter_tile"},
    "wgrad._FP8_BLOCK_TILES": {"down": "wgrad_fp8_block_down_tile", "gate_up": "wgrad_fp8_block_gate_up_tile"},
    "wgrad._FP8_BLOCK_INTERPRETER_SIZES": "wgrad_fp8_block_interpreter_sizes",
    "gather.TOKEN_MAJOR_MIN_TOPK": "token_major_min_topk",
    "swiglu.FAST_SIGMOID": "fast_sigmoid",
    "warp_specialized.PING_PONG_TILE": "ping_pong_tile",
    "warp_specialized.COOPERATIVE_TILE": "cooperative_tile",
    "warp_specialized.FP8_BLOCK_TILE": "fp8_block_warp_specialized_tile",
    "warp_specialized.FP8_WGRAD_TMA_STORE": "fp8_wgrad_tma_store",
    "warp_specialized.GATHERED_TMA_STORE": "gathered_tma_store",
    "warp_specialized.SORTED_TMA_STORE": "sorted_tma_store",
    "warp_specialized.BF16_WGRAD_TMA_STORE": "bf16_wgrad_tma_store",
    "quant_fp8_block._WEIGHTS_GLUON": "weights_gluon",
    "quant_fp8_block._WEIGHT_GLUON_NUM_WARPS": "weight_gluon_num_warps",
    "quant_fp8_block._SORTED_BLOCK_W": "sorted_block_w",
    "quant_fp8_block._SORTED_NUM_WARPS": "sorted_num_warps",
    "quant_fp8_block._GATHERED_NARROW_MIN_WIDTH": "gathered_narrow_min_width",
    "quant_fp8_block._GATHERED_NARROW_BLOCK_W": "gathered_narrow_block_w",
    "quant_fp8_block._GATHERED_NARROW_NUM_WARPS": "gathered_narrow_num_warps",
    "quant_fp8_block._SORTED_BLOCK_W_INTERPRETER": "sorted_block_w_interpreter",
    "quant_fp8_block._SORTED_GLUON": "sorted_gluon",
    "quant_fp8_block._SORTED_GLUON_ROWS_PER_THREAD": "sorted_gluon_rows_per_thread",
    "quant_fp8_block._SORTED_GLUON_NUM_WARPS": "sorted_gluon_num_warps",
    "quant_fp8_block._SORTED_GLUON_NUM_WARPS_E4M3": "sorted_gluon_num_warps_e4m3",
    "functional.FP8_BLOCK_WGRADS_REQUANTIZE": "fp8_block_wgrads_requantize",
    "functional.FP8_BLOCK_D_GATE_UP_QUANTIZED": "fp8_block_d_gate_up_quantized",
    "functional.FP8_BLOCK_SORTED_OUTPUTS": "fp8_block_sorted_outputs",
    "functional.FP8_BLOCK_GATE_UP_E4M3": "fp8_block_gate_up_e4m3",
    "functional.FP8_BLOCK_ON_THE_WIRE": "fp8_block_on_the_wire",
    "dgrad._QUANTIZED_EPILOGUE_ROWS": "fp8_block_quantized_epilogue_rows",
    "gather.ROWS_PER_PROGRAM": "gather_rows_per_program",
    "gather.TOKENS_PER_PROGRAM": "gather_tokens_per_program",
    "combine.BLOCK_T": "combine_block_t",
    "combine.BLOCK_H": "combine_block_h",
    "combine.NUM_WARPS": "combine_num_warps",
    "schedule.ROUTES_PER_CHUNK": "schedule_routes_per_chunk",
    "schedule._SCAN_TILE_ELEMENTS": "schedule_scan_tile_elements",
    "quant.BLOCK_M_MAX": "mxfp8_tile_m",
    "quant.BLOCK_N_MAX": "mxfp8_tile_n",
    "quant_fp8_block._ACT_BLOCK_M": "fp8_block_activation_block_m",
    "comm._PUSH_ROWS": "push_rows",
    "comm._PUSH_COLS": "push_cols",
    "comm._PUSH_WARPS": "push_num_warps",
    "dispatch._COPY_ELEMENTS": "copy_elements",
}


@contextlib.contextmanager
def machine(name: str):
    """The availability checks of `name`: the interpreter (no CUDA), else a CUDA GPU (Hopper with
    Gluon usable, or not)."""
    gpu, hopper = name != "interpreter", name == "hopper"
    with contextlib.ExitStack() as stack:
        for module in [m for n, m in sys.modules.items() if n.startswith("mok.") and m is not None]:
            if hasattr(module, "interpreting"):
                stack.enter_context(mock.patch.object(module, "interpreting", lambda: not gpu))
        from mok.kernels import gluon_api
        from mok.kernels.gemm import hopper_common

        stack.enter_context(mock.patch("torch.cuda.is_available", lambda: gpu))
        stack.enter_context(mock.patch("torch.cuda.current_device", lambda: 0))
        stack.enter_context(mock.patch.object(hopper_common, "_hopper", lambda index: hopper))
        stack.enter_context(mock.patch.object(gluon_api, "usable", lambda *args, **kwargs: gpu))
        stack.enter_context(mock.patch.object(hopper_common, "available_here", lambda: hopper))
        yield


def _key(*parts) -> str:
    return "|".join(map(str, parts))


def choices() -> dict:
    """{machine: {call: result}} over `SHAPES`."""
    from mok.kernels import swiglu
    from mok.kernels.gemm import common, dgrad, hopper_common, wgrad

    out = {}
    for name in MACHINES:
        with machine(name):
            got = {"routing_block_m": common.routing_block_m(), "fast_sigmoid": swiglu.fast_sigmoid_here()}
            for cooperative in (False, True):
                got[_key("ws.tile_config", cooperative)] = hopper_common.tile_config(cooperative)
                got[_key("ws.wgrad_tile_config", cooperative)] = hopper_common.wgrad_tile_config(cooperative)
                got[_key("ws.fp8_block_tile_config", cooperative)] = hopper_common.fp8_block_tile_config(cooperative)
            for kind in ("gate_up", "down"):
                for allow in (False, True):
                    got[_key("dgrad._fp8_block_warp_specialized", kind, allow)] = (
                        dgrad._fp8_block_warp_specialized(kind, allow))
            for hidden, inter in SHAPES:
                got[_key("down_wgrad_reads_weighted_h", hidden, inter)] = (
                    dgrad.down_wgrad_reads_weighted_h(hidden, inter))
                got[_key("fp8_block_down_dgrad_gathers", hidden)] = dgrad.fp8_block_down_dgrad_gathers(hidden)
                for precision in ("bf16", "fp8_block"):
                    for allow in (False, True):
                        for kind, n_dim, k_dim in (("gate_up", inter, hidden), ("down", hidden, inter)):
                            for packed in (False, True):
                                got[_key("gemm_config", kind, n_dim, k_dim, precision, packed, allow)] = (
                                    common.gemm_config(kind, n_dim, k_dim, precision, packed, allow))
                        for kind, n_dim, k_dim in (("down", inter, hidden), ("gate_up", hidden, inter)):
                            got[_key("dgrad_config", kind, n_dim, k_dim, precision, allow)] = (
                                dgrad.dgrad_config(kind, n_dim, k_dim, precision, allow))
                        for kind, m_dim, n_dim in (("down", hidden, inter), ("gate_up", inter, hidden)):
                            got[_key("wgrad_config", kind, m_dim, n_dim, precision, allow)] = (
                                wgrad.wgrad_config(kind, m_dim, n_dim, precision, allow))
        out[name] = got
    return out


def _flat(recorded: dict) -> str:
    """One entry a line, so that a changed choice is one line of the diff."""
    lines = [f"{json.dumps(key)}: {json.dumps(value, sort_keys=True)}" for key, value in sorted(recorded.items())]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def plan_constants(plan) -> dict:
    """`CONSTANTS`' values in `plan`, under their recorded keys."""

    def value(fields):
        if isinstance(fields, dict):
            return {key: dict(getattr(plan, field)) for key, field in fields.items()}
        got = getattr(plan, fields)
        return dict(got) if hasattr(got, "keys") else got

    return {f"constant|{name}": value(fields) for name, fields in CONSTANTS.items()}


def recorded() -> dict:
    """`choices()` flattened to {"machine|call": result}."""
    return {f"{name}|{call}": got for name, calls in choices().items() for call, got in calls.items()}


if __name__ == "__main__":
    from mok.kernels.plan import HOPPER

    FIXTURE.write_text(_flat({**recorded(), **plan_constants(HOPPER)}))
