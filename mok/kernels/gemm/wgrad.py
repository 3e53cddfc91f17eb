"""Weight-gradient (wgrad) grouped GEMMs of the expert MLPs: reductions over each expert's rows.

    down:     d_w_down[e] = Σ_{r of e} dy_sorted[r]ᵀ · h[r]   [H, I]   dy_sorted[r] = bf16(w[t,j] · dOut[t])
    gate/up:  d_w_gate[e] = Σ_{r of e} d_g[r]ᵀ · x_sorted[r]  [I, H]
              d_w_up[e]   = Σ_{r of e} d_u[r]ᵀ · x_sorted[r]  [I, H]   (one launch, shared x tile)

Legend: r a row of the expert-sorted layout of `routing/schedule.py` in
[expert_offsets[e], expert_offsets[e+1]), T tokens, H hidden, I intermediate size, E_l
local experts. Every operand is in the sorted layout and read through TMA: x_sorted and
dy_sorted [rows, H] (`routing/gather.py`), h [rows, I] (the forward's) and d_gate_up
[rows, 2, I] (the down dgrad's). Gathering x and dOut by token inside these loads would need a new index
vector every K step (the reduction runs over rows); measured on H200 that held the
kernels far below their rate over sorted operands (benchmarks/LOG.md, "The backward rewrite").

Padding rows hold zeros in the sorted operands (their producers write them so), and a
sorted operand with fewer rows than the schedule's capacity reads zeros past its end
(TMA), so padding adds exactly nothing without any mask. The K loop steps BLOCK_K rows
at a time over the expert's routes, [expert_offsets[e], expert_offsets[e] + expert_counts[e])
rounded up to BLOCK_K (the schedule puts an expert's padding after its routes, so the steps
past that would multiply zeros: up to BLOCK_M − BLOCK_K rows per expert skipped in bf16,
none in fp8_block, whose steps are the 128-row scale blocks). BLOCK_K must divide BLOCK_M
(checked), so no step reads another expert's rows.

Grid: one program per (expert, M tile, N tile) of the output, expert outermost (or, with
the tile-config flag PERSISTENT, one program per SM walking those tiles in that order); each
tile walks its expert's rows in ascending order and accumulates in fp32, then stores
bf16 once — or, with `main_grad`, adds into a caller's fp32/bf16 buffer in place
(`main_grad += grad`, Megatron style; one read-modify-write per element). Experts with
no rows run zero steps and write exact zeros (or leave main_grad unchanged). No atomics,
fixed order: deterministic run to run.

Caller contract: the schedule was built for these rows; every row in
[expert_offsets[e], expert_offsets[e+1]) of each operand holds its data (zeros at
padding: the forward's h is zero there because its gathered x rows are).

fp8_block (the constexpr PRECISION, launchers `*_fp8_block`): the reduction runs
over rows, so both operands are quantized in 1×128 blocks along the rows, per expert
(a separate launch per operand ahead of these GEMMs: x and w·dOut gathered from the token
rows by `quant.fp8_block.quantize_fp8_block_gathered_t`, d_gate_up viewed as [rows, 2·I] by
`quantize_fp8_block_sorted_t`, and h recomputed from the saved g, u by
`quantize_fp8_block_swiglu_sorted_t`; the forward's h_q has its blocks along I and is not
kept). Each operand arrives transposed, aqᵀ [W, capacity_rows] with its scales sa
[capacity_rows / S, W], so both MMA operands are K-major (rows contiguous), and each K step
of BLOCK_K rows lies inside one block b of one expert:

    out[e, m, n] = Σ_steps  (Σ_{r in step} aqᵀ[m, r] · bqᵀ[n, r]) · sa[b, m] · sb[b, n]     (fp32)

Both scales are per output row / column here (no scalar weight scale), applied to each
step's fresh FP8 `tl.dot` as the forward's main loop does. BLOCK_K divides S = gcd(block_m,
128) (checked): on the GPU block_m = BLOCK_K = 128, one step per block as in DeepSeek-V3;
under the interpreter's block_m = 16, eight 16-row steps share a block's scales (the same
sum in another fp32 order). Padding rows quantize to exact zeros; NaN in a row makes its
128-row column blocks NaN, and with them the columns of out that read them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.fp8_block import FP8_BLOCK
from mok.kernels.common import expert_tile_coordinates, interpreting, launch_programs, round_to_bf16, tma_descriptor
from mok.kernels.gemm import hopper_common, hopper_wgrad
from mok.kernels.gemm.common import check_contiguous
from mok.kernels.plan import KernelPlan, kernel_plan
from mok.kernels.quant.fp8_block import sorted_scale_rows
from mok.kernels.routing.gather import check_sorted_rows
from mok.kernels.routing.schedule import RoutingSchedule

_SCALE_BLOCK = tl.constexpr(FP8_BLOCK)  # kernels read only constexpr globals

# --------------------------------------------------------------------------- configs

# Tile sizes, thresholds and variant flags are the kernel plan's (`plan.KernelPlan`, with each
# choice's reasons and records). With main_grad the warp-specialized read-modify-write epilogue
# spilled in one warp group (ptxas: 200–360 B), so the Triton kernel accumulates.


def wgrad_config(
    kind: str, m_dim: int, n_dim: int, precision: str = "bf16", allow_warp_specialized: bool = True
) -> dict:
    """Tile config of a wgrad GEMM (`kind` "down" or "gate_up") with output [m_dim, n_dim].

    H200, bf16, measured over sorted TMA operands (benchmarks/LOG.md; latest sweeps: records
    h200-20261130-wgrad-stages.json and the earlier -tune-wgrad): 8 warps, 64 rows per K
    step. "gate_up" keeps two 128×128 fp32 accumulators (as the forward's gate/up GEMM
    does) and streams two A tiles and one x tile per step (48 KiB of shared memory per
    stage); one 128×256 accumulator over the stacked [d_g | d_u] (STACKED) measured the
    same within the sweep's drift (record h200-20261130-gate-up-wgrad-stacked.json). It runs
    at 3 stages: 4 stages measured slower on mixtral-8x7b and deepseek-v3-slice in two sweeps. "down" has one accumulator, so it takes 128×256 tiles
    where the output is wide enough, 3 stages, and runs persistent up to
    `persistent_down_wgrad_max_inter` (faster on qwen3-30b, whose experts have ~1K rows,
    in both sweeps; slower at I ≥ 2048). BLOCK_K divides the schedule's
    BLOCK_M (128). The reduction runs over an expert's rows, whose count changes every
    step, so it is not part of any key.
    On Hopper the bf16 wgrads run warp-specialized unless `allow_warp_specialized` is False
    (main_grad): the down wgrad ping-pong up to `ping_pong_down_wgrad_max_inter` and cooperative
    above it (`cooperative_down_wgrad`), the gate/up wgrad cooperative (`cooperative_gate_up_wgrad`).
    The down wgrad walks its tiles `down_wgrad_group_m` row tiles per column sweep.
    fp8_block: `wgrad_fp8_block_*_tile`, the same for every shape (under the interpreter with
    `wgrad_fp8_block_interpreter_sizes`), or on Hopper without main_grad the warp-specialized
    kernel with `warp_specialized_fp8_block_wgrad`. Every threshold and flag named here is a
    field of the kernel plan (`plan.kernel_plan`).
    """
    plan = kernel_plan()
    warp_specialized_here = allow_warp_specialized and plan.warp_specialized
    if precision == "fp8_block":
        if warp_specialized_here and plan.warp_specialized_fp8_block_wgrad:
            return hopper_common.fp8_block_tile_config(stacked=kind == "gate_up")
        tiles = {"down": plan.wgrad_fp8_block_down_tile, "gate_up": plan.wgrad_fp8_block_gate_up_tile}[kind]
        return {**tiles, **(plan.wgrad_fp8_block_interpreter_sizes if interpreting() else {})}
    if interpreting():  # BLOCK_K divides the interpreter's routing BLOCK_M (16)
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=16, num_warps=4, num_stages=1)
    if kind == "down":
        return dict(_down_tiles(plan, n_dim, warp_specialized_here), GROUP_M=plan.down_wgrad_group_m)
    if warp_specialized_here and plan.cooperative_gate_up_wgrad:
        return hopper_common.wgrad_tile_config(cooperative=True)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def _down_tiles(plan: KernelPlan, inter: int, warp_specialized_here: bool) -> dict:
    """The bf16 down wgrad's tiles on the GPU (`wgrad_config`), before GROUP_M."""
    cooperative = inter > plan.ping_pong_down_wgrad_max_inter
    if warp_specialized_here and (not cooperative or plan.cooperative_down_wgrad):
        return hopper_common.wgrad_tile_config(cooperative=cooperative)
    return dict(BLOCK_M=128, BLOCK_N=256 if inter >= 256 else 128, BLOCK_K=64, num_warps=8, num_stages=3,
                PERSISTENT=inter <= plan.persistent_down_wgrad_max_inter)


