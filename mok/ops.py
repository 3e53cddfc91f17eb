"""The kernels as `torch.library` custom ops (`mok::<name>`) with fake implementations.

Fake implementations state each op's shape contract from host-known sizes only (the
schedule's capacities), which is what lets `torch.compile(fullgraph=True)` trace a mok
layer and CUDA graphs capture it: no output shape depends on routing data.

In eager mode the wrappers below call the launchers directly: going through the
dispatcher costs tens of microseconds per op in Python, which a layer of a few short
launches notices. Under `torch.compile` they call the registered op, so the compiled
graph holds `mok::<name>` nodes.

The schedule travels as one list of five tensors (row_source, tile_expert,
expert_offsets, expert_counts, num_rows); `routing_tensors` / `routing_from_tensors`
convert.
"""

from __future__ import annotations

import functools

import torch

from mok.kernels import combine as combine_kernels
from mok.kernels import grouped_gemm
from mok.kernels.schedule import RoutingSchedule, build_routing_schedule, capacity_rows


def routing_tensors(schedule: RoutingSchedule) -> list[torch.Tensor]:
    """[row_source, tile_expert, expert_offsets, expert_counts, num_rows] of a schedule."""
    return [schedule.row_source, schedule.tile_expert, schedule.expert_offsets, schedule.expert_counts, schedule.num_rows]


def routing_from_tensors(schedule_tensors: list[torch.Tensor], block_m: int) -> RoutingSchedule:
    row_source, tile_expert, expert_offsets, expert_counts, num_rows = schedule_tensors
    return RoutingSchedule(
        row_source, tile_expert, expert_offsets, expert_counts, num_rows,
        block_m=block_m, capacity_rows=row_source.shape[0], num_local_experts=expert_counts.shape[0],
    )


def _custom_op(name: str, mutates_args: tuple[str, ...] = ()):
    """Registers the decorated function as `mok::<name>`; returns a wrapper that runs it
    directly in eager mode and as the op while torch.compile traces. `wrapper.op` is the
    registered op (for `register_fake`)."""

    def register(fn):
        op = torch.library.custom_op(f"mok::{name}", fn, mutates_args=mutates_args)

        @functools.wraps(fn)
        def wrapper(*args):
            if torch.compiler.is_compiling():
                return op(*args)
            return fn(*args)

        wrapper.op = op
        return wrapper

    return register


# --------------------------------------------------------------------------- schedule


@_custom_op("routing_schedule", ("error_flag",))
def routing_schedule(
    topk_ids: torch.Tensor, error_flag: torch.Tensor, num_local_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_source, tile_expert, expert_offsets, expert_counts, num_rows) of `schedule.py`."""
    return tuple(routing_tensors(build_routing_schedule(topk_ids, num_local_experts, block_m, error_flag)))


@routing_schedule.op.register_fake
def _(topk_ids, error_flag, num_local_experts, block_m):
    rows = capacity_rows(topk_ids.shape[0] * topk_ids.shape[1], num_local_experts, block_m)
    new = topk_ids.new_empty
    return (
        new(rows, dtype=torch.int32),
        new(rows // block_m, dtype=torch.int32),
        new(num_local_experts + 1, dtype=torch.int32),
        new(num_local_experts, dtype=torch.int32),
        new(1, dtype=torch.int32),
    )


# --------------------------------------------------------------------------- grouped GEMMs


@_custom_op("gate_up_swiglu", ())
def gate_up_swiglu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    schedule_tensors: list[torch.Tensor],
    block_m: int,
    topk: int,
    swiglu_limit: float | None,
    store_gate_up: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [rows, I] bf16 and gate_up [rows, 2, I] bf16 (an empty [0, 2, I] when not stored)."""
    routing = routing_from_tensors(schedule_tensors, block_m)
    h, gate_up = grouped_gemm.gate_up_swiglu(x, w_gate, w_up, routing, topk, swiglu_limit, store_gate_up)
    if gate_up is None:
        gate_up = h.new_empty(0, 2, h.shape[1])
    return h, gate_up


@gate_up_swiglu.op.register_fake
def _(x, w_gate, w_up, schedule_tensors, block_m, topk, swiglu_limit, store_gate_up):
    rows, inter = schedule_tensors[0].shape[0], w_gate.shape[1]
    return x.new_empty(rows, inter), x.new_empty(rows if store_gate_up else 0, 2, inter)


@_custom_op("down_scatter", ())
def down_scatter(
    h: torch.Tensor,
    w_down: torch.Tensor,
    schedule_tensors: list[torch.Tensor],
    block_m: int,
    num_slots: int,
) -> torch.Tensor:
    """y [num_slots, H] bf16, each route's unweighted expert output in its slot."""
    routing = routing_from_tensors(schedule_tensors, block_m)
    return grouped_gemm.down_scatter(h, w_down, routing, num_slots)


