"""Context parallelism in the cost model: what splitting every sequence over ``cp`` ranks costs and saves.

A context-parallel rank holds ``1/cp`` of every sequence (``2 cp`` head-tail chunks, two per rank,
parallel/context/chunks.py), so everything :mod:`~lightning_parallel.planner.cost` prices per token
(block activations, logits, the matmul FLOPs, tensor-parallel all-reduces, pipeline sends) is priced
there at the local length ``s / cp``; attention FLOPs are ``12 (s / cp) s h`` per layer (local queries,
all keys), so they fall by ``cp`` too. Gradients are reduced, and ZeRO shards, over ``dp x cp``
(every cp rank computes different gradients of the same parameters). What remains, and lives here,
is what the exchange of keys and values adds, per block and microbatch, for the two forms of
parallel/context/attention.py. With ``T`` the rank's tokens of one microbatch (local length),
``kv = 2 h (a_kv / a) / t`` key and value elements per token per tensor-parallel rank and ``b``
bytes per element:

* ``"allgather"`` (Llama 3's form): forward all-gathers the group's keys and values, ``cp T kv b``
  bytes of which each rank receives ``(cp - 1) / cp``; backward reduce-scatters their gradients home
  (same size); neither overlaps the attention (it needs them). Memory: attention saves the gathered
  tensors for backward, ``(cp - 1) T kv b`` more per kept block than at ``cp = 1``, and the gradient
  of the gathered tensors lives at full length, ``cp T kv b``, while one block runs its backward.
* ``"ring"`` (pass-KV): ``cp - 1`` neighbour steps of the ``T kv b`` block. Forward sends the next
  block while this one is attended to (``4 T^2 h / t`` FLOPs), so only ``max(0, send - compute)``
  shows (times the profile's ``comm_overlap``); backward, as parallel/context/attention.py runs it,
  sends the next block while this one's gradients are computed (``8 T^2 h / t`` FLOPs, the same
  overlap) and each block's fp32 gradient after them (not overlapped), plus the last hop that
  brings every gradient home. Memory: the fp32 merged output and log-sum-exp
  kept for the flash-style backward (no ``s x s`` scores, whatever the kernel), and two blocks in
  flight with their fp32 gradients.

Under activation checkpointing the recomputed forward exchanges again.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_parallel.parallel.context.attention import FORMS  # ("allgather", "ring"): the strategy's default first
from lightning_parallel.planner.collectives import Link, collective_time, p2p_time
from lightning_parallel.planner.model import ModelFacts
ACC_BYTES = 4  # the ring's merged output and the gradients it sends are fp32 (its accumulation dtype)


def kv_elements(facts: ModelFacts, tp: int) -> float:
    """Key and value elements per token on one tensor-parallel rank (grouped-query: ``a_kv`` heads)."""
    return 2.0 * facts.hidden * facts.kv_heads / facts.heads / tp


@dataclass(frozen=True)
class ContextMemory:
    """Bytes context parallelism adds on a rank, beyond the activations priced at local length."""

    per_block: float  # each block whose activations are kept for backward
    transient: float  # while one block runs (its forward or its backward)


def context_memory(facts: ModelFacts, cp: int, form: str, local_tokens: float, tp: int, elem_bytes: int) -> ContextMemory:
    """What the K/V exchange keeps per block and what one running block holds (module docstring)."""
    if cp == 1:
        return ContextMemory(0.0, 0.0)
    kv = kv_elements(facts, tp) * local_tokens  # the rank's own keys and values of one microbatch
    if form == "allgather":
        return ContextMemory(per_block=(cp - 1) * kv * elem_bytes, transient=cp * kv * elem_bytes)
    saved = local_tokens * (facts.hidden / tp + facts.heads / tp) * ACC_BYTES  # fp32 output and log-sum-exp
    return ContextMemory(per_block=saved, transient=2 * kv * (elem_bytes + ACC_BYTES))


def context_comm_time(facts: ModelFacts, cp: int, form: str, local_tokens: float, tp: int, elem_bytes: int, link: Link,
                      flops_per_s: float, recompute: float = 0.0, overlap: float = 1.0,
                      gather_scale: float = 1.0, scatter_scale: float = 1.0) -> float:
    """Exposed seconds of one block's K/V exchange for one microbatch: forward, backward, and
    ``recompute`` (0-1: this block's share recomputed) forwards again (module docstring)."""
    if cp == 1:
        return 0.0
    kv_bytes = kv_elements(facts, tp) * local_tokens * elem_bytes
    if form == "allgather":
        gather = collective_time(cp * kv_bytes, cp, link, factor=1.0, scale=gather_scale)
        scatter = collective_time(cp * kv_bytes, cp, link, factor=1.0, scale=scatter_scale)
        return gather * (1.0 + recompute) + scatter
    block = 4.0 * local_tokens * local_tokens * facts.hidden / tp / flops_per_s  # local queries over one key block
    send = p2p_time(kv_bytes, link)
    forward = (cp - 1) * (send - min(send, block) * overlap)
    grad_bytes = kv_bytes / elem_bytes * ACC_BYTES
    hidden = send - min(send, 2.0 * block) * overlap  # the next block travels during this one's gradients
    backward = (cp - 1) * (hidden + p2p_time(grad_bytes, link)) + p2p_time(grad_bytes, link)
    return forward * (1.0 + recompute) + backward


__all__ = ["ACC_BYTES", "FORMS", "ContextMemory", "context_comm_time", "context_memory", "kv_elements"]
