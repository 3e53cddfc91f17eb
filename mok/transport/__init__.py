"""Transports: how the triton backend moves rows between expert-parallel ranks.

A transport is created once per workspace (`create_transport`, a collective over the
group). For each layer call its `plan(topk_ids, ...)` (called by `build_schedule`)
returns the call's dispatch and the schedule of the rows this rank's experts receive;
the dispatch then moves each token row once to each rank holding one of its experts
(`common.py`'s plan) and the partial results back:

    expert_x, expert_weights = dispatch.dispatch(x, topk_weights)   # token rows and their routes' weights
    parts             = dispatch.combine(part_rows)                 # Σ_{j local} w·y per (token, rank), back
    expert_d_out      = dispatch.dispatch_grad(d_out)
    dx_parts, d_topk_weights = dispatch.combine_grad(dx_rows, d_weight_rows)

The experts see every received row as a token with topk = k_l = min(topk, E_l), so the same
kernels run with and without expert parallelism; the source sums the partial rows of its
tokens through `dispatch.token_slot`.

"symmetric" (`SymmetricTransport`): peer stores into symmetric memory (NVLink) from
Triton kernels, device-side arrival counters, only the rows that exist travel; one host.
"nccl" (`NcclTransport`): `torch.distributed.all_to_all_single` with equal splits, on
any process group (NCCL on GPUs, gloo on CPU; across hosts). "auto" picks symmetric
where every rank's GPU can reach every peer's memory, else nccl.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mok.config import MoKConfig
from mok.transport.common import check_same_across_ranks
from mok.transport.nccl import NcclDispatch, NcclTransport
from mok.transport.symmetric import SymmetricDispatch, SymmetricTransport, symmetric_memory_unsupported

__all__ = ["Dispatch", "Transport", "NcclDispatch", "NcclTransport", "SymmetricDispatch", "SymmetricTransport",
           "check_same_across_ranks", "create_transport"]

Transport = NcclTransport | SymmetricTransport
Dispatch = NcclDispatch | SymmetricDispatch


def create_transport(
    config: MoKConfig,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
    error_flag: torch.Tensor,
) -> Transport:
    """The transport `config.transport` names ("auto": symmetric where it can run), for
    this group (a collective: every rank of `group` must call it). `error_flag` is the
    workspace's."""
    name = config.transport
    if name in ("auto", "symmetric"):
        reason = symmetric_memory_unsupported(group, device)
        if reason is None:
            return SymmetricTransport(config, group, device=device, num_local_tokens=num_local_tokens, topk=topk,
                                      hidden_size=hidden_size, error_flag=error_flag)
        if name == "symmetric":
            raise ValueError(f"config.transport: 'symmetric' cannot run on this group: {reason}; use 'nccl' or 'auto'")
    return NcclTransport(config, group, device=device, num_local_tokens=num_local_tokens, topk=topk)
