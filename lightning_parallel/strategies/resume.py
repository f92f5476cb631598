"""Exact mid-epoch resume: skip the batches the checkpointed run had already trained on.

Lightning restores the batch counter of an interrupted epoch but restarts the training
dataloader from its first batch, so a run resumed from a mid-epoch checkpoint trains on the
epoch's first batches again (Lightning issues #19815, #14579); after a restore it may also seed
the first iteration with the previous epoch's shuffle. The loader wrapped here, once after a
restore, sets the sampler's epoch to the epoch being resumed and skips the batches already
consumed, so the remaining batches are exactly those the uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader


def make_resumable(loader: object, batches_to_skip: Callable[[DataLoader], int]) -> object:
    """Give ``loader`` (in place: Lightning keeps using the same object) an ``__iter__`` that
    first skips ``batches_to_skip(loader)`` batches. Non-DataLoader iterables are left alone."""
    if not isinstance(loader, DataLoader) or getattr(loader, "_lp_resumable", False):
        return loader
    base = type(loader)

    def __iter__(self: Any) -> Any:  # noqa: N807
        skip = batches_to_skip(self)
        iterator = base.__iter__(self)
        for _ in range(skip):
            next(iterator)
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
