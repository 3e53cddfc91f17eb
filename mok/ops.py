"""The kernels as `torch.library` custom ops (`mok::<name>`) with fake implementations.

Fake implementations state each op's shape contract from host-known sizes only (the
schedule's capacities), which is what lets `torch.compile(fullgraph=True)` trace a mok
layer and CUDA graphs capture it: no output shape depends on routing data.

The schedule travels as five tensors (row_source, tile_expert, expert_offsets,
expert_counts, num_rows); `routing_tensors` / `routing_from_tensors` convert.
"""

from __future__ import annotations

import torch

from mok.kernels import combine as combine_kernels
from mok.kernels import grouped_gemm
from mok.kernels.schedule import RoutingSchedule, build_routing_schedule, capacity_rows


def routing_tensors(schedule: RoutingSchedule) -> tuple[torch.Tensor, ...]:
    return (schedule.row_source, schedule.tile_expert, schedule.expert_offsets, schedule.expert_counts, schedule.num_rows)


def routing_from_tensors(row_source, tile_expert, expert_offsets, expert_counts, num_rows, block_m: int) -> RoutingSchedule:
    return RoutingSchedule(
        row_source, tile_expert, expert_offsets, expert_counts, num_rows,
        block_m=block_m, capacity_rows=row_source.shape[0], num_local_experts=expert_counts.shape[0],
    )


# --------------------------------------------------------------------------- schedule


@torch.library.custom_op("mok::routing_schedule", mutates_args=("error_flag",))
def routing_schedule(
    topk_ids: torch.Tensor, error_flag: torch.Tensor, num_local_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_source, tile_expert, expert_offsets, expert_counts, num_rows) of `schedule.py`."""
    return routing_tensors(build_routing_schedule(topk_ids, num_local_experts, block_m, error_flag))


@routing_schedule.register_fake
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


@torch.library.custom_op("mok::gate_up_swiglu", mutates_args=())
def gate_up_swiglu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    row_source: torch.Tensor,
    tile_expert: torch.Tensor,
    expert_offsets: torch.Tensor,
    expert_counts: torch.Tensor,
    num_rows: torch.Tensor,
    block_m: int,
    topk: int,
    swiglu_limit: float | None,
    store_gate_up: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [rows, I] bf16 and gate_up [rows, 2, I] bf16 (an empty [0, 2, I] when not stored)."""
    routing = routing_from_tensors(row_source, tile_expert, expert_offsets, expert_counts, num_rows, block_m)
    h, gate_up = grouped_gemm.gate_up_swiglu(x, w_gate, w_up, routing, topk, swiglu_limit, store_gate_up)
    if gate_up is None:
        gate_up = h.new_empty(0, 2, h.shape[1])
    return h, gate_up


@gate_up_swiglu.register_fake
def _(x, w_gate, w_up, row_source, tile_expert, expert_offsets, expert_counts, num_rows, block_m, topk, swiglu_limit, store_gate_up):
    rows, inter = row_source.shape[0], w_gate.shape[1]
    return x.new_empty(rows, inter), x.new_empty(rows if store_gate_up else 0, 2, inter)


@torch.library.custom_op("mok::down_scatter", mutates_args=())
def down_scatter(
    h: torch.Tensor,
    w_down: torch.Tensor,
    row_source: torch.Tensor,
    tile_expert: torch.Tensor,
    expert_offsets: torch.Tensor,
    expert_counts: torch.Tensor,
    num_rows: torch.Tensor,
    block_m: int,
    num_slots: int,
) -> torch.Tensor:
    """y [num_slots, H] bf16, each route's unweighted expert output in its slot."""
    routing = routing_from_tensors(row_source, tile_expert, expert_offsets, expert_counts, num_rows, block_m)
    return grouped_gemm.down_scatter(h, w_down, routing, num_slots)


@down_scatter.register_fake
def _(h, w_down, row_source, tile_expert, expert_offsets, expert_counts, num_rows, block_m, num_slots):
    return h.new_empty(num_slots, w_down.shape[1])


# --------------------------------------------------------------------------- combine


@torch.library.custom_op("mok::combine", mutates_args=())
def combine(y: torch.Tensor, topk_weights: torch.Tensor, y_shared: torch.Tensor | None) -> torch.Tensor:
    """out [T, H] bf16 = y_shared + Σ_j w·y, fp32, ascending j."""
    return combine_kernels.combine(y, topk_weights, y_shared)


@combine.register_fake
def _(y, topk_weights, y_shared):
    return y.new_empty(topk_weights.shape[0], y.shape[1])
