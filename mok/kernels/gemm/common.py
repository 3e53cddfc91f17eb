"""What the grouped GEMMs of the expert MLPs share (`gate_up.py`, `down.py`, `dgrad.py`, `wgrad.py`
and their Hopper kernels beside them), over the expert-sorted row layout of `routing/schedule.py`:

- the forward GEMMs' tile chooser (`gemm_config`, `routing_block_m`) and the checks of a tile config;
- the launchers' checks of their operands (bf16 weights, fp8_block pairs of e4m3 data and scales);
- the Triton main loops over sorted rows (`sorted_rows_tile`, through TMA) and over token rows
  gathered by index (`gathered_rows_tile_fp8`), and the epilogues' store of a tile's rows to their
  route slots (`scatter_rows_to_slots`);
- the grid of a launch over [rows, H] tiles (the down GEMM, the gate/up dgrad), its last wave in
  column halves (`scatter_grid`, `last_wave_config`).

Legend: r a row of the sorted layout, src(r) = row_source[r] = t·topk + j (−1: padding),
e = tile_expert[r // BLOCK_M], H hidden, I intermediate size, E_l local experts.

fp8_block (the constexpr PRECISION, launchers `*_fp8_block`): the GEMMs' kernels
on E4M3 operands aq, wq with fp32 block scales, one per 1×128 block of an activation row
(sa: x's or h's) and one per 128×128 block of a weight (sw), applied per 128-wide K step:

    acc[r, n] = Σ_kb  sa[r, kb] · sw[e, n // 128, kb] · Σ_{k in block kb} aq[r, k] · wq[e, n, k]     (fp32)

BLOCK_K = 128, so each K step is one fresh FP8 `tl.dot` followed by one scaled fp32 add:
the DeepSeek-V3 recipe, which also bounds what Hopper's FP8 MMA loses to its narrow
internal accumulator to 128 terms. Hopper's FP8 MMA needs both operands K-major in
shared memory: gathered x rows, h rows and the [N, K] weight tiles all have K contiguous.
H and I must be multiples of 128, so no K step or h block is ragged.

Every output element is computed by one program with a fixed K loop: deterministic.
Caller contract: the schedule was built for these tensors with the same BLOCK_M.
Tile configs are chosen per shape class by `gemm_config` (measured on H200, see
benchmarks/LOG.md); the key never includes per-expert counts, which change every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.fp8_block import FP8_BLOCK
from mok.kernels.common import interpreting, launch_programs, num_sms, round_to_bf16
from mok.kernels.gemm import hopper_common
from mok.kernels.plan import kernel_plan
from mok.kernels.routing.schedule import RoutingSchedule

_SCALE_BLOCK = tl.constexpr(FP8_BLOCK)  # kernels read only constexpr globals


@triton.jit
def load_weight_tile(w_desc, expert, n0, k0, n_dim):
    """[BLOCK_K, BLOCK_N] tile of W[expert]ᵀ through a TMA descriptor over all experts' rows
    ([E·n_dim, k_dim], block [BLOCK_N, BLOCK_K]). Rows past this expert's n_dim belong to
    the next expert (zeros past the last): callers mask those columns at the store."""
    return w_desc.load([expert * n_dim + n0, k0]).T


@triton.jit
def weight_block_scale(w_scale_ptr, expert, n0, k0, n_dim, reduce_dim):
    """fp32 scale of the 128×128 block of W[expert] holding row n0 and column k0, from the
    contiguous [E, n_dim/128, reduce_dim/128] scales of `mok.fp8_block_quantize`."""
    block_row = expert.to(tl.int64) * (n_dim // _SCALE_BLOCK) + n0 // _SCALE_BLOCK
    return tl.load(w_scale_ptr + block_row * (reduce_dim // _SCALE_BLOCK) + k0 // _SCALE_BLOCK)


@triton.jit
def sorted_rows_tile(
    a_desc, a_scale_ptr, w_desc, w_scale_ptr, m0, expert, n0, reduce_dim, n_dim, stride_a_scale_r, acc,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """acc + a[m0 : m0+BLOCK_M] · W[expert][n0 : n0+BLOCK_N]ᵀ, [BLOCK_M, BLOCK_N] fp32, over
    contiguous sorted rows; both operands through TMA descriptors, W[expert] [n_dim,
    reduce_dim] (K-major). fp8_block: both e4m3 with their block scales (a_scale [rows,
    reduce_dim/128] with rows `stride_a_scale_r` apart; BLOCK_N divides 128, so one weight scale
    per step); else bf16 and the scale pointers unused. Also the fp8_block dgrad GEMMs' main
    loop (`dgrad.py`)."""
    for k0 in range(0, reduce_dim, BLOCK_K):
        a = a_desc.load([m0, k0])
        b = load_weight_tile(w_desc, expert, n0, k0, n_dim)
        if PRECISION == "fp8_block":
            rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
            a_scale = tl.load(a_scale_ptr + rows * stride_a_scale_r + k0 // _SCALE_BLOCK)  # [BLOCK_M] fp32
            w_scale = weight_block_scale(w_scale_ptr, expert, n0, k0, n_dim, reduce_dim)
            acc += tl.dot(a, b) * (a_scale[:, None] * w_scale)
        else:
            if INTERPRETER:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def gathered_rows_tile_fp8(
    a_ptr, a_scale_ptr, token, row_valid, w_desc, w_scale_ptr, expert, n0, reduce_dim, n_dim, stride_a_t, acc,
    BLOCK_K: tl.constexpr,
):
    """acc + Σ_kb (a[token] · W[expert][n0 : n0+BLOCK_N]ᵀ) with the fp8_block scales applied per
    K step: a's rows gathered by token from e4m3 token rows [T, reduce_dim] (scales [T,
    reduce_dim/128]), W[expert] [n_dim, reduce_dim] (K-major) through `w_desc`. Rows not
    `row_valid` (padding) read zeros with scale 0, so they add exactly nothing. `sorted_rows_tile`
    with a's rows gathered by index instead of through TMA: the fp8_block down dgrad's main loop
    where it reads dOut's token rows (`dgrad.py`)."""
    k_offs = tl.arange(0, BLOCK_K)
    token64 = token.to(tl.int64)
    a_ptrs = a_ptr + token64[:, None] * stride_a_t + k_offs[None, :]
    a_scale_ptrs = a_scale_ptr + token64 * (reduce_dim // _SCALE_BLOCK)
    for k0 in range(0, reduce_dim, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=row_valid[:, None], other=0.0)
        b = load_weight_tile(w_desc, expert, n0, k0, n_dim)
        a_scale = tl.load(a_scale_ptrs + k0 // _SCALE_BLOCK, mask=row_valid, other=0.0)  # [BLOCK_M] fp32
        w_scale = weight_block_scale(w_scale_ptr, expert, n0, k0, n_dim, reduce_dim)
        acc += tl.dot(a, b) * (a_scale[:, None] * w_scale)
    return acc


@triton.jit
def scatter_rows_to_slots(
    out_ptr, tile, row_source_ptr, rows, n_offs, n_dim, stride_out_s,
    SORTED: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """out[row_source[r], n_offs] = bf16(tile[r]) for each sorted row r of the tile; padding
    rows (source −1) and columns past n_dim store nothing. SORTED: every row to out[r] instead
    (padding rows too), the sorted layout that `combine` gathers."""
    values = round_to_bf16(tile, INTERPRETER)
    col_ok = (n_offs < n_dim)[None, :]
    if SORTED:
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out_s + n_offs[None, :], values, mask=col_ok)
        return
    source = tl.load(row_source_ptr + rows)
    slot = tl.where(source >= 0, source, 0).to(tl.int64)
    tl.store(out_ptr + slot[:, None] * stride_out_s + n_offs[None, :], values, mask=(source >= 0)[:, None] & col_ok)


# --------------------------------------------------------------------------- configs

# Tile sizes, thresholds and variant flags are the kernel plan's (`plan.KernelPlan`, with each
# choice's reasons and records).


def gemm_config(
    kind: str, n_dim: int, reduce_dim: int, precision: str = "bf16", packed_gate_up: bool = False,
    allow_warp_specialized: bool = True,
) -> dict:
    """Tile config for a GEMM of output width n_dim and reduction reduce_dim (gate/up:
    `packed_gate_up` when its weights are one tensor, `gate_up_packed`; down:
    `allow_warp_specialized` False keeps the Triton kernel).

    H200, bf16, chosen by `benchmarks/tune_gemm.py` on the three GPU presets (records
    h200-20261130-gemm-tiles.json, -tiles-v2.json): 128×128 tiles with two accumulators
    for gate/up and 128×256 for the single-accumulator down GEMM at 8 warps, 4 stages;
    TMA loads of the weights beat pointer loads; 128×64 / 64×128 tiles at 4 warps lose;
    gate/up reads x copied to the sorted layout from
    `sorted_x_min_inter` on, unless it takes packed weights (`packed_max_inter`); the
    down GEMM runs persistent up to `persistent_down_max_inter` (record
    h200-20261130-persistent.json), and per tile above it, its last wave in column halves
    with `split_last_wave`. Under the interpreter, small tiles keep the CPU tests
    fast (BLOCK_M 32, a whole MXFP8 block of rows).
    On Hopper the bf16 down GEMM into local slots runs warp-specialized (ping-pong) up to
    `ping_pong_down_max_inter`, and cooperative above it with `cooperative_down`.
    fp8_block: the plan's `fp8_block_*_tile`, the same for every shape until measured; on Hopper the down
    GEMM into local slots warp-specialized with `warp_specialized_fp8_block_down`, the gate/up
    GEMM with `warp_specialized_fp8_block_gate_up`. Every threshold and flag named here is a
    field of the kernel plan (`plan.kernel_plan`).
    """
    plan = kernel_plan()
    if precision == "fp8_block":
        measured_faster = {"down": plan.warp_specialized_fp8_block_down,
                           "gate_up": plan.warp_specialized_fp8_block_gate_up}[kind]
        if measured_faster and allow_warp_specialized and plan.warp_specialized:
            return hopper_common.fp8_block_tile_config()
        return dict(plan.fp8_block_interpreter_tile if interpreting() else
                    {"down": plan.fp8_block_down_tile, "gate_up": plan.fp8_block_gate_up_tile}[kind])
    if interpreting():
        split = dict(SPLIT_LAST_WAVE=plan.split_last_wave) if kind == "down" else {}
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1, **split)
    if kind == "gate_up":
        packed = packed_gate_up and n_dim < plan.packed_max_inter
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=plan.gemm_group_m, num_warps=8, num_stages=4,
                    PACKED=packed, X_SORTED=not packed and n_dim >= plan.sorted_x_min_inter)
    cooperative = reduce_dim > plan.ping_pong_down_max_inter
    if allow_warp_specialized and (plan.cooperative_down or not cooperative) and plan.warp_specialized:
        return hopper_common.tile_config(cooperative)
    persistent = reduce_dim <= plan.persistent_down_max_inter
    return dict(BLOCK_M=128, BLOCK_N=256 if n_dim >= 2048 else 128, BLOCK_K=64, GROUP_M=plan.gemm_group_m, num_warps=8,
                num_stages=3 if persistent else 4, PERSISTENT=persistent, SPLIT_LAST_WAVE=plan.split_last_wave)


