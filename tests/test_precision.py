"""``Trainer(precision=...)`` means the same under every layout (strategies/precision.py).

One spawned run of 2 ranks and one of 4 train the package's GPT (MoE GPT for ``ep``) under each
layout and record, per step, what the user's step sees: the logits' dtype (the compute dtype
under ``bf16-mixed``), the targets' and a float mask's dtypes (never cast: int64 and float32),
the loss's dtype (fp32: autocast computes ``cross_entropy`` in fp32), and after backward the
dtypes of the parameters and gradients this rank holds (fp32 master weights, gradients reduced
in fp32). Losses are compared with ONE process of the same precision.

Tolerances, and why: bf16 keeps 8 significant bits (unit roundoff 2**-8 = 3.9e-3). The layouts
round in other places than one process does: FSDP2 gathers parameters in bf16 (one rounding
each, where autocast rounds per op), tensor parallelism sums partial matmuls in another order,
pipelines run the same ops per microbatch. A loss over 128 tokens averages those roundings.
Measured worst relative loss difference over the 5 steps (SGD lr 0.5, clipping 0.5): 6.8e-5
(zero3), 5.0e-5 (tp), 4.1e-5 (pp2 x tp2), 2.7e-5 (pp), 2.4e-5 (dp) -- so ``BF16_RTOL`` = 2e-3,
half a bf16 unit and 30 x the worst. A mixture of experts routes each token to its top-k
experts: a router score that moves by an ulp can flip a choice, a discrete jump (measured 6.0e-3
under ep=2), so ``MOE_BF16_RTOL`` = 2e-2, 5 bf16 units. fp16 keeps 11 bits (4.9e-4): measured
6.4e-6 (zero3), 2.5e-6 (pp); ``FP16_RTOL`` = 5e-4, one fp16 unit. The losses alone cannot tell bf16
from fp32 here (one process: 3.3e-5 apart), which is why the dtypes are checked directly.
``bf16-true`` (pp): the weights themselves are bf16, so each SGD update is rounded to a bf16
unit, and the pipeline averages per-microbatch bf16 losses where one process takes one bf16
mean: measured 7.8e-3 (2 bf16 units), ``BF16_TRUE_RTOL`` = 2e-2 (5 units).
Also here: 16-mixed (fp16 logits, one process's loss-scale sequence under ``ShardedGradScaler``),
activation checkpointing inside pipeline stages (exact fp32 parity, every block recomputed), and
the strategy's deprecated ``mixed_precision=`` (an alias of the Trainer's precision).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import MixedPrecision
import pytest
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from lightning_parallel.models import GPT, MoEGPT
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fit, token_data
from tests.test_data_parallel import HYBRID

BF16_RTOL = 2e-3
MOE_BF16_RTOL = 2e-2
FP16_RTOL = 5e-4
BF16_TRUE_RTOL = 2e-2
GPT_KWARGS = {"vocab_size": 64, "block_size": 16, "n_layer": 4, "n_head": 4, "n_embd": 32, "lr": 0.5}
MOE_KWARGS = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32, "lr": 0.5,
              "num_experts": 4, "top_k": 2, "aux_loss_coef": 0.1, "z_loss_coef": 0.01}
RECORDER = ("tests.test_precision:DtypeRecorder", {})


# ---------------------------------------------------------------- what the step sees
class _Probe:
    """Records the dtypes the user's step sees; batches are ``(tokens, targets, mask)``."""

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets, mask = batch
        self._mask_dtype = str(mask.dtype)
        return super().training_step((inputs, targets), batch_idx)  # type: ignore[misc]

    def compute_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        loss = super().compute_loss(logits, targets)  # type: ignore[misc]
        self._probe = {"logits": str(logits.dtype), "targets": str(targets.dtype), "loss": str(loss.dtype)}
        return loss


class ProbeGPT(_Probe, GPT):
    pass


class ProbeMoEGPT(_Probe, MoEGPT):
    pass


