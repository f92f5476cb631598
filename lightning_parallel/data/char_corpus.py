"""A character-level text corpus that is always present: Python's own standard library source.

Why: a language model should be tested on real text with real structure, but tests and
offline clusters cannot download one. Every Python installation carries megabytes of source
in ``sysconfig.get_paths()["stdlib"]``. Taking its top-level ``.py`` files in sorted order
gives a fixed corpus for a given Python version (a different Python version gives different
text, still with the same vocabulary).

Vocabulary: the 128 ASCII codes, always, so ``vocab_size=128`` matches whatever the files
contain. Characters outside ASCII become SUB (0x1A, ASCII's own "substitute" code) and files
are joined with FS (0x1C, the "file separator" code).
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_parallel.data.base import SplitDataModule, Splits, check_split_fractions, split_sizes
from lightning_parallel.models.base import check_positive_int
from lightning_parallel.errors import config_error

VOCAB_SIZE = 128
UNKNOWN_CODE = 0x1A  # ASCII SUB: stands in for every non-ASCII character
FILE_SEPARATOR = 0x1C  # ASCII FS: between two source files


def encode(text: str) -> Tensor:
    """Map text to uint8 codes < 128; non-ASCII characters become :data:`UNKNOWN_CODE`."""
    if not text:
        return torch.empty(0, dtype=torch.uint8)
    # UTF-32 in native byte order: exactly one int32 code point per character, vectorised.
    codec = "utf-32-le" if sys.byteorder == "little" else "utf-32-be"
    points = torch.frombuffer(bytearray(text.encode(codec)), dtype=torch.int32)
    return torch.where(points < VOCAB_SIZE, points, UNKNOWN_CODE).to(torch.uint8)


def decode(codes: Tensor | list[int]) -> str:
    """Inverse of :func:`encode` for ASCII text (unknown characters come back as ``\\x1a``)."""
    values = codes.tolist() if isinstance(codes, Tensor) else codes
    return "".join(chr(int(c)) for c in values)


def stdlib_source_files(stdlib_dir: str | Path | None = None) -> list[Path]:
    """The top-level ``.py`` files of the standard library, sorted by name (a fixed order)."""
    root = Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(
            f"no .py files found in the standard library directory {str(root)!r}; this Python keeps its "
            "standard library elsewhere (e.g. zipped). HINT: use SyntheticTokensData instead."
        )
    return files


def load_stdlib_corpus(max_chars: int, stdlib_dir: str | Path | None = None) -> Tensor:
    """The first ``max_chars`` characters of the sorted standard-library files, encoded."""
    parts: list[Tensor] = []
    total = 0
    separator = torch.tensor([FILE_SEPARATOR], dtype=torch.uint8)
    for path in stdlib_source_files(stdlib_dir):
        if total >= max_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        piece = torch.cat([encode(text), separator])[: max_chars - total]
        parts.append(piece)
        total += len(piece)
    return torch.cat(parts)


class WindowDataset(Dataset[tuple[Tensor, Tensor]]):
    """``(x, y)`` windows of a code stream: ``x = s[i:i+T]``, ``y = s[i+1:i+T+1]`` (int64)."""

    def __init__(self, stream: Tensor, starts: Tensor, block_size: int) -> None:
        self.stream = stream
        self.starts = starts
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = int(self.starts[index])
        chunk = self.stream[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class CharCorpusData(SplitDataModule):
    """Next-character windows over the standard-library corpus, split train / val / test.

    The stream is cut into three contiguous regions (no window crosses a boundary). Training
    windows start at positions drawn from a generator seeded with ``seed`` - as many as fit
    the region end to end, so one epoch sees about the whole region; validation and test use
    fixed, non-overlapping windows so that their numbers do not depend on the training seed.
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 8,
        max_chars: int = 200_000,
        seed: int = 0,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        shuffle: bool = True,
        num_workers: int = 0,
        eval_drop_last: bool = False,
    ) -> None:
        super().__init__(batch_size, seed, shuffle, num_workers, eval_drop_last)
        check_positive_int("block_size", block_size)
        check_positive_int("max_chars", max_chars)
        self.val_fraction, self.test_fraction = check_split_fractions(val_fraction, test_fraction)
        fractions = (1 - self.val_fraction - self.test_fraction, self.val_fraction, self.test_fraction)
        smallest = min(f for f in fractions if f > 0)
        if int(max_chars * smallest) < block_size + 1:
            raise config_error(
                ValueError,
                "max_chars",
                max_chars,
                f"leaves a split of {int(max_chars * smallest)} chars, shorter than one window "
                f"(block_size + 1 = {block_size + 1})",
                f"raise max_chars to at least {int((block_size + 1) / smallest) + 1}",
            )
        self.block_size = block_size
        self.max_chars = max_chars
        self.save_hyperparameters()

    @property
    def vocab_size(self) -> int:
        """Always 128 (ASCII), whatever the corpus holds."""
        return VOCAB_SIZE

    def _build(self) -> Splits:
        stream = load_stdlib_corpus(self.max_chars)
        n_train, n_val, _ = split_sizes(len(stream), self.val_fraction, self.test_fraction)
        train, val, test = stream[:n_train], stream[n_train : n_train + n_val], stream[n_train + n_val :]
        T = self.block_size
        g = torch.Generator().manual_seed(self.seed)
        train_starts = torch.randint(0, max(1, len(train) - T), (max(1, len(train) // T),), generator=g)
        return Splits(
            WindowDataset(train, train_starts, T),
            WindowDataset(val, self._tiling_starts(len(val)), T),
            WindowDataset(test, self._tiling_starts(len(test)), T),
        )

    def _tiling_starts(self, length: int) -> Tensor:
        """Starts of non-overlapping windows that fit in ``length`` chars (may be empty)."""
        return torch.arange(0, max(0, length - self.block_size), self.block_size)
