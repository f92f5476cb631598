"""A job for ``torchrun``: parity fits that crash once and must resume by themselves.

Run as ``python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts N
-m lightning_parallel.testing.elastic_job --out DIR --strategies dp,zero3,...`` (the test in
``tests/test_elastic.py`` does). Each strategy fits the same spec with a ``ModelCheckpoint``
(every few steps, ``save_last=True``) and ``ckpt_path="last"``, Lightning's convention for
"resume if there is something to resume from" (it starts from scratch when there is none).

Attempt ``k`` (torchrun's ``TORCHELASTIC_RESTART_COUNT``) kills one rank of strategy ``k``
mid-epoch, after the last checkpoint, with ``os._exit`` (no Python clean-up, as a crash or an
OOM kill would); torchrun then tears the group down and starts attempt ``k + 1``, which skips
the strategies already done, resumes strategy ``k`` from its ``last.ckpt`` and crashes
strategy ``k + 1``. Results (per-step losses of the resumed attempt, final parameters) are
written by rank 0 to ``DIR/<strategy>.pt``; the test compares them with one process.

Two nodes on one machine use the same job (``--nnodes 2 --node-rank i``, ``--no-crash``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

SPEC_KWARGS: dict[str, Any] = {
    "model": "lightning_parallel.models:GPT",
    "model_kwargs": {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16, "lr": 0.3},
    "data": "lightning_parallel.testing.parity:token_data",
    "data_kwargs": {"num_samples": 64, "block_size": 8, "vocab_size": 32},
    "global_batch": 8,
    "max_steps": 7,
    "trainer_kwargs": {"gradient_clip_val": 0.5},
}
CHECKPOINT_EVERY = 2
CRASH_AFTER_STEP = 5  # the last checkpoint before it is step 4: steps 5-7 are redone after the restart


class CrashAt:
    """Callback factory: ``os._exit(1)`` on ``rank`` once ``global_step`` reaches ``step``."""

    def __new__(cls, step: int, rank: int) -> Any:
        from lightning.pytorch import Callback

        class Crash(Callback):
            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                if trainer.global_step == step and trainer.global_rank == rank:
                    os._exit(1)

        return Crash()


def fit_spec(strategy: Any, devices: int, out: Path, name: str, crash: bool, trainer_kwargs: dict[str, Any] | None = None) -> Any:
    from lightning_parallel.testing.parity import FitSpec

    spec = FitSpec(**SPEC_KWARGS)
    callbacks = [("lightning_parallel.testing.elastic_job:CrashAt", {"step": CRASH_AFTER_STEP, "rank": 1})] if crash else []
    return dataclasses.replace(
        spec, strategy=strategy, devices=devices, checkpoint_every=CHECKPOINT_EVERY, checkpoint_dir=str(out / name),
        save_last=True, resume_from="last", callbacks=callbacks,
        trainer_kwargs={**spec.trainer_kwargs, **(trainer_kwargs or {})},
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategies", required=True, help="comma-separated preset names")
    parser.add_argument("--no-crash", action="store_true", help="never crash (the two-node run)")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout (s): a hang fails the attempt")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from lightning_parallel.testing.parity import run_fit

    out = Path(args.out)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    for index, name in enumerate(args.strategies.split(",")):
        result_file = out / f"{name}.pt"
        if result_file.exists():
            continue  # finished in an earlier attempt
        crash = not args.no_crash and index == attempt
        strategy = {"class": "lightning_parallel:strategy_from_name", "name": name, "timeout": args.timeout}
        result = run_fit(fit_spec(strategy, devices, out, name, crash, {"num_nodes": args.num_nodes}))
        if int(os.environ.get("RANK", "0")) == 0:
            result["attempt"] = attempt
            torch.save(result, out / f"{name}.pt.tmp")
            (out / f"{name}.pt.tmp").rename(result_file)
        torch.distributed.barrier()  # nobody starts the next strategy (and may crash) before the file exists


if __name__ == "__main__":
    main()
