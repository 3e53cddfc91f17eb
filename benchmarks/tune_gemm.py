"""Times the grouped-GEMM kernels over candidate tile configs on the GPU presets.

    python benchmarks/tune_gemm.py [--preset qwen3-30b ...] [--kernel down_wgrad ...] [--rounds R] [--out FILE.json]

Each config runs on the preset's real shape with random routing; TFLOPS count only the
routed rows (T·topk), so padding and masked tiles show up as lost throughput. Kernels:
the forward's gate_up (with and without X_SORTED, the copy of x included; gate/up weights
packed as `MoKMoE` keeps them, and as separate tensors: gate_up_separate) and down, the
backward's down_dgrad (with the SwiGLU backward epilogue), gate_up_dgrad, down_wgrad and
gate_up_wgrad (per-tile and persistent launches), and the fp8_block down GEMM, gate/up dgrad
and wgrads (down_fp8, gate_up_dgrad_fp8, down_wgrad_fp8, gate_up_wgrad_fp8, over operands
and weights quantized once ahead of the timing). Each config's output
is compared with the kernel's first config
(`max_abs_diff_vs_first`; 0 when the K order is the same). With `--rounds R` a kernel's
configs take turns R times (the order reversed every other round) and each reports the median
of all its timed calls: the GPU's clock falls under sustained load, so a config timed once, late
in a sweep, measures slower than the same config timed early. A kind's entry in `CONFIGS` may
also be a function of the preset (`benchmarks/sweeps/` vary each preset's defaults so).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch
import triton

from mok.bench.presets import GPU_PRESETS, PRESETS
from mok.fp8_block import fp8_block_quantize
from mok.kernels.gemm.dgrad import (
    dgrad_config,
    down_dgrad_swiglu,
    gate_up_dgrad_scatter,
    gate_up_dgrad_scatter_fp8_block,
)
from mok.kernels.routing.gather import gather_sorted_rows
from mok.kernels.gemm.common import gemm_config
from mok.kernels.gemm.down import down_scatter, down_scatter_fp8_block
from mok.kernels.gemm.gate_up import gate_up_swiglu, gate_up_swiglu_fp8_block
from mok.kernels.quant.fp8_block import quantize_fp8_block_activations, quantize_fp8_block_sorted_t
from mok.kernels.routing.schedule import build_routing_schedule
from mok.kernels.gemm.wgrad import (
    down_wgrad,
    down_wgrad_fp8_block,
    gate_up_wgrad,
    gate_up_wgrad_fp8_block,
    wgrad_config,
)
from mok.testing import make_inputs
from mok.testing.timing import times_ms


def _configs(*tiles, group_m: bool = True) -> list[dict]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_stages) tuples as configs at 8 warps."""
    extra = dict(GROUP_M=8) if group_m else {}
    return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=8, num_stages=s, **extra) for m, n, k, s in tiles]


def _persistent(configs: list[dict]) -> list[dict]:
    """The configs again as persistent launches (one program per SM, flattened tile loop)."""
    return [dict(cfg, PERSISTENT=True) for cfg in configs]


def _sorted_x(configs: list[dict]) -> list[dict]:
    """The gate/up configs again, reading x copied to the sorted layout (the copy is timed too)."""
    return [dict(cfg, X_SORTED=True) for cfg in configs]


_GATE_UP = _configs((128, 128, 64, 4), (128, 128, 64, 3))
CONFIGS = {
    "gate_up": [dict(cfg, PACKED=True) for cfg in _GATE_UP + _sorted_x(_GATE_UP)],
    "gate_up_separate": _GATE_UP + _sorted_x(_GATE_UP),
    "down": _configs((128, 256, 64, 4), (128, 256, 64, 3)) + _persistent(_configs((128, 256, 64, 3), (128, 256, 64, 4))),
    "down_dgrad": _configs((128, 256, 64, 3), (128, 128, 64, 4), (128, 128, 64, 3), (128, 128, 32, 6)),
    "gate_up_dgrad": _configs((128, 256, 64, 3), (128, 256, 64, 4))
    + _persistent(_configs((128, 256, 64, 3), (128, 256, 64, 4))),
    "down_wgrad": _configs((128, 256, 64, 3), (128, 256, 64, 4), (128, 128, 64, 4), group_m=False)
    + _persistent(_configs((128, 256, 64, 3), (128, 256, 64, 4), group_m=False)),
    "gate_up_wgrad": _configs((128, 128, 64, 3), (128, 128, 64, 4), (128, 128, 32, 6), group_m=False)
    + _persistent(_configs((128, 128, 64, 3), (128, 128, 64, 4), group_m=False)),
    # the library's fp8_block Triton tiles (the same for every shape)
    "gate_up_fp8": [gemm_config("gate_up", 0, 0, "fp8_block", allow_warp_specialized=False)],
    "down_fp8": [gemm_config("down", 0, 0, "fp8_block", allow_warp_specialized=False)],
    "gate_up_dgrad_fp8": [dgrad_config("gate_up", 0, 0, "fp8_block", allow_warp_specialized=False)],
    "down_wgrad_fp8": [wgrad_config("down", 0, 0, "fp8_block", allow_warp_specialized=False)],
    "gate_up_wgrad_fp8": [wgrad_config("gate_up", 0, 0, "fp8_block", allow_warp_specialized=False)],
}

