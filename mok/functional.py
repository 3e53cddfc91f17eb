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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from mok import reference
from mok import ops
from mok.config import MoKConfig
from mok.kernels.common import interpreting
from mok.kernels.gemm.dgrad import down_wgrad_reads_weighted_h, fp8_block_down_dgrad_gathers
from mok.kernels.gemm.common import routing_block_m
from mok.kernels.plan import kernel_plan
from mok.kernels.common import ERROR_BAD_EXPERT_ID, ERROR_CAPACITY_OVERFLOW, ERROR_PEER_TIMEOUT
from mok.fp8_block import FP8_BLOCK, fp8_block_round
from mok.mxfp8 import mxfp8_dequantize, mxfp8_quantize
from mok.reference import Gradients
from mok.transport import Dispatch, Transport, check_same_across_ranks, create_transport
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


# The fp8_block recipe's options (requantized wgrad operands, quantized d_g, d_u, sorted outputs,
# e4m3 g, u, e4m3 on the wire) are the kernel plan's `fp8_block_*` fields (`kernels.plan`), with
# their reasons and records.


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
        return torch.compiler.is_compiling() or not error_flag.is_cuda or _capturing_cuda_graph()

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
    `shared_routing` the one of the shared expert (every token to one expert), both as
    the tensors of `mok.ops.routing_schedule`, and `block_m` the M tile they pad to.
    Under expert parallelism `dispatch` moves rows to the experts' ranks and back, and
    `routing` covers the rows this rank's experts receive (each a token row sent once per
    (token, rank), with topk = k_l = min(topk, E_l) routes).
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
    _raise_landed_errors(workspace)
    block_m = routing_block_m()
    dispatch = None
    if workspace.transport is None:
        routing = ops.routing_schedule(topk_ids, workspace.error_flag, num_local_experts, block_m)
    else:  # `routing` then covers the rows this rank's experts receive
        plan = kernel_plan()
        fp8_wire = config.precision == "fp8_block" and plan.fp8_block_on_the_wire and plan.fp8_block_wgrads_requantize
        dispatch, routing = workspace.transport.plan(topk_ids, num_local_experts, workspace.error_flag, block_m,
                                                     fp8_wire)
    shared_routing = None
    if has_shared_expert:
        all_tokens = torch.zeros(num_tokens, 1, dtype=torch.int32, device=topk_ids.device)  # [T, 1]: one expert
        shared_routing = ops.routing_schedule(all_tokens, workspace.error_flag, 1, block_m)
    if config.strict:
        check_errors(workspace)
    return Schedule(topk_ids, num_local_experts, num_experts, backend, routing, shared_routing, block_m, dispatch)


# --------------------------------------------------------------------------- forward / backward


@dataclass(eq=False)
class ForwardContext:
    """What forward leaves for backward. `saved` maps names to tensors; the reference
    backend recomputes everything and saves nothing. `routed_weights`: in mxfp8 and
    fp8_block on the triton backend, the routed weights' quantized copies the forward's GEMMs
    read, which the backward's read too (as autograd's saved tensors would): without them a
    step captured in a CUDA graph, or traced by torch.compile, where no copy is cached,
    quantized every weight twice. Not frozen: a backward with `release_context=True` empties
    `saved` and `routed_weights` and sets `released`."""

    backend: str
    precision: str
    saved: dict[str, torch.Tensor] = field(default_factory=dict)
    released: bool = False  # a backward with release_context=True consumed `saved`
    routed_weights: tuple = ()  # (w_gate, w_up, w_down) as `_triton_routed_weights` gives them, or ()


def _fp8_round(t: torch.Tensor, precision: str, is_weight: bool) -> torch.Tensor:
    """t [..., N, K] rounded through `precision`'s FP8 format, in fp32. K, the last dim, is
    the forward GEMM's reduction dim for x [T, H] and for every routed weight (H for
    w_gate/w_up [E_l, I, H], I for w_down [E_l, H, I]). mxfp8: blocks of 32 along K;
    fp8_block: 1×128 blocks for an activation, 128×128 for a weight."""
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
        x, schedule.topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, precision=config.precision,
        strided_weights=schedule.backend == "reference" and config.precision == "bf16",
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


class _Fp8BlockWeight(NamedTuple):
    """A routed weight [E_l, N, K] as the fp8_block GEMMs read it (`mok.fp8_block_quantize`'s
    outputs): q [E_l, N, K] with scale [E_l, N/128, K/128] for the forward, the transposed
    copy q_t [E_l, K, N] with scale_t [E_l, K/128, N/128] for the dgrads."""

    q: torch.Tensor
    scale: torch.Tensor
    q_t: torch.Tensor
    scale_t: torch.Tensor


