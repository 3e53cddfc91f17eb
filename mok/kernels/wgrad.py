"""Weight-gradient (wgrad) grouped GEMMs of the expert MLPs: reductions over each expert's rows.

    down:     d_w_down[e] = Σ_{r of e} dy_sorted[r]ᵀ · h[r]   [H, I]   dy_sorted[r] = bf16(w[t,j] · dOut[t])
    gate/up:  d_w_gate[e] = Σ_{r of e} d_g[r]ᵀ · x_sorted[r]  [I, H]
              d_w_up[e]   = Σ_{r of e} d_u[r]ᵀ · x_sorted[r]  [I, H]   (one launch, shared x tile)

Legend: r a row of the expert-sorted layout of `schedule.py` in
[expert_offsets[e], expert_offsets[e+1]), T tokens, H hidden, I intermediate size, E_l
local experts. Every operand is in the sorted layout and read through TMA: x_sorted and
dy_sorted [rows, H] (`gather.py`), h [rows, I] (the forward's) and d_gate_up
[rows, 2, I] (the down dgrad's). Gathering x and dOut by token inside these loads would need a new index
vector every K step (the reduction runs over rows); measured on H200 that held the
kernels at ~360 TFLOPS against 570–660 over sorted operands (BENCHMARKS.md).

Padding rows hold zeros in the sorted operands (their producers write them so), and a
sorted operand with fewer rows than the schedule's capacity reads zeros past its end
(TMA), so padding adds exactly nothing without any mask. The K loop steps BLOCK_K rows
at a time inside [expert_offsets[e], expert_offsets[e+1]), which the schedule pads to
its BLOCK_M: BLOCK_K must divide BLOCK_M (checked), so no step reads another expert's
rows.

Grid: one program per (expert, M tile, N tile) of the output, expert outermost; each
program walks its expert's rows in ascending order and accumulates in fp32, then stores
bf16 once — or, with `main_grad`, adds into a caller's fp32/bf16 buffer in place
(`main_grad += grad`, Megatron style; one read-modify-write per element). Experts with
no rows run zero steps and write exact zeros (or leave main_grad unchanged). No atomics,
fixed order: deterministic run to run.

Caller contract: the schedule was built for these rows; every row in
[expert_offsets[e], expert_offsets[e+1]) of each operand holds its data (zeros at
padding: the forward's h is zero there because its gathered x rows are).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.common import interpreting, round_to_bf16, tma_descriptor
from mok.kernels.gather import check_sorted_rows
from mok.kernels.schedule import RoutingSchedule

# --------------------------------------------------------------------------- configs


def wgrad_config(kind: str, m_dim: int, n_dim: int) -> dict:
    """Tile config of a wgrad GEMM (`kind` "down" or "gate_up") with output [m_dim, n_dim].

    H200, bf16, measured over sorted TMA operands (BENCHMARKS.md): 8 warps, 64 rows per
    K step; "gate_up" keeps two 128×128 fp32 accumulators (as the forward's gate/up GEMM
    does) and streams two A tiles and one x tile per step (48 KiB of shared memory per
    stage), 4 stages: 587–609 TFLOPS; "down" has one accumulator, so it takes 128×256
    tiles where the output is wide enough, 3 stages: 438–636 TFLOPS (128×128: 375–569).
    BLOCK_K divides the schedule's BLOCK_M (128). The reduction runs over an
    expert's rows, whose count changes every step, so it is not part of any key.
    """
    if interpreting():  # BLOCK_K divides the interpreter's routing BLOCK_M (16)
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=16, num_warps=4, num_stages=1)
    if kind == "down":
        return dict(BLOCK_M=128, BLOCK_N=256 if n_dim >= 256 else 128, BLOCK_K=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4)


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def expert_tile_coordinates(pid, m_dim, n_dim, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(expert, m0, n0) of program `pid` over an [E_l, m_dim, n_dim] output, expert
    outermost so consecutive programs reread the same expert rows from L2."""
    num_m_tiles = tl.cdiv(m_dim, BLOCK_M)
    num_n_tiles = tl.cdiv(n_dim, BLOCK_N)
    tiles_per_expert = num_m_tiles * num_n_tiles
    expert = pid // tiles_per_expert
    tile = pid % tiles_per_expert
    return expert, (tile // num_n_tiles) * BLOCK_M, (tile % num_n_tiles) * BLOCK_N


@triton.jit
def store_weight_grad(ptrs, acc, mask, ACCUMULATE: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRETER: tl.constexpr):
    """Stores an fp32 tile (bf16 rounded to nearest even, or fp32), or adds it in place."""
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if OUT_BF16:
        tl.store(ptrs, round_to_bf16(acc, INTERPRETER), mask=mask)
    else:
        tl.store(ptrs, acc, mask=mask)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _sorted_rows_wgrad_kernel(
    # pointers: out[e] = Σ_r a[r]ᵀ · b[r], and out2[e] = Σ_r a2[r]ᵀ · b[r] with TWO_OUTPUTS
    a_desc, a2_desc, b_desc, out_ptr, out2_ptr,
    # schedule
    expert_offsets_ptr,
    # sizes: out is [E_l, m_dim, n_dim]
    m_dim, n_dim,
    # strides
    stride_out_e, stride_out_m,
    # meta
    TWO_OUTPUTS: tl.constexpr, ACCUMULATE: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """down: a = dy_sorted, b = h; gate/up: a, a2 = d_g, d_u (sharing the x_sorted tile b)."""
    expert, m0, n0 = expert_tile_coordinates(tl.program_id(0), m_dim, n_dim, BLOCK_M, BLOCK_N)
    row_start = tl.load(expert_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_K):
        a = a_desc.load([r0, m0]).T  # aᵀ [BLOCK_M, BLOCK_K rows]
        b = b_desc.load([r0, n0])  # b [BLOCK_K rows, BLOCK_N]
        if INTERPRETER:  # the interpreter's bf16 tl.dot is wrong (DESIGN §6); fp32 is exact
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        if TWO_OUTPUTS:
            a2 = a2_desc.load([r0, m0]).T
            if INTERPRETER:
                a2 = a2.to(tl.float32)
            acc2 = tl.dot(a2, b, acc2)
    m_offs = m0 + tl.arange(0, BLOCK_M)
    n_offs = n0 + tl.arange(0, BLOCK_N)
    offs = expert.to(tl.int64) * stride_out_e + m_offs[:, None].to(tl.int64) * stride_out_m + n_offs[None, :]
    mask = (m_offs < m_dim)[:, None] & (n_offs < n_dim)[None, :]
    store_weight_grad(out_ptr + offs, acc, mask, ACCUMULATE, OUT_BF16, INTERPRETER)
    if TWO_OUTPUTS:
        store_weight_grad(out2_ptr + offs, acc2, mask, ACCUMULATE, OUT_BF16, INTERPRETER)


# --------------------------------------------------------------------------- launchers


def _check(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...], device) -> None:
    if t.dtype not in dtypes or tuple(t.shape) != shape or not t.is_contiguous() or t.device != device:
        expected = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"{name}: expected a contiguous {expected} tensor of shape {list(shape)} on {device}, "
            f"got {t.dtype} {list(t.shape)} on {t.device}"
        )


