"""Restarts resume by themselves: torchrun ``--max-restarts`` with ``ckpt_path="last"``.

One torchrun job (2 processes) fits every strategy in turn; attempt ``k`` kills rank 1 of
strategy ``k`` with ``os._exit`` after step 5, past its last checkpoint (step 4). torchrun
restarts the whole group, the job skips the strategies already finished, and strategy ``k``
resumes from its ``last.ckpt`` (Lightning's ``ckpt_path="last"``; the scratch directory of an
interrupted save is never a candidate, see ``strategies/checkpoint/files.py``). The steps redone
after the restart must give the losses, and the run the final parameters, of one process
that never crashed (fp32, relative 1e-5). See ``lightning_parallel/testing/elastic_job.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_parallel.testing.elastic_job import CHECKPOINT_EVERY, CRASH_AFTER_STEP, SPEC_KWARGS, fit_spec
from lightning_parallel.testing.parity import run_fit

STRATEGIES = ["dp", "zero3", "tp", "pp", "3d"]


def _torchrun(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _assert_matches(result: dict, reference: dict, first_step: int, label: str) -> None:
    expected = reference["losses"][first_step:]
    assert len(result["losses"]) == len(expected) > 0, f"{label}: {result['losses']} vs {expected}"
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-5, atol=0,
                               msg=lambda m: f"{label} losses: {m}")
    for name, ref in reference["params"].items():
        error = float((result["params"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
        # (a key bias gets no gradient through softmax: ~1e-12, round-off only, as in assert_parity)
        assert error <= 1e-5 or float(ref.norm()) < 1e-8, f"{label} {name}: relative error {error:.2e}"


@pytest.mark.slow
def test_torchrun_restarts_resume_from_last_checkpoint(tmp_path: Path) -> None:
    proc = _torchrun(["--standalone", "--nproc-per-node", "2", f"--max-restarts={len(STRATEGIES)}", "--monitor-interval", "0.5",
                      "-m", "lightning_parallel.testing.elastic_job", "--out", str(tmp_path), "--strategies", ",".join(STRATEGIES)],
                     timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    reference = run_fit(fit_spec("auto", 1, tmp_path / "reference", "reference", crash=False))
    assert len(reference["losses"]) == SPEC_KWARGS["max_steps"]
    for index, name in enumerate(STRATEGIES):
        result = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert result["attempt"] == index + 1, f"{name}: crashed in attempt {index}, finished in {result['attempt']}"
        assert result["global_step"] == SPEC_KWARGS["max_steps"], name
        last_checkpoint = CRASH_AFTER_STEP // CHECKPOINT_EVERY * CHECKPOINT_EVERY  # steps after it are redone
        _assert_matches(result, reference, last_checkpoint, f"{name} after the restart")
        assert not any("partial" in p.name for p in (tmp_path / name).iterdir() if "last" in p.name), name
