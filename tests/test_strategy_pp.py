"""Pipeline parallelism through the Trainer: unchanged LightningModules match one process.

Every multi-process fit is compared with an in-process single-device fit of the same spec:
per-step logged ``train_loss`` on EVERY rank (the value is computed on the last stage only and
replayed everywhere), the final parameters (gathered from the ranks that own them: other ranks
free their copies), the logged metrics, and validate/predict/ModelCheckpoint results.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy

from lightning_parallel.models import GPT, MLPClassifier
from lightning_parallel.strategies.pipeline.config import auto_microbatches, resolve_pipeline_config
from lightning_parallel.strategies.pipeline.logs import (
    LogCapture,
    count_forward_calls,
    probe_forward_inputs,
    reduce_microbatch_logs,
)
from lightning_parallel.parallel.pipeline.schedules import schedule_spec
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing import parity
from lightning_parallel.testing.parity import FitSpec, run_fit, run_fits, token_data
from tests import gradient_probes
from tests.test_data_parallel import HYBRID, assert_parity

GPT_KWARGS = {"vocab_size": 64, "block_size": 16, "n_layer": 4, "n_head": 4, "n_embd": 32, "lr": 0.5}
GPT_SPEC = FitSpec(
    model="lightning_parallel.models:GPT",
    model_kwargs=GPT_KWARGS,
    data="lightning_parallel.testing.parity:token_data",
    global_batch=8,
    max_steps=5,
)
MLP_SPEC = FitSpec(model="lightning_parallel.models:MLPClassifier", model_kwargs={"dims": [16, 32, 32, 32, 4], "lr": 0.2}, max_steps=5)
CLIP = {"gradient_clip_val": 0.5}
ACCUM = {"accumulate_grad_batches": 2}


class LogsAsOneTensor(pl.Callback):
    """The step's logs and loss take the pickled broadcast once (the first step teaches every rank
    their layout), then one tensor broadcast per step (``strategies/pipeline/log_exchange.py``)."""

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        driver = getattr(trainer.strategy, "_pipeline", None)
        if driver is not None:
            assert trainer.global_step > 1 and driver._log_exchange.pickled == 1, driver._log_exchange.pickled


FREED = [*gradient_probes.FREED, (f"{__name__}:LogsAsOneTensor", {})]


def _pp(schedule: str, pp: int = 2, **kwargs: Any) -> dict[str, Any]:
    return {"class": HYBRID, "pipeline_parallel_size": pp, "pipeline_schedule": schedule, **kwargs}


# ---------------------------------------------------------------- multi-process workers
def _full_parameters(module: nn.Module) -> dict[str, Tensor]:
    """parity.full_parameters, but gathered from the owning stages (non-owners hold freed copies)."""
    trainer = module._trainer  # type: ignore[attr-defined]
    driver = getattr(trainer.strategy, "_pipeline", None) if trainer is not None else None
    if driver is None:
        return _ORIGINAL_FULL_PARAMETERS(module)
    return {n: t.cpu() for n, t in driver.gather_state(parameters_only=True).items()}


_ORIGINAL_FULL_PARAMETERS = parity.full_parameters


def _fit_worker(specs: list[FitSpec]) -> list[dict[str, Any]]:
    parity.full_parameters = _full_parameters  # this spawned process only
    return run_fits(specs)


def _check_fits(cases: list[tuple[str, FitSpec]], world_size: int, timeout: float) -> list[list[dict[str, Any]]]:
    results = run_distributed(_fit_worker, world_size, [spec for _, spec in cases], init_backend=None, timeout=timeout)
    for (label, spec), *per_rank in zip(cases, *results):
        reference = run_fit(dataclasses.replace(spec, strategy="auto", devices=1))
        if "clip" in label:
            assert max(reference["grad_norms"]) > spec.trainer_kwargs["gradient_clip_val"], "clipping must be active"
        for rank, result in enumerate(per_rank):  # every rank logs the single-process values
            # A torchmetrics object's step value is its rank's own batch under data parallelism
            # (Lightning does not sync Metric objects per step, with or without pipelines).
            assert_parity(result, reference, f"{label} (rank {rank})", metrics="dp2" not in label)
            assert result["metrics"].keys() == reference["metrics"].keys(), label
    return results


TWO_RANK = [
    ("gpt gpipe+clip", dataclasses.replace(GPT_SPEC, strategy=_pp("gpipe"), devices=2, trainer_kwargs=CLIP, callbacks=FREED)),
    ("gpt 1f1b m4+clip", dataclasses.replace(GPT_SPEC, strategy=_pp("1f1b", microbatches=4), devices=2, trainer_kwargs=CLIP,
                                             callbacks=gradient_probes.SEEN)),
    ("gpt zbv (zero bubble)", dataclasses.replace(GPT_SPEC, strategy=_pp("zbv"), devices=2)),
    ("mlp gpipe", dataclasses.replace(MLP_SPEC, strategy=_pp("gpipe"), devices=2)),
    # No clipping here: a clipped gradient hides a wrong accumulation scale.
    ("mlp 1f1b+accumulate", dataclasses.replace(MLP_SPEC, strategy=_pp("1f1b"), devices=2, trainer_kwargs=ACCUM,
                                                callbacks=FREED)),
    ("mlp interleaved_1f1b v2", dataclasses.replace(MLP_SPEC, strategy=_pp("interleaved_1f1b", virtual_stages=2), devices=2)),
]


def test_pp2_schedules_match_single_process() -> None:
    _check_fits(TWO_RANK, 2, timeout=400)


@pytest.mark.slow
def test_pp4_and_dp2_pp2_with_zero_match_single_process() -> None:
    cases = [
        ("gpt pp4 1f1b+clip", dataclasses.replace(GPT_SPEC, strategy=_pp("1f1b", pp=4), devices=4, trainer_kwargs=CLIP)),
        # 5 KB gradient buckets: several per stage, a weight of 16 KB reduced alone in place (parallel/data/buckets.py)
        ("gpt dp2xpp2 1f1b+clip", dataclasses.replace(GPT_SPEC, strategy=_pp("1f1b", data_parallel_size=2, ddp_bucket_cap_mb=0.005),
                                                      devices=4, trainer_kwargs=CLIP)),
        ("mlp dp2xpp2 gpipe+accumulate", dataclasses.replace(MLP_SPEC, strategy=_pp("gpipe", data_parallel_size=2), devices=4, trainer_kwargs=ACCUM)),
        # ZeRO inside the stages (FSDP2 per stage): 3 re-gathers per microbatch, 1 keeps them to the backward.
        ("gpt dp2xpp2 1f1b zero3+clip", dataclasses.replace(
            GPT_SPEC, strategy=_pp("1f1b", data_parallel_size=2, zero_stage=3), devices=4, trainer_kwargs=CLIP)),
        ("mlp dp2xpp2 gpipe zero1+accumulate", dataclasses.replace(
            MLP_SPEC, strategy=_pp("gpipe", data_parallel_size=2, zero_stage=1), devices=4, trainer_kwargs=ACCUM)),
    ]
    _check_fits(cases, 4, timeout=500)


# ---------------------------------------------------------------- validate / predict / checkpoint
def _loader(batch: int, start: int, count: int) -> DataLoader:
    data = token_data(num_samples=128)
    subset = torch.utils.data.Subset(data, range(start, start + count))
    return DataLoader(subset, batch_size=batch, shuffle=False, drop_last=True)


def _eval_run(strategy: Any, devices: int, ckpt_dir: str, model_cls: str = "lightning_parallel.models:GPT",
              model_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fit with validation and a ModelCheckpoint on val_loss, then validate and predict."""
    import lightning_parallel  # noqa: F401

    pl.seed_everything(7, verbose=False)
    model = parity._load(model_cls)(**(model_kwargs or GPT_KWARGS))
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", mode="min", save_top_k=1)
    every_epoch = ModelCheckpoint(dirpath=f"{ckpt_dir}/all", save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=parity._make_strategy(strategy), max_epochs=2, limit_train_batches=3,
        limit_val_batches=2, num_sanity_val_steps=1, use_distributed_sampler=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint, every_epoch],
    )
    trainer.fit(model, _loader(8, 0, 64), _loader(8, 64, 32))
    driver = getattr(trainer.strategy, "_pipeline", None)
    state = driver.model_state(full=True) if driver is not None else model.state_dict()
    validated = trainer.validate(model, _loader(8, 96, 32), verbose=False)
    predictions = trainer.predict(model, _loader(8, 96, 16))
    out = {
        "best": float(checkpoint.best_model_score),
        "best_path": Path(checkpoint.best_model_path).name,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "validated": validated,
        "predictions": torch.cat([p.cpu() for p in predictions]),
        "step": trainer.global_step,
        "state": {k: v.detach().cpu().clone() for k, v in state.items()},
    }
    # Load an older checkpoint into the already traced (pipeline) layout: the first epoch's weights.
    # (Loading also restores the callbacks' state, so everything above is read before.)
    out["validated_first"] = trainer.validate(
        model, _loader(8, 96, 32), ckpt_path=f"{ckpt_dir}/all/epoch=0-step=3.ckpt", verbose=False
    )
    return out


