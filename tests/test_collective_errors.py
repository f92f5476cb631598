"""Hangs are bounded and explained (``strategies/collective_errors.py``).

* A rank that stalls longer than the strategy's ``timeout`` makes its peer's collective fail
  within the timeout (gloo, 2 processes, ``dp`` with ``timeout=4``) with a
  ``CollectiveTimeoutError`` that names the phase (here the forward: DDP broadcasts its buffers
  there), the ranks of the axis groups it waited on, and the timeout; the stalled rank, once
  awake, fails the same way on the closed connection.
* NCCL's watchdog message is parsed for the collective and the mesh axis; errors that are not
  collective failures pass through untouched; the NCCL watchdog defaults never override a
  variable the user set.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from lightning_parallel.strategies.collective_errors import (
    CollectiveTimeoutError,
    explain,
    explain_collective_errors,
    nccl_watchdog_defaults,
)
from lightning_parallel.testing import run_distributed


def _stalled_peer() -> str:
    import time

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    import lightning_parallel
    from lightning_parallel.models import GPT
    from lightning_parallel.testing.parity import token_data

    class Stall(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 1 and trainer.global_rank == 1:
                time.sleep(12)  # three timeouts: rank 0's all-reduce gives up long before

    model = GPT(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, lr=0.1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=lightning_parallel.strategy_from_name("dp", timeout=4),
                         max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Stall()])
    try:
        trainer.fit(model, DataLoader(token_data(num_samples=32, block_size=8, vocab_size=32), batch_size=4))
    except CollectiveTimeoutError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_a_stalled_peer_fails_the_other_rank_with_the_axes_and_the_timeout() -> None:
    messages = run_distributed(_stalled_peer, 2, init_backend=None, timeout=240)
    rank0 = messages[0]
    assert rank0.startswith("rank 0: a collective in the "), rank0
    assert "dp_replicate=[0, 1]" in rank0 and "Collective timeout: 4 s" in rank0 and "HINT" in rank0, rank0
    assert messages[1].startswith("rank 1: a collective in the "), messages[1]  # its peer is gone when it wakes


def test_nccl_watchdog_message_names_the_collective_and_the_axis() -> None:
    text = ("[PG ID 3 PG GUID 5(mesh_tp) Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42,"
            " OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, Timeout(ms)=600000) ran for 600010 milliseconds")
    error = explain(RuntimeError(text), "backward (gradient reduction)", 1, {"tp": [0, 1], "pp": [1]}, timedelta(minutes=10))
    message = str(error)
    assert "(ALLREDUCE on the tp axis)" in message and "tp=[0, 1]" in message and "pp=" not in message, message
    assert "Collective timeout: 600 s" in message


def test_other_errors_pass_through_and_user_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="not a collective"):
        with explain_collective_errors("forward", 0, {}, timedelta(seconds=1)):
            raise ValueError("not a collective")
    with pytest.raises(CollectiveTimeoutError, match=r"rank 0: a collective in the forward timed out"):
        with explain_collective_errors("forward", 0, {"dp_shard": [0, 1]}, timedelta(seconds=1)):
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1000ms for recv operation to complete")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert nccl_watchdog_defaults("gloo") == {}
    applied = nccl_watchdog_defaults("cpu:gloo,cuda:nccl")
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in applied and applied["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
