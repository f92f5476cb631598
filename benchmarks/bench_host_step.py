"""Step time and fresh pages per step on the CPU, with and without issue 29's measures, side by side.

Not a timed test. ``benchmarks/bench_memory.py`` measures memory with a tensor tracker that runs
Python on every op, which distorts step times; this one runs ``trainer.fit`` alone. Per layout, the
final code and the code before issue 29's measures (``--before``: glibc's dynamic mmap threshold, torch's huge pages off,
autograd's weight-gradient temporaries in pipeline stages, FSDP2's per-unit host buffers through
gloo's own collectives; or ``--unpinned``: the final code with the dynamic threshold only) run in
turn, ``--repeat`` times, each in a fresh group of 4 spawned ranks: the meta-built 32 x 512 GPT of
README's memory table, global batch 4 x 64 tokens, SGD. Printed per run (worst rank): the mean step
after the first, the minor page faults per step (pages the process touched for the first time:
fresh ``mmap`` s fault in, recycled heap memory does not) and the peak RSS growth over the process
at start in units of the model's fp32 parameter bytes P; then the step-time ratio of each pair.

Run: ``python benchmarks/bench_host_step.py --layouts zero3,tp,pp,3d --repeat 2`` (about 1 minute a
run on 2 shared cores).
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
from bench_memory import _status, ranks_environment, switch_off_issue_29

from lightning_parallel.launcher import run_distributed


def _worker(args: argparse.Namespace, layout: str, variant: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, DistributedSampler

    import lightning_parallel  # noqa: F401 - registers the strategies
    from lightning_parallel.models.gpt import GPT
    from lightning_parallel.testing.parity import token_data

    torch.set_num_threads(1)
    switch_off_issue_29(unpinned=variant != "now", before=variant == "before")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    base = _status("VmRSS")
    times: list[float] = []
    faults: list[int] = []

    class Timer(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            self.t0, self.f0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        def on_train_batch_end(self, *args: Any) -> None:
            times.append(time.perf_counter() - self.t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.f0)

    trainer = pl.Trainer(accelerator="cpu", devices=args.ranks, strategy=layout, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[Timer()])
    pl.seed_everything(0, verbose=False)
    with trainer.init_module(empty_init=True):
        model = GPT(vocab_size=256, block_size=64, n_layer=args.layers, n_head=8, n_embd=512, lr=1e-3)
    if getattr(trainer.strategy, "lightning_module", "n/a") is None:
        trainer.strategy.connect(model)  # '3d' reads the model to choose its degrees
    sampler_kwargs = trainer.strategy.distributed_sampler_kwargs
    data = token_data(64, block_size=64, vocab_size=256)
    sampler = DistributedSampler(data, shuffle=False, drop_last=True, **sampler_kwargs)
    trainer.fit(model, DataLoader(data, batch_size=max(1, 4 // sampler_kwargs["num_replicas"]), sampler=sampler))
    later = slice(1, None)  # the first step builds pipelines and warms up
    return {"step": sum(times[later]) / len(times[later]), "faults": sum(faults[later]) / len(faults[later]),
            "rss": _status("VmHWM") - base, "loss": float(trainer.callback_metrics["train_loss"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default="zero3,tp,pp,3d")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--unpinned", action="store_true", help="compare with the final code under glibc's dynamic threshold")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    P = args.layers * 12 * 512 * 512 * 4 + 256 * 512 * 4 * 2  # the GPT's fp32 parameter bytes (blocks, embeddings)
    other = "unpinned" if args.unpinned else "before"
    ratios: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        for layout in args.layouts.split(","):
            steps = {}
            for variant in ("now", other):
                with ranks_environment(before=variant == "before"):
                    results = run_distributed(_worker, args.ranks, args, layout, variant, init_backend=None, timeout=1500,
                                              fresh_process=True)
                steps[variant] = max(r["step"] for r in results)
                print(f"{layout:14} {variant:9} step {steps[variant]:.2f} s  fresh pages {max(r['faults'] for r in results) * 4096 / 2**20:6.0f}"
                      f" MiB/step  peak RSS {max(r['rss'] for r in results) / P:.3f} P  loss {results[0]['loss']:.4f}", flush=True)
            ratios.setdefault(layout, []).append(steps["now"] / steps[other])
    for layout, values in ratios.items():
        print(f"{layout:14} step now / {other}: " + ", ".join(f"{v:.2f}x" for v in values))


if __name__ == "__main__":
    main()
