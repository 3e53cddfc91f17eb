"""Per-call time of mok's forward on qwen3-30b under different GPU conditions.

    python benchmarks/forward_gap.py

Times the training forward (autograd on) with CUDA events per call and back to back, right
after warm-up, after the eager torch-native layer has run, after 2 s of idle, and with a
sync before every call (so the host's issue time shows); then mok and eager alternately.
Run `nvidia-smi --query-gpu=timestamp,clocks.sm --format=csv -lms 200` beside it to see the
SM clock the GPU holds.
"""

from __future__ import annotations

import time

import torch

import mok
from mok.bench.baselines import grouped_mm_available, torch_moe
from mok.bench.presets import PRESETS
from mok.testing import make_inputs


def _events_median_ms(fn, reps: int = 50) -> float:
    """Median of per-call CUDA-event times, calls issued back to back."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) for start, end in events)[reps // 2]


def _back_to_back_ms(fn, reps: int = 50) -> float:
    """Mean time per call of `reps` calls between one pair of events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _synced_median_ms(fn, reps: int = 21) -> float:
    """Median per-call time with the GPU idle before each call: includes the host's issue time."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("forward_gap.py: needs a CUDA GPU")
    p = PRESETS["qwen3-30b"]
    inp = make_inputs(p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk, seed=0, device="cuda")
    for t in (inp.x, inp.topk_weights, *[w for w in inp.weights if w is not None]):
        t.requires_grad_()
    config = mok.MoKConfig()
    grouped = grouped_mm_available(inp.x.device)

    def mok_forward():
        return mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=config)

    def eager_forward():
        return torch_moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, grouped=grouped)

    for _ in range(10):
        mok_forward()
    torch.cuda.synchronize()
    print(f"after warm-up: events {_events_median_ms(mok_forward):.3f} ms, back to back {_back_to_back_ms(mok_forward):.3f} ms")
    for _ in range(60):
        eager_forward()
    torch.cuda.synchronize()
    print(f"after eager:   events {_events_median_ms(mok_forward):.3f} ms, back to back {_back_to_back_ms(mok_forward):.3f} ms")
    time.sleep(2)
    print(f"after 2 s idle: events {_events_median_ms(mok_forward):.3f} ms, back to back {_back_to_back_ms(mok_forward):.3f} ms")
    print(f"sync before every call: {_synced_median_ms(mok_forward):.3f} ms")
    for i in range(3):
        print(f"round {i}: mok {_events_median_ms(mok_forward):.3f} ms, eager {_events_median_ms(eager_forward):.3f} ms")


if __name__ == "__main__":
    main()
