"""The functional API: workspace, schedule, forward, backward, recompute.

A call runs in four steps, each usable alone:

    workspace = get_workspace(config, group, device=, num_local_tokens=, hidden_size=, topk=)
    schedule  = build_schedule(workspace, config, topk_ids, num_local_experts=)
    out, ctx  = forward(config, workspace, schedule, x, topk_weights,
                        ws_gate, ws_up, ws_down, w_gate, w_up, w_down, swiglu_limit=)
    grads     = backward(config, workspace, schedule, ctx, d_out, x, topk_weights,
                         ws_gate, ws_up, ws_down, w_gate, w_up, w_down, swiglu_limit=)

`moe(...)` bundles them into one autograd-aware call. Shared-expert weights may be None.

Backends: "reference" runs `mok.reference` (fp32 math, any device, expert parallelism
through `torch.distributed` collectives); "triton" runs the fused GPU kernels where they
support the call, under expert parallelism with rows moved by `mok.transport`.
`MoKConfig.backend="auto"` picks triton when it can.

Outputs: `out` and the gradients of x and of the weights are bf16, the
router-weight gradient fp32. Errors found on the device (bad expert ids, capacity
overflow) set the workspace's error flag; `check_errors(workspace)` raises them (a host
sync), and `MoKConfig(strict=True)` calls it after every step.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from mok import ops, reference
from mok.config import MoKConfig
from mok.kernels.common import ERROR_BAD_EXPERT_ID, ERROR_CAPACITY_OVERFLOW, ERROR_PEER_TIMEOUT, interpreting
from mok.kernels.gemm.common import routing_block_m
from mok.kernels.routing.schedule import RoutingSchedule
from mok.precision import recipe, take
from mok.precision.base import ArrivingRows, ReturningRows, capturing_cuda_graph
from mok.precision.bf16 import Bf16Saved
from mok.reference import Gradients
from mok.transport import Dispatch, Transport, check_same_across_ranks, create_transport
from mok.transport.common import exchange_beside, finish_now, own_tiles_split
from mok.validation import check_layer_inputs, check_tensor, check_topk_ids_values, flatten_tokens

__all__ = [
    "Workspace",
    "Schedule",
    "ForwardContext",
    "Gradients",
    "MoKError",
    "get_workspace",
    "create_workspace",
    "clear_workspace_cache",
    "build_schedule",
    "forward",
    "backward",
    "recompute_forward_context",
    "check_errors",
    "moe",
    "pack_gate_up",
    "expert_counts",
]


def pack_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of a gate and an up weight (routed [E_l, I, H] or shared [I_s, H]) that share
    one [2, ...] allocation, returned as its two (contiguous) halves.

    The triton backend's bf16 gate/up GEMM reads such a pair as one operand: one TMA box
    holds a gate and an up tile, and one 2·BLOCK_N-wide MMA per K step replaces two, so
    the x tile leaves shared memory once instead of twice (H200: 5% faster on qwen3-30b's
    and deepseek-v3-slice's shapes, bitwise the same result; from I = 8192 on the GEMM
    keeps two MMAs, which measured faster there). `MoKMoE` keeps its weights so;
    functional callers opt in by storing their weights as these views. Any pair works:
    one that is not packed takes two MMAs.
    """
    if w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype or w_gate.device != w_up.device:
        raise ValueError(
            f"w_up: expected the shape, dtype and device of w_gate ({list(w_gate.shape)} {w_gate.dtype} "
            f"{w_gate.device}), got {list(w_up.shape)} {w_up.dtype} {w_up.device}"
        )
    return torch.stack((w_gate, w_up)).unbind(0)  # halves of one [2, E_l, I, H]


class MoKError(RuntimeError):
    """A condition found on the device (capacity overflow, bad expert ids, a peer that never came)."""


_ERROR_MESSAGES = {
    ERROR_BAD_EXPERT_ID: "topk_ids held an expert id out of range or repeated within a row",
    ERROR_CAPACITY_OVERFLOW: "routing exceeded the schedule capacity (raise schedule_capacity_multiplier)",
    ERROR_PEER_TIMEOUT: "a peer rank did not arrive within MoKConfig.peer_timeout_s (a rank died, hung or skipped "
                        "a call); the ranks are out of step: call clear_workspace_cache() before the next call",
}


# --------------------------------------------------------------------------- workspace


@dataclass(frozen=True, eq=False)
class Workspace:
    """Per-(group, device, shape) state reused across calls: buffers, flags, the group.

    num_local_tokens is the most tokens one call may bring on this rank.
    """

    device: torch.device
    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    num_local_tokens: int
    hidden_size: int
    topk: int
    error_flag: torch.Tensor  # [1] int32, bits ERROR_*; zeroed by check_errors
    buffers: dict = field(default_factory=dict)
    transport: Transport | None = None  # moves rows between the ranks of the group (P > 1)
    error_copy: _ErrorCopy = field(default_factory=lambda: _ErrorCopy())  # the flag as the host last saw it


_WORKSPACE_CACHE: dict[tuple, Workspace] = {}