class _Mxfp8Weight(NamedTuple):
    """A routed weight [E_l, N, K] as the mxfp8 GEMMs read it on Hopper: rounded to the MXFP8
    grid and held in bf16 (`quant.mxfp8.mxfp8_round`, exact), `rows` in blocks of 32 along K for the
    forward, `cols` along N for the dgrads; both [E_l, N, K]."""

    rows: torch.Tensor
    cols: torch.Tensor


# The low-precision copies of a routed weight, by precision (looked up in `ops` at call time).
_WEIGHT_COPIES = {
    "fp8_block": lambda w: _Fp8BlockWeight(*ops.quantize_fp8_block_weights(w)),
    "mxfp8": lambda w: _Mxfp8Weight(*ops.mxfp8_round(w, True, True)),
}

# weight -> ((precision, its _version, its data_ptr), its copies); an entry goes with its weight.
_WEIGHT_COPY_CACHE = WeakIdKeyDictionary()


@torch.compiler.assume_constant_result
def _capturing_cuda_graph() -> bool:
    """Whether the current CUDA stream is capturing a graph. Folded to a constant while
    torch.compile traces (torch 2.11's dynamo refused the bool-returning call in a
    fullgraph trace on H200), where `_weight_copy` quantizes inside the graph anyway."""
    return torch.cuda.is_current_stream_capturing()


def _weight_copy(w: torch.Tensor, precision: str) -> _Fp8BlockWeight | _Mxfp8Weight:
    """w's copies for `precision`'s GEMMs (both orientations, one Triton launch), made once per
    version of w: forward and backward of a step share them, and an optimizer's in-place update
    (which bumps `w._version`) makes the next call quantize again. The key is host state, so a
    hit costs no device work and no sync. While torch.compile traces or a CUDA graph captures,
    w is quantized on every call instead, so the graph holds the quantization and each replay
    reads the weight as it is then; so is an inference-mode tensor, which has no version counter."""
    make = _WEIGHT_COPIES[precision]
    if torch.compiler.is_compiling() or (w.is_cuda and _capturing_cuda_graph()) or w.is_inference():
        return make(w)
    key = (precision, w._version, w.data_ptr())
    cached = _WEIGHT_COPY_CACHE.get(w)
    if cached is None or cached[0] != key:
        cached = _WEIGHT_COPY_CACHE[w] = (key, make(w))
    return cached[1]


def routed_weight_copies(weights: Sequence[torch.Tensor], precision: str) -> tuple:
    """Fresh copies of routed weights in the layouts `precision`'s GEMMs read (fp8_block: each
    weight's e4m3 blocks and scales, both orientations; mxfp8: its two rounded bf16 copies), one
    kernel launch per weight and no cache: what each in-place update of the weights adds to the
    step that follows it (the layer makes them once per version of a weight)."""
    if precision not in _WEIGHT_COPIES:
        raise ValueError(f"precision: expected one of {sorted(_WEIGHT_COPIES)}, got {precision!r}")
    return tuple(_WEIGHT_COPIES[precision](w) for w in weights)


def _triton_routed_weights(precision: str, routed: tuple[torch.Tensor, ...]) -> tuple:
    """The routed weights as the triton backend's expert GEMMs take them: the bf16 tensors, or
    their `_Fp8BlockWeight`s / `_Mxfp8Weight`s, which select those precisions' paths in
    `_expert_mlp` and `_expert_mlp_backward` (the shared expert's weights stay bf16 tensors)."""
    if precision == "bf16":
        return routed
    return tuple(_weight_copy(w, precision) for w in routed)


def _forward_weight(w):
    """The tensor a bf16-kernel forward GEMM reads for a routed (or shared) weight."""
    return w.rows if isinstance(w, _Mxfp8Weight) else w


def _dgrad_weight(w):
    """The tensor a bf16-kernel dgrad GEMM reads: in mxfp8 the copy rounded along N."""
    return w.cols if isinstance(w, _Mxfp8Weight) else w


