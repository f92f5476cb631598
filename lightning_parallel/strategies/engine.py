"""The step engine: one interface for what a step, a clip, a checkpoint and a load do, two implementations.

Why: ``HybridParallelStrategy`` used to branch on "is this a pipeline?" in every hook, and that is
how precision, clipping and checkpoints came to differ between the two paths. Now the strategy is
the Lightning layer (options, process group, layout, Lightning's contract) and calls one engine
for the work whose mechanics differ:

* :class:`EagerEngine` — every layout without pipelines (DDP, FSDP2, DTensor tensor parallelism,
  experts): Lightning's own step through the model the layout returned, the sharded-logits
  context of ``loss_parallel``, MoE losses, expert gradient reduction under DDP, layout-aware
  global-norm clipping, DCP state dicts;
* :class:`PipelineEngine` — pipelines (``strategies/pipeline/driver.py``): the schedule runs
  forward and backward inside ``training_step`` under the Trainer's precision context, the step's
  backward restores the schedule's gradients, clipping spans every stage, and state dicts and loads
  touch only the stages this rank keeps.

What is common stays in the strategy and is written once: the Trainer's precision plugin
(pre/post backward, the optimizer step with its scaler), the non-finite check, the explained
collective errors, RNG and mid-epoch resume, async and sharded saving.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_parallel.parallel.clip import clip_grad_norm_
from lightning_parallel.parallel.dims import PP_DP
from lightning_parallel.parallel.tensor.loss import sharded_logits_step
from lightning_parallel.strategies.checkpoint import files as ckpt
from lightning_parallel.strategies import precision as prec
from lightning_parallel.strategies.early_zero_grad import free_dropped_gradients
from lightning_parallel.strategies.experts import add_moe_losses, reduce_expert_grads

EVAL_HOOKS = ("validation_step", "test_step", "predict_step")


class StepEngine(Protocol):
    """What the strategy delegates; ``strategy`` is the ``HybridParallelStrategy`` that owns it."""

    forward_phase: str  # how a collective error during training_step is explained

    def training_step(self, *args: Any, **kwargs: Any) -> Any: ...

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor: ...

    def eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any: ...

    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> None: ...

    def model_state(self, full: bool) -> dict[str, Any]: ...

    def optimizer_state(self, optimizer: Optimizer, full: bool) -> dict[str, Any]: ...

    def load(self, path: Path, fitting: bool, weights_only: bool | None) -> dict[str, Any]: ...

    def configure_metrics(self, module: nn.Module) -> None: ...


def _set_metric_sync(module: nn.Module, group: Any, on_step: bool | None) -> None:
    """Which ranks each torchmetrics object syncs over, and (``on_step`` not None) whether per step.

    torchmetrics syncs over the whole world by default, where tensor and pipeline peers hold
    duplicate states: each engine names the group that holds each sample once. Whether a Metric
    syncs per step is its own ``dist_sync_on_step``, as under Lightning's DDP (which logs each
    rank's step value and syncs at ``compute``); the eager engine leaves it to the user
    (``on_step=None``): a per-step sync is one barrier plus an all-gather per state and step (under
    cProfile, waits included, 11 ms of a 240 ms ZeRO-3 step on the CPU benchmark). Epoch values
    (``compute``) always sync over ``group``.
    """
    from torchmetrics import Metric

    for metric in module.modules():
        if isinstance(metric, Metric):
            metric.process_group = group
            if on_step is not None:
                metric.dist_sync_on_step = on_step


class EagerEngine:
    """Layouts without pipelines: Lightning's step through the wrapped model (see the module doc)."""

    forward_phase = "forward"

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        s = self.strategy
        free_dropped_gradients(s.lightning_module, s.train_batch_idx, s.optimizers)  # not held through the forward
        with sharded_logits_step(s.loss_parallel) as release:
            output = release(ParallelStrategy.training_step(s, *args, **kwargs))
        return add_moe_losses(s.lightning_module, output)

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        s = self.strategy
        result = ParallelStrategy.backward(s, closure_loss, optimizer, *args, **kwargs)
        if isinstance(s.model, DistributedDataParallel):  # FSDP2 reduces experts over edp itself
            reduce_expert_grads(s._expert_params, s.parallel_dims)
        return result

    def eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        s = self.strategy
        step = getattr(ParallelStrategy, hook)
        if hook == "predict_step":  # predictions are returned whole: no sharded-logits context
            return step(s, *args, **kwargs)
        with sharded_logits_step(s.loss_parallel) as release:
            return release(step(s, *args, **kwargs))

    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(params, max_norm, device=self.strategy.root_device)

    def model_state(self, full: bool) -> dict[str, Any]:
        return ckpt.model_state(self.strategy.lightning_module, full=full)

    def optimizer_state(self, optimizer: Optimizer, full: bool) -> dict[str, Any]:
        return ckpt.optimizer_state(self.strategy.lightning_module, optimizer, full=full)

    def load(self, path: Path, fitting: bool, weights_only: bool | None) -> dict[str, Any]:
        module = self.strategy.lightning_module
        return ckpt.load_into(module, list(self.strategy.optimizers), path, module.strict_loading, weights_only)

    def configure_metrics(self, module: nn.Module) -> None:
        """Sync over the data-parallel ranks (tensor-parallel peers hold the same samples); per step
        only where the Metric asks for it (``dist_sync_on_step=True``: then its step value is the
        single-process one on every rank)."""
        _set_metric_sync(module, self.strategy._data_parallel_group(), on_step=None)


