"""What a benchmark run leaves behind: a rich table, a JSON record, a PNG plot.

Record: `<out>/<gpu-slug>-<yyyymmdd>-<what>.json` with the machine, versions, date and
command, and one entry per (preset, pass, impl, precision); the plot of the speedup over
the baseline (torch-eager; torch-ep-nccl under expert parallelism) goes next to it with
the same stem and `.png`. An existing file is never overwritten: a second run on the same
day gets a `-2`, `-3`, ... suffix.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from mok.bench.runner import BASELINE, EP_BASELINE, Result

__all__ = ["machine_info", "gpu_slug", "record", "output_stem", "write_json", "plot_speedup", "print_table"]

# Measured ceilings of one H200 (cuBLAS bf16 and row-scaled fp8 GEMMs at 8192³): what a layer could at best reach.
CEILING_TFLOPS = {"bf16": 735.0, "mxfp8": 1224.0, "fp8_block": 1224.0}


def machine_info(device: torch.device | str, num_gpus: int = 1) -> dict:
    """gpu (device name), num_gpus (used: the expert-parallel ranks, 1 without), versions."""
    device = torch.device(device)
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        cuda = torch.version.cuda
    else:
        gpu, cuda = "cpu", None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "gpu": gpu,
        "num_gpus": num_gpus,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": cuda,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
    }


def gpu_slug(gpu: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3', 'cpu' -> 'cpu'."""
    name = re.sub(r"^(nvidia|amd)\s+", "", gpu.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def _clean(value):
    """JSON-safe: non-finite floats become the strings 'inf'/'nan' (JSON has no Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def record(results: Sequence[Result], info: dict, command: str, settings: dict, date: datetime.date) -> dict:
    """The benchmark's record: machine and versions, date, command, settings, results."""
    return _clean({
        **info,
        "date": date.isoformat(),
        "command": command,
        "settings": settings,
        "results": [r.to_dict() for r in results],
    })


def output_stem(out_dir: Path, gpu: str, date: datetime.date, what: str) -> Path:
    """`<out>/<gpu-slug>-<yyyymmdd>-<what>`, with a -2, -3, ... suffix if that JSON exists."""
    what = re.sub(r"[^A-Za-z0-9._+-]+", "-", what).strip("-") or "bench"
    base = out_dir / f"{gpu_slug(gpu)}-{date:%Y%m%d}-{what}"
    stem, n = base, 1
    while stem.with_suffix(".json").exists() or stem.with_suffix(".png").exists():
        n += 1
        stem = base.with_name(f"{base.name}-{n}")
    return stem


def write_json(rec: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    return path


def _label(r: Result) -> str:
    return r.impl if r.precision == "bf16" else f"{r.impl} ({r.precision})"


def plot_speedup(results: Sequence[Result], path: Path, title: str = "") -> Path | None:
    """Grouped bars: speedup over the baseline (torch-eager; torch-ep-nccl under expert
    parallelism) per preset/pass, one bar per impl (precision).

    Returns None (and writes nothing) when matplotlib is missing or nothing was timed
    next to the baseline.
    """
    timed = [r for r in results if r.speedup is not None]
    if not timed:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        print("mok.bench: matplotlib is not installed, no plot written", file=sys.stderr)
        return None
    groups = list(dict.fromkeys(f"{r.preset}\n{r.pass_}" for r in timed))
    labels = list(dict.fromkeys(_label(r) for r in timed))
    speed = {(f"{r.preset}\n{r.pass_}", _label(r)): r.speedup for r in timed}
    baselines = ", ".join(sorted({EP_BASELINE if r.ep > 1 else BASELINE for r in timed}))
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) + 2), 4.5))
    for i, label in enumerate(labels):
        xs = [g + (i - (len(labels) - 1) / 2) * width for g in range(len(groups))]
        ys = [speed.get((group, label), 0.0) for group in groups]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, labels=[f"{y:.2f}×" if y else "" for y in ys], fontsize=7, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel(f"speedup over {baselines} (higher is better)")
    ax.set_title(title.replace(" · warmup", "\nwarmup"), fontsize=9)  # two lines: fits the figure
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _num(value: float | None) -> str:
    """At least 3 significant digits without a long tail: 0.00263, 5.41, 203.1."""
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _status(r: Result) -> str:
    if r.status == "ok":
        note = "" if r.same_function else " (different function: not checked)"
        return "[green]ok[/green]" + note + (f" [dim]{r.message}[/dim]" if r.message else "")
    first = _first_line(r.message)
    color = {"FAIL": "red", "error": "red", "skipped": "yellow"}.get(r.status, "white")
    return f"[{color}]{r.status}[/{color}]" + (f": {first}" if first else "")


