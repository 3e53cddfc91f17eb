"""mok as a Hugging Face transformers experts backend.

    import mok.integrations.transformers  # registers "mok"
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="mok")
    model.set_experts_implementation("mok")  # or switch a loaded model

Every MoE layer's routed experts (the `@use_experts_implementation` experts modules:
Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, ...) then run through mok's forward and
backward on the module's own `gate_up_proj` [E, 2·I, H] and `down_proj` [E, H, I]; the
model's router and shared expert stay in torch. Gradients reach those parameters.

Weights: on the reference backend (CPU) mok reads the two halves of `gate_up_proj` as views.
The triton backend (CUDA) reads contiguous [E, I, H] weights, so each call copies
`gate_up_proj` into mok's packed [2, E, I, H] gate/up layout (one copy kernel, freed after
the forward; the backward makes it again instead of keeping it), which always reflects
in-place weight updates; `d_gate_up_proj` is the two halves' gradients concatenated.

Dtypes: mok computes in bf16 (fp32 accumulation). A bf16 model runs as it is; for another
dtype (e.g. an fp32 model on CPU) the hidden states and expert weights are cast to bf16 on
the way in (autograd carries the gradients back in the model's dtype) and the output is
cast back, so results are bf16-accurate.

Experts the backend cannot run (biases, gpt-oss's clamped `(up + 1)·gate·sigmoid(α·gate)`,
transposed or interleaved gate/up layouts, non-SiLU activations, transformers' own expert
parallelism) raise a ValueError naming what is missing when the implementation is set.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate
from transformers.modeling_utils import PreTrainedModel

from mok.config import SIZE_ALIGNMENT, MoKConfig
from mok.functional import _autograd_keeps_graph, backward, build_schedule, forward, get_workspace

NAME = "mok"
_CONFIGS: dict[str, MoKConfig] = {}


def is_experts_module(module: nn.Module) -> bool:
    """A module built under transformers' `@use_experts_implementation` (it sets these flags)."""
    return all(hasattr(module, flag) for flag in ("has_gate", "has_bias", "is_transposed", "is_concatenated"))


def unsupported_features(experts: nn.Module) -> list[str]:
    """What this experts module needs that mok's math does not have, under the registered
    config's precision (empty when it can run)."""
    missing = []
    if not experts.has_gate:
        missing.append("ungated experts (mok runs SwiGLU: silu(x·Wg)·(x·Wu))")
    if experts.has_bias:
        missing.append("expert biases (gate_up_proj_bias, down_proj_bias)")
    if getattr(experts, "has_post_expert_norm", False):
        missing.append("a post-expert norm")
    if experts.is_transposed:
        missing.append("the transposed [E, H, 2·I] weight layout")
    if not experts.is_concatenated:
        missing.append("interleaved gate/up columns")
    if type(experts)._apply_gate is not _default_apply_gate:
        missing.append(f"its own gate function {type(experts).__name__}._apply_gate (mok computes silu(gate)·up)")
    elif not isinstance(getattr(experts, "act_fn", None), (nn.SiLU, SiLUActivation)):
        missing.append(f"activation {type(getattr(experts, 'act_fn', None)).__name__} (mok's SwiGLU uses SiLU)")
    if getattr(experts, "_is_expert_parallel", False):
        missing.append("transformers' expert parallelism (use mok.MoKMoE with ep_group)")
    weights = (getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None))
    if not missing and not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
        missing.append("3-D gate_up_proj and down_proj parameters")
    elif not missing:
        _, two_inter, hidden = experts.gate_up_proj.shape
        precision = _CONFIGS[NAME].precision
        align = SIZE_ALIGNMENT[precision]
        if two_inter % (2 * align) or hidden % align:
            missing.append(f"hidden size {hidden} and intermediate size {two_inter // 2} as multiples of {align} "
                           f"(mok's {precision} alignment)")
    return missing


def check_model(model: nn.Module) -> None:
    """Raises a ValueError naming each experts module of `model` that mok cannot run."""
    problems = [
        f"{name or type(model).__name__} ({type(module).__name__}): {', '.join(missing)}"
        for name, module in model.named_modules()
        if is_experts_module(module) and (missing := unsupported_features(module))
    ]
    if problems:
        raise ValueError(
            f'experts_implementation="{NAME}": these experts modules need what mok does not support: '
            + "; ".join(problems)
        )