class PipelineEngine:
    """Pipelines: the schedule's step, per-stage clipping and state (see the module doc)."""

    forward_phase = "pipeline schedule (forward and backward)"

    def __init__(self, strategy: Any, driver: Any) -> None:
        self.strategy = strategy
        self.driver = driver

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # Lightning enters the precision context in Strategy.training_step; the schedule is entered here
        with prec.pipeline_step_context(self.strategy.precision_plugin, "training_step"):
            return self.driver.training_step(*args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # The schedule already ran backward inside training_step; Lightning's closure zeroed the
        # gradients since (zero_grad runs between step and backward): put them back.
        # (16-mixed: the schedule backpropagated the scaled loss; scaling this stand-in only
        # starts the scaler's scale on ranks without the last stage, which unscale_ needs.)
        s = self.strategy
        assert s.lightning_module is not None
        closure_loss = s.precision_plugin.pre_backward(closure_loss, s.lightning_module)
        self.driver.backward()
        return s.precision_plugin.post_backward(closure_loss, s.lightning_module)

    def eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        with prec.pipeline_step_context(self.strategy.precision_plugin, hook):
            return self.driver.eval_step(hook, *args, **kwargs)

    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> None:
        self.driver.clip_grad_norm_(max_norm)  # the norm spans every stage's parameters

    def model_state(self, full: bool) -> dict[str, Any]:
        return self.driver.checkpoint_model_state(full=full)  # each tensor from the stage keeping it

    def optimizer_state(self, optimizer: Optimizer, full: bool) -> dict[str, Any]:
        return self.driver.checkpoint_optimizer_state(optimizer, full=full)  # strategies/checkpoint/pipeline.py

    def load(self, path: Path, fitting: bool, weights_only: bool | None) -> dict[str, Any]:
        """Per rank, only what its stages hold. Before the stages exist (they are traced from the
        first batch) the load waits for them: then no rank reads another stage's tensors, and a
        meta-built model has real ones to fill. ``validate/test/predict(ckpt_path=...)`` after a fit
        (stages traced): model weights only. The deferred load keeps ``weights_only`` for the first batch."""
        module = self.strategy.lightning_module
        strict = module.strict_loading
        if self.driver._runtime is None:
            self.driver.defer_load(path, strict, weights_only)
            return ckpt.read_rest(path, weights_only)
        if fitting:
            raise RuntimeError(
                f"Resuming fit from {path} into a module whose pipeline stages are already traced (a second"
                " fit on the same module) is not supported: its optimizer state lives in the traced layout."
                " HINT: resume in a fresh Trainer with a freshly built module (checkpoints are layout-independent)."
            )
        rest = self.driver.load(path, [], strict, weights_only)
        return rest if rest is not None else ckpt.read_rest(path, weights_only)

    def configure_metrics(self, module: nn.Module) -> None:
        """Only last-stage ranks update metrics (the driver replays their step values; a per-step
        sync would wait for ranks that never update), and epoch values sync over the pipeline and
        data ranks of this rank's tensor column (the world when tp == 1), where the other stages add
        empty states and the tensor-parallel peers' duplicate states stay out."""
        dims = self.strategy.parallel_dims
        _set_metric_sync(module, dims.axis(PP_DP).get_group() if dims.tp > 1 else None, on_step=False)


def engine_for(strategy: Any) -> StepEngine:
    """The engine of the layout the strategy applied: the pipeline driver's if it built one."""
    driver = getattr(strategy, "_pipeline", None)
    return PipelineEngine(strategy, driver) if driver is not None else EagerEngine(strategy)


__all__ = ["EVAL_HOOKS", "EagerEngine", "PipelineEngine", "StepEngine", "engine_for"]
