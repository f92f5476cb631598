"""Exit status of the real entry points, run as a user, a scheduler or a CI job runs them: the
``lightning-parallel`` console script with 2 processes (Lightning's launcher re-runs it for rank
1) and ``python -m lightning_parallel.train`` (single run and multirun). 0 after success and
nothing printed after it; 1 when training fails on any rank, with the error last on stderr;
2 for a configuration error; a multirun with a failed job exits 1 after writing the summary."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import yaml

from lightning_parallel.app.exit_status import failures_after_success, stop_after_failure

ROOT = Path(__file__).resolve().parents[1]
CONSOLE_SCRIPT = Path(sys.executable).with_name("lightning-parallel")
SMALL = ["--trainer.max_steps=3", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1",
         "--trainer.limit_test_batches=1", "--trainer.limit_predict_batches=1", "--data.num_samples=256",
         "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
HYDRA_SMALL = ["model=seed_mlp", "data=synthetic_classification", "data.num_samples=256", "callbacks=none",
               "logger=none", "run_test=false", "trainer.max_steps=3", "trainer.val_check_interval=3",
               "trainer.limit_val_batches=1", "+trainer.enable_progress_bar=false"]
REPR = "LightningParallelCLI object"  # what `sys.exit(<the CLI object>)` printed (issue 18)


class FailOnRank(pl.Callback):
    """Raises in one rank's second training step: a failure on that rank only."""

    def __init__(self, rank: int = 1, step: int = 1) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"injected failure on rank {self.rank}")


def _run(command: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH: the ranks import FailOnRank from this module
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    assert CONSOLE_SCRIPT.is_file(), f"{CONSOLE_SCRIPT} missing: pip install -e '.[app]'"
    return _run([str(CONSOLE_SCRIPT), *args], cwd)


def hydra_app(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "lightning_parallel.train", *args], cwd)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _process(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", code])


def test_the_launching_rank_tells_failed_ranks_from_blocked_ones() -> None:
    """After rank 0 failed: a rank that exited non-zero by itself failed; one still running (blocked
    in a collective) is killed and not blamed; one that exited 0 is neither."""
    failed, done, blocked = _process("raise SystemExit(3)"), _process("pass"), _process("import time; time.sleep(120)")
    failed.wait(), done.wait()
    assert stop_after_failure({1: failed, 2: blocked, 3: done}, grace=1.0) == {1: 3}
    assert blocked.returncode is not None and blocked.returncode < 0  # killed, not left running


def test_the_launching_rank_reports_ranks_that_fail_after_it_succeeded() -> None:
    failed, done, hung = _process("raise SystemExit(3)"), _process("pass"), _process("import time; time.sleep(120)")
    failed.wait(), done.wait()
    assert failures_after_success({1: done, 2: failed, 3: hung}, this_rank=0, timeout=1.0) == [
        "rank 2 exited with status 3 after rank 0 finished (its error is above)",
        "rank 3 did not exit within 1s after rank 0 finished (killed)",
    ]
    assert hung.returncode is not None and hung.returncode < 0


def test_cli_print_config_file_fits_unchanged_then_validate_test_predict_exit_0(tmp_path: Path) -> None:
    # The example config, its strategy given as class + init args on the command line (dp2, ZeRO-1).
    strategy = ["--trainer.strategy=lightning_parallel.HybridParallelStrategy",
                "--trainer.strategy.data_parallel_size=2", "--trainer.strategy.zero_stage=1"]
    printed = cli(["fit", "--config", str(ROOT / "examples" / "cli_config.yaml"), *strategy, *SMALL, "--print_config"],
                  tmp_path)
    assert printed.returncode == 0, printed.stderr[-3000:]
    config_file = tmp_path / "printed.yaml"
    config_file.write_text(printed.stdout)
    assert yaml.safe_load(printed.stdout)["trainer"]["devices"] == 2

    fit = cli(["fit", "--config", str(config_file)], tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert REPR not in fit.stdout + fit.stderr
    (run_dir,) = list((tmp_path / "lightning_logs").iterdir())
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved == yaml.safe_load(printed.stdout)  # the file trained exactly as printed
    assert json.loads((run_dir / "parallelism.json").read_text())["data_parallel_replicas"] == 2
    (ckpt,) = list((run_dir / "checkpoints").iterdir())

    outputs = {}
    for subcommand in ("validate", "test", "predict"):
        proc = cli([subcommand, "--config", str(config_file), f"--ckpt_path={ckpt}"], tmp_path)
        assert proc.returncode == 0, f"{subcommand}: {proc.stderr[-3000:]}"
        assert REPR not in proc.stdout + proc.stderr
        outputs[subcommand] = proc.stdout
    assert "val_loss" in outputs["validate"] and "test_loss" in outputs["test"]


@pytest.mark.parametrize("rank", [1, 0], ids=["launched-rank", "launching-rank"])
def test_cli_fit_failing_on_one_rank_exits_1_with_the_error_last(tmp_path: Path, rank: int) -> None:
    proc = cli(["fit", "--config", str(ROOT / "examples" / "cli_config.yaml"), *SMALL,
                f"--trainer.callbacks+={__name__}.FailOnRank", f"--trainer.callbacks.rank={rank}"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"RuntimeError: injected failure on rank {rank}" in proc.stderr
    last = _last_line(proc.stderr)
    if rank == 0:  # its own error, as a traceback; the other rank was stopped quietly
        assert last.endswith(f"RuntimeError: injected failure on rank {rank}"), proc.stderr[-3000:]
        assert "Connection closed" not in proc.stderr
    else:  # rank 1's traceback, then one line instead of rank 0's consequential traceback
        assert last.startswith("lightning-parallel: error: rank 1 exited with status 1"), proc.stderr[-3000:]
        assert proc.stderr.count("Traceback (most recent call last)") == 1
    assert REPR not in proc.stdout + proc.stderr


def test_hydra_single_run_config_error_exits_2(tmp_path: Path) -> None:
    # (exit 0 after success: tests/test_examples_and_app.py runs the app and asserts it)
    bad = hydra_app([*HYDRA_SMALL, "strategy=zero3", "strategy.zero_stage=7", f"hydra.run.dir={tmp_path}/bad"], tmp_path)
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert _last_line(bad.stderr).startswith("lightning_parallel.train: error: `zero_stage`=7 is invalid")


def test_hydra_multirun_with_a_failed_job_exits_1_after_the_summary(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # job 0: 1 process, run inside the app's process (there is no rank 1 to fail); job 1: 2 processes,
    # rank 1 fails. (Job 0 also leaves Lightning's LOCAL_RANK in the environment: job 1 must still spawn.)
    proc = hydra_app(["-m", *HYDRA_SMALL, "strategy=dp", "trainer.devices=1,2",
                      f"+callbacks.fail._target_={__name__}.FailOnRank", "+callbacks.fail.rank=1",
                      f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["status"], r["world_size"]) for r in rows] == [("ok", "1"), ("FAILED", "")]
    assert "injected failure on rank 1" in rows[1]["error"] and not rows[0]["error"]
    assert "1 of 2 jobs FAILED" in (sweep / "summary.md").read_text()
    assert "injected failure on rank 1" in (sweep / "1" / "error.txt").read_text()
    assert _last_line(proc.stderr).startswith("lightning_parallel.train: error: 1 of 2 jobs FAILED")
