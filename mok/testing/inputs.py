"""Seeded random inputs for the MoE layer (never zeros), shared by tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok.functional import pack_gate_up


@dataclass(frozen=True)
class MoEInputs:
    """Tensors of one layer call; weights hold all E experts (slice them for EP ranks)."""

    x: torch.Tensor  # [T, H] bf16
    topk_ids: torch.Tensor  # [T, topk] int64
    topk_weights: torch.Tensor  # [T, topk] fp32
    w_gate: torch.Tensor  # [E, I, H]
    w_up: torch.Tensor  # [E, I, H]
    w_down: torch.Tensor  # [E, H, I]
    ws_gate: torch.Tensor | None  # [I_s, H]
    ws_up: torch.Tensor | None  # [I_s, H]
    ws_down: torch.Tensor | None  # [H, I_s]

    @property
    def weights(self) -> tuple:
        """(w_gate, w_up, w_down, ws_gate, ws_up, ws_down)"""
        return (self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up, self.ws_down)


def make_topk_ids(
    num_tokens: int,
    num_experts: int,
    topk: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    skew: float = 0.0,
) -> torch.Tensor:
    """[T, topk] int64 expert ids, distinct within each row. `skew` > 0 favours low ids."""
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    if skew:
        scores = scores + skew * torch.linspace(1.0, 0.0, num_experts)
    return torch.topk(scores, topk, dim=1).indices.to(device)


def make_inputs(
    num_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    topk: int,
    shared_intermediate_size: int = 0,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    signed_weights: bool = False,
    topk_ids: torch.Tensor | None = None,
) -> MoEInputs:
    """Random layer inputs with O(1) activations; the same seed gives the same tensors.

    Weights use the fan-in scale 1/sqrt(fan_in) so outputs stay O(1) at every size.
    Router weights are a softmax over the chosen experts, or N(0,1) with `signed_weights`.
    Each gate/up pair shares one allocation, as in `MoKMoE` (`mok.pack_gate_up`).
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    H, I, E, I_s = hidden_size, intermediate_size, num_experts, shared_intermediate_size
    x = randn(num_tokens, H)
    if topk_ids is None:
        topk_ids = make_topk_ids(num_tokens, E, topk, gen)
    logits = torch.randn(num_tokens, topk, generator=gen)
    topk_weights = logits if signed_weights else torch.softmax(logits, dim=-1)
    def gate_up_pair(*shape):
        return pack_gate_up(randn(*shape, scale=H**-0.5), randn(*shape, scale=H**-0.5))

    shared = (None, None, None)
    if I_s:
        shared = (*gate_up_pair(I_s, H), randn(H, I_s, scale=I_s**-0.5))
    return MoEInputs(
        x,
        topk_ids.to(device=device, dtype=torch.int64),
        topk_weights.to(device=device, dtype=torch.float32),
        *gate_up_pair(E, I, H),
        randn(E, H, I, scale=I**-0.5),
        *shared,
    )


@dataclass(frozen=True)
class OddCase:
    """A small layer shape that exercises an edge of the schedule or the kernels."""

    num_tokens: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    topk: int
    shared_intermediate_size: int = 0
    swiglu_limit: float | None = None
    routing: str = "random"  # "random" | "one expert" (all to expert 3) | "few experts" (only topk + 2 used)

    def inputs(self, *, seed: int = 0, device: torch.device | str = "cpu") -> MoEInputs:
        """Inputs with signed router weights (the router-weight gradient must not care)."""
        gen = torch.Generator().manual_seed(seed)
        T, E, topk = self.num_tokens, self.num_experts, self.topk
        ids = None
        if self.routing == "one expert":
            ids = torch.full((T, topk), 3, dtype=torch.int64)
        elif self.routing == "few experts":
            ids = torch.stack([torch.randperm(topk + 2, generator=gen)[:topk] for _ in range(T)])
        return make_inputs(T, self.hidden_size, self.intermediate_size, E, topk, self.shared_intermediate_size,
                           seed=seed, device=device, signed_weights=True, topk_ids=ids)


ODD_CASES: dict[str, OddCase] = {
    "one token": OddCase(1, 32, 16, 4, 2),
    "ragged T + shared": OddCase(37, 64, 48, 5, 2, 32),
    "clamp + shared": OddCase(21, 32, 32, 4, 2, 16, swiglu_limit=0.6),
    "topk = 1": OddCase(19, 32, 16, 3, 1),
    "topk = E": OddCase(13, 32, 16, 4, 4),
    "all to one expert": OddCase(23, 32, 16, 4, 1, routing="one expert"),
    "empty experts": OddCase(30, 48, 32, 8, 2, routing="few experts"),
}
