"""Check, then time: the benchmark's loop over presets and implementations.

For each preset: seeded inputs on the device, the fp32 reference (`mok.reference`) with a
fixed random d_out, then every implementation's output (and, for `fwd+bwd`, every
gradient) checked against it at the accuracy bar for its precision. Only after all checks is
the reference freed and each passing implementation timed: `fwd` (the training forward,
autograd on) and `fwd+bwd` (forward + `torch.autograd.grad(out, leaves, d_out)`, so no
gradient accumulates between runs). An implementation that misses the bar is reported FAIL
with its errors and not timed; one that cannot run here is reported skipped with the reason.

Baselines always run in bf16 (they are what mok is compared with in every precision);
`mok` runs once per requested precision.

Under expert parallelism (`run(..., group=)` on every rank of a group of P ranks) each
rank draws its own T tokens and routing from seed + rank and holds its E/P local experts;
the reference is `mok.reference.ep_moe_forward/backward`, the implementations are
`EP_IMPLS` (the baseline `torch-ep-nccl`, `mok` with `group=` on the transport "auto"
picks, `mok-nccl` on the NCCL transport, and `mok-overlap` with the exchanges beside other
work), and the ranks agree
on every check before anything is timed (a case fails or is skipped on all of them if on
one). A run's time is, per iteration, the slowest rank's; the median of that is reported,
with TFLOPS per rank.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import gc
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import mok
from mok import reference
from mok.bench.baselines import SonicMoE, grouped_mm_available, torch_ep_moe, torch_moe
from mok.bench.presets import Preset
from mok.kernels.plan import check_fields, override
from mok.precision import routed_weight_copies
from mok.reference import Gradients
from mok.testing import TOLERANCES, cosine_similarity, make_inputs, mismatch_report, relative_error
from mok.testing.inputs import MoEInputs
from mok.testing.timing import PeakMemory, summarize_ms, times_ms
from mok.transport import NcclDispatch

__all__ = [
    "PASSES", "IMPLS", "EP_IMPLS", "BASELINE", "EP_BASELINE", "EP_CAPACITY_MULTIPLIER", "ImplSpec", "Impl", "Skip",
    "Case", "Result", "plan", "num_steps", "run", "slowest_rank_ms", "under_variant",
]

PASSES = ("fwd", "fwd+bwd")


class Skip(Exception):
    """An implementation that cannot run here (missing package, unsupported precision)."""


@dataclass(frozen=True, eq=False)
class Impl:
    """One implementation bound to one preset's inputs.

    forward() -> out [T, H]; grad_inputs: the leaves autograd differentiates;
    to_gradients(grads) -> the layer's 8 gradients in order (None for an absent shared expert);
    plan_fields: (field, value) of the kernel plan set while the implementation runs (its check
    and every timed round, backward included), then restored (`mok-variant`).
    """

    forward: Callable[[], torch.Tensor]
    grad_inputs: tuple[torch.Tensor, ...]
    to_gradients: Callable[[Sequence[torch.Tensor | None]], Sequence[torch.Tensor | None]]
    same_function: bool = True
    note: str = ""
    extra: dict = field(default_factory=dict)
    peer_bytes: dict[str, int] | None = None  # pass -> bytes this rank sends other ranks (expert parallelism)
    plan_fields: tuple[tuple[str, object], ...] = ()
    # What one in-place update of the routed weights adds to the next step (mok's low
    # precisions: the weights' copies, which the timed steps find cached), timed on its own.
    per_weight_update: Callable[[], object] | None = None


def parse_variant(text: str, parser: argparse.ArgumentParser) -> tuple[str, object]:
    """(field, value) of a --variant FIELD=VALUE: a field of the kernel plan
    (`mok.kernels.plan.KernelPlan`) and a Python literal."""
    field_name, sep, literal = text.partition("=")
    field_name = field_name.strip()
    if not sep or not field_name.isidentifier():
        parser.error(f"--variant: expected FIELD=VALUE with a field of the kernel plan, got {text!r}")
    try:
        check_fields({field_name: None})
    except ValueError as exc:
        parser.error(f"--variant: {exc} (in {text!r})")
    try:
        value = ast.literal_eval(literal.strip())
    except (ValueError, SyntaxError):
        parser.error(f"--variant: expected a Python literal after '=', got {literal.strip()!r} (in {text!r})")
    return field_name, value


def under_variant(plan_fields: Sequence[tuple[str, object]]) -> contextlib.AbstractContextManager:
    """The kernel plan with these (field, value) for the duration of the block, restored after it
    whatever happens inside (`mok.kernels.plan.override`)."""
    return override(**dict(plan_fields))


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
    routed = (inp.w_gate, inp.w_up, inp.w_down)
    return Impl(
        lambda: mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=config),
        _leaves(inp),
        _pad_gradients,
        extra={"config": dataclasses.asdict(config)},
        # the copies are the triton backend's, which `auto` runs on CUDA (elsewhere the reference)
        per_weight_update=(None if precision == "bf16" or not inp.x.is_cuda
                           else lambda: routed_weight_copies(routed, precision)),
    )


def _make_torch_ep(inp: MoEInputs, precision: str, group: dist.ProcessGroup) -> Impl:
    grouped = grouped_mm_available(inp.x.device)
    return Impl(lambda: torch_ep_moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, group=group, grouped=grouped),
                _leaves(inp), _pad_gradients, extra={"grouped_mm": grouped})


# Per-peer send capacity of mok's NCCL transport, as a multiple of an even share of the
# routes (MoKConfig.schedule_capacity_multiplier). The benchmark's routing is uniformly
# random, so each peer gets its even share within a few percent at every preset; the
# exact worst case (None) would move P times the rows of an even split in every exchange.
EP_CAPACITY_MULTIPLIER = 1.25


def _make_mok_ep(inp: MoEInputs, precision: str, group: dist.ProcessGroup, transport: str = "auto",
                 overlap: tuple[int, ...] = (0, 0, 0)) -> Impl:
    """mok over `group`; `overlap`: MoKConfig's (overlap_comm_sms, overlap_dispatch_sms, overlap_return_sms)."""
    config = mok.MoKConfig(precision=precision, schedule_capacity_multiplier=EP_CAPACITY_MULTIPLIER,
                           transport=transport, overlap_comm_sms=overlap[0], overlap_dispatch_sms=overlap[1],
                           overlap_return_sms=overlap[2])
    (num_tokens, hidden), topk = inp.x.shape, inp.topk_ids.shape[1]
    workspace = mok.get_workspace(config, group, device=inp.x.device, num_local_tokens=num_tokens,
                                  hidden_size=hidden, topk=topk)
    # The call's own schedule (a collective on every rank): on the triton backend it says
    # how many rows each exchange moves; the reference backend moves what the routing needs.
    dispatch = mok.build_schedule(workspace, config, inp.topk_ids, num_local_experts=inp.w_gate.shape[0],
                                  has_shared_expert=inp.ws_gate is not None).dispatch
    peer_bytes = None
    extra = {"config": dataclasses.asdict(config)}
    if dispatch is not None:
        peer_bytes = {pass_: dispatch.peer_bytes(hidden, pass_ == "fwd+bwd") for pass_ in PASSES}
    if isinstance(dispatch, NcclDispatch):  # rows the routing needs, beside the capacity the exchanges move
        extra["peer_token_rows_per_rank"] = dispatch.peer_rows()
    return Impl(
        lambda: mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=config, group=group),
        _leaves(inp),
        _pad_gradients,
        extra=extra,
        peer_bytes=peer_bytes,
    )


