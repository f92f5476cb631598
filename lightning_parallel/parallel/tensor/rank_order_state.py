"""State dicts of a model with rank-ordered parameters, keyed by name: always in the model's order.

:mod:`~lightning_parallel.parallel.tensor.rank_order` stores a packed projection of unequal parts
(Phi-3's ``qkv_proj``) in rank order. Checkpoints, ``trainer.save_checkpoint`` and anything reading
a state dict by name must see the model's order, or a checkpoint saved under ``tp`` would load
into another layout (or another ``tp`` degree) with its rows permuted. torch's state-dict API
(``get_model_state_dict``, ``get_optimizer_state_dict``) detaches the parameters, so the mark is
found again by name here: a sharded state keeps its DTensors, marked (the checkpoint layout
writes them in the model's order, :mod:`~lightning_parallel.parallel.tensor.checkpoint_layout`);
a full state (plain tensors in rank order) is reordered at once.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel.parallel.tensor.rank_order import RankOrder, mark, rank_order


def rank_orders(module: nn.Module) -> dict[str, tuple[RankOrder, tuple[int, ...]]]:
    """Parameter FQN -> (its rank order, its global shape), for every rank-ordered parameter."""
    return {name: (order, tuple(p.shape)) for name, p in module.named_parameters()
            if (order := rank_order(p)) is not None}


def _to_model_order(value: Any, order: RankOrder, shape: tuple[int, ...]) -> Any:
    if not isinstance(value, Tensor) or tuple(value.shape) != shape:
        return value  # not laid out like the parameter (a step count)
    if isinstance(value, DTensor):
        return mark(value, order)
    return order.natural(value)


def _to_stored(value: Any, order: RankOrder, shape: tuple[int, ...]) -> Any:
    if isinstance(value, Tensor) and not isinstance(value, DTensor) and tuple(value.shape) == shape:
        return order.stored(value)
    return value


def model_order(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """A model state dict from torch's API in the model's order (sharded: marked; full: reordered)."""
    orders = rank_orders(module)
    return {k: _to_model_order(v, *orders[k]) if k in orders else v for k, v in state.items()}


def _optimizer(state: dict[str, Any], module: nn.Module, convert: Any) -> dict[str, Any]:
    orders = rank_orders(module)
    if not orders or not isinstance(state.get("state"), dict):
        return state
    per_param = {name: ({k: convert(v, *orders[name]) for k, v in entries.items()} if name in orders else entries)
                 for name, entries in state["state"].items()}
    return {**state, "state": per_param}


def optimizer_model_order(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """An FQN-keyed optimizer state in the model's order (its moments are laid out like the parameters)."""
    return _optimizer(state, module, _to_model_order)


def full_states_stored(state: dict[str, Any], module: nn.Module, optimizer: bool) -> dict[str, Any]:
    """A full (consolidated, model-order) state reordered for torch to split into rank-ordered parameters."""
    if optimizer:
        return _optimizer(state, module, _to_stored)
    orders = rank_orders(module)
    return {k: _to_stored(v, *orders[k]) if k in orders else v for k, v in state.items()}


__all__ = ["full_states_stored", "model_order", "optimizer_model_order", "rank_orders"]
