"""Attention over the whole sequence when each rank holds only its chunks of it.

Queries stay local; every query needs the keys and values of every position it may see. Two
forms, chosen by ``context_parallel_attention``:

* ``"allgather"`` (Llama 3's form, Grattafiori et al. 2024, section 3.3.2): all-gather the keys
  and values of the group, then attention of the local queries over the whole sequence, run one
  (query chunk, key chunk) pair at a time and merged by log-sum-exp (``pairs.py``), so no
  sequence-sized mask is built. One collective per layer, exact; the gathered keys and values
  (``cp`` times the local ones) are what it costs in memory. Llama 3 chose it because keys and
  values are small under GQA and it handles any mask.
* ``"ring"`` (ring attention, Liu et al. 2023): keys and values travel around the group, one
  neighbour step at a time, while each rank attends to the block it holds; partial results are
  merged by their log-sum-exp (online softmax). Only two blocks live at once, the backward
  recomputes each block's probabilities from the saved log-sum-exp (the flash-attention
  backward) and sends each block's key/value gradients home along the same ring.
* ``"ulysses"`` (DeepSpeed-Ulysses): all-to-all from sequence chunks to head groups and back
  (``ulysses.py``), where ``cp`` divides the head count.

Masks are built from global positions, so causal, padding and sliding-window masks hold across
chunk boundaries: a query at global position ``i`` may see key ``j`` when ``j <= i`` (causal),
``i - j < window`` (sliding window, Hugging Face's convention) and key ``j`` is not padding.
A query that may see no key at all (a padding position under left padding) gets zeros, as
torch's SDPA gives since 2.5.

The block math is written in plain torch ops (no kernel-specific entry point), so the same code
runs on CPU (what the tests run) and CUDA; scores are computed in fp32 for fp32, bf16 and fp16 inputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.compat import functional_collectives
from lightning_parallel.parallel.context.chunks import ChunkLayout

FORMS = ("allgather", "ring", "ulysses")


def visibility(q_pos: Tensor, k_pos: Tensor, key_valid: Tensor | None, causal: bool, window: int | None) -> Tensor | None:
    """Boolean mask ``[B or 1, 1, Sq, Sk]`` (True = may attend), or None when every pair may."""
    mask = None
    if causal:
        mask = q_pos[:, None] >= k_pos[None, :]
    if window is not None:
        near = (q_pos[:, None] - k_pos[None, :]) < window
        mask = near if mask is None else mask & near
    if mask is not None:
        mask = mask[None, None]
    if key_valid is not None:
        valid = key_valid[:, k_pos][:, None, None, :]
        mask = valid if mask is None else mask & valid
    return mask


def _repeat_heads(t: Tensor, heads: int) -> Tensor:
    """Key/value heads repeated for grouped-query attention (head ``h`` reads kv head ``h // rep``)."""
    rep = heads // t.size(1)
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, layout: ChunkLayout, group: dist.ProcessGroup, *,
                        key_valid: Tensor | None, causal: bool, window: int | None, scale: float) -> Tensor:
    """Local queries over the all-gathered keys and values (autograd: the backward reduce-scatters
    their gradients home), one chunk pair at a time so no ``S/cp x S`` mask exists (``pairs.py``)."""
    from lightning_parallel.parallel.context.pairs import pair_attention  # pairs.py reuses this file's block math

    kv = functional_collectives.all_gather_single_autograd(torch.stack([k, v]).contiguous(), 3, group)
    keys, values = kv.unbind(0)
    # grouped-query heads read the gathered key/value heads in place (no repeated copies kept for backward)
    return pair_attention(q, keys, values, layout, key_valid=key_valid, causal=causal, window=window, scale=scale)


def _acc(t: Tensor) -> Tensor:
    """The accumulation dtype of the block math: fp32 for fp32/bf16/fp16 inputs, fp64 for fp64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    s = torch.matmul(_acc(q), _acc(k).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _probabilities(s: Tensor, lse: Tensor) -> Tensor:
    # exp(-inf - -inf) is NaN for a row that sees nothing in any block: such rows get zeros
    return torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)


def _merge(out: Tensor | None, lse: Tensor | None, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online softmax: two partial attentions over disjoint key sets combined by their log-sum-exp."""
    if out is None or lse is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    w_old = torch.exp(lse - new).nan_to_num_(0.0).unsqueeze(-1)
    w_new = torch.exp(block_lse - new).nan_to_num_(0.0).unsqueeze(-1)
    return out * w_old + block_out * w_new, new


# Scores held at once by one query tile of a ring block (2**20 elements: 4 MiB in fp32; three such
# tensors live together in the backward; 2**24 kept 192 MiB at any length, docs/context.md): the ring's
# transient memory stays bounded whatever the block length, as a flash kernel's tiles keep it.
TILE_ELEMENTS = 1 << 20


