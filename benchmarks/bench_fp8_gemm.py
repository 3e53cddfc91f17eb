"""fp8_block against bf16 grouped GEMMs on the GPU presets: checked first, then TFLOPS side by side.

    python benchmarks/bench_fp8_gemm.py [--preset qwen3-30b ...] [--sweep] [--dgrad] [--out FILE.json]

Per preset (random routing, seed 0): one schedule serves both precisions. The weights are
quantized once outside the timing (`mok.fp8_block_quantize`: once per optimizer step in
training); x's quantization (`quantize_fp8_block_activations`) is timed on its own, since the
layer pays it every step. Before any timing, each fp8 GEMM is checked against the same
quantized math in torch (fp32, the first experts' rows) and, through the down GEMM, against
the bf16 kernels. Both precisions store g, u as training does. TFLOPS count only the routed
rows (T·topk), as `tune_gemm.py` does. `--sweep` also times the alternative fp8 tile configs
below. Each config line ends with its compiled kernel's registers per thread, spilled bytes
and shared memory. `--dgrad` also times the backward's two dgrad GEMMs (`mok.kernels.gemm.dgrad`)
in both precisions on the forward's g, u, each fp8 output first checked against the bf16
kernel's, and the quantize steps of their sorted operands on their own.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

from mok.bench.presets import GPU_PRESETS, PRESETS
from mok.fp8_block import fp8_block_dequantize, fp8_block_quantize
from mok.kernels.gemm import dgrad
from mok.kernels.gemm.common import gemm_config, routing_block_m
from mok.kernels.gemm.down import _down_scatter_kernel, down_scatter, down_scatter_fp8_block
from mok.kernels.gemm.gate_up import _gate_up_swiglu_kernel, gate_up_swiglu, gate_up_swiglu_fp8_block
from mok.kernels.routing.gather import gather_sorted_rows
from mok.kernels.quant.fp8_block import quantize_fp8_block_activations
from mok.kernels.routing.schedule import build_routing_schedule
from mok.testing import make_inputs, relative_error
from mok.testing.timing import time_ms

# Alternatives to the kernel plan's `fp8_block_*_tile` (BLOCK_K and gate/up's BLOCK_N are fixed at 128).
FP8_GATE_UP_SWEEP = [
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4),  # 192 KiB
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=16, num_warps=8, num_stages=3),
]
FP8_DOWN_SWEEP = [
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),  # 96 KiB
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=5),  # 160 KiB
    # 24 KiB per stage, 4 warps (ptxas: 153 registers): three CTAs per SM, so one CTA's scaled
    # adds can overlap another's MMAs.
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
]
_CHECKED_EXPERTS = 4  # experts whose rows the torch statement recomputes (bounds its memory)
_MAX_STATEMENT_ERR = 0.01  # bf16 output rounding plus FP8 MMA accumulation, relative L1
_MAX_VS_BF16_ERR = 0.1  # the fp8_block accuracy bar, against the bf16 kernels' y


def compiled_resources(kernel, precision: str, cfg: dict) -> str:
    """Registers per thread, spills and shared memory of `kernel` compiled for this precision
    and tile config, read from Triton 3.6's per-device JIT cache (internals: a Triton without
    them gets "n/a" rather than a failed benchmark)."""
    want = {**{k: v for k, v in cfg.items() if k.isupper()}, "PRECISION": precision}
    try:
        found = []
        for k in kernel.device_caches[torch.cuda.current_device()][0].values():
            constants = {kernel.arg_names[index[0]]: v for index, v in k.src.constants.items()}
            same_options = (k.metadata.num_warps, k.metadata.num_stages) == (cfg["num_warps"], cfg["num_stages"])
            if same_options and all(constants.get(n) == v for n, v in want.items()):
                found.append(f"{k.n_regs} regs, {k.n_spills} spills, {k.metadata.shared // 1024} KiB smem")
        return "; ".join(found)
    except AttributeError:
        return "n/a"


def check_fp8_block(inp, sched, topk, quantized, outputs, y_bf16) -> dict:
    """Relative L1 errors of the fp8 kernels' g, u, y against the same quantized math in torch
    (the first experts' rows), and of y against the bf16 kernels; raises past the bars."""
    (x_q, x_scale), w_gate, w_up, w_down = quantized
    h_q, h_scale, gate_up, y = outputs
    num_rows = int(sched.num_rows)
    rows = torch.arange(num_rows, device=y.device)
    source = sched.row_source[:num_rows].long()
    expert = sched.tile_expert.long()[rows // sched.block_m]
    keep = (source >= 0) & (expert < _CHECKED_EXPERTS)
    rows, source, expert = rows[keep], source[keep], expert[keep]
    x_deq = fp8_block_dequantize(x_q[source // topk], x_scale[source // topk])  # [routes, H] fp32
    h_deq = fp8_block_dequantize(h_q[rows], h_scale[rows])  # [routes, I] fp32
    stmt = {"gate": [], "up": [], "y": []}
    for e in range(_CHECKED_EXPERTS):
        mine = expert == e
        wg, wu, wd = (fp8_block_dequantize(q[e], s[e], (128, 128)) for q, s in (w_gate, w_up, w_down))
        stmt["gate"].append(x_deq[mine] @ wg.T)
        stmt["up"].append(x_deq[mine] @ wu.T)
        stmt["y"].append(h_deq[mine] @ wd.T)
    order = torch.cat([(expert == e).nonzero().flatten() for e in range(_CHECKED_EXPERTS)])
    errs = {
        "gate": relative_error(gate_up[rows[order], 0], torch.cat(stmt["gate"])),
        "up": relative_error(gate_up[rows[order], 1], torch.cat(stmt["up"])),
        "y": relative_error(y[source[order]], torch.cat(stmt["y"])),
    }
    errs["y_vs_bf16"] = relative_error(y, y_bf16)
    bad = {k: v for k, v in errs.items() if v > (_MAX_VS_BF16_ERR if k == "y_vs_bf16" else _MAX_STATEMENT_ERR)}
    if bad:
        raise AssertionError(f"fp8_block kernels fail their check: {bad} (all: {errs})")
    return errs


def time_dgrad(name: str, inp, sched, topk: int, gate_up: torch.Tensor) -> list[dict]:
    """The two dgrad GEMMs, bf16 then fp8_block (default tiles), after checking each fp8 output
    against the bf16 kernel's (the accuracy bars); the activation quantize steps timed on their own."""
    T, H = inp.x.shape
    I, routes, num_rows = gate_up.shape[2], T * topk, int(sched.num_rows)
    d_out = torch.randn_like(inp.x)  # [T, H] bf16
    _, d_out_sorted, _ = gather_sorted_rows(inp.x, d_out, inp.topk_weights, sched, topk)
    if dgrad.fp8_block_down_dgrad_gathers(H):  # token rows: the fp8_block down dgrad gathers them
        d_out_pair = quantize_fp8_block_activations(d_out)
    else:
        d_out_pair = quantize_fp8_block_activations(d_out_sorted)
    w_down_t = fp8_block_quantize(inp.w_down)[2:]  # [E, I, H] e4m3, [E, I/128, H/128]
    w_gate_up_t = [x for w in (inp.w_gate, inp.w_up) for x in fp8_block_quantize(w)[2:]]  # [E, H, I] pairs
    d_gate_up, _ = dgrad.down_dgrad_swiglu(d_out_sorted, inp.topk_weights, gate_up, inp.w_down, sched)
    grads = [x for j in (0, 1) for x in quantize_fp8_block_activations(d_gate_up[:, j])]  # d_g, d_u pairs
    kinds = {  # (bf16 launch, fp8_block launch, what to compare, FLOPs)
        "down_dgrad": (
            lambda: dgrad.down_dgrad_swiglu(d_out_sorted, inp.topk_weights, gate_up, inp.w_down, sched),
            lambda: dgrad.down_dgrad_swiglu_fp8_block(*d_out_pair, inp.topk_weights, gate_up, *w_down_t, sched),
            lambda out: (out[0][:num_rows], out[1]),
            2.0 * routes * H * I,
        ),
        "gate_up_dgrad": (
            lambda: dgrad.gate_up_dgrad_scatter(d_gate_up, inp.w_gate, inp.w_up, sched, routes),
            lambda: dgrad.gate_up_dgrad_scatter_fp8_block(*grads, *w_gate_up_t, sched, routes),
            lambda out: (out,),
            4.0 * routes * H * I,
        ),
    }
    records = []
    for kind, (bf16_fn, fp8_fn, compared, flops) in kinds.items():
        errs = [relative_error(a, b) for a, b in zip(compared(fp8_fn()), compared(bf16_fn()))]
        if max(errs) > _MAX_VS_BF16_ERR:
            raise AssertionError(f"{name} {kind}: fp8_block vs bf16 relative L1 {errs}")
        bf16_tflops = None
        for precision, fn in (("bf16", bf16_fn), ("fp8_block", fp8_fn)):
            ms = time_ms(fn, warmup=5, reps=30)["median"]
            tflops = flops / ms / 1e9
            bf16_tflops = bf16_tflops or tflops
            print(f"{name:18s} {kind:13s} {precision:9s} {ms:8.3f} ms {tflops:7.1f} TF  {tflops / bf16_tflops:5.2f}x bf16"
                  f"  vs bf16 {' '.join(f'{e:.2e}' for e in errs)}", flush=True)
            records.append(dict(preset=name, kernel=kind, precision=precision, ms=ms, tflops=tflops, vs_bf16=errs))
    rows = sched.capacity_rows
    for what, fn, width in (
        ("d_out quantize", lambda: quantize_fp8_block_activations(d_out_sorted), H),
        ("d_g,d_u quantize", lambda: [quantize_fp8_block_activations(d_gate_up[:, j]) for j in (0, 1)], 2 * I),
    ):
        ms = time_ms(fn, warmup=5, reps=50)["median"]
        print(f"{name:18s} {what:16s} {ms:8.3f} ms {3 * rows * width / ms / 1e6:7.0f} GB/s", flush=True)
        records.append(dict(preset=name, kernel=what, precision="fp8_block", ms=ms))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", choices=list(GPU_PRESETS))
    parser.add_argument("--sweep", action="store_true", help="also time the alternative fp8 tile configs")
    parser.add_argument("--dgrad", action="store_true", help="also time the dgrad GEMMs, bf16 and fp8_block")
    parser.add_argument("--out", default=None, help="JSON record of every timed kernel")
    args = parser.parse_args()
    records = []
    for name in args.preset or GPU_PRESETS:
        p = PRESETS[name]
        T, H, I, E, topk = p.num_tokens, p.hidden_size, p.intermediate_size, p.num_experts, p.topk
        inp = make_inputs(T, H, I, E, topk, seed=0, device="cuda")
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        sched = build_routing_schedule(inp.topk_ids, E, routing_block_m(), flag)
        routes = T * topk
        x_pair = quantize_fp8_block_activations(inp.x)
        quantized = (x_pair, *(fp8_block_quantize(w)[:2] for w in (inp.w_gate, inp.w_up, inp.w_down)))
        w_gate, w_up, w_down = quantized[1:]

        h_bf16, _ = gate_up_swiglu(inp.x, inp.w_gate, inp.w_up, sched, topk, store_gate_up=True)
        y_bf16 = down_scatter(h_bf16, inp.w_down, sched, routes)
        h_q, h_scale, gate_up = gate_up_swiglu_fp8_block(
            *x_pair, *w_gate, *w_up, sched, topk, store_gate_up=True
        )
        y = down_scatter_fp8_block(h_q, h_scale, *w_down, sched, routes)
        errs = check_fp8_block(inp, sched, topk, quantized, (h_q, h_scale, gate_up, y), y_bf16)
        summary = " ".join(f"{k} {v:.2e}" for k, v in errs.items())
        print(f"{name}: fp8_block checked, relative L1 {summary}", flush=True)

        def gate_up_fn(precision, cfg):
            if precision == "bf16":
                return lambda: gate_up_swiglu(inp.x, inp.w_gate, inp.w_up, sched, topk, None, True, cfg)
            return lambda: gate_up_swiglu_fp8_block(*x_pair, *w_gate, *w_up, sched, topk, None, True, cfg)

        def down_fn(precision, cfg):
            if precision == "bf16":
                return lambda: down_scatter(h_bf16, inp.w_down, sched, routes, cfg)
            return lambda: down_scatter_fp8_block(h_q, h_scale, *w_down, sched, routes, cfg)

        ms_x = time_ms(lambda: quantize_fp8_block_activations(inp.x), warmup=5, reps=50)["median"]
        print(f"{name:18s} {'x quantize':8s} fp8_block {ms_x:8.3f} ms {3 * T * H / ms_x / 1e6:7.0f} GB/s", flush=True)
        kinds = (
            ("gate_up", gate_up_fn, _gate_up_swiglu_kernel, I, H, 4.0 * routes * H * I, FP8_GATE_UP_SWEEP),
            ("down", down_fn, _down_scatter_kernel, H, I, 2.0 * routes * H * I, FP8_DOWN_SWEEP),
        )
        num_rows = int(sched.num_rows)
        checked = {"gate_up": gate_up[:num_rows], "down": y}  # the default fp8 configs' outputs, checked above
        for kind, make_fn, kernel, n_dim, reduce_dim, flops, sweep in kinds:
            bf16_cfg = gemm_config(kind, n_dim, reduce_dim)
            fp8_cfg = gemm_config(kind, n_dim, reduce_dim, "fp8_block")
            runs = [("bf16", bf16_cfg), ("fp8_block", fp8_cfg)] + [("fp8_block", c) for c in sweep if args.sweep]
            bf16_tflops = None
            for precision, cfg in runs:
                try:
                    fn = make_fn(precision, cfg)
                    if precision == "fp8_block" and cfg != fp8_cfg:  # a sweep config against the checked default
                        out = fn()
                        drift = relative_error(out[2][:num_rows] if kind == "gate_up" else out, checked[kind])
                        if drift > _MAX_STATEMENT_ERR:
                            raise AssertionError(f"relative L1 {drift:.2e} from the default config's output")
                    ms = time_ms(fn, warmup=5, reps=30)["median"]
                except Exception as err:  # a config that does not fit (shared memory) or fails is skipped, not fatal
                    print(f"{name:18s} {kind:8s} {precision:9s} {cfg} failed: {type(err).__name__}: {str(err)[:120]}")
                    continue
                tflops = flops / ms / 1e9
                bf16_tflops = bf16_tflops or tflops
                resources = compiled_resources(kernel, precision, cfg)
                print(
                    f"{name:18s} {kind:8s} {precision:9s} {ms:8.3f} ms {tflops:7.1f} TF  "
                    f"{tflops / bf16_tflops:5.2f}x bf16  {cfg}  [{resources}]",
                    flush=True,
                )
                records.append(dict(preset=name, kernel=kind, precision=precision, config=cfg, ms=ms, tflops=tflops,
                                    resources=resources, check=errs if precision == "fp8_block" else None))
        if args.dgrad:
            records += time_dgrad(name, inp, sched, topk, gate_up)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                     command=" ".join(sys.argv), results=records),
                f, indent=1,
            )


if __name__ == "__main__":
    main()
