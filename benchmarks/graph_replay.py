"""One mok forward+backward (as `mok.bench` times it: `mok.moe`, then `torch.autograd.grad` of
every input) run eagerly, against the same step captured once in a CUDA graph and replayed:
what the launches cost the layer (a replay launches nothing from the host), and that a replay
gives the eager gradients bit for bit. Three alternating rounds per precision. In fp8_block a
captured step quantizes the routed weights on every replay (the graph cannot consult the
host-side cache that eager calls use), so its replays also time `ops.quantize_fp8_block_weights`.

    python benchmarks/graph_replay.py [PRESET]   (default qwen3-30b)
"""
import statistics, sys
import torch
import mok
from mok.bench.presets import PRESETS
from mok.testing import make_inputs
from mok.testing.timing import capture_cuda_graph, times_ms

p = PRESETS[sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b"]
inp = make_inputs(p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk,
                  p.shared_intermediate_size, seed=0, device="cuda")
leaves = tuple(t.requires_grad_(True) for t in (inp.x, inp.topk_weights, *inp.weights) if t is not None)
d_out = torch.randn_like(inp.x)
for precision in ("bf16", "fp8_block"):
    config = mok.MoKConfig(precision=precision)

    def fn():
        out = mok.moe(inp.x, inp.topk_ids, inp.topk_weights, *inp.weights, config=config)
        return torch.autograd.grad(out, leaves, d_out, allow_unused=True)

    graph, captured = capture_cuda_graph(fn, warmup=3)
    graph.replay()
    eager = fn()
    same = all(a is None or torch.equal(a, b) for a, b in zip(captured, eager))
    for r in range(3):
        e = statistics.median(times_ms(fn, warmup=5, reps=40))
        g = statistics.median(times_ms(graph.replay, warmup=5, reps=40))
        print(f"{p.name} {precision:9s} round {r}: eager {e:.3f} ms, graph replay {g:.3f} ms, "
              f"gap {e - g:.3f} ms, replay bitwise the eager grads: {same}", flush=True)
    del graph, captured