def _configs_64(*tiles) -> list[dict]:
    """(BLOCK_N, num_warps, num_stages) tuples as 64-row configs, BLOCK_K 64."""
    return [dict(BLOCK_M=64, BLOCK_N=n, BLOCK_K=64, GROUP_M=8, num_warps=w, num_stages=s) for n, w, s in tiles]


# With `--block-m 64`: a schedule that pads each expert to 64 rows (half the padding of 128:
# 6% of qwen3-30b's rows at 128), so every GEMM over it takes 64-row tiles; 4 warps leave
# room for two programs per SM (one's epilogue overlapping the other's main loop).
_TILES_64 = _configs_64((128, 4, 3), (128, 4, 4), (128, 8, 4))
CONFIGS_64 = {
    "gate_up": [dict(cfg, PACKED=True) for cfg in _TILES_64],
    "down": _configs_64((256, 4, 2), (256, 4, 3), (256, 8, 3), (128, 4, 4)),
    "down_dgrad": _configs_64((256, 4, 2), (256, 8, 3), (128, 4, 4)),
    "gate_up_dgrad": _configs_64((256, 4, 2), (256, 8, 3), (128, 4, 4)),
    "down_wgrad": CONFIGS["down_wgrad"],
    "gate_up_wgrad": CONFIGS["gate_up_wgrad"],
}
# GEMM FLOPs per routed row, in units of H·I (gate/up GEMMs do two products).
FLOPS_PER_ROUTE_HI = {"gate_up": 4, "gate_up_separate": 4, "down": 2, "down_dgrad": 2, "gate_up_dgrad": 4, "down_wgrad": 2,
                      "gate_up_wgrad": 4, "gate_up_fp8": 4, "down_fp8": 2, "gate_up_dgrad_fp8": 4,
                      "down_wgrad_fp8": 2, "gate_up_wgrad_fp8": 4}


def _kernel_call(kind, cfg, inp, sched, topk, operands):
    """A no-argument call of kernel `kind` with tile config `cfg` on the preset's operands."""
    routes = inp.topk_ids.numel()
    calls = {
        # g, u stored as in training (the backward reads them)
        "gate_up": lambda: gate_up_swiglu(inp.x, inp.w_gate, inp.w_up, sched, topk, store_gate_up=True, tile_config=cfg),
        "gate_up_separate": lambda: gate_up_swiglu(inp.x, *operands["separate_gate_up"], sched, topk,
                                                   store_gate_up=True, tile_config=cfg),
        "down": lambda: down_scatter(operands["h"], inp.w_down, sched, routes, tile_config=cfg),
        "down_dgrad": lambda: down_dgrad_swiglu(operands["d_out_sorted"], inp.topk_weights, operands["gate_up"],
                                                inp.w_down, sched, tile_config=cfg),
        "gate_up_dgrad": lambda: gate_up_dgrad_scatter(operands["gate_up"], inp.w_gate, inp.w_up, sched, routes,
                                                       tile_config=cfg),
        "down_wgrad": lambda: down_wgrad(operands["dy_sorted"], operands["h"], sched, tile_config=cfg),
        "gate_up_wgrad": lambda: gate_up_wgrad(operands["gate_up"], operands["x_sorted"], sched, tile_config=cfg),
        "gate_up_fp8": lambda: gate_up_swiglu_fp8_block(*operands["x_q"], *operands["w_gate_q"], *operands["w_up_q"],
                                                        sched, topk, store_gate_up=True, tile_config=cfg),
        "down_fp8": lambda: down_scatter_fp8_block(*operands["h_q"], *operands["w_down_q"], sched, routes,
                                                   tile_config=cfg),
        "gate_up_dgrad_fp8": lambda: gate_up_dgrad_scatter_fp8_block(
            *operands["d_gate_q"], *operands["d_up_q"], *operands["w_gate_t_q"], *operands["w_up_t_q"], sched, routes,
            tile_config=cfg),
        "down_wgrad_fp8": lambda: down_wgrad_fp8_block(*operands["dy_t"], *operands["h_t"], sched, tile_config=cfg),
        "gate_up_wgrad_fp8": lambda: gate_up_wgrad_fp8_block(*operands["gate_up_t"], *operands["x_t"], sched,
                                                             tile_config=cfg),
    }
    return calls[kind]


