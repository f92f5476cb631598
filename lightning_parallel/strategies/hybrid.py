"""``HybridParallelStrategy``: one mesh-driven Lightning strategy for every parallel layout.

The named strategies (``dp``, ``zero1`` ... ``3d``) are presets of this class, so every
combination of axes goes through the same code. Composition order, applied in ``setup()`` to
the user's unchanged LightningModule::

    pipeline split -> tensor parallel -> expert parallel -> activation checkpointing
    -> data parallel (DDP, ZeRO-1 optimizer sharding, or FSDP2 sharding for ZeRO-2/3/HSDP)

Everything that depends only on the options is validated in ``__init__``; everything that
depends on the world size in ``setup_environment()`` before the process group exists. No rank
ever waits on a collective because of a configuration error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.compat import ddp_ignore
from lightning_parallel.compat_lightning import (
    MultiProcessingLauncher as _MultiProcessingLauncher,
    SubprocessScriptLauncher as _SubprocessScriptLauncher,
    all_gather_ddp_if_available as _all_gather_ddp_if_available,
    distributed_is_initialized as _distributed_is_initialized,
    optimizers_to_device as _optimizers_to_device,
    set_device_mesh,
    sync_ddp_if_available as _sync_ddp_if_available,
    unwrap_optimizer,
)
from lightning_parallel.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_parallel.parallel.compile import apply_compile, check_compile_layout, compile_kwargs
from lightning_parallel.parallel.blocks import find_repeated_blocks
from lightning_parallel.parallel.data_parallel import apply_ddp, apply_fsdp, fsdp_modules
from lightning_parallel.parallel.auto_degrees import DegreeChoice, choose_3d_degrees
from lightning_parallel.strategies.auto_layout import planner_inputs
from lightning_parallel.parallel.pipeline_schedules import resolve_virtual_stages, schedule_spec
from lightning_parallel.parallel.dims import DP, EDP, TP, Degree, ParallelDims
from lightning_parallel.parallel.expert_parallel import validate_expert_parallel
from lightning_parallel.parallel.materialize import MetaInitContext, RngSnapshot, has_meta_tensors, materialize_meta_module, move_real_tensors
from lightning_parallel.parallel.tensor_parallel import apply_tensor_parallel
from lightning_parallel.parallel.tp_plan import TensorParallelPlan, resolve_tp_plan
from lightning_parallel.parallel.zero import shard_optimizer_state
from lightning_parallel.pretrained import run_pending_loads
from lightning_parallel.strategies import checkpoint as ckpt
from lightning_parallel.strategies import precision as prec
from lightning_parallel.strategies.engine import StepEngine, engine_for
from lightning_parallel.strategies.experts import apply_experts
from lightning_parallel.strategies.layer_sync import apply_layer_sync, check_layer_sync
from lightning_parallel.strategies.resume import (
    RNG_KEY,
    consumed_batches,
    gather_rng_states,
    make_resumable,
    restore_rng_state,
)
from lightning_parallel.strategies.async_checkpoint import AsyncCheckpointWriter
from lightning_parallel.strategies.collective_errors import explain_collective_errors, nccl_watchdog_defaults
from lightning_parallel.strategies.nonfinite import NonFiniteGuard, NonFiniteMode, validate_nonfinite
from lightning_parallel.strategies.process_group import check_backend, default_backend, init_process_group
from lightning_parallel.strategies.options import (
    as_timedelta,
    check_fsdp_units,
    check_pipeline_precision,
    validate_more_options,
    validate_options,
)


# A module is parallelised in place once (fully_shard and checkpoint hooks cannot be applied
# twice); fit then test on one Trainer, or a second Trainer with the same layout, reuse it. The
# record lives in the module's own ``__dict__`` (not a parameter, buffer or submodule, so not in
# its state dict): it references the module (through the wrapper and the pipeline driver), and a
# global ``WeakKeyDictionary`` holding such values keeps every module alive forever; a reference
# cycle inside the module is freed by the garbage collector with the module.
_LAYOUT_ATTR = "_lightning_parallel_layout"
_LayoutRecord = tuple[tuple[Any, ...], nn.Module, Any, list[nn.Parameter]]


def _layout_record(module: nn.Module) -> _LayoutRecord | None:
    return module.__dict__.get(_LAYOUT_ATTR)


class _StepWrapper(nn.Module):
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


class HybridParallelStrategy(ParallelStrategy):
    """Data, ZeRO/FSDP2, tensor, pipeline and expert parallelism for an unchanged LightningModule.

    Args:
        data_parallel_size: ranks that see different data; ``"auto"`` = what the other degrees leave.
        tensor_parallel_size: ranks that split each layer (Megatron-style, DTensor).
        pipeline_parallel_size: pipeline stages.
        expert_parallel_size: ranks, drawn from the data-parallel ones, that split the experts.
        zero_stage: 0 replicated DDP, 1 optimizer-state sharding, 2 +gradients, 3 +parameters.
        cpu_offload: keep sharded state on the CPU (zero_stage 2-3).
        mixed_precision: deprecated alias of ``Trainer(precision=...)``, the one precision knob (see
            ``strategies/precision.py``); a value contradicting the Trainer's precision is an error.
        activation_checkpointing: recompute the repeated blocks' activations in backward.
        compile_blocks: ``torch.compile`` each repeated block in place (``True``: torch's defaults, or a
            mapping of ``torch.compile`` arguments such as ``{"backend": "aot_eager"}``); not with
            pipelines (see ``parallel/compile.py``).
        tp_plan: module-name glob -> style (``colwise``, ``rowwise``, ...), overriding the model's
            declared plan and the inferred one.
        strict_plan: a module that cannot be split by ``tensor_parallel_size`` is an error, not a warning.
        sequence_parallel: shard norms and dropout along the sequence between tensor-parallel regions.
        loss_parallel: keep the LM head's logits sharded over the vocabulary inside the steps and compute
            ``F.cross_entropy`` on the shards (``torch``'s ``loss_parallel``), never gathering the full
            logits for the loss; what else the step may do with the logits: :mod:`~lightning_parallel.parallel.tp_loss`.
        pipeline_schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zb``,
            ``zbv`` or ``dualpipev``.
        microbatches: microbatches per batch (``"auto"``: the number of stages, at least 2).
        virtual_stages: stages per rank for interleaved and V schedules (``"auto"``: what the schedule needs).
        split_points: module names that start a new pipeline stage (overrides the automatic cut).
        moe_aux_loss_coef, moe_z_loss_coef: override the MoE layers' loss coefficients (0 disables).
        hybrid_shard: HSDP, shard within ``data_parallel_size / data_parallel_replicate_size`` ranks
            and replicate across groups (``"auto"``: one group per node).
        ddp_bucket_cap_mb: DDP gradient bucket size; smaller buckets start communicating sooner.
        fsdp_units: ``"block"`` (default: one FSDP2 unit per repeated block, as torchtitan) or
            ``"sublayer"`` (a block's attention and MLP are units of their own: lower peak memory,
            one more unit per block to pay per step; ``parallel/data_parallel.py:sublayer_units``).
            Only where FSDP2 shards eager layouts (``zero_stage`` 2-3, or data x tensor parallelism).
        save_distributed_checkpoint: sharded DCP directory (default) or one consolidated file.
        async_save: write sharded checkpoints in the background (DCP ``async_save``): the step
            blocks only to copy the shards to CPU memory (see ``strategies/async_checkpoint.py``).
        on_nonfinite: a non-finite loss or gradient on any rank: ``"error"`` (default) stops every
            rank together naming the step and the first parameter, ``"skip"`` drops the step on
            every rank, ``"off"`` does not check (see ``strategies/nonfinite.py``).
        max_nonfinite_skips: with ``"skip"``, consecutive skipped steps before the run fails.
        timeout: collective timeout (seconds or timedelta): a dead peer fails the step, never hangs it.
        start_method: ``"popen"`` (re-run the script, like torchrun), or ``"spawn"``/``"fork"`` (notebooks,
            Hydra multirun).
    """

    strategy_name = "hybrid_parallel"

    def __init__(
        self,
        data_parallel_size: Degree = "auto",
        tensor_parallel_size: Degree = 1,
        pipeline_parallel_size: Degree = 1,
        expert_parallel_size: Degree = 1,
        zero_stage: int = 0,
        cpu_offload: bool = False,
        mixed_precision: str | None = None,
        activation_checkpointing: bool = False,
        compile_blocks: bool | Mapping[str, Any] = False,
        hybrid_shard: bool = False,
        data_parallel_replicate_size: Degree = "auto",
        tp_plan: dict[str, str] | None = None,
        strict_plan: bool = False,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        pipeline_schedule: str = "1f1b",
        microbatches: int | Literal["auto"] = "auto",
        virtual_stages: int | Literal["auto"] = "auto",
        split_points: list[str] | None = None,
        moe_aux_loss_coef: float | None = None,
        moe_z_loss_coef: float | None = None,
        ddp_bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        fsdp_units: Literal["block", "sublayer"] = "block",
        save_distributed_checkpoint: bool = True,
        async_save: bool = False,
        on_nonfinite: NonFiniteMode = "error",
        max_nonfinite_skips: int = 3,
        process_group_backend: str | None = None,
        timeout: timedelta | float = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork"] = "popen",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        degrees = {
            "data_parallel_size": data_parallel_size,
            "tensor_parallel_size": tensor_parallel_size,
            "pipeline_parallel_size": pipeline_parallel_size,
            "expert_parallel_size": expert_parallel_size,
            "data_parallel_replicate_size": data_parallel_replicate_size,
        }
        validate_options(
            degrees=degrees,
            zero_stage=zero_stage,
            cpu_offload=cpu_offload,
            mixed_precision=mixed_precision,
            activation_checkpointing=activation_checkpointing,
            hybrid_shard=hybrid_shard,
            start_method=start_method,
            strict_plan=strict_plan,
            sequence_parallel=sequence_parallel,
            tp_plan=tp_plan,
            loss_parallel=loss_parallel,
        )
        validate_more_options(
            pipeline_schedule=pipeline_schedule,
            microbatches=microbatches,
            virtual_stages=virtual_stages,
            split_points=split_points,
            moe_coefs={"moe_aux_loss_coef": moe_aux_loss_coef, "moe_z_loss_coef": moe_z_loss_coef},
            ddp_bucket_cap_mb=ddp_bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            async_save=async_save,
        )
        validate_nonfinite(on_nonfinite, max_nonfinite_skips)
        check_fsdp_units(fsdp_units, zero_stage, tensor_parallel_size, pipeline_parallel_size)
        compile_options = compile_kwargs(compile_blocks)  # typed errors here, before any process group
        check_compile_layout(compile_options, *(d if isinstance(d, int) else 1 for d in (pipeline_parallel_size, tensor_parallel_size)))
        prec.warn_mixed_precision_deprecated(mixed_precision)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._degrees = degrees
        self.zero_stage = zero_stage
        self.cpu_offload = cpu_offload
        self.mixed_precision = mixed_precision
        self.activation_checkpointing = activation_checkpointing
        self.compile_blocks = compile_blocks
        self._compile_kwargs = compile_options
        self._compiled_blocks: list[str] = []
        self.hybrid_shard = hybrid_shard
        self.tp_plan = dict(tp_plan) if tp_plan else None
        self.strict_plan = strict_plan
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self._tp_resolved: TensorParallelPlan | None = None
        self._degree_choice: tuple[int, DegreeChoice] | None = None
        self.pipeline_schedule = pipeline_schedule
        self.microbatches = microbatches
        self.virtual_stages = virtual_stages
        self.split_points = list(split_points) if split_points else None
        self.moe_aux_loss_coef = moe_aux_loss_coef
        self.moe_z_loss_coef = moe_z_loss_coef
        # Takes over the steps when the model is split into pipeline stages (see pipeline_driver.py).
        self._pipeline: Any | None = None
        self._expert_params: list[nn.Parameter] = []
        self._resume_skip_pending = False  # set when a checkpoint is restored for fit
        self._resume_rng: list[dict[str, Any]] | None = None
        self.ddp_bucket_cap_mb = ddp_bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.fsdp_units = fsdp_units
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._async_writer = AsyncCheckpointWriter() if async_save else None
        self._axis_groups: dict[str, list[int]] | None = None  # this rank's group on each mesh axis
        self._nonfinite = NonFiniteGuard(on_nonfinite, max_nonfinite_skips)
        self._process_group_backend = process_group_backend
        self._timeout = as_timedelta(timeout)
        self._start_method = start_method
        self._num_nodes = 1
        self._dims: ParallelDims | None = None
        self._checkpointed_blocks: list[str] = []
        self.train_batch_idx: int | None = None  # the training batch in progress (see on_train_batch_start)

    # ------------------------------------------------------------------ topology
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def parallel_dims(self) -> ParallelDims:
        """The resolved degrees; available from ``setup_environment()`` on."""
        if self._dims is None:
            raise RuntimeError(
                f"{type(self).__name__}.parallel_dims is resolved in setup_environment(), once the world size is known."
                " HINT: read it inside a LightningModule hook, not at construction."
            )
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.parallel_dims.mesh

    def resolve_dims(self, world_size: int | None = None) -> ParallelDims:
        """Resolve the degrees for ``world_size`` (default: devices x num_nodes). No collective."""
        world_size = world_size if world_size is not None else self.num_nodes * self.num_processes
        degrees = dict(self._degrees)
        if degrees["tensor_parallel_size"] == "auto" and degrees["pipeline_parallel_size"] == "auto":
            choice = self._choose_3d_degrees(world_size)
            degrees.update(tensor_parallel_size=choice.tp, pipeline_parallel_size=choice.pp, data_parallel_size=choice.dp)
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
        virtual = resolve_virtual_stages(schedule_spec(self.pipeline_schedule), self.virtual_stages)
        choice = choose_3d_degrees(
            module, world_size, processes_per_node=max(1, self.num_processes),
            data_parallel_size=self._degrees["data_parallel_size"], tp_plan=self.tp_plan,
            virtual_stages=virtual, split_points=self.split_points, **planner_inputs(self, module),
        )
        rank_zero_info(choice.explain())
        self._degree_choice = (world_size, choice)
        return choice

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dims = self._dims if self._dims is not None else self.resolve_dims()
        # Row-major mesh (pp, dp_replicate, dp_shard, tp): tp peers share a batch, pp stages too.
        dp_rank = (self.global_rank // dims.tp) % dims.dp
        return {"num_replicas": dims.dp, "rank": dp_rank}

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to honour ``self.log(..., sync_dist=True)`` (custom strategies must say so)."""
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        # The deprecated mixed_precision= folded into the Trainer's precision (or refused) first.
        self.precision_plugin = prec.resolve_precision_plugin(self.precision_plugin, self.mixed_precision, self.root_device.type)
        # Validate degrees against the world size before any process waits on another.
        self._dims = self.resolve_dims()
        self._resolve_plans()
        check_layer_sync(self._layer_sync, self._dims, self.lightning_module)  # Trainer(sync_batchnorm=True)
        check_pipeline_precision(self.precision_plugin, self._dims)  # Trainer(precision=...) the stages do not honour
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or default_backend(self.root_device, self.cpu_offload)
        check_backend(self._process_group_backend, self.root_device, self.cpu_offload)  # offloaded norms need gloo
        assert self.cluster_environment is not None
        nccl_watchdog_defaults(self._process_group_backend)  # before the group: NCCL reads them at creation
        init_process_group(self.cluster_environment, self._process_group_backend, self._timeout)  # per-attempt store
        mesh = self._dims.build_mesh(self.root_device.type)
        self._axis_groups = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in mesh.mesh_dim_names}
        rank_zero_info(f"{type(self).__name__}: {self._dims.describe()}, zero_stage={self.zero_stage}")

    def _resolve_plans(self) -> None:
        """Plan the model's layout (pure inspection), so plan errors come before any collective.

        A model that builds its layers in ``configure_model`` has none yet: it is planned in
        ``setup()`` instead, symmetrically on every rank.
        """
        module = self.lightning_module
        if module is not None and _layout_record(module) is not None:
            return  # laid out by an earlier stage (fit, then test): its plans were checked then
        if self.parallel_dims.ep > 1 and module is not None and any(True for _ in module.parameters()):
            validate_expert_parallel(module, self.parallel_dims.ep)  # no MoE layer, E % ep: before any collective
        if self._tp_resolved is None and self.parallel_dims.tp > 1 and module is not None and any(
            True for _ in module.parameters()
        ):
            self._tp_resolved = resolve_tp_plan(
                module, self.parallel_dims.tp, user_plan=self.tp_plan, strict=self.strict_plan,
                split_experts=self.parallel_dims.ep == 1,  # with ep > 1 expert parallelism owns the experts
            )

    # ------------------------------------------------------------------ model set-up
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        prec.use_sharded_grad_scaler(self.precision_plugin, self.root_device.type)  # 16-mixed: one overflow decision
        module = self.lightning_module
        assert module is not None
        set_device_mesh(module, self.device_mesh)  # LightningModule.device_mesh, as Lightning's own strategy sets
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.model = self._parallelize(module)
        self._install_global_norm_clipping()
        self._engine.configure_metrics(module)  # torchmetrics: which ranks a Metric syncs over
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _layout_signature(self) -> tuple[Any, ...]:
        dims = self.parallel_dims
        plan = tuple(sorted(self.tp_plan.items())) if self.tp_plan else None
        pipeline = (self.pipeline_schedule, self.microbatches, self.virtual_stages, tuple(self.split_points or ()))
        return (dims.shape, dims.ep, self.zero_stage, self.cpu_offload, prec.fsdp_param_dtype(self.precision_plugin),
                self.activation_checkpointing, plan, self.sequence_parallel, self.loss_parallel, pipeline)

    def _parallelize(self, module: pl.LightningModule) -> nn.Module:
        """Apply the layout once per module; a later setup with the same layout reuses it."""
        signature = self._layout_signature()
        record = _layout_record(module)
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
        fsdp = dims.pp == 1 and dims.dp > 1 and (self.zero_stage >= 2 or dims.tp > 1)
        check_fsdp_units(self.fsdp_units, self.zero_stage, dims.tp, dims.pp, dims.dp)  # every rank, before any collective
        if dims.pp > 1:
            from lightning_parallel.strategies.pipeline_driver import PipelineDriver

            check_compile_layout(self._compile_kwargs, dims.pp, dims.tp)
            # Stages are traced from the first real batch (the traced graph fixes its shape);
            # tensor parallelism is applied to the traced stages then (parallel/pipeline_tp.py).
            if dims.tp > 1:
                self._log_tp_plan()
            # A meta-built model stays meta: the driver traces it and materialises this rank's stages only.
            self._pipeline = PipelineDriver(self, module)
            return module
        apply_layer_sync(self._layer_sync, module, dims)  # BatchNorm statistics over the dp group
        blocks = find_repeated_blocks(module)
        check_compile_layout(self._compile_kwargs, dims.pp, dims.tp)  # "auto" degrees resolved now
        if dims.tp > 1:
            apply_tensor_parallel(
                module, dims.axis(TP), self._log_tp_plan(), sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel
            )
        experts, self._expert_params = apply_experts(module, dims, self.moe_aux_loss_coef, self.moe_z_loss_coef)
        if self.activation_checkpointing:
            self._checkpointed_blocks = apply_activation_checkpointing(module, blocks)
        if self._compile_kwargs is not None:  # after tp and checkpointing (traced in), before FSDP2 / DDP hooks
            self._compiled_blocks = apply_compile(blocks, self._compile_kwargs)
        if fsdp:
            # DTensor parameters (tensor parallel) cannot go through DDP: FSDP2 over the
            # (replicate, shard) mesh covers replication too (shard size 1 = all-reduce only).
            root = _StepWrapper(module)
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
        if dims.dp > 1:
            if self._expert_params:  # averaged over edp by reduce_expert_grads, not by DDP over dp
                names = [n for n, p in module.named_parameters() if any(p is q for q in self._expert_params)]
                ddp_ignore(module, names)
            return apply_ddp(
                module,
                dims.axis(DP),
                bucket_cap_mb=self.ddp_bucket_cap_mb,
                find_unused_parameters=self.find_unused_parameters,
            )
        return module

    @property
    def _uses_zero_redundancy_optimizer(self) -> bool:
        """ZeRO-1 without pipelines shards the optimizer with torch's ZeroRedundancyOptimizer (pipeline
        stages shard with FSDP2 at every zero_stage >= 1, see parallel/pipeline_fsdp.py)."""
        dims = self.parallel_dims
        return self.zero_stage == 1 and dims.dp > 1 and dims.pp == 1

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
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if not self._uses_zero_redundancy_optimizer:
            return
        group = self.parallel_dims.axis(DP).get_group()
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
        ``in_place``: pipeline stages (``also``) share the module's parameter objects (see parallel/pipeline_meta.py);
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

    # ------------------------------------------------------------------ steps
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
            return engine.training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        with self._explain("backward (gradient reduction)"):
            return self._engine.backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine.eval_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine.eval_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
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

    # ------------------------------------------------------------------ collectives
    def _data_parallel_group(self) -> dist.ProcessGroup | None:
        if self._dims is None or self._dims._mesh is None or self._dims.dp == self._dims.world_size:
            return None
        return self._dims.axis(DP).get_group()

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce over the data-parallel group by default: tensor and pipeline peers hold the same value."""
        if not isinstance(tensor, Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group if group is not None else self._data_parallel_group(), reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather over the data-parallel group by default, like ``reduce``: tensor and pipeline peers
        hold the same value, so gathering over the world would repeat each sample tp x pp times."""
        return _all_gather_ddp_if_available(tensor, group=group if group is not None else self._data_parallel_group(),
                                            sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Count over the world: ``reduce`` sums over the data-parallel group only, so Lightning's
        default (sum == world size) would be False for every decision under tp or pp."""
        if not _distributed_is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag > 0)

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return self._engine.model_state(full=not self._save_distributed_checkpoint)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = unwrap_optimizer(optimizer)
        assert self.lightning_module is not None
        return self._engine.optimizer_state(optimizer, full=not self._save_distributed_checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        with self._explain("checkpoint save"):
            self._save_checkpoint(checkpoint, filepath, storage_options)

    def _save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        target = self.broadcast(str(filepath))
        checkpoint[RNG_KEY] = gather_rng_states()
        if self._async_writer is not None and self._fitting_now():
            self._async_writer.save(checkpoint, ckpt.local_path(target, "async_save=True"))
        elif self._save_distributed_checkpoint:
            ckpt.save_sharded(checkpoint, ckpt.local_path(target, "save_distributed_checkpoint=True"))
        else:  # the string as given: Lightning's checkpoint IO writes fsspec URLs (s3://, gs://) itself
            super().save_checkpoint(checkpoint, target, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.finish_pending_save()  # a checkpoint still being written in the background is complete first
        path = ckpt.local_path(self.broadcast(str(checkpoint_path)), "loading a checkpoint")
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        self._resume_skip_pending = fitting
        loaded = self._engine.load(path, fitting)  # each rank reads only what it holds
        # Restored now (right for a checkpoint at an epoch end) and again once a mid-epoch resume
        # has created its data iterator, which draws from the RNG where the saved run did not.
        self._resume_rng = loaded.get(RNG_KEY) if fitting else None
        restore_rng_state(self._resume_rng)
        return loaded

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Resume mid-epoch at the right batch (see :mod:`lightning_parallel.strategies.resume`)."""
        return make_resumable(dataloader, self._batches_to_skip, lambda _: restore_rng_state(self._resume_rng))

    def _batches_to_skip(self, loader: torch.utils.data.DataLoader) -> int:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not self._resume_skip_pending or trainer is None or not trainer.training:
            return 0
        self._resume_skip_pending = False
        return consumed_batches(trainer, loader)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Already loaded in place by ``load_checkpoint`` (with resharding)."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Already loaded in place by ``load_checkpoint`` (with resharding)."""

    def _fitting_now(self) -> bool:
        """Saves during ``fit`` go to the background; one after it (``trainer.save_checkpoint`` once
        fit returned) is written at once: no later save, load or teardown would complete it."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING

    def finish_pending_save(self) -> None:
        """Wait for a background save (``async_save=True``) and put it in place (collective)."""
        if self._async_writer is not None and self._async_writer.pending:
            self._async_writer.wait()

    def _close_async_writer(self) -> None:
        if self._async_writer is not None:
            self._async_writer.close()

    @override
    def teardown(self) -> None:
        if _distributed_is_initialized():
            self._close_async_writer()  # the last checkpoint is complete before the run ends
        if isinstance(self.model, (DistributedDataParallel, _StepWrapper)):
            self.model = self.lightning_module
        assert self.cluster_environment is not None and self.accelerator is not None
        # Lightning's ``Strategy.teardown`` minus its ``lightning_module.cpu()`` (as Lightning's own
        # ModelParallelStrategy): sharded and pipelined parameters stay where their layout put them.
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
