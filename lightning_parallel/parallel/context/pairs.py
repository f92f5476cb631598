"""The all-gather form's attention, one (query chunk, key chunk) pair at a time.

One attention call of the local queries over the gathered sequence needs a ``[S/cp x S]`` mask
(SDPA turns it into an fp32 tensor per layer and the CPU flash kernel keeps it for backward: more
than cp1's whole activation peak at 8K tokens, docs/context.md). The head-tail chunks make that
mask unnecessary: chunk boundaries are multiples of the chunk length, so under a causal mask a
(query chunk, key chunk) pair is either invisible (skipped), the diagonal (the kernel's own
``is_causal``) or fully visible (no mask). Only a pair that padding or a sliding window actually
cuts gets a ``chunk x chunk`` mask, built when the pair runs and dropped after it. Pair results are
merged by their log-sum-exp (the ring's online softmax), and the backward runs pair by pair with
the merged output and log-sum-exp (the flash-attention backward), so nothing S-sized but the
gathered keys and values is kept.

Each pair runs torch's CPU flash kernel where the tensors are on the CPU (it returns the
log-sum-exp, handles grouped-query heads and every float dtype); elsewhere, or with
``CPU_FLASH = False`` (the tests run both), the ring's plain-torch tiled block math
(fp32 accumulation for bf16/fp16).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_parallel.compat import flash_attention_ops
from lightning_parallel.parallel.context.attention import (
    _acc,
    _block_backward,
    _block_forward,
    _fold_heads,
    _merge,
    _repeat_heads,
    visibility,
)
from lightning_parallel.parallel.context.chunks import ChunkLayout

# The CUDA entry points (``_scaled_dot_product_flash_attention``/``_efficient_attention``) take no
# boolean mask or pad their log-sum-exp, and no GPU was at hand to check their backward with an
# external log-sum-exp; CUDA pairs run the block math until that is measured.
CPU_FLASH = True


@dataclass(frozen=True)
class Pair:
    """One key chunk that a query chunk sees: where it lies in the gathered keys, and how it is masked."""

    keys: slice  # rows of the gathered keys/values
    causal: bool  # the diagonal chunk under a causal mask and nothing else: the kernel's own is_causal
    mask: Tensor | None  # ``[B or 1, 1, chunk, chunk]`` True = may attend; only where padding or a window cuts


def _key_starts(layout: ChunkLayout) -> list[int]:
    """Global start of each chunk of the gathered keys, in gathered (rank) order."""
    return [cid * layout.chunk for r in range(layout.cp) for cid in layout.chunk_ids(r)]


def pairs(layout: ChunkLayout, q_slot: int, key_valid: Tensor | None, causal: bool, window: int | None,
          device: torch.device) -> Iterator[Pair]:
    """The key chunks that local query chunk ``q_slot`` (0: head, 1: tail) may see, masks built lazily
    so at most one lives at a time."""
    c = layout.chunk
    q0 = layout.chunk_ids(layout.rank)[q_slot] * c
    for slot, k0 in enumerate(_key_starts(layout)):
        lo, hi = q0 - k0 - (c - 1), q0 - k0 + (c - 1)  # range of query minus key position over the pair
        if (causal and hi < 0) or (window is not None and lo >= window):
            continue
        keys = slice(slot * c, (slot + 1) * c)
        valid = None if key_valid is None else key_valid[:, k0:k0 + c]
        if valid is not None and bool(valid.all()):
            valid = None
        if valid is None and not (window is not None and hi >= window):
            if not (causal and lo < 0):
                yield Pair(keys, False, None)
                continue
            if q0 == k0:
                yield Pair(keys, True, None)
                continue
        q_pos = torch.arange(q0, q0 + c, device=device)
        mask = visibility(q_pos, torch.arange(k0, k0 + c, device=device), key_valid, causal, window)
        if mask is not None and bool(mask.any()):
            yield Pair(keys, False, mask)


def _use_flash(q: Tensor) -> bool:
    return CPU_FLASH and q.device.type == "cpu"


def _bias(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The CPU flash kernel takes an additive mask of the query's dtype, not a boolean one."""
    return None if mask is None else torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _causal_mask(n: int, device: torch.device) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()[None, None]