def routing_block_m() -> int:
    """The M tile every grouped GEMM of a schedule uses (the schedule pads experts to it)."""
    return gemm_config("gate_up", 0, 0)["BLOCK_M"]


def checked_tile_config(
    tile_config: dict | None, default: dict, schedule: RoutingSchedule, precision: str, what: str, whole_block_n: bool
) -> dict:
    """`tile_config` or `default`, checked against the schedule's M tile and, in fp8_block,
    the scale block (`what` names the GEMM in errors; `whole_block_n`: BLOCK_N must be 128).
    The warp-specialized kernels check their fp8_block tiles themselves."""
    cfg = tile_config or default
    if cfg["BLOCK_M"] != schedule.block_m:
        raise ValueError(f"schedule: expected block_m {cfg['BLOCK_M']}, got {schedule.block_m}")
    if precision == "fp8_block" and not cfg.get("WARP_SPECIALIZED", False):
        check_fp8_block_tiles(cfg, what, whole_block_n)
    return cfg


def _tile_config(
    kind: str, n_dim: int, reduce_dim: int, precision: str, tile_config: dict | None, schedule: RoutingSchedule,
    packed_gate_up: bool = False, allow_warp_specialized: bool = True,
) -> dict:
    default = gemm_config(kind, n_dim, reduce_dim, precision, packed_gate_up, allow_warp_specialized)
    return checked_tile_config(tile_config, default, schedule, precision, kind, kind == "gate_up")


