"""The GPT of :mod:`lightning_parallel.models.gpt` with its MLPs replaced by MoE layers.

Nothing here is distributed: the model is a plain LightningModule, and its ``training_step``
is GPT's. Why the auxiliary losses are not added in ``compute_loss``: the strategy adds them
(``lightning_parallel.nn.collect_moe_losses``) to the loss Lightning backpropagates, for this
model and for any other model built with ``lightning_parallel.nn.MoE``, so adding them here
too would count them twice. Each MoE layer keeps its coefficients (``aux_loss_coef``,
``z_loss_coef``), which the strategy may override.

Parameter names: ``blocks.{i}.mlp.{router.gate.weight, experts.w1, experts.w2[, experts.w3],
shared_expert.{fc,proj}.weight}`` replace ``blocks.{i}.mlp.{fc,proj}``; everything else is
GPT's.
"""

from __future__ import annotations

import math

from torch import nn

from lightning_parallel.models.base import check_positive_int
from lightning_parallel.models.gpt import GPT
from lightning_parallel.nn.experts import Activation
from lightning_parallel.nn.moe import MoE
from lightning_parallel.nn.router import ScoreFunc, check_routing_args


class MoEGPT(GPT):
    """GPT whose feed-forward is a top-k mixture of experts in every ``moe_every``-th block
    (block ``i`` is MoE when ``i % moe_every == 0``; the others keep GPT's dense MLP).

    ``expert_hidden_dim`` defaults to ``4 * n_embd`` (each expert is one GPT MLP);
    ``capacity_factor=None`` is dropless.
    """

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        bias: bool = True,
        lr: float = 0.1,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        num_experts: int = 4,
        top_k: int = 2,
        capacity_factor: float | None = None,
        expert_hidden_dim: int | None = None,
        score_func: ScoreFunc = "softmax",
        activation: Activation = "gelu",
        shared_expert_hidden_dim: int | None = None,
        moe_every: int = 1,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.001,
    ) -> None:
        # Validated before GPT builds anything, so a bad value fails fast with its own name.
        check_routing_args(num_experts, top_k, score_func)
        check_positive_int("moe_every", moe_every)
        if expert_hidden_dim is not None:
            check_positive_int("expert_hidden_dim", expert_hidden_dim)
        if shared_expert_hidden_dim is not None:
            check_positive_int("shared_expert_hidden_dim", shared_expert_hidden_dim)
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.expert_hidden_dim = expert_hidden_dim
        self.score_func = score_func
        self.activation = activation
        self.shared_expert_hidden_dim = shared_expert_hidden_dim
        self.moe_every = moe_every
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        super().__init__(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias, lr, optimizer, momentum, weight_decay, eps)
        # GPT-2 depth scaling for the experts' output projection, as GPT does for ``proj``.
        for module in self.modules():
            if isinstance(module, MoE):
                nn.init.normal_(module.experts.w2, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        if layer_idx % self.moe_every != 0:
            return super()._make_mlp(layer_idx)
        return MoE(
            self.n_embd,
            self.expert_hidden_dim or 4 * self.n_embd,
            self.num_experts,
            self.top_k,
            score_func=self.score_func,
            capacity_factor=self.capacity_factor,
            activation=self.activation,
            shared_expert_hidden_dim=self.shared_expert_hidden_dim,
            dropout=self.dropout,
            aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef,
        )


__all__ = ["MoEGPT"]
