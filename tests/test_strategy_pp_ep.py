"""Pipelines with MoE layers (pp x ep, tp x pp, 4D dp x tp x pp x ep, ``strategy="3d"``) match one process.

MoE dispatch has data-dependent shapes, so pipeline stages run each MoE layer as one opaque op
(``parallel/pipeline/moe.py``); expert parallelism splits the experts of each stage over its
data-parallel ranks.

The reference for training: the MoE balance loss is not linear in the batch, and a pipeline
computes it per microbatch (its statistics summed over the data-parallel ranks of that
microbatch), so the single-process run it must equal is one with gradient accumulation over the
same microbatches: a batch of ``global_batch / microbatches`` and ``accumulate_grad_batches =
microbatches``. With ``microbatches=2`` and the parity sampler, microbatch ``m`` of every data
rank together is the reference's ``m``-th accumulated batch, so each pipelined step's loss is the
mean of two reference losses, and the parameters after 5 steps are equal. Evaluation and
checkpoints are checked against plain Lightning with the balance losses off (which plain
Lightning does not add).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fits
from tests.test_data_parallel import HYBRID, assert_parity
from tests.test_expert_parallel import DIM, HFStyleBlock
from tests.test_strategy_ep import MOE_SPEC

MICROBATCHES = 2


class HFStyleMoEClassifier(pl.LightningModule):
    """Two residual blocks whose feed-forward is a Hugging Face-style experts module (a Python loop
    over ``torch.where(index == e)``: data-dependent) behind a traced top-k router: under pipelines
    the experts module itself is the opaque op."""

    def __init__(self, lr: float = 0.3) -> None:
        super().__init__()
        self.lr = lr
        self.inp = nn.Linear(16, DIM)
        self.layers = nn.ModuleList([HFStyleBlock(top_k=2) for _ in range(2)])
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)  # the mean over the data-parallel ranks
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


HF_SPEC = FitSpec(model="tests.test_strategy_pp_ep:HFStyleMoEClassifier", global_batch=16, max_steps=5, strategy={"class": HYBRID})


def _pp(**kwargs: Any) -> dict[str, Any]:
    return {"class": HYBRID, "pipeline_parallel_size": 2, "microbatches": MICROBATCHES, **kwargs}


# The zero-bubble V schedule: 2 stages per rank (4 blocks), 4 microbatches.
ZB_SPEC = dataclasses.replace(MOE_SPEC, model_kwargs={**MOE_SPEC.model_kwargs, "n_layer": 4})


def _accumulating(spec: FitSpec, microbatches: int = MICROBATCHES) -> FitSpec:
    return dataclasses.replace(
        spec, global_batch=spec.global_batch // microbatches,
        trainer_kwargs={**spec.trainer_kwargs, "accumulate_grad_batches": microbatches},
    )


def _references() -> list[dict[str, Any]]:
    """The MoE GPT accumulating over the microbatches (2, and 4 for the V schedule), and the
    HF-style model (no balance loss) plainly."""
    specs = [_accumulating(MOE_SPEC), HF_SPEC, _accumulating(ZB_SPEC, 4)]
    return run_distributed(run_fits, 1, specs, init_backend=None, timeout=300)[0]


def _per_step(values: list[float], microbatches: int = MICROBATCHES) -> torch.Tensor:
    return torch.tensor(values).view(-1, microbatches).mean(1)


def _assert_matches_accumulated(result: dict[str, Any], reference: dict[str, Any], label: str, microbatches: int = MICROBATCHES) -> None:
    assert len(result["losses"]) == MOE_SPEC.max_steps == len(reference["losses"]) // microbatches, label
    torch.testing.assert_close(torch.tensor(result["losses"]), _per_step(reference["losses"], microbatches), rtol=1e-5,
                               atol=0, msg=lambda m: f"{label}: {m}")
    for key in ("moe_aux_loss", "moe_z_loss"):  # logged as without pipelines: summed over layers, mean over microbatches
        torch.testing.assert_close(torch.tensor(result["series"][key]), _per_step(reference["series"][key], microbatches),
                                   rtol=1e-5, atol=0, msg=lambda m: f"{label} {key}: {m}")
    # Per-layer statistics of the whole batch: the same keys; token counts add up over the microbatches.
    moe_keys = sorted(k for k in reference["series"] if k.startswith("moe/"))
    assert moe_keys and moe_keys == sorted(k for k in result["series"] if k.startswith("moe/")), label
    for key in (k for k in moe_keys if k.endswith("_tokens")):
        torch.testing.assert_close(torch.tensor(result["series"][key]), microbatches * _per_step(reference["series"][key], microbatches),
                                   rtol=0, atol=0, msg=lambda m: f"{label} {key}: {m}")
    assert result["params"].keys() == reference["params"].keys(), label
    for name, ref in reference["params"].items():
        torch.testing.assert_close(result["params"][name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} {name}: {m}")


def _moe_eval_kwargs() -> dict[str, Any]:
    kwargs = dict(MOE_SPEC.model_kwargs)
    kwargs.update(aux_loss_coef=0.0, z_loss_coef=0.0)  # plain Lightning (the reference) does not add them
    return kwargs


def _worker(ckpt_dir: str) -> dict[str, Any]:
    from tests.test_strategy_pp import _eval_run

    specs = [
        dataclasses.replace(MOE_SPEC, strategy=_pp(expert_parallel_size=2), devices=4),
        dataclasses.replace(MOE_SPEC, strategy=_pp(pipeline_schedule="gpipe", zero_stage=1), devices=4),  # experts replicated
        dataclasses.replace(MOE_SPEC, strategy="3d", devices=4),
        dataclasses.replace(HF_SPEC, strategy=_pp(expert_parallel_size=2), devices=4),
        # MoE layers replicated over tp: 14% of the parameters split, so the partial split is accepted explicitly
        dataclasses.replace(MOE_SPEC, strategy=_pp(tensor_parallel_size=2, tensor_parallel_min_split=0.0), devices=4),
        dataclasses.replace(ZB_SPEC, strategy=_pp(expert_parallel_size=2, pipeline_schedule="zbv", microbatches=4), devices=4),
        dataclasses.replace(MOE_SPEC, strategy=_pp(expert_parallel_size=2, zero_stage=3), devices=4),
    ]
    fits = run_fits(specs)
    evaluation = _eval_run(_pp(expert_parallel_size=2), 4, ckpt_dir, "lightning_parallel.models:MoEGPT", _moe_eval_kwargs())
    return {"fits": fits, "eval": evaluation}


def test_pp2_x_ep2_and_3d_on_moe_match_single_process(tmp_path: Path) -> None:
    from tests.test_strategy_pp import _assert_eval_matches, _eval_run

    per_rank = run_distributed(_worker, 4, str(tmp_path / "pp_ep"), init_backend=None, timeout=600)
    reference, hf_reference, zb_reference = _references()
    assert reference["series"]["moe_aux_loss"][0] > 0  # the balance loss is really in play
    labels = ("pp2 x ep2 (dp2) 1f1b+clip", "pp2 x dp2 gpipe zero1, experts replicated", "3d auto on MoE: pp2 x dp2 (ep2)")
    for rank, result in enumerate(per_rank):
        for label, fit in zip(labels, result["fits"]):
            _assert_matches_accumulated(fit, reference, f"rank {rank} {label}")
        assert_parity(result["fits"][3], hf_reference, f"rank {rank} HF-style experts, pp2 x ep2", metrics=False)
        _assert_matches_accumulated(result["fits"][4], reference, f"rank {rank} tp2 x pp2 on MoE")
        _assert_matches_accumulated(result["fits"][5], zb_reference, f"rank {rank} pp2 x ep2 zbv", microbatches=4)
        _assert_matches_accumulated(result["fits"][6], reference, f"rank {rank} pp2 x ep2 zero3")
    pp_ep, _, auto = per_rank[0]["fits"][:3]
    assert auto["layout"]["dims"] == pp_ep["layout"]["dims"] == "pp=2 x dp_replicate=2 x dp_shard=1 x tp=1 (ep=2)"
    evaluation = _eval_run("auto", 1, str(tmp_path / "ref"), "lightning_parallel.models:MoEGPT", _moe_eval_kwargs())
    _assert_eval_matches([result["eval"] for result in per_rank], evaluation)


@pytest.mark.slow
def test_4d_dp2_x_tp2_x_pp2_x_ep2_matches_single_process() -> None:
    """``strategy="3d"`` on 8 processes and the MoE GPT chooses all four axes; it trains as one process."""
    result = run_distributed(run_fits, 8, [dataclasses.replace(MOE_SPEC, strategy="3d", devices=8)], init_backend=None,
                             timeout=900)
    reference = _references()[0]
    for rank, per_rank in enumerate(result):
        assert per_rank[0]["layout"]["dims"] == "pp=2 x dp_replicate=2 x dp_shard=1 x tp=2 (ep=2)"
        _assert_matches_accumulated(per_rank[0], reference, f"rank {rank} 4D")


# ---------------------------------------------------------------- checkpoints across layouts
# MOE_SPEC with momentum (optimizer state to reshard) on 3 steps an epoch, balance losses off: the
# task loss is linear in the batch, so one process on the full batch is the exact reference and
# both layouts see the same batches per epoch (what a resume at an epoch end counts on).
RESUME = dataclasses.replace(
    MOE_SPEC, model_kwargs={**_moe_eval_kwargs(), "momentum": 0.9}, data_kwargs={"num_samples": 24}, max_steps=6,
    strategy={"class": HYBRID},
)


def _phase(spec: Any, first: bool, path: Path) -> Any:
    if first:
        return dataclasses.replace(spec, max_steps=-1, max_epochs=1, save_to=str(path))
    return dataclasses.replace(spec, max_steps=-1, max_epochs=2, resume_from=str(path))


@pytest.mark.slow
def test_resume_between_pp_x_ep_and_one_process(tmp_path: Path) -> None:
    """pp2 x ep2 -> one process and one process -> pp2 x ep2, sharded checkpoints with momentum:
    the resumed 3 steps equal those of an uninterrupted run."""
    pp_ep = dataclasses.replace(RESUME, strategy=_pp(expert_parallel_size=2), devices=4)
    reference, _ = run_distributed(run_fits, 1, [RESUME, _phase(RESUME, True, tmp_path / "one.ckpt")], init_backend=None,
                                   timeout=300)[0]
    _, from_one = run_distributed(run_fits, 4, [_phase(pp_ep, True, tmp_path / "pp_ep.ckpt"), _phase(pp_ep, False, tmp_path / "one.ckpt")],
                                  init_backend=None, timeout=500)[0]
    to_one = run_distributed(run_fits, 1, [_phase(RESUME, False, tmp_path / "pp_ep.ckpt")], init_backend=None, timeout=300)[0][0]
    for label, resumed in (("1 -> pp2 x ep2", from_one), ("pp2 x ep2 -> 1", to_one)):
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(reference["losses"][3:]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{label}: {m}")
        for name, ref in reference["params"].items():
            torch.testing.assert_close(resumed["params"][name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} {name}: {m}")
