"""mok's torchtitan modules against torchtitan's own on a tiny MoE: output, input and
parameter gradients, the expert-load counts, and the config switch."""

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter  # noqa: E402
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

from mok.integrations.torchtitan import MoKGroupedExperts, MoKRoutedExperts, use_mok  # noqa: E402
from mok.testing import relative_error  # noqa: E402

D, F, E, K = 64, 32, 8, 2  # dim, hidden_dim, experts, top-k
# torchtitan's router asks for an fp32 autocast, which the CPU does not have (it warns).
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")


def _moe_config(top_k: int = K) -> MoE.Config:
    return MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=top_k),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=D, out_features=E), top_k=top_k, score_func="softmax"
        ),
        load_balance_coeff=None,
    )


def _run(module, x):
    """Output, d_x and every parameter's gradient (fp32) of sum(out²)."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = module(x)
    out.float().square().sum().backward()
    grads = {name: p.grad.float() for name, p in module.named_parameters()}
    return {"out": out.detach().float(), "d_x": x.grad.float(), **grads}


def _assert_matches(ours: dict, theirs: dict, what: str) -> None:
    """Within bf16 tolerance of torchtitan's module (which computes its experts in bf16, h
    included, where mok keeps h in fp32)."""
    assert ours.keys() == theirs.keys(), f"{what}: {sorted(ours)} vs {sorted(theirs)}"
    for name in ours:
        err = relative_error(ours[name], theirs[name])
        assert err <= 0.02, f"{what} {name}: {err=:.4g} from torchtitan's"


def _both(build_ours, build_theirs, x):
    """(mok module, torchtitan's) in bf16 on the same random weights."""
    torch.manual_seed(0)
    theirs = build_theirs()
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(0, 0.1)
    ours = build_ours()
    ours.load_state_dict(theirs.state_dict())
    return _run(ours.bfloat16(), x), _run(theirs.bfloat16(), x)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("whole_layer", [True, False])
@pytest.mark.parametrize("top_k", [1, K])
def test_moe_layer_matches_torchtitan(device, whole_layer, top_k):
    x = torch.randn(2, 13, D, dtype=torch.bfloat16)
    with torch.device(device):
        ours, theirs = _both(
            lambda: use_mok(_moe_config(top_k), whole_layer=whole_layer).build(),
            lambda: _moe_config(top_k).build(),
            x.to(device),
        )
    _assert_matches(ours, theirs, f"{device=} {whole_layer=} {top_k=}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_grouped_experts_with_padding_and_an_empty_expert(device):
    counts = torch.tensor([3, 0, 5, 1, 2, 0, 4, 1], device=device)  # 16 rows, experts 1 and 5 empty
    x = torch.randn(19, D, dtype=torch.bfloat16, device=device)  # 3 padding rows past the counts
    config = GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E)
    with torch.device(device):
        theirs = GroupedExperts(config)
        with torch.no_grad():
            for param in theirs.parameters():
                param.normal_(0, 0.1)
        ours = MoKGroupedExperts(MoKGroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E))
    ours.load_state_dict(theirs.state_dict())
    results, outputs = [], []
    for module in (ours, theirs):
        x_in = x.clone().requires_grad_()
        out = module(x_in, counts)
        out[:16].float().square().sum().backward()  # torchtitan leaves padding rows' output undefined
        outputs.append(out.detach())
        results.append({"out": out[:16].float(), "d_x": x_in.grad[:16].float(),
                        **{n: p.grad.float() for n, p in module.named_parameters()}})
    assert torch.equal(outputs[0][16:], torch.zeros_like(outputs[0][16:])), f"{device=}: padding rows not zero"
    for name in results[0]:
        err = relative_error(results[0][name], results[1][name])
        assert err <= 0.02, f"{device=} {name}: {err=:.4g} from torchtitan's GroupedExperts"
    for e in (1, 5):
        assert torch.equal(ours.w1_EFD.grad[e], torch.zeros_like(ours.w1_EFD.grad[e])), f"empty expert {e}"


def test_counts_equal_a_plain_count():
    moe = use_mok(_moe_config(), count_tokens=True).build()
    assert isinstance(moe.routed_experts, MoKRoutedExperts)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.1)
    x = torch.randn(3, 7, D)
    _, ids, _ = moe.router(x)
    moe(x)
    expected = torch.bincount(ids.flatten(), minlength=E)
    assert torch.equal(moe.routed_experts.global_tokens_per_expert_E, expected)


