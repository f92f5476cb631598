"""Per-head biases and parameters: a whole bias cut to this rank's heads once for every layer that
reads it, and a module's own per-head parameters split with the heads (:class:`HeadParameters`).

A bias arrives whole with a gradient where nothing made it split: T5's all-zero cross-attention
bias, which HF marks as needing a gradient under gradient checkpointing, or a bias looked up from a
parameter table that is not an ``nn.Embedding``. T5's learned position bias was one until its
embedding was split with the heads (``embedding_colwise``); the story below is how it was measured.
T5 computes its relative position bias ``(1, H, T, S)`` in the first layer's attention, returns it,
and every later layer of the stack reads it. Under SDPA, Hugging Face turns it into each layer's
attention mask: ``bias.contiguous()``, or ``torch.where(mask, bias, min).contiguous()`` with a
padding or causal mask (``create_position_bias_mask``). The bias is replicated (its embedding is
small and stays whole) and the attention is split along the heads, so each layer's mask was cut
to this rank's heads: a local slice forward, whose backward gathers the gradient whole, once per
layer (issue 26: T5 1.19x the minimum, 4 all-gathers per step more).

Here the bias itself is cut once (:func:`head_cut`, keyed by the tensor as it was made: a later
region reads it converted to a replicated DTensor, ``region_inputs.replicated_source`` maps that
back), each layer's mask is rebuilt on this rank's heads from that one cut (the region's dispatch
mode records how a mask was made from a bias, :func:`note_derived`; attention asks for
:func:`derived_cut`), and autograd sums the layers' gradients before the one gather. Exact: the
same values (``where`` and copies are elementwise over the heads), one gather per bias.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils.weak import WeakIdKeyDictionary

from lightning_parallel.compat import tensor_version
from lightning_parallel.parallel.tensor.region_inputs import is_replicated, local_piece, piece, replicated_source, shared_conversion

_CUTS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a bias -> (key, its head-split DTensor)
# A mask made from a bias -> (cond, bias, other) of torch.where, or (None, bias, None) for a copy of it.
_DERIVED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_COPIES: frozenset[Callable[..., Any]] = frozenset({Tensor.contiguous, Tensor.clone, torch.clone})


def _replicated_bias(x: Any) -> bool:
    """A 4-D tensor that needs a gradient and is the same on every rank (plain, or a replicated DTensor)."""
    return isinstance(x, Tensor) and x.ndim == 4 and x.requires_grad and is_replicated(x)


def head_cut(x: Tensor, mesh: DeviceMesh, dim: int) -> Tensor:
    """This rank's heads (``Shard(dim)``) of ``x`` (plain or replicated: the same on every rank) as a
    local tensor; one redistribution per tensor for all its readers (module doc)."""
    x = replicated_source(x)
    # Held, not weakly kept: between two layers nothing else references the cut DTensor.
    cut = shared_conversion(_CUTS, x, (id(mesh), dim, tensor_version(x)), lambda: piece(x, mesh, Shard(dim)), hold=True)
    return cut.to_local()


def note_derived(func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    """Remember how ``out`` was made from a replicated bias: ``torch.where(cond, bias, other)``, or a copy
    (``contiguous``, ``clone``) of a bias or of such a mask. Called for every call in a region."""
    if func is torch.where:
        if not kwargs and len(args) == 3 and _replicated_bias(args[1]) and isinstance(out, Tensor):
            _DERIVED[out] = args
    elif func in _COPIES and args and isinstance(out, Tensor) and out is not args[0]:
        src = args[0]
        recipe = _DERIVED.get(src) if isinstance(src, Tensor) else None
        if recipe is not None:
            _DERIVED[out] = recipe
        elif _replicated_bias(src):
            _DERIVED[out] = (None, src, None)


def derived_cut(mask: Tensor, mesh: DeviceMesh, dim: int) -> Tensor | None:
    """This rank's heads of a mask :func:`note_derived` recorded, rebuilt from the bias's one cut; else None."""
    recipe = _DERIVED.get(mask)
    if recipe is None:
        return None
    cond, bias, other = recipe
    if cond is None:
        return head_cut(bias, mesh, dim)

    def local(x: Any) -> Any:  # no gradient: this rank's heads by a local slice, or broadcast as is
        if not isinstance(x, Tensor):
            return x
        if x.ndim == mask.ndim and x.shape[dim] == mask.shape[dim] > 1:
            return local_piece(x, mesh, Shard(dim))
        return x.to_local() if isinstance(x, DTensor) else x

    if isinstance(cond, Tensor) and cond.requires_grad or isinstance(other, Tensor) and other.requires_grad:
        return None
    return torch.where(local(cond), head_cut(bias, mesh, dim), local(other))


class HeadParameters(ParallelStyle):
    """The ``head_parameters`` style: a module's own parameters, each one row per attention head
    (GPT-OSS's attention sinks, ``(H,)``), split along dim 0 as the heads are (``Shard(0)``).

    Inside the region the sinks meet the head-split scores (``reshape(1, -1, 1, 1)``, ``expand``,
    ``cat`` along the keys) in DTensor's semantics on the rank's own heads; kept whole they were
    sliced there and their gradient gathered back, and the ``cat`` of split scores with whole sinks
    gathered the scores."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]),
                                                         requires_grad=param.requires_grad))
        return module


__all__ = ["HeadParameters", "derived_cut", "head_cut", "note_derived"]
