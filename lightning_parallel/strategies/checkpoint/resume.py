"""Exact mid-epoch resume: skip the batches the checkpointed run had already trained on.

Lightning restores the batch counter of an interrupted epoch but restarts the training
dataloader from its first batch, so a run resumed from a mid-epoch checkpoint trains on the
epoch's first batches again (Lightning issues #19815, #14579); after a restore it may also seed
the first iteration with the previous epoch's shuffle. The loader wrapped here, once after a
restore, sets the sampler's epoch to the epoch being resumed and skips the batches already
consumed, so the remaining batches are exactly those the uninterrupted run would have seen.
Each rank's RNG streams (torch, CUDA, Python, NumPy) are saved and restored as well, so random
layers such as dropout continue as they would have.

RNG streams after a change of world size (``n`` saved streams, ``m`` ranks resuming): rank ``r``
restores saved stream ``r % n``. Rank ``r < n`` thus gets its own stream back, and a rank without
a counterpart copies one that existed; the result is deterministic. Why a copy and not a fresh
derived seed: Lightning's ``seed_everything`` seeds every rank alike, and under data parallelism
(any ZeRO stage) every rank draws alike, so the saved streams are all in the same state; a copy
keeps the resumed ranks in step, and a draw that does not depend on the rank's share of the
batch (a per-step LayerDrop decision, a randomly chosen augmentation, noise on replicated
weights) continues exactly as in a run resumed under the original layout.

What cannot match, and does not:

* draws shaped by the rank's share of the batch (dropout masks, per-sample noise): each of the
  ``n`` data-parallel ranks drew a mask for its own rows from its own stream; under ``m`` ranks
  the rows are split differently, so no assignment of streams reproduces those masks;
* draws on a tensor-parallel shard (attention dropout on a rank's heads): shaped by the shard;
* pipeline stages, which draw for their own layers only, so their saved streams differ: rank
  ``r`` of the new layout takes stage ``r % n``'s stream whatever layers it now runs (pp2 -> one
  process continues stage 0's stream for every layer; pp2 -> dp2 gives the two data-parallel
  ranks different streams, so even their per-step draws differ).

Those runs continue with other, equally valid, random draws; weights, optimizer state and data
order still resume exactly. CUDA generators are restored for the device indices present both in
the checkpoint and on the resuming machine. (DTensor's random ops draw from the default device
generator in the torch used here (2.13: no separate DTensor RNG state to save), so these states
cover tensor-parallel dropout as well.)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader

RNG_KEY = "lightning_parallel_rng"
_announced: int | None = None  # the states whose change of world size was last reported


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

        # As plain types and a tensor (not numpy's ndarray): a checkpoint must load with
        # torch.load(weights_only=True), which Lightning's own strategies use by default.
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (str(name), torch.from_numpy(keys.astype(numpy.int64)), int(pos), int(has_gauss), float(cached))
    except ImportError:  # numpy is optional
        pass
    return state


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states (a collective): dropout and other random ops differ per rank, so
    an exact resume needs each rank's own stream back."""
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, _rng_state())
    return states


def rng_state_for_rank(states: object, rank: int) -> dict[str, Any] | None:
    """The saved RNG state rank ``rank`` restores: saved stream ``rank % len(states)`` (see the
    module docstring for why), or ``None`` when the checkpoint has none.

    Raises ``TypeError`` for an entry that is not a list of per-rank state dicts: such a
    checkpoint was not written by this strategy, or was edited, and restoring part of it
    would silently break an exact resume.
    """
    if states is None or (isinstance(states, list) and not states):
        return None
    if not isinstance(states, list) or not all(isinstance(s, dict) and "torch" in s for s in states):
        raise TypeError(
            f"Checkpoint entry `{RNG_KEY}` must be a list with one dict of RNG states per saved rank"
            f" (each with a 'torch' key), got {type(states).__name__}."
            f" HINT: delete the `{RNG_KEY}` key from the checkpoint to resume with the RNG streams as"
            " seeded, or resume from a checkpoint written by HybridParallelStrategy."
        )
    return states[rank % len(states)]


def restore_rng_state(states: list[dict[str, Any]] | None) -> bool:
    """Restore this rank's RNG streams from the per-rank ``states`` of a checkpoint.

    Under the world size the checkpoint was saved with, each rank gets its own streams back (an
    exact resume). Under another, rank ``r`` takes saved stream ``r % len(states)``: see the
    module docstring for what then continues exactly and what cannot. Returns whether anything
    was restored (``False`` for a checkpoint without RNG states).
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    state = rng_state_for_rank(states, rank)
    if state is None or states is None:
        return False
    global _announced
    if len(states) != world_size and _announced != id(states):  # once per checkpoint, not per restore
        _announced = id(states)
        rank_zero_info(
            f"Resuming on {world_size} processes from RNG streams saved by {len(states)}: rank r takes"
            " saved stream r mod the saved count. Random draws shaped by each rank's share of the batch"
            " (dropout masks) differ from a resume under the original layout; see lightning_parallel.strategies.checkpoint.resume."
        )
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        for index in range(min(len(saved), torch.cuda.device_count())):  # devices present on both sides
            torch.cuda.set_rng_state(saved[index], index)
    if "numpy" in state:
        import numpy

        name, keys, pos, has_gauss, cached = state["numpy"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else numpy.asarray(keys)
        numpy.random.set_state((name, keys.astype(numpy.uint32), pos, has_gauss, cached))
    return True
