"""Checkpoint tensors -> model tensors through ``transformers``' own conversion mapping, read lazily.

Why. ``transformers`` 5 models hold some parameters fused where checkpoints store them apart: a
Mixtral layer keeps its experts as ``mlp.experts.gate_up_proj`` ``[E, 2*I, H]`` and
``mlp.experts.down_proj`` ``[E, H, I]``, while ``save_pretrained`` and the Hub checkpoints store
``block_sparse_moe.experts.<e>.w1/w2/w3.weight`` per expert. ``from_pretrained`` converts with the
model's checkpoint conversion mapping: renamings, and ``WeightConverter`` operations such as
``MergeModulelist`` (``torch.stack`` of the experts) and ``Concatenate`` (``torch.cat`` of gate and
up). Building the fused tensor and then slicing it would read every expert on every rank.

How. The mapping comes from ``transformers`` (``get_model_conversion_mapping``: nothing is written
per model here), and its operations run unchanged on placeholders (:class:`Lazy`). A placeholder
records ``torch.stack`` and ``torch.cat`` as a tree over the checkpoint tensors, so a box of the
result (the rows and columns a rank holds) is read as the boxes of the sources it covers: a block of
experts under expert parallelism, the gate rows and the up rows of a tensor-parallel shard. Any
other torch operation (a transpose, a rotary permutation) runs on its sources read whole, then the
box is cut out: exact, but not sparse (the loader's ``bytes_read`` shows it). A model without a
mapping, or a module that is not a ``transformers`` model, keeps the checkpoint's own keys.

A box is one tuple of runs per tensor dim: the ``(start, stop)`` index ranges a rank holds, in its
local order (one run for a plain shard, several for a packed ``_StridedShard`` one).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.compat import tree_leaves, tree_map

Runs = tuple[tuple[int, int], ...]
Box = tuple[Runs, ...]


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple(((0, n),) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(sum(stop - start for start, stop in runs) for runs in box)


def runs_of(indices: list[int]) -> Runs:
    """Consecutive indices merged into ``(start, stop)`` runs, order kept."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return tuple(runs)


def take(tensor: Tensor, box: Box) -> Tensor:
    """The box of an in-memory tensor (the fallback path's last step)."""
    for dim, runs in enumerate(box):
        if runs == ((0, tensor.shape[dim]),):
            continue
        if len(runs) == 1:
            tensor = tensor.narrow(dim, runs[0][0], runs[0][1] - runs[0][0])
        else:
            tensor = tensor.index_select(dim, torch.cat([torch.arange(a, b) for a, b in runs]).to(tensor.device))
    return tensor.contiguous()


