"""Tensor parallelism sends the Megatron minimum: counted with ``CommDebugMode`` (issue 26, item 4).

Parity cannot see communication: a region whose q, k and v projections each reduced their input
gradient (three all-reduces where one suffices) trained to the same numbers. So this counts the
DTensor collectives of one forward + backward of the package's GPT and Llama (2 blocks, tp2,
pure torch, gloo) and holds them to the minimum, per phase:

* without sequence parallelism, per block 2 all-reduces forward (each region's output) and 2
  backward (each region's input gradient: q/k/v, or gate/up, summed before one reduction), plus
  1 forward all-reduce for the vocabulary-parallel embedding and, for the gathered LM head,
  1 all-gather forward and 1 all-reduce backward;
* with sequence parallelism the same reductions as reduce-scatters and all-gathers (a region
  gathers the sequence on entry and reduce-scatters its output; backward the reverse), plus the
  all-reduce of every sequence-parallel norm parameter's partial gradient.

The same minimum holds inside traced pipeline stages (tp2 x pp2, through the Trainer: HF Llama
and the package's GPT), where the graph has no module hooks and the passes of
``parallel/pipeline/tensor.py`` place the reductions: each row-parallel output reduced where it is
computed, each group of column-parallel matmuls' input gradient reduced once where their input is
made. ``benchmarks/bench_tp_comms.py`` prints the same counts for every coverage model.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from lightning_parallel.testing import run_distributed

BLOCKS = 2


def _build(kind: str) -> torch.nn.Module:
    from lightning_parallel.models.gpt import GPT
    from lightning_parallel.models.llama import Llama

    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(vocab_size=64, block_size=16, n_layer=BLOCKS, n_head=4, n_embd=32)
    return Llama(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=BLOCKS, num_attention_heads=8,
                 num_key_value_heads=4)


def _count(cases: list[tuple[str, bool]]) -> list[dict[str, int]]:
    """Per case: DTensor collective counts of one forward + backward, keyed ``phase/op``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_parallel.parallel.tensor.apply import apply_tensor_parallel
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan

    class PhaseCounts(CommDebugMode):
        """``CommDebugMode`` with each functional collective's phase (inside an autograd graph task: backward)."""

        def __init__(self) -> None:
            super().__init__()
            self.phases: Counter[str] = Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            before = sum(self.comm_counts.values())
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is not NotImplemented and sum(self.comm_counts.values()) != before:
                phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
                self.phases[f"{phase}/{func._overloadpacket.__name__}"] += 1
            return out

    mesh = init_device_mesh("cpu", (2,))
    out = []
    for kind, sequence_parallel in cases:
        model = _build(kind)
        apply_tensor_parallel(model, mesh, resolve_tp_plan(model, 2), sequence_parallel=sequence_parallel)
        torch.manual_seed(1)
        tokens = torch.randint(0, 64, (4, 9))
        mode = PhaseCounts()
        with mode:
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)).backward()
        out.append(dict(mode.phases))
    return out


def test_region_input_gradient_reduced_once() -> None:
    cases = [("gpt", False), ("llama", False), ("gpt", True)]
    gpt, llama, gpt_sp = run_distributed(_count, 2, cases, timeout=300)[0]
    regions = 2 * BLOCKS
    minimum = {"fwd/all_reduce": regions + 1, "fwd/all_gather_into_tensor": 1, "bwd/all_reduce": regions + 1}
    assert gpt == minimum, gpt  # separate q, k, v (and one fc): were 3 + 1 all-reduces per block backward
    assert llama == minimum, llama  # q, k, v and gate, up: were 3 + 2
    norm_params = 2 * (2 * BLOCKS + 1)  # ln_1, ln_2 per block and ln_f; weight and bias each
    assert gpt_sp == {
        # regions gather the sequence on entry; the LM head gathers it, then gathers the logits
        "fwd/all_gather_into_tensor": regions + 2,
        "fwd/reduce_scatter_tensor": regions + 1,  # region outputs, the embedding's output
        "bwd/reduce_scatter_tensor": regions + 1,  # region inputs, the LM head's input
        # region outputs' gradients; the token embedding's reduce-scatter and the position embedding's
        # slice each gather the gradient of the stream they started
        "bwd/all_gather_into_tensor": regions + 2,
        "bwd/all_reduce": norm_params,  # sequence-parallel norms: partial parameter gradients
    }, gpt_sp


