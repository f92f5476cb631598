"""Hydra callback: after a multirun, one table of every job's metrics (markdown and CSV).

A job that failed or wrote no results appears as ``FAILED``, so a partial sweep is never
presented as a complete one; a failed job's error is kept in ``<job dir>/error.txt`` and its
last line shown in the ``error`` column. The table is written even when a job failed (see
:mod:`lightning_parallel.app.sweep`). Jobs run with the parallelism monitor (the default
callbacks) also report throughput, memory per device and the communication share.
"""

from __future__ import annotations

import csv
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf

from lightning_parallel.app.sweep import SweepReport

COLUMNS = (
    "job", "overrides", "status", "world_size", "steps", "fit_seconds", "val_loss", "val_acc", "test_loss", "test_acc",
    "samples_per_s", "state_mb_per_device", "peak_mb_per_device", "comm_share", "error",
)
MB = 2**20
ERROR_FILE = "error.txt"
ERROR_CELL_CHARS = 200


def _choice(job_dir: Path, group: str) -> str | None:
    """The config-group option a job ran with (``strategy`` -> ``zero3``), from Hydra's record."""
    hydra_file = job_dir / ".hydra" / "hydra.yaml"
    if not hydra_file.exists():
        return None
    choices = OmegaConf.load(hydra_file).hydra.runtime.get("choices", {})
    value = choices.get(group)
    return str(value) if value is not None else None


def monitor_columns(monitor: dict[str, Any]) -> dict[str, Any]:
    """Per-device figures from the monitor's summary: the largest over ranks (what must fit)."""
    states = [r["total"] for r in monitor.get("state_bytes_per_rank") or []]
    peaks = monitor.get("peak_memory_bytes_per_rank") or []
    return {
        "samples_per_s": monitor.get("samples_per_s"),
        "tokens_per_s": monitor.get("tokens_per_s"),
        "step_ms": 1e3 * monitor["step_seconds"] if monitor.get("step_seconds") else None,
        "state_mb_per_device": max(states) / MB if states else None,
        "peak_mb_per_device": max(peaks) / MB if peaks else None,
        "peak_memory_kind": monitor.get("peak_memory_kind"),
        "comm_share": monitor.get("comm_share"),
    }


def _job_order(job_dir: Path) -> tuple[int, str]:
    """Hydra's job number first (``10_...`` after ``9_...``, not after ``1_...``), then the name."""
    number = job_dir.name.split("_", 1)[0]
    return (int(number) if number.isdigit() else 1 << 30, job_dir.name)


def _error_line(job_dir: Path) -> str | None:
    """A failed job's error in one line (the first line of its error file), short enough for a cell."""
    error_file = job_dir / ERROR_FILE
    if not error_file.exists():
        return None
    lines = error_file.read_text().splitlines()
    return (lines[0] if lines else "(empty error file)")[:ERROR_CELL_CHARS].replace("|", "/")


def error_summary(err: BaseException) -> str:
    """``Type: last line of the message`` of the innermost cause: Hydra wraps a constructor's
    ``ValueError`` in an ``InstantiationException`` whose own last line is only ``full_key: ...``."""
    while err.__cause__ is not None:
        err = err.__cause__
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"


def failed_jobs(sweep_dir: Path, summary_file: str = "results.json") -> tuple[int, int]:
    """(FAILED jobs, all jobs) of a sweep directory, as the summary counts them."""
    rows = collect_rows(sweep_dir, summary_file) if sweep_dir.is_dir() else []
    return sum(row["status"] != "ok" for row in rows), len(rows)


def collect_rows(sweep_dir: Path, summary_file: str = "results.json") -> list[dict[str, Any]]:
    rows = []
    for job_dir in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir()), key=_job_order):
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        overrides = overrides_file.read_text().replace("\n- ", " ").strip("- \n") if overrides_file.exists() else ""
        result_file = job_dir / summary_file
        row: dict[str, Any] = {"job": job_dir.name, "overrides": overrides, "status": "FAILED",
                               "strategy": _choice(job_dir, "strategy"), "error": _error_line(job_dir)}
        if result_file.exists():
            data = json.loads(result_file.read_text())
            fit, test = data.get("fit", {}), data.get("test", {})
            row.update(
                status="ok",
                world_size=data.get("world_size"),
                steps=data.get("global_step"),
                fit_seconds=round(data.get("fit_seconds", 0.0), 2),
                val_loss=fit.get("val_loss"),
                val_acc=fit.get("val_acc"),
                test_loss=test.get("test_loss"),
                test_acc=test.get("test_acc"),
                model=data.get("model"),
                layout=data.get("layout"),
            )
            if data.get("monitor"):
                row.update(monitor_columns(data["monitor"]))
        rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    """Rows as a markdown table, with a bold line under it when any row FAILED."""
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in columns) + " |" for row in rows]
    failed = sum(row["status"] != "ok" for row in rows)
    if failed:
        lines.append(f"\n**{failed} of {len(rows)} jobs FAILED: this sweep is incomplete.**")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_summary(sweep_dir: Path, rows: list[dict[str, Any]]) -> str:
    table = markdown_table(rows, COLUMNS)
    (sweep_dir / "summary.md").write_text(table + "\n")
    write_csv(sweep_dir / "summary.csv", rows, COLUMNS)
    return table


class SweepSummary(SweepReport):
    """Writes ``summary.md`` and ``summary.csv`` in the sweep directory and prints the table;
    records each failed job's error in its directory (in single runs too)."""

    def report(self, sweep_dir: Path, summary_file: str) -> None:
        print(write_summary(sweep_dir, collect_rows(sweep_dir, summary_file)))

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status != JobStatus.FAILED:
            return
        try:
            _ = job_return.return_value  # a failed job's value raises its exception
            return
        except Exception as err:  # noqa: BLE001 - any failure of the job is recorded
            short, text = error_summary(err), "".join(traceback.format_exception(err))
        job_dir = Path(config.hydra.runtime.output_dir)
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / ERROR_FILE).write_text(f"{short}\n\n{text}")  # first line: the summary's error cell
        print(f"[lightning_parallel] job {job_dir.name} FAILED: {short[:ERROR_CELL_CHARS]} "
              f"(full error: {job_dir / ERROR_FILE})", file=sys.stderr)
