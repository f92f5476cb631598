"""How the strategy lays a model out: the degrees for the world size, the plans checked before any
collective, the techniques applied in the documented order (``HybridParallelStrategy``'s module
docstring), once per module, and meta-built models materialised where their layout puts them.

A mixin of :class:`~lightning_parallel.strategies.hybrid.HybridParallelStrategy`: it reads the
strategy's options and state; it exists so that ``hybrid.py`` stays Lightning's contract and a
dispatcher.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_parallel.compat import ddp_ignore
from lightning_parallel.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_parallel.parallel.compile import apply_compile, check_compile_layout, check_compile_model
from lightning_parallel.parallel.blocks import find_repeated_blocks
from lightning_parallel.parallel.data.apply import apply_ddp, apply_fsdp
from lightning_parallel.planner.auto_degrees import DegreeChoice, choose_3d_degrees
from lightning_parallel.strategies.auto_layout import planner_inputs, planning_view
from lightning_parallel.parallel.pipeline.schedules import resolve_virtual_stages, schedule_spec
from lightning_parallel.parallel.context.hf import routable_models, route_hf_models
from lightning_parallel.parallel.dims import EDP, TP, ParallelDims
from lightning_parallel.parallel.experts.apply import validate_expert_parallel
from lightning_parallel.parallel.materialize import MetaInitContext, RngSnapshot, has_meta_tensors, materialize_meta_module, move_real_tensors
from lightning_parallel.parallel.tensor.apply import apply_tensor_parallel
from lightning_parallel.parallel.tensor.plan import TensorParallelPlan, resolve_tp_plan
from lightning_parallel.parallel.tensor.split_share import check_split_share
from lightning_parallel.pretrained import run_pending_loads
from lightning_parallel.strategies import precision as prec
from lightning_parallel.strategies.experts import apply_experts
from lightning_parallel.strategies.layer_sync import apply_layer_sync
from lightning_parallel.strategies.options import check_fsdp_units


# A module is parallelised in place once (fully_shard and checkpoint hooks cannot be applied
# twice); fit then test on one Trainer, or a second Trainer with the same layout, reuse it. The
# record lives in the module's own ``__dict__`` (not a parameter, buffer or submodule, so not in
# its state dict): it references the module (through the wrapper and the pipeline driver), and a
# global ``WeakKeyDictionary`` holding such values keeps every module alive forever; a reference
# cycle inside the module is freed by the garbage collector with the module.
_LAYOUT_ATTR = "_lightning_parallel_layout"
_LayoutRecord = tuple[tuple[Any, ...], nn.Module, Any, list[nn.Parameter]]


def layout_record(module: nn.Module) -> _LayoutRecord | None:
    return module.__dict__.get(_LAYOUT_ATTR)


class StepWrapper(nn.Module):
    """FSDP2 root around the LightningModule.

    Lightning calls ``training_step``, not ``forward``; its forward redirection calls this
    wrapper's ``forward`` with ``training_step`` patched in, so the FSDP root hooks (unshard,
    gradient reduction) run around the whole step exactly once, whatever the step calls.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class LayoutMixin:
    """The layout half of ``HybridParallelStrategy``: degrees, plans, application, materialisation."""

    def resolve_dims(self, world_size: int | None = None) -> ParallelDims:
        """Resolve the degrees for ``world_size`` (default: devices x num_nodes). No collective."""
        world_size = world_size if world_size is not None else self.num_nodes * self.num_processes
        degrees = dict(self._degrees)
        if degrees["tensor_parallel_size"] == "auto" and degrees["pipeline_parallel_size"] == "auto":
            cp = degrees["context_parallel_size"]  # an int: laid out on world / cp; "auto": the planner chooses it too
            choice = self._choose_3d_degrees(world_size // cp if isinstance(cp, int) and world_size % cp == 0 else world_size)
            degrees.update(tensor_parallel_size=choice.tp, pipeline_parallel_size=choice.pp, data_parallel_size=choice.dp,
                           context_parallel_size=choice.cp)
            if degrees["expert_parallel_size"] == "auto":  # 4D for a model with MoE layers, 1 for a dense one
                degrees["expert_parallel_size"] = choice.ep
        dims = ParallelDims.resolve(
            world_size, **degrees, sharded=self.zero_stage >= 2, hybrid=self.hybrid_shard, num_nodes=self.num_nodes
        )
        if dims.pp > 1 and self.zero_stage == 1:  # pipeline stages shard over dp with FSDP2 at every zero_stage >= 1
            dims = ParallelDims.resolve(world_size, **degrees, sharded=True, hybrid=self.hybrid_shard, num_nodes=self.num_nodes)
        return dims

    def _choose_3d_degrees(self, world_size: int) -> DegreeChoice:
        """Both model-parallel degrees "auto" (strategy '3d'): chosen from the model, once, logged on rank 0."""
        cached = self._degree_choice
        if cached is not None and cached[0] == world_size:
            return cached[1]
        module = self.lightning_module
        if module is None:
            raise RuntimeError(
                "The 3D degrees are chosen from the model, and no model is attached yet. HINT: read"
                " distributed_sampler_kwargs after Trainer.fit has started, call strategy.connect(model) first,"
                " or give tensor_parallel_size and pipeline_parallel_size as ints."
            )
        module = planning_view(module)  # layers built in configure_model(): planned on a meta-device twin
        virtual = resolve_virtual_stages(schedule_spec(self.pipeline_schedule), self.virtual_stages)
        choice = choose_3d_degrees(
            module, world_size, processes_per_node=max(1, self.num_processes),
            data_parallel_size=self._degrees["data_parallel_size"], tp_plan=self.tp_plan,
            virtual_stages=virtual, split_points=self.split_points, **planner_inputs(self, module),
        )
        rank_zero_info(choice.explain())
        self._degree_choice = (world_size, choice)
        return choice

    def _resolve_plans(self) -> None:
        """Plan the model's layout (pure inspection), so plan errors come before any collective.

        A model that builds its layers in ``configure_model`` has none yet: it is planned in
        ``setup()`` instead, symmetrically on every rank.
        """
        module = self.lightning_module
        if module is not None and layout_record(module) is not None:
            return  # laid out by an earlier stage (fit, then test): its plans were checked then
        if self.parallel_dims.ep > 1 and module is not None and any(True for _ in module.parameters()):
            validate_expert_parallel(module, self.parallel_dims.ep)  # no MoE layer, E % ep: before any collective
        if self.parallel_dims.cp > 1 and module is not None and any(True for _ in module.parameters()):
            routable_models(module, self.parallel_dims.cp)  # a model cp cannot route: before any collective
        if self._tp_resolved is None and self.parallel_dims.tp > 1 and module is not None and any(
            True for _ in module.parameters()
        ):
            self._tp_resolved = resolve_tp_plan(
                module, self.parallel_dims.tp, user_plan=self.tp_plan, strict=self.strict_plan,
                split_experts=self.parallel_dims.ep == 1,  # with ep > 1 expert parallelism owns the experts
                fsdp_composable=self.parallel_dims.grad_size > 1,  # no data parallelism: nothing shards beside tp
            )
            # A plan that leaves most of the model whole on every rank is refused, not warned about.
            check_split_share(module, self._tp_resolved, self.tensor_parallel_min_split, self.parallel_dims.ep)

    def _layout_signature(self) -> tuple[Any, ...]:
        dims = self.parallel_dims
        plan = tuple(sorted(self.tp_plan.items())) if self.tp_plan else None
        pipeline = (self.pipeline_schedule, self.microbatches, self.virtual_stages, tuple(self.split_points or ()))
        return (dims.shape, dims.ep, self.zero_stage, self.cpu_offload, prec.fsdp_param_dtype(self.precision_plugin),
                self.activation_checkpointing, plan, self.sequence_parallel, self.loss_parallel, pipeline)

    def _parallelize(self, module: pl.LightningModule) -> nn.Module:
        """Apply the layout once per module; a later setup with the same layout reuses it."""
        signature = self._layout_signature()
        record = layout_record(module)
        if record is not None:
            previous, root, self._pipeline, self._expert_params = record
            if previous != signature:
                raise RuntimeError(
                    f"This {type(module).__name__} was already parallelised with layout {previous}; it cannot be"
                    f" re-laid out as {signature} in place. HINT: build a fresh model and load a checkpoint into it"
                    " (checkpoints are layout-independent)."
                )
            return root
        root = self._apply_layout(module)
        module.__dict__[_LAYOUT_ATTR] = (signature, root, self._pipeline, self._expert_params)
        return root

    def _apply_layout(self, module: pl.LightningModule) -> nn.Module:
        """Apply the techniques in the documented order; return what Lightning should call."""
        dims = self.parallel_dims
        fsdp = dims.pp == 1 and dims.grad_size > 1 and (self.zero_stage >= 2 or dims.tp > 1)
        check_fsdp_units(self.fsdp_units, self.zero_stage, dims.tp, dims.pp, dims.grad_size)  # every rank, before any collective
        if dims.pp > 1:
            from lightning_parallel.strategies.pipeline.driver import PipelineDriver

            check_compile_layout(self._compile_kwargs, dims.pp, dims.tp)
            # Stages are traced from the first real batch (the traced graph fixes its shape);
            # tensor parallelism is applied to the traced stages then (parallel/pipeline/tensor.py).
            if dims.tp > 1:
                self._log_tp_plan()
            if dims.cp > 1:  # before tracing: the stages record the routed attention as one op (parallel/context/traced.py)
                route_hf_models(module, dims.cp)
            # A meta-built model stays meta: the driver traces it and materialises this rank's stages only.
            self._pipeline = PipelineDriver(self, module)
            return module
        apply_layer_sync(self._layer_sync, module, dims)  # BatchNorm statistics over the dp group
        blocks = find_repeated_blocks(module)
        check_compile_layout(self._compile_kwargs, dims.pp, dims.tp)  # "auto" degrees resolved now
        check_compile_model(self._compile_kwargs, module, dims.tp, self.sequence_parallel)
        if dims.tp > 1:
            apply_tensor_parallel(
                module, dims.axis(TP), self._log_tp_plan(), sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel
            )
        experts, self._expert_params = apply_experts(module, dims, self.moe_aux_loss_coef, self.moe_z_loss_coef)
        if dims.cp > 1:  # attention, positions and labels= across the sequence's chunks (parallel/context/hf.py)
            route_hf_models(module, dims.cp)
        if self.activation_checkpointing:
            self._checkpointed_blocks = apply_activation_checkpointing(module, blocks)
        if self._compile_kwargs is not None:  # after tp and checkpointing (traced in), before FSDP2 / DDP hooks
            self._compiled_blocks = apply_compile(blocks, self._compile_kwargs)
        if fsdp:
            # DTensor parameters (tensor parallel) cannot go through DDP: FSDP2 over the
            # (replicate, shard) mesh covers replication too (shard size 1 = all-reduce only).
            root = StepWrapper(module)
            apply_fsdp(
                root,
                [block for _, block in blocks],
                dims.data_parallel_mesh(),
                reshard_after_forward=self.zero_stage == 3,  # 0 with tp: nothing is sharded anyway
                mixed_precision=prec.fsdp_param_dtype(self.precision_plugin),  # the Trainer's precision
                cpu_offload=self.cpu_offload,
                own_meshes=[(m, dims.axis(EDP)) for m in experts.values()],
                split_blocks=self.fsdp_units == "sublayer",
            )
            self._materialize(root)  # meta-built model: each rank allocates and initialises its shards only
            return root
        self._materialize(module)  # DDP broadcasts real tensors; tp / ep parameters are DTensor shards already
        if dims.grad_size > 1:  # gradients averaged over dp (x cp: context-parallel ranks hold different ones)
            if self._expert_params:  # averaged over edp by reduce_expert_grads, not by DDP over dp
                names = [n for n, p in module.named_parameters() if any(p is q for q in self._expert_params)]
                ddp_ignore(module, names)
            return apply_ddp(
                module,
                dims.axis(dims.grad_axis),
                bucket_cap_mb=self.ddp_bucket_cap_mb,
                find_unused_parameters=self.find_unused_parameters,
            )
        return module

    @property
    def _uses_zero_redundancy_optimizer(self) -> bool:
        """ZeRO-1 without pipelines shards the optimizer with torch's ZeroRedundancyOptimizer (pipeline
        stages shard with FSDP2 at every zero_stage >= 1, see parallel/pipeline/fsdp.py)."""
        dims = self.parallel_dims
        return self.zero_stage == 1 and dims.grad_size > 1 and dims.pp == 1

    @property
    def tensor_parallel_plan(self) -> TensorParallelPlan:
        """The resolved tensor-parallel plan (module -> style) for the attached module."""
        self._resolve_plans()
        if self._tp_resolved is None:
            raise RuntimeError("No tensor-parallel plan: tensor_parallel_size is 1 or no module with parameters is attached yet.")
        return self._tp_resolved

    def _log_tp_plan(self) -> TensorParallelPlan:
        plan = self.tensor_parallel_plan
        rank_zero_info(f"Tensor-parallel plan ({plan.source}):\n{plan.table()}")
        return plan

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if has_meta_tensors(self.model):  # built on the meta device: materialised after the layout
            move_real_tensors(self.model, self.root_device)
        else:
            self.model.to(self.root_device)

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``Trainer.init_module(empty_init=True)`` builds the model on the meta device (as Lightning's
        ModelParallelStrategy does); set-up applies the layout to the meta parameters, then each rank
        allocates and initialises only what it holds, from the random state recorded here, so the
        values are those of an eager build (see :mod:`lightning_parallel.parallel.materialize`)."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        self._meta_rng = RngSnapshot.capture(self.root_device)
        with MetaInitContext(self.root_device), self.precision_plugin.tensor_init_context():  # metrics: real states
            yield

    def _materialize(
        self, module: nn.Module, in_place: bool = False, also: Sequence[nn.Module] = (), full_shapes: dict[str, Any] | None = None
    ) -> dict[Tensor, Tensor]:
        """Allocate and initialise this rank's part of a meta-built model (no-op otherwise; no collective).
        ``in_place``: pipeline stages (``also``) share the module's parameter objects (see parallel/pipeline/meta.py);
        returns the tensors that had to be replaced by new objects, for the optimizers."""
        if not has_meta_tensors(module):
            return {}
        device = torch.device("cpu") if self.cpu_offload else self.root_device  # FSDP2 offload keeps shards on the CPU
        report = materialize_meta_module(module, device, getattr(self, "_meta_rng", None), buffer_device=self.root_device,
                                         in_place=in_place, also=also, full_shapes=full_shapes)
        self._meta_report = report  # for the monitor and the tests: what this rank holds, the largest temporary
        run_pending_loads(module, full_shapes)  # load_pretrained(...) on the meta model: each rank reads the slices it holds
        rank_zero_info(
            f"Materialised the meta-device model: {report.local_bytes / 2**20:.1f} MiB held on rank 0, largest"
            f" initialisation temporary {report.peak_temporary_bytes / 2**20:.1f} MiB"
        )
        return report.replaced
