"""A training step's logs and loss, from the last pipeline stage to every rank of its pipeline.

Why: the step's loss and the ``self.log`` values exist on the last stage only, and every rank
must replay them (``strategies/pipeline/logs.py``). ``broadcast_object_list`` pickles them
(``torch.save`` per tensor), sends a size and then the bytes, and unpickles: 3.8 ms of a 330 ms
step under cProfile on the 2-rank pipeline benchmark at 8 microbatches
(``benchmarks/bench_pipeline_vs_manual.py``), about 1% of the step that a hand-written loop does
not pay. But what a step logs has the same layout from step to step: the same names, shapes,
dtypes and ``self.log`` arguments. Once every rank of the pipeline group knows that layout, the
values travel as one float64 vector in one tensor broadcast, its first element saying whether the
last stage's step still has that layout. When it does not (the first step, a new name, a
different ``batch_size=``), the vector says so and the pickled broadcast follows, which teaches
every rank the new layout. Values whose dtype float64 does not hold exactly (int64, complex)
always take the pickled path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.strategies.pipeline.logs import LogRecord, detached_cpu, to_device

_EXACT_IN_FLOAT64 = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.uint8, torch.int8,
                     torch.int16, torch.int32)


@dataclass(frozen=True)
class _Slot:
    """Where one value sits in the vector, and what it is."""

    name: str
    metric: str | None
    kwargs: dict[str, Any]
    shape: torch.Size
    dtype: torch.dtype
    start: int

    @property
    def stop(self) -> int:
        return self.start + self.shape.numel()


def _layout(records: list[LogRecord], loss: Tensor) -> list[_Slot] | None:
    """The slots of ``loss`` (first) and ``records`` in one vector, or None if a dtype does not pack."""
    slots, start = [], 0
    for name, metric, kwargs, value in [("", None, {}, loss), *((r.name, r.metric, r.kwargs, r.value) for r in records)]:
        if value.dtype not in _EXACT_IN_FLOAT64:
            return None
        slots.append(_Slot(name, metric, dict(kwargs), value.shape, value.dtype, start))
        start += value.numel()
    return slots


def _same(slots: list[_Slot], records: list[LogRecord], loss: Tensor) -> bool:
    """Whether this step's ``loss`` and ``records`` have the layout ``slots`` describe."""
    if len(slots) != len(records) + 1:
        return False
    values = [("", None, {}, loss), *((r.name, r.metric, r.kwargs, r.value) for r in records)]
    try:
        return all(
            (s.name, s.metric, s.shape, s.dtype) == (name, metric, value.shape, value.dtype) and bool(s.kwargs == kwargs)
            for s, (name, metric, kwargs, value) in zip(slots, values)
        )
    except (RuntimeError, TypeError, ValueError):  # a log argument whose == is not a bool (a tensor)
        return False


class LogExchange:
    """Sends the last stage's ``(records, loss)`` to every rank of ``group`` (see the module doc).

    ``src`` is the global rank of the group's last stage; ``device`` the one the group's backend
    serves (NCCL rejects CPU tensors), where the vector and the values every rank gets live."""

    def __init__(self, group: Any, src: int, device: torch.device, holds_last: bool) -> None:
        self.group, self.src, self.device, self.holds_last = group, src, device, holds_last
        self._slots: list[_Slot] | None = None  # the layout every rank of the group learnt last
        self.pickled = 0  # steps that took the pickled path (tests read it)

    def __call__(self, records: list[LogRecord] | None, loss: Tensor) -> tuple[list[LogRecord], Tensor]:
        """The last stage's records and loss, on every rank of the group, on ``device``."""
        slots = self._slots
        if slots is not None:
            vector = torch.zeros(1 + slots[-1].stop, dtype=torch.float64, device=self.device)
            if self.holds_last and _same(slots, records or [], loss):
                vector[0] = 1.0
                values = (loss, *(r.value for r in records or []))
                vector[1:].copy_(torch.cat([v.detach().reshape(-1).to(self.device, torch.float64) for v in values]))
            dist.broadcast(vector, src=self.src, group=self.group)
            if bool(vector[0]):  # the step's one read on the host
                return self._unpack(slots, vector[1:])
        box = [detached_cpu((records, loss)) if self.holds_last else None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        records, loss = to_device(box[0], self.device)
        self._slots = _layout(records, loss)  # every rank of the group computes it from the same values
        self.pickled += 1
        return records, loss

    @staticmethod
    def _unpack(slots: list[_Slot], values: Tensor) -> tuple[list[LogRecord], Tensor]:
        out = [values[s.start:s.stop].reshape(s.shape).to(s.dtype) for s in slots]
        records = [LogRecord(s.name, value, s.metric, dict(s.kwargs)) for s, value in zip(slots[1:], out[1:])]
        return records, out[0]


__all__ = ["LogExchange"]
