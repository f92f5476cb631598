"""Loss parallelism (``lightning_parallel.parallel.tensor.loss``): pure torch, 2 ranks (gloo), plus option checks.

One spawned run checks, against an unsharded copy of the same GPT on every rank: the LM head
hands the step a ``Shard(-1)`` DTensor and nothing of the full logits' size is saved for the
backward; ``F.cross_entropy`` as a user writes it (``logits.view(-1, V)``) gives the same loss
and gradients (mean, sum, none, ``ignore_index``, class weights); accuracy-style ``argmax`` and
``max(dim)`` are exact, ties across shards included; what loss parallelism cannot keep sharded
(``softmax``, label smoothing, tensor indexing) still computes the right values, with a warning; outside a step
the head returns the gathered logits, and logits returned from a step leave as plain tensors.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_parallel.testing import run_distributed

REL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=REL, atol=1e-7, msg=lambda m: f"{what}: {m}")


def _local_numel(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).numel()


def _worker() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_parallel.models.gpt import GPT
    from lightning_parallel.parallel.tensor.apply import apply_tensor_parallel
    from lightning_parallel.parallel.tensor.loss import sharded_logits_step
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan

    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    torch.manual_seed(0)
    V, B, T = 256, 4, 8
    model = GPT(vocab_size=V, block_size=T, n_layer=1, n_head=4, n_embd=32)
    reference = copy.deepcopy(model)
    apply_tensor_parallel(model, mesh, resolve_tp_plan(model, tp), loss_parallel=True)
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    y[0, :3] = -100  # ignored positions
    weight = torch.rand(V) + 0.5
    out: dict[str, Any] = {}

    # 1. The user's loss and its gradients, with nothing of size B*T*V saved for the backward.
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(_local_numel(t)) or t, lambda t: t):
        with sharded_logits_step(True) as release:
            logits = model(x)
            out["head"] = (type(logits).__name__, str(logits.placements), tuple(logits.to_local().shape))
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            loss = release(loss)
    out["max_saved"], out["full_logits"] = max(saved), B * T * V
    assert type(loss) is torch.Tensor, type(loss)
    ref_logits = reference(x)
    ref_loss = F.cross_entropy(ref_logits.view(-1, V), y.view(-1))
    _close(loss, ref_loss, "mean loss")
    loss.backward()
    ref_loss.backward()
    ref_grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, ref_grads[name].grad, rtol=REL, atol=1e-7, msg=lambda m: f"grad {name}: {m}")

    # 2. Other reductions, ignore_index, class weights, nn.CrossEntropyLoss (forward + input grads).
    model.zero_grad()
    variants: list[tuple[str, Any]] = [
        ("sum", lambda lg, t: F.cross_entropy(lg, t, reduction="sum")),
        ("none", lambda lg, t: F.cross_entropy(lg, t, reduction="none", ignore_index=-100).mean()),
        ("weight", lambda lg, t: F.cross_entropy(lg, t, weight=weight)),
        ("module", lambda lg, t: torch.nn.CrossEntropyLoss()(lg, t)),
        ("class_dim_1", lambda lg, t: F.cross_entropy(lg.view(B, T, V).transpose(1, 2), t.view(B, T))),
    ]
    for label, fn in variants:
        with sharded_logits_step(True):
            sharded = model(x).reshape(-1, V)
            value = fn(sharded, y.view(-1))
        (grad,) = torch.autograd.grad(value, sharded)
        dense = reference(x).reshape(-1, V)
        ref_value = fn(dense, y.view(-1))
        (ref_grad,) = torch.autograd.grad(ref_value, dense)
        _close(value, ref_value, label)
        _close(grad.full_tensor(), ref_grad, f"{label} input grad")

    # 3. argmax / max over the vocabulary: exact, without gathering; ties across shards go to the lowest index.
    with torch.no_grad(), sharded_logits_step(True):
        logits = model(x)
        _close(logits.detach().argmax(dim=-1).float(), ref_logits.argmax(dim=-1).float(), "argmax")
        _close(F.cross_entropy(logits.view(-1, V), y.view(-1)), ref_loss.detach(), "loss without grad (validation)")
        values, idx = torch.max(logits, dim=2, keepdim=True)
        ref_values, ref_idx = torch.max(ref_logits, dim=2, keepdim=True)
        _close(values, ref_values, "max values")
        assert torch.equal(idx, ref_idx)
        ties = torch.zeros(3, V)
        ties[0, [5, V // 2 + 1]] = 1.0  # the maximum on both shards
        ties[1, [V // 2 + 3, V - 1]] = 2.0  # twice on the second shard
        ties[2, :] = 7.0  # everything equal
        sharded_ties = distribute_tensor(ties, mesh, [Shard(1)])
        setattr(sharded_ties, "_lightning_parallel_sharded_logits", True)
        assert torch.equal(sharded_ties.argmax(1), ties.argmax(1)), sharded_ties.argmax(1)

    # 4. What cannot stay sharded is still right (and warns): softmax, label smoothing.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sharded_logits_step(True):
            logits = model(x)
            probs = logits.softmax(dim=-1)
            smooth = F.cross_entropy(logits.view(-1, V), y.view(-1), label_smoothing=0.1)
            picked = logits[torch.arange(B), 3]  # advanced indexing (tensor index)
            last = logits[:, -1, :].argmax(-1)  # basic slice stays sharded, argmax exact
        assert type(probs) is torch.Tensor and type(smooth) is torch.Tensor and type(picked) is torch.Tensor
        _close(picked, ref_logits[torch.arange(B), 3], "advanced indexing")
        assert torch.equal(last, ref_logits[:, -1, :].argmax(-1))
        _close(probs, ref_logits.softmax(dim=-1), "softmax")
        _close(smooth, F.cross_entropy(ref_logits.view(-1, V), y.view(-1), label_smoothing=0.1), "label smoothing")
    out["warnings"] = [str(w.message) for w in caught if "loss_parallel" in str(w.message)]

    # 5. Outside a step the head gathers; a step returning its logits returns plain full tensors.
    plain = model(x)
    assert type(plain) is torch.Tensor
    _close(plain, ref_logits, "logits outside a step")
    with sharded_logits_step(True) as release:
        returned = release({"loss": F.cross_entropy(model(x).view(-1, V), y.view(-1)), "logits": model(x)})
    assert type(returned["logits"]) is torch.Tensor and type(returned["loss"]) is torch.Tensor
    _close(returned["logits"], ref_logits, "returned logits")
    return out


def test_loss_parallel_pure_torch_tp2() -> None:
    out = run_distributed(_worker, 2, timeout=240)[0]
    assert out["head"] == ("DTensor", "(Shard(dim=2),)", (4, 8, 128)), out["head"]
    # The largest tensor kept for the backward is the half-vocabulary log-softmax, not the full logits.
    assert out["max_saved"] <= out["full_logits"] // 2, out
    # rank 0 warns once per gathering call
    assert any("softmax" in w for w in out["warnings"]), out["warnings"]
    assert any("cross_entropy" in w for w in out["warnings"]), out["warnings"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"loss_parallel": "yes", "tensor_parallel_size": 2}, TypeError, "`loss_parallel`='yes'.*must be a bool.*HINT"),
        ({"loss_parallel": True}, ValueError, "`loss_parallel`='True with tensor_parallel_size=1'.*HINT"),
        ({"loss_parallel": True, "tensor_parallel_size": 2, "pipeline_parallel_size": 2}, ValueError,
         "pipeline_parallel_size=2.*HINT: set loss_parallel=False"),
    ],
)
def test_loss_parallel_option_is_validated(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    from lightning_parallel import HybridParallelStrategy

    with pytest.raises(error, match=match):
        HybridParallelStrategy(**kwargs)
