"""Pipeline schedules by name, where their stages live, and what microbatch counts they accept.

Why this file exists apart from ``torch.distributed.pipelining``: a schedule that is handed a
microbatch count it cannot serve may hang in a send/recv or raise on one rank only, while
its peers wait. Every rule a schedule has is checked here, from plain integers, so that each
rank raises the same typed error before any process waits on another.

Stages are numbered along the model (stage 0 holds the embedding, the last stage the head).
Single-stage schedules put stage ``r`` on pipeline rank ``r``. Looped schedules (interleaved
1F1B, looped BFS, interleaved zero bubble) give each rank ``virtual_stages`` stages spaced
``pp`` apart: rank ``r`` holds ``r, r + pp, ...``. V-shaped schedules (ZBV, DualPipeV) give
each rank two stages that mirror each other: rank ``r`` holds ``r`` and ``2 pp - 1 - r``, so
the first and the last stage share rank 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, fx
from torch.distributed.pipelining import Pipe
from torch.distributed.pipelining import schedules as _sched

from lightning_parallel.compat import (
    GraphPipelineStage,
    PipelineAction,
    PipelineComputationType,
    PipelineScheduleRuntime,
    modify_graph_op_device,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
)
from lightning_parallel.parallel.errors import config_error

StageStyle = Literal["single", "loop", "v"]


@dataclass(frozen=True)
class ScheduleSpec:
    """What the engine needs to know about one schedule before building it."""

    name: str
    cls: type
    style: StageStyle
    zero_bubble: bool = False

    @property
    def multi_stage(self) -> bool:
        return self.style != "single"


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("gpipe", _sched.ScheduleGPipe, "single"),
    "1f1b": ScheduleSpec("1f1b", _sched.Schedule1F1B, "single"),
    "interleaved_1f1b": ScheduleSpec("interleaved_1f1b", _sched.ScheduleInterleaved1F1B, "loop"),
    "looped_bfs": ScheduleSpec("looped_bfs", _sched.ScheduleLoopedBFS, "loop"),
    "interleaved_zb": ScheduleSpec("interleaved_zb", _sched.ScheduleInterleavedZeroBubble, "loop", zero_bubble=True),
    "zbv": ScheduleSpec("zbv", _sched.ScheduleZBVZeroBubble, "v", zero_bubble=True),
    "dualpipev": ScheduleSpec("dualpipev", _sched.ScheduleDualPipeV, "v", zero_bubble=True),
}
"""Accepted ``pipeline_schedule`` values. Naive layer placement is ``gpipe`` with one microbatch."""


def schedule_spec(name: Any) -> ScheduleSpec:
    """Look a schedule up by its config name (case-insensitive; ``-`` and ``_`` are the same)."""
    if not isinstance(name, str):
        raise config_error(TypeError, "pipeline_schedule", name, "a schedule is named by a string", f"use one of {sorted(SCHEDULES)}")
    key = name.lower().replace("-", "_")
    if key not in SCHEDULES:
        raise config_error(ValueError, "pipeline_schedule", name, "unknown schedule", f"use one of {sorted(SCHEDULES)}")
    return SCHEDULES[key]


def resolve_virtual_stages(spec: ScheduleSpec, virtual_stages: int | Literal["auto"]) -> int:
    """Stages per rank: 1 for single-stage schedules, 2 for V schedules, >= 2 for looped ones."""
    if virtual_stages == "auto":
        return 1 if spec.style == "single" else 2
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int):
        raise config_error(TypeError, "virtual_stages", virtual_stages, 'it is an int or "auto"', 'use virtual_stages="auto"')
    if spec.style == "single" and virtual_stages != 1:
        raise config_error(
            ValueError,
            "virtual_stages",
            virtual_stages,
            f"schedule {spec.name!r} runs one stage per rank",
            "use virtual_stages=1, or pipeline_schedule='interleaved_1f1b' for several stages per rank",
        )
    if spec.style == "v" and virtual_stages != 2:
        raise config_error(ValueError, "virtual_stages", virtual_stages, f"schedule {spec.name!r} runs exactly two stages per rank (a V)", "use virtual_stages=2")
    if spec.style == "loop" and virtual_stages < 2:
        raise config_error(
            ValueError,
            "virtual_stages",
            virtual_stages,
            f"schedule {spec.name!r} interleaves at least two stages per rank",
            "use virtual_stages=2 (or more), or pipeline_schedule='1f1b' for one stage per rank",
        )
    return virtual_stages


def stage_to_rank(num_stages: int, pp_size: int, style: StageStyle) -> list[int]:
    """``result[stage]`` is the pipeline rank (index in the pp group) that runs ``stage``."""
    assert num_stages % pp_size == 0, (num_stages, pp_size)
    if style != "v":
        return [stage % pp_size for stage in range(num_stages)]
    return [stage if stage < pp_size else 2 * pp_size - 1 - stage for stage in range(num_stages)]


def stages_of_rank(pp_rank: int, num_stages: int, pp_size: int, style: StageStyle) -> list[int]:
    """The stage indices one pipeline rank runs, in increasing order."""
    return [s for s, r in enumerate(stage_to_rank(num_stages, pp_size, style)) if r == pp_rank]


def check_microbatches(spec: ScheduleSpec, pp_size: int, virtual_stages: int, microbatches: Any) -> int:
    """Raise unless ``spec`` can run ``microbatches`` microbatches on ``pp_size`` ranks.

    The rules mirror what each torch schedule needs to finish (1F1B would otherwise raise on
    some ranks only; the V schedules would wait for microbatches that never come).
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int):
        raise config_error(TypeError, "microbatches", microbatches, "it is a positive int", "pass e.g. microbatches=4")
    if microbatches < 1:
        raise config_error(ValueError, "microbatches", microbatches, "at least one microbatch is needed", "use microbatches >= 1")
    m, p = microbatches, pp_size
    if spec.name == "1f1b" and m < p:
        raise config_error(
            ValueError,
            "microbatches",
            m,
            f"schedule '1f1b' needs at least as many microbatches as stages ({p}); with fewer its warm-up never ends",
            f"use microbatches >= {p}, or pipeline_schedule='gpipe'",
        )
    rounds = max(1, m // p)
    if spec.name in ("interleaved_1f1b", "interleaved_zb") and m % rounds:
        # torch cuts the microbatches into m // p rounds and cannot schedule a partial round.
        ok = [c for c in range(max(1, m - 2 * p), m + 2 * p) if c % max(1, c // p) == 0]
        raise config_error(
            ValueError,
            "microbatches",
            m,
            f"schedule {spec.name!r} runs microbatches in {rounds} equal rounds (microbatches // pipeline_parallel_size), "
            f"so it must be a multiple of {rounds}",
            f"use one of microbatches={ok}",
        )
    if spec.name == "dualpipev" and m < 2 * p:
        raise config_error(
            ValueError,
            "microbatches",
            m,
            f"schedule 'dualpipev' (a V of {2 * p} stages on {p} ranks) needs at least as many microbatches as stages ({2 * p})",
            f"use microbatches >= {2 * p}, or pipeline_schedule='zbv'",
        )
    return m


def check_batch_size(batch_size: int, microbatches: int, microbatch_size: int | None = None) -> None:
    """The batch must split into ``microbatches`` equal parts of the traced size (shapes are fixed)."""
    if batch_size % microbatches:
        raise config_error(
            ValueError,
            "batch_size",
            batch_size,
            f"a batch is cut into microbatches={microbatches} equal microbatches, so it must be divisible by {microbatches}",
            "choose a batch size that is a multiple of microbatches and set drop_last=True on the DataLoader",
        )
    if microbatch_size is not None and batch_size // microbatches != microbatch_size:
        raise config_error(
            ValueError,
            "batch_size",
            batch_size,
            f"the pipeline was traced for microbatches of {microbatch_size} rows (batch {microbatch_size * microbatches}); "
            "traced stages have fixed shapes",
            "keep every batch the same size (drop_last=True on the DataLoader), or build the pipeline for this batch size",
        )


def build_schedule(
    spec: ScheduleSpec,
    stages: list[Any],
    microbatches: int,
    loss_fn: Callable[..., torch.Tensor] | None,
) -> Any:
    """Instantiate the torch schedule. Gradients are never scaled by torch (``scale_grads=False``):
    it divides the whole accumulated ``.grad``, which breaks gradient accumulation across steps
    and divides a parameter twice when two local stages share it; the engine scales the loss instead.
    """
    if spec.style == "single":
        assert len(stages) == 1, len(stages)
        return spec.cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    return spec.cls(stages, microbatches, loss_fn=loss_fn, scale_grads=False)


class _ForwardOnlyMapping(_sched.PipelineScheduleMulti):
    """Sets the stage placement of a forward-only order (torch's validator insists on backwards)."""

    _stage_ranks: list[int]

    def _validate_and_set_stage_mapping(self, actions: dict[int, list[Any]]) -> None:
        self.stage_index_to_group_rank = dict(enumerate(self._stage_ranks))
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank


def merge_microbatch_outputs(chunks: list[Any], reduction: Literal["mean", "sum"]) -> Any:
    """The microbatches' outputs as one batch's. Tensors with a batch dim are concatenated along it
    (torch's default merge); a 0-dim tensor, a loss the model computes per microbatch (an
    encoder-decoder given ``labels=``), is their mean or sum (``reduction``, as for the training
    loss), where torch's merge fails to concatenate it; anything else is microbatch 0's."""
    flattened = [tree_flatten(chunk) for chunk in chunks]
    flat, spec = [leaves for leaves, _ in flattened], flattened[0][1]
    merged: list[Any] = []
    for values in zip(*flat):
        if isinstance(values[0], Tensor) and values[0].dim() > 0:
            merged.append(torch.cat(values))
        elif isinstance(values[0], Tensor):
            total = torch.stack(values).sum()
            merged.append(total / len(values) if reduction == "mean" else total)
        else:
            merged.append(values[0])
    return tree_unflatten(merged, spec)


class _MergedOutputs:
    """An evaluation schedule's merge of its microbatches' outputs (:func:`merge_microbatch_outputs`)."""

    loss_reduction: Literal["mean", "sum"] = "mean"

    def _merge_outputs(self, output_chunks: list[Any]) -> Any:
        return merge_microbatch_outputs(output_chunks, self.loss_reduction)


class ForwardOnlyGPipe(_MergedOutputs, _sched.ScheduleGPipe):
    """torch's GPipe forward (one stage per rank), with the merge above."""


class ForwardOnlyMulti(_MergedOutputs, PipelineScheduleRuntime, _ForwardOnlyMapping):
    """Forward-only schedule for several stages per rank, in any placement (loop or V).

    torch's multi-stage schedules run their backward actions even without a loss function, so
    they cannot evaluate. Here each rank runs its stages in model order, all microbatches of a
    stage before the next: every forward waits only on an earlier stage, so no rank waits in a
    cycle, whatever the placement. torch lowers this order to sends and receives as usual.
    """

    def __init__(self, stages: list[Any], microbatches: int, stage_ranks: list[int]) -> None:
        self._stage_ranks = list(stage_ranks)
        super().__init__(stages=stages, n_microbatches=microbatches, loss_fn=None, scale_grads=False)
        order: dict[int, list[Any]] = {r: [] for r in range(self.pp_group_size)}
        for stage, rank in enumerate(stage_ranks):
            order[rank].extend(PipelineAction(stage, PipelineComputationType.FORWARD, mb) for mb in range(microbatches))
        self.pipeline_order = order
        self._prepare_schedule_with_comms(order)


def build_eval_schedule(spec: ScheduleSpec, stages: list[Any], microbatches: int, stage_ranks: list[int],
                        loss_reduction: Literal["mean", "sum"] = "mean") -> Any:
    """A forward-only schedule over the same stages placement as ``spec``'s training schedule."""
    if spec.style == "single":
        assert len(stages) == 1, len(stages)
        schedule: Any = ForwardOnlyGPipe(stages[0], microbatches, loss_fn=None, scale_grads=False)
    else:
        schedule = ForwardOnlyMulti(stages, microbatches, stage_ranks)
    schedule.loss_reduction = loss_reduction
    return schedule


def microbatch_example(args: tuple[Any, ...], kwargs: dict[str, Any], microbatches: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The first microbatch of a batch: every tensor sliced along dim 0 (what the schedule feeds a stage)."""
    size = batch_size_of(args, kwargs)
    check_batch_size(size, microbatches)
    rows = size // microbatches
    cut = tree_map(lambda t: t[:rows] if isinstance(t, Tensor) else t, (tuple(args), dict(kwargs)))
    return cut[0], cut[1]


def first_batched(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return leaf
    raise config_error(TypeError, "batch", type(args).__name__, "the forward inputs contain no batched tensor to cut into microbatches", "pass tensors whose dim 0 is the batch")


def batch_size_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Rows of the batch: dim 0 of the first batched tensor among the forward inputs."""
    return int(first_batched(args, kwargs).shape[0])


def _contiguous_meta(meta: Any) -> Any:
    """The same tensor metadata with row-major strides (what a receive buffer is allocated from)."""
    if meta is None or not hasattr(meta, "stride"):
        return meta
    return dataclasses.replace(meta, stride=torch.empty(meta.shape, device="meta").stride())


def _without_grad(meta: Any) -> Any:
    return dataclasses.replace(meta, requires_grad=False) if meta is not None and hasattr(meta, "requires_grad") else meta


def _contiguous_ops(ops: list[dist.P2POp]) -> list[dist.P2POp]:
    for op in ops:
        if isinstance(op.tensor, Tensor) and not op.tensor.is_contiguous():
            op.tensor = op.tensor.contiguous()  # the send's work keeps the copy alive until it completes
    return ops


class TracedStage(GraphPipelineStage):
    """A traced stage that sends and receives contiguous tensors, and whose start-up handshake
    skips neighbours on its own rank.

    * Contiguity: torch allocates receive buffers with the strides the traced example had and
      sends stage outputs as they are; a Hugging Face model hands non-contiguous tensors across
      a cut (GPT-2's attention output after ``transpose``, Llama's rotary ``cos``/``sin``), and
      gloo (like NCCL) sends and receives contiguous memory only ("input tensor has to be
      contiguous"). The values crossing are the same in any layout, so buffers and sent tensors
      are made row-major; the receiving graph runs on them unchanged (a contiguous tensor
      supports every view the traced graph takes).
    * Handshake: torch's handshake for traced stages sends a dummy tensor to the previous and
      next stage; in a V schedule two adjacent stages share a rank and gloo cannot send to
      itself, so the first step crashes. Local neighbours exchange tensors in memory and need
      no handshake.
    """

    def __init__(self, *args: Any, cut_grads: tuple[list[bool], list[bool]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cut_grads = cut_grads  # (inputs, outputs) that carry a gradient (parallel/pipeline/cut_grads.py); None: all floating ones

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        me = self.group_rank
        ops = super()._get_init_p2p_neighbors_ops()
        return [op for op in ops if op.group_peer != me]

    def _create_act_recv_info(self) -> tuple[Any, ...]:
        infos = super()._create_act_recv_info()
        for i, info in enumerate(infos):
            if info.buffer is not None and not info.buffer.is_contiguous():
                grad = info.buffer.requires_grad
                info.buffer = torch.empty(info.buffer.shape, dtype=info.buffer.dtype, device=info.buffer.device).requires_grad_(grad)
                info.tensor_meta = _contiguous_meta(info.tensor_meta)
            if self.cut_grads is not None and not self.cut_grads[0][i] and info.buffer is not None:
                # No gradient for it: none is computed, none sent back (its sender posts no receive).
                info.buffer.requires_grad_(False)
                info.tensor_meta = _without_grad(info.tensor_meta)
        return infos

    def _create_act_send_info(self) -> dict[int, list[Any]]:
        info = super()._create_act_send_info()
        # The next stage's gradient for each output arrives in a buffer allocated from these.
        metas = [_contiguous_meta(m) for m in self._stage_meta.outputs]
        if self.cut_grads is not None and not self.is_last:  # an output nobody differentiates: no gradient receive posted for it
            metas = [m if needs else _without_grad(m) for m, needs in zip(metas, self.cut_grads[1], strict=True)]
        self._stage_meta.outputs = tuple(metas)
        return info

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return _contiguous_ops(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return _contiguous_ops(super().get_bwd_send_ops(bwd_chunk_id))


def build_stage(pipe: Pipe, index: int, device: torch.device, group: dist.ProcessGroup,
                cut_grads: tuple[list[bool], list[bool]] | None = None) -> GraphPipelineStage:
    """``Pipe.build_stage`` with :class:`TracedStage` (same steps: device fix-up, then the stage)."""
    stage_module = pipe.get_stage_module(index)
    if isinstance(stage_module, fx.GraphModule):
        modify_graph_op_device(stage_module, device)
    return TracedStage(stage_module, index, pipe.info(), device, group, cut_grads=cut_grads)
