"""Per-kernel GPU time of one mok layer call on a preset (torch.profiler), to see where
the time goes beyond the GEMMs, and how long the GPU sat idle between the kernels of
the profiled calls (the span from the first kernel's start to the last one's end, less
the time some kernel ran; the profiler's own host overhead can add to it).

    python benchmarks/profile_layer.py --preset qwen3-30b [--backward] [--precision fp8_block] [--iters 10] [--registers]
        [--variant FIELD=VALUE ...]

`--variant` profiles with a kernel-plan field changed, as `mok.bench --variant` times it.
`--registers` also lists every Triton kernel the call compiled with its registers per
thread and the bytes it spills (ptxas's numbers, as the driver reports them on load): a
kernel that spills is the first suspect when it runs slower than its FLOPs or bytes say.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import mok
from mok.bench.presets import GPU_PRESETS, PRESETS
from mok.bench.runner import parse_variant, under_variant
from mok.testing import make_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="qwen3-30b", choices=list(GPU_PRESETS))
    parser.add_argument("--backward", action="store_true", help="profile forward + backward")
    parser.add_argument("--precision", default="bf16", choices=mok.config.PRECISIONS)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--registers", action="store_true", help="list registers and spills of each compiled kernel")
    parser.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE",
                        help="a module setting to profile with (repeatable)")
    args = parser.parse_args()
    with under_variant([parse_variant(text, parser) for text in args.variant]):
        profile_layer(args)


def layer_step(preset: str, precision: str, backward: bool) -> Callable[[], object]:
    """One mok layer call (and its backward) on a preset's inputs, seeded, on the GPU; the
    step returns the output, or with `backward` the gradients of x, the router weights and
    every weight."""
    p = PRESETS[preset]
    inp = make_inputs(p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk,
                      p.shared_intermediate_size, seed=0, device="cuda")
    leaves = [t.requires_grad_() for t in (inp.x, inp.topk_weights, *[w for w in inp.weights if w is not None])]
    # seeded on the CPU: the CUDA generator's initial seed differs from one process to the next
    d_out = torch.randn(inp.x.shape, generator=torch.Generator().manual_seed(1)).to(inp.x)
    config = mok.MoKConfig(precision=precision)

    def step():
        out = mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=config)
        return torch.autograd.grad(out, leaves, d_out) if backward else out

    return step


def profile_layer(args: argparse.Namespace) -> None:
    step = layer_step(args.preset, args.precision, args.backward)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
    rows = {}
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.self_device_time_total > 0:
            rows[evt.key] = (evt.self_device_time_total / args.iters / 1000, evt.count // args.iters)
    total = sum(ms for ms, _ in rows.values())
    print(f"{args.preset} {args.precision} {'fwd+bwd' if args.backward else 'fwd'}: {total:.3f} ms of kernels per call")
    for name, (ms, count) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"  {ms:8.3f} ms  x{count:<3d} {name[:90]}")
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    span_us, busy_us = span_and_busy(kernels)
    print(f"GPU span {span_us / args.iters / 1000:.3f} ms per call, idle between kernels "
          f"{(span_us - busy_us) / args.iters / 1000:.3f} ms per call")
    if args.registers:
        _print_registers()


def span_and_busy(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(last end - first start, time covered by at least one interval) of [start, end) intervals."""
    if not intervals:
        return 0.0, 0.0
    intervals = sorted(intervals)
    busy, (run_start, run_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > run_end:
            busy += run_end - run_start
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    busy += run_end - run_start
    return max(end for _, end in intervals) - intervals[0][0], busy


def _print_registers() -> None:
    """Registers and spill bytes of every compiled specialization of mok's Triton kernels."""
    import gc

    from triton.runtime.jit import JITFunction

    print("registers per thread / spilled bytes of each compiled kernel (warps, stages):")
    for fn in gc.get_objects():
        if not issubclass(type(fn), JITFunction) or not fn.__module__.startswith("mok."):
            continue
        for kernel_cache, *_ in fn.device_caches.values():
            for kernel in kernel_cache.values():
                kernel._init_handles()
                meta = kernel.metadata
                print(f"  {fn.__name__:36s} {kernel.n_regs:4d} regs {kernel.n_spills:6d} B spilled"
                      f"  ({meta.num_warps} warps, {meta.num_stages} stages)")


if __name__ == "__main__":
    main()
