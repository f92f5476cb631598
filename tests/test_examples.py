"""The examples a user copies, run as a user runs them, the comparison report, and the Hydra
app's bad input (unknown config option, unknown strategy option, degrees vs devices)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_parallel import PRESETS
from lightning_parallel.app.compare import write_comparison

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# Registered names that train the seed MLP on 2 processes (ep needs an MoE model).
SEED_STRATEGIES = [name for name in PRESETS if name != "ep"]
FAST: set[str] = set()  # zero3 runs in tests/test_examples_and_app.py, tp in the GPT example below


def run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


# The seed MLP (1000 -> 500 -> 100 -> 10, no block, no residual width) has no column/row pair the
# planner can prove; tensor parallelism used to leave all of it replicated, silently (0% sharded).
REFUSED = {"tp": r"tensor parallelism finds nothing to split in SeedModel.*HINT: .*tp_plan=",
           # context parallelism splits token sequences of a Hugging Face model; an MLP has neither
           "cp": r"this SeedModel holds no transformers PreTrainedModel.*HINT: "}


@pytest.mark.parametrize(
    "strategy", [s if s in FAST else pytest.param(s, marks=pytest.mark.slow) for s in SEED_STRATEGIES]
)
def test_seed_example_under_every_registered_strategy(tmp_path: Path, strategy: str) -> None:
    proc = run([str(EXAMPLES / "quickstart.py"), "--strategy", strategy, "--steps", "4"], tmp_path)
    if strategy in REFUSED:  # a clear error before any collective, never a run that splits nothing
        assert proc.returncode != 0 and re.search(REFUSED[strategy], proc.stderr), proc.stderr[-3000:]
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"done: strategy={strategy} steps=4" in proc.stdout


def test_gpt_example_tensor_parallel_with_zero3(tmp_path: Path) -> None:
    proc = run([str(EXAMPLES / "gpt_hybrid.py"), "--steps", "6"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: dp=1 tp=2 steps=6" in proc.stdout
    monitor = json.loads((tmp_path / "parallelism.json").read_text())
    assert monitor["tokens_per_s"] > 0 and monitor["data_parallel_replicas"] == 1


def test_cli_yaml_config_example(tmp_path: Path) -> None:
    proc = run(["-m", "lightning_parallel.cli", "fit", "--config", str(EXAMPLES / "cli_config.yaml"),
                "--trainer.max_steps=4", "--trainer.val_check_interval=2", "--trainer.enable_progress_bar=false"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = list((tmp_path / "lightning_logs").iterdir())
    assert json.loads((run_dir / "parallelism.json").read_text())["world_size"] == 2


def _fake_job(sweep: Path, name: str, strategy: str, results: dict | None) -> None:
    hydra_dir = sweep / name / ".hydra"
    hydra_dir.mkdir(parents=True)
    (hydra_dir / "overrides.yaml").write_text(f"- strategy={strategy}\n")
    (hydra_dir / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    choices:\n      strategy: {strategy}\n")
    if results is not None:
        (sweep / name / "results.json").write_text(json.dumps(results))


def test_comparison_marks_a_failed_job_and_never_looks_complete(tmp_path: Path) -> None:
    monitor = {"samples_per_s": 100.0, "tokens_per_s": None, "step_seconds": 0.08, "comm_share": 0.25,
               "state_bytes_per_rank": [{"total": 2 * 2**20}, {"total": 3 * 2**20}],
               "peak_memory_bytes_per_rank": [400 * 2**20, 410 * 2**20], "peak_memory_kind": "cpu_peak_rss"}
    _fake_job(tmp_path, "0_strategy=dp", "dp", {"fit": {"val_loss": 1.5}, "world_size": 2, "global_step": 8, "monitor": monitor})
    _fake_job(tmp_path, "1_strategy=zero3", "zero3", None)  # crashed before writing results
    table = write_comparison(tmp_path)
    assert "| dp | 2 | ok | 100 |" in table and "| zero3 |  | FAILED |" in table
    assert "1 of 2 jobs FAILED: this sweep is incomplete" in table
    rows = list(csv.DictReader(open(tmp_path / "compare.csv")))
    assert rows[0]["state_mb_per_device"] == "3.0" and rows[0]["comm_share"] == "0.25" and rows[1]["status"] == "FAILED"
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_comparison_rows_follow_the_job_numbers(tmp_path: Path) -> None:
    monitor = {"samples_per_s": 1.0, "step_seconds": 0.1, "state_bytes_per_rank": [{"total": 2**20}]}
    for number, strategy in ((10, "3d"), (2, "dp"), (1, "single")):
        _fake_job(tmp_path, f"{number}_strategy={strategy}", strategy,
                  {"fit": {}, "world_size": 1, "monitor": monitor, "model": "GPT", "layout": "tp2 pp2"})
    write_comparison(tmp_path)
    rows = list(csv.DictReader(open(tmp_path / "compare.csv")))
    assert [r["strategy"] for r in rows] == ["single", "dp", "3d"]  # job 10 last, not after job 1
    assert (rows[2]["layout"], rows[2]["model"]) == ("tp2 pp2", "GPT")


@pytest.mark.slow
def test_compare_experiment_sweep(tmp_path: Path) -> None:
    proc = run(["-m", "lightning_parallel.train", "experiment=compare", "strategy=single,dp,zero3,3d",
                "trainer.max_steps=6", "trainer.val_check_interval=6", f"hydra.sweep.dir={tmp_path}"], ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "compare.csv")))
    assert [(r["strategy"], r["devices"], r["status"]) for r in rows] == [
        ("single", "1", "ok"), ("dp", "2", "ok"), ("zero3", "2", "ok"), ("3d", "4", "ok")
    ]
    assert [(r["layout"], r["model"]) for r in rows[1:]] == [("dp2", "GPT"), ("dp2", "GPT"), ("tp2 pp2", "GPT")]
    assert float(rows[2]["state_mb_per_device"]) < float(rows[1]["state_mb_per_device"])
    assert float(rows[3]["state_mb_per_device"]) < float(rows[2]["state_mb_per_device"])  # split 4 ways vs 2
    assert rows[0]["comm_share"] == "" and 0 < float(rows[1]["comm_share"]) < 1
    assert (tmp_path / "compare.png").exists() and "FAILED" not in (tmp_path / "compare.md").read_text()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=zer3"], "Could not find 'strategy/zer3'"),
        (["strategy=zero3", "strategy.bucket=1"], "Key 'bucket' is not in struct"),
        (["strategy=tp", "strategy.tensor_parallel_size=3", "trainer.devices=2"], "must divide the world size 2"),
    ],
    ids=["unknown-config-option", "unknown-strategy-option", "degrees-vs-devices"],
)
def test_app_bad_input_fails_with_a_clear_message(tmp_path: Path, overrides: list[str], message: str) -> None:
    proc = run(["-m", "lightning_parallel.train", "experiment=quick", *overrides, f"hydra.run.dir={tmp_path}/run",
                "logger=none"], ROOT, timeout=200)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not (tmp_path / "run" / "results.json").exists()
