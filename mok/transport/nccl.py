"""The NCCL-fallback transport: expert parallelism on `torch.distributed.all_to_all_single`.

One layer call on each of the P ranks of the group (C = the send capacity, E_l local
experts per rank, T tokens, kernels in `mok/kernels/dispatch.py`):

    plan       route_slots: each route's slot p·C + c in a [P·C] send buffer (by local
               expert, then t·topk + j, per destination p) and the local expert id of
               every send row (−1: empty) → exchange, with this rank's error flag in an
               extra column → receive_expert_ids → the receiver's schedule over its P·C
               received rows, each a token with topk = 1 (`skip_empty_ids`), sources
               interleaved, mapped back to the rows where the exchange put them
    forward    pack x rows → exchange → (caller: gate/up + SwiGLU, down into the received
               rows) → exchange back → unpack into slots t·topk + j
    backward   pack dOut rows and router weights → exchange → (caller: dgrad, wgrad) →
               exchange dx rows and router-weight gradients back → unpack

Every exchange moves C rows per pair of ranks (equal splits): no count goes to the host,
so nothing synchronises with it, and every rank runs the same collectives in the same
order whatever its routing, so a rank whose routes overflow cannot leave a peer waiting.
The router weight goes to the expert's rank beside the dOut row (its own [P·C, 1]
exchange) and is applied there in fp32, not folded into a bf16 w·dOut row.

Capacity C and the receiver's schedule: `mok/transport/common.py`. Routes past C set
ERROR_CAPACITY_OVERFLOW on every rank (raised by `check_errors`, or at once with
`strict=True`) and contribute zeros; nothing is written out of bounds. Memory per
call: the send and receive buffers of P·C rows per direction, and the P·C received token
rows, kept for the backward.

Determinism: rows are placed at fixed positions and the collectives only move bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mok import ops
from mok.transport.common import RouteCapacity, receiver_schedule


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single with equal splits: block p of `send` goes to rank p, block p of
    the result came from rank p."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


@dataclass(frozen=True, eq=False)
class NcclDispatch:
    """The routes of one layer call and the row moves along them (module docstring)."""

    group: dist.ProcessGroup | None
    world_size: int  # P
    send_capacity: int  # C
    topk: int
    route_slot: torch.Tensor  # [T·topk] int32: row of the send buffer, −1 for a route not sent

    @property
    def num_expert_rows(self) -> int:
        """P·C: rows of every buffer this rank sends or receives."""
        return self.world_size * self.send_capacity

    def peer_bytes(self, hidden_size: int, with_backward: bool) -> int:
        """Bytes this rank sends its P − 1 peers in one forward (and backward), C rows per
        peer in each exchange: the plan's expert ids (C + 1 int32), x rows and y rows (H
        bf16 each); the backward adds dOut and dx rows and the router weights and their
        gradients (fp32). The block a rank exchanges with itself stays on the device."""
        int32, bf16, fp32 = 4, 2, 4
        forward = (self.send_capacity + 1) * int32 + 2 * self.send_capacity * hidden_size * bf16
        backward = 2 * self.send_capacity * (hidden_size * bf16 + fp32)
        return (self.world_size - 1) * (forward + (backward if with_backward else 0))

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] token rows → [P·C, H]: the rows routed to this rank's experts."""
        return _exchange(ops.pack_rows(x, self.route_slot, self.topk, self.num_expert_rows), self.group)

    def peer_rows(self, kind: str) -> None:
        """Epilogues cannot store on the peers over NCCL: the caller combines."""
        return None

    def received_x(self, expert_x: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The received token rows for the backward: what `dispatch` returned, kept as is."""
        return expert_x

    def combine(self, y_rows: torch.Tensor) -> torch.Tensor:
        """[P·C, W] rows computed for the received rows → [T·topk, W] in route slots (zeros
        for routes not sent)."""
        return ops.unpack_rows(_exchange(y_rows, self.group), self.route_slot)

    def dispatch_grad(self, d_out: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dOut rows [P·C, H] and router weights [P·C, 1] fp32 of the received routes."""
        weights = ops.pack_rows(topk_weights.view(-1, 1), self.route_slot, 1, self.num_expert_rows)
        return self.dispatch(d_out), _exchange(weights, self.group)

    def combine_grad(self, dx_rows: torch.Tensor, d_weight_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dx_slots [T·topk, H] and d_topk_weights [T, topk] fp32 from the experts' ranks."""
        d_topk_weights = self.combine(d_weight_rows.view(-1, 1)).view(-1, self.topk)
        return self.combine(dx_rows), d_topk_weights


class NcclTransport(RouteCapacity):
    """Expert parallelism over `group` through `all_to_all_single` (module docstring).
    Creating one is a collective: the ranks agree on the largest token count."""

    def plan(
        self, topk_ids: torch.Tensor, num_local_experts: int, error_flag: torch.Tensor, block_m: int
    ) -> tuple[NcclDispatch, tuple[torch.Tensor, ...]]:
        """This call's dispatch, and the schedule (the tensors of `ops.routing_schedule`) of
        the P·C rows this rank's experts receive. A collective."""
        num_ranks, capacity = self.world_size, self.send_capacity(num_local_experts)
        route_slot, send_expert, _ = ops.route_slots(topk_ids, error_flag, num_local_experts, num_ranks, capacity)
        # [P, C + 1]: this rank's error flag rides with the ids, so every rank learns of all ranks' routing errors
        send_ids = torch.cat([send_expert.view(num_ranks, capacity), error_flag.expand(num_ranks, 1)], dim=1)
        schedule = receiver_schedule(_exchange(send_ids, self.group), error_flag, num_local_experts, block_m)
        return NcclDispatch(self.group, num_ranks, capacity, topk_ids.shape[1], route_slot), schedule
