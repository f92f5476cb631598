"""Activation checkpointing of the repeated blocks, keeping parameter names.

The seeds' 100-layer MLP trades compute for memory by recomputing each block's activations
in backward. We use torch's composable ``checkpoint`` (a hook on the module, not a wrapper
class), so the parameter names and therefore checkpoints stay those of the user's model.

A recomputed block runs its forward twice. A Hugging Face layer that appends its keys and values to
the model's cache (``use_cache=True``, the default of most configs) then appends them twice, and the
recomputed attention reads a cache twice as long as the first pass did (Falcon under ``tp2`` failed
with a shape error in backward). Hugging Face turns the cache off for the same reason when its own
gradient checkpointing is on (``GradientCheckpointingLayer``, and its Trainer sets
``use_cache=False``); so does this, on every Hugging Face config in the module, with a warning.
"""

from __future__ import annotations

import warnings

from torch import nn

from lightning_parallel.compat import checkpoint_module
from lightning_parallel.parallel.blocks import find_repeated_blocks


def disable_kv_cache(module: nn.Module) -> list[str]:
    """Set ``config.use_cache = False`` on every submodule whose config has it on; return their names."""
    changed: list[str] = []
    seen: set[int] = set()
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if config is None or id(config) in seen or getattr(config, "use_cache", None) is not True:
            continue
        seen.add(id(config))
        config.use_cache = False
        changed.append(name or type(sub).__name__)
    return changed


def apply_activation_checkpointing(module: nn.Module, blocks: list[tuple[str, nn.Module]] | None = None) -> list[str]:
    """Checkpoint every repeated block of ``module`` in place; return the names checkpointed."""
    blocks = find_repeated_blocks(module) if blocks is None else blocks
    for _, block in blocks:
        checkpoint_module(block)
    if blocks and (changed := disable_kv_cache(module)):
        warnings.warn(
            f"activation_checkpointing: set `config.use_cache=False` on {changed}: a recomputed layer would write its "
            "key/value cache a second time (Hugging Face does the same under gradient checkpointing)",
            UserWarning, stacklevel=2,
        )
    return [name for name, _ in blocks]
