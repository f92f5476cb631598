"""What ``HybridParallelStrategy`` decides before its process group exists, callable without processes.

Why one function for both: the dry run (``python -m lightning_parallel.plan``) must print what a
job would do, and it once resolved the degrees on its own (``ParallelDims.resolve`` with the
preset's values). For a preset with automatic degrees that path differs from the strategy's:
``strategy="3d"`` chooses tensor and pipeline degrees from the model and the world size, so the
dry run printed "pp=8" (and failed: "8 stages > 4 blocks") where the job would run dp2 x tp2 x pp2.
Here the dry run hands the strategy what the Trainer would (processes per node, device type,
precision plugin, ``sync_batchnorm``, the meta-device model) and asks the strategy itself, through
:func:`resolve_layout`: the first steps of ``setup_environment()``, in the same order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn

from lightning_parallel.errors import config_error
from lightning_parallel.parallel.dims import ParallelDims
from lightning_parallel.parallel.tensor.plan import TensorParallelPlan
from lightning_parallel.planner.auto_degrees import DegreeChoice

# Lightning's legacy spellings of ``Trainer(precision=)`` (lightning.fabric.connector), as the Trainer reads them.
_PRECISION_ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}


def trainer_precision_plugin(precision: str | int | None, device_type: str) -> Precision:
    """The precision plugin ``Trainer(precision=...)`` gives a strategy of this package.

    Mirrors Lightning's accelerator connector for a strategy that is not FSDP, DeepSpeed or XLA
    (``16-mixed`` on CPU becomes ``bf16-mixed``, as the Trainer does with a warning). Only the
    plugin's ``precision`` string enters the layout decisions (compute dtype, what pipelines
    honour), so a precision without its own class here keeps that string on a base plugin.
    """
    flag = _PRECISION_ALIASES.get(str(precision), str(precision)) if precision is not None else "32-true"
    if flag == "32-true":
        return Precision()
    if flag == "64-true":
        return DoublePrecision()
    if flag in ("16-true", "bf16-true"):
        return HalfPrecision(flag)  # type: ignore[arg-type]
    if flag in ("16-mixed", "bf16-mixed"):
        flag = "bf16-mixed" if device_type == "cpu" else flag
        return MixedPrecision(flag, "cpu" if device_type == "cpu" else "cuda")  # type: ignore[arg-type]
    plugin = Precision()
    plugin.precision = flag  # type: ignore[assignment]
    return plugin


def resolve_layout(strategy: Any, world_size: int | None = None) -> ParallelDims:
    """The degrees and plan checks of ``setup_environment()``, in its order, with no collective.

    The deprecated ``mixed_precision=`` folded into the precision plugin, the degrees resolved
    (``"auto"`` included: ``3d`` asks the planner), the combinations context parallelism refuses,
    the tensor-parallel plan and the experts checked, then the layer-sync and pipeline-precision
    refusals. Sets ``strategy._dims``.
    """
    from lightning_parallel.strategies import precision as prec
    from lightning_parallel.strategies.context import check_context_layout
    from lightning_parallel.strategies.layer_sync import check_layer_sync
    from lightning_parallel.strategies.options import check_pipeline_precision

    strategy.precision_plugin = prec.resolve_precision_plugin(strategy.precision_plugin, strategy.mixed_precision, strategy.root_device.type)
    strategy._dims = strategy.resolve_dims(world_size)
    check_context_layout(strategy._dims, bool(strategy.compile_blocks))
    strategy._resolve_plans()
    check_layer_sync(strategy._layer_sync, strategy._dims, strategy.lightning_module)
    check_pipeline_precision(strategy.precision_plugin, strategy._dims)
    return strategy._dims


@dataclass(frozen=True)
class Preflight:
    """What the strategy resolved for one world: degrees, the 3d choice (if any), the tp plan (if checked)."""

    dims: ParallelDims
    choice: DegreeChoice | None
    tp_plan: TensorParallelPlan | None
    processes_per_node: int
    device_type: str


def _device_type(accelerator: str | None) -> str:
    """The device type the Trainer's ``accelerator`` means (CUDA or CPU: the planner has profiles for those)."""
    name = str(accelerator or "auto").lower()
    if name in ("gpu", "cuda"):
        return "cuda"
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu"


@contextlib.contextmanager
def _quiet_rank_zero_info() -> Generator[None, None, None]:
    """The strategy logs its 3d choice at INFO for a job's log; the dry run prints it on stdout instead."""
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def preflight(
    strategy: Any,
    module: nn.Module,
    world_size: int,
    *,
    num_nodes: int = 1,
    accelerator: str | None = "cpu",
    precision: str | int | None = "32-true",
    sync_batchnorm: bool = False,
) -> Preflight:
    """Prepare ``strategy`` as ``Trainer(devices=world_size // num_nodes, num_nodes=...)`` would, then resolve.

    ``module`` is the (meta-device) model the job trains; ``strategy`` a fresh, unconnected
    ``HybridParallelStrategy`` (it is connected to ``module`` here and used up by the call).
    """
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1 or world_size % num_nodes:
        raise config_error(
            ValueError, "trainer.num_nodes", num_nodes, f"the world size {world_size} must be num_nodes x devices per node",
            "give +world_size=N with N a multiple of trainer.num_nodes",
        )
    device_type = _device_type(accelerator)
    per_node = world_size // num_nodes
    strategy.num_nodes = num_nodes
    strategy.parallel_devices = (
        [torch.device("cuda", i) for i in range(per_node)] if device_type == "cuda" else [torch.device("cpu")] * per_node
    )
    strategy.precision_plugin = trainer_precision_plugin(precision, device_type)
    if sync_batchnorm:
        from lightning.pytorch.plugins import TorchSyncBatchNorm

        strategy._layer_sync = TorchSyncBatchNorm()
    strategy.connect(module)
    with _quiet_rank_zero_info():
        dims = resolve_layout(strategy, world_size)
    cached = strategy._degree_choice
    return Preflight(
        dims=dims, choice=cached[1] if cached is not None else None, tp_plan=strategy._tp_resolved,
        processes_per_node=per_node, device_type=device_type,
    )


__all__ = ["Preflight", "preflight", "resolve_layout", "trainer_precision_plugin"]