def _group_size_and_rank(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    if not dist.is_initialized():
        raise ValueError("group: expected an initialized torch.distributed process group, but none is initialized")
    return dist.get_world_size(group), dist.get_rank(group)


def create_workspace(
    config: MoKConfig,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device | str,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
) -> Workspace:
    """A new workspace (uncached). Under a group of P > 1 ranks, checks that every rank
    agrees on hidden_size and topk and creates the transport (collectives, once per
    workspace)."""
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config: expected a MoKConfig, got {type(config).__name__}")
    for name, value in (("num_local_tokens", num_local_tokens), ("hidden_size", hidden_size), ("topk", topk)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    world_size, rank = _group_size_and_rank(group)
    error_flag = torch.zeros(1, dtype=torch.int32, device=device)
    transport = None
    if world_size > 1:
        check_same_across_ranks(group, {"hidden_size": hidden_size, "topk": topk}, device)
        transport = create_transport(config, group, device=device, num_local_tokens=num_local_tokens,
                                     hidden_size=hidden_size, topk=topk, error_flag=error_flag)
    return Workspace(
        device=device,
        group=group,
        world_size=world_size,
        rank=rank,
        num_local_tokens=num_local_tokens,
        hidden_size=hidden_size,
        topk=topk,
        error_flag=error_flag,
        transport=transport,
    )


def get_workspace(
    config: MoKConfig,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device | str,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
    cache: dict | None = None,
) -> Workspace:
    """The cached workspace for these arguments (created on first use), from `cache` if
    given (`MoKMoE` gives each layer its own, so layers never share buffers), else from
    the module-wide cache that `clear_workspace_cache` empties."""
    cache = _WORKSPACE_CACHE if cache is None else cache
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (config, id(group) if group is not None else None, device, num_local_tokens, hidden_size, topk)
    workspace = cache.get(key)
    if workspace is None:
        workspace = create_workspace(
            config, group, device=device, num_local_tokens=num_local_tokens, hidden_size=hidden_size, topk=topk
        )
        cache[key] = workspace
    return workspace


def clear_workspace_cache() -> None:
    """Drops every cached workspace (their buffers are freed once nothing else holds them)."""
    _WORKSPACE_CACHE.clear()


class _ErrorCopy:
    """The error flag as of the last triton-backend call, copied into pinned host memory
    behind that call's work (a non_blocking copy and an event, no sync). Once the event has
    completed the host reads the copy for free, so the next call can raise a bad routing
    without ever waiting for the device."""

    def __init__(self):
        self.host: torch.Tensor | None = None  # [1] int32, pinned; allocated on the first copy
        self.copied: torch.cuda.Event | None = None

    @staticmethod
    def _skipped(error_flag: torch.Tensor) -> bool:
        # A captured graph would replay the copy with no host read in step with it, and a query
        # of an event is not allowed while a stream captures; torch.compile cannot trace either.
        return torch.compiler.is_compiling() or not error_flag.is_cuda or capturing_cuda_graph()

    def take(self, error_flag: torch.Tensor) -> None:
        """Queues the copy on the current stream, after everything queued so far."""
        if self._skipped(error_flag):
            return
        if self.host is None:
            self.host = torch.zeros(1, dtype=torch.int32, device="cpu", pin_memory=True)
            self.copied = torch.cuda.Event()
        stream = torch.cuda.current_stream(error_flag.device)
        self.host.copy_(error_flag, non_blocking=True)
        self.copied.record(stream)

    def landed_flags(self, error_flag: torch.Tensor) -> int:
        """The copied bits if the last copy has landed, else 0. Never waits."""
        if self._skipped(error_flag) or self.copied is None or not self.copied.query():
            return 0
        return int(self.host[0])

    def clear(self) -> None:
        if self.host is not None:
            self.host.zero_()


def _raise_flags(workspace: Workspace, flags: int) -> None:
    if flags:
        workspace.error_flag.zero_()
        workspace.error_copy.clear()
        messages = [msg for bit, msg in _ERROR_MESSAGES.items() if flags & bit]
        raise MoKError("mok: " + "; ".join(messages))


def check_errors(workspace: Workspace, *, blocking: bool = True) -> None:
    """Raises MoKError for any error flag the device set, then clears the flag.
    `blocking=True` reads the flag itself (a host sync); `blocking=False` reads only the copy
    the last triton-backend call left in host memory, if it has landed (no sync, may be one
    call behind). Under expert parallelism on the triton backend the flag also holds every
    other rank's routing errors (they travel with the dispatch), so all ranks raise alike."""
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking: expected a bool, got {type(blocking).__name__}")
    if not blocking:
        _raise_flags(workspace, workspace.error_copy.landed_flags(workspace.error_flag))
        return
    _raise_flags(workspace, int(workspace.error_flag.item()))


def _raise_landed_errors(workspace: Workspace) -> None:
    """At the start of a triton-backend call on one rank: raises what an earlier call's copied
    flag shows, without a sync. Under expert parallelism the ranks' copies land at different
    times, and one rank raising here would leave the others waiting in the next exchange, so
    there the caller runs `check_errors` at a point every rank reaches."""
    if workspace.world_size == 1:
        _raise_flags(workspace, workspace.error_copy.landed_flags(workspace.error_flag))


# --------------------------------------------------------------------------- backend choice


def _triton_unsupported(config: MoKConfig, workspace: Workspace) -> str | None:
    """Why the triton backend cannot run this call, or None when it can (every precision runs)."""
    if workspace.device.type != "cuda" and not interpreting():
        return f"it runs on CUDA devices (or under TRITON_INTERPRET=1), not {workspace.device}"
    return None


def _backend(config: MoKConfig, workspace: Workspace) -> str:
    reason = _triton_unsupported(config, workspace)
    if config.backend == "triton":
        if reason is not None:
            raise NotImplementedError(f"backend='triton' cannot run this call: {reason}; use backend='auto'")
        return "triton"
    if config.backend == "auto" and reason is None and workspace.device.type == "cuda":
        return "triton"
    return "reference"


# --------------------------------------------------------------------------- schedule


@dataclass(frozen=True, eq=False)
class Schedule:
    """Where every route goes this call. Built once, used by forward and backward.

    topk_ids: [T, topk] global expert ids. num_experts = num_local_experts · P.
    On the triton backend, `routing` holds the device schedule of the routed experts and
    `shared_routing` the one of the shared expert (every token to one expert), both
    `RoutingSchedule`s (`mok.ops.routing_schedule`), which the ops take as they are.
    Under expert parallelism `dispatch` moves rows to the experts' ranks and back, and
    `routing` covers the rows this rank's experts receive (each a token row sent once per
    (token, rank), with topk = k_l = min(topk, E_l) routes).
    """

    topk_ids: torch.Tensor
    num_local_experts: int
    num_experts: int
    backend: str
    routing: RoutingSchedule | None = None
    shared_routing: RoutingSchedule | None = None
    dispatch: Dispatch | None = None


def build_schedule(
    workspace: Workspace,
    config: MoKConfig,
    topk_ids: torch.Tensor,
    *,
    num_local_experts: int,
    has_shared_expert: bool = True,
) -> Schedule:
    """Validates the routing and prepares what forward and backward need to move tokens.
    `has_shared_expert=False` skips the shared expert's schedule (forward then refuses
    shared-expert weights).

    On the triton backend no data leaves the device: bad expert ids (and, under expert
    parallelism, routes beyond the transport's capacity) set the workspace's error flag
    (raised by `check_errors`, or at once with `MoKConfig(strict=True)`). Under expert
    parallelism it is a collective: it exchanges the routing with the other ranks."""
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int32, torch.int64), shape=(None, workspace.topk), device=workspace.device)
    num_tokens = topk_ids.shape[0]
    if num_tokens > workspace.num_local_tokens:
        raise ValueError(f"topk_ids: expected at most num_local_tokens={workspace.num_local_tokens} rows, got {num_tokens}")
    if not isinstance(num_local_experts, int) or num_local_experts < 1:
        raise ValueError(f"num_local_experts: expected a positive int, got {num_local_experts!r}")
    num_experts = num_local_experts * workspace.world_size
    if workspace.topk > num_experts:
        raise ValueError(f"topk_ids: expected topk <= num_experts ({num_experts}), got topk={workspace.topk}")
    backend = _backend(config, workspace)
    if backend == "reference":
        check_topk_ids_values(topk_ids, num_experts)
        return Schedule(topk_ids.long(), num_local_experts, num_experts, backend)
    _raise_landed_errors(workspace)
    block_m = routing_block_m()
    dispatch = None
    if workspace.transport is None:
        routing = ops.routing_schedule(topk_ids, workspace.error_flag, num_local_experts, block_m)
    else:  # `routing` then covers the rows this rank's experts receive
        fp8_wire = recipe(config.precision).sends_fp8_rows()
        dispatch, routing = workspace.transport.plan(topk_ids, num_local_experts, workspace.error_flag, block_m,
                                                     fp8_wire)
    shared_routing = None
    if has_shared_expert:
        all_tokens = torch.zeros(num_tokens, 1, dtype=torch.int32, device=topk_ids.device)  # [T, 1]: one expert
        shared_routing = ops.routing_schedule(all_tokens, workspace.error_flag, 1, block_m)
    if config.strict:
        check_errors(workspace)
    return Schedule(topk_ids, num_local_experts, num_experts, backend, routing, shared_routing, dispatch)


