"""The definition of correct: the MoE layer in plain PyTorch, fp32 math.

Every kernel, backend and benchmark in mok is checked against these functions. They
import nothing else from mok, compute in fp32 whatever the input dtypes, and return fp32.

Legend: T local tokens, H hidden size, I expert intermediate size, I_s shared
intermediate size, topk routes per token, E_l local experts (all experts when P = 1),
P expert-parallel ranks; global expert e lives on rank e // E_l as local expert e % E_l.

    one expert:  g = x Wgᵀ, u = x Wuᵀ, h = silu(g)·u, y = h Wdᵀ
    the layer:   out[t] = y_shared[t] + Σ_j w[t,j]·y_{e(t,j)}(x_t)      (ascending j)

With `swiglu_limit = L`: g ← min(g, L), u ← clamp(u, −L, L) before h; the gradient is
zero where a clamp was active (g > L, |u| > L).

The backward is written out by hand (no autograd), returning the layer's gradients in order;
the router-weight gradient is ⟨dOut[t], y_{e(t,j)}⟩, exact for any sign of w.

`routed_x` (optional, in every layer function): the rows the routed experts read in place
of x, for a caller that emulates a low-precision format by rounding the routed experts'
operand while the shared expert keeps reading x. The gradient flowing into it is
returned as part of d_x.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "Gradients",
    "ExpertActivations",
    "swiglu_mlp_forward",
    "swiglu_mlp_backward",
    "moe_forward",
    "moe_backward",
    "ep_moe_forward",
    "ep_moe_backward",
]


class Gradients(NamedTuple):
    """The layer's gradients, in order. Shared ones are None without a shared expert."""

    d_x: torch.Tensor  # [T, H]
    d_topk_weights: torch.Tensor  # [T, topk]
    d_w_gate: torch.Tensor  # [E_l, I, H]
    d_w_up: torch.Tensor  # [E_l, I, H]
    d_w_down: torch.Tensor  # [E_l, H, I]
    d_ws_gate: torch.Tensor | None = None  # [I_s, H]
    d_ws_up: torch.Tensor | None = None  # [I_s, H]
    d_ws_down: torch.Tensor | None = None  # [H, I_s]


class ExpertActivations(NamedTuple):
    """What one SwiGLU MLP computed for a batch of rows, in fp32 (before any clamp)."""

    gate: torch.Tensor  # [n, I]
    up: torch.Tensor  # [n, I]
    h: torch.Tensor  # [n, I]
    y: torch.Tensor  # [n, H]


# --------------------------------------------------------------------------- one expert


def swiglu_mlp_forward(
    x: torch.Tensor,  # [n, H]
    w_gate: torch.Tensor,  # [I, H]
    w_up: torch.Tensor,  # [I, H]
    w_down: torch.Tensor,  # [H, I]
    swiglu_limit: float | None = None,
) -> ExpertActivations:
    x = x.float()
    gate = x @ w_gate.float().T  # [n, I]
    up = x @ w_up.float().T  # [n, I]
    if swiglu_limit is not None:
        h = F.silu(gate.clamp(max=swiglu_limit)) * up.clamp(-swiglu_limit, swiglu_limit)
    else:
        h = F.silu(gate) * up  # [n, I]
    y = h @ w_down.float().T  # [n, H]
    return ExpertActivations(gate, up, h, y)


