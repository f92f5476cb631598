"""What a tensor-parallel attention region computes on its own heads and does not gather:

* ``baddbmm`` on heads merged into the batch dim (Bloom's ALiBi scores) runs on each rank's rows,
  without the three all-gathers DTensor made (``parallel/tensor/merged_heads.py``);
* head-split attention weights leave a region as ``None`` unless the model returns them
  (``output_attentions``), as under the SDPA implementation; with ``output_attentions=True`` they
  equal one process's (``parallel/tensor/attention_weights.py``).

Both on transformers' own ``BloomForCausalLM`` (eager attention only), against one process.
The per-step counts for Bloom and MPT are held by ``tests/test_tp_comms.py``.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.testing import run_distributed


def _counting() -> Any:
    """``CommDebugMode`` without its module tracker, whose backward hooks on every module change what runs."""
    from lightning_parallel.testing.comm_counts import BytesCommDebugMode

    return BytesCommDebugMode()


def _baddbmm_worker() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from lightning_parallel.parallel.tensor.merged_heads import local_baddbmm

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    b, h, t, hd = 2, 4, 5, 3
    q, k = torch.randn(b, h, t, hd, requires_grad=True), torch.randn(b, h, t, hd, requires_grad=True)
    out: dict[str, Any] = {}
    for label, bias in (("bias per row", torch.randn(b * h, 1, t)), ("bias broadcast", torch.randn(1, t, t))):
        dq, dk = (distribute_tensor(x.detach(), mesh, [Shard(1)]).requires_grad_() for x in (q, k))
        mq, mk = dq.reshape(b * h, t, hd), dk.reshape(b * h, t, hd).transpose(-1, -2)
        mode = _counting()
        with mode:
            scores = local_baddbmm(torch.Tensor.baddbmm, (bias,), {"batch1": mq, "batch2": mk, "beta": 0.5, "alpha": 0.25})
            scores.view(b, h, t, t).softmax(-1).full_tensor().square().sum().backward()
        expected = bias.baddbmm(q.reshape(b * h, t, hd), k.reshape(b * h, t, hd).transpose(-1, -2), beta=0.5, alpha=0.25)
        q.grad = k.grad = None
        expected.view(b, h, t, t).softmax(-1).square().sum().backward()
        out[label] = {
            "placement": (type(scores.placements[0]).__name__, scores.placements[0].dim, getattr(scores.placements[0], "split_factor", None)),
            "value": (scores.full_tensor() - expected).abs().max().item(),
            "grads": max((dq.grad.full_tensor() - q.grad).abs().max().item(), (dk.grad.full_tensor() - k.grad).abs().max().item()),
            "collectives": {str(op): n for op, n in mode.get_comm_counts().items() if n},
        }
    whole = DTensor.from_local(torch.randn(b * h, t, hd), mesh, [Replicate()])
    out["replicated batches left to DTensor"] = local_baddbmm(torch.baddbmm, (torch.randn(b * h, t, t), whole, whole.transpose(-1, -2)), {})
    mq = distribute_tensor(q.detach(), mesh, [Shard(1)]).reshape(b * h, t, hd)
    learned = torch.zeros(1, t, t, requires_grad=True)  # broadcast over rows: its gradient sums every rank's
    out["learned broadcast bias left to DTensor"] = local_baddbmm(torch.baddbmm, (learned, mq, mq.transpose(-1, -2)), {})
    return out


def test_baddbmm_on_merged_heads_runs_on_each_ranks_rows() -> None:
    for result in run_distributed(_baddbmm_worker, 2, timeout=120):
        for label in ("bias per row", "bias broadcast"):
            case = result[label]
            assert case["placement"] == ("_StridedShard", 0, 2), (label, case)  # each batch element's heads split
            assert case["value"] < 1e-6 and case["grads"] < 1e-6, (label, case)
            # the full_tensor() of the loss is the only gather left (forward, and its backward slice)
            assert set(case["collectives"]) <= {"c10d_functional.all_gather_into_tensor"}, (label, case)
            assert sum(case["collectives"].values()) == 1, (label, case)
        assert result["replicated batches left to DTensor"] is None
        assert result["learned broadcast bias left to DTensor"] is None


def _bloom() -> torch.nn.Module:
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    config = BloomConfig(vocab_size=64, hidden_size=32, n_head=4, n_layer=2, hidden_dropout=0.0, attention_dropout=0.0)
    return BloomForCausalLM(config).float()


def _phase_counts(mode: Any) -> Counter[str]:
    return Counter({str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n})


def _gradient_error(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    expected = dict(reference.named_parameters())
    return max(
        ((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) - expected[n].grad).abs().max().item()
        / max(expected[n].grad.abs().max().item(), 1e-12) for n, p in model.named_parameters())


def _bloom_worker() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from lightning_parallel.parallel.activation_checkpointing import apply_activation_checkpointing
    from lightning_parallel.parallel.tensor.apply import apply_tensor_parallel
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reference = _bloom()
    model = copy.deepcopy(reference)
    apply_tensor_parallel(model, mesh, resolve_tp_plan(model, 2, fsdp_composable=False))
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}

    mode = _counting()
    with mode:
        plain = model(ids)
    expected = reference(ids, output_attentions=True)
    out["default"] = {"attentions": plain.attentions, "forward": _phase_counts(mode),
                      "logits": (plain.logits - expected.logits).abs().max().item()}
    asked = model(ids, output_attentions=True)
    out["asked"] = {"count": len(asked.attentions), "weights": max(
        (a - e).abs().max().item() for a, e in zip(asked.attentions, expected.attentions, strict=True))}

    # Activation checkpointing (the strategy's: every block) reruns the regions inside the backward.
    apply_activation_checkpointing(model)
    reference(ids).logits.square().mean().backward()
    for label, asked_for in (("recomputed", False), ("recomputed, asked", True)):
        for p in model.parameters():
            p.grad = None
        mode = _counting()
        with mode:
            model(ids, output_attentions=asked_for).logits.square().mean().backward()
        out[label] = {"collectives": _phase_counts(mode), "grads": _gradient_error(model, reference)}
    return out


def test_attention_weights_are_gathered_only_when_the_model_returns_them() -> None:
    for result in run_distributed(_bloom_worker, 2, timeout=180):
        default = result["default"]
        assert default["attentions"] is None, default  # not asked for: no per-layer all-gather of (B, H, T, T)
        assert default["forward"] == {"all_reduce": 5, "all_gather_into_tensor": 1}, default  # 2 per block, embedding; LM head
        assert default["logits"] < 1e-5, default
        assert result["asked"]["count"] == 2 and result["asked"]["weights"] < 1e-6, result["asked"]
        recomputed = result["recomputed"]
        assert recomputed["grads"] < 1e-5, recomputed
        # forward 5 + 1; backward 5 all-reduces; the blocks' recomputation 2, the attention's (torch stops it once
        # every saved tensor is back, before the MLP's), and no gather: it drops the weights too (2 more if not)
        assert recomputed["collectives"] == {"all_reduce": 12, "all_gather_into_tensor": 1}, recomputed
        asked = result["recomputed, asked"]  # gathered in the forward, dropped when recomputed
        assert asked["grads"] < 1e-5, asked
        assert asked["collectives"] == {"all_reduce": 12, "all_gather_into_tensor": 3}, asked