# --------------------------------------------------------------------------- forward / backward


@dataclass(eq=False)
class SavedActivations:
    """What the triton backend's forward leaves for its backward. `routed` and `shared` are the
    recipes' own (`Recipe.forward`'s); the backward takes every tensor out as it reads it
    (`precision.take`), so that a context it releases frees each after its last reader."""

    routed: Any  # the routed experts' recipe's saved dataclass
    shared: Bf16Saved | None = None  # the shared expert's (bf16 recipe)
    route_row: torch.Tensor | None = None  # [T·topk] each route's row of y and dx, where they stay sorted (one rank)
    # under expert parallelism: the rows this rank's experts received ([P·C, H], or e4m3 rows and
    # scales where the recipe `sends_fp8_rows`) and their routes' router weights [P·C, k_l] fp32
    expert_x: torch.Tensor | tuple | None = None
    expert_weights: torch.Tensor | None = None

    def copy(self) -> SavedActivations:
        """A copy to take from that leaves this one whole (the tensors are shared, not copied)."""
        return dataclasses.replace(self, routed=copy.copy(self.routed), shared=copy.copy(self.shared))


@dataclass(eq=False)
class ForwardContext:
    """What forward leaves for backward: `saved` on the triton backend (None without
    needs_backward; the reference backend recomputes everything and saves nothing).
    `routed_weights`: where the recipe's GEMMs read copies of the routed weights (mxfp8,
    fp8_block), the copies the forward read, which the backward's read too (as autograd's saved
    tensors would be): without them a step captured in a CUDA graph, or traced by torch.compile,
    where no copy is cached, quantized every weight twice. Not frozen: a backward with
    `release_context=True` empties `saved` and `routed_weights` and sets `released`."""

    backend: str
    precision: str
    saved: SavedActivations | None = None
    released: bool = False  # a backward with release_context=True consumed `saved`
    routed_weights: tuple = ()  # the recipe's `prepare_weights` copies, or ()


# The shared expert runs in bf16 whatever the layer's precision.
_SHARED_RECIPE = recipe("bf16")


