"""On two or more GPUs (skipped elsewhere): ZeRO-3 with CPU offload and gradient clipping on NCCL.

The offloaded gradients live on the CPU; the global-norm clipping all-reduces their norms
there, which needs the CPU half of the ``cuda:nccl,cpu:gloo`` backend the strategy picks
(``strategies/process_group.py``). On one process group of NCCL alone this step fails with
"No backend type associated with device type cpu". Parity with one GPU, fp32, relative 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fit, run_fits

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

SPEC = FitSpec(
    model="lightning_parallel.models:GPT",
    model_kwargs={"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32, "lr": 0.5},
    data="lightning_parallel.testing.parity:token_data",
    global_batch=8,
    max_steps=5,
    trainer_kwargs={"gradient_clip_val": 0.5, "accelerator": "cuda"},
)


def test_zero3_offload_with_clipping_on_nccl_matches_one_gpu() -> None:
    spec = dataclasses.replace(SPEC, strategy="zero3_offload", devices=2)
    result = run_distributed(run_fits, 2, [spec], init_backend=None, timeout=600)[0][0]
    reference = run_fit(dataclasses.replace(SPEC, strategy="auto", devices=1))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    for name, ref in reference["params"].items():
        error = float((result["params"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert error <= 1e-5 or float(ref.norm()) < 1e-8, name