def _stage_counts(specs: list[Any]) -> list[dict[str, Any]]:
    from lightning_parallel.testing.comm_counts import RESULTS
    from lightning_parallel.testing.parity import run_fit

    out = []
    for spec in specs:
        RESULTS.clear()
        run_fit(spec)
        out.append(RESULTS[-1])
    return out


def test_traced_stages_reduce_each_region_once() -> None:
    from lightning_parallel.coverage import MODELS
    from lightning_parallel.testing.parity import FitSpec

    gpt = FitSpec(model="lightning_parallel.models:GPT", model_kwargs={"vocab_size": 64, "block_size": 16, "n_layer": 4, "n_head": 4, "n_embd": 32},
                  data="lightning_parallel.testing.parity:token_data", global_batch=8)
    layout = {"class": "lightning_parallel:HybridParallelStrategy", "tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    specs = [dataclasses.replace(base, strategy=layout, devices=4, max_steps=2, trainer_kwargs={},
                                 callbacks=[("lightning_parallel.testing.comm_counts:CommCounter", {"model": name, "layout": "tp2 x pp2"})])
             for name, base in (("llama", MODELS["llama"]), ("gpt", gpt), ("t5", MODELS["t5"]))]
    for rank, (llama, gpt_counts, t5) in enumerate(run_distributed(_stage_counts, 4, specs, init_backend=None, timeout=400)):
        # T5's position bias, split with the heads, crosses the cut as each tp rank's shard from the second
        # step on (parallel/pipeline/shard_crossing.py): no gather of it forward, none of its gradient backward.
        counts, minimum = t5["counts"], t5["minimum"]
        dtensor = {k: v / minimum["microbatches"] for k, v in counts.items()
                   if k.split("/")[:2] in (["fwd", "dtensor"], ["bwd", "dtensor"]) and not k.endswith("/bytes") and v}
        expected = {f"{p}/dtensor/{k}": minimum.get(f"{p}_{k}", 0) for p in ("fwd", "bwd") for k in ("AR", "AG", "RS")}
        expected = {k: v for k, v in expected.items() if v}
        assert dtensor == expected, f"t5 rank {rank} ({minimum['stage']} stage): {dtensor} against {minimum}"
        for name, result in (("llama", llama), ("gpt", gpt_counts)):
            counts, minimum = result["counts"], result["minimum"]
            per_forward = {(phase, kind): counts.get(f"{phase}/dtensor/{kind}", 0) / minimum["microbatches"]
                           for phase, kind in (("fwd", "AR"), ("fwd", "AG"), ("bwd", "AR"))}
            label = f"{name} rank {rank} ({minimum['stage']} stage): {per_forward} against {minimum}"
            assert minimum["regions"] == 4, label  # 2 blocks per stage: attention and MLP each
            assert per_forward["fwd", "AR"] == minimum["fwd_AR"] and per_forward["fwd", "AG"] == minimum["fwd_AG"], label
            assert per_forward["bwd", "AR"] == minimum["bwd_AR"], label
            if minimum["stage"] == "last":
                # One gradient sent back per microbatch: the hidden states. Llama's cut also carries the rotary
                # cos and sin, which carry none (parallel/pipeline/cut_grads.py); torch's default sent 3 and
                # reduced each use of cos and sin under tp (13 backward all-reduces per microbatch, minimum 5).
                assert counts.get("step/c10d/send", 0) / minimum["microbatches"] == 1, f"{label}: {counts}"


