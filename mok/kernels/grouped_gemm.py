"""Grouped GEMMs of the expert MLPs over the expert-sorted row layout of `schedule.py`.

    gate/up:  h[r] = silu(x[src(r) // topk] · Wg[e]ᵀ) · (x[src(r) // topk] · Wu[e]ᵀ)   (fp32, stored bf16)
    down:     y[src(r)] = h[r] · Wd[e]ᵀ                                              (unweighted, bf16)

Legend: r a row of the sorted layout, src(r) = row_source[r] = t·topk + j (−1: padding),
e = tile_expert[r // BLOCK_M], H hidden, I intermediate size, E_l local experts.

The gate/up kernel gathers token rows by index inside its loads (no permuted copy of x)
and keeps two accumulators, so g and u never leave registers before SwiGLU; with
`swiglu_limit` L it applies g ← min(g, L), u ← clamp(u, −L, L) in fp32. When the
backward needs them it also stores the pre-activations g and u ([rows, 2, I] bf16), so
the backward recomputes h from them instead of redoing the gate/up GEMM.
The down kernel scatters each row's y straight into its combine slot src(r), so no
un-permute pass exists. Padding rows compute zeros and store nothing.

Every output element is computed by one program with a fixed K loop: deterministic.
Caller contract: the schedule was built for these tensors with the same BLOCK_M.
Tile configs are chosen per shape class by `_gemm_config` (measured on H200, see
BENCHMARKS.md); the key never includes per-expert counts, which change every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mok.kernels.common import interpreting, round_to_bf16
from mok.kernels.schedule import RoutingSchedule
from mok.kernels.swiglu import swiglu_forward


@triton.jit
def tile_coordinates(pid, max_m_tiles, num_n_tiles, GROUP_M: tl.constexpr):
    """(m_tile, n_tile) of program `pid`, walking GROUP_M row tiles per column sweep so
    consecutive programs reuse the same weight tiles from L2."""
    tiles_per_group = GROUP_M * num_n_tiles
    group = pid // tiles_per_group
    first_m = group * GROUP_M
    group_rows = min(max_m_tiles - first_m, GROUP_M)
    m_tile = first_m + (pid % tiles_per_group) % group_rows
    n_tile = (pid % tiles_per_group) // group_rows
    return m_tile, n_tile


@triton.jit
def load_weight_tile(w_desc, expert, n0, k0, n_dim):
    """[BLOCK_K, BLOCK_N] tile of W[expert]ᵀ through a TMA descriptor over all experts' rows
    ([E·n_dim, k_dim], block [BLOCK_N, BLOCK_K]). Rows past this expert's n_dim belong to
    the next expert (zeros past the last): callers mask those columns at the store."""
    return w_desc.load([expert * n_dim + n0, k0]).T


@triton.jit
def gather_gate_up_tile(
    x_ptr, w_gate_desc, w_up_desc, token, row_valid, expert, n0, hidden, inter, stride_x_t,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """g, u [BLOCK_M, BLOCK_N] fp32 for token rows `token` (gathered from x inside the
    loads) against rows n0.. of expert `expert`'s gate and up weights, reducing over H."""
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_offs = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token.to(tl.int64)[:, None] * stride_x_t + k_offs[None, :]
    for k0 in range(0, hidden, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=row_valid[:, None] & (k0 + k_offs < hidden)[None, :], other=0.0)
        b_gate = load_weight_tile(w_gate_desc, expert, n0, k0, inter)
        b_up = load_weight_tile(w_up_desc, expert, n0, k0, inter)
        if INTERPRETER:  # the interpreter's bf16 tl.dot is wrong (DESIGN §6); fp32 is exact
            a, b_gate, b_up = a.to(tl.float32), b_gate.to(tl.float32), b_up.to(tl.float32)
        acc_gate = tl.dot(a, b_gate, acc_gate)
        acc_up = tl.dot(a, b_up, acc_up)
    return acc_gate, acc_up


