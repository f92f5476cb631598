"""Multi-process parity of the data-parallel presets with single-process training (gloo, CPU).

Each spawned run fits several strategies in one process group, so the start-up cost is paid
once. Every fit is compared with an in-process single-device fit of the same spec: per-step
logged losses (``sync_dist=True``), final parameters, and the torchmetrics epoch metric.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fit, run_fits
from tests import gradient_probes

MODEL = "tests.tiny_models:TinyNet"
CLIP = {"gradient_clip_val": 0.3}
ACCUM = {"accumulate_grad_batches": 2}
HYBRID = "lightning_parallel:HybridParallelStrategy"


def _spec(strategy: Any, devices: int, trainer_kwargs: dict[str, Any], callbacks: list[Any] | None = None) -> FitSpec:
    return FitSpec(model=MODEL, strategy=strategy, devices=devices, max_steps=5, trainer_kwargs=trainer_kwargs,
                   callbacks=callbacks or [])


def _reference(spec: FitSpec) -> dict[str, Any]:
    return run_fit(dataclasses.replace(spec, strategy="auto", devices=1))


class SyncMetricsOnStep:
    """Callback: every torchmetrics object syncs per step (``dist_sync_on_step=True``), the user's
    choice that makes a Metric's step value the single-process one on every rank. The strategy
    leaves that flag to the user, as Lightning's DDP does, and only chooses the group (the
    data-parallel ranks); parity tests that compare step values under dp > 1 ask for it."""

    def __new__(cls) -> Any:
        from lightning.pytorch import Callback
        from torchmetrics import Metric

        class _Sync(Callback):
            def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
                for metric in pl_module.modules():
                    if isinstance(metric, Metric):
                        metric.dist_sync_on_step = True

        return _Sync()


STEP_SYNC = [("tests.test_data_parallel:SyncMetricsOnStep", {})]


class MetricFlagProbe:
    """Callback: at the end of fit, how many torchmetrics objects sync per step (a metric): the
    strategy must leave the module's own ``dist_sync_on_step`` (False here) as it found it."""

    def __new__(cls) -> Any:
        from lightning.pytorch import Callback
        from torchmetrics import Metric

        class _Probe(Callback):
            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                synced = sum(1 for m in pl_module.modules() if isinstance(m, Metric) and m.dist_sync_on_step)
                trainer.callback_metrics["metrics_synced_per_step"] = torch.tensor(float(synced))

        return _Probe()


