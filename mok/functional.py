"""The functional API (SPEC §3.2): workspace, schedule, forward, backward, recompute.

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

Outputs follow SPEC §1: `out` and the gradients of x and of the weights are bf16, the
router-weight gradient fp32. Errors found on the device (bad expert ids, capacity
overflow) set the workspace's error flag; `check_errors(workspace)` raises them (a host
sync), and `MoKConfig(strict=True)` calls it after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mok import reference
from mok import ops
from mok.config import MoKConfig
from mok.kernels.common import interpreting
from mok.kernels.grouped_gemm import routing_block_m
from mok.kernels.common import ERROR_BAD_EXPERT_ID, ERROR_CAPACITY_OVERFLOW, ERROR_PEER_TIMEOUT
from mok.fp8_block import FP8_BLOCK, fp8_block_round
from mok.mxfp8 import mxfp8_dequantize, mxfp8_quantize
from mok.reference import Gradients
from mok.transport import Dispatch, Transport, create_transport
from mok.validation import check_layer_inputs, check_tensor, check_topk_ids_values

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
]


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
        _check_same_across_ranks(group, {"hidden_size": hidden_size, "topk": topk}, device)
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


def _check_same_across_ranks(group, values: dict[str, int], device: torch.device) -> None:
    mine = torch.tensor(list(values.values()), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    for rank, theirs in enumerate(gathered):
        for (name, value), other in zip(values.items(), theirs.tolist()):
            if other != value:
                raise ValueError(f"{name}: expected the same value on every rank, got {value} here and {other} on rank {rank}")


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


def check_errors(workspace: Workspace) -> None:
    """Raises MoKError for any error flag the device set, then clears the flag (a host sync).
    Under expert parallelism on the triton backend the flag also holds every other rank's
    routing errors (they travel with the dispatch), so all ranks raise alike."""
    flags = int(workspace.error_flag.item())
    if flags:
        workspace.error_flag.zero_()
        messages = [msg for bit, msg in _ERROR_MESSAGES.items() if flags & bit]
        raise MoKError("mok: " + "; ".join(messages))


# --------------------------------------------------------------------------- backend choice


# What the triton backend still lacks for each low precision.
_TRITON_MISSING = {
    "mxfp8": "its grouped GEMMs are not written yet (only its quantizer kernel)",
    "fp8_block": "its backward grouped GEMMs are not written yet (its quantizers and forward GEMMs are, unwired)",
}


def _triton_unsupported(config: MoKConfig, workspace: Workspace) -> str | None:
    """Why the triton backend cannot run this call, or None when it can."""
    if workspace.device.type != "cuda" and not interpreting():
        return f"it runs on CUDA devices (or under TRITON_INTERPRET=1), not {workspace.device}"
    if config.precision != "bf16":
        return f"precision={config.precision!r}: {_TRITON_MISSING[config.precision]}"
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
    `shared_routing` the one of the shared expert (every token to one expert), both as
    the tensors of `mok.ops.routing_schedule`, and `block_m` the M tile they pad to.
    Under expert parallelism `dispatch` moves rows to the experts' ranks and back, and
    `routing` covers the rows this rank's experts receive (each a token with topk = 1).
    """

    topk_ids: torch.Tensor
    num_local_experts: int
    num_experts: int
    backend: str
    routing: tuple[torch.Tensor, ...] | None = None
    shared_routing: tuple[torch.Tensor, ...] | None = None
    block_m: int = 0
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
    block_m = routing_block_m()
    dispatch = None
    if workspace.transport is None:
        routing = ops.routing_schedule(topk_ids, workspace.error_flag, num_local_experts, block_m)
    else:  # `routing` then covers the rows this rank's experts receive
        dispatch, routing = workspace.transport.plan(topk_ids, num_local_experts, workspace.error_flag, block_m)
    shared_routing = None
    if has_shared_expert:
        all_tokens = torch.zeros(num_tokens, 1, dtype=torch.int32, device=topk_ids.device)  # [T, 1]: one expert
        shared_routing = ops.routing_schedule(all_tokens, workspace.error_flag, 1, block_m)
    if config.strict:
        check_errors(workspace)
    return Schedule(topk_ids, num_local_experts, num_experts, backend, routing, shared_routing, block_m, dispatch)


