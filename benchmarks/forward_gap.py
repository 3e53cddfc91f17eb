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
from mok.testing.timing import back_to_back_ms, time_ms


def _events_median_ms(fn) -> float:
    """Median of 50 per-call CUDA-event times, calls issued back to back, no warm-up."""
    return time_ms(fn, warmup=0, reps=50, device="cuda")["median"]


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

    def report(when: str) -> None:
        events, queued = _events_median_ms(mok_forward), back_to_back_ms(mok_forward, device="cuda")
        print(f"{when}: events {events:.3f} ms, back to back {queued:.3f} ms")

    for _ in range(10):
        mok_forward()
    torch.cuda.synchronize()
    report("after warm-up")
    for _ in range(60):
        eager_forward()
    torch.cuda.synchronize()
    report("after eager")
    time.sleep(2)
    report("after 2 s idle")
    synced = time_ms(mok_forward, warmup=0, reps=21, device="cuda", setup=torch.cuda.synchronize)["median"]
    print(f"sync before every call: {synced:.3f} ms")
    for i in range(3):
        mok_ms, eager_ms = _events_median_ms(mok_forward), _events_median_ms(eager_forward)
        print(f"round {i}: mok {mok_ms:.3f} ms, eager {eager_ms:.3f} ms")


if __name__ == "__main__":
    main()
