"""The symmetric-memory transport: expert parallelism over NVLink, rows moved by peer
stores from Triton kernels (`mok/kernels/comm/push.py`), no collective library on the path.
Each token row goes once to each rank holding ≥ 1 of its experts (the plan of `common.py`).

Each rank allocates one buffer with `torch.distributed._symmetric_memory` (the same
layout on every rank, so a region's address on rank p is p's base + the same offset):

    region          shape                written by                         read by
    recv_info       [P, L] int32         source p, row p: C·k_l expert ids, plan
                                         its error flag
    recv_x          [P·C, H] bf16        source p, rows p·C + c             gate/up GEMM, backward
    recv_weights    [P·C·k_l] fp32       source p, beside its x rows        the expert-side sum (a copy)
    y_parts         [P·C, H] bf16        expert rank p, row p·C + c         the source's sum over ranks
    recv_d_out      [P·C, H] bf16        source p, rows p·C + c             backward
    dx_parts        [P·C, H] bf16        expert rank p, row p·C + c         the source's d_x sum
    d_weight_slots  [P·C·k_l] fp32       expert rank p, per route           d_topk_weights (a copy)
    arrivals        [9, P] int32         every rank, one counter per (kind, source)

(C the token capacity of `common.py`, k_l = min(topk, E_l) ≤ topk, L = C·topk + 1 rounded
up to a multiple of _INFO_CHUNK.) In fp8_block, x and dOut rows travel quantized (1×128
blocks along H): H e4m3 bytes at recv_x_q and H/128 fp32 scales at recv_x_scale, both inside
recv_x's bytes (2·H bytes a row hold H + H/32), likewise for recv_d_out. Source rows land at
my_rank·C + c on the expert's rank (BY_SLOT of `push_rows`, the pair's send row p·C + c
as the slot) and the partial rows come back to row p·C + c of the source, the same place, so
nothing is unpacked. One layer call on each rank:

    plan       token_plan → push row p of [ids | flag] to rank p → wait → the receiver's
               schedule (`common.py`)
    forward    push x rows and the routes' router weights → wait → (caller: gate/up +
               SwiGLU, down, the sum of each row's routes) → push the partial rows → wait;
               with overlap, the x rows to this rank itself first, on the caller's stream,
               then the caller's gate/up tiles of them beside the peers' pushes; and the
               partial rows to the peers first, beside the caller's down tiles of its own
               rows, whose partial rows then go to itself
    backward   push dOut rows → wait → (caller: dgrad, wgrad, the sum of each row's dx) →
               push the dx rows and the router-weight gradients → wait

Only rows that exist travel (no padding to capacity as with equal-split collectives).
Pairs past the capacity set ERROR_CAPACITY_OVERFLOW (every rank learns it through the plan);
they move nothing and their routes contribute zeros.

Safe to overwrite (the third sync pattern of `mok/kernels/comm/push.py`) follows from the order
of the calls, checked for every region: a rank pushes into a peer's region only after a wait that
needs a push the peer made after its last read of that region. E.g. rank a's next push
into b's recv_x follows a's wait for b's partial y rows, which b pushed after its gate/up
GEMM read recv_x (and, with a backward, a's wait for b's dx rows, pushed after b's backward
read recv_x). a's next push into b's y_parts follows a's wait for b's next plan, which b
pushed after summing y_parts. Every rank runs the same sequence of calls.

The received x rows stay in recv_x for the backward's weight gradient. The next
dispatch through this transport overwrites them; `received_x` notices (a host-side
count, no sync) and sends them again, so a model whose layers share a workspace stays
correct and pays one more x exchange per layer in the backward; give each layer its own
workspace to avoid it. The received router weights and d_topk_weights are copied out of
their regions (the first is read in the backward, the second leaves the layer); every other
region is consumed before the call returns.

Waits are bounded by `MoKConfig.peer_timeout_s`: a rank that never arrives becomes
ERROR_PEER_TIMEOUT, raised by `check_errors`; the workspace is unusable afterwards
(`clear_workspace_cache()`). Determinism: every element is written by one program of
one rank at a fixed place; the counters are the only atomics.
"""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mok import ops
from mok.config import MoKConfig
from mok.kernels.comm.push import push_rows, wait_arrivals
from mok.kernels.routing.schedule import RoutingSchedule
from mok.transport.common import (RouteCapacity, TokenPairs, check_same_across_ranks, finish_now, sending, token_plan,
                                  token_receiver_schedule)

