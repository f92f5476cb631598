"""Synthetic, learnable data sets generated from a seed: vectors for MLPs, sequences for GPTs.

Random inputs with random labels would train no model, and a loss that cannot fall hides a
strategy that trains nothing. So both sets carry structure a model can learn:

* :class:`SyntheticClassificationData` labels Gaussian inputs with a fixed random *teacher*
  network, so a student MLP of the same width family can fit them.
* :class:`SyntheticTokensData` makes noisy arithmetic progressions modulo the vocabulary; the
  next token follows from the previous two, so attention has something real to find, and the
  noise sets a loss floor well above zero.

Everything is drawn from a private ``torch.Generator`` seeded with ``seed``: the global RNG
(which seeds model init) is left alone, and every rank builds identical tensors.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from lightning_parallel.data.base import SplitDataModule, Splits, check_split_fractions, split_sizes
from lightning_parallel.models.base import check_fraction, check_positive_int
from lightning_parallel.errors import config_error


def _split_tensors(x: torch.Tensor, y: torch.Tensor, val_fraction: float, test_fraction: float) -> Splits:
    """Cut already-shuffled tensors into contiguous train / val / test parts."""
    n_train, n_val, _ = split_sizes(len(x), val_fraction, test_fraction)
    a, b = n_train, n_train + n_val
    return Splits(TensorDataset(x[:a], y[:a]), TensorDataset(x[a:b], y[a:b]), TensorDataset(x[b:], y[b:]))


class SyntheticClassificationData(SplitDataModule):
    """``num_samples`` Gaussian vectors of ``in_dim`` features labelled by a random teacher MLP.

    Teacher: ``in_dim -> teacher_hidden`` (tanh) ``-> num_classes``; the label is the argmax of
    its logits after each class's mean logit is subtracted, which keeps the classes roughly
    balanced (a raw random network tends to favour a few classes). Inputs are float32
    ``(in_dim,)``; labels int64 scalars.
    """

    def __init__(
        self,
        in_dim: int = 1000,
        num_classes: int = 10,
        num_samples: int = 2048,
        batch_size: int = 32,
        seed: int = 0,
        val_fraction: float = 0.125,
        test_fraction: float = 0.125,
        teacher_hidden: int = 64,
        shuffle: bool = True,
        num_workers: int = 0,
        eval_drop_last: bool = False,
    ) -> None:
        super().__init__(batch_size, seed, shuffle, num_workers, eval_drop_last)
        for field, value in (
            ("in_dim", in_dim),
            ("num_classes", num_classes),
            ("num_samples", num_samples),
            ("teacher_hidden", teacher_hidden),
        ):
            check_positive_int(field, value)
        if num_classes < 2:
            raise config_error(ValueError, "num_classes", num_classes, "must be >= 2", "pass e.g. num_classes=10")
        self.val_fraction, self.test_fraction = check_split_fractions(val_fraction, test_fraction)
        self.in_dim = in_dim
        self.num_classes = num_classes
        self.num_samples = num_samples
        self.teacher_hidden = teacher_hidden
        self.save_hyperparameters()

    def _build(self) -> Splits:
        g = torch.Generator().manual_seed(self.seed)
        w1 = torch.randn(self.in_dim, self.teacher_hidden, generator=g) / self.in_dim**0.5
        w2 = torch.randn(self.teacher_hidden, self.num_classes, generator=g) / self.teacher_hidden**0.5
        x = torch.randn(self.num_samples, self.in_dim, generator=g)
        logits = torch.tanh(x @ w1) @ w2
        y = (logits - logits.mean(dim=0)).argmax(dim=1)
        return _split_tensors(x, y, self.val_fraction, self.test_fraction)


class SyntheticTokensData(SplitDataModule):
    """Noisy arithmetic progressions over ``vocab_size`` tokens, as next-token pairs.

    Each sequence is ``start + stride * i (mod vocab_size)`` for ``block_size + 1`` steps with a
    random start and a stride in ``[1, max_stride]``; each token is then replaced by a uniform
    random one with probability ``noise``. Samples are ``(x, y) = (seq[:-1], seq[1:])``, int64
    ``(block_size,)`` each.
    """

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 64,
        num_samples: int = 1024,
        batch_size: int = 8,
        seed: int = 0,
        noise: float = 0.1,
        max_stride: int = 7,
        val_fraction: float = 0.125,
        test_fraction: float = 0.125,
        shuffle: bool = True,
        num_workers: int = 0,
        eval_drop_last: bool = False,
    ) -> None:
        super().__init__(batch_size, seed, shuffle, num_workers, eval_drop_last)
        for field, value in (
            ("vocab_size", vocab_size),
            ("block_size", block_size),
            ("num_samples", num_samples),
            ("max_stride", max_stride),
        ):
            check_positive_int(field, value)
        if vocab_size < 2:
            raise config_error(ValueError, "vocab_size", vocab_size, "must be >= 2", "pass e.g. vocab_size=128")
        if max_stride >= vocab_size:
            raise config_error(
                ValueError,
                "max_stride",
                max_stride,
                f"must be < vocab_size={vocab_size} (a stride of vocab_size repeats one token)",
                f"pass max_stride <= {vocab_size - 1}",
            )
        self.noise = check_fraction("noise", noise)
        self.val_fraction, self.test_fraction = check_split_fractions(val_fraction, test_fraction)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.num_samples = num_samples
        self.max_stride = max_stride
        self.save_hyperparameters()

    def _build(self) -> Splits:
        g = torch.Generator().manual_seed(self.seed)
        n, length = self.num_samples, self.block_size + 1
        start = torch.randint(0, self.vocab_size, (n, 1), generator=g)
        stride = torch.randint(1, self.max_stride + 1, (n, 1), generator=g)
        seq = (start + stride * torch.arange(length)) % self.vocab_size
        corrupt = torch.rand(n, length, generator=g) < self.noise
        seq = torch.where(corrupt, torch.randint(0, self.vocab_size, (n, length), generator=g), seq)
        return _split_tensors(seq[:, :-1].contiguous(), seq[:, 1:].contiguous(), self.val_fraction, self.test_fraction)
