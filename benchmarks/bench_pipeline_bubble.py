"""Measured pipeline bubble vs the textbook (p - 1) / (m + p - 1), for GPipe and 1F1B.

Not a timed test: run ``python benchmarks/bench_pipeline_bubble.py [--pp 2 4] [--microbatches 4 8]``.

What is measured: on every rank, the time spent inside stage compute (each microbatch's
forward and backward, timed around ``forward_one_chunk`` / ``backward_one_chunk``) against the
wall time of the whole ``train_step``. ``bubble = 1 - busy / wall``, averaged over ranks. The
theory assumes equal stages, backward = a fixed multiple of forward and free communication, so
the measured value is higher by the communication and scheduling overhead; GPipe and 1F1B have
the same theoretical bubble (1F1B saves activation memory, not idle time).

Caveat: with more ranks than free CPU cores the processes time-share cores and the busy time
is inflated by waiting for a core, which hides the bubble; read p=4 on a 2-core machine with
that in mind (the script prints the core count).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.parallel.pipeline.runtime import build_pipeline
from lightning_parallel.parallel.pipeline.trace import trace_pipeline
from lightning_parallel.parallel.pipeline.plan import plan_pipeline
from lightning_parallel.parallel.pipeline.schedules import schedule_spec
from lightning_parallel.testing import run_distributed

WIDTH, ROWS_PER_MICROBATCH, BLOCKS_PER_STAGE, STEPS, WARMUP = 512, 128, 2, 5, 2


class Stack(nn.Module):
    """Equal blocks, so every stage costs the same (the theory's assumption)."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)) for _ in range(blocks))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _timed(stage: Any, busy: list[float]) -> None:
    """Accumulate the compute time of this stage's forward and backward calls into ``busy``."""
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        inner = getattr(stage, name)

        def wrapper(*args: Any, __inner: Any = inner, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return __inner(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start

        setattr(stage, name, wrapper)


def _bench_worker(microbatch_counts: list[int]) -> list[dict[str, Any]]:
    pp = dist.get_world_size()
    torch.manual_seed(0)
    model = Stack(BLOCKS_PER_STAGE * pp)
    plan = plan_pipeline(model, pp)
    rows = []
    for m in microbatch_counts:
        x = torch.randn(m * ROWS_PER_MICROBATCH, WIDTH)
        traced = trace_pipeline(model, (x,), plan=plan, microbatches=m, build_eval=False)
        for name in ("gpipe", "1f1b"):
            runtime = build_pipeline(
                model, plan=plan, schedule=schedule_spec(name), microbatches=m, loss_fn=lambda out, rows: F.mse_loss(out, x[rows]), traced=traced, build_eval=False
            )
            busy = [0.0]
            for stage in runtime.stages:
                _timed(stage, busy)
            wall = 0.0
            for step in range(WARMUP + STEPS):
                if step == WARMUP:
                    busy[0] = 0.0
                dist.barrier()
                start = time.perf_counter()
                runtime.train_step(x)
                if step >= WARMUP:
                    wall += time.perf_counter() - start
                model.zero_grad(set_to_none=True)
            rows.append({"schedule": name, "m": m, "busy": busy[0], "wall": wall})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    print(f"CPU cores available: {len(os.sched_getaffinity(0))}; width {WIDTH}, {ROWS_PER_MICROBATCH} rows per microbatch, {STEPS} timed steps")
    print(f"{'p':>2} {'m':>2} {'schedule':>8} {'measured':>9} {'theory':>7} {'ratio':>6} {'step ms':>8}")
    for pp in args.pp:
        per_rank = run_distributed(_bench_worker, pp, args.microbatches, timeout=600)
        for i, row in enumerate(per_rank[0]):
            m = row["m"]
            bubble = sum(1.0 - r[i]["busy"] / r[i]["wall"] for r in per_rank) / pp
            theory = (pp - 1) / (m + pp - 1)
            step_ms = 1000 * max(r[i]["wall"] for r in per_rank) / STEPS
            print(f"{pp:>2} {m:>2} {row['schedule']:>8} {bubble:>9.3f} {theory:>7.3f} {bubble / theory:>6.2f} {step_ms:>8.1f}")


if __name__ == "__main__":
    main()
