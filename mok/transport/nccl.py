"""The NCCL-fallback transport: expert parallelism on `torch.distributed.all_to_all_single`,
each token row sent once to each rank holding ≥ 1 of its experts.

One layer call on each of the P ranks of the group (C = the token capacity, k_l =
min(topk, E_l) the routes one row can carry, T tokens; plan in `common.py`):

    plan       token_plan: each (token, rank) pair's send row p·C + c and the k_l local
               expert ids per row (−1: empty) → exchange, with this rank's error flag in an
               extra column → the receiver's schedule over its P·C received rows, each a token
               with topk = k_l (`skip_empty_ids`), sources interleaved
    forward    pack x rows and the routes' router weights → exchange → (caller: gate/up +
               SwiGLU, down, then the sum of each row's local routes Σ_q w·y, fp32) → one
               partial row per (token, rank) back → (caller: out[t] = y_shared[t] + Σ_p part_p,
               ascending p, fp32, through `token_slot`)
    backward   pack dOut rows → exchange → (caller: dgrad, wgrad, the sum of each row's dx over
               its local routes) → dx partial rows and the k_l router-weight gradients back →
               d_topk_weights per route; (caller: d_x = dx_shared + Σ_p dx_p, ascending p)

Every exchange moves C rows per pair of ranks (equal splits): no count goes to the host,
so nothing synchronises with it, and every rank runs the same collectives in the same
order whatever its routing, so a rank whose routes overflow cannot leave a peer waiting.
The router weights go to the expert's rank beside the x rows and stay there for the
backward, where they are applied to dOut in fp32.

Pairs past C set ERROR_CAPACITY_OVERFLOW on every rank (raised by `check_errors`, or at once
with `strict=True`) and contribute zeros; nothing is written out of bounds. Memory per call:
the send and receive buffers of P·C rows per exchange, and the P·C received token rows and
their weights, kept for the backward.

Determinism: rows are placed at fixed positions and the collectives only move bytes; the
sums run in the fixed orders above (j ascending on the expert's rank, then p ascending at
the source), so results do not depend on the capacity.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mok import ops
from mok.kernels.routing.schedule import RoutingSchedule
from mok.transport.common import RouteCapacity, TokenPairs, sending, token_plan, token_receiver_schedule


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single with equal splits: block p of `send` goes to rank p, block p of
    the result came from rank p."""
    return _start_exchange(send, group, beside=False)()


def _start_exchange(send: torch.Tensor, group, beside: bool = True) -> Callable[[], torch.Tensor]:
    """`_exchange` started (`beside`: from the side stream, `common.sending`); its finish
    returns the result. Every exchange of the transport passes here."""
    recv = torch.empty_like(send)
    with sending(send.device) if beside else contextlib.nullcontext():
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return functools.partial(_received, work, send, recv)


def _received(work, send: torch.Tensor, recv: torch.Tensor) -> torch.Tensor:
    """recv once `work` has landed (for the current stream); `send` stays alive until then."""
    work.wait()
    return recv


