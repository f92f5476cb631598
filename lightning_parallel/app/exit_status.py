"""One exit status for the ranks that Lightning's launcher started from this process.

Why this exists: run from a shell with ``devices=N``, Lightning's subprocess launcher re-runs
the command for local ranks 1..N-1 and then forgets them. The launching process exits with
its own status only, so a rank that fails after rank 0 finished goes unnoticed (and may still
be printing after the shell prompt came back), and a rank that fails *first* leaves rank 0 with
a secondary error ("Connection closed by peer") whose long traceback, printed last, buries the
real one. Lightning kills its children only on Ctrl-C.

So the launching process (the CLI's rank 0) waits for the ranks it started and folds their exit
statuses into its own, and when rank 0 itself fails it tells its own error apart from the
consequence of another rank's: a rank that exits non-zero *on its own* within a short grace
period is a rank that failed; the others are still blocked in a collective and are stopped.

It takes the ranks over from Lightning's child-process observer (a thread that polls them every
5 s and SIGKILLs the launching process when one exited non-zero): the observer watches the
launcher's list of processes, which is emptied when this module takes them, so it cannot kill
the launching process halfway through its report.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_parallel.compat_lightning import SubprocessScriptLauncher as _SubprocessScriptLauncher

# Ranks finish the same work as rank 0; after rank 0 is done they only tear down. Generous.
FINISH_TIMEOUT_S = 300.0
# A rank that failed first is exiting while rank 0 reports the broken connection: seconds.
FAILED_RANK_GRACE_S = 3.0


def leave_launched_rank() -> None:
    """End a rank that another process launched (local rank > 0) once its command succeeded,
    without the interpreter's shutdown; the launching rank (local rank 0) returns as usual.

    Why: such a rank sometimes aborted at exit, after its run succeeded and its process groups were
    destroyed: "terminate called without an active exception", status -6, no Python frame left (a
    C++ thread still joinable when the process's static destructors run; pytorch#190489). Measured
    on this machine: 1 in 10 runs of ``lightning-parallel test`` on the CLI example (dp2, ZeRO-1),
    which the launching rank then rightly reports as a failed rank. Nothing of the rank's own is
    left to run at that point (the Trainer tore down: loggers finalised, checkpoints written and
    awaited), so it flushes its output and leaves with status 0. Only the console entry point calls
    this: a program calling ``main(args)`` itself keeps its process."""
    if os.environ.get("LOCAL_RANK", "0") in ("", "0"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


def take_launched_ranks(trainer: Any) -> dict[int, subprocess.Popen[Any]]:
    """Global rank -> process, for the ranks this process launched (empty under torchrun, SLURM,
    on the ranks themselves, and before the launcher ran). The launcher's list is emptied: from
    now on the caller, not Lightning's observer thread, watches these processes."""
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    if not isinstance(launcher, _SubprocessScriptLauncher):
        return {}
    first = int(trainer.node_rank) * int(trainer.num_devices)
    ranks = {first + local_rank: proc for local_rank, proc in enumerate(launcher.procs, start=1)}
    launcher.procs.clear()  # the observer holds this very list; empty, it stops
    return ranks


def _wait(proc: subprocess.Popen[Any], deadline: float) -> int | None:
    """The process's exit status, or None if it is still running at ``deadline`` (monotonic)."""
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _kill(proc: subprocess.Popen[Any]) -> None:
    # SIGKILL: a rank blocked in a collective does not react to SIGTERM (Lightning does the same).
    proc.kill()
    proc.wait()


def failures_after_success(
    ranks: dict[int, subprocess.Popen[Any]], this_rank: int, timeout: float = FINISH_TIMEOUT_S
) -> list[str]:
    """Wait for every launched rank after this one (``this_rank``) succeeded; one message per rank
    that did not exit 0 (a rank still running at the deadline is killed and reported)."""
    problems = []
    deadline = time.monotonic() + timeout
    for rank, proc in ranks.items():
        status = _wait(proc, deadline)
        if status is None:
            _kill(proc)
            problems.append(f"rank {rank} did not exit within {timeout:.0f}s after rank {this_rank} finished (killed)")
        elif status != 0:
            problems.append(f"rank {rank} exited with status {status} after rank {this_rank} finished (its error is above)")
    return problems


def stop_after_failure(ranks: dict[int, subprocess.Popen[Any]], grace: float = FAILED_RANK_GRACE_S) -> dict[int, int]:
    """After this rank failed: give each launched rank ``grace`` seconds to exit by itself, kill
    the rest, and return rank -> status of the ranks that exited non-zero on their own (the ranks
    that failed; empty when this rank's error came first)."""
    failed = {}
    deadline = time.monotonic() + grace
    for rank, proc in ranks.items():
        status = _wait(proc, deadline)
        if status is None:
            _kill(proc)
        elif status != 0:
            failed[rank] = status
    return failed


class RankExitStatus(Callback):
    """On the launching process, when the run fails: stop the launched ranks at once (before
    Lightning's teardown and its observer can interfere) and remember which ranks had failed on
    their own - ``failed_first``, rank -> exit status, empty when this rank's error came first."""

    def __init__(self) -> None:
        self.failed_first: dict[int, int] = {}

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.failed_first = stop_after_failure(take_launched_ranks(trainer))
