"""Unit tests of the pipeline planner and schedule rules: no process group, meta-device models."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_parallel.models.gpt import GPT
from lightning_parallel.models.mlp import DeepMLP, MLPClassifier
from lightning_parallel.parallel.pipeline.plan import _min_max_partition, plan_pipeline
from lightning_parallel.parallel.pipeline.schedules import (
    SCHEDULES,
    check_batch_size,
    check_microbatches,
    resolve_virtual_stages,
    schedule_spec,
    stage_to_rank,
)


def meta_gpt(n_layer: int = 8) -> GPT:
    with torch.device("meta"):
        return GPT(vocab_size=1000, block_size=16, n_layer=n_layer, n_head=2, n_embd=32)


def params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_gpt_auto_plan_puts_embedding_first_head_last_and_balances() -> None:
    model = meta_gpt(8)
    assert next(model.parameters()).is_meta
    plan = plan_pipeline(model, 2)
    assert plan.source == "repeated blocks"
    assert plan.blocks == tuple(f"blocks.{i}" for i in range(8))
    first, last = plan.stages
    assert first.modules[:3] == ("tok_emb", "pos_emb", "drop") and "lm_head" not in first.modules
    assert last.modules[-2:] == ("ln_f", "lm_head") and "tok_emb" not in last.modules
    # every parameter is counted once per stage that holds it; the untied model splits exactly
    assert first.num_params + last.num_params == params(model)
    assert abs(first.share + last.share - 1.0) < 1e-12
    # optimal: no single cut position gives a smaller largest stage
    emb = params(model.tok_emb) + params(model.pos_emb)
    head = params(model.ln_f) + params(model.lm_head)
    block = params(model.blocks[0])
    best = min(max(emb + k * block, (8 - k) * block + head) for k in range(1, 8))
    assert max(first.num_params, last.num_params) == best
    assert plan.split_points == (last.modules[0],)


def test_virtual_stage_placement_loop_and_v() -> None:
    model = meta_gpt(8)
    loop = plan_pipeline(model, 2, 2, style="loop")
    v = plan_pipeline(model, 2, 2, style="v")
    assert [s.rank for s in loop.stages] == [0, 1, 0, 1]
    assert [s.rank for s in v.stages] == [0, 1, 1, 0]
    assert loop.split_points == v.split_points and len(loop.split_points) == 3
    assert v.stages_for_rank(0) == [0, 3] and loop.stages_for_rank(0) == [0, 2]
    assert stage_to_rank(8, 4, "v") == [0, 1, 2, 3, 3, 2, 1, 0]


def test_sequential_mlp_cuts_before_linear_layers_only() -> None:
    model = MLPClassifier(dims=[16, 64, 64, 64, 64, 8])  # net = Linear, ReLU, ..., Linear
    plan = plan_pipeline(model, 3)
    linear_names = {f"net.{i}" for i, m in enumerate(model.net) if isinstance(m, nn.Linear)}
    assert set(plan.split_points) <= linear_names
    for stage in plan.stages:  # an activation stays with the Linear it follows
        assert isinstance(model.get_submodule(stage.modules[0]), nn.Linear)
    assert sum(s.num_params for s in plan.stages) == params(model)


def test_deep_mlp_stem_first_head_last() -> None:
    with torch.device("meta"):
        model = DeepMLP(in_dim=8, width=32, depth=6, num_classes=4)
    plan = plan_pipeline(model, 3)
    assert plan.stages[0].modules[0] == "stem" and plan.stages[-1].modules[-1] == "head"
    assert [len([m for m in s.modules if m.startswith("blocks.")]) for s in plan.stages] == [2, 2, 2]


def test_min_max_partition_is_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(30):
        costs = [rng.randint(1, 20) for _ in range(rng.randint(3, 8))]
        parts = rng.randint(1, len(costs))
        starts = _min_max_partition(costs, parts)
        assert starts[0] == 0 and len(starts) == parts and starts == sorted(set(starts))

        def worst(starts: list[int]) -> int:
            bounds = starts + [len(costs)]
            return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))

        brute = min(worst([0, *c]) for c in itertools.combinations(range(1, len(costs)), parts - 1))
        assert worst(starts) == brute


def test_measured_block_costs_move_the_cut() -> None:
    model = meta_gpt(8)
    even = plan_pipeline(model, 2)
    slow_tail = plan_pipeline(model, 2, block_costs=[1.0] * 7 + [10.0])
    assert slow_tail.split_points != even.split_points
    assert slow_tail.split_points == ("blocks.7",)  # the slow block gets a stage of its own
    assert slow_tail.stages[1].share > 0.5


def test_user_split_points_are_honoured_and_validated() -> None:
    model = meta_gpt(8)
    plan = plan_pipeline(model, 2, split_points=["blocks.6"])
    assert plan.source == "split_points" and plan.split_points == ("blocks.6",)
    assert plan.stages[1].modules == ("blocks.6", "blocks.7", "ln_f", "lm_head")
    # a split point deeper than a block splits that block's parent open
    deep = plan_pipeline(model, 2, split_points=["blocks.3.mlp"])
    assert deep.stages[1].modules[0] == "blocks.3.mlp" and "blocks.3.attn" in deep.stages[0].modules
    with pytest.raises(ValueError, match=r"`split_points`.*no module 'blocks\.66'.*HINT: use module names such as"):
        plan_pipeline(model, 2, split_points=["blocks.66"])
    with pytest.raises(ValueError, match=r"4 stages .* need 3 split points, got 1"):
        plan_pipeline(model, 4, split_points=["blocks.2"])
    with pytest.raises(ValueError, match="definition order"):
        plan_pipeline(model, 3, split_points=["blocks.5", "blocks.2"])
    with pytest.raises(ValueError, match="stage 0 would hold no module with parameters"):
        plan_pipeline(model, 2, split_points=["tok_emb"])
    with pytest.raises(TypeError, match="list of module names"):
        plan_pipeline(model, 2, split_points="blocks.4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass one of split_points and block_costs"):
        plan_pipeline(model, 2, split_points=["blocks.4"], block_costs=[1.0] * 8)


def test_more_stages_than_blocks_is_an_error() -> None:
    model = meta_gpt(3)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \* virtual_stages.*4.*more stages than blocks: the model has 3 blocks"):
        plan_pipeline(model, 2, 2, style="loop")


def test_model_without_block_stack_asks_for_split_points() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="no repeated block stack.*HINT: name the first module of each stage with split_points"):
        plan_pipeline(model, 2)


class _SeedNaive(nn.Module):
    """The seeds' naive model-parallel example: three named layers, no container."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(1000, 500), nn.Linear(500, 100), nn.Linear(100, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def test_top_level_layers_are_cut_when_there_is_no_stack() -> None:
    plan = plan_pipeline(_SeedNaive(), 2)
    assert [list(stage.modules) for stage in plan.stages] == [["fc1"], ["fc2", "fc3"]]  # balanced by parameters
    assert plan.split_points == ("fc2",)


