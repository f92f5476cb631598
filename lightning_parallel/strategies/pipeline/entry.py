"""Which call of a LightningModule's step the pipeline runs: ``self(...)`` or ``self.model(...)``.

Most people wrap a Hugging Face model as ``self.model = AutoModelForCausalLM...`` and write
``loss = self.model(input_ids=x, labels=x).loss`` in ``training_step``: the step never calls the
LightningModule's own ``forward``. The pipeline's *entry* is therefore the first model call a
step makes, found by the same probe that captures ``forward``'s inputs
(:func:`~lightning_parallel.strategies.pipeline.logs.probe_entry_inputs`): the
LightningModule's ``forward`` (entry ``""``) or the ``forward`` of one of its direct children.

For a child entry the LightningModule is still what gets traced and cut (so parameter names,
the stage plan and ``configure_optimizers`` stay as they are): while tracing, its ``forward``
is the child call, with the child's output flattened to its tensors (a ``ModelOutput`` is a
registered pytree). In the loss role the child's ``forward`` returns that output rebuilt from
the last stage's tensors. Three Hugging Face conventions are handled here, each because the
trace could not carry it:

* ``labels=`` (the loss inside the model): a Hugging Face causal LM's loss would be computed on
  the last stage from a tensor only the first stage receives. Its labels are kept out of the trace
  and the loss is the model's own ``loss_function(logits, labels, vocab_size)`` on the last stage's
  logits, what the model's ``forward`` computes (``loss_type="ForCausalLM"``); under context
  parallelism the last stage's cp peers shift each microbatch's labels over the whole sequence
  first (``parallel/context/hf.py``), as the unpipelined model call does. Any other model (an
  encoder-decoder, whose labels also make its decoder inputs) keeps its labels in the trace: the
  tracer routes an input a later stage reads through stage 0
  (:mod:`~lightning_parallel.parallel.pipeline.route_inputs`), and the model computes its own loss
  on its last stage, per microbatch (averaged over them like any pipelined loss).
* ``use_cache`` (on by default): a ``DynamicCache`` built during training is never read (no
  earlier tokens), and it would leave the last stage as an output; every ``config.use_cache``
  under the module is off while tracing, and a ``use_cache=`` keyword is dropped, which changes
  no logit. (Hugging Face turns the cache off itself under gradient checkpointing.)
* ``output_router_logits`` (MoE aux loss inside the model): the router logits of every layer
  would have to reach the last stage; refused with a fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from lightning_parallel.compat import TreeSpec, tree_flatten, tree_unflatten
from lightning_parallel.parallel.context.hf import shift_labels_globally
from lightning_parallel.parallel.context.step import active_step
from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.pipeline.fork_trace import ship_back

LOSS_KWARGS = ("labels", "num_items_in_batch", "shift_labels")  # consumed by HF's loss_function, not the trace
DROPPED_KWARGS = ("use_cache",)


@dataclass
class Entry:
    """The module a step calls (``name``: ``""`` for the LightningModule's own ``forward``) and,
    once traced, the structure of that call's output (child entries)."""

    name: str
    spec: list[TreeSpec] = field(default_factory=list)  # set while tracing (a list: written by the traced forward)

    def module(self, root: nn.Module) -> nn.Module:
        return root.get_submodule(self.name) if self.name else root

    def describe(self) -> str:
        return "forward" if not self.name else f"self.{self.name}"


def split_kwargs(entry: Entry, root: nn.Module, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keywords of the captured call split into (traced, loss-side); checks what cannot be pipelined."""
    if not entry.name:
        return dict(kwargs), {}
    sub = entry.module(root)
    config = getattr(sub, "config", None)
    if any(kwargs.get(k) is not None for k in LOSS_KWARGS) and (kwargs.get("output_router_logits") or getattr(config, "output_router_logits", False)):
        raise config_error(
            ValueError, "output_router_logits", True,
            "the router auxiliary loss needs every layer's router logits on the last stage, but each stage holds only its own",
            "set config.output_router_logits=False (the MoE layers run as opaque ops; use the strategy's moe_aux_loss_coef "
            "for balancing), or use a strategy without pipeline parallelism",
        )
    if not is_hf_causal_lm(sub):  # the model computes its loss in its last stage, from labels routed there (route_inputs.py)
        return {k: v for k, v in kwargs.items() if k not in DROPPED_KWARGS}, {}
    traced = {k: v for k, v in kwargs.items() if k not in LOSS_KWARGS and k not in DROPPED_KWARGS}
    loss = {k: v for k, v in kwargs.items() if k in LOSS_KWARGS and v is not None}
    return traced, loss


def is_hf_causal_lm(module: nn.Module) -> bool:
    """A Hugging Face causal LM whose ``forward`` computes ``loss_function(logits, labels, vocab_size)``
    (``loss_type`` "ForCausalLM"; ``None`` for classes such as ``GPT2LMHeadModel``, where HF falls back to it)."""
    name = type(module).__name__
    return (
        callable(getattr(module, "loss_function", None))
        and getattr(module, "loss_type", None) in ("ForCausalLM", None)
        and (name.endswith("ForCausalLM") or name.endswith("LMHeadModel"))
    )


@contextmanager
def _no_cache(root: nn.Module) -> Iterator[None]:
    configs = {id(c): c for m in root.modules() if (c := getattr(m, "config", None)) is not None and getattr(c, "use_cache", None)}
    try:
        for c in configs.values():
            c.use_cache = False
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


@contextmanager
def tracing_forward(root: nn.Module, entry: Entry) -> Iterator[None]:
    """While tracing: no caches, and for a child entry ``root.forward`` is the child call, flattened."""
    with _no_cache(root):
        if not entry.name:
            yield
            return
        sub = entry.module(root)

        def forward(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
            leaves, spec = tree_flatten(sub(*args, **kwargs))
            entry.spec[:] = [spec]
            return tuple(leaves)

        previous = root.__dict__.get("forward")
        root.forward = forward  # type: ignore[method-assign]
        try:
            with ship_back(entry.spec):  # filled by the trace, which may run in a forked child
                yield
        finally:
            if previous is None:
                del root.forward
            else:
                root.forward = previous  # type: ignore[method-assign]


def rebuilt_output(root: nn.Module, entry: Entry, out: Any) -> Callable[..., Any]:
    """The entry's ``forward`` in the loss (or evaluation) role: the pipeline's ``out`` in the shape
    the entry returns, with the Hugging Face loss computed here when the step passed ``labels=``."""
    if not entry.name:
        return lambda *_, **__: out
    sub = entry.module(root)
    (spec,) = entry.spec
    leaves = list(out) if isinstance(out, (tuple, list)) else [out]
    if len(leaves) != spec.num_leaves:
        raise RuntimeError(f"the last stage returned {len(leaves)} tensors, the traced self.{entry.name} call {spec.num_leaves}")

    def forward(*_: Any, **kwargs: Any) -> Any:
        result = tree_unflatten(leaves, spec)
        _, loss_kwargs = split_kwargs(entry, root, kwargs)
        if loss_kwargs:
            logits = result["logits"] if isinstance(result, dict) else getattr(result, "logits", None)
            if not isinstance(logits, Tensor):
                raise config_error(ValueError, f"self.{entry.name}", type(result).__name__, "its output has no `logits` to compute the loss from", "return logits")
            step = active_step()
            if step is not None and isinstance(loss_kwargs.get("labels"), Tensor):  # context parallelism: see hf.py
                loss_kwargs = shift_labels_globally(sub, step, dict(loss_kwargs))
                result["loss"] = step.global_value(sub.loss_function(logits=logits, vocab_size=sub.config.vocab_size, **loss_kwargs))
            else:
                result["loss"] = sub.loss_function(logits=logits, vocab_size=sub.config.vocab_size, **loss_kwargs)
        return result

    return forward


def entry_mismatch_error(hook: str, entry: Entry, found: str) -> Exception:
    return config_error(
        ValueError, hook, f"calls {found}",
        f"the pipeline stages were traced from {entry.describe()}, the call the first step made; "
        "every step hook must call the same one",
        f"call {entry.describe()} in every step hook (training, validation, test, predict)",
    )
