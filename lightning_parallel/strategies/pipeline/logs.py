"""How a LightningModule's own step code runs under a pipeline: probing, patching, logging.

Under pipeline parallelism the user's ``training_step`` cannot run as written on any single
rank: the first stage holds the input layers, the last stage the head. The driver therefore
runs the step code twice, in two roles, and this file holds the machinery for both:

* as a *probe* (every rank, before the schedule): ``forward`` is replaced by a recorder that
  raises a private exception at its first call, which yields what the step passes to
  ``forward`` (the inputs for the first stage) without knowing the step's code;
* as the *loss* (last stage, per microbatch): ``forward`` returns the stage output instead,
  so the step computes its loss, metrics and logs from it, unchanged.

``self.log`` calls made in the loss role happen on one rank only, once per microbatch.
They are captured here, reduced across microbatches (size-weighted, following each call's
``reduce_fx``), and replayed with the same keyword arguments on every rank, inside the
strategy's hook where Lightning's logging context is active; so loggers, the progress bar
and callbacks (``ModelCheckpoint(monitor=...)``) see single-process values everywhere.

torchmetrics objects logged directly (``self.log("acc", metric)``): ``update`` runs on the
last stage only. The replay logs the same Metric object on every rank with its
``_forward_cache`` set to the reduced step value, so step values match; at epoch end
Lightning calls ``compute()`` on every rank, whose own sync (over the default group) adds
the last stages' states to the untouched (default) states of the other ranks. That is exact
for states reduced by ``sum``/``cat``/``max``/``min`` (all stat-score, accuracy, mean/sum and
curve metrics); a state with ``dist_reduce_fx="mean"`` would be averaged with defaults.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import numbers
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_parallel.compat import tree_map
from lightning_parallel.parallel.errors import config_error

_LOG_SIGNATURE = inspect.signature(LightningModule.log)


class _ForwardCalled(BaseException):
    """Raised by the probe's ``forward``; a BaseException so a step's ``except Exception`` cannot swallow it."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any], name: str = "") -> None:
        super().__init__()
        self.args, self.kwargs, self.name = args, kwargs, name


@dataclass
class StepDone:
    """A probed hook that finished without calling ``forward`` (nothing to pipeline)."""

    result: Any
    records: list[LogRecord]


@dataclass
class LogRecord:
    """One ``self.log`` call: the value (CPU tensor), the Metric's FQN if an object was logged, the kwargs."""

    name: str
    value: Tensor
    metric: str | None
    kwargs: dict[str, Any] = field(default_factory=dict)


@contextmanager
def patched(module: nn.Module, **attrs: Callable[..., Any]) -> Iterator[None]:
    """Set instance attributes (``forward``, ``log``) for the duration; restore what was there."""
    previous = {name: module.__dict__.get(name) for name in attrs}
    try:
        for name, fn in attrs.items():
            object.__setattr__(module, name, fn)
        yield
    finally:
        for name, old in previous.items():
            if old is None:
                object.__delattr__(module, name)
            else:
                object.__setattr__(module, name, old)


def other_calls_error(hook: str, what: str, others: list[str]) -> Exception:
    return config_error(
        ValueError,
        hook,
        f"calls {', '.join(f'self.{n}' for n in others)} besides {what}",
        f"the pipeline stages are cut from {what}; a module with parameters called outside it would run on the last "
        "stage only, trained there and stale on every other rank",
        f"call those modules inside {what} (e.g. in forward), or use a strategy without pipeline parallelism",
    )


def forward_twice_error(hook: str, what: str = "forward") -> Exception:
    return config_error(
        ValueError,
        f"{hook}",
        f"calls {what} more than once",
        "a pipeline runs the model's forward once per step: the stages are fed the inputs of the first call "
        "and its output is the only one the last stage produces",
        "call self(...) once per step (concatenate the inputs of several calls into one batch), "
        "or use a strategy without pipeline parallelism",
    )


def metric_names(module: nn.Module) -> dict[int, str]:
    """``id(metric) -> name`` of every torchmetrics object in ``module``."""
    return {id(m): n for n, m in module.named_modules() if isinstance(m, Metric)}


