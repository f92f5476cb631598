"""``PipelineDriver``: runs an unchanged LightningModule's steps through pipeline stages.

``HybridParallelStrategy`` hands its steps here when ``pipeline_parallel_size > 1``. The engine
(:mod:`lightning_parallel.parallel.pipeline.runtime`) cuts ``forward`` into stages; this file makes the
user's hooks fit around it (see :mod:`lightning_parallel.strategies.pipeline.logs` for how the step code runs):

* Configuration is resolved in ``setup()`` on every rank (schedule, virtual stages, microbatch
  count, the stage plan), so bad input fails before any process sends. The stages are traced
  lazily from the first real batch, because the traced graph fixes the microbatch shape.
* What is traced is the first model call the step makes: ``self(...)``, or a child such as
  ``self.model(...)`` (how Hugging Face models are usually wrapped; ``labels=`` then becomes
  the model's own loss on the last stage): :mod:`lightning_parallel.strategies.pipeline.entry`.
* ``training_step`` runs the schedule (forward and backward of every microbatch), with the
  user's ``training_step`` as the per-microbatch loss on the last stage. Lightning's closure
  then calls ``zero_grad`` before ``backward``: the new gradients are therefore stashed, the
  ones that were there restored, and ``backward()`` adds the stash back (this also keeps
  ``accumulate_grad_batches`` right, where ``zero_grad`` runs on a window's first batch only).
  On a window's first batch the old gradients are freed before the schedule instead, since
  ``zero_grad`` would drop them: no rank holds two sets of its stages' gradients.
  The loss returned to Lightning is the full-batch value on every rank, as a fresh leaf.
* Once traced, the layout follows the documented order on the stages: tensor parallelism on
  the traced stage graphs (:mod:`~lightning_parallel.parallel.pipeline.tensor`), expert
  parallelism on the experts the stages own (MoE layers are opaque ops in the graphs,
  :mod:`~lightning_parallel.parallel.pipeline.moe`; expert gradients are averaged over ``edp``,
  the rest over ``dp``), then ZeRO
  (``zero_stage`` 1-3: FSDP2 per stage, :mod:`~lightning_parallel.parallel.pipeline.fsdp`);
  the optimizers Lightning built in ``setup`` are pointed at the new parameters.
* Data parallel x pipeline with ZeRO stage 0: each stage's gradients are averaged over its
  data-parallel peers after the schedule (the strategy's sampler already shards the data).
* Each rank keeps only the parameters its stages use (:meth:`PipelineRuntime.release_non_owned`):
  the optimizer, built from ``module.parameters()``, skips the others (their grad stays None).
* Validation, test and predict run a forward-only pipe; the hook runs once on the last stage
  with the merged output and its return value and logs are broadcast to every stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_parallel.compat_lightning import attached_trainer, unwrap_optimizer
from lightning_parallel.nn.moe import MoEStats, moe_stats_log, set_moe_loss_coefs, set_moe_stats_group
from lightning_parallel.parallel.allocator import release_host_memory
from lightning_parallel.parallel.data.buckets import gradient_buckets
from lightning_parallel.parallel.dims import EP, PP, TP
from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.blocks import find_repeated_blocks
from lightning_parallel.parallel.pipeline.runtime import PipelineRuntime, build_pipeline
from lightning_parallel.parallel.pipeline.trace import CheckpointedForward
from lightning_parallel.parallel.pipeline.fsdp import apply_stage_fsdp, unsharded_for_eval
from lightning_parallel.parallel.pipeline.moe import (
    MoEStepRecord,
    apply_stage_expert_parallel,
    moe_losses_to_backward,
    opaque_units,
    replicate_opaque_calls,
    unit_parameter_names,
)
from lightning_parallel.parallel.pipeline.tensor import (
    apply_stage_tensor_parallel,
    local_part,
    parameter_placements,
    retarget_calls,
    swap_optimizer_parameters,
)
from lightning_parallel.parallel.context.traced import TRACED_ATTENTION, local_heads_attention
from lightning_parallel.parallel.pipeline.meta import meta_output_forward, retarget_devices, to_meta
from lightning_parallel.parallel.pipeline.schedules import batch_size_of
from lightning_parallel.strategies.early_zero_grad import gradients_dropped_before_backward
from lightning_parallel.strategies.experts import reduce_expert_grads
from lightning_parallel.strategies.pipeline.log_exchange import LogExchange
from lightning_parallel.strategies.precision import grad_scaler
from lightning_parallel.strategies.pipeline.config import resolve_pipeline_config
from lightning_parallel.strategies.pipeline.state import PipelineStateMixin
from lightning_parallel.strategies.pipeline.entry import Entry, entry_mismatch_error, rebuilt_output, split_kwargs, tracing_forward
from lightning_parallel.strategies.pipeline.logs import (
    LogCapture,
    LogRecord,
    StepDone,
    detached_cpu,
    forward_twice_error,
    metric_names,
    model_calls,
    other_calls_error,
    patched,
    probe_entry_inputs,
    reduce_microbatch_logs,
    replay_logs,
    slice_batch,
    to_device,
    training_loss,
)


@dataclass
class _TrainStep:
    """The batch being trained, for the loss function the schedule calls per microbatch."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    batch_size: int
    accumulate: int
    records: list[tuple[list[LogRecord], int]] = field(default_factory=list)


