"""How a grouped GEMM's time steps with its number of M tiles: the last wave of tiles.

A launch of one program per tile at one program per SM runs its tiles in waves of
`num_sms` (132 on H200): a launch of 16·132 + 16 tiles takes 17 tile-times, 5% more than
16·132 for 0.8% more tiles. The M tile count follows the routing (each expert's rows padded
to 128), so this script builds routings with exact per-expert counts: every expert gets
T·topk/E routes, except that `--extra` of them get a few more and the others share the
difference (the same total), each extra one adding one M tile. With 16 column tiles
(mixtral-8x7b's down GEMM and gate/up dgrad, H = 4096 at BLOCK_N = 256), 128 + 4 M tiles
fill 16 waves exactly and 128 + 5 start a 17th.

It times the kernels on the default tiles, which compute a last wave of at most half the
SMs' tiles as column halves (the plan's `split_last_wave`), on the same tiles all whole,
and on narrower ones (BLOCK_N 128 and 64), whose time per FLOP says what a half tile costs.
Configs take turns `--rounds` times (the clock falls under sustained load); ms are the
medians of all calls.

    python benchmarks/sweeps/tile_waves.py [--preset mixtral-8x7b] [--extra 0,4,5,7] [--rounds 3] [--out F.json]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
import tune_gemm  # noqa: E402

from mok.bench.presets import GPU_PRESETS, PRESETS  # noqa: E402
from mok.kernels.common import num_sms  # noqa: E402
from mok.kernels.gemm.dgrad import dgrad_config, gate_up_dgrad_scatter  # noqa: E402
from mok.kernels.gemm.common import gemm_config, routing_block_m  # noqa: E402
from mok.kernels.gemm.down import down_scatter  # noqa: E402
from mok.kernels.routing.schedule import build_routing_schedule  # noqa: E402
from mok.testing import make_inputs  # noqa: E402
from mok.testing.timing import times_ms  # noqa: E402


def exact_routing(num_tokens: int, num_experts: int, topk: int, extra: int, generator: torch.Generator) -> torch.Tensor:
    """[T, topk] int64 ids giving each expert T·topk/E routes, but `extra` experts an eighth of
    an M tile more and the others as many fewer in all, rows in random order: one M tile more
    per extra expert."""
    base, step = num_tokens * topk // num_experts, routing_block_m() // 8
    others = num_experts - extra
    if base * num_experts != num_tokens * topk or base % routing_block_m() or others < 1:
        raise ValueError(f"extra: expected T·topk/E a multiple of the M tile and extra < E, got {extra}")
    deficit = [extra * step // others + (i < extra * step % others) for i in range(others)]
    if max(deficit) >= routing_block_m():
        raise ValueError(f"extra: {extra} leaves the other experts a whole M tile short")
    counts = [base + step] * extra + [base - d for d in deficit]
    # Sorted ids, route j of token t at t + j·T: an expert's run (≤ T long) never gives a token
    # the same expert twice.
    ids = torch.repeat_interleave(torch.arange(num_experts), torch.tensor(counts))
    ids = ids.view(topk, num_tokens).t()
    return ids[torch.randperm(num_tokens, generator=generator)].contiguous()


def _configs(kind: str, hidden: int, inter: int) -> list[dict]:
    """The library's per-tile config (its last wave in column halves where that applies), the
    same with every tile whole, and whole tiles of half and a quarter the width."""
    default = (gemm_config("down", hidden, inter, allow_warp_specialized=False) if kind == "down"
               else dgrad_config("gate_up", hidden, inter, allow_warp_specialized=False))
    whole = dict(default, SPLIT_LAST_WAVE=False)
    narrow = [dict(whole, BLOCK_N=n, PERSISTENT=False) for n in (128, 64) if n < default["BLOCK_N"]]
    return [default, whole, *narrow]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", choices=list(GPU_PRESETS), help="default: mixtral-8x7b")
    parser.add_argument("--extra", default="0,4,5,7", help="experts with one M tile more, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for name in args.preset or ["mixtral-8x7b"]:
        p = PRESETS[name]
        T, H, I, E, topk = p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk
        inp = make_inputs(T, H, I, E, topk, seed=0, device="cuda")
        gen = torch.Generator().manual_seed(1)
        routes = T * topk
        cases = []
        for extra in (int(e) for e in args.extra.split(",")):
            ids = exact_routing(T, E, topk, extra, gen).cuda()
            sched = build_routing_schedule(ids, E, routing_block_m(), torch.zeros(1, dtype=torch.int32, device="cuda"))
            m_tiles = int(sched.num_rows) // routing_block_m()  # a host sync, outside the timed calls
            h = torch.randn(sched.capacity_rows, I, device="cuda").bfloat16()
            gate_up = torch.randn(sched.capacity_rows, 2, I, device="cuda").bfloat16()
            calls = {
                "down": lambda cfg, h=h, s=sched: down_scatter(h, inp.w_down, s, routes, tile_config=cfg),
                "gate_up_dgrad": lambda cfg, g=gate_up, s=sched: gate_up_dgrad_scatter(
                    g, inp.w_gate, inp.w_up, s, routes, tile_config=cfg),
            }
            for kind, call in calls.items():
                for cfg in _configs(kind, H, I):
                    cases.append(dict(extra=extra, m_tiles=m_tiles, kind=kind, cfg=cfg, fn=lambda c=call, g=cfg: c(g)))
        for case in cases:
            case["fn"]()  # compile outside the timed rounds
        times = [[] for _ in cases]
        for r in range(args.rounds):
            for i in range(len(cases)) if r % 2 == 0 else reversed(range(len(cases))):
                times[i] += times_ms(cases[i]["fn"], warmup=3, reps=10)
        sms = num_sms(torch.device("cuda"))
        for case, t in zip(cases, times):
            tiles = case["m_tiles"] * triton.cdiv(H, case["cfg"]["BLOCK_N"])
            ms = statistics.median(t)
            flops = tune_gemm.FLOPS_PER_ROUTE_HI[case["kind"]] * routes * H * I
            row = dict(preset=name, kernel=case["kind"], extra=case["extra"], m_tiles=case["m_tiles"], tiles=tiles,
                       waves=tiles / sms, ms=ms, tflops=flops / ms / 1e9, ms_per_wave=ms / triton.cdiv(tiles, sms),
                       config=dict(case["cfg"]))
            results.append(row)
            split = "split" if case["cfg"].get("SPLIT_LAST_WAVE") else "whole"
            print(f"{name:14s} {case['kind']:14s} M tiles {case['m_tiles']:4d}  "
                  f"BLOCK_N {case['cfg']['BLOCK_N']:3d} {split}  "
                  f"{tiles:5d} tiles = {row['waves']:6.2f} waves  {ms:7.3f} ms  {row['tflops']:6.1f} TF  "
                  f"{row['ms_per_wave']:.4f} ms per started wave", flush=True)
    if args.out:
        tune_gemm.write_record(args.out, results)


if __name__ == "__main__":
    main()
