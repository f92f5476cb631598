"""Test-wide settings: one intra-op thread (the machines have 2 cores, shared by spawned ranks),
and one pool of warm worker groups for the whole session (``lightning_parallel.worker_pool``:
spawned ranks are reused across tests instead of importing torch and Lightning again each time;
``LP_FRESH_PROCESSES=1`` turns it off)."""

from collections.abc import Iterator

import pytest
import torch

from lightning_parallel.worker_pool import WorkerPool, pooled

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def worker_pool() -> Iterator[WorkerPool | None]:
    with pooled() as pool:
        yield pool
    if pool is not None:
        print(f"\nworker pool: {pool.tasks_run} distributed runs on {pool.spawned} spawned groups")