class PipelineDriver(PipelineStateMixin):
    """Drives ``strategy``'s steps for ``module`` split into pipeline stages (see the module docstring)."""

    def __init__(self, strategy: Any, module: pl.LightningModule) -> None:
        self.strategy, self.module = strategy, module
        dims = strategy.parallel_dims
        self.dims = dims
        self.config = resolve_pipeline_config(
            module,
            dims.pp,
            strategy.pipeline_schedule,
            strategy.microbatches,
            strategy.virtual_stages,
            strategy.split_points,
            zero_stage=strategy.zero_stage,
            tp=dims.tp,
            mixed_precision=strategy.mixed_precision,
            activation_checkpointing=strategy.activation_checkpointing,
            sequence_parallel=strategy.sequence_parallel,
            loss_parallel=strategy.loss_parallel,
            cpu_offload=strategy.cpu_offload,
        )
        self.group = dims.axis(PP).get_group()
        # gradients are averaged over dp, and over cp too (each cp rank's gradient covers its chunks)
        self._dp_group = dims.axis(dims.grad_axis).get_group() if dims.grad_size > 1 else None
        self._last_rank = dist.get_global_rank(self.group, self.config.plan.stages[-1].rank)
        self._runtime: PipelineRuntime | None = None
        self.checkpointed: list[str] = []  # block FQNs recomputed in backward on this rank, once traced
        self._entry: Entry | None = None  # the call the stages were traced from (forward or self.<child>)
        self._step: _TrainStep | None = None
        self._stash: list[tuple[nn.Parameter, Tensor]] = []
        self._metric_table: dict[int, str] | None = None  # id -> name of the module's Metrics (see _with_output)
        self._log_exchange: LogExchange | None = None  # the training step's logs and loss to every stage
        self._keepers: dict[str, int] = {}
        self._owned_params: list[nn.Parameter] = []  # what this rank steps, once traced (see _build)
        self._pending_load: tuple[Path, bool, bool | None] | None = None  # (path, strict, weights_only) for the first batch
        self._moe = bool(opaque_units(module))
        self._expert_params: set[int] = set()  # ids of expert-parallel parameters (averaged over edp, not dp)
        self._sharded: set[int] = set()  # ids of parameters FSDP2 manages (ZeRO 1-3): not averaged here
        if self._moe and (strategy.moe_aux_loss_coef is not None or strategy.moe_z_loss_coef is not None):
            set_moe_loss_coefs(module, aux=strategy.moe_aux_loss_coef, z=strategy.moe_z_loss_coef)
        rank_zero_info(self.config.plan.table())

    # ------------------------------------------------------------------ state
    @property
    def runtime(self) -> PipelineRuntime:
        if self._runtime is None:
            raise RuntimeError("The pipeline stages are traced from the first batch; no step has run yet.")
        return self._runtime

    @property
    def device(self) -> torch.device:
        return self.strategy.root_device

    def _build(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Trace and build the stages from this batch, then free what other stages own."""
        probe = probe_entry_inputs(self.module, hook, args, kwargs)
        if isinstance(probe, StepDone):
            return  # nothing to trace from this hook; a later one will
        entry = Entry(probe[0])
        # A meta-built model is traced on meta inputs of the batch's shapes; its step is counted with the
        # forward answering zeros of the output's shapes (parallel/pipeline/meta.py).
        meta = any(p.is_meta for p in self.module.parameters())
        target = self.module.get_submodule(entry.name) if entry.name else self.module
        with meta_output_forward(target, probe[1], probe[2], self.device, enabled=meta):
            calls, others = model_calls(self.module, hook, args, kwargs, entry=entry.name)
        if calls > 1:
            raise forward_twice_error(hook, entry.describe())
        if others:
            raise other_calls_error(hook, entry.describe(), others)
        traced_kwargs, _ = split_kwargs(entry, self.module, probe[2])
        self._check_batch(hook, (probe[1], traced_kwargs), traced=None)
        cfg = self.config
        with tracing_forward(self.module, entry):
            self._runtime = build_pipeline(
                self.module,
                to_meta(probe[1]) if meta else probe[1],
                to_meta(traced_kwargs) if meta else traced_kwargs,
                plan=cfg.plan,
                schedule=cfg.spec,
                microbatches=cfg.microbatches,
                loss_fn=self._loss,
                group=self.group,
                device=self.device,
                # activation_checkpointing=True: the stages' traced copies of the repeated blocks recompute in backward
                checkpoint_blocks=[n for n, _ in find_repeated_blocks(self.module)] if self.strategy.activation_checkpointing else (),
            )
        self._entry = entry
        self.checkpointed = sorted(  # what this rank's training stages recompute (own and the model's checkpointing)
            n for s in self._runtime.stages_submodules(train=True) for n, m in s.named_modules()
            if isinstance(m.__dict__.get("forward"), CheckpointedForward)
        )
        scaler = grad_scaler(self.strategy.precision_plugin)  # 16-mixed: the schedule backpropagates the scaled loss
        self._runtime.loss_scale = scaler.scale if scaler is not None else None
        self._runtime.release_non_owned()
        release_host_memory()  # tracing's garbage (export's fake tensors, graphs of the other stages) off the heap
        stage_fsdp = self.dims.grad_size > 1 and self.strategy.zero_stage >= 1  # FSDP2 shards the stages (below)
        whole = unit_parameter_names(self.module)  # MoE layers' parameters: kept out of tp and ZeRO (see below)
        if self._moe and self.dims.grad_size > 1:  # balance losses over the global microbatch (all its tokens)
            set_moe_stats_group(self.module, self.dims.axis(self.dims.grad_axis).get_group())
        if self.dims.tp > 1:  # pipeline split -> tensor parallel: shard what this rank's stages kept
            plan = self.strategy.tensor_parallel_plan
            # MoE layers are opaque ops that run replicated over tp: their parameters stay whole.
            owned = self._runtime.owned_parameter_names() - whole
            mapping = apply_stage_tensor_parallel(self.module, self._runtime.stage_modules(), owned, self.dims.axis(TP), plan)
            swap_optimizer_parameters(self._optimizers(), mapping)
            if not stage_fsdp:  # no FSDP2 below: the plan's layout is final
                tp_mesh = self.dims.axis(TP)
                self._runtime.shard_shared_gradients({n: (tp_mesh, p) for n, p in parameter_placements(self.module, plan).items()})
            for stage_module in self._runtime.stage_modules():
                replicate_opaque_calls(stage_module)
                retarget_calls(stage_module, {TRACED_ATTENTION: local_heads_attention})  # cp attention on local heads
        experts: list[nn.Parameter] = []
        if self.dims.ep > 1:  # -> expert parallel: split the experts this rank's stages kept (still meta for a meta model)
            mapping = apply_stage_expert_parallel(
                self.module, self._runtime.stage_modules(), self._runtime.owned_parameter_names(), self.dims.axis(EP),
                self.dims.axis(self.dims.grad_axis),  # the ranks holding different tokens: dp (x cp), as without pipelines
            )
            swap_optimizer_parameters(self._optimizers(), mapping)
            experts = list(mapping.values())
        if meta:  # allocate and initialise only what this rank's stages kept (tp shards and expert blocks included)
            retarget_devices(self._runtime.stage_modules(), self.device)
            replaced = self.strategy._materialize(self.module, in_place=True, also=self._runtime.stage_modules(),
                                                  full_shapes=self._runtime.released)
            swap_optimizer_parameters(self._optimizers(), {o: n for o, n in replaced.items() if isinstance(o, nn.Parameter)})
            experts = [replaced.get(p, p) for p in experts]
        self._expert_params = {id(p) for p in experts}
        self._runtime.finalize_code()  # lean stage code (parallel/pipeline/codegen.py), before FSDP2 wraps the stages
        if stage_fsdp:  # -> data-parallel sharding (FSDP2 per stage, over dp x cp)
            runtime = self._runtime
            # MoE layers run eagerly inside opaque ops, on the layer's own parameters, which FSDP2
            # (gathering into the stage's registrations) would not reach: they stay out of it, and
            # their gradients are averaged like those of replicated data parallelism.
            kept_whole = {p for n, p in self.module.named_parameters() if n in whole}
            mapping = apply_stage_fsdp(
                self.module, runtime.stages_submodules(train=True), runtime.stages_submodules(train=False),
                self.dims.data_parallel_mesh(), reshard_after_forward=self.strategy.zero_stage == 3, ignored=kept_whole,
            )
            swap_optimizer_parameters(self._optimizers(), mapping)
            self._sharded = {id(p) for p in mapping.values()}  # FSDP2 reduce-scatters their gradients itself
        released: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(released, sorted(self._runtime.released), group=self.group)
        names = [n for n, _ in (*self.module.named_parameters(), *self.module.named_buffers())]
        self._keepers = {n: min(r for r, gone in enumerate(released) if n not in gone) for n in names}
        # The parameters this rank steps, final now that every layout has replaced its parameters: read
        # every step (walking named_parameters each time cost 2.5 ms of a 550 ms pp2 m=8 step under cProfile).
        self._owned_params = self._runtime.owned_parameters()
        if self._pending_load is not None:  # a resume: each rank reads what its stages now hold
            path, strict, weights_only = self._pending_load
            self._pending_load = None
            self.load(path, self._optimizers(), strict, weights_only)

    def _optimizers(self) -> list[Any]:
        """The strategy's optimizers, unwrapped from Lightning's ``LightningOptimizer``."""
        return [unwrap_optimizer(o) for o in self.strategy.optimizers]

    def _check_batch(self, hook: str, probe: tuple[tuple[Any, ...], dict[str, Any]], traced: int | None) -> None:
        size = batch_size_of(*probe)
        m = self.config.microbatches
        if size % m:
            raise config_error(
                ValueError,
                "batch_size",
                size,
                f"{hook} feeds forward batches that are cut into microbatches={m} equal parts, so it must be divisible by {m}",
                "choose a batch size that is a multiple of microbatches and set drop_last=True on the DataLoader",
            )
        if traced is not None and size != traced:
            raise config_error(
                ValueError,
                "batch_size",
                size,
                f"the pipeline stages were traced for batches of {traced} rows and traced stages have fixed shapes; "
                f"{hook} received {size}",
                "give every DataLoader (train, val, test, predict) the same batch size and drop_last=True "
                "(Trainer: keep the last smaller batch out)",
            )

    def _ready(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | StepDone:
        """The inputs ``hook`` feeds the pipeline's entry (tracing it on first use), or StepDone."""
        if self._runtime is None:
            self._build(hook, args, kwargs)
        probe = probe_entry_inputs(self.module, hook, args, kwargs)
        if isinstance(probe, StepDone):
            return probe
        assert self._runtime is not None and self._entry is not None, "_build traces whenever the probe finds a model call"
        if probe[0] != self._entry.name:
            raise entry_mismatch_error(hook, self._entry, Entry(probe[0]).describe())
        inputs = (probe[1], split_kwargs(self._entry, self.module, probe[2])[0])
        self._check_batch(hook, inputs, self._runtime.microbatch_size * self.config.microbatches)
        return inputs

    def _broadcast(self, obj: Any) -> Any:
        box = [detached_cpu(obj) if self.runtime.holds_last else None]
        dist.broadcast_object_list(box, src=self._last_rank, group=self.group)
        return to_device(box[0], self.device)

    def _with_output(self, hook: str, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, LogCapture]:
        """Run the user's ``hook`` with ``forward`` returning ``out`` (the last stage's output)."""
        if self._metric_table is None:  # the module's Metrics do not change during fit
            self._metric_table = metric_names(self.module)
        capture = LogCapture(self.module, self._metric_table)
        calls = [0]
        entry = self._entry
        assert entry is not None, "the stages are traced before they produce output"
        rebuilt = rebuilt_output(self.module, entry, out)

        def forward(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            if calls[0] > 1:
                raise forward_twice_error(hook, entry.describe())
            return rebuilt(*a, **k)

        with patched(self.module, log=capture), patched(entry.module(self.module), forward=forward):
            result = getattr(self.module, hook)(*args, **kwargs)
        return result, capture

    # ------------------------------------------------------------------ training
    def _loss(self, out: Any, rows: Tensor) -> Tensor:
        """The schedule's loss: the user's training_step on microbatch ``rows``, forward returning ``out``."""
        step = self._step
        assert step is not None, "the schedule called the loss outside a training step"
        batch = slice_batch(step.args[0], rows, step.batch_size)
        result, capture = self._with_output("training_step", out, (batch, *step.args[1:]), step.kwargs)
        step.records.append((capture.records, int(rows.numel())))
        # Lightning divides the closure loss by accumulate_grad_batches before backward; the
        # schedule's backward starts here, so the division happens here.
        return training_loss(result) / step.accumulate

    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """One batch through the schedule; returns the full-batch loss (a leaf) on every rank."""
        module = self.module
        if not module.automatic_optimization:
            raise config_error(
                ValueError, "automatic_optimization", False, "the pipeline schedule runs backward itself", "use automatic optimization with pipeline parallelism"
            )
        probe = self._ready("training_step", args, kwargs)
        if isinstance(probe, StepDone):
            raise config_error(
                ValueError, "training_step", "never calls forward", "the pipeline stages are the model's forward; a step that does not call it (or a child module such as self.model) has nothing to run", "call self(...) or self.model(...) in training_step"
            )
        runtime = self.runtime
        accumulate = int(module.trainer.accumulate_grad_batches) if attached_trainer(module) is not None else 1
        params = self._owned_params
        # The gradients already there are put back after the schedule, unless Lightning's zero_grad
        # drops them before this step's backward anyway, unobserved: then they are freed now, not
        # held beside the new ones for the whole schedule (strategies/early_zero_grad.py).
        keep = not gradients_dropped_before_backward(module, self.strategy.train_batch_idx)
        previous = [p.grad if keep else None for p in params]
        for p in params:
            p.grad = None
        self._step = _TrainStep(args, kwargs, batch_size_of(*probe), accumulate)
        try:
            # A microbatch's loss is scaled by 1 / (microbatches x accumulate): so are its MoE balance losses.
            with moe_losses_to_backward(1.0 / (self.config.microbatches * accumulate)) as moe_losses:
                loss = runtime.train_step(*probe[0], broadcast_loss=False, **probe[1])
            self._average_over_data_parallel(params)
            records = reduce_microbatch_logs(self._step.records) if runtime.holds_last else None
        finally:
            self._step = None
            self._stash = [(p, p.grad) for p in params if p.grad is not None]
            for p, g in zip(params, previous):
                p.grad = g
        if self._log_exchange is None:
            self._log_exchange = LogExchange(self.group, self._last_rank, self.device, runtime.holds_last)
        records, loss = self._log_exchange(records, loss)  # the logs and the loss: one tensor broadcast
        replay_logs(module, records, self.device)
        if self._moe:
            self._log_moe(moe_losses)
        return (loss * accumulate).to(self.device).detach().requires_grad_(True)

    def _log_moe(self, record: MoEStepRecord) -> None:
        """Log what an MoE model logs without pipelines, from layers that live on several stages:
        ``moe_aux_loss``/``moe_z_loss`` (summed over layers, averaged over the microbatches) and
        per layer the statistics of the whole batch (:meth:`MoEStepRecord.layer_stats`)."""
        m = self.config.microbatches
        values = torch.zeros(2, dtype=torch.float32, device=self.device)
        if record.aux:
            values[0] = torch.stack(record.aux).sum().float() / m
            values[1] = torch.stack(record.z).sum().float() / m
        dist.all_reduce(values, group=self.group)
        self.module.log("moe_aux_loss", values[0])
        self.module.log("moe_z_loss", values[1])
        per_stage: list[Any] = [None] * dist.get_world_size(self.group)
        mine = {n: detached_cpu((s.tokens_per_expert, s.dropped_fraction)) for n, s in record.layer_stats().items()}
        dist.all_gather_object(per_stage, mine, group=self.group)
        layers = sorted(((name, MoEStats(counts, dropped_fraction=dropped)) for stage in per_stage for name, (counts, dropped) in stage.items()),
                        key=lambda item: item[0])
        self.module.log_dict({k: v.to(self.device) for k, v in moe_stats_log(layers).items()})

    @torch.no_grad()
    def _average_over_data_parallel(self, params: list[nn.Parameter]) -> None:
        """Mean of the new gradients over the stage's data-parallel peers, in buckets of
        ``ddp_bucket_cap_mb`` (DDP's size); expert-parallel parameters over the peers holding the
        same experts (edp) instead.

        Buckets, not one flat copy of every gradient: that copy was a third live copy of the stage's
        state at the step's end (parameters, gradients, the flat buffer), and the CPU backend
        allocates scratch of the message's size beside it (issue 29: ``3d`` on 8 ranks, dp2 x tp2 x
        pp2 with ZeRO-0, held 0.75 P tensor-exact and 1.02 P resident at that moment). A gradient of
        a bucket's size or more is reduced in place; smaller ones are packed per dtype."""
        if self._dp_group is None:
            return
        reduce_expert_grads([p for p in params if id(p) in self._expert_params], self.dims)
        skip = self._expert_params | self._sharded
        grads = [local_part(p.grad) for p in params if p.grad is not None and id(p) not in skip]
        world = dist.get_world_size(self._dp_group)
        for bucket in gradient_buckets(grads, int(self.strategy.ddp_bucket_cap_mb * 2**20)):
            alone = len(bucket) == 1 and bucket[0].is_contiguous()
            flat = bucket[0] if alone else torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=self._dp_group)
            flat /= world
            if not alone:
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

    def backward(self) -> None:
        """Add the gradients of the last training step back (Lightning zeroed ``.grad`` in between)."""
        for p, g in self._stash:
            p.grad = g if p.grad is None else p.grad.add_(g)
        self._stash = []

    def clip_grad_norm_(self, max_norm: float) -> Tensor | None:
        """Clip by the global norm over every stage (the dp peers hold identical averaged gradients)."""
        return self._runtime.clip_grad_norm_(max_norm) if self._runtime is not None else None

    # ------------------------------------------------------------------ evaluation
    def eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        """``validation_step``/``test_step``/``predict_step`` through the forward-only pipe."""
        probe = self._ready(hook, args, kwargs)
        if isinstance(probe, StepDone):  # the hook does not use the model: it ran already, everywhere
            replay_logs(self.module, probe.records, self.device)
            return probe.result
        runtime = self.runtime
        with unsharded_for_eval(runtime.stages_submodules(train=True), runtime.stages_submodules(train=False)):
            out = runtime.eval_step(*probe[0], **probe[1])
        payload = None
        if self.runtime.holds_last:
            result, capture = self._with_output(hook, out, args, kwargs)
            payload = (result, capture.records)
        result, records = self._broadcast(payload)
        replay_logs(self.module, records, self.device)
        return result
