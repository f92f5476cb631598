"""The Trainer's ``precision=`` as the one precision knob of ``HybridParallelStrategy``.

What each value means under every layout (dp, zero1-3, hsdp, tp, ep, pp, 3d):

* ``32-true``: fp32 everywhere (Lightning's default).
* ``bf16-mixed`` / ``16-mixed``: the step (forward, the user's loss) runs under
  ``torch.autocast`` (Lightning's ``MixedPrecision`` plugin), so matmuls compute in the low
  dtype and the ops autocast keeps in fp32 (softmax, norms, ``cross_entropy``) stay fp32 in every
  layout. Master weights stay fp32 and gradients are reduced in fp32. Where FSDP2 holds the
  parameters under ``bf16-mixed``, its ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
  is derived from it (half the all-gather bytes; why not under 16-mixed: :func:`fsdp_param_dtype`); the root of the FSDP2 tree is the step wrapper, whose
  "inputs" are the user's batch, so the root never casts its inputs: targets, masks and
  integer inputs reach ``training_step`` as the DataLoader made them.
  Pipelines run the whole schedule (the stages' forward and the per-microbatch loss) under the
  same autocast; the stages are traced under it too, so the tensors crossing a cut are
  received in the dtype autocast gives them (bf16 where the producing op is a matmul, fp32
  where the residual stream keeps fp32), which is the dtype one process would hold there.
* ``16-mixed`` adds loss scaling. Lightning's per-process ``GradScaler`` decides on overflow
  from the gradients one rank holds; with sharded (FSDP2, DTensor) or pipelined gradients ranks
  hold different gradients and would decide differently (one rank steps, another skips). It is
  replaced by torch's ``ShardedGradScaler`` (:class:`LayoutGradScaler`: on the gradients' local
  parts) with the same settings, which all-reduces the overflow flag over the world. Under pipelines the schedule backpropagates the scaled loss.
* ``bf16-true``: as in Lightning, the module is converted to bf16 (and so are the batch's float tensors).

The strategy's own ``mixed_precision=`` option is a deprecated alias: a value that agrees with
the Trainer's precision (or is given with the Trainer's default, ``32-true``) becomes the
Trainer's precision, with a deprecation warning; one that contradicts it is a typed error.
"""

from __future__ import annotations

import contextlib
import warnings
from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from lightning_parallel.errors import config_error

MIXED = ("bf16-mixed", "16-mixed")
PIPELINE_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
"""The Trainer precisions pipeline stages honour (each trained under pp in tests/test_precision.py);
others (16-true, 64-true, transformer-engine, bitsandbytes: not tested there) are refused."""


def trainer_precision(plugin: Any) -> str:
    """The precision string of a Lightning precision plugin (``"32-true"`` for the default one)."""
    value = str(getattr(plugin, "precision", "32-true"))
    return "32-true" if value == "32" else value


def mixed_compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a ``*-mixed`` precision, None for every other precision."""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)


def warn_mixed_precision_deprecated(mixed_precision: str | None) -> None:
    """Called at construction: the option still works, but it is the Trainer's knob now."""
    if mixed_precision is None:
        return
    warnings.warn(
        f"HybridParallelStrategy(mixed_precision={mixed_precision!r}) is deprecated: the Trainer's precision is the one"
        f" precision knob under every layout. Use Trainer(precision={mixed_precision!r}) and drop mixed_precision.",
        DeprecationWarning,
        stacklevel=3,
    )


