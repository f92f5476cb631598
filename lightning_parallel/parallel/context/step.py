"""The context-parallel step in progress: what the routed attention and the model hooks read.

The strategy cuts the batch (``batch.py``) and activates one :class:`ContextStep` for the
training step and its backward (activation checkpointing recomputes attention inside the
backward, and the recomputation must see the same chunks), or for one evaluation step. Outside
an active step the routed attention is ordinary attention: ``predict_step`` and any call the
strategy did not cut run whole sequences on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.parallel.context.attention import context_attention
from lightning_parallel.parallel.context.chunks import ChunkLayout
from lightning_parallel.parallel.context.torch_ring import torch_ring_applies, torch_ring_attention


@dataclass
class ContextStep:
    layout: ChunkLayout
    group: dist.ProcessGroup
    form: str
    key_valid: Tensor | None = None  # global [B, S] padding (True = token), from the model's attention_mask
    depth: int = 0  # nesting of hooked model calls: the outermost one handles positions and labels
    pipelined: bool = False  # pipeline stages: attention is a traced op (traced.py), labels= handled on the last stage

    def gather(self, local: Tensor, dim: int = 1) -> Tensor:
        """The whole-sequence tensor, in global order, from every rank's part (no gradient)."""
        parts = [torch.empty_like(local) for _ in range(self.layout.cp)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return self.layout.restore(torch.cat(parts, dim=dim), dim)

    def all_reduce_sum(self, value: Tensor) -> Tensor:
        total = value.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total

    def global_value(self, loss: Tensor) -> Tensor:
        """``loss`` with the value of the group's mean and this rank's own gradient.

        Why: each rank's loss covers its chunks; its gradient is its share of the whole
        sequence's (gradients are averaged over dp x cp), while the value a user logs or
        Lightning shows must be the whole sequence's loss, the same on every rank of the group."""
        mean = self.all_reduce_sum(loss) / self.layout.cp
        return loss + (mean - loss.detach())

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window: int | None, scale: float,
                  key_valid: Tensor | None = None) -> Tensor:
        """The layer's attention over the whole sequence: torch's own engine where its causal-only mask
        and CUDA flash kernel apply (``torch_ring.py``), this package's forms otherwise. ``key_valid``:
        the padding, default this step's (a pipeline stage passes each microbatch's own)."""
        key_valid = self.key_valid if key_valid is None else key_valid
        if key_valid is not None and torch_ring_applies(self.form, q, None, causal, window) and bool(key_valid.all()):
            key_valid = None  # a padding mask without padding (a tokenizer's all-ones mask) masks nothing
        if torch_ring_applies(self.form, q, key_valid, causal, window):
            return torch_ring_attention(self.form, q, k, v, self.group, scale)
        return context_attention(self.form, q, k, v, self.layout, self.group, key_valid=key_valid,
                                 causal=causal, window=window, scale=scale)


_ACTIVE: list[ContextStep] = []


def active_step() -> ContextStep | None:
    return _ACTIVE[-1] if _ACTIVE else None


def activate(step: ContextStep) -> None:
    _ACTIVE[:] = [step]


def deactivate() -> None:
    _ACTIVE.clear()
