"""The fp8_block weight gradients' error with their activation operand in 128×128 blocks: the
numerics side of a recipe question (plain PyTorch, CPU or GPU).

One expert's weight gradient dW = Aᵀ·B over its rows (tokens), A the gradient operand (d_g, d_u
or w·dOut) and B the activation (x or h). DeepSeek-V3's recipe rounds both through FP8 twice, as the
layer does: first in 1×128 blocks along the features (the e4m3 copies the forward and the
dgrads use), then in 1×128 blocks along the tokens (the wgrad's reduction dim). Each K step of
the wgrad then needs the factor sa[m]·sb[n] per element. With B's second rounding in 128×128
blocks (tokens × features) instead, the factor is one per row; on the H200 at the power cap that
takes the wgrads 0.31 ms less per qwen3-30b step (BENCHMARKS.md, "Tried: the padding's MMAs
skipped"). This script prints both recipes' error against the fp32 product of the unrounded
operands (the accuracy measures: Σ|diff| / Σ|ref| and cosine), on Gaussian operands and on operands
with outlier features or tokens, which a shared 128×128 scale serves worst (with outlier features,
also over dW's other columns alone).

    python benchmarks/sweeps/wgrad_block_numerics.py [--rows R] [--out-features M] [--in-features N]
        [--outlier-scale S] [--seed SEED]
"""

from __future__ import annotations

import argparse

import torch

from mok.fp8_block import FP8_BLOCK, fp8_block_round
from mok.testing import cosine_similarity, relative_error


def _twice_rounded(t: torch.Tensor, token_block: tuple[int, int]) -> torch.Tensor:
    """t [tokens, features] rounded along its features (1×128), then along its tokens in
    `token_block` blocks of the transpose ([features, tokens]): what the wgrad multiplies."""
    along_features = fp8_block_round(t)  # [tokens, features] fp32
    return fp8_block_round(along_features.T.contiguous(), token_block).T  # [tokens, features] fp32


def _operands(kind: str, rows: int, out_features: int, in_features: int, outlier_scale: float,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [rows, out_features], B [rows, in_features]) in bf16: Gaussian; with `kind` "features"
    B's every 64th feature times outlier_scale, with "tokens" both operands' every 64th token."""
    a = torch.randn(rows, out_features, generator=gen)
    b = torch.randn(rows, in_features, generator=gen)
    if kind == "features":
        b[:, ::64] *= outlier_scale
    elif kind == "tokens":
        a[::64] *= outlier_scale
        b[::64] *= outlier_scale
    return a.bfloat16(), b.bfloat16()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1024, help="the expert's rows (qwen3-30b: about 1024)")
    parser.add_argument("--out-features", type=int, default=1536, help="dW's rows (qwen3-30b gate/up: 2·I)")
    parser.add_argument("--in-features", type=int, default=2048, help="dW's columns (qwen3-30b gate/up: H)")
    parser.add_argument("--outlier-scale", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    print(f"dW [{args.out_features}, {args.in_features}] over {args.rows} rows; outliers x{args.outlier_scale:g} "
          f"on every 64th feature of B or token of A and B")
    print(f"{'operands':10s} {'B in 1x128 along tokens (recipe)':>34s} {'B in 128x128 blocks':>26s}")
    ordinary = torch.arange(args.in_features) % 64 != 0  # the columns of dW no outlier feature makes
    for kind in ("gaussian", "features", "tokens"):
        a, b = _operands(kind, args.rows, args.out_features, args.in_features, args.outlier_scale, gen)
        reference = a.float().T @ b.float()  # [out_features, in_features] fp32
        a_rounded = _twice_rounded(a, (1, FP8_BLOCK))
        got = [a_rounded.T @ _twice_rounded(b, b_block) for b_block in ((1, FP8_BLOCK), (FP8_BLOCK, FP8_BLOCK))]
        views = {kind: lambda t: t}
        if kind == "features":  # where a shared scale serves worst: the ordinary features beside the outliers
            views["  others"] = lambda t: t[:, ordinary]
        for name, view in views.items():
            cells = [f"rel {relative_error(view(g), view(reference)):.4f}, "
                     f"cos {cosine_similarity(view(g), view(reference)):.5f}" for g in got]
            print(f"{name:10s} {cells[0]:>34s} {cells[1]:>26s}", flush=True)


if __name__ == "__main__":
    main()