def resolve_precision_plugin(plugin: Precision, mixed_precision: str | None, device_type: str) -> Precision:
    """The precision plugin the run uses, with the deprecated ``mixed_precision=`` folded into it.

    ``mixed_precision`` None or ``"32-true"``: the Trainer's plugin as it is. Otherwise the
    Trainer's precision must be the same value, or the default ``32-true`` (then a Lightning
    ``MixedPrecision`` plugin of that value takes its place); anything else contradicts it.
    """
    if mixed_precision in (None, "32-true"):
        return plugin
    current = trainer_precision(plugin)
    if current == mixed_precision:
        return plugin
    if type(plugin) is Precision:  # the Trainer's default (32-true): the alias decides
        return MixedPrecision(mixed_precision, device=device_type)  # type: ignore[arg-type]
    raise config_error(
        ValueError, "mixed_precision", mixed_precision,
        f"it contradicts Trainer(precision={current!r}); the Trainer's precision is the one knob (mixed_precision is a"
        " deprecated alias of it)",
        f"drop mixed_precision from the strategy and keep Trainer(precision={current!r}), or pass"
        f" Trainer(precision={mixed_precision!r})",
    )


def fsdp_param_dtype(plugin: Precision) -> str | None:
    """What FSDP2's mixed-precision policy gathers parameters in (``apply_fsdp``'s ``mixed_precision``), or None.

    ``bf16-mixed`` only. Under ``*-true`` the parameters already have the low dtype. Under
    ``16-mixed`` FSDP2 keeps fp32 parameters and autocast computes in fp16: fp16 parameters would
    give the ops autocast leaves alone (embedding, norm weights) fp16 gradients that overflow
    where one process's fp32 gradients do not (measured: the scaler backed off one step more
    than one process did), so the loss scale would no longer follow one process's."""
    return "bf16-mixed" if trainer_precision(plugin) == "bf16-mixed" else None


def grad_scaler(plugin: Precision) -> Any | None:
    """The plugin's gradient scaler (``16-mixed``), or None."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if scaler is not None and getattr(scaler, "is_enabled", lambda: True)() else None


class LayoutGradScaler(ShardedGradScaler):
    """torch's ``ShardedGradScaler`` checking and unscaling the local part of every gradient.

    Why: torch unscales a device's gradients in one foreach call, and under tensor parallelism
    they mix DTensors with plain tensors (modules the plan leaves whole), which DTensor refuses
    ("got mixed torch.Tensor and DTensor"). Each rank unscales what it holds, in place (a
    DTensor's local tensor is its storage), and ``unscale_`` all-reduces the overflow flag over
    the world as before. Relies on ``_unscale_grads_`` reading only ``param_groups[*]["params"][*].grad``
    (torch 2.12-2.13).
    """

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool = True) -> Any:
        local = SimpleNamespace(param_groups=[
            {"params": [SimpleNamespace(grad=p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in group["params"]]}
            for group in optimizer.param_groups
        ])
        return super()._unscale_grads_(local, inv_scale, found_inf, allow_fp16)


def use_sharded_grad_scaler(plugin: Precision, device_type: str) -> None:
    """Swap a per-process ``GradScaler`` for a :class:`LayoutGradScaler` with the same settings.

    Why: overflow must be one decision for all ranks (see the module docstring). Its found-inf
    all-reduce runs over the world, so every rank (every stage, every shard) takes it. Called in
    ``setup()``, after the callbacks' ``setup`` (a callback may install its own scaler).
    """
    scaler = grad_scaler(plugin)
    if scaler is None or isinstance(scaler, LayoutGradScaler):
        return
    state = scaler.state_dict()
    sharded = LayoutGradScaler(
        device=device_type, init_scale=state["scale"], growth_factor=state["growth_factor"],
        backoff_factor=state["backoff_factor"], growth_interval=state["growth_interval"],
    )
    sharded.load_state_dict(state)
    plugin.scaler = sharded  # type: ignore[attr-defined]


def pipeline_step_context(plugin: Precision, hook: str) -> contextlib.AbstractContextManager[Any]:
    """The plugin's context for ``hook`` (autocast for ``*-mixed``, the default dtype for ``*-true``),
    around the pipeline schedule: Lightning enters it in ``Strategy.training_step`` and friends,
    which the pipeline path does not call."""
    contexts = {
        "training_step": plugin.train_step_context,
        "validation_step": plugin.val_step_context,
        "test_step": plugin.test_step_context,
        "predict_step": plugin.predict_step_context,
    }
    return contexts[hook]()
