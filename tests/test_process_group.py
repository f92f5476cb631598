"""The default backend per device: CPU offload on CUDA gets a CPU backend too (NCCL rejects CPU tensors)."""

from __future__ import annotations

import torch

from lightning_parallel.strategies.process_group import default_backend, restart_attempt


def test_default_backend_pairs_gloo_with_nccl_under_cpu_offload() -> None:
    assert default_backend(torch.device("cpu"), cpu_offload=False) == "gloo"
    assert default_backend(torch.device("cpu"), cpu_offload=True) == "gloo"
    assert default_backend(torch.device("cuda", 0), cpu_offload=False) == "nccl"
    # offloaded gradients are clipped (their norms all-reduced) on the CPU
    assert default_backend(torch.device("cuda", 1), cpu_offload=True) == "cuda:nccl,cpu:gloo"


def test_restart_attempt_reads_torchelastic(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_attempt() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_attempt() == 2
