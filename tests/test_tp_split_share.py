"""A tensor-parallel layout that splits too little is refused, not warned about (issue 26, item 2).

Real ``transformers`` classes (tiny random configs, meta device) and this package's MoE GPT: the
strategy plans them as ``setup_environment()`` does (``resolve_dims`` then ``_resolve_plans``,
no process group), so the refusal reaches every rank before any collective.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

from lightning_parallel import HybridParallelStrategy
from lightning_parallel.models import MoEGPT
from lightning_parallel.parallel.tensor.plan import resolve_tp_plan
from lightning_parallel.parallel.tensor.split_share import split_share

TINY = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
        "intermediate_size": 64, "max_position_embeddings": 64}


class Wrapped(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def _hf(config: str, model: str, **overrides: Any) -> Wrapped:
    with torch.device("meta"):
        return Wrapped(getattr(transformers, model)(getattr(transformers, config)(**{**TINY, **overrides})))


def _moe_gpt() -> Wrapped:
    with torch.device("meta"):
        return Wrapped(MoEGPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, num_experts=4))


def _planned(module: pl.LightningModule, world: int, **kwargs: Any) -> HybridParallelStrategy:
    strategy = HybridParallelStrategy(**kwargs)
    strategy._lightning_module = module
    strategy._dims = strategy.resolve_dims(world)
    strategy._resolve_plans()
    return strategy


def test_a_plan_splitting_under_half_is_a_typed_error_naming_what_stays_whole() -> None:
    # StableLM: the inferred plan finds no row-parallel partner for its k/v projections (38% split).
    stablelm = _hf("StableLmConfig", "StableLmForCausalLM")
    with pytest.raises(ValueError) as info:
        _planned(stablelm, 2, tensor_parallel_size=2)
    message = str(info.value)
    assert "`tensor_parallel_min_split`=0.5 is invalid" in message and "splits only 3" in message, message
    assert "`model.model.layers.*.self_attn.k_proj` x2" in message and "HINT: " in message and "tensor_parallel_min_split=0" in message
    # This package's MoE GPT: its experts (w1/w2 layout) are not a tp layout; 14% split under tp alone.
    with pytest.raises(ValueError, match=r"splits only 1\d\.\d%.*mlp\.experts"):
        _planned(_moe_gpt(), 2, tensor_parallel_size=2)
    assert not (dist.is_available() and dist.is_initialized())


def test_what_another_axis_splits_counts_and_the_user_may_accept_a_partial_split() -> None:
    # tp2 x ep2: the experts are divided by expert parallelism, so no rank holds them whole.
    moe = _moe_gpt()
    strategy = _planned(moe, 4, tensor_parallel_size=2, expert_parallel_size=2)
    assert strategy._tp_resolved is not None and strategy._tp_resolved.fraction_sharded < 0.5
    assert split_share(moe, strategy._tp_resolved, ["model.blocks.0.mlp.experts", "model.blocks.1.mlp.experts"]) > 0.5
    # The explicit opt-in: the same StableLM layout, accepted, with the plan's warning still given.
    with pytest.warns(UserWarning, match="keeps these projections whole"):
        accepted = _planned(_hf("StableLmConfig", "StableLmForCausalLM"), 2, tensor_parallel_size=2, tensor_parallel_min_split=0.0)
    assert accepted._tp_resolved is not None and 0.3 < accepted._tp_resolved.fraction_sharded < 0.5


@pytest.mark.parametrize(("config", "model", "overrides"), [
    ("Qwen3Config", "Qwen3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 8}),
    ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 64, "word_embed_proj_dim": 32}),
    ("BioGptConfig", "BioGptForCausalLM", {}),
])
def test_families_the_plan_splits_pass_the_default(config: str, model: str, overrides: dict[str, Any]) -> None:
    module = _hf(config, model, **overrides)
    strategy = _planned(module, 2, tensor_parallel_size=2)
    plan = strategy._tp_resolved
    assert plan is not None and split_share(module, plan) == pytest.approx(plan.fraction_sharded, abs=0.02)
    assert plan.fraction_sharded > 0.8


def test_3d_with_automatic_degrees_skips_a_tensor_parallel_degree_it_would_refuse() -> None:
    # Four processes: tp2 x pp2 is the only layout with both model axes, and StableLM's tp plan is refused.
    stablelm = _hf("StableLmConfig", "StableLmForCausalLM", num_hidden_layers=4)
    assert resolve_tp_plan(stablelm, 2).fraction_sharded < 0.5
    chosen = {}
    for min_split in (0.5, 0.0):
        strategy = HybridParallelStrategy(tensor_parallel_size="auto", pipeline_parallel_size="auto", tensor_parallel_min_split=min_split)
        strategy.parallel_devices = [torch.device("cpu")] * 4  # one node of four processes: tp may span them
        strategy._lightning_module = stablelm
        chosen[min_split] = strategy.resolve_dims(4)
    assert chosen[0.5].tp == 1 and chosen[0.5].pp > 1, chosen
    assert (chosen[0.0].tp, chosen[0.0].pp) == (2, 2), chosen  # accepted partial split: the planner's tp2 x pp2