class Lazy(ABC):
    """A tensor not read yet: a checkpoint tensor, or ``torch.stack``/``torch.cat``/another op of lazies.

    ``read(box)`` returns that box of the tensor. Torch functions and tensor methods called on a
    placeholder (what ``transformers``' conversion operations do) build new placeholders.
    """

    @property
    @abstractmethod
    def shape(self) -> tuple[int, ...]: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @abstractmethod
    def read(self, box: Box) -> Tensor:
        """The ``box`` of this tensor, reading only the sources (and their boxes) it covers."""

    @abstractmethod
    def sources(self) -> list[str]:
        """The checkpoint keys this tensor is made of (for error messages)."""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: int | None = None) -> Any:
        return torch.Size(self.shape) if dim is None else self.shape[dim]

    def meta(self) -> Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")

    def contiguous(self, *args: Any, **kwargs: Any) -> Lazy:
        return self  # a read is contiguous anyway

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.stack, torch.cat, torch.concat):
            tensors = args[0] if args else kwargs["tensors"]
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if set(kwargs) <= {"tensors", "dim"} and tensors and all(isinstance(t, Lazy) for t in tensors):
                return (Stacked if func is torch.stack else Concatenated)(list(tensors), int(dim))
        return Computed.of(func, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        """Tensor methods (``.reshape``, ``.transpose``, ...) run through :class:`Computed`."""
        method = getattr(Tensor, name, None) if not name.startswith("_") else None
        if method is None or not callable(method):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return lambda *args, **kwargs: Computed.of(method, (self, *args), kwargs)

    def __getitem__(self, index: Any) -> Any:
        return Computed.of(Tensor.__getitem__, (self, index), {})


class Source(Lazy):
    """One tensor of the checkpoint, read box by box from its file (``reader``: ``pretrained._Reader``)."""

    def __init__(self, reader: Any, key: str) -> None:
        self.reader, self.key = reader, key

    @property
    def shape(self) -> tuple[int, ...]:
        return self.reader.shape(self.key)

    @property
    def dtype(self) -> torch.dtype:
        return self.reader.dtype(self.key)

    def sources(self) -> list[str]:
        return [self.key]

    def read(self, box: Box) -> Tensor:
        split = next((d for d, runs in enumerate(box) if len(runs) > 1), None)
        if split is None:  # one contiguous box: one slice of the file
            return self.reader.read(self.key, tuple(slice(*runs[0]) for runs in box))
        return torch.cat([self.read((*box[:split], (run,), *box[split + 1:])) for run in box[split]], dim=split)


class _Combined(Lazy):
    """A tensor made of other lazy tensors (``parts``): their dtype, and every file key they read."""

    parts: list[Lazy]

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def sources(self) -> list[str]:
        return [key for part in self.parts for key in part.sources()]


class Stacked(_Combined):
    """``torch.stack(parts, dim)``: a box reads only the parts (experts) its runs on ``dim`` cover."""

    def __init__(self, parts: list[Lazy], dim: int) -> None:
        self.parts = parts
        self.along = dim if dim >= 0 else dim + parts[0].ndim + 1

    @property
    def shape(self) -> tuple[int, ...]:
        shapes = {part.shape for part in self.parts}
        if len(shapes) != 1:
            raise ValueError(f"torch.stack of tensors of different shapes {sorted(shapes)}")
        one = shapes.pop()
        return (*one[:self.along], len(self.parts), *one[self.along:])

    def read(self, box: Box) -> Tensor:
        rest = (*box[:self.along], *box[self.along + 1:])
        picked = [i for start, stop in box[self.along] for i in range(start, stop)]
        if not picked:
            return torch.empty(box_shape(box), dtype=self.dtype)
        return torch.stack([self.parts[i].read(rest) for i in picked], dim=self.along)


class Concatenated(_Combined):
    """``torch.cat(parts, dim)``: each run on ``dim`` reads only the parts it overlaps."""

    def __init__(self, parts: list[Lazy], dim: int) -> None:
        self.parts = parts
        self.along = dim if dim >= 0 else dim + parts[0].ndim

    @property
    def shape(self) -> tuple[int, ...]:
        shapes = [part.shape for part in self.parts]
        rest = {(*s[:self.along], *s[self.along + 1:]) for s in shapes}
        if len(rest) != 1 or any(len(s) <= self.along for s in shapes):
            raise ValueError(f"torch.cat along dim {self.along} of tensors of shapes {shapes}")
        first = shapes[0]
        return (*first[:self.along], sum(s[self.along] for s in shapes), *first[self.along + 1:])

    def read(self, box: Box) -> Tensor:
        pieces = []
        for start, stop in box[self.along]:
            offset = 0
            for part in self.parts:
                size = part.shape[self.along]
                lo, hi = max(start, offset), min(stop, offset + size)
                if lo < hi:
                    pieces.append(part.read((*box[:self.along], ((lo - offset, hi - offset),), *box[self.along + 1:])))
                offset += size
        if not pieces:
            return torch.empty(box_shape(box), dtype=self.dtype)
        return torch.cat(pieces, dim=self.along)


class Computed(Lazy):
    """Any other torch op on placeholders: its shape from a run on meta tensors; a read runs it on the
    sources read whole and cuts the box out (exact, not sparse)."""

    def __init__(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], result: Tensor,
                 pick: int | None) -> None:
        self.func, self.args, self.kwargs, self.result, self.pick = func, args, kwargs, result, pick

    @classmethod
    def of(cls, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A placeholder per tensor ``func`` returns (a tuple for ``chunk``/``split``); a non-tensor
        result (``.size(0)``) is returned as the meta run gives it."""
        to_meta = lambda x: x.meta() if isinstance(x, Lazy) else x  # noqa: E731
        result = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        if isinstance(result, Tensor):
            return cls(func, args, kwargs, result, None)
        if isinstance(result, (tuple, list)) and result and all(isinstance(r, Tensor) for r in result):
            return type(result)(cls(func, args, kwargs, r, i) for i, r in enumerate(result))
        return result

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.result.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.result.dtype

    def sources(self) -> list[str]:
        return [key for leaf in tree_leaves((self.args, self.kwargs)) if isinstance(leaf, Lazy) for key in leaf.sources()]

    def read(self, box: Box) -> Tensor:
        to_real = lambda x: x.read(full_box(x.shape)) if isinstance(x, Lazy) else x  # noqa: E731
        out = self.func(*tree_map(to_real, self.args), **tree_map(to_real, self.kwargs))
        return take(out if self.pick is None else out[self.pick], box)


def _natural_key(key: str) -> list[tuple[int, Any]]:
    """``experts.10`` after ``experts.9``: the order transformers collects a converter's tensors in
    (a ``MergeModulelist`` stacks them in this order)."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in key.split(".")]


Conversions = tuple[list[Any], list[Any]]  # (renamings, converters): transformers' WeightTransform objects


def conversions(module: nn.Module) -> Conversions:
    """(renamings, converters) of ``transformers``' checkpoint conversion mapping for ``module``;
    empty for a module that is not a ``transformers`` model, or a ``transformers`` without one (4.x,
    whose models hold the checkpoint's own layout)."""
    try:  # transformers 5 API (conversion_mapping / core_model_loading, checked on 5.24)
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return [], []
    if not isinstance(module, PreTrainedModel):
        return [], []
    mapping = get_model_conversion_mapping(module)
    return ([m for m in mapping if not isinstance(m, WeightConverter)], [m for m in mapping if isinstance(m, WeightConverter)])


@dataclass
class Plan:
    """What to read for each target tensor (its clean name), and what did not fit."""

    tensors: dict[str, Lazy] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # target -> why its conversion failed, naming the sources


def describe(sources: list[str]) -> str:
    """The source keys of a target, shortened for an error message."""
    return f"{sources[0]}" if len(sources) == 1 else f"{sources[0]} ... {sources[-1]} ({len(sources)} tensors)"


def plan_reads(module: nn.Module, keys: list[str], names: dict[str, str], source: Callable[[str], Lazy],
               mapping: Conversions | None = None) -> Plan:
    """Map the checkpoint ``keys`` to ``module``'s tensors the way ``from_pretrained`` does.

    ``names``: every name a target goes by (tied aliases included) -> its clean name. Each key is
    renamed by the mapping's renamings and at most one converter (``transformers``'
    ``rename_source_key``); a key the mapping renames to no known name but that is a name itself
    keeps it (as ``from_pretrained`` does). Converter targets get their operations run on
    placeholders, one converter instance per target. ``mapping``: :func:`conversions` of ``module``
    looked up earlier (before a layout changed its classes), else looked up now.
    """
    renamings, converters = conversions(module) if mapping is None else mapping
    rename: Callable[[str], tuple[str, str | None]] = lambda key: (key, None)  # noqa: E731
    if renamings or converters:
        from transformers.core_model_loading import rename_source_key  # transformers 5 API, checked on 5.24

        prefix = getattr(module, "base_model_prefix", None) or None
        rename = lambda key: rename_source_key(key, renamings, converters, prefix, names)  # noqa: E731
    by_pattern = {pattern: conv for conv in converters for pattern in conv.source_patterns}
    plan = Plan()
    fused: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(keys, key=_natural_key):
        name, pattern = rename(key)
        if name not in names and key in names:
            name, pattern = key, None
        if name not in names:
            plan.unexpected.append(key)
        elif pattern is None:
            if names[name] not in plan.tensors:  # a tied tensor stored under two names: either one
                plan.tensors[names[name]] = source(key)
        else:
            conv, collected = fused.setdefault(names[name], (copy.deepcopy(by_pattern[pattern]), defaultdict(list)))
            collected[pattern].append(key)
    for target, (conv, collected) in fused.items():
        _convert(module, target, conv, {p: [source(k) for k in ks] for p, ks in collected.items()}, names, plan)
    return plan


def _convert(module: nn.Module, target: str, conv: Any, collected: dict[str, list[Lazy]], names: dict[str, str],
             plan: Plan) -> None:
    """Run one ``WeightConverter`` (transformers 5: ``collected_tensors`` + ``convert(layer_name, model=,
    config=)``) on placeholders; record its targets, or why it failed."""
    sources = [lazy.key for lazies in collected.values() for lazy in lazies if isinstance(lazy, Source)]
    for pattern, lazies in collected.items():
        conv.collected_tensors[pattern] = lazies
    try:
        out = conv.convert(target, model=module, config=getattr(module, "config", None))
    except Exception as err:  # a shape the operations reject (one expert too few, ...), told with its sources
        plan.failed[target] = f"{type(conv).__name__}{tuple(conv.source_patterns)} of {describe(sources)}: {err}"
        return
    for name, value in out.items():
        value = value[0] if isinstance(value, list) else value
        if name in names and isinstance(value, Lazy):
            plan.tensors[names[name]] = value
        else:
            plan.unexpected.append(f"{name} (converted from {describe(sources)})")


__all__ = ["Box", "Conversions", "Lazy", "Plan", "Source", "box_shape", "conversions", "describe", "full_box", "plan_reads", "runs_of", "take"]
