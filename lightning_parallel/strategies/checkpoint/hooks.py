"""Lightning's checkpoint hooks for ``HybridParallelStrategy``: save (sharded, consolidated or in the
background), load with resharding into whatever layout is running, and resume mid-epoch at the
right batch with the saved random state.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.compat_lightning import trainer_call_weights_only, unwrap_optimizer
from lightning_parallel.parallel.data.loader_view import data_parallel_view, with_data_parallel_view
from lightning_parallel.strategies.checkpoint import files as ckpt
from lightning_parallel.strategies.checkpoint.resume import (
    RNG_KEY,
    consumed_batches,
    gather_rng_states,
    make_resumable,
    restore_rng_state,
)


class CheckpointHooksMixin:
    """Save, load and resume hooks of ``HybridParallelStrategy``."""

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return self._engine.model_state(full=not self._save_distributed_checkpoint)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = unwrap_optimizer(optimizer)
        assert self.lightning_module is not None
        return self._engine.optimizer_state(optimizer, full=not self._save_distributed_checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        with self._explain("checkpoint save"):
            self._save_checkpoint(checkpoint, filepath, storage_options)

    def _save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        target = self.broadcast(str(filepath))
        checkpoint[RNG_KEY] = gather_rng_states()
        if self._async_writer is not None and self._fitting_now():
            self._async_writer.save(checkpoint, ckpt.local_path(target, "async_save=True"))
        elif self._save_distributed_checkpoint:
            ckpt.save_sharded(checkpoint, ckpt.local_path(target, "save_distributed_checkpoint=True"))
        else:  # the string as given: Lightning's checkpoint IO writes fsspec URLs (s3://, gs://) itself
            super().save_checkpoint(checkpoint, target, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read ``checkpoint_path`` into whatever layout runs. ``weights_only`` is Lightning's
        (``trainer.fit(..., weights_only=...)``), honoured as its own strategies do: ``None`` is torch's
        default (weights-only), ``False`` the user's trust in the file; it reaches every read, the
        pipeline's deferred one at the first batch included (:mod:`.safe_load`). Lightning 2.6 drops
        it for a strategy that restores after setup, as this one does: then it is read from the
        Trainer call itself (:func:`~lightning_parallel.compat_lightning.trainer_call_weights_only`)."""
        if weights_only is None:
            weights_only = trainer_call_weights_only()
        self.finish_pending_save()  # a checkpoint still being written in the background is complete first
        path = ckpt.local_path(self.broadcast(str(checkpoint_path)), "loading a checkpoint")
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        self._resume_skip_pending = fitting
        loaded = self._engine.load(path, fitting, weights_only)  # each rank reads only what it holds
        # Restored now (right for a checkpoint at an epoch end) and again once a mid-epoch resume
        # has created its data iterator, which draws from the RNG where the saved run did not.
        self._resume_rng = loaded.get(RNG_KEY) if fitting else None
        restore_rng_state(self._resume_rng)
        return loaded

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Datasets that shard themselves by rank (litdata's ``StreamingDataset``, ...) get the
        data-parallel view the sampler gets (:mod:`lightning_parallel.parallel.data.loader_view`);
        then resume mid-epoch at the right batch (see :mod:`lightning_parallel.strategies.checkpoint.resume`)."""
        sampler = self.distributed_sampler_kwargs
        view = data_parallel_view(sampler["num_replicas"], sampler["rank"], nodes=self.num_nodes)
        dataloader = with_data_parallel_view(dataloader, view)
        return make_resumable(dataloader, self._batches_to_skip, lambda _: restore_rng_state(self._resume_rng))

    def _batches_to_skip(self, loader: torch.utils.data.DataLoader) -> int:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not self._resume_skip_pending or trainer is None or not trainer.training:
            return 0
        self._resume_skip_pending = False
        return consumed_batches(trainer, loader)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Already loaded in place by ``load_checkpoint`` (with resharding)."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Already loaded in place by ``load_checkpoint`` (with resharding)."""

    def _fitting_now(self) -> bool:
        """Saves during ``fit`` go to the background; one after it (``trainer.save_checkpoint`` once
        fit returned) is written at once: no later save, load or teardown would complete it."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING

    def finish_pending_save(self) -> None:
        """Wait for a background save (``async_save=True``) and put it in place (collective)."""
        if self._async_writer is not None and self._async_writer.pending:
            self._async_writer.wait()

    def _close_async_writer(self) -> None:
        if self._async_writer is not None:
            self._async_writer.close()