@down_scatter.op.register_fake
def _(h, w_down, schedule_tensors, block_m, num_slots):
    return h.new_empty(num_slots, w_down.shape[1])


# --------------------------------------------------------------------------- combine


@_custom_op("combine", ())
def combine(y: torch.Tensor, topk_weights: torch.Tensor, y_shared: torch.Tensor | None) -> torch.Tensor:
    """out [T, H] bf16 = y_shared + Σ_j w·y, fp32, ascending j."""
    return combine_kernels.combine(y, topk_weights, y_shared)


@combine.op.register_fake
def _(y, topk_weights, y_shared):
    return y.new_empty(topk_weights.shape[0], y.shape[1])


# --------------------------------------------------------------------------- backward: sorted rows

from mok.kernels import dgrad, gather, wgrad  # noqa: E402  (the backward section keeps its imports here)


@_custom_op("gather_sorted_rows", ())
def gather_sorted_rows(
    a: torch.Tensor,
    b: torch.Tensor | None,
    schedule_tensors: list[torch.Tensor],
    block_m: int,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """a_sorted, b_sorted [rows, H] bf16: the token rows of every route in the sorted
    layout, zeros at padding (b_sorted an empty [0, H] without b)."""
    routing = routing_from_tensors(schedule_tensors, block_m)
    a_sorted, b_sorted = gather.gather_sorted_rows(a, b, routing, topk)
    return a_sorted, a.new_empty(0, a.shape[1]) if b_sorted is None else b_sorted


@gather_sorted_rows.op.register_fake
def _(a, b, schedule_tensors, block_m, topk):
    rows = schedule_tensors[0].shape[0]
    return a.new_empty(rows, a.shape[1]), a.new_empty(0 if b is None else rows, a.shape[1])


# --------------------------------------------------------------------------- backward: dgrad


@_custom_op("down_dgrad_swiglu", ())
def down_dgrad_swiglu(
    d_out_sorted: torch.Tensor,
    topk_weights: torch.Tensor | None,
    gate_up: torch.Tensor,
    w_down: torch.Tensor,
    schedule_tensors: list[torch.Tensor],
    block_m: int,
    swiglu_limit: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d_gate_up [rows, 2, I] bf16, h_weighted [rows, I] bf16 (w·h, the down wgrad's
    operand) and d_topk_weights [T, topk] fp32 (an empty [0] fp32 when topk_weights is
    None: the shared expert has no router weight)."""
    routing = routing_from_tensors(schedule_tensors, block_m)
    d_gate_up, h_weighted, d_topk_weights = dgrad.down_dgrad_swiglu(
        d_out_sorted, topk_weights, gate_up, w_down, routing, swiglu_limit
    )
    if d_topk_weights is None:
        d_topk_weights = gate_up.new_empty(0, dtype=torch.float32)
    return d_gate_up, h_weighted, d_topk_weights


@down_dgrad_swiglu.op.register_fake
def _(d_out_sorted, topk_weights, gate_up, w_down, schedule_tensors, block_m, swiglu_limit):
    shape = (0,) if topk_weights is None else tuple(topk_weights.shape)
    return (
        gate_up.new_empty(gate_up.shape),
        gate_up.new_empty(gate_up.shape[0], gate_up.shape[2]),
        gate_up.new_empty(shape, dtype=torch.float32),
    )


@_custom_op("gate_up_dgrad_scatter", ())
def gate_up_dgrad_scatter(
    d_gate_up: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    schedule_tensors: list[torch.Tensor],
    block_m: int,
    num_slots: int,
) -> torch.Tensor:
    """dx_slots [num_slots, H] bf16: d_g·Wg + d_u·Wu of each route, in its slot."""
    routing = routing_from_tensors(schedule_tensors, block_m)
    return dgrad.gate_up_dgrad_scatter(d_gate_up, w_gate, w_up, routing, num_slots)


@gate_up_dgrad_scatter.op.register_fake
def _(d_gate_up, w_gate, w_up, schedule_tensors, block_m, num_slots):
    return d_gate_up.new_empty(num_slots, w_gate.shape[2])


# --------------------------------------------------------------------------- backward: wgrad


@_custom_op("down_wgrad", ())
def down_wgrad(
    d_out_sorted: torch.Tensor,
    h_weighted: torch.Tensor,
    schedule_tensors: list[torch.Tensor],
    block_m: int,
) -> torch.Tensor:
    """d_w_down [E_l, H, I] bf16 = Σ_rows dOutᵀ (w·h) per expert, fp32 accumulation."""
    routing = routing_from_tensors(schedule_tensors, block_m)
    return wgrad.down_wgrad(d_out_sorted, h_weighted, routing)


@down_wgrad.op.register_fake
def _(d_out_sorted, h_weighted, schedule_tensors, block_m):
    return h_weighted.new_empty(schedule_tensors[3].shape[0], d_out_sorted.shape[1], h_weighted.shape[1])


@_custom_op("down_wgrad_accumulate", ("main_grad",))
def down_wgrad_accumulate(
    main_grad: torch.Tensor,
    d_out_sorted: torch.Tensor,
    h_weighted: torch.Tensor,
    schedule_tensors: list[torch.Tensor],
    block_m: int,
) -> None:
    """main_grad [E_l, H, I] fp32/bf16 += d_w_down, in place (Megatron-style main_grad)."""
    routing = routing_from_tensors(schedule_tensors, block_m)
    wgrad.down_wgrad(d_out_sorted, h_weighted, routing, main_grad=main_grad)


@down_wgrad_accumulate.op.register_fake
def _(main_grad, d_out_sorted, h_weighted, schedule_tensors, block_m):
    return None


@_custom_op("gate_up_wgrad", ())
def gate_up_wgrad(
    d_gate_up: torch.Tensor,
    x_sorted: torch.Tensor,
    schedule_tensors: list[torch.Tensor],
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_w_gate, d_w_up) [E_l, I, H] bf16 = Σ_rows d_gᵀ x, d_uᵀ x per expert, fp32 accumulation."""
    routing = routing_from_tensors(schedule_tensors, block_m)
    return wgrad.gate_up_wgrad(d_gate_up, x_sorted, routing)


@gate_up_wgrad.op.register_fake
def _(d_gate_up, x_sorted, schedule_tensors, block_m):
    shape = (schedule_tensors[3].shape[0], d_gate_up.shape[2], x_sorted.shape[1])
    return d_gate_up.new_empty(shape), d_gate_up.new_empty(shape)


@_custom_op("gate_up_wgrad_accumulate", ("main_grad_gate", "main_grad_up"))
def gate_up_wgrad_accumulate(
    main_grad_gate: torch.Tensor,
    main_grad_up: torch.Tensor,
    d_gate_up: torch.Tensor,
    x_sorted: torch.Tensor,
    schedule_tensors: list[torch.Tensor],
    block_m: int,
) -> None:
    """main_grad_gate, main_grad_up [E_l, I, H] fp32/bf16 += d_w_gate, d_w_up, in place."""
    routing = routing_from_tensors(schedule_tensors, block_m)
    wgrad.gate_up_wgrad(d_gate_up, x_sorted, routing, main_grad_gate, main_grad_up)


@gate_up_wgrad_accumulate.op.register_fake
def _(main_grad_gate, main_grad_up, d_gate_up, x_sorted, schedule_tensors, block_m):
    return None


# --------------------------------------------------------------------------- mxfp8 quantize

from mok.kernels import quant  # noqa: E402  (appended section keeps its imports here)


@_custom_op("mxfp8_quantize", ())
def _mxfp8_quantize(
    t: torch.Tensor, rowwise: bool, colwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, q_t, scale_t) of `quant.mxfp8_quantize_triton`; a pair not asked for is an
    empty [0] tensor of its dtype (custom ops cannot return None)."""
    q, scale, q_t, scale_t = quant.mxfp8_quantize_triton(t, rowwise, colwise)
    empty = lambda dtype: t.new_empty(0, dtype=dtype)  # noqa: E731
    return (
        empty(torch.float8_e4m3fn) if q is None else q,
        empty(torch.uint8) if scale is None else scale,
        empty(torch.float8_e4m3fn) if q_t is None else q_t,
        empty(torch.uint8) if scale_t is None else scale_t,
    )


@_mxfp8_quantize.op.register_fake
def _(t, rowwise, colwise):
    quant.validate_mxfp8_quantize_args(t, rowwise, colwise)
    *lead, M, N = t.shape
    new = t.new_empty
    return (
        new(*lead, M, N, dtype=torch.float8_e4m3fn) if rowwise else new(0, dtype=torch.float8_e4m3fn),
        new(*lead, M, N // 32, dtype=torch.uint8) if rowwise else new(0, dtype=torch.uint8),
        new(*lead, N, M, dtype=torch.float8_e4m3fn) if colwise else new(0, dtype=torch.float8_e4m3fn),
        new(*lead, N, M // 32, dtype=torch.uint8) if colwise else new(0, dtype=torch.uint8),
    )


def mxfp8_quantize(
    t: torch.Tensor, rowwise: bool = True, colwise: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`mok::mxfp8_quantize`: the Triton quantizer, with `mok.mxfp8.mxfp8_quantize`'s signature
    and outputs (the pair not asked for is None again); bit-exact with it."""
    q, scale, q_t, scale_t = _mxfp8_quantize(t, rowwise, colwise)
    return (q if rowwise else None, scale if rowwise else None, q_t if colwise else None, scale_t if colwise else None)
