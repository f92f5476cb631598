"""``ParallelismMonitor``: throughput, model-state and peak memory, and communication share.

A Lightning callback, so it works with any strategy (ours or Lightning's) and any logger.
Per training batch it logs global samples/s and tokens/s, step time and the fraction of the
step this rank spent blocked in collectives (see :mod:`lightning_parallel.callbacks.measure`
for what is and is not counted); once per run it records what each rank holds (parameters,
gradients, optimizer state) and its peak memory over two windows (CUDA ``max_memory_allocated`` and
``max_memory_reserved`` on a GPU; on every device the process's peak RSS, the number a cluster's
memory limit kills it by): *set-up* (from the
callback's ``setup`` hook, right after the process group exists, through ``configure_model``,
the strategy's layout and materialisation and a checkpoint restore, to the first training
batch) and *training* (from the first training batch to the end of ``fit``; a pipeline traces
its stages inside the first step, so that is counted here). At the end of ``fit`` the per-rank
figures are gathered and rank 0 writes them as JSON next to the run's outputs.

Why "global" means data-parallel ranks: tensor- and pipeline-parallel peers process the same
samples, so samples/s = local batch x data-parallel replicas / step time of the slowest rank.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_parallel.callbacks.measure import CollectiveTimer, PeakWindow, model_state_bytes
from lightning_parallel.errors import config_error

RESULT_FILE = "parallelism.json"


def _first_tensor(batch: Any, integer: bool = False) -> torch.Tensor | None:
    """The first tensor in a (nested) batch; with ``integer``, the first integer one of rank >= 2 (token ids)."""
    if isinstance(batch, torch.Tensor):
        if not integer:
            return batch if batch.ndim >= 1 else None
        return batch if batch.ndim >= 2 and not batch.is_floating_point() and batch.dtype != torch.bool else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = _first_tensor(item, integer)
        if found is not None:
            return found
    return None


def data_parallel_replicas(trainer: pl.Trainer) -> int:
    """How many ranks see different samples (the sampler's replicas); 1 for a single device."""
    if trainer.world_size == 1:
        return 1
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", trainer.world_size))


class ParallelismMonitor(Callback):
    """Logs throughput, step time and communication share per step; writes a per-rank JSON summary.

    Args:
        warmup_steps: first steps left out of the run's averages (start-up, allocator, lazy init).
        measure_communication: time collectives (patches ``torch.distributed`` functions and
            registers a DDP comm hook for the duration of ``fit``).
        output_dir: where rank 0 writes ``parallelism.json``; ``None``: the trainer's log dir
            (or ``default_root_dir`` without a logger).
        prog_bar: show samples/s and the communication share on the progress bar.
    """

    def __init__(
        self,
        warmup_steps: int = 2,
        measure_communication: bool = True,
        output_dir: str | None = None,
        prog_bar: bool = True,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise config_error(ValueError, "warmup_steps", warmup_steps, "it must be an int >= 0", "pass warmup_steps=2")
        self.warmup_steps = warmup_steps
        self.measure_communication = measure_communication
        self.output_dir = output_dir
        self.prog_bar = prog_bar
        self.timer = CollectiveTimer()
        self.summary: dict[str, Any] | None = None
        self._window = PeakWindow()
        self._setup_peak: tuple[int, str] | None = None
        self._setup_host: tuple[int, str] | None = None
        self._setup_reserved: int | None = None
        self._reset()

    def _reset(self) -> None:
        self._steps: list[tuple[float, float, int, int | None]] = []  # (step s, comm s, samples, tokens)
        self._state: dict[str, int] | None = None
        self._grads: int | None = None
        self._t0 = self._comm0 = 0.0

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # the set-up window opens: the process group exists, the layout does not yet
            self._setup_peak = None
            self._window.start(trainer.strategy.root_device)

    def _close_setup_window(self, trainer: pl.Trainer) -> None:
        """Record the set-up peak and open the training window (first training batch, or the end of a fit without one)."""
        if self._setup_peak is None and self._window.started:
            device = trainer.strategy.root_device
            self._setup_peak = self._window.read(device)
            self._setup_host, self._setup_reserved = self._window.read_host(), self._window.read_reserved(device)
            self._window.start(device)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self.summary = None
        if self.measure_communication and trainer.world_size > 1:
            self.timer.install()
            if isinstance(trainer.strategy.model, DistributedDataParallel):
                self.timer.hook_ddp(trainer.strategy.model)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._sync(pl_module)
        self._close_setup_window(trainer)
        self._t0, self._comm0 = time.perf_counter(), self.timer.seconds

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.timer.end_of_backward()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # Gradients exist from backward until the next zero_grad; the optimizer state is that of the
        # previous step, so the figure is completed after the step (on_train_batch_end).
        self._grads = model_state_bytes(pl_module)["gradients"]

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sync(pl_module)
        step_s = time.perf_counter() - self._t0
        comm_s = self.timer.seconds - self._comm0
        replicas = data_parallel_replicas(trainer)
        first, tokens = _first_tensor(batch), _first_tensor(batch, integer=True)
        samples = int(first.shape[0]) * replicas if first is not None else 0
        token_count = int(tokens.numel()) * replicas if tokens is not None else None
        self._steps.append((step_s, comm_s, samples, token_count))
        if self._grads is not None:
            state = model_state_bytes(pl_module, trainer.optimizers)
            state["gradients"] = self._grads
            state["total"] = state["parameters"] + state["gradients"] + state["optimizer_state"]
            if self._state is None or state["total"] >= self._state["total"]:
                self._state = state
            self._grads = None
        metrics = {"perf/step_ms": 1e3 * step_s, "perf/samples_per_s": samples / step_s if step_s > 0 else 0.0}
        if token_count is not None:
            metrics["perf/tokens_per_s"] = token_count / step_s if step_s > 0 else 0.0
        if self.measure_communication and trainer.world_size > 1:
            metrics["perf/comm_share"] = min(1.0, comm_s / step_s) if step_s > 0 else 0.0
        if self._state is not None:
            metrics["mem/state_bytes"] = float(self._state["total"])
        if self._window.started:  # the process's peak RSS in the training window so far (what a cluster limit sees)
            metrics["mem/peak_rss_bytes"] = float(self._window.read_host()[0])
            reserved = self._window.read_reserved(trainer.strategy.root_device)
            if reserved is not None:
                metrics["mem/cuda_max_reserved_bytes"] = float(reserved)
        for key, value in metrics.items():
            bar = self.prog_bar and key in ("perf/samples_per_s", "perf/comm_share")
            pl_module.log(key, value, on_step=True, on_epoch=False, prog_bar=bar, logger=bool(trainer.loggers), batch_size=1)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.timer.uninstall()
        self._close_setup_window(trainer)
        local = self._local_summary(trainer, pl_module)
        per_rank = [local]
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            per_rank = [None] * dist.get_world_size()  # type: ignore[list-item]
            dist.all_gather_object(per_rank, local)
        self.summary = self._combine(trainer, per_rank)
        path = self.result_path(trainer)  # on every rank: trainer.log_dir is a broadcast
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.summary, indent=2))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.timer.uninstall()  # also after a failed run: never leave torch.distributed patched

    # ------------------------------------------------------------------ results
    def result_path(self, trainer: pl.Trainer) -> Path:
        """Where the JSON goes: ``output_dir``, else the log dir, else ``default_root_dir``.

        Call it on every rank: ``trainer.log_dir`` broadcasts rank 0's directory."""
        root = self.output_dir or trainer.log_dir or trainer.default_root_dir
        return Path(root) / RESULT_FILE

    def _sync(self, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def _local_summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        steps = self._steps[self.warmup_steps:] if len(self._steps) > self.warmup_steps else self._steps
        step_s = sum(s[0] for s in steps)
        comm_s = sum(s[1] for s in steps)
        device = trainer.strategy.root_device
        peak, kind = self._window.read(device) if self._window.started else PeakWindow().read(device)
        setup_peak, setup_kind = self._setup_peak or (None, None)
        host, host_kind = self._window.read_host() if self._window.started else PeakWindow().read_host()
        return {
            "steps": len(steps),
            "step_seconds": step_s / len(steps) if steps else None,
            "comm_share": comm_s / step_s if step_s > 0 else None,
            "samples": sum(s[2] for s in steps),
            "tokens": sum(s[3] or 0 for s in steps) if steps and steps[0][3] is not None else None,
            "state_bytes": self._state or model_state_bytes(pl_module, trainer.optimizers),
            "peak_memory_bytes": peak,
            "peak_memory_kind": kind,
            "setup_peak_memory_bytes": setup_peak,
            "setup_peak_memory_kind": setup_kind,
            "peak_rss_bytes": host,
            "peak_rss_kind": host_kind,
            "setup_peak_rss_bytes": self._setup_host[0] if self._setup_host else None,
            "cuda_max_memory_reserved_bytes": self._window.read_reserved(device) if self._window.started else None,
            "setup_cuda_max_memory_reserved_bytes": self._setup_reserved,
        }

    def _combine(self, trainer: pl.Trainer, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
        step_times = [r["step_seconds"] for r in per_rank if r["step_seconds"]]
        slowest = max(step_times) if step_times else None
        first = per_rank[0]
        per_step_samples = first["samples"] / first["steps"] if first["steps"] else 0
        per_step_tokens = first["tokens"] / first["steps"] if first["steps"] and first["tokens"] is not None else None
        shares = [r["comm_share"] for r in per_rank if r["comm_share"] is not None]
        measured = self.measure_communication and trainer.world_size > 1
        return {
            "strategy": type(trainer.strategy).__name__,
            "world_size": trainer.world_size,
            "data_parallel_replicas": data_parallel_replicas(trainer),
            "steps_measured": first["steps"],
            "warmup_steps": self.warmup_steps,
            "step_seconds": slowest,
            "samples_per_s": per_step_samples / slowest if slowest else None,
            "tokens_per_s": per_step_tokens / slowest if slowest and per_step_tokens is not None else None,
            "comm_share": (sum(shares) / len(shares)) if measured and shares else None,
            "comm_share_per_rank": [r["comm_share"] for r in per_rank] if measured else None,
            "comm_measured": (
                "host time blocked in torch.distributed collectives"
                + (" + DDP all-reduce tail of backward" if self.timer.ddp_hooked else "")
                + "; DTensor (tensor-parallel) collectives not counted"
            ) if measured else "not measured (single process or measure_communication=False)",
            "state_bytes_per_rank": [r["state_bytes"] for r in per_rank],
            "peak_memory_bytes_per_rank": [r["peak_memory_bytes"] for r in per_rank],
            "peak_memory_kind": first["peak_memory_kind"],
            "setup_peak_memory_bytes_per_rank": [r["setup_peak_memory_bytes"] for r in per_rank],
            "setup_peak_memory_kind": first["setup_peak_memory_kind"],
            "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in per_rank],
            "peak_rss_kind": first["peak_rss_kind"],
            "setup_peak_rss_bytes_per_rank": [r["setup_peak_rss_bytes"] for r in per_rank],
            "cuda_max_memory_reserved_bytes_per_rank": [r["cuda_max_memory_reserved_bytes"] for r in per_rank],
            "setup_cuda_max_memory_reserved_bytes_per_rank": [r["setup_cuda_max_memory_reserved_bytes"] for r in per_rank],
            "peak_memory_windows": "setup: callback setup (process group up) to the first training batch;"
                                   " training: first training batch to the end of fit",
        }
