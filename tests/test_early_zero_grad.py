"""When the strategy may free the gradients Lightning's ``zero_grad`` is about to drop (no process group).

The multi-process parity runs check the effect (``tests/gradient_probes.py`` in the dp/zero and
pipeline runs); these check the rule itself, case by case, against a real ``Trainer``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_parallel.strategies.early_zero_grad import free_dropped_gradients, gradients_dropped_before_backward


class Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 2)
        self.frozen_out = nn.Linear(2, 2)  # not in the optimizer below


class OverridesZeroGrad(Plain):
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)


class InspectsGradients(Plain):
    def on_before_zero_grad(self, optimizer: Any) -> None:
        pass


class Manual(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class CallbackInspects(pl.Callback):
    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        pass


def _attached(module: pl.LightningModule, accumulate: int = 1, callbacks: list[pl.Callback] | None = None) -> pl.LightningModule:
    module.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                accumulate_grad_batches=accumulate, callbacks=callbacks or [])
    return module


@pytest.mark.parametrize(("module", "accumulate", "batch_idx", "expected"), [
    (Plain(), 1, 0, True),
    (Plain(), 1, 5, True),
    (Plain(), 2, 1, False),  # inside an accumulation window: Lightning keeps them
    (Plain(), 2, 2, True),  # a window's first batch
    (Plain(), 1, None, False),  # no batch in progress (outside fit)
    (OverridesZeroGrad(), 1, 3, False),  # the override decides what happens to them
    (InspectsGradients(), 1, 3, False),  # the module looks at them in on_before_zero_grad
    (Manual(), 1, 3, False),  # the user calls zero_grad
])
def test_rule_follows_lightning(module: pl.LightningModule, accumulate: int, batch_idx: int | None, expected: bool) -> None:
    assert gradients_dropped_before_backward(_attached(module, accumulate), batch_idx) is expected


def test_a_callback_inspecting_gradients_keeps_them() -> None:
    assert not gradients_dropped_before_backward(_attached(Plain(), callbacks=[CallbackInspects()]), 3)
    assert gradients_dropped_before_backward(_attached(Plain(), callbacks=[pl.Callback()]), 3)


def test_skipped_backward_keeps_them() -> None:
    module = _attached(Plain())
    module.trainer.fit_loop._skip_backward = True  # what StochasticWeightAveraging sets while it recomputes BatchNorm
    assert not gradients_dropped_before_backward(module, 3)


def test_unattached_module_keeps_them() -> None:
    assert not gradients_dropped_before_backward(Plain(), 0)


def test_only_the_optimizers_gradients_are_freed() -> None:
    module = _attached(Plain())
    optimizer = torch.optim.SGD(module.net.parameters(), lr=0.1)
    module.frozen_out(module.net(torch.randn(4, 3))).sum().backward()
    assert free_dropped_gradients(module, 2, [optimizer])
    assert all(p.grad is None for p in module.net.parameters())
    assert all(p.grad is not None for p in module.frozen_out.parameters())  # as optimizer.zero_grad() leaves them
    module.frozen_out(module.net(torch.randn(4, 3))).sum().backward()
    assert not free_dropped_gradients(_attached(module, accumulate=2), 1, [optimizer])  # inside a window: kept
    assert all(p.grad is not None for p in module.net.parameters())
