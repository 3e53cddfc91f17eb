"""Transports: how the triton backend moves rows between expert-parallel ranks.

A transport is created once per workspace (`create_transport`, a collective over the
group). For each layer call its `plan(topk_ids, ...)` (called by `build_schedule`)
returns the call's dispatch and the schedule of the rows this rank's experts receive;
the dispatch then moves rows along the routes:

    expert_x          = dispatch.dispatch(x)                      # token rows to the experts' ranks
    y_slots           = dispatch.combine(y_rows)                  # expert outputs back, slot t·topk+j
    d_out_rows, w_rows = dispatch.dispatch_grad(d_out, topk_weights)
    dx_slots, d_topk_weights = dispatch.combine_grad(dx_rows, d_weight_rows)

The experts see every received row as a token with topk = 1, so the same kernels run
with and without expert parallelism.

"nccl" (`NcclTransport`): `torch.distributed.all_to_all_single` with equal splits, on
any process group (NCCL on GPUs, gloo on CPU). "auto" picks it for now; a transport on
symmetric memory (NVLink peer stores inside the kernels) will take the same place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mok.config import MoKConfig
from mok.transport.nccl import NcclDispatch, NcclTransport

__all__ = ["NcclDispatch", "NcclTransport", "create_transport"]


def create_transport(
    config: MoKConfig,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device,
    num_local_tokens: int,
    topk: int,
) -> NcclTransport:
    """The transport `config.transport` names, for this group (a collective: every rank of
    `group` must call it)."""
    return NcclTransport(config, group, device=device, num_local_tokens=num_local_tokens, topk=topk)