@dataclass(frozen=True, eq=False)
class NcclDispatch(TokenPairs):
    """The (token, rank) pairs of one layer call and the row moves along them (module docstring).
    The `start_*` calls take the symmetric transport's `num_programs` and ignore it: NCCL sizes
    its own kernels."""

    group: dist.ProcessGroup | None
    world_size: int  # P
    rank: int  # this rank's place in the group
    send_capacity: int  # C
    topk: int
    routes_per_row: int  # k_l
    token_slot: torch.Tensor  # [T·P] int32: send row of pair (t, p) at t·P + p, −1: none
    route_place: torch.Tensor  # [T·topk] int32: each route's sent route (p·C + c)·k_l + q, −1: not sent
    received_routes: torch.Tensor  # [P·C·k_l] int32: each received route's index, −1: empty
    fp8_wire: bool = False  # fp8_block: x (and dOut, where the dgrad reads it per token) travel in e4m3 + scales

    def peer_bytes(self, hidden_size: int, with_backward: bool) -> int:
        """Bytes this rank sends its P − 1 peers in one forward (and backward), C rows per
        peer in each exchange: the plan's expert ids (C·k_l + 1 int32), x rows and their
        router weights (k_l fp32), partial y rows (H bf16); the backward adds dOut rows, dx
        rows (H bf16) and their router-weight gradients (k_l fp32). A dispatched row is H bf16,
        or with `fp8_wire` H e4m3 and H/128 fp32 scales (dOut where `d_out_on_fp8_wire`). The
        block a rank exchanges with itself stays on the device."""
        int32, bf16, fp32 = 4, 2, 4
        rows, k_l = self.send_capacity, self.routes_per_row
        x_row, d_out_row = self.dispatched_row_bytes(hidden_size)
        forward = (rows * k_l + 1) * int32 + rows * (x_row + hidden_size * bf16 + k_l * fp32)
        backward = rows * (d_out_row + hidden_size * bf16 + k_l * fp32)
        return (self.world_size - 1) * (forward + (backward if with_backward else 0))

    def _start_send_rows(self, rows: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[Any, Callable[[], Any]]:
        """[T, W] token rows (or a tuple of such, e.g. e4m3 rows and their scales) on their way:
        (the packed rows sent, [P·C, W], where block p goes to rank p: this rank's own block is
        already what it receives from itself; the finish, which gives the rows [P·C, W] of the
        (token, rank) pairs received here)."""
        if isinstance(rows, tuple):
            parts = [self._start_send_rows(t) for t in rows]
            return tuple(sent for sent, _ in parts), lambda: tuple(finish() for _, finish in parts)
        # e4m3 travels as bytes: collectives (gloo) take no fp8 dtype
        raw = rows.view(torch.uint8) if rows.dtype == torch.float8_e4m3fn else rows
        packed = ops.pack_rows(raw, self.token_slot, self.world_size, self.num_expert_rows)
        finish = _start_exchange(packed, self.group)
        return packed.view(rows.dtype), lambda: finish().view(rows.dtype)

    def start_dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, num_programs: int | None = None
                       ) -> Callable[[], Any]:
        """[T, H] token rows and [T, topk] router weights on their way; the finish gives the
        received rows [P·C, H] (with `fp8_wire`: quantized in 1×128 blocks before they travel,
        the pair of e4m3 rows and their [P·C, H/128] fp32 scales) and their routes' weights
        [P·C, k_l] fp32 (0 for empty routes)."""
        return self.start_dispatch_split(x, topk_weights, num_programs)[1]

    def start_dispatch_split(self, x: torch.Tensor, topk_weights: torch.Tensor, num_programs: int | None = None
                             ) -> tuple[Any, Callable[[], Any]]:
        """`start_dispatch` with what is here at once: (rows [P·C, H] (or the e4m3 pair) whose own
        rows, p = this rank, are those the finish will give, the finish). The own rows are the
        packed send buffer's own block."""
        sent, rows = self._start_send_rows(ops.quantize_fp8_block_activations(x) if self.fp8_wire else x)
        weights = _start_exchange(self._pack_weights(topk_weights), self.group)
        return sent, lambda: (rows(), weights().view(-1, self.routes_per_row))

    def _pack_weights(self, topk_weights: torch.Tensor) -> torch.Tensor:
        """[P·C·k_l] fp32: each sent route's weight, zeros elsewhere (the expert side's sums
        read every slot)."""
        num_sent = self.num_expert_rows * self.routes_per_row
        send = topk_weights.new_zeros(num_sent + 1, dtype=torch.float32)  # the last: routes not sent
        target = torch.where(self.route_place >= 0, self.route_place.long(), num_sent)
        return send.scatter_(0, target, topk_weights.reshape(-1).float())[:num_sent]

    def received_x(self, expert_x: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The received token rows for the backward: what `dispatch` returned, kept as is."""
        return expert_x

    def start_combine(self, part_rows: torch.Tensor, num_programs: int | None = None) -> Callable[[], torch.Tensor]:
        """[P·C, H] partial rows of the received rows on their way back; the finish gives
        [P·C, H] this rank's tokens' partial rows from each rank, pair (t, p) at row
        token_slot[t·P + p]."""
        return _start_exchange(part_rows, self.group)

    def start_combine_split(self, part_rows: torch.Tensor, num_programs: int | None = None
                            ) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """`start_combine` while this rank's own rows are still being written: part_rows' other
        blocks (written) go now; (where the own rows go, [C, H], a tensor apart, which the
        exchange, reading part_rows meanwhile, does not touch; the finish, which puts them into
        the exchange's result and gives `start_combine`'s rows)."""
        own_rows = self.own_rows()
        own = part_rows.new_empty(own_rows.stop - own_rows.start, part_rows.shape[1])  # [C, H]
        received = _start_exchange(part_rows, self.group)

        def finish() -> torch.Tensor:
            rows = received()
            rows[own_rows] = own
            return rows

        return own, finish

    def start_dispatch_grad(self, d_out: torch.Tensor, num_programs: int | None = None) -> Callable[[], Any]:
        """dOut rows on their way; the finish gives those [P·C, H] of the received rows (where
        `d_out_on_fp8_wire`: the pair of e4m3 rows and scales, quantized before they travel)."""
        quantized = self.d_out_on_fp8_wire(d_out.shape[1])
        return self._start_send_rows(ops.quantize_fp8_block_activations(d_out) if quantized else d_out)[1]

    def start_combine_grad(self, dx_rows: torch.Tensor, d_weight_rows: torch.Tensor, num_programs: int | None = None
                           ) -> Callable[[], Any]:
        """dx partial rows [P·C, H] and the [P·C, k_l] router-weight gradients on their way back;
        the finish gives the dx partial rows (as `start_combine`'s) and d_topk_weights [T, topk]
        fp32."""
        d_weights = _start_exchange(d_weight_rows.reshape(-1, 1), self.group)  # [P·C·k_l, 1]
        dx = self.start_combine(dx_rows)
        return lambda: (dx(), ops.unpack_rows(d_weights(), self.route_place).view(-1, self.topk))


class NcclTransport(RouteCapacity):
    """Expert parallelism over `group` through `all_to_all_single` (module docstring).
    Creating one is a collective: the ranks agree on the largest token count."""

    def plan(
        self, topk_ids: torch.Tensor, num_local_experts: int, error_flag: torch.Tensor, block_m: int,
        fp8_wire: bool = False,
    ) -> tuple[NcclDispatch, RoutingSchedule]:
        """This call's dispatch (`fp8_wire`: x and dOut travel in fp8_block), and the schedule
        of the P·C rows this rank's experts receive, as tokens with topk = k_l. A collective."""
        num_ranks, capacity = self.world_size, self.token_capacity()
        routes_per_row = min(topk_ids.shape[1], num_local_experts)
        token_slot, route_place, send_expert = token_plan(topk_ids, num_local_experts, num_ranks, capacity,
                                                          error_flag)
        # [P, C·k_l + 1]: this rank's error flag rides with the ids, so every rank learns of all ranks' routing errors
        send_ids = torch.cat([send_expert.view(num_ranks, -1), error_flag.expand(num_ranks, 1)], dim=1)
        schedule, received_routes = token_receiver_schedule(
            _exchange(send_ids, self.group), error_flag, num_local_experts, routes_per_row, block_m, self.rank
        )
        dispatch = NcclDispatch(self.group, num_ranks, self.rank, capacity, topk_ids.shape[1], routes_per_row, token_slot,
                                route_place, received_routes, fp8_wire)
        return dispatch, schedule