def _expert_mlp(x, w_gate, w_up, w_down, routing, block_m, topk, num_slots, swiglu_limit, needs_backward,
                sorted_rows=False):
    """y [num_slots, H] of the experts in `routing` (fp8_block with `sorted_rows`: [capacity_rows,
    H] in the sorted layout), and what their backward reads (empty without `needs_backward`):
    the pre-activations g, u and h of every sorted row.

    With `_Fp8BlockWeight`s the GEMMs run in fp8_block: x quantized in 1×128 blocks along H,
    h quantized by the gate/up epilogue for the down GEMM. The backward then gets g, u (in
    e4m3 with their scales, "gate_up_scale", where the plan's `fp8_block_gate_up_e4m3` applies), and
    with the plan's `fp8_block_wgrads_requantize` these e4m3 copies of x and h and their scales too (for
    the wgrads, which requantize them down the rows); without it, it quantizes h down the rows
    from g, u, and x from its bf16 rows.

    With `_Mxfp8Weight`s the bf16 GEMMs read operands rounded to the MXFP8 grid (exact in bf16,
    `quant.mxfp8.mxfp8_round`): x and h in blocks of 32 along H and I, the weights' `rows` copies.
    The backward gets h unrounded (its wgrad rounds it along the rows)."""
    if isinstance(w_gate, _Fp8BlockWeight):
        # [T, H] e4m3, [T, H/128] fp32 (x arrives quantized from the dispatch: the plan's `fp8_block_on_the_wire`)
        x_q, x_scale = x if isinstance(x, tuple) else ops.quantize_fp8_block_activations(x)
        plan = kernel_plan()
        gate_up_e4m3 = (needs_backward and plan.fp8_block_gate_up_e4m3 and plan.fp8_block_wgrads_requantize
                        and swiglu_limit is None)
        # g, u: [rows, 2, I] bf16, or e4m3 with scales [rows, 2, I/128]
        h_q, h_scale, gate_up, gate_up_scale = ops.gate_up_swiglu_fp8_block(
            x_q, x_scale, w_gate.q, w_gate.scale, w_up.q, w_up.scale, routing, block_m, topk, swiglu_limit,
            needs_backward, gate_up_e4m3,
        )
        y = ops.down_scatter_fp8_block(h_q, h_scale, w_down.q, w_down.scale, routing, block_m, num_slots,
                                       sorted_rows)
        saved = {"gate_up": gate_up} if needs_backward else {}
        if gate_up_e4m3:
            saved["gate_up_scale"] = gate_up_scale
        if needs_backward and plan.fp8_block_wgrads_requantize:
            saved.update(x_q=x_q, x_scale=x_scale, h_q=h_q, h_scale=h_scale)
        return y, saved
    mxfp8 = isinstance(w_gate, _Mxfp8Weight)
    if mxfp8:
        x = ops.mxfp8_round(x)[0]  # [T, H] on the grid along H
    h, gate_up = ops.gate_up_swiglu(
        x, _forward_weight(w_gate), _forward_weight(w_up), routing, block_m, topk, swiglu_limit, needs_backward
    )
    h_operand = ops.mxfp8_round(h, True, False, routing, block_m)[0] if mxfp8 else h  # [rows, I]
    w_down_operand = _forward_weight(w_down)
    y = ops.down_scatter(h_operand, w_down_operand, routing, block_m, num_slots)
    return y, ({"gate_up": gate_up, "h": h} if needs_backward else {})


def _routed_forward(schedule, x, topk_weights, routed, swiglu_limit, needs_backward):
    """(y, route_row, combine weights, what the backward reads): y [T·topk, H] of the routed
    experts in route slots and route_row None, or with `_sorted_outputs` y [capacity_rows, H] in
    the sorted layout and route_row [T·topk] each route's row of it (also kept for the backward's
    dx); the weights are topk_weights. Under expert parallelism the token rows travel to the
    experts' ranks and y comes back (`_per_rank_forward`)."""
    dispatch = schedule.dispatch
    topk = topk_weights.shape[1]
    if dispatch is None:
        num_slots = x.shape[0] * topk
        sorted_rows = _sorted_outputs(routed)
        y, saved = _expert_mlp(
            x, *routed, schedule.routing, schedule.block_m, topk, num_slots, swiglu_limit, needs_backward,
            sorted_rows=sorted_rows,
        )
        saved = _routed_saved(saved, routed)
        route_row = ops.routing_from_tensors(schedule.routing, schedule.block_m).route_row if sorted_rows else None
        if needs_backward and sorted_rows:
            saved["route_row"] = route_row
        return y, route_row, topk_weights, saved
    return _per_rank_forward(schedule, x, topk_weights, routed, swiglu_limit, needs_backward)