def test_packed_projections_and_experts_reduce_once() -> None:
    """Hugging Face's own classes through the Trainer, at the minimum with no other DTensor collective:
    GPT-2's packed ``c_attn`` (weight and bias split per part: no gather of the bias gradient) under
    tp2 and tp2 x pp2 (its tied embedding and head exchange their gradient shard, not the gathered
    whole), Mixtral's split experts under tp2 (the hidden states' and routing weights' gradients
    summed in one all-reduce, not two), Qwen2-MoE's beside its shared expert (a region of its own,
    as in Megatron-Core). Regions that read the same tensor reduce its gradient once
    (``parallel/tensor/region_inputs.py``): BART's decoder layers' cross-attentions the encoder
    output's (once for all layers; it was once per key and value projection, then once per layer),
    GPT-J's parallel attention and MLP their block's one normalised input. The minimum counts one
    backward reduction per distinct tensor the column-parallel layers read. Bloom's ALiBi scores
    (``baddbmm`` on heads merged into the batch) run on each rank's heads, eager and traced, and
    Bloom's and MPT's eager attention weights are not gathered when the model does not return them
    (each cost one all-gather per layer, three for Bloom's ``baddbmm``). GPT-OSS: experts with biases,
    transposed, gate and up interleaved, split over tp (its down-projection bias counted on one rank);
    its attention sinks split with the heads (``head_parameters``; whole, the ``cat`` with the split
    scores gathered them); the probabilities it returns, a slice of the softmax, not gathered. Phi-3's
    grouped-query ``qkv_proj`` (q, k and v of unequal sizes) split per part in rank order
    (``parallel/tensor/rank_order.py``): its output and gradient were gathered once per layer each way."""
    from lightning_parallel.coverage import MODELS

    def spec(name: str, layout: str) -> Any:
        tp_pp = {"tp2": (2, 1), "tp2 x pp2": (2, 2)}[layout]
        strategy = {"class": "lightning_parallel:HybridParallelStrategy", "tensor_parallel_size": tp_pp[0], "pipeline_parallel_size": tp_pp[1]}
        return dataclasses.replace(MODELS[name], strategy=strategy, devices=tp_pp[0] * tp_pp[1], max_steps=2, trainer_kwargs={},
                                   callbacks=[("lightning_parallel.testing.comm_counts:CommCounter", {"model": name, "layout": layout})])

    cases = [("gpt2", "tp2"), ("mixtral", "tp2"), ("qwen2_moe", "tp2"), ("bart", "tp2"), ("gptj", "tp2"), ("bloom", "tp2"),
             ("mpt", "tp2"), ("gpt_oss", "tp2"), ("phi3", "tp2")]
    staged = [("gpt2", "tp2 x pp2"), ("bloom", "tp2 x pp2"), ("gpt_oss", "tp2 x pp2"), ("phi3", "tp2 x pp2")]
    results = [run_distributed(_stage_counts, 2, [spec(n, l) for n, l in cases], init_backend=None, timeout=400),
               run_distributed(_stage_counts, 4, [spec(n, l) for n, l in staged], init_backend=None, timeout=400)]
    for rank_results, names in zip(results, (cases, staged), strict=True):
        for rank, per_case in enumerate(rank_results):
            for (name, layout), result in zip(names, per_case, strict=True):
                counts, minimum = result["counts"], result["minimum"]
                dtensor = {k: v / minimum["microbatches"] for k, v in counts.items() if k.split("/")[:2] in (["fwd", "dtensor"], ["bwd", "dtensor"]) and not k.endswith("/bytes")}
                label = f"{name} {layout} rank {rank}: {dtensor} against {minimum}"
                assert minimum["regions"] > 0, label
                expected = {"fwd/dtensor/AR": minimum["fwd_AR"], "fwd/dtensor/AG": minimum["fwd_AG"],
                            "bwd/dtensor/AR": minimum["bwd_AR"]}
                assert {k: v for k, v in dtensor.items() if v} == {k: v for k, v in expected.items() if v}, label


