"""Times the grouped-GEMM kernels over candidate tile configs on the GPU presets.

    python benchmarks/tune_gemm.py [--preset qwen3-30b ...] [--out FILE.json]

Each config runs on the preset's real shape with random routing; TFLOPS count only the
routed rows (T·topk), so padding and masked tiles show up as lost throughput.
"""

from __future__ import annotations

import argparse
import json

import torch

from mok.bench.presets import GPU_PRESETS, PRESETS
from mok.kernels.grouped_gemm import down_scatter, gate_up_swiglu
from mok.kernels.schedule import build_routing_schedule
from mok.testing import make_inputs
from mok.testing.timing import time_ms

GATE_UP = [
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=16, num_warps=8, num_stages=4),
]
DOWN = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", action="append", choices=list(GPU_PRESETS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for name in args.preset or GPU_PRESETS:
        p = PRESETS[name]
        T, H, I, E, topk = p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk
        inp = make_inputs(T, H, I, E, topk, seed=0, device="cuda")
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        routes = T * topk
        for kind, configs, flops in (("gate_up", GATE_UP, 4.0 * routes * H * I), ("down", DOWN, 2.0 * routes * H * I)):
            for cfg in configs:
                sched = build_routing_schedule(inp.topk_ids, E, cfg["BLOCK_M"], flag)
                if kind == "gate_up":
                    fn = lambda: gate_up_swiglu(inp.x, inp.w_gate, inp.w_up, sched, topk, tile_config=cfg)  # noqa: E731
                else:
                    h = torch.randn(sched.capacity_rows, I, device="cuda").bfloat16()
                    fn = lambda: down_scatter(h, inp.w_down, sched, routes, tile_config=cfg)  # noqa: E731
                try:
                    ms = time_ms(fn, warmup=5, reps=20)["median"]
                except Exception as err:  # a config that does not fit (shared memory) is skipped, not fatal
                    print(f"{name:18s} {kind:8s} {cfg} failed: {type(err).__name__}: {str(err)[:120]}")
                    continue
                tflops = flops / ms / 1e9
                results.append(dict(preset=name, kernel=kind, config=cfg, ms=ms, tflops=tflops))
                print(f"{name:18s} {kind:8s} {ms:8.3f} ms {tflops:7.1f} TF  {cfg}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