def swiglu_backward(
    d_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """d_gate, d_up of h = silu(min(g, L)) · clamp(u, −L, L); all fp32."""
    if swiglu_limit is not None:
        gate_c = gate.clamp(max=swiglu_limit)
        up_c = up.clamp(-swiglu_limit, swiglu_limit)
    else:
        gate_c, up_c = gate, up
    sig = torch.sigmoid(gate_c)
    silu = gate_c * sig
    d_up = d_h * silu
    d_gate = d_h * up_c * sig * (1 + gate_c * (1 - sig))
    if swiglu_limit is not None:
        d_gate = torch.where(gate <= swiglu_limit, d_gate, 0.0)
        d_up = torch.where(up.abs() <= swiglu_limit, d_up, 0.0)
    return d_gate, d_up


def swiglu_mlp_backward(
    d_y: torch.Tensor,  # [n, H]
    x: torch.Tensor,  # [n, H]
    acts: ExpertActivations,
    w_gate: torch.Tensor,  # [I, H]
    w_up: torch.Tensor,  # [I, H]
    w_down: torch.Tensor,  # [H, I]
    swiglu_limit: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns d_x [n, H], d_w_gate [I, H], d_w_up [I, H], d_w_down [H, I], all fp32."""
    x, d_y = x.float(), d_y.float()
    d_w_down = d_y.T @ acts.h  # [H, I]
    d_h = d_y @ w_down.float()  # [n, I]
    d_gate, d_up = swiglu_backward(d_h, acts.gate, acts.up, swiglu_limit)
    d_x = d_gate @ w_gate.float() + d_up @ w_up.float()  # [n, H]
    return d_x, d_gate.T @ x, d_up.T @ x, d_w_down


# --------------------------------------------------------------------------- the layer


def _expert_rows(expert_of_row: torch.Tensor, num_local_experts: int) -> list[torch.Tensor]:
    """For each local expert, the indices of the rows routed to it, ascending."""
    order = torch.argsort(expert_of_row, stable=True)
    counts = torch.bincount(expert_of_row, minlength=num_local_experts).tolist()
    return list(torch.split(order, counts))


def _experts_forward(rows_x, expert_of_row, w_gate, w_up, w_down, swiglu_limit):
    """Runs every row through its local expert; returns y [n, H] and the per-expert rows/acts."""
    num_local_experts, hidden = w_gate.shape[0], w_gate.shape[2]
    y = rows_x.new_zeros(rows_x.shape[0], hidden, dtype=torch.float32)
    saved = []
    for e, rows in enumerate(_expert_rows(expert_of_row, num_local_experts)):
        acts = swiglu_mlp_forward(rows_x[rows], w_gate[e], w_up[e], w_down[e], swiglu_limit)
        y[rows] = acts.y
        saved.append((rows, acts))
    return y, saved


def _experts_backward(d_y, rows_x, saved, w_gate, w_up, w_down, swiglu_limit):
    """d_x per row [n, H] and fp32 weight gradients; experts with no rows get exact zeros."""
    d_x = torch.zeros(rows_x.shape[0], rows_x.shape[1], dtype=torch.float32, device=rows_x.device)
    d_w_gate = torch.zeros(w_gate.shape, dtype=torch.float32, device=w_gate.device)
    d_w_up = torch.zeros_like(d_w_gate)
    d_w_down = torch.zeros(w_down.shape, dtype=torch.float32, device=w_down.device)
    for e, (rows, acts) in enumerate(saved):
        if rows.numel() == 0:
            continue
        d_x[rows], d_w_gate[e], d_w_up[e], d_w_down[e] = swiglu_mlp_backward(
            d_y[rows], rows_x[rows], acts, w_gate[e], w_up[e], w_down[e], swiglu_limit
        )
    return d_x, d_w_gate, d_w_up, d_w_down


def _weighted_sum(y_routes: torch.Tensor, topk_weights: torch.Tensor, base: torch.Tensor | None):
    """out[t] = base[t] + Σ_j w[t,j]·y[t,j], ascending j, fp32. y_routes is [T, topk, H]."""
    out = torch.zeros_like(y_routes[:, 0]) if base is None else base.clone()
    w = topk_weights.float()
    for j in range(y_routes.shape[1]):
        out += w[:, j, None] * y_routes[:, j]
    return out


def _routed_rows(x: torch.Tensor, routed_x: torch.Tensor | None) -> torch.Tensor:
    """[T, H] fp32: what the routed experts read (module docstring, `routed_x`)."""
    if routed_x is None:
        return x.float()
    if routed_x.shape != x.shape:
        raise ValueError(f"routed_x: expected the shape of x {tuple(x.shape)}, got {tuple(routed_x.shape)}")
    return routed_x.float()


def _has_shared(ws_gate, ws_up, ws_down) -> bool:
    present = [w is not None for w in (ws_gate, ws_up, ws_down)]
    if any(present) and not all(present):
        raise ValueError("ws_gate, ws_up, ws_down: give all three shared-expert weights or none")
    return all(present)


def moe_forward(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, topk]
    topk_weights: torch.Tensor,  # [T, topk]
    w_gate: torch.Tensor,  # [E, I, H]
    w_up: torch.Tensor,  # [E, I, H]
    w_down: torch.Tensor,  # [E, H, I]
    ws_gate: torch.Tensor | None = None,  # [I_s, H]
    ws_up: torch.Tensor | None = None,  # [I_s, H]
    ws_down: torch.Tensor | None = None,  # [H, I_s]
    swiglu_limit: float | None = None,
    *,
    routed_x: torch.Tensor | None = None,  # [T, H], x when None
) -> torch.Tensor:
    """The layer's output [T, H] in fp32 (one process holds all E experts)."""
    return _moe_forward_saving(
        x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, swiglu_limit, routed_x
    )[0]


def _moe_forward_saving(
    x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, swiglu_limit, routed_x
):
    num_tokens, topk = topk_ids.shape
    xf = x.float()
    route_x = _routed_rows(x, routed_x).repeat_interleave(topk, dim=0)  # [T*topk, H], row t*topk+j
    y, saved = _experts_forward(route_x, topk_ids.reshape(-1).long(), w_gate, w_up, w_down, swiglu_limit)
    shared = None
    if _has_shared(ws_gate, ws_up, ws_down):
        shared = swiglu_mlp_forward(xf, ws_gate, ws_up, ws_down, swiglu_limit)
    out = _weighted_sum(y.view(num_tokens, topk, -1), topk_weights, None if shared is None else shared.y)
    return out, (route_x, y, saved, shared)


def moe_backward(
    d_out: torch.Tensor,  # [T, H]
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    ws_gate: torch.Tensor | None = None,
    ws_up: torch.Tensor | None = None,
    ws_down: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    *,
    routed_x: torch.Tensor | None = None,
) -> Gradients:
    """Every gradient of the layer, fp32, in the layer's order (recomputes the forward)."""
    num_tokens, topk = topk_ids.shape
    _, (route_x, y, saved, shared) = _moe_forward_saving(
        x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, swiglu_limit, routed_x
    )
    d_out = d_out.float()
    y_routes = y.view(num_tokens, topk, -1)
    d_topk_weights = (y_routes * d_out[:, None, :]).sum(-1)  # [T, topk], exact for any sign of w
    d_y = (topk_weights.float()[:, :, None] * d_out[:, None, :]).reshape(num_tokens * topk, -1)
    d_route_x, d_w_gate, d_w_up, d_w_down = _experts_backward(
        d_y, route_x, saved, w_gate, w_up, w_down, swiglu_limit
    )
    shared_grads = (None, None, None)
    d_x_shared = None
    if shared is not None:
        d_x_shared, *shared_grads = swiglu_mlp_backward(
            d_out, x, shared, ws_gate, ws_up, ws_down, swiglu_limit
        )
    d_x = _weighted_sum(d_route_x.view(num_tokens, topk, -1), torch.ones_like(topk_weights), d_x_shared)
    return Gradients(d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, *shared_grads)


# --------------------------------------------------------------------------- expert parallelism
#
# The same layer with the E experts split over the P ranks of `group`: each rank
# holds its T tokens and its E_l = E/P local experts; global expert e lives on rank e // E_l
# as local expert e % E_l. Each token row travels once to each rank holding at least one of
# its experts (ascending t per destination), with a [topk] row of the local expert ids
# (−1 where route j goes elsewhere) and router weights it needs there. The expert rank
# runs every local route of a row through its expert and sums them,
#     part_p[t] = Σ_{j on p} w[t,j]·y_{e(t,j)}(x_t)      (ascending j, fp32),
# and returns that one row; the source adds out[t] = y_shared[t] + Σ_p part_p[t], ascending
# p, fp32. The backward mirrors it: dOut rows once per (token, rank), dx summed over the
# local routes on the expert rank, d_topk_weights per route. Rows travel by
# `all_to_all_single` with uneven splits; the split sizes are exchanged first and read on
# the host (the reference may sync). Works on gloo (CPU) and NCCL (CUDA): every tensor lives
# on x's device.


class _EPRoutes(NamedTuple):
    """Where this rank's tokens go and what it received, for one call."""

    order: torch.Tensor  # [n_send] (token, destination) pairs t·P + p, grouped by destination rank
    send_counts: list[int]  # [P] token rows sent to each rank
    recv_counts: list[int]  # [P] token rows received from each rank
    recv_x: torch.Tensor  # [n_recv, H] fp32 token rows to run through local experts
    recv_expert: torch.Tensor  # [n_recv, topk] int64 local expert of each route of a row, −1: not here
    recv_weights: torch.Tensor  # [n_recv, topk] fp32 router weights, 0 where not here


def _all_to_all_rows(rows: torch.Tensor, send_counts, recv_counts, group) -> torch.Tensor:
    """Row exchange: rows[sum(send_counts[:p]):...] go to rank p; returns the received rows."""
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group)
    return out


def _check_ep_ids(ids: torch.Tensor, num_experts: int, num_local_experts: int, num_ranks: int, group) -> None:
    """Every rank learns whether any rank has an id out of range, so all raise together
    instead of some waiting forever on a peer that raised."""
    bad = ((ids < 0) | (ids >= num_experts)).any().int().reshape(1)  # [1]
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if bad.item():
        got = f"values in [{ids.min().item()}, {ids.max().item()}] here" if ids.numel() else "none here"
        raise ValueError(
            f"topk_ids: expected global expert ids in [0, {num_experts}) on every rank "
            f"(E_l={num_local_experts} local experts × P={num_ranks} ranks), got {got}"
        )


def _ep_dispatch(routed_x, topk_ids, topk_weights, num_local_experts, group) -> _EPRoutes:
    num_ranks = dist.get_world_size(group)
    num_tokens, topk = topk_ids.shape
    ids = topk_ids.long()  # [T, topk]
    _check_ep_ids(ids, num_local_experts * num_ranks, num_local_experts, num_ranks, group)
    dest = ids // num_local_experts  # [T, topk]
    # 1. The (token, rank) pairs with at least one route, grouped by rank, ascending t in each.
    reaches = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=ids.device)  # [T, P]
    reaches.scatter_(1, dest, True)
    pair = reaches.t().reshape(-1).nonzero().flatten()  # [n_send] p·T + t
    order = pair % num_tokens * num_ranks + pair // num_tokens  # [n_send] t·P + p
    send_counts_t = reaches.sum(0)  # [P]
    # 2. Exchange the counts so every rank knows how many rows it receives from each peer.
    recv_counts_t = torch.empty_like(send_counts_t)
    dist.all_to_all_single(recv_counts_t, send_counts_t, group=group)
    send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()
    # 3. Each pair's token row, and the local ids and weights of the token's routes on that rank.
    tokens, ranks = order // num_ranks, order % num_ranks  # [n_send]
    here = dest[tokens] == ranks[:, None]  # [n_send, topk]
    send_expert = torch.where(here, ids[tokens] % num_local_experts, -1)
    send_weights = torch.where(here, topk_weights.float()[tokens], 0.0)
    recv_x = _all_to_all_rows(routed_x[tokens], send_counts, recv_counts, group)  # [n_recv, H]
    recv_expert = _all_to_all_rows(send_expert, send_counts, recv_counts, group)  # [n_recv, topk]
    recv_weights = _all_to_all_rows(send_weights, send_counts, recv_counts, group)  # [n_recv, topk]
    return _EPRoutes(order, send_counts, recv_counts, recv_x, recv_expert, recv_weights)


