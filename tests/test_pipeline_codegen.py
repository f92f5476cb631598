"""Traced pipeline stages with inlined submodule calls and operators through Python bindings compute
exactly what the unflattened stages compute (no process group: stages are traced and run in one process)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from lightning_parallel.models import GPT
from lightning_parallel.parallel.pipeline.trace import CheckpointedForward, trace_pipeline
from lightning_parallel.parallel.pipeline.codegen import BINDINGS, lean_stage_code
from lightning_parallel.parallel.pipeline.plan import plan_pipeline

aten = torch.ops.aten
_x = torch.randn(2, 3, 8)
_w = torch.randn(5, 8)
#: op -> arguments as a traced graph passes them (positional as in the aten schema, keywords where keyword-only)
SAMPLES: dict[Any, tuple[tuple[Any, ...], dict[str, Any]]] = {
    aten.linear.default: ((_x, _w, torch.randn(5)), {}),
    aten.view.default: ((_x, [6, 8]), {}),
    aten.reshape.default: ((_x, [3, 16]), {}),
    aten.transpose.int: ((_x, 1, 2), {}),
    aten.permute.default: ((_x, [2, 0, 1]), {}),
    aten.add.Tensor: ((_x, _x), {"alpha": 2}),
    aten.sub.Tensor: ((_x, 1.5), {}),
    aten.mul.Tensor: ((_x, _x), {}),
    aten.div.Tensor: ((_x, 3.0), {}),
    aten.layer_norm.default: ((_x, [8], torch.randn(8), torch.randn(8), 1e-5, False), {}),
    aten.embedding.default: ((torch.randn(10, 4), torch.tensor([[1, 2], [3, 9]])), {}),
    aten.dropout.default: ((_x, 0.0, True), {}),
    aten.gelu.default: ((_x,), {"approximate": "tanh"}),
    aten.silu.default: ((_x,), {}),
    aten.relu.default: ((_x,), {}),
    aten.scaled_dot_product_attention.default: ((torch.randn(2, 2, 4, 8),) * 3 + (None, 0.0, True), {"scale": 0.5}),
    aten.matmul.default: ((_x, _w.t()), {}),
    aten.cat.default: (([_x, _x], 1), {}),
    aten.contiguous.default: ((_x.transpose(1, 2),), {}),
    aten.unsqueeze.default: ((_x, 1), {}),
}


def test_every_binding_computes_its_overload_from_the_same_arguments() -> None:
    assert set(SAMPLES) == set(BINDINGS), "a binding without a sample call (or the reverse)"
    for op, (args, kwargs) in SAMPLES.items():
        expected, got = op(*args, **kwargs), BINDINGS[op](*args, **kwargs)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"{op}: {m}")


def _stages(checkpoint: tuple[str, ...] = ()) -> tuple[GPT, list[torch.nn.Module]]:
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16, dropout=0.0)
    x = torch.randint(0, 32, (4, 8))
    traced = trace_pipeline(model, (x,), plan=plan_pipeline(model, 2), microbatches=2, build_eval=False,
                            checkpoint_blocks=checkpoint)
    return model, [traced.train.get_stage_module(k) for k in range(2)]


def _run(model: GPT, stages: list[torch.nn.Module], x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = stages[1](stages[0](x))
    F.cross_entropy(out.flatten(0, 1), x.flatten()).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _calls(stage: torch.nn.Module) -> list[str]:
    return [str(n.target) for n in stage.graph.nodes if n.op == "call_module"]


def test_lean_stages_compute_the_same_values_and_gradients() -> None:
    model, stages = _stages()
    x = torch.randint(0, 32, (2, 8))
    before = _run(model, stages, x)
    assert _calls(stages[0]), "the unflattened stage calls its submodules"
    block = stages[0].get_submodule("blocks.0")
    block_graph = [n.format_node() for n in block.graph.nodes]
    inlined, rebound = lean_stage_code(stages)
    assert inlined >= 2 * 4 and rebound > 20, (inlined, rebound)
    assert _calls(stages[0]) == [] and _calls(stages[1]) == [], "every plain submodule call is inlined"
    # a block whose call was inlined never runs again: no second inlined copy of its graph is built
    assert [n.format_node() for n in block.graph.nodes] == block_graph
    assert not any(n.target in BINDINGS for s in stages for n in s.graph.nodes if n.op == "call_function")
    after = _run(model, stages, x)
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    assert after[1].keys() == before[1].keys()
    for name, grad in before[1].items():
        torch.testing.assert_close(after[1][name], grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    # the parameters are still read through the hierarchy: the module's own objects
    assert dict(stages[0].named_parameters())["blocks.0.attn.q.weight"] is model.blocks[0].attn.q.weight


@pytest.mark.parametrize("kept", ["checkpointed", "hooked"])
def test_a_child_that_does_more_than_its_graph_stays_a_call(kept: str) -> None:
    model, stages = _stages(checkpoint=("blocks.0",) if kept == "checkpointed" else ())
    x = torch.randint(0, 32, (2, 8))
    seen: list[int] = []
    if kept == "hooked":  # as tensor parallelism's input/output redistributions and FSDP2 act
        stages[0].get_submodule("blocks.1").register_forward_hook(lambda m, i, o: seen.append(1))
    before = _run(model, stages, x)
    lean_stage_code(stages)
    name = "blocks.0" if kept == "checkpointed" else "blocks.1"
    assert _calls(stages[0]) == [name]
    child = stages[0].get_submodule(name)
    assert [n for n in child.graph.nodes if n.op == "call_module"] == [], "its own children are inlined"
    if kept == "checkpointed":
        assert isinstance(child.__dict__["forward"], CheckpointedForward)
    after = _run(model, stages, x)
    if kept == "hooked":
        assert len(seen) == 2  # the hook ran in both runs
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    for n, g in before[1].items():
        torch.testing.assert_close(after[1][n], g, rtol=0, atol=0)


def test_inlining_keeps_graphs_valid() -> None:
    _, stages = _stages()
    lean_stage_code(stages)
    for stage in stages:
        assert isinstance(stage, fx.GraphModule)
        stage.graph.lint()


def test_tensor_parallel_stage_forward_runs_the_code_of_the_last_recompile() -> None:
    """The tp x pp stage wrapper is installed before the lean code is generated: it must run the
    stage's current graph, not the method bound when it was installed (which ran the traced code)."""
    from types import SimpleNamespace

    from lightning_parallel.parallel.pipeline.tensor import TensorParallelStageForward

    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.add, (x, 1.0)))
    stage = fx.GraphModule(torch.nn.Module(), graph)
    stage.forward = TensorParallelStageForward(stage, SimpleNamespace(device_type="cpu"))  # type: ignore[method-assign]
    ones = torch.ones(3)
    torch.testing.assert_close(stage(ones), ones + 1)
    next(n for n in stage.graph.nodes if n.op == "call_function").args = (x, 2.0)
    stage.recompile()  # what finalize_code and tensor parallelism's graph passes do
    torch.testing.assert_close(stage(ones), ones + 2)
