"""Does the planner order this machine's layouts as they run? Predicted vs measured step times.

After :func:`~lightning_parallel.planner.hardware.calibrate_cpu` measures this machine, the planner
predicts the step time of the six layouts of tests/test_planner_peak_memory.py (the package's GPT,
fp32, 16 sequences of 64 tokens per step on 2 processes: dp, zero1, zero2, zero3, tp2, pp2). Two
spawned ranks then train each layout through ``Trainer`` + the strategy for ``--steps`` steps,
``--rounds`` times, the layouts interleaved (each round in a rotated order, so a slow spell of a
shared machine lands on different layouts); a layout's measured step time is the median over
rounds of its per-round median step (first ``--warmup`` steps dropped). Prints both and the
Spearman rank correlation (issue #16 asks for at least 0.8), for each of ``--runs`` independent
runs (each calibrates afresh), then all of them.

Timing on a shared machine measures the machine as much as the code: run it when the load average
is low (it refuses above ``--max-load`` unless ``--force``).

    python benchmarks/bench_planner_rank.py [--runs 3] [--rounds 5] [--steps 8] [--warmup 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.test_planner_peak_memory import GLOBAL_BATCH, GPT_KW, LAYOUTS, SEQ, _strategy  # noqa: E402


def _timer() -> Any:
    from lightning.pytorch import Callback

    class StepTimer(Callback):
        """Wall time of each training step (forward, backward, optimizer step)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self._start)

    return StepTimer()


def _fit(spec: Any, want: dict[str, int], steps: int, root: str) -> list[float]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_parallel.models import GPT
    from lightning_parallel.testing.parity import token_data

    torch.manual_seed(0)
    timer = _timer()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=_strategy(spec), max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer], default_root_dir=root,
    )
    dp = 2 // (want["tp"] * want["pp"])
    data = token_data(GLOBAL_BATCH * steps, SEQ, GPT_KW["vocab_size"])
    trainer.fit(GPT(**GPT_KW), DataLoader(data, batch_size=GLOBAL_BATCH // dp))
    return timer.times


def _rounds(root: str, rounds: int, steps: int, warmup: int) -> dict[str, list[float]]:
    names = list(LAYOUTS)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            spec, want = LAYOUTS[name]
            times = _fit(spec, want, steps, f"{root}/{r}/{name}")
            out[name].append(statistics.median(times[warmup:]))
    return out


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1  # ties share their average rank
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def predicted_step(want: dict[str, int], hardware: Any) -> float:
    from lightning_parallel.models import GPT
    from lightning_parallel.planner.search import SearchSpace, plan_layouts
    from lightning_parallel.planner.model import model_facts

    with torch.device("meta"):
        model = GPT(**GPT_KW)
    space = SearchSpace(tensor_parallel_size=want["tp"], pipeline_parallel_size=want["pp"], zero_stages=(want["zero"],),
                        activation_checkpointing=(False,), cpu_offload=(False,), hybrid_shard=(False,),
                        sequence_parallel=(False,), schedules=("1f1b",), microbatches=2 if want["pp"] > 1 else None)
    result = plan_layouts(model_facts(model), 2, global_batch=GLOBAL_BATCH, seq_len=SEQ, hardware=hardware, dtype="fp32",
                          optimizer="sgd_momentum", space=space)
    return result.ranked[0].step_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="independent calibrate-and-measure runs")
    parser.add_argument("--max-load", type=float, default=3.0)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--root", default="/tmp/bench_planner_rank")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    if load >= args.max_load and not args.force:
        sys.exit(f"load average {load:.1f} >= {args.max_load}: timings would measure the other jobs; rerun later or --force")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from lightning_parallel.planner.hardware import calibrate_cpu
    from lightning_parallel.testing import run_distributed

    names = list(LAYOUTS)
    results = []
    for run in range(args.runs):  # each run calibrates afresh, then times every layout
        start_load = os.getloadavg()[0]
        profile = calibrate_cpu()
        print(f"run {run + 1}/{args.runs} calibrated: {profile.notes}")
        measured = run_distributed(_rounds, 2, f"{args.root}/{run}", args.rounds, args.steps, args.warmup,
                                   init_backend=None, timeout=3600)[0]
        pred = [predicted_step(LAYOUTS[n][1], profile) for n in names]
        meas = [statistics.median(measured[n]) for n in names]
        print(f"{'layout':8} {'predicted ms':>13} {'measured ms':>12}  per-round medians (ms)")
        for n, p, m in zip(names, pred, meas):
            print(f"{n:8} {p * 1e3:13.1f} {m * 1e3:12.1f}  " + " ".join(f"{t * 1e3:.1f}" for t in measured[n]))
        rho = spearman(pred, meas)
        results.append(rho)
        print(f"run {run + 1}: Spearman rank correlation {rho:.2f} (load average at start {start_load:.1f})")
    print(f"Spearman over {len(results)} runs: " + ", ".join(f"{r:.2f}" for r in results)
          + f"; median {statistics.median(results):.2f}, least {min(results):.2f}")


if __name__ == "__main__":
    main()
