"""The transposing fp8_block quantizers (`quant_fp8_block.quantize_fp8_block_gathered_t`,
`quantize_fp8_block_sorted_t`, `quantize_fp8_block_swiglu_sorted_t`) on the qwen3-30b and
deepseek-v3-slice shapes: tile configs (columns per block, warps, column blocks per program
and the loads they keep in flight, launch order), every config timed in both orders (the
GPU's clock falls under sustained load), each output checked against the first config's over
the rows the schedule uses. GB/s counts each sorted row's bf16 read once (h: g and u) and its
e4m3 bytes written.

    python benchmarks/sweeps/fp8_sorted_quantizers.py
"""

import torch

from mok.bench.presets import PRESETS
from mok.kernels import quant_fp8_block
from mok.kernels.grouped_gemm import routing_block_m
from mok.kernels.schedule import build_routing_schedule
from mok.testing import make_inputs
from mok.testing.timing import time_ms

ROWS_FIRST = 1 << 30  # GROUP_ROWS: each column group's row blocks in turn (the launch's first axis)


def _tile(block_w, warps, steps=1, stages=1, group_rows=ROWS_FIRST):
    return dict(BLOCK_W=block_w, STEPS=steps, STAGES=stages, GROUP_ROWS=group_rows, num_warps=warps)


TILES = [
    _tile(64, 4), _tile(32, 2),  # the defaults (sorted; gathered at H > 2048)
    _tile(64, 4, group_rows=1), _tile(32, 2, group_rows=1), _tile(64, 4, group_rows=8),  # columns first
    _tile(64, 4, 4, 3), _tile(64, 4, 4, 3, group_rows=1), _tile(64, 4, 8, 2), _tile(64, 4, 16, 3),  # loops
]


def main() -> None:
    for name in ("qwen3-30b", "deepseek-v3-slice"):
        p = PRESETS[name]
        inp = make_inputs(p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk, seed=0,
                          device="cuda")
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        sched = build_routing_schedule(inp.topk_ids, p.num_experts, routing_block_m(), flag)
        num_rows = int(sched.num_rows)  # a host sync outside the timed calls
        d_out = torch.randn_like(inp.x)
        d_gate_up = torch.randn(sched.capacity_rows, 2 * p.intermediate_size, device="cuda").bfloat16()
        calls = {  # (call, bytes per sorted row)
            "x gathered": (lambda: quant_fp8_block.quantize_fp8_block_gathered_t(inp.x, sched, p.topk),
                           3 * p.hidden_size),
            "w·dOut gathered": (lambda: quant_fp8_block.quantize_fp8_block_gathered_t(
                d_out, sched, p.topk, inp.topk_weights), 3 * p.hidden_size),
            "d_gate_up sorted": (lambda: quant_fp8_block.quantize_fp8_block_sorted_t(d_gate_up, sched),
                                 6 * p.intermediate_size),
            "h from g, u": (lambda: quant_fp8_block.quantize_fp8_block_swiglu_sorted_t(
                d_gate_up.view(-1, 2, p.intermediate_size), sched), 5 * p.intermediate_size),
        }
        first = {}
        for tile in TILES + TILES[::-1]:
            for tile_name in ("_SORTED_TILE", "_GATHERED_NARROW_TILE"):
                setattr(quant_fp8_block, tile_name, tile)
            for what, (fn, row_bytes) in calls.items():
                q_t = fn()[0].view(torch.uint8)[:, :num_rows]
                same = torch.equal(q_t, first.setdefault(what, q_t))
                ms = time_ms(fn, warmup=3, reps=20)["median"]
                tile_text = " ".join(f"{k}={v}" for k, v in tile.items() if k != "GROUP_ROWS")
                order = "rows first" if tile["GROUP_ROWS"] == ROWS_FIRST else f"GROUP_ROWS={tile['GROUP_ROWS']}"
                print(f"{name:18s} {what:16s} {tile_text:42s} {order:13s} {ms:.3f} ms "
                      f"{num_rows * row_bytes / ms / 1e6:5.0f} GB/s same={same}", flush=True)


if __name__ == "__main__":
    main()
