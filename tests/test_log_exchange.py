"""The pipeline's step logs and loss reach every rank as one tensor once their layout is known
(``strategies/pipeline/log_exchange.py``); a changed layout, or a dtype float64 does not hold, takes the
pickled broadcast, and every rank gets the last stage's values either way."""

from __future__ import annotations

from typing import Any

from lightning_parallel.testing import run_distributed


def _steps() -> list[tuple[list[Any], Any]]:
    import torch

    from lightning_parallel.strategies.pipeline.logs import LogRecord

    def rec(name: str, value: Any, **kwargs: Any) -> LogRecord:
        return LogRecord(name, torch.as_tensor(value), None, kwargs)

    return [
        ([rec("loss", 1.5, prog_bar=True), rec("acc", torch.tensor([0.25, 0.5]))], torch.tensor(1.5)),
        ([rec("loss", 1.25, prog_bar=True), rec("acc", torch.tensor([0.75, 1.0]))], torch.tensor(1.25)),  # same layout
        ([rec("loss", 1.0, prog_bar=True), rec("acc", torch.tensor([0.5, 0.5]), batch_size=3)], torch.tensor(1.0)),  # kwargs
        ([rec("loss", 0.5, prog_bar=True), rec("acc", torch.tensor([0.5, 0.5]), batch_size=3)], torch.tensor(0.5)),
        ([rec("loss", 0.5), rec("n", torch.tensor(2**60))], torch.tensor(0.25)),  # int64: not exact in float64
        ([rec("loss", 0.5), rec("n", torch.tensor(2**60 + 1))], torch.tensor(0.125)),
        ([rec("loss", 0.75, prog_bar=True), rec("b", torch.tensor(True)), rec("h", torch.tensor(0.1, dtype=torch.bfloat16))],
         torch.tensor(0.5, dtype=torch.bfloat16)),
        ([rec("loss", 0.5, prog_bar=True), rec("b", torch.tensor(False)), rec("h", torch.tensor(0.2, dtype=torch.bfloat16))],
         torch.tensor(0.25, dtype=torch.bfloat16)),
    ]


def _worker() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lightning_parallel.strategies.pipeline.log_exchange import LogExchange

    last = dist.get_rank() == 1
    exchange = LogExchange(dist.group.WORLD, 1, torch.device("cpu"), holds_last=last)
    received, pickled = [], []
    for records, loss in _steps():
        got, got_loss = exchange(records if last else None, loss if last else torch.zeros(()))
        received.append(([(r.name, r.value, r.metric, r.kwargs) for r in got], got_loss))
        pickled.append(exchange.pickled)
    return {"received": received, "pickled": pickled}


def test_logs_travel_as_one_tensor_until_their_layout_changes() -> None:
    import torch

    results = run_distributed(_worker, 2, timeout=120)
    # pickled: the first step, the step whose kwargs changed, both int64 steps, the step with new names
    assert results[0]["pickled"] == results[1]["pickled"] == [1, 1, 2, 2, 3, 4, 5, 5]
    for (records, loss), (got, got_loss) in zip(_steps(), results[0]["received"]):
        assert got_loss.dtype == loss.dtype and torch.equal(got_loss, loss)
        assert [(n, m, k) for n, _, m, k in got] == [(r.name, r.metric, r.kwargs) for r in records]
        for (_, value, _, _), record in zip(got, records):
            assert value.dtype == record.value.dtype and value.shape == record.value.shape
            assert torch.equal(value, record.value), (value, record.value)
