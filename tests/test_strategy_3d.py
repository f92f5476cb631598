"""3D parallelism through the Trainer: tensor x pipeline (x data) parallel, unchanged GPT.

Tensor parallelism inside pipeline stages is applied to the traced stage graphs
(``parallel/pipeline/tensor.py``); these runs compare losses (logged on every rank), the final
parameters (gathered from their owning stages, full tensors from the tensor-parallel shards)
and the logged metrics with one process, with gradient clipping active: its norm spans the
tensor shards of every stage.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_parallel.models import GPT
from lightning_parallel.planner.auto_degrees import choose_3d_degrees
from lightning_parallel.strategies.pipeline.config import resolve_pipeline_config
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import run_fit, run_fits
from tests.test_data_parallel import assert_parity
from tests.test_strategy_pp import GPT_KWARGS, GPT_SPEC

class CountingGPT(GPT):
    """The GPT plus a torchmetrics sum logged per epoch: tensor-parallel peers hold duplicate
    metric states under pipelines, and a sync that counted them would double it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from torchmetrics import SumMetric

        self.tokens_seen = SumMetric()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.tokens_seen.update(torch.tensor(float(batch[1].numel())))  # update, not forward: epoch-only
        self.log("tokens_seen", self.tokens_seen, on_step=False, on_epoch=True)
        return loss


SPEC = dataclasses.replace(GPT_SPEC, model="tests.test_strategy_3d:CountingGPT", trainer_kwargs={"gradient_clip_val": 0.5})


class ConfiguredGPT(CountingGPT):
    """Lightning's idiom for large models: the layers are created in ``configure_model()``, so the
    module has no parameters when ``3d`` chooses its degrees (planned on a meta-device twin)."""

    LAYERS = ("tok_emb", "pos_emb", "blocks", "ln_f", "lm_head")

    def __init__(self, **kwargs: Any) -> None:
        with torch.random.fork_rng(devices=[]):  # the base class builds layers: leave the random stream as it was
            super().__init__(**kwargs)
        for name in self.LAYERS:
            delattr(self, name)

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        built = GPT(**{k: v for k, v in self.hparams.items() if k in GPT_KWARGS or k in GPT_SPEC.model_kwargs})
        for name in self.LAYERS:
            setattr(self, name, getattr(built, name))


def _hybrid(**kwargs: Any) -> dict[str, Any]:
    return {"class": "lightning_parallel:HybridParallelStrategy", **kwargs}


def _check(cases: list[tuple[str, Any]], devices: int, timeout: float, extra: list[Any] = ()) -> list[list[dict[str, Any]]]:
    """Fit ``cases`` (and ``extra`` specs, checked by the caller) in one group; compare the cases with one process."""
    specs = [dataclasses.replace(SPEC, strategy=strategy, devices=devices) for _, strategy in cases]
    results = run_distributed(run_fits, devices, [*specs, *extra], init_backend=None, timeout=timeout)
    reference = run_fit(dataclasses.replace(SPEC, strategy="auto", devices=1))
    assert max(reference["grad_norms"]) > 0.5, "clipping must be active"
    for index, (label, _) in enumerate(cases):
        for rank, per_rank in enumerate(results):
            # A torchmetrics object's step value is its rank's own batch under data parallelism
            # with pipelines (see test_strategy_pp): compare metrics where dp == 1.
            data_parallel = devices // 4 > 1
            assert_parity(per_rank[index], reference, f"{label} (rank {rank})", per_tensor=True, metrics=not data_parallel)
            assert per_rank[index]["metrics"]["tokens_seen"] == reference["metrics"]["tokens_seen"] > 0, (label, rank)
    return results


# ---------------------------------------------------------------- choosing degrees (no processes)
def _gpt(**overrides: Any) -> GPT:
    return GPT(**{**GPT_KWARGS, **overrides})


def _degrees(choice: Any) -> tuple[int, ...]:
    return (choice.dp, choice.tp, choice.pp)