def _per_rank_forward(schedule, x, topk_weights, routed, swiglu_limit, needs_backward):
    """`_routed_forward` with each token row sent once per (token, rank) (`mok.transport`): each
    received row is a token with topk = k_l, whose routes the expert's rank sums (Σ_q w·y,
    ascending q, fp32, one bf16 row); y is [P·C, H] of those partial rows back at the source,
    route_row the pairs' rows (token_slot [T·P]) and the combine weights ones [T, P]."""
    dispatch = schedule.dispatch
    # [P·C, H] (with the plan's `fp8_block_on_the_wire`: e4m3 rows and their scales), [P·C, k_l]
    expert_x, expert_weights = dispatch.dispatch(x, topk_weights)
    k_l = dispatch.routes_per_row
    y_routes, saved = _expert_mlp(
        expert_x, *routed, schedule.routing, schedule.block_m, k_l, dispatch.num_expert_rows * k_l, swiglu_limit,
        needs_backward,
    )
    saved = _routed_saved(saved, routed)
    parts = ops.combine(y_routes, expert_weights, None, dispatch.received_routes)  # [P·C, H]
    y = dispatch.combine(parts)
    ones = torch.ones(x.shape[0], dispatch.world_size, dtype=torch.float32, device=x.device)  # [T, P]
    return y, dispatch.token_slot, ones, {**saved, "expert_x": expert_x, "expert_weights": expert_weights}


def _sorted_outputs(routed) -> bool:
    """Whether the routed experts on one rank leave y and dx in the sorted layout
    (the plan's `fp8_block_sorted_outputs`: fp8_block)."""
    return kernel_plan().fp8_block_sorted_outputs and isinstance(routed[0], _Fp8BlockWeight)


def _routed_saved(saved: dict, routed) -> dict:
    """What the routed experts' backward reads of `_expert_mlp`'s `saved`: all of it, but h
    where the down wgrad takes w·h from the down dgrad instead (`_reads_weighted_h`)."""
    return {k: t for k, t in saved.items() if k != "h"} if _reads_weighted_h(routed) else saved


def _reads_weighted_h(routed) -> bool:
    """Whether the routed experts' down wgrad reads dOut's sorted rows and the down dgrad's
    w·h (bf16 weights, where `dgrad.down_wgrad_reads_weighted_h`), so that the forward keeps
    no h and the backward makes no w·dOut copy."""
    w_down = routed[2]
    return isinstance(w_down, torch.Tensor) and down_wgrad_reads_weighted_h(*w_down.shape[1:])


def _triton_forward(schedule, x, topk_weights, shared, routed, swiglu_limit, needs_backward):
    """out and what the backward reads: the pre-activations g, u and h of every routed row
    (and of the shared expert), 6·I bytes per route (g, u only, 4·I, where the bf16 down wgrad
    reads w·h: `_reads_weighted_h`; in fp8_block 4·I or, with the plan's `fp8_block_gate_up_e4m3`, 2·I, beside
    the e4m3 copies of h and x); nothing
    without `needs_backward`. `routed` as `_triton_routed_weights` gives them."""
    num_tokens, topk = topk_weights.shape
    y, route_row, weights, saved = _routed_forward(schedule, x, topk_weights, routed, swiglu_limit, needs_backward)
    y_shared = None
    if shared[0] is not None:
        ws_gate, ws_up, ws_down = (w.unsqueeze(0) for w in shared)  # one expert of the grouped GEMMs
        y_shared, shared_saved = _expert_mlp(
            x, ws_gate, ws_up, ws_down, schedule.shared_routing, schedule.block_m, 1, num_tokens, swiglu_limit, needs_backward
        )
        saved.update((name + "_shared", t) for name, t in shared_saved.items())
    return ops.combine(y, weights, y_shared, route_row), saved if needs_backward else {}


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
        routed = _triton_routed_weights(config.precision, routed)
        out, saved = _triton_forward(schedule, x, topk_weights, shared, routed, swiglu_limit, needs_backward)
        if config.strict:
            check_errors(workspace)
        workspace.error_copy.take(workspace.error_flag)
        copies = routed if needs_backward and config.precision != "bf16" else ()
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


