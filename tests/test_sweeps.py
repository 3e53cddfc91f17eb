"""The GPU sweeps of `benchmarks/sweeps/` build their config lists on any machine: every kind
is one `tune_gemm.py` can time, and each list holds what its docstring says it compares. Every
script of `benchmarks/` imports on any machine."""

import importlib.util
import pathlib
import sys

import pytest

from mok.bench.presets import GPU_PRESETS, PRESETS

_BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"


def _script(path: pathlib.Path, module_name: str):
    """Imports a script of `benchmarks/` (its own folder on the path, as when it runs)."""
    sys.path.insert(0, str(_BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(_BENCHMARKS))
    return module


def _sweep(name: str):
    return _script(_BENCHMARKS / "sweeps" / f"{name}.py", f"sweep_{name}")


_SCRIPTS = sorted([*_BENCHMARKS.glob("*.py"), *(_BENCHMARKS / "sweeps").glob("*.py")])


@pytest.mark.parametrize("path", _SCRIPTS, ids=[str(p.relative_to(_BENCHMARKS)) for p in _SCRIPTS])
def test_benchmark_scripts_import_on_any_machine(path):
    """Every script's imports still name what the library has (the scripts run only on the
    device, so nothing else would notice a name the library dropped)."""
    _script(path, f"script_{path.stem}")


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_group_m_sweep_varies_group_m_on_the_defaults(preset):
    sweep = _sweep("group_m")
    for kind, candidates in sweep.configs().items():
        assert kind in sweep.tune_gemm.FLOPS_PER_ROUTE_HI, kind
        triton_configs = [c for c in candidates(PRESETS[preset]) if not c.get("WARP_SPECIALIZED")]
        assert [c["GROUP_M"] for c in triton_configs] == list(sweep.GROUP_M), (preset, kind)
        assert all(_without_group_m(c) == _without_group_m(triton_configs[0]) for c in triton_configs), (preset, kind)


def _without_group_m(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "GROUP_M"}


def test_warp_specialized_sweep_brackets_each_kernel_with_its_triton_configs():
    sweep = _sweep("warp_specialized")
    for kind, candidates in sweep.configs().items():
        assert kind in sweep.tune_gemm.FLOPS_PER_ROUTE_HI, kind
        assert candidates == candidates[::-1], kind  # the same list forwards and reversed
        assert not candidates[0].get("WARP_SPECIALIZED") and any(c.get("WARP_SPECIALIZED") for c in candidates), kind


def test_arithmetic_cost_diagnostic_names_its_variants_and_refuses_others(monkeypatch):
    """Each family's `full` is the kernel as is (nothing patched) and every other variant
    replaces the helper with one of the same signature (the wgrads' `regstore` and `nostore`
    switch their store instead, `nostore` to one with `_wgrad_store`'s signature); an unknown
    family or variant stops with the usage."""
    import inspect

    from mok.kernels.gemm import hopper_common, hopper_scatter, hopper_wgrad
    from mok.kernels.quant import fp8_block as quant_fp8_block

    sweep = _sweep("fp8_arithmetic_cost")
    for variants, helper in ((sweep.WGRAD, hopper_common._add_scaled),
                             (sweep.QUANTIZER, quant_fp8_block._quantize_elements)):
        assert variants["full"] is None
        wanted = list(inspect.signature(helper.fn).parameters)
        for name, patch in variants.items():
            assert patch is None or list(inspect.signature(patch.fn).parameters) == wanted, name
    assert (list(inspect.signature(sweep._stored_never.fn).parameters)
            == list(inspect.signature(hopper_wgrad._wgrad_store.fn).parameters))
    assert (list(inspect.signature(sweep._scatter_stored_never.fn).parameters)
            == list(inspect.signature(hopper_scatter._scatter_store.fn).parameters))
    for argv in (["x", "wgrad", "fast"], ["x", "matmul", "full"], ["x"]):
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit, match="usage: fp8_arithmetic_cost.py"):
            sweep.main()


@pytest.mark.parametrize("num_tokens, num_experts, topk", [(8192, 8, 2), (8192, 32, 8), (16384, 128, 8)])
def test_tile_waves_routing_adds_one_m_tile_per_extra_expert(num_tokens, num_experts, topk):
    import torch

    from mok.kernels.gemm.common import routing_block_m

    sweep = _sweep("tile_waves")
    block_m = routing_block_m()
    base_tiles = num_tokens * topk // block_m
    for extra in (0, 4, 5, 7):
        ids = sweep.exact_routing(num_tokens, num_experts, topk, extra, torch.Generator().manual_seed(extra))
        assert ids.shape == (num_tokens, topk), extra
        assert (ids.sort(dim=1).values.diff(dim=1) != 0).all(), f"{extra=}: an expert twice in a row"
        counts = torch.bincount(ids.flatten(), minlength=num_experts)
        assert int(counts.sum()) == num_tokens * topk, extra
        assert int(((counts + block_m - 1) // block_m).sum()) == base_tiles + extra, extra


def test_tile_waves_sweep_times_split_and_whole_last_waves(monkeypatch):
    from mok.kernels.gemm import common, dgrad

    for module in (dgrad, common):  # the GPU's tile configs, also under the interpreter
        monkeypatch.setattr(module, "interpreting", lambda: False)
    sweep = _sweep("tile_waves")
    p = PRESETS["mixtral-8x7b"]
    for kind in ("down", "gate_up_dgrad"):
        split, whole, *narrow = sweep._configs(kind, p.hidden_size, p.intermediate_size)
        assert split["SPLIT_LAST_WAVE"] and not whole["SPLIT_LAST_WAVE"], kind
        assert {k: v for k, v in split.items() if k != "SPLIT_LAST_WAVE"} == {
            k: v for k, v in whole.items() if k != "SPLIT_LAST_WAVE"}, kind
        assert [c["BLOCK_N"] for c in narrow] == [128, 64] and not any(c["SPLIT_LAST_WAVE"] for c in narrow), kind


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_down_dgrad_prefetch_sweep_times_the_default_with_and_without_it(preset):
    from mok.kernels.gemm.dgrad import dgrad_config

    sweep = _sweep("down_dgrad_prefetch")
    (kind, candidates), = sweep.configs().items()
    assert kind in sweep.tune_gemm.FLOPS_PER_ROUTE_HI, kind
    p = PRESETS[preset]
    configs = candidates(p)
    assert [c["PREFETCH_GATE_UP"] for c in configs] == [True, False], preset
    default = dgrad_config("down", p.intermediate_size, p.hidden_size)
    assert all({k: v for k, v in c.items() if k != "PREFETCH_GATE_UP"} == {
        k: v for k, v in default.items() if k != "PREFETCH_GATE_UP"} for c in configs), preset