@triton.jit
def _gate_up_swiglu_kernel(
    # pointers
    x_ptr, w_gate_desc, w_up_desc, h_ptr, gate_up_ptr,
    # schedule
    row_source_ptr, tile_expert_ptr, num_rows_ptr,
    # sizes
    hidden, inter, topk, max_m_tiles, swiglu_limit,
    # strides
    stride_x_t, stride_h_r, stride_gu_r,
    # meta
    HAS_LIMIT: tl.constexpr, STORE_GATE_UP: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    m_tile, n_tile = tile_coordinates(tl.program_id(0), max_m_tiles, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if m_tile * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(tile_expert_ptr + m_tile)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    source = tl.load(row_source_ptr + rows)
    row_valid = source >= 0
    token = tl.where(row_valid, source // topk, 0)
    n_offs = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    gate, up = gather_gate_up_tile(
        x_ptr, w_gate_desc, w_up_desc, token, row_valid, expert, n_tile * BLOCK_N, hidden, inter, stride_x_t,
        BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETER,
    )
    out_mask = n_offs[None, :] < inter
    rows64 = rows.to(tl.int64)[:, None]
    h = swiglu_forward(gate, up, swiglu_limit, HAS_LIMIT)
    tl.store(h_ptr + rows64 * stride_h_r + n_offs[None, :], round_to_bf16(h, INTERPRETER), mask=out_mask)
    if STORE_GATE_UP:
        gu_ptrs = gate_up_ptr + rows64 * stride_gu_r + n_offs[None, :]
        tl.store(gu_ptrs, round_to_bf16(gate, INTERPRETER), mask=out_mask)
        tl.store(gu_ptrs + inter, round_to_bf16(up, INTERPRETER), mask=out_mask)


@triton.jit
def sorted_rows_tile(
    a_desc, w_desc, m0, expert, n0, reduce_dim, n_dim,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """a[m0 : m0+BLOCK_M] · W[expert][n0 : n0+BLOCK_N]ᵀ, [BLOCK_M, BLOCK_N] fp32, over
    contiguous sorted rows; both operands through TMA descriptors."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, reduce_dim, BLOCK_K):
        a = a_desc.load([m0, k0])
        b = load_weight_tile(w_desc, expert, n0, k0, n_dim)
        if INTERPRETER:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _down_scatter_kernel(
    # pointers
    h_desc, w_down_desc, y_ptr,
    # schedule
    row_source_ptr, tile_expert_ptr, num_rows_ptr,
    # sizes
    hidden, inter, max_m_tiles,
    # strides
    stride_y_s,
    # meta
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    m_tile, n_tile = tile_coordinates(tl.program_id(0), max_m_tiles, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if m_tile * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(tile_expert_ptr + m_tile)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    n_offs = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    y = sorted_rows_tile(
        h_desc, w_down_desc, m_tile * BLOCK_M, expert, n_tile * BLOCK_N, inter, hidden,
        BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETER,
    )
    source = tl.load(row_source_ptr + rows)
    slot = tl.where(source >= 0, source, 0).to(tl.int64)
    mask = (source >= 0)[:, None] & (n_offs[None, :] < hidden)
    tl.store(y_ptr + slot[:, None] * stride_y_s + n_offs[None, :], round_to_bf16(y, INTERPRETER), mask=mask)


# --------------------------------------------------------------------------- configs


def gemm_config(kind: str, n_dim: int, reduce_dim: int) -> dict:
    """Tile config for a GEMM of output width n_dim and reduction reduce_dim.

    H200, bf16, chosen by `benchmarks/tune_gemm.py` on the three GPU presets (record in
    benchmarks/results/h200-20261130-gemm-tiles.json): 128×128 tiles with two
    accumulators for gate/up and 128×256 for the single-accumulator down GEMM at 8
    warps; TMA loads of the weights beat pointer loads by 2–25%; 128×64 / 64×128 tiles
    at 4 warps lose 15%. Under the interpreter, small tiles keep the CPU tests fast.
    """
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)
    if kind == "gate_up":  # 4 stages: +2–4% at I ≤ 2048, −4% at mixtral's I = 14336 (H200 sweep)
        stages = 4 if n_dim <= 2048 else 3
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=stages)
    return dict(BLOCK_M=128, BLOCK_N=256 if n_dim >= 2048 else 128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def _descriptor(t: torch.Tensor, block_rows: int, block_cols: int) -> TensorDescriptor:
    """A TMA descriptor over the rows of `t` ([..., cols] flattened to 2-D) with that block.
    TMA needs 16-byte row strides: bf16 sizes that are multiples of 8, which
    `mok.validation` requires."""
    return TensorDescriptor.from_tensor(t.reshape(-1, t.shape[-1]), [block_rows, block_cols])


def routing_block_m() -> int:
    """The M tile every grouped GEMM of a schedule uses (the schedule pads experts to it)."""
    return gemm_config("gate_up", 0, 0)["BLOCK_M"]


# --------------------------------------------------------------------------- launchers


def _check_weights(name: str, w: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if w.dtype != torch.bfloat16 or tuple(w.shape) != shape or not w.is_contiguous() or w.device != device:
        raise ValueError(
            f"{name}: expected a contiguous bf16 tensor of shape {list(shape)} on {device}, "
            f"got {w.dtype} {list(w.shape)} on {w.device}"
        )


def gate_up_swiglu(
    x: torch.Tensor,  # [T, H] bf16
    w_gate: torch.Tensor,  # [E_l, I, H] bf16
    w_up: torch.Tensor,  # [E_l, I, H] bf16
    schedule: RoutingSchedule,
    topk: int,
    swiglu_limit: float | None = None,
    store_gate_up: bool = False,
    tile_config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [capacity_rows, I] bf16 in the schedule's sorted layout, and g,u [capacity_rows, 2, I]
    bf16 when `store_gate_up`. Rows past the schedule's `num_rows` are left unwritten.
    `tile_config` overrides `gemm_config` (for tuning)."""
    num_experts, inter, hidden = w_gate.shape
    if x.dim() != 2 or x.shape[1] != hidden or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous bf16 [T, {hidden}] tensor, got {x.dtype} {list(x.shape)}")
    _check_weights("w_gate", w_gate, (schedule.num_local_experts, inter, hidden), x.device)
    _check_weights("w_up", w_up, tuple(w_gate.shape), x.device)
    cfg = tile_config or gemm_config("gate_up", inter, hidden)
    if cfg["BLOCK_M"] != schedule.block_m:
        raise ValueError(f"schedule: expected block_m {cfg['BLOCK_M']}, got {schedule.block_m}")
    rows = schedule.capacity_rows
    h = torch.empty(rows, inter, dtype=torch.bfloat16, device=x.device)  # [capacity_rows, I]
    gate_up = torch.empty(rows, 2, inter, dtype=torch.bfloat16, device=x.device) if store_gate_up else None
    grid = (schedule.max_tiles * triton.cdiv(inter, cfg["BLOCK_N"]),)
    w_gate_desc, w_up_desc = (_descriptor(w, cfg["BLOCK_N"], cfg["BLOCK_K"]) for w in (w_gate, w_up))
    _gate_up_swiglu_kernel[grid](
        x, w_gate_desc, w_up_desc, h, h if gate_up is None else gate_up,
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        hidden, inter, topk, schedule.max_tiles, 0.0 if swiglu_limit is None else float(swiglu_limit),
        x.stride(0), h.stride(0), 2 * inter,
        HAS_LIMIT=swiglu_limit is not None, STORE_GATE_UP=store_gate_up, INTERPRETER=interpreting(), **cfg,
    )
    return h, gate_up


def down_scatter(
    h: torch.Tensor,  # [capacity_rows, I] bf16
    w_down: torch.Tensor,  # [E_l, H, I] bf16
    schedule: RoutingSchedule,
    num_slots: int,
    tile_config: dict | None = None,
) -> torch.Tensor:
    """y [num_slots, H] bf16: each sorted row's unweighted output stored at its slot
    row_source[r]. Slots no route points to are left unwritten."""
    num_experts, hidden, inter = w_down.shape
    if h.dim() != 2 or h.shape != (schedule.capacity_rows, inter) or h.dtype != torch.bfloat16:
        raise ValueError(f"h: expected a bf16 [{schedule.capacity_rows}, {inter}] tensor, got {h.dtype} {list(h.shape)}")
    _check_weights("w_down", w_down, (schedule.num_local_experts, hidden, inter), h.device)
    cfg = tile_config or gemm_config("down", hidden, inter)
    if cfg["BLOCK_M"] != schedule.block_m:
        raise ValueError(f"schedule: expected block_m {cfg['BLOCK_M']}, got {schedule.block_m}")
    y = torch.empty(num_slots, hidden, dtype=torch.bfloat16, device=h.device)  # [T·topk, H]
    grid = (schedule.max_tiles * triton.cdiv(hidden, cfg["BLOCK_N"]),)
    _down_scatter_kernel[grid](
        _descriptor(h, cfg["BLOCK_M"], cfg["BLOCK_K"]),
        _descriptor(w_down, cfg["BLOCK_N"], cfg["BLOCK_K"]),
        y,
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        hidden, inter, schedule.max_tiles,
        y.stride(0),
        INTERPRETER=interpreting(), **cfg,
    )
    return y