def test_3d_chooses_the_planners_fastest_layout_with_model_parallelism() -> None:
    # '3d' auto = the planner's fastest fitting layout among those with the most model-parallel
    # axes (planner/auto_degrees.py). 4 processes: tp2 x pp2 is the only layout with both.
    assert _degrees(choose_3d_degrees(_gpt(), 4, processes_per_node=4)) == (1, 2, 2)
    eight = choose_3d_degrees(_gpt(), 8, processes_per_node=8)
    assert _degrees(eight) == (2, 2, 2)
    # The choice is the planner's first among its candidates, and it explains the runner-up.
    assert eight.plan is not None and eight.plan.chosen.layout.tp == 2 and "runner-up" in eight.explain()
    assert all(p.step_time >= eight.plan.chosen.step_time for p in eight.plan.candidates)
    assert _degrees(choose_3d_degrees(_gpt(), 16, processes_per_node=8)) == (4, 2, 2)
    # 6 heads, 48 features: tp=2 fits; 12 processes -> tp 2, pp 2, dp 3.
    six = choose_3d_degrees(_gpt(n_head=6, n_embd=48), 12, processes_per_node=12)
    assert _degrees(six) == (3, 2, 2)
    # A head count and hidden size that 2 does not divide but 3 does: tp=3.
    three = choose_3d_degrees(_gpt(n_head=3, n_embd=33, vocab_size=63), 6, processes_per_node=6)
    assert _degrees(three) == (1, 3, 2)
    assert "tp=2: " in three.explain() and "not divisible by the tensor-parallel size 2" in three.explain()
    # data_parallel_size fixed: the model axes share what it leaves.
    fixed = choose_3d_degrees(_gpt(), 8, processes_per_node=8, data_parallel_size=2)
    assert _degrees(fixed) == (2, 2, 2)


def test_3d_takes_one_model_axis_where_only_one_fits() -> None:
    # Two processes: one model-parallel axis only (the planner predicts pp2 faster than tp2 on CPU).
    two = choose_3d_degrees(_gpt(), 2, processes_per_node=2)
    assert two.tp * two.pp == 2 and two.dp == 1
    assert two.plan is not None and {p.layout.tp for p in two.plan.candidates} == {1, 2}  # both were considered
    # 7 heads / 35 features: no tensor-parallel degree divides them; the pipeline takes 2.
    odd = choose_3d_degrees(_gpt(n_head=7, n_embd=35), 8, processes_per_node=8)
    assert _degrees(odd) == (4, 1, 2) and "tp=2: " in odd.explain()
    # MoE layers (4D): expert parallelism counts as a model-parallel axis; on 4 processes pp2 x dp2 with
    # ep2 is predicted faster than tp2 x dp2 with ep2 (tensor parallelism leaves the experts whole).
    from lightning_parallel.models import MoEGPT

    def moe_gpt(**kw: int) -> MoEGPT:
        return MoEGPT(**{"vocab_size": 64, "block_size": 16, "n_layer": 4, "n_head": 4, "n_embd": 32, "num_experts": 4, **kw})

    moe = choose_3d_degrees(moe_gpt(), 4, processes_per_node=4)
    assert (moe.dp, moe.tp, moe.pp, moe.ep) == (2, 1, 2, 2) and moe.plan is not None
    assert any(p.layout.tp == 2 and p.layout.ep == 2 and p.step_time > moe.plan.chosen.step_time for p in moe.plan.candidates)
    assert (lambda c: (c.dp, c.tp, c.pp, c.ep))(choose_3d_degrees(moe_gpt(), 8, processes_per_node=8)) == (2, 2, 2, 2)
    assert (lambda c: (c.dp, c.tp, c.pp, c.ep))(choose_3d_degrees(moe_gpt(num_experts=6), 16, processes_per_node=8)) == (4, 2, 2, 2)
    # 16+ stages, 4 blocks: no pipeline; tp x ep instead (ep 2 or 4, whichever the planner predicts faster).
    shallow = choose_3d_degrees(moe_gpt(), 8, processes_per_node=8, pipeline_schedule="interleaved_1f1b", virtual_stages=8)
    assert (shallow.dp, shallow.tp, shallow.pp) == (4, 2, 1) and shallow.ep in (2, 4) and "more stages than blocks" in shallow.explain()


