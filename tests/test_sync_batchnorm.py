"""``Trainer(sync_batchnorm=True)`` under the data-parallel strategies, and the batch norm behind it.

* pure torch (gloo, 2 ranks): :class:`DataParallelBatchNorm` on each rank's half of a batch gives
  one process's ``BatchNorm2d`` on the whole batch: outputs, input gradients, summed parameter
  gradients and running statistics;
* through the Trainer: transformers' ResNet under ``dp``, ``zero1``, ``zero2``, ``zero3`` with
  ``sync_batchnorm=True`` matches one process on the global batch; without the flag ``dp`` does
  not (each rank normalises with its own half batch), which shows the flag is what makes it exact;
* layouts that cannot honour the flag refuse it with a typed error before any collective.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from lightning_parallel.coverage import RESNET_LR
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fits, run_fits_in_fresh_process
from tests.test_data_parallel import assert_parity

RESNET = FitSpec(
    model="lightning_parallel.testing.real_models:VisionClassifier",
    model_kwargs={"arch": "resnet", "lr": RESNET_LR},  # why this lr: lightning_parallel/coverage.py
    data="lightning_parallel.testing.real_models:image_data",
    global_batch=8,
    max_steps=5,
    trainer_kwargs={"gradient_clip_val": 0.5, "sync_batchnorm": True},
)


def _batchnorm_worker() -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_parallel.parallel.data.sync_batchnorm import convert_sync_batchnorm

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3, bias=False),
                          nn.BatchNorm1d(3, momentum=None))
    x = torch.randn(6, 3, 8, 8) * 3 + 5  # a large channel mean: the variance must not cancel
    model, converted = convert_sync_batchnorm(model, dist.group.WORLD)
    local = x[rank * 3:(rank + 1) * 3].clone().requires_grad_(True)
    target = torch.randn(6, 3)
    out = model(local)
    ((out - target[rank * 3:(rank + 1) * 3]) ** 2).sum().backward()
    for param in model.parameters():  # gradient of the sum over both ranks' outputs
        dist.all_reduce(param.grad)
    return {"converted": converted, "out": out.detach(), "grad_x": local.grad,
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}


def test_batchnorm_over_two_ranks_equals_one_process_batchnorm() -> None:
    results = run_distributed(_batchnorm_worker, 2, init_backend="gloo", timeout=120)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3, bias=False),
                          nn.BatchNorm1d(3, momentum=None))
    x = (torch.randn(6, 3, 8, 8) * 3 + 5).requires_grad_(True)
    target = torch.randn(6, 3)
    out = model(x)
    ((out - target) ** 2).sum().backward()
    assert results[0]["converted"] == ["1", "5"]
    torch.testing.assert_close(torch.cat([r["out"] for r in results]), out.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([r["grad_x"] for r in results]), x.grad, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        # Relative to the tensor's scale: a conv in front of BatchNorm sums large cancelling terms
        # (one fp32 process is itself ~4e-7 of the norm away from fp64); the layers in front of a
        # BatchNorm have no bias, as in resnet (its true gradient is zero: round-off only).
        error = float((results[0]["grads"][name] - param.grad).norm())
        assert error <= 1e-5 * float(param.grad.norm()) + 1e-6, f"{name}: |diff| {error:.2e}, |grad| {float(param.grad.norm()):.2e}"
    for name, buffer in model.named_buffers():
        for r in results:
            torch.testing.assert_close(r["buffers"][name], buffer, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_resnet_sync_batchnorm_matches_one_process() -> None:
    cases = [("dp", "dp", True), ("zero1", "zero1", True), ("zero2", "zero2", True), ("zero3", "zero3", True),
             ("dp, no sync_batchnorm", "dp", False)]
    specs = [dataclasses.replace(RESNET, strategy=strategy, devices=2,
                                 trainer_kwargs={**RESNET.trainer_kwargs, "sync_batchnorm": sync}) for _, strategy, sync in cases]
    results = run_distributed(run_fits, 2, specs, init_backend=None, timeout=500)
    reference = run_fits_in_fresh_process([dataclasses.replace(RESNET, strategy="auto", devices=1,
                                                               trainer_kwargs={"gradient_clip_val": 0.5})])[0]
    assert max(reference["grad_norms"]) > 0.5, "the clipping threshold must actually clip"
    for i, (label, _, sync) in enumerate(cases):
        # The user logs without sync_dist: each rank logs its half batch; the global loss is their mean.
        merged = dict(results[0][i], losses=[(a + b) / 2 for a, b in zip(results[0][i]["losses"], results[1][i]["losses"])])
        if sync:
            assert_parity(merged, reference, label, per_tensor=True, metrics=False)
        else:  # per-rank statistics: documented to differ from one process on the global batch
            assert abs(merged["losses"][-1] - reference["losses"][-1]) > 1e-3 * abs(reference["losses"][-1]), label
    batchnorm = [n for n in reference["params"] if ".normalization." in n]  # transformers' ResNet names its BatchNorm so
    assert len(batchnorm) >= 10  # resnet's BatchNorm layers are really in play


@pytest.mark.parametrize(("degrees", "match"), [({"pipeline_parallel_size": 2}, "pipeline parallelism"),
                                                ({"tensor_parallel_size": 2, "data_parallel_size": 2}, "tensor parallelism")])
def test_layouts_that_cannot_sync_batchnorm_refuse_it(degrees: dict[str, int], match: str) -> None:
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    from lightning_parallel import HybridParallelStrategy
    from lightning_parallel.strategies.layer_sync import check_layer_sync
    from lightning_parallel.testing.real_models import VisionClassifier

    strategy = HybridParallelStrategy(**degrees)
    dims = strategy.resolve_dims(world_size=2 * max(degrees.values()) if len(degrees) == 1 else 4)
    with pytest.raises(ValueError, match=f"sync_batchnorm.*{match}.*HINT"):
        check_layer_sync(TorchSyncBatchNorm(), dims, VisionClassifier("resnet"))
    check_layer_sync(TorchSyncBatchNorm(), dims, VisionClassifier("vit"))  # no BatchNorm: nothing to refuse
    check_layer_sync(None, dims, VisionClassifier("resnet"))