def _sum_over_ranks(parts: torch.Tensor, routes: _EPRoutes, num_tokens: int, num_ranks: int, base):
    """[T, H]: base[t] + Σ_p parts[row of (t, p)], ascending p, fp32 (rows in `order`)."""
    per_pair = parts.new_zeros(num_tokens * num_ranks, parts.shape[1])  # [T·P, H], row t·P + p
    per_pair[routes.order] = parts
    return _weighted_sum(per_pair.view(num_tokens, num_ranks, -1), parts.new_ones(num_tokens, num_ranks), base)


def _ep_forward_saving(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, swiglu_limit, group,
                       routed_x):
    num_tokens, topk = topk_ids.shape
    num_ranks = dist.get_world_size(group)
    has_shared = _has_shared(ws_gate, ws_up, ws_down)
    routes = _ep_dispatch(_routed_rows(x, routed_x), topk_ids, topk_weights, w_gate.shape[0], group)
    # 4. The expert rank runs each received row's local routes through their experts:
    #    y [n_recv·topk, H], zeros for routes held elsewhere; then one weighted sum per row.
    route_x = routes.recv_x.repeat_interleave(topk, dim=0)  # [n_recv·topk, H], route i·topk + j
    expert = routes.recv_expert.reshape(-1)  # [n_recv·topk]
    local = (expert >= 0).nonzero().flatten()
    y_local, saved = _experts_forward(route_x[local], expert[local], w_gate, w_up, w_down, swiglu_limit)
    y = route_x.new_zeros(route_x.shape)
    y[local] = y_local
    y_routes = y.view(-1, topk, y.shape[1])  # [n_recv, topk, H]
    parts = _weighted_sum(y_routes, routes.recv_weights, None)  # [n_recv, H]
    # 5. One row per (token, rank) goes back; the source adds its shared expert and the P parts.
    parts_back = _all_to_all_rows(parts, routes.recv_counts, routes.send_counts, group)  # [n_send, H]
    shared = swiglu_mlp_forward(x, ws_gate, ws_up, ws_down, swiglu_limit) if has_shared else None
    out = _sum_over_ranks(parts_back, routes, num_tokens, num_ranks, None if shared is None else shared.y)
    return out, (routes, route_x, local, y_routes, saved, shared)