def _check_call(config, workspace, schedule, x, topk_weights, ws_gate, ws_up, ws_down, w_gate, w_up, w_down):
    num_tokens, hidden, _, num_local_experts, topk = check_layer_inputs(
        x, schedule.topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, precision=config.precision,
        strided_weights=schedule.backend == "reference" and recipe(config.precision).strided_reference_weights,
    )
    if hidden != workspace.hidden_size:
        raise ValueError(f"x: expected hidden size {workspace.hidden_size} (the workspace's), got {hidden}")
    if num_local_experts != schedule.num_local_experts:
        raise ValueError(
            f"w_gate: expected {schedule.num_local_experts} local experts (the schedule's), got {num_local_experts}"
        )
    if x.device != workspace.device:
        raise ValueError(f"x: expected a tensor on {workspace.device} (the workspace's device), got {x.device}")
    if ws_gate is not None and schedule.backend == "triton" and schedule.shared_routing is None:
        raise ValueError("ws_gate: the schedule was built with has_shared_expert=False, so it takes no shared expert")


def _reference_call(fn, config, workspace, schedule, x, topk_weights, ws_gate, ws_up, ws_down, w_gate, w_up, w_down, swiglu_limit, *lead):
    """`fn` (reference.moe_forward or moe_backward, or their EP versions) on this call's
    operands: the routed experts' rounded as the precision's recipe rounds them
    (`Recipe.reference_operands`); the shared expert keeps reading x and its weights in bf16, and
    the intermediate h stays fp32. Autocast is switched off inside: the reference defines the
    fp32 math, and a caller's `torch.autocast` would otherwise run its matmuls in bf16."""
    with torch.autocast(workspace.device.type, enabled=False):
        routed_x, w_gate_op, w_up_op, w_down_op = recipe(config.precision).reference_operands(x, w_gate, w_up, w_down)
        args = (*lead, x, schedule.topk_ids, topk_weights, w_gate_op, w_up_op, w_down_op, ws_gate, ws_up, ws_down)
        if workspace.world_size > 1:
            return getattr(reference, "ep_" + fn.__name__)(
                *args, swiglu_limit=swiglu_limit, group=workspace.group, routed_x=routed_x
            )
        return fn(*args, swiglu_limit=swiglu_limit, routed_x=routed_x)


class ForwardOverlap(NamedTuple):
    """A forward's SMs for the exchanges that run beside other work (`MoKConfig`'s fields of the
    same names; 0: the exchange finishes before the work)."""

    comm_sms: int = 0  # the x dispatch beside the shared expert (overlap_comm_sms)
    dispatch_sms: int = 0  # the x dispatch beside the gate/up GEMM's own tiles too (overlap_dispatch_sms)
    return_sms: int = 0  # the y return beside the down GEMM's own tiles (overlap_return_sms)


def _routed_forward(routed_recipe, schedule, x, topk_weights, routed, swiglu_limit, needs_backward, beside,
                    overlap: ForwardOverlap):
    """(y, route_row, combine weights, what the backward reads, what `beside()` returned): y
    [T·topk, H] of the routed experts in route slots and route_row None, or where the recipe has
    `sorted_outputs` y [capacity_rows, H] in the sorted layout and route_row [T·topk] each route's
    row of it (also kept for the backward's dx); the weights are topk_weights. Under expert
    parallelism the token rows travel to the experts' ranks and y comes back (`_per_rank_forward`).
    `beside` (None: nothing) is work that does not need the routed experts: it runs beside the
    dispatch where `overlap` says so."""
    dispatch = schedule.dispatch
    topk = topk_weights.shape[1]
    if dispatch is None:
        sorted_rows = routed_recipe.sorted_outputs()
        y, routed_saved = routed_recipe.forward(
            x, routed, schedule.routing, topk, x.shape[0] * topk, swiglu_limit, needs_backward, sorted_rows=sorted_rows
        )
        route_row = schedule.routing.route_row if sorted_rows else None
        return y, route_row, topk_weights, SavedActivations(routed_saved, route_row=route_row), _run(beside)
    return _per_rank_forward(routed_recipe, schedule, x, topk_weights, routed, swiglu_limit, needs_backward, beside,
                             overlap)


def _run(work):
    """work() (None for no work)."""
    return None if work is None else work()


def _per_rank_forward(routed_recipe, schedule, x, topk_weights, routed, swiglu_limit, needs_backward, beside,
                      overlap: ForwardOverlap):
    """`_routed_forward` with each token row sent once per (token, rank) (`mok.transport`): each
    received row is a token with topk = k_l, whose routes the expert's rank sums (Σ_q w·y,
    ascending q, fp32, one bf16 row); y is [P·C, H] of those partial rows back at the source,
    route_row the pairs' rows (token_slot [T·P]) and the combine weights ones [T, P]. `beside`
    runs while the x rows travel (`overlap.comm_sms`). The GEMMs' tiles of this rank's own tokens
    hide exchanges (`own_tiles_split`): with `overlap.dispatch_sms` the gate/up GEMM's run (with
    `beside`) while the peers' x rows arrive, where the recipe can (`gate_up_while_arriving`);
    with `overlap.return_sms` the down GEMM's run last, while the peers' partial rows go back."""
    dispatch = schedule.dispatch
    k_l = dispatch.routes_per_row
    landed = {}  # the exchange's received rows ("x") and their routes' weights ("weights")
    arriving = returning = None
    split_gate_up = overlap.dispatch_sms > 0 and routed_recipe.gate_up_while_arriving()
    if split_gate_up or overlap.return_sms:
        own, others = own_tiles_split(schedule.routing, dispatch.rank, dispatch.send_capacity * k_l)
    if overlap.return_sms:
        returning, returned = _returning_rows(dispatch, own, others, landed, x.shape[1], overlap.return_sms)
    if split_gate_up:
        rows_now, finish = dispatch.start_dispatch_split(x, topk_weights, overlap.dispatch_sms)

        def land():
            landed["x"], landed["weights"] = finish_now(finish, x.device)
            return landed["x"]

        arriving = ArrivingRows(own, others, rows_now, land, overlap.dispatch_sms)
        with arriving.before_landing():
            beside_result = _run(beside)
    else:
        # [P·C, H] (or e4m3 rows and their scales: the recipe's `sends_fp8_rows`), [P·C, k_l]
        (landed["x"], landed["weights"]), beside_result = exchange_beside(
            lambda programs: dispatch.start_dispatch(x, topk_weights, programs), lambda: _run(beside), x.device,
            overlap.comm_sms if beside is not None else 0,
        )
    y_routes, routed_saved = routed_recipe.forward(
        None if arriving else landed["x"], routed, schedule.routing, k_l, dispatch.num_expert_rows * k_l,
        swiglu_limit, needs_backward, arriving=arriving, returning=returning,
    )
    if returning is None:
        y = dispatch.combine(ops.combine(y_routes, landed["weights"], None, dispatch.received_routes))  # [P·C, H]
    else:
        own_parts, finish = returned
        _sum_received_routes(y_routes, landed["weights"], dispatch, dispatch.own_rows(), own_parts)
        y = finish_now(finish, x.device)
    ones = torch.ones(x.shape[0], dispatch.world_size, dtype=torch.float32, device=x.device)  # [T, P]
    saved = SavedActivations(routed_saved, expert_x=landed["x"], expert_weights=landed["weights"])
    return y, dispatch.token_slot, ones, saved, beside_result


