"""A small GPT, written as a plain LightningModule, trained with the most capable layout this
package runs today: tensor parallelism inside a group of ranks (Megatron-style on DTensor,
plan found automatically) and ZeRO-3 sharding across groups.

    python examples/gpt_hybrid.py                 # 2 processes: tp=2
    python examples/gpt_hybrid.py --devices 4     # 4 processes: dp=2 (ZeRO-3) x tp=2

Nothing in the model mentions parallelism. Lightning re-runs this script for every extra rank.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_parallel  # noqa: F401  (registers the strategy names)
from lightning_parallel import HybridParallelStrategy
from lightning_parallel.callbacks import ParallelismMonitor


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (f(x).view(B, T, self.heads, C // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(dim), Attention(dim, heads), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(pl.LightningModule):
    def __init__(self, vocab: int = 64, block: int = 32, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)


def counting_sequences(n: int = 512, block: int = 32, vocab: int = 64) -> TensorDataset:
    """Sequences that count up mod ``vocab`` from random starts: learnable in a few steps."""
    stream = (torch.randint(0, vocab, (n, 1)) + torch.arange(block + 1)) % vocab
    return TensorDataset(stream[:, :-1].contiguous(), stream[:, 1:].contiguous())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    pl.seed_everything(0)
    strategy = HybridParallelStrategy(tensor_parallel_size=2, data_parallel_size="auto", zero_stage=3)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps, logger=False,
        enable_checkpointing=False, callbacks=[ParallelismMonitor(output_dir=".")],
    )
    trainer.fit(TinyGPT(), DataLoader(counting_sequences(), batch_size=16, shuffle=True, drop_last=True))
    if trainer.is_global_zero:
        dims = trainer.strategy.parallel_dims
        print(f"done: dp={dims.dp} tp={dims.tp} steps={trainer.global_step} "
              f"train_loss={float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    main()
