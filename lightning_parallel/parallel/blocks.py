"""Find the repeated blocks of an unchanged model.

FSDP2 wraps, activation checkpointing and pipeline cuts all want the same unit: the block
that a model repeats (a transformer layer, an MLP layer). Users should not have to name it,
so we look for the container (``nn.ModuleList`` or ``nn.Sequential``) whose parameterised
children share one class and that holds the most parameters.
"""

from __future__ import annotations

from torch import nn


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_repeated_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return ``(qualified name, block)`` pairs of the largest stack of same-class blocks.

    Children without parameters (activations, dropout) are skipped, so
    ``nn.Sequential(Linear, ReLU, Linear, ReLU, Linear)`` yields its three ``Linear`` layers.
    Returns an empty list when no container holds at least two such blocks.
    """
    best: list[tuple[str, nn.Module]] = []
    best_params = 0
    for name, container in module.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = [(f"{name}.{child_name}" if name else child_name, child) for child_name, child in container.named_children()]
        weighted = [(n, c) for n, c in children if _num_params(c) > 0]
        if len(weighted) < 2 or len({type(c) for _, c in weighted}) != 1:
            continue
        params = sum(_num_params(c) for _, c in weighted)
        if params > best_params:
            best, best_params = weighted, params
    return best