def _written(kind: str, out, num_rows: int) -> torch.Tensor:
    """The part of a kernel's (first) output that it writes: sorted-layout outputs only up to
    the schedule's rows, so configs can be compared with each other."""
    first = out[0] if isinstance(out, tuple) else out
    return first[:num_rows] if kind in ("gate_up", "gate_up_separate", "gate_up_fp8", "down_dgrad") else first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", action="append", choices=list(GPU_PRESETS))
    parser.add_argument("--kernel", action="append", choices=list(CONFIGS))
    parser.add_argument("--block-m", type=int, default=128, choices=(64, 128),
                        help="rows each expert is padded to (the schedule's M tile); 64 times CONFIGS_64")
    parser.add_argument("--rounds", type=int, default=1, help="times each kernel's configs take turns (default 1)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    results = []
    for name in args.preset or GPU_PRESETS:
        p = PRESETS[name]
        T, H, I, E, topk = p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk
        inp = make_inputs(T, H, I, E, topk, seed=0, device="cuda")
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        block_m = args.block_m  # every config keeps the schedule's M tile
        configs = CONFIGS if block_m == 128 else CONFIGS_64
        sched = build_routing_schedule(inp.topk_ids, E, block_m, flag)
        operands = {  # [rows, ...] sorted-layout operands: random, zero in padding rows as the kernels leave them
            "h": torch.randn(sched.capacity_rows, I, device="cuda").bfloat16(),
            "gate_up": torch.randn(sched.capacity_rows, 2, I, device="cuda").bfloat16(),
        }
        operands["x_sorted"], operands["d_out_sorted"], operands["dy_sorted"] = gather_sorted_rows(
            inp.x, torch.randn(T, H, device="cuda").bfloat16(), inp.topk_weights, sched, topk
        )
        spaced = torch.stack([inp.w_gate, torch.empty_like(inp.w_gate), inp.w_up])  # a gap: not packed
        operands["separate_gate_up"] = (spaced[0], spaced[2])
        padding = sched.row_source < 0
        operands["h"][padding] = 0
        operands["gate_up"][padding] = 0
        kinds = [k for k in args.kernel or CONFIGS if k in configs]
        if any(k.endswith("_fp8") for k in kinds):  # e4m3 operands and their scales, as the layer makes them
            quantized = {"dy_t": operands["dy_sorted"], "h_t": operands["h"], "x_t": operands["x_sorted"],
                         "gate_up_t": operands["gate_up"].flatten(1)}
            operands.update({name: quantize_fp8_block_sorted_t(a, sched) for name, a in quantized.items()})
            rows = {"h_q": operands["h"], "d_gate_q": operands["gate_up"][:, 0], "d_up_q": operands["gate_up"][:, 1]}
            operands.update({name: quantize_fp8_block_activations(a) for name, a in rows.items()})
            operands["w_down_q"] = fp8_block_quantize(inp.w_down)[:2]  # [E, H, I] and its scales
            operands["w_gate_t_q"], operands["w_up_t_q"] = (fp8_block_quantize(w)[2:] for w in (inp.w_gate, inp.w_up))
            operands["w_gate_q"], operands["w_up_q"] = (fp8_block_quantize(w)[:2] for w in (inp.w_gate, inp.w_up))
            operands["x_q"] = quantize_fp8_block_activations(inp.x)
        num_rows = int(sched.num_rows)  # a host sync is fine here: outside the timed calls
        for kind in kinds:
            flops = FLOPS_PER_ROUTE_HI[kind] * T * topk * H * I
            first, runnable = None, []
            candidates = configs[kind](p) if callable(configs[kind]) else configs[kind]
            for cfg in candidates:
                fn = _kernel_call(kind, cfg, inp, sched, topk, operands)
                try:
                    out = _written(kind, fn(), num_rows)
                except Exception as err:  # a config that does not fit (shared memory) is skipped, not fatal
                    print(f"{name:18s} {kind:14s} {cfg} failed: {type(err).__name__}: {str(err)[:120]}", flush=True)
                    continue
                first = out if first is None else first
                runnable.append((cfg, fn, (out.float() - first.float()).abs().max().item()))
            timed = [[] for _ in runnable]
            for r in range(args.rounds):
                for i in range(len(runnable)) if r % 2 == 0 else reversed(range(len(runnable))):
                    timed[i] += times_ms(runnable[i][1], warmup=3, reps=15)
            for (cfg, _, max_diff), times in zip(runnable, timed):
                ms = statistics.median(times)
                tflops = flops / ms / 1e9
                results.append(dict(preset=name, kernel=kind, block_m=block_m, config=cfg, ms=ms, tflops=tflops,
                                    max_abs_diff_vs_first=max_diff, rounds=args.rounds))
                print(f"{name:18s} {kind:14s} {ms:8.3f} ms {tflops:7.1f} TF  diff vs first {max_diff:.3g}  {cfg}",
                      flush=True)
    if args.out:
        write_record(args.out, results)


def write_record(path: str, results: list[dict]) -> None:
    """A JSON record of one GPU's kernel timings: the machine, the versions, the date, the command."""
    record = dict(gpu=torch.cuda.get_device_name(), num_gpus=1, torch=torch.__version__, triton=triton.__version__,
                  date=datetime.date.today().isoformat(), command="python " + " ".join(sys.argv), results=results)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
