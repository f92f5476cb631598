"""Route an unchanged Hugging Face model through context parallelism.

Three things in a ``transformers`` model assume it sees whole sequences, and each is routed
through the public extension points transformers offers, never by editing the model:

* **Attention.** The model's attention implementation is switched to one registered with
  ``AttentionInterface`` (every model written for it, i.e. every model that lets
  ``set_attn_implementation`` change its attention, calls it for sdpa and eager alike). It runs
  :mod:`~lightning_parallel.parallel.context.attention` over the whole sequence, with the
  layer's own causality (``module.is_causal``), sliding window (the ``sliding_window`` the layer
  passes) and the batch's padding. A model that cannot switch is refused. Outside a
  context-parallel step it is torch's SDPA with transformers' own SDPA mask.
* **Positions.** A model derives ``position_ids`` from the length it is given; the outermost
  model call gets the global positions of the rank's chunks instead (rotary and learned
  position embeddings alike), unless the caller passes its own.
* **The ``labels=`` loss.** A causal LM shifts ``labels`` by one inside ``forward``; on chunks
  that would pair each chunk's last token with the first of the next chunk *held by this rank*
  (not the next in the sequence) and lose the token at every boundary. The labels are gathered,
  shifted over the whole sequence and cut again, then given to the model as ``shift_labels``
  (transformers' own argument for pre-shifted labels) with ``num_items_in_batch`` set so each
  rank's loss is its share of the whole sequence's token mean (``step.global_value`` then makes
  the value the whole mean on every rank).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.parallel.context.step import ContextStep, active_step
from lightning_parallel.parallel.context.traced import traced_attention
from lightning_parallel.parallel.errors import config_error

ATTENTION = "lightning_parallel_context"
IGNORE_INDEX = -100  # transformers' (and F.cross_entropy's) ignored label


def _pretrained_models(module: nn.Module) -> list[nn.Module]:
    from transformers import PreTrainedModel

    return [m for m in module.modules() if isinstance(m, PreTrainedModel)]


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
               **kwargs: Any) -> tuple[Tensor, None]:
    """An ``AttentionInterface`` function: context-parallel inside a step, torch's SDPA outside."""
    step = active_step()
    if step is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    layer = type(module).__name__
    for name, unsupported in (("attention dropout", dropout), ("attention logit soft-capping", kwargs.get("softcap")),
                              ("attention sinks", kwargs.get("s_aux")), ("output_attentions", kwargs.get("output_attentions"))):
        if unsupported:
            raise config_error(
                ValueError, f"{layer} {name}", unsupported,
                "context-parallel attention does not implement it (the whole-sequence softmax is merged across ranks)",
                "set it off in the model's config (e.g. attention_dropout=0.0), or train without context_parallel_size",
            )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.size(-1) ** -0.5
    if step.pipelined:  # a traced stage: one opaque op, padding read at run time (traced.py)
        out = traced_attention(query, key, value, attention_mask, causal=bool(causal), window=kwargs.get("sliding_window"), scale=scale)
        return out.transpose(1, 2).contiguous(), None
    (q, k, v), heads_of = _local_heads(layer, query, key, value)
    out = step.attention(q, k, v, causal=bool(causal), window=kwargs.get("sliding_window"), scale=scale)
    return heads_of(out).transpose(1, 2).contiguous(), None


def _local_heads(layer: str, *tensors: Tensor) -> tuple[tuple[Tensor, ...], Callable[[Tensor], Tensor]]:
    """Under tensor parallelism q/k/v arrive as DTensors split along the heads (``parallel/tensor/
    attention.py``); heads are independent, so context-parallel attention runs on this rank's
    heads and the output goes back as the same head-split DTensor. Keys and values kept whole
    (one multi-query head) are replicated and used as they are."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    query = tensors[0]
    if not isinstance(query, DTensor):
        return tensors, lambda out: out
    for t in tensors:
        if not isinstance(t, DTensor) or tuple(t.placements) not in ((Shard(1),), (Replicate(),)):
            raise config_error(
                ValueError, f"{layer} attention inputs", [getattr(t, "placements", "plain tensor") for t in tensors],
                "context parallelism with tensor parallelism needs q/k/v split along the heads (or k/v whole)",
                "check the tensor-parallel plan of this attention (strategy.tensor_parallel_plan)",
            )
    mesh, placements = query.device_mesh, query.placements
    return tuple(t.to_local() for t in tensors), lambda out: DTensor.from_local(out, mesh, placements, run_check=False)


def _mask(*args: Any, **kwargs: Any) -> Any:
    """The mask builder paired with :func:`_attention`: none inside a step (masks are built from
    global positions there), transformers' SDPA mask outside. In a pipelined step the 2-D padding
    mask itself (or None): the traced attention op takes it as an input, so each microbatch's
    padding reaches its attention at run time."""
    step = active_step()
    if step is not None:
        return kwargs.get("attention_mask") if step.pipelined else None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _mask)


def _arguments(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name (positional ones included, ``**kwargs`` flattened)."""
    signature = inspect.signature(model.forward)
    bound = dict(signature.bind_partial(*args, **kwargs).arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in bound:
            bound.update(bound.pop(name))
    return bound


def _accepts_kwargs(model: nn.Module) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())


