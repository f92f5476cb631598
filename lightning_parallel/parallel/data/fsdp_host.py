"""FSDP2 on the CPU: no buffers kept for a stream overlap that the CPU does not have.

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
* all-gathers are issued with ``async_op=True`` (``FSDPModule._set_unshard_async_op``): the
  copy-out then frees the flat output at once instead of keeping it for the next block, and the
  backward prefetch of the next block, which FSDP2 issues before the current block's backward,
  really runs on gloo's worker thread during that backward instead of blocking before it.

Values are unchanged (the same collectives on the same tensors, in the same order). Measured on
the 1 GiB GPT of ``benchmarks/bench_memory.py`` (4 CPU ranks, ZeRO-3): see README, "Models
larger than one device". CUDA keeps FSDP2's defaults: there the buffers buy the overlap.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from lightning_parallel.compat import FsdpReduceScatter, set_fsdp_unshard_async


class ReleasingReduceScatter(FsdpReduceScatter):
    """FSDP2's default reduce-scatter, then (when it blocked until done) its input's storage freed.

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
        # torch 2.13 renamed reduce_scatter_tensor (deprecated there) to reduce_scatter_single
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work = reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if not async_op:
            input_tensor.untyped_storage().resize_(0)
        return work


def release_host_buffers(modules: Iterable[FSDPModule], device: torch.device) -> int:
    """Apply the CPU settings of the module docstring to every FSDP2 module of ``modules`` whose
    compute ``device`` is the CPU; a no-op elsewhere (CUDA keeps FSDP2's overlap). Returns how many
    modules were changed."""
    if device.type != "cpu":
        return 0
    changed = 0
    for module in modules:
        module.set_custom_reduce_scatter(ReleasingReduceScatter())
        set_fsdp_unshard_async(module, True)
        changed += 1
    return changed


__all__ = ["ReleasingReduceScatter", "release_host_buffers"]