def check_fp8_block_tiles(cfg: dict, gemm: str, whole_block_n: bool) -> None:
    """fp8_block tiles: BLOCK_K is the scale block; BLOCK_N is it too when an epilogue
    quantizes each tile row as one 1×128 block (`whole_block_n`), else a divisor of it (one
    weight scale per K step)."""
    n_ok = cfg["BLOCK_N"] == FP8_BLOCK if whole_block_n else FP8_BLOCK % cfg["BLOCK_N"] == 0
    if cfg["BLOCK_K"] != FP8_BLOCK or not n_ok:
        want_n = f"{FP8_BLOCK}" if whole_block_n else f"a divisor of {FP8_BLOCK}"
        raise ValueError(
            f"tile_config: expected BLOCK_K {FP8_BLOCK} and BLOCK_N {want_n} for the fp8_block {gemm} GEMM, "
            f"got BLOCK_K {cfg['BLOCK_K']} BLOCK_N {cfg['BLOCK_N']}"
        )


# --------------------------------------------------------------------------- launchers


def check_contiguous(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...],
                     device) -> None:
    """t: a contiguous tensor of one of `dtypes`, of `shape`, on `device` (else ValueError naming it)."""
    if t.dtype not in dtypes or tuple(t.shape) != shape or not t.is_contiguous() or t.device != device:
        expected = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"{name}: expected a contiguous {expected} tensor of shape {list(shape)} on {device}, "
            f"got {t.dtype} {list(t.shape)} on {t.device}"
        )