def _error_run(strategy: Any, global_batch: int, model: str = "lightning_parallel.models:GPT", kwargs: dict[str, Any] | None = None) -> str:
    """A fit that must fail on this rank before any stage sends; returns the message."""
    spec = dataclasses.replace(GPT_SPEC, model=model, model_kwargs=kwargs or GPT_KWARGS, strategy=strategy, devices=2, global_batch=global_batch, max_steps=1)
    try:
        run_fit(spec)
    except (ValueError, TypeError) as error:
        return str(error)
    return "no error"


class BranchyGPT(GPT):
    """A forward with a branch on a tensor's value: torch.export cannot capture it as one graph."""

    def forward(self, idx: Tensor) -> Tensor:
        if idx.sum() > 0:
            idx = idx.clone()
        return super().forward(idx)


def _eval_and_errors_worker(ckpt_dir: str) -> dict[str, Any]:
    out = _eval_run({**_pp("1f1b"), "class": "lightning_parallel:HybridParallelStrategy"}, 2, ckpt_dir)
    out["errors"] = [
        _error_run(_pp("1f1b", microbatches=1), 8),
        _error_run(_pp("1f1b", microbatches=4), 6),
        _error_run(_pp("gpipe"), 8, "tests.test_strategy_pp:BranchyGPT"),
    ]
    return out


