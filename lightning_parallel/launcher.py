"""Run one function in N freshly spawned processes, the way torchrun would start them.

Used by the Hydra app (each multirun job starts its own ranks) and by every multi-process test.

Why not Lightning's launcher: it re-runs ``sys.argv`` (the pytest command line, or a Hydra
multirun), which cannot work inside a test runner. Why not ``torch.multiprocessing.spawn``:
it has no overall timeout, and a rank blocked in a collective keeps the test waiting forever.
Here every rank reports either its return value or its traceback, and after ``timeout``
seconds the stragglers are killed and the test fails with every rank's state.

Inside :func:`preloaded_workers` (the test session), ranks are forked from a server process that
imported torch, Lightning and this package once, instead of each spawned rank importing them
again (5-8 s of CPU per rank on the 2-core CI machine, most of the suite's start-up cost). Each
rank is still a new process: nothing one call runs is seen by the next, unlike a pool of reused
workers (an earlier attempt, whose carried-over state broke tensor-parallel parity).
``fresh_process=True`` keeps a call on spawned processes that imported nothing before.
"""

from __future__ import annotations

import codecs
import faulthandler
import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

DEFAULT_TIMEOUT_S = 300.0
FAILED_PEERS_GRACE_S = 15.0  # after one rank fails, how long its peers (often stuck in a collective) get to report
STDERR_TAIL_CHARS = 6000  # how much of a crashed or killed rank's own stderr its story quotes

_START_METHOD = "spawn"
"""How ranks start: ``spawn``, or ``forkserver`` inside :func:`preloaded_workers`."""


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

    # Trusted: the pickled return value of our own worker process, not a user's file.
    return torch.load(io.BytesIO(data), weights_only=False)


@contextmanager
def preloaded_workers(modules: Sequence[str]) -> Iterator[None]:
    """Inside this block, :func:`run_distributed` forks its ranks from a server that imported ``modules``.

    Why: importing torch and Lightning costs every spawned rank seconds of CPU before it does any
    work; the forkserver pays it once. Each rank is a fresh fork of that server (not a reused
    worker), gets the caller's environment, working directory and ``sys.path`` as a spawned rank
    does, and has touched no CUDA device (importing torch does not initialise CUDA). Modules that
    read the environment when imported see the server's: keep such settings out of ``modules``.
    The server lives until the calling process exits (multiprocessing starts it once)."""
    global _START_METHOD
    previous = _START_METHOD
    mp.get_context("forkserver").set_forkserver_preload(list(modules))
    _START_METHOD = "forkserver"
    try:
        yield
    finally:
        _START_METHOD = previous


def run_task(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    init_backend: str | None,
    pg_timeout_s: float,
    environment: dict[str, str],
) -> tuple[bool, bytes | str]:
    """Run ``fn(*args)`` as ``rank`` of ``world_size``: (True, pickled result) or (False, traceback).

    ``environment`` is the caller's ``os.environ``: a forked rank would otherwise see the
    forkserver's, taken when it started. The process group this creates (or ``fn`` creates, as a
    Trainer does) is destroyed before returning."""
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(worker_environment(rank, world_size, port))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if init_backend is not None:
            dist.init_process_group(init_backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
        try:
            value = fn(*args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return True, _dumps(value)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        return False, traceback.format_exc()


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], init_backend: str | None,
            pg_timeout_s: float, environment: dict[str, str], log_path: str, results: Any) -> None:
    with _stderr_kept_in(log_path):
        ok, payload = run_task(rank, world_size, port, fn, args, init_backend, pg_timeout_s, environment)
    results.put((rank, ok, payload))


@contextmanager
def _stderr_kept_in(log_path: str) -> Iterator[None]:
    """Send this rank's stderr (file descriptor 2: Python's and C++'s) to ``log_path``.

    Why: a rank that dies of a signal reports nothing, and what says why (a C++ ``terminate called
    ... what(): ...``, glibc's heap check, the Python stack ``faulthandler`` prints on SIGABRT or
    SIGSEGV) went to a stream shared with its peers, interleaved. A regular file keeps what was
    written even when the process dies; the parent relays it live (:class:`_StderrRelay`) and quotes
    its end in that rank's story. ``SIGUSR1`` dumps every thread's stack: the parent sends it to a
    rank it is about to kill for running out of time, so the story of a hang says where it waited."""
    sys.stderr.flush()
    with open(log_path, "ab", buffering=0) as log:
        os.dup2(log.fileno(), 2)
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    yield
    sys.stderr.flush()


class _StderrRelay(threading.Thread):
    """Copies what the ranks write to their stderr files onto this process's stderr, as it comes."""

    def __init__(self, paths: Sequence[str], interval_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.paths, self.interval_s = list(paths), interval_s
        self.offsets = [0] * len(self.paths)
        self.decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in self.paths]
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            self.relay()
        self.relay()

    def relay(self) -> None:
        for i, path in enumerate(self.paths):
            try:
                with open(path, "rb") as log:
                    log.seek(self.offsets[i])
                    data = log.read()
            except OSError:  # not created yet
                continue
            if data:
                self.offsets[i] += len(data)
                sys.stderr.write(self.decoders[i].decode(data))
                sys.stderr.flush()

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)


