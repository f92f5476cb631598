"""Shared LightningDataModule plumbing: build train/val/test once, serve four DataLoaders.

Every data module in the zoo is synthetic or bundled (nothing is downloaded at run time, so
tests and multi-process runs never race on a download) and a pure function of its arguments:
the same ``seed`` gives the same tensors on every rank, which is what lets a data-parallel run
be compared sample for sample with a single process.

Loader conventions, chosen for the strategies:
* ``batch_size`` is the per-process batch (Lightning's distributed sampler splits the dataset,
  not the batch).
* The train loader uses ``drop_last=True``: a pipeline traces one microbatch shape, and a
  ragged last batch would not split into equal microbatches.
* Shuffling uses a generator seeded from ``seed`` so a single-process order is reproducible
  without touching the global RNG. (Under a distributed sampler Lightning shuffles anyway.)
* Evaluation loaders keep every sample unless ``eval_drop_last=True`` (set it for pipeline
  evaluation when the split size is not a multiple of the batch size).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_parallel.models.base import check_positive_int
from lightning_parallel.errors import config_error


@dataclass(frozen=True)
class Splits:
    """The three datasets a data module serves; ``predict`` reuses ``test``."""

    train: Dataset[Any]
    val: Dataset[Any]
    test: Dataset[Any]


def check_seed(seed: Any) -> int:
    """A seed is any non-negative int (bools refused: ``True`` is almost always a slip)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise config_error(TypeError, "seed", seed, "must be an int", "pass e.g. seed=0")
    if seed < 0:
        raise config_error(ValueError, "seed", seed, "must be >= 0", "pass e.g. seed=0")
    return seed


def check_split_fractions(val_fraction: Any, test_fraction: Any) -> tuple[float, float]:
    """Both fractions in [0, 1) and together below 1, so the training split is never empty."""
    for field, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise config_error(TypeError, field, value, "must be a float", f"pass e.g. {field}=0.1")
        if not 0 <= value < 1:
            raise config_error(ValueError, field, value, "must lie in [0, 1)", f"pass e.g. {field}=0.1")
    if val_fraction + test_fraction >= 1:
        raise config_error(
            ValueError,
            "val_fraction + test_fraction",
            val_fraction + test_fraction,
            "must be < 1 so that training data remains",
            "lower one of the two fractions",
        )
    return float(val_fraction), float(test_fraction)


def split_sizes(n: int, val_fraction: float, test_fraction: float) -> tuple[int, int, int]:
    """Sizes of (train, val, test) for ``n`` samples; val and test are rounded down."""
    n_val = int(n * val_fraction)
    n_test = int(n * test_fraction)
    return n - n_val - n_test, n_val, n_test


class SplitDataModule(L.LightningDataModule):
    """Base class: subclasses implement :meth:`_build`; this class owns the loaders.

    ``setup`` builds the splits once (idempotent, cheap to call from every stage and every
    rank); the loader methods call it too, so the module also works outside a Trainer.
    """

    def __init__(
        self,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        eval_drop_last: bool = False,
    ) -> None:
        super().__init__()
        check_positive_int("batch_size", batch_size)
        check_seed(seed)
        for field, flag in (("shuffle", shuffle), ("eval_drop_last", eval_drop_last)):
            if not isinstance(flag, bool):
                raise config_error(TypeError, field, flag, "must be a bool", f"pass {field}=true or false")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise config_error(
                ValueError, "num_workers", num_workers, "must be an int >= 0", "use 0 (load in the main process)"
            )
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.eval_drop_last = eval_drop_last
        self._splits: Splits | None = None

    @abstractmethod
    def _build(self) -> Splits:
        """Create the datasets; must depend only on the constructor arguments."""

    def setup(self, stage: str | None = None) -> None:
        if self._splits is None:
            self._splits = self._build()

    @property
    def splits(self) -> Splits:
        """The datasets, built on first access."""
        self.setup()
        assert self._splits is not None
        return self._splits

    def _loader(self, dataset: Dataset[Any], *, train: bool) -> DataLoader[Any]:
        if train and len(dataset) < self.batch_size:  # type: ignore[arg-type]
            raise config_error(
                ValueError,
                "batch_size",
                self.batch_size,
                f"exceeds the {len(dataset)} training samples, so drop_last leaves no batch",  # type: ignore[arg-type]
                "lower batch_size or generate more samples",
            )
        generator = torch.Generator().manual_seed(self.seed) if train and self.shuffle else None
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train and self.shuffle,
            drop_last=True if train else self.eval_drop_last,
            num_workers=self.num_workers,
            generator=generator,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.splits.train, train=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.splits.val, train=False)

    def test_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.splits.test, train=False)

    def predict_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.splits.test, train=False)