def _pair_forward(q: Tensor, k: Tensor, v: Tensor, pair: Pair, scale: float) -> tuple[Tensor, Tensor]:
    """Output (accumulation dtype) and log-sum-exp of ``q`` over one key chunk."""
    if _use_flash(q):
        out, lse = flash_attention_ops("cpu")[0](
            q, k, v, 0.0, pair.causal, attn_mask=_bias(pair.mask, q.dtype), scale=scale)
        if pair.mask is not None:  # the kernel reports 0, not -inf, for a row that sees no key of this chunk
            lse = lse.masked_fill(~pair.mask.any(-1), float("-inf"))
        return _acc(out), lse
    mask = _causal_mask(q.size(2), q.device) if pair.causal else pair.mask
    heads = q.size(1)
    return _block_forward(q, _repeat_heads(k, heads), _repeat_heads(v, heads), mask, scale)


class _PairAttention(torch.autograd.Function):
    """Local queries over the gathered keys and values, pair by pair (module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, keys: Tensor, values: Tensor, layout: ChunkLayout, key_valid: Tensor | None,
                causal: bool, window: int | None, scale: float) -> Tensor:
        c, outs, lses = layout.chunk, [], []
        for q_slot in range(2):
            qc = q[:, :, q_slot * c:(q_slot + 1) * c]
            out = lse = None
            for pair in pairs(layout, q_slot, key_valid, causal, window, q.device):
                block_out, block_lse = _pair_forward(qc, keys[:, :, pair.keys], values[:, :, pair.keys], pair, scale)
                out, lse = _merge(out, lse, block_out, block_lse)
            if out is None or lse is None:  # this chunk's queries see no key at all (padding)
                out = _acc(qc.new_zeros(qc.shape))
                lse = _acc(qc.new_full(qc.shape[:-1], float("-inf")))
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, keys, values, out, lse, key_valid)
        ctx.layout, ctx.causal, ctx.window, ctx.scale = layout, causal, window, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, keys, values, out, lse, key_valid = ctx.saved_tensors
        layout: ChunkLayout = ctx.layout
        c, heads, flash = layout.chunk, q.size(1), _use_flash(q)
        dq, dkeys, dvalues = _acc(torch.zeros_like(q)), _acc(torch.zeros_like(keys)), _acc(torch.zeros_like(values))
        if flash:
            grad_out, out = grad_out.contiguous().to(q.dtype), out.to(q.dtype)
            # rows that see no key anywhere: every score of theirs is masked in every pair that runs,
            # so any finite log-sum-exp gives them zero probabilities (-inf would give exp(-inf + inf))
            lse = lse.masked_fill(lse == float("-inf"), 0.0)
        else:
            grad_out = _acc(grad_out)
            delta = (grad_out * out).sum(-1, keepdim=True)
        for q_slot in range(2):
            rows = slice(q_slot * c, (q_slot + 1) * c)
            qc = q[:, :, rows]
            for pair in pairs(layout, q_slot, key_valid, ctx.causal, ctx.window, q.device):
                k, v = keys[:, :, pair.keys], values[:, :, pair.keys]
                if flash:
                    dqp, dkp, dvp = flash_attention_ops("cpu")[1](
                        grad_out[:, :, rows], qc, k, v, out[:, :, rows], lse[:, :, rows], 0.0, pair.causal,
                        attn_mask=_bias(pair.mask, q.dtype), scale=ctx.scale)
                else:
                    mask = _causal_mask(c, q.device) if pair.causal else pair.mask
                    dqp, dkp, dvp = _block_backward(qc, _acc(_repeat_heads(k, heads)), _acc(_repeat_heads(v, heads)), mask,
                                                    ctx.scale, grad_out[:, :, rows], delta[:, :, rows], lse[:, :, rows])
                    dkp, dvp = _fold_heads(dkp, keys.size(1)), _fold_heads(dvp, keys.size(1))
                dq[:, :, rows] += dqp
                dkeys[:, :, pair.keys] += dkp
                dvalues[:, :, pair.keys] += dvp
        return dq.to(q.dtype), dkeys.to(keys.dtype), dvalues.to(values.dtype), None, None, None, None, None


def pair_attention(q: Tensor, keys: Tensor, values: Tensor, layout: ChunkLayout, *, key_valid: Tensor | None,
                   causal: bool, window: int | None, scale: float) -> Tensor:
    """``[B, H, 2 * chunk, D]``: the local queries over the gathered ``[B, H_kv, S, D]`` keys and values
    (in the all-gather's rank order), exact for causal, padding and sliding-window masks."""
    return _PairAttention.apply(q, keys, values, layout, key_valid, causal, window, scale)
