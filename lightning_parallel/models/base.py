"""Shared LightningModule plumbing for the model zoo: steps, metrics, logging, optimizers.

Every model here predicts class logits: an MLP classifies a vector, a GPT classifies the next
token over its vocabulary. So one base class owns what they have in common, written the way a
user writes it by hand (``self(x)`` once per step, ``self.log`` with ``sync_dist=True``, a
torchmetrics object logged directly). The strategies must train these modules *unchanged*, so
nothing here knows about meshes, DTensors or process groups: if a strategy needs a hook in
this file to work, the strategy is wrong, not the model.

Why the loss is a method (:meth:`ClassificationModule.compute_loss`): a subclass such as an
MoE GPT may want to add an auxiliary term without copying the step logic.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from lightning_parallel.errors import config_error

OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")
"""Names accepted by the ``optimizer`` argument of every model in the zoo."""


def check_positive_int(field: str, value: Any) -> int:
    """Return ``value`` if it is a positive int (bools refused), else raise a typed config error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise config_error(TypeError, field, value, "must be an int", f"pass a positive integer for `{field}`")
    if value <= 0:
        raise config_error(ValueError, field, value, "must be > 0", f"pass a positive integer for `{field}`")
    return value


def check_fraction(field: str, value: Any, *, allow_zero: bool = True) -> float:
    """Return ``value`` as a float in [0, 1) (or (0, 1) without ``allow_zero``), else raise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise config_error(TypeError, field, value, "must be a float", f"pass a number in [0, 1) for `{field}`")
    low_ok = value >= 0 if allow_zero else value > 0
    if not (low_ok and value < 1):
        interval = "[0, 1)" if allow_zero else "(0, 1)"
        raise config_error(ValueError, field, value, f"must lie in {interval}", f"pass a number in {interval}")
    return float(value)


def _check_optimizer_args(lr: Any, optimizer: Any, momentum: Any, weight_decay: Any, eps: Any) -> None:
    """Validate the optimizer arguments at construction, not at ``fit`` time on every rank."""
    for field, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise config_error(TypeError, field, value, "must be a float", f"pass a number for `{field}`")
    if not lr > 0:
        raise config_error(ValueError, "lr", lr, "must be > 0", "pass a positive learning rate such as 0.05")
    if not isinstance(optimizer, str) or optimizer.lower() not in OPTIMIZERS:
        raise config_error(
            ValueError, "optimizer", optimizer, f"must be one of {OPTIMIZERS}", "use optimizer='sgd' or 'adamw'"
        )
    if not 0 <= momentum < 1:
        raise config_error(ValueError, "momentum", momentum, "must lie in [0, 1)", "use 0.0 (plain SGD) or 0.9")
    if weight_decay < 0:
        raise config_error(ValueError, "weight_decay", weight_decay, "must be >= 0", "use 0.0 to disable it")
    if not eps > 0:
        raise config_error(ValueError, "eps", eps, "must be > 0", "use the AdamW default 1e-8")


class ClassificationModule(L.LightningModule):
    """Base for modules whose ``forward`` returns class logits ``(..., num_classes)``.

    A batch is ``(inputs, targets)``; targets hold class indices of the logits' leading shape
    (``(B,)`` for a classifier, ``(B, T)`` for a language model). Subclasses build their layers
    and implement ``forward``; they call ``self.save_hyperparameters()`` themselves so that the
    saved names are exactly their own constructor's (``type(m)(**m.hparams)`` rebuilds them).

    Why three metric objects: a torchmetrics object accumulates state between ``compute``
    calls, so training and evaluation must not share one.
    """

    def __init__(
        self,
        num_classes: int,
        lr: float,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        check_positive_int("num_classes", num_classes)
        _check_optimizer_args(lr, optimizer, momentum, weight_decay, eps)
        self.num_classes = num_classes
        self.lr = float(lr)
        self.optimizer_name = optimizer.lower()
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.eps = float(eps)
        # micro average = the fraction of correct predictions, what "accuracy" means to most users.
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def compute_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy over every prediction; subclasses may add terms (e.g. MoE balance)."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def _metric_inputs(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Flatten to ``(N,)`` predictions and targets, which every torchmetrics version accepts."""
        return logits.detach().argmax(dim=-1).reshape(-1), targets.reshape(-1)

    def _shared_step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        """Forward once, compute the loss, update the stage's metric, log both."""
        inputs, targets = batch
        logits = self(inputs)
        loss = self.compute_loss(logits, targets)
        metric: MulticlassAccuracy = getattr(self, f"{stage}_acc")
        metric(*self._metric_inputs(logits, targets))
        batch_size = int(targets.shape[0])
        self.log(f"{stage}_loss", loss, prog_bar=stage == "train", sync_dist=True, batch_size=batch_size)
        self.log(f"{stage}_acc", metric, prog_bar=stage == "train", sync_dist=True, batch_size=batch_size)
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._shared_step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._shared_step(batch, "test")

    def predict_step(self, batch: Tensor | tuple[Tensor, ...] | list[Tensor], batch_idx: int) -> Tensor:
        """Return the logits; accepts ``(inputs, targets)`` or bare inputs."""
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(inputs)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD (optionally with momentum) by default; AdamW when ``optimizer='adamw'``."""
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay, eps=self.eps)
        return torch.optim.SGD(
            self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