def test_use_mok_errors_and_idempotence():
    config = use_mok(use_mok(_moe_config()))
    assert type(config.routed_experts) is MoKRoutedExperts.Config
    inner = use_mok(_moe_config(), whole_layer=False).routed_experts.inner_experts
    assert type(inner) is MoKGroupedExperts.Config
    with pytest.raises(ValueError, match="model_config"):
        use_mok(Linear.Config(in_features=D, out_features=E))
    with pytest.raises(ValueError, match="count_tokens"):
        use_mok(_moe_config(), whole_layer=False, count_tokens=True)


def _routed_experts(num_experts: int, world_size: int = 1) -> MoKRoutedExperts:
    config = MoKRoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=num_experts),
        token_dispatcher=LocalTokenDispatcher.Config(num_experts=num_experts, top_k=K),
    )
    return config.build()


def _ep_rank(rank: int, world_size: int) -> dict[str, float]:
    """MoKRoutedExperts holding this rank's experts under an EP group, against the whole
    layer on one process over every rank's tokens: relative errors of out, d_x, weight grads,
    and whether the global token counts differ from a plain count of every rank's ids."""
    import torch.distributed as dist

    from mok.testing import make_topk_ids

    T, E_l = 6, E // world_size
    torch.manual_seed(0)  # every rank draws the same full weights and every rank's tokens
    full = _routed_experts(E)
    with torch.no_grad():
        for param in full.parameters():
            param.normal_(0, 0.1)
    x = torch.randn(world_size, 1, T, D, dtype=torch.bfloat16)
    ids = torch.stack([make_topk_ids(T, E, K) for _ in range(world_size)]).view(world_size, 1, T, K)
    scores = torch.rand(world_size, 1, T, K)
    counts = torch.zeros(E)  # unread by mok
    local = _routed_experts(E)
    local.inner_experts.w1_EFD = torch.nn.Parameter(full.inner_experts.w1_EFD[rank * E_l:(rank + 1) * E_l].clone())
    local.inner_experts.w2_EDF = torch.nn.Parameter(full.inner_experts.w2_EDF[rank * E_l:(rank + 1) * E_l].clone())
    local.inner_experts.w3_EFD = torch.nn.Parameter(full.inner_experts.w3_EFD[rank * E_l:(rank + 1) * E_l].clone())
    local.ep_group, local.count_tokens = dist.group.WORLD, True
    results = []
    for module, x_in, ids_in, scores_in in (
        (local, x[rank], ids[rank], scores[rank]),
        (full, x.view(1, world_size * T, D), ids.view(1, world_size * T, K), scores.view(1, world_size * T, K)),
    ):
        x_in = x_in.clone().requires_grad_()
        out = module(x_in, scores_in, ids_in, counts)
        out.float().square().sum().backward()
        results.append((out.detach().float(), x_in.grad.float(), module.inner_experts))
    (out, d_x, ours), (full_out, full_d_x, theirs) = results
    rows = slice(rank * T, (rank + 1) * T)
    errors = {"out": relative_error(out, full_out[:, rows]), "d_x": relative_error(d_x, full_d_x[:, rows])}
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        errors[name] = relative_error(getattr(ours, name).grad.float(),
                                      getattr(theirs, name).grad[rank * E_l:(rank + 1) * E_l].float())
    counted = torch.equal(local.global_tokens_per_expert_E, torch.bincount(ids.flatten(), minlength=E))
    return {**errors, "counts differ": float(not counted)}


def test_routed_experts_under_an_ep_group():
    from mok.testing.distributed import run_distributed

    for rank, errors in enumerate(run_distributed(_ep_rank, 2, timeout_s=180)):
        assert all(err < 0.01 for err in errors.values()), f"{rank=}: {errors}"


@pytest.mark.parametrize("whole_layer", [True, False])
def test_triton_backend_matches_the_reference_backend(whole_layer):
    from mok import MoKConfig
    from mok.kernels.common import interpreting

    if not interpreting() and not torch.cuda.is_available():
        pytest.skip("the triton backend needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cpu" if interpreting() else "cuda"
    torch.manual_seed(0)
    with torch.device(device):
        moe = use_mok(_moe_config(), whole_layer=whole_layer).build()
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.1)
    moe.bfloat16()
    mok_module = moe.routed_experts if whole_layer else moe.routed_experts.inner_experts
    x = torch.randn(2, 9, D, dtype=torch.bfloat16, device=device)
    results = []
    for backend in ("triton", "reference"):
        mok_module.mok_config = MoKConfig(backend=backend)
        results.append(_run(moe, x))
    _assert_matches(*results, f"triton vs reference {whole_layer=}")
