"""Attention on head-split DTensors runs on the local heads (``tp_attention.local_sdpa``), 2 ranks.

Why a test of its own: the fast path is a speed feature, so a regression would not fail any
parity test, it would only make ``tp`` slower again (math kernel + DTensor decomposition). The
worker checks that the GPT's and the Llama's attention really take it, that its outputs and
gradients equal ``F.scaled_dot_product_attention`` on the full tensors (causal, 2-D and
head-broadcast masks, per-head masks cut to the rank's heads with the learned one's full gradient,
grouped-query ``enable_gqa``, ``scale``), and that it declines what it cannot do exactly (dropout,
a mask over another count of heads, tensors not split along the heads).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lightning_parallel.testing import run_distributed


def _worker() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_parallel.models.gpt import GPT
    from lightning_parallel.models.llama import Llama
    from lightning_parallel.parallel.tensor import attention as tp_attention
    from lightning_parallel.parallel.tensor.apply import apply_tensor_parallel
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    B, H, T, hd = 2, 4, 6, 8
    q, k, v = (torch.randn(B, H, T, hd, requires_grad=True) for _ in range(3))
    kv2 = (torch.randn(B, 2, T, hd, requires_grad=True), torch.randn(B, 2, T, hd, requires_grad=True))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    cases: list[tuple[str, tuple, dict[str, Any]]] = [
        ("causal", (q, k, v), {"is_causal": True}),
        ("bool mask 2-D", (q, k, v), {"attn_mask": causal}),
        ("float mask (1, 1, T, T)", (q, k, v), {"attn_mask": torch.randn(1, 1, T, T)}),
        ("gqa", (q, *kv2), {"is_causal": True, "enable_gqa": True}),
        ("scale", (q, k, v), {"scale": 0.3}),
        ("per-head float mask (1, H, T, T)", (q, k, v), {"attn_mask": torch.randn(1, H, T, T)}),
        ("per-head float mask (B, H, T, T), gqa", (q, *kv2), {"attn_mask": torch.randn(B, H, T, T), "enable_gqa": True}),
    ]
    for label, tensors, kwargs in cases:
        sharded = [distribute_tensor(t.detach(), mesh, [Shard(1)]).requires_grad_() for t in tensors]
        out = tp_attention.local_sdpa(tuple(sharded), kwargs)
        assert out is not None, label
        ref = F.scaled_dot_product_attention(*tensors, **kwargs)
        torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}: {m}")
        grad = torch.randn_like(ref)
        out.backward(distribute_tensor(grad, mesh, [Shard(1)]))
        ref_grads = torch.autograd.grad(ref, tensors, grad)
        for s, r in zip(sharded, ref_grads):
            torch.testing.assert_close(s.grad.full_tensor(), r, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} grad: {m}")
    # A learned per-head bias (T5's position bias) as the mask: its gradient is the full one on every rank.
    bias = torch.randn(1, H, T, T, requires_grad=True)
    sharded = [distribute_tensor(t.detach(), mesh, [Shard(1)]).requires_grad_() for t in (q, k, v)]
    local_bias = bias.detach().clone().requires_grad_()
    out = tp_attention.local_sdpa(tuple(sharded), {"attn_mask": local_bias})
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    grad = torch.randn_like(ref)
    out.backward(distribute_tensor(grad, mesh, [Shard(1)]))
    (bias_grad,) = torch.autograd.grad(ref, bias, grad)
    torch.testing.assert_close(local_bias.grad, bias_grad, rtol=1e-5, atol=1e-6)
    sq, sk, sv = (distribute_tensor(t.detach(), mesh, [Shard(1)]) for t in (q, k, v))
    declined = {
        "dropout": tp_attention.local_sdpa((sq, sk, sv), {"dropout_p": 0.1}),
        "mask over another count of heads": tp_attention.local_sdpa((sq, sk, sv), {"attn_mask": torch.zeros(B, 2, T, T)}),
        "replicated q": tp_attention.local_sdpa(
            (distribute_tensor(q.detach(), mesh, [Replicate()]), sk, sv), {"is_causal": True}),
    }
    assert all(v is None for v in declined.values()), declined

    # The models' attention takes the fast path (counted through the module attribute the mode calls).
    hits: list[int] = []
    original = tp_attention.local_sdpa

    def counting(args: tuple, kwargs: dict) -> Any:
        out = original(args, kwargs)
        hits.append(out is not None)
        return out

    tp_attention.local_sdpa = counting  # type: ignore[assignment]
    try:
        taken = {}
        for name, model in (
            ("gpt", GPT(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32)),
            ("llama", Llama(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4)),
        ):
            apply_tensor_parallel(model, mesh, resolve_tp_plan(model, mesh.size()))
            hits.clear()
            model(torch.randint(0, 64, (2, 8))).sum().backward()
            taken[name] = list(hits)
    finally:
        tp_attention.local_sdpa = original  # type: ignore[assignment]
    return taken


def test_local_sdpa_tp2() -> None:
    taken = run_distributed(_worker, 2, timeout=240)[0]
    assert taken == {"gpt": [True, True], "llama": [True, True]}, taken
