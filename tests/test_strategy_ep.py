"""Expert parallelism through the Trainer on the MoE GPT: ``ep`` and ep x dp match one process.

The reference is one process under the same strategy class (world size 1), so the MoE
auxiliary losses join the backpropagated loss the same way; the user's ``training_step`` is
unchanged in both. Routing is dropless, so the result does not depend on how tokens are grouped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fits
from tests.test_data_parallel import HYBRID, STEP_SYNC, assert_parity

MOE_SPEC = FitSpec(
    model="lightning_parallel.models:MoEGPT",
    model_kwargs={"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32, "lr": 0.5,
                  "num_experts": 4, "top_k": 2, "aux_loss_coef": 0.1, "z_loss_coef": 0.01},
    data="lightning_parallel.testing.parity:token_data",
    global_batch=8,
    max_steps=5,
    strategy={"class": HYBRID},
    trainer_kwargs={"gradient_clip_val": 0.5},
)


def _reference() -> dict[str, Any]:
    return run_distributed(run_fits, 1, [MOE_SPEC], init_backend=None, timeout=300)[0][0]


def _check(cases: list[tuple[str, dict[str, Any]]], devices: int) -> list[dict[str, Any]]:
    # STEP_SYNC: the accuracy is logged per step, so its step value is compared only if it syncs per step
    specs = [dataclasses.replace(MOE_SPEC, strategy={"class": HYBRID, **kw}, devices=devices, callbacks=STEP_SYNC) for _, kw in cases]
    results = run_distributed(run_fits, devices, specs, init_backend=None, timeout=500)
    reference = _reference()
    assert reference["metrics"]["moe_aux_loss"] > 0  # the auxiliary loss is really in play
    for (label, _), result in zip(cases, results[0]):
        assert_parity(result, reference, label, per_tensor=True)
        assert result["metrics"]["moe_aux_loss"] == pytest.approx(reference["metrics"]["moe_aux_loss"], rel=1e-5)
    return results[0]


def test_ep2_matches_single_process() -> None:
    results = _check([("ep2", {"expert_parallel_size": 2}), ("ep auto zero3", {"expert_parallel_size": "auto", "zero_stage": 3})], 2)
    expert_total = sum(v.numel() for k, v in results[0]["params"].items() if ".experts." in k)
    total = sum(v.numel() for v in results[0]["params"].values())
    assert results[0]["layout"]["local_param_numel"] == total - expert_total // 2  # experts split in two


@pytest.mark.slow
def test_ep2_dp2_matches_single_process() -> None:
    _check(
        [
            ("ep2xedp2 zero0", {"expert_parallel_size": 2}),
            ("ep2xedp2 zero3", {"expert_parallel_size": 2, "zero_stage": 3}),
            # 4D minus pipelines: attention split over tp, experts over the dp ranks of each tp column.
            ("ep2 x tp2", {"expert_parallel_size": 2, "tensor_parallel_size": 2}),
        ],
        4,
    )
