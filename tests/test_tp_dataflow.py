"""Tensor-parallel plans read from the dataflow (issue 26 item 1), on families nobody listed.

The plan's pairs come from one recorded forward (``parallel/tensor/dataflow*.py``), not from
module names: the checks below run transformers classes the name-based planner was never written
against (BERT's attention output in a sibling module, T5's relative position bias, ALiBi, a fused
projection interleaved per key/value group, MLA), a model whose names lie, and the refusals
(multi-query's single key/value head, a state-space mixer). The multi-process check trains every
further family under tp2 against one process (the coverage cells: parity 1e-5 per tensor, clipping
active) and asserts that each rank really holds at most 75% of the parameters (half or more split).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_parallel.parallel.tensor.infer import analyse
from lightning_parallel.parallel.tensor.plan import resolve_tp_plan
from lightning_parallel.testing.more_families import MORE_FAMILIES
from lightning_parallel.testing.real_models import HFCausalLM


def _model(name: str) -> HFCausalLM:
    family, loss, config = MORE_FAMILIES[name]
    with torch.device("meta"):  # plans are made on meta-device models (init_module(empty_init=True))
        return HFCausalLM(family=family, loss=loss, config=config)


def _plan(name: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return resolve_tp_plan(_model(name), 2)


@pytest.mark.parametrize("name", [n for n in MORE_FAMILIES if n != "mamba"])
def test_every_further_family_is_planned_from_its_dataflow_and_split_at_least_half(name: str) -> None:
    model = _model(name)
    assert analyse(model, 2).method == {"model": "dataflow"}
    plan = _plan(name)
    assert plan.fraction_sharded >= 0.5, plan.table()
    rows = [n for n, s in plan.styles.items() if s == "rowwise"]
    assert rows, plan.table()


def test_bert_pairs_its_attention_across_sibling_modules() -> None:
    plan = _plan("bert")
    layer = "model.bert.encoder.layer.0"
    for q in ("query", "key", "value"):
        assert plan.styles[f"{layer}.attention.self.{q}"] == "colwise"
    assert plan.styles[f"{layer}.attention.output.dense"] == "rowwise"
    assert plan.styles[f"{layer}.intermediate.dense"] == "colwise"
    assert plan.styles[f"{layer}.output.dense"] == "rowwise"
    # The MLP pair spans the layer (intermediate and output are siblings): the layer is the region.
    assert layer in plan.regions and f"{layer}.attention" not in plan.regions
    assert plan.fraction_sharded > 0.8  # the rest: position/type embeddings, norms, the MLM transform


@pytest.mark.parametrize("name, fused, parts", [
    ("bloom", "model.transformer.h.0.self_attention.query_key_value", 1),  # per head: a plain split keeps heads
    ("falcon_gqa", "model.transformer.h.0.self_attention.query_key_value", 1),  # per key/value group
])
def test_fused_projections_split_by_how_the_graph_cuts_them(name: str, fused: str, parts: int) -> None:
    plan = _plan(name)
    assert plan.styles[fused] == "colwise"
    assert plan.packed.get(fused, 1) == parts


def test_packed_qkv_is_found_from_its_split_and_gpt2_keeps_it() -> None:
    # GPT-2's Conv1D c_attn is cut into three equal parts along the split dim: packed [q | k | v].
    from lightning_parallel.testing.real_models import HFCausalLM as LM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = resolve_tp_plan(LM(family="gpt2", n_layer=1), 2)
    assert plan.packed["model.transformer.h.0.attn.c_attn"] == 3


def test_what_cannot_be_split_is_said_with_the_reason() -> None:
    bigcode = _plan("gpt_bigcode")  # multi-query: [q | k | v] with one key/value head
    reason = bigcode.replicated["model.transformer.h.0.attn.c_attn"]
    assert "unequal parts" in reason, reason
    assert "model.transformer.h.0.attn.c_proj" in bigcode.replicated
    falcon = HFCausalLM(family="FalconConfig/FalconForCausalLM", config={
        "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1, "multi_query": True})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = resolve_tp_plan(falcon, 2)
    assert "query_key_value" not in " ".join(plan.styles)
    # its query and shared key/value heads are cut after a reshape into heads: no per-part split
    assert "unequal parts" in plan.replicated["model.transformer.h.0.self_attention.query_key_value"]
    assert plan.styles["model.transformer.h.0.mlp.dense_h_to_4h"] == "colwise"


def test_a_state_space_mixer_splitting_too_little_is_refused() -> None:
    from lightning_parallel.parallel.tensor.split_share import check_split_share

    model = _model("mamba")
    plan = _plan("mamba")
    assert plan.fraction_sharded < 0.5
    with pytest.raises(ValueError, match="tensor_parallel_min_split"):
        check_split_share(model, plan, 0.5, 1)


class _Misnamed(nn.Module):
    """An attention block whose names say the opposite of what it does: ``o_proj`` makes the
    queries, ``q_proj`` projects the output, ``up`` makes the values, ``down`` the keys."""

    def __init__(self, width: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.o_proj, self.down, self.up, self.q_proj = (nn.Linear(width, width) for _ in range(4))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 8)
        self.example_input_array = torch.randn(2, 5, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (f(self.norm(x)).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.o_proj, self.down, self.up))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.q_proj(y.transpose(1, 2).reshape(b, t, c)))


def test_names_do_not_decide_the_pairs() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = resolve_tp_plan(_Misnamed(), 2)
    assert {n: s for n, s in plan.styles.items() if n != "head"} == {
        "o_proj": "colwise", "down": "colwise", "up": "colwise", "q_proj": "rowwise"}, plan.table()
    assert plan.regions == ("",)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        odd = resolve_tp_plan(_Misnamed(width=12, heads=3), 2)  # 3 heads do not split over 2 ranks
    for name in ("o_proj", "down", "up"):
        assert "not divisible by tp 2" in odd.replicated[name], odd.table()


# Beyond tp: cells of the other columns of the further families' table (docs/coverage.md), one per layout kind.
OTHER_CELLS = [("bert", "3d"), ("falcon_gqa", "3d"), ("deepseek_v3", "3d"), ("bloom", "3d"), ("t5", "zero3"),
               ("mamba", "pp"), ("bart", "3d")]  # bart: labels= under tp2 x pp2 (inputs routed through stage 0)


@pytest.mark.slow
def test_further_families_tp2_match_one_process_and_split_at_least_half() -> None:
    from lightning_parallel import coverage

    names = list(MORE_FAMILIES)
    cells = coverage.run_matrix([(n, "tp") for n in names] + OTHER_CELLS, timeout_per_cell=240)
    for cell in cells:
        if cell.model == "mamba" and cell.strategy == "tp":  # a state-space mixer: too little to split, refused
            assert cell.kind == "refused" and "tensor_parallel_min_split" in cell.message, cell
            continue
        if cell.strategy != "tp":
            assert cell.kind == "ok", (cell.model, cell.strategy, cell.kind, cell.message, cell.value)
            continue
        assert cell.kind == "ok", (cell.model, cell.kind, cell.message, cell.value)
        assert cell.local_fraction is not None and cell.local_fraction <= 0.75, (cell.model, cell.local_fraction)
