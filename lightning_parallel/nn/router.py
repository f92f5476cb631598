"""Top-k token routing and the capacity rule that decides which assignments are dropped.

A router scores every token against every expert and keeps the ``top_k`` best. Two details
matter for reproducibility across layouts, so they are fixed here and documented:

* Scores are computed in fp32 whatever the activation dtype, because the top-k choice flips on
  round-off otherwise, and a flipped choice is a different model.
* Capacity (GShard/Switch) is counted per expert over the tokens one call routes, i.e. over
  the tokens one rank holds under data/expert parallelism. Within an expert, assignments are
  served in priority order: every token's first choice before any second choice, and within
  one choice rank, in token order (GShard's rule). Assignments past the capacity are dropped:
  their index becomes the sentinel ``num_experts`` and their weight 0, and the residual
  connection around the MoE layer carries the token unchanged.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from lightning_parallel.errors import config_error

ScoreFunc = Literal["softmax", "sigmoid"]


class Routing(NamedTuple):
    """What a router decided for ``T`` tokens, ``E`` experts and ``k`` choices per token."""

    logits: Tensor  # [T, E] fp32 raw router logits (the z-loss penalises their logsumexp)
    probs: Tensor  # [T, E] fp32 per-token distribution over experts (rows sum to 1): the aux loss's P
    indices: Tensor  # [T, k] int64 chosen experts, best first
    weights: Tensor  # [T, k] fp32 combine weights of the chosen experts


def check_routing_args(num_experts: object, top_k: object, score_func: object) -> None:
    """Validate router hyper-parameters with the project's error layout (no collectives here)."""
    for name, value in (("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise config_error(TypeError, name, value, "it must be an int", f"pass an int such as {name}=2")
        if value < 1:
            raise config_error(ValueError, name, value, "it must be at least 1", f"use {name}=1 or more")
    assert isinstance(top_k, int) and isinstance(num_experts, int)
    if top_k > num_experts:
        raise config_error(
            ValueError,
            "top_k",
            top_k,
            f"a token cannot choose more experts than exist (num_experts={num_experts})",
            f"use top_k <= {num_experts} or add experts",
        )
    if score_func not in ("softmax", "sigmoid"):
        raise config_error(ValueError, "score_func", score_func, 'it must be "softmax" or "sigmoid"', 'use score_func="softmax"')


class TopKRouter(nn.Module):
    """A linear gate followed by top-k selection over softmax or sigmoid scores.

    ``normalize_weights`` rescales the k chosen scores to sum to 1 (Mixtral, DeepSeek-V3). It
    defaults to ``top_k > 1``: with top-1 a normalised weight is always 1, which would cut the
    gate off from the task loss (Switch keeps the raw probability for that reason).
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: ScoreFunc = "softmax",
        normalize_weights: bool | None = None,
    ) -> None:
        super().__init__()
        check_routing_args(num_experts, top_k, score_func)
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.normalize_weights = top_k > 1 if normalize_weights is None else bool(normalize_weights)
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(self, x: Tensor) -> Routing:
        """Route ``x`` of shape ``[T, dim]``."""
        logits = self.gate(x).float()
        if self.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
            probs = scores
        else:
            scores = torch.sigmoid(logits)
            # Sigmoid scores are independent per expert; the balance loss needs a distribution.
            probs = scores / scores.sum(dim=-1, keepdim=True)
        weights, indices = torch.topk(scores, self.top_k, dim=-1)
        if self.normalize_weights:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(logits=logits, probs=probs, indices=indices, weights=weights)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert for one routing call: ``ceil(capacity_factor * tokens * top_k / experts)``.

    With a perfectly balanced router every expert receives ``tokens * top_k / experts``
    assignments; the factor is the head-room above that (Switch uses 1.0-1.25).
    """
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def drop_over_capacity(indices: Tensor, weights: Tensor, num_experts: int, capacity: int) -> tuple[Tensor, Tensor, Tensor]:
    """Apply the capacity rule of the module docstring.

    Returns ``(indices, weights, dropped)``: dropped assignments get index ``num_experts`` (the
    "no expert" sentinel, as in Hugging Face expert modules) and weight 0; ``dropped`` is the
    ``[T, k]`` boolean mask of them.
    """
    num_tokens, top_k = indices.shape
    # Priority order: choice rank first, then token position (slot-major flattening).
    priority = indices.t().reshape(-1)
    sorted_experts, perm = torch.sort(priority, stable=True)
    counts = torch.bincount(priority, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    position_sorted = torch.arange(priority.numel(), device=indices.device) - starts[sorted_experts]
    position = torch.empty_like(position_sorted)
    position[perm] = position_sorted
    dropped = (position >= capacity).reshape(top_k, num_tokens).t()
    indices = indices.masked_fill(dropped, num_experts)
    weights = weights.masked_fill(dropped, 0.0)
    return indices, weights, dropped
