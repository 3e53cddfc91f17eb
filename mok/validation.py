"""Input checks shared by every API level: each failure names the argument and what was expected.

Shape, dtype, device and layout checks cost no device work. The value checks on
`topk_ids` (range, repeats within a row) need the data: the reference backend runs them
on the host; the fast backend runs them inside its schedule kernel and raises through the
workspace's error flag.
"""

from __future__ import annotations

import torch

from mok.config import SIZE_ALIGNMENT


def _fmt_shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def check_tensor(
    name: str,
    t,
    *,
    dtypes: tuple[torch.dtype, ...],
    shape: tuple[int | None, ...],
    device: torch.device | None = None,
) -> None:
    """Type, dtype, rank, shape (None = any size), contiguity and device of one argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        expected = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {expected}, got {str(t.dtype).removeprefix('torch.')}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {expected}, got {_fmt_shape(t)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous()), got strides {t.stride()}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where x is), got {t.device}")


def flatten_tokens(x, topk_ids, topk_weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Size]:
    """x [..., H], topk_ids and topk_weights [..., topk] as [T, H] and [T, topk] (T = the
    product of the leading dims), and the leading dims to restore the output's shape with."""
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 1:
            raise ValueError(f"{name}: expected a tensor with at least one dim, got shape {_fmt_shape(t)}")
    lead = x.shape[:-1]
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.shape[:-1] != lead:
            raise ValueError(f"{name}: expected shape [{', '.join(map(str, lead))}, topk] (x's leading dims), "
                             f"got {_fmt_shape(t)}")
    return x.reshape(-1, x.shape[-1]), topk_ids.reshape(-1, topk_ids.shape[-1]), \
        topk_weights.reshape(-1, topk_weights.shape[-1]), lead


def check_alignment(name: str, size: int, precision: str) -> None:
    align = SIZE_ALIGNMENT[precision]
    if size % align:
        raise ValueError(f"{name}: expected a multiple of {align} in {precision} mode, got {size}")


def check_layer_inputs(
    x,
    topk_ids,
    topk_weights,
    w_gate,
    w_up,
    w_down,
    ws_gate=None,
    ws_up=None,
    ws_down=None,
    *,
    precision: str = "bf16",
) -> tuple[int, int, int, int, int]:
    """Checks every layer input; returns (T, H, I, E_l, topk)."""
    check_tensor("x", x, dtypes=(torch.bfloat16,), shape=(None, None))
    num_tokens, hidden = x.shape
    device = x.device
    if num_tokens < 1:
        raise ValueError(f"x: expected at least one token row, got shape {_fmt_shape(x)}")
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int32, torch.int64), shape=(num_tokens, None), device=device)
    topk = topk_ids.shape[1]
    check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=(num_tokens, topk), device=device)
    check_tensor("w_gate", w_gate, dtypes=(torch.bfloat16,), shape=(None, None, hidden), device=device)
    num_local_experts, inter = w_gate.shape[:2]
    check_tensor("w_up", w_up, dtypes=(torch.bfloat16,), shape=(num_local_experts, inter, hidden), device=device)
    check_tensor("w_down", w_down, dtypes=(torch.bfloat16,), shape=(num_local_experts, hidden, inter), device=device)
    if num_local_experts < 1:
        raise ValueError(f"w_gate: expected at least one local expert, got shape {_fmt_shape(w_gate)}")
    check_alignment("hidden_size (x.shape[1])", hidden, precision)
    check_alignment("intermediate_size (w_gate.shape[1])", inter, precision)
    check_shared_weights(ws_gate, ws_up, ws_down, hidden, device)
    if topk < 1:
        raise ValueError(f"topk_ids: expected at least one route per token, got shape {_fmt_shape(topk_ids)}")
    return num_tokens, hidden, inter, num_local_experts, topk


def check_shared_weights(ws_gate, ws_up, ws_down, hidden: int, device: torch.device) -> bool:
    """True when a shared expert is given; all three weights or none."""
    present = [w is not None for w in (ws_gate, ws_up, ws_down)]
    if not any(present):
        return False
    if not all(present):
        missing = [n for n, p in zip(("ws_gate", "ws_up", "ws_down"), present) if not p]
        raise ValueError(f"{', '.join(missing)}: expected all three shared-expert weights or none")
    check_tensor("ws_gate", ws_gate, dtypes=(torch.bfloat16,), shape=(None, hidden), device=device)
    shared_inter = ws_gate.shape[0]
    check_tensor("ws_up", ws_up, dtypes=(torch.bfloat16,), shape=(shared_inter, hidden), device=device)
    check_tensor("ws_down", ws_down, dtypes=(torch.bfloat16,), shape=(hidden, shared_inter), device=device)
    if shared_inter % 8:
        raise ValueError(f"ws_gate: expected a shared intermediate size that is a multiple of 8, got {shared_inter}")
    return True


def check_topk_ids_values(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Ids in [0, num_experts) and distinct within each row. Reads the data (a host sync)."""
    topk = topk_ids.shape[1]
    if topk > num_experts:
        raise ValueError(f"topk_ids: expected topk <= num_experts ({num_experts}), got topk={topk}")
    if topk_ids.numel() == 0:
        return
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < 0 or high >= num_experts:
        bad = low if low < 0 else high
        raise ValueError(f"topk_ids: expected expert ids in [0, {num_experts}), got {bad}")
    sorted_ids = topk_ids.sort(dim=1).values
    repeated = (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(dim=1)
    if bool(repeated.any()):
        row = int(repeated.nonzero()[0, 0])
        raise ValueError(
            f"topk_ids: expected distinct expert ids within each row, row {row} has {topk_ids[row].tolist()}"
        )
