"""Unit tests (no process group): degree resolution, option validation, registered names."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_parallel
from lightning_parallel import HybridParallelStrategy, ParallelDims
from lightning_parallel.parallel.blocks import find_repeated_blocks
from tests.tiny_models import TinyNet

LIGHTNING_BUILTINS = {
    "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "fsdp", "fsdp_cpu_offload", "deepspeed", "single_device",
    "single_xla", "xla", "model_parallel", "auto",
}


def test_resolve_auto_fills_data_parallel() -> None:
    dims = ParallelDims.resolve(8, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp) == (2, 2, 1, 2, 2)
    sharded = ParallelDims.resolve(8, tensor_parallel_size=2, sharded=True)
    assert (sharded.dp_replicate, sharded.dp_shard) == (1, 4)


def test_tensor_parallel_auto_takes_the_remaining_processes() -> None:
    assert ParallelDims.resolve(4, tensor_parallel_size="auto").tp == 4
    dims = ParallelDims.resolve(8, tensor_parallel_size="auto", data_parallel_size=2)
    assert (dims.tp, dims.dp) == (4, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size='auto'"):
        ParallelDims.resolve(4, tensor_parallel_size="auto", data_parallel_size=3)


def test_zero1_with_tensor_parallel_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`zero_stage`='1 with tensor_parallel_size=2'.*ZeroRedundancyOptimizer"):
        HybridParallelStrategy(zero_stage=1, tensor_parallel_size=2)
    with pytest.raises(TypeError, match=r"`tp_plan`"):
        HybridParallelStrategy(tp_plan=["q", "colwise"])


def test_resolve_hybrid_shard_splits_replicate_and_shard() -> None:
    dims = ParallelDims.resolve(4, sharded=True, hybrid=True)
    assert (dims.dp_replicate, dims.dp_shard) == (2, 2)
    dims = ParallelDims.resolve(16, sharded=True, hybrid=True, num_nodes=4)
    assert (dims.dp_replicate, dims.dp_shard) == (4, 4)
    dims = ParallelDims.resolve(8, sharded=True, hybrid=True, data_parallel_replicate_size=4)
    assert (dims.dp_replicate, dims.dp_shard) == (4, 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tensor_parallel_size": 0}, ValueError, r"`tensor_parallel_size`=0 .*at least 1.*HINT"),
        ({"tensor_parallel_size": "two"}, ValueError, r"`tensor_parallel_size`='two'.*\"auto\""),
        ({"pipeline_parallel_size": 2.0}, TypeError, r"`pipeline_parallel_size`=2.0 .*positive int"),
        ({"expert_parallel_size": True}, TypeError, r"`expert_parallel_size`=True"),
        ({"tensor_parallel_size": 3}, ValueError, r"3 \* 1 = 3.*must divide the world size 4"),
        ({"data_parallel_size": 2, "tensor_parallel_size": 1}, ValueError, r"2 \* 1 \* 1 = 2.*must equal the world size 4"),
        ({"expert_parallel_size": 3}, ValueError, r"`expert_parallel_size`=3.*divide data_parallel_size=4"),
        ({"sharded": True, "hybrid": True, "data_parallel_replicate_size": 3}, ValueError, r"`data_parallel_replicate_size`=3"),
    ],
)
def test_bad_degrees(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ParallelDims.resolve(4, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"zero_stage": 4}, ValueError, r"`zero_stage`=4 .*0 \(replicated\).*HINT: pass zero_stage=0, 1, 2 or 3"),
        ({"zero_stage": "3"}, TypeError, r"`zero_stage`='3'"),
        ({"zero_stage": 0, "cpu_offload": True}, ValueError, r"`cpu_offload`='True with zero_stage=0'.*zero_stage 2 or 3"),
        ({"zero_stage": 1, "cpu_offload": True}, ValueError, r"zero_stage=1"),
        ({"hybrid_shard": True}, ValueError, r"`hybrid_shard`"),
        ({"data_parallel_size": -1}, ValueError, r"`data_parallel_size`=-1"),
        ({"mixed_precision": "fp8"}, ValueError, r"`mixed_precision`='fp8'"),
        ({"activation_checkpointing": "yes"}, TypeError, r"`activation_checkpointing`='yes'.*bool"),
        ({"start_method": "thread"}, ValueError, r"`start_method`='thread'"),
        ({"timeout": -5}, ValueError, r"`timeout`=-5"),
    ],
)
def test_bad_strategy_options(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        HybridParallelStrategy(**kwargs)


def test_degrees_checked_against_world_size_before_any_collective() -> None:
    """Trainer construction with devices=4 and tp=3: the error comes from resolve, no process group exists."""
    import torch.distributed as dist

    strategy = HybridParallelStrategy(tensor_parallel_size=3)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    with pytest.raises(ValueError, match=r"must divide the world size 4"):
        trainer.strategy.setup_environment()
    assert not dist.is_initialized()


def test_presets_registered_without_shadowing_lightning() -> None:
    names = set(lightning_parallel.PRESETS)
    assert {"dp", "zero1", "zero2", "zero3", "fsdp2", "zero3_offload", "hsdp", "tp"} <= names
    assert not names & LIGHTNING_BUILTINS
    for name in names:
        assert StrategyRegistry[name]["strategy"] is HybridParallelStrategy
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="zero3_offload", logger=False)
    assert isinstance(trainer.strategy, HybridParallelStrategy)
    assert (trainer.strategy.zero_stage, trainer.strategy.cpu_offload) == (3, True)
    assert lightning_parallel.register_strategies() == []  # idempotent


def test_unknown_strategy_name_lists_ours() -> None:
    with pytest.raises(ValueError, match=r"`strategy`='zero4'.*\['3d', 'cp', 'dp', .*'zero3'.*HINT: did you mean 'zero3'\?"):
        lightning_parallel.strategy_from_name("zero4")
    with pytest.raises(ValueError, match=r"invalid strategy name"):  # the plain Trainer: Lightning's own message
        pl.Trainer(accelerator="cpu", devices=2, strategy="zero4", logger=False)
    assert lightning_parallel.strategy_from_name("zero3", cpu_offload=True).cpu_offload is True


def test_find_repeated_blocks() -> None:
    model = TinyNet(depth=4)
    names = [name for name, _ in find_repeated_blocks(model)]
    assert names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    import torch.nn as nn

    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert [n for n, _ in find_repeated_blocks(seq)] == ["0", "2", "4"]
    assert find_repeated_blocks(nn.Linear(3, 3)) == []
    # A ModuleList is a stack whatever its layers' classes (hybrid models); a Sequential's blocks share one.
    hybrid = nn.Module()
    hybrid.layers = nn.ModuleList([nn.Linear(8, 8), nn.GRU(8, 8), nn.Linear(8, 8), nn.Conv1d(8, 8, 3)])
    hybrid.head = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    assert [n for n, _ in find_repeated_blocks(hybrid)] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert find_repeated_blocks(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))) == []


def test_expert_parallel_errors_before_any_collective() -> None:
    import torch.distributed as dist

    from lightning_parallel.models import MoEGPT

    with pytest.raises(ValueError, match=r"`zero_stage`='1 with expert_parallel_size=2'"):
        HybridParallelStrategy(zero_stage=1, expert_parallel_size=2)
    for model, match in ((TinyNet(), r"(?i)no (MoE|expert)"), (MoEGPT(num_experts=3, top_k=1), r"(?i)num_experts.*3")):
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ep", logger=False)
        trainer.strategy.connect(model)
        with pytest.raises(ValueError, match=match):
            trainer.strategy.setup_environment()
        assert not dist.is_initialized()
