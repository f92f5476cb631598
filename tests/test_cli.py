"""The ``lightning-parallel`` CLI, run as a user runs it (the console script in a subprocess;
Lightning's launcher re-runs the command for rank 1): a preset name, the class with init args, ``--print_config``,
and bad input that must fail fast with one clear line and a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

BASE = [
    "--model=lightning_parallel.models.SeedMLP", "--data=lightning_parallel.data.SyntheticClassificationData",
    "--data.num_samples=256", "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_steps=4",
    "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
]
PARAMS = 1000 * 500 + 500 + 500 * 100 + 100 + 100 * 10 + 10


CONSOLE_SCRIPT = Path(sys.executable).with_name("lightning-parallel")  # what `pip install` puts on PATH


def cli(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    """The installed console script (its exit status is the one a shell sees; issue 18), not ``-m``."""
    assert CONSOLE_SCRIPT.is_file(), f"{CONSOLE_SCRIPT} missing: pip install -e '.[app]'"
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _run_dir(cwd: Path) -> Path:
    (version,) = list((cwd / "lightning_logs").iterdir())
    return version


def test_fit_with_a_preset_name(tmp_path: Path) -> None:
    proc = cli(["fit", *BASE, "--trainer.strategy=zero3"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = _run_dir(tmp_path)
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["trainer"]["strategy"]["class_path"] == "lightning_parallel.HybridParallelStrategy"
    assert config["trainer"]["strategy"]["init_args"]["zero_stage"] == 3
    monitor = json.loads((run / "parallelism.json").read_text())
    assert monitor["world_size"] == 2
    assert [r["parameters"] for r in monitor["state_bytes_per_rank"]] == [2 * PARAMS, 2 * PARAMS]  # half of 4P each


# The class + init args spelling, then validate / test / predict from its checkpoint: through a
# --print_config file in tests/test_exit_status.py (one flow, to keep the suite short).


def test_print_config_shows_the_strategy_options(tmp_path: Path) -> None:
    proc = cli(["fit", "--trainer.strategy=zero3_offload", "--print_config"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    strategy = yaml.safe_load(proc.stdout)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_parallel.HybridParallelStrategy"
    options = strategy["init_args"]
    assert options["zero_stage"] == 3 and options["cpu_offload"] is True
    assert {"data_parallel_size", "tensor_parallel_size", "mixed_precision", "activation_checkpointing"} <= set(options)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--trainer.strategy=zer3"], "`trainer.strategy`='zer3' is invalid", marks=pytest.mark.slow),
        (["--trainer.strategy=zero3", "--trainer.strategy.bucket_size=1"], "Option 'bucket_size' is not accepted"),
        (["--trainer.strategy=tp", "--trainer.strategy.tensor_parallel_size=3"], "must divide the world size 2"),
        pytest.param(["--trainer.strategy=dp", "--trainer.strategy.zero_stage=9"], "`zero_stage`=9 is invalid",
                     marks=pytest.mark.slow),
    ],
    ids=["unknown-name", "unknown-option", "degrees-vs-devices", "bad-value"],
)
def test_bad_input_fails_fast_with_a_clear_message(tmp_path: Path, args: list[str], message: str) -> None:
    proc = cli(["fit", *BASE, *args], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr
    assert "HINT" in proc.stderr or "not accepted" in proc.stderr
    assert not (tmp_path / "lightning_logs").exists()  # nothing trained, no rank started
