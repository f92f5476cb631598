"""Bad input, counted: every strategy option and degree with bad values, one table.

Each row is built the way a user would meet it: the constructor (``HybridParallelStrategy(...)``
or a preset by name), or the degrees checked against a world size (``resolve_dims``, which the
strategy calls in ``setup_environment()`` before the process group exists). Every case must
raise the expected type (``TypeError`` for a wrong type, ``ValueError`` for a bad value or a
combination that cannot work) with the project's message layout — the field in backticks, the
value, the rule, and a ``HINT:`` with a fix — and without a process group ever being created
(so no rank can wait on a collective because of it). docs/options.md ("Bad input") states the
number of cases; the last test keeps that number honest.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

import lightning_parallel
from lightning_parallel import HybridParallelStrategy

# (label, constructor kwargs, world size or None for construction only, error type, field in the message)
WRONG_TYPE: list[tuple[str, dict[str, Any], int | None, type[Exception], str]] = [
    ("zero_stage str", {"zero_stage": "3"}, None, TypeError, "zero_stage"),
    ("zero_stage bool", {"zero_stage": True}, None, TypeError, "zero_stage"),
    ("cpu_offload int", {"cpu_offload": 1}, None, TypeError, "cpu_offload"),
    ("activation_checkpointing str", {"activation_checkpointing": "yes"}, None, TypeError, "activation_checkpointing"),
    ("hybrid_shard int", {"hybrid_shard": 1}, None, TypeError, "hybrid_shard"),
    ("strict_plan str", {"strict_plan": "y"}, None, TypeError, "strict_plan"),
    ("sequence_parallel int", {"sequence_parallel": 1}, None, TypeError, "sequence_parallel"),
    ("loss_parallel str", {"loss_parallel": "true"}, None, TypeError, "loss_parallel"),
    ("tp_plan list", {"tp_plan": ["q", "colwise"]}, None, TypeError, "tp_plan"),
    ("tp_plan non-str style", {"tp_plan": {"q": 1}}, None, TypeError, "tp_plan"),
    ("tensor_parallel_size float", {"pipeline_parallel_size": 2.0}, None, TypeError, "pipeline_parallel_size"),
    ("expert_parallel_size bool", {"expert_parallel_size": True}, None, TypeError, "expert_parallel_size"),
    ("pipeline_schedule int", {"pipeline_schedule": 3}, None, TypeError, "pipeline_schedule"),
    ("microbatches str", {"microbatches": "many"}, None, TypeError, "microbatches"),
    ("microbatches float", {"microbatches": 2.5}, None, TypeError, "microbatches"),
    ("microbatches bool", {"microbatches": True}, None, TypeError, "microbatches"),
    ("virtual_stages str", {"virtual_stages": "x"}, None, TypeError, "virtual_stages"),
    ("split_points str", {"split_points": "blocks.1"}, None, TypeError, "split_points"),
    ("split_points ints", {"split_points": [1]}, None, TypeError, "split_points"),
    ("moe_aux_loss_coef str", {"moe_aux_loss_coef": "a"}, None, TypeError, "moe_aux_loss_coef"),
    ("ddp_bucket_cap_mb str", {"ddp_bucket_cap_mb": "x"}, None, TypeError, "ddp_bucket_cap_mb"),
    ("find_unused_parameters str", {"find_unused_parameters": "yes"}, None, TypeError, "find_unused_parameters"),
    ("save_distributed_checkpoint str", {"save_distributed_checkpoint": "no"}, None, TypeError, "save_distributed_checkpoint"),
    ("process_group_backend int", {"process_group_backend": 3}, None, TypeError, "process_group_backend"),
    ("max_nonfinite_skips str", {"max_nonfinite_skips": "3"}, None, TypeError, "max_nonfinite_skips"),
    ("tensor_parallel_min_split str", {"tensor_parallel_min_split": "half"}, None, TypeError, "tensor_parallel_min_split"),
    ("context_parallel_size float", {"context_parallel_size": 2.0}, None, TypeError, "context_parallel_size"),
    ("context_parallel_batch_dims list", {"context_parallel_batch_dims": ["0"]}, None, TypeError, "context_parallel_batch_dims"),
    ("context_parallel_batch_dims str dim", {"context_parallel_batch_dims": {"0": "1"}}, None, TypeError,
     "context_parallel_batch_dims['0']"),
]

OUT_OF_RANGE: list[tuple[str, dict[str, Any], int | None, type[Exception], str]] = [
    ("zero_stage 4", {"zero_stage": 4}, None, ValueError, "zero_stage"),
    ("tensor_parallel_min_split 1.5", {"tensor_parallel_min_split": 1.5}, None, ValueError, "tensor_parallel_min_split"),
    ("zero_stage -1", {"zero_stage": -1}, None, ValueError, "zero_stage"),
    ("tensor_parallel_size 0", {"tensor_parallel_size": 0}, None, ValueError, "tensor_parallel_size"),
    ("tensor_parallel_size word", {"tensor_parallel_size": "two"}, None, ValueError, "tensor_parallel_size"),
    ("data_parallel_size -2", {"data_parallel_size": -2}, None, ValueError, "data_parallel_size"),
    ("data_parallel_replicate_size 0", {"data_parallel_replicate_size": 0, "hybrid_shard": True, "zero_stage": 3},
     None, ValueError, "data_parallel_replicate_size"),
    ("mixed_precision fp8", {"mixed_precision": "fp8"}, None, ValueError, "mixed_precision"),
    ("pipeline_schedule unknown", {"pipeline_schedule": "zigzag"}, None, ValueError, "pipeline_schedule"),
    ("microbatches 0", {"microbatches": 0}, None, ValueError, "microbatches"),
    ("virtual_stages 0", {"virtual_stages": 0}, None, ValueError, "virtual_stages"),
    ("virtual_stages 2 on 1f1b", {"virtual_stages": 2}, None, ValueError, "virtual_stages"),
    ("virtual_stages 3 on zbv", {"pipeline_schedule": "zbv", "virtual_stages": 3}, None, ValueError, "virtual_stages"),
    ("moe_aux_loss_coef negative", {"moe_aux_loss_coef": -1.0}, None, ValueError, "moe_aux_loss_coef"),
    ("moe_z_loss_coef negative", {"moe_z_loss_coef": -0.1}, None, ValueError, "moe_z_loss_coef"),
    ("ddp_bucket_cap_mb 0", {"ddp_bucket_cap_mb": 0}, None, ValueError, "ddp_bucket_cap_mb"),
    ("ddp_bucket_cap_mb negative", {"ddp_bucket_cap_mb": -1}, None, ValueError, "ddp_bucket_cap_mb"),
    ("process_group_backend unknown", {"process_group_backend": "mpi2"}, None, ValueError, "process_group_backend"),
    ("process_group_backend bad pair", {"process_group_backend": "cpu:gloo,cuda:nccl2"}, None, ValueError, "process_group_backend"),
    ("timeout 0", {"timeout": 0}, None, ValueError, "timeout"),
    ("timeout negative", {"timeout": -5}, None, ValueError, "timeout"),
    ("timeout str", {"timeout": "x"}, None, ValueError, "timeout"),
    ("start_method unknown", {"start_method": "forkserver"}, None, ValueError, "start_method"),
    ("on_nonfinite unknown", {"on_nonfinite": "ignore"}, None, ValueError, "on_nonfinite"),
    ("max_nonfinite_skips 0", {"max_nonfinite_skips": 0}, None, ValueError, "max_nonfinite_skips"),
    ("fsdp_units unknown", {"fsdp_units": "layer"}, None, ValueError, "fsdp_units"),
    ("context_parallel_size 0", {"context_parallel_size": 0}, None, ValueError, "context_parallel_size"),
    ("context_parallel_attention unknown", {"context_parallel_attention": "ulysses2"}, None, ValueError,
     "context_parallel_attention"),
]

INCOMPATIBLE: list[tuple[str, dict[str, Any], int | None, type[Exception], str]] = [
    ("cpu_offload with zero 0", {"cpu_offload": True}, None, ValueError, "cpu_offload"),
    ("cpu_offload with zero 1", {"cpu_offload": True, "zero_stage": 1}, None, ValueError, "cpu_offload"),
    ("hybrid_shard with zero 0", {"hybrid_shard": True}, None, ValueError, "hybrid_shard"),
    ("replicate size without hybrid_shard", {"data_parallel_replicate_size": 2}, None, ValueError, "data_parallel_replicate_size"),
    ("zero1 with tp", {"zero_stage": 1, "tensor_parallel_size": 2}, None, ValueError, "zero_stage"),
    ("zero1 with ep", {"zero_stage": 1, "expert_parallel_size": 2}, None, ValueError, "zero_stage"),
    ("loss_parallel without tp", {"loss_parallel": True}, None, ValueError, "loss_parallel"),
    ("loss_parallel with pp", {"loss_parallel": True, "tensor_parallel_size": 2, "pipeline_parallel_size": 2},
     None, ValueError, "loss_parallel"),
    ("fsdp_units sublayer with zero 0", {"fsdp_units": "sublayer"}, None, ValueError, "fsdp_units"),
    ("fsdp_units sublayer with pp", {"fsdp_units": "sublayer", "zero_stage": 3, "pipeline_parallel_size": 2},
     None, ValueError, "fsdp_units"),
    ("cp with compile_blocks", {"context_parallel_size": 2, "compile_blocks": True}, None, ValueError,
     "context_parallel_size=2 with compile_blocks"),
]

WORLD_SIZE: list[tuple[str, dict[str, Any], int | None, type[Exception], str]] = [
    ("tp 3 on 4", {"tensor_parallel_size": 3}, 4, ValueError, "tensor_parallel_size * pipeline_parallel_size"),
    ("pp 8 on 4", {"pipeline_parallel_size": 8}, 4, ValueError, "tensor_parallel_size * pipeline_parallel_size"),
    ("tp 2 x pp 2 on 2", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 2, ValueError,
     "tensor_parallel_size * pipeline_parallel_size"),
    ("dp 2 on 4", {"data_parallel_size": 2}, 4, ValueError, "data_parallel_size * tensor_parallel_size * pipeline_parallel_size"),
    ("dp2 x tp2 x pp2 on 4", {"data_parallel_size": 2, "tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 4,
     ValueError, "data_parallel_size * tensor_parallel_size * pipeline_parallel_size"),
    ("ep 3 on dp 4", {"expert_parallel_size": 3}, 4, ValueError, "expert_parallel_size"),
    ("ep 4 on dp 2", {"expert_parallel_size": 4, "tensor_parallel_size": 2}, 4, ValueError, "expert_parallel_size"),
    ("replicate 3 on dp 4", {"zero_stage": 3, "hybrid_shard": True, "data_parallel_replicate_size": 3}, 4, ValueError,
     "data_parallel_replicate_size"),
    ("tp auto with dp 3 on 4", {"tensor_parallel_size": "auto", "data_parallel_size": 3}, 4, ValueError,
     "data_parallel_size * pipeline_parallel_size"),
    ("cp 3 on 4", {"context_parallel_size": 3}, 4, ValueError,
     "tensor_parallel_size * pipeline_parallel_size * context_parallel_size"),
    ("ep 3 on dp2 x cp2", {"context_parallel_size": 2, "expert_parallel_size": 3}, 4, ValueError, "expert_parallel_size"),
    ("cp auto with tp auto", {"context_parallel_size": "auto", "tensor_parallel_size": "auto"}, 4, ValueError,
     "context_parallel_size"),
]

CASES = WRONG_TYPE + OUT_OF_RANGE + INCOMPATIBLE + WORLD_SIZE


@pytest.mark.parametrize(("label", "kwargs", "world_size", "error", "field"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_typed_explained_error_before_any_collective(
    label: str, kwargs: dict[str, Any], world_size: int | None, error: type[Exception], field: str
) -> None:
    with pytest.raises(error) as info:
        strategy = HybridParallelStrategy(**kwargs)
        if world_size is None:
            pytest.fail(f"{label}: {kwargs} was accepted")
        strategy.resolve_dims(world_size)
    message = str(info.value)
    assert f"`{field}`=" in message, f"{label}: the message does not name the field: {message}"
    assert " is invalid: " in message and "HINT: " in message, f"{label}: no rule or fix: {message}"
    assert not (dist.is_available() and dist.is_initialized()), label  # no process group was ever created


def test_presets_take_overrides_through_the_same_checks() -> None:
    with pytest.raises(ValueError, match=r"`microbatches`=0 is invalid"):
        lightning_parallel.strategy_from_name("pp", microbatches=0)
    with pytest.raises(ValueError, match=r"`cpu_offload`='True with zero_stage=0'"):
        lightning_parallel.strategy_from_name("dp", cpu_offload=True)


def test_the_count_readme_states() -> None:
    assert len(CASES) == 80  # docs/options.md, "Bad input": keep both in step when adding cases


def test_pipelines_refuse_a_trainer_precision_they_would_ignore() -> None:
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="pp", precision="64-true", logger=False)
    with pytest.raises(ValueError, match=r"`Trainer\(precision\)`='64-true' is invalid: pipeline stages .* honour only .*HINT: use one"):
        trainer.strategy.setup_environment()
    assert not (dist.is_available() and dist.is_initialized())


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_pipelines_accept_the_trainer_precisions_they_honour(precision: str) -> None:
    """Once refused; now honoured inside the stages (trained and checked in tests/test_precision.py)."""
    import lightning.pytorch as pl

    from lightning_parallel.strategies.options import check_pipeline_precision

    from lightning.pytorch.plugins.precision import MixedPrecision

    # On the CPU Lightning turns precision="16-mixed" into bf16-mixed; fp16 comes through the plugin.
    kind = {"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed" else {"precision": precision}
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="pp", logger=False, **kind)
    assert trainer.strategy.precision_plugin.precision == precision
    check_pipeline_precision(trainer.strategy.precision_plugin, trainer.strategy.resolve_dims(2))
