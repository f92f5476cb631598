"""Forward inputs that a later stage reads reach it through the first stage; outputs that an
earlier stage computes leave through the last.

Only stage 0 receives the batch, and only the last stage's values leave the pipeline: torch's
stages feed the others with what earlier stages send. Encoder-decoders break both. T5 and BART
read ``decoder_input_ids`` (or ``labels``, shifted into them and compared with the logits for
their loss) in the decoder, and the encoder's ``attention_mask`` again in every cross-attention;
and they return the encoder's last hidden state beside the logits. So when the first trace shows
such a read or such an output (:class:`Routing`), the forward is traced again with copies: every
tensor input copied at the start of ``forward`` (computed in stage 0, so torch's split sends the
copy, like any value computed there, to each stage that reads it), and each early output copied at
its end (computed in the last stage, which receives the value as any later stage would). A model
that needs neither is traced once, unchanged.

The input copies are of the batch (token ids, masks, labels: a few KiB per microbatch) and carry no
gradient; the stages that do not read them neither receive nor send them. An early output is sent
to the last stage once per microbatch (an encoder's output usually is anyway: its cross-attention
reads it there).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import Tensor, fx, nn
from torch.distributed.pipelining import Pipe

from lightning_parallel.compat import tree_flatten, tree_leaves, tree_unflatten
from lightning_parallel.parallel.pipeline.foreign import restore_forwards


def cut_source(node: fx.Node) -> fx.Node:
    """The split graph's node that computes ``node`` (through the ``getitem`` of a stage's outputs)."""
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]  # type: ignore[assignment]
    return node


def _calls(pipe: Pipe) -> list[fx.Node]:
    return [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]


def late_inputs(pipe: Pipe) -> list[str]:
    """The forward inputs (placeholders of the split graph) that a stage after the first reads."""
    late: list[str] = []
    for node in _calls(pipe)[1:]:
        for arg in tree_leaves((node.args, node.kwargs)):
            if isinstance(arg, fx.Node) and (src := cut_source(arg)).op == "placeholder" and src.name not in late:
                late.append(src.name)
    return late


def early_outputs(pipe: Pipe) -> frozenset[int]:
    """Which of the forward's tensor outputs (in pytree order) are not computed by the last stage."""
    last = _calls(pipe)[-1]
    output = next(n for n in pipe.split_gm.graph.nodes if n.op == "output")
    values = [a for a in tree_leaves(output.args) if isinstance(a, fx.Node)]
    return frozenset(i for i, v in enumerate(values) if cut_source(v) is not last)


@dataclass(frozen=True)
class Routing:
    """What the traced forward copies: its tensor inputs (at its start, in stage 0) and the tensor
    outputs at ``outputs`` (pytree order; at its end, in the last stage)."""

    inputs: bool = False
    outputs: frozenset[int] = frozenset()

    @staticmethod
    def needed(pipe: Pipe) -> Routing:
        """What a trace that produced ``pipe`` should have copied, beside what it did."""
        return Routing(bool(late_inputs(pipe)), early_outputs(pipe))

    def __or__(self, other: Routing) -> Routing:
        return Routing(self.inputs or other.inputs, self.outputs | other.outputs)

    def __bool__(self) -> bool:
        return self.inputs or bool(self.outputs)


def _copied(value: Any, which: frozenset[int] | None = None) -> Any:
    """``value`` with its tensors copied (those at the tensor indices ``which``; all for None)."""
    leaves, spec = tree_flatten(value)
    tensors = [i for i, v in enumerate(leaves) if isinstance(v, Tensor)]
    for k, i in enumerate(tensors):
        if which is None or k in which:
            leaves[i] = leaves[i].clone()
    return tree_unflatten(leaves, spec)


@contextmanager
def routed(module: nn.Module, routing: Routing) -> Iterator[None]:
    """While tracing, ``module.forward`` copies what ``routing`` names (see the module doc)."""
    if not routing:
        yield
        return
    previous = module.__dict__.get("forward")
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if routing.inputs:
            args, kwargs = _copied((args, kwargs))
        out = inner(*args, **kwargs)
        return _copied(out, routing.outputs) if routing.outputs else out

    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        restore_forwards([(module, previous)])


__all__ = ["Routing", "cut_source", "early_outputs", "late_inputs", "routed"]
