"""Traffic and time model of one expert-parallel training step (forward + backward) per rank.

    python benchmarks/ep_model.py [--link-gbps 341] [--preset qwen3-30b,deepseek-v3-slice,deepseek-v3]
                                  [--ep 2,4,8,16,32,64] [--topk-ids ids.pt] [--check]

Bytes a rank sends its peers in each of the step's four exchanges (x dispatch, y combine,
dOut dispatch, dx combine), for two designs and two wire formats:

    design          rows per exchange                   per-row extras
    per-route       R = routes whose expert is remote   x: expert id (int32); dOut: w (fp32); dx: d_w (fp32)
    once-per-rank   N = (token, remote rank) pairs      x: k_l ids + k_l w (int32 + fp32); dx: k_l d_w (fp32)
                    with ≥ 1 route there                (k_l = min(topk, E_l): the routes one rank can hold)

    wire   bf16: 2·H bytes per row;  fp8: H + H/32 (e4m3 + one fp32 scale per 1×128 block)
           fp8 applies to the dispatches only (x, dOut): y and dx return in bf16.

and the predicted step time at each EP size P:

    serial:  compute + Σ exchanges
    ideal:   max(compute, Σ exchanges) + first-chunk latency (every exchange hidden under GEMMs
             in chunks of `--chunk-rows` rows: one chunk in before the first tile, one back
             after the last, per pass)
    built:   mok's overlap with `MoKConfig.overlap_comm_sms` = `--overlap-sms` C: the x
             dispatch beside the shared expert's forward, the dOut dispatch beside the shared
             expert's backward, the dx return beside the routed weight gradients; with
             `overlap_dispatch_sms` = `--overlap-dispatch-sms` C_x the x dispatch beside the
             gate/up GEMM's tiles of the rank's own tokens too, and with `overlap_return_sms` =
             `--overlap-return-sms` C_y the y return beside the down GEMM's own tiles. Each such exchange, pushed from C (C_y) programs, costs max(W·S/(S − C), its
             time at C programs) − W over the work W beside it (the persistent GEMMs leave C of
             the S SMs free). W from the compute time by FLOPs: the shared expert's forward
             6·T·H·I_s and backward twice that, the own tiles 1/P of the gate/up GEMM's
             4·T·k·H·I and of the down GEMM's 2·T·k·H·I, the routed wgrads 6·T·k·H·I, of a step
             of 3 × the forward's FLOPs; and beside the dOut dispatch the recipe's backward
             work that reads no dOut (bf16: x's sorted copy; fp8_block: hᵀ requantized), its
             HBM bytes at the measured copy rate. Without a shared expert only those copies are
             beside the dOut dispatch: it keeps 32 programs and holds no SMs. The GEMMs that run
             in two launches (gate/up with C_x, down with C_y) cost what `split_gemm_cost.py`
             measured on one GPU (`--split-records`; the nearest P of the preset's records).
    exchange = bytes / rate + 10 µs, rate = link · min(1, programs / 32): the link's rate was
             measured from 32 programs and is taken as proportional below that.

What it assumes:
- Routing: each rank's T tokens choose topk distinct experts uniformly among E (sampled,
  `--seed`), or the ids of `--topk-ids` (a `torch.save`d [T, topk] tensor); rank 0's view is
  counted (all ranks are alike under uniform routing). Expert e lives on rank e // (E/P).
- Compute: each rank's GEMM work equals one GPU's at the same T (it receives T·topk routes on
  average), so the compute time is the single-GPU fwd+bwd time of the preset, read from a
  record (bf16 wire: `--record`, fp8 wire: `--fp8-record`, whose fp8_block times they hold) or
  given by `--compute-ms`; GEMM efficiency is taken as independent of E_l and of the
  expert-side reduce of the once-per-rank design (a few % of a GEMM's bytes).
- Link: one bandwidth per direction per rank for all peers together (`--link-gbps`; the
  default is the measured peer-store rate over NVLink on H200). Beyond one NVLink domain
  (P > 8 on HGX boards) pass the network's rate instead (e.g. 50 for 400 Gb/s InfiniBand).
  In the ideal column exchanges do not slow the GEMMs (the comm SMs are taken as free).
- `deepseek-v3` is a whole DeepSeek-V3 MoE layer: E 256, topk 8, H 7168, I 2048, 8192 tokens
  per rank and one shared expert (I_s 2048); per rank it does deepseek-v3-slice's work, so it
  takes that preset's compute time.

`--check` compares the per-route, bf16, no-overlap prediction at P = 2 for qwen3-30b with the
measured step of benchmarks/results/h200-20261130-qwen3-30b-ep2-fused.json (the per-route
design with the y rows stored from the down GEMM's epilogue) and exits 1 beyond 15%.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import NamedTuple

import torch

from mok.bench.presets import PRESETS, Preset

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
# Single-GPU fwd+bwd records of the same card: bf16 from the day of the EP = 2 record, fp8_block the latest.
BF16_RECORD = RESULTS / "h200-20261130-fwd-bwd-v12.json"
FP8_RECORDS = (RESULTS / "h200-20261204-fp8-block-v39-qwen3-30b.json",
               RESULTS / "h200-20261204-fp8-block-v39-deepseek-v3-slice.json")
EP2_RECORD = RESULTS / "h200-20261130-qwen3-30b-ep2-fused.json"
# What running a GEMM in two launches over the own/others split costs (benchmarks/split_gemm_cost.py)
SPLIT_RECORDS = tuple(sorted(RESULTS.glob("h200-*-split-gemm-cost-*.json")))
EXCHANGE_LATENCY_MS = 0.010
HBM_GBPS = 4241  # H200, a device-to-device copy's bytes read + written (measured)
LINK_PROGRAMS = 32  # the programs the link rate was measured from
SMS = 132  # H100 SXM and H200
CHECK_TOLERANCE = 0.15
EXCHANGES = ("x", "y", "d_out", "dx")
DESIGNS = ("per-route", "once-per-rank")
WIRES = ("bf16", "fp8")

DEEPSEEK_V3 = Preset("deepseek-v3", 8192, 7168, 2048, 256, 8, 2048)
MODEL_PRESETS = {**{name: PRESETS[name] for name in ("qwen3-30b", "deepseek-v3-slice")}, "deepseek-v3": DEEPSEEK_V3}
COMPUTE_PRESET = {"deepseek-v3": "deepseek-v3-slice"}  # whose single-GPU time a preset takes


class Traffic(NamedTuple):
    """Rows rank 0 sends its peers in each exchange, under both designs (a NamedTuple, not a
    dataclass: the tests load this script without registering it as a module)."""

    remote_routes: int  # R
    remote_pairs: int  # N
    routes_per_rank: int  # k_l


def count_traffic(topk_ids: torch.Tensor, num_experts: int, world_size: int) -> Traffic:
    """R and N (module docstring) of rank 0's tokens `topk_ids` [T, topk]."""
    experts_per_rank = num_experts // world_size
    dest = topk_ids.long() // experts_per_rank  # [T, topk] rank of each route's expert
    remote = dest != 0
    reaches = torch.zeros(topk_ids.shape[0], world_size, dtype=torch.bool)  # [T, P]
    reaches.scatter_(1, dest, True)
    return Traffic(int(remote.sum()), int(reaches[:, 1:].sum()), min(topk_ids.shape[1], experts_per_rank))


