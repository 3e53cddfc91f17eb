"""Training quality of mok's precisions: one small byte-level MoE language model,
trained once per precision from the same initial weights on the same batches.

    python examples/train_moe_lm.py                                  # 2000 steps × bf16, mxfp8, fp8_block
    python examples/train_moe_lm.py --device cpu --steps 300 --batch-size 8 --seq-len 128 \
        --layers 2 --experts 8 --dim 128 --expert-dim 128          # ~5 min on 2 CPU cores

The model: bytes → embedding → N × [RMSNorm → causal self-attention, RMSNorm → top-k
softmax router → `mok.MoKMoE`] → RMSNorm → logits over 256 bytes. The router and its
Switch-Transformer load-balancing loss live in the model; mok runs the experts. Only the
MoE layer's precision differs between runs: everything else computes in fp32, and mok's
layer holds bf16 weights (as every precision's master copy; mxfp8 and fp8_block quantize
them on the fly). Each run uses what `MoKConfig(backend="auto")` picks for its precision
on the device (the JSON says which).

Data: the Python standard library's own sources (`sysconfig.get_paths()["stdlib"]`, every
*.py outside site-packages, sorted by path; every 20th file is held out for validation),
so the text exists offline on every machine. Batches are random windows drawn from a
generator seeded with --seed, the same sequence for every precision.

Writes `<out>/<device>-<yyyymmdd>-train-moe-lm.json` (per-step training loss, periodic
validation loss, config, versions, device, date, wall time, the mean of the last 100
training losses per precision and its relative difference to bf16) and a `.png` of the
loss curves next to it.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mok
from mok.bench.report import machine_info, output_stem, write_json
from mok.config import PRECISIONS, SIZE_ALIGNMENT

VOCAB = 256  # bytes
VALIDATION_EVERY_NTH_FILE = 20
THIRD_PARTY_DIRECTORIES = {"site-packages", "dist-packages"}  # installed packages, not the stdlib
AUX_LOSS_WEIGHT = 0.01  # Switch Transformer's load-balancing coefficient
LAST_STEPS = 100  # the training-loss window compared across precisions (the bar: within 1% of bf16)


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class TextData:
    train: torch.Tensor  # [n_train] uint8
    val: torch.Tensor  # [n_val] uint8
    info: dict


def load_stdlib_text() -> TextData:
    """The standard library's *.py files as bytes, joined by newlines; every
    VALIDATION_EVERY_NTH_FILE-th file (in sorted path order) goes to validation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in THIRD_PARTY_DIRECTORIES]
        files += [(Path(directory) / n).relative_to(root).as_posix() for n in names if n.endswith(".py")]
    files.sort()
    if not files:
        raise RuntimeError(f"no Python sources found under the standard library at {root}")
    splits = {"train": [], "val": []}
    for index, name in enumerate(files):
        splits["val" if index % VALIDATION_EVERY_NTH_FILE == 0 else "train"].append((root / name).read_bytes())
    train, val = (torch.frombuffer(bytearray(b"\n".join(splits[s])), dtype=torch.uint8) for s in ("train", "val"))
    info = {"source": str(root), "files": len(files), "train_bytes": train.numel(), "val_bytes": val.numel()}
    return TextData(train, val, info)


def windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets [B, seq_len] int64 of the windows starting at `starts` [B]."""
    rows = data[starts[:, None] + torch.arange(seq_len + 1)].long()  # [B, seq_len + 1]
    return rows[:, :-1], rows[:, 1:]


def random_starts(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(data.numel() - seq_len - 1, (batch_size,), generator=generator)


def fixed_starts(data: torch.Tensor, count: int, seq_len: int) -> torch.Tensor:
    """`count` window starts spread evenly over `data` (the validation set)."""
    return torch.linspace(0, data.numel() - seq_len - 1, count).long()


# --------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, S, D]
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)  # [B, h, S, D/h] each
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, h, S, D/h]
        return self.proj(y.transpose(1, 2).reshape(B, S, D))


class MoEFeedForward(nn.Module):
    """A top-k softmax router in front of mok's routed SwiGLU experts."""

    def __init__(self, dim: int, expert_dim: int, num_experts: int, topk: int, precision: str):
        super().__init__()
        self.topk = topk
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = mok.MoKMoE(dim, expert_dim, num_experts, topk, precision=precision)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x [B, S, D] fp32
        probs = self.router(x).softmax(dim=-1)  # [B, S, E]
        topk_weights, topk_ids = probs.topk(self.topk, dim=-1)  # [B, S, k]
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        out = self.experts(x.bfloat16(), topk_ids, topk_weights)  # [B, S, D] bf16
        return out.float(), load_balancing_loss(probs, topk_ids)