def _check_block_k(cfg: dict, schedule: RoutingSchedule) -> None:
    if schedule.block_m % cfg["BLOCK_K"]:
        raise ValueError(f"schedule: expected a block_m that BLOCK_K={cfg['BLOCK_K']} divides, got {schedule.block_m}")


_MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16)


def _launch_wgrad(a, a2, b, out, out2, schedule: RoutingSchedule, cfg: dict, accumulate: bool) -> None:
    """One launch of `_sorted_rows_wgrad_kernel` over out [E_l, m_dim, n_dim] (a2, out2 None
    for a single output); a, a2 [rows, m_dim] and b [rows, n_dim] in the sorted layout."""
    _check_block_k(cfg, schedule)
    experts, m_dim, n_dim = out.shape
    a_block = (cfg["BLOCK_K"], cfg["BLOCK_M"])
    a_desc = tma_descriptor(a, a_block)
    grid = (experts * triton.cdiv(m_dim, cfg["BLOCK_M"]) * triton.cdiv(n_dim, cfg["BLOCK_N"]),)
    _sorted_rows_wgrad_kernel[grid](
        a_desc, a_desc if a2 is None else tma_descriptor(a2, a_block),
        tma_descriptor(b, (cfg["BLOCK_K"], cfg["BLOCK_N"])), out, out if out2 is None else out2,
        schedule.expert_offsets,
        m_dim, n_dim,
        out.stride(0), out.stride(1),
        TWO_OUTPUTS=out2 is not None, ACCUMULATE=accumulate, OUT_BF16=out.dtype == torch.bfloat16,
        INTERPRETER=interpreting(), **cfg,
    )