# --------------------------------------------------------------------------- jit helpers


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
def _wgrad_tile(
    a_desc, a2_desc, b_desc, out_ptr, out2_ptr, a_scale_ptr, a2_scale_ptr, b_scale_ptr,
    expert_offsets_ptr, expert_counts_ptr, tile, m_dim, n_dim, split_m, stride_out_e, stride_out_m, stride_a_scale,
    stride_b_scale, PRECISION: tl.constexpr, TWO_OUTPUTS: tl.constexpr, STACKED: tl.constexpr, ACCUMULATE: tl.constexpr,
    OUT_BF16: tl.constexpr, INTERPRETER: tl.constexpr, SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of out (and out2): its expert's rows in ascending order."""
    expert, m0, n0 = expert_tile_coordinates(tile, m_dim, n_dim, BLOCK_M, BLOCK_N, GROUP_M)
    row_start = tl.load(expert_offsets_ptr + expert)
    row_end = row_start + tl.load(expert_counts_ptr + expert)  # the last step may run into the padding
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_K):
        if PRECISION == "fp8_block":
            # No upcast: the interpreter's fp8 tl.dot is right (only its bf16 one is wrong).
            a = a_desc.load([m0, r0])  # aᵀ [BLOCK_M, BLOCK_K rows], K-major
            b = b_desc.load([n0, r0]).T  # b [BLOCK_K rows, BLOCK_N] from K-major bᵀ
            # The scale row of the 128-row block (counted from the expert's first row) holding r0.
            slot = ((row_start + (r0 - row_start) // _SCALE_BLOCK * _SCALE_BLOCK) // SCALE_ROWS).to(tl.int64)
            scale_m = m0 + tl.arange(0, BLOCK_M)
            scale_n = n0 + tl.arange(0, BLOCK_N)
            a_scale = tl.load(a_scale_ptr + slot * stride_a_scale + scale_m, mask=scale_m < m_dim, other=0.0)
            b_scale = tl.load(b_scale_ptr + slot * stride_b_scale + scale_n, mask=scale_n < n_dim, other=0.0)
            # Row scales first, the column scales in the FMA (`hopper_common._add_scaled`'s PER_COLUMN).
            acc += (tl.dot(a, b) * a_scale[:, None]) * b_scale[None, :]
            if TWO_OUTPUTS:
                a2 = a2_desc.load([m0, r0])
                a2_scale = tl.load(a2_scale_ptr + slot * stride_a_scale + scale_m, mask=scale_m < m_dim, other=0.0)
                acc2 += (tl.dot(a2, b) * a2_scale[:, None]) * b_scale[None, :]
        else:
            a = a_desc.load([r0, m0]).T  # aᵀ [BLOCK_M, BLOCK_K rows]
            b = b_desc.load([r0, n0])  # b [BLOCK_K rows, BLOCK_N]
            if INTERPRETER:  # the interpreter's bf16 tl.dot is wrong (Triton 3.6-3.9); fp32 is exact
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)
            if TWO_OUTPUTS:
                a2 = a2_desc.load([r0, m0]).T
                if INTERPRETER:
                    a2 = a2.to(tl.float32)
                acc2 = tl.dot(a2, b, acc2)
    m_offs = m0 + tl.arange(0, BLOCK_M)
    n_offs = n0 + tl.arange(0, BLOCK_N)
    mask = (m_offs < m_dim)[:, None] & (n_offs < n_dim)[None, :]
    if STACKED:  # rows [split_m, m_dim) are out2's rows [0, m_dim - split_m)
        in_out2 = m_offs >= split_m
        m_offs = tl.where(in_out2, m_offs - split_m, m_offs)
    offs = expert.to(tl.int64) * stride_out_e + m_offs[:, None].to(tl.int64) * stride_out_m + n_offs[None, :]
    ptrs = out_ptr + offs
    if STACKED:
        ptrs = tl.where(in_out2[:, None], out2_ptr + offs, ptrs)
    store_weight_grad(ptrs, acc, mask, ACCUMULATE, OUT_BF16, INTERPRETER)
    if TWO_OUTPUTS:
        store_weight_grad(out2_ptr + offs, acc2, mask, ACCUMULATE, OUT_BF16, INTERPRETER)


@triton.jit
def _sorted_rows_wgrad_kernel(
    # pointers: out[e] = Σ_r a[r]ᵀ · b[r], and out2[e] = Σ_r a2[r]ᵀ · b[r] with TWO_OUTPUTS
    # (bf16: a, a2, b [rows, ·]; fp8_block: their transposed e4m3 copies [·, capacity_rows])
    a_desc, a2_desc, b_desc, out_ptr, out2_ptr,
    # fp8_block scales (unused in bf16): [capacity_rows / S, ·] fp32
    a_scale_ptr, a2_scale_ptr, b_scale_ptr,
    # schedule
    expert_offsets_ptr, expert_counts_ptr,
    # sizes: out is [E_l, m_dim, n_dim] in num_tiles tiles (with STACKED, out's rows [0, split_m)
    # then out2's); num_programs: the grid
    m_dim, n_dim, split_m, num_tiles, num_programs,
    # strides
    stride_out_e, stride_out_m, stride_a_scale, stride_b_scale,
    # meta
    PRECISION: tl.constexpr, TWO_OUTPUTS: tl.constexpr, STACKED: tl.constexpr, ACCUMULATE: tl.constexpr,
    OUT_BF16: tl.constexpr, INTERPRETER: tl.constexpr, SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    """down: a = dy_sorted, b = h;
    gate/up: a, a2 = d_g, d_u (sharing the x_sorted tile b), or with STACKED a = [d_g | d_u]
    (2·I wide) and one accumulator whose rows go to d_w_gate, then d_w_up."""
    # Two call sites, as in `down._down_scatter_kernel` (a one-tile loop spills there).
    if PERSISTENT:  # num_programs programs walk the tiles; the flattened loop overlaps a tile's
        # epilogue with the next tile's first loads
        for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=True):
            _wgrad_tile(a_desc, a2_desc, b_desc, out_ptr, out2_ptr, a_scale_ptr, a2_scale_ptr, b_scale_ptr,
                        expert_offsets_ptr, expert_counts_ptr, tile, m_dim, n_dim, split_m, stride_out_e,
                        stride_out_m, stride_a_scale, stride_b_scale, PRECISION, TWO_OUTPUTS, STACKED, ACCUMULATE,
                        OUT_BF16, INTERPRETER, SCALE_ROWS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        _wgrad_tile(a_desc, a2_desc, b_desc, out_ptr, out2_ptr, a_scale_ptr, a2_scale_ptr, b_scale_ptr,
                    expert_offsets_ptr, expert_counts_ptr, tl.program_id(0), m_dim, n_dim, split_m, stride_out_e,
                    stride_out_m, stride_a_scale, stride_b_scale, PRECISION, TWO_OUTPUTS, STACKED, ACCUMULATE,
                    OUT_BF16, INTERPRETER, SCALE_ROWS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


# --------------------------------------------------------------------------- launchers


def _check_block_k(cfg: dict, schedule: RoutingSchedule, precision: str) -> None:
    """No K step may cross an expert's end (bf16, fp8_block) or a scale block (fp8_block)."""
    if schedule.block_m % cfg["BLOCK_K"]:
        raise ValueError(f"schedule: expected a block_m that BLOCK_K={cfg['BLOCK_K']} divides, got {schedule.block_m}")
    if precision == "fp8_block" and FP8_BLOCK % cfg["BLOCK_K"]:
        raise ValueError(
            f"tile_config: expected a BLOCK_K that divides {FP8_BLOCK} (the scale block) for the fp8_block wgrad, "
            f"got {cfg['BLOCK_K']}"
        )


_MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16)


def _launch_wgrad(
    precision: str, a, a2, b, scales, out, out2, schedule: RoutingSchedule, cfg: dict, accumulate: bool
) -> None:
    """One launch of `_sorted_rows_wgrad_kernel` over out [E_l, m_dim, n_dim] (a2, out2 None
    for a single output). bf16: a, a2 [rows, m_dim] and b [rows, n_dim] in the sorted layout,
    `scales` None; fp8_block: their transposed e4m3 copies [m_dim or n_dim, capacity_rows] and
    `scales` = (a's, a2's or None, b's) [capacity_rows / S, ·] fp32, unit column stride. With
    cfg["PERSISTENT"], one program per SM walks the tiles. With cfg["STACKED"] (two outputs of
    one shape, a2 None), a holds both outputs' A operands one after the other along m_dim."""
    _check_block_k(cfg, schedule, precision)
    if cfg.get("WARP_SPECIALIZED", False):
        fp8 = precision == "fp8_block"
        if accumulate or cfg.get("STACKED", False) != (fp8 and out2 is not None):
            raise ValueError(
                "tile_config: WARP_SPECIALIZED is for the wgrads into a new gradient (no main_grad), STACKED for "
                "the fp8_block gate/up wgrad only"
            )
        hopper_wgrad.launch_wgrad(a, a2, b, out, out2, schedule, cfg, (scales[0], scales[2]) if fp8 else None)
        return
    cfg = {"PERSISTENT": False, "STACKED": False, "GROUP_M": 1, **cfg}
    if cfg["STACKED"] and (out2 is None or a2 is not None):
        raise ValueError("tile_config: STACKED is for the gate/up wgrad (two outputs, one stacked A operand)")
    experts, m_dim, n_dim = out.shape
    split_m = m_dim
    if cfg["STACKED"]:
        m_dim = 2 * split_m
    if precision == "fp8_block":  # K-major tiles of the transposed copies
        a_block, b_block = (cfg["BLOCK_M"], cfg["BLOCK_K"]), (cfg["BLOCK_N"], cfg["BLOCK_K"])
        a_scale, a2_scale, b_scale = scales
    else:
        a_block, b_block = (cfg["BLOCK_K"], cfg["BLOCK_M"]), (cfg["BLOCK_K"], cfg["BLOCK_N"])
        a_scale = a2_scale = b_scale = out  # an unread stand-in
    a_desc = tma_descriptor(a, a_block)
    num_tiles = experts * triton.cdiv(m_dim, cfg["BLOCK_M"]) * triton.cdiv(n_dim, cfg["BLOCK_N"])
    programs = launch_programs(num_tiles, cfg, out.device)
    _sorted_rows_wgrad_kernel[(programs,)](
        a_desc, a_desc if a2 is None else tma_descriptor(a2, a_block),
        tma_descriptor(b, b_block), out, out if out2 is None else out2,
        a_scale, a_scale if a2_scale is None else a2_scale, b_scale,
        schedule.expert_offsets, schedule.expert_counts,
        m_dim, n_dim, split_m, num_tiles, programs,
        out.stride(0), out.stride(1), a_scale.stride(0), b_scale.stride(0),
        PRECISION=precision, TWO_OUTPUTS=out2 is not None and not cfg["STACKED"], ACCUMULATE=accumulate,
        OUT_BF16=out.dtype == torch.bfloat16, INTERPRETER=interpreting(),
        SCALE_ROWS=sorted_scale_rows(schedule.block_m), **cfg,
    )


def _down_output(main_grad: torch.Tensor | None, schedule: RoutingSchedule, hidden: int, inter: int, device):
    """main_grad (checked), or a new bf16 d_w_down [E_l, H, I]."""
    shape = (schedule.num_local_experts, hidden, inter)
    if main_grad is not None:
        check_contiguous("main_grad", main_grad, _MAIN_GRAD_DTYPES, shape, device)
        return main_grad
    return torch.empty(shape, dtype=torch.bfloat16, device=device)  # [E_l, H, I]


def _gate_up_outputs(main_grad_gate, main_grad_up, schedule: RoutingSchedule, inter: int, hidden: int, device):
    """The two main_grads (checked), or new bf16 d_w_gate, d_w_up [E_l, I, H]."""
    shape = (schedule.num_local_experts, inter, hidden)
    if (main_grad_gate is None) != (main_grad_up is None):
        raise ValueError("main_grad_gate, main_grad_up: expected both or neither")
    if main_grad_gate is not None:
        check_contiguous("main_grad_gate", main_grad_gate, _MAIN_GRAD_DTYPES, shape, device)
        check_contiguous("main_grad_up", main_grad_up, (main_grad_gate.dtype,), shape, device)
        return main_grad_gate, main_grad_up
    d_w_gate = torch.empty(shape, dtype=torch.bfloat16, device=device)  # [E_l, I, H]
    return d_w_gate, torch.empty_like(d_w_gate)  # [E_l, I, H]


def _gate_up_a_operands(cfg: dict, stacked, d_gate, d_up):
    """The gate/up wgrad's A operands: (d_g and d_u stacked along m, None) for a STACKED tile
    config, else (d_g, d_u)."""
    return (stacked, None) if cfg.get("STACKED", False) else (d_gate, d_up)


def down_wgrad(
    dy_sorted: torch.Tensor,  # [<= capacity_rows, H] bf16, w·dOut in the sorted layout (zeros at padding)
    h: torch.Tensor,  # [<= capacity_rows, I] bf16, the forward's h (zeros at padding)
    schedule: RoutingSchedule,
    main_grad: torch.Tensor | None = None,  # [E_l, H, I] fp32/bf16, accumulated into in place
    tile_config: dict | None = None,
) -> torch.Tensor:
    """d_w_down [E_l, H, I]: a new bf16 tensor, or `main_grad` after `main_grad += d_w_down`."""
    hidden, inter = dy_sorted.shape[-1], h.shape[-1]
    check_sorted_rows("dy_sorted", dy_sorted, hidden, schedule)
    check_sorted_rows("h", h, inter, schedule)
    out = _down_output(main_grad, schedule, hidden, inter, h.device)
    cfg = tile_config or wgrad_config("down", hidden, inter, allow_warp_specialized=main_grad is None)
    _launch_wgrad("bf16", dy_sorted, None, h, None, out, None, schedule, cfg, accumulate=main_grad is not None)
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
    check_sorted_rows("x_sorted", x_sorted, hidden, schedule)
    check_contiguous("d_gate_up", d_gate_up, (torch.bfloat16,), (schedule.capacity_rows, 2, inter), device)
    d_w_gate, d_w_up = _gate_up_outputs(main_grad_gate, main_grad_up, schedule, inter, hidden, device)
    cfg = tile_config or wgrad_config("gate_up", inter, hidden, allow_warp_specialized=main_grad_gate is None)
    a, a2 = _gate_up_a_operands(cfg, d_gate_up.view(-1, 2 * inter), d_gate_up[:, 0], d_gate_up[:, 1])
    _launch_wgrad("bf16", a, a2, x_sorted, None, d_w_gate, d_w_up, schedule, cfg,
                  accumulate=main_grad_gate is not None)
    return d_w_gate, d_w_up


def _check_sorted_t_pair(q_name: str, q: torch.Tensor, scale_name: str, scale: torch.Tensor, width: int,
                         schedule: RoutingSchedule) -> None:
    """q: e4m3 [width, capacity_rows]; scale: fp32 [capacity_rows / S, width] (`quantize_fp8_block_sorted_t`)."""
    rows, device = schedule.capacity_rows, schedule.row_source.device
    check_contiguous(q_name, q, (torch.float8_e4m3fn,), (width, rows), device)
    check_contiguous(scale_name, scale, (torch.float32,), (rows // sorted_scale_rows(schedule.block_m), width), device)


def down_wgrad_fp8_block(
    dy_t_q: torch.Tensor,  # [H, capacity_rows] float8_e4m3fn, w·dOut's sorted rows in 1×128 column blocks
    dy_t_scale: torch.Tensor,  # [capacity_rows / S, H] fp32
    h_t_q: torch.Tensor,  # [I, capacity_rows] float8_e4m3fn, h recomputed from the saved g, u
    h_t_scale: torch.Tensor,  # [capacity_rows / S, I] fp32
    schedule: RoutingSchedule,
    main_grad: torch.Tensor | None = None,  # [E_l, H, I] fp32/bf16, accumulated into in place
    tile_config: dict | None = None,
) -> torch.Tensor:
    """The fp8_block down wgrad: d_w_down [E_l, H, I], a new bf16 tensor or `main_grad` after
    `+=`, as `down_wgrad`. dy's pair comes from `quantize_fp8_block_sorted_t(dy_sorted)`, h's
    from `quantize_fp8_block_swiglu_sorted_t(gate_up)`, for this schedule."""
    hidden, inter = dy_t_q.shape[0], h_t_q.shape[0]
    _check_sorted_t_pair("dy_t_q", dy_t_q, "dy_t_scale", dy_t_scale, hidden, schedule)
    _check_sorted_t_pair("h_t_q", h_t_q, "h_t_scale", h_t_scale, inter, schedule)
    out = _down_output(main_grad, schedule, hidden, inter, h_t_q.device)
    cfg = tile_config or wgrad_config("down", hidden, inter, "fp8_block", allow_warp_specialized=main_grad is None)
    _launch_wgrad("fp8_block", dy_t_q, None, h_t_q, (dy_t_scale, None, h_t_scale), out, None, schedule, cfg,
                  accumulate=main_grad is not None)
    return out


def gate_up_wgrad_fp8_block(
    d_gate_up_t_q: torch.Tensor,  # [2·I, capacity_rows] float8_e4m3fn: d_gᵀ then d_uᵀ, in 1×128 column blocks
    d_gate_up_t_scale: torch.Tensor,  # [capacity_rows / S, 2·I] fp32
    x_t_q: torch.Tensor,  # [H, capacity_rows] float8_e4m3fn, x's sorted rows in 1×128 column blocks
    x_t_scale: torch.Tensor,  # [capacity_rows / S, H] fp32
    schedule: RoutingSchedule,
    main_grad_gate: torch.Tensor | None = None,  # [E_l, I, H] fp32/bf16, accumulated into in place
    main_grad_up: torch.Tensor | None = None,  # [E_l, I, H], same dtype as main_grad_gate
    tile_config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8_block gate/up wgrad: (d_w_gate, d_w_up) [E_l, I, H], new bf16 tensors or the two
    main_grads after `+=`, as `gate_up_wgrad`. d_gate_up's pair comes from one
    `quantize_fp8_block_sorted_t(d_gate_up.flatten(1))` ([rows, 2, I] read as [rows, 2·I]),
    x's from `quantize_fp8_block_sorted_t(x_sorted)`, for this schedule."""
    if d_gate_up_t_q.dim() != 2 or d_gate_up_t_q.shape[0] % 2:
        raise ValueError(
            f"d_gate_up_t_q: expected a 2-D [2·I, capacity_rows] tensor, got shape {list(d_gate_up_t_q.shape)}"
        )
    inter, hidden = d_gate_up_t_q.shape[0] // 2, x_t_q.shape[0]
    device = x_t_q.device
    _check_sorted_t_pair("d_gate_up_t_q", d_gate_up_t_q, "d_gate_up_t_scale", d_gate_up_t_scale, 2 * inter, schedule)
    _check_sorted_t_pair("x_t_q", x_t_q, "x_t_scale", x_t_scale, hidden, schedule)
    d_w_gate, d_w_up = _gate_up_outputs(main_grad_gate, main_grad_up, schedule, inter, hidden, device)
    cfg = tile_config or wgrad_config("gate_up", inter, hidden, "fp8_block",
                                      allow_warp_specialized=main_grad_gate is None)
    a, a2 = _gate_up_a_operands(cfg, d_gate_up_t_q, d_gate_up_t_q[:inter], d_gate_up_t_q[inter:])
    # column views of the scales, row stride 2·I
    a_scale, a2_scale = _gate_up_a_operands(cfg, d_gate_up_t_scale, d_gate_up_t_scale[:, :inter],
                                            d_gate_up_t_scale[:, inter:])
    _launch_wgrad("fp8_block", a, a2, x_t_q, (a_scale, a2_scale, x_t_scale), d_w_gate, d_w_up,
                  schedule, cfg, accumulate=main_grad_gate is not None)
    return d_w_gate, d_w_up
