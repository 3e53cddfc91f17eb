"""The interface every precision recipe implements, and what the recipes share: taking saved
tensors out as they are read, the weight-gradient call, the FP8 recipes' cached weight copies."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mok.kernels.common import sms_left_free
from mok.kernels.routing.schedule import RoutingSchedule


def take(holder: Any, *names: str) -> Any:
    """The fields `names` of the dataclass `holder`, each set to None there: where `holder` had a
    tensor's only reference, the tensor is freed after its last reader instead of with `holder`."""
    values = tuple(getattr(holder, name) for name in names)
    for name in names:
        setattr(holder, name, None)
    return values[0] if len(values) == 1 else values


def weight_grads(fresh_op, accumulate_op, operands, main_grads, routing: RoutingSchedule, scales=()):
    """`fresh_op`'s new gradient(s) from `operands` (and their fp8_block `scales`); or, when
    `main_grads` holds buffers, `accumulate_op` adds into them in place and they are
    returned in the gradients' places."""
    if main_grads[0] is None:
        return fresh_op(*operands, routing, *scales)
    accumulate_op(*main_grads, *operands, routing, *scales)
    return main_grads if len(main_grads) > 1 else main_grads[0]


@dataclass(frozen=True, eq=False)
class ArrivingRows:
    """The routed experts' token rows while they arrive from the other ranks (expert parallelism,
    `transport.common.own_tiles_split`): the tiles of `own` read only rows already here, in
    `rows_now`; those of `others` need `land()`, the exchange's finish, which gives every row. The
    exchange runs from `comm_sms` SMs meanwhile."""

    own: RoutingSchedule
    others: RoutingSchedule
    rows_now: Any  # [P·C, H] bf16, or the (e4m3 rows, scales) pair the recipe's `sends_fp8_rows` says
    land: Callable[[], Any]
    comm_sms: int

    @contextlib.contextmanager
    def before_landing(self) -> Iterator[None]:
        """The block runs while the rows travel: its persistent launches leave the exchange its SMs."""
        rows = self.rows_now[0] if isinstance(self.rows_now, tuple) else self.rows_now
        with sms_left_free(rows.device, self.comm_sms):
            yield


@dataclass(frozen=True, eq=False)
class ReturningRows:
    """The routed experts' outputs while they go back to the other ranks (expert parallelism,
    `transport.common.own_tiles_split`): the down GEMM runs `others`' tiles (each holds a route of
    another rank's token), `send(y)` starts those tokens' rows back, then `own`'s tiles run into
    the same y while they travel, from all SMs but `comm_sms`."""

    others: RoutingSchedule
    own: RoutingSchedule
    send: Callable[[torch.Tensor], None]
    comm_sms: int


def down_gemm(launch: Callable[[RoutingSchedule], torch.Tensor],
              launch_into: Callable[[RoutingSchedule, torch.Tensor], None], routing: RoutingSchedule,
              returning: ReturningRows | None) -> torch.Tensor:
    """y of a recipe's down GEMM: `launch(routing)`, or with `returning` its two launches,
    `launch(others)`, then `launch_into(own, y)` while the first's rows travel."""
    if returning is None:
        return launch(routing)
    y = launch(returning.others)
    returning.send(y)
    with sms_left_free(y.device, returning.comm_sms):
        launch_into(returning.own, y)
    return y


