"""Validation of the context-parallel options (``HybridParallelStrategy.__init__``, before any process starts)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_parallel.parallel.context.attention import FORMS
from lightning_parallel.parallel.errors import config_error


def validate_context_options(attention: Any, batch_dims: Any) -> None:
    if attention not in FORMS:
        raise config_error(
            ValueError, "context_parallel_attention", attention,
            f"the forms are {list(FORMS)} (all-gather of keys and values, ring pass-KV, all-to-all over heads)",
            "pass context_parallel_attention='allgather' (the default), 'ring' or 'ulysses'",
        )
    if batch_dims is None:
        return
    if not isinstance(batch_dims, Mapping):
        raise config_error(
            TypeError, "context_parallel_batch_dims", batch_dims, "it maps a batch entry's path to its sequence dim (or None)",
            "pass e.g. context_parallel_batch_dims={'input_ids': 1, 'pair_bias': None}",
        )
    for path, dim in batch_dims.items():
        if not isinstance(path, str) or not (dim is None or (isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0)):
            raise config_error(
                TypeError, f"context_parallel_batch_dims[{path!r}]", dim,
                "keys are entry paths ('input_ids', '0', '1.mask') and values a dim >= 0 to split along, or None to keep whole",
                "pass e.g. context_parallel_batch_dims={'0': 1}",
            )


def check_context_combination(cp: int, pp: int, compile_blocks: bool, tp: int = 1, ep: int = 1) -> None:
    """Combinations context parallelism does not run yet: typed errors before any collective (in
    ``__init__`` for int degrees, again once "auto" degrees are resolved)."""
    if cp == 1:
        return
    if compile_blocks:
        raise config_error(
            ValueError, f"context_parallel_size={cp} with compile_blocks", compile_blocks,
            "the context-parallel attention exchanges keys and values inside each block, which torch.compile does not trace here",
            "set compile_blocks=False",
        )
