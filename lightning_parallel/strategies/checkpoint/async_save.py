"""Sharded checkpoints written in the background (``HybridParallelStrategy(async_save=True)``).

Why: a synchronous sharded save stops every rank for the whole write (serialise, write, fsync,
gather the metadata); on a cluster file system that is seconds to minutes per checkpoint.
``torch.distributed.checkpoint.async_save`` only *stages* the state in the step (a copy of each
rank's shards into CPU memory) and writes it from a background thread, so training goes on.

What this module adds around it, for the same guarantees as the synchronous save:

* **Atomicity.** The background write goes to the hidden scratch directory of the synchronous
  save; rank 0 adds ``meta.pt`` and renames it over the target only once the write finished on
  every rank (DCP's coordinator writes the metadata after gathering every rank's result). A
  crash during the write leaves the previous checkpoint in place and loadable.
* **One save at a time.** A later save, a load, and the end of the run first wait for the
  pending one (and finish it), so saves never interleave and nothing is lost at exit.
* **Its own process group.** The background thread's collectives (DCP gathers the save plans
  and results) run on a dedicated gloo group, created once by every rank at the first save:
  running them on the training group from another thread would interleave with the step's
  collectives (and NCCL's would need the GPU; the staged copies are on the CPU).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from lightning_parallel.strategies.checkpoint.files import begin_sharded_save, finish_sharded_save, split_checkpoint


@dataclass
class _Pending:
    future: Any  # Future (or AsyncSaveResponse) of dcp.async_save
    meta: dict[str, Any]
    path: Path


class AsyncCheckpointWriter:
    """At most one background sharded save in flight (see the module doc). Every rank calls
    ``save`` and ``wait`` at the same points (they are collectives)."""

    def __init__(self) -> None:
        self._pending: _Pending | None = None
        self._group: dist.ProcessGroup | None = None
        self._staging: DefaultStager | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def save(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Stage ``checkpoint`` now, write it in the background; returns once staged."""
        self.wait()
        if self._group is None:
            self._group = dist.new_group(backend="gloo")  # every rank, same order: the first save
        state = split_checkpoint(checkpoint)
        partial = begin_sharded_save(path)
        future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self._group, async_stager=self._stager())
        self._pending = _Pending(future, checkpoint, path)

    def _stager(self) -> DefaultStager:
        """One stager for every save: it keeps its CPU buffers, so each save copies into memory
        already mapped instead of allocating (page-faulting) the whole state again. Staging
        stays synchronous: the copy is complete when ``save`` returns, so the next optimizer
        step (or a BatchNorm's running statistics in the next forward) cannot change it."""
        if self._staging is None:
            cuda = torch.cuda.is_available()
            self._staging = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                         use_async_staging=False, use_non_blocking_copy=False))
        return self._staging

    def close(self) -> None:
        """Finish the pending save and release the staging buffers (end of the run)."""
        self.wait()
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def wait(self) -> None:
        """Block until the pending save is written everywhere, then put it in place. A failed
        write raises here (on every rank whose part failed, and on the coordinator)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        future = getattr(pending.future, "upload_completion", pending.future)  # AsyncSaveResponse or Future
        if isinstance(future, Future):
            future.result()
        else:
            future.wait()
        finish_sharded_save(pending.meta, pending.path)
        dist.barrier()
