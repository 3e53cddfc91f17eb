"""The bf16 recipe: bf16 operands, fp32 accumulation. The shared expert runs it in every precision."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mok import ops
from mok.kernels.gemm.dgrad import down_wgrad_reads_weighted_h
from mok.kernels.routing.schedule import RoutingSchedule
from mok.precision.base import Recipe, down_gemm, take, weight_grads


@dataclass(eq=False)
class Bf16Saved:
    """What the backward reads of a forward on bf16 MMAs (bf16 and mxfp8)."""

    gate_up: torch.Tensor | None  # [rows, 2, I] bf16: g, u of every sorted row
    h: torch.Tensor | None  # [rows, I] bf16; None where the down wgrad reads the down dgrad's w·h


@dataclass(eq=False)
class Bf16WgradOperands:
    """The weight gradients' operands, in the sorted layout, that `backward_data` leaves."""

    x: torch.Tensor | None  # [rows, H]
    d_gate_up: torch.Tensor | None  # [rows, 2, I]
    dy: torch.Tensor | None  # [rows, H]: w·dOut, or dOut where h is w·h
    h: torch.Tensor | None  # [rows, I]: h, or w·h
    w_down: torch.Tensor  # [E_l, H, I]: the down weight the forward read (d_w_down's shape)
    routing: RoutingSchedule


