"""``compile_blocks``: ``torch.compile`` of each repeated block, under dp, ZeRO, tp and ep, against one
uncompiled process (parity: losses and parameters, relative 1e-5, five steps, clipping on).

A pass must not be an uncompiled run in disguise: ``CompileProbe`` reports how many blocks carry a
compiled call and how many graphs dynamo built in that process, and both must be non-zero. One case
runs inductor (torch's default backend: the generated C++ kernels), the others ``aot_eager`` (dynamo's
graph capture and AOT autograd, without code generation: the same tracing of DTensor, FSDP2 hooks
and checkpointed regions, at a fraction of inductor's compile time on two shared cores).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import run_fits
from tests.test_data_parallel import HYBRID, _reference, assert_parity
from tests.test_strategy_ep import MOE_SPEC
from tests.test_strategy_tp import GPT_SPEC

EAGER = {"backend": "aot_eager"}
PROBE = [("tests.test_compile:CompileProbe", {})]
GPT_CASES: list[tuple[str, dict[str, Any]]] = [
    ("dp aot_eager", {"zero_stage": 0, "compile_blocks": EAGER}),
    ("zero3 inductor", {"zero_stage": 3, "compile_blocks": True}),
    ("zero2 + activation checkpointing aot_eager", {"zero_stage": 2, "activation_checkpointing": True, "compile_blocks": EAGER}),
]
MOE_CASES: list[tuple[str, dict[str, Any]]] = [("ep2 aot_eager", {"expert_parallel_size": 2, "compile_blocks": EAGER})]


class CompileProbe:
    """Callback: at the end of fit, the compiled blocks and dynamo's graph count, as metrics."""

    def __new__(cls) -> Any:
        from lightning.pytorch import Callback

        class _Probe(Callback):
            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                from torch._dynamo.utils import counters

                compiled = sum(1 for m in pl_module.modules() if getattr(m, "_compiled_call_impl", None) is not None)
                trainer.callback_metrics["compiled_blocks"] = torch.tensor(float(compiled))
                trainer.callback_metrics["dynamo_graphs"] = torch.tensor(float(counters["stats"]["unique_graphs"]))

        return _Probe()


def test_compiled_blocks_match_one_uncompiled_process() -> None:
    gpt = [dataclasses.replace(GPT_SPEC, strategy={"class": HYBRID, **kw}, devices=2, callbacks=PROBE) for _, kw in GPT_CASES]
    moe = [dataclasses.replace(MOE_SPEC, strategy={"class": HYBRID, **kw}, devices=2, callbacks=PROBE) for _, kw in MOE_CASES]
    results = run_distributed(run_fits, 2, gpt + moe, init_backend=None, timeout=900)[0]
    gpt_reference = _reference(GPT_SPEC)
    moe_reference = run_distributed(run_fits, 1, [MOE_SPEC], init_backend=None, timeout=300)[0][0]
    for (label, _), result, reference in zip(GPT_CASES + MOE_CASES, results,
                                             [gpt_reference] * len(GPT_CASES) + [moe_reference] * len(MOE_CASES)):
        assert result["metrics"]["compiled_blocks"] == 2, label  # both blocks of the 2-layer models
        assert result["metrics"]["dynamo_graphs"] > 0, label
        result["metrics"] = {k: v for k, v in result["metrics"].items() if k not in ("compiled_blocks", "dynamo_graphs")}
        assert_parity(result, reference, label, per_tensor=True, metrics=False)


def test_compile_blocks_bad_input_and_pipelines_are_typed_errors() -> None:
    from lightning_parallel.strategies.hybrid import HybridParallelStrategy

    with pytest.raises(ValueError, match=r"`compile_blocks`.*not torch.compile arguments.*HINT"):
        HybridParallelStrategy(compile_blocks={"bakend": "inductor"})
    with pytest.raises(TypeError, match=r"`compile_blocks`='yes'.*bool or a mapping"):
        HybridParallelStrategy(compile_blocks="yes")
    with pytest.raises(ValueError, match=r"`compile_blocks`.*pipeline_parallel_size=2.*traced.*HINT: use compile_blocks=False"):
        HybridParallelStrategy(pipeline_parallel_size=2, compile_blocks=True)
    with pytest.raises(ValueError, match=r"`compile_blocks`.*tensor_parallel_size=2.*DTensor.*HINT: use compile_blocks=False"):
        HybridParallelStrategy(tensor_parallel_size=2, compile_blocks=EAGER)


def test_3d_with_compile_is_a_typed_error_saying_why_each_layout_is_refused() -> None:
    # '3d' asks for a model-parallel layout; with compiled blocks the strategy allows neither tp nor
    # pp, so there is none, and the error says so in the strategy's own words (before any process group).
    from lightning_parallel.models import GPT
    from lightning_parallel.strategies.registry import strategy_from_name

    strategy = strategy_from_name("3d", compile_blocks=EAGER)
    strategy.parallel_devices = [torch.device("cpu")] * 4
    strategy.connect(GPT(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32))
    with pytest.raises(ValueError, match=r"no layout with a tensor-, pipeline- or expert-parallel degree above 1") as info:
        strategy.resolve_dims(4)
    text = str(info.value)
    assert "dp2 x tp1 x pp2 zero0 1f1b m2: the strategy refuses it: `compile_blocks`" in text
    assert "dp2 x tp2 x pp1 zero0: the strategy refuses it: `compile_blocks`" in text
