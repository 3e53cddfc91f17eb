"""Data-gradient (dgrad) grouped GEMMs of the expert MLPs, with fused epilogues.

    down dgrad:   a[r]   = dOut[t] · Wd[e]                         [I]   fp32, unweighted
                  d_h[r] = w[t,j] · a[r]                                 (w applied in fp32, here)
                  d_g[r], d_u[r] = swiglu_backward(d_h[r], g[r], u[r])   (clamp masks with a limit L)
                  route_partials[t·topk+j, n] = Σ_{i in N tile n} a[r,i] · h[r,i]
    router-weight gradient:
                  d_topk_weights[t,j] = Σ_n route_partials[t·topk+j, n]   (ascending n, fp32)
                                      = ⟨dOut[t], y[t·topk+j]⟩ = ⟨dOut[t]·Wd[e], h[r]⟩
    gate/up dgrad: dx_slots[t·topk+j] = d_g[r] · Wg[e] + d_u[r] · Wu[e]  [H]  one fp32 accumulator

Legend: r a row of the expert-sorted layout of `schedule.py`, src(r) = row_source[r] =
t·topk + j (−1: padding), e = tile_expert[r // BLOCK_M], T tokens, H hidden, I
intermediate size, topk routes per token, E_l local experts. g, u are the pre-activations
the forward stored ([rows, 2, I] bf16); h = silu(min(g, L)) · clamp(u, −L, L) is
recomputed from them in fp32.

The down dgrad reads dOut rows already in the sorted layout (`gather.py`'s d_out_sorted,
zeros in padding rows) and applies the router weight to the fp32 accumulator: d_h never
exists in bf16, and d_g, d_u carry a single bf16 rounding (at the d_gate_up store). The
router-weight gradient is the row-dot ⟨dOut[t]·Wd[e], h[r]⟩ over I, which equals
⟨dOut[t], y⟩: each program writes the partial dot of its N tile, a second tiny launch
sums them in ascending tile order. It never divides by w, so it is exact for any sign
of w, and it needs neither the forward's `y` nor a pass over [T·topk, H].
The shared expert runs the same kernels on its own schedule (every token to one expert,
topk = 1) with HAS_WEIGHTS = False: no weight, no partials.

The epilogue writes nothing else: one that also stored w·h for the down wgrad measured
1.5× slower on H200 (BENCHMARKS.md), so the down wgrad reads `gather.py`'s w·dOut rows
and the forward's h instead.

Padding rows (src = −1) get exact zeros in d_gate_up: the wgrad kernels read it through
TMA without masks and rely on it. Rows past the schedule's
`num_rows` are not written. dx_slots rows no route points to are not written.

Every GEMM operand is read through a TMA descriptor: the sorted rows (d_out_sorted,
d_gate_up) and the weights. A weight viewed as [E·K, N] lets the last K step of an
expert read the next expert's first rows when K is not a multiple of BLOCK_K; the
sorted operand is zero there (TMA fills past its last column), so they add nothing (for
finite weights). A sorted operand with fewer rows than the schedule's capacity reads
zeros past its end: the shared expert's sorted layout is the token order itself, so it
passes x and dOut as they are.

Caller contract: the schedule was built with the same BLOCK_M as these kernels' tiles
(checked); `gate_up` holds the forward's pre-activations for every row below `num_rows`.
Every output element is computed by one program with a fixed K loop, the partial sums
are added in a fixed order, and nothing uses atomics: deterministic run to run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.common import interpreting, round_to_bf16, tma_descriptor
from mok.kernels.grouped_gemm import routing_block_m, tile_coordinates
from mok.kernels.gather import check_sorted_rows
from mok.kernels.schedule import RoutingSchedule
from mok.kernels.swiglu import swiglu_backward

# --------------------------------------------------------------------------- configs


def dgrad_config(kind: str, n_dim: int, reduce_dim: int) -> dict:
    """Tile config of a dgrad GEMM (`kind` "down" or "gate_up") of output width n_dim.

    BLOCK_M is the schedule's M tile (`routing_block_m`): the rows of an M tile must
    belong to one expert. H200, bf16, every operand through TMA (sweep in BENCHMARKS.md):
    "gate_up" runs its two K loops (d_g·Wg, then d_u·Wu) one A and one B tile at a time,
    so 128×256×64 at 3 stages fits (48 KiB per stage) and measured 618–633 TFLOPS
    (128×128: 581–587); "down" keeps g, u and the accumulator live in its epilogue, so it
    stays at 128×128, where 4 stages beat 3 by 9–14%. Under the interpreter, small tiles
    keep the CPU tests fast. The key never includes per-expert counts (they change every
    step).
    """
    if interpreting():
        return dict(BLOCK_M=routing_block_m(), BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)
    if kind == "gate_up":
        return dict(BLOCK_M=routing_block_m(), BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=routing_block_m(), BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def sorted_rows_times_weight(
    a_desc, m0, w_desc, expert, n0, reduce_dim, acc,
    BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """acc + a[m0 : m0+BLOCK_M] · W[expert][:, n0 : n0+BLOCK_N] in fp32, where a is read
    through `a_desc` (blocks [BLOCK_M, BLOCK_K] of sorted rows) and W[expert] is a
    row-major [reduce_dim, n_dim] matrix read through `w_desc` (blocks [BLOCK_K, BLOCK_N]
    over [E·reduce_dim, n_dim]): the "nn" product of a dgrad."""
    w_row = expert * reduce_dim
    for k0 in range(0, reduce_dim, BLOCK_K):
        a = a_desc.load([m0, k0])
        b = w_desc.load([w_row + k0, n0])
        if INTERPRETER:  # the interpreter's bf16 tl.dot is wrong (DESIGN §6); fp32 is exact
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    return acc


# --------------------------------------------------------------------------- kernels


@triton.jit
def _down_dgrad_swiglu_kernel(
    # pointers
    d_out_desc, topk_weights_ptr, gate_up_ptr, w_down_desc, d_gate_up_ptr, route_partials_ptr,
    # schedule
    row_source_ptr, tile_expert_ptr, num_rows_ptr,
    # sizes
    hidden, inter, max_m_tiles, swiglu_limit,
    # strides
    stride_gu_r, stride_dgu_r,
    # meta
    HAS_WEIGHTS: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    num_n_tiles = tl.cdiv(inter, BLOCK_N)
    m_tile, n_tile = tile_coordinates(tl.program_id(0), max_m_tiles, num_n_tiles, GROUP_M)
    if m_tile * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(tile_expert_ptr + m_tile)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    source = tl.load(row_source_ptr + rows)
    row_valid = source >= 0
    slot = tl.where(row_valid, source, 0)
    n_offs = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    # a = dOut[t] · Wd[e] over H, unweighted: Wd[e] is [H, I], so its rows are the K dim.
    d_out_wd = sorted_rows_times_weight(
        d_out_desc, m_tile * BLOCK_M, w_down_desc, expert, n_tile * BLOCK_N, hidden,
        tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), BLOCK_K, INTERPRETER,
    )
    out_mask = (n_offs < inter)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gu_ptrs = gate_up_ptr + rows64 * stride_gu_r + n_offs[None, :]
    gate = tl.load(gu_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptrs + inter, mask=out_mask, other=0.0).to(tl.float32)
    w = tl.full((BLOCK_M,), 1.0, tl.float32)
    if HAS_WEIGHTS:
        w = tl.load(topk_weights_ptr + slot, mask=row_valid, other=0.0)
    d_gate, d_up, h = swiglu_backward(w[:, None] * d_out_wd, gate, up, swiglu_limit, HAS_LIMIT)
    # Padding rows: exact zeros whatever the saved g, u hold there.
    valid = row_valid[:, None]
    dgu_ptrs = d_gate_up_ptr + rows64 * stride_dgu_r + n_offs[None, :]
    tl.store(dgu_ptrs, round_to_bf16(tl.where(valid, d_gate, 0.0), INTERPRETER), mask=out_mask)
    tl.store(dgu_ptrs + inter, round_to_bf16(tl.where(valid, d_up, 0.0), INTERPRETER), mask=out_mask)
    if HAS_WEIGHTS:
        # ⟨dOut[t]·Wd[e], h[r]⟩ over this N tile (columns past I are zero on both sides).
        partial = tl.sum(d_out_wd * h, axis=1)
        tl.store(route_partials_ptr + slot.to(tl.int64) * num_n_tiles + n_tile, partial, mask=row_valid)


@triton.jit
def _sum_route_partials_kernel(
    route_partials_ptr, d_topk_weights_ptr, num_slots, num_parts,
    BLOCK_S: tl.constexpr,
):
    """d_topk_weights[s] = Σ_p route_partials[s, p], ascending p, fp32."""
    slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    valid = slots < num_slots
    acc = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for p in range(num_parts):
        acc += tl.load(route_partials_ptr + slots.to(tl.int64) * num_parts + p, mask=valid, other=0.0)
    tl.store(d_topk_weights_ptr + slots, acc, mask=valid)


@triton.jit
def _gate_up_dgrad_scatter_kernel(
    # pointers
    d_gate_desc, d_up_desc, w_gate_desc, w_up_desc, dx_ptr,
    # schedule
    row_source_ptr, tile_expert_ptr, num_rows_ptr,
    # sizes
    hidden, inter, max_m_tiles,
    # strides
    stride_dx_s,
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
    # Each output row depends only on its own d_gate_up row: padding rows cannot leak.
    # d_g · Wg[e] + d_u · Wu[e]: one accumulator through two K loops over I.
    m0, n0 = m_tile * BLOCK_M, n_tile * BLOCK_N
    dx = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dx = sorted_rows_times_weight(d_gate_desc, m0, w_gate_desc, expert, n0, inter, dx, BLOCK_K, INTERPRETER)
    dx = sorted_rows_times_weight(d_up_desc, m0, w_up_desc, expert, n0, inter, dx, BLOCK_K, INTERPRETER)
    source = tl.load(row_source_ptr + rows)
    slot = tl.where(source >= 0, source, 0).to(tl.int64)
    mask = (source >= 0)[:, None] & (n_offs[None, :] < hidden)
    tl.store(dx_ptr + slot[:, None] * stride_dx_s + n_offs[None, :], round_to_bf16(dx, INTERPRETER), mask=mask)


# --------------------------------------------------------------------------- launchers


def _check_bf16(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if t.dtype != torch.bfloat16 or tuple(t.shape) != shape or not t.is_contiguous() or t.device != device:
        raise ValueError(
            f"{name}: expected a contiguous bf16 tensor of shape {list(shape)} on {device}, "
            f"got {t.dtype} {list(t.shape)} on {t.device}"
        )


def _check_block_m(cfg: dict, schedule: RoutingSchedule) -> None:
    if cfg["BLOCK_M"] != schedule.block_m:
        raise ValueError(f"schedule: expected block_m {cfg['BLOCK_M']}, got {schedule.block_m}")


def down_dgrad_swiglu(
    d_out_sorted: torch.Tensor,  # [<= capacity_rows, H] bf16, dOut in the sorted layout (zeros at padding)
    topk_weights: torch.Tensor | None,  # [T, topk] fp32; None: unweighted (the shared expert)
    gate_up: torch.Tensor,  # [capacity_rows, 2, I] bf16, the forward's g, u
    w_down: torch.Tensor,  # [E_l, H, I] bf16
    schedule: RoutingSchedule,
    swiglu_limit: float | None = None,
    tile_config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d_gate_up [capacity_rows, 2, I] bf16, d_topk_weights [T, topk] fp32 or None).

    d_gate_up holds (d_g, d_u) per sorted row, exact zeros in padding rows; rows past the
    schedule's `num_rows` are left unwritten. d_topk_weights is returned when `topk_weights` is given (routed
    experts) and None otherwise (shared expert). Rows of d_out_sorted past its end read
    as zeros."""
    num_experts, hidden, inter = w_down.shape
    device = gate_up.device
    check_sorted_rows("d_out_sorted", d_out_sorted, hidden, schedule)
    if topk_weights is not None and (
        topk_weights.dtype != torch.float32 or topk_weights.dim() != 2 or not topk_weights.is_contiguous()
        or topk_weights.device != device
    ):
        raise ValueError(
            f"topk_weights: expected a contiguous fp32 [T, topk] tensor on {device}, "
            f"got {topk_weights.dtype} {list(topk_weights.shape)} on {topk_weights.device}"
        )
    _check_bf16("w_down", w_down, (schedule.num_local_experts, hidden, inter), device)
    _check_bf16("gate_up", gate_up, (schedule.capacity_rows, 2, inter), device)
    cfg = tile_config or dgrad_config("down", inter, hidden)
    _check_block_m(cfg, schedule)
    num_n_tiles = triton.cdiv(inter, cfg["BLOCK_N"])
    d_gate_up = torch.empty_like(gate_up)  # [capacity_rows, 2, I] bf16
    weighted = topk_weights is not None
    num_slots = topk_weights.numel() if weighted else 0
    # [T·topk, I / BLOCK_N] fp32: every slot a placed route points to is fully written.
    route_partials = torch.empty(num_slots, num_n_tiles, dtype=torch.float32, device=device)
    grid = (schedule.max_tiles * num_n_tiles,)
    _down_dgrad_swiglu_kernel[grid](
        tma_descriptor(d_out_sorted, (cfg["BLOCK_M"], cfg["BLOCK_K"])), topk_weights if weighted else d_gate_up,
        gate_up, tma_descriptor(w_down, (cfg["BLOCK_K"], cfg["BLOCK_N"])), d_gate_up,
        route_partials if weighted else d_gate_up,  # unused without weights (HAS_WEIGHTS=False)
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        hidden, inter, schedule.max_tiles, 0.0 if swiglu_limit is None else float(swiglu_limit),
        gate_up.stride(0), d_gate_up.stride(0),
        HAS_WEIGHTS=weighted, HAS_LIMIT=swiglu_limit is not None, INTERPRETER=interpreting(), **cfg,
    )
    if not weighted:
        return d_gate_up, None
    d_topk_weights = torch.empty_like(topk_weights)  # [T, topk] fp32
    block_s = 128
    _sum_route_partials_kernel[(triton.cdiv(num_slots, block_s),)](
        route_partials, d_topk_weights, num_slots, num_n_tiles, BLOCK_S=block_s, num_warps=4,
    )
    return d_gate_up, d_topk_weights


