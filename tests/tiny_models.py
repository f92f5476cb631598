"""Small LightningModules used by the multi-process tests; they know nothing of parallelism."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy


class Block(nn.Module):
    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


class TinyNet(pl.LightningModule):
    """Stem, a stack of identical residual blocks, a head: SGD, logs loss and a torchmetrics metric.

    ``layer_drop`` skips each block in training with that probability, decided by one draw per
    block and step (LayerDrop, Fan et al. 2019): unlike dropout's per-sample masks the draw does
    not depend on the batch, so every rank (all seeded alike) makes the same decisions as one
    process would. A skipped block is multiplied by zero rather than left out, so its parameters
    stay in the graph (zero gradients) and DDP finds every gradient it waits for.
    """

    def __init__(self, in_dim: int = 16, width: int = 32, depth: int = 3, num_classes: int = 4, lr: float = 0.5,
                 momentum: float = 0.0, dropout: float = 0.0, layer_drop: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Linear(in_dim, width)
        self.blocks = nn.ModuleList([Block(width, dropout) for _ in range(depth)])
        self.head = nn.Linear(width, num_classes)
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            out = block(h)
            if self.training and self.hparams.layer_drop > 0:
                keep = (torch.rand(()) >= self.hparams.layer_drop).to(out.dtype)
                out = h + keep * (out - h)
            h = out
        return self.head(h)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
