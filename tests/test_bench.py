"""`python -m mok.bench` in-process on CPU, and the torch baseline against the reference."""

import dataclasses
import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from mok import reference
from mok.bench import __main__ as cli
from mok.bench import report, runner
from mok.bench.baselines import torch_moe
from mok.reference import Gradients
from mok.testing import TOLERANCES, cosine_similarity, make_inputs, make_topk_ids, relative_error
from mok.testing.timing import PeakMemory, back_to_back_ms, capture_cuda_graph, percentile, time_ms

FAST = ["--reps", "1", "--warmup", "0"]
CUSTOM = ["--tokens", "37", "--hidden", "64", "--intermediate", "32", "--experts", "4", "--topk", "2"]


def _grouped_modes():
    modes = [False]
    try:  # torch's CPU fallback of _grouped_mm runs the same code path the GPU takes
        torch._grouped_mm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(1, 8, 8, dtype=torch.bfloat16),
                          offs=torch.tensor([2], dtype=torch.int32))
        modes.append(True)
    except (AttributeError, RuntimeError, NotImplementedError):
        pass
    return modes


@pytest.mark.parametrize("grouped", _grouped_modes())
@pytest.mark.parametrize("shared", [0, 32])
@pytest.mark.parametrize("topk", [1, 2])
def test_torch_eager_matches_reference(grouped, shared, topk):
    T, H, I, E = 37, 64, 32, 5  # noqa: E741 (the layer's names)
    # Ids drawn from E-1 experts and shifted: expert 0 gets no token.
    ids = make_topk_ids(T, E - 1, topk, torch.Generator().manual_seed(3)) + 1
    inp = make_inputs(T, H, I, E, topk, shared, seed=7, topk_ids=ids, signed_weights=True)
    leaves = [t.detach().requires_grad_() for t in (inp.x, inp.topk_weights, *inp.weights) if t is not None]
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = torch_moe(leaves[0], inp.topk_ids, leaves[1], *leaves[2:], grouped=grouped)
    grads = torch.autograd.grad(out, leaves, d_out)
    ref_out = reference.moe_forward(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    ref_grads = reference.moe_backward(d_out, inp.x, inp.topk_ids, inp.topk_weights, *inp.weights)
    ctx = f"{T=} {H=} {I=} {E=} {topk=} {shared=} {grouped=}"
    max_err, min_cos = TOLERANCES["bf16"]
    assert out.dtype == torch.bfloat16 and out.shape == (T, H), ctx
    assert relative_error(out, ref_out) <= max_err, ctx
    grads = tuple(grads) + (None,) * (len(ref_grads) - len(grads))  # no shared expert: no shared leaves
    for name, got, want in zip(Gradients._fields, grads, ref_grads, strict=True):
        if want is None:
            assert got is None, f"{name} {ctx}"
            continue
        err, cos = relative_error(got, want), cosine_similarity(got, want)
        assert err <= max_err and cos >= min_cos, f"{name}: rel_err {err:.3e} cosine {cos:.7f} {ctx}"
    d_w_gate, d_w_up, d_w_down = grads[2:5]
    for name, g in (("d_w_gate", d_w_gate), ("d_w_up", d_w_up), ("d_w_down", d_w_down)):
        assert torch.count_nonzero(g[0]) == 0, f"{name} of the expert with no token is not zero {ctx}"
    assert grads[1].dtype == torch.float32 and grads[0].dtype == torch.bfloat16, ctx


def _run(tmp_path, *args, device="cpu"):
    """The CLI in-process on `device` (the CPU also on a machine with a GPU), its record read back."""
    rc = cli.main([*args, *FAST, "--device", device, "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*.json")
    return rc, json.loads(path.read_text()), path


@pytest.mark.parametrize("args", [["--preset", "tiny"], CUSTOM], ids=["tiny", "custom"])
def test_cli_writes_record_and_plot(tmp_path, args):
    rc, rec, path = _run(tmp_path, *args)
    assert rc == 0
    for key in ("gpu", "num_gpus", "torch", "triton", "date", "command", "results"):
        assert key in rec, key
    assert rec["gpu"] == "cpu" and rec["num_gpus"] == 1 and "--reps 1" in rec["command"]
    assert path.name.startswith("cpu-") and path.with_suffix(".png").exists()
    preset = "tiny" if "--preset" in args else "custom"
    rows = {(r["impl"], r["pass"]): r for r in rec["results"]}
    assert len(rows) == len(rec["results"]) == 4  # default CPU impls: mok, torch-eager; two passes each
    for impl in ("mok", "torch-eager"):
        for pass_ in ("fwd", "fwd+bwd"):
            r = rows[(impl, pass_)]
            assert r["status"] == "ok", r
            assert r["preset"] == preset and r["precision"] == "bf16" and r["ep"] == 1
            assert r["ms"] > 0 and r["tflops"] > 0 and r["max_rel_err"] <= 0.01
            assert "peak_mem_gb" in r
    assert rows[("torch-eager", "fwd")]["speedup_vs_torch_eager"] == pytest.approx(1.0)
    if preset == "custom":
        (shape,) = rec["settings"]["presets"]
        dims = (shape["num_tokens"], shape["hidden_size"], shape["topk"], shape["shared_intermediate_size"])
        assert dims == (37, 64, 2, 0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_low_precision_rows_time_a_weight_update(tmp_path, capsys, device):
    """On CUDA, mok's low-precision rows carry what an update of the routed weights adds to the
    next step (the triton backend's copies, which the timed steps find cached), in the record and
    the printed table, and every mok row what its forward keeps for the backward; bf16 rows have
    no update cost. On the CPU the layer runs the reference backend, which keeps no copies."""
    rc, rec, _ = _run(tmp_path, "--preset", "tiny", "--impl", "mok", "--precision", "bf16,fp8_block", "--pass", "fwd",
                      device=device)
    assert rc == 0
    rows = {r["precision"]: r for r in rec["results"]}
    assert rows["fp8_block"]["status"] == rows["bf16"]["status"] == "ok", rows
    assert "weight_update_ms" not in rows["bf16"]["extra"]
    printed = capsys.readouterr().out
    if device == "cuda":
        assert rows["fp8_block"]["extra"]["weight_update_ms"] > 0
        assert "each in-place update of the routed weights adds" in printed
        assert all(r["extra"]["kept_gb"] > 0 for r in rows.values()), rows
    else:
        assert not any("weight_update_ms" in r["extra"] or "kept_gb" in r["extra"] for r in rows.values()), rows
        assert "each in-place update" not in printed
        assert "On the CPU mok runs its fp32 reference" in printed and "say nothing about" in printed


def test_records_go_to_an_untracked_folder_by_default():
    """`python -m mok.bench` writes to bench-results/ (in .gitignore); the repository's records
    are written on purpose, with --out benchmarks/results."""
    assert cli.build_parser().parse_args([]).out.as_posix() == "bench-results"
    assert cli.build_parser().parse_args(["--out", "benchmarks/results"]).out.as_posix() == "benchmarks/results"


def test_result_line_shows_weight_updates_and_what_is_kept():
    row = runner.Result(preset="tiny", pass_="fwd", impl="mok", precision="fp8_block", status="ok", ms=1.5,
                        ms_p20=1.4, ms_p80=1.6, peak_mem_gb=2.0, max_rel_err=0.05,
                        extra={"weight_update_ms": 0.25, "kept_gb": 0.125})
    line = report.result_line(row)
    assert "peak 2.00 GB, 0.12 GB kept for the backward, +0.25 ms per weight update" in line, line
    assert "kept" not in report.result_line(dataclasses.replace(row, extra={})), row


def test_wrong_impl_is_reported_fail_and_not_timed(tmp_path, monkeypatch):
    calls = []

    def make_broken(inp, precision):
        def forward():
            calls.append(1)
            return torch_moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights) * 1.05  # 5% off: over the bar

        leaves = tuple(t for t in (inp.x, inp.topk_weights, *inp.weights) if t is not None)
        return runner.Impl(forward, leaves, lambda g: tuple(g) + (None,) * (8 - len(g)))

    monkeypatch.setitem(runner.IMPLS, "broken", runner.ImplSpec(make_broken, "bf16"))
    rc, rec, _ = _run(tmp_path, *CUSTOM, "--impl", "torch-eager,broken")
    assert rc == 1
    broken = [r for r in rec["results"] if r["impl"] == "broken"]
    assert [r["pass"] for r in broken] == ["fwd", "fwd+bwd"]
    for r in broken:
        assert r["status"] == "FAIL" and r["ms"] is None and r["tflops"] is None, r
        assert "out rel_err" in r["message"] and r["max_rel_err"] > 0.01
    assert len(calls) == 1  # the check's one run; never timed
    assert all(r["status"] == "ok" for r in rec["results"] if r["impl"] == "torch-eager")


def test_unavailable_impl_is_skipped_not_fatal(tmp_path, monkeypatch):
    def make_missing(inp, precision):
        raise runner.Skip("not installed here")

    monkeypatch.setitem(runner.IMPLS, "missing", runner.ImplSpec(make_missing, "bf16"))
    rc, rec, _ = _run(tmp_path, *CUSTOM, "--impl", "missing,torch-eager", "--pass", "fwd", "--no-plot")
    assert rc == 0
    (missing,) = [r for r in rec["results"] if r["impl"] == "missing"]
    assert missing["status"] == "skipped" and missing["message"] == "not installed here" and missing["ms"] is None
    assert not list(tmp_path.glob("*.png"))


def test_no_write_and_second_run_does_not_overwrite(tmp_path):
    quick = [*CUSTOM, *FAST, "--impl", "torch-eager", "--pass", "fwd", "--out", str(tmp_path)]
    assert cli.main([*quick, "--no-write"]) == 0
    assert not list(tmp_path.iterdir())
    for _ in range(2):
        assert cli.main([*quick, "--tag", "t"]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert len(names) == 2 and any(n.endswith("-t-2.json") for n in names), names


@pytest.mark.parametrize(
    "argv",
    [
        ["--topk", "5", "--experts", "4"],
        ["--hidden", "60"],
        ["--preset", "nope"],
        ["--preset", "custom"],
        ["--impl", "mok,nope"],
        ["--precision", "fp4"],
        ["--reps", "0"],
        ["--rounds", "0"],
        ["--warmup", "-1"],
        ["--pass", "bwd"],
        ["--tokens", "x"],
    ],
)
def test_bad_arguments_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_settings(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_settings_defaults_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU
    settings, _ = cli.parse_settings(["--precision", "bf16,mxfp8", "--preset", "tiny", "--preset", "tiny"])
    assert settings.device == "cpu" and [p.name for p in settings.presets] == ["tiny"]
    assert settings.impls == ("mok", "torch-eager") and settings.passes == ("fwd", "fwd+bwd")
    assert (settings.warmup, settings.reps, settings.rounds) == cli.DEFAULT_REPS["cpu"]
    cases = runner.plan(settings.presets, settings.impls, settings.precisions, settings.passes)
    # Baseline first and in bf16 only; mok once per precision.
    assert [(c.impl, c.precision) for c in cases] == [("torch-eager", "bf16"), ("mok", "bf16"), ("mok", "mxfp8")]


def test_interleaved_rounds_take_turns_and_time_reps_calls(tmp_path, monkeypatch):
    """With rounds, the (impl, pass) pairs of a preset take turns, every other round in
    reverse order, and each gets `reps` timed calls in all."""
    order = []
    real = runner._time_round

    def spy(impl, pass_, d_out, warmup, reps, device):
        order.append((impl.forward, pass_, reps))
        return real(impl, pass_, d_out, warmup, reps, device)

    monkeypatch.setattr(runner, "_time_round", spy)
    rc = cli.main([*CUSTOM, "--impl", "torch-eager", "--reps", "5", "--rounds", "2", "--warmup", "0",
                   "--no-plot", "--out", str(tmp_path)])
    assert rc == 0
    passes = [p for _, p, _ in order]
    assert passes == ["fwd", "fwd+bwd", "fwd+bwd", "fwd"], passes
    assert [r for _, _, r in order] == [3, 3, 2, 2]
    (path,) = tmp_path.glob("*.json")
    rec = json.loads(path.read_text())
    assert [r["reps"] for r in rec["results"]] == [5, 5] and rec["settings"]["rounds"] == 2
    assert [runner._round_reps(3, 5, r) for r in range(3)] == [1, 1, 1]


def test_each_round_has_its_median_and_its_speedup(tmp_path, monkeypatch, capsys):
    """Rows keep each interleaved round's median (ms_rounds) and the baseline's over theirs,
    round by round (speedup_rounds); the log line and the table show their range."""
    calls = {"torch-eager": [[10.0, 12.0, 11.0], [20.0, 22.0]], "mok": [[5.0, 4.0, 6.0], [8.0, 8.0]]}
    rounds_done = {"torch-eager": 0, "mok": 0}
    real = runner._time_round

    def fixed_times(impl, pass_, d_out, warmup, reps, device):
        real(impl, pass_, d_out, warmup, reps, device)  # runs as ever; only its times are replaced
        name = "mok" if "config" in impl.extra else "torch-eager"
        times = calls[name][rounds_done[name]]
        rounds_done[name] += 1
        assert len(times) == reps, (name, reps)
        return list(times), None

    monkeypatch.setattr(runner, "_time_round", fixed_times)
    rc = cli.main([*CUSTOM, "--impl", "torch-eager,mok", "--pass", "fwd", "--reps", "5", "--rounds", "2",
                   "--warmup", "0", "--no-plot", "--out", str(tmp_path)])
    assert rc == 0 and rounds_done == {"torch-eager": 2, "mok": 2}
    (path,) = tmp_path.glob("*.json")
    rows = {r["impl"]: r for r in json.loads(path.read_text())["results"]}
    assert rows["torch-eager"]["ms_rounds"] == [11.0, 21.0] and rows["torch-eager"]["speedup_rounds"] is None
    assert rows["mok"]["ms_rounds"] == [5.0, 8.0]
    assert rows["mok"]["speedup_rounds"] == pytest.approx([11.0 / 5.0, 21.0 / 8.0])
    assert rows["mok"]["speedup_vs_torch_eager"] == pytest.approx(rows["torch-eager"]["ms"] / rows["mok"]["ms"])
    shown = capsys.readouterr()
    assert "rounds 2.20–2.62×" in shown.err and "(2.20–2.62)" in shown.out + shown.err


def test_under_variant_sets_and_restores_plan_fields():
    from mok.kernels.plan import kernel_plan

    before = kernel_plan().persistent_down_wgrad_max_inter
    with runner.under_variant([("persistent_down_wgrad_max_inter", before + 5)]):
        assert kernel_plan().persistent_down_wgrad_max_inter == before + 5
    assert kernel_plan().persistent_down_wgrad_max_inter == before
    with pytest.raises(RuntimeError, match="boom"):
        with runner.under_variant([("persistent_down_wgrad_max_inter", -1)]):
            raise RuntimeError("boom")
    assert kernel_plan().persistent_down_wgrad_max_inter == before


def test_variant_is_timed_in_turns_with_mok_under_its_settings(tmp_path, monkeypatch):
    """--variant adds mok-variant: mok's calls see the plan's value, mok-variant's the
    variant's, and the value is restored after the run."""
    import mok
    from mok.kernels.plan import kernel_plan

    original = kernel_plan().persistent_down_wgrad_max_inter
    seen = []
    real_moe = mok.moe

    def spy(*args, **kwargs):
        seen.append(kernel_plan().persistent_down_wgrad_max_inter)
        return real_moe(*args, **kwargs)

    monkeypatch.setattr(mok, "moe", spy)
    rc = cli.main([*CUSTOM, "--impl", "mok", "--variant", "persistent_down_wgrad_max_inter=7",
                   "--reps", "2", "--rounds", "2", "--warmup", "0", "--no-plot", "--out", str(tmp_path)])
    assert rc == 0 and kernel_plan().persistent_down_wgrad_max_inter == original
    assert set(seen) == {original, 7}, seen
    (path,) = tmp_path.glob("*.json")
    rec = json.loads(path.read_text())
    rows = {(r["impl"], r["pass"]): r for r in rec["results"]}
    assert set(rows) == {(i, p) for i in ("mok", "mok-variant") for p in ("fwd", "fwd+bwd")}
    assert all(r["status"] == "ok" for r in rows.values())
    assert rows[("mok-variant", "fwd")]["extra"]["variant"] == ["persistent_down_wgrad_max_inter=7"]
    assert rec["settings"]["variant"] == ["persistent_down_wgrad_max_inter=7"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--variant", "persistent_down_wgrad_max_inter"], "expected FIELD=VALUE"),
        (["--variant", "mok.kernels.gemm.wgrad.PERSISTENT_DOWN_WGRAD_MAX_INTER=0"], "expected FIELD=VALUE"),
        (["--variant", "nope=1"], "KernelPlan has no field 'nope'"),
        (["--variant", "persistent_down_wgrad_max_inter=big"], "expected a Python literal"),
        (["--impl", "mok-variant"], "give its settings with --variant"),
    ],
)
def test_bad_variants_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_settings(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, world_size, message",
    [
        (["--overlap", "4,0,8"], 1, "--overlap: expert parallelism only"),
        (["--overlap", "4,8"], 2, "expected C,C_X,C_Y, three ints >= 0, got '4,8'"),
        (["--overlap", "4,0,-1"], 2, "expected C,C_X,C_Y, three ints >= 0"),
        (["--impl", "mok,mok-overlap"], 2, "give its SMs with --overlap C,C_X,C_Y"),
    ],
)
def test_bad_overlaps_are_argparse_errors(argv, world_size, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_settings(["--device", "cpu", *argv], world_size=world_size)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_overlap_adds_mok_overlap_with_its_sms():
    """--overlap C,C_X,C_Y under expert parallelism: mok-overlap joins the default implementations,
    its cases carry (C, C_X, C_Y); without it the default leaves mok-overlap out."""
    settings, _ = cli.parse_settings(["--device", "cpu", "--preset", "tiny", "--overlap", "7,0,13"], world_size=2)
    assert settings.overlap == (7, 0, 13) and settings.impls[-1] == "mok-overlap", settings.impls
    cases = runner.plan(settings.presets, settings.impls, settings.precisions, settings.passes, expert_parallel=True,
                        overlap=settings.overlap)
    expected = {"torch-ep-nccl": (), "mok": (), "mok-nccl": (), "mok-overlap": (7, 0, 13)}
    assert {c.impl: c.overlap for c in cases} == expected
    plain, _ = cli.parse_settings(["--device", "cpu", "--preset", "tiny"], world_size=2)
    assert "mok-overlap" not in plain.impls and plain.overlap == ()


def test_timing_helpers_on_cpu():
    stats = time_ms(lambda: sum(range(1000)), warmup=1, reps=5, device="cpu")
    assert set(stats) >= {"median", "min", "p20", "p80"} and 0 <= stats["min"] <= stats["median"] <= stats["max"]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 20) == 5.0
    calls = []
    per_call = back_to_back_ms(lambda: calls.append(sum(range(1000))), reps=7, device="cpu")
    assert len(calls) == 7 and per_call > 0
    with pytest.raises(ValueError, match="reps"):
        back_to_back_ms(lambda: None, reps=0, device="cpu")
    with PeakMemory("cpu") as mem:
        pass
    assert mem.peak_gb is None and mem.delta_gb is None
    with pytest.raises(ValueError, match="warmup"):  # checked before any CUDA call
        capture_cuda_graph(lambda: None, warmup=-1)


def _sin_of_double(x: torch.Tensor) -> runner.Impl:
    """An Impl whose forward keeps one tensor for its backward: sin's input, 2·x (x's size)."""
    return runner.Impl(lambda: (x * 2).sin(), (x,), lambda grads: grads)


def test_kept_for_backward_is_cuda_only():
    assert runner._kept_extra(_sin_of_double(torch.randn(8, 8, requires_grad=True)), "cpu", None) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kept_for_backward_is_what_autograd_saves():
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)  # 4 MiB, a whole allocator block
    kept = runner._kept_extra(_sin_of_double(x), "cuda", None)["kept_gb"]
    assert kept == x.numel() * 4 / 1e9, kept
    with torch.no_grad():
        assert runner._kept_extra(_sin_of_double(x), "cuda", None)["kept_gb"] == 0


def test_gpu_slug():
    assert report.gpu_slug("NVIDIA H200") == "h200"
    assert report.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert report.gpu_slug("cpu") == "cpu"


def _fake_general_routing(x, router_scores, token_indices, expert_indices, w1, b1, w2, b2, E, stream_id,
                          activation_type, is_inference_mode_enabled=False, concat_layout=False):
    """SonicMoE's documented contract in plain torch: w1 (2I, H, E) with interleaved gate/up
    rows and stride order (2, 0, 1), w2 (H, I, E), routes in ascending token order."""
    assert w1.stride(2) == max(w1.stride()) and w2.stride(2) == max(w2.stride()), "stride order (2, 0, 1)"
    assert token_indices.dtype == expert_indices.dtype == torch.int32 and router_scores.dtype == torch.float32
    assert bool((token_indices[1:] >= token_indices[:-1]).all()), "token_indices sorted ascending"
    assert activation_type == "swiglu" and b1 is None and b2 is None and w2.shape[-1] == E
    w1_e = w1.permute(2, 0, 1)[expert_indices.long()]  # [M, 2I, H]
    w2_e = w2.permute(2, 0, 1)[expert_indices.long()]  # [M, H, I]
    z = (w1_e @ x[token_indices.long()][:, :, None]).squeeze(-1)  # [M, 2I]
    a = F.silu(z[:, 0::2]) * z[:, 1::2]  # [M, I]
    y = (w2_e @ a[:, :, None]).squeeze(-1)  # [M, H]
    out = torch.zeros(x.shape, dtype=torch.float32)
    out = out.index_add(0, token_indices.long(), router_scores[:, None] * y.float())
    return out.bfloat16(), None


def _install_fake_sonicmoe(monkeypatch, fn):
    module = types.ModuleType("sonicmoe")
    module.__version__ = "fake"
    module.moe_general_routing_inputs = fn
    enums = types.ModuleType("sonicmoe.enums")
    enums.ActivationType = types.SimpleNamespace(SWIGLU="swiglu")
    monkeypatch.setitem(sys.modules, "sonicmoe", module)
    monkeypatch.setitem(sys.modules, "sonicmoe.enums", enums)


def test_sonicmoe_wrapper_maps_weights_and_gradients(tmp_path, monkeypatch):
    # A fake that follows SonicMoE's documented layout checks our interleaving, views and
    # gradient mapping on CPU (the real package needs a Hopper GPU).
    _install_fake_sonicmoe(monkeypatch, _fake_general_routing)
    rc, rec, _ = _run(tmp_path, *CUSTOM, "--shared-intermediate", "16", "--impl", "torch-eager,sonicmoe")
    assert rc == 0
    rows = [r for r in rec["results"] if r["impl"] == "sonicmoe"]
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    assert rows[1]["max_rel_err"] <= 0.01 and rows[1]["min_cosine"] >= 0.9999
    assert rows[0]["extra"]["sonicmoe_version"] == "fake" and rows[0]["message"] == "shared expert in torch"


def test_sonicmoe_api_mismatch_or_absence_is_a_skip(tmp_path, monkeypatch):
    _install_fake_sonicmoe(monkeypatch, lambda x, router_logits, w1, w2: None)  # some other API
    rc, rec, _ = _run(tmp_path, *CUSTOM, "--impl", "torch-eager,sonicmoe", "--pass", "fwd")
    (row,) = [r for r in rec["results"] if r["impl"] == "sonicmoe"]
    assert rc == 0 and row["status"] == "skipped" and "does not take" in row["message"], row
    monkeypatch.setitem(sys.modules, "sonicmoe", None)  # import fails, as on a machine without it
    rc, rec, _ = _run(tmp_path / "2", *CUSTOM, "--impl", "sonicmoe", "--pass", "fwd")
    (row,) = rec["results"]
    assert rc == 0 and row["status"] == "skipped" and "Error" in row["message"], row


def test_log_lines_on_a_non_terminal_stderr(tmp_path, capsys):
    """With stderr captured (not a terminal), each step and each result is a line there as its
    preset finishes, so a run cut short still shows what it measured."""
    assert cli.main([*CUSTOM, *FAST, "--impl", "torch-eager,mok", "--pass", "fwd", "--no-write"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert any(line.endswith("custom: inputs + fp32 reference") for line in lines), lines
    results = [line for line in lines if " ms (" in line]
    assert len(results) == 2, lines
    assert any("custom fwd torch-eager: " in line and "(1.00×)" in line and line.endswith(", ok") for line in results)
    assert any("custom fwd mok: " in line and line.endswith(", ok") for line in results), results
