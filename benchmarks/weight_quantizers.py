"""The routed weights' fp8_block quantization on a GPU: the layer's Triton kernel
(`ops.quantize_fp8_block_weights`, which the layer runs once per in-place update of each weight)
against the public PyTorch `mok.fp8_block_quantize`, on qwen3-30b's three routed weights, in GB/s of
bf16 read plus q and q_t written.

    python benchmarks/weight_quantizers.py
"""
import statistics, torch, mok
from mok import ops
from mok.testing.timing import times_ms
w = [torch.randn(128, 768, 2048, device="cuda").bfloat16() for _ in range(2)] + [torch.randn(128, 2048, 768, device="cuda").bfloat16()]
gb = sum(t.numel() for t in w) * (2 + 1 + 1) / 1e9  # bf16 read, q and q_t written
for r in range(2):
    for name, fn in (("ops.quantize_fp8_block_weights (Triton)", lambda: [ops.quantize_fp8_block_weights(t) for t in w]),
                     ("mok.fp8_block_quantize (torch)", lambda: [mok.fp8_block_quantize(t) for t in w])):
        ms = statistics.median(times_ms(fn, warmup=3, reps=20))
        print(f"qwen3-30b's three routed weights, {name}: {ms:.3f} ms, {gb / ms * 1e3:.0f} GB/s", flush=True)
