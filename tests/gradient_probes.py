"""Callbacks that check when the strategy frees the gradients Lightning's ``zero_grad`` drops
(``lightning_parallel/strategies/early_zero_grad.py``), under every engine (eager, pipelines).

Both are no-ops under a strategy other than ours (the single-process reference runs)."""

from __future__ import annotations

import weakref
from typing import Any

import lightning.pytorch as pl

from lightning_parallel import HybridParallelStrategy


def _ours(trainer: pl.Trainer) -> bool:
    return isinstance(trainer.strategy, HybridParallelStrategy)


class OldGradientsFreed(pl.Callback):
    """On each ``accumulate_grad_batches`` window's first batch (after the first step) the previous
    gradients are gone when ``training_step`` runs (before the forward; under pipelines before the
    schedule, checked where the step runs as the loss, on the last stage), so they are never held
    beside the activations and the new gradients. Inside a window they are kept, and under
    pipelines accumulated into in place."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not _ours(trainer):
            return
        step = pl_module.training_step
        driver = getattr(trainer.strategy, "_pipeline", None)
        self.checked = 0

        def checked_step(*args: Any, **kwargs: Any) -> Any:
            # under pipelines: where the schedule runs the step as its loss (not the driver's input probe)
            in_step = driver is None or driver._step is not None
            if in_step and self.batch_idx > 0 and self.batch_idx % trainer.accumulate_grad_batches == 0:
                # (a later microbatch of a schedule sees this step's new gradients: only the old ones count)
                old = {id(p): ref for p, ref in self.refs}
                kept = [n for n, p in pl_module.named_parameters() if p.grad is not None and id(p) in old and p.grad is old[id(p)]()]
                assert not kept, f"batch {self.batch_idx}: old gradients still attached in training_step: {kept[:3]}"
                if driver is not None:  # nothing else holds them either (DDP's buckets would, under dp)
                    assert all(ref() is None for _, ref in self.refs), f"batch {self.batch_idx}: old gradients alive"
                self.checked += 1
            return step(*args, **kwargs)

        pl_module.training_step = checked_step  # type: ignore[method-assign]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batch_idx = batch_idx
        self.refs = [(p, weakref.ref(p.grad)) for p in pl_module.parameters() if p.grad is not None]

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pipelined = getattr(trainer.strategy, "_pipeline", None) is not None
        if pipelined and self.batch_idx % trainer.accumulate_grad_batches:  # accumulated into
            assert self.refs and all(p.grad is ref() for p, ref in self.refs), f"batch {self.batch_idx}: not accumulated in place"

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        last_stage = getattr(trainer.strategy, "_pipeline", None) is None or trainer.strategy._pipeline.runtime.holds_last
        if _ours(trainer) and last_stage:
            assert self.checked > 0, "no window's first batch was checked"


class GradientsSeenBeforeZeroGrad(pl.Callback):
    """A callback that overrides ``on_before_zero_grad`` sees the previous step's gradients there,
    as in Lightning (its docs inspect them there): the strategy then keeps them until Lightning's
    ``zero_grad``."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.batch_idx > 0:
            assert any(p.grad is not None for p in pl_module.parameters()), f"batch {self.batch_idx}: gradients gone"


FREED = [(f"{__name__}:OldGradientsFreed", {})]
SEEN = [(f"{__name__}:GradientsSeenBeforeZeroGrad", {})]
