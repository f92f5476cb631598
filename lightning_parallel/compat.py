"""Every private torch API lightning_parallel uses, in one place, each with the public API to move to.

Why one module: private names (underscore modules, classes, methods and attributes) change without deprecation between
torch releases. Kept here, a torch upgrade breaks one file, at import, with the name of what moved, instead of a
pipeline step on rank 3; and each entry says what to switch to once torch publishes it. ``tests/test_compat.py`` fails
when another module of the package imports a private torch name directly, and checks that every entry of
:data:`PRIVATE_APIS` still resolves in the installed torch.

"Since" is the oldest torch release whose Python sources define the name, read from the released wheels of 2.4 to 2.12
(2.4 means "2.4 or older"; 2.13 is the one installed and tested). The package as a whole needs torch >= 2.12
(:data:`TORCH_LOWER_BOUND`; see ``pyproject.toml``). Lightning's private names live in
:mod:`lightning_parallel.compat_lightning` so that the torch layer (``parallel/``) keeps importing nothing from
Lightning. The two private names of litdata (an optional library the data-parallel view serves) live here too, each with
the litdata release it was read from.

Not routed through here, by judgement: ``nn.Module``'s ``_parameters``/``_buffers``/``_modules``/``_apply`` (the
documented way to replace a tensor in place while keeping its name; torch's own ``nn.utils`` do the same); methods a
subclass overrides of the class it derives from here (:class:`GraphPipelineStage` below names them); and other
libraries' private attributes read by duck typing (``transformers``: ``_tp_plan``, ``_pp_plan``,
``_gradient_checkpointing_func``, ``_is_hf_initialized``, ``_initialize_weights``, ``config._attn_implementation``;
``torchmetrics``: ``Metric._defaults``, ``_forward_cache``, ``_update_count``, ``_computed``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

# --- pytree: flatten/unflatten nested containers of tensors --------------------------------
# Why: stage inputs/outputs, logged values and traced arguments are arbitrary nests.
# Since: 2.4 (far older). Public: none in torch (torch.utils._pytree is what torch's own
# distributed code uses; the standalone `optree` package is the public equivalent).
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_map, tree_unflatten

# --- composable activation checkpointing (a hook, not a wrapper class) ---------------------
# Why: keeps parameter names (FQNs) unchanged, so checkpoints load under any layout; the
# wrapper-class alternative (checkpoint_wrapper) inserts `_checkpoint_wrapped_module.` into
# every name. Since: 2.4. Public: none yet (torch.utils.checkpoint.checkpoint is the functional
# form, which needs the model's forward to call it).
from torch.distributed._composable import checkpoint as checkpoint_module

# --- meta-device construction ---------------------------------------------------------------
# Why: MetaInitContext subclasses the mode behind `with torch.device("meta")` to leave
# torchmetrics states on the real device (a metric's state must not be meta). Since: 2.4.
# Public: `with torch.device(...)` / torch.set_default_device, which cannot make that exception.
from torch.utils._device import DeviceContext
from torch.utils._device import _device_constructors as device_constructors

# --- fake tensors ---------------------------------------------------------------------------
# Why: an opaque MoE op must recognise shape-propagation inputs (fake or meta) and skip its
# collectives. Since: 2.4. Public: none yet.
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

# --- dispatch modes -------------------------------------------------------------------------
# Why: the tensor-parallel planner records a forward's ATen calls (parallel/tensor/dataflow_record.py).
# Since: 2.0. Public: none yet.
from torch.utils._python_dispatch import TorchDispatchMode

# --- functional collectives -----------------------------------------------------------------
# Why: DTensor redistributions return AsyncCollectiveTensor, which waits on first use; a value
# crossing a pipeline stage must be waited for before the send, and one entering a compiled block
# (tp_attention.settled) before AOT autograd sees it; the tests' collective recorder
# wraps the module's functions (DTensor's redistributions call them); context-parallel attention
# all-gathers keys and values with ``all_gather_single_autograd`` (its backward reduce-scatters;
# torch.distributed.nn's all_gather, the public one, is deprecated and gave wrong key/value
# gradients on gloo here, torch 2.13). Since: 2.4. Public: none yet.
from torch.distributed import _functional_collectives as functional_collectives

# --- torch's context-parallel ring attention ----------------------------------------------
# Why: on CUDA, context parallelism runs torch's own ring attention (fused flash kernels per block,
# merged by log-sum-exp) where its one mask applies: causal over head-tail chunks, this package's
# layout (parallel/context/torch_ring.py). Since: 2.12 here (the package's lower bound; the module
# moved to _context_parallel in a recent release, older wheels not checked). Public:
# torch.distributed.tensor.experimental.context_parallel, a context manager that shards whole
# buffers and patches SDPA, so it cannot take this package's chunks, padding or windows.
from torch.distributed.tensor.experimental._context_parallel._attention import (
    _templated_ring_attention as templated_ring_attention,
    _templated_ring_attention_backward as templated_ring_attention_backward,
)
from torch.distributed._functional_collectives import AsyncCollectiveTensor

# --- DTensor internals ----------------------------------------------------------------------
# Why: packed weights ([q|k|v], [gate|up]) are sharded so each rank holds its slice of every
# part; plain Shard would give rank 0 all of q. Since: 2.5 (torch.distributed.tensor). Public:
# none yet (torch.distributed.tensor exports it only under its private name).
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

# Why: which slice of a global tensor a rank holds, to index a sharded vocabulary (tp_loss; the
# pretrained loader asks distribute_tensor instead, which also splits strided shards right). Since: 2.5. Public: none yet (DCP reaches the same
# through DTensor.__create_chunk_list__, which is private too).
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# --- torch.distributed.pipelining internals ---------------------------------------------------
# Why: the traced frontend's stage class (what Pipe.build_stage returns); TracedStage subclasses
# it and overrides _get_init_p2p_neighbors_ops (2.9), _create_act_recv_info and
# _create_act_send_info (2.4), and writes _stage_meta.outputs (2.12: the lower bound of the
# package). Since: 2.4. Public: build_stage() returns one, but cannot be subclassed; none yet.
from torch.distributed.pipelining.stage import _PipelineStage as GraphPipelineStage

# Why: Pipe.build_stage moves the traced graph's device constants to the stage's device; we
# build TracedStage ourselves, so we repeat that step. Since: 2.4. Public: none (Pipe.build_stage).
from torch.distributed.pipelining._IR import _modify_graph_op_device as modify_graph_op_device

# Why: a forward-only schedule for evaluation of interleaved/V layouts is a runtime with a
# hand-written action list. Since: 2.5 (runtime), 2.4 (actions). Public: none yet
# (PipelineScheduleMulti takes no action list).
from torch.distributed.pipelining.schedules import _Action as PipelineAction
from torch.distributed.pipelining.schedules import _ComputationType as PipelineComputationType
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime as PipelineScheduleRuntime

# --- FSDP2 internals ------------------------------------------------------------------------
# Why: FSDP2's default all-gather and the base of a custom reduce-scatter (``FSDPModule.set_custom_all_gather``
# / ``set_custom_reduce_scatter``, public methods whose argument types are not exported): on the CPU
# ours reuse buffers and free them early (parallel/data/fsdp_host.py). Since: 2.9. Public: none yet.
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as FsdpReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather as FsdpDefaultAllGather

# --- nn internals ---------------------------------------------------------------------------
# Why: one base class for BatchNorm1d/2d/3d (and their lazy forms) to find and replace them for
# data-parallel statistics. Since: 2.4 (far older). Public: none; the tuple of public classes
# (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d) misses user subclasses of the base.
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

#: The oldest torch release with every API the package uses (see pyproject.toml): 2.12 adds
#: ``_PipelineStage._stage_meta``, which :class:`GraphPipelineStage`'s subclass rewrites.
TORCH_LOWER_BOUND = (2, 12)


def assert_tensor_metadata_op() -> Any:
    """``aten._assert_tensor_metadata.default``: the check ``torch.export`` records for ``.to(dtype)``.

    Why: pipeline stages under tensor parallelism run on DTensors whose metadata the check
    rejects; the unused assertions are removed from the traced graph. Since: 2.4 (op in
    native_functions). Public: none (an aten-internal op).
    """
    return torch.ops.aten._assert_tensor_metadata.default


def flash_attention_ops(device_type: str) -> tuple[Any, Any]:
    """The device's flash-attention kernel and its backward, both returning what a log-sum-exp merge
    needs: ``aten._scaled_dot_product_flash_attention_for_cpu`` (fp32/fp64/bf16 on the CPU) or
    ``aten._scaled_dot_product_flash_attention`` (CUDA, fp16/bf16).

    Why: context-parallel attention runs blocks of the sequence through the fused kernel and merges
    them by their log-sum-exp, which the public SDPA does not return. Since: 2.4 (ops in
    native_functions). Public: none (aten-internal ops behind F.scaled_dot_product_attention).
    """
    aten = torch.ops.aten
    if device_type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    return aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward.default


@contextmanager
def torch_ring_rotation(method: str) -> Iterator[None]:
    """torch's ring-attention engine with key/value rotation ``method`` ("ALL_GATHER" or "ALL_TO_ALL")
    and head-tail load balancing, for the calls inside the block; the module-level options restored after.

    Why: :func:`templated_ring_attention` reads both from ``_cp_options``, a module global (its public
    setter, ``set_rotate_method``, changes it for the whole process). Since: 2.12 here (see above).
    Public: ``torch.distributed.tensor.experimental._context_parallel.set_rotate_method`` (global).
    """
    from torch.distributed.tensor.experimental._context_parallel import _attention

    options = _attention._cp_options
    previous = options.rotate_method, options.enable_load_balance
    options.rotate_method, options.enable_load_balance = _attention._RotateMethod[method], True
    try:
        yield
    finally:
        options.rotate_method, options.enable_load_balance = previous


def foreach_norm(tensors: Sequence[Tensor], ord: float = 2.0, dtype: torch.dtype | None = None) -> list[Tensor]:
    """``torch._foreach_norm``: the ``ord``-norm of each tensor in one fused pass (in ``dtype``).

    Why: the non-finite guard checks every gradient every step, and global-norm clipping needs
    each local shard's norm per group of mesh axes. Since: 2.4 (``dtype``: 2.5). Public:
    ``torch.linalg.vector_norm`` per tensor (slower: one kernel each), or
    ``torch.nn.utils.get_total_norm(foreach=True)`` (2.6) when only the total is needed.
    """
    return list(torch._foreach_norm(list(tensors), ord, dtype=dtype))


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``DeviceMesh._flatten``: merge a sub-mesh's axes into one named axis (``dp`` from replicate x shard).

    Why: one process group over several axes, reachable by name. Since: 2.5. Public: none yet
    (torchtitan calls the same private method).
    """
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``DeviceMesh._unflatten``: split one axis into several named ones (``dp`` -> ``edp`` x ``ep``).

    Why: expert parallelism reuses the data-parallel ranks, regrouped. Since: 2.10. Public: none
    yet (init_device_mesh builds only the root mesh).
    """
    return mesh._unflatten(dim, sizes, names)


def ddp_ignore(module: nn.Module, names: Sequence[str]) -> None:
    """``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``.

    Why: DTensor parameters (tensor-parallel) and expert parameters are reduced by their own
    groups; DDP must neither broadcast nor all-reduce them. Since: 2.4 (far older). Public:
    none (FSDP2's ``ignored_params`` is the FSDP counterpart; DDP has no public argument).
    """
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(names))


def run_generated_code(module: nn.Module) -> None:
    """Set ``InterpreterModule._run_with_interpreter = False`` on every submodule that has it.

    Why: ``torch.export.unflatten`` modules interpret their graph node by node by default, which
    made a traced stage's forward twice as slow as the generated Python code. Since: 2.4.
    Public: none (the module-wide default ``torch.export.unflatten.RUN_WITH_INTERPRETER`` is
    private too).
    """
    for sub in module.modules():
        if hasattr(sub, "_run_with_interpreter"):
            sub._run_with_interpreter = False


def schedule_stages(schedule: Any) -> list[Any]:
    """The stages a pipeline schedule runs on this rank (``_stages``, or ``_stage`` for single-stage).

    Why: the driver needs each stage's module after building the schedule. Since: 2.4.
    Public: none yet (keep the stages you passed in, as the driver could).
    """
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


def op_arguments(op: Any) -> list[Any]:
    """``OpOverload._schema.arguments``: an ATen op's declared arguments (name, default).

    Why: the tensor-parallel planner binds recorded calls to argument names
    (parallel/tensor/dataflow.py). Since: 2.0. Public: none.
    """
    return list(op._schema.arguments)


def tensor_version(t: Tensor) -> int:
    """``t._version``, autograd's count of in-place writes to ``t``. Why: parallel/tensor/region_inputs.py
    shares a conversion of ``t`` only while it is unwritten. Since: 1.0. Public: none."""
    return t._version


def in_backward() -> bool:
    """``torch._C._current_graph_task_id() != -1``: whether an autograd backward pass is running on this thread.

    Why: the collective counter (testing/comm_counts.py) tells a forward collective from a backward
    one. Since: 1.13. Public: none.
    """
    return torch._C._current_graph_task_id() != -1


def comm_mode_native_ops() -> dict[Any, Any]:
    """``torch.distributed.tensor.debug._comm_mode.NATIVE_TO_PY_MAPPING``: c10d op -> the functional
    collective ``CommDebugMode`` counts it under.

    Why: the collective counter reads ``CommDebugMode``'s counts for a plain torch.distributed call.
    Since: 2.4. Public: none (``CommDebugMode.get_comm_counts`` reports the mapped names).
    """
    from torch.distributed.tensor.debug import _comm_mode

    return dict(_comm_mode.NATIVE_TO_PY_MAPPING)


def local_tensor(tensor: Any) -> Tensor | None:
    """``DTensor._local_tensor``: this rank's shard without an autograd edge, or None for a plain tensor.

    Why: memory accounting reads sizes without creating graph nodes. Since: 2.5
    (torch.distributed.tensor). Public: ``DTensor.to_local()`` (the same tensor under no_grad).
    """
    return getattr(tensor, "_local_tensor", None)


#: ``torch._C._nn._parse_to``: how ``Tensor.to`` / ``Module.to`` parse their arguments (device,
#: dtype, non_blocking, memory_format). Why: the tests' collective recorder follows where a CUDA run
#: would hold each tensor, and recognises this call among the functions its mode intercepts.
#: Since: 2.4 (far older). Public: none (``Tensor.to`` parses its arguments in C++).
parse_to = torch._C._nn._parse_to


def parse_to_device(*args: Any, **kwargs: Any) -> torch.device | None:
    """The device a ``Tensor.to(*args, **kwargs)`` call moves to (:data:`parse_to`), or None."""
    return parse_to(*args, **kwargs)[0]


def resolve_process_group(name: str) -> Any:
    """The process group registered under ``name`` (``distributed_c10d._resolve_process_group``).

    Why: functional collectives name their group by a string; the recorder maps it to ranks.
    Since: 2.4. Public: none yet.
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._resolve_process_group(name)


def process_group_device(group: Any = None) -> torch.device:
    """The device a process group's collectives run on (``distributed_c10d._get_pg_default_device``).

    Why: a rank whose tensors all live on the CPU (``cpu_offload``) still broadcasts on the device
    its group serves (NCCL: CUDA). Since: 2.4 (torch marks it "will be deprecated"). Public: none
    yet (torch's suggested ``_get_object_coll_device`` is private too).
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_pg_default_device(group)


def set_fsdp_unshard_async(module: Any, async_op: bool) -> None:
    """``FSDPModule._set_unshard_async_op``: issue this module's (and its FSDP2 submodules')
    all-gathers with ``async_op``.

    Why: on the CPU, FSDP2's blocking all-gathers keep the flat output of the last forward
    all-gather alive for a stream overlap the CPU does not have; asynchronous ones free it at the
    copy-out and let the backward prefetch run on gloo's thread (parallel/data/fsdp_host.py).
    Since: 2.6. Public: none yet (FSDPModule.unshard(async_op=True) for explicit prefetching).
    """
    module._set_unshard_async_op(async_op)


def storage_use_count(tensor: Tensor) -> int:
    """How many holders share ``tensor``'s storage (tensors and views of it, a collective's work, the
    storage's Python object). Why: a pooled buffer is free again when only the pool holds it
    (parallel/data/host_buffers.py). Since: 2.4 (2.0's CUDA-graph trees use it). Public: none."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def module_has_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs hooks of its own (``_forward_hooks``, ``_forward_pre_hooks``, ``_backward_hooks``,
    ``_backward_pre_hooks``). Why: a traced pipeline stage inlines a child's code into its own only when the call does
    nothing else (parallel/pipeline/codegen.py); tensor parallelism and FSDP2 act through hooks. Since: 2.4 (far older).
    Public: none (the register_* methods return handles, not a query)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks)


