"""Test-wide settings: one intra-op thread (the machines have 2 cores, shared by spawned ranks).

``LP_WORKER_POOL=1`` runs the session's multi-process tests on warm reused worker groups
(``lightning_parallel.worker_pool``). It is off by default: a full pooled run had six parity
failures that fresh processes do not have (issue 25, still open), and it saved under two minutes."""

import os
from collections.abc import Iterator

import pytest
import torch

from lightning_parallel.worker_pool import WorkerPool, pooled

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def worker_pool() -> Iterator[WorkerPool | None]:
    if os.environ.get("LP_WORKER_POOL") != "1":
        yield None
        return
    with pooled() as pool:
        yield pool
    if pool is not None:
        print(f"\nworker pool: {pool.tasks_run} distributed runs on {pool.spawned} spawned groups")
