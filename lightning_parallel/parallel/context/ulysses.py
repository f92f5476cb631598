"""Ulysses attention (DeepSpeed-Ulysses, Jacobs et al. 2023): trade the sequence split for a head split.

An all-to-all turns each rank's ``[heads, S / cp]`` slice into ``[heads / cp, S]``: every rank then
holds whole sequences for a group of heads, runs ordinary attention on them (heads are
independent), and a second all-to-all turns the output back into its sequence chunks. Two
all-to-alls per layer of ``(cp - 1) / cp`` of q, k, v and the output, against the ring's ``cp - 1``
key/value steps: less traffic at large ``cp``, but ``cp`` must divide the head count (key/value heads
that it does not divide are repeated first, as grouped-query attention would). The full sequence
runs in one SDPA call, so its memory is the kernel's; the gathered sequence is put in global order,
so a causal mask without padding or window is SDPA's own ``is_causal`` (no mask tensor at all).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_parallel.compat import functional_collectives
from lightning_parallel.parallel.context.chunks import ChunkLayout
from lightning_parallel.parallel.errors import config_error


def _heads_to_sequence(t: Tensor, cp: int, group: dist.ProcessGroup) -> Tensor:
    """``[B, H, S_local, D]`` (this rank's chunks, all heads) -> ``[B, H / cp, cp * S_local, D]``
    (this rank's head group, every rank's chunks in rank order)."""
    b, h, s, d = t.shape
    send = t.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # head group j goes to rank j
    got = functional_collectives.all_to_all_single_autograd(send, None, None, group)
    return got.view(cp, b, h // cp, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _sequence_to_heads(t: Tensor, cp: int, group: dist.ProcessGroup) -> Tensor:
    """The inverse of :func:`_heads_to_sequence`."""
    b, hg, full, d = t.shape
    s = full // cp
    send = t.view(b, hg, cp, s, d).permute(2, 0, 1, 3, 4).contiguous()  # rank j's chunks go back to rank j
    got = functional_collectives.all_to_all_single_autograd(send, None, None, group)
    return got.view(cp, b, hg, s, d).transpose(0, 1).reshape(b, cp * hg, s, d)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, layout: ChunkLayout, group: dist.ProcessGroup, *,
                      key_valid: Tensor | None, causal: bool, window: int | None, scale: float) -> Tensor:
    from lightning_parallel.parallel.context.attention import visibility

    cp, heads = layout.cp, q.size(1)
    if heads % cp:
        raise config_error(
            ValueError, "context_parallel_attention='ulysses'", f"{heads} attention heads (per tensor-parallel rank)",
            f"Ulysses splits the heads over the context-parallel ranks, so context_parallel_size={cp} must divide them",
            "use context_parallel_attention='allgather' or 'ring', or a context_parallel_size that divides the heads",
        )
    if k.size(1) % cp:  # grouped key/value heads cp does not divide: repeat them to one per query head
        k, v = (t.repeat_interleave(heads // t.size(1), dim=1) for t in (k, v))
    order = torch.argsort(layout.all_positions(q.device).flatten())  # rank order -> global order
    q, k, v = (_heads_to_sequence(t, cp, group).index_select(2, order) for t in (q, k, v))
    positions = torch.arange(layout.seq_len, device=q.device)
    plain_causal = causal and key_valid is None and window is None
    mask = None if plain_causal else visibility(positions, positions, key_valid, causal, window)
    rep = q.size(1) // k.size(1)
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1) if rep > 1 else k,
                                         v.repeat_interleave(rep, 1) if rep > 1 else v,
                                         attn_mask=mask, is_causal=plain_causal, scale=scale)
    back = torch.argsort(order)  # global order -> rank order
    return _sequence_to_heads(out.index_select(2, back), cp, group)
