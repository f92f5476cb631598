"""Tensor parallelism on the real Hugging Face classes, wrapped as users wrap them.

Every model here is the library's own class (``lightning_parallel.testing.real_models``): Llama,
Qwen2 (biased q/k/v), GPT-2 (``Conv1D``, fused ``c_attn``, ``lm_head`` tied to ``wte``), GPT-NeoX
(fused per-head ``query_key_value``), Phi-3 (fused ``qkv_proj`` with GQA and ``gate_up_proj``,
declared plan ``colwise_gather_output``/``rowwise_split_input``), Mixtral and Qwen2-MoE (experts
split per expert over tp), with the default ``use_cache=True``, both loss forms (``F.cross_entropy``
on the logits, ``self.model(..., labels=...).loss``) and left padding with an ``attention_mask``.
Each must match one process (per-step losses, final parameters; per-tensor relative 1e-5: the
row-parallel layers and the experts sum partial products in another order) with gradient
clipping active, *and* each rank must really hold about half of the parameters: a plan that
runs but splits nothing would pass parity, so the local parameter count is part of the claim.

A model tensor parallelism cannot split (transformers' ResNet: convolutions and batch norms)
fails with a typed error naming the modules and the fix, before any process waits on another.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

import pytest
import torch
from torch import nn

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fit
from lightning_parallel.testing.real_models import HFCausalLM
from tests.test_data_parallel import HYBRID, _reference, assert_parity

HF = "lightning_parallel.testing.real_models:HFCausalLM"
VISION = "lightning_parallel.testing.real_models:VisionClassifier"
TOKENS = "lightning_parallel.testing.parity:token_data"
PADDED = "lightning_parallel.testing.real_models:padded_token_data"
CLIP = {"gradient_clip_val": 0.5}


def _hf(family: str, loss: str = "logits", padding: bool = False, gradient_checkpointing: bool = False,
        **kwargs: Any) -> FitSpec:
    return FitSpec(
        model=HF, model_kwargs={"family": family, "loss": loss, "padding": padding, "n_layer": 2,
                                "gradient_checkpointing": gradient_checkpointing},
        data=PADDED if padding else TOKENS, global_batch=8, max_steps=5, trainer_kwargs=CLIP, **kwargs,
    )


# (label, spec): every HF family at least once, both loss forms, padding, the default cache.
TP2_CASES: list[tuple[str, FitSpec]] = [
    ("llama logits", _hf("llama")),
    ("llama labels padding", _hf("llama", "labels", padding=True)),
    ("qwen2 labels", _hf("qwen2", "labels")),
    ("qwen2 labels HF gradient checkpointing", _hf("qwen2", "labels", gradient_checkpointing=True)),
    ("gpt2 logits", _hf("gpt2")),
    ("gpt2 labels padding", _hf("gpt2", "labels", padding=True)),
    ("gpt_neox logits", _hf("gpt_neox")),
    ("phi3 labels", _hf("phi3", "labels")),
    ("mixtral logits", _hf("mixtral")),
    ("qwen2_moe labels", _hf("qwen2_moe", "labels")),
]
# transformers' ViT: attention (q/k/v/o in one module) and MLPs split, the patch embedding and
# the classifier kept whole, so each rank holds about 60% of it.
VIT = FitSpec(model=VISION, model_kwargs={"arch": "vit"}, data="lightning_parallel.testing.real_models:image_data",
              global_batch=8, max_steps=5, trainer_kwargs={"gradient_clip_val": 0.05})


# Multi-query: the single key/value head stays whole, so each rank holds about 61% of Falcon.
# transformers' Falcon: multi-query attention, attention and MLP in parallel from one norm, and an
# in-place add into the attention output (``mlp_output += attention_output``): a region's output must
# behave like an ordinary tensor (issue 26: it was a view made inside a custom Function).
FALCON = dataclasses.replace(_hf("llama"), model_kwargs={
    "family": "FalconConfig/FalconForCausalLM", "config": {
        "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "multi_query": True,
        "parallel_attn": True, "new_decoder_architecture": False, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "bias": False}})
RESNET_TP = FitSpec(model=VISION, model_kwargs={"arch": "resnet"}, data="lightning_parallel.testing.real_models:image_data",
                    global_batch=8, max_steps=5, strategy="tp", devices=2)


def fits_or_errors(specs: list[FitSpec]) -> list[dict[str, Any]]:
    """Each fit's result, or the exception it raised (type and message), in one process group."""
    out: list[dict[str, Any]] = []
    for spec in specs:
        try:
            out.append(run_fit(spec))
        except Exception as error:  # noqa: BLE001 - the test inspects it
            out.append({"error": type(error).__name__, "message": str(error), "trace": traceback.format_exc()[-2000:]})
    return out


