"""The parallel degrees of a run, their validation, and the one named ``DeviceMesh``.

Every technique takes its sub-mesh from here, so the ranks that form a tensor-parallel group
are the same ranks whichever technique asks. Axis order, outermost first, is
``pp, dp_replicate, dp_shard, cp, tp``: tensor parallelism talks most and gets the innermost
(fastest, e.g. NVLink-local) ranks, context parallelism (keys and values of every attention
layer, parallel/context/) the next, pipeline stages talk least and span the slowest links.
Experts are drawn from the data-parallel ranks: the expert mesh splits the flattened ``dp``
axis (``dp_cp`` under context parallelism) into ``edp`` (outer) and ``ep`` (inner). Context-parallel ranks see the same samples (the
sampler's view is ``dp``) but hold different gradients, so gradients are reduced, and ZeRO
shards, over ``dp x cp`` (``dp_cp``), as torchtitan does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_parallel.compat import flatten_mesh, unflatten_mesh
from lightning_parallel.parallel.errors import config_error

# Mesh axis names: the only place they are spelled.
PP = "pp"
DP_REPLICATE = "dp_replicate"
DP_SHARD = "dp_shard"
CP = "cp"
TP = "tp"
DP = "dp"  # flattened dp_replicate x dp_shard: gradient reduction and the data sampler
PP_DP = "pp_dp"  # flattened pp x dp (one per tp rank): metric states under pipelines, no tp duplicates
EDP = "edp"  # data-parallel ranks outside an expert group
EP = "ep"
DP_CP = "dp_cp"  # flattened dp x cp: gradient reduction, ZeRO sharding and logged values under context parallelism
FSDP_REPLICATE, FSDP_SHARD = "fsdp_replicate", "fsdp_shard"  # dp_cp regrouped for HSDP under context parallelism
MESH_AXES = (PP, DP_REPLICATE, DP_SHARD, CP, TP)

Degree = int | Literal["auto"]


def check_degree(name: str, value: object) -> None:
    """A degree is a positive int or the string "auto" (bool is not an int here)."""
    if isinstance(value, str):
        if value != "auto":
            raise config_error(ValueError, name, value, 'a degree is a positive int or "auto"', f'use {name}="auto" or an int >= 1')
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise config_error(TypeError, name, value, 'a degree is a positive int or "auto"', f"pass an int such as {name}=2")
    if value < 1:
        raise config_error(ValueError, name, value, "a degree must be at least 1", f"use {name}=1 to disable this axis")


def _what_is_left(world_size: int, explicit: int, field: str, auto_name: str) -> int:
    """The degree an "auto" ``auto_name`` takes: the world size over the product of the explicit degrees."""
    if world_size % explicit:
        raise config_error(
            ValueError, field, explicit, f"it must divide the world size {world_size} for {auto_name}='auto'",
            "choose degrees that divide the number of processes",
        )
    return world_size // explicit


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees; ``dp_replicate * dp_shard * cp * tp * pp == world_size`` always holds."""

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    _mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)

    @classmethod
    def resolve(
        cls,
        world_size: int,
        *,
        data_parallel_size: Degree = "auto",
        tensor_parallel_size: Degree = 1,
        pipeline_parallel_size: Degree = 1,
        expert_parallel_size: Degree = 1,
        data_parallel_replicate_size: Degree = "auto",
        context_parallel_size: Degree = 1,
        sharded: bool = False,
        hybrid: bool = False,
        num_nodes: int = 1,
    ) -> ParallelDims:
        """Turn user-facing degrees (ints or "auto") into concrete ones, or raise a clear error.

        ``sharded`` puts the data-parallel ranks on the ``dp_shard`` axis (ZeRO-2/3); otherwise
        they replicate (DDP, ZeRO-1). ``hybrid`` splits them into replicate x shard (HSDP), with
        ``data_parallel_replicate_size="auto"`` meaning one replica per node. ``context_parallel_size``
        counts with the model degrees: its ranks share samples, as tensor-parallel ranks do.
        """
        for name, value in (
            ("data_parallel_size", data_parallel_size),
            ("tensor_parallel_size", tensor_parallel_size),
            ("pipeline_parallel_size", pipeline_parallel_size),
            ("expert_parallel_size", expert_parallel_size),
            ("data_parallel_replicate_size", data_parallel_replicate_size),
            ("context_parallel_size", context_parallel_size),
        ):
            check_degree(name, value)
        dp_given = 1 if data_parallel_size == "auto" else data_parallel_size
        # An "auto" degree takes the processes the explicit degrees leave (all of them, by default).
        if context_parallel_size == "auto":
            if "auto" in (tensor_parallel_size, pipeline_parallel_size):
                raise config_error(
                    ValueError, "context_parallel_size", "auto",
                    "it cannot be 'auto' together with an 'auto' tensor_parallel_size or pipeline_parallel_size",
                    "give the tensor and pipeline degrees as ints, or an int context_parallel_size",
                )
            cp = _what_is_left(world_size, dp_given * tensor_parallel_size * pipeline_parallel_size,
                               "data_parallel_size * tensor_parallel_size * pipeline_parallel_size", "context_parallel_size")
        else:
            cp = context_parallel_size
        if pipeline_parallel_size == "auto":
            pp = _what_is_left(world_size, cp * dp_given * (1 if tensor_parallel_size == "auto" else tensor_parallel_size),
                               "data_parallel_size * tensor_parallel_size", "pipeline_parallel_size")
        else:
            pp = pipeline_parallel_size
        if tensor_parallel_size == "auto":
            tp = _what_is_left(world_size, cp * pp * dp_given, "data_parallel_size * pipeline_parallel_size", "tensor_parallel_size")
        else:
            tp = tensor_parallel_size
        model_degrees = tp * pp * cp
        if data_parallel_size == "auto":
            if world_size % model_degrees:
                raise config_error(
                    ValueError,
                    "tensor_parallel_size * pipeline_parallel_size" + (" * context_parallel_size" if cp > 1 else ""),
                    f"{tp} * {pp}" + (f" * {cp}" if cp > 1 else "") + f" = {model_degrees}",
                    f"the product must divide the world size {world_size}",
                    "choose degrees whose product divides the number of processes (devices x num_nodes)",
                )
            dp = world_size // model_degrees
        else:
            dp = data_parallel_size
            if dp * model_degrees != world_size:
                raise config_error(
                    ValueError,
                    "data_parallel_size * tensor_parallel_size * pipeline_parallel_size" + (" * context_parallel_size" if cp > 1 else ""),
                    f"{dp} * {tp} * {pp}" + (f" * {cp}" if cp > 1 else "") + f" = {dp * model_degrees}",
                    f"the product must equal the world size {world_size}",
                    'set data_parallel_size="auto" to use the remaining processes, or change devices/num_nodes',
                )
        # "auto" expert parallelism spreads the experts over every data-parallel rank (x context-parallel:
        # those ranks hold different tokens too, so experts are drawn from dp x cp).
        tokens = dp * cp
        ep = tokens if expert_parallel_size == "auto" else expert_parallel_size
        if tokens % ep:
            where = f"data_parallel_size={dp}" + (f" x context_parallel_size={cp}" if cp > 1 else "")
            raise config_error(
                ValueError,
                "expert_parallel_size",
                ep,
                f"expert-parallel ranks are drawn from the data-parallel ranks, so it must divide {where}",
                f"choose an expert_parallel_size among the divisors of {tokens}",
            )
        dp_replicate, dp_shard = (1, dp) if sharded else (dp, 1)
        if hybrid:
            replicate = data_parallel_replicate_size
            if replicate == "auto":
                # One replica per node; on a single node, two replica groups when there are at
                # least four data-parallel ranks, so HSDP differs from plain FSDP.
                replicate = num_nodes if num_nodes > 1 else (2 if dp >= 4 and dp % 2 == 0 else 1)
            if dp % replicate:
                raise config_error(
                    ValueError,
                    "data_parallel_replicate_size",
                    replicate,
                    f"it must divide data_parallel_size={dp}",
                    f"choose a divisor of {dp} (usually the number of nodes)",
                )
            dp_replicate, dp_shard = replicate, dp // replicate
        return cls(world_size=world_size, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, ep=ep, cp=cp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def grad_axis(self) -> str:
        """The axis gradients are averaged (and ZeRO shards) over: ``dp``, or ``dp_cp`` with context parallelism."""
        return DP_CP if self.cp > 1 else DP

    @property
    def grad_size(self) -> int:
        return self.dp * self.cp

    def describe(self) -> str:
        """``pp=.. x dp_replicate=.. x dp_shard=.. [x cp=..] x tp=.. (ep=..)``: cp only when it splits."""
        axes = [(name, size) for name, size in zip(MESH_AXES, self.shape) if name != CP or size > 1]
        return " x ".join(f"{name}={size}" for name, size in axes) + f" (ep={self.ep})"

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the named mesh (a collective call: every rank must call it, in the same order).

        Flattened and split axes (``dp``, ``edp``, ``ep``) are kept in a side table, since torch
        deprecates slicing derived axes from the root mesh.
        """
        if self._mesh is not None:
            return self._mesh
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_AXES)
        derived: dict[str, DeviceMesh] = {name: mesh[name] for name in MESH_AXES}
        derived[DP] = flatten_mesh(mesh[(DP_REPLICATE, DP_SHARD)], DP)
        if self.cp > 1:
            derived[DP_CP] = flatten_mesh(mesh[(DP_REPLICATE, DP_SHARD, CP)], DP_CP)
            fsdp = unflatten_mesh(derived[DP_CP], 0, (self.dp_replicate, self.dp_shard * self.cp), (FSDP_REPLICATE, FSDP_SHARD))
            derived[FSDP_REPLICATE], derived[FSDP_SHARD] = fsdp, fsdp[FSDP_SHARD]
        if self.pp > 1 and self.tp > 1:
            derived[PP_DP] = flatten_mesh(mesh[(PP, DP_REPLICATE, DP_SHARD)], PP_DP)
        if self.ep > 1:
            tokens = derived[DP_CP] if self.cp > 1 else derived[DP]
            expert = unflatten_mesh(tokens, 0, (self.grad_size // self.ep, self.ep), (EDP, EP))
            derived[EDP], derived[EP] = expert[EDP], expert[EP]
        object.__setattr__(self, "_mesh", mesh)
        object.__setattr__(self, "_axes", derived)
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("The device mesh is built in the strategy's setup_environment(); it is not available before.")
        return self._mesh

    def axis(self, name: str) -> DeviceMesh:
        """The 1D mesh of one axis (``tp``, ``dp``, ``ep``, ...) that contains this rank."""
        if self._mesh is None:
            raise RuntimeError(f"Axis {name!r} is not available before the mesh is built.")
        axes: dict[str, DeviceMesh] = getattr(self, "_axes")
        if name not in axes:
            raise KeyError(f"No mesh axis {name!r}; this run has {sorted(axes)}")
        return axes[name]

    def data_parallel_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: 2D (dp_replicate, dp_shard) for HSDP and for replication
        without sharding (dp_shard 1: all-reduce only), 1D dp_shard when nothing is replicated.

        Why not always 2D: FSDP2 treats any 2D mesh as HSDP and all-reduces every unit's gradient
        over the replicate axis after its reduce-scatter, also when that axis has one rank (a
        collective per unit and step that moves nothing: 5 per step on a 4-block GPT).

        With context parallelism the shard axis is ``dp_shard x cp`` (every cp rank holds different
        gradients, so it shards them too), regrouped from the flattened ``dp_cp`` axis."""
        if self.cp > 1:
            axes: dict[str, DeviceMesh] = getattr(self, "_axes")
            return axes[FSDP_SHARD] if self.dp_replicate == 1 else axes[FSDP_REPLICATE]
        if self.dp_replicate == 1 and self.dp_shard > 1:
            return self.mesh[DP_SHARD]
        return self.mesh[(DP_REPLICATE, DP_SHARD)]