def _expert_mlp_backward(d_out, x, topk_weights, weights, saved, routing, block_m, topk, num_slots, swiglu_limit,
                         main_grads=(None, None, None), *, token_order=False, sorted_rows=False):
    """dx_slots [num_slots, H] (fp8_block with `sorted_rows`: [capacity_rows, H] in the sorted
    layout) and the weight gradients of the experts in `routing` (plus
    d_topk_weights [T, topk] fp32 when `topk_weights` is given, else an empty tensor), from
    the forward's g,u ("gate_up") and h ("h"; none where the down wgrad reads the down dgrad's
    w·h, `_reads_weighted_h`), which it takes out of the dict `saved` as it reads them: a dict
    holding their only references frees each after its last reader (h after the down wgrad,
    g,u after the down dgrad). A weight with a `main_grads` buffer
    gets its gradient added into it, in place, and the buffer stands in its place among
    the returned gradients.

    The GEMMs read x and dOut in the sorted layout; `token_order=True` says the routing's
    sorted rows are the tokens in order and there is no router weight (the shared
    expert's), so x and dOut serve as they are instead of being gathered.

    With `_Fp8BlockWeight`s the GEMMs run in fp8_block: the dgrads read dOut and d_g, d_u
    quantized in 1×128 blocks along H and I against the weights' transposed copies; the
    wgrads reduce over rows, so their operands (x, w·dOut, d_g|d_u, and h recomputed from the
    saved g, u) are quantized in 1×128 blocks along the sorted rows. Gradients stay bf16.

    With `_Mxfp8Weight`s the bf16 GEMMs read operands rounded to the MXFP8 grid along their
    reduction dims: dOut along H and d_g, d_u along I against the weights' `cols` copies;
    x, w·dOut (both from the gather), d_g|d_u and h along the sorted rows."""
    w_gate, w_up, w_down = weights
    main_gate, main_up, main_down = main_grads
    mxfp8 = isinstance(w_gate, _Mxfp8Weight)
    if isinstance(w_gate, _Fp8BlockWeight):
        return _fp8_block_backward_routed(
            d_out, x, topk_weights, weights, main_grads, saved, routing, block_m, topk, num_slots, swiglu_limit,
            sorted_rows,
        )
    # The down wgrad reduces (w·dOut)ᵀ·h over the rows; where w·h is the smaller operand it
    # reads dOutᵀ·(w·h) instead, w·h written by the down dgrad (no w·dOut copy, no saved h).
    weighted_h = not token_order and _reads_weighted_h(weights)
    if token_order:  # the shared expert: bf16
        x_sorted, d_out_sorted, dy_sorted = x, d_out, d_out
    else:
        x_sorted, d_out_sorted, dy_sorted = ops.gather_sorted_rows(
            x, d_out, None if weighted_h else topk_weights, routing, block_m, topk, mxfp8
        )
    # Each sorted copy is dropped once its last reader has run, so the peak holds no copy
    # of dOut next to the gate/up GEMMs' operands.
    gate_up = saved.pop("gate_up")
    d_gate_up, d_topk_weights, h = ops.down_dgrad_swiglu(
        d_out_sorted, topk_weights, gate_up, _dgrad_weight(w_down), routing, block_m, swiglu_limit, weighted_h
    )
    del gate_up
    if weighted_h:  # (dOut, w·h) stand in for (w·dOut, h)
        dy_sorted = d_out_sorted
    else:
        h = saved.pop("h")
        h = ops.mxfp8_round(h, False, True, routing, block_m)[1] if mxfp8 else h
    del d_out_sorted
    down_wgrad_last = _down_wgrad_last((dy_sorted, h), w_down, main_down)
    if not down_wgrad_last:  # early: frees w·dOut's copy and h before the gate/up GEMMs
        d_w_down = _down_weight_grad(dy_sorted, h, main_down, routing, block_m)
        del dy_sorted, h
    d_gate_up_dgrad = d_gate_up_wgrad = d_gate_up  # [rows, 2, I]
    if mxfp8:
        rows, cols = ops.mxfp8_round(d_gate_up.flatten(1), True, True, routing, block_m)
        d_gate_up_dgrad, d_gate_up_wgrad = rows.view_as(d_gate_up), cols.view_as(d_gate_up)
    del d_gate_up
    dgrad_weights = (_dgrad_weight(w_gate), _dgrad_weight(w_up))
    d_w_gate, d_w_up = _weight_grads(
        ops.gate_up_wgrad, ops.gate_up_wgrad_accumulate, (d_gate_up_wgrad, x_sorted), (main_gate, main_up),
        routing, block_m,
    )
    del x_sorted, d_gate_up_wgrad  # dx_slots comes after them: the two never coexist
    dx_slots = ops.gate_up_dgrad_scatter(d_gate_up_dgrad, *dgrad_weights, routing, block_m, num_slots)
    del d_gate_up_dgrad
    if down_wgrad_last:
        d_w_down = _down_weight_grad(dy_sorted, h, main_down, routing, block_m)
    return dx_slots, d_topk_weights, (d_w_gate, d_w_up, d_w_down)