def _assert_tp_parity(label: str, result: dict[str, Any], spec: FitSpec, max_local: float) -> float:
    assert "error" not in result, f"{label}: {result.get('trace')}"
    reference = _reference(spec)
    assert max(reference["grad_norms"]) > spec.trainer_kwargs["gradient_clip_val"], label  # clipping is active
    assert_parity(result, reference, label, per_tensor=True, metrics=False)
    total = sum(p.numel() for p in result["params"].values())
    local = result["layout"]["local_param_numel"] / total
    assert local < max_local, f"{label}: each rank holds {local:.2f} of the parameters (plan splits too little)"
    return local


def test_hf_models_tp2_match_single_process_and_resnet_refused() -> None:
    cases = [*TP2_CASES, ("vit", VIT)]
    specs = [dataclasses.replace(spec, strategy="tp", devices=2) for _, spec in [*cases, ("falcon", FALCON)]]
    # Activation checkpointing recomputes each layer: Falcon's layers write the key/value cache, which
    # the recomputation wrote a second time (a shape error in backward) until the cache was turned off.
    checkpointed = dataclasses.replace(FALCON, strategy={"class": HYBRID, "tensor_parallel_size": 2, "activation_checkpointing": True}, devices=2)
    results = run_distributed(fits_or_errors, 2, [*specs, checkpointed, RESNET_TP], init_backend=None, timeout=900)[0]
    for (label, spec), result in zip(cases, results):
        _assert_tp_parity(label, result, spec, max_local=0.6)
    _assert_tp_parity("falcon (in-place add into a region's output)", results[len(cases)], FALCON, max_local=0.65)
    _assert_tp_parity("falcon, activation checkpointing", results[len(cases) + 1], FALCON, max_local=0.65)
    refused = results[-1]
    assert refused.get("error") == "ValueError", refused
    message = refused["message"]
    for needle in ("tensor_parallel_size", "nothing to split", "Conv2d", "BatchNorm2d", "model.resnet", "dp", "zero3", "tp_plan"):
        assert needle in message, (needle, message)


@pytest.mark.slow
def test_hf_dp2_tp2_match_single_process() -> None:
    """GPT-2 (packed ``_StridedShard`` c_attn, Conv1D, tied head) under FSDP2 (ZeRO-3) over dp x tp, and
    Mixtral with ep2 beside tp2 (expert parallelism owns the experts, tp the attention). Without
    padding: with it, HF's ``labels=`` loss is a mean over each data-parallel rank's own non-pad
    tokens, which differs from one process's mean over the global batch whatever tp does."""
    cases = [
        ("dp2xtp2 zero3 gpt2 labels", _hf("gpt2", "labels"),
         {"class": HYBRID, "tensor_parallel_size": 2, "data_parallel_size": 2, "zero_stage": 3}, 0.3),
        ("dp2xtp2 ep2 mixtral", _hf("mixtral"),
         {"class": HYBRID, "tensor_parallel_size": 2, "data_parallel_size": 2, "expert_parallel_size": 2}, 0.55),
        # Sequence parallelism over the block stacks under FSDP2: the stream's replicated norm weights are
        # FSDP2 parameters too (tests/test_hf_sequence_parallel.py has tp2 alone on more families).
        ("dp2xtp2 zero3 sequence_parallel llama", _hf("llama"), {**SP_DP, "zero_stage": 3}, 0.3),
        ("dp2xtp2 zero3 sequence_parallel bert", BERT, {**SP_DP, "zero_stage": 3}, 0.35),
        # T5's position-bias embedding split with the heads (weight Shard(1) on tp) under FSDP2's Shard(0).
        ("dp2xtp2 zero3 t5 labels", T5, {"class": HYBRID, "tensor_parallel_size": 2, "data_parallel_size": 2, "zero_stage": 3}, 0.35),
    ]
    specs = [dataclasses.replace(spec, strategy=strategy, devices=4) for _, spec, strategy, _ in cases]
    results = run_distributed(fits_or_errors, 4, specs, init_backend=None, timeout=900)
    for i, (label, spec, _, max_local) in enumerate(cases):
        assert all("error" not in rank[i] for rank in results), results[0][i].get("trace")
        # Each data-parallel rank logs its own batch's mean (no sync_dist, as users write it); with equal
        # token counts per rank the global batch's loss is the mean over ranks (tp peers log the same).
        losses = [sum(step) / len(step) for step in zip(*(rank[i]["losses"] for rank in results))]
        _assert_tp_parity(label, dict(results[0][i], losses=losses), spec, max_local=max_local)


