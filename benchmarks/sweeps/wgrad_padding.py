"""The bf16 weight-gradient GEMMs with their K loops over each expert's routes (rounded up to
BLOCK_K, the default) against the whole padded row range, on each preset's default tiles.

The schedule pads every expert to the 128-row M tile, on average ~64 rows of zeros; a wgrad
reduces over the rows, so stepping over the padding multiplies zeros. The old behaviour is the
same kernel given a schedule whose expert_counts are the padded counts. Both take turns
`--rounds` times (the GPU's clock falls under sustained load) and must give the same bits.

    python benchmarks/sweeps/wgrad_padding.py [--preset P ...] [--rounds N]
"""

import argparse
import dataclasses

import torch

from mok.bench.presets import PRESETS
from mok.kernels.routing.gather import gather_sorted_rows
from mok.kernels.gemm.common import routing_block_m
from mok.kernels.routing.schedule import build_routing_schedule
from mok.kernels.gemm.wgrad import down_wgrad, gate_up_wgrad
from mok.testing import make_inputs
from mok.testing.timing import time_ms


def _outputs(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", help="default: qwen3-30b, deepseek-v3-slice, mixtral-8x7b")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for name in args.preset or ("qwen3-30b", "deepseek-v3-slice", "mixtral-8x7b"):
        p = PRESETS[name]
        inp = make_inputs(p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk, seed=0,
                          device="cuda")
        sched = build_routing_schedule(inp.topk_ids, p.num_experts, routing_block_m(),
                                       torch.zeros(1, dtype=torch.int32, device="cuda"))
        padded = dataclasses.replace(sched, expert_counts=sched.expert_offsets.diff())
        x_sorted, _, dy_sorted = gather_sorted_rows(inp.x, torch.randn_like(inp.x), inp.topk_weights, sched, p.topk)
        h = torch.randn(sched.capacity_rows, p.intermediate_size, device="cuda").bfloat16()
        d_gate_up = torch.randn(sched.capacity_rows, 2, p.intermediate_size, device="cuda").bfloat16()
        for rows in (h, d_gate_up):  # zeros at padding, as the layer's own operands
            rows[sched.row_source < 0] = 0
        calls = {
            "down wgrad": lambda s: down_wgrad(dy_sorted, h, s),
            "gate/up wgrad": lambda s: gate_up_wgrad(d_gate_up, x_sorted, s),
        }
        for what, fn in calls.items():
            same = all(torch.equal(a, b) for a, b in zip(_outputs(fn(sched)), _outputs(fn(padded))))
            times = {"routes": [], "padded": []}
            for _ in range(args.rounds):
                for label, s in (("routes", sched), ("padded", padded)):
                    times[label].append(time_ms(lambda: fn(s), warmup=3, reps=20)["median"])
            print(f"{name:18s} {what:14s} routes {min(times['routes']):.3f}–{max(times['routes']):.3f} ms  "
                  f"padded {min(times['padded']):.3f}–{max(times['padded']):.3f} ms  same={same}", flush=True)


if __name__ == "__main__":
    main()
