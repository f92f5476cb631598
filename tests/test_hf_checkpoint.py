"""Checkpoints of real Hugging Face models under tensor parallelism save and resume exactly.

GPT-2's packed ``c_attn`` and Mixtral's tensor-parallel experts are ``_StridedShard`` DTensors
(each rank holds its slice of q, k and v), which ``dcp.save`` refused ("overlapping chunks"),
so the default sharded ``ModelCheckpoint`` crashed on them. Saved as plain ``Shard``
(``tp_fused.checkpoint_layout``) and restored after loading, a tp2 run stopped after 3 steps and
resumed for 3 more equals one process training 6 steps (losses of the resumed steps, final
parameters, fp32, relative 1e-5), with a sharded and with a consolidated checkpoint (plain
SGD has no per-parameter state, which the consolidated loader used to assert on). The
consolidated file also loads with ``torch.load(weights_only=True)``, as Lightning's own
strategies read it (the numpy RNG state is stored as a tensor).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fit, run_fits

HYBRID = "lightning_parallel:HybridParallelStrategy"


def _spec(family: str) -> FitSpec:
    return FitSpec(
        model="lightning_parallel.testing.real_models:HFCausalLM",
        model_kwargs={"family": family, "n_layer": 2, "lr": 0.5},
        data="lightning_parallel.testing.parity:token_data",
        data_kwargs={"num_samples": 96, "vocab_size": 64},
        global_batch=8,
        max_steps=6,
        trainer_kwargs={"gradient_clip_val": 0.5},
    )


CASES = [("gpt2", True), ("mixtral", True), ("gpt2", False)]  # (family, sharded checkpoint)


def _specs(directory: str) -> list[FitSpec]:
    specs = []
    for family, sharded in CASES:
        path = f"{directory}/{family}-{'sharded' if sharded else 'file'}.ckpt"
        strategy = {"class": HYBRID, "tensor_parallel_size": 2, "save_distributed_checkpoint": sharded}
        first = dataclasses.replace(_spec(family), strategy=strategy, devices=2, max_steps=3, save_to=path)
        specs += [first, dataclasses.replace(_spec(family), strategy=strategy, devices=2, resume_from=path)]
    return specs


@pytest.mark.slow
def test_tp2_checkpoints_of_packed_hf_models_resume_exactly(tmp_path: Path) -> None:
    results = run_distributed(run_fits, 2, _specs(str(tmp_path)), init_backend=None, timeout=600)[0]
    references: dict[str, Any] = {}
    for index, (family, sharded) in enumerate(CASES):
        reference = references.get(family) or run_fit(_spec(family))
        references[family] = reference
        resumed = results[2 * index + 1]
        label = f"{family} {'sharded' if sharded else 'consolidated'}"
        assert resumed["global_step"] == 6, label
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(reference["losses"][3:]), rtol=1e-5,
                                   atol=0, msg=lambda m: f"{label}: {m}")
        for name, ref in reference["params"].items():
            error = float((resumed["params"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
            assert error <= 1e-5 or float(ref.norm()) < 1e-8, f"{label} {name}: relative error {error:.2e}"
    checkpoint = torch.load(tmp_path / "gpt2-file.ckpt", weights_only=True)
    assert "transformer.h.0.attn.c_attn.weight" in {k.removeprefix("model.") for k in checkpoint["state_dict"]}
