"""The gate/up GEMM of the expert MLPs, SwiGLU in its epilogue, over the expert-sorted row layout of
`routing/schedule.py`.

    gate/up:  h[r] = silu(x[src(r) // topk] · Wg[e]ᵀ) · (x[src(r) // topk] · Wu[e]ᵀ)   (fp32, stored bf16)

Legend: r a row of the sorted layout, src(r) = row_source[r] = t·topk + j (−1: padding),
e = tile_expert[r // BLOCK_M], H hidden, I intermediate size, E_l local experts.

The gate/up kernel gathers token rows by index inside its loads (no permuted copy of x),
or, where the tile config says `X_SORTED` (large I, see `common.gemm_config`), reads a copy of x
in the sorted layout through TMA (`routing/gather.py`); g and u never leave registers before
SwiGLU: two accumulators, or (`PACKED`, gate and up weights in one allocation, see
`gate_up_packed`) one 2·BLOCK_N-wide accumulator split in the epilogue; with
`swiglu_limit` L it applies g ← min(g, L),
u ← clamp(u, −L, L) in fp32. When the backward needs them it also stores the
pre-activations g and u ([rows, 2, I] bf16), so the backward recomputes h from them
instead of redoing the gate/up GEMM.

A tile whose tile_expert is −1 is skipped: under expert parallelism the gate/up GEMM runs in two
launches over one layout (`transport.common.own_tiles_split`), each with the other's tiles taken
out, the second into the first's outputs (`outputs=`), once the peers' rows have arrived.

fp8_block (the constexpr PRECISION, `gate_up_swiglu_fp8_block`): E4M3 operands with fp32 block
scales, one fresh FP8 `tl.dot` per 128-wide K step scaled by its blocks' scales (`common.py`'s
formula). The gate/up A operand is x quantized once per token
(`quantize_fp8_block_activations`), gathered by index as in bf16. Its epilogue quantizes h
for the down GEMM with the quantizers' own device function (`quantize_row_blocks`, the
bit-exact rule of `mok.fp8_block`): BLOCK_N = 128, so each row of a tile is exactly one
1×128 block of h. h_q [rows, I] e4m3 and h_scale [rows, I/128] fp32 replace the bf16 h;
the down GEMM reads h_q through TMA. On Hopper the fp8_block GEMM runs warp-specialized where
`common.gemm_config` chooses it, x's token rows gathered by its producer (`hopper_gathered.py`).

What the fp8_block backward needs from this forward: g and u (`store_gate_up`, bf16, as in
bf16 mode) to recompute h and the SwiGLU derivative; h_q is not kept (the down wgrad
reduces over rows, so it needs h quantized along rows, not along I). Its dgrad GEMMs reduce
over I (gate/up) and H (down), so they read the weights' transposed copies (`q_t`,
`scale_t` of `mok.fp8_block_quantize`), K-major again; its wgrads reduce over rows, so a
separate quantizer (`quant.fp8_block.quantize_fp8_block_sorted_t`) re-quantizes their
operands along the rows (x_q's blocks run along H).

Every output element is computed by one program with a fixed K loop: deterministic.
Caller contract: the schedule was built for these tensors with the same BLOCK_M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.fp8_block import FP8_BLOCK
from mok.kernels.common import (
    column_halves,
    gate_up_parts,
    interpreting,
    round_to_bf16,
    tile_coordinates,
    tma_descriptor,
    tma_descriptor_pair,
)
from mok.kernels.gemm import hopper_gathered
from mok.kernels.gemm.common import (
    _check_weights,
    _tile_config,
    check_contiguous,
    check_fp8_block_pair,
    fp8_block_weight_shape,
    load_weight_tile,
    weight_block_scale,
)
from mok.kernels.quant.fp8_block import quantize_row_blocks
from mok.kernels.routing.gather import gather_sorted_rows
from mok.kernels.routing.schedule import RoutingSchedule
from mok.kernels.swiglu import fast_sigmoid_here, swiglu_forward

_SCALE_BLOCK = tl.constexpr(FP8_BLOCK)  # kernels read only constexpr globals


@triton.jit
def gather_gate_up_tile(
    x_ptr, x_scale_ptr, w_gate_desc, w_gate_scale_ptr, w_up_desc, w_up_scale_ptr,
    token, row_valid, m0, expert, n0, hidden, inter, stride_x_t,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr,
    X_SORTED: tl.constexpr, PACKED: tl.constexpr,
):
    """g, u [BLOCK_M, BLOCK_N] fp32 for token rows `token` (gathered from x inside the
    loads; X_SORTED: x_ptr is a TMA descriptor of x in the sorted layout, read at rows
    m0..) against rows n0.. of expert `expert`'s gate and up weights, reducing over H.
    PACKED (bf16): w_gate_desc covers both weights as one [2, E_l, I, H] tensor, and a K
    step is one [BLOCK_M, 2·BLOCK_N] dot over a box holding the gate and the up tile.
    fp8_block: x, weights e4m3 with their block scales (x_scale [T, H/128]); else bf16
    and the scale pointers unused."""
    if PACKED:
        acc_gate_up = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    else:
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_offs = tl.arange(0, BLOCK_K)
    if not X_SORTED:
        a_ptrs = x_ptr + token.to(tl.int64)[:, None] * stride_x_t + k_offs[None, :]
    for k0 in range(0, hidden, BLOCK_K):
        if X_SORTED:
            a = x_ptr.load([m0, k0])
        else:
            a = tl.load(a_ptrs + k0, mask=row_valid[:, None] & (k0 + k_offs < hidden)[None, :], other=0.0)
        if PACKED:
            b = w_gate_desc.load([0, expert, n0, k0]).reshape(2 * BLOCK_N, BLOCK_K).T  # [BLOCK_K, gate | up]
            if INTERPRETER:  # the interpreter's bf16 tl.dot is wrong (Triton 3.6-3.9); fp32 is exact
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc_gate_up = tl.dot(a, b, acc_gate_up)
        else:
            b_gate = load_weight_tile(w_gate_desc, expert, n0, k0, inter)
            b_up = load_weight_tile(w_up_desc, expert, n0, k0, inter)
            if PRECISION == "fp8_block":
                # No upcast: the interpreter's fp8 tl.dot is right (it reads the NaN byte as 480, but
                # a NaN block's scale is NaN too). Padding rows get scale 0, not token 0's, so their
                # h is exactly 0 even if x holds NaN.
                a_scale_ptrs = x_scale_ptr + token.to(tl.int64) * (hidden // _SCALE_BLOCK) + k0 // _SCALE_BLOCK
                a_scale = tl.load(a_scale_ptrs, mask=row_valid, other=0.0)  # [BLOCK_M] fp32
                gate_scale = weight_block_scale(w_gate_scale_ptr, expert, n0, k0, inter, hidden)
                up_scale = weight_block_scale(w_up_scale_ptr, expert, n0, k0, inter, hidden)
                acc_gate += tl.dot(a, b_gate) * (a_scale[:, None] * gate_scale)
                acc_up += tl.dot(a, b_up) * (a_scale[:, None] * up_scale)
            else:
                if INTERPRETER:
                    a, b_gate, b_up = a.to(tl.float32), b_gate.to(tl.float32), b_up.to(tl.float32)
                acc_gate = tl.dot(a, b_gate, acc_gate)
                acc_up = tl.dot(a, b_up, acc_up)
    if PACKED:
        acc_gate, acc_up = column_halves(acc_gate_up)
    return acc_gate, acc_up


@triton.jit
def _gate_up_swiglu_kernel(
    # pointers (h: bf16, or e4m3 bytes with h_scale in fp8_block; gate_up [rows, 2, I]: bf16, or e4m3
    # bytes with GATE_UP_E4M3)
    x_ptr, w_gate_desc, w_up_desc, h_ptr, gate_up_ptr,
    # fp8_block scales (unused in bf16): x [T, H/128], weights [E_l, I/128, H/128], h [rows, I/128];
    # GATE_UP_E4M3: g's and u's, written [rows, 2, I/128]
    x_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr, h_scale_ptr, gate_up_scale_ptr,
    # schedule
    row_source_ptr, tile_expert_ptr, num_rows_ptr,
    # sizes
    hidden, inter, topk, max_m_tiles, swiglu_limit,
    # strides
    stride_x_t, stride_h_r, stride_gu_r,
    # meta
    PRECISION: tl.constexpr, HAS_LIMIT: tl.constexpr, STORE_GATE_UP: tl.constexpr, GATE_UP_E4M3: tl.constexpr,
    INTERPRETER: tl.constexpr, FAST_SIGMOID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, X_SORTED: tl.constexpr, PACKED: tl.constexpr,
):
    m_tile, n_tile = tile_coordinates(tl.program_id(0), max_m_tiles, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if m_tile * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(tile_expert_ptr + m_tile)
    if expert < 0:
        return  # another launch's tile
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    source = tl.load(row_source_ptr + rows)
    row_valid = source >= 0
    token = tl.where(row_valid, source // topk, 0)
    n_offs = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    gate, up = gather_gate_up_tile(
        x_ptr, x_scale_ptr, w_gate_desc, w_gate_scale_ptr, w_up_desc, w_up_scale_ptr,
        token, row_valid, m_tile * BLOCK_M, expert, n_tile * BLOCK_N, hidden, inter, stride_x_t,
        PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETER, X_SORTED, PACKED,
    )
    out_mask = n_offs[None, :] < inter
    rows64 = rows.to(tl.int64)[:, None]
    h = swiglu_forward(gate, up, swiglu_limit, HAS_LIMIT, FAST_SIGMOID)
    if PRECISION == "fp8_block":  # BLOCK_N == 128: each tile row is one 1×128 block of h
        h_q, h_scale = quantize_row_blocks(h, INTERPRETER)  # [BLOCK_M, 128] uint8, [BLOCK_M, 1] fp32
        tl.store(h_ptr + rows64 * stride_h_r + n_offs[None, :], h_q, mask=out_mask)
        tl.store(h_scale_ptr + rows64 * (inter // _SCALE_BLOCK) + n_tile, h_scale)
    else:
        tl.store(h_ptr + rows64 * stride_h_r + n_offs[None, :], round_to_bf16(h, INTERPRETER), mask=out_mask)
    if STORE_GATE_UP:
        gu_ptrs = gate_up_ptr + rows64 * stride_gu_r + n_offs[None, :]
        if GATE_UP_E4M3:  # as h: each tile row one 1×128 block of g and one of u
            gate_q, gate_scale = quantize_row_blocks(gate, INTERPRETER)
            up_q, up_scale = quantize_row_blocks(up, INTERPRETER)
            tl.store(gu_ptrs, gate_q, mask=out_mask)
            tl.store(gu_ptrs + inter, up_q, mask=out_mask)
            gu_scale_ptrs = gate_up_scale_ptr + rows64 * (2 * inter // _SCALE_BLOCK) + n_tile
            tl.store(gu_scale_ptrs, gate_scale)
            tl.store(gu_scale_ptrs + inter // _SCALE_BLOCK, up_scale)
        else:
            tl.store(gu_ptrs, round_to_bf16(gate, INTERPRETER), mask=out_mask)
            tl.store(gu_ptrs + inter, round_to_bf16(up, INTERPRETER), mask=out_mask)


# --------------------------------------------------------------------------- launchers


def gate_up_packed(w_gate: torch.Tensor, w_up: torch.Tensor) -> bool:
    """Whether w_up starts where w_gate ends, both contiguous and alike: one [2, E_l, I, H]
    tensor, as `MoKMoE` and `mok.pack_gate_up` store them. The gate/up GEMM can then load a
    gate tile and an up tile as one TMA box and multiply them in one 2·BLOCK_N-wide dot,
    which reads the x tile from shared memory once per K step instead of twice (tile-config
    flag PACKED, where the plan's `packed_max_inter` says it measured faster); two dots, as for
    separate tensors, give bitwise the same result."""
    return (
        w_gate.is_contiguous() and w_up.is_contiguous() and w_up.shape == w_gate.shape
        and w_up.dtype == w_gate.dtype and w_up.device == w_gate.device
        and w_up.data_ptr() == w_gate.data_ptr() + w_gate.numel() * w_gate.element_size()
    )


def _launch_gate_up_swiglu(
    precision: str, x, x_scale, w_gate, w_gate_scale, w_up, w_up_scale, h, h_scale, gate_up,
    schedule: RoutingSchedule, topk: int, swiglu_limit: float | None, cfg: dict,
) -> None:
    """One launch of `_gate_up_swiglu_kernel`; the scales are None in bf16. gate_up: None, bf16
    [rows, 2, I], or (fp8_block) the pair (e4m3 bytes [rows, 2, I], scales [rows, 2, I/128]). bf16 only:
    cfg["X_SORTED"]: x is first copied to the sorted layout and read through TMA;
    cfg["PACKED"]: the weights, one [2, E_l, I, H] tensor (`gate_up_packed`), are read as such."""
    inter, hidden = w_gate.shape[1], w_gate.shape[2]
    cfg = dict(cfg)
    x_sorted = cfg.pop("X_SORTED", False)
    packed = cfg.pop("PACKED", False)
    if packed and not gate_up_packed(w_gate, w_up):
        raise ValueError("tile_config: PACKED needs w_gate and w_up stored as one tensor (mok.pack_gate_up)")
    x_operand = x
    if x_sorted:  # [capacity_rows, H], zeros at padding rows
        x_copy = gather_sorted_rows(x, None, None, schedule, topk)[0]
        x_operand = tma_descriptor(x_copy, (cfg["BLOCK_M"], cfg["BLOCK_K"]))
    grid = (schedule.max_tiles * triton.cdiv(inter, cfg["BLOCK_N"]),)
    if packed:
        w_gate_desc = w_up_desc = tma_descriptor_pair(w_gate, (2, 1, cfg["BLOCK_N"], cfg["BLOCK_K"]))
    else:
        w_gate_desc, w_up_desc = (tma_descriptor(w, (cfg["BLOCK_N"], cfg["BLOCK_K"])) for w in (w_gate, w_up))
    gate_up, gate_up_scale = gate_up_parts(gate_up)
    gate_up_e4m3 = gate_up_scale is not None
    scales = (x if s is None else s for s in (x_scale, w_gate_scale, w_up_scale, h_scale, gate_up_scale))  # x: unread
    _gate_up_swiglu_kernel[grid](
        x_operand, w_gate_desc, w_up_desc, h, h if gate_up is None else gate_up,
        *scales,
        schedule.row_source, schedule.tile_expert, schedule.num_rows,
        hidden, inter, topk, schedule.max_tiles, 0.0 if swiglu_limit is None else float(swiglu_limit),
        x.stride(0), h.stride(0), 2 * inter,
        PRECISION=precision, HAS_LIMIT=swiglu_limit is not None, STORE_GATE_UP=gate_up is not None,
        GATE_UP_E4M3=gate_up_e4m3,
        INTERPRETER=interpreting(), FAST_SIGMOID=fast_sigmoid_here(), X_SORTED=x_sorted, PACKED=packed, **cfg,
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
    outputs: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [capacity_rows, I] bf16 in the schedule's sorted layout, and g,u [capacity_rows, 2, I]
    bf16 when `store_gate_up`. Rows past the schedule's `num_rows`, and those of tiles it takes
    out, are left unwritten. `outputs`: (h, g,u or None) to write into instead of new tensors.
    `tile_config` overrides `gemm_config` (for tuning)."""
    num_experts, inter, hidden = w_gate.shape
    if x.dim() != 2 or x.shape[1] != hidden or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous bf16 [T, {hidden}] tensor, got {x.dtype} {list(x.shape)}")
    _check_weights("w_gate", w_gate, (schedule.num_local_experts, inter, hidden), x.device)
    _check_weights("w_up", w_up, tuple(w_gate.shape), x.device)
    cfg = _tile_config("gate_up", inter, hidden, "bf16", tile_config, schedule, gate_up_packed(w_gate, w_up))
    rows = schedule.capacity_rows
    if outputs is None:
        h = torch.empty(rows, inter, dtype=torch.bfloat16, device=x.device)  # [capacity_rows, I]
        gate_up = torch.empty(rows, 2, inter, dtype=torch.bfloat16, device=x.device) if store_gate_up else None
    else:
        h, gate_up = outputs
        check_contiguous("outputs[0] (h)", h, (torch.bfloat16,), (rows, inter), x.device)
        if store_gate_up:
            check_contiguous("outputs[1] (g,u)", gate_up, (torch.bfloat16,), (rows, 2, inter), x.device)
    _launch_gate_up_swiglu(
        "bf16", x, None, w_gate, None, w_up, None, h, None, gate_up, schedule, topk, swiglu_limit, cfg
    )
    return h, gate_up


def gate_up_swiglu_fp8_block(
    x_q: torch.Tensor,  # [T, H] float8_e4m3fn
    x_scale: torch.Tensor,  # [T, H/128] fp32
    w_gate_q: torch.Tensor,  # [E_l, I, H] float8_e4m3fn
    w_gate_scale: torch.Tensor,  # [E_l, I/128, H/128] fp32
    w_up_q: torch.Tensor,  # [E_l, I, H] float8_e4m3fn
    w_up_scale: torch.Tensor,  # [E_l, I/128, H/128] fp32
    schedule: RoutingSchedule,
    topk: int,
    swiglu_limit: float | None = None,
    store_gate_up: bool = False,
    tile_config: dict | None = None,
    gate_up_e4m3: bool = False,
    outputs: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None]:
    """The fp8_block gate/up GEMM: (h_q [capacity_rows, I] float8_e4m3fn, h_scale
    [capacity_rows, I/128] fp32), h quantized in 1×128 blocks for `down_scatter_fp8_block`,
    and g,u [capacity_rows, 2, I] bf16 when `store_gate_up`; with `gate_up_e4m3` too, g,u in
    1×128 blocks along I as h is, the pair (float8_e4m3fn [capacity_rows, 2, I], fp32
    [capacity_rows, 2, I/128]): DeepSeek-V3's SwiGLU input cached in FP8 for the backward, half
    the bytes (without a swiglu_limit: its clamps' zero gradients need g, u exactly). x_q, x_scale come from
    `quantize_fp8_block_activations(x)`, each weight pair from `mok.fp8_block_quantize`
    (its q, scale). Rows past the schedule's `num_rows`, and those of tiles it takes out, are left
    unwritten. `outputs`: what this returns, of an earlier call, to write into instead."""
    _, inter, hidden = fp8_block_weight_shape("w_gate_q", w_gate_q, "[E_l, I, H]", schedule.num_local_experts)
    device = w_gate_q.device
    if x_q.dim() != 2:
        raise ValueError(f"x_q: expected a 2-D [T, {hidden}] float8_e4m3fn tensor, got shape {list(x_q.shape)}")
    check_fp8_block_pair("x_q", x_q, "x_scale", x_scale, (x_q.shape[0], hidden), (1, FP8_BLOCK), device)
    for name, q, scale in (("w_gate", w_gate_q, w_gate_scale), ("w_up", w_up_q, w_up_scale)):
        check_fp8_block_pair(
            f"{name}_q", q, f"{name}_scale", scale, tuple(w_gate_q.shape), (FP8_BLOCK, FP8_BLOCK), device
        )
    if gate_up_e4m3 and (not store_gate_up or swiglu_limit is not None):
        raise ValueError(f"gate_up_e4m3: expected store_gate_up=True and no swiglu_limit, got store_gate_up="
                         f"{store_gate_up}, swiglu_limit={swiglu_limit}")
    cfg = _tile_config("gate_up", inter, hidden, "fp8_block", tile_config, schedule)
    rows = schedule.capacity_rows
    shapes = {"h_q": (rows, inter), "h_scale": (rows, inter // FP8_BLOCK), "g,u": (rows, 2, inter),
              "g,u scales": (rows, 2, inter // FP8_BLOCK)}
    if outputs is None:
        h_q = torch.empty(shapes["h_q"], dtype=torch.uint8, device=device)  # [capacity_rows, I] e4m3 bytes
        h_scale = torch.empty(shapes["h_scale"], dtype=torch.float32, device=device)  # [capacity_rows, I/128]
        gate_up = None
        if gate_up_e4m3:  # [capacity_rows, 2, I] e4m3 bytes, [capacity_rows, 2, I/128] fp32
            gate_up = (torch.empty(shapes["g,u"], dtype=torch.uint8, device=device),
                       torch.empty(shapes["g,u scales"], dtype=torch.float32, device=device))
        elif store_gate_up:  # [capacity_rows, 2, I] bf16
            gate_up = torch.empty(shapes["g,u"], dtype=torch.bfloat16, device=device)
    else:
        h_q, h_scale, gate_up = outputs
        check_contiguous("outputs[0] (h_q)", h_q, (torch.float8_e4m3fn,), shapes["h_q"], device)
        check_contiguous("outputs[1] (h_scale)", h_scale, (torch.float32,), shapes["h_scale"], device)
        if gate_up_e4m3:
            check_contiguous("outputs[2][0] (g,u)", gate_up[0], (torch.float8_e4m3fn,), shapes["g,u"], device)
            check_contiguous("outputs[2][1] (g,u scales)", gate_up[1], (torch.float32,), shapes["g,u scales"], device)
            gate_up = (gate_up[0].view(torch.uint8), gate_up[1])
        elif store_gate_up:
            check_contiguous("outputs[2] (g,u)", gate_up, (torch.bfloat16,), shapes["g,u"], device)
        h_q = h_q.view(torch.uint8)
    if cfg.get("WARP_SPECIALIZED", False):
        hopper_gathered.launch_gate_up_swiglu_fp8_block(x_q, x_scale, w_gate_q, w_gate_scale, w_up_q, w_up_scale, h_q,
                                                        h_scale, gate_up, schedule, topk, swiglu_limit, cfg)
    else:
        _launch_gate_up_swiglu(
            "fp8_block", x_q, x_scale, w_gate_q, w_gate_scale, w_up_q, w_up_scale, h_q, h_scale, gate_up,
            schedule, topk, swiglu_limit, cfg,
        )
    if gate_up_e4m3:
        gate_up = (gate_up[0].view(torch.float8_e4m3fn), gate_up[1])
    return h_q.view(torch.float8_e4m3fn), h_scale, gate_up
