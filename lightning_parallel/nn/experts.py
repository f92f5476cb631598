"""Experts stored as batched weights, called the way Hugging Face MoE blocks call theirs.

Why one tensor with a leading ``num_experts`` dimension instead of a ``ModuleList`` of MLPs:
expert parallelism shards that dimension (each rank keeps a contiguous block of experts under
the same parameter name), and grouped matmuls read it directly. Why the call convention
``forward(tokens, indices, weights)``: it is what Hugging Face experts modules take (Mixtral,
Qwen-MoE, ...), so the expert-parallel dispatcher treats this module and third-party ones the
same way. An index equal to ``num_experts`` (or any out-of-range value) means "no expert" (a
dropped assignment) and contributes nothing.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.errors import config_error

Activation = Literal["gelu", "relu", "silu", "swiglu"]
_ACTIVATIONS = ("gelu", "relu", "silu", "swiglu")


def _activate(name: str, h: Tensor, gate: Tensor | None) -> Tensor:
    if name == "swiglu":
        assert gate is not None
        return F.silu(h) * gate
    if name == "gelu":
        return F.gelu(h)
    if name == "relu":
        return F.relu(h)
    return F.silu(h)


class GroupedExperts(nn.Module):
    """``num_experts`` two-layer MLPs: ``w1`` ``[E, dim, hidden]``, ``w2`` ``[E, hidden, dim]``
    (and ``w3`` ``[E, dim, hidden]``, the gate of SwiGLU).

    The number of experts is read from the weights at call time, so the same code runs on the
    full set (one process) and on a rank's local block (expert parallelism).
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, activation: Activation = "gelu", init_std: float = 0.02) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise config_error(ValueError, "activation", activation, f"it must be one of {_ACTIVATIONS}", 'use activation="gelu"')
        self.num_experts = num_experts
        self.activation = activation
        self.init_std = init_std
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim)) if activation == "swiglu" else None
        self.register_parameter("w3", w3)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) as GPT-2 initialises its linear layers; the output projection is
        scaled like the input by ``init_std`` (callers with depth scaling re-initialise ``w2``)."""
        for weight in (self.w1, self.w2, self.w3):
            if weight is not None:
                nn.init.normal_(weight, mean=0.0, std=self.init_std)

    def forward(self, tokens: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """``tokens`` ``[..., dim]``, ``indices``/``weights`` ``[..., k]`` -> ``[..., dim]``:
        ``sum_j weights[t, j] * expert[indices[t, j]](tokens[t])``."""
        num_experts = self.w1.shape[0]
        dim = tokens.shape[-1]
        x = tokens.reshape(-1, dim)
        top_k = indices.shape[-1]
        flat = indices.reshape(-1)
        valid = ((flat >= 0) & (flat < num_experts)).nonzero().squeeze(1)
        experts_sorted, order = torch.sort(flat[valid], stable=True)
        assignment = valid[order]  # flat (token, choice) ids grouped by expert, token order within
        token = assignment // top_k
        counts = torch.bincount(experts_sorted, minlength=num_experts).tolist()
        h = self.run_experts(x[token], counts)
        h = h * weights.reshape(-1)[assignment].unsqueeze(-1).to(h.dtype)
        out = torch.zeros_like(x).index_add(0, token, h.to(x.dtype))  # autocast: bf16 expert outputs, summed in x.dtype
        return out.reshape(tokens.shape)

    def run_experts(self, x: Tensor, counts: list[int]) -> Tensor:
        """Apply expert ``e`` to the ``counts[e]`` consecutive rows of ``x`` that belong to it."""
        outputs = []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = x[start : start + n]
            start += n
            gate = rows @ self.w3[e] if self.w3 is not None else None
            outputs.append(_activate(self.activation, rows @ self.w1[e], gate) @ self.w2[e])
        if not outputs:
            # No rows: still touch every weight so each rank produces a (zero) gradient for it,
            # and gradient reduction over replicas never meets a missing gradient; touch the
            # (empty) input too, so that under expert parallelism the backward still reaches the
            # dispatch all-to-all, whose peers wait for this rank's part of it.
            touch = sum(w.sum() for w in (self.w1, self.w2, self.w3) if w is not None) + x.sum()
            return x.new_zeros(0, self.w2.shape[-1]) + 0.0 * touch
        return torch.cat(outputs, dim=0)

    def extra_repr(self) -> str:
        e, d, h = self.w1.shape
        return f"num_experts={e}, dim={d}, hidden_dim={h}, activation={self.activation}"


class DenseMLP(nn.Module):
    """One always-on MLP (the "shared expert" of DeepSeek/Qwen-MoE). It is a plain pair of
    ``nn.Linear`` layers on purpose: it is data-parallel like any dense layer and must not look
    like an experts module to the expert-parallel planner."""

    def __init__(self, dim: int, hidden_dim: int, activation: Activation = "gelu", bias: bool = False) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise config_error(ValueError, "activation", activation, f"it must be one of {_ACTIVATIONS}", 'use activation="gelu"')
        self.activation = activation
        self.fc = nn.Linear(dim, hidden_dim, bias=bias)
        self.gate = nn.Linear(dim, hidden_dim, bias=bias) if activation == "swiglu" else None
        self.proj = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate(x) if self.gate is not None else None
        return self.proj(_activate(self.activation, self.fc(x), gate))


__all__ = ["Activation", "DenseMLP", "GroupedExperts"]