def ep_moe_forward(
    x: torch.Tensor,  # [T, H] this rank's tokens
    topk_ids: torch.Tensor,  # [T, topk] GLOBAL expert ids in [0, E_l*P)
    topk_weights: torch.Tensor,  # [T, topk]
    w_gate: torch.Tensor,  # [E_l, I, H] this rank's local experts
    w_up: torch.Tensor,  # [E_l, I, H]
    w_down: torch.Tensor,  # [E_l, H, I]
    ws_gate: torch.Tensor | None = None,  # [I_s, H] this rank's copy of the shared expert
    ws_up: torch.Tensor | None = None,  # [I_s, H]
    ws_down: torch.Tensor | None = None,  # [H, I_s]
    swiglu_limit: float | None = None,
    group: dist.ProcessGroup | None = None,  # None = WORLD
    *,
    routed_x: torch.Tensor | None = None,  # [T, H], x when None
) -> torch.Tensor:
    """This rank's layer output [T, H] in fp32 under expert parallelism over `group`.

    A collective: every rank of `group` must call it. Equal, up to fp32 rounding, to the
    rows of `moe_forward` on all ranks' tokens concatenated in rank order with all E experts.
    """
    return _ep_forward_saving(
        x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, swiglu_limit, group, routed_x
    )[0]