def assert_parity(
    result: dict[str, Any], reference: dict[str, Any], label: str, *, per_tensor: bool = False, metrics: bool = True
) -> None:
    """Losses within relative 1e-5 per step; parameters within relative 1e-5 element-wise (atol 1e-6),
    or with ``per_tensor`` as ``||a - b|| / ||b||`` per tensor, for layouts that reorder sums."""
    assert len(result["losses"]) == len(reference["losses"]) >= 5, label
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0, msg=lambda m: f"{label}: {m}"
    )
    assert result["params"].keys() == reference["params"].keys(), label
    for name, ref in reference["params"].items():
        if per_tensor:
            error = float((result["params"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
            assert error <= 1e-5 or float(ref.norm()) < 1e-8, f"{label} {name}: relative error {error:.2e}"
        else:
            torch.testing.assert_close(result["params"][name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} {name}: {m}")
    if metrics:
        assert result["metrics"]["train_acc"] == pytest.approx(reference["metrics"]["train_acc"], rel=1e-6), label


TWO_RANK_CASES: list[tuple[str, Any, dict[str, Any]]] = [
    ("dp+clip", "dp", CLIP),
    ("zero1+clip", "zero1", CLIP),
    ("zero2+clip", "zero2", CLIP),
    ("zero3+clip", "zero3", CLIP),
    ("fsdp2+clip", "fsdp2", CLIP),
    ("zero3_offload+clip", "zero3_offload", CLIP),
    ("dp+accumulate", "dp", ACCUM),
    ("zero1+accumulate", "zero1", {**ACCUM, **CLIP}),
    ("zero3+accumulate+clip", "zero3", {**ACCUM, **CLIP}),
    ("zero3+activation_checkpointing", {"class": HYBRID, "zero_stage": 3, "activation_checkpointing": True}, CLIP),
    ("dp+activation_checkpointing", {"class": HYBRID, "zero_stage": 0, "activation_checkpointing": True}, {}),
]


def test_two_rank_presets_match_single_process() -> None:
    probe = [("tests.test_data_parallel:MetricFlagProbe", {})]
    # The gradients Lightning's zero_grad drops are freed before the forward, unless a callback
    # looks at them in on_before_zero_grad (tests/gradient_probes.py).
    grads = {label: gradient_probes.SEEN if label == "zero3+accumulate+clip" else gradient_probes.FREED
             for label, _, _ in TWO_RANK_CASES}
    specs = [_spec(strategy, 2, kwargs, probe + grads[label]) for label, strategy, kwargs in TWO_RANK_CASES]
    results = run_distributed(run_fits, 2, specs, init_backend=None, timeout=400)
    for rank_results in results:  # every rank logs the same reduced values and holds the same full params
        for (label, _, _), spec, result in zip(TWO_RANK_CASES, specs, rank_results):
            assert result["metrics"].pop("metrics_synced_per_step") == 0, label  # the user's flag, not ours
            reference = _reference(dataclasses.replace(spec, callbacks=[]))
            if "clip" in label:
                assert max(reference["grad_norms"]) > 0.3, "the clipping threshold must actually clip"
            assert_parity(result, reference, label)
    layouts = {label: r["layout"] for (label, _, _), r in zip(TWO_RANK_CASES, results[0])}
    total = sum(p.numel() for p in results[0][0]["params"].values())
    assert layouts["dp+clip"]["model"] == "DistributedDataParallel"
    assert layouts["zero1+clip"]["optimizer"] == "ZeroRedundancyOptimizer"
    assert layouts["zero1+clip"]["local_param_numel"] == total
    for label in ("zero2+clip", "zero3+clip", "zero3_offload+clip"):
        assert layouts[label]["local_param_numel"] < 0.6 * total, label  # parameters really are sharded


def test_four_rank_hsdp_and_dp_match_single_process() -> None:
    cases = [("hsdp", "hsdp", CLIP), ("dp4", "dp", CLIP), ("zero3x4", "zero3", ACCUM)]
    specs = [_spec(strategy, 4, kwargs) for _, strategy, kwargs in cases]
    results = run_distributed(run_fits, 4, specs, init_backend=None, timeout=400)
    for (label, _, _), spec, result in zip(cases, specs, results[0]):
        assert_parity(result, _reference(spec), label)
    total = sum(p.numel() for p in results[0][0]["params"].values())
    hsdp_local = results[0][0]["layout"]["local_param_numel"]
    zero3_local = results[0][2]["layout"]["local_param_numel"]
    assert 0.4 * total < hsdp_local < 0.6 * total  # sharded in pairs, replicated across pairs
    assert zero3_local < 0.3 * total  # sharded four ways


def _save_worker(strategy: str, directory: str) -> dict[str, Any]:
    """Fit 3 steps with momentum, then save both formats through Lightning's own save path."""
    import lightning.pytorch as pl

    from lightning_parallel.testing.parity import classification_data, full_parameters
    from tests.tiny_models import TinyNet

    import lightning_parallel

    out = {}
    for sharded in (True, False):
        pl.seed_everything(0, verbose=False)
        model = TinyNet(momentum=0.9)
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            strategy=lightning_parallel.strategy_from_name(strategy, save_distributed_checkpoint=sharded),
        )
        loader = torch.utils.data.DataLoader(classification_data(), batch_size=8)
        if sharded:
            trainer.fit(model, loader)
        else:
            trainer.fit(model, loader, ckpt_path=str(Path(directory) / "sharded.ckpt"))  # loads the sharded dir
        trainer.save_checkpoint(str(Path(directory) / ("sharded.ckpt" if sharded else "full.ckpt")))
        out["sharded" if sharded else "full"] = full_parameters(model)
    return out


@pytest.mark.parametrize("strategy", ["zero3", "zero1"])
def test_checkpoints_keep_original_names(tmp_path: Path, strategy: str) -> None:
    import torch.distributed.checkpoint as dcp

    from tests.tiny_models import TinyNet

    results = run_distributed(_save_worker, 2, strategy, str(tmp_path), init_backend=None, timeout=300)
    saved = results[0]["full"]
    names = {n for n, _ in TinyNet().named_parameters()}
    full = torch.load(tmp_path / "full.ckpt", weights_only=False)
    assert set(full["state_dict"]) == names
    fresh = TinyNet()
    fresh.load_state_dict(full["state_dict"], strict=True)  # loads into the unwrapped module
    for name, value in fresh.named_parameters():
        torch.testing.assert_close(value.detach(), saved[name], rtol=0, atol=0)
    optim = full["optimizer_states"][0]
    assert set(optim["state"]) == names and all("momentum_buffer" in s for s in optim["state"].values())
    assert full["global_step"] == 3  # the second fit resumed from the sharded checkpoint at step 3 and stopped
    # The sharded directory reads back without any process group, under the same names.
    template = {"state_dict": {n: torch.empty_like(v) for n, v in results[0]["sharded"].items()}}
    dcp.load(template, checkpoint_id=str(tmp_path / "sharded.ckpt"))
    for name, value in template["state_dict"].items():
        torch.testing.assert_close(value, results[0]["sharded"][name], rtol=0, atol=0)


def test_bf16_mixed_precision_trains_close_to_fp32() -> None:
    """Trainer(precision="bf16-mixed"): bf16 compute (autocast, plus the FSDP2 policy for zero3) with fp32
    master weights and reductions; close to fp32 (tests/test_precision.py compares with one bf16 process)."""
    cases = [("zero3 bf16", {"class": HYBRID, "zero_stage": 3}), ("dp bf16", {"class": HYBRID, "zero_stage": 0})]
    specs = [_spec(strategy, 2, {"precision": "bf16-mixed"}) for _, strategy in cases]
    results = run_distributed(run_fits, 2, specs, init_backend=None, timeout=300)[0]
    reference = _reference(dataclasses.replace(specs[0], trainer_kwargs={}))  # fp32
    for (label, _), result in zip(cases, results):
        assert all(p.dtype == torch.float32 for p in result["params"].values()), label  # fp32 master weights
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=3e-2, atol=0)
        assert result["losses"] != reference["losses"], f"{label}: bf16 compute must actually be in effect"
        assert result["losses"][-1] < result["losses"][0], label