class LogCapture:
    """Stands in for ``module.log``: records each call with its arguments normalised to keywords."""

    def __init__(self, module: nn.Module, metrics: dict[int, str] | None = None) -> None:
        self.module = module
        self.records: list[LogRecord] = []
        # id -> name of the module's Metrics: built when a Metric is logged, or given by the caller,
        # which makes one capture per microbatch and should not walk the module tree each time
        # (measured: 0.8 ms per microbatch on an 8-block GPT under cProfile)
        self._metric_table = metrics

    @property
    def _metric_names(self) -> dict[int, str]:
        if self._metric_table is None:
            self._metric_table = metric_names(self.module)
        return self._metric_table

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        bound = _LOG_SIGNATURE.bind(self.module, name, value, *args, **kwargs)
        extra = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
        extra.pop("sync_dist_group", None)  # a process group does not cross ranks; Lightning reduces over dp
        metric = None
        if isinstance(value, Metric):
            if id(value) not in self._metric_names:
                raise config_error(
                    ValueError, "self.log", name, "a torchmetrics object logged under pipeline parallelism must be a submodule of the LightningModule", "assign the metric as an attribute in __init__"
                )
            metric, value = self._metric_names[id(value)], value._forward_cache
            if value is None and extra.get("on_step") is False:
                # Epoch-only (``metric.update(...)`` then ``self.log(name, metric, on_step=False)``):
                # Lightning reads compute() of the synced states at epoch end, never a step value.
                value = torch.zeros(())
            if value is None:
                raise config_error(
                    ValueError, "self.log", name, "the metric was logged before it was called on this step's data", "call metric(preds, target) before self.log(name, metric)"
                )
        if isinstance(value, Tensor):
            tensor = value.detach()  # stays on its device: one copy to the host per step (_broadcast), not one per microbatch
        elif isinstance(value, numbers.Number):
            tensor = torch.tensor(float(value))
        else:
            raise config_error(
                TypeError, "self.log", f"{name}={type(value).__name__}", "under pipeline parallelism a logged value is a tensor, a number or a torchmetrics Metric", "log a scalar tensor or a number"
            )
        self.records.append(LogRecord(name, tensor, metric, extra))


def _reducer(reduce_fx: Any) -> str:
    if reduce_fx in ("sum", torch.sum):
        return "sum"
    if reduce_fx in ("max", torch.max):
        return "max"
    if reduce_fx in ("min", torch.min):
        return "min"
    return "mean"


def reduce_microbatch_logs(per_microbatch: list[tuple[list[LogRecord], int]]) -> list[LogRecord]:
    """One record per name from the microbatches' records (each with its row count).

    Why size-weighted: a step logs the mean over its batch; the mean of microbatch means weighted
    by their sizes (``batch_size=`` if the call gave one, else the rows) is the full-batch mean.
    A ``reduce_fx`` of ``sum``/``max``/``min`` combines microbatches the same way Lightning
    combines steps. A ``batch_size=`` given per microbatch is replayed as the sum, so epoch-level
    weighting matches single-process training.
    """
    grouped: dict[str, list[tuple[LogRecord, float]]] = {}
    for records, rows in per_microbatch:
        for record in records:
            weight = record.kwargs.get("batch_size")
            grouped.setdefault(record.name, []).append((record, float(rows if weight is None else weight)))
    out = []
    for name, items in grouped.items():
        first = items[0][0]
        device = next((r.value.device for r, _ in items if r.value.device.type != "cpu"), torch.device("cpu"))
        values = torch.stack([(r.value.reshape(()) if r.value.numel() == 1 else r.value).to(device, torch.float64) for r, _ in items])
        weights = torch.tensor([w for _, w in items], dtype=torch.float64, device=device)
        how = _reducer(first.kwargs.get("reduce_fx", "mean"))
        if how == "sum":
            value = values.sum(0)
        elif how == "max":
            value = values.max(0).values
        elif how == "min":
            value = values.min(0).values
        else:
            shape = (-1,) + (1,) * (values.dim() - 1)
            value = (values * weights.reshape(shape)).sum(0) / weights.sum()
        kwargs = dict(first.kwargs)
        if kwargs.get("batch_size") is not None:
            kwargs["batch_size"] = int(sum(w for _, w in items))
        out.append(LogRecord(name, value.to(first.value.dtype), first.metric, kwargs))
    return out


def replay_logs(module: LightningModule, records: list[LogRecord], device: torch.device) -> None:
    """Log each record through the real ``module.log`` (call inside a Lightning step hook)."""
    for record in records:
        value = record.value.to(device)
        if record.metric is None:
            module.log(record.name, value, **record.kwargs)
            continue
        metric = module.get_submodule(record.metric)
        assert isinstance(metric, Metric)
        metric._forward_cache = value
        # Stages other than the last never update the metric: without this, compute() at epoch
        # end warns that it ran before update() (the sync then adds the last stage's state).
        metric._update_count = max(metric._update_count, 1)
        module.log(record.name, metric, **record.kwargs)


