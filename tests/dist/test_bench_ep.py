"""`python -m mok.bench` under expert parallelism, on 2 gloo processes (what torchrun runs
on every rank), the reference backend on the CPU: every implementation passes the check
against the EP reference, the record says ep = 2, and the time reported is the median
of the per-iteration maximum over ranks.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from mok.bench import __main__ as cli
from mok.bench import runner
from mok.bench.baselines import torch_ep_moe
from mok.reference import Gradients, ep_moe_backward, ep_moe_forward
from mok.testing import TOLERANCES, cosine_similarity, make_inputs, make_topk_ids, relative_error
from mok.testing.distributed import run_distributed

P = 2
FAST = ["--preset", "tiny", "--reps", "2", "--warmup", "1", "--device", "cpu"]
SLOW_RANK_MS = 30.0  # extra time of rank 1's torch-ep-nccl forward


def _slow_on_rank(rank: int, make):
    """An EP impl factory whose forward sleeps SLOW_RANK_MS longer on `rank`, after the
    layer's collectives: that rank's own times include the sleep, whatever the other waits."""

    def make_slow(inp, precision, group):
        impl = make(inp, precision, group)

        def forward():
            out = impl.forward()
            if torch.distributed.get_rank(group) == rank:
                time.sleep(SLOW_RANK_MS / 1e3)
            return out

        return runner.Impl(forward, impl.grad_inputs, impl.to_gradients, extra=impl.extra)

    return make_slow


def _rank(rank: int, world_size: int, out_dir: str) -> tuple[int, dict]:
    """One spawn for the whole file (starting ranks costs seconds): the bench's exit code
    with rank 1 slowed down, and the baseline's (got, want) pairs."""
    spec = runner.EP_IMPLS["torch-ep-nccl"]
    runner.EP_IMPLS["torch-ep-nccl"] = runner.ImplSpec(_slow_on_rank(1, spec.make), spec.precision)
    return cli.main([*FAST, "--overlap", "4,2,8", "--out", out_dir]), _baseline_pairs(rank, world_size)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """(output folder, [(exit code, baseline pairs) per rank])."""
    out_dir = tmp_path_factory.mktemp("bench_ep")
    return out_dir, run_distributed(_rank, P, str(out_dir), timeout_s=120.0)


def test_bench_under_expert_parallelism(ranks):
    out_dir, results = ranks
    codes = [code for code, _ in results]
    assert codes == [0, 0], codes
    (path,) = out_dir.glob("*.json")  # the first rank alone writes
    assert path.name.startswith("cpu-") and path.stem.endswith("tiny_ep2") and path.with_suffix(".png").exists()
    rec = json.loads(path.read_text())
    assert rec["num_gpus"] == P and rec["command"].startswith(f"torchrun --nproc-per-node {P} -m mok.bench")
    assert rec["settings"]["expert_parallel"]["ranks"] == P
    rows = {(r["impl"], r["pass"]): r for r in rec["results"]}
    impls = ("torch-ep-nccl", "mok", "mok-nccl", "mok-overlap")
    assert set(rows) == {(i, p) for i in impls for p in ("fwd", "fwd+bwd")}, list(rows)
    assert rec["settings"]["overlap"] == [4, 2, 8]
    config = rows[("mok-overlap", "fwd")]["extra"]["config"]
    assert (config["overlap_comm_sms"], config["overlap_dispatch_sms"], config["overlap_return_sms"]) == (4, 2, 8), config
    assert rows[("mok", "fwd")]["extra"]["config"]["overlap_comm_sms"] == 0
    max_err, min_cos = TOLERANCES["bf16"]
    for (impl, pass_), r in rows.items():
        ctx = f"{impl=} {pass_=} {P=}"
        assert r["status"] == "ok" and r["ep"] == P and r["preset"] == "tiny", (ctx, r)
        assert 0 < r["max_rel_err"] <= max_err, ctx
        assert pass_ == "fwd" or r["min_cosine"] >= min_cos, ctx
        if pass_ == "fwd+bwd":  # every gradient was checked, on every rank
            assert {"d_x", "d_topk_weights", "d_w_gate", "d_ws_down"} <= set(r["errors"]), ctx
        # The reported median is of per-iteration maxima, so at least every rank's own median.
        per_rank = r["extra"]["ms_per_rank"]
        assert len(per_rank) == P and r["ms"] >= max(per_rank) > 0, (ctx, r["ms"], per_rank)
        assert r["tflops"] == pytest.approx(2 * 3 * 256 * 256 * (2 * 128 + 128) * (1 if pass_ == "fwd" else 3)
                                            / (r["ms"] * 1e-3) / 1e12), ctx
    for pass_ in ("fwd", "fwd+bwd"):
        slow = rows[("torch-ep-nccl", pass_)]
        assert slow["ms"] >= SLOW_RANK_MS and slow["extra"]["ms_per_rank"][1] >= SLOW_RANK_MS, slow
        mok_row = rows[("mok", pass_)]
        assert mok_row["speedup_vs_torch_ep_nccl"] == pytest.approx(slow["ms"] / mok_row["ms"]), mok_row


