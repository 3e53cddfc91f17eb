"""Check, then time: the benchmark's loop over presets and implementations (DESIGN §7).

For each preset: seeded inputs on the device, the fp32 reference (`mok.reference`) with a
fixed random d_out, then every implementation's output (and, for `fwd+bwd`, every
gradient) checked against it at SPEC §2's bar for its precision. Only after all checks is
the reference freed and each passing implementation timed: `fwd` (the training forward,
autograd on) and `fwd+bwd` (forward + `torch.autograd.grad(out, leaves, d_out)`, so no
gradient accumulates between runs). An implementation that misses the bar is reported FAIL
with its errors and not timed; one that cannot run here is reported skipped with the reason.

Baselines always run in bf16 (they are what mok is compared with in every precision);
`mok` runs once per requested precision.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

import mok
from mok import reference
from mok.bench.baselines import SonicMoE, grouped_mm_available, torch_moe
from mok.bench.presets import Preset
from mok.reference import Gradients
from mok.testing import TOLERANCES, cosine_similarity, make_inputs, mismatch_report, relative_error
from mok.testing.inputs import MoEInputs
from mok.testing.timing import PeakMemory, time_ms

__all__ = ["PASSES", "IMPLS", "ImplSpec", "Impl", "Skip", "Case", "Result", "plan", "num_steps", "run"]

PASSES = ("fwd", "fwd+bwd")


class Skip(Exception):
    """An implementation that cannot run here (missing package, unsupported precision)."""


@dataclass(frozen=True, eq=False)
class Impl:
    """One implementation bound to one preset's inputs.

    forward() -> out [T, H]; grad_inputs: the leaves autograd differentiates;
    to_gradients(grads) -> SPEC's 8 gradients in order (None for an absent shared expert).
    """

    forward: Callable[[], torch.Tensor]
    grad_inputs: tuple[torch.Tensor, ...]
    to_gradients: Callable[[Sequence[torch.Tensor | None]], Sequence[torch.Tensor | None]]
    same_function: bool = True
    note: str = ""
    extra: dict = field(default_factory=dict)


def _leaves(inp: MoEInputs) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in (inp.x, inp.topk_weights, *inp.weights) if t is not None)


def _pad_gradients(grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
    """to_gradients for impls differentiated w.r.t. _leaves(inp): None for an absent shared expert."""
    return tuple(grads) + (None,) * (len(Gradients._fields) - len(grads))


def _make_torch_eager(inp: MoEInputs, precision: str) -> Impl:
    grouped = grouped_mm_available(inp.x.device)
    return Impl(lambda: torch_moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, grouped=grouped),
                _leaves(inp), _pad_gradients, extra={"grouped_mm": grouped})


def _make_torch_compile(inp: MoEInputs, precision: str) -> Impl:
    grouped = grouped_mm_available(inp.x.device)
    compiled = torch.compile(torch_moe, dynamic=False)  # compiles on the first call: the check, untimed
    return Impl(lambda: compiled(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, grouped=grouped),
                _leaves(inp), _pad_gradients, extra={"grouped_mm": grouped})


def _make_sonicmoe(inp: MoEInputs, precision: str) -> Impl:
    try:
        layer = SonicMoE(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    except Exception as exc:  # not installed, or an API this wrapper does not know
        raise Skip(f"sonicmoe: {type(exc).__name__}: {exc}") from exc
    note = "shared expert in torch" if inp.ws_gate is not None else ""
    version = getattr(sys.modules.get("sonicmoe"), "__version__", "unknown")
    return Impl(layer, layer.grad_inputs, layer.gradients, note=note,
                extra={"sonicmoe_version": version, "api": "moe_general_routing_inputs (our routing)"})


def _make_mok(inp: MoEInputs, precision: str) -> Impl:
    config = mok.MoKConfig(precision=precision)
    return Impl(
        lambda: mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=config),
        _leaves(inp),
        _pad_gradients,
        extra={"config": dataclasses.asdict(config)},
    )


@dataclass(frozen=True)
class ImplSpec:
    """How to build an implementation.

    precision: fixed (baselines: bf16) or None (follows --precision).
    peer: a third-party package; an exception while it runs means it cannot run here
        (reported skipped), not that mok's benchmark failed. Wrong numbers are FAIL still.
    """

    make: Callable[[MoEInputs, str], Impl]
    precision: str | None = None
    peer: bool = False


# Ordered: the baseline first, so every later row can be compared with it.
IMPLS: dict[str, ImplSpec] = {
    "torch-eager": ImplSpec(_make_torch_eager, "bf16"),
    "torch-compile": ImplSpec(_make_torch_compile, "bf16"),
    "sonicmoe": ImplSpec(_make_sonicmoe, "bf16", peer=True),
    "mok": ImplSpec(_make_mok, None),
}


@dataclass(frozen=True)
class Case:
    """One implementation in one precision on one preset, for the given passes."""

    preset: Preset
    impl: str
    precision: str
    passes: tuple[str, ...]


@dataclass(frozen=True)
class Result:
    """One row of the record: DESIGN §7's fields first, then extras."""

    preset: str
    pass_: str
    impl: str
    precision: str
    status: str  # "ok" | "FAIL" (missed the accuracy bar or raised) | "skipped" | "error" (timing crashed)
    ep: int = 1
    ms: float | None = None
    tflops: float | None = None
    peak_mem_gb: float | None = None
    max_rel_err: float | None = None
    min_cosine: float | None = None
    ms_min: float | None = None
    ms_p20: float | None = None
    ms_p80: float | None = None
    reps: int | None = None
    peak_mem_delta_gb: float | None = None
    speedup_vs_torch_eager: float | None = None
    same_function: bool = True
    errors: dict = field(default_factory=dict)  # tensor name -> relative error (cosine for grads as "<name>:cos")
    message: str = ""  # why FAIL / skipped / error, or a note
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        order = ["preset", "pass", "impl", "precision", "ep", "ms", "tflops", "peak_mem_gb", "max_rel_err", "status"]
        return {k: d[k] for k in order} | {k: v for k, v in d.items() if k not in order}