def probe_forward_inputs(module: nn.Module, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | StepDone:
    """What ``hook`` passes to ``forward`` (its first call), or :class:`StepDone` if it never calls it.

    Side effects of the hook's code before its forward call run twice per step (once here).
    """
    capture = LogCapture(module)

    def recorder(*a: Any, **k: Any) -> Any:
        raise _ForwardCalled(a, k)

    with patched(module, forward=recorder, log=capture):
        try:
            result = getattr(module, hook)(*args, **kwargs)
        except _ForwardCalled as called:
            return called.args, called.kwargs
    return StepDone(result, capture.records)


def probe_entry_inputs(module: nn.Module, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, tuple[Any, ...], dict[str, Any]] | StepDone:
    """Like :func:`probe_forward_inputs`, but a call of a direct child with parameters (``self.model(...)``)
    counts too: returns the called module's name (``""`` for ``forward``) and its arguments."""
    capture = LogCapture(module)
    children = {name: child for name, child in module.named_children() if any(True for _ in child.parameters())}

    def recorder(name: str) -> Callable[..., Any]:
        def record(*a: Any, **k: Any) -> Any:
            raise _ForwardCalled(a, k, name)

        return record

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(module, forward=recorder(""), log=capture))
        for name, child in children.items():
            stack.enter_context(patched(child, forward=recorder(name)))
        try:
            result = getattr(module, hook)(*args, **kwargs)
        except _ForwardCalled as called:
            return called.name, called.args, called.kwargs
    return StepDone(result, capture.records)


def _metric_snapshot(module: nn.Module) -> list[tuple[Metric, dict[str, Any]]]:
    saved = []
    for m in module.modules():
        if isinstance(m, Metric):
            state = {k: copy.deepcopy(getattr(m, k)) for k in m._defaults}
            state.update({k: copy.copy(getattr(m, k, None)) for k in ("_update_count", "_forward_cache", "_computed")})
            saved.append((m, state))
    return saved


def count_forward_calls(module: nn.Module, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any], entry: str = "") -> int:
    """Run ``hook`` for real and count its calls of ``forward`` (of the child ``entry``, when the
    step calls ``self.<entry>(...)``); see :func:`model_calls`."""
    return model_calls(module, hook, args, kwargs, entry)[0]


def model_calls(module: nn.Module, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any], entry: str = "") -> tuple[int, list[str]]:
    """Run ``hook`` for real (no grad, RNG forked, logs muted, metric states restored): how often it
    calls the entry (``forward``, or the child ``entry``), and which other direct children with
    parameters it calls outside that call.

    Why: a step that calls forward twice must fail on every rank before any stage sends; only a
    real run reaches the second call. And a child called beside the entry (``self.head(self(x))``)
    would run eagerly on the last stage only, its parameters trained there and stale everywhere
    else. Done once, while every rank still holds every parameter.
    """
    calls = [0]
    inside = [False]
    others: list[str] = []
    target = module.get_submodule(entry) if entry else module
    inner = target.forward

    def counting(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        inside[0] = True
        try:
            return inner(*a, **k)
        finally:
            inside[0] = False

    def watching(name: str, child: nn.Module) -> Callable[..., Any]:
        original = child.forward

        def forward(*a: Any, **k: Any) -> Any:
            if not inside[0] and name not in others:
                others.append(name)
            return original(*a, **k)

        return forward

    children = {n: c for n, c in module.named_children() if n != entry and c is not target and any(True for _ in c.parameters())}
    saved = _metric_snapshot(module)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(torch.random.fork_rng())
            stack.enter_context(patched(module, log=lambda *a, **k: None))
            stack.enter_context(patched(target, forward=counting))
            for name, child in children.items():
                stack.enter_context(patched(child, forward=watching(name, child)))
            getattr(module, hook)(*args, **kwargs)
    finally:
        for metric, state in saved:
            for key, value in state.items():
                setattr(metric, key, value)
    return calls[0], others


def slice_batch(batch: Any, rows: Tensor, batch_size: int) -> Any:
    """The microbatch ``rows`` of ``batch``: every tensor whose dim 0 is the batch, cut along dim 0."""
    flat = rows.reshape(-1)
    start, n = int(flat[0]), int(flat.numel())
    contiguous = bool((flat == torch.arange(start, start + n, device=flat.device)).all())

    def cut(t: Any) -> Any:
        if not isinstance(t, Tensor) or t.dim() == 0 or t.shape[0] != batch_size:
            return t
        return t.narrow(0, start, n) if contiguous else t[flat.to(t.device)]

    return tree_map(cut, batch)


def training_loss(result: Any) -> Tensor:
    """The loss a ``training_step`` returned (a tensor, or a dict's ``"loss"``)."""
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise config_error(
            TypeError,
            "training_step",
            type(result).__name__,
            "under pipeline parallelism training_step must return a scalar loss tensor (or a dict with 'loss'); "
            "skipping a step by returning None would leave the other stages waiting",
            "return the loss for every batch",
        )
    return loss


def to_device(obj: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, obj)


def detached_cpu(obj: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, Tensor) else t, obj)
