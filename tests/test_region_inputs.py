"""Tensor-parallel regions reading one tensor share its replicated DTensor, and so one reduction of
its gradient; never across an in-place write, without grad mode, or into a backward pass
(``parallel/tensor/region_inputs.py``). The collective counts this saves (GPT-J's parallel blocks,
BART's cross-attention) are held by ``tests/test_tp_comms.py``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.testing import run_distributed


def _worker() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_parallel.parallel.tensor.region_inputs import replicated_region_input

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    x = torch.randn(3, requires_grad=True) * 1.0  # non-leaf, as a block's normalised hidden states
    a, b = replicated_region_input(x, mesh), replicated_region_input(x, mesh)
    out["shared"] = a is b
    ((a * 2).to_local().sum() + (b * 3).to_local().sum()).backward(inputs=[x])
    out["grad"] = x.grad.tolist() if x.grad is not None else None
    leaf = torch.randn(3, requires_grad=True)
    y = leaf * 1.0
    first = replicated_region_input(y, mesh)
    y.mul_(2.0)  # an in-place write between two readers
    out["after_inplace"] = replicated_region_input(y, mesh) is first
    with torch.no_grad():
        out["no_grad"] = replicated_region_input(y, mesh) is replicated_region_input(y, mesh)

    class Probe(torch.autograd.Function):
        """In its backward, convert a tensor twice (as an activation checkpoint's recomputation would)."""

        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            return t.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            w = torch.ones(2, requires_grad=True) * 1.0
            with torch.enable_grad():
                out["in_backward"] = replicated_region_input(w, mesh) is replicated_region_input(w, mesh)
            return g

    Probe.apply(leaf).sum().backward()
    return out


def test_regions_share_the_conversion_of_one_tensor_only_while_it_is_unchanged() -> None:
    for result in run_distributed(_worker, 2, timeout=120):
        assert result["shared"], result
        assert result["grad"] == [5.0, 5.0, 5.0], result  # both readers' gradients summed at the one node
        assert not result["after_inplace"], result
        assert not result["no_grad"], result
        assert not result["in_backward"], result
