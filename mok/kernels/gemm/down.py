"""The down GEMM of the expert MLPs over the expert-sorted row layout of `routing/schedule.py`.

    down:     y[src(r)] = h[r] · Wd[e]ᵀ                                              (unweighted, bf16)

Legend: r a row of the sorted layout, src(r) = row_source[r] = t·topk + j (−1: padding),
e = tile_expert[r // BLOCK_M], H hidden, I intermediate size, E_l local experts.

The down kernel scatters each row's y straight into its combine slot src(r), so no
un-permute pass exists (or, `sorted_rows`, leaves y in the sorted layout for the combine to gather).
Padding rows compute zeros and store nothing. A tile whose tile_expert is −1 is skipped: under
expert parallelism the down GEMM runs in two launches over one layout (`transport.common.own_tiles_split`),
the tiles holding other ranks' routes first, so that their rows start back while the rest run
into the same y (`out=`).
The down GEMM (and `dgrad.py`'s gate/up dgrad) may run persistent (tile-config flag
`PERSISTENT`): one program per SM walks the real tiles, so no program exits idle and a
tile's epilogue overlaps the next tile's loads; each tile's sum is unchanged. Launched one
program per tile instead, they split a last wave of at most half the SMs' tiles into column
halves (`SPLIT_LAST_WAVE`, `kernels.common.last_wave_tile_coordinates`): the number of M tiles
follows the routing, and a last wave of a few tiles would otherwise cost a whole tile's time
with most SMs idle. Each element keeps its K order, so the output is bitwise the same.

fp8_block (the constexpr PRECISION, `down_scatter_fp8_block`): the fp8_block main loop of `common.py`
over the gate/up GEMM's h_q [rows, I] e4m3 (read through TMA) and h_scale [rows, I/128] fp32,
and `mok.fp8_block_quantize(w_down)`'s 128×128 blocks.
On Hopper the down GEMM runs warp-specialized where `common.gemm_config` chooses it
(`hopper_scatter.py`).

Every output element is computed by one program with a fixed K loop: deterministic.
Caller contract: the schedule was built for these tensors with the same BLOCK_M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.fp8_block import FP8_BLOCK
from mok.kernels.common import interpreting, last_wave_tile_coordinates, num_sms, tile_coordinates, tma_descriptor
from mok.kernels.gemm import hopper_scatter
from mok.kernels.gemm.common import (
    _check_weights,
    _tile_config,
    check_contiguous,
    check_fp8_block_pair,
    fp8_block_weight_shape,
    last_wave_config,
    scatter_grid,
    scatter_rows_to_slots,
    sorted_rows_tile,
)
from mok.kernels.routing.schedule import RoutingSchedule

_SCALE_BLOCK = tl.constexpr(FP8_BLOCK)  # kernels read only constexpr globals


@triton.jit
def _down_tile(
    h_desc, w_down_desc, y_ptr, h_scale_ptr, w_down_scale_ptr, row_source_ptr, tile_expert_ptr, m_tile, n_tile,
    hidden, inter, stride_y_s,
    PRECISION: tl.constexpr, INTERPRETER: tl.constexpr, SORTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of the down GEMM, scattered to its rows' slots (SORTED: stored
    at its rows); nothing for a tile of expert −1 (another launch's)."""
    expert = tl.load(tile_expert_ptr + m_tile)
    if expert >= 0:
        rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        n_offs = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        y = sorted_rows_tile(
            h_desc, h_scale_ptr, w_down_desc, w_down_scale_ptr, m_tile * BLOCK_M, expert, n_tile * BLOCK_N, inter,
            hidden, inter // _SCALE_BLOCK, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PRECISION, BLOCK_M,
            BLOCK_N, BLOCK_K, INTERPRETER,
        )
        scatter_rows_to_slots(y_ptr, y, row_source_ptr, rows, n_offs, hidden, stride_y_s, SORTED, INTERPRETER)


