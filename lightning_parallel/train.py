"""``python -m lightning_parallel.train``: the Hydra app.

Lightning's own launcher re-runs ``sys.argv`` for every rank, which breaks Hydra multirun
(Lightning issue #11300). Here the app starts the ranks of each job itself (the same
environment torchrun gives them), so ``-m strategy=dp,zero3 trainer.devices=2`` runs two jobs
of two processes each. Under torchrun or SLURM the processes already exist: the job runs in
place.

Exit status: 0 when the run (or every job of a multirun) succeeded on every rank. A
configuration error found before any rank starts (strategy options, degrees vs devices) is one
line on stderr and exit status 2 in a single run; in a multirun it fails that job only. A job
that fails on any rank exits 1 (a single run), and a multirun with a FAILED job exits 1 after
writing the summary that marks it (Hydra alone would skip the summary; see
:mod:`lightning_parallel.app.sweep`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_parallel.app.job import run_job
from lightning_parallel.app.summary import failed_jobs
from lightning_parallel.app.sweep import finish_sweeps
from lightning_parallel.launcher import run_distributed

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
EXTERNAL_LAUNCH_VARS = ("LOCAL_RANK", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
# Read once, at start: a 1-process job of a multirun runs in this process, and Lightning's launcher
# leaves LOCAL_RANK/WORLD_SIZE in os.environ; the next job must not take them for torchrun's.
_LAUNCHED_EXTERNALLY = any(var in os.environ for var in EXTERNAL_LAUNCH_VARS)


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


def check_config(cfg: DictConfig) -> int:
    """What can be checked before any rank starts: the strategy's options and degrees, and that
    this process can start the ranks. Returns the number of processes of the job."""
    nprocs = _num_processes(cfg)
    strategy = instantiate(cfg.strategy)  # option errors here, once, before any rank starts
    if hasattr(strategy, "resolve_dims"):
        _check_degrees(cfg, strategy, nprocs)
    if nprocs > 1 and not _launched_externally() and cfg.trainer.get("num_nodes", 1) != 1:
        raise ValueError(
            f"`trainer.num_nodes`={cfg.trainer.num_nodes} needs a cluster launcher. "
            "HINT: use torchrun on each node, or `hydra/launcher=slurm` (see docs/cluster.md)."
        )
    return nprocs


def _launched_externally() -> bool:
    return _LAUNCHED_EXTERNALLY


def launch(cfg: DictConfig, nprocs: int) -> dict[str, Any]:
    """Run the job on this process, or spawn ``nprocs`` processes (one per local rank) and wait for them."""
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    if nprocs == 1 or _launched_externally():
        return run_job(config_yaml)
    return run_distributed(run_job, nprocs, config_yaml, init_backend=None, timeout=float(cfg.get("launch_timeout_s", 3600)))[0]


def _exit_on_config_error(err: Exception) -> None:
    """A single run stops on a configuration error with one line and status 2 (as the CLI does);
    in a multirun the error fails that job only, and the sweep goes on."""
    if HydraConfig.get().mode == RunMode.RUN:
        cause: BaseException = err
        while cause.__cause__ is not None:  # Hydra wraps a constructor's ValueError in InstantiationException
            cause = cause.__cause__
        print(f"lightning_parallel.train: error: {cause}", file=sys.stderr)
        raise SystemExit(2) from err  # Hydra catches Exception only: this ends the process


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    OmegaConf.set_struct(cfg, False)
    cfg.output_dir = HydraConfig.get().runtime.output_dir
    try:
        _model_for_strategy(cfg, HydraConfig.get().runtime.choices.get("strategy"))
        nprocs = check_config(cfg)
    except (ValueError, TypeError, InstantiationException) as err:
        _exit_on_config_error(err)
        raise
    results = launch(cfg, nprocs)
    print(f"[lightning_parallel] {results['strategy']} on {results['world_size']} processes, "
          f"{results['global_step']} steps in {results['fit_seconds']:.1f}s; fit {results['fit']}; test {results.get('test')}")
    value = results["fit"].get("val_loss")
    return float(value) if value is not None else None


def run() -> int:
    """``python -m lightning_parallel.train``: Hydra's ``main``, then the exit status of the whole
    run. Hydra itself exits 1 after a failed single run; after a multirun with a failed job it
    exits 1 too but skips the sweep's reports, which are written here before leaving."""
    try:
        main()
    except BaseException as stop:  # SystemExit from Hydra; an exception itself with HYDRA_FULL_ERROR=1; Ctrl-C
        failed = _sweep_failures()
        if isinstance(stop, SystemExit) and stop.code in (None, 0) and failed:
            raise SystemExit(1) from stop
        raise
    return 1 if _sweep_failures() else 0


def _sweep_failures() -> int:
    """Finish this process's sweeps (reports Hydra skipped) and report their FAILED jobs, last on stderr."""
    failed_total = 0
    for sweep_dir, summary_file in finish_sweeps().items():
        failed, total = failed_jobs(sweep_dir, summary_file)
        if failed:
            print(f"lightning_parallel.train: error: {failed} of {total} jobs FAILED "
                  f"(see {sweep_dir / 'summary.md'} and each job's error.txt)", file=sys.stderr)
        failed_total += failed
    return failed_total


if __name__ == "__main__":
    sys.exit(run())