def _returning_rows(dispatch, own, others, landed: dict, hidden: int, return_sms: int
                    ) -> tuple[ReturningRows, list]:
    """(the down GEMM's `ReturningRows`, [] that its `send` fills with `start_combine_split`'s
    (where the own partial rows go, finish)): `send` sums the peers' received rows into their
    partial rows, with the weights in `landed` by then, and starts them back."""
    parts = torch.empty(dispatch.num_expert_rows, hidden, dtype=torch.bfloat16,
                        device=dispatch.token_slot.device)  # [P·C, H]
    returned = []

    def send(y_routes):
        for rows in dispatch.peer_blocks():
            _sum_received_routes(y_routes, landed["weights"], dispatch, rows, parts[rows])
        returned.extend(dispatch.start_combine_split(parts, return_sms))

    return ReturningRows(others, own, send, return_sms), returned


def _sum_received_routes(y_routes, expert_weights, dispatch, rows: slice, out) -> None:
    """out [rows, H] = Σ_q w·y over the routes of the received rows `rows` (a block of the P·C),
    fp32, ascending q (`ops.combine_into`)."""
    if rows.stop > rows.start:
        k_l = dispatch.routes_per_row
        route_rows = dispatch.received_routes[rows.start * k_l: rows.stop * k_l]
        ops.combine_into(y_routes, expert_weights[rows], route_rows, out)


def _triton_forward(routed_recipe, schedule, x, topk_weights, shared, routed, swiglu_limit, needs_backward,
                    overlap: ForwardOverlap = ForwardOverlap()):
    """out and what the backward reads (None without `needs_backward`): the recipes' saved
    pre-activations of every routed row and of the shared expert's. `routed` as the recipe's
    `prepare_weights` gives them."""
    num_tokens = topk_weights.shape[0]

    def shared_forward():
        shared_experts = tuple(w.unsqueeze(0) for w in shared)  # one expert of the grouped GEMMs
        return _SHARED_RECIPE.forward(
            x, shared_experts, schedule.shared_routing, 1, num_tokens, swiglu_limit, needs_backward,
            token_order=True,
        )

    y, route_row, weights, saved, shared_result = _routed_forward(
        routed_recipe, schedule, x, topk_weights, routed, swiglu_limit, needs_backward,
        shared_forward if shared[0] is not None else None, overlap,
    )
    y_shared = None
    if shared_result is not None:
        y_shared, saved.shared = shared_result
    return ops.combine(y, weights, y_shared, route_row), saved if needs_backward else None


def forward(
    config: MoKConfig,
    workspace: Workspace,
    schedule: Schedule,
    x: torch.Tensor,  # [T, H] bf16
    topk_weights: torch.Tensor,  # [T, topk] fp32
    ws_gate: torch.Tensor | None,  # [I_s, H] bf16
    ws_up: torch.Tensor | None,  # [I_s, H] bf16
    ws_down: torch.Tensor | None,  # [H, I_s] bf16
    w_gate: torch.Tensor,  # [E_l, I, H]
    w_up: torch.Tensor,  # [E_l, I, H]
    w_down: torch.Tensor,  # [E_l, H, I]
    swiglu_limit: float | None = None,
    *,
    needs_backward: bool = True,
) -> tuple[torch.Tensor, ForwardContext]:
    """The layer's output [T, H] bf16 and the context backward needs (with
    `needs_backward=False` the triton backend skips saving the pre-activations)."""
    _check_call(config, workspace, schedule, x, topk_weights, ws_gate, ws_up, ws_down, w_gate, w_up, w_down)
    return _forward_checked(
        config, workspace, schedule, x, topk_weights, (ws_gate, ws_up, ws_down), (w_gate, w_up, w_down),
        swiglu_limit, needs_backward,
    )