def gate_up_dgrad_scatter(
    d_gate_up: torch.Tensor,  # [capacity_rows, 2, I] bf16
    w_gate: torch.Tensor,  # [E_l, I, H] bf16
    w_up: torch.Tensor,  # [E_l, I, H] bf16
    schedule: RoutingSchedule,
    num_slots: int,
    tile_config: dict | None = None,
) -> torch.Tensor:
    """dx_slots [num_slots, H] bf16: each sorted row's d_g·Wg[e] + d_u·Wu[e] stored at its
    slot row_source[r]. Slots no route points to are left unwritten."""
    num_experts, inter, hidden = w_gate.shape
    device = d_gate_up.device
    _check_bf16("d_gate_up", d_gate_up, (schedule.capacity_rows, 2, inter), device)
    _check_bf16("w_gate", w_gate, (schedule.num_local_experts, inter, hidden), device)
    _check_bf16("w_up", w_up, tuple(w_gate.shape), device)
    cfg = tile_config or dgrad_config("gate_up", hidden, inter)
    _check_block_m(cfg, schedule)
    dx = torch.empty(num_slots, hidden, dtype=torch.bfloat16, device=device)  # [T·topk, H] bf16
    grid = (schedule.max_tiles * triton.cdiv(hidden, cfg["BLOCK_N"]),)
    a_block = (cfg["BLOCK_M"], cfg["BLOCK_K"])
    b_block = (cfg["BLOCK_K"], cfg["BLOCK_N"])
    _gate_up_dgrad_scatter_kernel[grid](
        tma_descriptor(d_gate_up[:, 0], a_block), tma_descriptor(d_gate_up[:, 1], a_block),
        tma_descriptor(w_gate, b_block), tma_descriptor(w_up, b_block), dx,
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        hidden, inter, schedule.max_tiles,
        dx.stride(0),
        INTERPRETER=interpreting(), **cfg,
    )
    return dx
