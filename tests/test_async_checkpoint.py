"""Checkpoints saved in the background (``async_save=True``, ``strategies/checkpoint/async_save.py``).

* Under zero3 and tp (2 processes), a ``ModelCheckpoint`` every 2 steps with ``save_last``
  writes through ``dcp.async_save`` (counted: the synchronous ``dcp.save`` is never called),
  and every checkpoint it leaves is bit-equal to the one the synchronous save writes in the
  same run, the last one equal to the final parameters; no scratch directory is left behind.
* A rank that dies in the middle of a background write (``os._exit`` inside DCP's file
  writer, in the background thread) fails the run with an error, not a hang, and the
  previous checkpoint stays complete and loadable under the same name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_parallel.export import load_model_state
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fit

HYBRID = "lightning_parallel:HybridParallelStrategy"
SPEC = FitSpec(
    model="lightning_parallel.models:GPT",
    model_kwargs={"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16, "lr": 0.3},
    data="lightning_parallel.testing.parity:token_data",
    data_kwargs={"num_samples": 64, "block_size": 8, "vocab_size": 32},
    global_batch=8,
    max_steps=6,
    devices=2,
    checkpoint_every=2,
    save_last=True,
)
LAYOUTS = {"zero3": {"zero_stage": 3}, "tp": {"tensor_parallel_size": 2}}


def _count_saves() -> dict[str, int]:
    import torch.distributed.checkpoint as dcp

    import lightning_parallel.strategies.checkpoint.async_save as background
    import lightning_parallel.strategies.checkpoint.files as ckpt

    counts = {"async": 0, "sync": 0}
    async_save, save = dcp.async_save, dcp.save

    def counting_async(*args: Any, **kwargs: Any) -> Any:
        counts["async"] += 1
        return async_save(*args, **kwargs)

    def counting_sync(*args: Any, **kwargs: Any) -> Any:
        counts["sync"] += 1
        return save(*args, **kwargs)

    background.dcp.async_save = counting_async  # type: ignore[attr-defined]
    ckpt.dcp.save = counting_sync  # type: ignore[attr-defined]
    return counts


def _fit_both(directory: str) -> dict[str, Any]:
    counts = _count_saves()
    out: dict[str, Any] = {}
    for name, options in LAYOUTS.items():
        for mode in (False, True):
            before = dict(counts)
            spec = dataclasses.replace(SPEC, strategy={"class": HYBRID, "async_save": mode, **options},
                                       checkpoint_dir=f"{directory}/{name}-{mode}")
            result = run_fit(spec)
            out[f"{name}-{mode}"] = {"params": result["params"],
                                     "calls": {k: counts[k] - before[k] for k in counts}}
    return out


def test_background_saves_equal_synchronous_ones(tmp_path: Path) -> None:
    results = run_distributed(_fit_both, 2, str(tmp_path), init_backend=None, timeout=500)[0]
    for name in LAYOUTS:
        sync, background = results[f"{name}-False"], results[f"{name}-True"]
        assert background["calls"]["sync"] == 0 and background["calls"]["async"] >= 3, (name, background["calls"])
        assert sync["calls"]["async"] == 0, name
        names = sorted(p.name for p in (tmp_path / f"{name}-False").iterdir())
        assert names == sorted(p.name for p in (tmp_path / f"{name}-True").iterdir()), name  # no scratch left
        assert "last.ckpt" in names and "epoch=0-step=6.ckpt" in names, names
        for entry in names:
            a = load_model_state(tmp_path / f"{name}-False" / entry)
            b = load_model_state(tmp_path / f"{name}-True" / entry)
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key]), f"{name} {entry} {key}"
        final = load_model_state(tmp_path / f"{name}-True" / "last.ckpt")
        for key, value in background["params"].items():
            assert torch.equal(final[key], value), f"{name} {key}"


def _dies_in_background_write(directory: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.checkpoint import filesystem

    original = filesystem.FileSystemWriter.write_data
    calls = {"n": 0}

    def dying_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if dist.get_rank() == 1 and calls["n"] == 3:  # step 2 wrote its top-k and its last.ckpt; step 4 dies
            os._exit(17)
        return original(self, *args, **kwargs)

    filesystem.FileSystemWriter.write_data = dying_write  # type: ignore[method-assign]
    spec = dataclasses.replace(SPEC, strategy={"class": HYBRID, "zero_stage": 3, "async_save": True, "timeout": 20},
                               checkpoint_dir=directory, max_steps=4)
    run_fit(spec)


def test_a_crash_during_a_background_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"rank 1|exited with code 17"):
        run_distributed(_dies_in_background_write, 2, str(tmp_path), init_backend=None, timeout=120)
    state = load_model_state(tmp_path / "last.ckpt")  # still complete: the step-2 save
    reference = load_model_state(tmp_path / "epoch=0-step=2.ckpt")
    assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state)
    assert not (tmp_path / "epoch=0-step=4.ckpt").exists()
