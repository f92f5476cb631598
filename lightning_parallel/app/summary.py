"""Hydra callback: after a multirun, one table of every job's metrics (markdown and CSV).

A job that failed or wrote no results appears as ``FAILED``, so a partial sweep is never
presented as a complete one.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

COLUMNS = ("job", "overrides", "status", "world_size", "steps", "fit_seconds", "val_loss", "val_acc", "test_loss", "test_acc")


def collect_rows(sweep_dir: Path, summary_file: str = "results.json") -> list[dict[str, Any]]:
    rows = []
    for job_dir in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir()):
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        overrides = overrides_file.read_text().replace("\n- ", " ").strip("- \n") if overrides_file.exists() else ""
        result_file = job_dir / summary_file
        row: dict[str, Any] = {"job": job_dir.name, "overrides": overrides, "status": "FAILED"}
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
            )
        rows.append(row)
    return rows


def write_summary(sweep_dir: Path, rows: list[dict[str, Any]]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v))

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in COLUMNS) + " |" for row in rows]
    failed = sum(row["status"] != "ok" for row in rows)
    if failed:
        lines.append(f"\n**{failed} of {len(rows)} jobs FAILED: this sweep is incomplete.**")
    table = "\n".join(lines)
    (sweep_dir / "summary.md").write_text(table + "\n")
    with open(sweep_dir / "summary.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return table


class SweepSummary(Callback):
    """Writes ``summary.md`` and ``summary.csv`` in the sweep directory and prints the table."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            print(write_summary(sweep_dir, collect_rows(sweep_dir, config.get("summary_file", "results.json"))))