@dataclass(frozen=True)
class ImplSpec:
    """How to build an implementation.

    precision: fixed (baselines: bf16) or None (follows --precision).
    peer: a third-party package; an exception while it runs means it cannot run here
        (reported skipped), not that mok's benchmark failed. Wrong numbers are FAIL still.
    """

    make: Callable[..., Impl]  # (inputs, precision), and the group for EP_IMPLS
    precision: str | None = None
    peer: bool = False


# Ordered: the baseline first, so every later row can be compared with it.
IMPLS: dict[str, ImplSpec] = {
    "torch-eager": ImplSpec(_make_torch_eager, "bf16"),
    "torch-compile": ImplSpec(_make_torch_compile, "bf16"),
    "sonicmoe": ImplSpec(_make_sonicmoe, "bf16", peer=True),
    "mok": ImplSpec(_make_mok, None),
    # mok again, with the run's variant (`Case.variant`: kernel-plan fields such as tile-config
    # thresholds) set during its calls, so that two settings are timed in turns in one process
    "mok-variant": ImplSpec(_make_mok, None),
}
# Under expert parallelism: make(inputs, precision, group).
EP_IMPLS: dict[str, ImplSpec] = {
    "torch-ep-nccl": ImplSpec(_make_torch_ep, "bf16"),
    "mok": ImplSpec(_make_mok_ep, None),
    "mok-nccl": ImplSpec(functools.partial(_make_mok_ep, transport="nccl"), None),
    # mok with the exchanges beside other work (`Case.overlap`), timed in turns with mok
    "mok-overlap": ImplSpec(_make_mok_ep, None),
}
# What speedups are measured against: on one device, and under expert parallelism.
BASELINE, EP_BASELINE = "torch-eager", "torch-ep-nccl"


