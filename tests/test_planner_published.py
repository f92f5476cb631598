"""The planner against published training runs: given the model, cluster and batch, its first choice is
the published layout or one it predicts faster that fits, and its predicted per-GPU throughput of the
published layout is within 25% of the published figure. Pure computation on meta-device models.

Sources (figures as published; where this project's search tools could not retrieve the primary
text, that is said per row):

* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", arXiv 2104.04473, Table 1 (weak scaling, A100 80GB, fp16, vocabulary 51,200,
  sequence 2,048, activation recomputation; throughput counted with their FLOP formula
  ``96 B s l h^2 (1 + s / 6h + V / 16 l h)``, which includes the recomputed forward). The 1T row
  (128 layers, hidden 25,600, 160 heads, t=8, p=64, 3,072 GPUs, batch 3,072, 163 TFLOP/s = 52% of
  peak) is confirmed by the abstract (502 petaFLOP/s on 3,072 GPUs, 52% of peak) and by a
  description of the run as a 6 (data) x 8 (tensor) x 64 (pipeline) mesh; the 529.6B and 145.6B
  rows are Table 1's as recalled: the table itself (an image in the Megatron-LM README) could not be
  fetched here. Table 1 has no 175B row; 145.6B (96 heads, hidden 12,288, 80 layers) is its
  GPT-3-class model.
* Llama 3, arXiv 2407.21783, the parallelism table (Table 4): 405B (126 layers, hidden 16,384,
  FFN 53,248, 128 heads, 8 KV heads, vocabulary 128,256), 16,384 H100-80GB, TP8 CP1 PP16 DP128,
  sequence 8,192, 16M tokens per batch, 400 TFLOP/s per GPU (BF16 MFU 41%); and its long-context row,
  16,384 H100, TP8 CP16 PP16 DP8, sequence 131,072, 16M tokens per batch, 380 TFLOP/s per GPU.
  Retrieved here via a page quoting Meta's SC'24 slide with the same rows
  (glennklockwood.com/garden/llama-3.1); the paper's own table text was not retrievable.
* torchtitan docs/performance.md (pytorch/torchtitan): Llama 3 8B and 70B with FSDP on 64 A100
  80GB, local batch 1, sequence 8,192 (torchtitan's Llama 3 default), 8B selective-layer
  activation checkpointing 2,904 tokens/s per GPU, 70B full checkpointing 331 tokens/s per GPU;
  Llama 3.1 405B with FSDP 16 x TP 8 on 128 H100 (94 GB), local batch 2 (global 32), full
  checkpointing, 109 tokens/s per GPU (29.0% MFU, no Float8). The 8B row (torchtitan's selective
  per-layer checkpointing) is compared with full checkpointing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

from lightning_parallel.models import GPT
from lightning_parallel.planner.hardware import GiB
from lightning_parallel.planner.search import SearchSpace, plan_layouts
from lightning_parallel.testing.real_models import build_hf_model


def _gpt(layers: int, hidden: int, heads: int) -> GPT:
    with torch.device("meta"):
        return GPT(vocab_size=51200, block_size=2048, n_layer=layers, n_head=heads, n_embd=hidden)


def _llama(layers: int, hidden: int, ffn: int, heads: int) -> torch.nn.Module:
    with torch.device("meta"):
        return build_hf_model("llama", layers, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                              num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)


def _megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int = 51200) -> float:
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


@dataclass(frozen=True)
class Run:
    build: Callable[[], torch.nn.Module]
    gpus: int
    batch: int  # sequences per step
    seq: int
    hardware: str
    dtype: str
    degrees: tuple[int, int, int]  # tp, pp, dp as published
    options: dict[str, Any]  # what the publication fixes beyond the degrees
    figure: float  # TFLOP/s per GPU (Megatron: their formula; Llama 3: model FLOPs) or tokens/s per GPU
    unit: str
    memory_gib: float | None = None
    partial_recompute: bool = False  # the engine also checkpoints only some blocks per stage (Megatron-LM)


RUNS = {
    "megatron-145.6B": Run(lambda: _gpt(80, 12288, 96), 1536, 2304, 2048, "a100-80gb", "fp16", (8, 8, 24),
                           {"activation_checkpointing": True, "sequence_parallel": False, "zero_stage": 0}, 148.0, "megatron"),
    "megatron-529.6B": Run(lambda: _gpt(105, 20480, 128), 2520, 2520, 2048, "a100-80gb", "fp16", (8, 35, 9),
                           {"activation_checkpointing": True, "sequence_parallel": False, "zero_stage": 0}, 163.0, "megatron"),
    "megatron-1T": Run(lambda: _gpt(128, 25600, 160), 3072, 3072, 2048, "a100-80gb", "fp16", (8, 64, 6),
                       {"activation_checkpointing": True, "sequence_parallel": False, "zero_stage": 0}, 163.0, "megatron"),
    "llama3-405B-16k": Run(lambda: _llama(126, 16384, 53248, 128), 16384, 2048, 8192, "h100-80gb", "bf16", (8, 16, 128),
                           {}, 400.0, "tflops", partial_recompute=True),
    "torchtitan-8B": Run(lambda: _llama(32, 4096, 14336, 32), 64, 64, 8192, "a100-80gb", "bf16", (1, 1, 64),
                         {"activation_checkpointing": True, "zero_stage": 3}, 2904.0, "tokens"),
    "torchtitan-70B": Run(lambda: _llama(80, 8192, 28672, 64), 64, 64, 8192, "a100-80gb", "bf16", (1, 1, 64),
                          {"activation_checkpointing": True, "zero_stage": 3}, 331.0, "tokens"),
    "torchtitan-405B": Run(lambda: _llama(126, 16384, 53248, 128), 128, 32, 8192, "h100-80gb", "bf16", (8, 1, 16),
                           {"activation_checkpointing": True, "zero_stage": 3, "sequence_parallel": True}, 109.0, "tokens", 94.0),
}
# Llama 3 405B on 16K H100: without checkpointing TP8 x PP16 at sequence 8,192 does not fit 80 GB
# (the first rank holds 16 + 15/4 microbatches of its blocks, ~78 GiB) and full checkpointing costs
# 4/3 of the compute: predicted 0.70 x the published 400 TFLOP/s. Korthikanti et al. 2022's selective
# recomputation (arXiv 2205.05198, section 5) recomputes only the attention core, whose s^2 scores
# the H100 profile's fused attention never stores, so it saves nothing here. What does fit is block
# recomputation as Megatron-LM offers it (--recompute-method block --recompute-num-layers k: the
# first k blocks of each stage): measured here, 1 block per stage, predicted 0.88. The paper does
# not report its recomputation setting; the search is given the option, not the value.
KNOWN_MISSES: dict[str, str] = {}


def _throughput(run: Run, model: torch.nn.Module, pred: Any) -> float:
    if run.unit == "megatron":
        return _megatron_flops(run.batch, run.seq, model.n_layer, model.n_embd) / pred.step_time / run.gpus / 1e12
    if run.unit == "tflops":
        return pred.tflops_per_device
    return pred.tokens_per_second_per_device


@pytest.mark.parametrize("name", list(RUNS))
def test_published_layout_fits_and_throughput_within_25_percent(name: str) -> None:
    if name in KNOWN_MISSES:
        pytest.xfail(KNOWN_MISSES[name])  # measured in test_known_misses_still_miss
    run = RUNS[name]
    model = run.build()
    memory = int(run.memory_gib * GiB) if run.memory_gib else None
    # CPU offload is left out of the search: it never wins at these sizes and doubles the search time.
    result = plan_layouts(model, run.gpus, global_batch=run.batch, seq_len=run.seq, hardware=run.hardware,
                          dtype=run.dtype, device_memory=memory,
                          space=SearchSpace(cpu_offload=(False,), partial_recompute=run.partial_recompute))
    tp, pp, dp = run.degrees
    pool = result.ranked + [r.prediction for r in result.rejected if r.prediction is not None]
    published = [p for p in pool if (p.layout.tp, p.layout.pp, p.layout.dp) == (tp, pp, dp) and not p.layout.cpu_offload
                 and all(getattr(p.layout, k) == v for k, v in run.options.items())]
    assert published, f"{name}: the published layout tp{tp} x pp{pp} x dp{dp} was not enumerated"
    fitting = [p for p in published if p.fits]
    assert fitting, f"{name}: the planner says the published layout does not fit: {published[0].reason}"
    best_published = min(fitting, key=lambda p: p.step_time)
    chosen = result.chosen
    assert chosen.fits and chosen.step_time <= best_published.step_time
    assert (chosen.layout.tp, chosen.layout.pp, chosen.layout.dp) == run.degrees or chosen.step_time < best_published.step_time
    predicted = _throughput(run, model, best_published)
    assert abs(predicted / run.figure - 1) <= 0.25, (
        f"{name}: predicted {predicted:.1f} vs published {run.figure} ({best_published.layout.describe()})")


def test_llama3_405b_without_block_recomputation_misses() -> None:
    """Checkpointing all blocks or none (this project's strategy) leaves the 405B row at ~0.70: the
    gain above comes from modelling block recomputation, not from retuned constants."""
    run = RUNS["llama3-405B-16k"]
    model = run.build()
    tp, pp, dp = run.degrees
    space = SearchSpace(tensor_parallel_size=tp, pipeline_parallel_size=pp, cpu_offload=(False,))
    result = plan_layouts(model, run.gpus, global_batch=run.batch, seq_len=run.seq, hardware=run.hardware,
                          dtype=run.dtype, space=space)
    ratio = _throughput(run, model, result.chosen) / run.figure
    assert result.chosen.layout.activation_checkpointing and 0.5 < ratio < 0.75, ratio


# Llama 3 405B on 16,384 H100s, Table 4 of "The Llama 3 Herd of Models" (Grattafiori et al. 2024, arXiv
# 2407.21783), 16M tokens per step in both rows: (tp, cp, pp, dp) and TFLOP/s per GPU as published.
LLAMA3_TABLE4 = {8192: ((8, 1, 16, 128), 400.0), 131072: ((8, 16, 16, 8), 380.0)}
LLAMA3_TOKENS_PER_STEP = 16 * 2**20


@functools.cache
def _llama3_plan(seq: int) -> Any:
    run = RUNS["llama3-405B-16k"]  # the same model, cluster and search options as the 8,192-token row above
    return plan_layouts(run.build(), run.gpus, global_batch=LLAMA3_TOKENS_PER_STEP // seq, seq_len=seq,
                        hardware=run.hardware, dtype=run.dtype,
                        space=SearchSpace(cpu_offload=(False,), partial_recompute=run.partial_recompute))


@pytest.mark.parametrize("seq", sorted(LLAMA3_TABLE4))
def test_llama3_405b_context_parallel_only_at_long_context(seq: int) -> None:
    """The layout class of Table 4: context parallelism at 131,072 tokens, none at 8,192.

    Nothing states the answer: the search adds cp > 1 only where no layout without it is left, and
    at 131,072 tokens (128 sequences per step) every such layout is over 80 GB (the published 8K
    degrees tp8 x pp16 x dp128 by 100 GiB even with every block recomputed: one sequence's
    activations and logits per microbatch), while at 8,192 tokens layouts without cp fit. At 131K the
    published layout fits, the choice is it or one predicted faster, and its predicted throughput is
    within 25% of the published 380 TFLOP/s, as for the rows above.
    """
    result = _llama3_plan(seq)
    (tp, cp, pp, dp), figure = LLAMA3_TABLE4[seq]
    chosen = result.chosen
    if cp == 1:
        assert chosen.layout.cp == 1 and not result.notes
        assert all(r.prediction is None or r.prediction.layout.cp == 1 for r in result.rejected)
        return
    assert chosen.layout.cp > 1, chosen.layout.describe()
    without = [r.prediction for r in result.rejected if r.prediction is not None and r.prediction.layout.cp == 1]
    assert without and all(not p.fits and p.peak_bytes > 80 * GiB for p in without)
    short_tp, _, short_pp, short_dp = LLAMA3_TABLE4[8192][0]  # the 8K layout, tried at 131K: over memory
    assert any((p.layout.tp, p.layout.pp, p.layout.dp) == (short_tp, short_pp, short_dp) for p in without)
    published = [p for p in result.ranked if (p.layout.tp, p.layout.cp, p.layout.pp, p.layout.dp) == (tp, cp, pp, dp)]
    assert published, "the published layout tp8 x cp16 x pp16 x dp8 does not fit"
    best = min(published, key=lambda p: p.step_time)
    assert chosen.step_time <= best.step_time
    assert abs(best.tflops_per_device / figure - 1) <= 0.25, (best.layout.describe(), best.tflops_per_device)
