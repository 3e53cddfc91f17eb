"""Precision recipes: how the experts' GEMMs run in one precision.

A recipe is everything of a layer call that depends on the precision: the copies of the weights the
kernels read, which kernels run the expert MLP forward and backward and on which operands, and what
the forward keeps for the backward. The flow in `mok.functional` (workspace, schedule, the
expert-parallel exchange, the shared expert, the combine, error checks) is the same for every
precision and calls a recipe (`Recipe`, `base.py`) at these points:

    prepare_weights(w_gate, w_up, w_down)           the routed weights as the kernels read them
    forward(x, weights, routing, ...)               -> (y, saved)
    backward_data(d_out, x, topk_weights, weights, saved, routing, ...)
                                                    -> (dx, d_topk_weights, state): the dgrads
    backward_weights(state, main_grads)             -> (d_w_gate, d_w_up, d_w_down): the wgrads
    reference_operands(x, w_gate, w_up, w_down)     the reference backend's operands, rounded alike

`saved` and `state` are the recipe's own dataclasses, whose fields the backward takes out as it reads
them, so that a released context frees each activation after its last reader. The backward comes in
two calls so that the flow can move dx between ranks while the weight-gradient GEMMs run. The
shared expert runs the bf16 recipe in every precision.

To add a precision: write `mok/precision/<name>.py` with a `Recipe` subclass (`QuantizedRecipe` where
the GEMMs read low-precision copies of the weights), its kernels in `mok.kernels` and their custom ops
in `mok.ops`; add it to `_RECIPES` below and its name and size alignment to `mok.config`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mok.precision.base import QuantizedRecipe, Recipe, take
from mok.precision.bf16 import Bf16Recipe
from mok.precision.fp8_block import Fp8BlockRecipe
from mok.precision.mxfp8 import Mxfp8Recipe

__all__ = ["QuantizedRecipe", "Recipe", "recipe", "routed_weight_copies", "take"]

_RECIPES: dict[str, Recipe] = {r.name: r for r in (Bf16Recipe(), Mxfp8Recipe(), Fp8BlockRecipe())}


def recipe(precision: str) -> Recipe:
    """The recipe of `precision` ("bf16", "mxfp8", "fp8_block")."""
    found = _RECIPES.get(precision)
    if found is None:
        raise ValueError(f"precision: expected one of {sorted(_RECIPES)}, got {precision!r}")
    return found


def routed_weight_copies(weights: Sequence[torch.Tensor], precision: str) -> tuple:
    """Fresh copies of routed weights in the layouts `precision`'s GEMMs read (fp8_block: each
    weight's e4m3 blocks and scales, both orientations; mxfp8: its two rounded bf16 copies), one
    kernel launch per weight and no cache: what each in-place update of the weights adds to the
    step that follows it (the layer makes them once per version of a weight)."""
    with_copies = sorted(name for name, r in _RECIPES.items() if r.weights_are_copies)
    if precision not in with_copies:
        raise ValueError(f"precision: expected one of {with_copies}, got {precision!r}")
    return _RECIPES[precision].fresh_weight_copies(weights)