def _gate_up_operands(gate_up_proj: torch.Tensor, backend: str, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w_gate, w_up [E, I, H] from the fused gate_up_proj [E, 2·I, H]: views where the backend
    reads strided weights (the reference's torch ops in bf16), else one copy into mok's packed
    [2, E, I, H] layout (the triton kernels read contiguous weights through TMA descriptors)."""
    inter = gate_up_proj.shape[1] // 2
    if backend == "reference" and precision == "bf16":
        return gate_up_proj[:, :inter], gate_up_proj[:, inter:]
    return gate_up_proj.unflatten(1, (2, inter)).transpose(0, 1).contiguous().unbind(0)


class _FusedGateUpExperts(torch.autograd.Function):
    """mok's forward and backward on transformers' fused expert weights; neither the gate/up
    copy (triton) nor anything else of the weights is kept between forward and backward."""

    @staticmethod
    def forward(ctx, config, x, topk_ids, topk_weights, gate_up_proj, down_proj):
        num_tokens, hidden = x.shape
        workspace = get_workspace(
            config, None, device=x.device, num_local_tokens=num_tokens, hidden_size=hidden, topk=topk_ids.shape[1]
        )
        schedule = build_schedule(
            workspace, config, topk_ids, num_local_experts=gate_up_proj.shape[0], has_shared_expert=False
        )
        w_gate, w_up = _gate_up_operands(gate_up_proj, schedule.backend, config.precision)
        out, context = forward(
            config, workspace, schedule, x, topk_weights, None, None, None, w_gate, w_up, down_proj,
            needs_backward=any(ctx.needs_input_grad),
        )
        ctx.save_for_backward(x, topk_weights, gate_up_proj, down_proj)
        ctx.state = (config, workspace, schedule, context)
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, topk_weights, gate_up_proj, down_proj = ctx.saved_tensors
        config, workspace, schedule, context = ctx.state
        w_gate, w_up = _gate_up_operands(gate_up_proj, schedule.backend, config.precision)
        grads = backward(
            config, workspace, schedule, context, d_out.contiguous(), x, topk_weights, None, None, None,
            w_gate, w_up, down_proj, release_context=not _autograd_keeps_graph(),
        )
        d_gate_up = torch.cat((grads.d_w_gate, grads.d_w_up), dim=1) if ctx.needs_input_grad[4] else None
        return None, grads.d_x, None, grads.d_topk_weights, d_gate_up, grads.d_w_down


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)


def experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    config: MoKConfig | None = None,
) -> torch.Tensor:
    """The experts interface's call: hidden_states [T, H], top_k_index [T, topk] expert ids,
    top_k_weights [T, topk] -> [T, H] in hidden_states' dtype."""
    missing = unsupported_features(self)
    if missing:
        raise ValueError(f'experts_implementation="{NAME}": {type(self).__name__} needs {", ".join(missing)}')
    out = _FusedGateUpExperts.apply(
        MoKConfig() if config is None else config,
        _bf16(hidden_states).contiguous(),
        top_k_index.contiguous(),
        top_k_weights.float().contiguous(),
        _bf16(self.gate_up_proj),
        _bf16(self.down_proj),
    )
    return out.to(hidden_states.dtype)


def _mok_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    return experts_forward(self, hidden_states, top_k_index, top_k_weights, config=_CONFIGS.get(NAME))


_original_get_correct_experts_implementation = PreTrainedModel.get_correct_experts_implementation
_original_post_init = PreTrainedModel.post_init


# transformers validates an implementation's name only (and at `__init__`'s start, before the
# modules exist); these two hooks add mok's check of the model's experts modules, so that
# `from_pretrained(..., experts_implementation="mok")` (checked once the modules are built,
# by `post_init`) and `set_experts_implementation("mok")` fail at once, not at a forward.
def _get_correct_experts_implementation(self, requested_experts):
    applicable = _original_get_correct_experts_implementation(self, requested_experts)
    if applicable == NAME:
        check_model(self)
    return applicable


def _post_init(self):
    _original_post_init(self)
    if getattr(self.config, "_experts_implementation", None) == NAME:
        check_model(self)


def register(config: MoKConfig | None = None) -> None:
    """Registers (again) the `"mok"` experts implementation, running under `config`
    (default `MoKConfig()`: bf16, backend "auto"). Importing this module calls it once."""
    if config is not None and not isinstance(config, MoKConfig):
        raise TypeError(f"config: expected a MoKConfig or None, got {type(config).__name__}")
    _CONFIGS[NAME] = MoKConfig() if config is None else config
    ExpertsInterface.register(NAME, _mok_experts_forward)
    PreTrainedModel.get_correct_experts_implementation = _get_correct_experts_implementation
    PreTrainedModel.post_init = _post_init


register()