def row_bytes(hidden: int, wire: str) -> int:
    """Bytes of one H-wide row on the wire."""
    return 2 * hidden if wire == "bf16" else hidden + hidden // 32


def exchange_bytes(traffic: Traffic, hidden: int, design: str, wire: str) -> dict[str, int]:
    """Bytes per exchange (module docstring's table)."""
    int32 = fp32 = 4
    if design == "per-route":
        rows = traffic.remote_routes
        extra = {"x": int32, "y": 0, "d_out": fp32, "dx": fp32}
    else:
        rows, k_l = traffic.remote_pairs, traffic.routes_per_rank
        extra = {"x": k_l * (int32 + fp32), "y": 0, "d_out": 0, "dx": k_l * fp32}
    width = {"x": row_bytes(hidden, wire), "y": 2 * hidden, "d_out": row_bytes(hidden, wire), "dx": 2 * hidden}
    return {kind: rows * (width[kind] + extra[kind]) for kind in EXCHANGES}


def step_ms(compute_ms: float, sent: dict[str, int], link_gbps: float, chunk_bytes: float) -> tuple[float, float]:
    """(no overlap, overlap) step time in ms."""
    exchange_ms = sum(n / (link_gbps * 1e6) + EXCHANGE_LATENCY_MS for n in sent.values())
    first_chunk_ms = 2 * 2 * (chunk_bytes / (link_gbps * 1e6) + EXCHANGE_LATENCY_MS)
    return compute_ms + exchange_ms, max(compute_ms, exchange_ms) + first_chunk_ms


