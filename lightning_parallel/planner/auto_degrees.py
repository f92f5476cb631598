"""Degrees for ``strategy="3d"`` (tensor, pipeline, expert and data parallel "auto"): the planner's choice.

What ``3d`` auto means: the fastest layout the cost model predicts (:mod:`~lightning_parallel.planner.search`)
among those that fit in device memory *and* use the most model-parallel axes the model and the
world size allow. "3D" asks for model parallelism: with both tensor and pipeline degrees above 1
possible (4 devices and a dense model: only tp2 x pp2), it gets both; with MoE layers, expert
parallelism counts as a model-parallel axis (4 devices: pp2 x dp2 with ep2, or tp2 x pp2 with
the experts replicated, whichever the planner predicts faster; 8 devices: all four axes). The
unrestricted best (often plain data parallelism for a small model) is what the dry run
``python -m lightning_parallel.plan --search`` ranks first (``--3d`` shows what ``3d`` chooses from).

Options given to the strategy are kept (ZeRO stage, activation checkpointing, schedule,
microbatches, an int ``data_parallel_size`` or ``expert_parallel_size``); the planner fills in
only the "auto" degrees. The hardware profile is fixed per device type (never measured here),
and the batch is a nominal one (two sequences per device of the model's maximum length: the
data loader does not exist yet when the degrees are chosen), so every rank computes the same
choice without talking to the others. A model that allows no model-parallel degree above 1 is
an error listing every degree tried and why it failed, not a silent fallback to data parallelism.

Context parallelism: with an int ``context_parallel_size`` the strategy asks for the degrees of the
``world / cp`` ranks left, and the planner prices them on the whole world with that ``cp`` fixed (each
rank holds ``1/cp`` of every sequence, gradients over ``dp x cp``), so the choice sees the memory cp
saves. With ``context_parallel_size="auto"`` the planner chooses cp too, searching it only where no
layout without it fits at the nominal batch (the model's longest sequence): ``3d`` turns to context
parallelism for long sequences, not by default. The strategy's own check refuses what cp does not
compose with (``compile_blocks``; ``strategies/auto_layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_parallel.parallel.errors import config_error
from lightning_parallel.planner.hardware import HardwareProfile
from lightning_parallel.planner.search import LayoutCheck, PlanResult, SearchSpace, plan_layouts
from lightning_parallel.planner.model import model_facts


@dataclass(frozen=True)
class DegreeChoice:
    """The chosen degrees, and the planner's result that explains them (for the log line)."""

    dp: int
    tp: int
    pp: int
    tried: tuple[str, ...]
    ep: int = 1
    plan: PlanResult | None = None
    cp: int = 1  # fixed by the user, or chosen for context_parallel_size="auto" (module docstring)

    def explain(self) -> str:
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        head = f"3d degrees: dp={self.dp}{cp} x tp={self.tp} x pp={self.pp} (ep={self.ep})"
        return head + ("\n" + self.plan.explain() if self.plan is not None else "; " + "; ".join(self.tried))


def _auto_or_int(name: str, value: Any, world_size: int) -> int | None:
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (name == "data_parallel_size" and world_size % value):
        raise config_error(
            ValueError, name, value, f"it must divide the world size {world_size}" if name == "data_parallel_size" else "a positive int or 'auto'",
            'choose a divisor of the number of processes, or "auto"',
        )
    return value


