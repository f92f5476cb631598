"""Validation of the strategy's non-degree options, done in ``__init__`` before any process starts.

Degrees are validated against the world size in ``ParallelDims.resolve`` (once the number of
processes is known); everything that does not depend on it is checked here, so a typo in a
config fails at construction, on every rank, with a message naming the field and a fix.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning_parallel.parallel.data.apply import _DTYPES
from lightning_parallel.parallel.dims import check_degree
from lightning_parallel.errors import config_error

MIXED_PRECISION_CHOICES = (None, "32-true", *sorted(k for k in _DTYPES if k.endswith("-mixed")))
START_METHODS = ("popen", "spawn", "fork")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise config_error(TypeError, name, value, "it must be a bool", f"pass {name}=True or {name}=False")


def validate_options(
    *,
    degrees: dict[str, Any],
    zero_stage: Any,
    cpu_offload: Any,
    mixed_precision: Any,
    activation_checkpointing: Any,
    hybrid_shard: Any,
    start_method: Any,
    strict_plan: Any = False,
    sequence_parallel: Any = False,
    tp_plan: Any = None,
    loss_parallel: Any = False,
) -> None:
    """Raise a typed, explained error for the first invalid option."""
    for name, value in degrees.items():
        check_degree(name, value)
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, int):
        raise config_error(TypeError, "zero_stage", zero_stage, "it must be an int in 0-3", "pass zero_stage=0 (DDP), 1, 2 or 3")
    if zero_stage not in (0, 1, 2, 3):
        raise config_error(
            ValueError,
            "zero_stage",
            zero_stage,
            "ZeRO stages are 0 (replicated), 1 (optimizer state), 2 (+gradients) and 3 (+parameters)",
            "pass zero_stage=0, 1, 2 or 3",
        )
    for name, value in (
        ("cpu_offload", cpu_offload),
        ("activation_checkpointing", activation_checkpointing),
        ("hybrid_shard", hybrid_shard),
        ("strict_plan", strict_plan),
        ("sequence_parallel", sequence_parallel),
        ("loss_parallel", loss_parallel),
    ):
        check_bool(name, value)
    if cpu_offload and zero_stage < 2:
        raise config_error(
            ValueError,
            "cpu_offload",
            f"True with zero_stage={zero_stage}",
            "offloading moves sharded parameters, gradients and optimizer state to the CPU, which needs zero_stage 2 or 3",
            "set zero_stage=3 (strategy 'zero3_offload') or cpu_offload=False",
        )
    if hybrid_shard and zero_stage < 2:
        raise config_error(
            ValueError,
            "hybrid_shard",
            f"True with zero_stage={zero_stage}",
            "HSDP shards within a replica group, which needs zero_stage 2 or 3",
            "set zero_stage=3 (strategy 'hsdp') or hybrid_shard=False",
        )
    replicate = degrees.get("data_parallel_replicate_size", "auto")
    if replicate != "auto" and not hybrid_shard:
        raise config_error(
            ValueError,
            "data_parallel_replicate_size",
            f"{replicate} with hybrid_shard=False",
            "replica groups exist only under hybrid sharding (HSDP); without it every data-parallel rank is its own replica",
            "set hybrid_shard=True with zero_stage 2 or 3 (strategy 'hsdp'), or leave data_parallel_replicate_size='auto'",
        )
    if mixed_precision not in MIXED_PRECISION_CHOICES:
        raise config_error(
            ValueError,
            "mixed_precision",
            mixed_precision,
            f"it must be one of {MIXED_PRECISION_CHOICES}",
            'use mixed_precision="bf16-mixed", or None for fp32',
        )
    if tp_plan is not None and (
        not hasattr(tp_plan, "items") or not all(isinstance(k, str) and isinstance(v, str) for k, v in tp_plan.items())
    ):
        raise config_error(
            TypeError, "tp_plan", tp_plan, "it must map module-name globs to style names",
            'pass e.g. tp_plan={"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}',
        )
    tensor_parallel = degrees.get("tensor_parallel_size", 1) != 1
    pipeline = degrees.get("pipeline_parallel_size", 1) != 1  # stages shard with FSDP2 at every zero_stage >= 1
    if zero_stage == 1 and tensor_parallel and not pipeline:
        raise config_error(
            ValueError,
            "zero_stage",
            f"1 with tensor_parallel_size={degrees['tensor_parallel_size']}",
            "ZeRO-1 uses torch's ZeroRedundancyOptimizer, which does not take tensor-parallel (DTensor) parameters",
            "use zero_stage=2 or 3 (FSDP2 shards the optimizer state too) or zero_stage=0",
        )
    if loss_parallel and degrees.get("tensor_parallel_size", 1) == 1:
        raise config_error(
            ValueError, "loss_parallel", "True with tensor_parallel_size=1",
            "loss parallelism computes the loss on vocabulary shards, which needs a tensor-parallel LM head",
            'set tensor_parallel_size to 2 or more (or "auto", strategy "tp"), or loss_parallel=False',
        )
    if loss_parallel and degrees.get("pipeline_parallel_size", 1) != 1:
        raise config_error(
            ValueError, "loss_parallel", f"True with pipeline_parallel_size={degrees['pipeline_parallel_size']!r}",
            "under pipeline parallelism the last stage runs the step as the schedule's loss, which does not keep the logits sharded",
            "set loss_parallel=False with pipeline parallelism",
        )
    if zero_stage == 1 and degrees.get("expert_parallel_size", 1) != 1:
        raise config_error(
            ValueError,
            "zero_stage",
            f"1 with expert_parallel_size={degrees['expert_parallel_size']}",
            "ZeroRedundancyOptimizer broadcasts every parameter over all data-parallel ranks, which would overwrite each rank's own experts",
            "use zero_stage=0, 2 or 3 with expert parallelism",
        )
    if start_method not in START_METHODS:
        raise config_error(
            ValueError,
            "start_method",
            start_method,
            f"it must be one of {START_METHODS}",
            'use "popen" for scripts and torchrun, "spawn" for notebooks and Hydra multirun',
        )


def as_timedelta(timeout: timedelta | float | int) -> timedelta:
    """Collective timeout: a timedelta, or seconds (Hydra and the CLI pass numbers)."""
    if isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise config_error(ValueError, "timeout", timeout, "it must be a positive number of seconds or a timedelta", "pass timeout=1800")
    return timedelta(seconds=float(timeout))


BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def _check_auto_or_positive_int(name: str, value: Any, example: str) -> None:
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise config_error(TypeError, name, value, 'it must be a positive int or "auto"', f'pass {name}="auto" or e.g. {name}={example}')
    if value < 1:
        raise config_error(ValueError, name, value, "it must be at least 1", f'pass {name}="auto" or e.g. {name}={example}')


def _check_backend(value: Any) -> None:
    """``None`` (the device's default), a backend name, or per-device pairs (``"cpu:gloo,cuda:nccl"``)."""
    if value is None:
        return
    fix = 'pass None (gloo on CPU, nccl on CUDA), "gloo", "nccl", or "cpu:gloo,cuda:nccl" for CPU and GPU tensors'
    if not isinstance(value, str):
        raise config_error(TypeError, "process_group_backend", value, "it must be a string or None", fix)
    names = [part.split(":", 1)[-1].strip() for part in value.split(",")]
    if not all(name in BACKENDS for name in names):
        raise config_error(ValueError, "process_group_backend", value, f"every backend must be one of {BACKENDS}", fix)


def validate_more_options(
    *,
    pipeline_schedule: Any,
    microbatches: Any,
    virtual_stages: Any,
    split_points: Any,
    moe_coefs: dict[str, Any],
    ddp_bucket_cap_mb: Any,
    find_unused_parameters: Any,
    save_distributed_checkpoint: Any,
    process_group_backend: Any,
    async_save: Any = False,
    tensor_parallel_min_split: Any = 0.5,
) -> None:
    """The options that do not depend on the world size and that ``validate_options`` leaves out:
    checked in ``__init__`` too, so that a typo fails at construction (not when the first batch
    reaches a pipeline, or never, when no pipeline is used and the option is silently ignored)."""
    from lightning_parallel.parallel.pipeline.schedules import resolve_virtual_stages, schedule_spec

    spec = schedule_spec(pipeline_schedule)
    share = tensor_parallel_min_split
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
        raise config_error(ValueError if isinstance(share, (int, float)) and not isinstance(share, bool) else TypeError,
                           "tensor_parallel_min_split", share, "it is a fraction of the parameters, a number in [0, 1]",
                           "pass e.g. tensor_parallel_min_split=0.5 (the default), or 0 to accept any tensor-parallel plan")
    _check_auto_or_positive_int("microbatches", microbatches, "4")
    _check_auto_or_positive_int("virtual_stages", virtual_stages, "2")
    resolve_virtual_stages(spec, virtual_stages)
    if split_points is not None and (
        isinstance(split_points, str) or not all(isinstance(name, str) and name for name in split_points)
    ):
        raise config_error(TypeError, "split_points", split_points, "it must be a list of module names (strings)",
                           'pass e.g. split_points=["blocks.2"] (the modules that start stages 2, 3, ...)')
    for name, value in moe_coefs.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise config_error(TypeError, name, value, "it must be a number or None", f"pass e.g. {name}=0.01, 0 to disable, or None")
        if value < 0:
            raise config_error(ValueError, name, value, "a loss coefficient cannot be negative", f"pass {name}=0 to disable the loss")
    if isinstance(ddp_bucket_cap_mb, bool) or not isinstance(ddp_bucket_cap_mb, (int, float)):
        raise config_error(TypeError, "ddp_bucket_cap_mb", ddp_bucket_cap_mb, "it must be a number of MiB", "pass ddp_bucket_cap_mb=25")
    if ddp_bucket_cap_mb <= 0:
        raise config_error(ValueError, "ddp_bucket_cap_mb", ddp_bucket_cap_mb, "a bucket must hold more than 0 MiB", "pass ddp_bucket_cap_mb=25")
    check_bool("find_unused_parameters", find_unused_parameters)
    check_bool("save_distributed_checkpoint", save_distributed_checkpoint)
    check_bool("async_save", async_save)
    if async_save and not save_distributed_checkpoint:
        raise config_error(
            ValueError, "async_save", "True with save_distributed_checkpoint=False",
            "background saves write sharded DCP directories; one consolidated file is gathered and written by rank 0",
            "keep save_distributed_checkpoint=True, or use Lightning's AsyncCheckpointIO plugin for consolidated files",
        )
    _check_backend(process_group_backend)


def check_fsdp_units(fsdp_units: Any, zero_stage: int, tp: Any, pp: Any, dp: Any = "auto") -> None:
    """``fsdp_units`` is ``"block"`` or ``"sublayer"``, and ``"sublayer"`` only where FSDP2 wraps an
    eager layout: no pipelines, more than one data-parallel rank, ``zero_stage`` 2-3 or tensor
    parallelism. Degrees still ``"auto"`` pass here; ``_apply_layout`` checks the resolved ones."""
    if fsdp_units not in ("block", "sublayer"):
        raise config_error(ValueError, "fsdp_units", fsdp_units, "it must be 'block' or 'sublayer'",
                           "pass fsdp_units='block' (one FSDP2 unit per block) or 'sublayer' (attention and MLP apart)")
    if fsdp_units == "block":
        return
    known = {name: v for name, v in (("tp", tp), ("pp", pp), ("dp", dp)) if isinstance(v, int)}
    if known.get("pp", 1) > 1 or known.get("dp", 2) == 1 or (zero_stage < 2 and known.get("tp", 2) == 1):
        raise config_error(
            ValueError, "fsdp_units", fsdp_units,
            f"it sets how FSDP2 wraps an eager layout, and this one (zero_stage={zero_stage}, tensor_parallel_size={tp},"
            f" pipeline_parallel_size={pp}, data_parallel_size={dp}) has none: FSDP2 shards only with more than one"
            " data-parallel rank and zero_stage 2-3 or tensor parallelism, and pipelines wrap their stages themselves",
            "leave fsdp_units='block', or use zero_stage=2/3 on several data-parallel ranks without pipeline parallelism",
        )


def check_pipeline_precision(precision_plugin: Any, dims: Any) -> None:
    """Pipelines honour the Trainer precisions of ``precision.PIPELINE_PRECISIONS``; another one is refused.

    Why refuse the rest (64-true, transformer-engine, bitsandbytes, ...): the traced stages run
    only the plugin's step context and its module conversion; a plugin that replaces layers or
    hooks elsewhere would be silently ignored inside the stages.
    """
    from lightning_parallel.strategies.precision import PIPELINE_PRECISIONS, trainer_precision

    precision = trainer_precision(precision_plugin)
    if dims.pp > 1 and precision not in PIPELINE_PRECISIONS:
        raise config_error(
            ValueError, "Trainer(precision)", precision,
            f"pipeline stages (pipeline_parallel_size={dims.pp}) honour only {list(PIPELINE_PRECISIONS)}",
            "use one of those (e.g. precision='bf16-mixed'), or a layout without pipelines (dp, zero1-3, tp, ep)",
        )