def _fp8_block_backward_routed(d_out, x, topk_weights, weights, main_grads, saved, routing, block_m, topk, num_slots,
                               swiglu_limit, sorted_rows):
    """`_expert_mlp_backward` with `_Fp8BlockWeight`s (routed experts only: the shared expert
    stays bf16). x and dOut are never copied in bf16: their sorted rows are gathered by the
    quantizers themselves (dOut's in 1×128 blocks along H for the down dgrad, or, where the
    down dgrad gathers them itself, quantized per token), x's and w·dOut's in blocks along the
    rows for the wgrads, each bitwise what quantizing `gather_sorted_rows`' copies gives; or,
    where the forward saved e4m3 copies of x and h (the plan's `fp8_block_wgrads_requantize`), x, h and
    w·dOut (from dOut's per-token copy, where the down dgrad gathers it) requantized down the
    rows from their 1×128 blocks along H and I. With the plan's `fp8_block_d_gate_up_quantized` the down
    dgrad's epilogue quantizes d_g, d_u along I for the gate/up dgrad, and d_gᵀ, d_uᵀ are
    requantized from those copies too."""
    w_gate, w_up, w_down = weights
    main_gate, main_up, main_down = main_grads
    rows_in_use = routing[4]  # [1] int32: the schedule's num_rows; the quantizers skip the rest
    if isinstance(d_out, tuple):  # quantized per token before the dispatch (the plan's `fp8_block_on_the_wire`)
        per_token_d_out, d_out_pair = True, d_out
    elif per_token_d_out := fp8_block_down_dgrad_gathers(d_out.shape[1]):
        # [T, H] e4m3, [T, H/128] fp32: the down dgrad gathers
        d_out_pair = ops.quantize_fp8_block_activations(d_out)
    else:  # [rows, H] e4m3, [rows, H/128] fp32
        d_out_pair = ops.quantize_fp8_block_gathered(d_out, routing, block_m, topk)
    gate_up = saved.pop("gate_up")
    gate_up_scale = saved.pop("gate_up_scale", None)  # with the plan's `fp8_block_gate_up_e4m3`
    # d_g, d_u: [rows, 2, I] bf16 (and an empty scale), or e4m3 with its 1×128 scales [rows, 2, I/128]
    quantized = kernel_plan().fp8_block_d_gate_up_quantized
    d_gate_up, d_gate_up_scale, d_topk_weights = ops.down_dgrad_swiglu_fp8_block(
        *d_out_pair, topk_weights, gate_up, w_down.q_t, w_down.scale_t, routing, block_m, swiglu_limit, quantized,
        gate_up_scale,
    )
    # The wgrads' operands down the rows: with the forward's e4m3 copies, x and h requantized from them and w·dOut
    # from dOut's per-token copy (where the down dgrad read one); else x and w·dOut from their bf16 token rows and
    # h recomputed from g, u. Pairs of (e4m3 rows [T or rows, W], their scales [·, W/128]), or (bf16 rows, None).
    # h's goes first, so that g, u are freed before the gate/up GEMMs.
    requantize = "x_q" in saved
    x_pair = (saved.pop("x_q"), saved.pop("x_scale")) if requantize else (x, None)
    dy_pair = d_out_pair if requantize and per_token_d_out else (d_out, None)
    del d_out_pair
    if requantize:
        h_t = ops.quantize_fp8_block_sorted_t(saved.pop("h_q"), routing, block_m, saved.pop("h_scale"))  # [I, rows]
    else:
        h_t = ops.quantize_fp8_block_swiglu_sorted_t(gate_up, routing, block_m, swiglu_limit)  # [I, rows]
    del gate_up, gate_up_scale
    if quantized:
        d_gate_pair, d_up_pair = ((d_gate_up[:, j], d_gate_up_scale[:, j]) for j in (0, 1))
    else:
        d_gate_pair, d_up_pair = (ops.quantize_fp8_block_activations(d_gate_up[:, j], rows_in_use) for j in (0, 1))
    dx_slots = ops.gate_up_dgrad_scatter_fp8_block(
        *d_gate_pair, *d_up_pair, w_gate.q_t, w_gate.scale_t, w_up.q_t, w_up.scale_t, routing, block_m, num_slots,
        sorted_rows,
    )
    del d_gate_pair, d_up_pair
    # Each wgrad's operands are quantized right before it runs: [W, rows] e4m3 and [rows / S, W] fp32 each.
    d_gate_up_t = ops.quantize_fp8_block_sorted_t(  # d_gᵀ, d_uᵀ: [2·I, rows]
        d_gate_up.flatten(1), routing, block_m, d_gate_up_scale.flatten(1) if quantized else None
    )
    del d_gate_up, d_gate_up_scale
    x_t = ops.quantize_fp8_block_gathered_t(x_pair[0], None, routing, block_m, topk, x_pair[1])  # [H, rows]
    del x_pair
    d_w_gate, d_w_up = _weight_grads(
        ops.gate_up_wgrad, ops.gate_up_wgrad_accumulate, (d_gate_up_t[0], x_t[0]), (main_gate, main_up), routing,
        block_m, scales=(d_gate_up_t[1], x_t[1]),
    )
    del d_gate_up_t, x_t
    dy_t = ops.quantize_fp8_block_gathered_t(dy_pair[0], topk_weights, routing, block_m, topk, dy_pair[1])
    del dy_pair
    d_w_down = _weight_grads(
        ops.down_wgrad, ops.down_wgrad_accumulate, (dy_t[0], h_t[0]), (main_down,), routing, block_m,
        scales=(dy_t[1], h_t[1]),
    )
    return dx_slots, d_topk_weights, (d_w_gate, d_w_up, d_w_down)