@dataclass(frozen=True)
class Case:
    """One implementation in one precision on one preset, for the given passes (and for
    `mok-variant`, the kernel-plan (field, value) settings it runs under; for `mok-overlap`,
    MoKConfig's (overlap_comm_sms, overlap_dispatch_sms, overlap_return_sms))."""

    preset: Preset
    impl: str
    precision: str
    passes: tuple[str, ...]
    variant: tuple[tuple[str, object], ...] = ()
    overlap: tuple[int, ...] = ()


@dataclass(frozen=True)
class Result:
    """One row of the record: the standard fields first, then extras."""

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
    speedup_vs_torch_ep_nccl: float | None = None
    ms_rounds: list[float] | None = None  # the median of each interleaved round, in run order
    # ms_rounds of the baseline over this row's, round by round: the rounds take turns within
    # a few hundred ms, so each ratio sees one clock, while the medians' ratio spans the run
    speedup_rounds: list[float] | None = None
    same_function: bool = True
    errors: dict = field(default_factory=dict)  # tensor name -> relative error (cosine for grads as "<name>:cos")
    message: str = ""  # why FAIL / skipped / error, or a note
    extra: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        """Over the baseline of its kind of run: torch-eager on one device, torch-ep-nccl under EP."""
        return self.speedup_vs_torch_ep_nccl if self.ep > 1 else self.speedup_vs_torch_eager

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        order = ["preset", "pass", "impl", "precision", "ep", "ms", "tflops", "peak_mem_gb", "max_rel_err", "status"]
        return {k: d[k] for k in order} | {k: v for k, v in d.items() if k not in order}


def plan(
    presets: Sequence[Preset],
    impls: Sequence[str],
    precisions: Sequence[str],
    passes: Sequence[str],
    *,
    expert_parallel: bool = False,
    variant: Sequence[tuple[str, object]] = (),
    overlap: tuple[int, ...] = (),
) -> list[Case]:
    """Cases in run order: per preset, impls in registry order (baseline first); `variant`
    goes with the `mok-variant` cases, `overlap` with the `mok-overlap` ones."""
    registry = EP_IMPLS if expert_parallel else IMPLS
    cases = []
    ordered = [name for name in registry if name in impls] + [name for name in impls if name not in registry]
    for preset in presets:
        for name in ordered:
            spec = registry[name]
            for precision in ([spec.precision] if spec.precision else precisions):
                cases.append(Case(preset, name, precision, tuple(passes),
                                  tuple(variant) if name == "mok-variant" else (),
                                  tuple(overlap) if name == "mok-overlap" else ()))
    return cases


