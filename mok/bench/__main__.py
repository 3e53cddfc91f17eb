"""`python -m mok.bench`: check mok and the baselines against the reference, then time them.

Examples:
    python -m mok.bench                                   # tiny on CPU; the 3 GPU presets on CUDA
    python -m mok.bench --preset qwen3-30b --pass fwd+bwd
    python -m mok.bench --tokens 37 --hidden 64 --intermediate 32 --experts 4 --topk 2 --no-write
    python -m mok.bench --preset qwen3-30b --variant persistent_down_wgrad_max_inter=0
                                                          # mok and mok-variant in turns: an A/B in one run
    torchrun --nproc-per-node 2 -m mok.bench --preset qwen3-30b   # expert parallelism over 2 GPUs
    torchrun --nproc-per-node 2 -m mok.bench --preset qwen3-30b --overlap 3,0,0
                                                          # and mok-overlap in turns with mok
    python -m mok.bench --preset qwen3-30b --out benchmarks/results   # a record for the repository

Records go to `bench-results/` (untracked) unless --out names another folder.

Under torchrun (WORLD_SIZE > 1), or in a process that already joined a default process
group of several ranks, it runs the expert-parallel benchmark over them: T tokens per
rank, the E experts split over the P ranks, mok (with `group=`) against torch-ep-nccl;
the first rank prints the table and writes the record.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import shlex
import site
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from mok.bench import report, runner
from mok.bench.baselines import sonicmoe_available
from mok.bench.presets import GPU_PRESETS, PRESETS, Preset
from mok.config import PRECISIONS, SIZE_ALIGNMENT

# Custom shape flags -> Preset fields; unspecified ones default to the `tiny` preset's
# (except the shared expert: none unless --shared-intermediate is given).
SHAPE_FLAGS = {
    "tokens": "num_tokens",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "experts": "num_experts",
    "topk": "topk",
    "shared_intermediate": "shared_intermediate_size",
}
# (warmup, reps, rounds): GPU runs take milliseconds each; the CPU reference backend is slow.
# On the GPU the implementations take turns in 6 rounds of 10 calls (`runner.run`): run to
# run, a layer's time on H200 moved by up to 5%, and by more for whichever ran first; an even
# number of rounds gives every implementation each place in the round equally often.
DEFAULT_REPS = {"cuda": (10, 60, 6), "cpu": (2, 5, 1)}


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def _split(values: Sequence[str] | None) -> list[str]:
    """Repeated and comma-separated values, in order, without duplicates."""
    return list(dict.fromkeys(v.strip() for value in values or () for v in value.split(",") if v.strip()))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mok.bench",
        description="Check mok and the baselines against the fp32 reference, then time them.",
    )
    what = p.add_argument_group("what to run")
    what.add_argument("--preset", action="append", metavar="NAME[,NAME]",
                      help=f"preset(s): {', '.join(PRESETS)}, or custom (default: tiny without CUDA, "
                           f"{', '.join(GPU_PRESETS)} with it)")
    what.add_argument("--pass", dest="passes", choices=("fwd", "fwd+bwd", "both"), default="both",
                      help="fwd: the training forward; fwd+bwd: forward and backward (default: both)")
    what.add_argument("--precision", action="append", metavar="P[,P]",
                      help=f"mok precision(s): {', '.join(PRECISIONS)} (default bf16); baselines always run bf16")
    what.add_argument("--impl", action="append", metavar="NAME[,NAME]",
                      help=f"implementations: {', '.join(runner.IMPLS)} (default: mok, torch-eager, and on CUDA "
                           "torch-compile, plus sonicmoe when importable); under torchrun "
                           f"{', '.join(runner.EP_IMPLS)} (default: all)")
    what.add_argument("--variant", action="append", metavar="FIELD=VALUE",
                      help="also time mok as mok-variant, with the kernel plan's field (mok.kernels.plan.KernelPlan) "
                           "set to the Python literal VALUE during its calls (repeatable), e.g. "
                           "persistent_down_wgrad_max_inter=0; one GPU only")
    what.add_argument("--overlap", metavar="C,C_X,C_Y",
                      help="under expert parallelism, also time mok as mok-overlap with MoKConfig(overlap_comm_sms=C, "
                           "overlap_dispatch_sms=C_X, overlap_return_sms=C_Y), in turns with mok")
    what.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                      help="auto: CUDA when available (default: auto)")
    shape = p.add_argument_group("custom shape (any of these implies --preset custom; the rest default to tiny's, "
                                  "no shared expert unless --shared-intermediate)")
    shape.add_argument("--tokens", type=_int_at_least(1), metavar="T")
    shape.add_argument("--hidden", type=_int_at_least(1), metavar="H")
    shape.add_argument("--intermediate", type=_int_at_least(1), metavar="I")
    shape.add_argument("--experts", type=_int_at_least(1), metavar="E")
    shape.add_argument("--topk", type=_int_at_least(1), metavar="K")
    shape.add_argument("--shared-intermediate", type=_int_at_least(0), metavar="I_S")
    how = p.add_argument_group("how")
    how.add_argument("--warmup", type=_int_at_least(0), help="untimed runs first (default: 10 on CUDA, 2 on CPU)")
    how.add_argument("--reps", type=_int_at_least(1),
                     help="timed runs, median reported (default: 60 on CUDA, 5 on CPU)")
    how.add_argument("--rounds", type=_int_at_least(1),
                     help="the implementations of a preset take turns in this many rounds of reps/rounds "
                          "timed runs each, every other round in reverse order (default: 6 on CUDA, 1 on CPU)")
    how.add_argument("--seed", type=int, default=0, help="input seed; d_out uses seed+1 (default: 0)")
    how.add_argument("--sonicmoe-site", type=Path, metavar="DIR",
                     help="a site dir holding the sonic-moe bundle (e.g. /tmp/site), added before import")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("bench-results"),
                     help="folder for the JSON and PNG (default: bench-results, untracked; the repository's "
                          "records go to benchmarks/results)")
    out.add_argument("--tag", help="the <what> of <gpu>-<yyyymmdd>-<what>.json (default: the preset names)")
    out.add_argument("--no-write", action="store_true", help="print the table only, write no files")
    out.add_argument("--no-plot", action="store_true", help="write no PNG")
    return p


@dataclasses.dataclass(frozen=True)
class Settings:
    presets: tuple[Preset, ...]
    passes: tuple[str, ...]
    precisions: tuple[str, ...]
    impls: tuple[str, ...]
    device: str
    warmup: int
    reps: int
    rounds: int
    seed: int
    ep: int = 1  # expert-parallel ranks (P); 1: one device
    variant: tuple[tuple[str, object], ...] = ()  # mok-variant's kernel-plan (field, value)
    overlap: tuple[int, ...] = ()  # mok-overlap's (overlap_comm_sms, overlap_dispatch_sms, overlap_return_sms)


def _world_size() -> int:
    """Ranks of this run: the initialised default process group's, else torchrun's WORLD_SIZE, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _custom_preset(args, parser, precisions) -> Preset:
    tiny = PRESETS["tiny"]
    fields = {field: getattr(args, flag) for flag, field in SHAPE_FLAGS.items() if getattr(args, flag) is not None}
    preset = dataclasses.replace(tiny, **{"name": "custom", "shared_intermediate_size": 0, **fields})
    if preset.topk > preset.num_experts:
        parser.error(f"--topk: expected at most --experts ({preset.num_experts}), got {preset.topk}")
    align = max(SIZE_ALIGNMENT[p] for p in ("bf16", *precisions))
    for flag, size in (("--hidden", preset.hidden_size), ("--intermediate", preset.intermediate_size)):
        if size % align:
            parser.error(f"{flag}: expected a multiple of {align} (for precision {', '.join(precisions)}), got {size}")
    if preset.shared_intermediate_size % SIZE_ALIGNMENT["bf16"]:
        parser.error(f"--shared-intermediate: expected 0 or a multiple of 8, got {preset.shared_intermediate_size}")
    return preset


