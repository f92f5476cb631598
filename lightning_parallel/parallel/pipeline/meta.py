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

Every pipeline layout takes this path: pipeline stages alone, with tensor parallelism (DTensor
shards materialise like any other), with replicated data parallelism, with ZeRO (each rank
materialises its stages whole, then FSDP2 shards them over the data-parallel ranks: at most one
stage's full parameters, never the model) and with expert parallelism (the experts of this
rank's stages are split over ``ep`` while still meta, so a rank allocates only its block of its
own stages' experts, as the eager ``ep`` layout does). Measured (``tests/test_meta_init.py``,
pp2 x ep2 on a tiny Mixtral, 4 ranks): each rank holds 0.29 of the model's parameter bytes, where
its stage alone is 0.5 and materialising the model before tracing, as pp x ep once did, held 1.0.

MoE units never run on meta tensors. The tracer calls each one as an opaque op whose shape
rule is "the output looks like the first input" (:mod:`lightning_parallel.parallel.pipeline.moe`), and
:func:`meta_output_forward` runs the model's forward the same way. Why: MoE internals have no
faithful meta kernels. The package's ``MoE`` dispatches with ``nonzero`` (a data-dependent
shape: no meta kernel at all), and Hugging Face Mixtral's experts take the ``grouped_mm`` path
on meta tensors as on CPU, where torch's meta kernel accepts bf16 inputs only ("Expected inputs
of BF16 type") while the CPU kernel takes fp32 too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_parallel.compat import tree_map
from lightning_parallel.parallel.pipeline.moe import opaque_forwards

_META = torch.device("meta")


def to_meta(tree: Any) -> Any:
    """The same structure with every tensor replaced by a meta tensor of its shape and dtype."""
    return tree_map(lambda t: torch.empty_like(t, device=_META) if isinstance(t, torch.Tensor) else t, tree)


@contextlib.contextmanager
def meta_output_forward(
    target: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device, enabled: bool = True
) -> Iterator[None]:
    """Within the block, ``target.forward`` returns zeros on ``device`` shaped like its output for
    ``args``/``kwargs`` (computed once on meta tensors, MoE units as the tracer's opaque ops: see
    the module docstring). Why: the forward-count probe runs the whole step, whose code after the
    forward (a metric's ``unique``, an ``.item()``) may have no meta kernel or need values; the
    step sees real tensors, the model's meta weights are never read."""
    if not enabled:
        yield
        return
    with torch.no_grad(), opaque_forwards(target):
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


__all__ = ["meta_output_forward", "retarget_devices", "to_meta"]