def ep_moe_backward(
    d_out: torch.Tensor,  # [T, H]
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, topk] GLOBAL expert ids
    topk_weights: torch.Tensor,  # [T, topk]
    w_gate: torch.Tensor,  # [E_l, I, H]
    w_up: torch.Tensor,  # [E_l, I, H]
    w_down: torch.Tensor,  # [E_l, H, I]
    ws_gate: torch.Tensor | None = None,
    ws_up: torch.Tensor | None = None,
    ws_down: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    group: dist.ProcessGroup | None = None,  # None = WORLD
    *,
    routed_x: torch.Tensor | None = None,
) -> Gradients:
    """This rank's gradients under expert parallelism, fp32, in the layer's order (recomputes the forward).

    d_x and d_topk_weights are for this rank's tokens; d_w_gate/up/down for its E_l local
    experts, summed over the rows every rank sent them. The shared expert is replicated:
    its gradients here come from this rank's tokens only -- per-rank partial sums that the
    caller all-reduces (as data-parallel gradients are); this function does not.
    A collective: every rank of `group` must call it.
    """
    num_tokens, topk = topk_ids.shape
    num_ranks = dist.get_world_size(group)
    _, (routes, route_x, local, y_routes, saved, shared) = _ep_forward_saving(
        x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, swiglu_limit, group, routed_x
    )
    d_out = d_out.float()
    # 1. dOut rows go to the expert ranks once per (token, rank), in the forward's send order.
    tokens = routes.order // num_ranks
    d_out_recv = _all_to_all_rows(d_out[tokens], routes.send_counts, routes.recv_counts, group)  # [n_recv, H]
    # 2. On the expert rank: the router-weight gradient ⟨dOut, y⟩ of each local route (exact for
    #    any sign of w), d_y = w·dOut, the expert backward, dx summed over the row's local routes.
    d_weights_recv = (y_routes * d_out_recv[:, None, :]).sum(-1)  # [n_recv, topk], 0 for routes elsewhere
    d_y = (routes.recv_weights[:, :, None] * d_out_recv[:, None, :]).reshape(-1, d_out.shape[1])
    d_x_local, d_w_gate, d_w_up, d_w_down = _experts_backward(
        d_y[local], route_x[local], saved, w_gate, w_up, w_down, swiglu_limit
    )
    d_route_x = route_x.new_zeros(route_x.shape)
    d_route_x[local] = d_x_local
    d_x_parts = _weighted_sum(d_route_x.view(-1, topk, d_out.shape[1]), routes.recv_weights.new_ones(
        routes.recv_weights.shape), None)  # [n_recv, H]
    # 3. One dx row and the topk router-weight gradients per (token, rank) go back.
    d_x_back = _all_to_all_rows(d_x_parts, routes.recv_counts, routes.send_counts, group)  # [n_send, H]
    d_weights_back = _all_to_all_rows(d_weights_recv, routes.recv_counts, routes.send_counts, group)  # [n_send, topk]
    d_topk_weights = torch.zeros(num_tokens * num_ranks, topk, dtype=torch.float32, device=x.device)
    d_topk_weights[routes.order] = d_weights_back
    # a route's gradient came from its expert's rank; the others' entries are zero
    d_topk_weights = d_topk_weights.view(num_tokens, num_ranks, topk).sum(1)  # [T, topk]
    # 4. The source's shared expert on its own tokens, then d_x = dx_shared + Σ_p dx_p, ascending p.
    shared_grads = (None, None, None)
    d_x_shared = None
    if shared is not None:
        d_x_shared, *shared_grads = swiglu_mlp_backward(d_out, x, shared, ws_gate, ws_up, ws_down, swiglu_limit)
    d_x = _sum_over_ranks(d_x_back, routes, num_tokens, num_ranks, d_x_shared)
    return Gradients(d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, *shared_grads)
