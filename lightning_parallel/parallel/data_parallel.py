"""Data parallelism: replicated (DDP) and sharded (FSDP2) over the data-parallel mesh axes.

How the ZeRO stages map onto torch (what each rank holds between steps, for P parameters,
N data-parallel ranks):

=====  ==========================================================  ===========================
stage  torch mechanism                                             held per rank
=====  ==========================================================  ===========================
0      ``DistributedDataParallel``: bucketed all-reduce of grads    params P, grads P, optim P
       overlapped with backward
1      DDP + ``ZeroRedundancyOptimizer``: grads all-reduced, each   params P, grads P, optim P/N
       rank updates its 1/N of the params and broadcasts them
2      FSDP2 ``fully_shard(reshard_after_forward=False)``: params   params P/N (+P during the
       gathered once per step and kept until backward, grads         step), grads P/N, optim P/N
       reduce-scattered
3      FSDP2 ``fully_shard(reshard_after_forward=True)``: params    params P/N (+1 block at a
       gathered per block in forward and again in backward          time), grads P/N, optim P/N
=====  ==========================================================  ===========================

ZeRO-2 on FSDP2 also shards the parameters at rest, which the original ZeRO-2 does not; it
never holds more than the original does. CPU offload (FSDP2 ``CPUOffloadPolicy``) keeps the
sharded params, grads and optimizer step on the CPU. HSDP is FSDP2 on a 2D
``(dp_replicate, dp_shard)`` mesh: shard within a node, all-reduce across nodes (the seeds'
topology-aware communication).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16": torch.bfloat16, "16": torch.float16}


def mixed_precision_dtype(mixed_precision: str | None) -> torch.dtype | None:
    """The compute dtype of a Lightning-style precision string ("bf16-mixed", ...), or None for fp32."""
    if mixed_precision in (None, "32", "32-true", "fp32"):
        return None
    return _DTYPES[mixed_precision]


def apply_ddp(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    bucket_cap_mb: float = 25.0,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
) -> DistributedDataParallel:
    """Wrap ``module`` in torch's DDP over the flattened data-parallel axis.

    Gradient buckets are all-reduced as soon as they fill during backward, overlapping
    communication with the rest of backward; ``gradient_as_bucket_view`` avoids a copy.
    """
    device = next(module.parameters()).device
    return DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=dp_mesh.get_group(),
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,
        find_unused_parameters=find_unused_parameters,
        static_graph=static_graph,
    )


def apply_fsdp(
    root: nn.Module,
    blocks: Sequence[nn.Module],
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    mixed_precision: str | None = None,
    cpu_offload: bool = False,
    own_meshes: Sequence[tuple[nn.Module, DeviceMesh]] = (),
) -> FSDPModule:
    """Shard ``blocks`` one FSDP2 unit each, then ``root`` (which takes the remaining params).

    ``dp_mesh`` is 1D (FSDP) or 2D ``(replicate, shard)`` (HSDP). Parameter names do not change.
    ``mixed_precision`` ("bf16-mixed", "16-mixed"): parameters are gathered and computed in that
    dtype, gradients reduced in fp32 and kept fp32 in the shards (fp32 master weights); the root
    does not cast its inputs. None: fp32 throughout, so parity with fp32 single-process training
    holds. ``own_meshes`` are modules sharded first on a mesh of their own: experts, whose
    gradients are averaged over the ``edp`` ranks only.
    """
    dtype = mixed_precision_dtype(mixed_precision)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    # The root's inputs are whatever it is called with (a strategy's step wrapper: the user's
    # batch): targets, masks and integer inputs are never cast; blocks cast their activations.
    root_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=mp_policy.reduce_dtype, cast_forward_inputs=False)
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for module, mesh in own_meshes:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, offload_policy=offload)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, offload_policy=offload)
    # The root's params are used first in forward and last in backward: never reshard them early.
    fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, mp_policy=root_policy, offload_policy=offload)
    assert isinstance(root, FSDPModule)
    return root


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]
