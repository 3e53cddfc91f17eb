"""The combine (`kernels/routing/combine.py`) on the qwen3-30b and deepseek-v3-slice shapes: its tile
(tokens × hidden columns per program) and warps, over y in route slots and over y in the
schedule's sorted layout gathered by route_row (the fp8_block layer's, the plan's `fp8_block_sorted_outputs`).
Every config is timed in both orders; each output is checked bitwise against the first.
GB/s counts y's rows read once and out written once.

    python benchmarks/sweeps/combine.py
"""

import torch

from mok.bench.presets import PRESETS
from mok.kernels.routing import combine as combine_kernels
from mok.kernels.gemm.common import routing_block_m
from mok.kernels.plan import override
from mok.kernels.routing.schedule import build_routing_schedule
from mok.testing import make_inputs
from mok.testing.timing import time_ms

# (the plan's combine_block_t, combine_block_h, combine_num_warps)
CONFIGS = [(16, 512, 4), (8, 512, 4), (16, 256, 4), (8, 1024, 4), (16, 1024, 8), (32, 256, 4), (4, 2048, 8)]
SHAPES = ("qwen3-30b", "deepseek-v3-slice")


def main() -> None:
    for name in SHAPES:
        p = PRESETS[name]
        inp = make_inputs(p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk, seed=0,
                          device="cuda")
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        sched = build_routing_schedule(inp.topk_ids, p.num_experts, routing_block_m(), flag)
        num_slots = inp.topk_ids.numel()
        route_row = sched.route_row
        y_slots = torch.randn(num_slots, p.hidden_size, device="cuda").bfloat16()
        y_sorted = torch.randn(sched.capacity_rows, p.hidden_size, device="cuda").bfloat16()
        y_sorted[route_row.long()] = y_slots
        calls = {"slots": lambda: combine_kernels.combine(y_slots, inp.topk_weights),
                 "sorted": lambda: combine_kernels.combine(y_sorted, inp.topk_weights, None, route_row)}
        gbytes = (num_slots + p.num_tokens) * p.hidden_size * 2 / 1e9
        first = None
        for block_t, block_h, warps in CONFIGS + CONFIGS[::-1]:
            with override(combine_block_t=block_t, combine_block_h=block_h, combine_num_warps=warps):
                for layout, call in calls.items():
                    out = call()
                    first = out if first is None else first
                    ms = time_ms(call, warmup=3, reps=30)["median"]
                    print(f"{name:18s} {layout:6s} BLOCK_T={block_t:2d} BLOCK_H={block_h:4d} warps={warps}  "
                          f"{ms:.3f} ms {gbytes * 1e3 / ms:5.0f} GB/s same={torch.equal(out, first)}", flush=True)


if __name__ == "__main__":
    main()