def tensor_has_grad_hooks(tensor: torch.Tensor) -> bool:
    """Whether hooks wait on ``tensor``'s gradient (``register_hook``, ``register_post_accumulate_grad_hook``). Why: a
    pipeline stage adds a weight's gradient in its GEMM only where none does (parallel/pipeline/grad_accumulation.py)."""
    return bool(tensor._backward_hooks) or bool(getattr(tensor, "_post_accumulate_grad_hooks", None))


def global_module_hooks() -> bool:
    """Whether any global module hook is registered (``nn.modules.module.register_module_forward_hook``
    and its siblings), which would see every module call. Why and since: as :func:`module_has_hooks`."""
    from torch.nn.modules import module as nn_module

    return any(getattr(nn_module, name) for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                    "_global_backward_hooks", "_global_backward_pre_hooks"))


def multihead_attention_init(module: nn.MultiheadAttention) -> Any:
    """``nn.MultiheadAttention._reset_parameters``: the module's own initialisation, as a callable.

    Why: a meta-built model is initialised module by module after allocation; MultiheadAttention
    has no public ``reset_parameters``. Since: 2.4 (far older). Public: none yet.
    """
    return module._reset_parameters


# --- litdata (optional; read from litdata 0.2.76, the release pinned in the test extra) ------
def litdata_env_class() -> Any:
    """litdata's ``_DistributedEnv`` (``litdata.utilities.env``), or ``None`` where litdata has not
    been imported.

    Why: its classmethod ``detect()`` is where every litdata object reads the rank and world size
    (``torch.distributed``, then the ``WORLD_SIZE``/``GLOBAL_RANK``/``NNODES`` variables); the
    data-parallel view (``parallel/data/loader_view.py``) answers it inside a loader's calls. Since:
    litdata 0.2.76 (read there). Public: none (``StreamingDataset.distributed_env``, a public
    attribute, is replaced instead wherever the dataset is at hand). Not imported here: litdata is
    optional, and a process that never imported it holds no litdata object to answer.
    """
    import sys

    module = sys.modules.get("litdata.utilities.env")
    return getattr(module, "_DistributedEnv", None) if module is not None else None