def _route_inputs(model: nn.Module, step: ContextStep, call: dict[str, Any]) -> dict[str, Any]:
    """Global positions, the global padding mask and globally shifted labels for the outermost call."""
    tokens = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
    if tokens is None or tokens.size(1) != step.layout.local_len:
        raise config_error(
            ValueError, f"{type(model).__name__} input length", None if tokens is None else tuple(tokens.shape),
            f"under context parallelism the model receives this rank's {step.layout.local_len} of"
            f" {step.layout.seq_len} tokens (the batch is cut by the strategy)",
            "pass input_ids (or inputs_embeds) taken from the batch the step received",
        )
    batch = tokens.size(0)
    if call.get("position_ids") is None:
        call["position_ids"] = step.layout.positions(device=tokens.device).unsqueeze(0).expand(batch, -1)
    mask = call.get("attention_mask")
    if isinstance(mask, Tensor) and mask.ndim != 2:
        raise config_error(
            ValueError, "attention_mask", tuple(mask.shape),
            "under context parallelism only a [batch, sequence] padding mask can be carried across chunks",
            "pass the tokenizer's 2-D attention_mask (causality and sliding windows come from the model itself)",
        )
    if step.pipelined:  # the padding reaches the traced attention op as an input; labels= on the last stage
        if isinstance(call.get("labels"), Tensor) and torch.compiler.is_exporting():
            raise config_error(
                ValueError, f"{type(model).__name__}(labels=...)", "inside the traced forward",
                "under pipeline x context parallelism a labels= loss must stay out of the pipeline's trace, so that it is"
                " computed on the last stage over labels shifted across the whole sequence",
                "call the model from training_step (self.model(..., labels=...)), or compute the loss from the logits",
            )
        return call
    step.key_valid = step.gather(mask).bool() if isinstance(mask, Tensor) else None  # this call's padding only
    return shift_labels_globally(model, step, call)


def shift_labels_globally(model: nn.Module, step: ContextStep, call: dict[str, Any]) -> dict[str, Any]:
    """A ``labels=`` call's keywords with the labels shifted over the whole sequence (see the module
    docstring); the pipeline's last stage calls it for each microbatch's loss."""
    labels = call.get("labels")
    if isinstance(labels, Tensor):
        for taken in ("shift_labels", "num_items_in_batch"):
            if call.get(taken) is not None:
                raise config_error(
                    ValueError, taken, "given", "under context parallelism the strategy shifts the labels over the whole"
                    " sequence and sets the token count itself", f"drop {taken}= and pass labels= alone",
                )
        if not _accepts_kwargs(model):
            raise config_error(
                ValueError, f"{type(model).__name__}(labels=...)", "labels",
                "its forward takes no **kwargs, so it cannot receive labels shifted over the whole sequence",
                "compute the loss from the logits against targets shifted in the dataset, or train without context_parallel_size",
            )
        whole = step.gather(labels)
        shifted = step.layout.split(F.pad(whole[:, 1:], (0, 1), value=IGNORE_INDEX), 1)
        count = step.all_reduce_sum((shifted != IGNORE_INDEX).sum()).clamp_min(1)
        call["shift_labels"] = shifted
        call["num_items_in_batch"] = count.to(torch.float32) / step.layout.cp
    return call


def _pre_hook(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    step = active_step()
    if step is None:
        return None
    if step.pipelined:  # no collectives, no nesting count: the pipeline probes calls it abandons midway
        return (), _route_inputs(model, step, _arguments(model, args, kwargs))
    step.depth += 1
    if step.depth > 1:  # an inner model called by the outer one: positions are passed down already
        return None
    return (), _route_inputs(model, step, _arguments(model, args, kwargs))


def _post_hook(model: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    step = active_step()
    if step is None or step.pipelined:
        return None
    step.depth -= 1
    loss = getattr(output, "loss", None)
    if step.depth == 0 and isinstance(loss, Tensor) and kwargs.get("shift_labels") is not None:
        output.loss = step.global_value(loss)
    return output


def routable_models(module: nn.Module, cp: int) -> list[nn.Module]:
    """The ``transformers`` models inside ``module`` context parallelism can route, or a typed error
    (pure inspection: the strategy calls it before any collective, and again when it routes)."""
    models = _pretrained_models(module)
    if not models:
        raise config_error(
            ValueError, "context_parallel_size", cp,
            f"context parallelism routes a Hugging Face model's attention, positions and labels= loss, and this"
            f" {type(module).__name__} holds no transformers PreTrainedModel",
            "wrap a transformers model in the LightningModule, or train without context_parallel_size",
        )
    for model in models:
        if "position_ids" not in inspect.signature(model.forward).parameters:
            raise config_error(
                ValueError, f"{type(model).__name__}.forward", "no position_ids argument",
                "context parallelism gives each rank the global positions of its chunks through position_ids; a model"
                " that derives positions from the length it is given would place every chunk at the start",
                "use a model whose forward takes position_ids, or train without context_parallel_size",
            )
    return models


def route_hf_models(module: nn.Module, cp: int) -> list[nn.Module]:
    """Switch every ``transformers`` model inside ``module`` to context-parallel attention and
    install the position/label hooks; return the models. A module holding none is an error."""
    models = routable_models(module, cp)
    _register()
    for model in models:
        model.set_attn_implementation(ATTENTION)
        if model.config._attn_implementation != ATTENTION:
            raise config_error(
                ValueError, f"{type(model).__name__} attention", model.config._attn_implementation,
                "its attention does not go through transformers' AttentionInterface, so it cannot run across chunks",
                "use a model written for the AttentionInterface, or train without context_parallel_size",
            )
        model.register_forward_pre_hook(_pre_hook, with_kwargs=True)
        model.register_forward_hook(_post_hook, with_kwargs=True)
    return models