def _forward_checked(config, workspace, schedule, x, topk_weights, shared, routed, swiglu_limit, needs_backward):
    """`forward` after its argument checks (`moe` checks once for both)."""
    if schedule.backend == "triton":
        routed_recipe = recipe(config.precision)
        routed = routed_recipe.prepare_weights(*routed)
        out, saved = _triton_forward(routed_recipe, schedule, x, topk_weights, shared, routed, swiglu_limit,
                                     needs_backward, ForwardOverlap(config.overlap_comm_sms,
                                                                    config.overlap_dispatch_sms,
                                                                    config.overlap_return_sms))
        if config.strict:
            check_errors(workspace)
        workspace.error_copy.take(workspace.error_flag)
        copies = routed if needs_backward and routed_recipe.weights_are_copies else ()
        return out, ForwardContext(schedule.backend, config.precision, saved, routed_weights=copies)
    out = _reference_call(
        reference.moe_forward, config, workspace, schedule, x, topk_weights, *shared, *routed, swiglu_limit,
    )
    return out.to(torch.bfloat16), ForwardContext(schedule.backend, config.precision)


def recompute_forward_context(
    config: MoKConfig,
    workspace: Workspace,
    schedule: Schedule,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    ws_gate: torch.Tensor | None,
    ws_up: torch.Tensor | None,
    ws_down: torch.Tensor | None,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
) -> ForwardContext:
    """The context `forward` returned for these inputs, rebuilt for activation
    checkpointing (bitwise equal to the original)."""
    return forward(
        config, workspace, schedule, x, topk_weights, ws_gate, ws_up, ws_down, w_gate, w_up, w_down, swiglu_limit
    )[1]


def _routed_backward(routed_recipe, schedule, saved, d_out, x, topk_weights, routed, swiglu_limit, main_grads, beside,
                     overlap_sms):
    """(dx_slots [T·topk, H], route_row None), or where the forward kept one (`_routed_forward`)
    (dx [capacity_rows, H] in the sorted layout, route_row); d_topk_weights [T, topk] fp32, the
    routed weight gradients and what `beside()` returned. Under expert parallelism the dOut rows
    travel to the experts' ranks (which kept the router weights from the forward and apply them in
    fp32), and partial dx rows and router-weight gradients come back (`_per_rank_backward`)."""
    num_tokens, topk = topk_weights.shape
    if schedule.dispatch is None:
        route_row = take(saved, "route_row")
        dx, d_topk_weights, state = routed_recipe.backward_data(
            d_out, x, topk_weights, routed, saved.routed, schedule.routing, topk, num_tokens * topk, swiglu_limit,
            sorted_rows=route_row is not None,
        )
        return dx, route_row, d_topk_weights, routed_recipe.backward_weights(state, main_grads), _run(beside)
    return _per_rank_backward(routed_recipe, schedule, saved, d_out, x, routed, swiglu_limit, main_grads, beside,
                              overlap_sms)


def _per_rank_backward(routed_recipe, schedule, saved, d_out, x, routed, swiglu_limit, main_grads, beside,
                       overlap_sms):
    """`_routed_backward` with dOut rows sent once per (token, rank) (`_per_rank_forward`): the
    expert's rank runs the backward of each received row's k_l routes (their router weights
    kept from the forward), sums the row's dx over them (ascending q, fp32, one bf16 row) and
    returns it with the routes' router-weight gradients. (dx [P·C, H] partial rows, route_row
    token_slot [T·P], d_topk_weights [T, topk], grads, what `beside()` returned). With
    `overlap_sms`, `beside` and the part of the recipe's backward that reads no dOut
    (`prepare_backward`) run while the dOut rows travel, the weight gradients while the dx rows
    travel back."""
    dispatch = schedule.dispatch
    expert_x = dispatch.received_x(take(saved, "expert_x"), x)  # [P·C, H] (or e4m3 rows and scales)
    expert_weights = take(saved, "expert_weights")  # [P·C, k_l]
    k_l = dispatch.routes_per_row

    def work():
        return _run(beside), routed_recipe.prepare_backward(expert_x, saved.routed, schedule.routing, k_l,
                                                            swiglu_limit)

    # [P·C, H] (or e4m3 rows and scales: the recipe's `sends_fp8_rows`)
    start = functools.partial(dispatch.start_dispatch_grad, d_out)
    prepared = None  # without overlap backward_data makes x's copy beside dOut's, in one pass
    if overlap_sms == 0:
        expert_d_out, beside_result = exchange_beside(start, lambda: _run(beside), d_out.device, 0)
    elif beside is None:
        # nothing persistent beside the exchange (the preparation's copies launch one program per
        # block of rows): it keeps the config's programs and every SM
        finish = start(None)
        beside_result, prepared = work()
        expert_d_out = finish_now(finish, d_out.device)
    else:
        expert_d_out, (beside_result, prepared) = exchange_beside(start, work, d_out.device, overlap_sms)
    dx_routes, d_weights, state = routed_recipe.backward_data(
        expert_d_out, expert_x, expert_weights, routed, saved.routed, schedule.routing, k_l,
        dispatch.num_expert_rows * k_l, swiglu_limit, prepared=prepared,
    )
    received = dispatch.received_routes.view(-1, k_l) >= 0  # [P·C, k_l]
    dx_parts = ops.combine(dx_routes, received.float(), None, dispatch.received_routes)  # [P·C, H]
    # empty routes have no row, so nothing wrote their gradient
    d_weights = torch.where(received, d_weights, 0.0)
    (dx, d_topk_weights), grads = exchange_beside(
        lambda programs: dispatch.start_combine_grad(dx_parts, d_weights, programs),
        lambda: routed_recipe.backward_weights(state, main_grads), d_out.device, overlap_sms,
    )
    return dx, dispatch.token_slot, d_topk_weights, grads, beside_result


