"""The routed weights' fp8_block quantization on a GPU, on qwen3-30b's three routed weights, in
GB/s of bf16 read plus q and q_t written: the layer's Triton kernel
(`ops.quantize_fp8_block_weights`, which the layer runs once per in-place update of each weight)
against the public PyTorch `mok.fp8_block_quantize` (the reference). Two rounds.

    python benchmarks/weight_quantizers.py
"""

from __future__ import annotations

import statistics

import torch

import mok
from mok import ops
from mok.bench.presets import PRESETS
from mok.testing.timing import times_ms


def main() -> None:
    p = PRESETS["qwen3-30b"]
    E, H, I = p.num_experts, p.hidden_size, p.intermediate_size
    weights = [torch.randn(E, I, H, device="cuda").bfloat16() for _ in range(2)]  # w_gate, w_up
    weights.append(torch.randn(E, H, I, device="cuda").bfloat16())  # w_down
    gb = sum(w.numel() for w in weights) * (2 + 1 + 1) / 1e9  # bf16 read, q and q_t written
    quantizers = {"ops.quantize_fp8_block_weights (Triton)": ops.quantize_fp8_block_weights,
                  "mok.fp8_block_quantize (torch)": mok.fp8_block_quantize}
    for _ in range(2):
        for name, quantize in quantizers.items():
            ms = statistics.median(times_ms(lambda: [quantize(w) for w in weights], warmup=3, reps=20))
            print(f"qwen3-30b's three routed weights, {name}: {ms:.3f} ms, {gb / ms * 1e3:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