def num_steps(cases: Sequence[Case], rounds: int = 1) -> int:
    """Progress steps: per preset one for inputs + reference, per case one check + one per
    pass and round."""
    return len({c.preset for c in cases}) + sum(1 + rounds * len(c.passes) for c in cases)


# --------------------------------------------------------------------------- check


@dataclass(frozen=True, eq=False)
class _Reference:
    out: torch.Tensor  # [T, H] fp32
    grads: Gradients | None  # fp32, the layer's order
    d_out: torch.Tensor  # [T, H] bf16


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, P) in `group`; (0, 1) on one device (group None)."""
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _gather(value, group: dist.ProcessGroup | None) -> list:
    """Every rank's picklable `value`, by rank; [value] on one device."""
    if group is None:
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _inputs(preset: Preset, seed: int, device, group: dist.ProcessGroup | None = None) -> MoEInputs:
    """This rank's seeded inputs (seed + rank): T tokens routed over all E experts, and its
    E/P local experts [rank·E/P, (rank+1)·E/P) (all E on one device)."""
    rank, num_ranks = _rank_and_size(group)
    inp = make_inputs(
        preset.num_tokens, preset.hidden_size, preset.intermediate_size, preset.num_experts, preset.topk,
        preset.shared_intermediate_size, seed=seed + rank, device=device,
    )
    if num_ranks > 1:
        num_local_experts = preset.num_experts // num_ranks
        local = slice(rank * num_local_experts, (rank + 1) * num_local_experts)
        inp = dataclasses.replace(
            inp, **{name: getattr(inp, name)[local].contiguous() for name in ("w_gate", "w_up", "w_down")}
        )
    # Leaves that autograd differentiates; every implementation shares them.
    return dataclasses.replace(
        inp, **{name: getattr(inp, name).detach().requires_grad_() for name in
                ("x", "topk_weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")
                if getattr(inp, name) is not None},
    )


def _reference(inp: MoEInputs, seed: int, with_grads: bool, group: dist.ProcessGroup | None = None) -> _Reference:
    rank, num_ranks = _rank_and_size(group)
    # d_out's seeds follow the inputs' (seed + rank, rank < P): seed + 1 on one device.
    gen = torch.Generator().manual_seed(seed + num_ranks + rank)
    d_out = torch.randn(inp.x.shape, generator=gen).to(device=inp.x.device, dtype=torch.bfloat16)
    weights = (w.detach() if w is not None else None for w in inp.weights)
    args = (inp.x.detach(), inp.topk_ids, inp.topk_weights.detach(), *weights)
    forward, backward = reference.moe_forward, reference.moe_backward
    if group is not None:
        forward = functools.partial(reference.ep_moe_forward, group=group)
        backward = functools.partial(reference.ep_moe_backward, group=group)
    with torch.no_grad():
        out = forward(*args)
        grads = backward(d_out, *args) if with_grads else None
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


@dataclass(frozen=True)
class _Verdict:
    """What checking one case found, on one rank or agreed by all: status "checked" (with
    its errors, ok per pass and what missed the bar), "skipped" or "FAIL" (raised), and why."""

    status: str
    message: str = ""
    errors: dict = field(default_factory=dict)
    ok: dict = field(default_factory=dict)


