"""The implementations mok is measured against, computing the same layer.

`torch_moe` is the pure-PyTorch layer the way torchtitan builds it: sort the routes by
expert, gather their token rows, one grouped GEMM each for gate, up and down
(`torch._grouped_mm` on CUDA), SwiGLU, scale by the router weight, `index_add` back into an
fp32 buffer, add the shared expert, cast to bf16. It is differentiable by autograd with
respect to x, topk_weights and every weight. `torch.compile(torch_moe, dynamic=False)` is
the compiled baseline.

`torch_ep_moe` is the same layer under expert parallelism, the way torchtitan builds it:
the ranks exchange how many rows each sends each expert, copy the splits to the host
(`.tolist()`, a sync: that is the baseline's real cost), move the rows with the autograd
`all_to_all_single` (`all_to_all_single_autograd` of `_functional_collectives`, which
torchtitan calls), regroup them by local expert, run the same expert GEMMs, send the
results back and add them into the fp32 buffer as `torch_moe` does.

`SonicMoE` wraps SonicMoE (Dao-AILab, pip `sonic-moe`) through its general-routing entry
point, so it runs with *our* topk_ids and topk_weights and computes the same function.

Legend: T tokens, H hidden, I expert intermediate, I_s shared intermediate, E experts,
topk routes per token, M = T·topk routes.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

__all__ = ["torch_moe", "torch_ep_moe", "grouped_mm_available", "SonicMoE", "sonicmoe_available"]


def grouped_mm_available(device: torch.device | str) -> bool:
    """True where `torch._grouped_mm` runs its fused kernel: CUDA (SM80+)."""
    return torch.device(device).type == "cuda" and hasattr(torch, "_grouped_mm")


def _swiglu_dense(x, w_gate, w_up, w_down):
    """One SwiGLU MLP in the input dtype: (silu(x Wgᵀ) · x Wuᵀ) Wdᵀ."""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def _experts_grouped_mm(x_sorted, counts, w_gate, w_up, w_down):
    """All experts at once with `torch._grouped_mm`; rows of x_sorted grouped by expert.

    `offs[e]` is where expert e's rows end (int32, as `_grouped_mm` requires). Weights are
    [E, out, in], so `w.transpose(-2, -1)` is the [E, in, out] column-major operand the
    kernel wants for `x @ w[e].T`. No host sync: the offsets stay on the device.
    """
    offs = torch.cumsum(counts, dim=0).to(torch.int32)  # [E]
    gate = torch._grouped_mm(x_sorted, w_gate.transpose(-2, -1), offs=offs)  # [M, I]
    up = torch._grouped_mm(x_sorted, w_up.transpose(-2, -1), offs=offs)  # [M, I]
    h = F.silu(gate) * up  # [M, I]
    return torch._grouped_mm(h, w_down.transpose(-2, -1), offs=offs)  # [M, H]


def _experts_loop(x_sorted, counts, w_gate, w_up, w_down):
    """One matmul chain per expert: torchtitan's fallback where `_grouped_mm` is missing.

    `counts.tolist()` is a host sync, as in torchtitan's loop path.
    """
    chunks = torch.split(x_sorted, counts.tolist())
    ys = [_swiglu_dense(rows, w_gate[e], w_up[e], w_down[e]) for e, rows in enumerate(chunks)]
    return torch.cat(ys)  # [M, H]


def _sort_by_expert(flat_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [M]: route indices t·topk+j sorted by expert, counts [E] int64: routes per expert).

    Stable, so each expert sees its rows in ascending t·topk+j. Counts by scatter_add, not
    bincount: bincount's output size depends on the data, which torch.compile(dynamic=False)
    cannot trace without a graph break.
    """
    order = torch.argsort(flat_ids, stable=True)  # [M]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # [E]
    return order, counts


def _run_experts(x_sorted, counts, w_gate, w_up, w_down, grouped: bool) -> torch.Tensor:
    """Unweighted expert outputs [M, H] of rows grouped by expert (counts [E] rows each)."""
    experts = _experts_grouped_mm if grouped else _experts_loop
    return experts(x_sorted, counts, w_gate, w_up, w_down)


def _weighted_combine(x, y_sorted, order, topk_weights, shared) -> torch.Tensor:
    """out [T, H] bf16: Σ_j w[t,j]·y[t,j] added with `index_add` into an fp32 buffer, plus
    the shared expert (dense over all tokens, `shared` = (ws_gate, ws_up, ws_down) or Nones),
    in fp32 before the one final cast. y_sorted [M, H] holds route order[i] in row i."""
    num_tokens, hidden = x.shape
    token_of_route = order // topk_weights.shape[1]  # [M]
    w_sorted = topk_weights.reshape(-1)[order].float()  # [M]
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    out = out.index_add(0, token_of_route, y_sorted.float() * w_sorted[:, None])  # [T, H] fp32
    if shared[0] is not None:
        out = out + _swiglu_dense(x, *shared).float()
    return out.to(torch.bfloat16)