def plan(
    presets: Sequence[Preset], impls: Sequence[str], precisions: Sequence[str], passes: Sequence[str]
) -> list[Case]:
    """Cases in run order: per preset, impls in registry order (baseline first)."""
    cases = []
    ordered = [name for name in IMPLS if name in impls] + [name for name in impls if name not in IMPLS]
    for preset in presets:
        for name in ordered:
            spec = IMPLS[name]
            for precision in ([spec.precision] if spec.precision else precisions):
                cases.append(Case(preset, name, precision, tuple(passes)))
    return cases


def num_steps(cases: Sequence[Case]) -> int:
    """Progress steps: per preset one for inputs + reference, per case one check + one per pass."""
    return len({c.preset for c in cases}) + sum(1 + len(c.passes) for c in cases)


# --------------------------------------------------------------------------- check


@dataclass(frozen=True, eq=False)
class _Reference:
    out: torch.Tensor  # [T, H] fp32
    grads: Gradients | None  # fp32, SPEC order
    d_out: torch.Tensor  # [T, H] bf16


def _inputs(preset: Preset, seed: int, device) -> MoEInputs:
    inp = make_inputs(
        preset.num_tokens, preset.hidden_size, preset.intermediate_size, preset.num_experts, preset.topk,
        preset.shared_intermediate_size, seed=seed, device=device,
    )
    # Leaves that autograd differentiates; every implementation shares them.
    return dataclasses.replace(
        inp, **{name: getattr(inp, name).detach().requires_grad_() for name in
                ("x", "topk_weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")
                if getattr(inp, name) is not None},
    )


def _reference(inp: MoEInputs, seed: int, with_grads: bool) -> _Reference:
    gen = torch.Generator().manual_seed(seed + 1)
    d_out = torch.randn(inp.x.shape, generator=gen).to(device=inp.x.device, dtype=torch.bfloat16)
    weights = (w.detach() if w is not None else None for w in inp.weights)
    args = (inp.x.detach(), inp.topk_ids, inp.topk_weights.detach(), *weights)
    with torch.no_grad():
        out = reference.moe_forward(*args)
        grads = reference.moe_backward(d_out, *args) if with_grads else None
    return _Reference(out, grads, d_out)


def _check(impl: Impl, ref: _Reference, precision: str) -> tuple[dict, dict, str]:
    """Runs impl once; returns (errors, ok per pass, message). Raises what the impl raises."""
    max_err, min_cos = TOLERANCES[precision]
    out = impl.forward()
    errors = {"out": relative_error(out, ref.out)}
    problems = []
    if not errors["out"] <= max_err:
        problems.append(f"out rel_err {errors['out']:.3e} > {max_err}\n" + mismatch_report(out, ref.out, "out"))
    ok = {"fwd": not problems}
    if ref.grads is not None:
        grads = torch.autograd.grad(out, impl.grad_inputs, ref.d_out, allow_unused=True)
        for name, got, want in zip(Gradients._fields, impl.to_gradients(grads), ref.grads, strict=True):
            if want is None and got is None:
                continue
            if got is None or want is None:
                problems.append(f"{name}: {'missing' if got is None else 'unexpected'} gradient")
                errors[name] = math.inf
                continue
            err, cos = relative_error(got, want), cosine_similarity(got, want)
            errors[name], errors[name + ":cos"] = err, cos
            if not (err <= max_err and cos >= min_cos):
                problems.append(
                    f"{name} rel_err {err:.3e} (≤ {max_err}), cosine {cos:.6f} (≥ {min_cos})\n"
                    + mismatch_report(got, want, name)
                )
        ok["fwd+bwd"] = not problems
    return errors, ok, "\n".join(problems)


def _summary(errors: dict, pass_: str) -> tuple[float | None, float | None]:
    """(max relative error, min cosine) over what the pass checks."""
    names = [k for k in errors if not k.endswith(":cos") and (pass_ == "fwd+bwd" or k == "out")]
    coses = [v for k, v in errors.items() if k.endswith(":cos")] if pass_ == "fwd+bwd" else []
    return (max(errors[k] for k in names) if names else None), (min(coses) if coses else None)