def built_ms(compute_ms: float, sent: dict[str, int], link_gbps: float, preset: Preset, overlap_sms: int,
             world_size: int, return_sms: int = 0, wire: str = "bf16", split_cost: dict | None = None,
             dispatch_sms: int = 0) -> float:
    """The step with the overlap as built (module docstring), `overlap_sms` = C, `dispatch_sms` = C_x
    and `return_sms` = C_y, at P = `world_size`, with `wire`'s recipe (bf16 or fp8_block);
    `split_cost`: the gate/up and down GEMMs' extra time in two launches, as fractions
    ({"gate_up": f, "down": f}; none: 0)."""
    def exchange(kind: str, programs: int) -> float:
        rate = link_gbps * min(1.0, programs / LINK_PROGRAMS)
        return sent[kind] / (rate * 1e6) + EXCHANGE_LATENCY_MS

    routed = preset.num_tokens * preset.topk * preset.hidden_size * preset.intermediate_size
    shared = preset.num_tokens * preset.hidden_size * preset.shared_intermediate_size
    ms_per_unit = compute_ms / (3 * (routed + shared))
    # the gate/up GEMM is 4 of the forward's 6·T·k·H·I, the down GEMM 2
    gate_up_ms, down_ms = 2 / 3 * routed * ms_per_unit, 1 / 3 * routed * ms_per_unit
    prepare_ms = prepare_backward_bytes(preset, sent, world_size, wire) / (HBM_GBPS * 1e6)
    split_cost = split_cost or {}
    # each exchange: (its programs, the persistent GEMMs beside it, the copies beside it); 0 programs: serial
    if dispatch_sms:
        x_dispatch = (dispatch_sms, shared * ms_per_unit + gate_up_ms / world_size, 0.0)
    else:
        x_dispatch = (overlap_sms, shared * ms_per_unit, 0.0)
    beside = {"x": x_dispatch, "y": (return_sms, down_ms / world_size, 0.0),
              "d_out": (overlap_sms, 2 * shared * ms_per_unit, prepare_ms),
              "dx": (overlap_sms, routed * ms_per_unit, 0.0)}
    step = compute_ms
    step += split_cost.get("gate_up", 0.0) * gate_up_ms if dispatch_sms else 0.0  # the GEMMs in two launches
    step += split_cost.get("down", 0.0) * down_ms if return_sms else 0.0
    for kind in EXCHANGES:
        programs, gemms, copies = beside[kind]
        if programs == 0:
            step += exchange(kind, LINK_PROGRAMS)
        elif gemms == 0.0:  # copies alone, or nothing: the config's programs, no SM held
            step += max(copies, exchange(kind, LINK_PROGRAMS)) - copies
        else:
            step += max(gemms * SMS / (SMS - programs) + copies, exchange(kind, programs)) - gemms - copies
    return step


def prepare_backward_bytes(preset: Preset, sent: dict[str, int], world_size: int, wire: str) -> int:
    """HBM bytes (read + written) of the recipe's backward work that reads no dOut, per rank: bf16,
    x's sorted copy (each received row read once, T·k rows of H bf16 written; received rows: the
    pairs with peers, `sent["y"]` / 2H, and as many of the rank's own per peer, P / (P − 1) of
    them); fp8_block, hᵀ requantized down the rows (T·k rows of I e4m3 read and written)."""
    routes = preset.num_tokens * preset.topk
    if wire == "fp8":
        return 2 * routes * preset.intermediate_size
    received = sent["y"] // (2 * preset.hidden_size) * world_size // max(1, world_size - 1)
    return (routes + received) * preset.hidden_size * 2


def record_ms(paths, preset: str, precision: str) -> float | None:
    """The single-GPU mok fwd+bwd time of `preset` in `precision` from the first record that has it."""
    for path in paths:
        for r in json.loads(pathlib.Path(path).read_text())["results"]:
            if (r.get("impl"), r.get("pass"), r.get("preset"), r.get("precision"), r.get("ep", 1)) == (
                    "mok", "fwd+bwd", preset, precision, 1):
                return float(r["ms"])
    return None


def measured_ep2_ms() -> float:
    for r in json.loads(EP2_RECORD.read_text())["results"]:
        if (r["impl"], r["pass"], r["precision"], r["ep"]) == ("mok", "fwd+bwd", "bf16", 2):
            return float(r["ms"])
    raise ValueError(f"{EP2_RECORD.name}: no mok bf16 fwd+bwd result at ep 2")