class Bf16Recipe(Recipe):
    """bf16 GEMMs. Subclasses that also run on bf16 MMAs (mxfp8) change the operands through the
    `_*_operand` / `_*_weight` hooks.

    `token_order=True` (forward and backward_data) says the routing's sorted rows are the tokens in
    order and there is no router weight (the shared expert's), so x and dOut serve as they are
    instead of being gathered."""

    name = "bf16"
    # gather_sorted_rows rounds its sorted copies to the MXFP8 grid
    rounds_sorted_rows = False

    def gate_up_while_arriving(self):
        return True

    def forward(self, x, weights, routing, topk, num_slots, swiglu_limit, needs_backward, *,
                sorted_rows=False, token_order=False, arriving=None, returning=None):
        w_gate, w_up, w_down = weights
        w_gate, w_up = self._forward_weight(w_gate), self._forward_weight(w_up)
        if arriving is None:
            h, gate_up = ops.gate_up_swiglu(self._gate_up_operand(x), w_gate, w_up, routing, topk, swiglu_limit,
                                            needs_backward)
        else:
            with arriving.before_landing():
                h, gate_up = ops.gate_up_swiglu(arriving.rows_now, w_gate, w_up, arriving.own, topk, swiglu_limit,
                                                needs_backward)
            ops.gate_up_swiglu_into(arriving.land(), w_gate, w_up, arriving.others, topk, swiglu_limit, h, gate_up)
        h_rows, w_down_rows = self._down_operand(h, routing), self._forward_weight(w_down)
        y = down_gemm(lambda tiles: ops.down_scatter(h_rows, w_down_rows, tiles, num_slots),
                      lambda tiles, y: ops.down_scatter_into(h_rows, w_down_rows, tiles, y), routing, returning)
        if not needs_backward:
            return y, None
        return y, Bf16Saved(gate_up, None if self._reads_weighted_h(w_down, token_order) else h)

    def prepare_backward(self, x, saved, routing, topk, swiglu_limit):
        """x's sorted copy, the gate/up wgrad's operand."""
        return ops.gather_sorted_rows(x, None, None, routing, topk, self.rounds_sorted_rows)[0]

    def backward_data(self, d_out, x, topk_weights, weights, saved, routing, topk, num_slots, swiglu_limit,
                      *, sorted_rows=False, token_order=False, prepared=None):
        """The GEMMs read x and dOut in the sorted layout. The down wgrad reduces (w·dOut)ᵀ·h over
        the rows; where w·h is the smaller operand it reads dOutᵀ·(w·h) instead, w·h written by the
        down dgrad (no w·dOut copy, no saved h). g, u are freed after the down dgrad, and each
        sorted copy once its last reader has run."""
        w_gate, w_up, w_down = weights
        weighted_h = self._reads_weighted_h(w_down, token_order)
        if token_order:
            x_sorted, d_out_sorted, dy_sorted = x, d_out, d_out
        else:
            x_sorted, d_out_sorted, dy_sorted = ops.gather_sorted_rows(
                x if prepared is None else None, d_out, None if weighted_h else topk_weights, routing, topk,
                self.rounds_sorted_rows,
            )
            if prepared is not None:
                x_sorted = prepared
        d_gate_up, d_topk_weights, h = ops.down_dgrad_swiglu(
            d_out_sorted, topk_weights, take(saved, "gate_up"), self._dgrad_weight(w_down), routing,
            swiglu_limit, weighted_h,
        )
        if weighted_h:  # (dOut, w·h) stand in for (w·dOut, h)
            dy_sorted = d_out_sorted
        else:
            h = self._wgrad_h_operand(take(saved, "h"), routing)
        del d_out_sorted
        d_gate_up_dgrad, d_gate_up_wgrad = self._d_gate_up_operands(d_gate_up, routing)
        del d_gate_up
        dx = ops.gate_up_dgrad_scatter(
            d_gate_up_dgrad, self._dgrad_weight(w_gate), self._dgrad_weight(w_up), routing, num_slots
        )
        operands = Bf16WgradOperands(x_sorted, d_gate_up_wgrad, dy_sorted, h, self._forward_weight(w_down), routing)
        return dx, d_topk_weights, operands

    def backward_weights(self, state: Bf16WgradOperands, main_grads):
        main_gate, main_up, main_down = main_grads
        down_last = _down_wgrad_last((state.dy, state.h), state.w_down, main_down)
        if not down_last:
            d_w_down = self._down_weight_grad(state, main_down)
        d_w_gate, d_w_up = weight_grads(ops.gate_up_wgrad, ops.gate_up_wgrad_accumulate, take(state, "d_gate_up", "x"),
                                        (main_gate, main_up), state.routing)
        if down_last:
            d_w_down = self._down_weight_grad(state, main_down)
        return d_w_gate, d_w_up, d_w_down

    @staticmethod
    def _down_weight_grad(state: Bf16WgradOperands, main_down):
        """d_w_down from w·dOut's sorted copy and h (or main_down after `+=`)."""
        return weight_grads(ops.down_wgrad, ops.down_wgrad_accumulate, take(state, "dy", "h"), (main_down,),
                            state.routing)

    def _reads_weighted_h(self, w_down, token_order: bool) -> bool:
        """Whether the routed experts' down wgrad reads dOut's sorted rows and the down dgrad's w·h
        (where `dgrad.down_wgrad_reads_weighted_h`), so that the forward keeps no h and the
        backward makes no w·dOut copy."""
        return not token_order and down_wgrad_reads_weighted_h(*w_down.shape[1:])

    # The operands of the GEMMs, as a subclass on bf16 MMAs changes them: here as they are.

    def _gate_up_operand(self, x):
        return x

    def _down_operand(self, h, routing):
        return h

    def _forward_weight(self, w):
        return w

    def _dgrad_weight(self, w):
        return w

    def _wgrad_h_operand(self, h, routing):
        return h

    def _d_gate_up_operands(self, d_gate_up, routing):
        """(d_g, d_u as the gate/up dgrad reads them, as the gate/up wgrad reads them)."""
        return d_gate_up, d_gate_up


def _down_wgrad_last(operands: Sequence[torch.Tensor], w_down: torch.Tensor, main_down: torch.Tensor | None) -> bool:
    """Whether the down wgrad runs after the gate/up wgrad rather than before it: where its operands
    (w·dOut and h, rows × (H + I)) take less memory than the gradient it allocates (d_w_down,
    E_l × H × I; nothing with a main_grad buffer). First, it frees its operands before the gate/up
    wgrad's peak; last, its output is not yet there. mixtral-8x7b: 0.64 GB of operands against a
    0.94 GB gradient, so it goes last; qwen3-30b and deepseek-v3-slice keep it first."""
    if main_down is not None:
        return False
    experts, hidden, inter = w_down.shape
    operand_bytes = sum(t.numel() * t.element_size() for t in operands)
    return operand_bytes < experts * hidden * inter * 2
