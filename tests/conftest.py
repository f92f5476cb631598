"""Test-wide settings: one intra-op thread (the machines have 2 cores, shared by spawned ranks), and
multi-process tests fork their ranks from a server that imported torch, Lightning, transformers
and this package once (``launcher.preloaded_workers``): each spawned rank used to spend 5-8 s of
CPU importing them. ``LP_SPAWN_WORKERS=1`` spawns every rank from scratch instead, and so does a
machine with a CUDA device: a forked rank cannot use a CUDA driver its parent initialised, and
whether importing these modules initialises it has not been checked on a GPU yet."""

import os
from collections.abc import Iterator

import pytest
import torch

from lightning_parallel.launcher import preloaded_workers

torch.set_num_threads(1)

PRELOADED = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor.parallel",
    "torch.export",
    "lightning.pytorch",
    "torchmetrics",
    "transformers",
    "lightning_parallel",
    "lightning_parallel.testing.parity",
)


@pytest.fixture(scope="session", autouse=True)
def preloaded_ranks() -> Iterator[None]:
    if os.environ.get("LP_SPAWN_WORKERS") == "1" or torch.cuda.is_available():
        yield
        return
    with preloaded_workers(PRELOADED):
        yield
