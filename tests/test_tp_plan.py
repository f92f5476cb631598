"""Tensor-parallel plans without a process group: inference, declared and user plans, bad input.

Models are built on the meta device, as the dry run does, so these checks also prove that
planning never needs real weights or a collective.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lightning_parallel.models.gpt import GPT
from lightning_parallel.models.llama import BASE_MODEL_TP_PLAN, Llama
from lightning_parallel.models.mlp import MLPClassifier, SeedMLP
from lightning_parallel.parallel.tensor.plan import resolve_tp_plan
from lightning_parallel.parallel.tensor.shards import tp_param_bytes


def meta(factory, *args, **kwargs):
    with torch.device("meta"):
        return factory(*args, **kwargs)


def small_gpt(**kwargs) -> GPT:
    params = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32) | kwargs
    return meta(GPT, **params)


def small_llama(**kwargs) -> Llama:
    params = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4) | kwargs
    return meta(Llama, **params)


LLAMA_LAYER = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}


def llama_styles(layers: int = 2) -> dict[str, str]:
    styles = {f"layers.{i}.{k}": v for i in range(layers) for k, v in LLAMA_LAYER.items()}
    return styles | {"embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_inferred_plan(tp: int) -> None:
    model = small_gpt()
    plan = resolve_tp_plan(model, tp)
    expected = {"tok_emb": "embedding_rowwise", "lm_head": "colwise_gather_output"}
    for i in range(2):
        expected |= {f"blocks.{i}.attn.{n}": "colwise" for n in "qkv"}
        expected |= {f"blocks.{i}.attn.proj": "rowwise", f"blocks.{i}.mlp.fc": "colwise", f"blocks.{i}.mlp.proj": "rowwise"}
    assert plan.source == "inferred" and plan.styles == expected
    assert set(plan.regions) == {"blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"}
    assert set(plan.norms) == {"blocks.0.ln_1", "blocks.0.ln_2", "blocks.1.ln_1", "blocks.1.ln_2", "ln_f"}
    assert plan.stream_embeddings == ("tok_emb", "pos_emb") and plan.lm_heads == ("lm_head",)
    assert plan.replicated["pos_emb"] == "position/extra embedding"
    replicated = sum(p.numel() for n, p in model.named_parameters() if "ln_" in n or n.startswith("pos_emb"))
    replicated += 2 * 2 * 32  # the row-parallel biases (attn.proj, mlp.proj) stay whole
    total = sum(p.numel() for p in model.parameters())
    assert plan.total_params == total and plan.sharded_params == total - replicated
    assert plan.fraction_sharded == pytest.approx((total - replicated) / total)


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_inferred_plan_finds_gqa_and_swiglu(tp: int) -> None:
    plan = resolve_tp_plan(small_llama(), tp)
    assert plan.source == "inferred" and plan.styles == llama_styles()
    assert set(plan.regions) == {"layers.0.self_attn", "layers.0.mlp", "layers.1.self_attn", "layers.1.mlp"}
    assert "norm" in plan.norms and "layers.1.post_attention_layernorm" in plan.norms


def test_declared_plan_is_read_the_hugging_face_way() -> None:
    plan = resolve_tp_plan(small_llama(declare_tp_plan=True), 2)
    assert plan.source == "declared" and plan.styles == llama_styles()
    assert not plan.warnings


def test_declared_plan_beats_inference_and_user_plan_beats_both() -> None:
    model = small_llama(declare_tp_plan=True)
    model.config.base_model_tp_plan = {k: v for k, v in BASE_MODEL_TP_PLAN.items() if ".mlp." in k}
    model._tp_plan = {}
    declared = resolve_tp_plan(model, 2)
    # The declared plan decides what it names (the MLPs); inferred groups it does not name complete it.
    assert declared.source == "declared+inferred"
    assert declared.styles == llama_styles()
    assert any("does not reach" in w for w in declared.warnings), declared.warnings
    user = resolve_tp_plan(model, 2, user_plan={"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"})
    assert user.source == "user"
    assert user.styles == {f"layers.{i}.self_attn.{n}": s for i in range(2) for n, s in (("q_proj", "colwise"), ("o_proj", "rowwise"))}


def test_seed_mlp_pairs_first_two_linears_and_keeps_the_last_whole() -> None:
    model = meta(SeedMLP)
    plan = resolve_tp_plan(model, 4)
    assert plan.styles == {"net.0": "colwise", "net.2": "rowwise"}
    assert plan.replicated == {"net.4": "no column/row-parallel partner found"}
    assert plan.regions == ("net",) and plan.norms == () and plan.stream_embeddings == ()
    assert plan.sharded_params == 1000 * 500 + 500 + 500 * 100
    assert plan.total_params == 1000 * 500 + 500 + 500 * 100 + 100 + 100 * 10 + 10
    table = plan.table()
    assert re.search(r"^net\.0 +colwise$", table, re.M)
    assert re.search(r"^net\.4 +replicate \(no column/row-parallel partner found\)$", table, re.M)
    assert "sharded 550,500 of 551,610 parameters (99.8%)" in table


def test_table_folds_repeated_layers() -> None:
    table = resolve_tp_plan(small_gpt(), 2).table()
    assert "Tensor-parallel plan (tp=2, source=inferred)" in table
    assert "blocks.*.attn.q     colwise  x2" in table
    assert "blocks.*.ln_1       replicate (norm (sequence-sharded under sequence_parallel))  x2" in table


def test_param_bytes_on_meta_model() -> None:
    model = small_gpt()
    plan = resolve_tp_plan(model, 4)
    report = tp_param_bytes(model, plan)
    total_bytes = 4 * plan.total_params
    assert report["unsharded_total_bytes"] == total_bytes
    assert report["sharded_bytes_per_rank"] == 4 * plan.sharded_params // 4
    assert report["replicated_bytes_per_rank"] == 4 * (plan.total_params - plan.sharded_params)
    assert report["total_bytes_per_rank"] == report["sharded_bytes_per_rank"] + report["replicated_bytes_per_rank"]
    assert report["per_module_bytes_per_rank"]["blocks.0.attn.q"] == 4 * (32 * 32 + 32) // 4
    assert report["per_module_bytes_per_rank"]["blocks.0.attn.proj"] == 4 * (32 * 32 // 4 + 32)
    assert "pos_emb" in report["replicated_modules"]


def test_heads_not_divisible_replicate_the_attention_with_a_warning() -> None:
    model = small_gpt(n_head=6, n_embd=48)
    with pytest.warns(UserWarning, match=r"blocks\.0\.attn`: attention heads=6 is not divisible by tensor_parallel_size=4"):
        plan = resolve_tp_plan(model, 4)
    for name in ("q", "k", "v", "proj"):
        assert f"blocks.0.attn.{name}" not in plan.styles
        assert plan.replicated[f"blocks.0.attn.{name}"] == "attention heads 6 % tp 4 != 0"
    assert plan.styles["blocks.0.mlp.fc"] == "colwise"  # the MLP is still split
    with pytest.raises(ValueError, match=r"module `blocks\.0\.attn` has attention heads=6, which is not divisible by the tensor-parallel size 4"):
        resolve_tp_plan(model, 4, strict=True)


def test_kv_heads_not_divisible() -> None:
    model = small_llama(num_key_value_heads=2)
    with pytest.warns(UserWarning, match=r"layers\.0\.self_attn`: key/value heads=2"):
        plan = resolve_tp_plan(model, 4)
    assert "layers.0.self_attn.k_proj" not in plan.styles and plan.styles["layers.0.mlp.up_proj"] == "colwise"
    assert resolve_tp_plan(model, 2).styles == llama_styles()
    with pytest.raises(ValueError, match=r"key/value heads=2, which is not divisible by the tensor-parallel size 4"):
        resolve_tp_plan(model, 4, strict=True)


def test_hidden_and_vocab_not_divisible() -> None:
    mlp = meta(MLPClassifier, dims=[8, 6, 4])
    with pytest.warns(UserWarning, match=r"module `net\.0`: out_features=6"):
        plan = resolve_tp_plan(mlp, 4)
    assert plan.styles == {} and plan.fraction_sharded == 0.0
    with pytest.raises(ValueError, match=r"module `net\.0` has out_features=6.*tensor-parallel size 4"):
        resolve_tp_plan(mlp, 4, strict=True)
    gpt = small_gpt(vocab_size=66)
    with pytest.warns(UserWarning, match=r"module `tok_emb`: vocabulary size \(num_embeddings\)=66"):
        plan = resolve_tp_plan(gpt, 4)
    assert "tok_emb" not in plan.styles and "lm_head" not in plan.styles and plan.styles["blocks.0.attn.q"] == "colwise"
    with pytest.raises(ValueError, match=r"`tok_emb` has vocabulary size \(num_embeddings\)=66"):
        resolve_tp_plan(gpt, 4, strict=True)


def test_user_plan_errors_list_close_matches() -> None:
    model = small_gpt()
    with pytest.raises(ValueError, match=r"no module matches this name \(close matches: \['blocks\.\*\.attn\.q'"):
        resolve_tp_plan(model, 2, user_plan={"blocks.*.attn.qq": "colwise"})
    with pytest.raises(ValueError, match=r"unknown tensor-parallel style \(close matches: \['colwise'"):
        resolve_tp_plan(model, 2, user_plan={"blocks.*.attn.q": "colwize"})
    with pytest.raises(ValueError, match=r"needs an nn.Linear .* got LayerNorm"):
        resolve_tp_plan(model, 2, user_plan={"blocks.*.ln_1": "colwise"})
    with pytest.raises(TypeError, match="tp_plan"):
        resolve_tp_plan(model, 2, user_plan=[("blocks.*.attn.q", "colwise")])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tensor_parallel_size"):
        resolve_tp_plan(model, "2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        resolve_tp_plan(model, 0)


def test_user_plan_aliases_and_group_divisibility() -> None:
    model = small_gpt(n_head=6, n_embd=48)
    plan = resolve_tp_plan(model, 2, user_plan={"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise_rep", "lm_head": "colwise_rep"})
    assert plan.source == "user"
    assert plan.styles == {"blocks.0.mlp.fc": "colwise", "blocks.0.mlp.proj": "rowwise", "blocks.1.mlp.fc": "colwise",
                           "blocks.1.mlp.proj": "rowwise", "lm_head": "colwise_gather_output"}
    assert plan.regions == ("blocks.0.mlp", "blocks.1.mlp")
    with pytest.warns(UserWarning, match=r"blocks\.0\.attn`: attention heads=6"):
        plan = resolve_tp_plan(model, 4, user_plan={"blocks.*.attn.q": "colwise", "blocks.*.attn.proj": "rowwise"})
    assert plan.styles == {}


class _TiedLM(nn.Module):
    """Embedding and head sharing one weight: both must split the vocabulary (dim 0) alike."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(32, 16)
        self.n_head = 2
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.wte(idx)))


