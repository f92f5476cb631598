"""Sequence parallelism over a model's block stacks, for models that read the sequence length.

Megatron splits the residual stream along the sequence right after the embedding and gathers it
before the LM head; :mod:`~lightning_parallel.parallel.tensor.apply` does that for models whose
code between the embedding and the blocks is per token. Hugging Face models are not: after the
embedding they build the attention mask, ``cache_position``, position ids and the rotary tables
from the length of the embedding output (``inputs_embeds.shape[1]``) and pass them to every layer.
Split there, all of it would cover half the sequence.

So for them the split spans the block stacks instead: each stack (an ``nn.ModuleList`` whose
layers hold the tensor-parallel regions: a decoder's ``layers``, BERT's ``encoder.layer``, T5's
encoder and decoder ``block``) receives the full hidden states from the model's own code; its
first layer keeps this rank's slice of the sequence (a local slice, no communication) and the
output of its last layer is gathered again (one all-gather per stack and forward). In between, the
stream is a ``Shard(1)`` DTensor, not a plain slice: the layers' own code runs in DTensor's global
semantics (in the regions' dispatch mode, plain tensors joining as replicated), so whatever a
layer does besides its regions is exact without being told: norms and residual adds run on the
rank's slice, their replicated weights' gradients summed over the ranks; a residual handed into a
region (Bloom, MPT) stays split; a module kept whole (a multi-query attention) gathers what it
needs; shapes are the global ones, so a layer's reshapes by the sequence length stay right. Each
region gathers the sequence once on entry and reduce-scatters its output (the Megatron minimum),
and the masks, position tables and cross-attention inputs the layers receive are the full ones,
which is what the regions, seeing the whole sequence, need. The model's code after a stack (final
norm, pooler, LM head, losses) sees the full sequence.

An MoE layer whose experts are split over tp runs as one region on the gathered sequence (the
experts need the same tokens on every tp rank): an all-gather in, its experts' partial outputs
left partial (``ExpertsForward``) and reduce-scattered to the rank's slice at the layer's exit; in
backward their input gradients are all-reduced (Megatron reduce-scatters them: its count, twice
those bytes). Refused
at run time: ``output_hidden_states=True`` (the model would collect the layers' split outputs).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication

from lightning_parallel.parallel.blocks import is_hf_model
from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.tensor.attention import ReplicateMixedMode, _first_tensor_arg, _first_tensor_out, full_value
from lightning_parallel.parallel.tensor.flat_stream import is_flat_stream, note_column_input, reduce_to_stream, unflatten_stream
from lightning_parallel.parallel.tensor.region_inputs import gathered_stream, is_sequence_stream


def inside(name: str, containers: Iterable[str]) -> bool:
    """Whether module ``name`` is one of ``containers`` or below one of them (``""`` is the root)."""
    return any(c == "" or name == c or name.startswith(f"{c}.") for c in containers)


def reads_sequence_length(module: nn.Module) -> bool:
    """Whether the split must span the block stacks rather than start at the embedding (module doc)."""
    return any(is_hf_model(m) for m in module.modules())


def block_stacks(module: nn.Module, regions: Iterable[str]) -> list[list[str]]:
    """The layer names of every ``nn.ModuleList`` whose parameterised layers each hold a region,
    outermost first (a list inside a stack's layer is part of that layer)."""
    regions = tuple(regions)
    stacks: list[list[str]] = []
    for name, container in module.named_modules():
        if not isinstance(container, nn.ModuleList) or any(inside(name, stack) for stack in stacks):
            continue
        layers = [f"{name}.{n}" if name else n for n, c in container.named_children() if any(True for _ in c.parameters())]
        if layers and all(any(inside(r, (layer,)) for r in regions) for layer in layers):
            stacks.append(layers)
    return stacks


def whole_blocks(module: nn.Module, stacks: list[list[str]], regions: Iterable[str], experts: Iterable[str] = ()) -> list[str]:
    """The stack layers' children that run as regions of their own on the gathered sequence.

    Two kinds. A child kept whole that holds two or more linear layers (an attention or MLP the plan
    could not split, e.g. multi-query attention): DTensor alone gathered each projection's input and,
    in backward, the saved ones again; as a region it gathers its input once and its parameters'
    gradients need no reduction. And an MoE layer whose ``experts`` are split over tp: they need the
    same tokens on every tp rank (their partial outputs are summed), so the layer runs on the whole
    sequence (its shared expert, a region inside it, is part of it)."""
    from lightning_parallel.parallel.tensor.fused import is_linear_like

    regions, experts = tuple(regions), tuple(experts)
    out = []
    for layer in (layer for stack in stacks for layer in stack):
        for child, sub in module.get_submodule(layer).named_children():
            name = f"{layer}.{child}"
            if inside(name, regions):
                continue
            if any(inside(e, (name,)) for e in experts):
                out.append(name)
            elif not any(inside(r, (name,)) for r in regions) and sum(1 for m in sub.modules() if is_linear_like(m)) >= 2:
                out.append(name)
    return out


@dataclass(frozen=True)
class StackSpan:
    """Where the stream is split: the ``stacks`` (their layers' names), the layers' children that run
    as regions on the gathered sequence (``gathered``, :func:`whole_blocks`), and every module that
    sees the stream split (``split``: the layers' modules less the gathered ones)."""

    stacks: list[list[str]]
    gathered: list[str]
    split: frozenset[str]


def stack_span(module: nn.Module, regions: Iterable[str], experts: Iterable[str]) -> StackSpan:
    """The :class:`StackSpan` of ``module`` (computed once per model: it walks the module tree)."""
    regions = tuple(regions)
    stacks = block_stacks(module, regions)
    gathered = whole_blocks(module, stacks, regions, experts)
    split = frozenset(n for layer in (layer for stack in stacks for layer in stack)
                      for n, _ in module.get_submodule(layer).named_modules(prefix=layer) if not inside(n, gathered))
    return StackSpan(stacks, gathered, split)


def check_stacks(module: nn.Module, regions: Iterable[str], experts: Iterable[str]) -> None:
    """Refuse what this split cannot run (module doc), with no collective."""
    regions, experts = tuple(regions), tuple(experts)
    span = stack_span(module, regions, experts)
    if not span.stacks:
        raise config_error(
            ValueError, "sequence_parallel", True,
            f"{type(module).__name__} has no layer list (nn.ModuleList) whose layers hold its tensor-parallel "
            f"regions {list(regions)[:3]}, so there is no span of blocks to split along the sequence",
            "set sequence_parallel=false for this model",
        )
    loose = [e for e in experts if any(inside(e, stack) for stack in span.stacks) and not inside(e, span.gathered)]
    if loose:
        raise config_error(
            ValueError, "sequence_parallel", True,
            f"the experts {loose[:3]} are split over tensor-parallel ranks, which must then hold the same tokens, and they "
            "are not inside a module of their layer that could run on the whole sequence",
            "set sequence_parallel=false, or give the experts to expert parallelism (expert_parallel_size)",
        )


def _dtensor_semantics(fn: Any) -> Any:
    """``fn`` run in the regions' dispatch mode, plain tensors joining as replicated (module doc)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with ReplicateMixedMode(), implicit_replication():
            return fn(*args, **kwargs)

    return run


class _CheckpointInDTensorSemantics:
    """A Hugging Face layer's ``_gradient_checkpointing_func`` whose function runs in DTensor semantics.

    Why: transformers (5) checkpoints a layer's class ``forward``, not the module call, so the
    backward's recomputation calls that ``forward`` directly, outside :class:`StackLayerForward` and
    its dispatch mode (measured: Qwen2 with ``gradient_checkpointing_enable()`` failed in backward on
    a norm weight meeting the split stream). Wrapping the function given to the checkpoint runs the
    first pass and the recomputation alike in it, reentrant or not."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return self.inner(_dtensor_semantics(fn), *args, **kwargs)


class StackLayerForward:
    """A stack layer's ``forward``: the stream as a ``Shard(1)`` DTensor, the layer's code in DTensor
    semantics; the first layer splits the full hidden states, the last gathers them (module doc).
    An object, not a closure, so ``copy.deepcopy`` of the model rebinds it (as ``RegionForward``)."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh, *, first: bool, last: bool) -> None:
        self.module, self.original, self.mesh, self.first, self.last = module, module.forward, mesh, first, last

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor) or not x.is_floating_point():
            return x
        if x.ndim < 2 or x.shape[1] % self.mesh.size():
            raise config_error(
                ValueError, "sequence length", tuple(x.shape),
                f"with sequence_parallel=True dim 1 of the hidden states must be divisible by tensor_parallel_size={self.mesh.size()}",
                "pad or crop sequences to a multiple of the TP size, or set sequence_parallel=false",
            )
        return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(self.mesh, [Shard(1)])

    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.first:
            args, kwargs = _first_tensor_arg(args, kwargs, self._split)
        checkpoint = getattr(self.module, "_gradient_checkpointing_func", None)  # set whenever the user enables it
        if checkpoint is not None and not isinstance(checkpoint, _CheckpointInDTensorSemantics):
            self.module._gradient_checkpointing_func = _CheckpointInDTensorSemantics(checkpoint)
        out = _dtensor_semantics(self.original)(*args, **kwargs)
        return _first_tensor_out(out, full_value) if self.last else out


def _refuse_hidden_states(module: nn.Module, args: tuple, kwargs: dict) -> None:
    asked = kwargs.get("output_hidden_states")
    if asked is None:
        asked = getattr(getattr(module, "config", None), "output_hidden_states", False)
    if asked:
        raise config_error(
            ValueError, "output_hidden_states", True,
            "with sequence_parallel=True the hidden states between a stack's layers are split along the sequence",
            "call the model with output_hidden_states=False, or train with sequence_parallel=false",
        )


def _gather_stream_input(module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook of a column-parallel layer in a stack: a split stream input is gathered here,
    once for every layer reading it (``gathered_stream``), not inside the matmul.

    Why: a region entered through a column-parallel layer rather than its module's forward (BERT's and
    BART's MLP, whose region is the whole layer) handed the layer the ``Shard(1)`` stream; DTensor's
    matmul gathered it in the forward and, the matmul having saved the split input for its weight
    gradient, gathered it again in the backward: one all-gather per region more than the minimum.
    A stream flattened to tokens (``flat_stream``) is gathered the same way, and its layout noted for
    the row-parallel layer after it."""
    if not args:
        return None
    note_column_input(args[0])
    if is_sequence_stream(args[0]):
        return (gathered_stream(args[0]), *args[1:])
    if is_flat_stream(args[0]):  # gathered as (B, T, C): the gradient reduce-scattered, not all-reduced
        return (gathered_stream(unflatten_stream(args[0])).reshape(args[0].shape), *args[1:])
    return None


def install_stack_layers(
    module: nn.Module, mesh: DeviceMesh, stacks: list[list[str]], columns: Iterable[str] = (), rows: Iterable[str] = ()
) -> None:
    """Route every stack layer's forward through :class:`StackLayerForward` (parameters and FQNs untouched),
    gather a split stream where the ``columns`` (column-parallel layers) read it, and reduce-scatter the
    ``rows``' (row-parallel layers') partial outputs to the stream's placement (``flat_stream``)."""
    layers = [layer for stack in stacks for layer in stack]
    for name in columns:
        if inside(name, layers):
            module.get_submodule(name).register_forward_pre_hook(_gather_stream_input)
    for name in rows:
        if inside(name, layers):
            module.get_submodule(name).register_forward_hook(reduce_to_stream)
    for stack in stacks:
        for i, name in enumerate(stack):
            layer = module.get_submodule(name)
            layer.forward = StackLayerForward(layer, mesh, first=i == 0, last=i == len(stack) - 1)  # type: ignore[method-assign]
    for sub in module.modules():
        if is_hf_model(sub):
            sub.register_forward_pre_hook(_refuse_hidden_states, with_kwargs=True)


__all__ = ["StackLayerForward", "StackSpan", "block_stacks", "stack_span", "check_stacks", "inside", "install_stack_layers", "reads_sequence_length", "whole_blocks"]
