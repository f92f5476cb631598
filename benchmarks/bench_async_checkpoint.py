"""How long a sharded save blocks the step: synchronous vs ``async_save=True``, side by side.

Two gloo ranks each hold half of a model's state (``--mib`` MiB of fp32 in all, 8 tensors per
rank, what ZeRO-3 leaves a rank); each round writes it once synchronously
(``checkpoint.save_sharded``) and once in the background (``AsyncCheckpointWriter.save``,
which returns after staging), then waits for the background write. Printed per round: the
time the step is blocked by each, and their ratio (target: async blocks at most 0.10 of a
synchronous save). Not a test: these machines are noisy; run it on a quiet one::

    python benchmarks/bench_async_checkpoint.py --mib 512 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _rank_main(mib: int, rounds: int, directory: str) -> list[dict[str, float]]:
    import torch.distributed as dist

    from lightning_parallel.strategies.checkpoint.async_save import AsyncCheckpointWriter
    from lightning_parallel.strategies.checkpoint.files import save_sharded

    rank = dist.get_rank()
    numel = mib * 2**20 // 4 // 2 // 8  # half the state per rank, in 8 tensors
    shards = {f"layer{i}.rank{rank}": torch.randn(numel) for i in range(8)}
    writer = AsyncCheckpointWriter()
    out = []
    for r in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        save_sharded({"state_dict": dict(shards), "step": r}, Path(directory) / f"sync-{r}")
        sync = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        writer.save({"state_dict": dict(shards), "step": r}, Path(directory) / f"async-{r}")
        blocked = time.perf_counter() - start
        for tensor in shards.values():  # the "next steps" change the state; the staged copy must not
            tensor.add_(1.0)
        start = time.perf_counter()
        writer.wait()
        finish = time.perf_counter() - start
        out.append({"sync_s": sync, "async_blocked_s": blocked, "async_wait_s": finish})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256, help="total state size over both ranks")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    from lightning_parallel.testing import run_distributed

    with tempfile.TemporaryDirectory() as directory:
        results: list[Any] = run_distributed(_rank_main, 2, args.mib, args.rounds, directory, timeout=1800)
    rows = results[0]
    print(f"state {args.mib} MiB over 2 ranks; seconds the save blocks the step (rank 0)")
    print("round  sync   async(blocked)  ratio   async(rest, in background)")
    for i, row in enumerate(rows):
        print(f"{i:5d}  {row['sync_s']:5.2f}  {row['async_blocked_s']:14.3f}  {row['async_blocked_s'] / row['sync_s']:5.3f}"
              f"   {row['async_wait_s']:.2f}")
    ratio = statistics.median(r["async_blocked_s"] / r["sync_s"] for r in rows)
    print(f"median blocked ratio async / sync = {ratio:.3f} (target <= 0.10)")


if __name__ == "__main__":
    main()