def compute_times(args) -> dict[tuple[str, str], float]:
    """(preset, wire) -> single-GPU fwd+bwd ms: `--compute-ms` overrides, else the records."""
    times = {}
    for name in MODEL_PRESETS:
        source = COMPUTE_PRESET.get(name, name)
        times[name, "bf16"] = record_ms([args.record], source, "bf16")
        times[name, "fp8"] = record_ms(args.fp8_record, source, "fp8_block")
    for item in args.compute_ms:
        name, _, value = item.partition("=")
        preset, _, wire = name.partition(":")
        if preset not in MODEL_PRESETS or wire not in ("", *WIRES):
            raise ValueError(f"--compute-ms: expected PRESET[:WIRE]=MS with PRESET in {sorted(MODEL_PRESETS)} and "
                             f"WIRE in {WIRES}, got {item!r}")
        for w in (wire,) if wire else WIRES:
            times[preset, w] = float(value)
    return times


def split_costs(paths) -> dict[tuple[str, int, str], dict[str, float]]:
    """(preset, P, wire) -> {"gate_up": f, "down": f} from split_gemm_cost.py's records."""
    costs: dict = {}
    for path in paths:
        record = json.loads(pathlib.Path(path).read_text())
        for r in record["results"]:
            gemm, precision = r["gemm"].split()
            wire = "bf16" if precision == "bf16" else "fp8"
            costs.setdefault((record["preset"], record["ep"], wire), {})[gemm] = r["cost"]
    return costs


def split_cost_for(costs: dict, preset: str, world_size: int, wire: str) -> dict[str, float]:
    """The measured split cost of `preset` (the preset whose compute time it takes) at the nearest
    P measured, or an empty dict where none was."""
    preset = COMPUTE_PRESET.get(preset, preset)
    measured = [p for (name, p, w) in costs if name == preset and w == wire]
    if not measured:
        return {}
    return costs[preset, min(measured, key=lambda p: abs(p - world_size)), wire]


def model_rows(preset: Preset, world_sizes, compute: dict, link_gbps: float, chunk_rows: int, seed: int,
               topk_ids: torch.Tensor | None = None, overlap_sms: int = 4, return_sms: int = 0,
               costs: dict | None = None, dispatch_sms: int = 0) -> list[dict]:
    """One dict per (P, design, wire): bytes per exchange, compute and step times."""
    rows = []
    ids = topk_ids
    if ids is None:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.rand(preset.num_tokens, preset.num_experts, generator=gen).topk(preset.topk, dim=1).indices
    for world_size in world_sizes:
        if preset.num_experts % world_size:
            rows.append({"preset": preset.name, "ep": world_size, "skipped": f"E={preset.num_experts} not divisible"})
            continue
        traffic = count_traffic(ids, preset.num_experts, world_size)
        for design in DESIGNS:
            for wire in WIRES:
                sent = exchange_bytes(traffic, preset.hidden_size, design, wire)
                compute_ms = compute[preset.name, wire]
                chunk = chunk_rows * row_bytes(preset.hidden_size, wire)
                plain, overlapped = (None, None) if compute_ms is None else step_ms(compute_ms, sent, link_gbps, chunk)
                cost = split_cost_for(costs or {}, preset.name, world_size, wire)
                built = None if compute_ms is None else built_ms(compute_ms, sent, link_gbps, preset, overlap_sms,
                                                                 world_size, return_sms, wire, cost, dispatch_sms)
                rows.append({"preset": preset.name, "ep": world_size, "design": design, "wire": wire,
                             "bytes": sent, "rows": traffic.remote_routes if design == "per-route"
                             else traffic.remote_pairs, "compute_ms": compute_ms, "step_ms": plain,
                             "overlap_ms": overlapped, "built_ms": built})
    return rows


def _fmt_ms(value: float | None) -> str:
    return "     —" if value is None else f"{value:6.2f}"