def parse_settings(
    argv: Sequence[str] | None = None, world_size: int | None = None
) -> tuple[Settings, argparse.Namespace]:
    """Parses and validates the command line (argparse errors exit with status 2) for a run
    over `world_size` expert-parallel ranks (None: as `_world_size` finds them)."""
    ep = _world_size() if world_size is None else world_size
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    if args.sonicmoe_site is not None:
        if not args.sonicmoe_site.is_dir():
            parser.error(f"--sonicmoe-site: expected a directory, got {args.sonicmoe_site}")
        site.addsitedir(str(args.sonicmoe_site))

    precisions = _split(args.precision) or ["bf16"]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad:
        parser.error(f"--precision: expected one of {', '.join(PRECISIONS)}, got {', '.join(bad)}")

    names = _split(args.preset)
    custom_given = any(getattr(args, flag) is not None for flag in SHAPE_FLAGS)
    if custom_given and "custom" not in names:
        names.append("custom")
    if not names:
        names = list(GPU_PRESETS) if device == "cuda" else ["tiny"]
    bad = [n for n in names if n not in PRESETS and n != "custom"]
    if bad:
        parser.error(f"--preset: expected names from {', '.join([*PRESETS, 'custom'])}, got {', '.join(bad)}")
    if "custom" in names and not custom_given:
        parser.error("--preset custom: give its shape with --tokens/--hidden/--intermediate/--experts/--topk/"
                     "--shared-intermediate")
    presets = tuple(_custom_preset(args, parser, precisions) if n == "custom" else PRESETS[n] for n in names)
    for preset in presets:
        align = max(SIZE_ALIGNMENT[p] for p in precisions)
        if preset.name != "custom" and (preset.hidden_size % align or preset.intermediate_size % align):
            parser.error(f"--precision: preset {preset.name} has H/I not multiples of {align}")
        if preset.num_experts % ep:
            flag = "--experts" if preset.name == "custom" else f"--preset {preset.name}"
            parser.error(f"{flag}: expected a number of experts divisible by the {ep} expert-parallel ranks, "
                         f"got E={preset.num_experts}")

    registry = runner.EP_IMPLS if ep > 1 else runner.IMPLS
    impls = _split(args.impl)
    if not impls and ep > 1:
        impls = [name for name in runner.EP_IMPLS if name != "mok-overlap"]
    elif not impls:
        impls = ["mok", "torch-eager"]
        if device == "cuda":
            impls.append("torch-compile")
            if sonicmoe_available():
                impls.append("sonicmoe")
    variant = tuple(runner.parse_variant(text, parser) for text in args.variant or ())
    if variant and ep > 1:
        parser.error("--variant: one GPU only (not under expert parallelism)")
    if variant and "mok-variant" not in impls:
        impls.append("mok-variant")
    if "mok-variant" in impls and not variant:
        parser.error("--impl mok-variant: give its settings with --variant FIELD=VALUE")
    overlap = _parse_overlap(args.overlap, ep, parser) if args.overlap is not None else ()
    if overlap and "mok-overlap" not in impls:
        impls.append("mok-overlap")
    if "mok-overlap" in impls and not overlap:
        parser.error("--impl mok-overlap: give its SMs with --overlap C,C_X,C_Y")
    bad = [i for i in impls if i not in registry]
    if bad:
        where = f" (under {ep} expert-parallel ranks)" if ep > 1 else ""
        parser.error(f"--impl: expected names from {', '.join(registry)}{where}, got {', '.join(bad)}")

    warmup, reps, rounds = DEFAULT_REPS[device]
    settings = Settings(
        presets=presets,
        passes=runner.PASSES if args.passes == "both" else (args.passes,),
        precisions=tuple(precisions),
        impls=tuple(impls),
        device=device,
        warmup=warmup if args.warmup is None else args.warmup,
        reps=reps if args.reps is None else args.reps,
        rounds=min(rounds if args.rounds is None else args.rounds, reps if args.reps is None else args.reps),
        seed=args.seed,
        ep=ep,
        variant=variant,
        overlap=overlap,
    )
    return settings, args


