"""Pipelines trace in a forked child and ship the stage graphs back (``parallel/pipeline/fork_trace.py``, issue 29).

What a rank gets from the child must be what it would have traced itself: the same cut, owners and
graphs, its stages holding the module's own parameter objects (never copies), computing the same
values, with the state the trace records outside its result (MoE op handles, a child module's output
structure) in place. Single process: ``trace_pipeline`` needs no process group. The multi-process
pipelined runs (``test_hf_pp.py``, ``test_strategy_pp.py``, ``test_strategy_3d.py``,
``test_strategy_pp_ep.py``) go through the same path."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from torch import nn

from lightning_parallel.models.gpt import GPT
from lightning_parallel.models.moe_gpt import MoEGPT
from lightning_parallel.parallel.pipeline import fork_trace, trace
from lightning_parallel.parallel.pipeline.fork_trace import ENV, run_in_child, ship_back
from lightning_parallel.parallel.pipeline.plan import plan_pipeline
from lightning_parallel.parallel.pipeline.trace import stage_interface, trace_pipeline
from lightning_parallel.strategies.pipeline.entry import Entry, tracing_forward
from lightning_parallel.testing.real_models import HFCausalLM

pytestmark = pytest.mark.skipif(not fork_trace.available(), reason="tracing in a forked child needs Linux and no CUDA context")


def _graphs(stage: nn.Module) -> list[tuple[str, list[tuple[str, str, Any]]]]:
    """Every traced submodule's nodes (op, target, the value's shape) in order."""
    out = []
    for name, sub in stage.named_modules():
        graph = getattr(sub, "graph", None)
        if isinstance(graph, torch.fx.Graph):
            val = [getattr(n.meta.get("val"), "shape", None) for n in graph.nodes]
            out.append((name, [(n.op, str(n.target), tuple(v) if v is not None else None) for n, v in zip(graph.nodes, val)]))
    return out


def _trace_both(monkeypatch: pytest.MonkeyPatch, module: nn.Module, x: torch.Tensor, pp: int, local: list[int], entry: Entry) -> tuple[Any, Any, Any]:
    """(traced in a child, traced here, every stage traced whole here), asserting the child's result was the one used."""
    plan = plan_pipeline(module, pp)
    used: list[bool] = []

    def recorded(fn: Any, mod: nn.Module, timeout: float = 600.0) -> Any:
        result = run_in_child(fn, mod, timeout)
        used.append(result is not None)
        return result

    monkeypatch.setattr(trace, "run_in_child", recorded)
    with tracing_forward(module, entry):
        child = trace_pipeline(module, (x,), {}, plan=plan, microbatches=2, local_stages=local)
        child_spec = list(entry.spec)
        entry.spec.clear()
        monkeypatch.setenv(ENV, "0")
        here = trace_pipeline(module, (x,), {}, plan=plan, microbatches=2, local_stages=local)
        whole = trace_pipeline(module, (x,), {}, plan=plan, microbatches=2)
    assert used == [True, False, False], "the child's trace was not used"
    assert child_spec == entry.spec, "what the traced forward recorded did not come back from the child"
    return child, here, whole


@pytest.mark.parametrize("kind", ["gpt", "moe_gpt", "hf_llama"])
def test_the_child_traces_what_this_process_would(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    torch.manual_seed(0)
    entry = Entry("")
    if kind == "gpt":
        module: nn.Module = GPT(vocab_size=64, block_size=16, n_layer=8, n_head=2, n_embd=32)
    elif kind == "moe_gpt":  # MoE units are opaque ops: their handles must resolve in this process
        module = MoEGPT(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, num_experts=4)
    else:  # a child module's call: its output structure is recorded by the traced forward
        module, entry = HFCausalLM(family="llama", n_layer=4, config={"tie_word_embeddings": True}), Entry("model")
    x = torch.randint(0, 64, (4, 16))
    local = [1]
    child, here, whole = _trace_both(monkeypatch, module, x, 2, local, entry)
    assert child.holders_by_stage == here.holders_by_stage and child.used_anywhere == here.used_anywhere
    assert child.local_stages == here.local_stages
    for mine, theirs in ((child.train, here.train), (child.eval, here.eval)):
        assert stage_interface(mine) == stage_interface(theirs)
        assert _graphs(mine.get_stage_module(1)) == _graphs(theirs.get_stage_module(1))
    originals = {id(p) for p in module.parameters()}
    stage = child.train.get_stage_module(1)
    assert stage.parameters() and all(id(p) in originals for p in stage.parameters()), "the stage must hold the module's own parameters"
    with torch.no_grad():  # the stage computes what the in-process trace's does
        inputs = whole.train.get_stage_module(0)(x[:2])
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        torch.testing.assert_close(stage(*inputs), here.train.get_stage_module(1)(*inputs), rtol=0, atol=0)


def test_a_meta_built_model_ships_no_weights_and_keeps_its_parameters() -> None:
    with torch.device("meta"):
        module = GPT(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
    plan = plan_pipeline(module, 2)
    traced = trace_pipeline(module, (torch.randint(0, 64, (2, 16)),), plan=plan, microbatches=1, build_eval=False, local_stages=[0])
    stage = traced.train.get_stage_module(0)
    params = dict(module.named_parameters())
    for name, p in stage.named_parameters():
        assert p is params[name]


def test_what_the_child_puts_in_a_shipped_list_arrives_here() -> None:
    box: list[Any] = []
    with ship_back(box):
        assert run_in_child(lambda: box.append(os.getpid()) or "done", nn.Linear(2, 2)) == "done"
    assert len(box) == 1 and box[0] != os.getpid(), "filled by the child, and only once"


def test_tensors_that_are_not_the_modules_arrive_as_values() -> None:
    """Constants and export's copies of tied tensors are shipped by their bytes (not torch's own pickling,
    which would ``torch.load`` them with ``weights_only=False``); the module's own travel by identity."""
    module = nn.Linear(2, 2)
    sent = (torch.arange(6.0).reshape(2, 3).t(), nn.Parameter(torch.ones(2)), torch.tensor([], dtype=torch.bfloat16),
            torch.tensor([True, False]), module.weight)
    got = run_in_child(lambda: sent, module)
    assert got is not None
    for a, b in zip(got[:4], sent[:4]):
        assert type(a) is type(b) and a.dtype == b.dtype and a.requires_grad == b.requires_grad
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[4] is module.weight


def test_a_failing_or_stuck_child_leaves_the_work_to_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails() -> None:
        raise ValueError("the model's own error")

    assert run_in_child(fails, nn.Linear(2, 2)) is None
    assert run_in_child(lambda: lambda: None, nn.Linear(2, 2)) is None  # a result that cannot be pickled
    start = time.monotonic()
    assert run_in_child(lambda: time.sleep(60), nn.Linear(2, 2), timeout=1.0) is None  # killed past its timeout
    assert time.monotonic() - start < 30
    monkeypatch.setenv(ENV, "0")
    assert not fork_trace.available() and run_in_child(lambda: "never", nn.Linear(2, 2)) is None