def _triton_backward(routed_recipe, schedule, saved, d_out, x, topk_weights, shared, routed, swiglu_limit,
                     main_grads, overlap_sms=0) -> Gradients:
    """The backward on one GPU, no host sync: per expert group the recipe's data gradients (down
    dgrad + SwiGLU backward + router-weight gradient, gate/up dgrad into route slots), then its
    wgrad GEMMs; then d_x = dx_shared + Σ_j dx_slots (the combine with unit weights, ascending j;
    under expert parallelism + Σ_p of the ranks' partial rows, ascending p). Takes what it reads
    out of `saved` as it goes (pass a copy to keep them)."""
    num_tokens, topk = topk_weights.shape
    shared_saved = take(saved, "shared")
    d_out = d_out.to(torch.bfloat16)  # a GEMM operand (no copy when it already is bf16)

    def shared_backward():
        shared_experts = tuple(w.unsqueeze(0) for w in shared)  # one expert of the grouped GEMMs
        dx_shared, _, state = _SHARED_RECIPE.backward_data(
            d_out, x, None, shared_experts, shared_saved, schedule.shared_routing, 1, num_tokens,
            swiglu_limit, token_order=True,
        )
        grads = _SHARED_RECIPE.backward_weights(
            state, tuple(None if main_grads.get(n) is None else main_grads[n].unsqueeze(0) for n in _SHARED)
        )
        return dx_shared, tuple(g.squeeze(0) for g in grads)

    dx_slots, route_row, d_topk_weights, routed_grads, shared_result = _routed_backward(
        routed_recipe, schedule, saved, d_out, x, topk_weights, routed, swiglu_limit,
        tuple(main_grads.get(n) for n in _ROUTED), shared_backward if shared[0] is not None else None, overlap_sms,
    )
    dx_shared, shared_grads = shared_result if shared_result is not None else (None, (None, None, None))
    # unweighted sum over the routes (or, under expert parallelism once per rank, the P partial rows)
    num_parts = topk if route_row is None else route_row.shape[0] // num_tokens
    ones = torch.ones(num_tokens, num_parts, dtype=torch.float32, device=x.device)  # [T, topk or P]
    d_x = ops.combine(dx_slots, ones, dx_shared, route_row)
    return Gradients(d_x, d_topk_weights, *routed_grads, *shared_grads)


def backward(
    config: MoKConfig,
    workspace: Workspace,
    schedule: Schedule,
    context: ForwardContext,
    d_out: torch.Tensor,  # [T, H] bf16
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    ws_gate: torch.Tensor | None,
    ws_up: torch.Tensor | None,
    ws_down: torch.Tensor | None,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
    *,
    main_grads: dict[str, torch.Tensor] | None = None,
    release_context: bool = False,
) -> Gradients:
    """Every gradient in the layer's order: d_x, d_topk_weights, routed then shared weights.

    `main_grads` maps weight names ("w_gate", "w_up", "w_down", "ws_gate", "ws_up",
    "ws_down") to fp32 or bf16 buffers of the weight's shape: those gradients are added
    into the buffers in place (Megatron's main_grad), in fp32, and the buffers are returned
    in their places. "w_gate" and "w_up" (and "ws_gate", "ws_up") go together.

    `release_context=True` frees the context's activations as soon as the backward has read
    them (h after the down dgrad or the down weight gradient, g,u after the down dgrad), so the
    weight gradients never sit next to them; the context then serves no second backward (`moe`
    releases it unless autograd keeps the graph, `retain_graph=True`).

    In mxfp8 and fp8_block the backward's GEMMs read the routed weights' quantized copies that
    the forward made and left in the context, as autograd's saved tensors would be read: the
    weights given here are checked, not quantized again."""
    _check_call(config, workspace, schedule, x, topk_weights, ws_gate, ws_up, ws_down, w_gate, w_up, w_down)
    main_grads = _check_main_grads(main_grads, dict(zip(_ROUTED + _SHARED, (w_gate, w_up, w_down, ws_gate, ws_up, ws_down))))
    if not isinstance(context, ForwardContext) or context.precision != config.precision:
        raise ValueError("context: expected the ForwardContext that forward returned under this config")
    if context.released:
        raise ValueError(
            "context: its activations were released by an earlier backward (release_context=True); "
            "run forward or recompute_forward_context again for another backward"
        )
    check_tensor("d_out", d_out, dtypes=(torch.bfloat16, torch.float32), shape=tuple(x.shape), device=x.device)
    if schedule.backend == "triton" and context.backend != "triton":
        raise ValueError(f"context: expected a context of the triton backend (the schedule's), got {context.backend!r}")
    context.released = release_context
    if schedule.backend == "triton":
        if context.saved is None:
            raise ValueError("context: expected the pre-activations a forward with needs_backward=True saves")
        routed_recipe = recipe(config.precision)
        routed = context.routed_weights or routed_recipe.prepare_weights(w_gate, w_up, w_down)
        if release_context:
            context.routed_weights = ()
        saved = context.saved if release_context else context.saved.copy()  # taken from as the backward reads
        grads = _triton_backward(
            routed_recipe, schedule, saved, d_out, x, topk_weights, (ws_gate, ws_up, ws_down), routed, swiglu_limit,
            main_grads, config.overlap_comm_sms,
        )
        workspace.error_copy.take(workspace.error_flag)
        return grads
    grads = _reference_call(
        reference.moe_backward, config, workspace, schedule, x, topk_weights, ws_gate, ws_up, ws_down,
        w_gate, w_up, w_down, swiglu_limit, d_out,
    )
    out = []
    for name, grad in zip(Gradients._fields, grads):
        buffer = main_grads.get(name.removeprefix("d_"))
        if buffer is not None:
            out.append(buffer.add_(grad))
        else:
            out.append(grad if grad is None or name == "d_topk_weights" else grad.to(torch.bfloat16))
    return Gradients(*out)


