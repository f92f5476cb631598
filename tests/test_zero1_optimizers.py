"""ZeRO-1 rebuilds the user's optimizer as a ZeroRedundancyOptimizer with the same groups and settings,
for every torch optimizer: AdamW's groups hold ``decoupled_weight_decay``, which its constructor
does not take (it failed with a TypeError), and a scheduler adds ``initial_lr``."""

from __future__ import annotations

from typing import Any

import torch

from lightning_parallel.testing import run_distributed


def _step_each() -> list[dict[str, Any]]:
    import torch.distributed as dist

    from lightning_parallel.parallel.data.zero1 import shard_optimizer_state

    out = []
    for name, make in (("adamw", lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
                       ("adam", lambda p: torch.optim.Adam(p, lr=1e-2)),
                       ("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        optimizer = make(model.parameters())
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)  # adds initial_lr to the groups
        reference = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        sharded = shard_optimizer_state(optimizer, dist.group.WORLD)
        model(torch.ones(2, 4)).sum().backward()
        sharded.step()
        settings = {k: v for k, v in sharded.param_groups[0].items() if k != "params"}
        out.append({"name": name, "same": settings == reference, "weight": model.weight.detach().clone()})
    return out


def test_zero1_takes_every_optimizer_with_its_settings() -> None:
    results = run_distributed(_step_each, 2, timeout=120)
    for rank0, rank1 in zip(*results):
        assert rank0["same"] and rank1["same"], rank0["name"]
        assert torch.equal(rank0["weight"], rank1["weight"]), rank0["name"]  # stepped and broadcast alike