def test_sequence_parallel_hf_models_at_the_minimum() -> None:
    """Sequence parallelism over Hugging Face block stacks (``parallel/tensor/sequence_stacks.py``), through
    the Trainer: per region one all-gather of the sequence on entry (one per distinct tensor read: GPT-J's
    parallel attention and MLP share it) and one reduce-scatter of its output, the reverse in backward;
    each stack's ends; one all-reduce per replicated parameter on the split stream (norms) and nothing
    else. The families cover what made more: BERT's and BART's residual add and norm inside the region
    (the gathered input added to the split output; BART's encoder output read by every cross-attention),
    their MLP region entered through its first linear, GPT-BigCode's multi-query attention kept whole;
    OPT's tokens flattened to ``(batch x sequence, width)`` around its MLP (``parallel/tensor/flat_stream.py``)."""
    from lightning_parallel.coverage import MODELS

    strategy = {"class": "lightning_parallel:HybridParallelStrategy", "tensor_parallel_size": 2, "sequence_parallel": True}
    names = ["llama", "bert", "bart", "gptj", "gpt_bigcode", "bloom", "opt", "phi3"]
    specs = [dataclasses.replace(MODELS[name], strategy=strategy, devices=2, max_steps=2, trainer_kwargs={},
                                 callbacks=[("lightning_parallel.testing.comm_counts:CommCounter", {"model": name, "layout": "tp2 sp"})])
             for name in names]
    for rank, per_case in enumerate(run_distributed(_stage_counts, 2, specs, init_backend=None, timeout=400)):
        for name, result in zip(names, per_case, strict=True):
            counts, minimum = result["counts"], result["minimum"]
            dtensor = {k: v for k, v in counts.items() if k.split("/")[:2] in (["fwd", "dtensor"], ["bwd", "dtensor"]) and not k.endswith("/bytes")}
            expected = {f"{phase}/dtensor/{kind}": minimum[f"{phase}_{kind}"] for phase in ("fwd", "bwd") for kind in ("AR", "AG", "RS")}
            label = f"{name} rank {rank}: {dtensor} against {minimum}"
            assert minimum["regions"] > 0 and minimum["fwd_RS"] == minimum["regions"], label
            assert {k: v for k, v in dtensor.items() if v} == {k: v for k, v in expected.items() if v}, label


def test_t5_position_bias_is_split_with_the_heads() -> None:
    """T5's relative position bias, made in each stack's first layer and read by every layer as (part of)
    its SDPA mask: its embedding (one column per head) is split with the heads (``embedding_colwise``,
    ``parallel/tensor/infer.py``) and the bias passes between the layers' regions split, so nothing
    gathers it or its gradient (before: once per layer, then once per stack): T5 at the minimum."""
    from lightning_parallel.coverage import MODELS

    strategy = {"class": "lightning_parallel:HybridParallelStrategy", "tensor_parallel_size": 2}
    spec = dataclasses.replace(MODELS["t5"], strategy=strategy, devices=2, max_steps=2, trainer_kwargs={},
                               callbacks=[("lightning_parallel.testing.comm_counts:CommCounter", {"model": "t5", "layout": "tp2"})])
    for rank, (result,) in enumerate(run_distributed(_stage_counts, 2, [spec], init_backend=None, timeout=400)):
        counts, minimum = result["counts"], result["minimum"]
        dtensor = {k: v for k, v in counts.items() if k.split("/")[:2] in (["fwd", "dtensor"], ["bwd", "dtensor"]) and not k.endswith("/bytes")}
        expected = {"fwd/dtensor/AR": minimum["fwd_AR"], "bwd/dtensor/AR": minimum["bwd_AR"]}
        assert {k: v for k, v in dtensor.items() if v} == expected, f"rank {rank}: {dtensor} against {minimum}"
