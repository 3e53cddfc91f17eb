"""Host (Python) time to enqueue one mok forward+backward, against the GPU's time for it: is
the layer's time the GPU's, or does the GPU wait for launches? The host time is taken while
a long sleep kernel keeps the GPU busy ahead of the steps, so no step waits on the GPU. The
host time is also split into the part inside Triton's launcher (`JITFunction.run`, Gluon's
kernels included: argument binding, specialization, the driver call) and the rest (mok's code,
autograd, PyTorch's own launches).

    python benchmarks/host_overhead.py --preset qwen3-30b [--precision fp8_block] [--steps 20] [--cprofile [FILE]]

The GPU's time per step is taken twice: back to back as the benchmark runs the steps, and with
all the steps queued behind the sleep kernel (the GPU never waits for the host). A gap between
the two is GPU time lost to the host. `--cprofile` also lists the host's hot spots over ten
steps (by own time) and saves the statistics to FILE when given.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from triton.runtime.jit import JITFunction

import mok
from mok.bench.presets import GPU_PRESETS
from mok.testing.timing import back_to_back_ms, percentile
from profile_layer import layer_step  # benchmarks/, the script's own folder

_SLEEP_CYCLES = int(2e9)  # about a second of GPU time at H200's clocks: longer than the enqueued steps


class LaunchClock:
    """Within the block: how many Triton kernels were launched and the host seconds spent inside
    their launcher (`JITFunction.run`, which Gluon's kernels inherit)."""

    def __init__(self):
        self.launches, self.seconds = 0, 0.0
        self.by_kernel: dict[str, list] = {}  # kernel name -> [launches, seconds]

    def __enter__(self) -> LaunchClock:
        self._run = run = JITFunction.run
        clock = self

        def timed_run(fn, *args, **kwargs):
            start = time.perf_counter()
            try:
                return run(fn, *args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                clock.seconds += seconds
                clock.launches += 1
                tally = clock.by_kernel.setdefault(fn.fn.__name__, [0, 0.0])
                tally[0] += 1
                tally[1] += seconds

        JITFunction.run = timed_run
        return self

    def __exit__(self, *exc) -> None:
        JITFunction.run = self._run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="qwen3-30b", choices=list(GPU_PRESETS))
    parser.add_argument("--precision", default="bf16", choices=mok.config.PRECISIONS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cprofile", nargs="?", const="", metavar="FILE",
                        help="list the host's hot spots over ten steps (and save the statistics to FILE)")
    args = parser.parse_args()
    step = layer_step(args.preset, args.precision, backward=True)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    gpu_ms = back_to_back_ms(step, reps=args.steps)
    torch.cuda.synchronize()
    torch.cuda._sleep(_SLEEP_CYCLES)
    queued_start, queued_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    queued_start.record()
    host_ms = []
    with LaunchClock() as clock:
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            host_ms.append((time.perf_counter() - start) * 1e3)
    queued_end.record()
    torch.cuda.synchronize()
    host_ms.sort()
    print(f"{args.preset} {args.precision} fwd+bwd: GPU {gpu_ms:.3f} ms per step back to back, "
          f"{queued_start.elapsed_time(queued_end) / args.steps:.3f} ms with every step queued ahead; host enqueue "
          f"median {percentile(host_ms, 50):.3f} ms (min {host_ms[0]:.3f}, max {host_ms[-1]:.3f}); of each step "
          f"{clock.seconds / args.steps * 1e3:.3f} ms inside Triton's launcher over "
          f"{clock.launches / args.steps:.1f} launches")
    for name, (launches, seconds) in sorted(clock.by_kernel.items(), key=lambda item: -item[1][1]):
        print(f"  {seconds / args.steps * 1e3:7.3f} ms per step in {launches / args.steps:.0f} launches of {name}")
    if args.cprofile is not None:
        torch.cuda._sleep(_SLEEP_CYCLES)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(10):
            step()
        profiler.disable()
        torch.cuda.synchronize()
        if args.cprofile:
            profiler.dump_stats(args.cprofile)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
