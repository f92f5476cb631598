"""Pipeline parallelism for an unchanged ``nn.Module``: build this rank's stages and run their schedules.

Tracing and cutting live in :mod:`~lightning_parallel.parallel.pipeline.trace`.

The model's own ``forward`` is traced by ``torch.distributed.pipelining``'s tracer frontend
(``torch.export`` + ``pipe_split`` markers at the plan's split points), so no model code
changes and parameter names (FQNs) stay the original ones. Facts this file relies on:

* The traced graph fixes the microbatch shape and the train/eval mode, so a training pipe and
  a forward-only evaluation pipe are traced separately, and batches must keep one size.
* The stage modules are meant to share the ``Parameter`` objects of the original module, so an
  optimizer built from ``module.parameters()`` (``configure_optimizers`` as written) steps the
  stages. ``torch.export`` breaks this for tied weights (it hands the stages copies), so every
  stage tensor is re-pointed at the original object by its FQN.
* Marking a split point patches a submodule's ``forward``; the patch is undone after tracing,
  else a second trace of the same module recurses.
* MoE layers (data-dependent dispatch shapes) are traced as one opaque op each and run eagerly
  inside the stage (:mod:`~lightning_parallel.parallel.pipeline.moe`).
* Gradients accumulate in ``.grad`` and are never rescaled after the fact: the loss of each
  microbatch is divided by the microbatch count instead, so gradients survive across steps
  (gradient accumulation) and a parameter held by two local stages is not divided twice.
* A parameter used on stages of two ranks (tied embedding and head) gets each rank's share
  of the gradient; :meth:`PipelineRuntime.train_step` sums the new shares over the pipeline
  group, so every holder ends the step with the full gradient.

Errors about the model or the config are raised while tracing and building, identically on
every rank, before any process sends or receives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, distribute_tensor

from lightning_parallel.compat import GraphPipelineStage as _PipelineStage, schedule_stages
from lightning_parallel.parallel.clip import total_norm
from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.pipeline.codegen import lean_stage_code
from lightning_parallel.parallel.pipeline.grad_accumulation import gemm_accumulated_weight_grads
from lightning_parallel.parallel.pipeline.shard_crossing import agree_shard_crossings
from lightning_parallel.parallel.pipeline.cut_grads import input_sources, resolve_cut_gradients, stage_dependencies
from lightning_parallel.parallel.pipeline.eval_reuse import unique_modules
from lightning_parallel.parallel.pipeline.plan import PipelinePlan
from lightning_parallel.parallel.pipeline.tensor import full_value, local_part
from lightning_parallel.parallel.pipeline.schedules import (
    ScheduleSpec,
    build_eval_schedule,
    build_schedule,
    build_stage,
    check_batch_size,
    check_microbatches,
    first_batched,
)
from lightning_parallel.parallel.pipeline.trace import TracedPipeline, stage_interface, trace_pipeline

LossFn = Callable[[Any, Any], Tensor]


def _pp_group(group: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup:
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise config_error(ValueError, "group", group, "the pipeline runs on a 1D mesh", "pass ParallelDims.axis(PP)")
        return group.get_group()
    return group if group is not None else dist.group.WORLD  # type: ignore[return-value]


class PipelineRuntime:
    """This rank's stages and schedules; the one object a strategy talks to.

    Every rank of the pipeline group calls the same methods with the same (full) batch: the
    runtime validates it everywhere, then feeds it to the first stage and the target to the
    last. ``target`` defaults to the row indices ``arange(B)`` (a CPU tensor), so a ``loss_fn(output, rows)``
    can look the rest of the batch up itself (how a LightningModule's ``training_step`` serves
    as the loss).
    """

    def __init__(
        self,
        module: nn.Module,
        plan: PipelinePlan,
        spec: ScheduleSpec,
        group: dist.ProcessGroup,
        microbatches: int,
        microbatch_size: int,
        train_stages: list[Any],
        eval_stages: list[Any] | None,
        loss_fn: LossFn,
        loss_reduction: Literal["mean", "sum"],
        holders: dict[str, set[int]],
        used_anywhere: frozenset[int] | None = None,
        input_sources: list[list[tuple[int, int] | None]] | None = None,
    ) -> None:
        self.module, self.plan, self.spec, self.group = module, plan, spec, group
        self._used_anywhere = used_anywhere  # ids of tensors some stage (of any rank) uses; None: all
        self.microbatches, self.microbatch_size = microbatches, microbatch_size
        self.pp_rank = dist.get_rank(group)
        self.stage_indices = plan.stages_for_rank(self.pp_rank)
        self.holds_first = 0 in self.stage_indices
        self.holds_last = plan.num_stages - 1 in self.stage_indices
        self._last_rank = dist.get_global_rank(group, plan.stages[-1].rank)
        self._loss_fn, self._reduction = loss_fn, loss_reduction
        # Loss scaling (16-mixed): multiplies what the schedule backpropagates, e.g. a GradScaler's
        # ``scale``; the losses reported by ``train_step`` stay unscaled.
        self.loss_scale: Callable[[Tensor], Tensor] | None = None
        self._mb_losses: list[Tensor] = []
        self._train = build_schedule(spec, train_stages, microbatches, self._scaled_loss)
        self._eval = build_eval_schedule(spec, eval_stages, microbatches, [s.rank for s in plan.stages], loss_reduction) if eval_stages else None
        self._holders = holders  # canonical FQN -> pipeline ranks whose stages use it
        params = dict(module.named_parameters())
        self._owned = {n for n, ranks in holders.items() if self.pp_rank in ranks}
        self._shared = sorted(n for n, ranks in holders.items() if len(ranks) > 1)
        self._shared_meta = {n: (params[n].shape, params[n].dtype, params[n].device) for n in self._shared}
        self._shared_layouts: dict[str, tuple[DeviceMesh, list[Placement], torch.Size]] = {}
        self.last_losses: list[Tensor] = []
        self.released: dict[str, torch.Size] = {}
        self._code_final = False  # see finalize_code
        self._input_sources = input_sources  # the pipe's wiring, for shard crossings (shard_crossing.py); None: none

    @property
    def stages(self) -> list[_PipelineStage]:
        """This rank's training stages (``.submod`` is the stage module; for wrapping or profiling)."""
        return schedule_stages(self._train)

    # ownership -------------------------------------------------------------------------------
    def owned_parameter_names(self) -> set[str]:
        """Canonical FQNs (as ``module.named_parameters()`` spells them) this rank's stages use."""
        return set(self._owned)

    def owners(self) -> dict[str, set[int]]:
        """Canonical FQN -> pipeline ranks holding it; a checkpoint gathers each from its owner."""
        return {n: set(r) for n, r in self._holders.items()}

    def owned_parameters(self) -> list[nn.Parameter]:
        """The parameters to optimise on this rank (the others never receive a gradient here)."""
        return [p for n, p in self.module.named_parameters() if n in self._owned]

    def release_non_owned(self) -> dict[str, torch.Size]:
        """Free the memory of parameters and buffers no local stage uses; return their names and shapes.

        The tensors stay the same objects under the same FQNs (an optimizer built before or
        after still works: their ``.grad`` stays ``None``, so optimizers skip them), but their
        data becomes an empty tensor on the same device, so moving the module between devices
        stays legal. Their values now live only on their owners: gather from :meth:`owners`
        before saving a full checkpoint. A tensor that no stage of any rank uses (a Hugging
        Face rotary embedding's ``original_inv_freq``, kept for dynamic rope scaling) stays on
        every rank: releasing it everywhere would lose it from checkpoints.
        """
        used = {id(t) for s in self.stage_modules() for t in (*s.parameters(), *s.buffers())}
        if self._used_anywhere is not None:
            used |= {id(t) for t in (*self.module.parameters(), *self.module.buffers())} - self._used_anywhere
        # (meta tensors of a model built on the meta device have no storage: every data_ptr() is 0)
        kept = {t.untyped_storage().data_ptr() for s in self.stage_modules() for t in (*s.parameters(), *s.buffers()) if not t.is_meta}
        released: dict[str, torch.Size] = {}
        with torch.no_grad():
            for name, tensor in (*self.module.named_parameters(), *self.module.named_buffers()):
                if id(tensor) in used or tensor.numel() == 0 or tensor.untyped_storage().data_ptr() in kept:
                    continue  # in use here, already released, or a view of a tensor in use
                released[name] = tensor.shape
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        self.released.update(released)
        return released

    def stage_modules(self) -> list[nn.Module]:
        """Every local stage module, training and evaluation (they share the parameters), each once: a
        training stage module may serve evaluation too (:mod:`~lightning_parallel.parallel.pipeline.eval_reuse`)."""
        return unique_modules(self.stages_submodules(train=True) + self.stages_submodules(train=False))

    def stages_submodules(self, train: bool) -> list[nn.Module]:
        """The local training (or evaluation) stage modules, in stage order."""
        schedule = self._train if train else self._eval
        if schedule is None:
            return []
        return [s.submod for s in schedule_stages(schedule)]

    # steps ---------------------------------------------------------------------------------------
    def _scaled_loss(self, output: Any, target: Any) -> Tensor:
        loss = self._loss_fn(output, target)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}")
        self._mb_losses.append(loss.detach())
        loss = loss / self.microbatches if self._reduction == "mean" else loss
        return self.loss_scale(loss) if self.loss_scale is not None else loss

    def _inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        first = first_batched(args, kwargs)
        check_batch_size(int(first.shape[0]), self.microbatches, self.microbatch_size)
        if target is None:
            # On the host whatever the batch's device: the loss reads each microbatch's rows as
            # Python ints (slice_batch), which on a CUDA tensor would be two syncs per microbatch.
            target = torch.arange(first.shape[0])
        if not self.holds_first:
            args, kwargs = (), {}
        return args, kwargs, target if self.holds_last else None

    def finalize_code(self) -> tuple[int, int]:
        """Inline the stages' submodule calls and call operators through torch's Python bindings
        (:mod:`lightning_parallel.parallel.pipeline.codegen`), once: after tensor and expert parallelism have changed the stages
        (their hooks keep a call in place) and before ZeRO wraps them (the pipeline driver calls it
        there), or at the first step. Returns (calls inlined, operator calls rebound); (0, 0) after
        the first time. Then tensor parallelism's passes that need one graph per stage
        (``TensorParallelStageForward.after_inlining``: q, k and v meet their shared input there)."""
        if self._code_final:
            return 0, 0
        self._code_final = True
        counts = lean_stage_code(self.stage_modules())
        for stage in self.stage_modules():
            after = getattr(stage.__dict__.get("forward"), "after_inlining", None)  # tensor parallelism's last pass
            if after is not None:
                after(stage)
        return counts

    def train_step(self, *args: Any, target: Any = None, broadcast_loss: bool = True, **kwargs: Any) -> Tensor:
        """Forward and backward of one batch through the pipeline; returns the full-batch loss on every rank
        (``broadcast_loss=False``: on the last stage's rank only, zero elsewhere, for a caller that
        sends it with something else in one collective).

        Gradients are added to ``.grad`` (nothing is zeroed), as one ``loss.backward()`` would.
        """
        self.finalize_code()
        args, kwargs, target = self._inputs(args, kwargs, target)
        params = dict(self.module.named_parameters())
        before = {n: (None if params[n].grad is None else params[n].grad.clone()) for n in self._shared if n in self._owned}
        self._mb_losses = []
        # Weight gradients accumulated inside their GEMMs (grad_accumulation.py), unless the schedule
        # computes them in a pass of their own (zero bubble: autograd.grad on the weights).
        with gemm_accumulated_weight_grads(not self.spec.zero_bubble):
            self._train.step(*args, target=target, return_outputs=False, **kwargs)
        self._agree_shard_crossings()
        self._sum_shared_grads(params, before)
        self.last_losses = list(self._mb_losses)
        device = self.stages[0].device  # the device the group's backend serves (NCCL rejects CPU tensors)
        loss = torch.zeros((), dtype=torch.float32, device=device)
        if self.holds_last:
            stacked = torch.stack([l.detach().float().to(device) for l in self._mb_losses])
            loss = stacked.mean() if self._reduction == "mean" else stacked.sum()
        if broadcast_loss:
            dist.broadcast(loss, src=self._last_rank, group=self.group)
        return loss

    def _agree_shard_crossings(self) -> None:
        """Once, after the first training step, on every rank: tensor-parallel stages send the values
        they split as shards from now on (parallel/pipeline/shard_crossing.py)."""
        sources, self._input_sources = self._input_sources, None
        forwards = {s.stage_index: s.submod.__dict__.get("forward") for s in self.stages}
        forwards = {k: f for k, f in forwards.items() if hasattr(f, "split_outputs_seen")}
        if sources is not None and forwards:  # tensor parallelism applies to every rank's stages or to none
            agree_shard_crossings(forwards, sources, self.plan.num_stages - 1, self.group)

    def shard_shared_gradients(self, layouts: dict[str, tuple[DeviceMesh, list[Placement]]]) -> None:
        """Shared parameters (a tied embedding and LM head on the first and last stage) that every
        stage holding them splits alike, given on every rank: canonical FQN -> (mesh, placements).

        Their gradients then cross the pipeline as this rank's shard, summed with the peers that hold
        the same shard (the pipeline group of a tensor-parallel rank), instead of being gathered
        whole first: one all-gather per step and ``tp`` times the bytes saved. Only for layouts every
        rank can derive alike (the tensor-parallel plan; not FSDP2's, which only holders see)."""
        self._shared_layouts = {}
        for name, (mesh, placements) in layouts.items():
            if name in self._shared:
                shape, dtype, _ = self._shared_meta[name]
                local = distribute_tensor(torch.empty(shape, dtype=dtype, device="meta"), mesh, placements, src_data_rank=None)
                self._shared_layouts[name] = (mesh, list(placements), local.to_local().shape)

    def _sum_shared_grads(self, params: dict[str, nn.Parameter], before: dict[str, Tensor | None]) -> None:
        for name in self._shared:
            shape, dtype, _ = self._shared_meta[name]
            layout = self._shared_layouts.get(name)
            # On the device the group's backend serves: a meta-built model's parameter was on "meta"
            # when this was recorded, and a stage between the holders sends zeros (NCCL rejects CPU).
            delta = torch.zeros(layout[2] if layout else shape, dtype=dtype, device=self.stages[0].device)
            grad = params[name].grad
            if name in before and grad is not None:
                delta = grad - before[name] if before[name] is not None else grad.clone()
                if layout is not None and isinstance(delta, DTensor):  # this rank's shard, in the parameter's layout
                    delta = delta.redistribute(layout[0], layout[1]).to_local()
                else:  # tensor-parallel stages: the whole tensor crosses the pipeline
                    delta = full_value(delta)
            dist.all_reduce(delta, group=self.group)
            if name in before:
                param = params[name]
                if layout is not None:
                    delta = DTensor.from_local(delta, layout[0], layout[1], run_check=False, shape=shape, stride=param.stride())
                elif isinstance(param, DTensor):
                    delta = distribute_tensor(delta, param.device_mesh, param.placements, src_data_rank=None)
                param.grad = delta if before[name] is None else before[name] + delta

    @torch.no_grad()
    def eval_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only (eval-mode trace); the merged full-batch output on the last stage's rank, else None."""
        if self._eval is None:
            raise RuntimeError("This pipeline was built without an evaluation pipe (build_eval=False).")
        self.finalize_code()
        args, kwargs, _ = self._inputs(args, kwargs, None)
        return self._eval.step(*args, **kwargs)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the norm of all gradients of the whole model, computed across the stages.

        A parameter on two ranks' stages counts once (on the lowest rank holding it).
        """
        params = dict(self.module.named_parameters())
        # Sorted: the norm reduces per group of gradients, in the same order on every rank (a set's
        # order follows per-process string hashing, and two groups over the same ranks would mix).
        counted = [params[n] for n in sorted(self._owned) if min(self._holders[n]) == self.pp_rank]
        # A rank may count no parameter (all held lower, or frozen): its zero goes where the others' norms are.
        device = next((p.device for p in params.values()), self.stages[0].device)
        norm = total_norm(counted, norm_type, extra_groups=(self.group,), device=device)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for name in self._owned:
            if params[name].grad is not None:
                local_part(params[name].grad).mul_(coef.to(params[name].grad.device))
        return norm

    def describe(self) -> str:
        """The plan's table plus what this rank actually holds."""
        return f"{self.plan.table()}\nrank {self.pp_rank}: stages {self.stage_indices}, {len(self._owned)} parameters owned"


