"""Attention weights split over the heads are gathered only when the model returns them.

Hugging Face attentions return ``(attn_output, attn_weights)``. Under the eager implementation
(Bloom and MPT have no other; Gemma 2 and 3 recommend it for training; any model loaded with
``attn_implementation="eager"``) the weights are the ``(B, H, T, S)`` softmax probabilities, and
in a tensor-parallel region they are split over the heads. Gathering them at the region's exit
(what a region does with every output) costs one all-gather of ``B * H * T * S`` elements per
layer per forward, the largest tensor of the attention, for a value the decoder layer drops
unless the caller passed ``output_attentions=True`` (issue 26: Bloom and MPT 1.18x the minimum).

So the model's own flag decides, as it does for the SDPA implementation, which returns ``None``
weights: a forward pre-hook on every ``PreTrainedModel`` resolves ``output_attentions`` (the call's
argument, else the enclosing model's, else ``config.output_attentions``, as transformers does) and,
while that forward runs and the flag is false, a region returns ``None`` in place of each later
output that *is* attention probabilities: the result of a softmax computed in the region, through
dtype casts, dropout and indexing (:func:`mark_probabilities`, called by the region's dispatch mode), and
still split along the heads. Nothing else is dropped: T5's attention also returns its position
bias, which the next layers read. With the flag true, or outside a Hugging Face model's forward,
every output is gathered as before. A region rerun inside the backward (activation-checkpoint
recomputation) drops them too: only the tensors it saves are used, never its outputs.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.weak import WeakIdKeyDictionary

from lightning_parallel.compat import in_backward
from lightning_parallel.parallel.blocks import is_hf_model

_STATE = threading.local()


def _stack() -> list[bool]:
    if not hasattr(_STATE, "requested"):
        _STATE.requested = []
    return _STATE.requested


def _asked(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The call's ``output_attentions`` argument, by keyword or position, else None."""
    if "output_attentions" in kwargs or not args:
        return kwargs.get("output_attentions")
    try:
        return inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments.get("output_attentions")
    except TypeError:
        return None


def _push(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Resolve the flag as transformers does: the call's argument, else the enclosing model's
    (an outer model passes it down, or records the attentions with hooks of its own), else the config."""
    requested, stack = _asked(module, args, kwargs), _stack()
    if requested is None:
        requested = stack[-1] if stack else getattr(getattr(module, "config", None), "output_attentions", False)
    stack.append(bool(requested))


def _pop(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
    stack = _stack()
    if stack:
        stack.pop()


def track_requested_attentions(root: nn.Module) -> int:
    """Hook every Hugging Face model in ``root`` so regions know whether attentions are returned."""
    count = 0
    for module in root.modules():
        if is_hf_model(module) and not getattr(module, "_lp_tracks_attentions", False):
            module.register_forward_pre_hook(_push, with_kwargs=True)
            module.register_forward_hook(_pop, with_kwargs=True, always_call=True)
            module._lp_tracks_attentions = True  # type: ignore[assignment]
            count += 1
    return count


def _unrequested() -> bool:
    if in_backward():  # rerun inside the backward: its outputs are discarded
        return True
    stack = _stack()
    return bool(stack) and not stack[-1]


_SOFTMAX: frozenset[Callable[..., Any]] = frozenset({F.softmax, torch.softmax, Tensor.softmax})
# Calls that keep attention probabilities what they are: dtype casts, copies, dropout, and indexing (GPT-OSS
# returns ``probs[..., :-1]``, its probabilities less the attention sinks' column).
_KEEPS = frozenset({Tensor.to, Tensor.type_as, Tensor.float, Tensor.half, Tensor.bfloat16, Tensor.contiguous,
                    F.dropout, torch.dropout, Tensor.clone, Tensor.view_as, Tensor.__getitem__})
_TRACKED = _SOFTMAX | _KEEPS
_PROBABILITIES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # by identity: a tensor's == is elementwise


def mark_probabilities(func: Callable[..., Any], args: tuple, out: Any) -> None:
    """Remember ``out`` as attention probabilities if ``func`` made them (see the module doc).
    Runs on every call of a region: one set lookup for all other calls."""
    if func not in _TRACKED or not isinstance(out, DTensor):
        return
    if func in _SOFTMAX or (args and isinstance(args[0], DTensor) and args[0] in _PROBABILITIES):
        _PROBABILITIES[out] = True


def head_split_probabilities(value: Any) -> bool:
    return (
        isinstance(value, DTensor) and value.ndim == 4 and value in _PROBABILITIES
        and any(isinstance(p, Shard) and p.dim == 1 for p in value.placements)
    )


def drop_unrequested_weights(out: Any) -> Any:
    """``out`` with its later head-split attention probabilities replaced by ``None`` when attentions
    are not returned."""
    if not isinstance(out, tuple) or len(out) < 2 or not any(head_split_probabilities(v) for v in out[1:]):
        return out
    if not _unrequested():
        return out
    return (out[0], *(None if head_split_probabilities(v) else v for v in out[1:]))


__all__ = ["drop_unrequested_weights", "head_split_probabilities", "mark_probabilities", "track_requested_attentions"]
