"""Gradient clipping by the global norm, whatever the layout of the gradients.

``torch.nn.utils.clip_grad_norm_`` sees only what a rank holds. Under sharding each rank
holds a piece of each gradient (DTensor ``Shard``) and under pipeline parallelism each rank
holds whole gradients of some parameters only; clipping by the local norm then gives a
different model on every layout (a known bug in several frameworks). Here every rank
computes the same global norm: local squared sums are added over the mesh axes on which a
gradient is sharded, then over ``extra_groups`` (e.g. the pipeline axis, where parameters are
disjoint), and each gradient is scaled by the same factor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from lightning_parallel.compat import foreach_norm

_Group = dist.ProcessGroup | None


def _shard_groups(grad: DTensor) -> tuple[dist.ProcessGroup, ...]:
    """Groups of the mesh dims on which ``grad`` is split (FSDP2's ``_StridedShard`` included,
    which is not a ``Shard`` subclass in every torch release)."""
    mesh = grad.device_mesh
    return tuple(mesh.get_group(dim) for dim, placement in enumerate(grad.placements) if not placement.is_replicate())


def total_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    extra_groups: Iterable[_Group] = (),
    device: torch.device | None = None,
) -> torch.Tensor:
    """The norm of all gradients of ``parameters`` taken as one vector across every rank.

    A rank may hold no gradient (a pipeline stage of frozen layers) and still joins the
    reductions over ``extra_groups``: its zero is made where its peers' norms are, on the
    gradients' or else the parameters' device, or ``device`` when it holds no parameter at all
    (a CPU zero would reach NCCL; under ``cpu_offload`` the parameters are on the CPU and the
    group has a gloo backend for them)."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    inf = norm_type == float("inf")
    extra_groups = list(extra_groups)
    device = grads[0].device if grads else parameters[0].device if parameters else device
    if device is None:
        if extra_groups:
            raise ValueError("total_norm: this rank holds no parameter but reduces over extra_groups; pass device="
                             " (the device those process groups serve: the strategy's root device)")
        device = torch.device("cpu")  # nothing to reduce: a plain zero
    by_groups: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]] = {}  # local shards per sharding axes
    for grad in grads:
        groups: tuple[dist.ProcessGroup, ...] = ()
        local = grad
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):  # pending sums: reduce before the norm
                grad = grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])
            groups, local = _shard_groups(grad), grad.to_local()
        tensors = by_groups.setdefault(groups, [])
        if local.numel() > 0:  # an empty shard adds 0 (and the fused inf-norm refuses it)
            tensors.append(local.detach())
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    result = torch.zeros((), device=device)
    for groups, tensors in by_groups.items():
        value = torch.zeros((), device=device)
        if tensors:  # one fused pass (a kernel per device and dtype, not per tensor), in fp32 whatever the dtype
            norms = torch.stack([n.to(device) for n in foreach_norm(tensors, norm_type, torch.float32)])
            value = norms.max() if inf else (norms ** norm_type).sum()
        for group in groups:
            dist.all_reduce(value, op=op, group=group)
        result = torch.maximum(result, value) if inf else result + value
    for group in extra_groups:
        dist.all_reduce(result, op=op, group=group)
    return result if inf else result ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    extra_groups: Iterable[_Group] = (),
    device: torch.device | None = None,
) -> torch.Tensor:
    """Scale gradients in place so that their global norm is at most ``max_norm``; return the norm
    (``device``: see :func:`total_norm`)."""
    params = list(parameters)
    norm = total_norm(params, norm_type, extra_groups, device)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            grad.to_local().mul_(coef.to(grad.device))
        else:
            grad.mul_(coef.to(grad.device))
    return norm