def build_pipeline(
    module: nn.Module,
    example_args: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    *,
    plan: PipelinePlan,
    schedule: ScheduleSpec,
    microbatches: int,
    loss_fn: LossFn,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    device: torch.device | str | None = None,
    loss_reduction: Literal["mean", "sum"] = "mean",
    build_eval: bool = True,
    traced: TracedPipeline | None = None,
    checkpoint_blocks: Sequence[str] = (),
) -> PipelineRuntime:
    """Build this rank's stages and schedules for ``module`` (traced here unless ``traced`` is given).

    ``example_args``/``example_kwargs`` are one full batch of forward inputs (every later batch
    must have the same shapes). ``loss_fn(output, target)`` runs on the last stage per
    microbatch, ``output`` being what the model's forward returns for that microbatch.
    Every check happens before any collective; the one collective before the schedules run (when it
    traces here) compares the cut every rank traced.
    """
    pg = _pp_group(group)
    if dist.get_world_size(pg) != plan.pp_size:
        raise config_error(ValueError, "pipeline_parallel_size", plan.pp_size, f"the pipeline group has {dist.get_world_size(pg)} ranks", "plan with the pipeline group's size")
    if loss_reduction not in ("mean", "sum"):
        raise config_error(ValueError, "loss_reduction", loss_reduction, 'it is "mean" or "sum"', 'use "mean" for a loss averaged over the batch')
    check_microbatches(schedule, plan.pp_size, plan.virtual_stages, microbatches)
    if plan.style != schedule.style or (schedule.style == "single") != (plan.virtual_stages == 1):
        raise config_error(
            ValueError, "virtual_stages", plan.virtual_stages, f"a {plan.style} plan does not fit schedule {schedule.name!r} ({schedule.style})", "plan with style=schedule.style and its virtual stages"
        )
    local = plan.stages_for_rank(dist.get_rank(pg))
    dependencies: dict[int, Any] = {}
    if traced is None:
        if example_args is None:
            raise config_error(TypeError, "example_args", None, "tracing needs one example batch of forward inputs", "pass example_args (or a TracedPipeline as traced=)")
        # Only this rank's stages are traced node by node (the others' blocks as opaque calls:
        # parallel/pipeline/foreign.py). Every rank must see the same cut, or their sends and receives
        # would not pair: if any rank's opaque calls changed what crosses a cut, all trace whole.
        traced = trace_pipeline(module, example_args, example_kwargs, plan=plan, microbatches=microbatches, build_eval=build_eval,
                                checkpoint_blocks=checkpoint_blocks, local_stages=local)
        cut = [stage_interface(p) for p in (traced.train, traced.eval) if p is not None]
        mine = {k: stage_dependencies(traced.train.get_stage_module(k)) for k in local}  # what each output depends on
        gathered: list[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(gathered, (cut, mine), group=pg)
        if any(c != cut for c, _ in gathered):
            traced = trace_pipeline(module, example_args, example_kwargs, plan=plan, microbatches=microbatches, build_eval=build_eval,
                                    checkpoint_blocks=checkpoint_blocks)
            dependencies = {k: stage_dependencies(traced.train.get_stage_module(k)) for k in range(len(plan.stages))}
        else:
            dependencies = {k: d for _, theirs in gathered for k, d in theirs.items()}
    elif traced.plan.split_points != plan.split_points:
        raise config_error(ValueError, "traced", list(traced.plan.split_points), f"it was cut at other split points than the plan ({list(plan.split_points)})", "trace with this plan")
    elif not traced.traces_whole(local):
        raise config_error(ValueError, "traced", sorted(traced.local_stages or ()), f"it traced stages {sorted(traced.local_stages or ())} whole, and this rank builds {local}",
                           "trace with local_stages=plan.stages_for_rank(rank) of this plan (or None)")
    if build_eval and traced.eval is None:
        raise config_error(ValueError, "build_eval", True, "the given trace has no evaluation pipe", "trace with build_eval=True")
    dev = torch.device(device) if device is not None else next(module.parameters()).device
    holders: dict[str, set[int]] = {}
    for k, names in enumerate(traced.holders_by_stage):
        for name in names:
            holders.setdefault(name, set()).add(plan.stages[k].rank)
    # Which values crossing a cut carry gradients (parallel/pipeline/cut_grads.py): known alike on every rank when
    # it traced here (exchanged above); a given trace keeps torch's default (every floating value), as its peers will.
    grads = resolve_cut_gradients(traced.train, dependencies) if len(dependencies) == len(plan.stages) else {}
    train_stages = [build_stage(traced.train, k, dev, pg, grads.get(k)) for k in local]
    eval_stages = [build_stage(traced.eval, k, dev, pg) for k in local] if build_eval and traced.eval is not None else None
    return PipelineRuntime(
        module, plan, schedule, pg, microbatches, traced.microbatch_size, train_stages, eval_stages, loss_fn, loss_reduction, holders,
        traced.used_anywhere, input_sources(traced.train),
    )