def test_3d_error_lists_the_degrees_tried() -> None:
    # Neither axis fits: no degree divides 7 heads, and 2 processes x 8 virtual stages need 16 blocks.
    with pytest.raises(ValueError, match=r"tensor-, pipeline- or expert-parallel degree.*more stages than blocks.*tp=2: .*35.*tp=4: .*tp=8: .*HINT"):
        choose_3d_degrees(_gpt(n_head=7, n_embd=35, n_layer=1), 8, processes_per_node=8, virtual_stages=8,
                          pipeline_schedule="interleaved_1f1b")
    # Tensor parallelism stays inside a node: 2 processes per node allow tp=2 only.
    with pytest.raises(ValueError, match=r"tp=2: .*35.*tp=4: tensor parallelism stays inside a node \(2 devices per node\)"):
        choose_3d_degrees(_gpt(n_head=7, n_embd=35, n_layer=1), 8, processes_per_node=2, virtual_stages=8,
                          pipeline_schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match=r"data_parallel_size.*divide the world size 8"):
        choose_3d_degrees(_gpt(), 8, processes_per_node=8, data_parallel_size=3)


def test_3d_options_that_do_not_compose_yet_are_refused() -> None:
    model = _gpt()
    with pytest.raises(ValueError, match=r"pipeline_schedule.*zbv.*gpipe, 1f1b"):
        resolve_pipeline_config(model, 2, "zbv", "auto", "auto", None, tp=2)
    with pytest.raises(ValueError, match=r"sequence_parallel.*True"):
        resolve_pipeline_config(model, 2, "1f1b", "auto", "auto", None, tp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"loss_parallel"):
        resolve_pipeline_config(model, 2, "1f1b", "auto", "auto", None, tp=2, loss_parallel=True)


# ---------------------------------------------------------------- multi-process parity
def test_tp2_x_pp2_and_3d_preset_match_single_process() -> None:
    configured = dataclasses.replace(SPEC, model="tests.test_strategy_3d:ConfiguredGPT", strategy="3d", devices=4)
    results = _check(
        [
            ("tp2 x pp2 1f1b", _hybrid(tensor_parallel_size=2, pipeline_parallel_size=2, microbatches=2)),
            ("tp2 x pp2 interleaved_1f1b v2", _hybrid(
                tensor_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", virtual_stages=2,
                microbatches=2)),
            ("3d (auto: tp2 x pp2)", "3d"),
        ],
        4,
        timeout=500,
        extra=[configured],
    )
    # configure_model(): 3d chose its degrees on a meta-device twin, then trained the real build.
    reference = run_fit(dataclasses.replace(configured, strategy="auto", devices=1))
    for rank, per_rank in enumerate(results):
        dims = per_rank[-1]["layout"]["dims"]
        assert "pp=2 " in dims and "tp=2" in dims, dims
        assert_parity(per_rank[-1], reference, f"3d with configure_model (rank {rank})", per_tensor=True)


@pytest.mark.slow
def test_dp2_x_tp2_x_pp2_matches_single_process() -> None:
    _check(
        [
            ("dp2 x tp2 x pp2 gpipe", _hybrid(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2)),
            ("dp2 x tp2 x pp2 1f1b zero3", _hybrid(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=3)),
        ],
        8,
        timeout=900,
    )


def _eval_worker(ckpt_dir: str) -> list[dict[str, Any]]:
    from tests.test_strategy_pp import _eval_run

    return [
        _eval_run(_hybrid(data_parallel_size=2, pipeline_parallel_size=2, zero_stage=3), 4, f"{ckpt_dir}/zero3"),
        _eval_run(_hybrid(tensor_parallel_size=2, pipeline_parallel_size=2), 4, f"{ckpt_dir}/tp"),
    ]


@pytest.mark.slow
def test_zero3_and_tp_stages_validate_predict_and_checkpoint(tmp_path: Path) -> None:
    """The forward-only pipes under ZeRO-3 stages (gathered for evaluation) and tensor-parallel stages:
    ModelCheckpoint(monitor="val_loss"), trainer.validate and trainer.predict equal one process."""
    from tests.test_strategy_pp import _assert_eval_matches, _eval_run

    results = run_distributed(_eval_worker, 4, str(tmp_path), init_backend=None, timeout=600)
    reference = _eval_run("auto", 1, str(tmp_path / "ref"))
    for index in range(2):
        _assert_eval_matches([per_rank[index] for per_rank in results], reference)