class _HFLikeBase(nn.Module):
    """Shaped like a Hugging Face base model: a declared plan names ``h`` as the layer stack."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, 8)
        self.h = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.adapters = nn.ModuleList(nn.Linear(8, 64) for _ in range(6))  # larger decoy stack
        self.ln_f = nn.LayerNorm(8)


class _HFLikeCausalLM(nn.Module):
    base_model_prefix = "transformer"

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            base_model_pp_plan={"wte": (["input_ids"], ["h"]), "h": (["h"], ["h"]), "ln_f": (["h"], ["h"])}
        )
        self.transformer = _HFLikeBase()
        self.lm_head = nn.Linear(8, 50)


def test_hugging_face_declared_pipeline_plan_wins_over_the_largest_stack() -> None:
    plan = plan_pipeline(_HFLikeCausalLM(), 2)
    assert plan.source == "base_model_pp_plan"
    assert plan.blocks == tuple(f"transformer.h.{i}" for i in range(4))
    assert all(p.startswith("transformer.h.") for p in plan.split_points)
    assert plan.stages[0].modules[0] == "transformer.wte" and plan.stages[-1].modules[-1] == "lm_head"
    # without the declaration the decoy stack (more parameters) would have been chosen
    bare = _HFLikeCausalLM()
    del bare.config
    assert plan_pipeline(bare, 2).blocks[0].startswith("transformer.adapters.")


def test_table_lists_stages_ranks_shares_and_compact_module_names() -> None:
    plan = plan_pipeline(meta_gpt(8), 2, 2, style="v")
    table = plan.table()
    assert "4 stages on 2 ranks (2 per rank, v placement)" in table
    lines = table.splitlines()
    assert len(lines) == 2 + 4
    assert "tok_emb, pos_emb, drop, blocks.0" in lines[2]
    assert lines[5].split()[1] == "0"  # the last stage is on rank 0 in a V
    assert "..." not in table and "blocks." in table
    shares = [float(line.split()[3].rstrip("%")) for line in lines[2:]]
    assert abs(sum(shares) - 100.0) < 0.2


def test_schedule_names_virtual_stages_and_microbatch_rules() -> None:
    assert {"gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"} <= set(SCHEDULES)
    assert schedule_spec("Interleaved-1F1B").name == "interleaved_1f1b"
    with pytest.raises(ValueError, match=r"`pipeline_schedule`='pipedream' is invalid: unknown schedule"):
        schedule_spec("pipedream")
    with pytest.raises(TypeError, match="pipeline_schedule"):
        schedule_spec(3)
    assert resolve_virtual_stages(schedule_spec("1f1b"), "auto") == 1
    assert resolve_virtual_stages(schedule_spec("interleaved_1f1b"), "auto") == 2
    assert resolve_virtual_stages(schedule_spec("interleaved_1f1b"), 3) == 3
    with pytest.raises(ValueError, match="one stage per rank"):
        resolve_virtual_stages(schedule_spec("gpipe"), 2)
    with pytest.raises(ValueError, match="exactly two stages per rank"):
        resolve_virtual_stages(schedule_spec("zbv"), 3)
    with pytest.raises(ValueError, match="at least two stages per rank"):
        resolve_virtual_stages(schedule_spec("interleaved_zb"), 1)
    gpipe, one_f, zbv = schedule_spec("gpipe"), schedule_spec("1f1b"), schedule_spec("zbv")
    assert check_microbatches(gpipe, 4, 1, 1) == 1  # naive layer placement: one microbatch
    with pytest.raises(ValueError, match=r"`microbatches`=2 is invalid: schedule '1f1b' needs at least as many microbatches as stages \(4\)"):
        check_microbatches(one_f, 4, 1, 2)
    assert check_microbatches(one_f, 4, 1, 4) == 4
    assert check_microbatches(zbv, 2, 2, 1) == 1  # measured: ZBV drains a V that is not full
    interleaved, dualpipe = schedule_spec("interleaved_1f1b"), schedule_spec("dualpipev")
    for ok in (1, 2, 3, 4, 6, 8, 10):  # rounds of m // p microbatches must be equal
        assert check_microbatches(interleaved, 2, 2, ok) == ok
    with pytest.raises(ValueError, match=r"`microbatches`=5 is invalid: .*2 equal rounds.*HINT: use one of microbatches=\[.*4, 6"):
        check_microbatches(interleaved, 2, 2, 5)
    with pytest.raises(ValueError, match="interleaved_zb"):
        check_microbatches(schedule_spec("interleaved_zb"), 4, 2, 9)
    with pytest.raises(ValueError, match=r"'dualpipev'.*needs at least as many microbatches as stages \(4\)"):
        check_microbatches(dualpipe, 2, 2, 3)
    with pytest.raises(TypeError, match="microbatches"):
        check_microbatches(gpipe, 2, 1, 2.0)
    with pytest.raises(ValueError, match="at least one microbatch"):
        check_microbatches(gpipe, 2, 1, 0)


def test_batch_size_rules() -> None:
    check_batch_size(8, 4)
    check_batch_size(8, 4, microbatch_size=2)
    with pytest.raises(ValueError, match=r"`batch_size`=10 is invalid: .*divisible by 4.*drop_last=True"):
        check_batch_size(10, 4)
    with pytest.raises(ValueError, match="traced for microbatches of 2 rows"):
        check_batch_size(12, 4, microbatch_size=2)
