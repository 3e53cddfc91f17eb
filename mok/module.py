"""`MoKMoE`: the whole MoE layer as an `nn.Module` that owns its expert weights."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from mok.config import PRECISIONS, MoKConfig
from mok.functional import check_errors, expert_counts, moe, pack_gate_up
from mok.kernels.gemm.gate_up import gate_up_packed
from mok.validation import check_alignment, flatten_tokens


class MoKMoE(nn.Module):
    """Routed SwiGLU experts (plus an optional shared expert) behind a router you supply.

    forward(x [..., H] bf16, topk_ids [..., topk], topk_weights [..., topk] fp32) -> [..., H] bf16

    Parameters follow `nn.Linear`'s [out, in] layout and the layer's names: `w_gate`,
    `w_up` [E_l, I, H], `w_down` [E_l, H, I] for this rank's E_l = num_experts / P local
    experts, and `ws_gate`, `ws_up` [I_s, H], `ws_down` [H, I_s] with a shared expert.
    Under `ep_group`, `topk_ids` hold global expert ids and tokens travel to the ranks
    that own their experts. Each gate/up pair lives in one allocation (`mok.pack_gate_up`),
    which the bf16 gate/up GEMM reads faster; moving the module (`.to`, `.cuda`,
    `to_empty`) packs the moved pair again.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        topk: int,
        shared_intermediate_size: int = 0,
        precision: str = "bf16",
        ep_group: dist.ProcessGroup | None = None,
        config: MoKConfig | None = None,
        swiglu_limit: float | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        for name, value in (
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
            ("num_experts", num_experts),
            ("topk", topk),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if not isinstance(shared_intermediate_size, int) or shared_intermediate_size < 0:
            raise ValueError(f"shared_intermediate_size: expected an int >= 0, got {shared_intermediate_size!r}")
        if topk > num_experts:
            raise ValueError(f"topk: expected at most num_experts ({num_experts}), got {topk}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
        # The forward would refuse these sizes on every call; say so when the layer is built.
        check_alignment("hidden_size", hidden_size, precision)
        check_alignment("intermediate_size", intermediate_size, precision)
        if shared_intermediate_size % 8:
            raise ValueError(f"shared_intermediate_size: expected a multiple of 8, got {shared_intermediate_size}")
        if swiglu_limit is not None and not swiglu_limit > 0:
            raise ValueError(f"swiglu_limit: expected None or a positive number, got {swiglu_limit!r}")
        if dtype != torch.bfloat16:
            raise TypeError(f"dtype: expected torch.bfloat16 (the layer's parameter dtype), got {dtype}")
        config = MoKConfig(precision=precision) if config is None else config
        if not isinstance(config, MoKConfig):
            raise TypeError(f"config: expected a MoKConfig or None, got {type(config).__name__}")
        if config.precision != precision:
            config = MoKConfig(**{**config.__dict__, "precision": precision})
        world_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        if num_experts % world_size:
            raise ValueError(f"num_experts: expected a multiple of the ep_group size ({world_size}), got {num_experts}")

        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.num_local_experts, self.topk = num_experts, num_experts // world_size, topk
        self.shared_intermediate_size = shared_intermediate_size
        self.precision, self.ep_group, self.config, self.swiglu_limit = precision, ep_group, config, swiglu_limit

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))

        H, I, E_l, I_s = hidden_size, intermediate_size, self.num_local_experts, shared_intermediate_size
        self.w_gate, self.w_up, self.w_down = param(E_l, I, H), param(E_l, I, H), param(E_l, H, I)
        if I_s:
            self.ws_gate, self.ws_up, self.ws_down = param(I_s, H), param(I_s, H), param(H, I_s)
        else:
            self.ws_gate = self.ws_up = self.ws_down = None
        # This layer's own workspaces: under expert parallelism the received token rows stay
        # in the workspace until the backward, and a workspace shared with another layer
        # would make this layer's backward send them again.
        self._workspaces: dict = {}
        self._pack_gate_up()
        self.reset_parameters()

    @torch.no_grad()
    def _pack_gate_up(self) -> None:
        """Stores each gate/up pair (routed, shared) as the two halves of one tensor, in place
        of the parameters' data, unless it already is one (plain tensors only: a sharded
        or otherwise wrapped parameter is left as it is)."""
        for gate_name, up_name in (("w_gate", "w_up"), ("ws_gate", "ws_up")):
            gate, up = getattr(self, gate_name), getattr(self, up_name)
            if gate is None or type(gate.data) is not torch.Tensor or type(up.data) is not torch.Tensor:
                continue
            if not gate_up_packed(gate, up):
                gate.data, up.data = pack_gate_up(gate.data, up.data)

    def _apply(self, fn, recurse=True):
        # A move allocates each parameter on its own; keep the gate/up pairs packed.
        super()._apply(fn, recurse)
        self._pack_gate_up()
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """`nn.Linear`'s default: uniform in ±1/sqrt(fan_in), fan_in = the weight's last dim."""
        for weight in self.parameters():
            bound = 1.0 / math.sqrt(weight.shape[-1])
            weight.uniform_(-bound, bound)

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        expert_counts_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`expert_counts_out`: an int32/int64 [num_experts] device tensor that receives the
        routes each global expert got in this call (summed over the EP group), with no host
        sync (`mok.expert_counts`)."""
        x_rows, id_rows, weight_rows, lead = flatten_tokens(x, topk_ids, topk_weights)  # [T, H], [T, topk] ×2
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected a tensor of shape [..., {self.hidden_size}], got {tuple(x.shape)}")
        if topk_ids.shape[-1] != self.topk:
            raise ValueError(f"topk_ids: expected shape [..., {self.topk}] (the layer's topk), got {tuple(topk_ids.shape)}")
        out = moe(
            x_rows.contiguous(),
            id_rows.contiguous(),
            weight_rows.contiguous(),
            self.w_gate,
            self.w_up,
            self.w_down,
            self.ws_gate,
            self.ws_up,
            self.ws_down,
            config=self.config,
            swiglu_limit=self.swiglu_limit,
            group=self.ep_group,
            workspace_cache=self._workspaces,
        )
        if expert_counts_out is not None:
            expert_counts(id_rows, self.num_experts, group=self.ep_group, out=expert_counts_out)
        return out.view(*lead, self.hidden_size)

    def check_errors(self, *, blocking: bool = True) -> None:
        """Raises `mok.MoKError` for an error the device found in this layer's calls (bad expert
        ids, capacity overflow, a peer that never came), then clears it. `blocking=True` reads
        the device's flag (a host sync); `blocking=False` reads only the copy the last call left
        in host memory, if it has landed. On one GPU the next call raises a landed error anyway."""
        for workspace in self._workspaces.values():
            check_errors(workspace, blocking=blocking)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"num_experts={self.num_experts} ({self.num_local_experts} local), topk={self.topk}, "
            f"shared_intermediate_size={self.shared_intermediate_size}, precision={self.precision!r}"
        )
