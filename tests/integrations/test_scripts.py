"""examples/finetune_hf_qwen3_moe.py and benchmarks/hf_layer_stack.py run end to end on the
CPU at tiny sizes (the benchmark's GPU run uses the same code at qwen3-30b's sizes)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _load(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_finetune_example_lowers_the_loss():
    losses = _load("examples/finetune_hf_qwen3_moe.py").main(["--steps", "4", "--batch-size", "2", "--seq-len", "32"])
    assert len(losses) == 4 and losses[-1] < losses[0], f"{losses=}"


def test_layer_stack_benchmark_checks_times_and_records(tmp_path):
    tiny = ["--device", "cpu", "--layers", "2", "--tokens", "48", "--hidden", "64", "--moe-intermediate", "32",
            "--experts", "8", "--topk", "2", "--warmup", "1", "--rounds", "1", "--reps", "1", "--out", str(tmp_path)]
    result = _load("benchmarks/hf_layer_stack.py").main(tiny)
    [path] = tmp_path.glob("cpu-*-hf-layer-stack.json")
    assert json.loads(path.read_text()) == result
    assert [row["impl"] for row in result["results"]] == ["hf-mok", "hf-grouped_mm"]
    assert all(row["ms"] > 0 and row["steps"] == 1 for row in result["results"])
    assert result["speedup_mok_over_grouped_mm"] > 0 and "hf_layer_stack.py" in result["command"]
