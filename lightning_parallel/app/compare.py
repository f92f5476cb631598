"""The strategy comparison (the seeds' table): strategy, devices, samples/s, memory per device,
communication share - as markdown, CSV and a PNG bar chart.

Used by ``python -m lightning_parallel.train experiment=compare`` (a Hydra callback runs it
after the sweep) and callable on any finished sweep directory::

    python -m lightning_parallel.app.compare multirun/2025-01-01/12-00-00

Every figure comes from the jobs' own ``results.json`` (the parallelism monitor's summary); a
job without one is a ``FAILED`` row, the table says the sweep is incomplete, and the chart's
title says so too - a partial comparison is never presented as a complete one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lightning_parallel.app.summary import collect_rows, markdown_table, write_csv
from lightning_parallel.app.sweep import SweepReport

COLUMNS = (
    "strategy", "devices", "status", "samples_per_s", "tokens_per_s", "step_ms", "state_mb_per_device",
    "peak_mb_per_device", "comm_share", "val_loss", "layout", "model",
)
CHARTS = (
    ("samples_per_s", "samples / s (global)"),
    ("state_mb_per_device", "model state per device (MiB)\nparams + grads + optimizer"),
    ("peak_mb_per_device", "peak memory per device (MiB)"),
    ("comm_share", "share of step time\nwaiting in collectives"),
)


def comparison_rows(sweep_dir: Path, summary_file: str = "results.json") -> list[dict[str, Any]]:
    rows = collect_rows(sweep_dir, summary_file)
    for row in rows:
        row["devices"] = row.get("world_size")
        row["strategy"] = row.get("strategy") or row["overrides"]
    return rows


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """One bar chart per figure, strategies on the x axis; a failed job is a labelled gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['strategy']}\n({r.get('devices') or '?'} dev)" for r in rows]
    fig, axes = plt.subplots(1, len(CHARTS), figsize=(4.2 * len(CHARTS), 4.2))
    for ax, (key, name) in zip(axes, CHARTS):
        values = [r.get(key) if r["status"] == "ok" and r.get(key) is not None else 0.0 for r in rows]
        bars = ax.bar(range(len(rows)), values, color=["tab:blue" if r["status"] == "ok" else "tab:red" for r in rows])
        for bar, row in zip(bars, rows):
            if row["status"] != "ok":
                ax.annotate("FAILED", (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom", color="tab:red", rotation=90)
            elif row.get(key) is None:
                ax.annotate("n/a", (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom", rotation=90)
        ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=8)
        ax.set_title(name, fontsize=10)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_comparison(sweep_dir: Path, summary_file: str = "results.json") -> str:
    """Write ``compare.md``, ``compare.csv`` and ``compare.png`` in ``sweep_dir``; return the markdown."""
    rows = comparison_rows(sweep_dir, summary_file)
    if not rows:
        raise FileNotFoundError(f"no Hydra job directories under {sweep_dir}. HINT: pass the sweep directory of a multirun")
    failed = sum(r["status"] != "ok" for r in rows)
    kinds = sorted({r["peak_memory_kind"] for r in rows if r.get("peak_memory_kind")})
    notes = [
        "",
        "samples/s: global (local batch x data-parallel replicas / step time of the slowest rank), after warm-up.",
        "state: parameters + gradients + optimizer state this rank holds (largest rank). "
        f"peak: {', '.join(kinds) or 'n/a'} (largest rank; CPU RSS includes the Python/torch runtime).",
        "comm share: host time blocked in collectives / step time, mean over ranks "
        "(DTensor tensor-parallel collectives are not counted: a lower bound for tp and 3d).",
    ]
    table = markdown_table(rows, COLUMNS) + "\n" + "\n".join(notes)
    (sweep_dir / "compare.md").write_text(table + "\n")
    write_csv(sweep_dir / "compare.csv", rows, COLUMNS)
    title = "strategy comparison" + (f" - INCOMPLETE: {failed} of {len(rows)} jobs FAILED" if failed else "")
    plot(rows, sweep_dir / "compare.png", title)
    return table


class CompareReport(SweepReport):
    """Hydra callback: after the sweep (also one with a failed job), write and print the comparison."""

    def report(self, sweep_dir: Path, summary_file: str) -> None:
        print(write_comparison(sweep_dir, summary_file))
        print(f"[lightning_parallel] comparison: {sweep_dir}/compare.md, compare.csv, compare.png")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m lightning_parallel.app.compare SWEEP_DIR")
    print(write_comparison(Path(sys.argv[1])))
