"""The mxfp8 recipe (OCP MX v1.0): E4M3 elements with one power-of-two scale per 32 along each GEMM's
reduction dim. Hopper has no MX instruction, so each operand is rounded to the MX grid and kept in
bf16, which holds every such value exactly (`kernels/quant/mxfp8.py`'s `mxfp8_round`), and the bf16 recipe's GEMMs
compute the MX products exactly in fp32."""

from __future__ import annotations

from typing import NamedTuple

import torch

from mok import ops
from mok.mxfp8 import mxfp8_dequantize, mxfp8_quantize
from mok.precision.base import QuantizedRecipe
from mok.precision.bf16 import Bf16Recipe


class Mxfp8Weight(NamedTuple):
    """A routed weight [E_l, N, K] as the mxfp8 GEMMs read it: rounded to the MXFP8 grid and held
    in bf16, `rows` in blocks of 32 along K for the forward, `cols` along N for the dgrads; both
    [E_l, N, K]."""

    rows: torch.Tensor
    cols: torch.Tensor


class Mxfp8Recipe(QuantizedRecipe, Bf16Recipe):
    """The bf16 recipe on operands rounded along their reduction dims: forward x and h along H and
    I against the weights' `rows` copies; backward dOut along H and d_g, d_u along I against their
    `cols` copies, and the wgrads' x, w·dOut (both from the gather), d_g|d_u and h along the sorted
    rows. The forward keeps h unrounded (its wgrad rounds it along the rows)."""

    name = "mxfp8"
    rounds_sorted_rows = True

    def weight_copy(self, w):
        return Mxfp8Weight(*ops.mxfp8_round(w, True, True))

    def round_operand(self, t, is_weight):
        q, scale, _, _ = mxfp8_quantize(t, rowwise=True, colwise=False)
        return mxfp8_dequantize(q, scale)

    def _reads_weighted_h(self, w_down, token_order):
        return False

    def gate_up_while_arriving(self):
        return False  # x is rounded to the MX grid in one pass over all its rows first

    def _gate_up_operand(self, x):
        return ops.mxfp8_round(x)[0]  # [T, H] along H

    def _down_operand(self, h, routing):
        return ops.mxfp8_round(h, True, False, routing)[0]  # [rows, I] along I

    def _forward_weight(self, w):
        return w.rows

    def _dgrad_weight(self, w):
        return w.cols

    def _wgrad_h_operand(self, h, routing):
        return ops.mxfp8_round(h, False, True, routing)[1]  # [rows, I] along the rows

    def _d_gate_up_operands(self, d_gate_up, routing):
        rows, cols = ops.mxfp8_round(d_gate_up.flatten(1), True, True, routing)
        return rows.view_as(d_gate_up), cols.view_as(d_gate_up)
