"""The kernels as `torch.library` custom ops (`mok::<name>`) with fake implementations.

Fake implementations state each op's shape contract from host-known sizes only (the
schedule's capacities), which is what lets `torch.compile(fullgraph=True)` trace a mok
layer and CUDA graphs capture it: no output shape depends on routing data.

In eager mode the wrappers below call the launchers directly: going through the
dispatcher costs tens of microseconds per op in Python, which a layer of a few short
launches notices. Under `torch.compile` they call the registered op, so the compiled
graph holds `mok::<name>` nodes.

Every op that follows a schedule takes it as the `RoutingSchedule` (`kernels/routing/schedule.py`) that
`routing_schedule` returns. A custom op's schema holds tensors and plain values only, so at the
op's boundary `_custom_op` passes the schedule as its six tensors (`routing_tensors`) and block_m
and rebuilds the dataclass inside; in eager mode the dataclass goes straight through.
"""

from __future__ import annotations

import functools
import inspect

import torch

from mok.fp8_block import FP8_BLOCK
from mok.kernels.routing import combine as combine_kernels
from mok.kernels.gemm import down as down_kernels
from mok.kernels.gemm import gate_up as gate_up_kernels
from mok.kernels.routing.schedule import RoutingSchedule, build_routing_schedule, capacity_rows


def routing_tensors(schedule: RoutingSchedule) -> list[torch.Tensor]:
    """[row_source, tile_expert, expert_offsets, expert_counts, num_rows, route_row] of a schedule:
    how it crosses a custom op's boundary (with its block_m)."""
    return [schedule.row_source, schedule.tile_expert, schedule.expert_offsets, schedule.expert_counts, schedule.num_rows,
            schedule.route_row]


def _routing_from_tensors(schedule_tensors: list[torch.Tensor], block_m: int) -> RoutingSchedule:
    row_source, tile_expert, expert_offsets, expert_counts, num_rows, route_row = schedule_tensors
    return RoutingSchedule(
        row_source, tile_expert, expert_offsets, expert_counts, num_rows, route_row,
        block_m=block_m, capacity_rows=row_source.shape[0], num_local_experts=expert_counts.shape[0],
    )


def _custom_op(name: str, mutates_args: tuple[str, ...] = ()):
    """Registers the decorated function as `mok::<name>`; returns a wrapper that runs it
    directly in eager mode and as the op while torch.compile traces. A `routing` parameter
    (a `RoutingSchedule`, passed positionally) becomes the op's `schedule_tensors` and `block_m`.
    `wrapper.op` is the registered op, `wrapper.op_args(*args)` the wrapper's arguments as the op
    takes them, and `wrapper.register_fake` registers a fake implementation with the function's
    own signature."""

    def register(fn):
        at = _routing_position(fn)
        op = torch.library.custom_op(f"mok::{name}", _taking_tensors(fn, at), mutates_args=mutates_args)

        def op_args(*args):
            if at is None:
                return args
            routing = args[at]
            return (*args[:at], routing_tensors(routing), routing.block_m, *args[at + 1:])

        @functools.wraps(fn)
        def wrapper(*args):
            if torch.compiler.is_compiling():
                return op(*op_args(*args))
            return fn(*args)

        wrapper.op = op
        wrapper.op_args = op_args
        wrapper.register_fake = lambda fake: op.register_fake(_taking_tensors(fake, at))
        return wrapper

    return register


def _routing_position(fn) -> int | None:
    """The index of fn's `routing` parameter, or None without one."""
    names = list(inspect.signature(fn).parameters)
    return names.index("routing") if "routing" in names else None


def _taking_tensors(fn, at: int | None):
    """fn with its `routing` parameter (at index `at`) taken as the schedule's tensors and block_m,
    the signature torch.library infers the op's schema from."""
    if at is None:
        return fn

    @functools.wraps(fn)
    def taking_tensors(*args):
        return fn(*args[:at], _routing_from_tensors(args[at], args[at + 1]), *args[at + 2:])

    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    flat = [inspect.Parameter("schedule_tensors", kind, annotation=list[torch.Tensor]),
            inspect.Parameter("block_m", kind, annotation=int)]
    taking_tensors.__signature__ = signature.replace(parameters=params[:at] + flat + params[at + 1:])
    return taking_tensors


# --------------------------------------------------------------------------- schedule


