"""Context parallelism on real Hugging Face classes against one process on the whole sequence.

Each sequence is cut into head-tail chunks over the ``cp`` ranks; attention runs across them
(all three forms: all-gather of keys and values, ring, Ulysses all-to-all), positions stay global (RoPE in Llama, Qwen2
and Mistral; GPT-2's learned positions), the ``labels=`` loss shifts over the whole sequence, and
gradients are averaged over dp x cp. Every case must match one process (per-step losses, final
parameters, relative 1e-5 per tensor) over 5 steps with gradient clipping active, with left
padding in the batch where marked and Mistral's sliding window shorter than the sequence.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fits_in_fresh_process, token_data
from tests.test_data_parallel import HYBRID, _reference, assert_parity
from lightning_parallel.testing.real_models import HFCausalLM
from tests.test_hf_tp import TOKENS, _hf, fits_or_errors

# Mistral with a sliding window (6) shorter than the sequence (16): the window crosses chunk boundaries.
MISTRAL = {"family": "MistralConfig/MistralForCausalLM", "config": {
    "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "intermediate_size": 64, "max_position_embeddings": 64, "sliding_window": 6}}


def _cp(spec: FitSpec, form: str, devices: int = 2, **degrees: Any) -> FitSpec:
    strategy = {"class": HYBRID, "context_parallel_size": 2, "context_parallel_attention": form, **degrees}
    return dataclasses.replace(spec, strategy=strategy, devices=devices)


def _mistral(loss: str, padding: bool = False) -> FitSpec:
    spec = _hf("llama", loss, padding=padding)
    return dataclasses.replace(spec, model_kwargs={**spec.model_kwargs, **MISTRAL})


CP2_CASES: list[tuple[str, FitSpec]] = [
    ("llama logits allgather", _cp(_hf("llama"), "allgather")),
    ("llama labels padding ring, validate", _cp(dataclasses.replace(_hf("llama", "labels", padding=True), validate=True), "ring")),
    ("qwen2 labels allgather", _cp(_hf("qwen2", "labels"), "allgather")),
    ("gpt2 labels padding allgather", _cp(_hf("gpt2", "labels", padding=True), "allgather")),
    ("gpt2 logits ring", _cp(_hf("gpt2"), "ring")),
    ("mistral sliding window labels padding ring", _cp(_mistral("labels", padding=True), "ring")),
    ("mistral sliding window labels allgather", _cp(_mistral("labels"), "allgather")),
    ("llama labels padding ulysses", _cp(_hf("llama", "labels", padding=True), "ulysses")),
    ("gpt2 logits ulysses", _cp(_hf("gpt2"), "ulysses")),
    ("cp2 ep2 qwen2_moe logits ring", _cp(_hf("qwen2_moe"), "ring", expert_parallel_size=2)),  # experts over the cp pair
]


def _assert_cp_parity(label: str, ranks: list[dict[str, Any]], spec: FitSpec, reference: dict[str, Any] | None = None) -> None:
    assert all("error" not in r for r in ranks), f"{label}: {ranks[0].get('trace')}"
    dims = ranks[0]["layout"]["dims"]
    assert f"cp={spec.strategy['context_parallel_size']}" in dims, (label, dims)  # the sequence really was split
    total = sum(p.numel() for p in ranks[0]["params"].values())
    held = max(r["layout"]["local_param_numel_end"] for r in ranks) / total  # pipelines split at the first batch
    pp, tp = (spec.strategy.get(f"{axis}_parallel_size", 1) for axis in ("pipeline", "tensor"))
    if pp > 1 or tp > 1:  # and the stages / tp really split the layers beside it
        assert held < (0.35 if pp > 1 and tp > 1 else 0.6), (label, dims, held)
    reference = reference or _reference(dataclasses.replace(spec, strategy="auto", devices=1))
    assert max(reference["grad_norms"]) > spec.trainer_kwargs["gradient_clip_val"], label  # clipping is active
    # labels=: every rank logs the whole sequence's loss; a loss on the logits covers the rank's chunks (equal
    # token counts without padding), so the whole batch's loss is the mean over ranks either way.
    losses = [sum(step) / len(step) for step in zip(*(r["losses"] for r in ranks))]
    assert_parity(dict(ranks[0], losses=losses), reference, label, per_tensor=True, metrics=False)
    if spec.validate:  # trainer.validate after fit: the step is cut too, val_loss (sync_dist) reduced over dp x cp
        for rank in ranks:
            torch.testing.assert_close(rank["metrics"]["val_loss"], reference["metrics"]["val_loss"], rtol=1e-5, atol=0)


def test_hf_models_cp2_match_single_process() -> None:
    results = run_distributed(fits_or_errors, 2, [spec for _, spec in CP2_CASES], init_backend=None, timeout=900)
    for i, (label, spec) in enumerate(CP2_CASES):
        _assert_cp_parity(label, [rank[i] for rank in results], spec)


CP4_CASES: list[tuple[str, FitSpec]] = [
    ("cp4 llama labels padding ring", _cp(_hf("llama", "labels", padding=True), "ring", 4, context_parallel_size=4)),
    ("cp4 qwen2 logits allgather", _cp(_hf("qwen2"), "allgather", 4, context_parallel_size=4)),
    ("dp2xcp2 llama logits allgather", _cp(_hf("llama"), "allgather", 4, data_parallel_size=2)),
    ("dp2xcp2 zero3 gpt2 labels ring", _cp(_hf("gpt2", "labels"), "ring", 4, data_parallel_size=2, zero_stage=3)),
    ("tp2xcp2 llama labels padding allgather", _cp(_hf("llama", "labels", padding=True), "allgather", 4, tensor_parallel_size=2)),
    ("tp2xcp2 qwen2 logits ring", _cp(_hf("qwen2"), "ring", 4, tensor_parallel_size=2)),
    ("tp2xcp2 llama labels ulysses", _cp(_hf("llama", "labels"), "ulysses", 4, tensor_parallel_size=2)),
    ("cp4 mistral sliding window labels padding ulysses", _cp(_mistral("labels", padding=True), "ulysses", 4,
                                                             context_parallel_size=4)),
    # experts drawn from dp x cp: ep2 inside each cp pair's 4 ranks of tokens
    ("dp2xcp2 ep2 mixtral labels allgather", _cp(_hf("mixtral", "labels"), "allgather", 4, data_parallel_size=2,
                                                 expert_parallel_size=2)),
]


def test_hf_models_cp4_dp_cp_tp_cp_match_single_process() -> None:
    """Four ranks: cp4, dp2 x cp2 (DDP and ZeRO-3 over dp x cp), tp2 x cp2 (heads split by tp, sequence by cp),
    dp2 x cp2 x ep2 (experts drawn from the dp x cp ranks).
    dp2 cases carry no padding: HF's loss is a mean over each data-parallel rank's own tokens (see test_hf_tp)."""
    results = run_distributed(fits_or_errors, 4, [spec for _, spec in CP4_CASES], init_backend=None, timeout=900)
    for i, (label, spec) in enumerate(CP4_CASES):
        _assert_cp_parity(label, [rank[i] for rank in results], spec)


# Pipeline stages run cp attention as one traced op (parallel/context/traced.py). With padding, a pipelined
# labels= loss is a token mean per microbatch (as in tests/test_hf_pp.py): those cases are compared with one
# process accumulating over the same microbatches (True below), the others with one full-batch step (validation
# runs the forward-only pipe on whole batches, so it is checked on a case without padding).
PP_CP_CASES: list[tuple[str, FitSpec, bool]] = [
    ("pp2xcp2 llama labels padding allgather", _cp(_hf("llama", "labels", padding=True), "allgather", 4,
                                                   pipeline_parallel_size=2), True),
    ("pp2xcp2 qwen2 logits ring (forward is the entry)", _cp(_hf("qwen2"), "ring", 4, pipeline_parallel_size=2), False),
    ("pp2xcp2 gpt2 labels ulysses, validate", _cp(dataclasses.replace(_hf("gpt2", "labels"), validate=True), "ulysses", 4,
                                                  pipeline_parallel_size=2), False),
    ("pp2xcp2xep2 qwen2_moe labels allgather (experts opaque in the stages, drawn from the cp pair)",
     _cp(_hf("qwen2_moe", "labels"), "allgather", 4, pipeline_parallel_size=2, expert_parallel_size=2), False),
    ("pp2xcp2 mistral sliding window labels padding ring", _cp(_mistral("labels", padding=True), "ring", 4,
                                                               pipeline_parallel_size=2), True),
]


def test_hf_models_pp2_cp2_match_single_process() -> None:
    """Four ranks, two stages, each stage's sequence over two cp ranks: positions, padding and the labels=
    shift stay global inside traced stages (the last stage shifts each microbatch's labels over the cp pair)."""
    from tests.test_hf_pp import _per_step, _single_process

    results = run_distributed(fits_or_errors, 4, [spec for _, spec, _ in PP_CP_CASES], init_backend=None, timeout=900)
    for i, (label, spec, accumulating) in enumerate(PP_CP_CASES):
        ranks = [rank[i] for rank in results]
        assert "pp=2" in ranks[0].get("layout", {}).get("dims", ""), (label, ranks[0].get("trace"))
        reference = _reference(_single_process(spec, accumulating))
        if accumulating:
            reference = {**reference, "losses": _per_step(reference["losses"])}
        _assert_cp_parity(label, ranks, spec, reference)


PP_CP_8_CASES: list[tuple[str, FitSpec, bool]] = [
    ("tp2xpp2xcp2 llama labels padding allgather", _cp(_hf("llama", "labels", padding=True), "allgather", 8,
                                                      pipeline_parallel_size=2, tensor_parallel_size=2), True),
    ("dp2xpp2xcp2 zero1 gpt2 labels ring", _cp(_hf("gpt2", "labels"), "ring", 8, pipeline_parallel_size=2,
                                               data_parallel_size=2, zero_stage=1), False),
    ("dp2xpp2xcp2xep2 mixtral logits ring", _cp(_hf("mixtral"), "ring", 8, pipeline_parallel_size=2, data_parallel_size=2,
                                                expert_parallel_size=2), False),
]


def test_hf_models_tp_pp_cp_dp_pp_cp_ep_match_single_process() -> None:
    """Eight ranks: tp2 x pp2 x cp2 (the traced attention op runs on each tp rank's heads inside the stage
    graph), dp2 x pp2 x cp2 with ZeRO-1 (FSDP2 per stage over dp x cp) and dp2 x pp2 x cp2 x ep2 (experts
    drawn from the dp x cp ranks of each stage)."""
    from tests.test_hf_pp import _per_step, _single_process

    results = run_distributed(fits_or_errors, 8, [spec for _, spec, _ in PP_CP_8_CASES], init_backend=None, timeout=900)
    for i, (label, spec, accumulating) in enumerate(PP_CP_8_CASES):
        reference = _reference(_single_process(spec, accumulating))
        if accumulating:
            reference = {**reference, "losses": _per_step(reference["losses"])}
        _assert_cp_parity(label, [rank[i] for rank in results], spec, reference)


def test_checkpoints_move_between_cp_and_one_process(tmp_path: Path) -> None:
    """Train an epoch (3 steps) under cp2 x ZeRO-3 (sharded checkpoint), resume on one process; and one
    process (single file) resumed under cp2 with the ring: the next 3 steps equal an uninterrupted run's."""
    base = dataclasses.replace(_hf("llama", "labels"), data_kwargs={"num_samples": 24}, max_steps=-1)
    reference = run_fits_in_fresh_process([dataclasses.replace(base, max_epochs=2)])[0]
    cp_file, single_file = tmp_path / "cp.ckpt", tmp_path / "single.ckpt"
    first_cp = _cp(dataclasses.replace(base, max_epochs=1, save_to=str(cp_file)), "allgather", zero_stage=3)
    then_cp = _cp(dataclasses.replace(base, max_epochs=2, resume_from=str(single_file)), "ring")
    run_fits_in_fresh_process([dataclasses.replace(base, max_epochs=1, save_to=str(single_file))])
    run_distributed(fits_or_errors, 2, [first_cp], init_backend=None, timeout=600)
    resumed_single = run_fits_in_fresh_process([dataclasses.replace(  # the strategy on one process reads the sharded directory
        base, max_epochs=2, resume_from=str(cp_file), strategy={"class": HYBRID})])[0]
    resumed_cp = run_distributed(fits_or_errors, 2, [then_cp], init_backend=None, timeout=600)[0][0]
    for label, resumed in (("cp2 zero3 -> one process", resumed_single), ("one process -> cp2 ring", resumed_cp)):
        assert "error" not in resumed, resumed.get("trace")
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(reference["losses"][3:]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{label}: {m}")
        for name, ref in reference["params"].items():
            error = float((resumed["params"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
            assert error <= 1e-5, f"{label} {name}: relative error {error:.2e}"


def ambiguous_data(num_samples: int = 32) -> TensorDataset:
    """Tokens beside a per-sample [S, S] tensor: the sequence length is in two of its dims."""
    tokens = token_data(num_samples=num_samples).tensors[0]
    return TensorDataset(tokens, torch.zeros(num_samples, tokens.size(1), tokens.size(1)))


class FourDMaskLM(HFCausalLM):
    """Passes a 4-D attention mask of its own, which cannot be carried across chunks."""

    def _step_loss(self, batch: Any) -> torch.Tensor:
        x, _ = batch
        square = torch.ones(x.size(0), 1, x.size(1), x.size(1), dtype=torch.bool, device=x.device).tril()
        return self.model(input_ids=x, attention_mask=square, labels=x).loss


def test_refusals_are_typed_errors() -> None:
    """What context parallelism cannot run is a ValueError naming the cause and the fix, on every rank."""
    cases = [
        ("not a transformers model", FitSpec(model="lightning_parallel.models:GPT", data=TOKENS,
                                             model_kwargs={"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4,
                                                           "n_embd": 32}), "holds no transformers PreTrainedModel"),
        ("attention dropout", dataclasses.replace(_hf("llama"), model_kwargs={
            **_hf("llama").model_kwargs, "config": {"attention_dropout": 0.1}}), "attention dropout"),
        ("length 18 on cp2", dataclasses.replace(_hf("llama"), data_kwargs={"block_size": 18}), "multiple of it"),
        ("4-D attention mask", dataclasses.replace(_hf("llama"), model=f"{__name__}:FourDMaskLM"),
         "only a [batch, sequence] padding mask"),
        ("ambiguous entry", dataclasses.replace(_hf("llama"), data=f"{__name__}:ambiguous_data"),
         "context_parallel_batch_dims={'1': <dim to split>}"),
    ]
    specs = [_cp(dataclasses.replace(spec, max_steps=1), "allgather") for _, spec, _ in cases]
    for rank in run_distributed(fits_or_errors, 2, specs, init_backend=None, timeout=600):
        for (label, _, needle), result in zip(cases, rank):
            assert result.get("error") == "ValueError", (label, result)
            assert needle in result["message"] and "HINT" in result["message"], (label, result["message"])


def test_predict_under_pp_x_cp_is_a_typed_error() -> None:
    """Prediction runs whole sequences on every cp rank; stages traced for chunks cannot take them."""
    from lightning_parallel.parallel.dims import ParallelDims
    from lightning_parallel.strategies.context import check_predict

    check_predict(ParallelDims(world_size=2, cp=2))  # cp alone: whole sequences, no stages
    check_predict(ParallelDims(world_size=2, pp=2))
    with pytest.raises(ValueError, match="predict_step.*traced") as error:
        check_predict(ParallelDims(world_size=4, pp=2, cp=2))
    assert "HINT" in str(error.value)
