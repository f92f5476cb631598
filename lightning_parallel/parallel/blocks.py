"""Find the repeated blocks of an unchanged model.

FSDP2 wraps, activation checkpointing and pipeline cuts all want the same unit: the block
that a model repeats (a transformer layer, an MLP layer). Users should not have to name it,
so we look for the container that holds the most parameters among: an ``nn.ModuleList`` of
at least two parameterised layers, whatever their classes, and an ``nn.Sequential`` whose
parameterised children share one class.

Why a ``ModuleList`` may mix classes: hybrid stacks (Jamba's attention, Mamba and MoE layers;
dense and MoE layers alternating) keep their layers in one list that ``forward`` runs in order,
which is exactly a block stack; each layer is still one unit to wrap, recompute or place on a
stage (pipelines balance them by cost, not by count). A ``Sequential`` mixing classes is a small
network (``Linear, ReLU, Linear``): there only its same-class layers are blocks.
"""

from __future__ import annotations

from torch import nn


def is_hf_model(module: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel`` (checked by name: transformers is an optional dependency)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in type(module).__mro__)


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_repeated_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return ``(qualified name, block)`` pairs of the largest block stack (module docstring).

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
        mixed = len({type(c) for _, c in weighted}) != 1
        if len(weighted) < 2 or (mixed and not isinstance(container, nn.ModuleList)):
            continue
        params = sum(_num_params(c) for _, c in weighted)
        if params > best_params:
            best, best_params = weighted, params
    return best
