"""Gradients reduced outside DDP and FSDP2 go in DDP-sized buckets (``parallel/data/buckets.py``)."""

from __future__ import annotations

import torch

from lightning_parallel.parallel.data.buckets import gradient_buckets


def test_buckets_hold_at_most_the_cap_keep_order_and_dtype_and_a_large_gradient_alone() -> None:
    small = [torch.zeros(10) for _ in range(5)]  # 40 bytes each
    large = torch.zeros(100)  # 400 bytes: over the cap
    half = torch.zeros(10, dtype=torch.bfloat16)
    grads = [*small[:3], large, *small[3:], half, small[0]]
    buckets = list(gradient_buckets(grads, cap_bytes=100))
    assert [len(b) for b in buckets] == [2, 1, 1, 2, 1, 1]
    assert [t for b in buckets for t in b] == grads  # every gradient once, in order
    assert buckets[2] == [large]
    for bucket in buckets:
        assert len({t.dtype for t in bucket}) == 1
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for t in bucket) <= 100
    assert list(gradient_buckets([], 100)) == []