def _check_case(case: Case, inp: MoEInputs, ref: _Reference, group) -> tuple[Impl | None, _Verdict]:
    spec = (IMPLS if group is None else EP_IMPLS)[case.impl]
    try:
        if group is None:
            impl = spec.make(inp, case.precision)
        else:
            impl = spec.make(inp, case.precision, group, **({"overlap": case.overlap} if case.overlap else {}))
        if case.variant:
            settings = [f"{name}={value!r}" for name, value in case.variant]
            impl = dataclasses.replace(impl, plan_fields=case.variant, extra=impl.extra | {"variant": settings})
        with under_variant(impl.plan_fields):
            errors, ok, message = _check(impl, ref, case.precision)
    except (Skip, NotImplementedError) as exc:
        return None, _Verdict("skipped", str(exc))
    except Exception as exc:  # a crash is a failed check, reported, never fatal to the run
        return None, _Verdict("skipped" if spec.peer else "FAIL", f"raised {type(exc).__name__}: {exc}")
    return impl, _Verdict("checked", message, errors, ok)


def _agree(mine: _Verdict, group) -> _Verdict:
    """The ranks' common verdict, so that all of them time the same cases: FAIL or skipped
    where any rank says so; else the worst errors over ranks, a pass ok where every rank's is."""
    if group is None:
        return mine
    verdicts = _gather(mine, group)
    for status in ("FAIL", "skipped"):
        if any(v.status == status for v in verdicts):
            return _Verdict(status, "\n".join(f"rank {r}: {v.message}" for r, v in enumerate(verdicts)
                                              if v.status == status))
    errors = {name: (min if name.endswith(":cos") else max)(v.errors[name] for v in verdicts) for name in mine.errors}
    ok = {pass_: all(v.ok[pass_] for v in verdicts) for pass_ in mine.ok}
    message = "\n".join(f"rank {r}: {v.message}" for r, v in enumerate(verdicts) if v.message)
    return _Verdict("checked", message, errors, ok)


def _summary(errors: dict, pass_: str) -> tuple[float | None, float | None]:
    """(max relative error, min cosine) over what the pass checks."""
    names = [k for k in errors if not k.endswith(":cos") and (pass_ == "fwd+bwd" or k == "out")]
    coses = [v for k, v in errors.items() if k.endswith(":cos")] if pass_ == "fwd+bwd" else []
    return (max(errors[k] for k in names) if names else None), (min(coses) if coses else None)


# --------------------------------------------------------------------------- time


@dataclass(frozen=True)
class _Timing:
    """One (impl, pass) timed. stats: of the reported per-iteration times (under expert
    parallelism the slowest rank's); peak memory: the largest over ranks; ms_per_rank:
    each rank's own median under expert parallelism, None on one device."""

    stats: dict
    peak_mem_gb: float | None
    peak_mem_delta_gb: float | None
    ms_per_rank: list[float] | None
    ms_rounds: list[float]


