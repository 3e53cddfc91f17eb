"""What the fp8_block kernels' per-element arithmetic costs: one kernel family timed with part
of that arithmetic cut out (the outputs are then wrong; timing only). One variant per process:
the JIT keys its cache by source, so a patched helper must be in place before the first compile.

    python benchmarks/sweeps/fp8_arithmetic_cost.py wgrad VARIANT [tune_gemm.py's options]
        the warp-specialized fp8 wgrads' per-step scaling (`gemm.hopper_common._add_scaled`), and
        their epilogue (regstore, nostore: also for the bf16 wgrads, `--kernel down_wgrad
        --kernel gate_up_wgrad`, each at the library's tile config for the preset):
        full  acc + (P · sa[m]) · sb[n]   the kernel as is
        col   acc + P · sb[n]              the column scales' loads kept, the outer product cut
        row   acc + P · sa[m]              as the scatter GEMMs (one scale per row)
        none  acc + P
        regstore  the kernel with its tiles stored from registers (the plan's fp8_ and bf16_wgrad_tma_store off)
        nostore   regstore, but each output tile reduced to one value and stored only if that
                  value is -1e-30 (never), so no tile is converted or written
    python benchmarks/sweeps/fp8_arithmetic_cost.py scatter VARIANT [tune_gemm.py's options]
        the warp-specialized fp8 scatter GEMMs (down, gate/up dgrad), whose epilogue stores each
        row of a tile to its route's slot from registers:
        full     the kernel as is
        nostore  each output tile reduced to one value and stored only if that value is -1e-30
                 (never): what the epilogue's conversion and stores cost
    python benchmarks/sweeps/fp8_arithmetic_cost.py quantizer VARIANT
        the transposing quantizers' per-element rule (`quant_fp8_block._quantize_elements`, in
        the Gluon kernel on the GPU) on the qwen3-30b and deepseek-v3-slice shapes:
        full  the kernel as is
        copy  each element only converted to e4m3 (loads, amax, scales, transpose and stores kept)
"""

import pathlib
import sys

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path[:0] = [str(pathlib.Path(__file__).parents[1]), str(pathlib.Path(__file__).parent)]
import fp8_sorted_quantizers  # noqa: E402
import tune_gemm  # noqa: E402

from mok.kernels.gemm import hopper_common, hopper_scatter, hopper_wgrad, wgrad  # noqa: E402
from mok.kernels.quant import fp8_block as quant_fp8_block  # noqa: E402
from mok.kernels.plan import override  # noqa: E402


@gluon.jit
def _column_scaled(acc, product, a_scale, b_scale, PER_COLUMN: gl.constexpr):
    return acc + product * b_scale


@gluon.jit
def _row_scaled(acc, product, a_scale, b_scale, PER_COLUMN: gl.constexpr):
    return acc + product * a_scale[:, None]


@gluon.jit
def _unscaled(acc, product, a_scale, b_scale, PER_COLUMN: gl.constexpr):
    return acc + product


@gluon.jit
def _stored_never(acc, out, out2_ptr, expert, first_row, n0, m_dim, n_dim, split_m, stride_out_e,
                  STORE_VECTOR: gl.constexpr):
    # The reduction keeps the accumulator (and so the MMAs and their scaling) live.
    total = gl.sum(gl.sum(acc, axis=1), axis=0)
    gl.store(out + expert, total.to(gl.bfloat16), mask=total == -1.0e-30)


@gluon.jit
def _scatter_stored_never(acc, y_ptr, row_source_ptr, first_row, n0, m_dim, n_dim, stride_y, SCATTER: gl.constexpr,
                          STORE_VECTOR: gl.constexpr):
    total = gl.sum(gl.sum(acc, axis=1), axis=0)
    gl.store(y_ptr + n0, total.to(y_ptr.dtype.element_ty), mask=total == -1.0e-30)


@triton.jit
def _converted_only(x, reciprocal, INTERPRETER: tl.constexpr):
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)


WGRAD = {"full": None, "col": _column_scaled, "row": _row_scaled, "none": _unscaled, "regstore": None, "nostore": None}
SCATTER = {"full": None, "nostore": _scatter_stored_never}
QUANTIZER = {"full": None, "copy": _converted_only}


def _time_quantizers(variant: str) -> None:
    for name in fp8_sorted_quantizers.SHAPES:
        rows, calls = fp8_sorted_quantizers.quantizer_calls(name)
        for what, (call, row_bytes) in calls.items():
            print(f"{variant:5s} {name:18s} {what:16s} {fp8_sorted_quantizers.time_call(call, rows, row_bytes)}",
                  flush=True)


def main() -> None:
    family, variant = sys.argv[1:3] if len(sys.argv) >= 3 else ("", "")
    variants = {"wgrad": WGRAD, "scatter": SCATTER, "quantizer": QUANTIZER}.get(family)
    if variants is None or variant not in variants:
        raise SystemExit(f"usage: fp8_arithmetic_cost.py wgrad {{{','.join(WGRAD)}}} [tune_gemm options] | "
                         f"scatter {{{','.join(SCATTER)}}} [tune_gemm options] | "
                         f"quantizer {{{','.join(QUANTIZER)}}}; got {sys.argv[1:3]}")
    del sys.argv[1:3]
    if family == "quantizer":
        if variants[variant] is not None:
            quant_fp8_block._quantize_elements = variants[variant]
        _time_quantizers(variant)
        return
    if family == "scatter":
        if variants[variant] is not None:
            hopper_scatter._scatter_store = variants[variant]
        tile = {kind: lambda p: hopper_common.fp8_block_tile_config() for kind in ("down_fp8", "gate_up_dgrad_fp8")}
        _time_gemms(variant, tile)
        return
    if variants[variant] is not None:
        hopper_common._add_scaled = variants[variant]
    if variant == "nostore":
        hopper_wgrad._wgrad_store = _stored_never
    tile = {"down_wgrad_fp8": lambda p: hopper_common.fp8_block_tile_config(stacked=False),
            "gate_up_wgrad_fp8": lambda p: hopper_common.fp8_block_tile_config(stacked=True),
            "down_wgrad": lambda p: wgrad.wgrad_config("down", p.hidden_size, p.intermediate_size),
            "gate_up_wgrad": lambda p: wgrad.wgrad_config("gate_up", p.intermediate_size, p.hidden_size)}
    register_stores = variant in ("regstore", "nostore")
    with override(fp8_wgrad_tma_store=not register_stores, bf16_wgrad_tma_store=not register_stores):
        _time_gemms(variant, tile)


def _time_gemms(variant: str, tile: dict) -> None:
    """tune_gemm.py's main over the kernels of `tile` (kind -> preset -> config), each config timed twice."""
    tune_gemm.CONFIGS = {kind: (lambda p, config=config: [config(p)] * 2) for kind, config in tile.items()}
    print(f"== {variant}", flush=True)
    tune_gemm.main()


if __name__ == "__main__":
    main()