def _assert_eval_matches(results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    for rank, result in enumerate(results):
        assert result["step"] == reference["step"] == 6
        assert result["best"] == pytest.approx(reference["best"], rel=1e-5), rank
        assert result["best_path"] == reference["best_path"] == "epoch=1-step=6.ckpt"
        for key, value in reference["callback_metrics"].items():
            assert result["callback_metrics"][key] == pytest.approx(value, rel=1e-5), (rank, key)
        assert result["validated"][0].keys() == reference["validated"][0].keys()
        for key, value in reference["validated"][0].items():
            assert result["validated"][0][key] == pytest.approx(value, rel=1e-5), (rank, key)
        torch.testing.assert_close(result["predictions"], reference["predictions"], rtol=1e-5, atol=1e-5)
        assert reference["validated_first"][0]["val_loss"] != pytest.approx(reference["validated"][0]["val_loss"], rel=1e-3)
        for key, value in reference["validated_first"][0].items():
            assert result["validated_first"][0][key] == pytest.approx(value, rel=1e-5), (rank, key)
        assert result["state"].keys() == reference["state"].keys()
        for key, value in reference["state"].items():
            torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {key}: {m}")


def test_pp2_validate_predict_checkpoint_and_errors(tmp_path: Path) -> None:
    results = run_distributed(_eval_and_errors_worker, 2, str(tmp_path / "pp"), init_backend=None, timeout=300)
    reference = _eval_run("auto", 1, str(tmp_path / "ref"))
    _assert_eval_matches(results, reference)
    for result in results:
        few, indivisible, branchy = result["errors"]
        assert "schedule '1f1b' needs at least as many microbatches as stages" in few
        assert "must be divisible by 4" in indivisible
        assert "cannot be captured as one graph" in branchy


# ---------------------------------------------------------------- bad input and helpers, no processes
def test_config_errors_before_any_process() -> None:
    model = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    with pytest.raises(ValueError, match="needs at least as many microbatches as stages"):
        resolve_pipeline_config(model, 2, "1f1b", 1, "auto", None)
    with pytest.raises(ValueError, match="more stages than blocks"):
        resolve_pipeline_config(model, 4, "1f1b", 4, "auto", None)
    with pytest.raises(ValueError, match="unknown schedule"):
        resolve_pipeline_config(model, 2, "zigzag", 2, "auto", None)
    with pytest.raises(ValueError, match="`cpu_offload`=True is invalid: it is not supported together with pipeline"):
        resolve_pipeline_config(model, 2, "1f1b", 2, "auto", None, zero_stage=3, cpu_offload=True)
    with pytest.raises(ValueError, match="runs one stage per rank"):
        resolve_pipeline_config(model, 2, "1f1b", 2, 2, None)
    config = resolve_pipeline_config(GPT(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16), 2, "zbv", "auto", "auto", None)
    assert (config.microbatches, config.virtual_stages, config.plan.num_stages) == (4, 2, 4)
    assert auto_microbatches(schedule_spec("gpipe"), 4) == 4


class TwiceGPT(GPT):
    """A training_step that calls forward twice (two half batches)."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        half = x.shape[0] // 2
        loss = self.compute_loss(self(x[:half]), y[:half]) + self.compute_loss(self(x[half:]), y[half:])
        self.log("train_loss", loss)
        return loss


def test_probes_find_forward_inputs_and_double_forward_without_side_effects() -> None:
    model = TwiceGPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    x = torch.randint(0, 32, (4, 8))
    batch = (x, torch.roll(x, -1, 1))
    args, kwargs = probe_forward_inputs(model, "training_step", (batch, 0), {})  # type: ignore[misc]
    assert kwargs == {} and len(args) == 1 and torch.equal(args[0], x[:2])
    assert count_forward_calls(model, "training_step", (batch, 0), {}) == 2
    plain = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    before = plain.train_acc._update_count
    assert count_forward_calls(plain, "training_step", (batch, 0), {}) == 1
    assert plain.train_acc._update_count == before and "forward" not in plain.__dict__ and "log" not in plain.__dict__


def test_microbatch_logs_reduce_to_the_full_batch_values() -> None:
    module = MLPClassifier(dims=[4, 3])
    metric: MulticlassAccuracy = module.train_acc
    per_mb = []
    for values, rows in (([0.5, 3.0], 2), ([1.5, 1.0], 6)):
        capture = LogCapture(module)
        capture("loss", torch.tensor(values[0]), prog_bar=True, batch_size=rows)
        capture("count", values[1], reduce_fx="sum")
        metric._forward_cache = torch.tensor(values[0])
        capture("acc", metric)
        per_mb.append((capture.records, rows))
    loss, count, acc = reduce_microbatch_logs(per_mb)
    assert float(loss.value) == pytest.approx((0.5 * 2 + 1.5 * 6) / 8) and loss.kwargs == {"prog_bar": True, "batch_size": 8}
    assert float(count.value) == 4.0 and acc.metric == "train_acc"
    with pytest.raises(TypeError, match="a logged value is a tensor, a number or a torchmetrics Metric"):
        LogCapture(module)("bad", "text")
