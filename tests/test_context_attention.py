"""Context-parallel attention (parallel/context/attention.py) against one process's full attention.

Each rank holds its head-tail chunks of q, k, v; the output rows and the gradients of q, k, v
must equal the matching rows of ``F.scaled_dot_product_attention`` over the whole sequence,
for every form, grouped-query heads, left padding, a sliding window and no mask at all. The
all-gather form runs its chunk pairs through torch's CPU flash kernel and, with
``pairs.CPU_FLASH = False``, through the block math other devices use: both are checked, in
float64 and (the kernel's fp32 path, against the float64 reference) in float32.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_parallel.parallel.context import attention, pairs
from lightning_parallel.parallel.context.attention import context_attention, visibility
from lightning_parallel.parallel.context.chunks import ChunkLayout
from lightning_parallel.testing import run_distributed

# (label, causal, window, padding, kv_heads)
CASES = [
    ("causal", True, None, False, 4),
    ("causal gqa padding", True, None, True, 2),
    ("sliding window 5 gqa", True, 5, False, 2),
    ("sliding window 11 padding", True, 11, True, 4),
    ("bidirectional padding", False, None, True, 4),
]


def _inputs(seq: int, kv_heads: int, padding: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, seq, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, seq, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, kv_heads, seq, 8, generator=gen, dtype=torch.float64)
    valid = torch.ones(2, seq, dtype=torch.bool)
    if padding:
        valid[0, :3] = False  # left padding
        valid[1, :seq // 2 + 1] = False  # more than a whole chunk of padding
    return q, k, v, valid, torch.randn(2, 4, seq, 8, generator=gen, dtype=torch.float64)


def _reference(q, k, v, valid, grad, causal, window, padding):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    pos = torch.arange(q.size(2))
    mask = visibility(pos, pos, valid if padding else None, causal, window)
    rep = q.size(1) // k.size(1)
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _check_all(seq: int, tile_elements: int | None = None, flash: bool = True,
               dtype: torch.dtype = torch.float64) -> list[tuple[str, str, float]]:
    """Every case and form on this group; returns (case, form, worst relative error against the
    float64 reference). ``tile_elements``: the ring's (and the block math's) query tiles made small,
    so a block is computed in several tiles; ``flash``: the all-gather pairs on the CPU flash kernel."""
    if tile_elements is not None:
        attention.TILE_ELEMENTS = tile_elements
    pairs.CPU_FLASH = flash
    group, rank, cp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    layout = ChunkLayout(seq, cp, rank)
    results = []
    for label, causal, window, padding, kv_heads in CASES:
        q, k, v, valid, grad = _inputs(seq, kv_heads, padding)
        ref = _reference(q, k, v, valid, grad, causal, window, padding)
        for form in ("allgather", "ring", "ulysses"):
            lq, lk, lv = (layout.split(t, 2).to(dtype).requires_grad_() for t in (q, k, v))
            out = context_attention(form, lq, lk, lv, layout, group, key_valid=valid if padding else None,
                                    causal=causal, window=window, scale=8 ** -0.5)
            out.backward(layout.split(grad, 2).to(dtype))
            got = (out.detach(), lq.grad, lk.grad, lv.grad)
            worst = 0.0
            for mine, full in zip(got, ref):
                full = layout.split(full, 2)
                worst = max(worst, float((mine.double() - full).abs().max() / full.abs().max().clamp_min(1e-12)))
            results.append((label, form, worst))
    return results


@pytest.mark.parametrize("cp,tile_elements,flash", [(2, None, True), (2, 200, False), (4, None, True), (4, None, False)])
def test_context_attention_matches_full_attention(cp: int, tile_elements: int | None, flash: bool) -> None:
    for label, form, worst in run_distributed(_check_all, cp, 24, tile_elements, flash)[0]:
        assert worst < 1e-10, (f"{label} / {form} at cp{cp} (tiles of {tile_elements} scores, flash pairs {flash}): "
                               f"relative error {worst:.2e}")


def test_context_attention_float32_matches_float64_reference() -> None:
    """The CPU flash kernel's fp32 path (what training runs) for the all-gather pairs, outputs and
    q/k/v gradients, against full attention in float64."""
    for label, form, worst in run_distributed(_check_all, 2, 24, None, True, torch.float32)[0]:
        assert worst < 1e-5, f"{label} / {form} in float32 at cp2: relative error {worst:.2e}"


def test_chunk_layout_is_head_tail_balanced() -> None:
    layout = ChunkLayout(16, 2, 0)
    assert layout.positions().tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert layout.positions(1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = torch.arange(16)[None]
    gathered = torch.cat([ChunkLayout(16, 2, r).split(x, 1) for r in range(2)], dim=1)
    assert torch.equal(layout.restore(gathered, 1), x)
    # causal work per rank: pairs (i, j <= i) are equal under head-tail chunks
    pairs = [int(sum(p + 1 for p in ChunkLayout(64, 4, r).positions().tolist())) for r in range(4)]
    assert len(set(pairs)) == 1, pairs


def _ulysses_with_three_heads() -> str:
    layout = ChunkLayout(8, 2, dist.get_rank())
    q = torch.randn(1, 3, 4, 8)
    try:
        context_attention("ulysses", q, q, q, layout, dist.group.WORLD, key_valid=None, causal=True, window=None, scale=1.0)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_ulysses_needs_heads_the_group_divides() -> None:
    for message in run_distributed(_ulysses_with_three_heads, 2):
        assert "context_parallel_size=2 must divide them" in message and "HINT" in message, message
