"""Host buffers handed out again instead of allocated again: FSDP2's per-unit all-gathers on the CPU.

Why: the strategy pins glibc's mmap threshold in its processes (``parallel/allocator.py``), so that
a freed buffer goes back to the system instead of staying resident, fragmented, in the heap (4.2x
the model per rank under ``zero3`` without it). The price is that every buffer above 128 KiB is a
fresh ``mmap`` whose pages fault in, zeroed, on first touch: about 2.5 GB/s against 28 GB/s for
recycled memory (one process, 1 MiB buffers). FSDP2 allocates each unit's flat all-gather output
once in forward and once in backward, the same few sizes for every unit of every step; on the
32-block GPT of ``benchmarks/bench_memory.py`` those alone are 0.8 GB of fresh pages per rank and
step. A caching allocator (the CUDA one) would recycle them; the CPU allocator has none.

:class:`HostBufferPool` is that cache for the buffers the strategy itself hands FSDP2 (through
``FSDPModule.set_custom_all_gather``'s ``allocate``): exact sizes, a few buffers per size. A buffer
is free again when nothing but the pool shares its storage: FSDP2 drops the all-gather result after
its copy-out, and gloo's work object holds the tensors while the collective runs, so a buffer still
being filled or read is never handed out. The pool keeps at most ``per_key`` buffers per size; a
request beyond them gets a fresh one that is not kept.

Memory: the pool keeps the buffers between uses, one unit's gathered parameters per distinct unit
size (12 MiB, 0.03x of the model, on that GPT). At the step's peak that buffer is in use anyway
(the next unit's prefetched all-gather), so the peak does not grow; measured in
``docs/memory.md``. Only buffers whose lifetime ends inside FSDP2's own unit loop belong here:
nothing that outlives the step (sharded gradients) and nothing that is idle while the step's peak
is reached (the reduce-scatter input is freed instead, ``fsdp_host.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_parallel.compat import storage_use_count


class HostBufferPool:
    """Flat buffers keyed by (numel, dtype, device), reused once only the pool refers to them."""

    def __init__(self, per_key: int = 2) -> None:
        self.per_key = per_key
        self._buffers: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._idle_count: dict[int, int] = {}  # id(buffer) -> use count when only the pool holds it
        self.fresh = 0  # buffers allocated (kept or not)
        self.reused = 0  # requests served by a kept buffer

    def take(self, numel: int, dtype: torch.dtype, device: torch.device,
             allocate: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """A flat buffer of ``numel`` elements, uninitialised: a kept one that nothing else holds,
        else a fresh one from ``allocate`` (default ``torch.empty``), kept while fewer than
        ``per_key`` of this size are."""
        held = self._buffers.setdefault((numel, dtype, torch.device(device)), [])
        for buffer in held:
            if storage_use_count(buffer) <= self._idle_count[id(buffer)]:
                self.reused += 1
                return buffer.view(numel)  # a tensor of its own: while it lives, the storage counts it
        buffer = (allocate() if allocate is not None else torch.empty(numel, dtype=dtype, device=device)).view(numel)
        self.fresh += 1
        if len(held) < self.per_key:
            held.append(buffer)
            self._idle_count[id(buffer)] = storage_use_count(buffer)
        return buffer.view(numel)

    def kept_bytes(self) -> int:
        """Bytes the pool keeps resident (in use or idle)."""
        return sum(b.numel() * b.element_size() for held in self._buffers.values() for b in held)

    def clear(self) -> None:
        """Drop every kept buffer (their memory goes back once their last user lets go)."""
        self._buffers.clear()
        self._idle_count.clear()


__all__ = ["HostBufferPool"]
