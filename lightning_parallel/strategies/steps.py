"""Lightning's step hooks for ``HybridParallelStrategy``: each hands the step to the layout's step
engine (``strategies/engine.py``), wraps it in the collective-error explanation, and owns what
happens around the optimizer step (ZeRO-1 sharding, the non-finite check, global-norm clipping,
no gradient sync on accumulation steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import lightning.pytorch as pl
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.compat_lightning import unwrap_optimizer
from lightning_parallel.parallel.data.apply import fsdp_modules
from lightning_parallel.parallel.data.zero1 import shard_optimizer_state
from lightning_parallel.strategies import context, precision as prec
from lightning_parallel.strategies.engine import StepEngine, engine_for
from lightning_parallel.strategies.collective_errors import explain_collective_errors


class StepHooksMixin:
    """Steps, backward, optimizer step and accumulation of ``HybridParallelStrategy``."""

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if not self._uses_zero_redundancy_optimizer:
            return
        group = self.parallel_dims.axis(self.parallel_dims.grad_axis).get_group()
        for idx, optimizer in enumerate(self.optimizers):
            sharded = shard_optimizer_state(optimizer, group)
            for config in self.lr_scheduler_configs:
                if getattr(config.scheduler, "optimizer", None) is optimizer:
                    config.scheduler.optimizer = sharded  # type: ignore[attr-defined]
            self.optimizers[idx] = sharded

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any | None = None, **kwargs: Any) -> Any:
        with self._explain("optimizer step (clipping, non-finite check, ZeRO)"):
            return self._optimizer_step(optimizer, closure, model, **kwargs)

    def _optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any | None = None, **kwargs: Any) -> Any:
        """Run the closure, let every rank agree that its loss and gradients are finite (see
        ``strategies/nonfinite.py``), then clip and step as Lightning would; a skipped step never
        reaches the optimizer on any rank."""
        if not self._nonfinite.active or prec.grad_scaler(self.precision_plugin) is not None:
            # 16-mixed: the grad scaler owns non-finite gradients (it skips the step and backs off, as torch does)
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        result = closure()
        inner = unwrap_optimizer(optimizer)
        params = [p for group in inner.param_groups for p in group["params"]]
        loss = result if isinstance(result, Tensor) else None
        step = self.lightning_module.trainer.global_step if self.lightning_module is not None else -1
        if not self._nonfinite.step_is_finite(self.lightning_module, params, loss, step, self.root_device):
            return None
        return self.precision_plugin.optimizer_step(optimizer, model=model, closure=lambda: result, **kwargs)

    def _explain(self, phase: str) -> contextlib.AbstractContextManager[None]:
        """Collective timeouts and lost peers in ``phase`` re-raised with the axes' ranks (see
        ``strategies/collective_errors.py``)."""
        return explain_collective_errors(phase, self.global_rank, self._axis_groups, self._timeout)

    def _install_global_norm_clipping(self) -> None:
        """Route Lightning's norm clipping through the layout-aware global norm."""
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: int | float) -> None:
            self._engine.clip_grad_norm(optimizer, float(clip_val))

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Remember the batch index: a step predicts from it whether Lightning's zero_grad follows,
        as Lightning decides it, and frees the gradients it would drop (``strategies/early_zero_grad.py``)."""
        self.train_batch_idx = batch_idx
        super().on_train_batch_start(batch, batch_idx)

    @property
    def _engine(self) -> StepEngine:
        """The step engine of the applied layout (``strategies/engine.py``): eager, or the pipeline's."""
        return engine_for(self)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self._engine
        with self._explain(engine.forward_phase):
            # context parallelism: this rank's chunks of the batch; the step stays active through backward
            args = context.begin_step(self.parallel_dims, self.context_parallel_attention, self.context_parallel_batch_dims, args)
            try:
                return context.global_loss(engine.training_step(*args, **kwargs))
            except BaseException:
                context.end_step()
                raise

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        try:
            with self._explain("backward (gradient reduction)"):
                return self._engine.backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            context.end_step()

    def _eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        args = context.begin_step(self.parallel_dims, self.context_parallel_attention, self.context_parallel_batch_dims, args)
        try:
            return self._engine.eval_step(hook, *args, **kwargs)
        finally:
            context.end_step()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        context.end_step()  # predictions run whole sequences on every context-parallel rank
        context.check_predict(self.parallel_dims)
        return self._engine.eval_step("predict_step", *args, **kwargs)

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip gradient reduction on accumulation steps (DDP ``no_sync``, FSDP2 gradient sync off)."""
        if isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield
            return
        roots = fsdp_modules(self.model) if self.model is not None else []
        for root in roots:
            root.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for root in roots:
                root.set_requires_gradient_sync(True, recurse=False)
