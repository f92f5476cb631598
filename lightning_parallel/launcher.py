"""Run one function in N freshly spawned processes, the way torchrun would start them.

Used by the Hydra app (each multirun job starts its own ranks) and by every multi-process test.

Why not Lightning's launcher: it re-runs ``sys.argv`` (the pytest command line, or a Hydra
multirun), which cannot work inside a test runner. Why not ``torch.multiprocessing.spawn``:
it has no overall timeout, and a rank blocked in a collective keeps the test waiting forever.
Here every rank reports either its return value or its traceback, and after ``timeout``
seconds the stragglers are killed and the test fails with every rank's state.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

DEFAULT_TIMEOUT_S = 300.0


class DistributedRunError(RuntimeError):
    """One or more ranks failed or did not finish in time; the message holds each rank's story."""


def free_port() -> int:
    """A TCP port that is free right now on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def worker_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets, so that Lightning sees externally created processes."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "NODE_RANK": "0",
        "GROUP_RANK": "0",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _dumps(obj: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    init_backend: str | None,
    pg_timeout_s: float,
    results: Any,
) -> None:
    os.environ.update(worker_environment(rank, world_size, port))
    try:
        import torch

        torch.set_num_threads(1)
        if init_backend is not None:
            import torch.distributed as dist

            dist.init_process_group(
                init_backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
            )
        try:
            value = fn(*args)
        finally:
            if init_backend is not None:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
        results.put((rank, True, _dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    init_backend: str | None = "gloo",
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks and return the per-rank results.

    ``fn`` must be importable (a module-level function). With ``init_backend`` set, each rank
    joins a process group of that backend first (pure-torch tests); with ``None`` the function
    creates it itself (a Lightning ``Trainer`` does). Collectives time out a little before the
    run does, so a rank stuck in one fails with a traceback instead of being killed silently.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    pg_timeout_s = max(10.0, timeout * 0.8)
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, fn, args, init_backend, pg_timeout_s, results),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in outcomes]
                # A rank that died without reporting (killed, segfault): give the queue a moment.
                if dead and all(procs[r].exitcode not in (0, None) for r in dead):
                    time.sleep(1.0)
                    if results.empty():
                        for r in dead:
                            outcomes[r] = (False, f"process exited with code {procs[r].exitcode} without a result")
                continue
            outcomes[rank] = (ok, payload)
            if not ok:
                # A failed rank usually leaves its peers blocked in a collective; wait briefly for them.
                deadline = min(deadline, time.monotonic() + 15.0)
    finally:
        for proc in procs:
            proc.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    if len(outcomes) == world_size and all(ok for ok, _ in outcomes.values()):
        return [_loads(outcomes[r][1]) for r in range(world_size)]
    lines = [f"distributed run of {getattr(fn, '__name__', fn)} on {world_size} ranks failed:"]
    for r in range(world_size):
        if r not in outcomes:
            lines.append(f"--- rank {r}: no result within {timeout:.0f}s (killed)")
        elif not outcomes[r][0]:
            lines.append(f"--- rank {r} failed:\n{outcomes[r][1]}")
        else:
            lines.append(f"--- rank {r}: ok")
    raise DistributedRunError("\n".join(lines))