_ROUTED = ("w_gate", "w_up", "w_down")
_SHARED = ("ws_gate", "ws_up", "ws_down")


def _check_main_grads(main_grads, weights: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    if main_grads is None:
        return {}
    if not isinstance(main_grads, dict):
        raise TypeError(f"main_grads: expected a dict of weight name to buffer, got {type(main_grads).__name__}")
    for name, buffer in main_grads.items():
        if name not in weights:
            raise ValueError(f"main_grads: expected keys among {tuple(weights)}, got {name!r}")
        weight = weights[name]
        if weight is None:
            raise ValueError(f"main_grads[{name!r}]: the layer has no {name} (no shared expert)")
        check_tensor(f"main_grads[{name!r}]", buffer, dtypes=(torch.float32, torch.bfloat16),
                     shape=tuple(weight.shape), device=weight.device)
    for gate, up in (("w_gate", "w_up"), ("ws_gate", "ws_up")):
        if (gate in main_grads) != (up in main_grads):
            raise ValueError(f"main_grads: expected {gate!r} and {up!r} together (one kernel computes both)")
    return main_grads


# --------------------------------------------------------------------------- autograd


def _autograd_keeps_graph() -> bool:
    """Whether the running autograd backward keeps its graph (`retain_graph=True`), so that
    the forward's activations must outlive it. Also True while torch.compile traces, where
    the private query is not traceable, and on a torch without it."""
    keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return torch.compiler.is_compiling() or keeps_graph is None or bool(keeps_graph())


class _MoELayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, config, group, swiglu_limit, workspace_cache, x, topk_ids, topk_weights, w_gate, w_up, w_down,
                ws_gate, ws_up, ws_down):
        num_tokens, hidden = x.shape
        workspace = get_workspace(
            config, group, device=x.device, num_local_tokens=num_tokens, hidden_size=hidden, topk=topk_ids.shape[1],
            cache=workspace_cache,
        )
        schedule = build_schedule(
            workspace, config, topk_ids, num_local_experts=w_gate.shape[0], has_shared_expert=ws_gate is not None
        )
        shared = (ws_gate, ws_up, ws_down)
        out, context = _forward_checked(
            config, workspace, schedule, x, topk_weights, shared, (w_gate, w_up, w_down), swiglu_limit,
            any(ctx.needs_input_grad),
        )
        ctx.save_for_backward(x, topk_weights, w_gate, w_up, w_down, *shared)
        ctx.state = (config, workspace, schedule, context, swiglu_limit)
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, topk_weights, w_gate, w_up, w_down, *shared = ctx.saved_tensors
        config, workspace, schedule, context, swiglu_limit = ctx.state
        grads = backward(
            config, workspace, schedule, context, d_out.contiguous(), x, topk_weights, *shared,
            w_gate, w_up, w_down, swiglu_limit, release_context=not _autograd_keeps_graph(),
        )
        return (
            None, None, None, None, grads.d_x, None, grads.d_topk_weights, grads.d_w_gate, grads.d_w_up, grads.d_w_down,
            grads.d_ws_gate, grads.d_ws_up, grads.d_ws_down,
        )


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    ws_gate: torch.Tensor | None = None,
    ws_up: torch.Tensor | None = None,
    ws_down: torch.Tensor | None = None,
    *,
    config: MoKConfig | None = None,
    swiglu_limit: float | None = None,
    group: dist.ProcessGroup | None = None,
    workspace_cache: dict | None = None,
) -> torch.Tensor:
    """The whole layer as one autograd-aware call: x [..., H] bf16, topk_ids and topk_weights
    [..., topk] -> out [..., H] bf16 (leading dims flattened into tokens and restored).
    `workspace_cache`: where its workspace is cached (`get_workspace`'s `cache`)."""
    config = MoKConfig() if config is None else config
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config: expected a MoKConfig or None, got {type(config).__name__}")
    x, topk_ids, topk_weights, lead = flatten_tokens(x, topk_ids, topk_weights)
    check_layer_inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, precision=config.precision)
    out = _MoELayer.apply(config, group, swiglu_limit, workspace_cache, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    return out if len(lead) == 1 else out.view(*lead, out.shape[-1])  # [T, H] in, the layer's own output out


# --------------------------------------------------------------------------- load statistics


def expert_counts(
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    group: dist.ProcessGroup | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routes each global expert received in this call: [num_experts] on topk_ids' device,
    for load-balancing losses and aux-loss-free expert biases, with no host sync.

    Counted from this rank's topk_ids [T, topk] by an integer scatter-add (exact and
    deterministic; ids outside [0, num_experts) count nowhere, the layer raises on them).
    Under expert parallelism (`group`) the counts are summed over the group's ranks by an
    all-reduce: a collective every rank calls, stream-ordered on NCCL (no host sync).
    `out`: an int32/int64 [num_experts] tensor the counts are written into (and returned);
    by default a new int32 tensor."""
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int32, torch.int64), shape=(None, None))
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
    if out is None:
        out = torch.empty(num_experts, dtype=torch.int32, device=topk_ids.device)
    else:
        check_tensor("out", out, dtypes=(torch.int32, torch.int64), shape=(num_experts,), device=topk_ids.device)
    ids = topk_ids.reshape(-1)
    valid = (ids >= 0) & (ids < num_experts)  # [T*topk]: a bad id must not index out of bounds
    out.zero_().scatter_add_(0, ids.clamp(0, num_experts - 1).long(), valid.to(out.dtype))
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out
