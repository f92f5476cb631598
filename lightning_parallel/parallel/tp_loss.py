"""Loss parallelism: cross-entropy on the vocabulary-sharded logits (work in progress)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any


@contextlib.contextmanager
def sharded_logits_step(enabled: bool) -> Generator[Callable[[Any], Any], None, None]:
    """Scope of one step; yields ``release`` for the step's output (identity when disabled)."""
    if enabled:
        raise NotImplementedError("loss_parallel=True is not implemented yet. HINT: set loss_parallel=False")
    yield lambda output: output