def load_balancing_loss(probs: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's E · Σ_e (share of routes to e) · (mean router probability of e);
    1 when routing is uniform. probs [..., E], topk_ids [..., k]."""
    num_experts = probs.shape[-1]
    experts = torch.arange(num_experts, device=probs.device)
    route_share = (topk_ids.reshape(-1, 1) == experts).float().mean(dim=0)  # [E], sums to 1
    mean_prob = probs.reshape(-1, num_experts).mean(dim=0)  # [E]
    return num_experts * (route_share * mean_prob).sum()


class Block(nn.Module):
    def __init__(self, args: argparse.Namespace, precision: str):
        super().__init__()
        self.attn_norm = nn.RMSNorm(args.dim)
        self.attn = CausalSelfAttention(args.dim, args.heads)
        self.moe_norm = nn.RMSNorm(args.dim)
        self.moe = MoEFeedForward(args.dim, args.expert_dim, args.experts, args.topk, precision)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x))
        moe_out, aux_loss = self.moe(self.moe_norm(x))
        return x + moe_out, aux_loss


class MoELanguageModel(nn.Module):
    def __init__(self, args: argparse.Namespace, precision: str):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, args.dim)
        self.position = nn.Embedding(args.seq_len, args.dim)
        self.blocks = nn.ModuleList(Block(args, precision) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.dim)
        self.head = nn.Linear(args.dim, VOCAB, bias=False)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean next-byte cross-entropy and the mean load-balancing loss of the blocks."""
        x = self.embed(inputs) + self.position(torch.arange(inputs.shape[1], device=inputs.device))  # [B, S, D]
        aux_losses = []
        for block in self.blocks:
            x, aux_loss = block(x)
            aux_losses.append(aux_loss)
        logits = self.head(self.norm(x))  # [B, S, 256]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), torch.stack(aux_losses).mean()


# --------------------------------------------------------------------------- training


def make_optimizer(model: nn.Module, args: argparse.Namespace):
    """AdamW with weight decay on matrices only; linear warm-up, then cosine decay to 10%."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    warmup = max(1, args.steps // 20)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


@torch.no_grad()
def evaluate(model: nn.Module, val_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    return sum(model(inputs, targets)[0].item() for inputs, targets in val_batches) / len(val_batches)


def chosen_backend(precision: str, args: argparse.Namespace, device: torch.device) -> str:
    """The backend `MoKConfig(backend="auto")` picks for this precision and device."""
    config = mok.MoKConfig(precision=precision)
    workspace = mok.create_workspace(
        config, None, device=device, num_local_tokens=1, hidden_size=args.dim, topk=args.topk
    )
    topk_ids = torch.arange(args.topk, device=device).unsqueeze(0)  # [1, k]
    return mok.build_schedule(workspace, config, topk_ids, num_local_experts=args.experts).backend


def train(precision: str, args: argparse.Namespace, data: TextData, device: torch.device) -> dict:
    """One run: the same initial weights and batches for every precision."""
    torch.manual_seed(args.seed)
    model = MoELanguageModel(args, precision).to(device)
    optimizer, scheduler = make_optimizer(model, args)
    batch_order = torch.Generator().manual_seed(args.seed)
    val_starts = fixed_starts(data.val, args.eval_batches * args.batch_size, args.seq_len)
    val_batches = [tuple(t.to(device) for t in windows(data.val, starts, args.seq_len))
                   for starts in val_starts.split(args.batch_size)]
    train_losses = torch.zeros(args.steps, device=device)  # read at log points: no sync per step
    val_losses, logged_steps, logged_time = [], 0, 0.0
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = random_starts(data.train, args.batch_size, args.seq_len, batch_order)
        inputs, targets = (t.to(device, non_blocking=True) for t in windows(data.train, starts, args.seq_len))
        loss, aux_loss = model(inputs, targets)
        (loss + AUX_LOSS_WEIGHT * aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_losses[step - 1] = loss.detach()
        if step % args.eval_every == 0 or step == args.steps:
            val_losses.append([step, evaluate(model, val_batches)])
        if step % args.log_every == 0 or step == args.steps:
            recent = train_losses[logged_steps:step].mean().item()  # syncs
            now = time.perf_counter() - start
            tokens_per_s = (step - logged_steps) * args.batch_size * args.seq_len / (now - logged_time)
            val = f"  val {val_losses[-1][1]:.4f}" if val_losses else ""
            print(f"{precision:>9}  step {step:>5}/{args.steps}  loss {recent:.4f}{val}  {tokens_per_s:,.0f} tok/s",
                  flush=True)
            logged_steps, logged_time = step, now
    wall_s = time.perf_counter() - start
    losses = train_losses.tolist()
    return {
        "backend": chosen_backend(precision, args, device),
        "train_loss": losses,
        "val_loss": val_losses,
        "wall_s": wall_s,  # training and validation
        "tokens_per_s": args.steps * args.batch_size * args.seq_len / wall_s,
        "mean_train_loss_last_steps": sum(losses[-LAST_STEPS:]) / len(losses[-LAST_STEPS:]),
    }


# --------------------------------------------------------------------------- output


def plot(runs: dict[str, dict], path: Path, title: str) -> None:
    """Training loss (moving average) with validation points, and each precision's
    difference to bf16 in percent."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    def smooth(values: list[float]) -> torch.Tensor:
        window = max(1, min(50, len(values) // 10))
        return F.avg_pool1d(torch.tensor([values]), window, stride=1).squeeze(0)

    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(12, 4.5))
    baseline = smooth(runs["bf16"]["train_loss"]) if "bf16" in runs else None
    for precision, run in runs.items():
        curve = smooth(run["train_loss"])
        steps = torch.arange(len(curve)) + (len(run["train_loss"]) - len(curve)) + 1
        (line,) = ax_loss.plot(steps, curve, label=f"{precision} (train)", linewidth=1)
        val_steps, val = zip(*run["val_loss"])
        ax_loss.plot(val_steps, val, "o--", color=line.get_color(), markersize=3, linewidth=0.8,
                     label=f"{precision} (val)")
        if baseline is not None and precision != "bf16":
            ax_diff.plot(steps, 100 * (curve - baseline) / baseline, color=line.get_color(), label=precision,
                         linewidth=1)
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats / byte)", title="loss")
    ax_loss.legend(fontsize=8)
    ax_diff.axhline(0.0, color="black", linewidth=0.8)
    for bar in (-1.0, 1.0):
        ax_diff.axhline(bar, color="grey", linewidth=0.8, linestyle=":")
    ax_diff.set(xlabel="step", ylabel="% vs bf16 (smoothed training loss)",
                title="difference to bf16 (bar: within 1%)")
    if baseline is not None and len(runs) > 1:
        ax_diff.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precisions", default="bf16,mxfp8,fp8_block",
                        help=f"comma-separated, of {', '.join(PRECISIONS)}")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--seed", type=int, default=0)
    model = parser.add_argument_group("model")
    model.add_argument("--dim", type=int, default=256, help="model (hidden) size H")
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--experts", type=int, default=16)
    model.add_argument("--topk", type=int, default=2)
    model.add_argument("--expert-dim", type=int, default=256, help="expert intermediate size I")
    optim = parser.add_argument_group("optimisation and reporting")
    optim.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    optim.add_argument("--eval-every", type=int, default=100, help="steps between validation losses")
    optim.add_argument("--eval-batches", type=int, default=4, help="validation batches (fixed windows)")
    optim.add_argument("--log-every", type=int, default=100, help="steps between progress lines")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.precisions = [p for p in args.precisions.split(",") if p]
    bad = [p for p in args.precisions if p not in PRECISIONS]
    if bad or not args.precisions:
        parser.error(f"--precisions: expected a comma-separated list of {', '.join(PRECISIONS)}, got {bad or 'none'}")
    for flag in ("steps", "batch_size", "seq_len", "dim", "layers", "heads", "experts", "topk", "expert_dim",
                 "eval_every", "eval_batches", "log_every"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected a positive int, got {getattr(args, flag)}")
    align = max(SIZE_ALIGNMENT[p] for p in args.precisions)
    for flag in ("dim", "expert_dim"):
        if getattr(args, flag) % align:
            parser.error(f"--{flag.replace('_', '-')}: expected a multiple of {align} "
                         f"for {', '.join(args.precisions)}, got {getattr(args, flag)}")
    if args.dim % args.heads:
        parser.error(f"--heads: expected a divisor of --dim ({args.dim}), got {args.heads}")
    if args.topk > args.experts:
        parser.error(f"--topk: expected at most --experts ({args.experts}), got {args.topk}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    data = load_stdlib_text()
    print(f"data: {data.info['files']} files from {data.info['source']}, "
          f"{data.info['train_bytes']:,} training / {data.info['val_bytes']:,} validation bytes", flush=True)
    info, date = machine_info(device), datetime.date.today()
    stem = output_stem(args.out, info["gpu"], date, "train-moe-lm")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    record = {
        **info,
        "mok": mok.__version__,
        "date": date.isoformat(),
        "command": shlex.join(["python", f"examples/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]),
        "config": {**config, "aux_loss_weight": AUX_LOSS_WEIGHT, "last_steps": min(LAST_STEPS, args.steps)},
        "data": data.info,
        "runs": {},
    }
    title = (f"byte-level MoE LM on the Python stdlib · {info['gpu']} · {args.layers}×(d={args.dim}, "
             f"{args.experts} experts top-{args.topk}, I={args.expert_dim}) · batch {args.batch_size}×{args.seq_len}")
    runs = record["runs"]
    for precision in args.precisions:
        runs[precision] = train(precision, args, data, device)
        compare_to_bf16(runs)
        # Written after every precision, so a run cut short still leaves the finished ones.
        write_json(record, stem.with_suffix(".json"))
        plot(runs, stem.with_suffix(".png"), title)
    for precision, run in runs.items():
        diff = "" if run["rel_diff_to_bf16"] is None else f"  ({100 * run['rel_diff_to_bf16']:+.2f}% vs bf16)"
        print(f"{precision:>9} [{run['backend']}]: mean training loss of the last {record['config']['last_steps']} "
              f"steps {run['mean_train_loss_last_steps']:.4f}{diff}, {run['wall_s']:.1f} s")
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return record


def compare_to_bf16(runs: dict[str, dict]) -> None:
    """Sets each run's rel_diff_to_bf16 (None until bf16 has run)."""
    bf16 = runs.get("bf16", {}).get("mean_train_loss_last_steps")
    for run in runs.values():
        run["rel_diff_to_bf16"] = None if bf16 is None else (run["mean_train_loss_last_steps"] - bf16) / bf16


if __name__ == "__main__":
    main()
