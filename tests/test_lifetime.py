"""Lifetime and Lightning's strategy contract: what a fit leaves behind, and the default groups.

* A parallelised module is freed with its Trainer: the layout record lives inside the module
  (a reference cycle the garbage collector frees), not in a global table that keeps every
  model, its wrapper and its pipeline driver alive for the life of the process.
* ``teardown`` completes Lightning's (``checkpoint_io.teardown()`` runs).
* ``all_gather`` gathers over the data-parallel group by default, like ``reduce``: under tp2
  there is one data rank, so each rank gets its own value once, not its tensor peer's copy too.
* An fsspec URL is not turned into a wrong local path (``Path("s3://b/x")`` is ``s3:/b/x``).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from lightning_parallel.testing import run_distributed

TOKENS = {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16, "lr": 0.1}


def _fit_and_release(strategy: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from torch.utils.data import DataLoader

    import lightning_parallel
    from lightning_parallel.models import GPT
    from lightning_parallel.testing.parity import token_data

    class RecordingIO(TorchCheckpointIO):
        torn_down = False

        def teardown(self) -> None:
            RecordingIO.torn_down = True

    model = GPT(**TOKENS)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=lightning_parallel.strategy_from_name(strategy),
                         plugins=[RecordingIO()], max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(token_data(num_samples=32, block_size=8, vocab_size=32), batch_size=4)
    trainer.fit(model, loader)
    gathered = trainer.strategy.all_gather(torch.tensor([float(trainer.global_rank)]))
    ref = weakref.ref(model)
    del model, trainer
    gc.collect()
    return {"freed": ref() is None, "torn_down": RecordingIO.torn_down, "gathered": gathered.tolist()}


def _fit_all() -> list[dict[str, Any]]:
    return [_fit_and_release(name) for name in ("dp", "zero3", "tp", "pp")]


def test_models_are_freed_teardown_completes_and_all_gather_uses_data_group() -> None:
    results = run_distributed(_fit_all, 2, init_backend=None, timeout=400)
    for rank, per_rank in enumerate(results):
        for name, result in zip(("dp", "zero3", "tp", "pp"), per_rank):
            assert result["freed"], f"{name} rank {rank}: the module outlived its Trainer"
            assert result["torn_down"], f"{name} rank {rank}: checkpoint_io.teardown() did not run"
            expected = [[0.0], [1.0]] if name in ("dp", "zero3") else [[float(rank)]]  # tp2, pp2: one data rank
            assert result["gathered"] == expected, f"{name} rank {rank}: {result['gathered']}"


def test_fsspec_urls_are_not_mangled_into_local_paths() -> None:
    from lightning_parallel.strategies.checkpoint.files import local_path

    assert str(local_path("/tmp/run/last.ckpt", "x")) == "/tmp/run/last.ckpt"
    assert str(local_path("file:///tmp/run/x.ckpt", "x")) == "/tmp/run/x.ckpt"
    with pytest.raises(ValueError, match=r"s3://bucket/run/last.ckpt.*save_distributed_checkpoint=False"):
        local_path("s3://bucket/run/last.ckpt", "save_distributed_checkpoint=True")