# --------------------------------------------------------------------------- forward / backward


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """What forward leaves for backward. `saved` maps names to tensors; the reference
    backend recomputes everything and saves nothing."""

    backend: str
    precision: str
    saved: dict[str, torch.Tensor] = field(default_factory=dict)


def _fp8_round(t: torch.Tensor, precision: str, is_weight: bool) -> torch.Tensor:
    """t [..., N, K] rounded through `precision`'s FP8 format, in fp32. K, the last dim, is
    the forward GEMM's reduction dim for x [T, H] and for every routed weight (H for
    w_gate/w_up [E_l, I, H], I for w_down [E_l, H, I]). mxfp8: blocks of 32 along K;
    fp8_block: 1×128 blocks for an activation, 128×128 for a weight (SPEC §2)."""
    if precision == "mxfp8":
        q, scale, _, _ = mxfp8_quantize(t, rowwise=True, colwise=False)
        return mxfp8_dequantize(q, scale)
    return fp8_block_round(t, (FP8_BLOCK, FP8_BLOCK) if is_weight else (1, FP8_BLOCK))


def _reference_operands(config: MoKConfig, x, w_gate, w_up, w_down):
    """The routed experts' operands (x, w_gate, w_up, w_down) as the reference backend uses
    them: as given in bf16; in mxfp8 and fp8_block, each rounded through the format's
    quantization. The shared expert keeps reading x and its weights in bf16, and the
    intermediate h stays fp32."""
    if config.precision == "bf16":
        return x, w_gate, w_up, w_down
    routed = (_fp8_round(w, config.precision, is_weight=True) for w in (w_gate, w_up, w_down))
    return _fp8_round(x, config.precision, is_weight=False), *routed


