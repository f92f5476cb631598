"""Real data with no download: scikit-learn's bundled 8x8 handwritten digits (1797 images).

Why this set: it ships inside the scikit-learn wheel, so tests and offline clusters can train
on real images, and an MLP reaches >90 % accuracy in a few hundred steps on a CPU - enough to
tell a strategy that trains from one that only appears to.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from lightning_parallel.data.base import SplitDataModule, Splits, check_split_fractions, split_sizes

NUM_FEATURES = 64
NUM_CLASSES = 10


def _load_digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """Features (1797, 64) float32 and labels (1797,) int64 from scikit-learn, imported lazily."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "DigitsData needs scikit-learn for its bundled digits data set. "
            "HINT: `pip install scikit-learn` (or `pip install lightning_parallel[test]`)."
        ) from err
    bunch = load_digits()
    x = torch.as_tensor(bunch.data, dtype=torch.float32)
    y = torch.as_tensor(bunch.target, dtype=torch.int64)
    return x, y


class DigitsData(SplitDataModule):
    """8x8 digits as 64 standardised features and labels 0-9, split by a seeded permutation.

    Standardisation uses the *training* split's mean and standard deviation only, so validation
    and test never leak into preprocessing. The std is floored at one grey level (of 16): a
    border pixel that is almost always 0 would otherwise turn its rare ink into a 30-sigma input.
    """

    def __init__(
        self,
        batch_size: int = 32,
        seed: int = 0,
        val_fraction: float = 0.2,
        test_fraction: float = 0.1,
        shuffle: bool = True,
        num_workers: int = 0,
        eval_drop_last: bool = False,
    ) -> None:
        super().__init__(batch_size, seed, shuffle, num_workers, eval_drop_last)
        self.val_fraction, self.test_fraction = check_split_fractions(val_fraction, test_fraction)
        self.save_hyperparameters()

    @property
    def in_dim(self) -> int:
        """Number of input features (8x8 pixels)."""
        return NUM_FEATURES

    @property
    def num_classes(self) -> int:
        return NUM_CLASSES

    def _build(self) -> Splits:
        x, y = _load_digits_arrays()
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        x, y = x[order], y[order]
        n_train, n_val, _ = split_sizes(len(x), self.val_fraction, self.test_fraction)
        mean = x[:n_train].mean(dim=0)
        std = x[:n_train].std(dim=0).clamp_min(1.0)
        x = (x - mean) / std
        a, b = n_train, n_train + n_val
        return Splits(TensorDataset(x[:a], y[:a]), TensorDataset(x[a:b], y[a:b]), TensorDataset(x[b:], y[b:]))
