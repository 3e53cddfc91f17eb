"""What both transports share: the token capacity C, the once-per-(token, rank) plan and
the receiver's schedule.

Capacity: each rank may send each peer C = min(T_max, ⌈R / P⌉) token rows, T_max the largest
`num_local_tokens` of the ranks' workspaces (one C for all), R = `MoKConfig.receive_capacity`
(the routes one rank may receive; None: the exact worst case, which never overflows). Every
row carries at least one route, so R bounds the rows too.

Plan (`token_plan`): a token's row goes once to each rank holding ≥ 1 of its experts, with
the k_l = min(topk, E_l) slots of local expert ids (−1: empty) and router weights of its
routes there. Rows of source p sit at p·C + c (c: the token's place among this rank's tokens
to p, ascending t); route q of row i (its q-th route to that rank, ascending j) is received
route i·k_l + q.

Overlap (`exchange_beside`): an exchange is started (`start_*` of a dispatch: what it sends is
prepared on the current stream, the sending runs on the device's side stream), the caller
queues work that does not need it, then the exchange's `finish` makes the side stream's work
visible to the current stream (a stream wait, no host sync) and returns what arrived. The
side stream forks from the current one and joins it again, so a CUDA graph captures both.

Receiver's schedule (`token_receiver_schedule`): every received row is a token with
topk = k_l, so the single-GPU kernels run unchanged on the received rows. The schedule is
built over the received rows rotated to start at this rank's own (p = my rank, then p + 1, …,
wrapping), so that inside each expert the routes of this rank's own tokens come first, then
mapped back to the rows where the exchange put them.

Own tiles (`own_tiles_split`): the schedule's M tiles in two sets, those whose routes all came
from this rank's own tokens and the rest. The gate/up GEMM computes the own tiles before any
peer's row has arrived; the down GEMM computes them last, while the other ranks' partial rows
travel back. The own routes leading each expert make all but at most one of an expert's tiles
with own routes own-only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from mok import ops
from mok.config import MoKConfig
from mok.kernels.common import ERROR_CAPACITY_OVERFLOW, sms_left_free
from mok.kernels.gemm.dgrad import fp8_block_down_dgrad_gathers
from mok.kernels.routing.schedule import RoutingSchedule, sorted_route_rows


def check_same_across_ranks(group: dist.ProcessGroup | None, values: dict[str, int], device: torch.device) -> None:
    """Raises ValueError naming the first of `values` that some rank of `group` holds
    differently (a collective: every rank passes the same names)."""
    mine = torch.tensor(list(values.values()), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    for rank, theirs in enumerate(gathered):
        for (name, value), other in zip(values.items(), theirs.tolist()):
            if other != value:
                raise ValueError(f"{name}: expected the same value on every rank, got {value} here and {other} on rank {rank}")


class RouteCapacity:
    """C for a group (module docstring). Creating one is a collective: the ranks agree on
    the largest token count (a host sync, once per workspace)."""

    def __init__(
        self, config: MoKConfig, group: dist.ProcessGroup | None, *, device: torch.device, num_local_tokens: int,
        topk: int,
    ):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        most_tokens = torch.tensor([num_local_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(most_tokens, op=dist.ReduceOp.MAX, group=group)
        self.max_local_tokens = int(most_tokens.item())
        self.topk = topk
        self.receive_capacity = config.receive_capacity(self.max_local_tokens, topk, self.world_size)

    def token_capacity(self) -> int:
        """C of the once-per-(token, rank) plan: token rows one rank may send one peer. Each
        row carries ≥ 1 route, so the routes a rank may receive bound its rows too."""
        return min(self.max_local_tokens, -(-self.receive_capacity // self.world_size))


class TokenPairs:
    """What both transports' dispatches share about one call's (token, rank) pairs. A subclass
    holds world_size (P), rank, send_capacity (C), token_slot [T·P] int32 and fp8_wire."""

    @property
    def num_expert_rows(self) -> int:
        """P·C: rows of every buffer this rank sends or receives."""
        return self.world_size * self.send_capacity

    def d_out_on_fp8_wire(self, hidden_size: int) -> bool:
        """Whether dOut travels quantized: with `fp8_wire`, where the fp8_block down dgrad reads
        dOut's per-token quantization (`dgrad.fp8_block_down_dgrad_gathers`); elsewhere it
        needs dOut's bf16 rows."""
        return self.fp8_wire and fp8_block_down_dgrad_gathers(hidden_size)

    def dispatched_row_bytes(self, hidden_size: int) -> tuple[int, int]:
        """(bytes of one x row, of one dOut row) on the wire: H bf16, or H e4m3 and H/128 fp32 scales."""
        fp8_row, bf16_row = hidden_size + hidden_size // 128 * 4, hidden_size * 2
        return (fp8_row if self.fp8_wire else bf16_row), (fp8_row if self.d_out_on_fp8_wire(hidden_size) else bf16_row)

    def own_rows(self) -> slice:
        """The rows of every [P·C, …] buffer that this rank exchanges with itself: block p = rank."""
        return slice(self.rank * self.send_capacity, (self.rank + 1) * self.send_capacity)

    def peer_blocks(self) -> tuple[slice, slice]:
        """The rows of every [P·C, …] buffer exchanged with the other ranks: the blocks before and
        after `own_rows` (either may be empty)."""
        own = self.own_rows()
        return slice(0, own.start), slice(own.stop, self.num_expert_rows)

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor):
        """`start_dispatch`, landed: the received rows and their routes' weights."""
        return finish_now(self.start_dispatch(x, topk_weights), x.device)

    def combine(self, part_rows: torch.Tensor) -> torch.Tensor:
        """`start_combine`, landed: this rank's tokens' partial rows from each rank."""
        return finish_now(self.start_combine(part_rows), part_rows.device)

    def dispatch_grad(self, d_out: torch.Tensor):
        """`start_dispatch_grad`, landed: the dOut rows of the received rows."""
        return finish_now(self.start_dispatch_grad(d_out), d_out.device)

    def combine_grad(self, dx_rows: torch.Tensor, d_weight_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`start_combine_grad`, landed: dx partial rows and d_topk_weights."""
        return finish_now(self.start_combine_grad(dx_rows, d_weight_rows), dx_rows.device)

    def peer_rows(self) -> int:
        """Token rows this rank's tokens need on other ranks per exchange: its (token, rank)
        pairs with another rank. Counts on the device: a host sync, for reports only."""
        pairs = self.token_slot.view(-1, self.world_size) >= 0  # [T, P]
        return int(pairs.sum()) - int(pairs[:, self.rank].sum())


def _or_flags(flags: torch.Tensor) -> torch.Tensor:
    """[1] int32: the bitwise OR of `flags` [P] int32 (error bits), on the device."""
    bits = 1 << torch.arange(31, device=flags.device, dtype=torch.int32)  # [31]
    return ((flags[:, None] & bits) != 0).any(0).to(torch.int32).mul(bits).sum().to(torch.int32).view(1)


def token_plan(
    topk_ids: torch.Tensor,  # [T, topk] global expert ids
    num_local_experts: int,
    world_size: int,
    capacity: int,
    error_flag: torch.Tensor,  # [1] int32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_slot [T·P] int32, route_place [T·topk] int32, send_expert [P·C·k_l] int32) of the
    once-per-(token, rank) plan (module docstring): the send row p·C + c of each (token t,
    rank p) pair at t·P + p; each route's received route (p·C + c)·k_l + q; the local expert
    of each sent route. −1: no row (no route there, beyond the capacity, or a bad id). Pairs
    past C set ERROR_CAPACITY_OVERFLOW; bad ids set ERROR_BAD_EXPERT_ID (`sorted_route_rows`
    validates them). Plain torch ops on the device: no host sync."""
    num_tokens, topk = topk_ids.shape
    routes_per_row = min(topk, num_local_experts)
    device = topk_ids.device
    good = (sorted_route_rows(topk_ids, num_local_experts * world_size, error_flag)[0] >= 0).view(num_tokens, topk)
    ids = topk_ids.long()
    dest = torch.where(good, ids // num_local_experts, world_size)  # [T, topk]; P: nowhere
    reaches = torch.zeros(num_tokens, world_size + 1, dtype=torch.bool, device=device)
    reaches = reaches.scatter_(1, dest, True)[:, :world_size]  # [T, P]
    place = torch.cumsum(reaches.to(torch.int32), dim=0) - 1  # [T, P]: the token's row among those to p
    fits = reaches & (place < capacity)
    overflow = (reaches & ~fits).any().to(torch.int32) * ERROR_CAPACITY_OVERFLOW
    error_flag.bitwise_or_(overflow.view(1))
    ranks = torch.arange(world_size, device=device, dtype=torch.int32)
    token_slot = torch.where(fits, ranks * capacity + place, -1).to(torch.int32)  # [T, P]
    # q: the route's place among its token's routes to the same rank (ascending j)
    earlier = torch.ones(topk, topk, dtype=torch.bool, device=device).tril(-1)  # [j, j'] j' < j
    q = ((dest[:, :, None] == dest[:, None, :]) & earlier).sum(-1)  # [T, topk]
    row = token_slot.gather(1, dest.clamp(max=world_size - 1))  # [T, topk]
    route_place = torch.where(good & (row >= 0), row * routes_per_row + q, -1).to(torch.int32)
    num_sent = world_size * capacity * routes_per_row
    send_expert = torch.full((num_sent + 1,), -1, dtype=torch.int32, device=device)  # the last: unsent routes
    target = torch.where(route_place >= 0, route_place.long(), num_sent).view(-1)
    send_expert.scatter_(0, target, (ids % num_local_experts).to(torch.int32).view(-1))
    return token_slot.reshape(-1).contiguous(), route_place.view(-1), send_expert[:num_sent]


def token_receiver_schedule(
    recv_ids: torch.Tensor,  # [P, C·k_l + 1] int32: each source's expert ids, then its error flag
    error_flag: torch.Tensor,  # [1] int32
    num_local_experts: int,
    routes_per_row: int,  # k_l
    block_m: int,
    rank: int,
) -> tuple[RoutingSchedule, torch.Tensor]:
    """(the schedule of the P·C received rows as tokens with topk = k_l, received_routes
    [P·C·k_l] int32: each received route's own index, −1 for an empty one); ORs the sources'
    flags into `error_flag`. `rank`: the receiver's, whose own rows lead each expert."""
    num_ranks = recv_ids.shape[0]
    capacity = (recv_ids.shape[1] - 1) // routes_per_row
    num_rows = num_ranks * capacity
    error_flag.bitwise_or_(_or_flags(recv_ids[:, -1]))
    ids = recv_ids[:, :-1].reshape(num_rows, routes_per_row)
    own_first = rank * capacity  # ordered row i is received row (i + own_first) mod P·C
    ordered = ops.routing_schedule(torch.roll(ids, -own_first, dims=0), error_flag, num_local_experts, block_m, True)
    received = (ordered.row_source + own_first * routes_per_row) % (num_rows * routes_per_row)
    row_source = torch.where(ordered.row_source >= 0, received, ordered.row_source)
    route_row = torch.roll(ordered.route_row, own_first * routes_per_row)
    flat = ids.reshape(-1)
    received_routes = torch.where(flat >= 0, torch.arange(flat.shape[0], device=flat.device, dtype=torch.int32), -1)
    return dataclasses.replace(ordered, row_source=row_source, route_row=route_row), received_routes


def own_tiles_split(schedule: RoutingSchedule, rank: int, routes_per_source: int
                    ) -> tuple[RoutingSchedule, RoutingSchedule]:
    """(own, others): `schedule` (a `token_receiver_schedule`'s) with the other set's M tiles
    taken out (tile_expert −1): own's tiles hold only routes of this rank's own tokens
    (received routes [rank·C·k_l, (rank + 1)·C·k_l), `routes_per_source` = C·k_l), others'
    every other tile. own's row_source also leaves out others' rows, so that nothing it runs
    reads a row that has not arrived. Every row below num_rows is in exactly one of them."""
    rows = schedule.row_source
    from_peer = (rows >= 0) & (rows // routes_per_source != rank)
    peer_tile = from_peer.view(-1, schedule.block_m).any(1)  # [max_tiles]
    peer_row = peer_tile[:, None].expand(-1, schedule.block_m).reshape(-1)  # [capacity_rows]
    own = dataclasses.replace(schedule, tile_expert=torch.where(peer_tile, -1, schedule.tile_expert),
                              row_source=torch.where(peer_row, -1, rows))
    others = dataclasses.replace(schedule, tile_expert=torch.where(peer_tile, schedule.tile_expert, -1))
    return own, others


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream exchanges run on beside the GEMMs of `device` (None off CUDA: no streams)."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return _SIDE_STREAMS[index]


@contextlib.contextmanager
def sending(device: torch.device) -> Iterator[None]:
    """Runs the block on the side stream, after everything queued on the current stream so far
    (what it sends must stay alive until the exchange's finish: the caller holds it)."""
    side = side_stream(device)
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield


def exchange_beside(start: Callable[[int | None], Callable[[], Any]], work: Callable[[], Any], device: torch.device,
                    overlap_sms: int) -> tuple[Any, Any]:
    """(what the exchange `start(num_programs)` delivers (a dispatch's `start_*`), work()). With
    `overlap_sms` > 0 the exchange runs from that many programs while `work` is queued beside it,
    persistent launches leaving it those SMs; with 0 it finishes first, from the config's programs."""
    if overlap_sms == 0:
        return finish_now(start(None), device), work()
    finish = start(overlap_sms)
    with sms_left_free(device, overlap_sms):
        result = work()
    return finish_now(finish, device), result


def finish_now(finish: Callable[[], Any], device: torch.device) -> Any:
    """The exchange whose `finish` this is, landed for the current stream: its result."""
    side = side_stream(device)
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)
    return finish()

