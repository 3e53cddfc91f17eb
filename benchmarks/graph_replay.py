"""One mok forward+backward (`profile_layer.layer_step`: `mok.moe`, then `torch.autograd.grad`
of every input, as `mok.bench` times it) run eagerly, against the same step captured once in a
CUDA graph and replayed: what the launches cost the layer (a replay launches nothing from the
host), and that a replay gives the eager gradients bit for bit. Three alternating rounds per
precision. In fp8_block a captured step quantizes the routed weights on every replay (the graph
cannot consult the host-side cache that eager calls use), so its replays also time
`ops.quantize_fp8_block_weights`.

    python benchmarks/graph_replay.py [PRESET]   (default qwen3-30b)
"""

from __future__ import annotations

import argparse
import statistics

import torch

from mok.bench.presets import GPU_PRESETS
from mok.testing.timing import capture_cuda_graph, times_ms
from profile_layer import layer_step  # benchmarks/, the script's own folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("preset", nargs="?", default="qwen3-30b", choices=list(GPU_PRESETS))
    args = parser.parse_args()
    for precision in ("bf16", "fp8_block"):
        step = layer_step(args.preset, precision, backward=True)
        graph, captured = capture_cuda_graph(step, warmup=3)
        graph.replay()
        same = all(torch.equal(a, b) for a, b in zip(captured, step()))
        for r in range(3):
            eager = statistics.median(times_ms(step, warmup=5, reps=40))
            replay = statistics.median(times_ms(graph.replay, warmup=5, reps=40))
            print(f"{args.preset} {precision:9s} round {r}: eager {eager:.3f} ms, graph replay {replay:.3f} ms, "
                  f"gap {eager - replay:.3f} ms, replay bitwise the eager grads: {same}", flush=True)
        del graph, captured, step


if __name__ == "__main__":
    main()
