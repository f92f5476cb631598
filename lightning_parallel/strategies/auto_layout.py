"""What ``HybridParallelStrategy`` tells the layout planner when ``3d`` leaves the degrees "auto".

The planner itself (:mod:`lightning_parallel.planner.search`) is pure torch; this is the Lightning
side: which hardware profile the accelerator is, the compute dtype the Trainer's precision
means, the options the user fixed, and the engine's own rules (a layout the strategy would refuse,
e.g. ``compile_blocks`` with pipeline parallelism, or a Trainer precision pipelines do
not run, is rejected with the strategy's own message, not chosen and then refused).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_parallel.compat_lightning import attached_trainer
from lightning_parallel.planner.hardware import get_profile, profile_for_device
from lightning_parallel.planner.cost import Layout


def _compute_dtype(strategy: Any) -> str:
    precision = str(getattr(strategy.precision_plugin, "precision", "") or "") + " " + str(strategy.mixed_precision or "")
    if "bf16" in precision:
        return "bf16"
    if "16" in precision.replace("32", ""):
        return "fp16"
    return "fp32"


def engine_check(strategy: Any, module: nn.Module) -> Any:
    """A ``Layout -> reason | None`` callable with the strategy's validation rules for that layout."""
    from lightning_parallel.parallel.compile import check_compile_layout
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan
    from lightning_parallel.parallel.tensor.split_share import check_split_share
    from lightning_parallel.parallel.dims import ParallelDims
    from lightning_parallel.strategies.context import check_context_layout
    from lightning_parallel.strategies.options import check_pipeline_precision, validate_options
    from lightning_parallel.strategies.pipeline.config import resolve_pipeline_config

    @functools.cache
    def split_checked(tp: int, ep: int) -> None:
        import warnings

        with warnings.catch_warnings():  # the plan's notes are for the layout chosen, not each candidate
            warnings.simplefilter("ignore")
            plan = resolve_tp_plan(module, tp, user_plan=strategy.tp_plan, strict=strategy.strict_plan, split_experts=ep == 1)
        check_split_share(module, plan, strategy.tensor_parallel_min_split, ep)

    def check(layout: Layout) -> str | None:
        degrees = {
            "data_parallel_size": layout.dp, "tensor_parallel_size": layout.tp, "pipeline_parallel_size": layout.pp,
            "expert_parallel_size": layout.ep, "data_parallel_replicate_size": strategy._degrees["data_parallel_replicate_size"],
        }
        try:
            validate_options(
                degrees=degrees, zero_stage=strategy.zero_stage, cpu_offload=strategy.cpu_offload,
                mixed_precision=strategy.mixed_precision, activation_checkpointing=strategy.activation_checkpointing,
                hybrid_shard=strategy.hybrid_shard, start_method=strategy._start_method, strict_plan=strategy.strict_plan,
                sequence_parallel=strategy.sequence_parallel, tp_plan=strategy.tp_plan, loss_parallel=strategy.loss_parallel,
            )
            check_compile_layout(getattr(strategy, "_compile_kwargs", None), layout.pp, layout.tp)  # compiled blocks
            cp = layout.cp if layout.cp > 1 else strategy._degrees.get("context_parallel_size", 1)
            if isinstance(cp, int) and cp > 1:  # the planner prices cp; the strategy's own cp refusals (compile_blocks)
                check_context_layout(ParallelDims(world_size=layout.dp * layout.tp * layout.pp * cp, dp_replicate=layout.dp,
                                                  tp=layout.tp, pp=layout.pp, ep=layout.ep, cp=cp), bool(strategy.compile_blocks))
            if layout.tp > 1:  # a tp degree whose plan splits too little would be refused (split_share.py)
                split_checked(layout.tp, layout.ep)
            if layout.pp > 1:
                check_pipeline_precision(strategy.precision_plugin, layout)  # Trainer(precision) != 32-true
                resolve_pipeline_config(
                    module, layout.pp, strategy.pipeline_schedule, layout.microbatches, strategy.virtual_stages,
                    strategy.split_points, zero_stage=strategy.zero_stage, tp=layout.tp, mixed_precision=strategy.mixed_precision,
                    activation_checkpointing=strategy.activation_checkpointing, sequence_parallel=strategy.sequence_parallel,
                    loss_parallel=strategy.loss_parallel, cpu_offload=strategy.cpu_offload,
                )
        except (ValueError, TypeError) as error:
            return "the strategy refuses it: " + str(error).strip().splitlines()[0].split(". HINT:", 1)[0][:240]
        return None

    return check


def planning_view(module: nn.Module) -> nn.Module:
    """The model to choose degrees on: ``module`` itself, or a meta-device twin with its layers built.

    Lightning's idiom for large models creates the layers in ``configure_model()``, which Lightning
    calls after the strategy has set up its processes, and so after the degrees must be known. Such
    a module (no parameters yet, ``configure_model`` overridden) is planned on a deep copy whose
    ``configure_model`` runs under the meta device: shapes only, no memory, no change to the
    user's module, which Lightning then builds once for real. The Trainer it is attached to is
    shared with the copy, not copied (``configure_model`` may read ``self.trainer``).
    """
    if any(True for _ in module.parameters()) or not isinstance(module, pl.LightningModule):
        return module
    if not is_overridden("configure_model", module, pl.LightningModule):
        return module
    trainer = attached_trainer(module)  # None when planned before fit
    twin = copy.deepcopy(module, {id(trainer): trainer} if trainer is not None else {})
    with torch.device("meta"):
        twin.configure_model()
    return twin


def planner_inputs(strategy: Any, module: nn.Module) -> dict[str, Any]:
    """Keyword arguments for :func:`~lightning_parallel.planner.auto_degrees.choose_3d_degrees`."""
    devices = strategy.parallel_devices or []
    device = devices[0] if devices else torch.device("cpu")
    profile = profile_for_device(device) if device.type == "cuda" else get_profile("cpu")
    cp = strategy._degrees.get("context_parallel_size", 1)
    return {
        "context_parallel_size": cp if isinstance(cp, int) else None,  # "auto": searched where nothing without it fits
        "context_parallel_attention": getattr(strategy, "context_parallel_attention", "allgather"),
        "expert_parallel_size": strategy._degrees["expert_parallel_size"],
        "pipeline_schedule": strategy.pipeline_schedule,
        "microbatches": strategy.microbatches,
        "zero_stage": strategy.zero_stage,
        "activation_checkpointing": strategy.activation_checkpointing,
        "cpu_offload": strategy.cpu_offload,
        "hybrid_shard": strategy.hybrid_shard,
        "sequence_parallel": strategy.sequence_parallel,
        "hardware": profile,
        "device_memory": profile.memory_bytes,
        "dtype": _compute_dtype(strategy),
        "check": engine_check(strategy, module),
    }


__all__ = ["engine_check", "planner_inputs", "planning_view"]
