"""End to end, as a user runs them: the example script (Lightning's own launcher re-runs it per
rank) and the Hydra app's single run and 2-job multirun with 2-process strategies."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, timeout: int = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )


def test_quickstart_example_trains_under_zero3_with_lightning_launcher(tmp_path: Path) -> None:
    proc = _run([str(ROOT / "examples" / "quickstart.py"), "--strategy", "zero3", "--steps", "6"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: strategy=zero3 steps=6" in proc.stdout


@pytest.mark.slow
def test_hydra_multirun_two_jobs_and_summary(tmp_path: Path) -> None:
    proc = _run(
        ["-m", "lightning_parallel.train", "-m", "experiment=quick", "strategy=dp,zero3", "trainer.devices=2",
         "run_test=false", f"hydra.sweep.dir={tmp_path}/sweep", "callbacks=none", "logger=none"],
        ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "summary.csv")))
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert {r["world_size"] for r in rows} == {"2"}
    assert "strategy=dp" in rows[0]["overrides"] and "strategy=zero3" in rows[1]["overrides"]
    assert all(float(r["val_loss"]) > 0 for r in rows)
    assert (tmp_path / "sweep" / "summary.md").read_text().count("| ok |") == 2


def test_bad_strategy_option_fails_fast_with_a_clear_message(tmp_path: Path) -> None:
    proc = _run(["-m", "lightning_parallel.train", "strategy=zero3", "strategy.zero_stage=7",
                 f"hydra.run.dir={tmp_path}"], ROOT, timeout=120)
    assert proc.returncode != 0
    assert "`zero_stage`=7 is invalid" in proc.stderr
