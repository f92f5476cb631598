"""Real Hugging Face models under the data-parallel and expert-parallel presets.

A covering subset of the coverage matrix (``python -m lightning_parallel.coverage`` runs all of
it): every real model of ``lightning_parallel.testing.real_models`` at least once, every
strategy of this file at least once, and the ways HF users write a model: the loss from
``labels=`` inside the model, ``attention_mask`` with padding, HF's own
``gradient_checkpointing_enable()`` under ZeRO-3, ``Trainer(sync_batchnorm=True)`` under ZeRO-2
and HSDP, and GPT-2's tied ``lm_head``/``wte`` under ZeRO-3 (a broken tie would show up as a
second parameter name). Parity as everywhere: per-step
losses and final parameters of one process on the same global batch, fp32, rel 1e-5, five
steps, gradient clipping active.

The wrappers log ``train_loss`` without ``sync_dist`` (as users do), so each rank logs its own
batch's mean; with equal per-rank denominators the global batch's loss is the mean over ranks.
A padded batch's token-mean loss is not: under data parallelism (as under any DDP) the step
averages per-rank means, which is one process accumulating the same per-rank batches; that
case is compared rank by rank with such a reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from torch.utils.data import Subset, TensorDataset

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fits, run_fits_in_fresh_process
from tests.test_data_parallel import HYBRID, assert_parity

RM = "lightning_parallel.testing.real_models"
CLIP = 0.5
TOKENS = "lightning_parallel.testing.parity:token_data"


def _lm(family: str, strategy: str, **model_kwargs: Any) -> FitSpec:
    return FitSpec(model=f"{RM}:HFCausalLM", model_kwargs={"family": family, **model_kwargs}, data=TOKENS,
                   strategy=strategy, devices=2, global_batch=8, max_steps=5, trainer_kwargs={"gradient_clip_val": CLIP})


def _vision(arch: str, strategy: str, **trainer_kwargs: Any) -> FitSpec:
    return FitSpec(model=f"{RM}:VisionClassifier", model_kwargs={"arch": arch}, data=f"{RM}:image_data", strategy=strategy,
                   devices=2, global_batch=8, max_steps=5, trainer_kwargs={"gradient_clip_val": CLIP, **trainer_kwargs})


def rank_interleaved_padded_data(world: int = 2, per_rank: int = 4, **kwargs: Any) -> Subset[Any]:
    """``padded_token_data`` reordered so that one process reading it in order sees, for every
    step, rank 0's batch, then rank 1's, ... of a ``DistributedSampler(shuffle=False)`` run."""
    from lightning_parallel.testing.real_models import padded_token_data

    data: TensorDataset = padded_token_data(**kwargs)
    steps = len(data) // (world * per_rank)
    order = [r + world * (per_rank * k + j) for k in range(steps) for r in range(world) for j in range(per_rank)]
    return Subset(data, order)


TWO_RANK_CASES: list[tuple[str, FitSpec]] = [
    ("llama dp", _lm("llama", "dp")),
    ("qwen2 zero1", _lm("qwen2", "zero1")),
    ("gpt2 zero3 (tied lm_head)", _lm("gpt2", "zero3")),
    ("gpt_neox zero2", _lm("gpt_neox", "zero2")),
    ("phi3 dp labels=", _lm("phi3", "dp", loss="labels")),
    ("llama zero3 HF gradient checkpointing labels=", _lm("llama", "zero3", loss="labels", gradient_checkpointing=True)),
    ("llama zero3 fsdp_units=sublayer", dataclasses.replace(_lm("llama", "zero3"), strategy={"class": HYBRID, "zero_stage": 3,
                                                                                          "fsdp_units": "sublayer"})),
    ("mixtral ep2", _lm("mixtral", "ep")),
    ("qwen2_moe ep2", _lm("qwen2_moe", "ep")),
    ("qwen2_moe ep2 zero3", dataclasses.replace(_lm("qwen2_moe", "ep"), strategy={"class": HYBRID, "expert_parallel_size": 2,
                                                                                  "zero_stage": 3})),
    ("resnet zero2 sync_batchnorm", _vision("resnet", "zero2", sync_batchnorm=True)),
    ("vit zero1", _vision("vit", "zero1")),
]
PADDED = dataclasses.replace(_lm("qwen2", "zero3", loss="labels", padding=True), data=f"{RM}:padded_token_data")


def _reference(spec: FitSpec) -> FitSpec:
    kwargs = {k: v for k, v in spec.trainer_kwargs.items() if k != "sync_batchnorm"}  # one process: global batch already
    return dataclasses.replace(spec, strategy="auto", devices=1, trainer_kwargs=kwargs)


def _mean_over_ranks(results: list[list[dict[str, Any]]], i: int) -> dict[str, Any]:
    losses = [sum(step) / len(step) for step in zip(*(rank[i]["losses"] for rank in results))]
    return dict(results[0][i], losses=losses)


def test_real_models_under_data_and_expert_parallel_presets_match_one_process() -> None:
    specs = [spec for _, spec in TWO_RANK_CASES] + [PADDED]
    results = run_distributed(run_fits, 2, specs, init_backend=None, timeout=900)
    # Padded batches, loss from labels= (a mean over each rank's unpadded tokens): rank r's step k is
    # batch 2k + r of one process accumulating the same per-rank batches over two.
    padded = dataclasses.replace(PADDED, strategy="auto", devices=1, global_batch=4, data=f"{__name__}:rank_interleaved_padded_data",
                                 trainer_kwargs={**PADDED.trainer_kwargs, "accumulate_grad_batches": 2})
    *references, padded_reference = run_fits_in_fresh_process([_reference(spec) for _, spec in TWO_RANK_CASES] + [padded])
    total = {label: sum(p.numel() for p in results[0][i]["params"].values()) for i, (label, _) in enumerate(TWO_RANK_CASES)}
    for i, ((label, _), reference) in enumerate(zip(TWO_RANK_CASES, references)):
        assert max(reference["grad_norms"]) > CLIP, f"{label}: the clipping threshold must actually clip"
        assert_parity(_mean_over_ranks(results, i), reference, label, per_tensor=True, metrics=False)
    layouts = {label: results[0][i]["layout"] for i, (label, _) in enumerate(TWO_RANK_CASES)}
    assert layouts["llama dp"]["model"] == "DistributedDataParallel"
    assert layouts["qwen2 zero1"]["optimizer"] == "ZeroRedundancyOptimizer"
    for label in ("gpt2 zero3 (tied lm_head)", "gpt_neox zero2", "resnet zero2 sync_batchnorm"):
        assert layouts[label]["local_param_numel"] < 0.6 * total[label], label  # really sharded
    index = {label: i for i, (label, _) in enumerate(TWO_RANK_CASES)}
    # sublayer units: each decoder layer's self_attn and mlp are FSDP2 units inside the layer's unit
    layers = results[0][index["llama dp"]]["params"].keys()
    blocks = len({k.split(".layers.")[1].split(".")[0] for k in layers if ".layers." in k})
    split, whole = layouts["llama zero3 fsdp_units=sublayer"]["fsdp_units"], layouts["llama zero3 HF gradient checkpointing labels="]["fsdp_units"]
    assert blocks >= 2 and split == whole + 2 * blocks, (split, whole, blocks)
    for label in ("mixtral ep2", "qwen2_moe ep2"):  # experts split in two, the rest (incl. qwen2_moe's shared expert) whole
        experts = sum(v.numel() for k, v in results[0][index[label]]["params"].items() if ".experts." in k)
        assert experts > 0 and layouts[label]["local_param_numel"] == total[label] - experts // 2, label
    assert layouts["qwen2_moe ep2 zero3"]["local_param_numel"] < 0.6 * total["qwen2_moe ep2 zero3"]  # the rest sharded too
    assert max(padded_reference["grad_norms"]) > CLIP
    per_rank = [rank[-1] for rank in results]
    for r, result in enumerate(per_rank):
        assert_parity(dict(result, losses=result["losses"]), dict(padded_reference, losses=padded_reference["losses"][r::2]),
                      f"qwen2 zero3 padding rank {r}", per_tensor=True, metrics=False)
    # The padding really varies the per-rank token counts (so the mean of rank means is not the global mean).
    from lightning_parallel.testing.real_models import padded_token_data

    mask = padded_token_data().tensors[1][:8]
    assert int(mask[0::2].sum()) != int(mask[1::2].sum())


def test_real_models_under_hsdp_on_four_ranks_match_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # ATen's AVX2 kernels, in freshly spawned ranks and reference (ATen reads the variable when a
    # process runs its first kernel). With its AVX-512 kernels (an AMD EPYC test machine) ResNet's
    # first batch-norm bias read 1.10e-05 from one process, over the 1e-5 bound, on this code and on
    # the code before it; with AVX2 kernels on the same machine, below it. Its gradient is a sum with
    # heavy cancellation, whose rounding follows the kernels' reduction order (batch 2 per rank
    # against 8). Kept at 1e-5 under the kernels the bound was set with; see the 2026-12-05 note.
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    cases = [("resnet hsdp sync_batchnorm", dataclasses.replace(_vision("resnet", "hsdp", sync_batchnorm=True), devices=4)),
             ("mixtral hsdp", dataclasses.replace(_lm("mixtral", "hsdp"), devices=4)),
             # experts over ep2, their gradients averaged over the two ranks holding the same experts (edp2)
             ("qwen2_moe ep2 x edp2", dataclasses.replace(_lm("qwen2_moe", "ep"), devices=4,
                                                          strategy={"class": HYBRID, "expert_parallel_size": 2}))]
    results = run_distributed(run_fits, 4, [spec for _, spec in cases], init_backend=None, timeout=600, fresh_process=True)
    references = run_distributed(run_fits, 1, [_reference(spec) for _, spec in cases], init_backend=None, timeout=600,
                                 fresh_process=True)[0]
    for i, (label, spec) in enumerate(cases):
        assert_parity(_mean_over_ranks(results, i), references[i], label, per_tensor=True, metrics=False)
        total = sum(p.numel() for p in results[0][i]["params"].values())
        if "hsdp" in label:
            assert 0.4 * total < results[0][i]["layout"]["local_param_numel"] < 0.6 * total, label  # 2 x 2: shard in pairs
    experts = sum(v.numel() for k, v in results[0][2]["params"].items() if ".experts." in k)
    assert results[0][2]["layout"]["local_param_numel"] == total - experts // 2
