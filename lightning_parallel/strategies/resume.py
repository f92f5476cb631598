"""Exact mid-epoch resume: skip the batches the checkpointed run had already trained on.

Lightning restores the batch counter of an interrupted epoch but restarts the training
dataloader from its first batch, so a run resumed from a mid-epoch checkpoint trains on the
epoch's first batches again (Lightning issues #19815, #14579); after a restore it may also seed
the first iteration with the previous epoch's shuffle. The loader wrapped here, once after a
restore, sets the sampler's epoch to the epoch being resumed and skips the batches already
consumed, so the remaining batches are exactly those the uninterrupted run would have seen.
Each rank's RNG streams (torch, CUDA, Python, NumPy) are saved and restored as well, so random
layers such as dropout continue as they would have.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

RNG_KEY = "lightning_parallel_rng"


def make_resumable(
    loader: object, batches_to_skip: Callable[[DataLoader], int], after_skip: Callable[[int], None]
) -> object:
    """Give ``loader`` (in place: Lightning keeps using the same object) an ``__iter__`` that
    first skips ``batches_to_skip(loader)`` batches, then calls ``after_skip(count)``: creating
    an iterator draws from the global RNG, which the checkpointed run did not do mid-epoch.
    Non-DataLoader iterables are left alone."""
    if not isinstance(loader, DataLoader) or getattr(loader, "_lp_resumable", False):
        return loader
    base = type(loader)

    def __iter__(self: Any) -> Any:  # noqa: N807
        skip = batches_to_skip(self)
        iterator = base.__iter__(self)
        for _ in range(skip):
            next(iterator)
        if skip:
            after_skip(skip)
        return iterator

    loader.__class__ = type(base.__name__, (base,), {"__iter__": __iter__, "_lp_resumable": True})
    return loader


def consumed_batches(trainer: Any, loader: DataLoader) -> int:
    """Batches of the current epoch a restored run already trained on; re-seeds the sampler epoch.

    ``ready`` counts fetched batches: a checkpoint written at a batch end has not yet marked
    that batch ``completed``, but it was trained on.
    """
    consumed = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
    total = trainer.num_training_batches  # honours limit_train_batches once Lightning has set it
    if total == float("inf"):
        try:
            total = len(loader)
        except TypeError:  # an iterable without a length: trust the counter
            total = consumed + 1
    if consumed == 0 or consumed >= total:  # saved at an epoch end: Lightning starts the next one right
        return 0
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(trainer.current_epoch)
    return consumed


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:  # numpy is optional
        pass
    return state


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states (a collective): dropout and other random ops differ per rank, so
    an exact resume needs each rank's own stream back."""
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, _rng_state())
    return states


def restore_rng_state(states: list[dict[str, Any]] | None) -> bool:
    """Restore this rank's RNG streams when the checkpoint has one per rank of this world size.

    After a change of world size there is no rank-to-rank correspondence; the streams are left
    as they are (losses of random layers then differ from the uninterrupted run).
    """
    if not states or len(states) != dist.get_world_size():
        return False
    state = states[dist.get_rank()]
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    return True
