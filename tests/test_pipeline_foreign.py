"""A rank traces other ranks' blocks as opaque calls (``parallel/pipeline/foreign.py``): its own stages,
the owners of every parameter and the tensors some stage uses are those of a whole trace.

Single process: ``trace_pipeline`` needs no process group; each rank's ``local_stages`` is traced in turn
and compared with one trace of every stage whole. The multi-process runs of the pipelined strategies
(``test_strategy_pp.py``, ``test_hf_pp.py``, ``test_strategy_3d.py``) go through the same path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_parallel.models.gpt import GPT
from lightning_parallel.parallel.pipeline.foreign import FOREIGN_OP, OtherRanksStage, foreign_calls
from lightning_parallel.parallel.pipeline.plan import plan_pipeline
from lightning_parallel.parallel.pipeline.trace import stage_interface, trace_pipe, trace_pipeline
from lightning_parallel.strategies.pipeline.entry import Entry, tracing_forward
from lightning_parallel.testing.real_models import HFCausalLM


def _nodes(stage: nn.Module) -> list[str]:
    return [str(n.target) for sub in stage.modules() if isinstance(getattr(sub, "graph", None), torch.fx.Graph) for n in sub.graph.nodes
            if n.op in ("call_function", "call_module", "get_attr")]


def _run_stages(traced: Any, stages: list[int], x: torch.Tensor) -> Any:
    out: Any = (x,)
    for k in stages:
        out = traced.train.get_stage_module(k)(*(out if isinstance(out, tuple) else (out,)))
    return out


@pytest.mark.parametrize("pp,virtual,style", [(4, 1, "single"), (2, 2, "loop")])
def test_each_rank_traces_its_stages_whole_and_counts_every_owner(pp: int, virtual: int, style: Any) -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=16, n_layer=8, n_head=2, n_embd=32)
    plan = plan_pipeline(model, pp, virtual, style=style)
    x = torch.randint(0, 64, (4, 16))
    whole = trace_pipeline(model, (x,), plan=plan, microbatches=2)
    assert whole.local_stages is None and all(not foreign_calls(whole.train.get_stage_module(k)) for k in range(plan.num_stages))
    for rank in range(pp):
        local = plan.stages_for_rank(rank)
        traced = trace_pipeline(model, (x,), plan=plan, microbatches=2, local_stages=local)
        assert traced.local_stages == frozenset(local) and traced.traces_whole(local)
        assert not traced.traces_whole(range(plan.num_stages))
        assert traced.holders_by_stage == whole.holders_by_stage
        assert traced.used_anywhere == whole.used_anywhere
        assert stage_interface(traced.train) == stage_interface(whole.train) and stage_interface(traced.eval) == stage_interface(whole.eval)
        # the pipe as the tracer cut it, before the other ranks' stage modules are left behind in the child
        cut, _ = trace_pipe(model, (x[:2],), {}, plan, training=True, local_stages=local)
        for k in range(plan.num_stages):
            mine, full = (_nodes(t.get_stage_module(k)) for t in (traced.train, whole.train))
            evaluation = traced.eval.get_stage_module(k)
            if k in local:
                assert mine == full and not foreign_calls(evaluation)
            else:  # every block of another rank's stage is one call; what is not a block (embeddings, head) stays
                blocks = [n for n in plan.stages[k].modules if n.startswith("blocks.")]
                assert len(foreign_calls(cut.get_stage_module(k))) == len(blocks)
                assert len(_nodes(cut.get_stage_module(k))) < len(full) / 2
                # ... and what this rank keeps of it: a placeholder, in both pipes and in their interpreters' tables
                for pipe in (traced.train, traced.eval):
                    assert isinstance(pipe.get_stage_module(k), OtherRanksStage) and not list(pipe.get_stage_module(k).parameters())
                    kept = {id(m) for j in local for m in pipe.get_stage_module(j).modules()} | {id(pipe.split_gm)}
                    assert not any(isinstance(m, torch.fx.GraphModule) for m in pipe.executor.submodules.values() if id(m) not in kept)
        with torch.no_grad():  # a rank's own stages compute what the whole trace's do, on one microbatch
            if 0 in local:
                torch.testing.assert_close(_run_stages(traced, [0], x[:2]), _run_stages(whole, [0], x[:2]))
            else:
                hidden = _run_stages(whole, list(range(local[0])), x[:2])
                hidden = hidden if isinstance(hidden, tuple) else (hidden,)
                torch.testing.assert_close(traced.train.get_stage_module(local[0])(*hidden), whole.train.get_stage_module(local[0])(*hidden))


def test_other_ranks_stages_never_run_here() -> None:
    model = GPT(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
    plan = plan_pipeline(model, 2)
    x = torch.randint(0, 64, (2, 16))
    traced = trace_pipeline(model, (x,), plan=plan, microbatches=1, build_eval=False, local_stages=[1])
    with pytest.raises(RuntimeError, match="another pipeline rank's stage"):
        traced.train.get_stage_module(0)(x)
    with pytest.raises(RuntimeError, match="another pipeline rank's stage"):
        FOREIGN_OP([x.float()], 0)


def test_a_block_holding_a_split_point_is_traced() -> None:
    """A split inside a block must be seen by the tracer: that block is never opaque."""
    model = GPT(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
    plan = plan_pipeline(model, 2, split_points=["blocks.1.mlp"])
    x = torch.randint(0, 64, (2, 16))
    whole = trace_pipeline(model, (x,), plan=plan, microbatches=1, build_eval=False)
    traced = trace_pipeline(model, (x,), plan=plan, microbatches=1, build_eval=False, local_stages=[1])
    assert traced.holders_by_stage == whole.holders_by_stage
    cut, _ = trace_pipe(model, (x,), {}, plan, training=True, local_stages=[1])
    assert len(foreign_calls(cut.get_stage_module(0))) == 1  # blocks.0; blocks.1 (split inside) traced
    assert _nodes(traced.train.get_stage_module(1)) == _nodes(whole.train.get_stage_module(1))


def test_hugging_face_layers_with_keyword_inputs_and_tied_head() -> None:
    """Llama layers take keyword tensors (position embeddings as a tuple, the mask): the opaque call
    carries them all; the tied embedding and head are owned by both end stages, as in a whole trace."""
    torch.manual_seed(0)
    module = HFCausalLM(family="llama", n_layer=4, config={"tie_word_embeddings": True})
    x = torch.randint(0, 64, (4, 16))
    plan = plan_pipeline(module, 2)
    with tracing_forward(module, Entry("")):
        whole = trace_pipeline(module, (x,), {}, plan=plan, microbatches=2)
        for local in ([0], [1]):
            traced = trace_pipeline(module, (x,), {}, plan=plan, microbatches=2, local_stages=local)
            assert traced.local_stages == frozenset(local)
            assert traced.holders_by_stage == whole.holders_by_stage and traced.used_anywhere == whole.used_anywhere
            # the layers also receive position_ids, which they do not read: the opaque calls leave it out,
            # else it would cross the cut on one rank's view and not on the other's
            assert stage_interface(traced.train) == stage_interface(whole.train) and stage_interface(traced.eval) == stage_interface(whole.eval)
            assert _nodes(traced.train.get_stage_module(local[0])) == _nodes(whole.train.get_stage_module(local[0]))
    shared = whole.holders_by_stage[0] & whole.holders_by_stage[1]
    assert shared, "the tied embedding is used on both stages"
