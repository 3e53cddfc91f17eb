"""What running a grouped GEMM in two launches over one layout costs, on one GPU: expert
parallelism's own tiles and the others' (`transport.common.own_tiles_split`, with
`MoKConfig.overlap_dispatch_sms` / `overlap_return_sms`) against one launch over all of them. The
overlap model (`ep_model.py`) takes this cost as zero.

    python benchmarks/split_gemm_cost.py [--preset qwen3-30b] [--ep 2] [--out FILE]

Rank 0's side of EP = P, built on one GPU: every rank's T tokens route uniformly over the E
experts (seed + rank), each (token, rank 0) pair sends one row (`token_plan`, capacity C from
`MoKConfig(schedule_capacity_multiplier=1.25)` as the benchmark's EP runs), and rank 0's
receiver schedule orders them, own routes first (`token_receiver_schedule`). Then the gate/up
GEMM (bf16 and fp8_block, g, u kept) and the down GEMM over the received rows, each timed as one
launch and as two (own tiles, then the others' into the same outputs, and for the down GEMM the
other way round), medians of `--reps` CUDA-event timings. Both results are checked bitwise equal
first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

import mok
from mok import ops
from mok.bench.presets import PRESETS
from mok.fp8_block import fp8_block_quantize
from mok.kernels.gemm.common import routing_block_m
from mok.testing import make_topk_ids
from mok.testing.timing import time_ms
from mok.transport.common import own_tiles_split, token_plan, token_receiver_schedule


def receiver_schedule(preset, world_size: int, seed: int, device):
    """(schedule of rank 0's received rows, its own and others' halves, k_l, received rows)."""
    num_tokens, topk, num_experts = preset.num_tokens, preset.topk, preset.num_experts
    local_experts = num_experts // world_size
    config = mok.MoKConfig(schedule_capacity_multiplier=1.25)
    capacity = min(num_tokens, -(-config.receive_capacity(num_tokens, topk, world_size) // world_size))
    routes_per_row = min(topk, local_experts)
    blocks = []
    for rank in range(world_size):
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        ids = make_topk_ids(num_tokens, num_experts, topk, torch.Generator().manual_seed(seed + rank)).to(device)
        send_expert = token_plan(ids, local_experts, world_size, capacity, flag)[2]
        blocks.append(torch.cat([send_expert.view(world_size, -1)[0], flag]))  # to rank 0, then the flag
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    schedule, _ = token_receiver_schedule(torch.stack(blocks), flag, local_experts, routes_per_row, routing_block_m(), 0)
    if int(flag):
        raise RuntimeError(f"the plan overflowed its capacity {capacity} (error flag {int(flag)})")
    own, others = own_tiles_split(schedule, 0, capacity * routes_per_row)
    return schedule, own, others, routes_per_row, world_size * capacity


def _gemms(preset, schedule, own, others, k_l: int, rows: int, device, seed: int) -> dict:
    """name -> (one launch, two launches): callables returning the outputs to compare."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_experts = schedule.num_local_experts
    hidden, inter = preset.hidden_size, preset.intermediate_size

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).bfloat16()

    x = randn(rows, hidden)
    w_gate, w_up = randn(num_experts, inter, hidden, scale=0.02), randn(num_experts, inter, hidden, scale=0.02)
    w_down = randn(num_experts, hidden, inter, scale=0.02)
    slots = rows * k_l
    h = ops.gate_up_swiglu(x, w_gate, w_up, schedule, k_l, None, False)[0]

    def gate_up_two():
        outputs = ops.gate_up_swiglu(x, w_gate, w_up, own, k_l, None, True)
        ops.gate_up_swiglu_into(x, w_gate, w_up, others, k_l, None, *outputs)
        return outputs

    def down_two():
        y = ops.down_scatter(h, w_down, others, slots)
        ops.down_scatter_into(h, w_down, own, y)
        return y

    x_q, x_scale = ops.quantize_fp8_block_activations(x)
    q_gate, q_up, q_down = (fp8_block_quantize(w)[:2] for w in (w_gate, w_up, w_down))
    h_q, h_scale = ops.gate_up_swiglu_fp8_block(x_q, x_scale, *q_gate, *q_up, schedule, k_l, None, False)[:2]

    def fp8_gate_up_two():
        outputs = ops.gate_up_swiglu_fp8_block(x_q, x_scale, *q_gate, *q_up, own, k_l, None, True)
        ops.gate_up_swiglu_fp8_block_into(x_q, x_scale, *q_gate, *q_up, others, k_l, None, *outputs)
        return outputs[:3]

    def fp8_down_two():
        y = ops.down_scatter_fp8_block(h_q, h_scale, *q_down, others, slots)
        ops.down_scatter_fp8_block_into(h_q, h_scale, *q_down, own, False, y)
        return y

    return {
        "gate_up bf16": (lambda: ops.gate_up_swiglu(x, w_gate, w_up, schedule, k_l, None, True), gate_up_two),
        "down bf16": (lambda: ops.down_scatter(h, w_down, schedule, slots), down_two),
        "gate_up fp8_block": (
            lambda: ops.gate_up_swiglu_fp8_block(x_q, x_scale, *q_gate, *q_up, schedule, k_l, None, True)[:3],
            fp8_gate_up_two),
        "down fp8_block": (lambda: ops.down_scatter_fp8_block(h_q, h_scale, *q_down, schedule, slots), fp8_down_two),
    }