def slowest_rank_ms(times_per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per iteration, the slowest rank's milliseconds: an expert-parallel step ends when
    its last rank does. times_per_rank[r][i]: rank r's iteration i."""
    return [max(times) for times in zip(*times_per_rank, strict=True)]


def _largest(values: Sequence[float | None]) -> float | None:
    return None if any(v is None for v in values) else max(values)


def _time_round(impl: Impl, pass_: str, d_out: torch.Tensor, warmup: int, reps: int, device
                ) -> tuple[list[float], float | None]:
    """One round: `reps` timed calls after `warmup` untimed ones; (per-call ms, the round's
    peak GB over what was allocated on entry, None off CUDA)."""
    if pass_ == "fwd":
        def fn():
            impl.forward()
    else:
        def fn():
            torch.autograd.grad(impl.forward(), impl.grad_inputs, d_out, allow_unused=True)
    with under_variant(impl.plan_fields), PeakMemory(device) as mem:
        times = times_ms(fn, warmup=warmup, reps=reps, device=device)
    return times, mem.delta_gb


def _round_medians(times: Sequence[float], round_sizes: Sequence[int]) -> list[float]:
    """The median of each round's calls; `times` holds the rounds' calls one after another."""
    starts = [sum(round_sizes[:i]) for i in range(len(round_sizes))]
    return [summarize_ms(list(times[start:start + size]))["median"] for start, size in zip(starts, round_sizes)]


def _timing(times: list[float], round_sizes: list[int], delta_gb: float | None, inputs_gb: float | None,
            group) -> _Timing:
    """The statistics of one (impl, pass) over all its rounds (`round_sizes` calls each, in
    order); under EP, of the slowest rank per call."""
    peak = None if delta_gb is None else inputs_gb + delta_gb
    if group is None:
        return _Timing(summarize_ms(times), peak, delta_gb, None, _round_medians(times, round_sizes))
    ranks = _gather((times, peak, delta_gb), group)
    slowest = slowest_rank_ms([times for times, _, _ in ranks])
    return _Timing(
        summarize_ms(slowest),
        _largest([peak for _, peak, _ in ranks]),
        _largest([delta for _, _, delta in ranks]),
        [summarize_ms(times)["median"] for times, _, _ in ranks],
        _round_medians(slowest, round_sizes),
    )


def _timing_extra(impl: Impl, pass_: str, timing: _Timing) -> dict:
    """Under expert parallelism: each rank's median and, where the implementation knows
    them, the bytes each rank sends the others per pass and their rate over the pass."""
    extra = {}
    if timing.ms_per_rank is not None:
        extra["ms_per_rank"] = timing.ms_per_rank
    if impl.peer_bytes is not None:
        sent = impl.peer_bytes[pass_]
        extra["peer_bytes_per_rank"] = sent
        extra["peer_gb_per_s"] = sent / (timing.stats["median"] * 1e-3) / 1e9
    return extra


def _weight_update_extra(impl: Impl, device) -> dict:
    """{"weight_update_ms": median ms} of what an update of the routed weights adds to the next
    step, where the implementation has such a cost; {} otherwise."""
    if impl.per_weight_update is None:
        return {}
    with under_variant(impl.plan_fields):
        return {"weight_update_ms": summarize_ms(times_ms(impl.per_weight_update, warmup=2, reps=10,
                                                          device=device))["median"]}


def _kept_extra(impl: Impl, device, group) -> dict:
    """{"kept_gb": GB} that one training forward leaves allocated for its backward beside its
    output (under expert parallelism the largest over ranks): what each layer of a model holds
    until its backward runs. {} off CUDA."""
    if torch.device(device).type != "cuda":
        return {}
    with under_variant(impl.plan_fields):
        impl.forward()  # whatever a first call caches (workspaces, weight copies) is not kept per layer
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        out = impl.forward()
        kept = torch.cuda.memory_allocated(device) - before - out.untyped_storage().nbytes()
        del out
    return {"kept_gb": max(_gather(kept / 1e9, group))}


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


@dataclass(eq=False)
class _Timed:
    """One checked (impl, pass) of a preset, filled in round by round: its per-call ms, the
    largest peak over what was allocated on entry (None off CUDA), or why timing failed."""

    impl: Impl
    pass_: str
    row: dict  # the Result fields it shares with its check
    times: list[float] = field(default_factory=list)
    round_sizes: list[int] = field(default_factory=list)  # calls timed in each round
    delta_gb: float | None = None
    error: str | None = None


def _round_reps(reps: int, rounds: int, round_: int) -> int:
    """Timed calls in round `round_`: reps split as evenly as it goes, the first rounds
    taking the remainder (at least one call each)."""
    return max(1, reps // rounds + (round_ < reps % rounds))


# Untimed calls at the start of every round after the first: a round follows another
# implementation's, whose memory and caches the first call would pay for.
ROUND_WARMUP = 2


def _round_order(timed: list, round_: int) -> list:
    """The order the (impl, pass) pairs take in round `round_`: as given in even rounds,
    reversed in odd ones. On the H200 a pair's time depends on its place in the round: in one
    run, deepseek-v3-slice's fp8_block layer took about 3% less in the place before
    another build than in the one after it, whichever build sat where (benchmarks/LOG.md, "Which
    place in the round"). Reversing every other round gives each pair both neighbours'
    places alike, so the bias falls out of the medians of an even number of rounds."""
    return timed if round_ % 2 == 0 else timed[::-1]


def run(
    cases: Sequence[Case],
    *,
    warmup: int,
    reps: int,
    rounds: int = 1,
    seed: int = 0,
    device: torch.device | str = "cpu",
    progress: Callable[[str], None] | None = None,
    group: dist.ProcessGroup | None = None,
    preset_done: Callable[[list[Result]], None] | None = None,
) -> list[Result]:
    """Checks and times every case; returns one Result per (case, pass), speedups attached.
    Each (case, pass) runs `warmup` untimed calls, then `reps` timed calls in `rounds` turns
    interleaved with the other cases of its preset (medians over all its calls).
    `preset_done` gets each preset's results as soon as they are in (so a run cut short
    leaves the presets it finished on record).

    group: a process group of P > 1 ranks to run the expert-parallel benchmark over (cases
    planned with `expert_parallel=True`; every rank calls `run` alike and gets the same
    results); None: one device.
    """
    step = progress or (lambda description: None)
    rounds = min(rounds, reps)
    num_ranks = _rank_and_size(group)[1]
    results: list[Result] = []
    for preset in dict.fromkeys(c.preset for c in cases):
        first_result = len(results)
        preset_cases = [c for c in cases if c.preset == preset]
        needs_grads = any("fwd+bwd" in c.passes for c in preset_cases)
        step(f"{preset.name}: inputs + fp32 reference")
        cuda = torch.device(device).type == "cuda"
        before_gb = torch.cuda.memory_allocated(device) / 1e9 if cuda else None
        inp = _inputs(preset, seed, device, group)
        # The inputs alone: whatever an earlier preset left allocated is not this preset's.
        inputs_gb = torch.cuda.memory_allocated(device) / 1e9 - before_gb if cuda else None
        ref = _reference(inp, seed, needs_grads, group)
        # Phase 1: build and check every implementation while the reference is resident.
        checked = []
        for case in preset_cases:
            step(f"{preset.name}: check {case.impl} ({case.precision})")
            row = dict(preset=preset.name, impl=case.impl, precision=case.precision, ep=num_ranks)
            impl, verdict = _check_case(case, inp, ref, group)
            verdict = _agree(verdict, group)
            if verdict.status != "checked":
                results += [Result(pass_=p, status=verdict.status, message=verdict.message, **row)
                            for p in case.passes]
                for _ in range(rounds * len(case.passes)):
                    step(f"{preset.name}: {case.impl} {verdict.status}")
                continue
            checked.append((case, impl, verdict))
        d_out = ref.d_out
        del ref
        _free(device)
        # Phase 2: time what passed. The (impl, pass) pairs take turns, `rounds` rounds of
        # reps / rounds calls each, so that the GPU's clock drifting over the run (H200: a few
        # percent between runs, lower under sustained load) weighs on all of them alike.
        timed: list[_Timed] = []
        for case, impl, verdict in checked:
            row = dict(preset=preset.name, impl=case.impl, precision=case.precision, ep=num_ranks,
                       same_function=impl.same_function)
            for pass_ in case.passes:
                max_err, min_cos = _summary(verdict.errors, pass_)
                checked_row = dict(row, errors=verdict.errors, max_rel_err=max_err, min_cosine=min_cos)
                if verdict.ok[pass_]:
                    timed.append(_Timed(impl, pass_, checked_row))
                else:
                    for _ in range(rounds):
                        step(f"{preset.name}: {case.impl} ({case.precision}) {pass_} failed its check")
                    results.append(Result(pass_=pass_, status="FAIL", message=verdict.message, extra=impl.extra,
                                          **checked_row))
        for round_ in range(rounds):
            for t in _round_order(timed, round_):
                name = f"{preset.name}: {t.row['impl']} ({t.row['precision']}) {t.pass_}"
                if t.error is not None:
                    step(f"{name}: {t.error}")
                    continue
                step(f"{name}: time" + (f", round {round_ + 1}/{rounds}" if rounds > 1 else ""))
                try:
                    times, delta_gb = _time_round(
                        t.impl, t.pass_, d_out, warmup if round_ == 0 else ROUND_WARMUP,
                        _round_reps(reps, rounds, round_), device,
                    )
                except Exception as exc:
                    t.error = f"timing raised {type(exc).__name__}: {exc}"
                    _free(device)
                    continue
                t.times += times
                t.round_sizes.append(len(times))
                t.delta_gb = delta_gb if t.delta_gb is None else max(t.delta_gb, delta_gb)
        per_impl = {}  # id(impl) -> its `_weight_update_extra` and `_kept_extra`, once for all its passes
        for t in timed:
            if t.error is not None:
                results.append(Result(pass_=t.pass_, status="error", message=t.error, extra=t.impl.extra, **t.row))
                continue
            timing = _timing(t.times, t.round_sizes, t.delta_gb, inputs_gb, group)
            stats = timing.stats
            if id(t.impl) not in per_impl:
                per_impl[id(t.impl)] = _weight_update_extra(t.impl, device) | _kept_extra(t.impl, device, group)
            extra = t.impl.extra | _timing_extra(t.impl, t.pass_, timing) | per_impl[id(t.impl)]
            results.append(Result(
                pass_=t.pass_, status="ok", ms=stats["median"],
                tflops=preset.flops(t.pass_) / (stats["median"] * 1e-3) / 1e12,
                peak_mem_gb=timing.peak_mem_gb, peak_mem_delta_gb=timing.peak_mem_delta_gb,
                ms_min=stats["min"], ms_p20=stats["p20"], ms_p80=stats["p80"], reps=len(t.times),
                ms_rounds=timing.ms_rounds, message=t.impl.note,
                extra=extra, **t.row,
            ))
        del checked, inp, d_out
        _free(device)
        if preset_done is not None:
            preset_done(with_speedups(_sorted(results[first_result:], cases)))
    return with_speedups(_sorted(results, cases))


def _sorted(results: Sequence[Result], cases: Sequence[Case]) -> list[Result]:
    """Grouped by preset, then pass; within a group in case order (baseline first)."""
    presets = list(dict.fromkeys(c.preset.name for c in cases))
    impls = list(dict.fromkeys((c.impl, c.precision) for c in cases))
    order = {key: i for i, key in enumerate(impls)}
    return sorted(results, key=lambda r: (presets.index(r.preset), PASSES.index(r.pass_), order[(r.impl, r.precision)]))


def with_speedups(results: Sequence[Result]) -> list[Result]:
    """Each timed row's speedup over its baseline (BASELINE on one device, EP_BASELINE under
    expert parallelism) on the same preset and pass, when that was timed: of the medians, and
    round by round where both rows have their rounds' medians."""
    def baseline(r: Result) -> str:
        return EP_BASELINE if r.ep > 1 else BASELINE

    base = {(r.preset, r.pass_, r.ep): r for r in results if r.impl == baseline(r) and r.ms is not None}
    speedups = []
    for r in results:
        b = base.get((r.preset, r.pass_, r.ep))
        if r.ms is None or b is None:
            speedups.append(r)
            continue
        name = "speedup_vs_torch_ep_nccl" if r.ep > 1 else "speedup_vs_torch_eager"
        rounds = None  # none for the baseline itself: 1 in every round
        if r is not b and r.ms_rounds and b.ms_rounds and len(r.ms_rounds) == len(b.ms_rounds):
            rounds = [base_ms / ms for base_ms, ms in zip(b.ms_rounds, r.ms_rounds)]
        speedups.append(dataclasses.replace(r, **{name: b.ms / r.ms}, speedup_rounds=rounds))
    return speedups
