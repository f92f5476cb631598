"""One shape for every configuration error: the field, the value, the rule and a fix.

Users meet these errors on a cluster, often in the log of one rank among many: a message that
names all four saves a round trip. They are raised before any process waits on a collective.
A checkpoint that weights-only loading refuses raises :class:`UnsafeCheckpointError`, whose
message follows the same layout (the file, the refused object, torch's words, the ways forward).
"""

from __future__ import annotations

import pickle
from typing import Any


def config_error(kind: type[Exception], field: str, value: Any, rule: str, fix: str) -> Exception:
    """Build ``kind`` (ValueError, TypeError, ...) with the project's message layout."""
    return kind(f"`{field}`={value!r} is invalid: {rule}. HINT: {fix}")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds an object that weights-only loading refuses to unpickle (it could run code).

    A ``pickle.UnpicklingError``, as torch's own refusal is, so code that catches torch's error
    catches this one; it adds the file (``source``) and the refused global (``refused``, ``None``
    where torch's message names none). The message carries torch's words and the two ways
    forward (built by ``lightning_parallel.strategies.checkpoint.safe_load.refusal``).
    """

    def __init__(self, message: str, source: str | None = None, refused: str | None = None) -> None:
        super().__init__(message)
        self.source, self.refused = source, refused

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt whole on the ranks that receive it (a failure gathered by a collective).
        return type(self), (str(self), self.source, self.refused)
