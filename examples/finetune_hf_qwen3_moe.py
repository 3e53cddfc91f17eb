"""Fine-tunes a Hugging Face transformers Qwen3-MoE model with mok running its experts.

    python examples/finetune_hf_qwen3_moe.py                 # tiny random model, CPU, a few seconds
    python examples/finetune_hf_qwen3_moe.py --device cuda   # the same on a GPU (mok's triton kernels)

One line switches a model to mok: `experts_implementation="mok"` (after
`import mok.integrations.transformers`). The model here is built from a config with random
weights so the example runs offline; for a real checkpoint use
`AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="mok")`.
The router, attention and everything else stay transformers' own; each MoE layer's routed
experts run through mok's forward and backward on the model's `gate_up_proj` and `down_proj`.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import mok.integrations.transformers  # noqa: F401  (registers experts_implementation="mok")


def tiny_qwen3_moe_config() -> Qwen3MoeConfig:
    """A Qwen3-MoE with every size scaled down (8 experts, top-2, 2 layers)."""
    return Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128, output_router_logits=True, router_aux_loss_coef=0.01,
    )


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_qwen3_moe_config(), dtype=torch.bfloat16, experts_implementation="mok"
    ).to(args.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # One fixed batch of random tokens: the loss falls as the model memorises it.
    batch = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len), device=args.device)
    losses = []
    for step in range(args.steps):
        loss = model(batch, labels=batch).loss  # includes the router's load-balancing loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"step {step}: loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
