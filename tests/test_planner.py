"""The layout planner (parallel/planner*.py): what it enumerates, rejects, predicts and ranks. No processes.

Expected byte counts are computed here from the model's own parameters (not from the planner's
helpers), so a drifted formula fails. Published configurations: tests/test_planner_published.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from lightning_parallel.models import GPT, MoEGPT
from lightning_parallel.planner.hardware import GiB, PROFILES, calibrate_cpu, get_profile
from lightning_parallel.planner.search import SearchSpace, plan_layouts
from lightning_parallel.planner.cost import bubble_factor, inflight

KW = {"vocab_size": 64, "block_size": 16, "n_layer": 4, "n_head": 4, "n_embd": 32}


def _gpt(**overrides: Any) -> GPT:
    with torch.device("meta"):
        return GPT(**{**KW, **overrides})


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _find(result: Any, **fields: Any) -> Any:
    pool = result.ranked + [r.prediction for r in result.rejected if r.prediction is not None]
    found = [p for p in pool if all(getattr(p.layout, k) == v for k, v in fields.items())]
    assert found, f"no layout with {fields}"
    return found[0]


def test_model_state_bytes_per_zero_stage_are_exact() -> None:
    model = _gpt()
    n = _params(model)
    space = SearchSpace(tensor_parallel_size=1, pipeline_parallel_size=1, activation_checkpointing=(False,),
                        cpu_offload=(False,), hybrid_shard=(False,))
    result = plan_layouts(model, 4, global_batch=8, hardware="cpu", dtype="fp32", space=space)
    # fp32 weights (4 bytes), fp32 gradients (4), AdamW moments (8); ZeRO-1 shards the moments,
    # ZeRO-2 the gradients too, ZeRO-3 the weights too, over the 4 data-parallel ranks. ZeRO-2 runs
    # on FSDP2, which stores sharded weights too and holds the gathered copy during the step only.
    expected = {0: n * 16, 1: n * (4 + 4 + 8 / 4), 2: n * 16 / 4, 3: n * 16 / 4}
    for stage, nbytes in expected.items():
        pred = _find(result, zero_stage=stage)
        assert pred.memory["model_state"] == pytest.approx(nbytes, rel=1e-9), stage
    assert _find(result, zero_stage=2).memory["gathered_params"] == pytest.approx(n * 4)  # the unsharded fp32 copy
    assert _find(result, zero_stage=3).memory["gathered_params"] < n * 4  # two blocks at a time
    # SGD without momentum keeps no optimizer state.
    sgd = plan_layouts(model, 4, global_batch=8, hardware="cpu", dtype="fp32", optimizer="sgd", space=space)
    assert _find(sgd, zero_stage=0).memory["model_state"] == pytest.approx(n * 8)


def test_tensor_and_pipeline_splits_come_from_the_strategys_planners() -> None:
    model = _gpt()
    result = plan_layouts(model, 8, global_batch=8, hardware="cpu", dtype="fp32")
    reasons = {r.what: r.reason for r in result.rejected if r.prediction is None}
    assert "attention heads=4" in reasons["tp=8"] and "not divisible by the tensor-parallel size 8" in reasons["tp=8"]
    assert "more stages than blocks" in reasons["tp=1 x pp=8"]
    # tp2: every planned weight is split except the position embedding, norms and row-parallel biases.
    h, v, b, layers = KW["n_embd"], KW["vocab_size"], KW["block_size"], KW["n_layer"]
    replicated = b * h + (2 * layers + 1) * 2 * h + 2 * layers * h
    per_rank = (_params(model) - replicated) / 2 + replicated
    pred = _find(result, tp=2, pp=1, zero_stage=0, activation_checkpointing=False)
    assert pred.memory["params"] == pytest.approx(per_rank * 4, rel=0.01)
    # pp2 cuts 4 blocks 2 + 2: the busiest rank holds about half the parameters (embeddings with stage 0).
    pp = _find(result, tp=1, pp=2, zero_stage=0)
    assert 0.4 * _params(model) * 4 < pp.memory["params"] < 0.75 * _params(model) * 4


def test_batch_and_memory_rejections_say_why() -> None:
    model = _gpt()
    odd = plan_layouts(model, 4, global_batch=6, hardware="cpu", dtype="fp32")
    assert any("global batch 6 is not divisible by dp 4" in r.reason for r in odd.rejected)
    # A device that holds the sharded state but not a whole replica: only sharded layouts fit.
    n = _params(model)
    tight = plan_layouts(model, 4, global_batch=8, hardware="cpu", dtype="fp32", device_memory=int(n * 9),
                         space=SearchSpace(activation_checkpointing=(False, True)))
    assert tight.ranked and all(p.peak_bytes <= n * 9 for p in tight.ranked)
    assert any(r.reason.startswith("does not fit by ") and r.reason.endswith(" GiB") for r in tight.rejected)
    assert all(p.layout.zero_stage >= 1 or p.layout.tp * p.layout.pp > 1 for p in tight.ranked)
    with pytest.raises(ValueError, match=r"no layout fits for GPT .*does not fit by .*HINT"):
        plan_layouts(model, 4, global_batch=8, hardware="cpu", dtype="fp32", device_memory=1024).chosen


def test_activations_schedules_and_checkpointing() -> None:
    assert [inflight("gpipe", 4, 8, 1, 0), inflight("1f1b", 4, 8, 1, 0), inflight("1f1b", 4, 8, 1, 3)] == [8, 4, 1]
    assert bubble_factor("1f1b", 4, 8, 1) == pytest.approx(11 / 8)
    assert bubble_factor("interleaved_1f1b", 4, 8, 2) == pytest.approx((8 + 1.5) / 8)
    model = _gpt(n_layer=8)
    result = plan_layouts(model, 4, global_batch=32, hardware="a100-80gb", dtype="bf16")
    full = _find(result, tp=1, pp=4, zero_stage=0, activation_checkpointing=False, schedule="gpipe", microbatches=8)
    ckpt = _find(result, tp=1, pp=4, zero_stage=0, activation_checkpointing=True, schedule="gpipe", microbatches=8)
    one = _find(result, tp=1, pp=4, zero_stage=0, activation_checkpointing=False, schedule="1f1b", microbatches=8)
    assert ckpt.memory["activations"] < full.memory["activations"]
    assert one.memory["activations"] == pytest.approx(full.memory["activations"] / 2)  # 4 of 8 microbatches in flight
    assert ckpt.time["compute"] > full.time["compute"]  # the recomputed forward


def test_moe_experts_split_over_ep() -> None:
    with torch.device("meta"):
        model = MoEGPT(**KW, num_experts=4)
    result = plan_layouts(model, 4, global_batch=8, hardware="cpu", dtype="fp32")
    one = _find(result, tp=1, pp=1, ep=1, zero_stage=0)
    four = _find(result, tp=1, pp=1, ep=4, zero_stage=0)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n or n.endswith("experts.w1"))
    assert experts > 0 and one.memory["params"] - four.memory["params"] == pytest.approx(experts * 4 * 3 / 4, rel=0.02)
    assert any("expert counts [4] are not divisible by 8" in r.reason for r in plan_layouts(
        model, 8, global_batch=8, hardware="cpu", dtype="fp32").rejected)


def test_choice_explanation_and_json() -> None:
    result = plan_layouts(_gpt(), 8, global_batch=16, hardware="cpu", dtype="fp32", space=SearchSpace(require_model_parallel=True))
    text = result.explain()
    assert text.startswith("planner: ") and "runner-up:" in text and "not possible: tp=8" in text
    assert result.chosen.layout.tp > 1 and result.chosen.layout.pp > 1
    data = json.loads(result.dumps())
    for key in ("model", "world_size", "hardware", "devices_per_node", "device_memory_bytes", "global_batch", "seq_len",
                "dtype", "chosen", "runner_up", "ranked", "faster_rejected", "rejected", "counts"):
        assert key in data, key
    chosen = data["chosen"]
    for key in ("layout", "describe", "strategy_kwargs", "peak_bytes_per_rank", "step_time_s", "tokens_per_s_per_device",
                "tflops_per_device", "memory_bytes", "time_s", "fits"):
        assert key in chosen, key
    assert chosen["strategy_kwargs"]["tensor_parallel_size"] == result.chosen.layout.tp
    assert data["ranked"][0]["step_time_s"] <= data["ranked"][-1]["step_time_s"]


def test_hardware_profiles_and_calibration() -> None:
    assert {"a100-80gb", "h100-80gb", "h200", "cpu"} <= set(PROFILES)
    assert get_profile("H100").name == "h100-80gb" and get_profile("h200").memory_bytes > 130 * GiB
    with pytest.raises(ValueError, match=r"unknown hardware profile"):
        get_profile("tpu-v9")
    measured = calibrate_cpu(size=64, repeats=2, processes=0)  # ranks: tests/test_planner_calibrate.py
    assert measured.peak_flops["fp32"] > 0 and measured.intra_latency > 0 and measured.memory_bytes > 0
    assert "GFLOP/s" in measured.notes


def test_section_5_1_advice_comes_out_of_the_model() -> None:
    """Seeds 5.1: small model -> data parallel; large -> sharded or model parallel; very large -> hybrid."""
    with torch.device("meta"):
        small = GPT(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)  # GPT-2 124M
        large = GPT(vocab_size=50304, block_size=2048, n_layer=40, n_head=40, n_embd=5120)  # ~13B
        huge = GPT(vocab_size=51200, block_size=2048, n_layer=96, n_head=96, n_embd=12288)  # ~175B
    quick = SearchSpace(cpu_offload=(False,), hybrid_shard=(False,))
    s = plan_layouts(small, 8, global_batch=64, hardware="a100-80gb", space=quick).chosen.layout
    assert (s.tp, s.pp, s.zero_stage) == (1, 1, 0) or (s.tp, s.pp) == (1, 1)  # data parallel
    g = plan_layouts(large, 8, global_batch=64, hardware="a100-80gb", space=quick).chosen.layout
    assert g.zero_stage >= 1 or g.tp * g.pp > 1  # a whole replica (~210 GB of state) cannot fit: sharded or split
    h = plan_layouts(huge, 256, global_batch=512, hardware="a100-80gb", space=quick).chosen.layout
    assert h.model_axes >= 1 and h.dp > 1 and h.tp * h.pp > 1  # hybrid: data x model parallel


def test_strategy_3d_keeps_explicit_options_and_logs_the_choice() -> None:
    from lightning_parallel.strategies.registry import strategy_from_name

    def resolve(world: int, **options: Any) -> Any:
        strategy = strategy_from_name("3d", **options)
        strategy.parallel_devices = [torch.device("cpu")] * world
        strategy.connect(GPT(**KW))
        dims = strategy.resolve_dims(world)
        return dims, strategy._degree_choice[1]

    dims, choice = resolve(4)
    assert (dims.tp, dims.pp) == (2, 2) and choice.explain().startswith("3d degrees: dp=1 x tp=2 x pp=2")
    assert "\nplanner: dp1 x tp2 x pp2 zero0 1f1b m2 for GPT on 4 x cpu" in choice.explain()
    # Activation checkpointing runs inside pipeline stages too: the planner keeps the option for
    # every layout it ranks, pipelined ones included, and rejects none of them for it.
    dims, choice = resolve(4, activation_checkpointing=True)
    assert all(p.layout.activation_checkpointing for p in choice.plan.ranked)
    assert any(p.layout.pp > 1 for p in choice.plan.ranked)
    assert "`activation_checkpointing`=True is invalid" not in choice.explain()
    # A fixed data-parallel degree and ZeRO stage are kept; the planner fills in tp and pp.
    dims, choice = resolve(8, data_parallel_size=2, zero_stage=3)
    assert dims.dp == 2 and dims.tp * dims.pp == 4 and all(p.layout.zero_stage == 3 for p in choice.plan.ranked)


def test_block_recomputation_only_when_asked_and_the_fewest_blocks_that_fit() -> None:
    import dataclasses

    from lightning_parallel.planner.cost import Workload, predict
    from lightning_parallel.planner.model import model_facts

    facts = model_facts(_gpt(n_layer=8))
    space = dict(tensor_parallel_size=1, pipeline_parallel_size=1, zero_stages=(0,), cpu_offload=(False,))
    both = plan_layouts(facts, 1, global_batch=64, hardware="a100-80gb", dtype="bf16", space=SearchSpace(**space))
    none, full = (_find(both, activation_checkpointing=ac) for ac in (False, True))
    memory = int((none.peak_bytes + full.peak_bytes) / 2)  # checkpointing every block fits, none does not
    default = plan_layouts(facts, 1, global_batch=64, hardware="a100-80gb", dtype="bf16", device_memory=memory,
                           space=SearchSpace(**space))
    assert all(p.layout.recompute_layers == 0 for p in default.ranked)  # the strategy cannot run it
    asked = plan_layouts(facts, 1, global_batch=64, hardware="a100-80gb", dtype="bf16", device_memory=memory,
                         space=SearchSpace(**space, partial_recompute=True))
    partial = _find(asked, activation_checkpointing=False, recompute_layers=asked.chosen.layout.recompute_layers)
    k = partial.layout.recompute_layers
    assert 0 < k < 8 and partial.fits and asked.chosen is partial
    assert full.peak_bytes < partial.peak_bytes <= memory < none.peak_bytes
    assert none.step_time < partial.step_time < full.step_time  # recomputes k of 8 blocks, not all
    work = Workload(global_batch=64, seq_len=16, dtype="bf16")
    shares = facts.shares(1, 1, 1, "single")
    fewer = predict(facts, dataclasses.replace(partial.layout, recompute_layers=k - 1), shares, work, get_profile("a100-80gb"))
    assert fewer.peak_bytes > memory  # k is the fewest that fit
    assert partial.layout.strategy_kwargs()["recompute_layers"] == k  # the strategy refuses the kwarg, loudly