def test_slowest_rank_per_iteration():
    # Rank medians 2 and 3; the per-iteration maxima 3, 5, 4 have median 4.
    assert runner.slowest_rank_ms([[1.0, 5.0, 2.0], [3.0, 1.0, 4.0]]) == [3.0, 5.0, 4.0]
    with pytest.raises(ValueError):  # ranks that timed different numbers of iterations
        runner.slowest_rank_ms([[1.0, 2.0], [1.0]])


def _baseline_pairs(rank: int, world_size: int) -> dict:
    """Per topk, (got, want) pairs of torch_ep_moe on this rank's inputs (global expert 1
    gets no route; ranks bring different token counts) against the EP reference."""
    T, H, I, E, I_s = 13 + 4 * rank, 64, 32, 6, 16  # noqa: E741 (the layer's dimension names)
    allowed = torch.tensor([e for e in range(E) if e != 1])
    local = slice(rank * E // world_size, (rank + 1) * E // world_size)
    pairs = {}
    for topk in (1, 2):
        ids = allowed[make_topk_ids(T, E - 1, topk, torch.Generator().manual_seed(rank))]
        inp = make_inputs(T, H, I, E, topk, I_s, seed=10 + rank, topk_ids=ids, signed_weights=True)
        weights = [inp.w_gate[local], inp.w_up[local], inp.w_down[local], inp.ws_gate, inp.ws_up, inp.ws_down]
        leaves = [t.detach().clone().requires_grad_() for t in (inp.x, inp.topk_weights, *weights)]
        d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(20 + rank)).bfloat16()
        out = torch_ep_moe(leaves[0], inp.topk_ids, *leaves[1:], grouped=False)
        grads = torch.autograd.grad(out, leaves, d_out)
        args = (inp.x, inp.topk_ids, inp.topk_weights, *weights)
        pairs[topk] = {"out": (out, ep_moe_forward(*args))}
        pairs[topk].update(zip(Gradients._fields, zip(grads, ep_moe_backward(d_out, *args), strict=True), strict=True))
    return pairs


def test_torch_ep_baseline_matches_reference(ranks):
    max_err, min_cos = TOLERANCES["bf16"]
    for rank, (_, by_topk) in enumerate(ranks[1]):
        for topk, pairs in by_topk.items():
            for name, (got, want) in pairs.items():
                err, cos = relative_error(got, want), cosine_similarity(got, want)
                assert err <= max_err and cos >= min_cos, (
                    f"{name}: rel_err {err:.3e} cosine {cos:.7f} {rank=} {topk=} {P=}")
            if rank == 0:  # global expert 1 is rank 0's local expert 1
                d_w_gate, _ = pairs["d_w_gate"]
                assert torch.count_nonzero(d_w_gate[1]) == 0, f"{topk=}: an expert with no route has a gradient"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--experts", "5", "--topk", "2"], "--experts: expected a number of experts divisible by the 2"),
        (["--preset", "tiny", "--impl", "torch-eager"], "--impl: expected names from torch-ep-nccl, mok"),
    ],
)
def test_bad_expert_parallel_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_settings(argv, world_size=P)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_expert_parallel_settings_default_to_every_ep_impl():
    settings, _ = cli.parse_settings(["--preset", "tiny"], world_size=P)
    assert settings.ep == P and settings.impls == ("torch-ep-nccl", "mok", "mok-nccl")
    cases = runner.plan(settings.presets, settings.impls, settings.precisions, settings.passes, expert_parallel=True)
    assert [c.impl for c in cases] == ["torch-ep-nccl", "mok", "mok-nccl"]  # the baseline first
