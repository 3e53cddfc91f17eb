"""What both transports share: the send capacity C and the receiver's schedule.

Capacity: each rank may send each peer C = min(T_max·min(topk, E_l), ⌈R / P⌉) rows,
T_max the largest `num_local_tokens` of the ranks' workspaces (one C for all), R =
`MoKConfig.receive_capacity` (None: the exact worst case, which never overflows). A
token's expert ids are distinct, so at most min(topk, E_l) of its routes go to one rank.

Receiver's schedule: the rows from source p sit at p·C + c of the received buffers; the
schedule is built over the interleaved order c·P + p, so that inside each expert,
ascending order takes the sources round-robin, then mapped back to the
rows where the exchange put them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mok import ops
from mok.config import MoKConfig


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

    def send_capacity(self, num_local_experts: int) -> int:
        """C: rows one rank may send one peer."""
        worst_case = self.max_local_tokens * min(self.topk, num_local_experts)
        return min(worst_case, -(-self.receive_capacity // self.world_size))


def receiver_schedule(
    recv_ids: torch.Tensor,  # [P, C + 1] int32: each source's local expert ids, then its error flag
    error_flag: torch.Tensor,  # [1] int32
    num_local_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, ...]:
    """The schedule (the tensors of `ops.routing_schedule`) of the P·C received rows, each
    a token with topk = 1, its row maps over p·C + c; ORs the sources' flags into
    `error_flag`."""
    num_ranks, capacity = recv_ids.shape[0], recv_ids.shape[1] - 1
    expert_ids = ops.receive_expert_ids(recv_ids, error_flag)  # [C·P, 1], row c·P + p
    interleaved, *tables, interleaved_route_row = ops.routing_schedule(
        expert_ids, error_flag, num_local_experts, block_m, True
    )
    row_source = torch.where(interleaved >= 0, interleaved % num_ranks * capacity + interleaved // num_ranks, interleaved)
    route_row = interleaved_route_row.view(capacity, num_ranks).t().reshape(-1)  # [P·C], received row p·C + c
    return (row_source, *tables, route_row)
