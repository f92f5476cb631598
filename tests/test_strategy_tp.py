"""Tensor parallelism through the Trainer: `tp` (with and without sequence parallelism) and
dp x tp (ZeRO 0 and 3) match one process in losses, parameters and the logged accuracy.

The GPT here is the package's own, unchanged: its attention reshapes with the global head
count and calls ``F.scaled_dot_product_attention``; the strategy finds the plan itself.
Gradient clipping is active in every case: under sequence parallelism the norm weights'
gradients come out of DTensor autograd as ``Partial`` sums, and a clipping norm that read them
as shards was off by 2e-5 (relative), enough to move ``tok_emb`` by 1.8e-5 in five steps.
The logged ``train_acc`` is a torchmetrics object logged per step: Lightning logs its
``forward`` value, which is the rank's own batch unless the metric syncs on step over the
data-parallel ranks, so dp x tp compares it too. ``loss_parallel=True`` runs the same unchanged
step on vocabulary-sharded logits, checked by probes that the full logits are never kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fits
from tests.test_data_parallel import HYBRID, STEP_SYNC, _reference, assert_parity

GPT_SPEC = FitSpec(
    model="lightning_parallel.models:GPT",
    model_kwargs={"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32, "lr": 0.5},
    data="lightning_parallel.testing.parity:token_data",
    global_batch=8,
    max_steps=5,
    trainer_kwargs={"gradient_clip_val": 0.5},
)


def _check(cases: list[tuple[str, Any]], devices: int) -> list[dict[str, Any]]:
    # STEP_SYNC: the GPT's accuracy is logged per step; under dp2 x tp2 it then syncs over the dp ranks only
    specs = [dataclasses.replace(GPT_SPEC, strategy=strategy, devices=devices, callbacks=STEP_SYNC) for _, strategy in cases]
    results = run_distributed(run_fits, devices, specs, init_backend=None, timeout=500)
    reference = _reference(GPT_SPEC)
    assert max(reference["grad_norms"]) > 0.5  # clipping is active
    for (label, _), result in zip(cases, results[0]):
        # Per-tensor relative error (||a - b|| / ||b|| <= 1e-5): the row-parallel layers sum partial
        # products in another order than one process, element-wise errors of near-zero entries are noise.
        assert_parity(result, reference, label, per_tensor=True, metrics=True)
    return results[0]


def test_tp2_matches_single_process() -> None:
    results = _check(
        [
            ("tp", "tp"),
            ("tp explicit", {"class": HYBRID, "tensor_parallel_size": 2}),
            ("tp sequence_parallel", {"class": HYBRID, "tensor_parallel_size": 2, "sequence_parallel": True}),
        ],
        2,
    )
    total = sum(p.numel() for p in results[0]["params"].values())
    assert results[0]["layout"]["local_param_numel"] < 0.6 * total  # the plan really shards
    assert results[2]["layout"]["local_param_numel"] == results[0]["layout"]["local_param_numel"]


@pytest.mark.slow
def test_dp2_tp2_zero0_and_zero3_match_single_process() -> None:
    results = _check(
        [
            ("dp2xtp2 zero0", {"class": HYBRID, "tensor_parallel_size": 2, "zero_stage": 0}),
            ("dp2xtp2 zero3", {"class": HYBRID, "tensor_parallel_size": 2, "zero_stage": 3}),
            ("dp2xtp2 zero3 loss_parallel", {"class": HYBRID, "tensor_parallel_size": 2, "zero_stage": 3, "loss_parallel": True}),
        ],
        4,
    )
    total = sum(p.numel() for p in results[0]["params"].values())
    assert results[1]["layout"]["local_param_numel"] < 0.3 * total  # tp and dp sharding multiply


class ProbeGPT:
    """The package's GPT, unchanged, plus two probes logged from its training step: the largest
    tensor (local elements) saved for the backward, and whether the LM head's output is a
    vocabulary-sharded DTensor. Built lazily so importing this test module stays cheap."""

    def __new__(cls, **kwargs: Any) -> Any:
        import torch
        from torch.distributed.tensor import DTensor

        from lightning_parallel.models import GPT

        class _ProbeGPT(GPT):
            def training_step(self, batch: Any, batch_idx: int) -> Any:
                saved: list[int] = []
                head: list[float] = []

                def pack(t: torch.Tensor) -> torch.Tensor:
                    saved.append((t.to_local() if isinstance(t, DTensor) else t).numel())
                    return t

                def record(module: Any, args: Any, out: Any) -> None:
                    sharded = isinstance(out, DTensor) and out.placements[0].is_shard(out.ndim - 1)
                    head.append(float(sharded and out.to_local().shape[-1] < out.shape[-1]))

                handle = self.lm_head.register_forward_hook(record)
                try:
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        loss = super().training_step(batch, batch_idx)
                finally:
                    handle.remove()
                self.log("probe_max_saved_numel", float(max(saved)))
                self.log("probe_head_sharded", head[0])
                return loss

        return _ProbeGPT(**kwargs)


def test_tp2_loss_parallel_matches_single_process() -> None:
    """``loss_parallel=True``: the unchanged GPT step (cross-entropy on ``logits.view(-1, V)``, a
    torchmetrics accuracy from ``argmax``) matches one process, and the full logits are never
    kept: the largest saved tensor is the half-vocabulary log-softmax. The plain ``tp`` run is
    the control that shows the probe does see the gathered logits (``B*T*V`` elements)."""
    vocab, batch, block = 256, 8, 16
    spec = dataclasses.replace(
        GPT_SPEC, model="tests.test_strategy_tp:ProbeGPT", model_kwargs={**GPT_SPEC.model_kwargs, "vocab_size": vocab},
        data_kwargs={"vocab_size": vocab, "block_size": block}, global_batch=batch,
    )
    cases = [
        ("tp2 loss_parallel", {"class": HYBRID, "tensor_parallel_size": 2, "loss_parallel": True}),
        ("tp2 loss_parallel sequence_parallel",
         {"class": HYBRID, "tensor_parallel_size": 2, "loss_parallel": True, "sequence_parallel": True}),
        ("tp2 gathered logits (control)", {"class": HYBRID, "tensor_parallel_size": 2}),
    ]
    specs = [dataclasses.replace(spec, strategy=strategy, devices=2) for _, strategy in cases]
    results = run_distributed(run_fits, 2, specs, init_backend=None, timeout=500)[0]
    reference = _reference(spec)
    assert max(reference["grad_norms"]) > 0.5  # clipping is active
    full_logits = batch * block * vocab
    for (label, _), result in zip(cases, results):
        assert_parity(result, reference, label, per_tensor=True, metrics=True)
        sharded = "loss_parallel" in label
        assert result["metrics"]["probe_head_sharded"] == float(sharded), label
        if sharded:
            assert result["metrics"]["probe_max_saved_numel"] <= full_logits // 2, (label, result["metrics"])
        else:
            assert result["metrics"]["probe_max_saved_numel"] >= full_logits, (label, result["metrics"])
