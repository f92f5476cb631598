"""On CUDA (skipped elsewhere): the parity matrix on NCCL, and bf16 + compile on one device.

The CPU suite proves each layout against one process on gloo; this proves the same on the backend
users run, where a collective given a CPU tensor fails ("No backend type associated with device
type cpu") and where bf16 kernels differ. fp32 parity with one GPU, relative 1e-5 per step and per
tensor, TF32 off (it would change the reference's matmuls). Sized to finish in a few minutes on 2 GPUs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fit, run_fits
from tests.test_data_parallel import HYBRID
from tests.test_strategy_ep import MOE_SPEC
from tests.test_strategy_tp import GPT_SPEC

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CUDA = {"accelerator": "cuda"}
# The CPU suite's specs (same models, data, clipping), on CUDA
GPT = dataclasses.replace(GPT_SPEC, trainer_kwargs={**GPT_SPEC.trainer_kwargs, **CUDA})
MOE = dataclasses.replace(MOE_SPEC, trainer_kwargs={**MOE_SPEC.trainer_kwargs, **CUDA})
TWO_GPU: list[tuple[str, FitSpec]] = [
    (name, dataclasses.replace(GPT, strategy=name, devices=2)) for name in ("dp", "zero1", "zero2", "zero3", "zero3_offload", "tp", "pp")
] + [("ep2", dataclasses.replace(MOE, strategy={"class": HYBRID, "expert_parallel_size": 2}, devices=2))]


def _close(result: dict[str, Any], reference: dict[str, Any], label: str) -> None:
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0,
                               msg=lambda m: f"{label}: {m}")
    for name, ref in reference["params"].items():
        error = float((result["params"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert error <= 1e-5 or float(ref.norm()) < 1e-8, f"{label} {name}: {error:.2e}"


@pytest.fixture(autouse=True)
def _no_tf32() -> Any:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA devices")
def test_two_gpu_layouts_match_one_gpu_on_nccl() -> None:
    results = run_distributed(run_fits, 2, [spec for _, spec in TWO_GPU], init_backend=None, timeout=900)[0]
    gpt_reference = run_fit(dataclasses.replace(GPT, strategy="auto", devices=1))
    moe_reference = run_distributed(run_fits, 1, [MOE], init_backend=None, timeout=300)[0][0]
    for (label, spec), result in zip(TWO_GPU, results):
        _close(result, moe_reference if spec.model == MOE.model else gpt_reference, label)


@pytest.mark.skipif(GPUS < 4, reason="needs 4 CUDA devices")
def test_3d_on_four_gpus_matches_one_gpu() -> None:
    spec = dataclasses.replace(GPT, strategy="3d", devices=4)
    result = run_distributed(run_fits, 4, [spec], init_backend=None, timeout=600)[0][0]
    _close(result, run_fit(dataclasses.replace(GPT, strategy="auto", devices=1)), "3d")


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", ["dp", "zero2", "zero3"])
def test_bf16_mixed_with_compiled_blocks_on_one_gpu(strategy: str) -> None:
    """One device, bf16-mixed, inductor: finite losses that fall, and close to uncompiled bf16 (bf16 tolerance)."""
    from lightning_parallel.strategies.registry import strategy_from_name

    kwargs = {**GPT.trainer_kwargs, "precision": "bf16-mixed"}
    spec = dataclasses.replace(GPT, devices=1, max_steps=8, trainer_kwargs=kwargs)
    compiled = run_fit(dataclasses.replace(spec, strategy=strategy_from_name(strategy, compile_blocks=True)))
    eager = run_fit(dataclasses.replace(spec, strategy=strategy_from_name(strategy)))
    losses = torch.tensor(compiled["losses"])
    assert torch.isfinite(losses).all() and losses[-1] < losses[0]
    torch.testing.assert_close(losses, torch.tensor(eager["losses"]), rtol=2e-2, atol=0)