def print_table(rows: list[dict], link_gbps: float, overlap_sms: int, return_sms: int, dispatch_sms: int) -> None:
    print(f"bytes a rank sends its peers per exchange (MB) and fwd+bwd step (ms) at {link_gbps:g} GB/s per direction; "
          f"built: overlap_comm_sms = {overlap_sms}, overlap_dispatch_sms = {dispatch_sms}, "
          f"overlap_return_sms = {return_sms}")
    print(f"{'preset':18} {'EP':>3} {'design':14} {'wire':4} {'rows':>8} {'x':>8} {'y':>8} {'dOut':>8} {'dx':>8} "
          f"{'total':>8} {'compute':>7} {'serial':>6} {'ideal':>6} {'built':>6}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['preset']:18} {r['ep']:>3} ({r['skipped']})")
            continue
        mb = [r["bytes"][k] / 1e6 for k in EXCHANGES]
        print(f"{r['preset']:18} {r['ep']:>3} {r['design']:14} {r['wire']:4} {r['rows']:>8} "
              + " ".join(f"{v:8.1f}" for v in mb) + f" {sum(mb):8.1f} {_fmt_ms(r['compute_ms']):>7} "
              f"{_fmt_ms(r['step_ms'])} {_fmt_ms(r['overlap_ms'])} {_fmt_ms(r['built_ms'])}")


def check_ep2(rows: list[dict]) -> tuple[float, float]:
    """(predicted, measured) qwen3-30b per-route bf16 no-overlap step at P = 2."""
    predicted = next(r["step_ms"] for r in rows if r["preset"] == "qwen3-30b" and r.get("ep") == 2
                     and r.get("design") == "per-route" and r.get("wire") == "bf16")
    return predicted, measured_ep2_ms()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=",".join(MODEL_PRESETS), help=f"comma-separated, of {sorted(MODEL_PRESETS)}")
    parser.add_argument("--ep", default="2,4,8,16,32,64", help="EP sizes")
    parser.add_argument("--link-gbps", type=float, default=341.0, help="GB/s per direction per rank")
    parser.add_argument("--chunk-rows", type=int, default=1024, help="rows of one overlap step")
    parser.add_argument("--overlap-sms", type=int, default=4, help="MoKConfig.overlap_comm_sms of the built column")
    parser.add_argument("--overlap-dispatch-sms", type=int, default=0,
                        help="MoKConfig.overlap_dispatch_sms of the built column")
    parser.add_argument("--overlap-return-sms", type=int, default=0,
                        help="MoKConfig.overlap_return_sms of the built column")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--topk-ids", help="a torch.save'd [T, topk] tensor of global ids, used for every preset")
    parser.add_argument("--record", default=str(BF16_RECORD), help="single-GPU record of the bf16 compute times")
    parser.add_argument("--fp8-record", nargs="*", default=[str(p) for p in FP8_RECORDS],
                        help="single-GPU records of the fp8_block compute times")
    parser.add_argument("--compute-ms", nargs="*", default=[], help="PRESET[:WIRE]=MS overrides")
    parser.add_argument("--split-records", nargs="*", default=[str(p) for p in SPLIT_RECORDS],
                        help="split_gemm_cost.py records of the built column's two-launch GEMMs (none: free)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--check", action="store_true", help="compare with the measured EP = 2 step (exit 1 beyond 15%%)")
    args = parser.parse_args(argv)
    for name, value in (("--overlap-sms", args.overlap_sms), ("--overlap-dispatch-sms", args.overlap_dispatch_sms),
                        ("--overlap-return-sms", args.overlap_return_sms)):
        if not 0 <= value < SMS:
            raise ValueError(f"{name}: expected 0 <= C < {SMS}, got {value}")
    names = args.preset.split(",")
    for name in names:
        if name not in MODEL_PRESETS:
            raise ValueError(f"--preset: expected names of {sorted(MODEL_PRESETS)}, got {name!r}")
    world_sizes = [int(p) for p in args.ep.split(",")]
    topk_ids = torch.load(args.topk_ids) if args.topk_ids else None
    compute = compute_times(args)
    rows = [r for name in names for r in model_rows(MODEL_PRESETS[name], world_sizes, compute, args.link_gbps,
                                                     args.chunk_rows, args.seed, topk_ids, args.overlap_sms,
                                                     args.overlap_return_sms, split_costs(args.split_records),
                                                     args.overlap_dispatch_sms)]
    print_table(rows, args.link_gbps, args.overlap_sms, args.overlap_return_sms, args.overlap_dispatch_sms)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.check:
        predicted, measured = check_ep2(rows)
        off = predicted / measured - 1
        print(f"check: qwen3-30b EP=2 per-route bf16, predicted {predicted:.2f} ms, measured {measured:.2f} ms "
              f"({EP2_RECORD.name}): {off:+.1%}")
        return 0 if abs(off) <= CHECK_TOLERANCE else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
