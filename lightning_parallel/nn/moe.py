"""A mixture-of-experts layer usable in any model, and the functions a trainer uses to read it.

The layer (``MoE``) = router + experts stored as batched weights + optional shared expert. It
takes ``[..., dim]`` and returns the same shape, so it replaces an MLP in place.

Why the losses are stored on the layer instead of returned: the model's ``forward`` and the
user's ``training_step`` stay unchanged. After each forward the layer keeps a ``MoEStats`` in
``self.moe_stats``; a trainer (our strategy) calls ``collect_moe_losses(model)`` and adds the
returned ``"moe_loss"`` to the loss it backpropagates, logs ``collect_moe_stats(model)`` and
then calls ``clear_moe_stats(model)``.

Losses (per layer; ``collect_moe_losses`` sums them over layers):

* load balance (Switch/GShard): ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the
  ``N * k`` top-k assignments routed to expert ``e`` (counted before capacity dropping, so the
  loss sees what the router wanted) and ``P_e`` the mean over the ``N`` tokens of the router's
  distribution (softmax probabilities, or sigmoid scores normalised to sum to 1). Equals 1 for
  a perfectly uniform router.
* router z-loss (ST-MoE): ``mean_t logsumexp(logits_t)^2``.

Global statistics under data parallelism: with a stats group set (``set_moe_stats_group``,
done by ``apply_expert_parallel`` and by the strategy), each forward all-reduces (sums), over
that group, one small fp64 buffer: per-expert assignment counts, per-expert probability sums
and the z sum (both detached), the token count and the dropped-assignment count. The loss
*values* are then those of the global batch, identical on every rank. The *gradient* flows only
through the rank's own tokens, scaled by the group size ``R``: data parallelism averages
gradients over the ``R`` ranks, so the averaged gradient equals the single-process gradient of
the global-batch loss (exactly, even for unequal token counts per rank). Without a group the
layer is the plain single-process layer (``R = 1``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.nn.experts import Activation, DenseMLP, GroupedExperts
from lightning_parallel.nn.router import Routing, ScoreFunc, TopKRouter, drop_over_capacity, expert_capacity
from lightning_parallel.errors import config_error


@dataclass
class MoEStats:
    """What one MoE forward measured. Tensors with ``None`` were not measured by that module
    (an expert-parallel third-party experts module knows counts but not the router's scores)."""

    tokens_per_expert: Tensor  # [E] fp32 assignments per expert before dropping, summed over the stats group
    aux_loss: Tensor | None = None  # load-balancing loss of the global batch (carries the gradient)
    z_loss: Tensor | None = None  # router z-loss of the global batch (carries the gradient)
    dropped_fraction: Tensor | None = None  # dropped / all top-k assignments, over the stats group
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0


def _check_coef(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise config_error(TypeError, name, value, "a loss coefficient is a float", f"pass e.g. {name}=0.01")
    if value < 0:
        raise config_error(ValueError, name, value, "a loss coefficient must be >= 0", f"use {name}=0 to disable the loss")
    return float(value)


class MoE(nn.Module):
    """Top-k routed experts (+ optional shared expert): a drop-in replacement for an MLP.

    ``capacity_factor=None`` is dropless. Otherwise each expert serves at most
    ``ceil(capacity_factor * T * top_k / num_experts)`` assignments of the ``T`` tokens of one
    call (one rank's tokens under parallelism), by the priority rule of
    ``lightning_parallel.nn.router``.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int = 8,
        top_k: int = 2,
        *,
        score_func: ScoreFunc = "softmax",
        normalize_weights: bool | None = None,
        capacity_factor: float | None = None,
        activation: Activation = "gelu",
        shared_expert_hidden_dim: int | None = None,
        dropout: float = 0.0,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.001,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if capacity_factor is not None:
            if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
                raise config_error(TypeError, "capacity_factor", capacity_factor, "it must be a float or None", "use capacity_factor=1.25, or None for dropless")
            if capacity_factor <= 0:
                raise config_error(ValueError, "capacity_factor", capacity_factor, "it must be > 0", "use capacity_factor=1.25, or None for dropless")
        self.router = TopKRouter(dim, num_experts, top_k, score_func, normalize_weights)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim, activation, init_std)
        self.shared_expert: nn.Module | None = None
        if shared_expert_hidden_dim is not None:
            self.shared_expert = DenseMLP(dim, shared_expert_hidden_dim, activation)
        self.dropout = nn.Dropout(dropout)
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.aux_loss_coef = _check_coef("aux_loss_coef", aux_loss_coef)
        self.z_loss_coef = _check_coef("z_loss_coef", z_loss_coef)
        self.moe_stats: MoEStats | None = None
        self._stats_group: dist.ProcessGroup | None = None
        self.last_dropped: Tensor | None = None  # [T, k] bool mask of the last call (tests, analysis)

    def forward(self, x: Tensor) -> Tensor:
        dim = x.shape[-1]
        tokens = x.reshape(-1, dim)
        routing = self.router(tokens)
        indices, weights = routing.indices, routing.weights
        dropped = torch.zeros_like(indices, dtype=torch.bool)
        if self.capacity_factor is not None:
            capacity = expert_capacity(tokens.shape[0], self.top_k, self.num_experts, self.capacity_factor)
            indices, weights, dropped = drop_over_capacity(indices, weights, self.num_experts, capacity)
        self.last_dropped = dropped
        out = self.experts(tokens, indices, weights.to(tokens.dtype))
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        self.moe_stats = self._statistics(routing, dropped)
        return self.dropout(out).reshape(x.shape)

    def _statistics(self, routing: Routing, dropped: Tensor) -> MoEStats:
        """Losses and load statistics of the global batch (see the module docstring)."""
        num_experts, top_k = self.num_experts, self.top_k
        counts = torch.bincount(routing.indices.reshape(-1), minlength=num_experts)
        prob_sum = routing.probs.sum(dim=0)
        z_sum = torch.logsumexp(routing.logits, dim=-1).square().sum()
        local = torch.cat(
            [
                counts.double(),
                prob_sum.detach().double(),
                z_sum.detach().double().reshape(1),
                torch.stack([torch.full_like(z_sum, routing.logits.shape[0]), dropped.sum().to(z_sum.dtype)]).detach().double(),
            ]
        )
        group = self._stats_group
        ranks = 1
        if group is not None:
            ranks = dist.get_world_size(group)
            if ranks > 1:
                dist.all_reduce(local, group=group)
        counts_g, prob_g = local[:num_experts], local[num_experts : 2 * num_experts]
        z_g, num_tokens, dropped_g = local[2 * num_experts], local[2 * num_experts + 1], local[2 * num_experts + 2]
        dtype = routing.probs.dtype
        scale = ranks / float(num_tokens)
        fraction = (counts_g / (num_tokens * top_k)).to(dtype)
        # value: global mean; gradient: this rank's share, scaled for the data-parallel average
        mean_prob = (prob_g / num_tokens).to(dtype) + (prob_sum - prob_sum.detach()) * scale
        aux = num_experts * (fraction * mean_prob).sum()
        z = (z_g / num_tokens).to(dtype) + (z_sum - z_sum.detach()) * scale
        return MoEStats(
            tokens_per_expert=counts_g.float(),
            aux_loss=aux,
            z_loss=z,
            dropped_fraction=(dropped_g / (num_tokens * top_k)).float(),
            aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef,
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, capacity_factor={self.capacity_factor}, "
            f"aux_loss_coef={self.aux_loss_coef}, z_loss_coef={self.z_loss_coef}"
        )


def named_moe_stats(module: nn.Module) -> Iterator[tuple[str, MoEStats]]:
    """``(module name, MoEStats)`` of every layer under ``module`` that has run since the last clear."""
    for name, sub in module.named_modules():
        stats = getattr(sub, "moe_stats", None)
        if isinstance(stats, MoEStats):
            yield name, stats


def collect_moe_losses(module: nn.Module) -> dict[str, Tensor]:
    """Sum the last forward's MoE losses over every layer in ``module``.

    Returns ``{}`` when no layer has run, else ``"moe_loss"`` (coefficient-weighted total: add it
    to the loss you backpropagate; terms whose coefficient is 0 are left out, so 0 disables),
    ``"moe_aux_loss"`` and ``"moe_z_loss"`` (unweighted sums over layers, for logging).
    """
    found = [stats for _, stats in named_moe_stats(module) if stats.aux_loss is not None and stats.z_loss is not None]
    if not found:
        return {}
    aux = torch.stack([s.aux_loss for s in found]).sum()  # type: ignore[misc]
    z = torch.stack([s.z_loss for s in found]).sum()  # type: ignore[misc]
    terms = [s.aux_loss_coef * s.aux_loss for s in found if s.aux_loss_coef > 0]  # type: ignore[operator]
    terms += [s.z_loss_coef * s.z_loss for s in found if s.z_loss_coef > 0]  # type: ignore[operator]
    total = torch.stack(terms).sum() if terms else torch.zeros((), dtype=aux.dtype, device=aux.device)
    return {"moe_loss": total, "moe_aux_loss": aux, "moe_z_loss": z}


def collect_moe_stats(module: nn.Module, prefix: str = "moe") -> dict[str, Tensor]:
    """Detached scalars for logging: per layer and expert the assignment count, per layer the
    dropped fraction and the load imbalance (max count / mean count), and the overall dropped
    fraction. Values are global over the stats group, hence equal on every rank."""
    return moe_stats_log(named_moe_stats(module), prefix)


def moe_stats_log(named: Iterable[tuple[str, MoEStats]], prefix: str = "moe") -> dict[str, Tensor]:
    """:func:`collect_moe_stats` for given ``(layer name, MoEStats)`` pairs (e.g. gathered from pipeline stages)."""
    out: dict[str, Tensor] = {}
    dropped = []
    for name, stats in named:
        key = f"{prefix}/{name}" if name else prefix
        counts = stats.tokens_per_expert.detach()
        for e, count in enumerate(counts):
            out[f"{key}/expert_{e}_tokens"] = count
        out[f"{key}/load_imbalance"] = counts.max() / counts.mean().clamp_min(1e-9)
        if stats.dropped_fraction is not None:
            out[f"{key}/dropped_fraction"] = stats.dropped_fraction.detach()
            dropped.append(stats.dropped_fraction.detach())
    if dropped:
        out[f"{prefix}/dropped_fraction"] = torch.stack(dropped).mean()
    return out


def clear_moe_stats(module: nn.Module) -> None:
    """Forget the last forward's statistics (and their autograd graph) in every layer."""
    for sub in module.modules():
        if isinstance(getattr(sub, "moe_stats", None), MoEStats):
            sub.moe_stats = None


def set_moe_loss_coefs(module: nn.Module, aux: float | None = None, z: float | None = None) -> int:
    """Override the loss coefficients of every ``MoE`` layer (``None`` keeps a layer's own);
    returns how many layers were changed. Validated before anything changes."""
    aux_value = None if aux is None else _check_coef("aux_loss_coef", aux)
    z_value = None if z is None else _check_coef("z_loss_coef", z)
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    for layer in layers:
        if aux_value is not None:
            layer.aux_loss_coef = aux_value
        if z_value is not None:
            layer.z_loss_coef = z_value
    return len(layers)


def set_moe_stats_group(module: nn.Module, group: dist.ProcessGroup | None) -> int:
    """Make every ``MoE`` layer compute its losses and statistics over ``group``: the ranks that
    hold different tokens of one global batch (the data-parallel group). Returns the count."""
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer._stats_group = group
    return len(layers)


__all__ = [
    "MoE",
    "MoEStats",
    "clear_moe_stats",
    "collect_moe_losses",
    "collect_moe_stats",
    "moe_stats_log",
    "named_moe_stats",
    "set_moe_loss_coefs",
    "set_moe_stats_group",
]
