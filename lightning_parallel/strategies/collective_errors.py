"""Bounded hangs with a useful message: what timed out, on which axis, waiting for which ranks.

A dead or stuck peer shows up on the other ranks as a collective that never completes. Two
things bound it and one explains it:

* **The bound.** Every group gets the strategy's ``timeout`` (default 1800 s; ``init_process_group``
  passes it on and ``DeviceMesh`` groups inherit it). On gloo, a blocked send/recv then raises.
  On NCCL the *watchdog* thread enforces it: with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (torch's
  default, set here if unset) it aborts the communicator and tears the process down instead of
  leaving the GPU kernel spinning; ``TORCH_NCCL_ENABLE_MONITORING=1`` adds the heartbeat
  monitor that kills a process whose watchdog itself is stuck (after
  ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``, 480 s by default); ``TORCH_NCCL_TRACE_BUFFER_SIZE``
  (set to 2000 here if unset) turns on the flight recorder, whose dump on timeout lists the
  last collectives of every group. :func:`nccl_watchdog_defaults` sets these before the group exists.
* **The message.** A timeout surfaces deep inside DDP, FSDP2, DTensor or a pipeline schedule,
  as gloo's "Timed out waiting 30000ms for recv operation" or NCCL's "Watchdog caught
  collective operation timeout: WorkNCCL(SeqNum=.., OpType=ALLREDUCE, ..)". :func:`explain_collective_errors`
  re-raises such an error as :class:`CollectiveTimeoutError` naming the phase of the step it
  happened in (forward, backward, optimizer step, checkpoint), the collective and the axis where
  the backend names them (NCCL's groups are named ``mesh_<axis>`` by ``DeviceMesh``), the ranks
  of every axis group this rank belongs to (one of them is the rank that died or hangs), and
  the timeout, with what to do.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Generator
from datetime import timedelta

import torch.distributed as dist

_NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # abort the communicator and tear down on a timeout
    "TORCH_NCCL_ENABLE_MONITORING": "1",  # heartbeat monitor: a stuck watchdog kills the process
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # flight recorder: the last collectives per group
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # ... dumped when a collective times out
}

# Messages of a collective that lost or waited too long for a peer (gloo and NCCL, torch 2.x).
_PATTERNS = (
    "Timed out waiting", "timed out", "Connection closed by peer", "Connection reset by peer",
    "Watchdog caught collective operation timeout", "NCCL communicator was aborted", "Broken pipe",
)


class CollectiveTimeoutError(RuntimeError):
    """A collective timed out or lost its peer; the message says where (see the module doc)."""


def nccl_watchdog_defaults(backend: str) -> dict[str, str]:
    """Set the NCCL watchdog variables the user has not set; return the ones set here."""
    if "nccl" not in backend:
        return {}
    applied = {key: value for key, value in _NCCL_DEFAULTS.items() if key not in os.environ}
    os.environ.update(applied)
    return applied


def _is_collective_failure(error: BaseException) -> bool:
    if isinstance(error, CollectiveTimeoutError):
        return False
    if isinstance(error, getattr(dist, "DistBackendError", ())) or isinstance(error, getattr(dist, "DistNetworkError", ())):
        return True
    return isinstance(error, RuntimeError) and any(p in str(error) for p in _PATTERNS)


def describe_groups(groups: dict[str, list[int]]) -> str:
    return ", ".join(f"{axis}={ranks}" for axis, ranks in groups.items() if len(ranks) > 1) or "none (1 process)"


def explain(error: BaseException, phase: str, rank: int, groups: dict[str, list[int]], timeout: timedelta) -> CollectiveTimeoutError:
    """The :class:`CollectiveTimeoutError` for ``error`` (see the module doc)."""
    text = str(error)
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    op = re.search(r"OpType=(\w+)", text)
    axis = re.search(r"\(mesh_(\w+)\)", text)
    where = f" ({op.group(1)}" if op else ""
    where += (f" on the {axis.group(1)} axis" if axis else "") + (")" if op else "")
    if axis and not op:
        where = f" (on the {axis.group(1)} axis)"
    return CollectiveTimeoutError(
        f"rank {rank}: a collective in the {phase}{where} timed out or lost a peer: {first}. This rank's groups"
        f" (the rank that died or hangs is in one of them): {describe_groups(groups)}. Collective timeout:"
        f" {timeout.total_seconds():.0f} s. HINT: read the log of the ranks listed for the first error (a crash,"
        " an OOM kill, or a rank that took another code path); raise HybridParallelStrategy(timeout=...) only if"
        " a slow step (first compile, a checkpoint on a slow file system) is expected to exceed it"
    )


@contextlib.contextmanager
def explain_collective_errors(phase: str, rank: int, groups: dict[str, list[int]] | None,
                              timeout: timedelta) -> Generator[None, None, None]:
    """Re-raise a collective's timeout or lost peer inside the block as :class:`CollectiveTimeoutError`."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised, typed, with the original chained
        if not _is_collective_failure(error):
            raise
        raise explain(error, phase, rank, groups or {}, timeout) from error