def down_wgrad(
    dy_sorted: torch.Tensor,  # [<= capacity_rows, H] bf16, w·dOut in the sorted layout (zeros at padding)
    h: torch.Tensor,  # [<= capacity_rows, I] bf16, the forward's h (zeros at padding)
    schedule: RoutingSchedule,
    main_grad: torch.Tensor | None = None,  # [E_l, H, I] fp32/bf16, accumulated into in place
    tile_config: dict | None = None,
) -> torch.Tensor:
    """d_w_down [E_l, H, I]: a new bf16 tensor, or `main_grad` after `main_grad += d_w_down`."""
    hidden, inter = dy_sorted.shape[-1], h.shape[-1]
    device = h.device
    experts = schedule.num_local_experts
    check_sorted_rows("dy_sorted", dy_sorted, hidden, schedule)
    check_sorted_rows("h", h, inter, schedule)
    if main_grad is not None:
        _check("main_grad", main_grad, _MAIN_GRAD_DTYPES, (experts, hidden, inter), device)
    out = main_grad
    if out is None:
        out = torch.empty(experts, hidden, inter, dtype=torch.bfloat16, device=device)  # [E_l, H, I]
    cfg = tile_config or wgrad_config("down", hidden, inter)
    _launch_wgrad(dy_sorted, None, h, out, None, schedule, cfg, accumulate=main_grad is not None)
    return out


def gate_up_wgrad(
    d_gate_up: torch.Tensor,  # [capacity_rows, 2, I] bf16
    x_sorted: torch.Tensor,  # [<= capacity_rows, H] bf16, x in the sorted layout (zeros at padding)
    schedule: RoutingSchedule,
    main_grad_gate: torch.Tensor | None = None,  # [E_l, I, H] fp32/bf16, accumulated into in place
    main_grad_up: torch.Tensor | None = None,  # [E_l, I, H], same dtype as main_grad_gate
    tile_config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_w_gate, d_w_up) [E_l, I, H]: new bf16 tensors, or the two main_grads after `+=`."""
    hidden, inter = x_sorted.shape[-1], d_gate_up.shape[-1]
    device = d_gate_up.device
    experts = schedule.num_local_experts
    check_sorted_rows("x_sorted", x_sorted, hidden, schedule)
    _check("d_gate_up", d_gate_up, (torch.bfloat16,), (schedule.capacity_rows, 2, inter), device)
    if (main_grad_gate is None) != (main_grad_up is None):
        raise ValueError("main_grad_gate, main_grad_up: expected both or neither")
    if main_grad_gate is not None:
        _check("main_grad_gate", main_grad_gate, _MAIN_GRAD_DTYPES, (experts, inter, hidden), device)
        _check("main_grad_up", main_grad_up, (main_grad_gate.dtype,), (experts, inter, hidden), device)
        d_w_gate, d_w_up = main_grad_gate, main_grad_up
    else:
        d_w_gate = torch.empty(experts, inter, hidden, dtype=torch.bfloat16, device=device)  # [E_l, I, H]
        d_w_up = torch.empty_like(d_w_gate)  # [E_l, I, H]
    cfg = tile_config or wgrad_config("gate_up", inter, hidden)
    _launch_wgrad(d_gate_up[:, 0], d_gate_up[:, 1], x_sorted, d_w_gate, d_w_up, schedule, cfg,
                  accumulate=main_grad_gate is not None)
    return d_w_gate, d_w_up