SP_DP = {"class": HYBRID, "tensor_parallel_size": 2, "data_parallel_size": 2, "sequence_parallel": True}
T5 = dataclasses.replace(_hf("llama"), model_kwargs={
    "family": "T5Config/T5ForConditionalGeneration", "loss": "labels", "n_layer": 2, "config": {
        "vocab_size": 64, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "dropout_rate": 0.0,
        "decoder_start_token_id": 0}})
BERT = dataclasses.replace(_hf("llama"), model_kwargs={  # post-norm encoder layers, regions nested in the layer
    "family": "BertConfig/BertForMaskedLM", "n_layer": 2, "config": {
        "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 64,
        "max_position_embeddings": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}})


# ---------------------------------------------------------------- plans (no process group)


def _plan(family: str) -> Any:
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan
    
    return resolve_tp_plan(HFCausalLM(family=family, n_layer=2), 2)


def test_gpt2_plan_splits_conv1d_and_packs_c_attn() -> None:
    plan = _plan("gpt2")
    assert plan.source == "inferred"
    layer = "model.transformer.h.0"
    assert plan.styles[f"{layer}.attn.c_attn"] == "colwise" and plan.packed[f"{layer}.attn.c_attn"] == 3
    assert plan.styles[f"{layer}.attn.c_proj"] == "rowwise"
    assert plan.styles[f"{layer}.mlp.c_fc"] == "colwise" and f"{layer}.mlp.c_fc" not in plan.packed
    assert plan.styles["model.lm_head"] == "colwise_gather_output"  # tied to wte, both split along the vocabulary
    assert plan.styles["model.transformer.wte"] == "embedding_rowwise"
    assert plan.fraction_sharded > 0.9


def test_declared_plans_are_mapped_and_completed() -> None:
    phi3 = _plan("phi3")  # transformers' own plan gathers the fused outputs and splits the next input ...
    assert phi3.source == "declared"
    # ... run as column/row pairs where the dataflow pairs the same modules (tests/test_tp_packed_parts.py)
    assert phi3.styles["model.model.layers.0.self_attn.qkv_proj"] == "colwise"
    assert phi3.styles["model.model.layers.0.self_attn.o_proj"] == "rowwise"
    assert phi3.styles["model.model.layers.0.mlp.down_proj"] == "rowwise"
    mixtral = _plan("mixtral")  # moe_tp_experts (+ packed_colwise / rowwise on its parameters)
    assert mixtral.styles["model.model.layers.0.mlp.experts"] == "moe_tp_experts"
    assert not [w for w in mixtral.warnings if "experts" in w], mixtral.warnings
    qwen = _plan("qwen2_moe")  # its declared mlp.*_proj entries miss the shared expert: the inferred plan adds it
    assert qwen.source == "declared+inferred"
    assert qwen.styles["model.model.layers.0.mlp.shared_expert.down_proj"] == "rowwise"
    for plan in (phi3, mixtral, qwen):
        assert plan.fraction_sharded > 0.95, plan.table()


def test_experts_left_to_expert_parallelism() -> None:
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan
    
    plan = resolve_tp_plan(HFCausalLM(family="mixtral", n_layer=1), 2, split_experts=False)
    experts = "model.model.layers.0.mlp.experts"
    assert experts not in plan.styles and "expert parallelism" in plan.replicated[experts]
    assert plan.styles["model.model.layers.0.self_attn.q_proj"] == "colwise"


