"""Context parallelism in the layout planner (planner/context_cost.py, cost.py, search.py): what a ``cp``
degree saves and costs, when the search considers it, and where the dry run and ``3d`` show it. No processes.

The expected numbers are written out here from the formulas docs/planner.md states (not through the
planner's helpers), so a drifted formula fails. The published long-context layout (Llama 3 405B at
131,072 tokens): tests/test_planner_published.py.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from lightning_parallel.models import GPT
from lightning_parallel.planner.cost import Layout, Workload, predict
from lightning_parallel.planner.hardware import GiB, get_profile
from lightning_parallel.planner.model import model_facts
from lightning_parallel.planner.search import SearchSpace, plan_layouts
from lightning_parallel.testing.real_models import HFCausalLM, build_hf_model

H, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 8, 2, 4, 32000  # grouped-query attention: 2 key/value heads of 8


def _llama() -> torch.nn.Module:
    with torch.device("meta"):
        return build_hf_model("llama", LAYERS, hidden_size=H, intermediate_size=512, num_attention_heads=HEADS,
                              num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=65536)


@pytest.fixture(scope="module")
def facts() -> Any:
    return model_facts(_llama())


def _predict(facts: Any, layout: Layout, seq: int = 4096, batch: int = 4) -> Any:
    shares = facts.shares(layout.tp, layout.pp, 1, "single")
    return predict(facts, layout, shares, Workload(global_batch=batch, seq_len=seq, dtype="bf16"), get_profile("h100"))


def test_cp_holds_one_cp_th_of_each_sequence_plus_the_kv_exchange(facts: Any) -> None:
    """Activations and logits fall by cp; the all-gather form keeps the gathered keys and values of every
    block (``(cp - 1) T kv b`` more each) and holds their full-length gradient while a block runs backward;
    the ring keeps its fp32 output and log-sum-exp and has two blocks with fp32 gradients in flight."""
    seq, batch, b = 4096, 4, 2  # bf16
    one = _predict(facts, Layout(1, 2, 1, 1), seq, batch)
    tokens = batch // 2 * seq  # a rank's tokens at cp = 1 (dp2: two sequences)
    kv = 2 * H * KV_HEADS / HEADS  # key and value elements per token
    for cp in (2, 4):
        local = tokens / cp
        gather = _predict(facts, Layout(1, 2, 1, 1, cp=cp, cp_attention="allgather"), seq, batch).memory
        assert gather["activations"] == pytest.approx(one.memory["activations"] / cp + LAYERS * (cp - 1) * local * kv * b)
        assert gather["logits"] == pytest.approx(one.memory["logits"] / cp)
        assert gather["context_kv"] == pytest.approx(tokens * kv * b)  # the whole sequence's K/V gradient: cp x local
        ring = _predict(facts, Layout(1, 2, 1, 1, cp=cp, cp_attention="ring"), seq, batch).memory
        assert ring["activations"] == pytest.approx(one.memory["activations"] / cp + LAYERS * local * (H + HEADS) * 4)
        assert ring["context_kv"] == pytest.approx(2 * local * kv * (b + 4))
    assert one.memory["context_kv"] == 0 and one.time["cp_comm"] == 0


def test_kv_traffic_per_block_and_microbatch(facts: Any) -> None:
    """All-gather: ``(cp-1)/cp`` of the layer's K/V forward and the reduce-scatter of their gradients in
    backward, exposed; ring: ``cp - 1`` neighbour steps, each hidden under the block's attention (forward)
    or its gradients (backward), the fp32 gradients exposed."""
    hw = get_profile("h100")
    bw, lat = hw.intra_bandwidth, hw.intra_latency  # cp x tp = 4 ranks inside a node
    seq, batch, cp, b = 4096, 4, 4, 2
    local = batch // 2 * seq / cp
    kv_bytes = local * 2 * H * KV_HEADS / HEADS * b  # one rank's block
    collective = (cp - 1) / cp * cp * kv_bytes / bw + math.ceil(math.log2(cp)) * lat
    gather = _predict(facts, Layout(1, 2, 1, 1, cp=cp), seq, batch)
    assert gather.time["cp_comm"] == pytest.approx(LAYERS * 2 * collective)
    ckpt = _predict(facts, Layout(1, 2, 1, 1, activation_checkpointing=True, cp=cp), seq, batch)
    assert ckpt.time["cp_comm"] == pytest.approx(LAYERS * 3 * collective)  # the recomputed forward gathers again
    ring = _predict(facts, Layout(1, 2, 1, 1, cp=cp, cp_attention="ring"), seq, batch)
    send, grad = kv_bytes / bw + lat, kv_bytes * 2 / bw + lat  # the block, and its fp32 gradient
    block = 4 * local * local * H / hw.flops("bf16")  # local queries over one key block
    # backward: the next block travels during this one's gradients (twice the forward's FLOPs), the fp32 gradient after
    per_block = (cp - 1) * max(0.0, send - block) + (cp - 1) * (max(0.0, send - 2 * block) + grad) + grad
    assert ring.time["cp_comm"] == pytest.approx(LAYERS * per_block)
    # The attention FLOPs are the local queries over all keys: dp2 x cp2 computes what dp4 does.
    assert _predict(facts, Layout(1, 2, 1, 1, cp=2), seq, batch).time["compute"] == pytest.approx(
        _predict(facts, Layout(1, 4, 1, 1), seq, batch).time["compute"])


def test_gradients_reduce_and_zero_shards_over_dp_x_cp(facts: Any) -> None:
    """Every cp rank holds different gradients of the same parameters: dp2 x cp2 reduces as dp4 does, and
    ZeRO-3 keeps 1/4 of the model state on each."""
    for zero in (0, 1, 3):
        if zero < 2:  # DDP / ZeRO-1: data-parallel ranks replicate
            mixed, plain = Layout(2, 1, 1, 1, zero_stage=zero, cp=2), Layout(4, 1, 1, 1, zero_stage=zero)
        else:  # FSDP2: they shard
            mixed, plain = Layout(1, 2, 1, 1, zero_stage=zero, cp=2), Layout(1, 4, 1, 1, zero_stage=zero)
        a, b = _predict(facts, mixed), _predict(facts, plain)
        assert a.time["dp_comm_total"] == pytest.approx(b.time["dp_comm_total"]), zero
        assert a.memory["model_state"] == pytest.approx(b.memory["model_state"]), zero


def test_layouts_name_their_cp_degree_and_form() -> None:
    layout = Layout(1, 8, 8, 16, cp=16, zero_stage=1)
    assert layout.world == 8 * 16 * 8 * 16 and layout.grad_ranks == 128
    assert layout.describe().startswith("dp8 x cp16 x tp8 x pp16 zero1 allgather")
    assert layout.strategy_kwargs()["context_parallel_size"] == 16
    assert layout.strategy_kwargs()["context_parallel_attention"] == "allgather"
    assert "context_parallel_size" not in Layout(1, 8, 1, 1).strategy_kwargs() and "cp" not in Layout(1, 8, 1, 1).describe()


def test_search_adds_cp_only_where_nothing_fits_without_it() -> None:
    """Short sequences: the layouts (and the choice) are those without cp; long ones: every layout
    without cp is over the device's memory (the logits of one 65,536-token sequence alone are 20 GiB),
    so cp layouts are searched and one is chosen. ``"always"`` ranks both; an int fixes the degree."""
    model = _llama()
    kw: dict[str, Any] = {"global_batch": 8, "hardware": "h100", "device_memory": 16 * GiB, "dtype": "bf16"}
    short = plan_layouts(model, 8, seq_len=2048, **kw)
    assert short.chosen.layout.cp == 1 and not short.notes
    assert all(p.layout.cp == 1 for p in short.ranked + [r.prediction for r in short.rejected if r.prediction])
    long = plan_layouts(model, 8, seq_len=65536, **kw)
    assert long.chosen.layout.cp > 1 and "no layout without context parallelism fits" in long.notes[0]
    without = [r for r in long.rejected if r.prediction is not None and r.prediction.layout.cp == 1]
    assert without and all(r.reason.startswith("does not fit") for r in without)
    both = plan_layouts(model, 8, seq_len=2048, space=SearchSpace(context_parallel="always"), **kw)
    assert {p.layout.cp for p in both.ranked} >= {1, 2} and both.evaluated > short.evaluated
    fixed = plan_layouts(model, 8, seq_len=2048, space=SearchSpace(context_parallel_size=2), **kw)
    assert {p.layout.cp for p in fixed.ranked} == {2}
    odd = plan_layouts(model, 8, seq_len=2040, space=SearchSpace(context_parallel_size=8, tensor_parallel_size=1), **kw)
    assert any("2 x cp = 16 equal chunks" in r.reason for r in odd.rejected)
    with pytest.raises(ValueError, match="context_parallel"):
        plan_layouts(model, 8, seq_len=2048, space=SearchSpace(context_parallel="sometimes"), **kw)


def test_dry_run_search_lists_cp(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_parallel.plan import main

    args = ["--search", "--world-size", "4", "--hardware", "h100", "--top", "3", "model=gpt"]
    assert main([*args, "--context-parallel", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if " x cp2 x " in line]
    assert rows and "compute / tp / cp / bubble / dp" in out
    assert main([*args, "--context-parallel-always", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "cp" in data["chosen"]["layout"] and "cp_comm" in data["chosen"]["time_s"]


def test_3d_prices_the_users_cp_and_keeps_the_strategys_refusals() -> None:
    """'3d' with context_parallel_size=2 on 8 processes: degrees for the 4 ranks per cp rank, priced on all
    8 with cp2 fixed. Pipelines compose with cp (stages run it as a traced op), so layouts with pp are
    candidates."""
    from lightning_parallel.strategies.hybrid import HybridParallelStrategy
    from lightning_parallel.strategies.preflight import preflight

    with torch.device("meta"):  # context parallelism routes a transformers model (its positions, its attention)
        model = HFCausalLM("llama", n_layer=4, config={"max_position_embeddings": 64})
    strategy = HybridParallelStrategy(data_parallel_size="auto", tensor_parallel_size="auto", pipeline_parallel_size="auto",
                                      context_parallel_size=2)
    result = preflight(strategy, model, 8)
    assert result.dims.cp == 2 and result.dims.tp * result.dims.pp > 1
    plan = result.choice.plan  # type: ignore[union-attr]
    assert result.choice.cp == 2 and plan.world_size == 8  # type: ignore[union-attr]
    assert {p.layout.cp for p in plan.ranked} == {2}
    assert any(p.layout.pp > 1 for p in plan.ranked)  # pp x cp is a candidate
    assert not any("does not compose" in r.reason for r in plan.rejected)


def test_3d_with_cp_auto_takes_the_planners_cp(monkeypatch: pytest.MonkeyPatch) -> None:
    """'3d' with context_parallel_size="auto": the planner searches cp (where nothing without it fits) on the
    whole world and the strategy lays out the degrees it chose, cp included."""
    import lightning_parallel.strategies.layout as layout
    from lightning_parallel.planner.auto_degrees import DegreeChoice
    from lightning_parallel.strategies.hybrid import HybridParallelStrategy

    asked: dict[str, Any] = {}

    def planner(module: Any, world_size: int, **kwargs: Any) -> DegreeChoice:
        asked.update(world_size=world_size, cp=kwargs["context_parallel_size"])
        return DegreeChoice(dp=1, tp=2, pp=1, tried=(), cp=2)

    monkeypatch.setattr(layout, "choose_3d_degrees", planner)
    strategy = HybridParallelStrategy(data_parallel_size="auto", tensor_parallel_size="auto", pipeline_parallel_size="auto",
                                      context_parallel_size="auto")
    with torch.device("meta"):
        strategy.connect(GPT(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=32))
    dims = strategy.resolve_dims(4)
    assert asked == {"world_size": 4, "cp": None}  # searched, on all 4 ranks
    assert (dims.dp, dims.cp, dims.tp, dims.pp) == (1, 2, 2, 1)