def litdata_wrapped_datasets(dataset: object) -> list[Any]:
    """The datasets a litdata ``CombinedStreamingDataset`` or ``ParallelStreamingDataset`` wraps
    (``_datasets``, declared by their base ``litdata.utilities.base._BaseStreamingDatasetWrapper``);
    ``[]`` for anything else.

    Why: each wrapped ``StreamingDataset`` holds its own rank and world size, which the
    data-parallel view replaces. Since: litdata 0.2.76 (read there). Public: none (the constructor
    argument ``datasets`` is not kept under a public name).
    """
    if not type(dataset).__module__.startswith("litdata."):
        return []
    return list(getattr(dataset, "_datasets", None) or ())


@dataclass(frozen=True)
class PrivateApi:
    """One private torch name the package uses: where it lives and what to move to."""

    name: str  # how this module exports it
    target: str  # "module:attr.attr" in torch
    since: str  # oldest torch release that defines it (checked in the 2.4-2.12 wheels)
    public: str  # the public API to move to, or "none yet"


PRIVATE_APIS: tuple[PrivateApi, ...] = (
    PrivateApi("module_has_hooks", "torch.nn.modules.module:Module._call_impl", "2.4", "none"),
    PrivateApi("global_module_hooks", "torch.nn.modules.module:_global_forward_hooks", "2.4", "none"),
    PrivateApi("tensor_has_grad_hooks", "torch._tensor:Tensor.register_post_accumulate_grad_hook", "2.4", "none"),
    PrivateApi("FsdpReduceScatter", "torch.distributed.fsdp._fully_shard._fsdp_api:ReduceScatter", "2.9", "none yet"),
    PrivateApi("FsdpDefaultAllGather", "torch.distributed.fsdp._fully_shard._fsdp_collectives:DefaultAllGather", "2.9", "none yet"),
    PrivateApi("storage_use_count", "torch:_C._storage_Use_Count", "2.4", "none"),
    PrivateApi("set_fsdp_unshard_async", "torch.distributed.fsdp:FSDPModule._set_unshard_async_op", "2.6", "none yet (FSDPModule.unshard(async_op=True))"),
    PrivateApi("tree_map", "torch.utils._pytree:tree_map", "2.4", "none yet (optree)"),
    PrivateApi("tree_leaves", "torch.utils._pytree:tree_leaves", "2.4", "none yet (optree)"),
    PrivateApi("tree_flatten", "torch.utils._pytree:tree_flatten", "2.4", "none yet (optree)"),
    PrivateApi("tree_unflatten", "torch.utils._pytree:tree_unflatten", "2.4", "none yet (optree)"),
    PrivateApi("TreeSpec", "torch.utils._pytree:TreeSpec", "2.4", "none yet (optree)"),
    PrivateApi("checkpoint_module", "torch.distributed._composable:checkpoint", "2.4", "none yet"),
    PrivateApi("DeviceContext", "torch.utils._device:DeviceContext", "2.4", "with torch.device(...)"),
    PrivateApi("device_constructors", "torch.utils._device:_device_constructors", "2.4", "none"),
    PrivateApi("FakeTensor", "torch._subclasses.fake_tensor:FakeTensor", "2.4", "none yet"),
    PrivateApi("FakeTensorMode", "torch._subclasses.fake_tensor:FakeTensorMode", "2.4", "none yet"),
    PrivateApi("TorchDispatchMode", "torch.utils._python_dispatch:TorchDispatchMode", "2.0", "none yet"),
    PrivateApi("AsyncCollectiveTensor", "torch.distributed._functional_collectives:AsyncCollectiveTensor", "2.4", "none yet"),
    PrivateApi("StridedShard", "torch.distributed.tensor.placement_types:_StridedShard", "2.5", "none yet"),
    PrivateApi("compute_local_shape_and_global_offset",
               "torch.distributed.tensor._utils:compute_local_shape_and_global_offset", "2.5", "none yet"),
    PrivateApi("GraphPipelineStage", "torch.distributed.pipelining.stage:_PipelineStage", "2.4", "build_stage() (not subclassable)"),
    PrivateApi("GraphPipelineStage._get_init_p2p_neighbors_ops",
               "torch.distributed.pipelining.stage:_PipelineStage._get_init_p2p_neighbors_ops", "2.9", "none"),
    PrivateApi("GraphPipelineStage._create_act_recv_info",
               "torch.distributed.pipelining.stage:_PipelineStage._create_act_recv_info", "2.4", "none"),
    PrivateApi("GraphPipelineStage._create_act_send_info",
               "torch.distributed.pipelining.stage:_PipelineStage._create_act_send_info", "2.4", "none"),
    PrivateApi("modify_graph_op_device", "torch.distributed.pipelining._IR:_modify_graph_op_device", "2.4", "Pipe.build_stage"),
    PrivateApi("PipelineAction", "torch.distributed.pipelining.schedules:_Action", "2.4", "none yet"),
    PrivateApi("PipelineComputationType", "torch.distributed.pipelining.schedules:_ComputationType", "2.4", "none yet"),
    PrivateApi("PipelineScheduleRuntime", "torch.distributed.pipelining.schedules:_PipelineScheduleRuntime", "2.5", "none yet"),
    PrivateApi("BatchNormBase", "torch.nn.modules.batchnorm:_BatchNorm", "2.4", "nn.BatchNorm1d/2d/3d (misses subclasses of the base)"),
    PrivateApi("assert_tensor_metadata_op", "torch:ops.aten._assert_tensor_metadata.default", "2.4", "none"),
    PrivateApi("foreach_norm", "torch:_foreach_norm", "2.4", "torch.linalg.vector_norm / nn.utils.get_total_norm"),
    PrivateApi("flatten_mesh", "torch.distributed.device_mesh:DeviceMesh._flatten", "2.5", "none yet"),
    PrivateApi("unflatten_mesh", "torch.distributed.device_mesh:DeviceMesh._unflatten", "2.10", "none yet"),
    PrivateApi("ddp_ignore",
               "torch.nn.parallel:DistributedDataParallel._set_params_and_buffers_to_ignore_for_model", "2.4",
               "none"),
    PrivateApi("run_generated_code", "torch.export.unflatten:InterpreterModule", "2.4", "none"),
    PrivateApi("schedule_stages", "torch.distributed.pipelining.schedules:PipelineScheduleSingle", "2.4", "none yet"),
    PrivateApi("local_tensor", "torch.distributed.tensor:DTensor._local_tensor", "2.5", "DTensor.to_local()"),
    PrivateApi("in_backward", "torch:_C._current_graph_task_id", "1.13", "none"),
    PrivateApi("tensor_version", "torch:Tensor._version", "1.0", "none"),
    PrivateApi("comm_mode_native_ops", "torch.distributed.tensor.debug._comm_mode:NATIVE_TO_PY_MAPPING", "2.4", "none"),
    PrivateApi("functional_collectives", "torch.distributed._functional_collectives:all_reduce", "2.4", "none yet"),
    PrivateApi("templated_ring_attention", "torch.distributed.tensor.experimental._context_parallel._attention:"
               "_templated_ring_attention", "2.12", "torch.distributed.tensor.experimental.context_parallel"),
    PrivateApi("templated_ring_attention_backward", "torch.distributed.tensor.experimental._context_parallel._attention:"
               "_templated_ring_attention_backward", "2.12", "torch.distributed.tensor.experimental.context_parallel"),
    PrivateApi("torch_ring_rotation", "torch.distributed.tensor.experimental._context_parallel._attention:_cp_options",
               "2.12", "set_rotate_method (process-wide)"),
    PrivateApi("flash_attention_ops", "torch:ops.aten._scaled_dot_product_flash_attention_for_cpu_backward", "2.4", "none"),
    PrivateApi("multihead_attention_init", "torch.nn:MultiheadAttention._reset_parameters", "2.4", "none yet"),
    PrivateApi("parse_to", "torch:_C._nn._parse_to", "2.4", "none"),
    PrivateApi("process_group_device", "torch.distributed.distributed_c10d:_get_pg_default_device", "2.4", "none yet"),
    PrivateApi("parse_to_device", "torch:_C._nn._parse_to", "2.4", "none"),
    PrivateApi("resolve_process_group", "torch.distributed.distributed_c10d:_resolve_process_group", "2.4", "none yet"),
    # litdata's, not torch's: "since" names the litdata release they were read from
    PrivateApi("litdata_env_class", "litdata.utilities.env:_DistributedEnv.detect", "litdata 0.2.76",
               "none (StreamingDataset.distributed_env, replaced where the dataset is at hand)"),
    PrivateApi("litdata_wrapped_datasets", "litdata.utilities.base:_BaseStreamingDatasetWrapper", "litdata 0.2.76", "none"),
)

