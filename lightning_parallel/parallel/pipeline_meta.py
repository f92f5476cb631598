"""Pipelines of meta-built models: trace on meta tensors, then materialise only the owned stages.

A model built on the meta device (``Trainer.init_module(empty_init=True)``) is traced as it is:
``torch.export`` needs shapes, dtypes and devices, not values, so the example batch goes in as
meta tensors of the same shapes (the probe that counts the step's forward calls runs the step
on real tensors, the forward answering zeros of its output's shapes). Two things in the traced stages then name the meta device and
are moved to the rank's device (:func:`retarget_devices`): constants created from an input's
device (``torch.arange(..., device=x.device)``: Hugging Face position ids and causal masks) and
device casts. After the split each rank releases what other stages own (empty tensors), and
:func:`~lightning_parallel.parallel.materialize.materialize_meta_module` (``in_place``: the
stages share the module's parameter objects, and the optimizer already holds them) allocates
and initialises only what is left: this rank's stages. The random stream still covers the
whole model (released modules are initialised on throw-away temporaries), so the stages hold
the values one process builds.

Which pipeline layouts take this path (:func:`stays_meta_until_traced`): every one without
expert parallelism: pipeline stages alone, with tensor parallelism (DTensor shards materialise
like any other), with replicated data parallelism, and with ZeRO (each rank materialises its
stages whole, then FSDP2 shards them over the data-parallel ranks: at most one stage's full
parameters, never the model). Expert parallelism on stages materialises the whole model before
tracing instead (every rank allocates the model once, then releases other stages' tensors):
tried on meta, :func:`meta_output_forward` (the model's forward on meta inputs, for the output
shapes the forward-count probe answers with) fails for Hugging Face Mixtral: off the CPU its
experts take the ``grouped_mm`` path, whose meta kernel accepts bf16 only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_parallel.compat import tree_map

_META = torch.device("meta")


def stays_meta_until_traced(ep: int) -> bool:
    """Whether the pipeline layout can trace a meta model and materialise its stages only (see doc)."""
    return ep == 1


def to_meta(tree: Any) -> Any:
    """The same structure with every tensor replaced by a meta tensor of its shape and dtype."""
    return tree_map(lambda t: torch.empty_like(t, device=_META) if isinstance(t, torch.Tensor) else t, tree)


@contextlib.contextmanager
def meta_output_forward(
    target: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device, enabled: bool = True
) -> Iterator[None]:
    """Within the block, ``target.forward`` returns zeros on ``device`` shaped like its output for
    ``args``/``kwargs`` (computed once on meta tensors). Why: the forward-count probe runs the whole
    step, whose code after the forward (a metric's ``unique``, an ``.item()``) may have no meta
    kernel or need values; the step sees real tensors, the model's meta weights are never read."""
    if not enabled:
        yield
        return
    with torch.no_grad():
        shaped = target(*to_meta(tuple(args)), **to_meta(dict(kwargs)))
    zeros = tree_map(lambda t: torch.zeros_like(t, device=device) if isinstance(t, torch.Tensor) else t, shaped)
    saved = target.__dict__.get("forward")
    target.forward = lambda *a, **k: zeros  # type: ignore[method-assign]
    try:
        yield
    finally:
        if saved is None:
            del target.forward
        else:
            target.forward = saved  # type: ignore[method-assign]


def _swap(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.device) and value.type == "meta":
        return device
    if isinstance(value, (list, tuple)):
        return type(value)(_swap(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _swap(v, device) for k, v in value.items()}
    return value


def retarget_devices(stage_modules: Iterable[nn.Module], device: torch.device) -> int:
    """Replace the meta device in every traced node's arguments by ``device``; regenerate the
    code. Returns the number of nodes changed."""
    changed = 0
    for stage in stage_modules:
        for sub in stage.modules():
            graph = getattr(sub, "graph", None)
            if not isinstance(graph, torch.fx.Graph):
                continue
            dirty = False
            for node in graph.nodes:
                args, kwargs = _swap(node.args, device), _swap(dict(node.kwargs), device)
                if args != node.args or kwargs != dict(node.kwargs):
                    node.args, node.kwargs = args, kwargs
                    changed += 1
                    dirty = True
            if not dirty:
                continue
            if isinstance(sub, torch.fx.GraphModule):
                sub.recompile()
            elif getattr(sub, "graph_module", None) is not None:  # torch.export's InterpreterModule
                sub.graph_module.recompile()
    return changed


__all__ = ["meta_output_forward", "retarget_devices", "stays_meta_until_traced", "to_meta"]