# One push per kind and call; the receiver counts each kind's arrivals apart.
_KINDS = ("plan", "x", "x_scale", "weights", "y", "d_out", "d_out_scale", "dx", "d_weight")
# Int32 words per pushed row of the plan's [P, L] block: the block travels as L / 1024
# rows per peer, so the push spreads it over programs like any other rows.
_INFO_CHUNK = 1024
_ALIGN_BYTES = 256


def symmetric_memory_unsupported(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """Why this group cannot use the transport (None if it can). A collective (all ranks
    exchange their host and device), so every rank reaches the same answer."""
    if device.type != "cuda":
        return f"it needs CUDA devices, got {device}"
    me = (socket.gethostname(), torch.device(device).index if device.index is not None else torch.cuda.current_device())
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, me, group=group)
    if len({host for host, _ in everyone}) > 1:
        return "the ranks are on more than one host (no NVLink between them)"
    reason = None
    if any(index != me[1] and not torch.cuda.can_device_access_peer(me[1], index) for _, index in everyone):
        reason = f"device {me[1]} cannot access every peer's memory"
    reasons: list = [None] * len(everyone)
    dist.all_gather_object(reasons, reason, group=group)
    return next((r for r in reasons if r is not None), None)


class SymmetricTransport(RouteCapacity):
    """Expert parallelism over `group` through symmetric memory (module docstring).
    Creating one is a collective (allocation, rendezvous, a barrier), once per workspace."""

    def __init__(
        self, config: MoKConfig, group: dist.ProcessGroup | None, *, device: torch.device, num_local_tokens: int,
        topk: int, hidden_size: int, error_flag: torch.Tensor,
    ):
        super().__init__(config, group, device=device, num_local_tokens=num_local_tokens, topk=topk)
        import torch.distributed._symmetric_memory as symm_mem

        self.config = config
        self.device = device
        self.error_flag = error_flag  # the workspace's: waits past the timeout set a bit in it
        self.num_programs = {kind: config.fwd_num_comm_sms for kind in ("plan", "x", "x_scale", "weights", "y")}
        self.num_programs.update({kind: config.bwd_num_comm_sms for kind in ("d_out", "d_out_scale", "dx", "d_weight")})
        # the receivers count the senders' programs: every rank must launch alike
        check_same_across_ranks(group, {"config.fwd_num_comm_sms": config.fwd_num_comm_sms,
                                        "config.bwd_num_comm_sms": config.bwd_num_comm_sms,
                                        "config.overlap_comm_sms": config.overlap_comm_sms,
                                        "config.overlap_dispatch_sms": config.overlap_dispatch_sms,
                                        "config.overlap_return_sms": config.overlap_return_sms}, device)
        num_ranks, capacity = self.world_size, self.token_capacity()
        rows, routes = num_ranks * capacity, num_ranks * capacity * topk  # k_l <= topk: the most routes
        self.regions = {  # name -> (shape, dtype)
            "recv_info": ((num_ranks * self._info_width(capacity * topk) // _INFO_CHUNK, _INFO_CHUNK), torch.int32),
            "recv_x": ((rows, hidden_size), torch.bfloat16),
            "recv_weights": ((routes,), torch.float32),
            "y_parts": ((rows, hidden_size), torch.bfloat16),
            "recv_d_out": ((rows, hidden_size), torch.bfloat16),
            "dx_parts": ((rows, hidden_size), torch.bfloat16),
            "d_weight_slots": ((routes,), torch.float32),
            "arrivals": ((len(_KINDS), num_ranks), torch.int32),
        }
        offsets, total = {}, 0
        for name, (shape, dtype) in self.regions.items():
            offsets[name] = total
            nbytes = dtype.itemsize * torch.Size(shape).numel()
            total += -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        self.buffer = symm_mem.empty(total, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, group if group is not None else dist.group.WORLD)
        self.views, self.peer_ptrs = {}, {}
        for name, (shape, dtype) in self.regions.items():
            nbytes = dtype.itemsize * torch.Size(shape).numel()
            self.views[name] = self.buffer[offsets[name]: offsets[name] + nbytes].view(dtype).view(shape)
            self.peer_ptrs[name] = torch.tensor(
                [base + offsets[name] for base in handle.buffer_ptrs], dtype=torch.int64, device=device
            )
        self.shapes = {name: shape for name, (shape, _) in self.regions.items()}
        if hidden_size % 128 == 0:
            for name in ("recv_x", "recv_d_out"):
                self._add_fp8_views(name, rows, hidden_size)
        self.expected = torch.zeros(len(_KINDS), num_ranks, dtype=torch.int32, device=device)  # arrivals consumed
        self.views["arrivals"].zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's counters are zero before anyone signals
        self.x_generation = 0  # dispatches of x so far (received_x compares)
        self._info_index: dict[int, torch.Tensor] = {}

    def _add_fp8_views(self, name: str, rows: int, hidden_size: int) -> None:
        """`name`_q [rows, H] e4m3 (as bytes) and `name`_scale [rows, H/128] fp32 over the bytes of
        the bf16 region `name` (2·H bytes a row hold H + H/32): where fp8_block rows travel."""
        raw = self.views[name].view(-1).view(torch.uint8)
        scale_offset = rows * hidden_size  # a multiple of 128 bytes: aligned as the pushes assume
        parts = {"_q": (0, (rows, hidden_size), torch.uint8),
                 "_scale": (scale_offset, (rows, hidden_size // 128), torch.float32)}
        for suffix, (offset, shape, dtype) in parts.items():
            nbytes = dtype.itemsize * torch.Size(shape).numel()
            self.views[name + suffix] = raw[offset: offset + nbytes].view(dtype).view(shape)
            self.peer_ptrs[name + suffix] = self.peer_ptrs[name] + offset
            self.shapes[name + suffix] = shape

    @staticmethod
    def _info_width(num_ids: int) -> int:
        """L: words of one source's plan row (its ids and its error flag), whole chunks."""
        return -(-(num_ids + 1) // _INFO_CHUNK) * _INFO_CHUNK

    def push(self, kind: str, src: torch.Tensor, index: torch.Tensor, region: str, num_programs: int | None = None,
             **kwargs) -> None:
        """Pushes rows of `src` into `region`'s rows on the ranks `index` says (`push_rows`)
        from `num_programs` programs (None: the config's for `kind`; every rank pushes a kind
        alike, and its `wait` names the same count)."""
        shape = self.shapes[region]
        row_width = shape[1] if len(shape) == 2 else 1
        push_rows(src, index, self.peer_ptrs[region], row_width, self.peer_ptrs["arrivals"], _KINDS.index(kind),
                  self.error_flag, num_dst_rows=shape[0], my_rank=self.rank,
                  num_programs=num_programs or self.num_programs[kind], **kwargs)

    def wait(self, kind: str, num_programs: int | None = None) -> None:
        """Peers' pushes of `kind` (from `num_programs` programs each, as `push`) visible here
        (bounded; `wait_arrivals`): every program of each peer's push has signalled."""
        wait_arrivals(self.views["arrivals"], self.expected, self.error_flag, _KINDS.index(kind),
                      num_programs or self.num_programs[kind], self.config.peer_timeout_s)

    def plan(
        self, topk_ids: torch.Tensor, num_local_experts: int, error_flag: torch.Tensor, block_m: int,
        fp8_wire: bool = False,
    ) -> tuple[SymmetricDispatch, RoutingSchedule]:
        """This call's dispatch (`fp8_wire`: x and dOut travel in fp8_block), and the schedule
        of the P·C rows this rank's experts receive, as tokens with topk = k_l. Every rank must call it."""
        if fp8_wire and "recv_x_q" not in self.views:
            raise ValueError(f"fp8_wire: expected a hidden size that is a multiple of 128, got {self.regions['recv_x'][0][1]}")
        num_ranks, capacity = self.world_size, self.token_capacity()
        routes_per_row = min(topk_ids.shape[1], num_local_experts)
        token_slot, route_place, send_expert = token_plan(topk_ids, num_local_experts, num_ranks, capacity,
                                                          error_flag)
        num_ids = capacity * routes_per_row
        width = self._info_width(num_ids)
        # [P, L]: C·k_l ids | this rank's error flag (so every rank learns all routing errors) | unused
        send_info = torch.cat([
            send_expert.view(num_ranks, num_ids), error_flag.expand(num_ranks, 1),
            send_expert.new_zeros(num_ranks, width - num_ids - 1),
        ], dim=1)
        chunks = width // _INFO_CHUNK
        self.push("plan", send_info.view(num_ranks * chunks, _INFO_CHUNK), self._plan_index(chunks), "recv_info",
                  by_slot=False, capacity=chunks)
        self.wait("plan")
        recv_info = self.views["recv_info"].view(-1)[: num_ranks * width].view(num_ranks, width)
        schedule, received_routes = token_receiver_schedule(
            recv_info[:, : num_ids + 1], error_flag, num_local_experts, routes_per_row, block_m, self.rank
        )
        dispatch = SymmetricDispatch(self, capacity, topk_ids.shape[1], routes_per_row, token_slot, route_place,
                                     received_routes, fp8_wire)
        return dispatch, schedule

    def _plan_index(self, chunks: int) -> torch.Tensor:
        """[P·chunks] int32: chunk i of the block for rank i // chunks lands in that rank's
        row my_rank·chunks + i % chunks of recv_info (seen as rows of _INFO_CHUNK words)."""
        index = self._info_index.get(chunks)
        if index is None:
            index = torch.arange(self.world_size * chunks, device=self.device) % chunks + self.rank * chunks
            index = self._info_index[chunks] = index.to(torch.int32)
        return index


class SymmetricDispatch(TokenPairs):
    """The (token, rank) pairs of one layer call and the row moves along them (module docstring)."""

    def __init__(self, transport: SymmetricTransport, capacity: int, topk: int, routes_per_row: int,
                 token_slot: torch.Tensor, route_place: torch.Tensor, received_routes: torch.Tensor,
                 fp8_wire: bool = False):
        self.transport = transport
        self.world_size = transport.world_size  # P
        self.rank = transport.rank
        self.send_capacity = capacity  # C
        self.topk = topk
        self.routes_per_row = routes_per_row  # k_l
        self.token_slot = token_slot  # [T·P] int32: send row p·C + c of pair (t, p) at t·P + p, −1: none
        self.route_place = route_place  # [T·topk] int32: each route's sent route (p·C + c)·k_l + q, −1: not sent
        self.received_routes = received_routes  # [P·C·k_l] int32: each received route's index, −1: empty
        self.fp8_wire = fp8_wire  # fp8_block: x (and dOut, where the dgrad reads it per token) travel in e4m3 + scales
        rank = transport.rank
        rows = torch.arange(self.num_expert_rows, device=token_slot.device, dtype=torch.int32)  # [P·C]
        received_rows = (received_routes.view(-1, routes_per_row) >= 0).any(1)
        # [P·C], [P·C·k_l]: where each received row's partial row, and each received route's router-weight gradient,
        # land on its source's rank (the source's own send row / route), −1: empty
        self.return_row = torch.where(received_rows, rank * capacity + rows % capacity, -1).to(torch.int32)
        num_routes = capacity * routes_per_row
        routes = torch.arange(received_routes.shape[0], device=token_slot.device, dtype=torch.int32)
        self.return_route = torch.where(received_routes >= 0, rank * num_routes + routes % num_routes, -1).to(torch.int32)
        self._x_generation = None

    def peer_bytes(self, hidden_size: int, with_backward: bool) -> int:
        """Bytes this rank pushes to its peers in one forward (and backward): the plan's block,
        then H-wide bf16 rows: x and dOut once per (own token, other rank), y and dx parts once
        per row received from another rank; fp32 router weights per own route sent away, their
        gradients per route received from another rank. Counts on the device: a host sync, for
        reports only."""
        transport, rank = self.transport, self.transport.rank
        num_routes = self.send_capacity * self.routes_per_row
        out_rows = self.peer_rows()
        in_rows = int(((self.return_row >= 0) & (self._row_sources() != rank)).sum())
        out_routes = int(((self.route_place >= 0) & (self.route_place // num_routes != rank)).sum())
        received = self.received_routes >= 0
        in_routes = int((received & (torch.arange(received.shape[0], device=received.device) // num_routes != rank)).sum())
        int32, bf16, fp32 = 4, 2, 4
        x_row, d_out_row = self.dispatched_row_bytes(hidden_size)
        plan = (self.world_size - 1) * transport._info_width(num_routes) * int32
        forward = plan + out_rows * x_row + in_rows * hidden_size * bf16 + out_routes * fp32
        backward = out_rows * d_out_row + in_rows * hidden_size * bf16 + in_routes * fp32
        return forward + (backward if with_backward else 0)

    def _row_sources(self) -> torch.Tensor:
        """[P·C]: the source rank of each received row."""
        rows = torch.arange(self.num_expert_rows, device=self.token_slot.device)
        return rows // self.send_capacity

    def _start_send_rows(self, kind: str, rows: torch.Tensor, region: str, quantized: bool,
                         num_programs: int | None = None, own_first: bool = False) -> Callable[[], Any]:
        """[T, H] token rows on their way (pushed from the side stream); the finish gives the rows
        [P·C, H] of the pairs received here (`_region_rows`); `quantized`: in fp8_block's 1×128
        blocks, as the pair of e4m3 rows and their [P·C, H/128] scales. `own_first`: the rows this
        rank sends itself are pushed on the current stream first, so they are here once it reaches
        its next launch; only the other ranks' go from the side stream."""
        transport = self.transport
        sends = {kind: (rows, region)}
        if quantized:
            q, scale = ops.quantize_fp8_block_activations(rows)
            sends = {kind: (q.view(torch.uint8), region + "_q"), kind + "_scale": (scale, region + "_scale")}

        def push(destinations: str) -> None:
            for name, (src, dst) in sends.items():
                transport.push(name, src, self.token_slot, dst, num_programs, by_slot=True,
                               capacity=self.send_capacity, routes_per_row=self.world_size, destinations=destinations)

        if own_first:
            push("self")
        with sending(rows.device):
            push("peers" if own_first else "all")
        return functools.partial(self._received_rows, sends, region, quantized, num_programs)

    def _received_rows(self, sends: dict, region: str, quantized: bool, num_programs: int | None):
        """What `_start_send_rows` delivers, once its pushes (`sends`, alive until now) arrived."""
        for name in sends:
            self.transport.wait(name, num_programs)
        return self._region_rows(region, quantized)

    def _region_rows(self, region: str, quantized: bool):
        """The P·C received rows of `region`: bf16 [P·C, H], or (`quantized`) the e4m3 rows and
        their [P·C, H/128] fp32 scales (views of its bytes)."""
        views, num_rows = self.transport.views, self.num_expert_rows
        if quantized:
            return views[region + "_q"][:num_rows].view(torch.float8_e4m3fn), views[region + "_scale"][:num_rows]
        return views[region][:num_rows]

    def _start_push_x(self, x: torch.Tensor, num_programs: int | None = None, own_first: bool = False
                      ) -> Callable[[], Any]:
        finish = self._start_send_rows("x", x, "recv_x", self.fp8_wire, num_programs, own_first)
        self.transport.x_generation += 1
        self._x_generation = self.transport.x_generation
        return finish

    def start_dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, num_programs: int | None = None
                       ) -> Callable[[], Any]:
        """[T, H] token rows and [T, topk] router weights on their way (pushed by `num_programs`
        programs, None: the config's); the finish gives the
        received rows [P·C, H] (a view of the transport's recv_x; rows no source filled hold
        stale values, and the schedule skips them; with `fp8_wire` the pair of e4m3 rows and
        scales, quantized before they travel) and their routes' weights [P·C, k_l] fp32 (a copy;
        0 for empty routes)."""
        return self._start_dispatch(x, topk_weights, num_programs, own_first=False)

    def start_dispatch_split(self, x: torch.Tensor, topk_weights: torch.Tensor, num_programs: int | None = None
                             ) -> tuple[Any, Callable[[], Any]]:
        """`start_dispatch` with what is here at once: (the received rows' view, whose own rows, p =
        this rank, are in place for the current stream's next launch; the finish)."""
        return self._region_rows("recv_x", self.fp8_wire), self._start_dispatch(x, topk_weights, num_programs,
                                                                                 own_first=True)

    def _start_dispatch(self, x, topk_weights, num_programs, own_first):
        num_routes = self.send_capacity * self.routes_per_row
        weights = topk_weights.reshape(-1, 1).float()
        with sending(x.device):
            self.transport.push("weights", weights, self.route_place, "recv_weights", num_programs, by_slot=True,
                                capacity=num_routes)
        rows = self._start_push_x(x, num_programs, own_first)
        return functools.partial(self._dispatched, rows, weights, num_programs)

    def _dispatched(self, rows: Callable[[], Any], sent_weights: torch.Tensor, num_programs: int | None):
        expert_x = rows()
        self.transport.wait("weights", num_programs)
        num_routes = self.send_capacity * self.routes_per_row
        weights = self.transport.views["recv_weights"][: self.world_size * num_routes]
        weights = torch.where(self.received_routes >= 0, weights, 0.0)  # stale values where no route came
        return expert_x, weights.view(-1, self.routes_per_row)

    def received_x(self, expert_x: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The received token rows for the backward: `expert_x` if no later dispatch has
        overwritten them, else sent again (every rank decides alike: same call sequence)."""
        if self._x_generation != self.transport.x_generation:
            return finish_now(self._start_push_x(x), x.device)
        return expert_x

    def start_combine(self, part_rows: torch.Tensor, num_programs: int | None = None) -> Callable[[], torch.Tensor]:
        """[P·C, H] partial rows of the received rows on their way back; the finish gives
        [P·C, H] this rank's tokens' partial rows from each rank, pair (t, p) at row
        token_slot[t·P + p] (a view of y_parts)."""
        return self._start_return_rows("y", part_rows, "y_parts", num_programs)

    def start_combine_split(self, part_rows: torch.Tensor, num_programs: int | None = None
                            ) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """`start_combine` while this rank's own rows are still being written: part_rows' other
        blocks (written) go now, from the side stream; (where the own rows go, [C, H], a view of
        part_rows; the finish, which pushes them to this rank itself on the current stream, then
        gives `start_combine`'s rows)."""
        self._start_return_rows("y", part_rows, "y_parts", num_programs, destinations="peers")

        def finish() -> torch.Tensor:
            return self._start_return_rows("y", part_rows, "y_parts", num_programs, destinations="self",
                                           beside=False)()

        return part_rows[self.own_rows()], finish

    def _start_return_rows(self, kind: str, rows: torch.Tensor, region: str, num_programs: int | None,
                           destinations: str = "all", beside: bool = True) -> Callable[[], torch.Tensor]:
        """`rows` [P·C, W] pushed back to their sources (`destinations`, `push_rows`), from the side
        stream (`beside`) or the current one; the finish waits for every rank's and gives `region`'s rows."""
        with sending(rows.device) if beside else contextlib.nullcontext():
            self.transport.push(kind, rows, self.return_row, region, num_programs, by_slot=False,
                                capacity=self.send_capacity, destinations=destinations)
        return functools.partial(self._returned_rows, kind, rows, region, num_programs)

    def _returned_rows(self, kind: str, sent: torch.Tensor, region: str, num_programs: int | None) -> torch.Tensor:
        self.transport.wait(kind, num_programs)
        return self.transport.views[region][: self.num_expert_rows]

    def start_dispatch_grad(self, d_out: torch.Tensor, num_programs: int | None = None) -> Callable[[], Any]:
        """dOut rows on their way; the finish gives those [P·C, H] of the received rows (a view
        of recv_d_out; where `d_out_on_fp8_wire`, the pair of e4m3 rows and scales)."""
        return self._start_send_rows("d_out", d_out, "recv_d_out", self.d_out_on_fp8_wire(d_out.shape[1]), num_programs)

    def start_combine_grad(self, dx_rows: torch.Tensor, d_weight_rows: torch.Tensor, num_programs: int | None = None
                           ) -> Callable[[], Any]:
        """dx partial rows [P·C, H] and the [P·C, k_l] router-weight gradients on their way back;
        the finish gives the dx partial rows (as `start_combine`'s, a view of dx_parts) and
        d_topk_weights [T, topk] fp32 (a copy: it leaves the layer)."""
        num_routes = self.send_capacity * self.routes_per_row
        d_weights = d_weight_rows.reshape(-1, 1)
        with sending(dx_rows.device):
            self.transport.push("d_weight", d_weights, self.return_route, "d_weight_slots", num_programs,
                                by_slot=False, capacity=num_routes)
        dx = self._start_return_rows("dx", dx_rows, "dx_parts", num_programs)
        return functools.partial(self._combined_grad, dx, d_weights, num_programs)

    def _combined_grad(self, dx: Callable[[], torch.Tensor], sent_d_weights: torch.Tensor, num_programs: int | None):
        dx_parts = dx()
        self.transport.wait("d_weight", num_programs)
        num_routes = self.send_capacity * self.routes_per_row
        d_weights = self.transport.views["d_weight_slots"][: self.world_size * num_routes].view(-1, 1)
        return dx_parts, ops.unpack_rows(d_weights, self.route_place).view(-1, self.topk)
