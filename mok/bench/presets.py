"""Benchmark shapes (per expert-parallel rank) and their useful FLOP count."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """One MoE layer shape: T tokens per rank, H hidden, I expert intermediate, E global experts."""

    name: str
    num_tokens: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    topk: int
    shared_intermediate_size: int = 0

    def forward_flops(self) -> float:
        """Useful forward FLOPs: 2·3·(T·k·H·I + T·H·I_s)."""
        routed = self.num_tokens * self.topk * self.hidden_size * self.intermediate_size
        shared = self.num_tokens * self.hidden_size * self.shared_intermediate_size
        return 6.0 * (routed + shared)

    def flops(self, pass_: str) -> float:
        """FLOPs of `fwd` or `fwd+bwd` (the backward counts twice the forward)."""
        if pass_ not in ("fwd", "fwd+bwd"):
            raise ValueError(f"pass_: expected 'fwd' or 'fwd+bwd', got {pass_!r}")
        return self.forward_flops() * (1 if pass_ == "fwd" else 3)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("qwen3-30b", 16384, 2048, 768, 128, 8, 0),
        Preset("deepseek-v3-slice", 8192, 7168, 2048, 32, 8, 2048),
        Preset("mixtral-8x7b", 8192, 4096, 14336, 8, 2, 0),
        Preset("tiny", 256, 256, 128, 8, 2, 128),
    )
}

GPU_PRESETS = ("qwen3-30b", "deepseek-v3-slice", "mixtral-8x7b")
