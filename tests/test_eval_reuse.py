"""A pipeline stage whose training and evaluation traces compute the same function is one module
(``parallel/pipeline/eval_reuse.py``, issue 29: the second copy cost each ``3d`` rank 14 MiB); a stage
whose modes differ keeps its own evaluation module. Traced as the strategies trace (in a forked child,
the shared module travelling back once). That evaluation through a shared stage, and through a separate
one, equals the model's own eval-mode output is checked on 2 ranks in ``test_pipeline.py``
(``eval_err``, ``dropout_eval_err``) and through Lightning in ``test_strategy_pp.py``/``test_hf_pp.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_parallel.models.gpt import GPT
from lightning_parallel.parallel.pipeline.eval_reuse import graph_signature, unique_modules
from lightning_parallel.parallel.pipeline.plan import plan_pipeline
from lightning_parallel.parallel.pipeline.trace import trace_pipeline
from lightning_parallel.testing.real_models import VOCAB, build_hf_model


def _shared(model: nn.Module, batch: torch.Tensor) -> list[bool]:
    plan = plan_pipeline(model, 2)
    traced = trace_pipeline(model, (batch,), plan=plan, microbatches=2)
    return [traced.train.get_stage_module(k) is traced.eval.get_stage_module(k) for k in range(plan.num_stages)]


def _resnet() -> nn.Module:
    import transformers

    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4)
    return transformers.ResNetForImageClassification(config)


TOKENS = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
CASES: dict[str, tuple[Any, torch.Tensor, list[bool]]] = {
    # zero dropout: the two traces differ only in dropout(x, 0.0, True) against dropout(x, 0.0, False)
    "gpt (ours), dropout 0": (lambda: GPT(vocab_size=VOCAB, block_size=16, n_layer=4, n_head=4, n_embd=32), TOKENS, [True, True]),
    "llama": (lambda: build_hf_model("llama", use_cache=False), TOKENS, [True, True]),
    "gpt2, dropout 0": (lambda: build_hf_model("gpt2", use_cache=False), TOKENS, [True, True]),
    # dropout in every block (GPT-2's defaults): evaluation computes something else
    "gpt2, dropout 0.1": (lambda: build_hf_model("gpt2", use_cache=False, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
                          TOKENS, [False, False]),
    # batch norm: batch statistics when training, running statistics in evaluation
    "resnet (batch norm)": (_resnet, torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0)), [False, False]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_stage_is_shared_exactly_where_both_modes_compute_the_same(case: str) -> None:
    build, batch, expected = CASES[case]
    torch.manual_seed(0)
    assert _shared(build(), batch) == expected


def test_the_signature_skips_identity_dropouts_and_fills_in_defaults() -> None:
    def graph(*calls: Any) -> torch.fx.Graph:
        g = torch.fx.Graph()
        x = g.placeholder("x")
        for target, args, kwargs in calls:
            x = g.call_function(target, (x, *args), kwargs)
        g.output(x)
        return g

    aten = torch.ops.aten
    plain = graph((aten.relu.default, (), {}))
    assert graph_signature(graph((aten.dropout.default, (0.0, True), {}), (aten.relu.default, (), {}))) == graph_signature(plain)
    assert graph_signature(graph((aten.dropout.default, (0.3, False), {}), (aten.relu.default, (), {}))) == graph_signature(plain)
    assert graph_signature(graph((aten.dropout.default, (0.3, True), {}), (aten.relu.default, (), {}))) != graph_signature(plain)
    # leaky_relu's negative_slope defaults to 0.01: spelled out or not, the same call
    assert graph_signature(graph((aten.leaky_relu.default, (0.01,), {}))) == graph_signature(graph((aten.leaky_relu.default, (), {})))
    assert graph_signature(graph((aten.leaky_relu.default, (0.2,), {}))) != graph_signature(graph((aten.leaky_relu.default, (), {})))
    # a constant tensor argument counts by its values, even where its repr would elide them
    big, other = torch.zeros(2000), torch.zeros(2000)
    other[1000] = 1.0
    assert repr(big) == repr(other)
    assert graph_signature(graph((aten.add.Tensor, (big,), {}))) == graph_signature(graph((aten.add.Tensor, (torch.zeros(2000),), {})))
    assert graph_signature(graph((aten.add.Tensor, (big,), {}))) != graph_signature(graph((aten.add.Tensor, (other,), {})))


def test_unique_modules_keeps_the_first_of_each_in_order() -> None:
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    assert unique_modules([a, b, a, b]) == [a, b]