def _round_range(r: Result, short: bool = False) -> str:
    """The range of the per-round speedups where there were several rounds: ", rounds
    1.07–1.11×" (`short`: " (1.07–1.11)")."""
    if not r.speedup_rounds or len(r.speedup_rounds) < 2:
        return ""
    low, high = min(r.speedup_rounds), max(r.speedup_rounds)
    return f" ({low:.2f}–{high:.2f})" if short else f", rounds {low:.2f}–{high:.2f}×"


def result_line(r: Result) -> str:
    """One plain line for a log: what ran, its time and speedup, or why it was not timed."""
    what = f"{r.preset} {r.pass_} {_label(r)}"
    if r.ms is None:
        first = _first_line(r.message)
        return f"{what}: {r.status}" + (f": {first}" if first else "")
    speedup = "" if r.speedup is None else f" ({r.speedup:.2f}×{_round_range(r)})"
    peak = "" if r.peak_mem_gb is None else f", peak {r.peak_mem_gb:.2f} GB"
    if "kept_gb" in r.extra:
        peak += f", {r.extra['kept_gb']:.2f} GB kept for the backward"
    update = ""
    if "weight_update_ms" in r.extra:
        update = f", +{_num(r.extra['weight_update_ms'])} ms per weight update"
    return (f"{what}: {_num(r.ms)} ms{speedup}, p20–p80 {_num(r.ms_p20)}–{_num(r.ms_p80)}{peak}{update}, "
            f"max rel err {_fmt(r.max_rel_err, '.2e')}, {r.status}")


def print_table(results: Sequence[Result], console: Console, title: str = "", cuda: bool = False) -> None:
    """One row per (preset, pass, impl, precision); FAIL details follow the table."""
    table = Table(title=title, title_justify="left")
    for name in ("preset", "pass", "impl", "precision"):
        table.add_column(name)
    for name in ("ms", "TFLOPS") + (("% ceiling",) if cuda else ()) + ("speedup", "peak GB", "max rel err"):
        table.add_column(name, justify="right")
    table.add_column("status")
    previous = None
    for r in results:
        if previous is not None and (r.preset, r.pass_) != previous:
            table.add_section()
        previous = (r.preset, r.pass_)
        ceiling = []
        if cuda:
            pct = None if r.tflops is None else 100 * r.tflops / CEILING_TFLOPS[r.precision]
            ceiling = [_fmt(pct, ".0f")]
        table.add_row(
            r.preset, r.pass_, r.impl, r.precision, _num(r.ms), _num(r.tflops), *ceiling,
            "-" if r.speedup is None else f"{r.speedup:.2f}×" + _round_range(r, short=True),
            _fmt(r.peak_mem_gb, ".2f"), _fmt(r.max_rel_err, ".2e"), _status(r),
        )
    console.print(table)
    if not cuda:
        console.print("On the CPU mok runs its fp32 reference (mok.reference), not its GPU kernels: "
                      "these times say nothing about mok's speed on a GPU.", highlight=False)
    updates = {(r.preset, _label(r)): r.extra["weight_update_ms"] for r in results if "weight_update_ms" in r.extra}
    for (preset, label), ms in updates.items():
        console.print(f"[dim]{preset} {label}: each in-place update of the routed weights adds {_num(ms)} ms to the "
                      f"next step (their low-precision copies; the timed steps find them cached)[/dim]",
                      highlight=False)
    shown = set()
    for r in results:
        key = (r.preset, r.impl, r.precision, r.message)
        if r.status in ("FAIL", "error") and r.message and key not in shown:
            shown.add(key)
            console.print(f"[red]{r.status}[/red] {r.preset} {r.impl} ({r.precision}):", highlight=False)
            console.print(r.message, markup=False, highlight=False)