def test_hf_style_names() -> None:
    from lightning_parallel.parallel.tensor.styles import canonical_style

    assert canonical_style("rowwise_split_input", where="x") == "rowwise_split_input"
    assert canonical_style("colwise_rep", where="x") == "colwise_gather_output"
    assert canonical_style("replicated_with_grad_allreduce", where="x") == "replicate"
    assert canonical_style("packed_colwise", where="x") == "packed_colwise"
    with pytest.raises(ValueError, match="unknown tensor-parallel style"):
        canonical_style("ep_router", where="x")


def test_unsupported_declared_style_falls_back_to_inferred() -> None:
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan
    
    model = HFCausalLM(family="llama", n_layer=1)
    for module in model.modules():  # transformers copies the config's plan to each model's ``_tp_plan``
        own = getattr(module, "_tp_plan", None)
        if own:  # a transformers style with no counterpart here
            module._tp_plan = {k: "mla_kv_a_proj" if k.endswith("mlp.down_proj") else v for k, v in own.items()}
    plan = resolve_tp_plan(model, 2)
    mlp = "model.model.layers.0.mlp"
    # The MLP is named by the declared plan, so it is not half-inferred: down_proj stays whole, and
    # gate/up, left without a row-parallel partner, gather their outputs (a split one would meet
    # the whole down_proj).
    assert any("mla_kv_a_proj" in w for w in plan.warnings), plan.warnings
    assert f"{mlp}.down_proj" in plan.replicated
    assert plan.styles[f"{mlp}.gate_proj"] == plan.styles[f"{mlp}.up_proj"] == "colwise_gather_output"
    assert plan.styles["model.model.layers.0.self_attn.o_proj"] == "rowwise"


def test_resnet_plan_is_a_typed_error() -> None:
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan
    from lightning_parallel.testing.real_models import VisionClassifier

    with pytest.raises(ValueError, match=r"nothing to split.*Conv2d.*HINT: use a data-parallel strategy"):
        resolve_tp_plan(VisionClassifier(arch="resnet"), 2)


def test_vit_plan_splits_attention_and_mlp() -> None:
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan
    from lightning_parallel.testing.real_models import VisionClassifier

    with pytest.warns(UserWarning, match=r"keeps these projections whole.*model.classifier`: no column/row-parallel partner"):
        plan = resolve_tp_plan(VisionClassifier(arch="vit"), 2)
    layer = "model.vit.layers.0"
    assert [plan.styles[f"{layer}.attention.{p}"] for p in ("q_proj", "k_proj", "v_proj", "o_proj")] == ["colwise"] * 3 + ["rowwise"]
    assert plan.styles[f"{layer}.mlp.fc1"] == "colwise" and plan.styles[f"{layer}.mlp.fc2"] == "rowwise"


def test_multihead_attention_is_named_as_kept_whole() -> None:
    """torch's own ``nn.TransformerEncoder`` (``nn.MultiheadAttention`` with its fused ``in_proj_weight``):
    the feed-forward layers split, the attention is named in the warning."""
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan

    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False))
    with pytest.warns(UserWarning, match=r"keeps these projections whole.*self_attn` x2: nn.MultiheadAttention: no tensor-parallel split"):
        plan = resolve_tp_plan(model, 2)
    assert plan.styles["0.layers.0.linear1"] == "colwise" and plan.styles["0.layers.0.linear2"] == "rowwise"


def test_split_packed_only_answers_exact_parts() -> None:
    from lightning_parallel.parallel.tensor.fused import split_packed

    assert split_packed(torch.Tensor.split, (torch.zeros(2, 6), 2), {"dim": 1}) is None  # not a DTensor
    assert split_packed(torch.Tensor.view, (torch.zeros(2, 6), 12), {}) is None


def test_conv1d_is_recognised() -> None:
    from transformers.pytorch_utils import Conv1D

    from lightning_parallel.parallel.tensor.fused import features, is_conv1d

    layer = Conv1D(12, 4)
    assert is_conv1d(layer) and features(layer) == (4, 12)
    assert not is_conv1d(nn.Linear(4, 12))