def torch_moe(
    x: torch.Tensor,  # [T, H] bf16
    topk_ids: torch.Tensor,  # [T, topk] int
    topk_weights: torch.Tensor,  # [T, topk] fp32
    w_gate: torch.Tensor,  # [E, I, H]
    w_up: torch.Tensor,  # [E, I, H]
    w_down: torch.Tensor,  # [E, H, I]
    ws_gate: torch.Tensor | None = None,  # [I_s, H]
    ws_up: torch.Tensor | None = None,  # [I_s, H]
    ws_down: torch.Tensor | None = None,  # [H, I_s]
    *,
    grouped: bool | None = None,
) -> torch.Tensor:
    """The layer in plain PyTorch ops: out [T, H] bf16.

    grouped: use `torch._grouped_mm` (default: where it has a fused kernel, i.e. CUDA) or a
    per-expert loop of matmuls.
    """
    if grouped is None:
        grouped = grouped_mm_available(x.device)
    topk = topk_ids.shape[1]
    # 1. Routes sorted by expert (scatter_add wants int64 indices).
    order, counts = _sort_by_expert(topk_ids.reshape(-1).long(), w_gate.shape[0])  # [M], [E]
    # 2. Gather the token rows, run the experts (unweighted y, bf16).
    y = _run_experts(x[order // topk], counts, w_gate, w_up, w_down, grouped)  # [M, H]
    # 3. Router weight in fp32, index_add back, shared expert, one final cast.
    return _weighted_combine(x, y, order, topk_weights, (ws_gate, ws_up, ws_down))


def torch_ep_moe(
    x: torch.Tensor,  # [T, H] bf16, this rank's tokens
    topk_ids: torch.Tensor,  # [T, topk] int, GLOBAL expert ids in [0, E_l·P)
    topk_weights: torch.Tensor,  # [T, topk] fp32
    w_gate: torch.Tensor,  # [E_l, I, H] this rank's local experts
    w_up: torch.Tensor,  # [E_l, I, H]
    w_down: torch.Tensor,  # [E_l, H, I]
    ws_gate: torch.Tensor | None = None,  # [I_s, H] this rank's copy of the shared expert
    ws_up: torch.Tensor | None = None,  # [I_s, H]
    ws_down: torch.Tensor | None = None,  # [H, I_s]
    *,
    group: dist.ProcessGroup | None = None,
    grouped: bool | None = None,
) -> torch.Tensor:
    """This rank's out [T, H] bf16 under expert parallelism over `group` (None: WORLD);
    global expert e lives on rank e // E_l. A collective: every rank of `group` calls it.
    Differentiable by autograd; the shared expert's weight gradients are this rank's part.
    """
    if grouped is None:
        grouped = grouped_mm_available(x.device)
    group = dist.group.WORLD if group is None else group  # the functional collectives take no None
    num_ranks = dist.get_world_size(group)
    num_local_experts = w_gate.shape[0]
    topk = topk_ids.shape[1]
    # 1. Routes sorted by global expert: grouped by destination rank, then by local expert.
    order, counts = _sort_by_expert(topk_ids.reshape(-1).long(), num_local_experts * num_ranks)  # [M], [P·E_l]
    # 2. Rows per (source rank, local expert) this rank receives; the splits go to the host
    #    in one copy (a sync), as all_to_all_single takes them as Python ints.
    recv_counts = torch.empty_like(counts)  # [P·E_l]: block p = what rank p sends each local expert here
    dist.all_to_all_single(recv_counts, counts, group=group)
    splits = torch.cat([counts.view(num_ranks, -1).sum(1), recv_counts.view(num_ranks, -1).sum(1)]).tolist()
    send_splits, recv_splits = splits[:num_ranks], splits[num_ranks:]
    num_recv = sum(recv_splits)
    # 3. Dispatch: every route's token row to its expert's rank.
    # x_recv [N, H] is ordered by (source rank, local expert).
    x_recv = funcol.all_to_all_single_autograd(x[order // topk], recv_splits, send_splits, group)
    # 4. Regroup by local expert (stable: by source rank within an expert), run the experts, undo.
    local_expert = torch.arange(num_local_experts, device=x.device).repeat(num_ranks)  # [P·E_l]
    expert_of_row = local_expert.repeat_interleave(recv_counts, output_size=num_recv)  # [N]
    regroup = torch.argsort(expert_of_row, stable=True)  # [N]
    local_counts = recv_counts.view(num_ranks, -1).sum(0)  # [E_l]
    y_grouped = _run_experts(x_recv[regroup], local_counts, w_gate, w_up, w_down, grouped)  # [N, H]
    y_recv = torch.empty_like(y_grouped)
    y_recv[regroup] = y_grouped  # [N, H] back in arrival order
    # 5. Combine: the rows go back to their source, in the order they were sent (= `order`).
    y_sorted = funcol.all_to_all_single_autograd(y_recv, send_splits, recv_splits, group)  # [M, H]
    return _weighted_combine(x, y_sorted, order, topk_weights, (ws_gate, ws_up, ws_down))


# --------------------------------------------------------------------------- SonicMoE


def sonicmoe_available() -> bool:
    """True when a `sonicmoe` package can be found (without importing it: that is slow)."""
    try:
        return importlib.util.find_spec("sonicmoe") is not None
    except (ImportError, ValueError):
        return False


class SonicMoE:
    """SonicMoE's layer on our routing and weights (SonicMoE has no shared expert: that one
    runs as `torch_moe` does, in bf16 matmuls, added in fp32 before the final cast).

    Uses `sonicmoe.moe_general_routing_inputs(x, router_scores, token_indices,
    expert_indices, w1, b1, w2, b2, E, stream_id, activation_type)` (sonic-moe 0.1.2.post1):
    routes flattened in ascending token order (its contract), int32 ids, fp32 scores;
    w1 (2I, H, E) = permute(1, 2, 0) of a contiguous [E, 2I, H] whose rows interleave
    gate and up (gate_0, up_0, gate_1, up_1, ...: its default layout); w2 (H, I, E) =
    permute(1, 2, 0) of our contiguous w_down [E, H, I], a view.

    The interleaved w1 is built once here, outside any timed region, as its own leaf
    (a SonicMoE model would store its weights that way); `gradients` maps its gradient
    back to d_w_gate and d_w_up. Raises ImportError/AttributeError/TypeError when the
    installed package lacks what this needs, so the caller can report a skip.
    """

    def __init__(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None):
        sonicmoe = importlib.import_module("sonicmoe")
        self._fn = getattr(sonicmoe, "moe_general_routing_inputs", None)
        if self._fn is None:
            functional = importlib.import_module("sonicmoe.functional")
            self._fn = functional.moe_general_routing_inputs
        self._swiglu = importlib.import_module("sonicmoe.enums").ActivationType.SWIGLU
        num_tokens, topk = topk_ids.shape
        num_experts, inter, hidden = w_gate.shape
        self.num_experts = num_experts
        self.x, self.topk_weights, self.w_down = x, topk_weights, w_down
        self.shared = (ws_gate, ws_up, ws_down) if ws_gate is not None else None
        with torch.no_grad():
            w1 = torch.stack([w_gate, w_up], dim=2).reshape(num_experts, 2 * inter, hidden)  # [E, 2I, H]
        self.w1 = w1.contiguous().requires_grad_(w_gate.requires_grad)
        self.token_indices = torch.arange(num_tokens, device=x.device, dtype=torch.int32).repeat_interleave(topk)  # [M]
        self.expert_indices = topk_ids.reshape(-1).to(torch.int32).contiguous()  # [M]
        # SonicMoE only runs on CUDA; elsewhere it raises on its own (the tests run a fake on CPU).
        self.stream_id = torch.cuda.current_stream(x.device).cuda_stream if x.device.type == "cuda" else 0
        # An API that changed shape should be a clear skip, not a crash mid-benchmark.
        try:
            signature = inspect.signature(self._fn)
        except (TypeError, ValueError):
            signature = None  # not introspectable: the first call will tell
        if signature is not None:
            try:
                signature.bind(*self._args())
            except TypeError as exc:
                raise TypeError(f"moe_general_routing_inputs{signature} does not take (x, router_scores, "
                                f"token_indices, expert_indices, w1, b1, w2, b2, E, stream_id, activation_type): "
                                f"{exc}") from exc

    @property
    def grad_inputs(self) -> tuple[torch.Tensor, ...]:
        """The leaves to differentiate, in the order `gradients` expects."""
        return (self.x, self.topk_weights, self.w1, self.w_down, *(self.shared or ()))

    def gradients(self, grads):
        """(d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down)."""
        d_x, d_topk_weights, d_w1, d_w_down, *d_shared = grads
        d_w1 = d_w1.reshape(self.num_experts, -1, 2, d_w1.shape[-1])  # [E, I, 2, H]
        shared = tuple(d_shared) if d_shared else (None, None, None)
        return (d_x, d_topk_weights, d_w1[:, :, 0], d_w1[:, :, 1], d_w_down, *shared)

    def _args(self) -> tuple:
        return (
            self.x,
            self.topk_weights.reshape(-1),  # [M] fp32, route t·topk+j
            self.token_indices,
            self.expert_indices,
            self.w1.permute(1, 2, 0),  # (2I, H, E)
            None,
            self.w_down.permute(1, 2, 0),  # (H, I, E)
            None,
            self.num_experts,
            self.stream_id,
            self._swiglu,
        )

    def __call__(self) -> torch.Tensor:
        out, _ = self._fn(*self._args())
        if self.shared is not None:
            out = (out.float() + _swiglu_dense(self.x, *self.shared).float()).to(torch.bfloat16)
        return out