def _check_weights(name: str, w: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    """w: a contiguous bf16 tensor of `shape` on `device` (weights, and the bf16 operands beside them)."""
    if w.dtype != torch.bfloat16 or tuple(w.shape) != shape or not w.is_contiguous() or w.device != device:
        raise ValueError(
            f"{name}: expected a contiguous bf16 tensor of shape {list(shape)} on {device}, "
            f"got {w.dtype} {list(w.shape)} on {w.device}"
        )


def _rows_strided(t: torch.Tensor, alignment: int) -> bool:
    """A 2-D tensor whose rows are contiguous and `alignment` bytes apart or a multiple of that."""
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % alignment == 0


def check_fp8_block_pair(
    q_name: str, q: torch.Tensor, scale_name: str, scale: torch.Tensor, shape: tuple[int, ...],
    block: tuple[int, int], device: torch.device, strided_rows: bool = False,
) -> None:
    """q: contiguous e4m3 of `shape` on `device`; scale: contiguous fp32, one per `block` of q's
    last two dims. With `strided_rows` (2-D pairs) each may also have rows further apart, as
    views of a wider tensor's column range are: q's a multiple of 16 bytes (its TMA descriptor)."""
    *lead, rows, cols = shape
    scale_shape = (*lead, rows // block[0], cols // block[1])
    checks = ((q_name, q, torch.float8_e4m3fn, shape), (scale_name, scale, torch.float32, scale_shape))
    for name, t, dtype, want in checks:
        laid_out = t.is_contiguous() or (strided_rows and _rows_strided(t, 16 if name == q_name else 4))
        if t.dtype != dtype or tuple(t.shape) != want or not laid_out or t.device != device:
            layout = "" if laid_out else " non-contiguous"
            expected = "a row-contiguous" if strided_rows else "a contiguous"
            raise ValueError(
                f"{name}: expected {expected} {str(dtype).removeprefix('torch.')} tensor of shape {list(want)} "
                f"on {device}, got {t.dtype} {list(t.shape)}{layout} on {t.device}"
            )


def fp8_block_weight_shape(name: str, w: torch.Tensor, layout: str, num_local_experts: int) -> tuple[int, int, int]:
    """[E_l, N, K] of a quantized weight whose N and K are multiples of the scale block."""
    if w.dim() != 3 or w.shape[0] != num_local_experts or w.shape[1] % FP8_BLOCK or w.shape[2] % FP8_BLOCK:
        raise ValueError(
            f"{name}: expected a 3-D {layout} tensor with E_l = {num_local_experts} (the schedule's) and "
            f"both other sizes multiples of {FP8_BLOCK} (fp8_block), got shape {list(w.shape)}"
        )
    return tuple(w.shape)


def scatter_grid(schedule: RoutingSchedule, hidden: int, cfg: dict) -> int:
    """Programs of a launch whose tiles cover [schedule rows, hidden] (the down GEMM, the
    gate/up dgrad): one per tile, or with cfg["PERSISTENT"] one per SM (at most one per
    tile); one per tile with cfg["SPLIT_LAST_WAVE"], num_sms // 2 more for the last wave's
    half tiles (`kernels.common.last_wave_tile_coordinates`; persistent launches keep whole tiles)."""
    device = schedule.row_source.device
    programs = launch_programs(schedule.max_tiles * triton.cdiv(hidden, cfg["BLOCK_N"]), cfg, device)
    return programs + (num_sms(device) // 2 if splits_last_wave(cfg) else 0)


def splits_last_wave(cfg: dict) -> bool:
    """Whether a launch with tile config `cfg` computes its last wave's tiles as column halves:
    SPLIT_LAST_WAVE on a per-tile (not persistent) launch."""
    return cfg.get("SPLIT_LAST_WAVE", False) and not cfg.get("PERSISTENT", False)


def last_wave_config(cfg: dict) -> dict:
    """The tile config of the last wave's half tiles (SPLIT_LAST_WAVE): BLOCK_N halved, for
    their weights' TMA blocks; `cfg` itself when it does not split."""
    return dict(cfg, BLOCK_N=cfg["BLOCK_N"] // 2) if splits_last_wave(cfg) else cfg
