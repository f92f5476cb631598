"""Create the default process group, safely across torchrun restarts.

Why not Lightning's ``_init_dist_connection`` alone: under ``torchrun --max-restarts`` the
workers of every attempt join the elastic agent's own ``TCPStore``, at the same
``MASTER_PORT`` (measured with torch 2.13: attempt 0 and attempt 1 both get the agent's port,
``TORCHELASTIC_USE_AGENT_STORE=True``), and torch adds no per-attempt prefix (its comment says
a new store is made per retry; in standalone mode it is not). The keys the crashed attempt
wrote (each gloo rank's listening address, NCCL's unique id) are still there, so a restarted
rank can read its peer's *old* address before the peer has written the new one: gloo then
fails with "connectFullMesh ... Connection refused", or waits until the collective timeout.
Prefixing the store with ``TORCHELASTIC_RESTART_COUNT`` gives every attempt its own key space.
Outside torchelastic this is exactly Lightning's function.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_parallel.errors import config_error

from lightning_parallel.compat_lightning import (
    default_process_group_backend_for_device as _get_default_process_group_backend_for_device,
    destroy_dist_connection as _destroy_dist_connection,
    init_dist_connection as _init_dist_connection,
)


def restart_attempt() -> int | None:
    """torchrun's attempt number (0 for the first run), or None outside torchelastic."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(value) if value is not None and value.isdigit() else None


def init_process_group(cluster_environment: ClusterEnvironment, backend: str, timeout: timedelta) -> None:
    """The world's process group: Lightning's way, with a per-attempt store under torchelastic."""
    attempt = restart_attempt()
    if dist.is_initialized() or attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        _init_dist_connection(cluster_environment, backend, timeout=timeout)
        return
    rank, world_size = cluster_environment.global_rank(), cluster_environment.world_size()
    os.environ["MASTER_ADDR"] = cluster_environment.main_address
    os.environ["MASTER_PORT"] = str(cluster_environment.main_port)
    agent_store = dist.TCPStore(cluster_environment.main_address, cluster_environment.main_port, world_size,
                                is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"lightning_parallel/attempt_{attempt}", agent_store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    if "nccl" in backend:  # as Lightning: destroy NCCL groups at exit (torch warns otherwise)
        atexit.register(_destroy_dist_connection)
    rank_zero_info(f"distributed_backend={backend}: {world_size} processes, torchrun attempt {attempt}")


def default_backend(device: torch.device, cpu_offload: bool) -> str:
    """The backend for ``device`` when the user named none: gloo on CPU, nccl on CUDA, and on
    CUDA with ``cpu_offload`` both (``"cuda:nccl,cpu:gloo"``): offloaded gradients and optimizer
    state live on the CPU, and the global-norm clipping all-reduces their norms where they are
    (NCCL rejects CPU tensors). Mesh sub-groups inherit the pair."""
    if device.type == "cuda":
        return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"
    return _get_default_process_group_backend_for_device(device)


def backend_serves_cpu(backend: str) -> bool:
    """Whether a backend string (``"nccl"``, ``"gloo"``, ``"cuda:nccl,cpu:gloo"``) reduces CPU tensors."""
    backend = backend.lower()
    return "cpu:" in backend or backend in ("gloo", "mpi")


def check_backend(backend: str, device: torch.device, cpu_offload: bool) -> None:
    """Refuse, before the group exists, a backend that cannot reduce what the layout keeps on the
    CPU: with ``cpu_offload`` the sharded gradients live there and the global-norm clipping
    all-reduces their norms where they are; an NCCL-only group would fail at the first clipped step."""
    if cpu_offload and device.type != "cpu" and not backend_serves_cpu(backend):
        raise config_error(
            ValueError, "process_group_backend", backend,
            "cpu_offload=True keeps gradients on the CPU and their norms are all-reduced there, which this backend"
            " cannot do (NCCL rejects CPU tensors)",
            f'pass process_group_backend="{device.type}:nccl,cpu:gloo" or leave it unset (that pair is the default'
            " with cpu_offload)",
        )