def _tiles(q: Tensor, k_len: int) -> list[slice]:
    rows = max(1, TILE_ELEMENTS // max(1, q.size(0) * q.size(1) * k_len))
    return [slice(i, min(i + rows, q.size(2))) for i in range(0, q.size(2), rows)]


def _rows(mask: Tensor | None, rows: slice) -> Tensor | None:
    return mask if mask is None or mask.size(2) == 1 else mask[:, :, rows]


def _block_forward(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` over one key block: its output and log-sum-exp, one query tile at a time."""
    outs, lses = [], []
    for rows in _tiles(q, keys.size(2)):
        s = _scores(q[:, :, rows], keys, _rows(mask, rows), scale)
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(_probabilities(s, lse), _acc(values)))
        lses.append(lse)
        del s
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _block_backward(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float, dout: Tensor,
                    delta: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one key block's share (flash-attention backward: probabilities recomputed from the
    whole sequence's log-sum-exp), one query tile at a time; key/value gradients per query head."""
    dq, dk, dv = [], torch.zeros_like(keys), torch.zeros_like(values)
    for rows in _tiles(q, keys.size(2)):
        p = _probabilities(_scores(q[:, :, rows], keys, _rows(mask, rows), scale), lse[:, :, rows])
        ds = p * (torch.matmul(dout[:, :, rows], values.transpose(-1, -2)) - delta[:, :, rows])
        dq.append(torch.matmul(ds, keys) * scale)
        dk += torch.matmul(ds.transpose(-1, -2), _acc(q[:, :, rows])) * scale
        dv += torch.matmul(p.transpose(-1, -2), dout[:, :, rows])
        del p, ds
    return torch.cat(dq, dim=2), dk, dv


class _Ring:
    """The neighbour exchange of one ring step: send to ``rank + 1``, receive from ``rank - 1``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, t: Tensor) -> tuple[list[Any], Tensor]:
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group), dist.P2POp(dist.irecv, buf, self.prev, self.group)]
        return dist.batch_isend_irecv(ops), buf

    @staticmethod
    def finish(requests: list[Any], buf: Tensor) -> Tensor:
        for request in requests:
            request.wait()
        return buf


class _RingAttention(torch.autograd.Function):
    """Ring attention with an explicit backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, layout: ChunkLayout, group: dist.ProcessGroup,
                key_valid: Tensor | None, causal: bool, window: int | None, scale: float) -> Tensor:
        ring, heads = _Ring(group), q.size(1)
        q_pos, k_pos = layout.positions(device=q.device), layout.all_positions(q.device)
        kv = torch.stack([k, v]).contiguous()
        out = lse = None
        for step in range(layout.cp):
            pending = ring.start(kv) if step < layout.cp - 1 else None  # the next block travels while this one computes
            mask = visibility(q_pos, k_pos[(layout.rank - step) % layout.cp], key_valid, causal, window)
            if mask is None or bool(mask.any()):
                block_out, block_lse = _block_forward(q, _repeat_heads(kv[0], heads), _repeat_heads(kv[1], heads), mask, scale)
                out, lse = _merge(out, lse, block_out, block_lse)
            if pending is not None:
                kv = _Ring.finish(*pending)
        if out is None or lse is None:  # no query sees any key (an all-padding batch)
            out = _acc(q.new_zeros(q.shape))
            lse = _acc(q.new_full(q.shape[:-1], float("-inf")))
        ctx.save_for_backward(q, k, v, out, lse, key_valid)
        ctx.layout, ctx.group, ctx.causal, ctx.window, ctx.scale = layout, group, causal, window, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, key_valid = ctx.saved_tensors
        layout: ChunkLayout = ctx.layout
        ring, heads = _Ring(ctx.group), q.size(1)
        q_pos, k_pos = layout.positions(device=q.device), layout.all_positions(q.device)
        dout = _acc(grad_out)
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(out)
        kv = torch.stack([k, v]).contiguous()
        dkv = _acc(torch.zeros_like(kv))  # travels with its block, back home at the end
        for step in range(layout.cp):
            pending = ring.start(kv) if step < layout.cp - 1 else None
            mask = visibility(q_pos, k_pos[(layout.rank - step) % layout.cp], key_valid, ctx.causal, ctx.window)
            if mask is None or bool(mask.any()):
                block_dq, block_dk, block_dv = _block_backward(
                    q, _acc(_repeat_heads(kv[0], heads)), _acc(_repeat_heads(kv[1], heads)), mask, ctx.scale, dout, delta, lse)
                dq += block_dq
                dkv[0] += _fold_heads(block_dk, kv.size(2))
                dkv[1] += _fold_heads(block_dv, kv.size(2))
            if pending is not None:  # the next key/value block arrived while this one's gradients were computed
                kv = _Ring.finish(*pending)
                dkv = _Ring.finish(*ring.start(dkv))
        if layout.cp > 1:
            dkv = _Ring.finish(*ring.start(dkv))  # the last hop: every block's gradient reaches its owner
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def _fold_heads(grad: Tensor, kv_heads: int) -> Tensor:
    """Sum the gradients of repeated query-head copies back onto their key/value head."""
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, layout: ChunkLayout, group: dist.ProcessGroup, *,
                   key_valid: Tensor | None, causal: bool, window: int | None, scale: float) -> Tensor:
    return _RingAttention.apply(q, k, v, layout, group, key_valid, causal, window, scale)


def context_attention(form: str, q: Tensor, k: Tensor, v: Tensor, layout: ChunkLayout, group: dist.ProcessGroup, *,
                      key_valid: Tensor | None, causal: bool, window: int | None, scale: float) -> Tensor:
    """``[B, H, S_local, D]`` attention output of the local queries over the whole sequence.

    ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention); ``key_valid`` is the
    global ``[B, S]`` padding mask (True = a real token) or None."""
    from lightning_parallel.parallel.context.ulysses import ulysses_attention

    fn = {"allgather": allgather_attention, "ring": ring_attention, "ulysses": ulysses_attention}[form]
    return fn(q, k, v, layout, group, key_valid=key_valid, causal=causal, window=window, scale=scale)