def _rows_in_use(outputs, schedule, slots_of: bool) -> list[torch.Tensor]:
    """The written part of each output: the sorted rows below num_rows, or (down) the slots rows point to."""
    if slots_of:
        source = schedule.row_source[: int(schedule.num_rows)]
        return [outputs[source[source >= 0].long()]]
    rows = int(schedule.num_rows)
    return [t[:rows].view(torch.uint8) for t in (outputs if isinstance(outputs, tuple) else (outputs,))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b", help=f"one of {sorted(PRESETS)}")
    parser.add_argument("--ep", type=int, default=2, help="EP size P of the simulated group")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the record here (JSON)")
    args = parser.parse_args(argv)
    if args.preset not in PRESETS:
        parser.error(f"--preset: expected one of {sorted(PRESETS)}, got {args.preset!r}")
    preset = PRESETS[args.preset]
    if args.ep < 2 or preset.num_experts % args.ep:
        parser.error(f"--ep: expected P >= 2 dividing E = {preset.num_experts}, got {args.ep}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    schedule, own, others, k_l, rows = receiver_schedule(preset, args.ep, args.seed, device)
    tiles = int(schedule.num_rows) // schedule.block_m
    own_tiles = int((own.tile_expert[:tiles] >= 0).sum())
    print(f"{preset.name} EP={args.ep}: {tiles} M tiles, {own_tiles} own ({own_tiles / tiles:.1%}), device {device}")
    results = []
    for name, (one, two) in _gemms(preset, schedule, own, others, k_l, rows, device, args.seed).items():
        slots_of = name.startswith("down")
        same = all(torch.equal(a, b) for a, b in zip(_rows_in_use(one(), schedule, slots_of),
                                                      _rows_in_use(two(), schedule, slots_of)))
        if not same:
            print(f"{name}: two launches differ from one", file=sys.stderr)
            return 1
        one_ms = time_ms(one, warmup=3, reps=args.reps, device=device)["median"]
        two_ms = time_ms(two, warmup=3, reps=args.reps, device=device)["median"]
        results.append({"gemm": name, "one_launch_ms": one_ms, "two_launches_ms": two_ms,
                        "cost": two_ms / one_ms - 1})
        print(f"{name:18} one launch {one_ms:7.3f} ms   two {two_ms:7.3f} ms   cost {two_ms / one_ms - 1:+.1%}")
    if args.out:
        info = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
                "triton": __import__("triton").__version__, "date": datetime.date.today().isoformat(),
                "command": "python benchmarks/split_gemm_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "preset": preset.name, "ep": args.ep, "m_tiles": tiles, "own_tiles": own_tiles, "results": results}
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
