"""mok in torchtitan: its routed-experts modules, same configs, parameters and call signatures.

    from mok.integrations.torchtitan import use_mok
    use_mok(model_config)  # every MoE layer's routed experts now run through mok

Two drop-ins, each a subclass of torchtitan's own module (so checkpoints, parameter init,
FSDP and the expert sharding plan see the same `inner_experts.w1_EFD` [E, F, D] (gate),
`w3_EFD` [E, F, D] (up) and `w2_EDF` [E, D, F] (down), mok's `w_gate`, `w_up`, `w_down`):

- `MoKRoutedExperts` replaces `RoutedExperts` (`use_mok`'s default): mok runs the whole
  routed path, dispatch + SwiGLU experts + weighted combine, from the router's top-k ids
  and scores. Under expert parallelism its `parallelize` takes the EP mesh's process group
  and mok moves the tokens itself (torchtitan's token dispatcher is not called).
- `MoKGroupedExperts` replaces `GroupedExperts` (`use_mok(..., whole_layer=False)`):
  forward(x_RD, num_tokens_per_expert_E) on rows already sorted by expert, after
  torchtitan's own dispatch (any of its token dispatchers), each row one route of weight 1.

Both compute in bf16 like torchtitan's `GroupedExperts` (inputs and weights cast to bf16,
the output cast back to the input's dtype). `MoKRoutedExperts.Config(count_tokens=True)`
writes the routes each global expert got in the last call (summed over the EP group, no
host sync) into its `global_tokens_per_expert_E` buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts

from mok.config import MoKConfig
from mok.functional import expert_counts, moe

# Workspaces kept per module, one per row count seen; torchtitan's EP dispatchers give a
# different row count most steps, so the cache is emptied when it grows past this.
_MAX_CACHED_WORKSPACES = 4


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)


def _workspace_cache(module) -> dict:
    if len(module._workspaces) >= _MAX_CACHED_WORKSPACES:
        module._workspaces.clear()
    return module._workspaces


def _swiglu_weights(experts: GroupedExperts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (w_gate, w_up, w_down) in bf16: torchtitan's w1, w3, w2."""
    return tuple(_bf16(_local(w)) for w in (experts.w1_EFD, experts.w3_EFD, experts.w2_EDF))


class MoKGroupedExperts(GroupedExperts):
    """torchtitan's `GroupedExperts` run by mok: rows x_RD [R, D] sorted by expert, the first
    num_tokens_per_expert_E[0] rows to expert 0, and so on; rows past the counts' sum (a
    dispatcher's padding) get weight 0, so their output rows are 0."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        precision: str = "bf16"

    def __init__(self, config: Config):
        super().__init__(config)
        self.mok_config = MoKConfig(precision=config.precision)
        self._workspaces: dict = {}

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        rows = x_RD.shape[0]
        if rows == 0:
            return x_RD.clone()
        weights = _swiglu_weights(self)
        num_local_experts = weights[0].shape[0]  # E / EP under torchtitan's expert parallelism
        row = torch.arange(rows, device=x_RD.device)  # [R]
        ends = torch.cumsum(num_tokens_per_expert_E.to(device=x_RD.device, dtype=torch.long), dim=0)  # [E_l]
        expert = torch.bucketize(row, ends, right=True)  # [R]: the local expert of each row, E_l past the counts
        out = moe(
            _bf16(x_RD).contiguous(),
            expert.clamp(max=num_local_experts - 1)[:, None].contiguous(),  # [R, 1]
            (expert < num_local_experts).float()[:, None].contiguous(),  # [R, 1]: padding rows weigh 0
            *weights,
            config=self.mok_config,
            workspace_cache=_workspace_cache(self),
        )
        return out.type_as(x_RD)


class MoKRoutedExperts(RoutedExperts):
    """torchtitan's `RoutedExperts` (dispatch, experts, combine) as one mok layer. Its
    `inner_experts` holds the weights as in torchtitan; the token dispatcher stays built (its
    config is part of the model's) but mok moves the tokens."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        precision: str = "bf16"
        count_tokens: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        self.mok_config = MoKConfig(precision=config.precision)
        self.ep_group = None
        self.count_tokens = config.count_tokens
        self._workspaces: dict = {}
        self.register_buffer(
            "global_tokens_per_expert_E",
            torch.zeros(self.inner_experts.num_experts, dtype=torch.int64),
            persistent=False,
        )

    def parallelize(self, parallel_dims) -> None:
        super().parallelize(parallel_dims)
        ep_mesh = parallel_dims.get_optional_mesh("ep")
        self.ep_group = None if ep_mesh is None else ep_mesh.get_group()
        self._workspaces.clear()

    def forward(
        self,
        x_BLD: torch.Tensor,
        topk_scores_BLK: torch.Tensor,
        topk_expert_ids_BLK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> torch.Tensor:
        """out [B, L, D] = Σ_k score[k]·expert_k(x), the router's weighting, as torchtitan's."""
        B, L, D = x_BLD.shape
        topk_expert_ids_TK = topk_expert_ids_BLK.reshape(B * L, -1)
        out_TD = moe(
            _bf16(x_BLD).reshape(B * L, D).contiguous(),
            topk_expert_ids_TK.contiguous(),
            topk_scores_BLK.reshape(B * L, -1).float().contiguous(),
            *_swiglu_weights(self.inner_experts),
            config=self.mok_config,
            group=self.ep_group,
            workspace_cache=_workspace_cache(self),
        )
        if self.count_tokens:
            with torch.no_grad():
                expert_counts(topk_expert_ids_TK, self.inner_experts.num_experts, group=self.ep_group,
                              out=self.global_tokens_per_expert_E)
        return out_TD.view(B, L, D).type_as(x_BLD)


def use_mok(model_config, *, whole_layer: bool = True, precision: str = "bf16", count_tokens: bool = False):
    """Switches every routed-experts config in `model_config` (a torchtitan model or MoE
    config, changed in place and returned) to mok's: `RoutedExperts.Config` to
    `MoKRoutedExperts.Config` (`whole_layer=True`), else each `GroupedExperts.Config` to
    `MoKGroupedExperts.Config`. Fields keep their values."""
    old, new, extra = (
        (RoutedExperts.Config, MoKRoutedExperts.Config, {"precision": precision, "count_tokens": count_tokens})
        if whole_layer
        else (GroupedExperts.Config, MoKGroupedExperts.Config, {"precision": precision})
    )
    if count_tokens and not whole_layer:
        raise ValueError("count_tokens: expected False with whole_layer=False (torchtitan's MoE counts tokens)")
    if isinstance(model_config, old):
        return _converted(model_config, new, extra)
    found = list(model_config.traverse(old))
    if not found:
        raise ValueError(f"model_config: expected a torchtitan config holding a {old.__qualname__}, found none")
    for _, config, parent, attr in found:
        converted = _converted(config, new, extra)
        if isinstance(attr, int):
            parent[attr] = converted
        else:
            setattr(parent, attr, converted)
    return model_config


def _converted(config, new_class, extra: dict):
    if isinstance(config, new_class):
        return config
    return new_class(**{f.name: getattr(config, f.name) for f in fields(config) if f.init}, **extra)
