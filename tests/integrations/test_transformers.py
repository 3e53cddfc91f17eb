"""The "mok" experts backend against transformers' own ("eager", "grouped_mm") on tiny random
models of each supported architecture: loss, logits and every parameter's gradient."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mok.integrations.transformers as mok_hf  # noqa: E402  (registers "mok")
from mok.testing import relative_error  # noqa: E402

# Tiny shapes shared by every architecture: H = 64, I = 32, 8 experts, top-2, 2 layers.
_COMMON = dict(
    vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64,
)


def _configs():
    from transformers import (
        DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig,
    )

    return {
        "qwen3_moe": Qwen3MoeConfig(**_COMMON, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
        # The shared expert (and its gate) stays in torch; only the routed experts go to mok.
        "qwen2_moe": Qwen2MoeConfig(**_COMMON, intermediate_size=64, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2),
        "mixtral": MixtralConfig(**_COMMON, head_dim=16, intermediate_size=32, num_local_experts=8,
                                 num_experts_per_tok=2),
        "olmoe": OlmoeConfig(**_COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2),
        "deepseek_v3": DeepseekV3Config(
            **_COMMON, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        ),
    }


CONFIGS = _configs()


def _model(config, implementation: str, device: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, experts_implementation=implementation)
    # transformers leaves some expert weights uninitialised in from_config: draw them all.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05)
    return model.to(device)


def _loss_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().float(), out.logits.detach().float(), grads


def _compare(arch: str, device: str, batch: int = 2, seq: int = 24) -> None:
    """Loss, logits and every gradient of the bf16 model under "mok": within bf16 tolerance of
    "eager", and no further from the fp32 model's (same weights, "eager") than twice what
    transformers' own bf16 backends are (on the CPU "grouped_mm" is often bitwise "eager",
    so the fp32 model is the reference that tells the two apart)."""
    config = CONFIGS[arch]
    model = _model(config, "eager", device)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    results = {}
    for implementation in ("eager", "grouped_mm", "mok"):
        model.set_experts_implementation(implementation)
        results[implementation] = _loss_and_grads(model, input_ids)
    model.float().set_experts_implementation("eager")
    fp32 = _loss_and_grads(model, input_ids)
    loss, eager_loss = results["mok"][0], results["eager"][0]
    assert abs(loss - eager_loss) <= 0.02 * abs(eager_loss), f"{arch=} {device=}: loss {loss} vs eager {eager_loss}"
    assert results["mok"][2].keys() == fp32[2].keys(), f"{arch=}: the parameters with a gradient differ"
    names = ["logits", *fp32[2]]

    def pick(result, name):
        return result[1] if name == "logits" else result[2][name]

    for name in names:
        ours, eager, truth = pick(results["mok"], name), pick(results["eager"], name), pick(fp32, name)
        bf16_err = max(relative_error(pick(results[impl], name), truth) for impl in ("eager", "grouped_mm"))
        err, eager_err = relative_error(ours, truth), relative_error(ours, eager)
        assert eager_err <= 0.02, f"{arch=} {device=} {name}: {eager_err=:.4g} from bf16 eager"
        assert err <= 2 * bf16_err, f"{arch=} {device=} {name}: {err=:.4g} from fp32, transformers' bf16 {bf16_err:.4g}"


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_matches_eager_and_grouped_mm(arch):
    _compare(arch, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_matches_eager_and_grouped_mm_cuda(arch):
    _compare(arch, "cuda", batch=4, seq=64)


def _experts_call(device: str):
    """One Qwen3-MoE experts module called directly, with its routing drawn at random."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = CONFIGS["qwen3_moe"]
    config._experts_implementation = "mok"
    experts = Qwen3MoeExperts(config).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.05)
        experts.down_proj.normal_(0, 0.05)
    x = torch.randn(10, config.hidden_size, device=device, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(config.num_experts, device=device)[:2] for _ in range(10)])
    weights = torch.rand(10, 2, device=device)
    return experts, x, ids, weights


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_weights_are_shared_not_copied(device):
    experts, x, ids, weights = _experts_call(device)
    before = experts(x, ids, weights)
    with torch.no_grad():
        experts.gate_up_proj[3:5, 7].mul_(3.0)  # an in-place update of one expert's gate and up rows
        experts.down_proj[:, 5].add_(0.1)
    after = experts(x, ids, weights)
    assert not torch.equal(before, after), f"{device=}: an in-place weight update left the output unchanged"
    experts.config._experts_implementation = "grouped_mm"
    expected = experts(x, ids, weights)
    assert relative_error(after.float(), expected.float()) < 0.01, f"{device=}: output after the update"


