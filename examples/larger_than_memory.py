"""Train a GPT that no rank could hold whole, under ``zero3`` or ``pp``, on 4 CPU processes.

The default shape (48 layers x 1600 wide, vocab 8192) has 1.50B parameters (fp32 5.6 GiB):
fp32 parameters plus gradients are 11.2 GiB *per rank* under Lightning's ``ddp`` (which
replicates them), 45 GiB for 4 ranks, about twice this 24 GiB machine. Built the way Lightning
documents for large models,

    with trainer.init_module(empty_init=True):
        model = GPT(...)

the parameters have no storage until the strategy has laid the model out; then each rank
allocates and initialises only what it holds (its 1/4 shards under ``zero3``, its stage under
``pp``), so no process ever holds the whole model. Every rank prints its peak RSS and the
parameters and gradients it holds after the last step.

    MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_TRIM_THRESHOLD_=1048576 python examples/larger_than_memory.py --strategy zero3
    MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_TRIM_THRESHOLD_=1048576 python examples/larger_than_memory.py --strategy pp
    python examples/larger_than_memory.py --strategy zero3 --layers 2 --width 64   # seconds

``MALLOC_*`` (glibc): FSDP2 gathers each block's parameters and frees them again,
block after block; with glibc's adaptive threshold those frees stay in its heap and the RSS
keeps growing (measured: past 5.5 GiB per rank in the first step under ``zero3``); with a fixed
1 MiB threshold every large tensor is its own mapping and goes back to the system when freed
(3.8 GiB peak per rank for the whole run).

Lightning re-runs this script for every extra rank.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_parallel  # noqa: F401  (registers "zero3", "pp", ...)
from lightning_parallel.models.gpt import GPT

GIB = 2**30


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in bytes; 0 where there is none."""
    path = Path("/proc/self/status")
    if not path.exists():
        return 0
    for line in path.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class MemoryReport(pl.Callback):
    """Per-step losses, and after the last step the bytes of parameters and gradients this rank
    holds (local shards of DTensors) and its peak RSS: what docs/memory.md reports."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.held: dict[str, int] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        self.losses.append(float(loss) if loss is not None else float("nan"))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        params = {local(p).untyped_storage()._cdata: local(p) for p in pl_module.parameters() if not local(p).is_meta}
        grads = [local(p.grad) for p in pl_module.parameters() if p.grad is not None]
        self.held = {"params_held": sum(t.untyped_storage().nbytes() for t in params.values()),
                     "grads_held": sum(g.numel() * g.element_size() for g in grads)}


def train(strategy: str, layers: int, width: int, heads: int, vocab: int, block: int, steps: int,
          devices: int = 4) -> dict[str, Any]:
    """One ``fit`` of ``steps`` SGD steps on this rank; returns what this rank measured."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    base_rss = _status_bytes("VmRSS")
    report = MemoryReport()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                         callbacks=[report])
    pl.seed_everything(0, verbose=False)
    with trainer.init_module(empty_init=True):  # meta device: no rank allocates the whole model
        model = GPT(vocab_size=vocab, block_size=block, n_layer=layers, n_head=heads, n_embd=width, lr=1e-3)
    num_params = sum(p.numel() for p in model.parameters())
    # Random next-token data; the batch is split over the data-parallel ranks (all 4 under zero3,
    # none under pp, whose microbatches split the one batch instead).
    gen = torch.Generator().manual_seed(0)
    stream = torch.randint(0, vocab, (64, block + 1), generator=gen)
    data = TensorDataset(stream[:, :-1].contiguous(), stream[:, 1:].contiguous())
    sampler_kwargs = trainer.strategy.distributed_sampler_kwargs  # type: ignore[attr-defined]
    sampler = DistributedSampler(data, shuffle=False, drop_last=True, **sampler_kwargs)
    loader = DataLoader(data, batch_size=max(1, 4 // sampler_kwargs["num_replicas"]), sampler=sampler, drop_last=True)
    trainer.fit(model, loader)
    return {"rank": trainer.global_rank, "params": num_params, "losses": report.losses, **report.held,
            "peak_rss": _status_bytes("VmHWM"), "rss_growth": _status_bytes("VmHWM") - base_rss}


def describe(strategy: str, result: dict[str, Any]) -> str:
    """One line per rank: what it held and its peak memory."""
    losses = " ".join(f"{v:.4f}" for v in result["losses"])
    return (f"{strategy} rank {result['rank']}: {result['params'] / 1e9:.2f}B parameters "
            f"(fp32 {result['params'] * 4 / GIB:.2f} GiB); held params {result['params_held'] / GIB:.2f} GiB "
            f"+ grads {result['grads_held'] / GIB:.2f} GiB; peak RSS {result['peak_rss'] / GIB:.2f} GiB "
            f"(+{result['rss_growth'] / GIB:.2f} GiB over the bare process); losses {losses}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", choices=["zero3", "pp"], default="zero3")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--heads", type=int, default=None, help="default: width // 64 (at least 1)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--block", type=int, default=16, help="sequence length")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--devices", type=int, default=4)
    args = parser.parse_args()
    heads = args.heads or max(1, args.width // 64)
    result = train(args.strategy, args.layers, args.width, heads, args.vocab, args.block, args.steps, args.devices)
    print(describe(args.strategy, result), flush=True)


if __name__ == "__main__":
    main()
