"""Context-parallel attention inside traced pipeline stages (pp x cp): one opaque op per attention call.

Why an op: a pipeline stage is cut from a ``torch.export`` trace, and the trace cannot hold what
context-parallel attention does at run time: collectives over the cp group (the all-gather of
keys and values, the ring's sends, Ulysses' all-to-all) and masks built from the batch's padding.
So while tracing, the routed Hugging Face attention (``hf.py``) records one call of
``lightning_parallel_cp::attention(q, k, v, key_mask, causal, window, scale)``, whose shape rule
is "queries' shape with the values' head dim". At run time the op's kernel runs
:func:`~lightning_parallel.parallel.context.attention.context_attention` eagerly on the step the
strategy activated, and its autograd graph is the output's graph (the kernel sits on the
``Autograd`` dispatch key, as the MoE op in ``parallel/pipeline/moe.py`` does).

What is read at run time, not fixed at trace time:

* **Padding.** ``key_mask`` is the microbatch's own 2-D padding mask, this rank's chunks (the
  mask builder paired with the routed attention hands it over instead of a 4-D mask); the kernel
  gathers it over the cp group, so every microbatch's keys are masked by its own rows.
* **The chunk layout, the group and the form** come from the active step (``ContextStep.attention``);
  the stage graph itself is the same on every cp rank but the positions it was traced with
  (``position_ids``, a graph input).

Causality, the sliding window and the scale are the layer's own constants, fixed in the trace.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_parallel.compat import FakeTensor
from lightning_parallel.parallel.context.step import active_step

_LIB = torch.library.Library("lightning_parallel_cp", "DEF")
_LIB.define("attention(Tensor q, Tensor k, Tensor v, Tensor? key_mask, bool causal, int? window, float scale) -> Tensor")


def _output_like(q: Tensor, v: Tensor) -> Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _run(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, causal: bool, window: int | None, scale: float) -> Tensor:
    """The op's kernel: the step's context-parallel attention (under the trace's fake tensors, the shape rule)."""
    if any(isinstance(x, FakeTensor) or x.is_meta for x in (q, k, v)):
        return _output_like(q, v)
    step = active_step()
    if step is None:
        raise RuntimeError("a traced context-parallel attention ran outside a context-parallel step (the strategy activates one per step)")
    if key_mask is None:
        return step.attention(q, k, v, causal=causal, window=window, scale=scale)
    key_valid = step.gather(key_mask.to(torch.int32)).bool()
    return step.attention(q, k, v, causal=causal, window=window, scale=scale, key_valid=key_valid)


def _shape_rule(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, causal: bool, window: int | None, scale: float) -> Tensor:
    return _output_like(q, v)


# Autograd key: the attention's own ops (and the ring's autograd Function) record the graph;
# CompositeExplicitAutograd: the same call where autograd is off (evaluation pipes under no_grad).
_LIB.impl("attention", _run, "Autograd")
_LIB.impl("attention", _run, "CompositeExplicitAutograd")
torch.library.register_fake("lightning_parallel_cp::attention", _shape_rule, lib=_LIB)
TRACED_ATTENTION = torch.ops.lightning_parallel_cp.attention.default


def traced_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, *, causal: bool, window: int | None,
                     scale: float) -> Tensor:
    """``[B, H, S_local, D]``: what a pipeline stage records for one attention call."""
    return TRACED_ATTENTION(q, k, v, key_mask, causal, window, float(scale))


def local_heads_attention(*args: Any) -> Tensor:
    """The op in a tensor-parallel stage, whose graph runs on DTensors split along the heads: heads
    are independent, so the op runs on this rank's heads and its output rejoins the graph as the
    query's head-split DTensor (the op itself has no sharding rule)."""
    from torch.distributed.tensor import DTensor

    q = args[0]
    if not isinstance(q, DTensor):
        return TRACED_ATTENTION(*args)
    local = [a.to_local() if isinstance(a, DTensor) else a for a in args]
    return DTensor.from_local(TRACED_ATTENTION(*local), q.device_mesh, q.placements, run_check=False)
