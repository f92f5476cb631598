"""The MoE layer on one process: routing, capacity rule, losses against hand computation,
expert discovery for expert parallelism, the MoE GPT, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.models.moe_gpt import MoEGPT
from lightning_parallel.nn import (
    GroupedExperts,
    MoE,
    TopKRouter,
    clear_moe_stats,
    collect_moe_losses,
    collect_moe_stats,
    drop_over_capacity,
    expert_capacity,
    set_moe_loss_coefs,
)
from lightning_parallel.parallel.experts.apply import find_expert_modules, validate_expert_parallel
from tests.test_expert_parallel import HFStyleModel

LOGITS = [[2.0, 0.0, -1.0], [0.5, 1.5, 0.0], [0.0, -0.5, 3.0], [1.0, 1.2, 0.9]]


def _layer_with_logits(top_k: int, score_func: str = "softmax") -> tuple[MoE, torch.Tensor]:
    """An MoE whose gate is the identity, so the router logits are the inputs."""
    moe = MoE(3, 4, num_experts=3, top_k=top_k, score_func=score_func)  # type: ignore[arg-type]
    with torch.no_grad():
        moe.router.gate.weight.copy_(torch.eye(3))
    return moe, torch.tensor(LOGITS)


def _hand_losses(top_k: int, score_func: str) -> tuple[float, float, list[int]]:
    """Switch/GShard balance loss and ST-MoE z-loss with plain Python floats."""
    num_experts, tokens = 3, len(LOGITS)
    counts = [0] * num_experts
    prob_sums = [0.0] * num_experts
    z = 0.0
    for row in LOGITS:
        if score_func == "softmax":
            exps = [math.exp(v) for v in row]
            scores = [e / sum(exps) for e in exps]
            probs = scores
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
            probs = [s / sum(scores) for s in scores]
        for e in sorted(range(num_experts), key=lambda e: -scores[e])[:top_k]:
            counts[e] += 1
        for e in range(num_experts):
            prob_sums[e] += probs[e]
        z += math.log(sum(math.exp(v) for v in row)) ** 2
    aux = num_experts * sum(counts[e] / (tokens * top_k) * prob_sums[e] / tokens for e in range(num_experts))
    return aux, z / tokens, counts


@pytest.mark.parametrize(("top_k", "score_func"), [(1, "softmax"), (2, "softmax"), (2, "sigmoid")])
def test_aux_and_z_loss_match_hand_computation(top_k: int, score_func: str) -> None:
    moe, x = _layer_with_logits(top_k, score_func)
    moe(x)
    losses = collect_moe_losses(moe)
    aux, z, counts = _hand_losses(top_k, score_func)
    assert losses["moe_aux_loss"].item() == pytest.approx(aux, rel=1e-6)
    assert losses["moe_z_loss"].item() == pytest.approx(z, rel=1e-6)
    assert losses["moe_loss"].item() == pytest.approx(0.01 * aux + 0.001 * z, rel=1e-6)
    stats = collect_moe_stats(moe)
    assert [stats[f"moe/expert_{e}_tokens"].item() for e in range(3)] == counts
    assert stats["moe/dropped_fraction"].item() == 0.0


def test_loss_gradients_equal_the_direct_formulas() -> None:
    torch.manual_seed(0)
    moe = MoE(6, 8, num_experts=4, top_k=2)
    x = torch.randn(10, 6)
    moe(x)
    losses = collect_moe_losses(moe)
    weight = moe.router.gate.weight
    grad_aux = torch.autograd.grad(losses["moe_aux_loss"], weight, retain_graph=True)[0]
    grad_z = torch.autograd.grad(losses["moe_z_loss"], weight)[0]
    logits = moe.router.gate(x)
    probs = torch.softmax(logits, dim=-1)
    fraction = torch.bincount(probs.topk(2).indices.reshape(-1), minlength=4) / (10 * 2)
    direct_aux = 4 * (fraction * probs.mean(0)).sum()
    direct_z = torch.logsumexp(logits, -1).square().mean()
    assert grad_aux.abs().max() > 0 and grad_z.abs().max() > 0
    torch.testing.assert_close(grad_aux, torch.autograd.grad(direct_aux, weight, retain_graph=True)[0], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grad_z, torch.autograd.grad(direct_z, weight)[0], rtol=1e-5, atol=1e-8)


def test_capacity_rule_serves_first_choices_first_then_token_order() -> None:
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [2, 0]])
    weights = torch.full((5, 2), 0.5)
    new_idx, new_w, dropped = drop_over_capacity(indices, weights, num_experts=3, capacity=2)
    expected = torch.tensor([[False, False], [False, False], [True, True], [False, True], [False, True]])
    assert torch.equal(dropped, expected)
    assert torch.equal(new_idx, indices.masked_fill(expected, 3))
    assert torch.equal(new_w, weights.masked_fill(expected, 0.0))
    assert expert_capacity(5, 2, 3, 1.0) == 4 and expert_capacity(8, 1, 4, 1.25) == 3


def test_layer_drops_by_the_rule_and_dropless_keeps_everything() -> None:
    torch.manual_seed(1)
    dropless = MoE(6, 8, num_experts=4, top_k=2)
    capped = MoE(6, 8, num_experts=4, top_k=2, capacity_factor=0.5)
    roomy = MoE(6, 8, num_experts=4, top_k=2, capacity_factor=100.0)
    capped.load_state_dict(dropless.state_dict())
    roomy.load_state_dict(dropless.state_dict())
    x = torch.randn(3, 5, 6)
    torch.testing.assert_close(roomy(x), dropless(x), rtol=0, atol=0)
    assert not dropless.last_dropped.any() and not roomy.last_dropped.any()
    out = capped(x)
    routing = capped.router(x.reshape(-1, 6))
    _, _, expected = drop_over_capacity(routing.indices, routing.weights, 4, expert_capacity(15, 2, 4, 0.5))
    assert torch.equal(capped.last_dropped, expected) and expected.any()
    fully_dropped = capped.last_dropped.all(dim=1)
    assert torch.all(out.reshape(-1, 6)[fully_dropped] == 0)  # the residual carries those tokens
    stats = collect_moe_stats(capped)
    assert stats["moe/dropped_fraction"].item() == pytest.approx(expected.float().mean().item())


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_experts_equal_a_per_token_loop(activation: str) -> None:
    torch.manual_seed(2)
    experts = GroupedExperts(5, 6, 7, activation)  # type: ignore[arg-type]
    x = torch.randn(9, 6)
    indices = torch.randint(0, 5, (9, 2))
    indices[3, 1] = 5  # the "no expert" sentinel contributes nothing
    weights = torch.rand(9, 2)
    expected = torch.zeros_like(x)
    for t in range(9):
        for j in range(2):
            e = int(indices[t, j])
            if e == 5:
                continue
            h = x[t] @ experts.w1[e]
            h = F.silu(h) * (x[t] @ experts.w3[e]) if activation == "swiglu" else F.gelu(h)
            expected[t] += weights[t, j] * (h @ experts.w2[e])
    torch.testing.assert_close(experts(x, indices, weights), expected, rtol=1e-5, atol=1e-6)


def test_router_weights() -> None:
    torch.manual_seed(3)
    x = torch.randn(7, 4)
    top2 = TopKRouter(4, 5, 2)(x)
    torch.testing.assert_close(top2.weights.sum(-1), torch.ones(7))
    top1 = TopKRouter(4, 5, 1)
    r1 = top1(x)
    torch.testing.assert_close(r1.weights[:, 0], torch.softmax(top1.gate(x), -1).max(-1).values)
    sig = TopKRouter(4, 5, 2, "sigmoid")(x)
    torch.testing.assert_close(sig.probs.sum(-1), torch.ones(7))


def test_coefficients_can_be_overridden_and_zero_disables() -> None:
    model = MoEGPT(n_layer=2, n_embd=16, n_head=2, num_experts=4, top_k=2)
    assert collect_moe_losses(model) == {}
    assert set_moe_loss_coefs(model, aux=0.0) == 2
    model(torch.randint(0, 128, (2, 8)))
    losses = collect_moe_losses(model)
    assert losses["moe_loss"].item() == pytest.approx(0.001 * losses["moe_z_loss"].item(), rel=1e-6)
    set_moe_loss_coefs(model, aux=0.0, z=0.0)
    model(torch.randint(0, 128, (2, 8)))
    assert collect_moe_losses(model)["moe_loss"].item() == 0.0
    assert "moe/blocks.1.mlp/expert_3_tokens" in collect_moe_stats(model)
    clear_moe_stats(model)
    assert collect_moe_losses(model) == {} and collect_moe_stats(model) == {}


def test_moe_gpt_replaces_mlps_and_keeps_gpt_names() -> None:
    model = MoEGPT(n_layer=3, n_embd=16, n_head=2, num_experts=4, top_k=1, moe_every=2, shared_expert_hidden_dim=8)
    names = {n for n, _ in model.named_parameters()}
    assert {"blocks.0.mlp.experts.w1", "blocks.0.mlp.router.gate.weight", "blocks.0.mlp.shared_expert.fc.weight"} <= names
    assert "blocks.1.mlp.fc.weight" in names and "blocks.2.mlp.experts.w2" in names
    assert set(find_expert_modules(model)) == {"blocks.0.mlp.experts", "blocks.2.mlp.experts"}
    rebuilt = type(model)(**model.hparams)
    assert rebuilt.moe_every == 2 and rebuilt.blocks[0].mlp.top_k == 1
    idx = torch.randint(0, 128, (2, 8))
    loss = model.compute_loss(model(idx), idx) + collect_moe_losses(model)["moe_loss"]
    loss.backward()
    assert model.blocks[0].mlp.router.gate.weight.grad.abs().sum() > 0
    assert model.blocks[2].mlp.experts.w1.grad.abs().sum() > 0


def test_third_party_experts_are_found_by_plan_or_layout() -> None:
    assert set(find_expert_modules(HFStyleModel(2, declare_plan=True))) == {"layers.0.mlp.experts"}
    assert set(find_expert_modules(HFStyleModel(2, declare_plan=False))) == {"layers.0.mlp.experts"}
    assert validate_expert_parallel(HFStyleModel(2, declare_plan=True), 4) == {"layers.0.mlp.experts": 8}

    class Router(nn.Module):  # HF-style router: num_experts and an [E, D] weight, one input
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 4
            self.weight = nn.Parameter(torch.zeros(4, 6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.t()

    assert find_expert_modules(nn.Sequential(Router())) == {}


def test_bad_input_is_rejected_with_typed_errors() -> None:
    with pytest.raises(ValueError, match="top_k.*num_experts=4"):
        MoE(8, 8, num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="top_k"):
        MoEGPT(num_experts=4, top_k=5)
    with pytest.raises(TypeError, match="num_experts"):
        MoE(8, 8, num_experts="4", top_k=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(8, 8, capacity_factor=0.0)
    with pytest.raises(ValueError, match="aux_loss_coef"):
        MoE(8, 8, aux_loss_coef=-1.0)
    with pytest.raises(ValueError, match="score_func"):
        MoE(8, 8, score_func="relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="z_loss_coef"):
        set_moe_loss_coefs(MoE(8, 8), z=-0.1)
    with pytest.raises(ValueError, match="expert_parallel_size.*has none"):
        validate_expert_parallel(nn.Sequential(nn.Linear(4, 4)), 2)
    with pytest.raises(ValueError, match="num_experts=6.*divisible"):
        validate_expert_parallel(MoEGPT(n_layer=1, n_embd=16, n_head=2, num_experts=6, top_k=2), 4)

    class ListExperts(nn.Module):  # experts as a ModuleList cannot be sharded by leading dim
        def __init__(self) -> None:
            super().__init__()
            self.config = type("C", (), {"base_model_ep_plan": {"experts": "moe_tp_experts"}})()
            self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])

    with pytest.raises(ValueError, match="leading num_experts dimension"):
        validate_expert_parallel(ListExperts(), 2)
