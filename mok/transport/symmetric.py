"""The symmetric-memory transport: expert parallelism over NVLink, rows moved by peer
stores from Triton kernels (`mok/kernels/comm.py`), no collective library on the path.

Each rank allocates one buffer with `torch.distributed._symmetric_memory` (the same
layout on every rank, so a region's address on rank p is p's base + the same offset):

    region          shape                written by                        read by
    recv_info       [P, L] int32         source p, row p: C expert ids,    plan
                                         its error flag, C routes t·topk+j
    recv_x          [P·C, H] bf16        source p, rows p·C + c            gate/up GEMM, backward gather
    y_slots         [R, H] bf16          the experts' ranks, row t·topk+j  combine epilogue
    recv_d_out      [P·C, H] bf16        source p, rows p·C + c            backward gather
    recv_weights    [P·C] fp32           source p, beside its dOut rows    down dgrad
    dx_slots        [R, H] bf16          the experts' ranks, row t·topk+j  d_x epilogue
    d_weight_slots  [R] fp32             the experts' ranks, per route     d_topk_weights
    arrivals        [6, P] int32         every rank, one counter per (kind, source)

(C the largest send capacity of `common.py`, R = T_max·topk, L = 2C + 2 rounded up to a
multiple of _INFO_CHUNK.) One layer call on each rank:

    plan       route_slots → push row p of [ids | flag | routes] to rank p → wait →
               the receiver's schedule (`common.py`) and each received row's route
    forward    push x rows to the experts' ranks (BY_SLOT) → wait → (caller: gate/up +
               SwiGLU, then the down GEMM, whose epilogue stores y rows straight into
               the sources' slots t·topk + j on their ranks: `peer_rows`) → wait
    backward   push dOut rows and router weights → wait → (caller: dgrad, wgrad; the
               gate/up dgrad's epilogue stores dx rows into the sources' slots) → push
               the router-weight gradients → wait
    (`combine` / `combine_grad` push rows computed into the received order instead.)

Only rows that exist travel (no padding to capacity as with equal-split collectives),
and the returning rows land in their slots, so nothing is unpacked. Routes past the
capacity set ERROR_CAPACITY_OVERFLOW (every rank learns it through the plan); they move
nothing and their slots are zeroed by the dispatch that would have sent them.

Safe to overwrite (the third sync pattern of `kernels/comm.py`) follows from the order of the calls,
checked for every region: a rank pushes into a peer's region only after a wait that
needs a push the peer made after its last read of that region. E.g. rank a's next push
into b's recv_x follows a's wait for b's y rows, which b pushed after its gate/up GEMM
read recv_x (and, with a backward, a's wait for b's dx rows, pushed after b's backward
gather). Every rank runs the same sequence of calls.

The received x rows stay in recv_x for the backward's weight gradient. The next
dispatch through this transport overwrites them; `received_x` notices (a host-side
count, no sync) and sends them again, so a model whose layers share a workspace stays
correct and pays one more x exchange per layer in the backward; give each layer its own
workspace to avoid it. d_topk_weights is copied out of d_weight_slots (it leaves the
layer); every other region is consumed before the call returns.

Waits are bounded by `MoKConfig.peer_timeout_s`: a rank that never arrives becomes
ERROR_PEER_TIMEOUT, raised by `check_errors`; the workspace is unusable afterwards
(`clear_workspace_cache()`). Determinism: every element is written by one program of
one rank at a fixed place; the counters are the only atomics.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from mok import ops
from mok.config import MoKConfig
from mok.kernels import comm
from mok.transport.common import RouteCapacity, check_same_across_ranks, receiver_schedule

# One push (or one GEMM launch storing on the peers) per kind and call; the receiver
# counts each kind's arrivals apart.
_KINDS = ("plan", "x", "y", "d_out", "dx", "d_weight")
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
        self.num_programs = {"plan": config.fwd_num_comm_sms, "x": config.fwd_num_comm_sms, "y": config.fwd_num_comm_sms,
                             "d_out": config.bwd_num_comm_sms, "dx": config.bwd_num_comm_sms,
                             "d_weight": config.bwd_num_comm_sms}
        # the receivers count the senders' programs: every rank must launch alike
        check_same_across_ranks(group, {"config.fwd_num_comm_sms": config.fwd_num_comm_sms,
                                        "config.bwd_num_comm_sms": config.bwd_num_comm_sms}, device)
        num_ranks, max_capacity = self.world_size, self.send_capacity(topk)  # E_l >= topk: the largest C
        num_slots = self.max_local_tokens * topk
        self.regions = {  # name -> (shape, dtype)
            "recv_info": ((num_ranks * self._info_width(max_capacity) // _INFO_CHUNK, _INFO_CHUNK), torch.int32),
            "recv_x": ((num_ranks * max_capacity, hidden_size), torch.bfloat16),
            "y_slots": ((num_slots, hidden_size), torch.bfloat16),
            "recv_d_out": ((num_ranks * max_capacity, hidden_size), torch.bfloat16),
            "recv_weights": ((num_ranks * max_capacity,), torch.float32),
            "dx_slots": ((num_slots, hidden_size), torch.bfloat16),
            "d_weight_slots": ((num_slots,), torch.float32),
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
        self.expected = torch.zeros(len(_KINDS), num_ranks, dtype=torch.int32, device=device)  # arrivals consumed
        self.views["arrivals"].zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's counters are zero before anyone signals
        self.x_generation = 0  # dispatches of x so far (received_x compares)
        self._info_index: dict[int, torch.Tensor] = {}

    @staticmethod
    def _info_width(capacity: int) -> int:
        return -(-(2 * capacity + 2) // _INFO_CHUNK) * _INFO_CHUNK

    def push(self, kind: str, src: torch.Tensor, index: torch.Tensor, region: str, **kwargs) -> None:
        """Pushes rows of `src` into `region`'s rows on the ranks `index` says (`comm.push_rows`)."""
        shape = self.regions[region][0]
        row_width = shape[1] if len(shape) == 2 else 1
        comm.push_rows(src, index, self.peer_ptrs[region], row_width, self.peer_ptrs["arrivals"], _KINDS.index(kind),
                       self.error_flag, num_dst_rows=shape[0], my_rank=self.rank, num_programs=self.num_programs[kind],
                       **kwargs)

    def wait(self, kind: str, programs_per_peer: int | None = None) -> None:
        """Peers' pushes of `kind` visible here (bounded; `comm.wait_arrivals`): each peer's
        `programs_per_peer` programs (default: its push's) have signalled."""
        programs = self.num_programs[kind] if programs_per_peer is None else programs_per_peer
        comm.wait_arrivals(self.views["arrivals"], self.expected, self.error_flag, _KINDS.index(kind), programs,
                           self.config.peer_timeout_s)

    def plan(
        self, topk_ids: torch.Tensor, num_local_experts: int, error_flag: torch.Tensor, block_m: int
    ) -> tuple[SymmetricDispatch, tuple[torch.Tensor, ...]]:
        """This call's dispatch, and the schedule (the tensors of `ops.routing_schedule`) of
        the P·C rows this rank's experts receive. Every rank must call it."""
        num_ranks, capacity = self.world_size, self.send_capacity(num_local_experts)
        route_slot, send_expert, send_route = ops.route_slots(
            topk_ids, error_flag, num_local_experts, num_ranks, capacity
        )
        width = self._info_width(capacity)
        # [P, L]: C ids | this rank's error flag (so every rank learns all routing errors) | C routes | unused
        send_info = torch.cat([
            send_expert.view(num_ranks, capacity), error_flag.expand(num_ranks, 1), send_route.view(num_ranks, capacity),
            send_route.new_zeros(num_ranks, width - 2 * capacity - 1),
        ], dim=1)
        chunks = width // _INFO_CHUNK
        self.push("plan", send_info.view(num_ranks * chunks, _INFO_CHUNK), self._plan_index(chunks), "recv_info",
                  by_slot=False, capacity=chunks)
        self.wait("plan")
        recv_info = self.views["recv_info"].view(-1)[: num_ranks * width].view(num_ranks, width)
        schedule = receiver_schedule(recv_info[:, : capacity + 1], error_flag, num_local_experts, block_m)
        return_route = recv_info[:, capacity + 1: 2 * capacity + 1].contiguous().view(-1)  # [P·C]: the source's route
        return SymmetricDispatch(self, capacity, topk_ids.shape[1], route_slot, return_route), schedule

    def _plan_index(self, chunks: int) -> torch.Tensor:
        """[P·chunks] int32: chunk i of the block for rank i // chunks lands in that rank's
        row my_rank·chunks + i % chunks of recv_info (seen as rows of _INFO_CHUNK words)."""
        index = self._info_index.get(chunks)
        if index is None:
            index = torch.arange(self.world_size * chunks, device=self.device) % chunks + self.rank * chunks
            index = self._info_index[chunks] = index.to(torch.int32)
        return index


