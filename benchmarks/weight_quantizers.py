"""The routed weights' fp8_block quantization on a GPU, on a preset's three routed weights
(qwen3-30b's by default), in GB/s of bf16 read plus q and q_t written: the layer's kernel
(`ops.quantize_fp8_block_weights`, run once per in-place update of each weight) in its Gluon
form (the default on NVIDIA GPUs) and its Triton form, each output checked bitwise against the
other's, then the public PyTorch `mok.fp8_block_quantize` (the reference). Two rounds.

    python benchmarks/weight_quantizers.py [--preset qwen3-30b]
"""

import argparse
import statistics

import torch

import mok
from mok import ops
from mok.bench.presets import GPU_PRESETS, PRESETS
from mok.kernels.plan import override
from mok.testing.timing import times_ms


def _kernel(gluon: bool):
    def quantize(w):
        with override(weights_gluon=gluon):
            return ops.quantize_fp8_block_weights(w)
    return quantize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="qwen3-30b", choices=list(GPU_PRESETS))
    args = parser.parse_args()
    p = PRESETS[args.preset]
    E, H, I = p.num_experts, p.hidden_size, p.intermediate_size
    weights = [torch.randn(E, I, H, device="cuda").bfloat16() for _ in range(2)]  # w_gate, w_up
    weights.append(torch.randn(E, H, I, device="cuda").bfloat16())  # w_down
    gb = sum(w.numel() for w in weights) * (2 + 1 + 1) / 1e9  # bf16 read, q and q_t written
    quantizers = {"Gluon kernel": _kernel(True), "Triton kernel": _kernel(False), "mok.fp8_block_quantize (torch)":
                  mok.fp8_block_quantize}
    first = [quantizers["Triton kernel"](w) for w in weights]
    for w, want in zip(weights, first):
        for got, expected in zip(quantizers["Gluon kernel"](w), want):
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # by bits: NaN equals NaN
    print(f"{args.preset}: the Gluon kernel's q, scale, q_t, scale_t are bitwise the Triton kernel's", flush=True)
    for _ in range(2):
        for name, quantize in quantizers.items():
            ms = statistics.median(times_ms(lambda: [quantize(w) for w in weights], warmup=3, reps=20))
            print(f"{args.preset}'s three routed weights, {name}: {ms:.3f} ms, {gb / ms * 1e3:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
