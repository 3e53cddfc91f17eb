"""The tensors a forward context holds, by name: what tests compare between a forward and its
recompute, and check a backward took out."""

from __future__ import annotations

import dataclasses

import torch


def saved_tensors(context) -> dict[str, torch.Tensor]:
    """Every tensor of `context.saved` (a `functional.ForwardContext`) by its dotted field name
    ("routed.gate_up", "shared.h", "route_row", "expert_x.0" for a pair's first); fields that hold
    none (not saved, or taken by a backward) are left out."""
    return {} if context.saved is None else _tensors(context.saved, "")


def _tensors(value, name: str) -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {name: value}
    if dataclasses.is_dataclass(value):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    elif isinstance(value, tuple):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {}
    found = {}
    for key, item in items:
        found.update(_tensors(item, f"{name}.{key}" if name else key))
    return found