class Recipe(ABC):
    """How the routed experts' GEMMs run in one precision: the operands they read, what the
    forward keeps for the backward, and the backward in two calls, data gradients first, then
    weight gradients. One stateless instance per precision (`mok.precision.recipe`).

    `routing` is the experts' `RoutingSchedule` (`ops.routing_schedule`); `topk` is routes per
    token row and `num_slots` the rows of y and dx in route slots (T·topk). `sorted_rows=True`,
    only where `sorted_outputs()`, leaves y and dx in the sorted layout instead
    ([capacity_rows, H])."""

    name: ClassVar[str]
    # Whether `prepare_weights` makes copies of the weights (which the forward's context keeps for
    # the backward, as autograd would keep saved tensors) rather than passing them through.
    weights_are_copies: ClassVar[bool] = False
    # Whether the reference backend reads the routed gate and up weights as given, views with a
    # contiguous last dim included (it rounds them otherwise).
    strided_reference_weights: ClassVar[bool] = True

    def prepare_weights(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> tuple:
        """The routed weights as this recipe's kernels read them, forward and backward."""
        return w_gate, w_up, w_down

    def reference_operands(self, x, w_gate, w_up, w_down) -> tuple:
        """(x, w_gate, w_up, w_down) as the reference backend computes with them: rounded
        through the format the kernels read them in."""
        return x, w_gate, w_up, w_down

    def sorted_outputs(self) -> bool:
        """Whether on one rank the routed experts leave y and dx in the sorted layout."""
        return False

    def sends_fp8_rows(self) -> bool:
        """Whether under expert parallelism x (and dOut) travel to the experts' ranks in e4m3 with
        1×128 scales: `forward` and `backward_data` then get such (rows, scales) pairs."""
        return False

    def gate_up_while_arriving(self) -> bool:
        """Whether `forward` takes `arriving` rows: its gate/up GEMM reads the received rows as they
        came (no pass over all of them first), so it can start on the rows already here."""
        return False

    @abstractmethod
    def forward(self, x, weights, routing, topk, num_slots, swiglu_limit, needs_backward, *,
                sorted_rows=False, arriving: ArrivingRows | None = None,
                returning: ReturningRows | None = None) -> tuple[torch.Tensor, Any]:
        """(y [num_slots, H] bf16, each route's unweighted expert output, and what `backward_data`
        reads: this recipe's saved dataclass, None without `needs_backward`). With `arriving`
        (only where `gate_up_while_arriving`), x is None and the gate/up GEMM runs as the rows
        land: `arriving.own`'s tiles, then `land()`, then `arriving.others`'; with `returning` the
        down GEMM runs in its two launches (`down_gemm`). `routing` is the schedule of both
        launches."""

    @abstractmethod
    def prepare_backward(self, x, saved, routing, topk, swiglu_limit) -> Any:
        """The part of `backward_data` that reads no dOut, apart: under expert parallelism it runs
        while dOut's rows travel, and `backward_data` takes its result as `prepared`. Takes what it
        reads out of `saved`, as `backward_data` would have."""

    @abstractmethod
    def backward_data(self, d_out, x, topk_weights, weights, saved, routing, topk, num_slots,
                      swiglu_limit, *, sorted_rows=False, prepared=None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(dx [num_slots, H] bf16, d_topk_weights [T, topk] fp32, state): the down dgrad with the
        SwiGLU backward and the router-weight gradient, then the gate/up dgrad. Takes what it
        reads out of `saved` (`take`); `state` holds what `backward_weights` reads. `prepared`:
        what `prepare_backward` returned for these arguments (None: it does that part itself)."""

    @abstractmethod
    def backward_weights(self, state: Any, main_grads: tuple) -> tuple:
        """(d_w_gate, d_w_up, d_w_down) [E_l, ...] bf16 from `backward_data`'s state, taking its
        operands out as it goes; a weight with a `main_grads` buffer (fp32 or bf16) gets its
        gradient added into it, in place, and the buffer stands in its place."""


# weight -> ((precision, its _version, its data_ptr), its copies); an entry goes with its weight.
_WEIGHT_COPY_CACHE = WeakIdKeyDictionary()


@torch.compiler.assume_constant_result
def capturing_cuda_graph() -> bool:
    """Whether the current CUDA stream is capturing a graph. Folded to a constant while
    torch.compile traces (torch 2.11's dynamo refused the bool-returning call in a
    fullgraph trace on H200), where weights are quantized inside the graph anyway."""
    return torch.cuda.is_current_stream_capturing()


class QuantizedRecipe(Recipe):
    """A recipe whose GEMMs read low-precision copies of the routed weights (both orientations,
    one launch per weight)."""

    weights_are_copies = True
    strided_reference_weights = False

    @abstractmethod
    def weight_copy(self, w: torch.Tensor) -> tuple:
        """w's copies as this recipe's GEMMs read them."""

    @abstractmethod
    def round_operand(self, t: torch.Tensor, is_weight: bool) -> torch.Tensor:
        """t [..., N, K] rounded through this recipe's format along K, in fp32 (the reference's
        operands). K is the forward GEMM's reduction dim for x [T, H] and for every routed weight."""

    def prepare_weights(self, w_gate, w_up, w_down) -> tuple:
        """Each weight's copies, made once per version of it: forward and backward of a step share
        them, and an optimizer's in-place update (which bumps `w._version`) makes the next call
        quantize again. The key is host state, so a hit costs no device work and no sync. While
        torch.compile traces or a CUDA graph captures, w is quantized on every call instead, so the
        graph holds the quantization and each replay reads the weight as it is then; so is an
        inference-mode tensor, which has no version counter."""
        return tuple(self._cached_copy(w) for w in (w_gate, w_up, w_down))

    def _cached_copy(self, w: torch.Tensor) -> tuple:
        if torch.compiler.is_compiling() or (w.is_cuda and capturing_cuda_graph()) or w.is_inference():
            return self.weight_copy(w)
        key = (self.name, w._version, w.data_ptr())
        cached = _WEIGHT_COPY_CACHE.get(w)
        if cached is None or cached[0] != key:
            cached = _WEIGHT_COPY_CACHE[w] = (key, self.weight_copy(w))
        return cached[1]

    def fresh_weight_copies(self, weights) -> tuple:
        """Every weight's copies made anew, no cache: what each in-place update of the weights adds
        to the step that follows it."""
        return tuple(self.weight_copy(w) for w in weights)

    def reference_operands(self, x, w_gate, w_up, w_down) -> tuple:
        x = self.round_operand(x, is_weight=False)
        return x, *(self.round_operand(w, is_weight=True) for w in (w_gate, w_up, w_down))
