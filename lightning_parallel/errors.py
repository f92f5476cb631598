"""One shape for every configuration error: the field, the value, the rule and a fix.

Users meet these errors on a cluster, often in the log of one rank among many: a message that
names all four saves a round trip. They are raised before any process waits on a collective.
"""

from __future__ import annotations

from typing import Any


def config_error(kind: type[Exception], field: str, value: Any, rule: str, fix: str) -> Exception:
    """Build ``kind`` (ValueError, TypeError, ...) with the project's message layout."""
    return kind(f"`{field}`={value!r} is invalid: {rule}. HINT: {fix}")