@_custom_op("routing_schedule", ("error_flag",))
def _routing_schedule(
    topk_ids: torch.Tensor, error_flag: torch.Tensor, num_local_experts: int, block_m: int,
    skip_empty_ids: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`routing_tensors` of `schedule.build_routing_schedule`'s schedule."""
    schedule = build_routing_schedule(topk_ids, num_local_experts, block_m, error_flag, skip_empty_ids)
    return tuple(routing_tensors(schedule))


@_routing_schedule.register_fake
def _(topk_ids, error_flag, num_local_experts, block_m, skip_empty_ids=False):
    rows = capacity_rows(topk_ids.shape[0] * topk_ids.shape[1], num_local_experts, block_m)
    new = topk_ids.new_empty
    return (
        new(rows, dtype=torch.int32),
        new(rows // block_m, dtype=torch.int32),
        new(num_local_experts + 1, dtype=torch.int32),
        new(num_local_experts, dtype=torch.int32),
        new(1, dtype=torch.int32),
        new(topk_ids.shape[0] * topk_ids.shape[1], dtype=torch.int32),
    )


def routing_schedule(
    topk_ids: torch.Tensor, error_flag: torch.Tensor, num_local_experts: int, block_m: int,
    skip_empty_ids: bool = False,
) -> RoutingSchedule:
    """`mok::routing_schedule`: the schedule of `kernels/routing/schedule.py` over topk_ids [T, topk]; with
    `skip_empty_ids`, ids of −1 are empty entries (no route), not errors."""
    return _routing_from_tensors(_routing_schedule(topk_ids, error_flag, num_local_experts, block_m, skip_empty_ids),
                                 block_m)


# --------------------------------------------------------------------------- grouped GEMMs


@_custom_op("gate_up_swiglu", ())
def gate_up_swiglu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    routing: RoutingSchedule,
    topk: int,
    swiglu_limit: float | None,
    store_gate_up: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [rows, I] bf16 and gate_up [rows, 2, I] bf16 (an empty [0, 2, I] when not stored)."""
    h, gate_up = gate_up_kernels.gate_up_swiglu(x, w_gate, w_up, routing, topk, swiglu_limit, store_gate_up)
    if gate_up is None:
        gate_up = h.new_empty(0, 2, h.shape[1])
    return h, gate_up


@gate_up_swiglu.register_fake
def _(x, w_gate, w_up, routing, topk, swiglu_limit, store_gate_up):
    rows, inter = routing.capacity_rows, w_gate.shape[1]
    return x.new_empty(rows, inter), x.new_empty(rows if store_gate_up else 0, 2, inter)


@_custom_op("gate_up_swiglu_into", ("h", "gate_up"))
def gate_up_swiglu_into(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    routing: RoutingSchedule,
    topk: int,
    swiglu_limit: float | None,
    h: torch.Tensor,
    gate_up: torch.Tensor,
) -> None:
    """`gate_up_swiglu`'s rows of `routing`'s tiles written into an earlier call's h and gate_up
    (an empty gate_up: not stored): the second launch over a layout that two schedules share
    (`transport.common.own_tiles_split`)."""
    store_gate_up = gate_up.shape[0] > 0
    gate_up_kernels.gate_up_swiglu(x, w_gate, w_up, routing, topk, swiglu_limit, store_gate_up,
                                   outputs=(h, gate_up if store_gate_up else None))


@gate_up_swiglu_into.register_fake
def _(x, w_gate, w_up, routing, topk, swiglu_limit, h, gate_up):
    return None


@_custom_op("down_scatter", ())
def down_scatter(
    h: torch.Tensor,
    w_down: torch.Tensor,
    routing: RoutingSchedule,
    num_slots: int,
) -> torch.Tensor:
    """y [num_slots, H] bf16, each route's unweighted expert output in its slot."""
    return down_kernels.down_scatter(h, w_down, routing, num_slots)


@down_scatter.register_fake
def _(h, w_down, routing, num_slots):
    return h.new_empty(num_slots, w_down.shape[1])


@_custom_op("down_scatter_into", ("y",))
def down_scatter_into(h: torch.Tensor, w_down: torch.Tensor, routing: RoutingSchedule, y: torch.Tensor) -> None:
    """`down_scatter`'s slots of `routing`'s tiles written into an earlier call's y: the second
    launch over a layout that two schedules share (`transport.common.own_tiles_split`)."""
    down_kernels.down_scatter(h, w_down, routing, y.shape[0], out=y)


@down_scatter_into.register_fake
def _(h, w_down, routing, y):
    return None


@_custom_op("gate_up_swiglu_fp8_block", ())
def gate_up_swiglu_fp8_block(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_gate_q: torch.Tensor,
    w_gate_scale: torch.Tensor,
    w_up_q: torch.Tensor,
    w_up_scale: torch.Tensor,
    routing: RoutingSchedule,
    topk: int,
    swiglu_limit: float | None,
    store_gate_up: bool,
    gate_up_e4m3: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h_q [rows, I] e4m3, h_scale [rows, I/128] fp32 (h in 1×128 blocks), gate_up [rows, 2, I]
    bf16 (an empty [0, 2, I] when not stored) and an empty [0] fp32; with `gate_up_e4m3`, gate_up
    [rows, 2, I] e4m3 and its scales [rows, 2, I/128] fp32 (1×128 blocks along I)."""
    h_q, h_scale, gate_up = gate_up_kernels.gate_up_swiglu_fp8_block(
        x_q, x_scale, w_gate_q, w_gate_scale, w_up_q, w_up_scale, routing, topk, swiglu_limit, store_gate_up,
        gate_up_e4m3=gate_up_e4m3,
    )
    if gate_up is None:
        gate_up = h_scale.new_empty(0, 2, h_q.shape[1], dtype=torch.bfloat16)
    gate_up, gate_up_scale = gate_up if gate_up_e4m3 else (gate_up, h_scale.new_empty(0))
    return h_q, h_scale, gate_up, gate_up_scale


@gate_up_swiglu_fp8_block.register_fake
def _(x_q, x_scale, w_gate_q, w_gate_scale, w_up_q, w_up_scale, routing, topk, swiglu_limit,
      store_gate_up, gate_up_e4m3=False):
    rows, inter = routing.capacity_rows, w_gate_q.shape[1]
    stored_rows = rows if store_gate_up else 0
    if gate_up_e4m3:
        gate_up = x_q.new_empty(stored_rows, 2, inter)
        gate_up_scale = x_scale.new_empty(stored_rows, 2, w_gate_scale.shape[1])  # [rows, 2, I/128]
    else:
        gate_up = x_scale.new_empty(stored_rows, 2, inter, dtype=torch.bfloat16)
        gate_up_scale = x_scale.new_empty(0)
    return (
        x_q.new_empty(rows, inter),
        x_scale.new_empty(rows, w_gate_scale.shape[1]),  # I/128
        gate_up,
        gate_up_scale,
    )


@_custom_op("gate_up_swiglu_fp8_block_into", ("h_q", "h_scale", "gate_up", "gate_up_scale"))
def gate_up_swiglu_fp8_block_into(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_gate_q: torch.Tensor,
    w_gate_scale: torch.Tensor,
    w_up_q: torch.Tensor,
    w_up_scale: torch.Tensor,
    routing: RoutingSchedule,
    topk: int,
    swiglu_limit: float | None,
    h_q: torch.Tensor,
    h_scale: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
) -> None:
    """`gate_up_swiglu_fp8_block`'s rows of `routing`'s tiles written into what an earlier call
    returned (as `gate_up_swiglu_into` for bf16): gate_up e4m3 with its scales, bf16, or empty."""
    gate_up_e4m3 = gate_up_scale.numel() > 0
    store_gate_up = gate_up.shape[0] > 0
    stored = (gate_up, gate_up_scale) if gate_up_e4m3 else gate_up if store_gate_up else None
    gate_up_kernels.gate_up_swiglu_fp8_block(
        x_q, x_scale, w_gate_q, w_gate_scale, w_up_q, w_up_scale, routing, topk, swiglu_limit, store_gate_up,
        gate_up_e4m3=gate_up_e4m3, outputs=(h_q, h_scale, stored),
    )


@gate_up_swiglu_fp8_block_into.register_fake
def _(x_q, x_scale, w_gate_q, w_gate_scale, w_up_q, w_up_scale, routing, topk, swiglu_limit, h_q, h_scale, gate_up,
      gate_up_scale):
    return None


@_custom_op("down_scatter_fp8_block", ())
def down_scatter_fp8_block(
    h_q: torch.Tensor,
    h_scale: torch.Tensor,
    w_down_q: torch.Tensor,
    w_down_scale: torch.Tensor,
    routing: RoutingSchedule,
    num_slots: int,
    sorted_rows: bool = False,
) -> torch.Tensor:
    """y [num_slots, H] bf16 from the fp8_block h and w_down, each route's unweighted output in its
    slot; `sorted_rows`: y [capacity_rows, H], each sorted row's at its own index."""
    return down_kernels.down_scatter_fp8_block(h_q, h_scale, w_down_q, w_down_scale, routing, num_slots,
                                               sorted_rows=sorted_rows)


@down_scatter_fp8_block.register_fake
def _(h_q, h_scale, w_down_q, w_down_scale, routing, num_slots, sorted_rows=False):
    rows = routing.capacity_rows if sorted_rows else num_slots
    return h_scale.new_empty(rows, w_down_q.shape[1], dtype=torch.bfloat16)


@_custom_op("down_scatter_fp8_block_into", ("y",))
def down_scatter_fp8_block_into(
    h_q: torch.Tensor,
    h_scale: torch.Tensor,
    w_down_q: torch.Tensor,
    w_down_scale: torch.Tensor,
    routing: RoutingSchedule,
    sorted_rows: bool,
    y: torch.Tensor,
) -> None:
    """`down_scatter_fp8_block`'s rows of `routing`'s tiles written into an earlier call's y (as
    `down_scatter_into` for bf16)."""
    down_kernels.down_scatter_fp8_block(h_q, h_scale, w_down_q, w_down_scale, routing, y.shape[0],
                                        sorted_rows=sorted_rows, out=y)


@down_scatter_fp8_block_into.register_fake
def _(h_q, h_scale, w_down_q, w_down_scale, routing, sorted_rows, y):
    return None


# --------------------------------------------------------------------------- combine


@_custom_op("combine", ())
def combine(y: torch.Tensor, topk_weights: torch.Tensor, y_shared: torch.Tensor | None,
            route_row: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, H] bf16 = y_shared + Σ_j w·y, fp32, ascending j (y's rows in route slots, or with
    `route_row` in the sorted layout)."""
    return combine_kernels.combine(y, topk_weights, y_shared, route_row)


@combine.register_fake
def _(y, topk_weights, y_shared, route_row=None):
    return y.new_empty(topk_weights.shape[0], y.shape[1])


@_custom_op("combine_into", ("out",))
def combine_into(y: torch.Tensor, topk_weights: torch.Tensor, route_row: torch.Tensor, out: torch.Tensor) -> None:
    """`combine` without a shared expert, written into `out` [T, H] bf16 (a view of a larger
    buffer: under expert parallelism one block of the rows that travel back)."""
    combine_kernels.combine(y, topk_weights, None, route_row, out=out)


@combine_into.register_fake
def _(y, topk_weights, route_row, out):
    return None


# --------------------------------------------------------------------------- backward: sorted rows

from mok.kernels.gemm import dgrad, wgrad  # noqa: E402  (the backward section keeps its imports here)
from mok.kernels.routing import gather  # noqa: E402


@_custom_op("gather_sorted_rows", ())
def gather_sorted_rows(
    x: torch.Tensor | None,
    d_out: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    routing: RoutingSchedule,
    topk: int,
    mxfp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_sorted, d_out_sorted, dy_sorted = w·dOut [rows, H] bf16 in the sorted layout
    (zeros at padding), each an empty [0, H] where its inputs are absent (x None: no x_sorted;
    d_out None: no d_out_sorted; topk_weights None: no dy_sorted); with `mxfp8`, each rounded to
    the MXFP8 grid of the GEMM that reads it."""
    copies = gather.gather_sorted_rows(x, d_out, topk_weights, routing, topk, mxfp8)
    rows = x if x is not None else d_out
    return tuple(rows.new_empty(0, rows.shape[1]) if t is None else t for t in copies)


@gather_sorted_rows.register_fake
def _(x, d_out, topk_weights, routing, topk, mxfp8=False):
    rows = x if x is not None else d_out
    num_rows, hidden = routing.capacity_rows, rows.shape[1]
    present = (x is not None, d_out is not None, topk_weights is not None)
    return tuple(rows.new_empty(num_rows if p else 0, hidden) for p in present)


# --------------------------------------------------------------------------- backward: dgrad


@_custom_op("down_dgrad_swiglu", ())
def down_dgrad_swiglu(
    d_out_sorted: torch.Tensor,
    topk_weights: torch.Tensor | None,
    gate_up: torch.Tensor,
    w_down: torch.Tensor,
    routing: RoutingSchedule,
    swiglu_limit: float | None,
    store_weighted_h: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d_gate_up [rows, 2, I] bf16, d_topk_weights [T, topk] fp32 (an empty [0] fp32
    when topk_weights is None: the shared expert has no router weight), and with
    `store_weighted_h` w·h [rows, I] bf16 for the down wgrad (else an empty [0, I])."""
    weighted_h = _weighted_h_buffer(gate_up, store_weighted_h)
    d_gate_up, d_topk_weights = dgrad.down_dgrad_swiglu(
        d_out_sorted, topk_weights, gate_up, w_down, routing, swiglu_limit,
        weighted_h=weighted_h if store_weighted_h else None,
    )
    return d_gate_up, _empty_if_none(d_topk_weights, gate_up), weighted_h


def _weighted_h_buffer(gate_up: torch.Tensor, store_weighted_h: bool) -> torch.Tensor:
    """The down dgrad's w·h output: [rows, I] bf16 with `store_weighted_h`, else an empty [0, I]."""
    rows, _, inter = gate_up.shape
    return gate_up.new_empty(rows if store_weighted_h else 0, inter)


def _empty_if_none(d_topk_weights: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The down dgrad's router-weight gradient, or an empty [0] fp32 without router weights
    (a custom op returns tensors only)."""
    return like.new_empty(0, dtype=torch.float32) if d_topk_weights is None else d_topk_weights


def _fake_down_dgrad(gate_up: torch.Tensor, topk_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (0,) if topk_weights is None else tuple(topk_weights.shape)
    return gate_up.new_empty(gate_up.shape, dtype=torch.bfloat16), gate_up.new_empty(shape, dtype=torch.float32)


@down_dgrad_swiglu.register_fake
def _(d_out_sorted, topk_weights, gate_up, w_down, routing, swiglu_limit, store_weighted_h=False):
    return *_fake_down_dgrad(gate_up, topk_weights), _weighted_h_buffer(gate_up, store_weighted_h)


@_custom_op("gate_up_dgrad_scatter", ())
def gate_up_dgrad_scatter(
    d_gate_up: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    routing: RoutingSchedule,
    num_slots: int,
) -> torch.Tensor:
    """dx_slots [num_slots, H] bf16: d_g·Wg + d_u·Wu of each route, in its slot."""
    return dgrad.gate_up_dgrad_scatter(d_gate_up, w_gate, w_up, routing, num_slots)


@gate_up_dgrad_scatter.register_fake
def _(d_gate_up, w_gate, w_up, routing, num_slots):
    return d_gate_up.new_empty(num_slots, w_gate.shape[2])


@_custom_op("down_dgrad_swiglu_fp8_block", ())
def down_dgrad_swiglu_fp8_block(
    d_out_q: torch.Tensor,
    d_out_scale: torch.Tensor,
    topk_weights: torch.Tensor | None,
    gate_up: torch.Tensor,
    w_down_t_q: torch.Tensor,
    w_down_t_scale: torch.Tensor,
    routing: RoutingSchedule,
    swiglu_limit: float | None,
    quantize_d_gate_up: bool = False,
    gate_up_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`down_dgrad_swiglu` on dOut quantized in 1×128 blocks (its token rows, gathered by the
    GEMM, or its sorted rows: `dgrad.fp8_block_down_dgrad_gathers`) and w_down's transposed
    fp8_block copy, reading the forward's g, u as gate_up [rows, 2, I] bf16, or with
    `gate_up_scale` e4m3 in 1×128 blocks (`gate_up_swiglu_fp8_block`'s with gate_up_e4m3):
    d_gate_up [rows, 2, I] bf16 and an empty [0] fp32, or with
    `quantize_d_gate_up` d_gate_up [rows, 2, I] e4m3 and its scales [rows, 2, I/128] fp32 (1×128
    blocks along I); d_topk_weights [T, topk] fp32 (empty [0] without topk_weights)."""
    saved = gate_up if gate_up_scale is None else (gate_up, gate_up_scale)
    d_gate_up, d_topk_weights = dgrad.down_dgrad_swiglu_fp8_block(
        d_out_q, d_out_scale, topk_weights, saved, w_down_t_q, w_down_t_scale, routing, swiglu_limit,
        quantize_d_gate_up=quantize_d_gate_up,
    )
    if not quantize_d_gate_up:
        d_gate_up = (d_gate_up, gate_up.new_empty(0, dtype=torch.float32))
    return *d_gate_up, _empty_if_none(d_topk_weights, gate_up)


@down_dgrad_swiglu_fp8_block.register_fake
def _(d_out_q, d_out_scale, topk_weights, gate_up, w_down_t_q, w_down_t_scale, routing, swiglu_limit,
      quantize_d_gate_up=False, gate_up_scale=None):
    d_gate_up, d_topk_weights = _fake_down_dgrad(gate_up, topk_weights)
    if not quantize_d_gate_up:
        return d_gate_up, gate_up.new_empty(0, dtype=torch.float32), d_topk_weights
    rows, _, inter = gate_up.shape
    return (gate_up.new_empty(gate_up.shape, dtype=torch.float8_e4m3fn),
            gate_up.new_empty(rows, 2, inter // FP8_BLOCK, dtype=torch.float32), d_topk_weights)


@_custom_op("gate_up_dgrad_scatter_fp8_block", ())
def gate_up_dgrad_scatter_fp8_block(
    d_gate_q: torch.Tensor,
    d_gate_scale: torch.Tensor,
    d_up_q: torch.Tensor,
    d_up_scale: torch.Tensor,
    w_gate_t_q: torch.Tensor,
    w_gate_t_scale: torch.Tensor,
    w_up_t_q: torch.Tensor,
    w_up_t_scale: torch.Tensor,
    routing: RoutingSchedule,
    num_slots: int,
    sorted_rows: bool = False,
) -> torch.Tensor:
    """dx_slots [num_slots, H] bf16 from d_g, d_u quantized in 1×128 blocks and the gate/up
    weights' transposed fp8_block copies; `sorted_rows`: dx [capacity_rows, H] in the sorted layout."""
    return dgrad.gate_up_dgrad_scatter_fp8_block(
        d_gate_q, d_gate_scale, d_up_q, d_up_scale, w_gate_t_q, w_gate_t_scale, w_up_t_q, w_up_t_scale,
        routing, num_slots, sorted_rows=sorted_rows,
    )


@gate_up_dgrad_scatter_fp8_block.register_fake
def _(d_gate_q, d_gate_scale, d_up_q, d_up_scale, w_gate_t_q, w_gate_t_scale, w_up_t_q, w_up_t_scale,
      routing, num_slots, sorted_rows=False):
    rows = routing.capacity_rows if sorted_rows else num_slots
    return d_gate_scale.new_empty(rows, w_gate_t_q.shape[1], dtype=torch.bfloat16)


# --------------------------------------------------------------------------- backward: wgrad


# bf16: the sorted operands as they are ([rows, W]). fp8_block (scales given): their
# transposed copies quantized in 1×128 blocks along the rows ([W, rows] e4m3, scales
# [rows / S, W] fp32: `quantize_fp8_block_sorted_t`), for the fp8 main loop of the same kernel.


def _wgrad_widths(a: torch.Tensor, b: torch.Tensor, fp8: bool) -> tuple[int, int]:
    """(width of a, width of b): the output's two dims."""
    return (a.shape[0], b.shape[0]) if fp8 else (a.shape[-1], b.shape[-1])


@_custom_op("down_wgrad", ())
def down_wgrad(
    dy: torch.Tensor,
    h: torch.Tensor,
    routing: RoutingSchedule,
    dy_scale: torch.Tensor | None = None,
    h_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """d_w_down [E_l, H, I] bf16 = Σ_rows (w·dOut)ᵀ h per expert, fp32 accumulation."""
    return _down_wgrad(dy, h, routing, dy_scale, h_scale, None)


@down_wgrad.register_fake
def _(dy, h, routing, dy_scale=None, h_scale=None):
    hidden, inter = _wgrad_widths(dy, h, dy_scale is not None)
    return h.new_empty(routing.num_local_experts, hidden, inter, dtype=torch.bfloat16)


@_custom_op("down_wgrad_accumulate", ("main_grad",))
def down_wgrad_accumulate(
    main_grad: torch.Tensor,
    dy: torch.Tensor,
    h: torch.Tensor,
    routing: RoutingSchedule,
    dy_scale: torch.Tensor | None = None,
    h_scale: torch.Tensor | None = None,
) -> None:
    """main_grad [E_l, H, I] fp32/bf16 += d_w_down, in place (Megatron-style main_grad)."""
    _down_wgrad(dy, h, routing, dy_scale, h_scale, main_grad)


@down_wgrad_accumulate.register_fake
def _(main_grad, dy, h, routing, dy_scale=None, h_scale=None):
    return None


def _down_wgrad(dy, h, routing, dy_scale, h_scale, main_grad):
    if dy_scale is None:
        return wgrad.down_wgrad(dy, h, routing, main_grad=main_grad)
    return wgrad.down_wgrad_fp8_block(dy, dy_scale, h, h_scale, routing, main_grad=main_grad)


@_custom_op("gate_up_wgrad", ())
def gate_up_wgrad(
    d_gate_up: torch.Tensor,
    x: torch.Tensor,
    routing: RoutingSchedule,
    d_gate_up_scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_w_gate, d_w_up) [E_l, I, H] bf16 = Σ_rows d_gᵀ x, d_uᵀ x per expert, fp32 accumulation.
    fp8_block: d_gate_up's copy is d_gᵀ then d_uᵀ, [2·I, rows]."""
    return _gate_up_wgrad(d_gate_up, x, routing, d_gate_up_scale, x_scale, None, None)


@gate_up_wgrad.register_fake
def _(d_gate_up, x, routing, d_gate_up_scale=None, x_scale=None):
    fp8 = d_gate_up_scale is not None
    inter, hidden = _wgrad_widths(d_gate_up, x, fp8)
    shape = (routing.num_local_experts, inter // 2 if fp8 else inter, hidden)
    return x.new_empty(shape, dtype=torch.bfloat16), x.new_empty(shape, dtype=torch.bfloat16)


@_custom_op("gate_up_wgrad_accumulate", ("main_grad_gate", "main_grad_up"))
def gate_up_wgrad_accumulate(
    main_grad_gate: torch.Tensor,
    main_grad_up: torch.Tensor,
    d_gate_up: torch.Tensor,
    x: torch.Tensor,
    routing: RoutingSchedule,
    d_gate_up_scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
) -> None:
    """main_grad_gate, main_grad_up [E_l, I, H] fp32/bf16 += d_w_gate, d_w_up, in place."""
    _gate_up_wgrad(d_gate_up, x, routing, d_gate_up_scale, x_scale, main_grad_gate, main_grad_up)


@gate_up_wgrad_accumulate.register_fake
def _(main_grad_gate, main_grad_up, d_gate_up, x, routing, d_gate_up_scale=None, x_scale=None):
    return None


def _gate_up_wgrad(d_gate_up, x, routing, d_gate_up_scale, x_scale, main_gate, main_up):
    if d_gate_up_scale is None:
        return wgrad.gate_up_wgrad(d_gate_up, x, routing, main_gate, main_up)
    return wgrad.gate_up_wgrad_fp8_block(d_gate_up, d_gate_up_scale, x, x_scale, routing, main_gate, main_up)


# --------------------------------------------------------------------------- fp8_block quantize

from mok.kernels.quant import fp8_block as quant_fp8_block  # noqa: E402  (appended section keeps its imports here)
from mok.kernels.quant.fp8_block import sorted_scale_rows  # noqa: E402


@_custom_op("quantize_fp8_block_activations", ())
def quantize_fp8_block_activations(
    x: torch.Tensor, num_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] e4m3, scale [M, K/128] fp32): x [M, K] in 1×128 blocks along K; rows at or past
    num_rows[0] (a schedule's rows in use, when given) left unwritten."""
    return quant_fp8_block.quantize_fp8_block_activations(x, num_rows)


def _fake_row_blocks(like: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake (q [rows, W] e4m3, scale [rows, ⌈W/128⌉] fp32) of a 1×128-block quantizer."""
    return like.new_empty(rows, width, dtype=torch.float8_e4m3fn), like.new_empty(
        rows, -(-width // 128), dtype=torch.float32
    )


def _fake_sorted_t(like: torch.Tensor, routing: RoutingSchedule, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake (q_t [W, rows] e4m3, scale_t [rows / S, W] fp32) of a transposing sorted-layout quantizer."""
    rows = routing.capacity_rows
    return like.new_empty(width, rows, dtype=torch.float8_e4m3fn), like.new_empty(
        rows // sorted_scale_rows(routing.block_m), width, dtype=torch.float32
    )


@quantize_fp8_block_activations.register_fake
def _(x, num_rows=None):
    return _fake_row_blocks(x, *x.shape)


@_custom_op("quantize_fp8_block_weights", ())
def quantize_fp8_block_weights(
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, q_t, scale_t) of a weight [E, N, K] in 128×128 blocks, as `mok.fp8_block_quantize`."""
    return quant_fp8_block.quantize_fp8_block_weights(w)


@quantize_fp8_block_weights.register_fake
def _(w):
    *lead, N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    new = w.new_empty
    return (
        new(*lead, N, K, dtype=torch.float8_e4m3fn), new(*lead, nb, kb, dtype=torch.float32),
        new(*lead, K, N, dtype=torch.float8_e4m3fn), new(*lead, kb, nb, dtype=torch.float32),
    )


@_custom_op("quantize_fp8_block_sorted_t", ())
def quantize_fp8_block_sorted_t(
    a: torch.Tensor, routing: RoutingSchedule, a_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_t [W, rows] e4m3, scale_t [rows / S, W] fp32): a sorted-layout [R, W] operand in 1×128
    blocks along its rows, per expert, transposed (`quant_fp8_block.quantize_fp8_block_sorted_t`);
    with `a_scale`, a is e4m3 in 1×128 blocks along W, dequantized first."""
    return quant_fp8_block.quantize_fp8_block_sorted_t(a, routing, a_scale)


@quantize_fp8_block_sorted_t.register_fake
def _(a, routing, a_scale=None):
    return _fake_sorted_t(a, routing, a.shape[1])


@_custom_op("quantize_fp8_block_gathered", ())
def quantize_fp8_block_gathered(
    x: torch.Tensor, routing: RoutingSchedule, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, K] e4m3, scale [rows, K/128] fp32): token rows x [T, K] gathered into the
    sorted layout and quantized in 1×128 blocks along K, without a bf16 copy
    (`quant_fp8_block.quantize_fp8_block_gathered`); rows past num_rows unwritten."""
    return quant_fp8_block.quantize_fp8_block_gathered(x, routing, topk)


@quantize_fp8_block_gathered.register_fake
def _(x, routing, topk):
    return _fake_row_blocks(x, routing.capacity_rows, x.shape[1])


@_custom_op("quantize_fp8_block_gathered_t", ())
def quantize_fp8_block_gathered_t(
    a: torch.Tensor, topk_weights: torch.Tensor | None, routing: RoutingSchedule, topk: int,
    a_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_t [W, rows] e4m3, scale_t [rows / S, W] fp32): token rows a [T, W] (times the router
    weights, when given) gathered into the sorted layout and quantized as
    `quantize_fp8_block_sorted_t`, without a bf16 copy (`quant_fp8_block.quantize_fp8_block_gathered_t`);
    with `a_scale`, a is e4m3 in 1×128 blocks along W, dequantized first."""
    return quant_fp8_block.quantize_fp8_block_gathered_t(a, routing, topk, topk_weights, a_scale)


@quantize_fp8_block_gathered_t.register_fake
def _(a, topk_weights, routing, topk, a_scale=None):
    return _fake_sorted_t(a, routing, a.shape[1])


@_custom_op("quantize_fp8_block_swiglu_sorted_t", ())
def quantize_fp8_block_swiglu_sorted_t(
    gate_up: torch.Tensor, routing: RoutingSchedule, swiglu_limit: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_t [I, rows] e4m3, scale_t [rows / S, I] fp32): h recomputed from the saved g, u
    [rows, 2, I] and quantized as `quantize_fp8_block_sorted_t`."""
    return quant_fp8_block.quantize_fp8_block_swiglu_sorted_t(gate_up, routing, swiglu_limit)


@quantize_fp8_block_swiglu_sorted_t.register_fake
def _(gate_up, routing, swiglu_limit):
    return _fake_sorted_t(gate_up, routing, gate_up.shape[2])


# --------------------------------------------------------------------------- mxfp8 quantize

from mok.kernels.quant import mxfp8 as quant_mxfp8  # noqa: E402  (appended section keeps its imports here)


@_custom_op("mxfp8_quantize", ())
def _mxfp8_quantize(
    t: torch.Tensor, rowwise: bool, colwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, q_t, scale_t) of `quant_mxfp8.mxfp8_quantize_triton`; a pair not asked for is an
    empty [0] tensor of its dtype (custom ops cannot return None)."""
    q, scale, q_t, scale_t = quant_mxfp8.mxfp8_quantize_triton(t, rowwise, colwise)
    empty = lambda dtype: t.new_empty(0, dtype=dtype)  # noqa: E731
    return (
        empty(torch.float8_e4m3fn) if q is None else q,
        empty(torch.uint8) if scale is None else scale,
        empty(torch.float8_e4m3fn) if q_t is None else q_t,
        empty(torch.uint8) if scale_t is None else scale_t,
    )


@_mxfp8_quantize.register_fake
def _(t, rowwise, colwise):
    quant_mxfp8.validate_mxfp8_quantize_args(t, rowwise, colwise)
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


def _pair_or_empty(t: torch.Tensor, pair: tuple[torch.Tensor | None, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """A pair of optional outputs with each None an empty [0] tensor (custom ops cannot return None)."""
    return tuple(t.new_empty(0, dtype=torch.bfloat16) if p is None else p for p in pair)


def _rounded_fake(t, rowwise, colwise):
    return tuple(t.new_empty(t.shape if wanted else (0,), dtype=torch.bfloat16) for wanted in (rowwise, colwise))


@_custom_op("mxfp8_round", ())
def _mxfp8_round(t: torch.Tensor, rowwise: bool, colwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of `quant_mxfp8.mxfp8_round`, bf16 in t's shape (one not asked for: empty [0])."""
    return _pair_or_empty(t, quant_mxfp8.mxfp8_round(t, rowwise, colwise))


@_mxfp8_round.register_fake
def _(t, rowwise, colwise):
    quant_mxfp8.validate_mxfp8_quantize_args(t, rowwise, colwise)
    return _rounded_fake(t, rowwise, colwise)


@_custom_op("mxfp8_round_sorted", ())
def _mxfp8_round_sorted(
    a: torch.Tensor, routing: RoutingSchedule, rowwise: bool, colwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mok::mxfp8_round` of a sorted-layout operand [rows, W] (padding rows zeros)."""
    return _pair_or_empty(a, quant_mxfp8.mxfp8_round(a, rowwise, colwise, routing))


@_mxfp8_round_sorted.register_fake
def _(a, routing, rowwise, colwise):
    return _rounded_fake(a, rowwise, colwise)


def mxfp8_round(
    t: torch.Tensor, rowwise: bool = True, colwise: bool = False,
    routing: RoutingSchedule | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """t rounded to the MXFP8 grid along its rows and/or columns, bf16 (`quant_mxfp8.mxfp8_round`;
    with `routing`, t is an operand in that schedule's sorted layout); None for the
    orientation not asked for."""
    if routing is None:
        rows, cols = _mxfp8_round(t, rowwise, colwise)
    else:
        rows, cols = _mxfp8_round_sorted(t, routing, rowwise, colwise)
    return rows if rowwise else None, cols if colwise else None


# --------------------------------------------------------------------------- expert-parallel dispatch

from mok.kernels.comm import dispatch  # noqa: E402  (appended section keeps its imports here)


@_custom_op("pack_rows", ())
def pack_rows(src: torch.Tensor, route_slot: torch.Tensor, routes_per_row: int, num_send_rows: int) -> torch.Tensor:
    """send [num_send_rows, W]: row slot(r) holds src[r // routes_per_row] (`dispatch.pack_rows`)."""
    return dispatch.pack_rows(src, route_slot, routes_per_row, num_send_rows)


@pack_rows.register_fake
def _(src, route_slot, routes_per_row, num_send_rows):
    return src.new_empty(num_send_rows, src.shape[1])


@_custom_op("unpack_rows", ())
def unpack_rows(recv: torch.Tensor, route_slot: torch.Tensor) -> torch.Tensor:
    """[T·topk, W]: row r holds recv[slot(r)], zeros without a slot (`dispatch.unpack_rows`)."""
    return dispatch.unpack_rows(recv, route_slot)


@unpack_rows.register_fake
def _(recv, route_slot):
    return recv.new_empty(route_slot.shape[0], recv.shape[1])
