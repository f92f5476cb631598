"""Lightning's collectives for ``HybridParallelStrategy``: ``reduce`` and ``all_gather`` run over the
data-parallel group (tensor and pipeline peers hold the same values), decisions over the world.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor
from typing_extensions import override

from lightning_parallel.compat_lightning import (
    all_gather_ddp_if_available as _all_gather_ddp_if_available,
    distributed_is_initialized as _distributed_is_initialized,
    sync_ddp_if_available as _sync_ddp_if_available,
)


class CollectivesMixin:
    """``reduce``, ``all_gather``, ``barrier``, ``broadcast`` of ``HybridParallelStrategy``."""

    def _data_parallel_group(self) -> dist.ProcessGroup | None:
        """dp, or dp x cp under context parallelism (each cp rank's values cover its own chunks)."""
        if self._dims is None or self._dims._mesh is None or self._dims.grad_size == self._dims.world_size:
            return None
        return self._dims.axis(self._dims.grad_axis).get_group()

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce over the data-parallel group by default: tensor and pipeline peers hold the same value."""
        if not isinstance(tensor, Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group if group is not None else self._data_parallel_group(), reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather over the data-parallel group by default, like ``reduce``: tensor and pipeline peers
        hold the same value, so gathering over the world would repeat each sample tp x pp times."""
        return _all_gather_ddp_if_available(tensor, group=group if group is not None else self._data_parallel_group(),
                                            sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Count over the world: ``reduce`` sums over the data-parallel group only, so Lightning's
        default (sum == world size) would be False for every decision under tp or pp."""
        if not _distributed_is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag > 0)

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]
