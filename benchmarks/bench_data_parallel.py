"""Data-parallel benchmark, side by side in one invocation on the same model and batch:
1 process, Lightning's ``ddp`` on 2, our ``dp`` on 2, our ``zero3`` on 2. Prints ratios
against the targets:

* our ``dp`` step time <= 1.03 x Lightning's ``ddp``;
* ``dp`` on 2 processes >= 1.8 x the samples/s of 1 process (a compute-bound model; each
  process gets one intra-op thread, so 2 processes use 2 cores);
* ``zero3`` model-state bytes per rank <= 1.05 x (single-process bytes / 2).

Not a timed test: timing depends on the machine (and on whoever else is using it). Each run
trains the seeds' "large" MLP shape (scaled by ``--width``) for ``--steps`` steps with the same
per-rank batch; step times are the median after ``--warmup`` steps, taken by the parallelism
monitor with communication timing off (so our runs carry no extra hooks).

    python benchmarks/bench_data_parallel.py --steps 30 --width 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_parallel  # noqa: F401  (registers the strategy names)
from lightning_parallel.callbacks import ParallelismMonitor, model_state_bytes
from lightning_parallel.launcher import run_distributed


class WideMLP(pl.LightningModule):
    """Compute-bound: a few wide Linear layers, so a step is mostly matmuls, not overhead."""

    def __init__(self, width: int, depth: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


class _StateProbe(pl.Callback):
    """Model-state bytes right before the last optimizer step (gradients and optimizer state present)."""

    def __init__(self) -> None:
        self.state: dict[str, int] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.state = model_state_bytes(pl_module, trainer.optimizers)


class _StepTimes(ParallelismMonitor):
    def __init__(self) -> None:
        super().__init__(warmup_steps=0, measure_communication=False, prog_bar=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.times = [s[0] for s in self._steps]


def _fit(strategy: str, devices: int, width: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(batch * (steps + 1) * max(devices, 1), width)
    data = DataLoader(TensorDataset(x, torch.randint(0, 10, (len(x),))), batch_size=batch, drop_last=True)
    timer, probe = _StepTimes(), _StateProbe()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer, probe],
    )
    trainer.fit(WideMLP(width), data)
    step = statistics.median(timer.times[warmup:])
    # With gradients (zeroed lazily at the next step) still present after the last step.
    return {"step_s": step, "samples_per_s": batch * devices / step, "state": probe.state}


def run(strategy: str, devices: int, args: argparse.Namespace) -> dict[str, Any]:
    params = (strategy, devices, args.width, args.batch, args.steps, args.warmup)
    if devices == 1:
        return _fit(*params)
    results = run_distributed(_fit, devices, *params, init_backend=None, timeout=900)
    slowest = max(r["step_s"] for r in results)
    return {"step_s": slowest, "samples_per_s": args.batch * devices / slowest, "state": results[0]["state"],
            "state_max": max(r["state"]["total"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch (the same for every run)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run Lightning's ddp and our dp alternately this many times; their ratio is the median of the rounds'")
    args = parser.parse_args()
    runs = {"1 process": ("auto", 1), "lightning ddp x2": ("ddp", 2), "our dp x2": ("dp", 2), "our zero3 x2": ("zero3", 2)}
    results = {name: run(strategy, devices, args) for name, (strategy, devices) in runs.items()}
    round_ratios = [results["our dp x2"]["step_s"] / results["lightning ddp x2"]["step_s"]]
    for _ in range(args.rounds - 1):  # the pair side by side again: the machine's load drifts between runs
        ddp_s, dp_s = run("ddp", 2, args)["step_s"], run("dp", 2, args)["step_s"]
        round_ratios.append(dp_s / ddp_s)
    print(f"\nmodel: WideMLP width={args.width}, per-rank batch {args.batch}, {args.steps} steps (median after {args.warmup})")
    print(f"{'run':<18}{'step ms':>10}{'samples/s':>12}{'state MiB/rank':>16}")
    for name, r in results.items():
        print(f"{name:<18}{1e3 * r['step_s']:>10.1f}{r['samples_per_s']:>12.1f}{r['state']['total'] / 2**20:>16.2f}")
    single, ddp, dp, zero3 = (results[n] for n in runs)
    dp_ratio = statistics.median(round_ratios)
    ratios = [
        ("our dp step time / lightning ddp", dp_ratio, "<= 1.03", dp_ratio <= 1.03),
        ("dp x2 samples/s / 1 process", dp["samples_per_s"] / single["samples_per_s"], ">= 1.8",
         dp["samples_per_s"] / single["samples_per_s"] >= 1.8),
        ("zero3 state per rank / (single / 2)", zero3["state_max"] / (single["state"]["total"] / 2), "<= 1.05",
         zero3["state_max"] / (single["state"]["total"] / 2) <= 1.05),
    ]
    if args.rounds > 1:
        print(f"our dp / lightning ddp per round: {' '.join(f'{r:.3f}' for r in round_ratios)} (median below)")
    print()
    for name, value, target, ok in ratios:
        print(f"{name:<38}{value:>8.3f}  target {target:<8}{'MET' if ok else 'NOT MET'}")


if __name__ == "__main__":
    main()
