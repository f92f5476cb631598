"""The parallelism monitor: its state-bytes figure against a hand count, single process and
sharded over 2 ranks, and the per-step metrics and JSON it produces."""

from __future__ import annotations

import json
import mmap
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.callbacks import ParallelismMonitor, model_state_bytes
from lightning_parallel.testing import run_distributed

DIMS = (1000, 500, 100, 10)  # the seeds' first model: every dim is even, so a 2-way shard is exactly half
PARAMS = sum(i * o + o for i, o in zip(DIMS[:-1], DIMS[1:]))  # 551,610


class SeedNet(pl.LightningModule):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(1000, 500), nn.Linear(500, 100), nn.Linear(100, 10)
        self.optimizer_name = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _loader(batch_size: int = 8) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(128, 1000, generator=gen)
    return DataLoader(TensorDataset(x, x[:, :10].argmax(1)), batch_size=batch_size)


def _fit(strategy: Any, devices: int, root: str, optimizer: str = "sgd", steps: int = 4) -> dict[str, Any]:
    torch.manual_seed(0)
    monitor = ParallelismMonitor(warmup_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[monitor], default_root_dir=root,
    )
    trainer.fit(SeedNet(optimizer), _loader())
    assert monitor.summary is not None
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("perf/", "mem/"))}
    return {"summary": monitor.summary, "logged": logged}


def test_state_bytes_hand_count_single_process_adam(tmp_path: Path) -> None:
    out = _fit("auto", 1, str(tmp_path), optimizer="adam")
    summary = out["summary"]
    # fp32 parameters and gradients; Adam: exp_avg + exp_avg_sq per element, one fp32 `step` per tensor.
    assert summary["state_bytes_per_rank"] == [
        {"parameters": 4 * PARAMS, "gradients": 4 * PARAMS, "optimizer_state": 8 * PARAMS + 4 * 6, "total": 16 * PARAMS + 24}
    ]
    assert summary["steps_measured"] == 3 and summary["samples_per_s"] > 0 and summary["tokens_per_s"] is None
    assert summary["comm_share"] is None  # one process: nothing to measure, and not invented
    assert summary["peak_memory_kind"] == "cpu_peak_rss" and summary["peak_memory_bytes_per_rank"][0] > 4 * PARAMS
    assert json.loads((tmp_path / "parallelism.json").read_text()) == summary
    assert {"perf/step_ms", "perf/samples_per_s", "mem/state_bytes"} <= set(out["logged"])


def test_state_bytes_function_counts_shared_tensors_once() -> None:
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight  # tied weights, as in a GPT
    assert model_state_bytes(tied)["parameters"] == 4 * 40


def _two_rank_runs(root: str) -> dict[str, Any]:
    return {name: _fit(name, 2, f"{root}/{name}") for name in ("dp", "zero1", "zero3")}


def test_state_bytes_under_dp_zero1_zero3_on_two_ranks(tmp_path: Path) -> None:
    ranks = run_distributed(_two_rank_runs, 2, str(tmp_path), init_backend=None, timeout=300)
    full = 4 * PARAMS  # SGD with momentum: one buffer per element
    dp, zero1, zero3 = (ranks[0][name]["summary"] for name in ("dp", "zero1", "zero3"))
    assert dp["state_bytes_per_rank"] == [{"parameters": full, "gradients": full, "optimizer_state": full, "total": 3 * full}] * 2
    half = full // 2
    assert zero3["state_bytes_per_rank"] == [{"parameters": half, "gradients": half, "optimizer_state": half, "total": 3 * half}] * 2
    # ZeRO-1 partitions whole tensors among ranks: the two partitions together are one full copy.
    assert [r["parameters"] for r in zero1["state_bytes_per_rank"]] == [full, full]
    assert sum(r["optimizer_state"] for r in zero1["state_bytes_per_rank"]) == full
    assert all(0 < r["optimizer_state"] < full for r in zero1["state_bytes_per_rank"])
    for summary in (dp, zero1, zero3):
        assert summary["world_size"] == 2 and summary["data_parallel_replicas"] == 2
        assert 0 < summary["comm_share"] < 1 and len(summary["comm_share_per_rank"]) == 2
    assert "DDP all-reduce" in dp["comm_measured"]
    assert (tmp_path / "zero3" / "parallelism.json").exists()
    assert 0 < ranks[0]["zero3"]["logged"]["perf/comm_share"] < 1


SETUP_BYTES = 128 * 2**20


class SetupHeavyNet(SeedNet):
    """Touches a 128 MiB buffer while the model is being set up (as materialising or loading a
    layout does) and frees it before training: only the set-up peak may hold it.

    The buffer is an anonymous mapping of its own, unmapped when freed: a tensor from the heap
    would depend on this process's history (after earlier tests in the same process glibc may
    serve 128 MiB from a free heap chunk and keep it resident after the free; seen once in a
    full-suite run, training peak = set-up peak)."""

    def configure_model(self) -> None:
        scratch = mmap.mmap(-1, SETUP_BYTES)
        view = torch.frombuffer(scratch, dtype=torch.uint8)
        view.fill_(1)  # written, so resident
        assert int(view[-1]) == 1
        del view
        scratch.close()  # unmapped: returned to the OS


def test_setup_peak_is_reported_beside_the_training_peak(tmp_path: Path) -> None:
    monitor = ParallelismMonitor(warmup_steps=0, measure_communication=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor],
                         default_root_dir=str(tmp_path))
    trainer.fit(SetupHeavyNet(), _loader())
    summary = monitor.summary
    assert summary is not None and summary["setup_peak_memory_kind"] == summary["peak_memory_kind"] == "cpu_peak_rss"
    setup, training = summary["setup_peak_memory_bytes_per_rank"][0], summary["peak_memory_bytes_per_rank"][0]
    assert setup >= SETUP_BYTES, summary
    # The scratch buffer was returned to the OS before training: the training window does not see it.
    assert training < setup - SETUP_BYTES // 2, summary
    assert json.loads((tmp_path / "parallelism.json").read_text())["setup_peak_memory_bytes_per_rank"] == [setup]
    # The process's own peak RSS beside it (on the CPU the same window, so the same figures); no CUDA here.
    assert summary["peak_rss_kind"] == "cpu_peak_rss" and summary["setup_peak_rss_bytes_per_rank"][0] >= SETUP_BYTES
    assert summary["peak_rss_bytes_per_rank"][0] < setup - SETUP_BYTES // 2, summary
    assert summary["cuda_max_memory_reserved_bytes_per_rank"] == [None]
    assert trainer.callback_metrics["mem/peak_rss_bytes"] > 0
