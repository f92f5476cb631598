"""Gradients grouped into buckets for an all-reduce, as DDP groups them.

Why not one flat copy of every gradient: that copy is as large as the gradients themselves, alive
beside them and the parameters while the reduction runs, and the CPU backend (gloo) allocates
scratch of the message's size on top; a bucket bounds both by its cap (DDP's ``bucket_cap_mb``,
25 MiB by default). Used where gradients are reduced outside DDP and FSDP2: pipeline stages with
replicated data parallelism (``strategies/pipeline/driver.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor


def gradient_buckets(grads: Iterable[Tensor], cap_bytes: int) -> Iterator[list[Tensor]]:
    """Consecutive runs of ``grads`` of one dtype and device holding at most ``cap_bytes`` together;
    a gradient of ``cap_bytes`` or more is a bucket of its own (reduced in place, not copied)."""
    bucket: list[Tensor] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        fits = size + nbytes <= cap_bytes
        if bucket and (not fits or grad.dtype != bucket[0].dtype or grad.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(grad)
        size += nbytes
    if bucket:
        yield bucket


__all__ = ["gradient_buckets"]
