"""Accuracy statistics as the accuracy bars define them, and a readable mismatch report."""

from __future__ import annotations

import math

import torch

# precision -> (max relative L1 error, min gradient cosine).
TOLERANCES: dict[str, tuple[float, float]] = {
    "bf16": (0.01, 0.9999),
    "mxfp8": (0.1, 0.996),
    "fp8_block": (0.1, 0.996),
}


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Σ|actual − reference| / Σ|reference| in fp64; NaN anywhere in `actual` gives inf."""
    actual, reference = actual.double(), reference.double()
    if actual.shape != reference.shape:
        raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} vs reference {tuple(reference.shape)}")
    diff = (actual - reference).abs()
    if not torch.isfinite(diff).all():
        return math.inf
    denom = reference.abs().sum().item()
    num = diff.sum().item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / denom


def cosine_similarity(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Cosine of the flattened tensors in fp64; two all-zero tensors count as 1."""
    a, r = actual.double().flatten(), reference.double().flatten()
    na, nr = a.norm().item(), r.norm().item()
    if na == 0.0 and nr == 0.0:
        return 1.0
    if na == 0.0 or nr == 0.0 or not math.isfinite(na):
        return 0.0
    return (a @ r).item() / (na * nr)


def mismatch_report(actual: torch.Tensor, reference: torch.Tensor, name: str = "tensor", top: int = 5) -> str:
    """Where and by how much two tensors differ: statistics and the worst elements."""
    a, r = actual.double().cpu(), reference.double().cpu()
    diff = (a - r).abs().nan_to_num(nan=math.inf)
    lines = [
        f"{name}: shape {tuple(r.shape)}, rel_err {relative_error(a, r):.3e}, "
        f"cosine {cosine_similarity(a, r):.6f}, max |diff| {diff.max().item() if diff.numel() else 0:.3e}, "
        f"nan in actual {int(torch.isnan(a).sum())}"
    ]
    if diff.numel():
        worst = torch.topk(diff.flatten(), min(top, diff.numel())).indices
        for flat in worst.tolist():
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), r.shape))
            lines.append(f"  at {idx}: actual {a[idx].item():.6g} reference {r[idx].item():.6g}")
    return "\n".join(lines)


def max_rel_err(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The largest relative error over named (actual, reference) pairs."""
    return max(relative_error(a, r) for a, r in pairs.values())


def assert_close_to_reference(
    actual: torch.Tensor | None,
    reference: torch.Tensor | None,
    precision: str = "bf16",
    name: str = "tensor",
    context: str = "",
    check_cosine: bool = False,
) -> None:
    """Raises AssertionError with a mismatch report when the accuracy bar for `precision` is missed."""
    if actual is None or reference is None:
        if actual is not None or reference is not None:
            raise AssertionError(f"{name}: one of actual/reference is None {context}")
        return
    max_err, min_cos = TOLERANCES[precision]
    err = relative_error(actual, reference)
    cos = cosine_similarity(actual, reference)
    if err > max_err or (check_cosine and cos < min_cos):
        raise AssertionError(
            f"{name} misses the {precision} bar (rel_err ≤ {max_err}"
            + (f", cosine ≥ {min_cos}" if check_cosine else "")
            + f") {context}\n"
            + mismatch_report(actual, reference, name)
        )