def masked_token_data(**kwargs: Any) -> TensorDataset:
    """``token_data`` plus a float32 per-token mask: a float input FSDP2's root must not cast."""
    x, y = token_data(**kwargs).tensors
    return TensorDataset(x, y, torch.ones(y.shape, dtype=torch.float32))


_RECORDS: dict[str, list[Any]] = {}


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class DtypeRecorder(pl.Callback):
    """Per step: the probe's dtypes (on the rank that ran the loss), the held parameters' and
    gradients' dtypes after backward, the grad scaler's scale; at the end, the scaler's class
    and the blocks pipeline stages recompute."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        held = [p for p in pl_module.parameters() if p.grad is not None and _local(p).numel() > 0]
        _RECORDS["params"].append(sorted({str(p.dtype) for p in held}))
        _RECORDS["grads"].append(sorted({str(p.grad.dtype) for p in held}))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        _RECORDS["probe"].append(getattr(pl_module, "_probe", None))
        _RECORDS["mask"].append(getattr(pl_module, "_mask_dtype", None))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        _RECORDS["scale"].append(float(scaler.get_scale()) if scaler is not None else None)
        pl_module.__dict__.pop("_probe", None)  # the next step must set it again

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        _RECORDS["scaler"].append(type(scaler).__name__ if scaler is not None else None)
        driver = getattr(trainer.strategy, "_pipeline", None)
        _RECORDS["checkpointed"].append(list(driver.checkpointed) if driver is not None else None)


def fit_and_record(specs: list[FitSpec]) -> list[dict[str, Any]]:
    out = []
    for spec in specs:
        _RECORDS.clear()
        _RECORDS.update({k: [] for k in ("params", "grads", "probe", "mask", "scale", "scaler", "checkpointed")})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            result = run_fit(spec)
        result["records"] = {k: list(v) for k, v in _RECORDS.items()}
        out.append(result)
    return out


# ---------------------------------------------------------------- specs
def _spec(precision: str, strategy: Any = "auto", devices: int = 1, moe: bool = False, **extra: Any) -> FitSpec:
    """On the CPU Lightning turns ``Trainer(precision="16-mixed")`` into bf16-mixed (no fp16 AMP
    there, it says), so fp16 goes through the plugin, with a scaler that overflows in the first
    step: at 2**24 the fp16 gradients overflow (65504) by far, so the step is skipped; backed off
    to 2**16 they are far from it (one process overflows from about 2**19 on here), so later steps
    train, and no layout's round-off can flip a skip decision."""
    callbacks = [RECORDER]
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, backoff_factor=2.0**-8)
        extra["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    else:
        extra["precision"] = precision
    return FitSpec(
        model=f"tests.test_precision:{'ProbeMoEGPT' if moe else 'ProbeGPT'}",
        model_kwargs=MOE_KWARGS if moe else GPT_KWARGS,
        data="tests.test_precision:masked_token_data",
        global_batch=8, max_steps=extra.pop("max_steps", 5), strategy=strategy, devices=devices,
        trainer_kwargs={"gradient_clip_val": 0.5, **extra}, callbacks=callbacks,
    )


PP = {"class": HYBRID, "pipeline_parallel_size": 2, "pipeline_schedule": "1f1b"}
TWO_RANKS: list[tuple[str, FitSpec, str]] = [  # label, spec, reference key
    ("dp", _spec("bf16-mixed", "dp", 2), "bf16"),
    ("zero3", _spec("bf16-mixed", "zero3", 2), "bf16"),
    ("tp", _spec("bf16-mixed", {"class": HYBRID, "tensor_parallel_size": 2}, 2), "bf16"),
    ("ep", _spec("bf16-mixed", {"class": HYBRID, "expert_parallel_size": 2}, 2, moe=True), "moe_bf16"),
    ("pp", _spec("bf16-mixed", PP, 2), "bf16"),
    ("dp via mixed_precision=", _spec("32-true", {"class": HYBRID, "mixed_precision": "bf16-mixed"}, 2), "bf16"),
    ("zero3 16-mixed", _spec("16-mixed", "zero3", 2, max_steps=8), "fp16"),
    ("pp 16-mixed", _spec("16-mixed", PP, 2, max_steps=8), "fp16"),
    ("tp 16-mixed", _spec("16-mixed", {"class": HYBRID, "tensor_parallel_size": 2}, 2, max_steps=8), "fp16"),
    ("pp 32-true + activation checkpointing", _spec("32-true", {**PP, "activation_checkpointing": True}, 2), "fp32"),
    ("pp bf16-true", _spec("bf16-true", PP, 2), "bf16_true"),
]
FOUR_RANKS: list[tuple[str, FitSpec, str]] = [
    ("pp2 x tp2", _spec("bf16-mixed", {"class": HYBRID, "pipeline_parallel_size": 2, "tensor_parallel_size": 2}, 4), "bf16"),
    ("pp2 x dp2 zero1", _spec("bf16-mixed", {**PP, "zero_stage": 1}, 4), "bf16"),
]
REFERENCES = {
    "bf16": _spec("bf16-mixed"),
    "moe_bf16": _spec("bf16-mixed", moe=True),
    "fp16": _spec("16-mixed", max_steps=8),
    "fp32": _spec("32-true"),
    "bf16_true": _spec("bf16-true"),
}
F32, BF16, F16 = "torch.float32", "torch.bfloat16", "torch.float16"
# reference key -> (logits, loss, float mask, held parameters and gradients) as the step sees them
EXPECTED = {
    "bf16": (BF16, F32, F32, F32), "moe_bf16": (BF16, F32, F32, F32), "fp16": (F16, F32, F32, F32), "fp32": (F32, F32, F32, F32),
    # bf16-true as in Lightning: the module is bf16, and its plugin converts every float tensor of the batch
    "bf16_true": (BF16, BF16, BF16, BF16),
}


def _check_dtypes(label: str, per_rank: list[dict[str, Any]], key: str) -> None:
    steps = len(per_rank[0]["losses"])
    for step in range(steps):
        probes = [r["records"]["probe"][step] for r in per_rank if r["records"]["probe"][step] is not None]
        assert probes, f"{label} step {step}: no rank ran the loss"
        logits, loss, mask, held = EXPECTED[key]
        for probe in probes:
            assert probe == {"logits": logits, "targets": "torch.int64", "loss": loss}, f"{label} step {step}: {probe}"
        masks = {r["records"]["mask"][step] for r in per_rank} - {None}
        assert masks == {mask}, f"{label} step {step}: the float mask arrived as {masks}"
    for rank, r in enumerate(per_rank):
        assert r["records"]["params"] and all(d == [held] for d in r["records"]["params"]), f"{label} rank {rank}"
        assert all(d == [held] for d in r["records"]["grads"]), f"{label} rank {rank}: {r['records']['grads']}"


def _check_losses(label: str, result: dict[str, Any], reference: dict[str, Any], rtol: float) -> float:
    got, want = torch.tensor(result["losses"]), torch.tensor(reference["losses"])
    assert len(got) == len(want) >= 5, label
    torch.testing.assert_close(got, want, rtol=rtol, atol=0, msg=lambda m: f"{label}: {m}")
    return float(((got - want).abs() / want.abs()).max())


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    return dict(zip(REFERENCES, fit_and_record(list(REFERENCES.values()))))


def test_reference_runs_compute_in_their_precision(references: dict[str, dict[str, Any]]) -> None:
    for key, ref in references.items():
        _check_dtypes(f"one process {key}", [ref], key)
    bf16, fp32 = torch.tensor(references["bf16"]["losses"]), torch.tensor(references["fp32"]["losses"])
    print("one process, bf16-mixed vs 32-true: relative loss difference", float(((bf16 - fp32).abs() / fp32).max()))
    scales = references["fp16"]["records"]["scale"]
    assert scales == [2.0**16] * len(scales), scales  # the first step overflowed and was skipped, the scale backed off
    norms = references["fp16"]["grad_norms"]  # unscaled, before the optimizer step: non-finite on the skipped step only
    assert not math.isfinite(norms[0]) and all(math.isfinite(g) for g in norms[1:]), norms


def test_every_layout_honours_the_trainers_precision(references: dict[str, dict[str, Any]]) -> None:
    two = run_distributed(fit_and_record, 2, [s for _, s, _ in TWO_RANKS], init_backend=None, timeout=560)
    four = run_distributed(fit_and_record, 4, [s for _, s, _ in FOUR_RANKS], init_backend=None, timeout=400)
    worst: dict[str, float] = {}
    for cases, results in ((TWO_RANKS, two), (FOUR_RANKS, four)):
        for i, (label, spec, key) in enumerate(cases):
            per_rank = [rank[i] for rank in results]
            _check_dtypes(label, per_rank, key)
            reference = references[key]
            if key == "fp32":  # exact parity, and the stages really recompute their blocks
                worst[label] = _check_losses(label, per_rank[0], reference, 1e-5)
                for name, ref in reference["params"].items():
                    torch.testing.assert_close(per_rank[0]["params"][name], ref, rtol=1e-5, atol=1e-6)
                held = [r["records"]["checkpointed"][0] for r in per_rank]
                assert all(held) and sorted(sum(held, [])) == [f"blocks.{i}" for i in range(4)], held
                continue
            rtol = {"fp16": FP16_RTOL, "moe_bf16": MOE_BF16_RTOL, "bf16_true": BF16_TRUE_RTOL}.get(key, BF16_RTOL)
            for rank, r in enumerate(per_rank):
                worst[f"{label} rank {rank}"] = _check_losses(f"{label} rank {rank}", r, reference, rtol)
            if key == "fp16":
                for r in per_rank:
                    assert r["records"]["scaler"] == ["LayoutGradScaler"], label
                    assert r["records"]["scale"] == reference["records"]["scale"], f"{label}: {r['records']['scale']}"
    print("worst relative loss difference per layout:", {k: f"{v:.1e}" for k, v in worst.items()})


# ---------------------------------------------------------------- no process group
def test_mixed_precision_is_a_deprecated_alias_of_the_trainers_precision() -> None:
    from lightning_parallel import HybridParallelStrategy
    from lightning_parallel.strategies.precision import resolve_precision_plugin
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    with pytest.warns(DeprecationWarning, match=r"mixed_precision='bf16-mixed'.*Trainer\(precision='bf16-mixed'\)"):
        HybridParallelStrategy(mixed_precision="bf16-mixed")
    plugin = resolve_precision_plugin(Precision(), "bf16-mixed", "cpu")
    assert isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed"
    same = MixedPrecision("bf16-mixed", "cpu")
    assert resolve_precision_plugin(same, "bf16-mixed", "cpu") is same
    with pytest.raises(ValueError, match=r"`mixed_precision`='bf16-mixed' is invalid: it contradicts Trainer\(precision='16-mixed'\).*HINT"):
        resolve_precision_plugin(MixedPrecision("16-mixed", "cpu"), "bf16-mixed", "cpu")


def test_contradicting_precisions_fail_before_any_process_group() -> None:
    import torch.distributed as dist

    from lightning_parallel import HybridParallelStrategy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        strategy = HybridParallelStrategy(mixed_precision="16-mixed")
    trainer = pl.Trainer(accelerator="cpu", devices=2, precision="bf16-true", logger=False, strategy=strategy)
    with pytest.raises(ValueError, match=r"`mixed_precision`='16-mixed' is invalid: it contradicts Trainer\(precision='bf16-true'\)"):
        trainer.strategy.setup_environment()
    assert not (dist.is_available() and dist.is_initialized())
