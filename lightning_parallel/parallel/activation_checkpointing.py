"""Activation checkpointing of the repeated blocks, keeping parameter names.

The seeds' 100-layer MLP trades compute for memory by recomputing each block's activations
in backward. We use torch's composable ``checkpoint`` (a hook on the module, not a wrapper
class), so the parameter names and therefore checkpoints stay those of the user's model.
"""

from __future__ import annotations

from torch import nn

from lightning_parallel.compat import checkpoint_module
from lightning_parallel.parallel.blocks import find_repeated_blocks


def apply_activation_checkpointing(module: nn.Module, blocks: list[tuple[str, nn.Module]] | None = None) -> list[str]:
    """Checkpoint every repeated block of ``module`` in place; return the names checkpointed."""
    blocks = find_repeated_blocks(module) if blocks is None else blocks
    for _, block in blocks:
        checkpoint_module(block)
    return [name for name, _ in blocks]