def test_tied_embedding_and_head() -> None:
    model = meta(_TiedLM)
    plan = resolve_tp_plan(model, 2)
    assert plan.styles == {"wte": "embedding_rowwise", "head": "colwise_gather_output", "mlp.0": "colwise", "mlp.2": "rowwise"}
    assert plan.total_params == 32 * 16 + 16 * 64 + 64 + 64 * 16 + 16  # the shared weight counted once
    # A user plan that splits the tied weight two different ways keeps both whole.
    plan = resolve_tp_plan(model, 2, user_plan={"wte": "embedding_rowwise", "head": "rowwise"})
    assert plan.styles == {}
    assert "tied" in plan.replicated["wte"]


def _t5(num_heads: int = 4) -> nn.Module:
    import transformers

    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=num_heads,
                                   dropout_rate=0.0, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def test_t5_position_bias_embedding_is_split_with_its_heads() -> None:
    """T5's ``relative_attention_bias`` (num_buckets x heads, inside each stack's first attention) joins
    that attention's group as ``embedding_colwise``: split with the heads at tp2 (weight dim 1, its bytes
    counted as split), kept whole with them where the heads do not divide (3 heads at tp2). A declared
    ``embedding_colwise`` is accepted on an embedding and refused on a linear."""
    biases = ["encoder.block.0.layer.0.SelfAttention.relative_attention_bias",
              "decoder.block.0.layer.0.SelfAttention.relative_attention_bias"]
    plan = resolve_tp_plan(_t5(), 2)
    assert [plan.styles.get(b) for b in biases] == ["embedding_colwise"] * 2, plan.table()
    with pytest.warns(UserWarning, match="leaves 3 heads"):
        odd = resolve_tp_plan(_t5(num_heads=3), 2)
    assert not any(b in odd.styles for b in biases), odd.table()
    assert "encoder.block.0.layer.0.SelfAttention.q" not in odd.styles
    user = resolve_tp_plan(_t5(), 2, user_plan={"encoder.block.0.layer.0.SelfAttention.relative_attention_bias": "embedding_colwise"})
    assert user.styles[biases[0]] == "embedding_colwise"
    with pytest.raises(ValueError, match="embedding_colwise"):
        resolve_tp_plan(_t5(), 2, user_plan={"encoder.block.0.layer.0.SelfAttention.q": "embedding_colwise"})
