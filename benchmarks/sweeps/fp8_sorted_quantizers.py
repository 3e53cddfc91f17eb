"""The transposing fp8_block quantizers (`quant_fp8_block.quantize_fp8_block_gathered_t`,
`quantize_fp8_block_sorted_t`, `quantize_fp8_block_swiglu_sorted_t`) on the qwen3-30b and
deepseek-v3-slice shapes: the Triton kernel's columns per program and warps (for every operand,
the gathered wide ones' own tile switched off) and the Gluon kernel's rows per thread and warps,
every config timed in both orders (the GPU's clock falls under
sustained load), each output checked against the first config's over the columns the schedule
uses. GB/s counts each sorted row's bf16 read once (h: g and u) and its e4m3 bytes written.
With `--e4m3` it sweeps the Gluon kernel on the operands the layer requantizes (the SCALED mode:
x's and dOut's per-token e4m3 rows gathered, d_g|d_u's and h's e4m3 sorted rows, each with its
1×128 row scales); GB/s then counts each sorted row's e4m3 bytes read once and written once.

    python benchmarks/sweeps/fp8_sorted_quantizers.py [--e4m3]
"""

import sys

import torch

from mok.bench.presets import PRESETS
from mok.kernels.quant import fp8_block as quant_fp8_block
from mok.kernels.gemm.common import routing_block_m
from mok.kernels.plan import override
from mok.kernels.routing.schedule import build_routing_schedule
from mok.testing import make_inputs
from mok.testing.timing import time_ms

# ("triton", columns per program, warps) or ("gluon", rows per thread, warps)
CONFIGS = [("triton", 64, 4), ("triton", 32, 2), ("gluon", 16, 4), ("gluon", 8, 4), ("gluon", 16, 2), ("gluon", 8, 8),
           ("gluon", 4, 4)]
E4M3_CONFIGS = [("gluon", 16, 2), ("gluon", 16, 1), ("gluon", 16, 4), ("gluon", 8, 2), ("gluon", 8, 1), ("gluon", 32, 1),
                ("gluon", 32, 2)]
SHAPES = ("qwen3-30b", "deepseek-v3-slice")


def quantizer_calls(name: str) -> tuple[int, dict]:
    """(rows the schedule uses, {operand: (no-argument call, bytes per sorted row)}) on a preset's shapes."""
    p = PRESETS[name]
    inp = make_inputs(p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk, seed=0, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    sched = build_routing_schedule(inp.topk_ids, p.num_experts, routing_block_m(), flag)
    d_out = torch.randn_like(inp.x)
    gate_up = torch.randn(sched.capacity_rows, 2, p.intermediate_size, device="cuda").bfloat16()
    calls = {
        "x gathered": (lambda: quant_fp8_block.quantize_fp8_block_gathered_t(inp.x, sched, p.topk), 3 * p.hidden_size),
        "w·dOut gathered": (lambda: quant_fp8_block.quantize_fp8_block_gathered_t(d_out, sched, p.topk,
                                                                                 inp.topk_weights), 3 * p.hidden_size),
        "d_gate_up sorted": (lambda: quant_fp8_block.quantize_fp8_block_sorted_t(gate_up.flatten(1), sched),
                             6 * p.intermediate_size),
        "h from g, u": (lambda: quant_fp8_block.quantize_fp8_block_swiglu_sorted_t(gate_up, sched),
                        5 * p.intermediate_size),
    }
    if "--e4m3" in sys.argv:
        calls = _e4m3_calls(p, inp, sched, d_out, gate_up)
    return int(sched.num_rows), calls  # a host sync outside the timed calls


def _e4m3_calls(p, inp, sched, d_out, gate_up) -> dict:
    """The SCALED-mode calls, on operands quantized along their rows as the layer's forward keeps them."""
    x_q, d_out_q = (quant_fp8_block.quantize_fp8_block_activations(t) for t in (inp.x, d_out))
    d_gate_up_q = quant_fp8_block.quantize_fp8_block_activations(gate_up.flatten(1))
    h_q = quant_fp8_block.quantize_fp8_block_activations(gate_up[:, 0])
    hidden, inter = p.hidden_size, p.intermediate_size
    return {
        "x_q gathered": (lambda: quant_fp8_block.quantize_fp8_block_gathered_t(x_q[0], sched, p.topk,
                                                                              a_scale=x_q[1]), 2 * hidden),
        "w·dOut_q gathered": (lambda: quant_fp8_block.quantize_fp8_block_gathered_t(
            d_out_q[0], sched, p.topk, inp.topk_weights, a_scale=d_out_q[1]), 2 * hidden),
        "d_gate_up_q sorted": (lambda: quant_fp8_block.quantize_fp8_block_sorted_t(d_gate_up_q[0], sched,
                                                                                  a_scale=d_gate_up_q[1]), 4 * inter),
        "h_q sorted": (lambda: quant_fp8_block.quantize_fp8_block_sorted_t(h_q[0], sched, a_scale=h_q[1]), 2 * inter),
    }


def time_call(call, rows: int, row_bytes: int) -> str:
    """'<ms> ms <GB/s> GB/s' of one quantizer call."""
    ms = time_ms(call, warmup=3, reps=20)["median"]
    return f"{ms:.3f} ms {rows * row_bytes / ms / 1e6:5.0f} GB/s"


def main() -> None:
    for name in SHAPES:
        rows, calls = quantizer_calls(name)
        first = {}
        configs = E4M3_CONFIGS if "--e4m3" in sys.argv else CONFIGS
        for kernel, size, warps in configs + configs[::-1]:
            if kernel == "gluon":
                fields = dict(sorted_gluon_rows_per_thread=size, sorted_gluon_num_warps=warps,
                              sorted_gluon_num_warps_e4m3=warps)
            else:
                fields = dict(sorted_block_w=size, sorted_num_warps=warps)
            config = f"{kernel} {'rows/thread' if kernel == 'gluon' else 'BLOCK_W'}={size:3d} warps={warps}"
            # every operand on the swept tile: none takes the narrow gathered one
            with override(sorted_gluon=kernel == "gluon", gathered_narrow_min_width=1 << 30, **fields):
                for what, (call, row_bytes) in calls.items():
                    q_t = call()[0].view(torch.uint8)[:, :rows]
                    same = torch.equal(q_t, first.setdefault(what, q_t))
                    print(f"{name:18s} {what:16s} {config} {time_call(call, rows, row_bytes)} same={same}",
                          flush=True)


if __name__ == "__main__":
    main()