def _parse_overlap(text: str, ep: int, parser: argparse.ArgumentParser) -> tuple[int, int, int]:
    """(C, C_x, C_y) of --overlap C,C_X,C_Y."""
    if ep == 1:
        parser.error("--overlap: expert parallelism only (run under torchrun with several ranks)")
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        parser.error(f"--overlap: expected C,C_X,C_Y, three ints >= 0, got {text!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


@contextlib.contextmanager
def _process_group(settings: Settings):
    """The group the expert-parallel run spans: the default group when the caller already
    joined one; else the one this process joins as torchrun's rank (nccl with one GPU per
    LOCAL_RANK on CUDA, gloo on CPU) and leaves at the end. None on one device."""
    if settings.ep == 1:
        yield None
        return
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    if settings.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if settings.device == "cuda" else "gloo")
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; 0 when every implementation that ran passed its check, else 1.
    Under expert parallelism every rank runs it and returns the same; the first prints and writes."""
    argv = list(sys.argv[1:] if argv is None else argv)
    settings, args = parse_settings(argv)
    with _process_group(settings) as group:
        leader = group is None or dist.get_rank(group) == 0
        results, info, title = _run(settings, group, show_progress=leader)
    if leader:
        _report(results, info, title, settings, args, argv)
    return 1 if any(r.status in ("FAIL", "error") for r in results) else 0


def _run(settings: Settings, group, show_progress: bool) -> tuple[list[runner.Result], dict, str]:
    """(results, machine info, title) of the benchmark, with a progress bar on stderr, or, where
    stderr is not a terminal (a log file, a pipe), a line per step and per result there."""
    info = report.machine_info(settings.device, num_gpus=settings.ep)
    cases = runner.plan(settings.presets, settings.impls, settings.precisions, settings.passes,
                        expert_parallel=settings.ep > 1, variant=settings.variant, overlap=settings.overlap)
    ranks = f" · EP {settings.ep} (max over ranks, TFLOPS per rank)" if settings.ep > 1 else ""
    title = (f"mok.bench on {info['gpu']}{ranks} · torch {info['torch']} · triton {info['triton']} · "
             f"warmup {settings.warmup}, median of {settings.reps}"
             + (f" in {settings.rounds} interleaved rounds" if settings.rounds > 1 else ""))
    stderr = Console(stderr=True)
    log = show_progress and not stderr.is_terminal
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=stderr, transient=True, disable=log or not show_progress)
    start = time.perf_counter()

    def log_line(text: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {text}", file=sys.stderr, flush=True)

    with progress:
        task = progress.add_task("starting", total=runner.num_steps(cases, settings.rounds))

        def step(description: str) -> None:
            progress.update(task, description=description, advance=1)
            if log:
                log_line(description)

        def preset_done(results: list[runner.Result]) -> None:
            if log:
                for r in results:
                    log_line(report.result_line(r))

        results = runner.run(cases, warmup=settings.warmup, reps=settings.reps, rounds=settings.rounds,
                             seed=settings.seed, device=settings.device, progress=step, group=group,
                             preset_done=preset_done)
    return results, info, title


def _report(results, info: dict, title: str, settings: Settings, args: argparse.Namespace, argv: list[str]) -> None:
    """The table on stdout; unless --no-write, the JSON record and the PNG plot."""
    console = Console()
    if not console.is_terminal:  # piped or captured: don't squeeze the table into 80 columns
        console = Console(width=200)
    report.print_table(results, console, title=title, cuda=settings.device == "cuda")
    if args.no_write:
        return
    date = datetime.date.today()
    what = args.tag or "_".join(p.name for p in settings.presets)
    if settings.ep > 1 and args.tag is None:
        what += f"_ep{settings.ep}"
    stem = report.output_stem(args.out, info["gpu"], date, what)
    rec_settings = {
        "device": settings.device,
        "passes": list(settings.passes),
        "precisions": list(settings.precisions),
        "impls": list(settings.impls),
        "warmup": settings.warmup,
        "reps": settings.reps,
        "rounds": settings.rounds,
        "seed": settings.seed,
        "variant": [f"{name}={value!r}" for name, value in settings.variant],
        "overlap": list(settings.overlap),
        "presets": [dataclasses.asdict(p) for p in settings.presets],
        "timing": "CUDA events per run (perf_counter on CPU), the implementations of a preset taking turns in "
                  "`rounds` rounds; fwd = training forward with autograd on; "
                  "fwd+bwd = forward + torch.autograd.grad(out, leaves, d_out)",
        "peak_mem_gb": "inputs resident + the pass's own peak (CUDA allocator)",
        "kept_gb": "in extra: what one training forward leaves allocated beside its output, for its backward",
    }
    launcher = "python -m mok.bench"
    if settings.ep > 1:
        launcher = f"torchrun --nproc-per-node {settings.ep} -m mok.bench"
        rec_settings["expert_parallel"] = {
            "ranks": settings.ep,
            "per_rank": "T tokens and routing from seed + rank, E/P local experts; TFLOPS per rank",
            "timing": "per iteration the slowest rank's time (all_gather), then the median over iterations",
            "mok_capacity_multiplier": runner.EP_CAPACITY_MULTIPLIER,
            "peer_bytes_per_rank": "bytes a rank sends the other ranks per pass (mok's transport); "
                                   "peer_gb_per_s = that over the pass's median time",
        }
    command = launcher + (" " + shlex.join(argv) if argv else "")
    rec = report.record(results, info, command, rec_settings, date)
    path = report.write_json(rec, stem.with_suffix(".json"))
    console.print(f"wrote {path}")
    if not args.no_plot:
        png = report.plot_speedup(results, stem.with_suffix(".png"), title=title)
        if png is not None:
            console.print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
