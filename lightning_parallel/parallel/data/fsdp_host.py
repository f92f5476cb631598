"""FSDP2 on the CPU: no buffers kept for a stream overlap that the CPU does not have, none copied
or allocated again that can be avoided.

Why: FSDP2 keeps buffers alive past their use so that CUDA streams can overlap communication
with compute: the previous block's reduce-scatter input until the next block's reduce-scatter
(``reduce_scatter_max_input_buffers``, at least 1), and in forward the previous block's flat
all-gather output until the next block's copy-out ("implicit prefetching"). On the CPU its
streams are no-ops and it issues both collectives with ``async_op=False``, so the calling thread
waits for each one to finish: the buffers overlap nothing and only cost one block's worth of
memory each at the step's peak.

So, for modules whose FSDP2 compute device is the CPU (:func:`release_host_buffers`):

* the reduce-scatter goes through a custom comm (``FSDPModule.set_custom_reduce_scatter``) that
  frees its input's storage once the blocking reduce-scatter has returned; FSDP2 still holds
  the tensor object, now empty, until the next block's reduce-scatter;
* on gloo that reduce-scatter is an all-reduce of the input in place and a copy of this rank's
  chunk: gloo's own ``reduce_scatter_tensor`` clones its input and all-reduces the clone (torch's
  ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), one more unit-sized buffer per unit,
  faulted in afresh under the pinned mmap threshold. The input is FSDP2's copy of the gradients,
  discarded afterwards, so the clone protects nothing; the results are bitwise those of gloo's
  reduce-scatter (``tests/test_fsdp_host_buffers.py``);
* all-gathers are issued with ``async_op=True`` (``FSDPModule._set_unshard_async_op``): the
  copy-out then frees the flat output at once instead of keeping it for the next block, and the
  backward prefetch of the next block, which FSDP2 issues before the current block's backward,
  really runs on gloo's worker thread during that backward instead of blocking before it;
* their flat outputs come from a :class:`~lightning_parallel.parallel.data.host_buffers.HostBufferPool`
  (``FSDPModule.set_custom_all_gather``): the copy-out frees the buffer before the next unit's
  all-gather asks for one, so one buffer per unit size serves every unit, in both directions; on
  gloo they are filled in place by one broadcast per rank (:class:`PooledAllGather`), without
  gloo's own gather buffer.

Values are unchanged: the same reductions of the same tensors in the same order, and on gloo the
collectives that give bitwise gloo's own results (``tests/test_fsdp_host_buffers.py``). Measured on
the GPTs of ``benchmarks/bench_memory.py`` (4 CPU ranks, ZeRO-3): ``docs/memory.md``. CUDA keeps
FSDP2's defaults: there the buffers buy the overlap, and the caching allocator recycles them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from lightning_parallel.compat import FsdpDefaultAllGather, FsdpReduceScatter, set_fsdp_unshard_async
from lightning_parallel.parallel.data.host_buffers import HostBufferPool


class ReleasingReduceScatter(FsdpReduceScatter):
    """FSDP2's reduce-scatter (on gloo: the all-reduce it is made of, in place), then, when it
    blocked until done, its input's storage freed.

    FSDP2 allocates the input (the unsharded gradients, copied in) through :meth:`allocate`, calls
    this, and keeps a reference to the input only to stop a CUDA allocator from reusing it while
    the collective runs on another stream: after a blocking collective nothing reads it again."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        if async_op or not _is_gloo(group):
            # torch 2.13 renamed reduce_scatter_tensor (deprecated there) to reduce_scatter_single
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            work = reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        else:
            work = dist.all_reduce(input_tensor, op=op, group=group)
            output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()].view_as(output_tensor))
        if not async_op:
            input_tensor.untyped_storage().resize_(0)
        return work


class PooledAllGather(FsdpDefaultAllGather):
    """FSDP2's all-gather into a flat output taken from a :class:`HostBufferPool`; on gloo (up to
    :data:`BROADCAST_RANKS` ranks), one broadcast per rank straight into its chunk of that output.

    Why broadcasts: gloo's all-gather gathers into a flat buffer of its own, allocated for the call,
    and copies it out into the output: one more unit-sized fresh buffer per unit and direction. A
    rank's chunk of the output already holds its shard (FSDP2's copy-in puts the input there), so
    each rank broadcasting its chunk fills every chunk in place with the same bytes. N collectives of
    1/N of the unit each instead of one: their fixed cost grows with N, hence the bound."""

    def __init__(self, pool: HostBufferPool) -> None:
        self.pool = pool

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(int(s) for s in size)
        fresh = super().allocate  # FSDP2's own allocation, where a pooled buffer is not free
        return self.pool.take(numel, dtype, device, lambda: fresh((numel,), dtype=dtype, device=device)).view(*size)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False,
    ) -> dist.Work | None:
        if _is_gloo(group) and group.size() <= BROADCAST_RANKS:
            chunks = output_tensor.view(group.size(), -1)
            work = AllWorks([dist.broadcast(chunks[src], group=group, group_src=src, async_op=True)
                             for src in range(group.size())])
            if async_op:
                return work
            work.wait()
            return None
        return super().__call__(output_tensor, input_tensor, group, async_op)


BROADCAST_RANKS = 16
"""Largest gloo group whose all-gathers run as one broadcast per rank. Measured at 4 and 8 ranks
(``zero3``, 32 x 512 GPT, 8 ranks: step 12.4 s against 14.1 s with gloo's all-gather, 1.8 against 2.6
GB of fresh pages per rank and step); beyond 16 untested, so gloo's own all-gather runs there."""


class AllWorks(dist.Work):
    """Several collectives' works as one (what FSDP2 waits on): waits for each in turn."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self.works = works

    def wait(self, timeout: Any = None) -> bool:  # each work is bounded by its group's own timeout
        for work in self.works:
            work.wait()
        self.works = []  # their tensors are let go: the pooled buffer is free once FSDP2 copied out
        return True


def _is_gloo(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` runs CPU collectives on gloo. Read from the backend config ("cpu:gloo",
    "cpu:gloo,cuda:nccl"): ``get_backend`` answers "undefined" for groups split from the world."""
    return "cpu:gloo" in str(dist.get_backend_config(group))


def release_host_buffers(modules: Iterable[FSDPModule], device: torch.device) -> HostBufferPool | None:
    """Apply the CPU settings of the module docstring to every FSDP2 module of ``modules`` whose
    compute ``device`` is the CPU; a no-op elsewhere (CUDA keeps FSDP2's overlap). Returns the pool
    the modules' all-gathers share (one per model: its units share sizes), None where nothing changed."""
    if device.type != "cpu":
        return None
    pool = HostBufferPool()
    for module in modules:
        module.set_custom_reduce_scatter(ReleasingReduceScatter())
        module.set_custom_all_gather(PooledAllGather(pool))
        set_fsdp_unshard_async(module, True)
    return pool


__all__ = ["PooledAllGather", "ReleasingReduceScatter", "release_host_buffers"]
