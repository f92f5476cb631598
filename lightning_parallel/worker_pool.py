"""Warm groups of worker processes that run many :func:`~lightning_parallel.launcher.run_distributed` calls.

Why: a spawned rank spends ~4 s importing torch and Lightning before it does anything, and the
test suite spawned hundreds of groups; start-up, not the work, was most of its time. Inside
:func:`pooled`, a call for ``N`` ranks goes to a group of ``N`` processes started once and reused.

What a reused process could carry from one task to the next is put back after each task: the
environment, the working directory, ``sys.path``, torch's process-wide settings (default dtype
and device, float32 matmul precision, deterministic mode, grad mode, anomaly mode, thread
count) and the process group (destroyed). A group that failed, timed out, lost a process or
grew past :data:`RSS_LIMIT_BYTES` is killed and replaced by a fresh one on the next call.
A call that measures the process itself (peak RSS since start) passes ``fresh_process=True``.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_parallel import launcher

RSS_LIMIT_BYTES = 3 * 2**30
"""A worker resident above this after a task is replaced (the allocator rarely returns memory)."""
PARENT_POLL_S = 5.0  # how often an idle worker checks that the process that started it is alive
DISABLE_ENV = "LP_FRESH_PROCESSES"
"""Set to 1 to make :func:`pooled` a no-op: every call spawns its own processes, as before."""


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _torch_settings() -> tuple[Any, ...]:
    import torch

    return (
        torch.get_default_dtype(),
        torch.get_default_device(),
        torch.get_float32_matmul_precision(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.is_grad_enabled(),
        torch.is_anomaly_enabled(),
        torch.get_num_threads(),
    )


class _ProcessState:
    """What a task may change process-wide, captured before it and restored after."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.sys_path = list(sys.path)
        self.torch = _torch_settings()

    def restore(self) -> None:
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.sys_path
        if self.torch != _torch_settings():  # each setter only when changed: set_default_device pushes a mode
            dtype, device, matmul, deterministic, warn_only, grad, anomaly, threads = self.torch
            torch.set_default_dtype(dtype)
            if torch.get_default_device() != device:
                torch.set_default_device(None if device.type == "cpu" else device)
            torch.set_float32_matmul_precision(matmul)
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
            torch.set_grad_enabled(grad)
            torch.autograd.set_detect_anomaly(anomaly)
            torch.set_num_threads(threads)
        gc.collect()


def _pool_worker(rank: int, world_size: int, tasks: Any, results: Any, parent_pid: int) -> None:
    """Run tasks for ``rank`` until told to stop (``None``) or the parent process is gone."""
    import torch

    torch.set_num_threads(1)
    while True:
        try:
            message = tasks.get(timeout=PARENT_POLL_S)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return
            continue
        if message is None:
            return
        task, port, payload = message
        state = _ProcessState()
        try:
            fn, args, init_backend, pg_timeout_s = pickle.loads(payload)
            ok, result = launcher.run_task(rank, world_size, port, fn, args, init_backend, pg_timeout_s)
        except BaseException:  # noqa: BLE001 - an unloadable task is this task's failure, not the worker's
            import traceback

            ok, result = False, traceback.format_exc()
        finally:
            state.restore()
        results.put((task, rank, ok, result, _resident_bytes()))


class _Group:
    """``world_size`` warm processes, one task queue each, one shared result queue."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        # Not daemonic: a task's Trainer or DataLoader may start processes of its own.
        self.procs = [
            ctx.Process(target=_pool_worker, args=(rank, world_size, self.tasks[rank], self.results, os.getpid()), daemon=False)
            for rank in range(world_size)
        ]
        for proc in self.procs:
            proc.start()

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def close(self, kill: bool) -> None:
        if not kill:
            for q in self.tasks:
                q.put(None)
            for proc in self.procs:
                proc.join(timeout=10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for q in (*self.tasks, self.results):
            q.close()
            q.cancel_join_thread()


class WorkerPool:
    """One warm :class:`_Group` per world size, reused by every call for that many ranks."""

    def __init__(self, rss_limit_bytes: int = RSS_LIMIT_BYTES) -> None:
        self.rss_limit_bytes = rss_limit_bytes
        self._groups: dict[int, _Group] = {}
        self._task = 0
        self.spawned = 0  # groups started, for the record
        self.tasks_run = 0

    def run(self, fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], *, init_backend: str | None, timeout: float) -> list[Any]:
        """Like :func:`~lightning_parallel.launcher.run_distributed`, on this pool's processes."""
        payload = pickle.dumps((fn, args, init_backend, launcher.pg_timeout_for(timeout)))  # unpicklable: fail here
        group = self._groups.get(world_size)
        if group is None or not group.alive():
            if group is not None:
                group.close(kill=True)
            group = self._groups[world_size] = _Group(world_size)
            self.spawned += 1
        self._task += 1
        self.tasks_run += 1
        port = launcher.free_port()
        for q in group.tasks:
            q.put((self._task, port, payload))
        try:
            outcomes, rss = launcher.collect(group.results, group.procs, world_size, timeout, self._task)
        except BaseException:
            self._discard(world_size)
            raise
        over_limit = any(r is not None and r > self.rss_limit_bytes for r in rss.values())
        if not launcher.succeeded(outcomes, world_size) or over_limit:
            self._discard(world_size)  # a failed task may leave peers stuck in a collective
        return launcher.results_or_raise(fn, world_size, timeout, outcomes)

    def _discard(self, world_size: int) -> None:
        group = self._groups.pop(world_size, None)
        if group is not None:
            group.close(kill=True)

    def close(self) -> None:
        for world_size in list(self._groups):
            group = self._groups.pop(world_size)
            group.close(kill=not group.alive())


@contextmanager
def pooled() -> Iterator[WorkerPool | None]:
    """Route :func:`~lightning_parallel.launcher.run_distributed` calls to a warm :class:`WorkerPool`.

    Yields ``None`` (and changes nothing) when ``LP_FRESH_PROCESSES=1`` is set."""
    if os.environ.get(DISABLE_ENV) == "1":
        yield None
        return
    previous, pool = launcher._POOL, WorkerPool()
    launcher._POOL = pool
    try:
        yield pool
    finally:
        launcher._POOL = previous
        pool.close()