def _check_call(config, workspace, schedule, x, topk_weights, ws_gate, ws_up, ws_down, w_gate, w_up, w_down):
    num_tokens, hidden, _, num_local_experts, topk = check_layer_inputs(
        x, schedule.topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, precision=config.precision
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
    operands. Autocast is switched off inside: the reference defines the fp32 math, and a
    caller's `torch.autocast` would otherwise run its matmuls in bf16."""
    with torch.autocast(workspace.device.type, enabled=False):
        routed_x, w_gate_op, w_up_op, w_down_op = _reference_operands(config, x, w_gate, w_up, w_down)
        args = (*lead, x, schedule.topk_ids, topk_weights, w_gate_op, w_up_op, w_down_op, ws_gate, ws_up, ws_down)
        if workspace.world_size > 1:
            return getattr(reference, "ep_" + fn.__name__)(
                *args, swiglu_limit=swiglu_limit, group=workspace.group, routed_x=routed_x
            )
        return fn(*args, swiglu_limit=swiglu_limit, routed_x=routed_x)


def _expert_mlp(x, w_gate, w_up, w_down, routing, block_m, topk, num_slots, swiglu_limit, needs_backward):
    """y [num_slots, H] of the experts in `routing`, and what their backward reads (empty
    without `needs_backward`): the pre-activations g, u and h of every sorted row."""
    h, gate_up = ops.gate_up_swiglu(x, w_gate, w_up, routing, block_m, topk, swiglu_limit, needs_backward)
    y = ops.down_scatter(h, w_down, routing, block_m, num_slots)
    return y, ({"gate_up": gate_up, "h": h} if needs_backward else {})


def _routed_forward(schedule, x, routed, topk, swiglu_limit, needs_backward):
    """y [T·topk, H] of the routed experts in route slots, and what their backward reads.
    Under expert parallelism the token rows travel to the experts' ranks, where each
    received row is a token with topk = 1, and y comes back; the received rows are kept
    for the gate/up weight gradient."""
    dispatch = schedule.dispatch
    if dispatch is None:
        return _expert_mlp(x, *routed, schedule.routing, schedule.block_m, topk, x.shape[0] * topk, swiglu_limit, needs_backward)
    expert_x = dispatch.dispatch(x)  # [P·C, H]
    y_rows, saved = _expert_mlp(
        expert_x, *routed, schedule.routing, schedule.block_m, 1, expert_x.shape[0], swiglu_limit, needs_backward
    )
    return dispatch.combine(y_rows), {**saved, "expert_x": expert_x}


def _triton_forward(schedule, x, topk_weights, shared, routed, swiglu_limit, needs_backward):
    """out and what the backward reads: the pre-activations g, u and h of every routed row
    (and of the shared expert), 6·I bytes per route; nothing without `needs_backward`."""
    num_tokens, topk = topk_weights.shape
    y, saved = _routed_forward(schedule, x, routed, topk, swiglu_limit, needs_backward)
    y_shared = None
    if shared[0] is not None:
        ws_gate, ws_up, ws_down = (w.unsqueeze(0) for w in shared)  # one expert of the grouped GEMMs
        y_shared, shared_saved = _expert_mlp(
            x, ws_gate, ws_up, ws_down, schedule.shared_routing, schedule.block_m, 1, num_tokens, swiglu_limit, needs_backward
        )
        saved.update((name + "_shared", t) for name, t in shared_saved.items())
    return ops.combine(y, topk_weights, y_shared), saved if needs_backward else {}


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
        out, saved = _triton_forward(schedule, x, topk_weights, shared, routed, swiglu_limit, needs_backward)
        if config.strict:
            check_errors(workspace)
        return out, ForwardContext(schedule.backend, config.precision, saved)
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


def _expert_mlp_backward(d_out, x, topk_weights, weights, saved, routing, block_m, topk, num_slots, swiglu_limit,
                         main_grads=(None, None, None), *, token_order=False):
    """dx_slots [num_slots, H] and the weight gradients of the experts in `routing` (plus
    d_topk_weights [T, topk] fp32 when `topk_weights` is given, else an empty tensor), from
    the forward's `saved` g,u ("gate_up") and h ("h"). A weight with a `main_grads` buffer
    gets its gradient added into it, in place, and the buffer stands in its place among
    the returned gradients.

    The GEMMs read x and dOut in the sorted layout; `token_order=True` says the routing's
    sorted rows are the tokens in order and there is no router weight (the shared
    expert's), so x and dOut serve as they are instead of being gathered."""
    w_gate, w_up, w_down = weights
    main_gate, main_up, main_down = main_grads
    if token_order:
        x_sorted, d_out_sorted, dy_sorted = x, d_out, d_out
    else:
        x_sorted, d_out_sorted, dy_sorted = ops.gather_sorted_rows(x, d_out, topk_weights, routing, block_m, topk)
    d_gate_up, d_topk_weights = ops.down_dgrad_swiglu(
        d_out_sorted, topk_weights, saved["gate_up"], w_down, routing, block_m, swiglu_limit
    )
    dx_slots = ops.gate_up_dgrad_scatter(d_gate_up, w_gate, w_up, routing, block_m, num_slots)
    if main_gate is None:
        d_w_gate, d_w_up = ops.gate_up_wgrad(d_gate_up, x_sorted, routing, block_m)
    else:
        ops.gate_up_wgrad_accumulate(main_gate, main_up, d_gate_up, x_sorted, routing, block_m)
        d_w_gate, d_w_up = main_gate, main_up
    if main_down is None:
        d_w_down = ops.down_wgrad(dy_sorted, saved["h"], routing, block_m)
    else:
        ops.down_wgrad_accumulate(main_down, dy_sorted, saved["h"], routing, block_m)
        d_w_down = main_down
    return dx_slots, d_topk_weights, (d_w_gate, d_w_up, d_w_down)


def _routed_backward(schedule, saved, d_out, x, topk_weights, routed, swiglu_limit, main_grads):
    """dx_slots [T·topk, H], d_topk_weights [T, topk] fp32 and the routed weight gradients.
    Under expert parallelism the dOut rows and router weights travel to the experts' ranks
    (which apply the weights in fp32), and dx rows and router-weight gradients come back."""
    num_tokens, topk = topk_weights.shape
    dispatch = schedule.dispatch
    if dispatch is None:
        return _expert_mlp_backward(
            d_out, x, topk_weights, routed, saved, schedule.routing, schedule.block_m,
            topk, num_tokens * topk, swiglu_limit, main_grads,
        )
    expert_x = dispatch.received_x(saved["expert_x"], x)  # [P·C, H]
    expert_d_out, expert_weights = dispatch.dispatch_grad(d_out, topk_weights)  # [P·C, H], [P·C, 1]
    dx_rows, d_weight_rows, grads = _expert_mlp_backward(
        expert_d_out, expert_x, expert_weights, routed, saved, schedule.routing, schedule.block_m,
        1, expert_x.shape[0], swiglu_limit, main_grads,
    )
    return (*dispatch.combine_grad(dx_rows, d_weight_rows), grads)


def _triton_backward(schedule, saved, d_out, x, topk_weights, shared, routed, swiglu_limit, main_grads) -> Gradients:
    """DESIGN §3's backward on one GPU, no host sync: per expert group, down dgrad + SwiGLU
    backward + router-weight gradient, gate/up dgrad into route slots, wgrad GEMMs; then
    d_x = dx_shared + Σ_j dx_slots (the combine with unit weights, ascending j). Reads the
    forward's g,u and h (not y: the router-weight gradient is ⟨dOut·Wd, h⟩ over I)."""
    num_tokens, topk = topk_weights.shape
    if saved.get("gate_up") is None or saved["gate_up"].shape[0] == 0:
        raise ValueError("context: expected the pre-activations a forward with needs_backward=True saves")
    d_out = d_out.to(torch.bfloat16)  # a GEMM operand (no copy when it already is bf16)
    dx_slots, d_topk_weights, routed_grads = _routed_backward(
        schedule, saved, d_out, x, topk_weights, routed, swiglu_limit, tuple(main_grads.get(n) for n in _ROUTED)
    )
    dx_shared, shared_grads = None, (None, None, None)
    if shared[0] is not None:
        shared_experts = tuple(w.unsqueeze(0) for w in shared)  # one expert of the grouped GEMMs
        dx_shared, _, grads = _expert_mlp_backward(
            d_out, x, None, shared_experts, {"gate_up": saved["gate_up_shared"], "h": saved["h_shared"]},
            schedule.shared_routing,
            schedule.block_m, 1, num_tokens, swiglu_limit,
            tuple(None if main_grads.get(n) is None else main_grads[n].unsqueeze(0) for n in _SHARED),
            token_order=True,
        )
        shared_grads = tuple(g.squeeze(0) for g in grads)
    ones = torch.ones(num_tokens, topk, dtype=torch.float32, device=x.device)  # [T, topk]: unweighted sum
    d_x = ops.combine(dx_slots, ones, dx_shared)
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
) -> Gradients:
    """Every gradient in SPEC §1's order: d_x, d_topk_weights, routed then shared weights.

    `main_grads` maps weight names ("w_gate", "w_up", "w_down", "ws_gate", "ws_up",
    "ws_down") to fp32 or bf16 buffers of the weight's shape: those gradients are added
    into the buffers in place (Megatron's main_grad), in fp32, and the buffers are returned
    in their places. "w_gate" and "w_up" (and "ws_gate", "ws_up") go together."""
    _check_call(config, workspace, schedule, x, topk_weights, ws_gate, ws_up, ws_down, w_gate, w_up, w_down)
    main_grads = _check_main_grads(main_grads, dict(zip(_ROUTED + _SHARED, (w_gate, w_up, w_down, ws_gate, ws_up, ws_down))))
    if not isinstance(context, ForwardContext) or context.precision != config.precision:
        raise ValueError("context: expected the ForwardContext that forward returned under this config")
    check_tensor("d_out", d_out, dtypes=(torch.bfloat16, torch.float32), shape=tuple(x.shape), device=x.device)
    if schedule.backend == "triton":
        if context.backend != "triton":
            raise ValueError(f"context: expected a context of the triton backend (the schedule's), got {context.backend!r}")
        return _triton_backward(
            schedule, context.saved, d_out, x, topk_weights, (ws_gate, ws_up, ws_down), (w_gate, w_up, w_down),
            swiglu_limit, main_grads,
        )
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
            w_gate, w_up, w_down, swiglu_limit,
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
    """The whole layer as one autograd-aware call: out [T, H] bf16. `workspace_cache`:
    where its workspace is cached (`get_workspace`'s `cache`)."""
    config = MoKConfig() if config is None else config
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config: expected a MoKConfig or None, got {type(config).__name__}")
    check_layer_inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, precision=config.precision)
    return _MoELayer.apply(config, group, swiglu_limit, workspace_cache, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