def choose_3d_degrees(
    module: nn.Module,
    world_size: int,
    *,
    processes_per_node: int,
    data_parallel_size: int | str = "auto",
    expert_parallel_size: int | str = "auto",
    tp_plan: dict[str, str] | None = None,
    virtual_stages: int = 1,
    split_points: list[str] | None = None,
    pipeline_schedule: str | None = None,
    microbatches: Any = "auto",
    zero_stage: int = 0,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    hybrid_shard: bool = False,
    sequence_parallel: bool = False,
    hardware: str | HardwareProfile = "cpu",
    device_memory: int | None = None,
    dtype: str = "fp32",
    global_batch: int | None = None,
    seq_len: int | None = None,
    check: LayoutCheck | None = None,
    context_parallel_size: int | None = 1,
    context_parallel_attention: str = "allgather",
) -> DegreeChoice:
    """Tensor, pipeline, expert and data degrees for ``module`` on ``world_size`` processes (module docstring).

    ``pipeline_schedule=None`` lets the planner pick among 1F1B, interleaved 1F1B and GPipe;
    ``microbatches`` "auto" is the strategy's rule (one per stage, at least 2). With
    ``context_parallel_size`` ``cp > 1``, ``world_size`` is the ranks per context-parallel rank
    (``world / cp``) and the layouts are priced on ``world_size x cp`` devices; ``None`` (the strategy's
    ``context_parallel_size="auto"``) searches cp on ``world_size`` devices where nothing without it fits
    (at the model's longest sequence, ``seq_len`` unless given).
    """
    if not any(True for _ in module.parameters()):
        raise config_error(
            ValueError, "tensor_parallel_size / pipeline_parallel_size", '"auto"',
            "choosing 3D degrees reads the model's layers, and this model has none yet (built in configure_model?)",
            "give tensor_parallel_size and pipeline_parallel_size as ints",
        )
    if world_size < 2:  # the planner would find only the single-process layout and list nothing it tried
        raise config_error(
            ValueError, "tensor_parallel_size / pipeline_parallel_size", f'"auto" on world size {world_size}',
            "strategy '3d' chooses a tensor-, pipeline- or expert-parallel degree above 1, and any such degree needs"
            " at least 2 processes",
            "run on 2 or more devices (4 gives tp2 x pp2), give the degrees as ints, or use 'dp' / 'zero3' on one",
        )
    dp = _auto_or_int("data_parallel_size", data_parallel_size, world_size)
    ep = _auto_or_int("expert_parallel_size", expert_parallel_size, world_size)
    facts = model_facts(module, tp_plan=tp_plan, split_points=split_points)
    schedules = (pipeline_schedule,) if pipeline_schedule else ("1f1b", "interleaved_1f1b", "gpipe")

    def auto_microbatches(pp: int, schedule: str) -> int:
        if microbatches != "auto":
            return int(microbatches)
        return 2 * pp if schedule in ("zbv", "dualpipev") else max(2, pp)

    cp = context_parallel_size
    space = SearchSpace(
        data_parallel_size=dp, expert_parallel_size=ep, zero_stages=(zero_stage,),
        activation_checkpointing=(activation_checkpointing,), cpu_offload=(cpu_offload,), hybrid_shard=(hybrid_shard,),
        sequence_parallel=(sequence_parallel,),
        schedules=schedules, virtual_stages=virtual_stages if virtual_stages > 1 else 2,
        microbatches=auto_microbatches, require_model_parallel=True,
        context_parallel_size=cp, context_parallel_attention=(context_parallel_attention,),
    )
    seq = seq_len or facts.max_seq or 128
    if cp is not None and cp > 1:  # a nominal length that the 2 x cp head-tail chunks cut evenly (the real batch is not known yet)
        seq = max(2 * cp, seq // (2 * cp) * 2 * cp)
    batch = global_batch or 2 * world_size * (virtual_stages if virtual_stages > 1 else 1)
    result = plan_layouts(
        facts, world_size * (cp or 1), global_batch=batch, seq_len=seq, hardware=hardware, devices_per_node=processes_per_node,
        device_memory=device_memory, dtype=dtype, space=space, check=check,
    )
    chosen = result.chosen.layout  # raises the listed reasons when nothing with model parallelism fits
    tried = tuple(f"{r.what}: {r.reason}" for r in result.rejected[:8])
    return DegreeChoice(dp=chosen.dp, tp=chosen.tp, pp=chosen.pp, ep=chosen.ep, tried=tried, plan=result, cp=chosen.cp)


__all__ = ["DegreeChoice", "choose_3d_degrees"]