def _down_wgrad_last(operands: Sequence[torch.Tensor], w_down, main_down: torch.Tensor | None) -> bool:
    """Whether the down wgrad runs after the gate/up GEMMs rather than right after the down
    dgrad: where its operands (w·dOut and h, rows × (H + I)) take less memory than the
    gradient it allocates (d_w_down, E_l × H × I; nothing with a main_grad buffer). Early it
    frees its operands before the gate/up GEMMs' peak; late, its output is not yet there.
    mixtral-8x7b: 0.64 GB of operands against a 0.94 GB gradient, so it goes last (a
    training step's peak −0.3 GB); qwen3-30b and deepseek-v3-slice keep it early."""
    if main_down is not None:
        return False
    experts, hidden, inter = _forward_weight(w_down).shape
    operand_bytes = sum(t.numel() * t.element_size() for t in operands)
    return operand_bytes < experts * hidden * inter * 2


def _down_weight_grad(dy_sorted: torch.Tensor, h: torch.Tensor, main_down, routing, block_m):
    """d_w_down from w·dOut's sorted copy and h (or main_down after `+=`)."""
    return _weight_grads(ops.down_wgrad, ops.down_wgrad_accumulate, (dy_sorted, h), (main_down,), routing, block_m)


def _weight_grads(fresh_op, accumulate_op, operands, main_grads, routing, block_m, scales=()):
    """`fresh_op`'s new gradient(s) from `operands` (and their fp8_block `scales`); or, when
    `main_grads` holds buffers, `accumulate_op` adds into them in place and they are
    returned in the gradients' places."""
    if main_grads[0] is None:
        return fresh_op(*operands, routing, block_m, *scales)
    accumulate_op(*main_grads, *operands, routing, block_m, *scales)
    return main_grads if len(main_grads) > 1 else main_grads[0]


def _routed_backward(schedule, saved, d_out, x, topk_weights, routed, swiglu_limit, main_grads):
    """(dx_slots [T·topk, H], route_row None), or where the forward kept one (`_routed_forward`)
    (dx [capacity_rows, H] in the sorted layout, route_row); d_topk_weights [T, topk] fp32 and the
    routed weight gradients. Under expert parallelism the dOut rows travel to the experts'
    ranks (which kept the router weights from the forward and apply them in fp32), and partial
    dx rows and router-weight gradients come back (`_per_rank_backward`)."""
    num_tokens, topk = topk_weights.shape
    dispatch = schedule.dispatch
    if dispatch is None:
        route_row = saved.pop("route_row", None)
        dx, d_topk_weights, grads = _expert_mlp_backward(
            d_out, x, topk_weights, routed, saved, schedule.routing, schedule.block_m,
            topk, num_tokens * topk, swiglu_limit, main_grads, sorted_rows=route_row is not None,
        )
        return dx, route_row, d_topk_weights, grads
    return _per_rank_backward(schedule, saved, d_out, x, routed, swiglu_limit, main_grads)