def test_fp32_model_runs_in_bf16_with_fp32_gradients():
    experts, x, ids, weights = _experts_call("cpu")
    experts.float()
    results = {}
    for implementation in ("mok", "eager"):
        experts.config._experts_implementation = implementation
        experts.zero_grad(set_to_none=True)
        x_in = x.float().requires_grad_()
        out = experts(x_in, ids, weights)
        out.square().sum().backward()
        results[implementation] = (out.detach(), x_in.grad, experts.gate_up_proj.grad, experts.down_proj.grad)
    for name, ours, eager in zip(("out", "d_x", "d_gate_up_proj", "d_down_proj"), *results.values()):
        assert ours.dtype == torch.float32, f"{name}: expected the model's dtype, got {ours.dtype}"
        assert relative_error(ours, eager) < 0.01, f"{name}: {relative_error(ours, eager)=}"


def test_unsupported_model_raises_when_set():
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(**{**_COMMON, "num_hidden_layers": 1}, head_dim=16, intermediate_size=32,
                          num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"GptOssExperts.*biases.*_apply_gate"):
        model.set_experts_implementation("mok")
    with pytest.raises(ValueError, match="GptOssExperts"):
        AutoModelForCausalLM.from_config(config, experts_implementation="mok")


def test_registered_name_and_config():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert mok_hf.NAME in ALL_EXPERTS_FUNCTIONS
    with pytest.raises(TypeError, match="config"):
        mok_hf.register(config="bf16")


def test_register_another_precision():
    import mok

    experts, x, ids, weights = _experts_call("cpu")
    expected = experts(x, ids, weights)
    mok_hf.register(mok.MoKConfig(precision="mxfp8"))
    try:
        out = experts(x, ids, weights)
    finally:
        mok_hf.register()
    err = relative_error(out.float(), expected.float())
    assert 0 < err < 0.1, f"mxfp8 output {err=} from bf16's"


def test_gradient_checkpointing_and_no_grad():
    """Activation checkpointing reruns mok's forward inside the backward: the same loss and
    gradients; under no_grad (generation, evaluation) the same logits."""
    config = CONFIGS["qwen3_moe"]
    model = _model(config, "mok", "cpu")
    input_ids = torch.randint(0, config.vocab_size, (2, 16))
    loss, logits, grads = _loss_and_grads(model, input_ids)
    model.gradient_checkpointing_enable()
    model.train()
    ckpt_loss, _, ckpt_grads = _loss_and_grads(model, input_ids)
    assert torch.equal(loss, ckpt_loss)
    assert all(torch.equal(grads[name], ckpt_grads[name]) for name in grads), "gradients under checkpointing"
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits.float(), logits)


@pytest.mark.gpu
def test_experts_call_needs_no_host_sync():
    experts, x, ids, weights = _experts_call("cuda")
    x.requires_grad_()
    experts(x, ids, weights).sum().backward()  # first call: compiles, builds the workspace
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        experts(x, ids, weights).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _triton_device() -> str:
    """Where mok's triton backend runs here: the CPU under TRITON_INTERPRET=1, else CUDA."""
    from mok.kernels.common import interpreting

    if interpreting():
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("the triton backend needs TRITON_INTERPRET=1 or a CUDA device")
    return "cuda"


def test_triton_backend_matches_the_reference_backend():
    """The GPU path (gate_up_proj copied into mok's packed layout, its gradient reassembled)
    against the reference backend's views, through the experts interface."""
    import mok

    experts, x, ids, weights = _experts_call(_triton_device())
    results = {}
    for backend in ("triton", "reference"):
        mok_hf.register(mok.MoKConfig(backend=backend))
        experts.zero_grad(set_to_none=True)
        x_in, w_in = x.clone().requires_grad_(), weights.clone().requires_grad_()
        try:
            out = experts(x_in, ids, w_in)
        finally:
            mok_hf.register()
        out.float().square().sum().backward()
        results[backend] = (out, x_in.grad, w_in.grad, experts.gate_up_proj.grad, experts.down_proj.grad)
    names = ("out", "d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj")
    for name, ours, reference in zip(names, *results.values()):
        err = relative_error(ours.float(), reference.float())
        assert err < 0.01, f"{name}: triton backend {err=:.4g} from the reference backend"


def test_unaligned_sizes_raise_when_set():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(**_COMMON, head_dim=16, intermediate_size=64, moe_intermediate_size=12, num_experts=4,
                            num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts.*intermediate size 12 as multiples of 8"):
        model.set_experts_implementation("mok")