# --------------------------------------------------------------------------- time


def _time(impl: Impl, pass_: str, d_out: torch.Tensor, warmup: int, reps: int, device) -> tuple[dict, PeakMemory]:
    if pass_ == "fwd":
        def fn():
            impl.forward()
    else:
        def fn():
            torch.autograd.grad(impl.forward(), impl.grad_inputs, d_out, allow_unused=True)
    with PeakMemory(device) as mem:
        stats = time_ms(fn, warmup=warmup, reps=reps, device=device)
    return stats, mem


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def run(
    cases: Sequence[Case],
    *,
    warmup: int,
    reps: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> list[Result]:
    """Checks and times every case; returns one Result per (case, pass), speedups attached."""
    step = progress or (lambda description: None)
    results: list[Result] = []
    for preset in dict.fromkeys(c.preset for c in cases):
        preset_cases = [c for c in cases if c.preset == preset]
        needs_grads = any("fwd+bwd" in c.passes for c in preset_cases)
        step(f"{preset.name}: inputs + fp32 reference")
        inp = _inputs(preset, seed, device)
        inputs_gb = torch.cuda.memory_allocated(device) / 1e9 if torch.device(device).type == "cuda" else None
        ref = _reference(inp, seed, needs_grads)
        # Phase 1: build and check every implementation while the reference is resident.
        checked = []
        for case in preset_cases:
            step(f"{preset.name}: check {case.impl} ({case.precision})")
            row = dict(preset=preset.name, impl=case.impl, precision=case.precision)
            try:
                impl = IMPLS[case.impl].make(inp, case.precision)
                errors, ok, message = _check(impl, ref, case.precision)
            except (Skip, NotImplementedError) as exc:
                results += [Result(pass_=p, status="skipped", message=str(exc), **row) for p in case.passes]
                for _ in case.passes:
                    step(f"{preset.name}: skip {case.impl}")
                continue
            except Exception as exc:  # a crash is a failed check, reported, never fatal to the run
                msg = f"raised {type(exc).__name__}: {exc}"
                status = "skipped" if IMPLS[case.impl].peer else "FAIL"
                results += [Result(pass_=p, status=status, message=msg, **row) for p in case.passes]
                for _ in case.passes:
                    step(f"{preset.name}: {case.impl} failed")
                continue
            checked.append((case, impl, errors, ok, message))
        d_out = ref.d_out
        del ref
        _free(device)
        # Phase 2: time what passed, one (impl, pass) at a time.
        for case, impl, errors, ok, message in checked:
            row = dict(preset=preset.name, impl=case.impl, precision=case.precision,
                       same_function=impl.same_function, extra=impl.extra)
            for pass_ in case.passes:
                step(f"{preset.name}: time {case.impl} ({case.precision}) {pass_}")
                max_err, min_cos = _summary(errors, pass_)
                checked_row = dict(row, errors=errors, max_rel_err=max_err, min_cosine=min_cos)
                if not ok[pass_]:
                    results.append(Result(pass_=pass_, status="FAIL", message=message, **checked_row))
                    continue
                try:
                    stats, mem = _time(impl, pass_, d_out, warmup, reps, device)
                except Exception as exc:
                    msg = f"timing raised {type(exc).__name__}: {exc}"
                    results.append(Result(pass_=pass_, status="error", message=msg, **checked_row))
                    _free(device)
                    continue
                ms = stats["median"]
                results.append(Result(
                    pass_=pass_, status="ok", ms=ms, tflops=preset.flops(pass_) / (ms * 1e-3) / 1e12,
                    peak_mem_gb=None if mem.delta_gb is None else inputs_gb + mem.delta_gb,
                    peak_mem_delta_gb=mem.delta_gb, ms_min=stats["min"], ms_p20=stats["p20"], ms_p80=stats["p80"],
                    reps=reps, message=impl.note, **checked_row,
                ))
        del checked, inp, d_out
        _free(device)
    return with_speedups(_sorted(results, cases))


def _sorted(results: Sequence[Result], cases: Sequence[Case]) -> list[Result]:
    """Grouped by preset, then pass; within a group in case order (baseline first)."""
    presets = list(dict.fromkeys(c.preset.name for c in cases))
    impls = list(dict.fromkeys((c.impl, c.precision) for c in cases))
    order = {key: i for i, key in enumerate(impls)}
    return sorted(results, key=lambda r: (presets.index(r.preset), PASSES.index(r.pass_), order[(r.impl, r.precision)]))


def with_speedups(results: Sequence[Result]) -> list[Result]:
    """Each timed row's speedup over torch-eager on the same preset and pass (when timed)."""
    eager = {(r.preset, r.pass_): r.ms for r in results if r.impl == "torch-eager" and r.ms is not None}
    return [
        dataclasses.replace(r, speedup_vs_torch_eager=eager[(r.preset, r.pass_)] / r.ms)
        if r.ms is not None and (r.preset, r.pass_) in eager else r
        for r in results
    ]
