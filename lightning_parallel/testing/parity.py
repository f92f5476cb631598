"""Parity runs: train one LightningModule under a strategy and under one process, compare.

The claim every strategy makes is "same losses and parameters as single-process training on
the same global batch". To test it the data order must be identical: Lightning always shuffles
the sampler it injects, so a run here uses ``use_distributed_sampler=False`` and a
``DistributedSampler(shuffle=False)`` built from the strategy's own ``distributed_sampler_kwargs``
(data-parallel rank and size). Rank ``r`` of ``n`` then sees samples ``r, r+n, ...``; step ``k``
of all ranks together covers the same contiguous block as step ``k`` of one process with an
``n`` times larger batch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_parallel.compat_lightning import attached_trainer
from lightning_parallel.parallel.tensor.rank_order import full_natural


@dataclass
class FitSpec:
    """Everything one parity run needs; picklable so spawned ranks can receive it."""

    model: str  # "package.module:ClassName"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    data: str = "lightning_parallel.testing.parity:classification_data"
    data_kwargs: dict[str, Any] = field(default_factory=dict)
    strategy: Any = "auto"  # a registered name, or {"class": "pkg.mod:Class", **kwargs}
    devices: int = 1
    global_batch: int = 16
    max_steps: int = 6
    max_epochs: int | None = None  # with max_steps=-1: stop at an epoch end (clean resume point)
    seed: int = 1234
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    resume_from: str | None = None  # ckpt_path for trainer.fit
    save_to: str | None = None  # trainer.save_checkpoint after fit
    checkpoint_every: int = 0  # >0: a ModelCheckpoint writing to ``checkpoint_dir`` every N steps
    checkpoint_dir: str | None = None
    save_last: bool = False  # the ModelCheckpoint also keeps ``last.ckpt`` (for ``resume_from="last"``)
    callbacks: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # extra ("pkg.mod:Class", kwargs)
    validate: bool = False  # trainer.validate on the training data after fit (the evaluation step's collectives)


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def classification_data(num_samples: int = 256, in_dim: int = 16, num_classes: int = 4, seed: int = 0) -> TensorDataset:
    """A small learnable classification set, the same on every rank for a seed."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, in_dim, generator=gen)
    teacher = torch.randn(in_dim, num_classes, generator=gen)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def token_data(num_samples: int = 128, block_size: int = 16, vocab_size: int = 64, seed: int = 0) -> TensorDataset:
    """Next-token pairs ``(x, y)`` for language-model parity runs: counting sequences mod ``vocab_size``
    from seeded random starts, so a model learns fast and its argmax predictions are not near-ties."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab_size, (num_samples, 1), generator=gen)
    stream = (starts + torch.arange(block_size + 1)) % vocab_size
    return TensorDataset(stream[:, :-1].contiguous(), stream[:, 1:].contiguous())


class _Recorder:
    """Callback recording per-step logged losses and the unclipped gradient norm (reference runs)."""

    def __new__(cls) -> Any:
        from lightning.pytorch import Callback

        class Recorder(Callback):
            def __init__(self) -> None:
                self.losses: list[float] = []
                self.series: dict[str, list[float]] = {}  # every scalar logged metric, per batch
                self.grad_norms: list[float] = []
                self.layout: dict[str, Any] = {}

            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in pl_module.parameters())
                dims = getattr(trainer.strategy, "parallel_dims", None)
                self.layout = {
                    "dims": dims.describe() if dims is not None else None,
                    "model": type(trainer.strategy.model).__name__,
                    "optimizer": type(trainer.optimizers[0]).__name__ if trainer.optimizers else None,
                    "local_param_numel": local,
                    "groups": _axis_groups(dims),
                    "fsdp_units": sum(1 for m in pl_module.modules() if isinstance(m, FSDPModule)),
                }

            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                # pipelines build (and split) their stages at the first batch: what a rank holds after training
                self.layout["local_param_numel_end"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                                                           for p in pl_module.parameters())

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
                value = trainer.callback_metrics.get("train_loss")
                if value is not None:
                    self.losses.append(float(value))
                for key, metric in trainer.callback_metrics.items():
                    if isinstance(metric, torch.Tensor) and metric.numel() == 1:
                        self.series.setdefault(key, []).append(float(metric))

            def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
                grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
                if grads and not any(isinstance(g, DTensor) for g in grads):
                    self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

        return Recorder()


def _axis_groups(dims: Any) -> dict[str, list[int]]:
    """Global ranks of this rank's group on each mesh axis (where ranks sit: nodes, tp inside them)."""
    import torch.distributed as dist

    if dims is None or getattr(dims, "_mesh", None) is None:
        return {}
    return {name: dist.get_process_group_ranks(dims.mesh.get_group(name)) for name in dims.mesh.mesh_dim_names}


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor under its original name (a collective for DTensors, and
    over the pipeline group under pipeline parallelism: a stage frees the parameters other stages
    own, so those are fetched from their owners instead of read from the freed copies)."""
    trainer = attached_trainer(module)
    driver = getattr(trainer.strategy, "_pipeline", None) if trainer is not None else None
    if driver is not None:
        return {n: t.detach().cpu().clone() for n, t in driver.gather_state(parameters_only=True).items()}
    out = {}
    for name, param in module.named_parameters():
        value = full_natural(param) if isinstance(param, DTensor) else param
        out[name] = value.detach().cpu().clone()
    return out


def _make_strategy(spec: Any) -> Any:
    if isinstance(spec, dict):
        kwargs = dict(spec)
        return _load(kwargs.pop("class"))(**kwargs)
    return spec


def run_fit(spec: FitSpec) -> dict[str, Any]:
    """Fit per ``spec`` in this process (one rank of a spawned group, or the reference run)."""
    import lightning.pytorch as pl

    import lightning_parallel  # noqa: F401  (registers the strategy names)

    pl.seed_everything(spec.seed, verbose=False)
    model = _load(spec.model)(**spec.model_kwargs)
    dataset = _load(spec.data)(**spec.data_kwargs)
    recorder = _Recorder()
    callbacks: list[Any] = [recorder]
    if spec.checkpoint_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=spec.checkpoint_dir, every_n_train_steps=spec.checkpoint_every,
                                                      save_top_k=-1, save_last=spec.save_last or None))
    callbacks.extend(_load(name)(**kwargs) for name, kwargs in spec.callbacks)
    trainer_kwargs = {"accelerator": "cpu", **spec.trainer_kwargs}  # "cuda" for the GPU tests
    trainer = pl.Trainer(
        devices=spec.devices,
        strategy=_make_strategy(spec.strategy),
        max_steps=spec.max_steps,
        max_epochs=spec.max_epochs,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=bool(spec.checkpoint_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    if spec.devices > 1 and getattr(trainer.strategy, "lightning_module", "n/a") is None:
        trainer.strategy.connect(model)  # strategy '3d' reads the model to choose the degrees (and the sampler's dp size)
    sampler_kwargs = trainer.strategy.distributed_sampler_kwargs if spec.devices > 1 else {"num_replicas": 1, "rank": 0}
    replicas = sampler_kwargs["num_replicas"]
    if spec.global_batch % replicas:
        raise ValueError(f"global_batch={spec.global_batch} must be divisible by the data-parallel size {replicas}")
    sampler = DistributedSampler(dataset, shuffle=False, drop_last=True, **sampler_kwargs)
    loader = DataLoader(dataset, batch_size=spec.global_batch // replicas, sampler=sampler, drop_last=True)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=spec.resume_from)
    if spec.save_to:
        trainer.save_checkpoint(spec.save_to)
    if spec.validate:
        trainer.validate(model, dataloaders=loader, verbose=False)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
    return {
        "layout": recorder.layout,
        "losses": recorder.losses,
        "series": recorder.series,
        "grad_norms": recorder.grad_norms,
        "params": full_parameters(model),
        "metrics": metrics,
        "global_step": trainer.global_step,
    }


def run_fits(specs: list[FitSpec]) -> list[dict[str, Any]]:
    """Several fits in one process group (one spawn pays the start-up cost once)."""
    return [run_fit(spec) for spec in specs]


def run_fits_in_fresh_process(specs: list[FitSpec], timeout: float = 900.0) -> list[dict[str, Any]]:
    """One-process reference fits, run in a new process of their own, as the ranks they are
    compared with are (forked from the test session's preloaded server, or spawned). Why: a reference fitted inside the test process depends on what earlier
    tests left there; a CI run's in-process resnet reference left its fresh-process trajectory
    at the second step (gradient norm 4e-5 apart, loss 2.4e-4 by the fifth), in the process that
    had run the suite's earlier tests, while the same fit in a fresh process matched the ranks to 1e-6."""
    from lightning_parallel.testing import run_distributed

    return run_distributed(run_fits, 1, specs, init_backend=None, timeout=timeout)[0]