def _per_rank_backward(schedule, saved, d_out, x, routed, swiglu_limit, main_grads):
    """`_routed_backward` with dOut rows sent once per (token, rank) (`_per_rank_forward`): the
    expert's rank runs the backward of each received row's k_l routes (their router weights
    kept from the forward), sums the row's dx over them (ascending q, fp32, one bf16 row) and
    returns it with the routes' router-weight gradients. (dx [P·C, H] partial rows, route_row
    token_slot [T·P], d_topk_weights [T, topk], grads)."""
    dispatch = schedule.dispatch
    expert_x = dispatch.received_x(saved.pop("expert_x"), x)  # [P·C, H]
    if isinstance(expert_x, tuple):  # fp8 on the wire: the received e4m3 rows are the wgrad's x (sent again
        saved["x_q"], saved["x_scale"] = expert_x  # if a later dispatch overwrote the transport's buffer)
    expert_weights = saved.pop("expert_weights")  # [P·C, k_l]
    # [P·C, H] (or e4m3 rows and scales: the plan's `fp8_block_on_the_wire`)
    expert_d_out = dispatch.dispatch_grad(d_out)
    k_l = dispatch.routes_per_row
    dx_routes, d_weights, grads = _expert_mlp_backward(
        expert_d_out, expert_x, expert_weights, routed, saved, schedule.routing, schedule.block_m,
        k_l, dispatch.num_expert_rows * k_l, swiglu_limit, main_grads,
    )
    received = dispatch.received_routes.view(-1, k_l) >= 0  # [P·C, k_l]
    dx_parts = ops.combine(dx_routes, received.float(), None, dispatch.received_routes)  # [P·C, H]
    # empty routes have no row, so nothing wrote their gradient
    d_weights = torch.where(received, d_weights, 0.0)
    dx, d_topk_weights = dispatch.combine_grad(dx_parts, d_weights)
    return dx, dispatch.token_slot, d_topk_weights, grads


def _triton_backward(schedule, saved, d_out, x, topk_weights, shared, routed, swiglu_limit, main_grads) -> Gradients:
    """The backward on one GPU, no host sync: per expert group, down dgrad + SwiGLU
    backward + router-weight gradient, gate/up dgrad into route slots, wgrad GEMMs; then
    d_x = dx_shared + Σ_j dx_slots (the combine with unit weights, ascending j; under expert
    parallelism + Σ_p of the ranks' partial rows, ascending p). Reads the
    forward's g,u and, where it saved one, h (not y: the router-weight gradient is ⟨dOut·Wd, h⟩
    over I, h recomputed from g, u), taking them out of `saved` as it goes (pass a copy to keep
    them)."""
    num_tokens, topk = topk_weights.shape
    if saved.get("gate_up") is None or saved["gate_up"].shape[0] == 0:
        raise ValueError("context: expected the pre-activations a forward with needs_backward=True saves")
    shared_saved = {"gate_up": saved.pop("gate_up_shared"), "h": saved.pop("h_shared")} if shared[0] is not None else {}
    d_out = d_out.to(torch.bfloat16)  # a GEMM operand (no copy when it already is bf16)
    dx_slots, route_row, d_topk_weights, routed_grads = _routed_backward(
        schedule, saved, d_out, x, topk_weights, routed, swiglu_limit, tuple(main_grads.get(n) for n in _ROUTED)
    )
    dx_shared, shared_grads = None, (None, None, None)
    if shared[0] is not None:
        shared_experts = tuple(w.unsqueeze(0) for w in shared)  # one expert of the grouped GEMMs
        dx_shared, _, grads = _expert_mlp_backward(
            d_out, x, None, shared_experts, shared_saved, schedule.shared_routing,
            schedule.block_m, 1, num_tokens, swiglu_limit,
            tuple(None if main_grads.get(n) is None else main_grads[n].unsqueeze(0) for n in _SHARED),
            token_order=True,
        )
        shared_grads = tuple(g.squeeze(0) for g in grads)
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
    them (h after the down weight gradient, g,u after the down dgrad), so the weight
    gradients never sit next to them; the context then serves no second backward (`moe`
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
        routed = context.routed_weights or _triton_routed_weights(config.precision, (w_gate, w_up, w_down))
        if release_context:
            context.routed_weights = ()
        saved = context.saved if release_context else dict(context.saved)  # taken from as the backward reads
        grads = _triton_backward(
            schedule, saved, d_out, x, topk_weights, (ws_gate, ws_up, ws_down), routed, swiglu_limit, main_grads
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
