"""One training job: instantiate data, model, callbacks, loggers, trainer; fit; test.

The job runs on every rank with the configuration already resolved to plain YAML, so the
ranks need no Hydra context. Rank 0 returns the job's metrics; with the parallelism monitor
among the callbacks (the default), its per-rank summary is included under ``monitor``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_parallel.callbacks import ParallelismMonitor


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1}


def run_job(config_yaml: str) -> dict[str, Any]:
    """Train and test per the resolved config; return metrics (meaningful on every rank, written by rank 0)."""
    import lightning.pytorch as pl

    import lightning_parallel  # noqa: F401  (registers the strategy names)

    cfg = OmegaConf.create(config_yaml)
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]  # null disables one
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values()]
    strategy = instantiate(cfg.strategy)
    trainer: pl.Trainer = instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks, logger=loggers or False)
    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    fit_seconds = time.perf_counter() - start
    results: dict[str, Any] = {"fit": _floats(trainer.callback_metrics), "fit_seconds": fit_seconds}
    if cfg.get("run_test", False):
        tested = trainer.test(model, datamodule=datamodule, verbose=False)
        results["test"] = {k: float(v) for k, v in (tested[0] if tested else {}).items()}
    results["global_step"] = trainer.global_step
    results["world_size"] = trainer.world_size
    results["strategy"] = type(trainer.strategy).__name__
    results["model"] = type(model).__name__
    dims = getattr(trainer.strategy, "parallel_dims", None)
    if dims is not None:  # e.g. "dp2 tp2 pp2": what '3d' and the "auto" degrees chose
        degrees = [f"{axis}{getattr(dims, axis)}" for axis in ("dp", "tp", "pp", "ep") if getattr(dims, axis) > 1]
        results["layout"] = " ".join(degrees) or "1 process"
    monitor = next((c for c in trainer.callbacks if isinstance(c, ParallelismMonitor)), None)  # type: ignore[attr-defined]
    if monitor is not None and monitor.summary is not None:
        results["monitor"] = monitor.summary
    if trainer.is_global_zero and cfg.get("output_dir"):
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / cfg.get("summary_file", "results.json")).write_text(json.dumps(results, indent=2))
    return results
