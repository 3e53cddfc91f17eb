"""Host (Python) time to enqueue one mok forward+backward, against the GPU's time for it: is
the layer's time the GPU's, or does the GPU wait for launches? The host time is taken while
a long sleep kernel keeps the GPU busy ahead of the steps, so no step waits on the GPU.

    python benchmarks/host_overhead.py --preset qwen3-30b [--precision fp8_block] [--steps 20] [--cprofile]

`--cprofile` also lists the host's hot spots over ten steps (by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import mok
from mok.bench.presets import GPU_PRESETS
from mok.testing.timing import back_to_back_ms, percentile
from profile_layer import layer_step  # benchmarks/, the script's own folder

_SLEEP_CYCLES = int(2e9)  # about a second of GPU time at H200's clocks: longer than the enqueued steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="qwen3-30b", choices=list(GPU_PRESETS))
    parser.add_argument("--precision", default="bf16", choices=mok.config.PRECISIONS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cprofile", action="store_true", help="list the host's hot spots over ten steps")
    args = parser.parse_args()
    step = layer_step(args.preset, args.precision, backward=True)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    gpu_ms = back_to_back_ms(step, reps=args.steps)
    torch.cuda.synchronize()
    torch.cuda._sleep(_SLEEP_CYCLES)
    host_ms = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        host_ms.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    host_ms.sort()
    print(f"{args.preset} {args.precision} fwd+bwd: GPU {gpu_ms:.3f} ms per step back to back; host enqueue "
          f"median {percentile(host_ms, 50):.3f} ms (min {host_ms[0]:.3f}, max {host_ms[-1]:.3f})")
    if args.cprofile:
        torch.cuda._sleep(_SLEEP_CYCLES)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(10):
            step()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