class SymmetricDispatch:
    """The routes of one layer call and the row moves along them (module docstring)."""

    def __init__(self, transport: SymmetricTransport, capacity: int, topk: int, route_slot: torch.Tensor,
                 return_route: torch.Tensor):
        self.transport = transport
        self.world_size = transport.world_size  # P
        self.send_capacity = capacity  # C
        self.topk = topk
        self.route_slot = route_slot  # [T·topk] int32: row p·C + c of the route at its expert's rank, −1: not sent
        self.return_route = return_route  # [P·C] int32: the source's route of each received row, −1: empty
        self._x_generation = None

    @property
    def num_expert_rows(self) -> int:
        """P·C: rows of the received buffers."""
        return self.world_size * self.send_capacity

    def _slots(self, region: str) -> torch.Tensor:
        return self.transport.views[region][: self.route_slot.shape[0]]

    def peer_bytes(self, hidden_size: int, with_backward: bool) -> int:
        """Bytes this rank sends its peers in one forward (and backward): the plan's block,
        then two H-wide bf16 rows per route to another rank (x out, y back), and in the
        backward two more and an fp32 each way. Counts the routes on the device: a host
        sync, for reports only."""
        transport = self.transport
        dest = torch.div(self.route_slot, self.send_capacity, rounding_mode="floor")
        remote = int(((self.route_slot >= 0) & (dest != transport.rank)).sum())
        int32, bf16, fp32 = 4, 2, 4
        forward = (self.world_size - 1) * transport._info_width(self.send_capacity) * int32 + 2 * remote * hidden_size * bf16
        backward = 2 * remote * (hidden_size * bf16 + fp32)
        return forward + (backward if with_backward else 0)

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] token rows → [P·C, H]: the rows routed to this rank's experts (a view of
        the transport's recv_x; rows no source filled hold stale values, and the schedule
        skips them)."""
        transport = self.transport
        transport.push("x", x, self.route_slot, "recv_x", by_slot=True, capacity=self.send_capacity,
                       routes_per_row=self.topk, zero_rows=self._slots("y_slots"))
        transport.wait("x")
        transport.x_generation += 1
        self._x_generation = transport.x_generation
        return transport.views["recv_x"][: self.num_expert_rows]

    def received_x(self, expert_x: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The received token rows for the backward: `expert_x` if no later dispatch has
        overwritten them, else sent again (every rank decides alike: same call sequence)."""
        if self._x_generation != self.transport.x_generation:
            return self.dispatch(x)
        return expert_x

    def peer_rows(self, kind: str) -> comm.PeerRows:
        """Where the down GEMM ("y") or the gate/up dgrad ("dx") stores its rows itself: in
        the sources' slots on their ranks, so the rows cross NVLink while other tiles
        compute. Then `combined` / `combined_grad` instead of `combine` / `combine_grad`."""
        transport, region = self.transport, {"y": "y_slots", "dx": "dx_slots"}[kind]
        return comm.PeerRows(transport.peer_ptrs[region], self.return_route, self.send_capacity,
                             transport.peer_ptrs["arrivals"], _KINDS.index(kind) * self.world_size + transport.rank,
                             transport.views[region])

    def combined(self, num_programs: int) -> torch.Tensor:
        """y [T·topk, H] in route slots, once the peers' down GEMMs of `num_programs`
        programs each (`peer_rows("y")`) have landed; a view of the transport's y_slots."""
        self.transport.wait("y", num_programs)
        return self._slots("y_slots")

    def combined_grad(self, d_weight_rows: torch.Tensor, num_programs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As `combine_grad`, with the dx rows stored by the peers' gate/up dgrads of
        `num_programs` programs each (`peer_rows("dx")`); the router-weight gradients
        [P·C, 1] fp32 travel on their own."""
        transport = self.transport
        transport.push("d_weight", d_weight_rows.reshape(-1, 1), self.return_route, "d_weight_slots", by_slot=False,
                       capacity=self.send_capacity)
        transport.wait("dx", num_programs)
        transport.wait("d_weight")
        return self._slots("dx_slots"), self._slots("d_weight_slots").view(-1, self.topk).clone()

    def combine(self, y_rows: torch.Tensor) -> torch.Tensor:
        """[P·C, H] rows computed for the received rows → [T·topk, H] in route slots (zeros
        for routes not sent); a view of the transport's y_slots."""
        self.transport.push("y", y_rows, self.return_route, "y_slots", by_slot=False, capacity=self.send_capacity)
        self.transport.wait("y")
        return self._slots("y_slots")

    def dispatch_grad(self, d_out: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dOut rows [P·C, H] and router weights [P·C, 1] fp32 of the received routes."""
        transport = self.transport
        scalars = (topk_weights.reshape(-1), transport.peer_ptrs["recv_weights"], self._slots("d_weight_slots"))
        transport.push("d_out", d_out, self.route_slot, "recv_d_out", by_slot=True, capacity=self.send_capacity,
                       routes_per_row=self.topk, zero_rows=self._slots("dx_slots"), scalars=scalars)
        transport.wait("d_out")
        rows = self.num_expert_rows
        return transport.views["recv_d_out"][:rows], transport.views["recv_weights"][:rows].view(rows, 1)

    def combine_grad(self, dx_rows: torch.Tensor, d_weight_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dx_slots [T·topk, H] (a view of the transport's) and d_topk_weights [T, topk] fp32
        (a copy: it leaves the layer) from the experts' ranks."""
        transport = self.transport
        scalars = (d_weight_rows.reshape(-1), transport.peer_ptrs["d_weight_slots"], None)
        transport.push("dx", dx_rows, self.return_route, "dx_slots", by_slot=False, capacity=self.send_capacity,
                       scalars=scalars)
        transport.wait("dx")
        return self._slots("dx_slots"), self._slots("d_weight_slots").view(-1, self.topk).clone()