@triton.jit
def _down_scatter_kernel(
    # pointers (h, w_down: bf16, or e4m3 with their scales in fp8_block; w_down_half_desc: blocks
    # of BLOCK_N // 2 rows, read by the last wave's half tiles with SPLIT_LAST_WAVE)
    h_desc, w_down_desc, w_down_half_desc, y_ptr,
    # fp8_block scales (unused in bf16): h [rows, I/128], w_down [E_l, H/128, I/128]
    h_scale_ptr, w_down_scale_ptr,
    # schedule
    row_source_ptr, tile_expert_ptr, num_rows_ptr,
    # sizes (num_programs: the grid)
    hidden, inter, num_sms, num_programs,
    # strides
    stride_y_s,
    # meta
    PRECISION: tl.constexpr, INTERPRETER: tl.constexpr,
    SORTED: tl.constexpr,  # y in the sorted layout [capacity_rows, H] instead of route slots
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, SPLIT_LAST_WAVE: tl.constexpr,
):
    num_n_tiles = tl.cdiv(hidden, BLOCK_N)
    num_m_tiles = tl.cdiv(tl.load(num_rows_ptr), BLOCK_M)
    # Two call sites, not one loop over a one-tile range in the per-tile case: that form
    # compiled (sm_90a, triton 3.6) to 254 registers and 472 B of spills against 194 and none.
    if PERSISTENT:  # num_programs programs walk the real tiles; the flattened loop overlaps a
        # tile's epilogue with the next tile's first loads
        for tile in tl.range(tl.program_id(0), num_m_tiles * num_n_tiles, num_programs, flatten=True):
            m_tile, n_tile = tile_coordinates(tile, num_m_tiles, num_n_tiles, GROUP_M)
            _down_tile(h_desc, w_down_desc, y_ptr, h_scale_ptr, w_down_scale_ptr, row_source_ptr, tile_expert_ptr,
                       m_tile, n_tile, hidden, inter, stride_y_s, PRECISION, INTERPRETER, SORTED, BLOCK_M, BLOCK_N,
                       BLOCK_K)
    else:
        m_tile, n_tile, half = last_wave_tile_coordinates(
            tl.program_id(0), num_m_tiles, num_n_tiles, num_sms, GROUP_M, SPLIT_LAST_WAVE)
        if (m_tile >= 0) & (half < 0):
            _down_tile(h_desc, w_down_desc, y_ptr, h_scale_ptr, w_down_scale_ptr, row_source_ptr, tile_expert_ptr,
                       m_tile, n_tile, hidden, inter, stride_y_s, PRECISION, INTERPRETER, SORTED, BLOCK_M, BLOCK_N,
                       BLOCK_K)
        if SPLIT_LAST_WAVE:
            if half >= 0:
                _down_tile(h_desc, w_down_half_desc, y_ptr, h_scale_ptr, w_down_scale_ptr, row_source_ptr,
                           tile_expert_ptr, m_tile, 2 * n_tile + half, hidden, inter, stride_y_s, PRECISION,
                           INTERPRETER, SORTED, BLOCK_M, BLOCK_N // 2, BLOCK_K)


# --------------------------------------------------------------------------- launchers


def _launch_down_scatter(
    precision: str, h, h_scale, w_down, w_down_scale, y, schedule: RoutingSchedule, cfg: dict,
    sorted_rows: bool = False,
) -> None:
    """One launch of `_down_scatter_kernel` (the scales are None in bf16), or, for a tile config
    with WARP_SPECIALIZED, of `hopper_scatter`'s kernel. `sorted_rows`: y [capacity_rows, H],
    each row at its own index."""
    if cfg.get("WARP_SPECIALIZED", False):
        scales = None if h_scale is None else (h_scale, w_down_scale)
        hopper_scatter.launch_down_scatter(h, w_down, y, schedule, cfg, scales, scatter=not sorted_rows)
        return
    hidden, inter = w_down.shape[1], w_down.shape[2]
    programs = scatter_grid(schedule, hidden, cfg)
    cfg = {"PERSISTENT": False, "SPLIT_LAST_WAVE": False, **cfg}
    half = last_wave_config(cfg)
    _down_scatter_kernel[(programs,)](
        tma_descriptor(h, (cfg["BLOCK_M"], cfg["BLOCK_K"])),
        tma_descriptor(w_down, (cfg["BLOCK_N"], cfg["BLOCK_K"])),
        tma_descriptor(w_down, (half["BLOCK_N"], cfg["BLOCK_K"])),
        y,
        y if h_scale is None else h_scale, y if w_down_scale is None else w_down_scale,
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        hidden, inter, num_sms(y.device), programs,
        y.stride(0),
        PRECISION=precision, INTERPRETER=interpreting(), SORTED=sorted_rows, **cfg,
    )


def down_scatter(
    h: torch.Tensor,  # [capacity_rows, I] bf16
    w_down: torch.Tensor,  # [E_l, H, I] bf16
    schedule: RoutingSchedule,
    num_slots: int,
    tile_config: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [num_slots, H] bf16: each sorted row's unweighted output stored at its slot
    row_source[r]. Slots no route points to, and those of tiles the schedule takes out, are left
    unwritten. `out`: an earlier call's y to write into instead of a new tensor."""
    num_experts, hidden, inter = w_down.shape
    if h.dim() != 2 or h.shape != (schedule.capacity_rows, inter) or h.dtype != torch.bfloat16:
        raise ValueError(f"h: expected a bf16 [{schedule.capacity_rows}, {inter}] tensor, got {h.dtype} {list(h.shape)}")
    _check_weights("w_down", w_down, (schedule.num_local_experts, hidden, inter), h.device)
    cfg = _tile_config("down", hidden, inter, "bf16", tile_config, schedule)
    y = _down_output(out, num_slots, hidden, h.device)  # [T·topk, H]
    _launch_down_scatter("bf16", h, None, w_down, None, y, schedule, cfg)
    return y


def _down_output(out: torch.Tensor | None, rows: int, hidden: int, device: torch.device) -> torch.Tensor:
    """[rows, H] bf16: `out` once checked, or a new tensor."""
    if out is None:
        return torch.empty(rows, hidden, dtype=torch.bfloat16, device=device)
    check_contiguous("out", out, (torch.bfloat16,), (rows, hidden), device)
    return out


def down_scatter_fp8_block(
    h_q: torch.Tensor,  # [capacity_rows, I] float8_e4m3fn
    h_scale: torch.Tensor,  # [capacity_rows, I/128] fp32
    w_down_q: torch.Tensor,  # [E_l, H, I] float8_e4m3fn
    w_down_scale: torch.Tensor,  # [E_l, H/128, I/128] fp32
    schedule: RoutingSchedule,
    num_slots: int,
    tile_config: dict | None = None,
    sorted_rows: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp8_block down GEMM: y [num_slots, H] bf16, each sorted row's unweighted output
    at its slot row_source[r], from `gate_up_swiglu_fp8_block`'s h_q, h_scale and
    `mok.fp8_block_quantize(w_down)`'s q, scale. Slots no route points to, and those of tiles the
    schedule takes out, are left unwritten.
    `sorted_rows`: y [capacity_rows, H] in the sorted layout instead, row r's output at row r
    (padding rows too; rows at or past num_rows unwritten), for `combine` with
    the schedule's `route_row`. `out`: an earlier call's y to write into (as `down_scatter`'s)."""
    _, hidden, inter = fp8_block_weight_shape("w_down_q", w_down_q, "[E_l, H, I]", schedule.num_local_experts)
    device = w_down_q.device
    check_fp8_block_pair("h_q", h_q, "h_scale", h_scale, (schedule.capacity_rows, inter), (1, FP8_BLOCK), device)
    check_fp8_block_pair(
        "w_down_q", w_down_q, "w_down_scale", w_down_scale, tuple(w_down_q.shape), (FP8_BLOCK, FP8_BLOCK), device
    )
    cfg = _tile_config("down", hidden, inter, "fp8_block", tile_config, schedule)
    rows = schedule.capacity_rows if sorted_rows else num_slots
    y = _down_output(out, rows, hidden, device)  # [T·topk or capacity_rows, H]
    _launch_down_scatter("fp8_block", h_q, h_scale, w_down_q, w_down_scale, y, schedule, cfg, sorted_rows=sorted_rows)
    return y
