"""Free the gradients Lightning is about to drop before the step's forward, not after it.

Why: Lightning's automatic optimization runs ``training_step`` (the whole forward) first and only
then ``zero_grad`` (on the first batch of each ``accumulate_grad_batches`` window), so the previous
step's gradients stay allocated through the forward, beside the activations and, under FSDP2, the
gathered blocks: one gradient copy of the model state on every rank at the forward's peak. A
hand-written loop calls ``zero_grad`` before the forward. Measured on the 1 GiB GPT of
``benchmarks/bench_memory.py`` (4 ranks): under ``zero3`` the training peak was in the second
step's forward with all of the first step's gradient shards live; under ``pp`` the schedule held
two sets of its stages' gradients (896 -> 624 MiB once freed).

Freeing them early changes nothing Lightning's contract lets anyone see, and that is the rule
(:func:`gradients_dropped_before_backward`): it applies only when Lightning itself will call
``zero_grad`` before this step's backward (automatic optimization, the window's first batch, the
backward not skipped) through the default ``LightningModule.optimizer_zero_grad`` (an override may
keep them), and when nothing looks at them in between: neither the module nor any callback
overrides ``on_before_zero_grad``, the one hook that runs there (Lightning's docs show it
inspecting gradients). Only the gradients of the optimizer's parameters are freed, as
``optimizer.zero_grad()`` would; a parameter outside every optimizer keeps accumulating, as in
Lightning.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
from torch import nn

from lightning_parallel.compat_lightning import attached_trainer, backward_skipped


def gradients_dropped_before_backward(module: pl.LightningModule, batch_idx: int | None) -> bool:
    """Whether Lightning's ``zero_grad`` drops every optimizer gradient between this ``training_step``
    and its backward, unobserved (see the module docstring)."""
    trainer = attached_trainer(module)
    if batch_idx is None or trainer is None or not module.automatic_optimization:
        return False
    if backward_skipped(trainer) or batch_idx % int(trainer.accumulate_grad_batches):
        return False
    if type(module).optimizer_zero_grad is not pl.LightningModule.optimizer_zero_grad:
        return False
    observers = [module, *trainer.callbacks]
    return not any(_overrides(o, "on_before_zero_grad") for o in observers)


def _overrides(obj: Any, hook: str) -> bool:
    base = pl.LightningModule if isinstance(obj, pl.LightningModule) else pl.Callback
    return getattr(type(obj), hook, None) is not getattr(base, hook)


def optimizer_parameters(optimizers: Iterable[Any]) -> list[nn.Parameter]:
    """The parameters ``optimizer.zero_grad()`` clears, over every optimizer (each once)."""
    seen: dict[int, nn.Parameter] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
    return list(seen.values())


def free_dropped_gradients(module: pl.LightningModule, batch_idx: int | None, optimizers: Iterable[Any]) -> bool:
    """Set the optimizers' gradients to ``None`` now if Lightning would drop them before this
    step's backward anyway (:func:`gradients_dropped_before_backward`); return whether it did."""
    if not gradients_dropped_before_backward(module, batch_idx):
        return False
    for p in optimizer_parameters(optimizers):
        p.grad = None
    return True


__all__ = ["free_dropped_gradients", "gradients_dropped_before_backward", "optimizer_parameters"]
