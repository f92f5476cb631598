"""``HybridParallelStrategy``: one mesh-driven Lightning strategy for every parallel layout.

The named strategies (``dp``, ``zero1`` ... ``3d``) are presets of this class, so every
combination of axes goes through the same code. Composition order, applied in ``setup()`` to
the user's unchanged LightningModule::

    pipeline split -> tensor parallel -> expert parallel -> activation checkpointing
    -> data parallel (DDP, ZeRO-1 optimizer sharding, or FSDP2 sharding for ZeRO-2/3/HSDP)

Everything that depends only on the options is validated in ``__init__``; everything that
depends on the world size in ``setup_environment()`` before the process group exists. No rank
ever waits on a collective because of a configuration error.

This file is Lightning's contract (options, topology, process group, ``setup``, ``teardown``) and a
dispatcher; the rest of the class lives beside it as mixins, one concern each: ``layout.py`` (the
degrees, the plans, the techniques applied in the order above, materialisation), ``steps.py``
(steps and the optimizer step, handed to the step engine of ``engine.py``), ``collectives.py``
and ``checkpoint/hooks.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_parallel.compat_lightning import (
    MultiProcessingLauncher as _MultiProcessingLauncher,
    SubprocessScriptLauncher as _SubprocessScriptLauncher,
    distributed_is_initialized as _distributed_is_initialized,
    optimizers_to_device as _optimizers_to_device,
    set_device_mesh,
)
from lightning_parallel.parallel.allocator import configure_allocators, huge_pages_missed
from lightning_parallel.parallel.compile import check_compile_layout, compile_kwargs
from lightning_parallel.planner.auto_degrees import DegreeChoice
from lightning_parallel.parallel.dims import Degree, ParallelDims
from lightning_parallel.parallel.tensor.split_share import DEFAULT_MIN_SPLIT
from lightning_parallel.parallel.tensor.plan import TensorParallelPlan
from lightning_parallel.strategies import precision as prec
from lightning_parallel.strategies.checkpoint.async_save import AsyncCheckpointWriter
from lightning_parallel.strategies.collective_errors import nccl_watchdog_defaults
from lightning_parallel.strategies.preflight import resolve_layout
from lightning_parallel.parallel.context.options import check_context_combination, validate_context_options
from lightning_parallel.strategies.nonfinite import NonFiniteGuard, NonFiniteMode, validate_nonfinite
from lightning_parallel.strategies.process_group import check_backend, default_backend, init_process_group
from lightning_parallel.strategies.checkpoint.hooks import CheckpointHooksMixin
from lightning_parallel.strategies.collectives import CollectivesMixin
from lightning_parallel.strategies.layout import LayoutMixin, StepWrapper
from lightning_parallel.strategies.steps import StepHooksMixin
from lightning_parallel.strategies.options import (
    as_timedelta,
    check_fsdp_units,
    validate_more_options,
    validate_options,
)


class HybridParallelStrategy(LayoutMixin, StepHooksMixin, CollectivesMixin, CheckpointHooksMixin, ParallelStrategy):
    """Data, ZeRO/FSDP2, tensor, pipeline and expert parallelism for an unchanged LightningModule.

    Args:
        data_parallel_size: ranks that see different data; ``"auto"`` = what the other degrees leave.
        tensor_parallel_size: ranks that split each layer (Megatron-style, DTensor).
        pipeline_parallel_size: pipeline stages.
        expert_parallel_size: ranks, drawn from the data-parallel ones, that split the experts.
        context_parallel_size: ranks that split every sequence (head-tail balanced chunks) and run attention
            across them; they see the same samples, and gradients are reduced over data x context ranks.
            For Hugging Face models inside the LightningModule (``parallel/context/``).
        context_parallel_attention: ``"allgather"`` (keys and values gathered per layer, Llama 3's form),
            ``"ring"`` (keys and values passed around the group, merged by log-sum-exp) or ``"ulysses"``
            (all-to-all from sequence chunks to head groups; ``context_parallel_size`` must divide the heads).
        context_parallel_batch_dims: batch entry path -> sequence dim (or None: keep whole), for entries the
            automatic rule (dim 1 of the length of the first 2-D entry) cannot tell (``parallel/context/batch.py``).
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
        tensor_parallel_min_split: the least fraction of the parameters tensor parallelism must split
            (those another axis divides, the experts under ``expert_parallel_size``, count as split);
            a plan below it is an error (``parallel/tensor/split_share.py``). 0 accepts any plan.
        sequence_parallel: shard norms and dropout along the sequence between tensor-parallel regions.
        loss_parallel: keep the LM head's logits sharded over the vocabulary inside the steps and compute
            ``F.cross_entropy`` on the shards (``torch``'s ``loss_parallel``), never gathering the full
            logits for the loss; what else the step may do with the logits: :mod:`~lightning_parallel.parallel.tensor.loss`.
        pipeline_schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zb``,
            ``zbv`` or ``dualpipev``.
        microbatches: microbatches per batch (``"auto"``: the number of stages, at least 2).
        virtual_stages: stages per rank for interleaved and V schedules (``"auto"``: what the schedule needs).
        split_points: module names that start a new pipeline stage (overrides the automatic cut).
        moe_aux_loss_coef, moe_z_loss_coef: override the MoE layers' loss coefficients (0 disables).
        hybrid_shard: HSDP, shard within ``data_parallel_size / data_parallel_replicate_size`` ranks
            and replicate across groups (``"auto"``: one group per node).
        ddp_bucket_cap_mb: DDP gradient bucket size; smaller buckets start communicating sooner. Pipeline
            stages with replicated data parallelism all-reduce their gradients in buckets of this size.
        fsdp_units: ``"block"`` (default: one FSDP2 unit per repeated block, as torchtitan) or
            ``"sublayer"`` (a block's attention and MLP are units of their own: lower peak memory,
            one more unit per block to pay per step; ``parallel/data/apply.py:sublayer_units``).
            Only where FSDP2 shards eager layouts (``zero_stage`` 2-3, or data x tensor parallelism).
        save_distributed_checkpoint: sharded DCP directory (default) or one consolidated file.
        async_save: write sharded checkpoints in the background (DCP ``async_save``): the step
            blocks only to copy the shards to CPU memory (see ``strategies/checkpoint/async_save.py``).
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
        context_parallel_size: Degree = 1,
        context_parallel_attention: Literal["allgather", "ring", "ulysses"] = "allgather",
        context_parallel_batch_dims: dict[str, int | None] | None = None,
        zero_stage: int = 0,
        cpu_offload: bool = False,
        mixed_precision: str | None = None,
        activation_checkpointing: bool = False,
        compile_blocks: bool | Mapping[str, Any] = False,
        hybrid_shard: bool = False,
        data_parallel_replicate_size: Degree = "auto",
        tp_plan: dict[str, str] | None = None,
        strict_plan: bool = False,
        tensor_parallel_min_split: float = DEFAULT_MIN_SPLIT,
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
            "context_parallel_size": context_parallel_size,
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
            tensor_parallel_min_split=tensor_parallel_min_split,
            async_save=async_save,
        )
        validate_nonfinite(on_nonfinite, max_nonfinite_skips)
        validate_context_options(context_parallel_attention, context_parallel_batch_dims)
        check_context_combination(*(d if isinstance(d, int) else 1 for d in (context_parallel_size, pipeline_parallel_size)),
                                  bool(compile_blocks),
                                  *(d if isinstance(d, int) else 1 for d in (tensor_parallel_size, expert_parallel_size)))
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
        self.context_parallel_attention = context_parallel_attention
        self.context_parallel_batch_dims = dict(context_parallel_batch_dims) if context_parallel_batch_dims else None
        self.cpu_offload = cpu_offload
        self.mixed_precision = mixed_precision
        self.activation_checkpointing = activation_checkpointing
        self.compile_blocks = compile_blocks
        self._compile_kwargs = compile_options
        self._compiled_blocks: list[str] = []
        self.hybrid_shard = hybrid_shard
        self.tp_plan = dict(tp_plan) if tp_plan else None
        self.strict_plan = strict_plan
        self.tensor_parallel_min_split = float(tensor_parallel_min_split)
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
        # Takes over the steps when the model is split into pipeline stages (see strategies/pipeline/driver.py).
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


    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dims = self._dims if self._dims is not None else self.resolve_dims()
        # Row-major mesh (pp, dp_replicate, dp_shard, cp, tp): tp and cp peers share a batch, pp stages too.
        dp_rank = (self.global_rank // (dims.tp * dims.cp)) % dims.dp
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
        # Precision folded in, degrees resolved and every plan and combination checked against the world
        # size before any process waits on another; the dry run (plan.py) calls the same function.
        self._dims = resolve_layout(self)
        # glibc's mmap threshold pinned (peak RSS 4.2 -> 0.7 P per rank under zero3) and CUDA's expandable
        # segments, before any buffer is allocated: see parallel/allocator.py.
        self._allocators = configure_allocators(self.root_device.type)
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
        if self.root_device.type == "cpu" and (missed := huge_pages_missed(self._allocators["host_huge_pages"])) is not None:
            rank_zero_info(f"{type(self).__name__}: {missed}")


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


    # ------------------------------------------------------------------ steps


    # ------------------------------------------------------------------ collectives


    # ------------------------------------------------------------------ checkpoints


    @override
    def teardown(self) -> None:
        if _distributed_is_initialized():
            self._close_async_writer()  # the last checkpoint is complete before the run ends
        if isinstance(self.model, (DistributedDataParallel, StepWrapper)):
            self.model = self.lightning_module
        assert self.cluster_environment is not None and self.accelerator is not None
        # Lightning's ``Strategy.teardown`` minus its ``lightning_module.cpu()`` (as Lightning's own
        # ModelParallelStrategy): sharded and pipelined parameters stay where their layout put them.
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