def _stderr_tail(log_path: str) -> str:
    try:
        with open(log_path, "rb") as log:
            text = log.read().decode(errors="replace")
    except OSError:
        return ""
    # faulthandler ends its report with every loaded extension module (one line, thousands of characters)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("Extension modules:"))
    return text[-STDERR_TAIL_CHARS:]


def collect(results: Any, procs: list[Any], world_size: int, timeout: float) -> dict[int, tuple[bool, Any]]:
    """Wait for ``world_size`` reports on ``results``: rank -> (ok, payload).

    Stops early when a rank died without reporting (killed, segfault) and, once one rank failed,
    gives its peers :data:`FAILED_PEERS_GRACE_S` to report."""
    deadline = time.monotonic() + timeout
    outcomes: dict[int, tuple[bool, Any]] = {}
    while len(outcomes) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in outcomes]
            # A rank that died without reporting: give the queue a moment.
            if dead and all(procs[r].exitcode not in (0, None) for r in dead):
                time.sleep(1.0)
                if results.empty():
                    for r in dead:
                        outcomes[r] = (False, f"process exited with code {procs[r].exitcode} without a result")
            continue
        outcomes[rank] = (ok, payload)
        if not ok:
            deadline = min(deadline, time.monotonic() + FAILED_PEERS_GRACE_S)
    return outcomes


def succeeded(outcomes: dict[int, tuple[bool, Any]], world_size: int) -> bool:
    return len(outcomes) == world_size and all(ok for ok, _ in outcomes.values())


def results_or_raise(fn: Callable[..., Any], world_size: int, timeout: float, outcomes: dict[int, tuple[bool, Any]],
                     logs: Sequence[str] = ()) -> list[Any]:
    """Every rank's return value, or a :class:`DistributedRunError` telling each rank's story.

    A rank that died without reporting, or was killed, is told by the end of its own stderr."""
    if succeeded(outcomes, world_size):
        return [_loads(outcomes[r][1]) for r in range(world_size)]
    lines = [f"distributed run of {getattr(fn, '__name__', fn)} on {world_size} ranks failed:"]
    for r in range(world_size):
        silent = r not in outcomes or not isinstance(outcomes[r][1], bytes) and "without a result" in outcomes[r][1]
        tail = _stderr_tail(logs[r]) if silent and r < len(logs) else ""
        if r not in outcomes:
            lines.append(f"--- rank {r}: no result within {timeout:.0f}s (killed)")
        elif not outcomes[r][0]:
            lines.append(f"--- rank {r} failed:\n{outcomes[r][1]}")
        else:
            lines.append(f"--- rank {r}: ok")
        if tail:
            lines.append(f"--- rank {r}'s stderr, last {len(tail)} characters:\n{tail}")
    raise DistributedRunError("\n".join(lines))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    init_backend: str | None = "gloo",
    timeout: float = DEFAULT_TIMEOUT_S,
    fresh_process: bool = False,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks and return the per-rank results.

    ``fn`` must be importable (a module-level function). With ``init_backend`` set, each rank
    joins a process group of that backend first (pure-torch tests); with ``None`` the function
    creates it itself (a Lightning ``Trainer`` does). Collectives time out a little before the
    run does, so a rank stuck in one fails with a traceback instead of being killed silently.
    ``fresh_process``: spawn, even inside :func:`preloaded_workers` (a measurement of the whole
    process, such as its peak RSS since start, must not include the forkserver's imports).
    """
    ctx = mp.get_context("spawn" if fresh_process else _START_METHOD)
    results = ctx.Queue()
    port = free_port()
    pg_timeout_s = pg_timeout_for(timeout)
    with tempfile.TemporaryDirectory(prefix="lp-ranks-") as logs_dir:
        logs = [os.path.join(logs_dir, f"rank{rank}.stderr") for rank in range(world_size)]
        procs = [
            ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, init_backend, pg_timeout_s, dict(os.environ),
                                              logs[rank], results), daemon=False)
            for rank in range(world_size)
        ]
        relay = _StderrRelay(logs)
        relay.start()
        for proc in procs:
            proc.start()
        started = time.monotonic()
        try:
            outcomes = collect(results, procs, world_size, timeout)
        finally:
            grace = max(0.0, min(5.0, started + timeout - time.monotonic()))
            for proc in procs:
                proc.join(timeout=grace)
            _stop(procs)
            relay.stop()
        return results_or_raise(fn, world_size, timeout, outcomes, logs)


def _stop(procs: list[Any]) -> None:
    """Kill the ranks still running, after asking each for its threads' stacks (``SIGUSR1``, see
    :func:`_stderr_kept_in`) so that the story of a hang says where it waited."""
    alive = [proc for proc in procs if proc.is_alive()]
    for proc in alive:
        os.kill(proc.pid, signal.SIGUSR1)
    if alive:
        time.sleep(1.0)
    for proc in alive:
        proc.kill()
        proc.join(timeout=5)


def pg_timeout_for(timeout: float) -> float:
    """Collectives time out a little before the run does, so a stuck rank reports a traceback."""
    return max(10.0, timeout * 0.8)
