"""The seed articles' first model (1000 -> 500 -> 100 -> 10), a plain LightningModule, trained
under any registered strategy by name: `python examples/quickstart.py --strategy zero3`.

Nothing in the model knows about parallelism. Lightning re-runs this script once per extra
rank (like torchrun), so it must be a script, not a notebook cell.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_parallel  # noqa: F401  (registers the strategy names)


class SeedModel(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(1000, 500), nn.Linear(500, 100), nn.Linear(100, 10)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    pl.seed_everything(0)
    x = torch.randn(1024, 1000)
    y = (x[:, :10]).argmax(dim=1)  # a learnable rule
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=args.strategy, max_steps=args.steps,
        logger=False, enable_checkpointing=False,
    )
    trainer.fit(SeedModel(), DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
    if trainer.is_global_zero:
        print(f"done: strategy={args.strategy} steps={trainer.global_step} train_loss={float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    main()
