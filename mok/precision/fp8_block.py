"""The fp8_block recipe (DeepSeek-V3's): E4M3 operands, activations with one fp32 scale per 1×128
block along the reduction dim, weights per 128×128 block, the scales applied per 128-wide K step
on fp32 accumulators. Its options (requantized wgrad operands, quantized d_g, d_u, sorted outputs,
e4m3 g, u, e4m3 on the wire) are the kernel plan's `fp8_block_*` fields (`kernels.plan`), with
their reasons and records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from mok import ops
from mok.fp8_block import FP8_BLOCK, fp8_block_round
from mok.kernels.gemm.dgrad import fp8_block_down_dgrad_gathers
from mok.kernels.plan import kernel_plan
from mok.kernels.routing.schedule import RoutingSchedule
from mok.precision.base import QuantizedRecipe, down_gemm, take, weight_grads


class Fp8BlockWeight(NamedTuple):
    """A routed weight [E_l, N, K] as the fp8_block GEMMs read it (`mok.fp8_block_quantize`'s
    outputs): q [E_l, N, K] with scale [E_l, N/128, K/128] for the forward, the transposed
    copy q_t [E_l, K, N] with scale_t [E_l, K/128, N/128] for the dgrads."""

    q: torch.Tensor
    scale: torch.Tensor
    q_t: torch.Tensor
    scale_t: torch.Tensor


@dataclass(eq=False)
class Fp8BlockSaved:
    """What the backward reads of an fp8_block forward."""

    gate_up: torch.Tensor | None  # [rows, 2, I] bf16 g, u, or e4m3 (the plan's `fp8_block_gate_up_e4m3`)
    gate_up_scale: torch.Tensor | None  # [rows, 2, I/128] fp32 where gate_up is e4m3
    # e4m3 copies the wgrads requantize down the rows (the plan's `fp8_block_wgrads_requantize`)
    x_q: torch.Tensor | None  # [T, H] e4m3
    x_scale: torch.Tensor | None  # [T, H/128] fp32
    h_q: torch.Tensor | None  # [rows, I] e4m3
    h_scale: torch.Tensor | None  # [rows, I/128] fp32


@dataclass(eq=False)
class Fp8BlockWgradOperands:
    """What the weight gradients read, left by `backward_data`. Pairs are (e4m3 rows, their 1×128
    scales along the width), or (bf16 rows, None) to quantize from."""

    d_gate_up: torch.Tensor | None  # [rows, 2, I] bf16, or e4m3 with d_gate_up_scale
    d_gate_up_scale: torch.Tensor | None  # [rows, 2, I/128] fp32
    x: tuple | None  # token rows [T, H]
    dy: tuple | None  # dOut's token rows [T, H] (times the router weights when quantized)
    h_t: tuple | None  # hᵀ quantized down the rows: [I, rows] e4m3, [rows / S, I] fp32
    topk_weights: torch.Tensor
    routing: RoutingSchedule
    topk: int


class Fp8BlockRecipe(QuantizedRecipe):
    """FP8 MMAs with block scales on the routed experts. The forward quantizes x in 1×128 blocks
    along H, and the gate/up epilogue h along I for the down GEMM. The dgrads read dOut and d_g, d_u
    in 1×128 blocks along H and I against the weights' transposed copies; the wgrads reduce over
    rows, so their operands (x, w·dOut, d_g|d_u, h) are quantized in 1×128 blocks along the sorted
    rows. x and dOut are never copied in bf16: the quantizers gather their sorted rows themselves,
    each bitwise what quantizing `gather_sorted_rows`' copies gives."""

    name = "fp8_block"

    def weight_copy(self, w):
        return Fp8BlockWeight(*ops.quantize_fp8_block_weights(w))

    def round_operand(self, t, is_weight):
        return fp8_block_round(t, (FP8_BLOCK, FP8_BLOCK) if is_weight else (1, FP8_BLOCK))

    def sorted_outputs(self):
        return kernel_plan().fp8_block_sorted_outputs

    def sends_fp8_rows(self):
        plan = kernel_plan()
        return plan.fp8_block_on_the_wire and plan.fp8_block_wgrads_requantize

    def gate_up_while_arriving(self):
        return self.sends_fp8_rows()  # else x is quantized in one pass over all its rows first

    def forward(self, x, weights, routing, topk, num_slots, swiglu_limit, needs_backward, *,
                sorted_rows=False, arriving=None, returning=None):
        """The backward gets g, u (in e4m3 with their scales where the plan's `fp8_block_gate_up_e4m3`
        applies) and, with the plan's `fp8_block_wgrads_requantize`, the e4m3 copies of x and h."""
        w_gate, w_up, w_down = weights
        plan = kernel_plan()
        gate_up_e4m3 = (needs_backward and plan.fp8_block_gate_up_e4m3 and plan.fp8_block_wgrads_requantize
                        and swiglu_limit is None)
        gate_up_weights = (w_gate.q, w_gate.scale, w_up.q, w_up.scale)
        if arriving is None:
            # [T, H] e4m3, [T, H/128] fp32 (x arrives quantized from the dispatch: `sends_fp8_rows`)
            x_q, x_scale = x if isinstance(x, tuple) else ops.quantize_fp8_block_activations(x)
            # g, u: [rows, 2, I] bf16, or e4m3 with scales [rows, 2, I/128]
            h_q, h_scale, gate_up, gate_up_scale = ops.gate_up_swiglu_fp8_block(
                x_q, x_scale, *gate_up_weights, routing, topk, swiglu_limit, needs_backward, gate_up_e4m3,
            )
        else:
            with arriving.before_landing():
                h_q, h_scale, gate_up, gate_up_scale = ops.gate_up_swiglu_fp8_block(
                    *arriving.rows_now, *gate_up_weights, arriving.own, topk, swiglu_limit, needs_backward,
                    gate_up_e4m3,
                )
            x_q, x_scale = arriving.land()
            ops.gate_up_swiglu_fp8_block_into(x_q, x_scale, *gate_up_weights, arriving.others, topk, swiglu_limit,
                                              h_q, h_scale, gate_up, gate_up_scale)
        down_operands = (h_q, h_scale, w_down.q, w_down.scale)
        y = down_gemm(lambda tiles: ops.down_scatter_fp8_block(*down_operands, tiles, num_slots, sorted_rows),
                      lambda tiles, y: ops.down_scatter_fp8_block_into(*down_operands, tiles, sorted_rows, y),
                      routing, returning)
        if not needs_backward:
            return y, None
        copies = (x_q, x_scale, h_q, h_scale) if plan.fp8_block_wgrads_requantize else (None,) * 4
        return y, Fp8BlockSaved(gate_up, gate_up_scale if gate_up_e4m3 else None, *copies)

    def prepare_backward(self, x, saved, routing, topk, swiglu_limit):
        """hᵀ quantized down the rows, the down wgrad's operand (`_h_t`)."""
        return self._h_t(saved, saved.gate_up, routing, swiglu_limit)

    @staticmethod
    def _h_t(saved, gate_up, routing, swiglu_limit):
        """hᵀ quantized down the rows: [I, rows] e4m3, [rows / S, I] fp32, from the forward's e4m3 h
        (taken out of `saved`) where it kept one, else from the bf16 g, u."""
        if saved.h_q is not None:
            return ops.quantize_fp8_block_sorted_t(take(saved, "h_q"), routing, take(saved, "h_scale"))
        return ops.quantize_fp8_block_swiglu_sorted_t(gate_up, routing, swiglu_limit)

    def backward_data(self, d_out, x, topk_weights, weights, saved, routing, topk, num_slots, swiglu_limit,
                      *, sorted_rows=False, prepared=None):
        """dOut is quantized in 1×128 blocks along H for the down dgrad (its sorted rows, or, where the
        down dgrad gathers them itself, per token); with the plan's `fp8_block_d_gate_up_quantized`
        the down dgrad's epilogue quantizes d_g, d_u along I for the gate/up dgrad. Where the forward
        saved e4m3 copies of x and h, the wgrads requantize x, h and w·dOut (from dOut's per-token
        copy, where the down dgrad read one) down the rows; else x and w·dOut come from their bf16
        token rows and h is recomputed from g, u."""
        w_gate, w_up, w_down = weights
        rows_in_use = routing.num_rows  # [1] int32; the quantizers skip the rest
        if isinstance(d_out, tuple):  # quantized per token before the dispatch (`sends_fp8_rows`)
            per_token_d_out, d_out_pair = True, d_out
        elif per_token_d_out := fp8_block_down_dgrad_gathers(d_out.shape[1]):
            # [T, H] e4m3, [T, H/128] fp32: the down dgrad gathers
            d_out_pair = ops.quantize_fp8_block_activations(d_out)
        else:  # [rows, H] e4m3, [rows, H/128] fp32
            d_out_pair = ops.quantize_fp8_block_gathered(d_out, routing, topk)
        gate_up, gate_up_scale = take(saved, "gate_up", "gate_up_scale")
        # d_g, d_u: [rows, 2, I] bf16 (and an empty scale), or e4m3 with its 1×128 scales [rows, 2, I/128]
        quantized = kernel_plan().fp8_block_d_gate_up_quantized
        d_gate_up, d_gate_up_scale, d_topk_weights = ops.down_dgrad_swiglu_fp8_block(
            *d_out_pair, topk_weights, gate_up, w_down.q_t, w_down.scale_t, routing, swiglu_limit, quantized,
            gate_up_scale,
        )
        # x received in e4m3 (`sends_fp8_rows`) is the forward's x_q: the same rows, sent again where
        # a later dispatch overwrote the transport's buffer
        saved_x = take(saved, "x_q", "x_scale")
        x_pair = x if isinstance(x, tuple) else saved_x if saved_x[0] is not None else (x, None)
        requantize = x_pair[1] is not None
        dy_pair = d_out_pair if requantize and per_token_d_out else (d_out, None)
        del d_out_pair
        # h's goes first, so that g, u are freed before the gate/up GEMMs
        h_t = self._h_t(saved, gate_up, routing, swiglu_limit) if prepared is None else prepared
        del gate_up, gate_up_scale
        if quantized:
            d_gate_pair, d_up_pair = ((d_gate_up[:, j], d_gate_up_scale[:, j]) for j in (0, 1))
        else:
            d_gate_pair, d_up_pair = (ops.quantize_fp8_block_activations(d_gate_up[:, j], rows_in_use) for j in (0, 1))
        dx = ops.gate_up_dgrad_scatter_fp8_block(
            *d_gate_pair, *d_up_pair, w_gate.q_t, w_gate.scale_t, w_up.q_t, w_up.scale_t, routing, num_slots,
            sorted_rows,
        )
        del d_gate_pair, d_up_pair
        operands = Fp8BlockWgradOperands(d_gate_up, d_gate_up_scale if quantized else None, x_pair, dy_pair, h_t,
                                         topk_weights, routing, topk)
        return dx, d_topk_weights, operands

    def backward_weights(self, state: Fp8BlockWgradOperands, main_grads):
        """Each wgrad's operands are quantized right before it runs: [W, rows] e4m3 and [rows / S, W]
        fp32 each."""
        main_gate, main_up, main_down = main_grads
        routing, topk = state.routing, state.topk
        d_gate_up, d_gate_up_scale = take(state, "d_gate_up", "d_gate_up_scale")
        d_gate_up_t = ops.quantize_fp8_block_sorted_t(  # d_gᵀ, d_uᵀ: [2·I, rows]
            d_gate_up.flatten(1), routing, None if d_gate_up_scale is None else d_gate_up_scale.flatten(1)
        )
        del d_gate_up, d_gate_up_scale
        x_rows, x_scale = take(state, "x")
        x_t = ops.quantize_fp8_block_gathered_t(x_rows, None, routing, topk, x_scale)  # [H, rows]
        del x_rows, x_scale
        d_w_gate, d_w_up = weight_grads(
            ops.gate_up_wgrad, ops.gate_up_wgrad_accumulate, (d_gate_up_t[0], x_t[0]), (main_gate, main_up), routing,
            scales=(d_gate_up_t[1], x_t[1]),
        )
        del d_gate_up_t, x_t
        dy_rows, dy_scale = take(state, "dy")
        dy_t = ops.quantize_fp8_block_gathered_t(dy_rows, state.topk_weights, routing, topk, dy_scale)
        del dy_rows, dy_scale
        h_t = take(state, "h_t")
        d_w_down = weight_grads(
            ops.down_wgrad, ops.down_wgrad_accumulate, (dy_t[0], h_t[0]), (main_down,), routing,
            scales=(dy_t[1], h_t[1]),
        )
        return d_w_gate, d_w_up, d_w_down
