"""End-of-sweep reports that are written even when a job of the sweep failed.

Why this exists: Hydra calls ``on_multirun_end`` only when every job succeeded. Its basic
sweeper re-raises the first failed job's error once the batch of jobs has run, so the
callbacks that would write ``summary.md`` or ``compare.md`` - the tables that mark the failed
job - never run, and the sweep directory holds no summary exactly when one is needed.

So a :class:`SweepReport` registers itself when the sweep starts, and the app's entry point
(``python -m lightning_parallel.train``) calls :func:`finish_sweeps` when Hydra returns or
exits: the reports Hydra skipped are written then, and the entry point learns which sweeps
ran, to turn their FAILED jobs into a non-zero exit status.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

DEFAULT_SUMMARY_FILE = "results.json"

_pending: list[SweepReport] = []  # started, not yet written, in start order
_sweeps: dict[Path, str] = {}  # sweep directory -> the jobs' summary file name, for every sweep started


class SweepReport(Callback):
    """A Hydra callback that writes a report on the sweep directory after the sweep, failed or not."""

    _sweep_dir: Path | None = None
    _summary_file: str = DEFAULT_SUMMARY_FILE

    def report(self, sweep_dir: Path, summary_file: str) -> None:
        """Write (and print) the report; the jobs' results are ``<job dir>/<summary_file>``."""
        raise NotImplementedError

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._sweep_dir = Path(config.hydra.sweep.dir)
        self._summary_file = str(config.get("summary_file", DEFAULT_SUMMARY_FILE))
        _sweeps[self._sweep_dir] = self._summary_file
        _pending.append(self)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish()

    def _finish(self) -> None:
        if self in _pending:
            _pending.remove(self)
        if self._sweep_dir is not None and self._sweep_dir.is_dir():
            self.report(self._sweep_dir, self._summary_file)


def finish_sweeps() -> dict[Path, str]:
    """Write the reports that Hydra skipped (latest first, as Hydra runs ``on_multirun_end``) and
    return the sweeps this process ran: directory -> summary file name. Forgets them."""
    while _pending:
        report = _pending[-1]
        try:
            report._finish()  # leaves _pending first, so a report that raises is not retried
        except Exception as err:  # noqa: BLE001 - like Hydra: one report's failure must not hide the others
            print(f"[lightning_parallel] {type(report).__name__} failed: {type(err).__name__}: {err}", file=sys.stderr)
    sweeps = dict(_sweeps)
    _sweeps.clear()
    return sweeps
