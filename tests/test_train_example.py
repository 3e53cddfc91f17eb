"""examples/train_moe_lm.py on the CPU, tiny sizes, all three precisions: it trains, the
precisions differ but stay close, and it leaves its JSON record and PNG behind."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_moe_lm.py"
STEPS = 16
TINY = ["--steps", str(STEPS), "--batch-size", "4", "--seq-len", "64", "--dim", "128", "--layers", "1", "--heads", "2",
        "--experts", "4", "--expert-dim", "128", "--eval-every", "8", "--eval-batches", "2", "--log-every", "8",
        "--device", "cpu", "--precisions", "bf16,mxfp8,fp8_block"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_moe_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    """Tiny tensors: intra-op threads only add synchronisation (and thrash on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_trains_in_every_precision_and_writes_its_record(example, tmp_path, one_thread):
    record = example.main([*TINY, "--out", str(tmp_path)])
    [json_path] = tmp_path.glob("cpu-*-train-moe-lm.json")
    assert json_path.with_suffix(".png").stat().st_size > 10_000
    assert json.loads(json_path.read_text()) == record
    assert record["config"]["steps"] == STEPS and record["data"]["files"] > 100 and record["torch"]
    runs = record["runs"]
    assert list(runs) == ["bf16", "mxfp8", "fp8_block"]
    for precision, run in runs.items():
        losses = run["train_loss"]
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), precision
        first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
        assert last < first - 1.0, f"{precision}: training loss went from {first:.3f} to {last:.3f}"
        assert [step for step, _ in run["val_loss"]] == [8, 16], precision
        assert run["val_loss"][-1][1] < 4.5, precision  # well below uniform bytes, ln 256 = 5.55
        assert run["backend"] == "reference" and run["wall_s"] > 0, precision
        assert run["mean_train_loss_last_steps"] == pytest.approx(sum(losses) / STEPS), precision
    assert runs["bf16"]["rel_diff_to_bf16"] == 0.0
    for precision in ("mxfp8", "fp8_block"):
        run = runs[precision]
        assert run["train_loss"] != runs["bf16"]["train_loss"], f"{precision} trained exactly as bf16"
        assert abs(run["rel_diff_to_bf16"]) < 0.02, f"{precision}: {run['rel_diff_to_bf16']=}"
    assert runs["mxfp8"]["train_loss"] != runs["fp8_block"]["train_loss"]


def test_rejects_sizes_the_precisions_cannot_take(example, capsys):
    with pytest.raises(SystemExit):
        example.main(["--dim", "96", "--precisions", "bf16,fp8_block"])
    assert "--dim: expected a multiple of 128 for bf16, fp8_block, got 96" in capsys.readouterr().err
