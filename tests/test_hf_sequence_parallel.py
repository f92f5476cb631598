"""Sequence parallelism on the real Hugging Face classes (issue 26: it was refused for them).

They build masks, position ids and rotary tables from the embedding output's length, so the split
spans their block stacks (``parallel/tensor/sequence_stacks.py``). Families chosen for what each
layer does besides its regions: RoPE with grouped-query attention (Llama), learned positions and
``Conv1D`` (GPT-2), post-norm encoder layers whose MLP region contains the attention region and
whose residual add and norm run inside the region (BERT), an encoder-decoder with a position bias
returned by the first layer and cross-attention reading the encoder stack's output (T5), a residual
handed into the regions with ALiBi (Bloom), a multi-query attention kept whole inside a split stack
(GPT-BigCode), a parallel attention + MLP block (Falcon, grouped), and MoE layers whose experts tp
splits (Mixtral; Qwen2-MoE with a shared expert, a region inside the MoE layer), which run on the
gathered sequence, and tokens flattened to ``(batch x sequence, width)`` around the MLP (OPT). Each must match one process (losses and parameters, per-tensor relative 1e-5,
clipping active) and split at least half of the parameters. Refused with typed errors: a sequence
the tp size does not divide (ViT's 17 tokens), ``output_hidden_states=True``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_parallel.coverage import CLIP, MODELS
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec
from tests.test_data_parallel import HYBRID, _reference, assert_parity
from tests.test_hf_tp import _hf, fits_or_errors

SP = {"class": HYBRID, "tensor_parallel_size": 2, "sequence_parallel": True}
# family -> the largest fraction of the parameters one rank may hold
FAMILIES = {"llama": 0.55, "gpt2": 0.6, "bert": 0.6, "t5": 0.6, "bloom": 0.55, "gpt_bigcode": 0.66, "falcon_gqa": 0.55,
            "mixtral": 0.55, "qwen2_moe": 0.55, "opt": 0.6}


def _sp(model: str, **config: Any) -> FitSpec:
    base = MODELS[model]
    kwargs = {**base.model_kwargs, "config": {**(base.model_kwargs.get("config") or {}), **config}} if config else base.model_kwargs
    return dataclasses.replace(base, strategy=SP, devices=2, model_kwargs=kwargs,
                               trainer_kwargs={**base.trainer_kwargs, "gradient_clip_val": CLIP})


# With what users combine it: padding with an attention mask and HF's labels= loss, HF's own gradient
# checkpointing (transformers checkpoints the layer's class forward: its recomputation runs outside the
# layer's call), the package's activation checkpointing, loss parallelism.
VARIANTS = {
    "llama labels padding": (_hf("llama", "labels", padding=True), SP),
    "qwen2 HF gradient checkpointing": (_hf("qwen2", "labels", gradient_checkpointing=True), SP),
    "llama activation_checkpointing": (_hf("llama"), {**SP, "activation_checkpointing": True}),
    "gpt2 loss_parallel": (_hf("gpt2"), {**SP, "loss_parallel": True}),
}


def test_hf_sequence_parallel_matches_single_process_or_refuses() -> None:
    specs = [_sp(family) for family in FAMILIES]
    variants = [dataclasses.replace(spec, strategy=strategy, devices=2) for spec, strategy in VARIANTS.values()]
    refused = [_sp("vit"), _sp("llama", output_hidden_states=True)]
    results = run_distributed(fits_or_errors, 2, [*specs, *variants, *refused], init_backend=None, timeout=900)[0]
    for label, spec, result in zip(VARIANTS, variants, results[len(specs):]):
        assert "error" not in result, f"{label}: {result.get('trace')}"
        assert_parity(result, _reference(spec), label, per_tensor=True, metrics=False)
    for (family, max_local), spec, result in zip(FAMILIES.items(), specs, results):
        assert "error" not in result, f"{family}: {result.get('trace')}"
        reference = _reference(spec)
        assert max(reference["grad_norms"]) > CLIP, family  # clipping is active
        assert_parity(result, reference, family, per_tensor=True, metrics=False)
        local = result["layout"]["local_param_numel"] / sum(p.numel() for p in result["params"].values())
        assert local < max_local, f"{family}: each rank holds {local:.2f} of the parameters"
    vit, hidden = results[len(specs) + len(variants):]
    assert vit.get("error") == "ValueError" and "divisible by tensor_parallel_size=2" in vit["message"], vit
    assert "(8, 17, 32)" in vit["message"], vit
    assert hidden.get("error") == "ValueError" and "output_hidden_states" in hidden["message"], hidden
