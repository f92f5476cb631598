"""``python -m lightning_parallel.train``: the Hydra app.

Lightning's own launcher re-runs ``sys.argv`` for every rank, which breaks Hydra multirun
(Lightning issue #11300). Here the app starts the ranks of each job itself (the same
environment torchrun gives them), so ``-m strategy=dp,zero3 trainer.devices=2`` runs two jobs
of two processes each. Under torchrun or SLURM the processes already exist: the job runs in
place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_parallel.app.job import run_job
from lightning_parallel.launcher import run_distributed

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
EXTERNAL_LAUNCH_VARS = ("LOCAL_RANK", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _num_processes(cfg: DictConfig) -> int:
    devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
    if isinstance(devices, int):
        count = devices
    elif isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        count = len(devices)
    else:  # "auto" / "-1": what the accelerator has
        import torch

        count = torch.cuda.device_count() if cfg.trainer.get("accelerator") in ("gpu", "cuda") else 1
    return count * int(nodes)


def _model_for_strategy(cfg: DictConfig, strategy: str | None) -> None:
    """``compare_model_by_strategy: {ep: moe_gpt}`` (experiment=compare): the job of that strategy
    gets that ``model/`` option instead, e.g. expert parallelism needs a model with MoE layers.
    The group choice cannot follow the strategy in Hydra's defaults list (an interpolated choice
    resolves only in the primary config), hence this step."""
    option = (cfg.get("compare_model_by_strategy") or {}).get(strategy) if strategy else None
    if option is None:
        return
    path = CONF_DIR / "model" / f"{option}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(
            f"`compare_model_by_strategy.{strategy}`={option!r} is not a model config (known: {known}). "
            "HINT: name a file of conf/model/"
        )
    cfg.model = OmegaConf.load(path)  # interpolations such as ${data.block_size} resolve in cfg


def _check_degrees(cfg: DictConfig, strategy: Any, nprocs: int) -> None:
    """Degrees vs devices x num_nodes, before any rank starts. Strategy '3d' (tensor and pipeline
    degrees both "auto") chooses its degrees from the model: it gets the model, built on the meta
    device (no memory), and the processes per node, as the Trainer would give them."""
    if cfg.strategy.get("tensor_parallel_size") == "auto" and cfg.strategy.get("pipeline_parallel_size") == "auto":
        import torch

        nodes = int(cfg.trainer.get("num_nodes", 1))
        with torch.device("meta"):
            model = instantiate(cfg.model)
        strategy.num_nodes = nodes
        strategy.parallel_devices = [torch.device("cpu")] * max(1, nprocs // nodes)
        strategy.connect(model)
    strategy.resolve_dims(nprocs)


def launch(cfg: DictConfig) -> dict[str, Any]:
    """Run the job on this process, or spawn one process per local rank and wait for them."""
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    nprocs = _num_processes(cfg)
    strategy = instantiate(cfg.strategy)  # option errors here, once, before any rank starts
    if hasattr(strategy, "resolve_dims"):
        _check_degrees(cfg, strategy, nprocs)
    if nprocs == 1 or any(var in os.environ for var in EXTERNAL_LAUNCH_VARS):
        return run_job(config_yaml)
    if cfg.trainer.get("num_nodes", 1) != 1:
        raise ValueError(
            f"`trainer.num_nodes`={cfg.trainer.num_nodes} needs a cluster launcher. "
            "HINT: use torchrun on each node, or `hydra/launcher=slurm` (see README)."
        )
    return run_distributed(run_job, nprocs, config_yaml, init_backend=None, timeout=float(cfg.get("launch_timeout_s", 3600)))[0]


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    OmegaConf.set_struct(cfg, False)
    cfg.output_dir = HydraConfig.get().runtime.output_dir
    _model_for_strategy(cfg, HydraConfig.get().runtime.choices.get("strategy"))
    results = launch(cfg)
    print(f"[lightning_parallel] {results['strategy']} on {results['world_size']} processes, "
          f"{results['global_step']} steps in {results['fit_seconds']:.1f}s; fit {results['fit']}; test {results.get('test')}")
    value = results["fit"].get("val_loss")
    return float(value) if value is not None else None


if __name__ == "__main__":
    main()
