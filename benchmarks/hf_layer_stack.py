"""A transformers Qwen3-MoE stack, forward + backward, with experts_implementation "mok"
against transformers' "grouped_mm", side by side in one process.

    python benchmarks/hf_layer_stack.py --out benchmarks/results       # H100/H200, < 4 min
    python benchmarks/hf_layer_stack.py --device cpu --tokens 64 --hidden 64 --moe-intermediate 32 \
        --experts 8 --topk 2 --rounds 2 --reps 2                         # a smoke run on the CPU

The stack: `--layers` transformers `Qwen3MoeSparseMoeBlock`s (router + routed experts) with
residual connections, at qwen3-30b's sizes by default (hidden 2048, moe_intermediate 768,
128 experts, top-8, 16384 tokens, bf16), random weights, the config built in code (no
download). Both implementations run on the very same modules (only
`config._experts_implementation` changes), so they share weights and routing.

Before timing: one forward + backward of the first block under "eager", "grouped_mm" and
"mok" (output, d_x and every parameter's gradient); mok must stay within bf16 tolerance of
"eager" and no further from it than twice what "grouped_mm" is, or the run stops.
Timing: CUDA events around each forward + backward (`mok.testing.times_ms`), warm-up first,
then `--rounds` interleaved rounds of `--reps` steps per implementation; the median over
all steps. FLOPs count the routed experts' useful work: 3 × 2·3·T·topk·H·I per block.

Writes `<out>/<gpu>-<yyyymmdd>-hf-layer-stack.json`: gpu, versions, date, command, shapes,
per-implementation ms / TFLOPS / relative error, and mok's speedup over grouped_mm.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch
import transformers
import triton
from torch import nn
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import mok.integrations.transformers as mok_hf
from mok.testing import relative_error
from mok.testing.timing import times_ms

IMPLS = ("mok", "grouped_mm")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON record")
    return parser.parse_args(argv)


class Stack(nn.Module):
    """`layers` MoE blocks with residuals: x ← x + block(x)."""

    def __init__(self, config: Qwen3MoeConfig, layers: int):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(Qwen3MoeSparseMoeBlock(config) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def build(args) -> tuple[Stack, torch.Tensor, torch.Tensor]:
    config = Qwen3MoeConfig(
        hidden_size=args.hidden, moe_intermediate_size=args.moe_intermediate, num_experts=args.experts,
        num_experts_per_tok=args.topk, norm_topk_prob=True,
    )
    torch.manual_seed(args.seed)
    stack = Stack(config, args.layers).to(device=args.device, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in stack.named_parameters():
            param.normal_(0, param.shape[-1] ** -0.5)  # fan-in scale: O(1) activations
    x = torch.randn(1, args.tokens, args.hidden, device=args.device, dtype=torch.bfloat16)
    d_out = torch.randn_like(x)
    return stack, x, d_out


def set_impl(stack: Stack, impl: str) -> None:
    stack.config._experts_implementation = impl  # every block's experts read this config


def step(module: nn.Module, x: torch.Tensor, d_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward + backward; returns out, d_x and every parameter's gradient."""
    x = x.detach().requires_grad_()
    out = module(x)
    out.backward(d_out)
    return {"out": out.detach(), "d_x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


def check(stack: Stack, x: torch.Tensor, d_out: torch.Tensor) -> dict[str, float]:
    """The first block under each implementation against "eager"; the worst relative error each."""
    block = stack.blocks[0]
    results = {}
    for impl in ("eager", *IMPLS):
        set_impl(stack, impl)
        block.zero_grad(set_to_none=True)
        results[impl] = {k: v.float() for k, v in step(block, x, d_out).items()}
    block.zero_grad(set_to_none=True)
    worst = {impl: max(relative_error(results[impl][k], results["eager"][k]) for k in results["eager"]) for impl in IMPLS}
    for key in results["eager"]:
        err = relative_error(results["mok"][key], results["eager"][key])
        gmm = relative_error(results["grouped_mm"][key], results["eager"][key])
        if err > max(2 * gmm, 0.02):
            raise SystemExit(f"mok's {key} is {err:.4g} from eager (grouped_mm: {gmm:.4g}); not timing")
    return worst


def time_impls(stack: Stack, x: torch.Tensor, d_out: torch.Tensor, args) -> dict[str, list[float]]:
    """Per-step ms of each implementation, rounds interleaved so drift hits both alike."""
    times = {impl: [] for impl in IMPLS}

    def zero_grads():
        stack.zero_grad(set_to_none=True)

    for round_index in range(args.rounds):
        for impl in IMPLS:
            set_impl(stack, impl)
            warmup = args.warmup if round_index == 0 else 1
            times[impl] += times_ms(lambda: step(stack, x, d_out), warmup=warmup, reps=args.reps,
                                    device=args.device, setup=zero_grads)
    return times


def record(args, argv, worst: dict, times: dict[str, list[float]]) -> dict:
    flop = args.layers * 3 * 2 * 3 * args.tokens * args.topk * args.hidden * args.moe_intermediate
    ms = {impl: statistics.median(t) for impl, t in times.items()}
    cuda = torch.device(args.device).type == "cuda"
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    return {
        "gpu": gpu,
        "num_gpus": 1 if cuda else 0,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/hf_layer_stack.py", *(sys.argv[1:] if argv is None else argv)]),
        "shape": {"layers": args.layers, "T": args.tokens, "H": args.hidden, "I": args.moe_intermediate,
                  "E": args.experts, "topk": args.topk},
        "results": [
            {"preset": "hf-qwen3-moe-stack", "pass": "fwd+bwd", "impl": f"hf-{impl}", "precision": "bf16", "ep": 1,
             "ms": round(ms[impl], 4), "tflops": round(flop / ms[impl] / 1e9, 1), "max_rel_err_vs_eager": worst[impl],
             "steps": len(times[impl])}
            for impl in IMPLS
        ],
        "speedup_mok_over_grouped_mm": round(ms["grouped_mm"] / ms["mok"], 3),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    stack, x, d_out = build(args)
    mok_hf.check_model(stack)
    worst = check(stack, x, d_out)
    result = record(args, argv, worst, time_impls(stack, x, d_out, args))
    for row in result["results"]:
        print(f"{row['impl']:>14}: {row['ms']:8.3f} ms  {row['tflops']:6.1f} TFLOPS  "
              f"max rel err vs eager {row['max_rel_err_vs_eager']:.4f}")
    print(f"mok / grouped_mm speedup: {result['speedup_mok_over_grouped_mm']:.3f}x on {result['gpu']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = result["gpu"].lower().replace("nvidia ", "").split()[0]
        path = args.out / f"{name}-{result['date'].replace('-', '')}-hf-layer-stack.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
