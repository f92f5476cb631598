"""ZeRO-1: optimizer-state sharding over replicated parameters.

torch's ``ZeroRedundancyOptimizer`` partitions the parameters among the data-parallel ranks;
each rank keeps optimizer state only for its partition, steps it, and broadcasts the updated
parameters. The user's optimizer (class, hyper-parameters, param groups) is rebuilt inside it,
so ``configure_optimizers`` stays as written.
"""

from __future__ import annotations

import inspect

import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer


def shard_optimizer_state(optimizer: Optimizer, group: dist.ProcessGroup) -> ZeroRedundancyOptimizer:
    """Rebuild ``optimizer`` as a ZeroRedundancyOptimizer over ``group`` (same groups and settings)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    groups = [dict(g) for g in optimizer.param_groups]
    for g in groups:
        g["params"] = list(g["params"])
    first, rest = groups[0], groups[1:]
    params = first.pop("params")
    # Only what the optimizer's constructor takes: a group also holds keys its constructor derives
    # (AdamW's ``decoupled_weight_decay``) or a scheduler added (``initial_lr``); set those after.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    ctor = {k: v for k, v in first.items() if takes_any or k in accepted}
    sharded = ZeroRedundancyOptimizer(params, optimizer_class=type(optimizer), process_group=group, **ctor)
    sharded.param_groups[0].update({k: v for k, v in first.items() if k not in ctor})
    for g in rest:
        sharded.add_param_group(g)
    return sharded


def full_optimizer_state(optimizer: ZeroRedundancyOptimizer) -> dict:
    """Gather every rank's partition of the state onto global rank 0 (a collective).

    Returns the full, index-keyed state dict on rank 0 and an empty dict elsewhere.
    """
    optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if dist.get_rank() == 0 else {}