#: Private attribute names reached only through the wrappers above (the test rejects ``x.<name>`` and ``getattr(x, "<name>")`` elsewhere).
PRIVATE_ATTRIBUTES = frozenset({
    "_assert_tensor_metadata", "_backward_hooks", "_backward_pre_hooks", "_datasets", "_flatten", "_foreach_norm", "_forward_hooks",
    "_forward_pre_hooks", "_get_pg_default_device", "_global_forward_hooks", "_local_tensor", "_parse_to", "_post_accumulate_grad_hooks",
    "_reset_parameters", "_resolve_process_group", "_run_with_interpreter", "_schema", "_set_params_and_buffers_to_ignore_for_model",
    "_set_unshard_async_op", "_stage", "_stages", "_storage_Use_Count", "_unflatten", "_version",
})

__all__ = [
    "PRIVATE_APIS", "PRIVATE_ATTRIBUTES", "TORCH_LOWER_BOUND", "AsyncCollectiveTensor", "BatchNormBase", "DeviceContext", "FakeTensor", "FakeTensorMode",
    "FsdpDefaultAllGather", "FsdpReduceScatter", "GraphPipelineStage", "PipelineAction", "PipelineComputationType", "PipelineScheduleRuntime", "PrivateApi", "StridedShard",
    "TreeSpec", "assert_tensor_metadata_op", "checkpoint_module", "compute_local_shape_and_global_offset", "ddp_ignore", "device_constructors",
    "flash_attention_ops", "flatten_mesh", "foreach_norm", "functional_collectives", "global_module_hooks", "litdata_env_class",
    "litdata_wrapped_datasets", "local_tensor", "modify_graph_op_device", "module_has_hooks", "multihead_attention_init", "op_arguments",
    "tensor_has_grad_hooks", "in_backward", "comm_mode_native_ops", "parse_to", "parse_to_device", "process_group_device", "resolve_process_group",
    "run_generated_code", "set_fsdp_unshard_async", "schedule_stages", "storage_use_count", "templated_ring_attention", "templated_ring_attention_backward",
    "torch_ring_rotation", "tree_flatten", "tree_leaves", "tree_map", "tree_unflatten", "unflatten_mesh", "tensor_version", "TorchDispatchMode",
]
