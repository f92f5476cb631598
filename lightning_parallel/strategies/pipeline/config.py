"""The pipeline options a strategy is given, validated and planned before any process communicates.

Shared by the pipeline driver (which builds the stages from the result) and the ``3d`` planner's
layout check (which asks whether a candidate layout is valid without building anything).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.pipeline.plan import PipelinePlan, plan_pipeline
from lightning_parallel.parallel.pipeline.schedules import (
    ScheduleSpec,
    check_microbatches,
    resolve_virtual_stages,
    schedule_spec,
)


@dataclass(frozen=True)
class PipelineConfig:
    """Everything decided before the first batch, identically on every rank."""

    spec: ScheduleSpec
    virtual_stages: int
    microbatches: int
    plan: PipelinePlan


def auto_microbatches(spec: ScheduleSpec, pp: int) -> int:
    """``microbatches="auto"``: one per rank (at least 2), so 1F1B's warm-up fills the pipeline;
    two per rank for the V schedules, whose 2 x pp stages each need a microbatch in flight."""
    return 2 * pp if spec.style == "v" else max(2, pp)


def resolve_pipeline_config(
    module: nn.Module,
    pp: int,
    schedule: Any,
    microbatches: Any,
    virtual_stages: Any,
    split_points: list[str] | None,
    *,
    zero_stage: int = 0,
    tp: int = 1,
    mixed_precision: str | None = None,
    activation_checkpointing: bool = False,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    cpu_offload: bool = False,
) -> PipelineConfig:
    """Validate the pipeline options and plan the stages (no process group, no collective).

    ``mixed_precision`` is accepted for the callers' sake and not checked: it is folded into the
    Trainer's precision, which the stages honour (``strategies/precision.py``)."""
    spec = schedule_spec(schedule)
    unsupported = [
        ("cpu_offload", cpu_offload, cpu_offload, "use cpu_offload=False with pipeline parallelism"),
        # Tensor parallelism inside stages (parallel/pipeline/tensor.py): the zero-bubble schedules
        # split the backward by detaching DTensor gradient views in place, which autograd refuses.
        ("pipeline_schedule", schedule, tp > 1 and spec.zero_bubble,
         "with tensor_parallel_size > 1 use gpipe, 1f1b, interleaved_1f1b or looped_bfs"),
        ("sequence_parallel", sequence_parallel, tp > 1 and sequence_parallel, "use sequence_parallel=false with pipeline parallelism"),
        ("loss_parallel", loss_parallel, tp > 1 and loss_parallel,
         "use loss_parallel=false with pipeline parallelism (the last stage hands the loss full logits)"),
    ]
    for name, value, bad, fix in unsupported:
        if bad:
            raise config_error(ValueError, name, value, f"it is not supported together with pipeline_parallel_size={pp} yet", fix)
    v = resolve_virtual_stages(spec, virtual_stages)
    m = auto_microbatches(spec, pp) if microbatches == "auto" else microbatches
    check_microbatches(spec, pp, v, m)
    plan = plan_pipeline(module, pp, v, style=spec.style, split_points=split_points)
    return PipelineConfig(spec, v, m, plan)
