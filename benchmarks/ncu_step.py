"""One mok layer step (forward and backward) between the CUDA profiler's start and stop, so that
Nsight Compute reads the hardware counters of that step's kernels alone (warm-up steps first:
compiles and caches stay out of the profile).

    ncu --clock-control none --profile-from-start off [--section ...] [-k regex:NAME]
        python benchmarks/ncu_step.py [--preset qwen3-30b] [--precision fp8_block]

`--clock-control none` leaves the GPU's clocks as they are (ncu locks them to base otherwise).
"""

from __future__ import annotations

import argparse

import torch

import mok
from mok.bench.presets import GPU_PRESETS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b", choices=list(GPU_PRESETS))
    parser.add_argument("--precision", default="fp8_block", choices=mok.config.PRECISIONS)
    parser.add_argument("--warmup", type=int, default=3, help="steps before the profiled one")
    args = parser.parse_args()
    from profile_layer import layer_step  # beside this script

    step = layer_step(args.preset, args.precision, backward=True)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
