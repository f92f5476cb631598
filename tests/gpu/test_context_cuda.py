"""Context parallelism on CUDA (skipped elsewhere).

One GPU: the three attention forms on a one-rank NCCL group (the head-tail chunks, masks, the
ring's block math and the all-to-all run on the device, nothing on the CPU) against SDPA over the
whole sequence, in fp32 and bf16. Two GPUs: HF Llama and Qwen2 under cp2 on NCCL match one GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_parallel.parallel.context.attention import FORMS, context_attention, visibility
from lightning_parallel.parallel.context.chunks import ChunkLayout
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import run_fit, run_fits
from tests.test_context_parallel import _assert_cp_parity, _cp
from tests.test_hf_tp import _hf

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CUDA = {"accelerator": "cuda"}


def _forms_on_one_gpu() -> dict[str, float]:
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    errors = {}
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", generator=gen, dtype=dtype) for _ in range(3))
        valid = torch.ones(2, 64, dtype=torch.bool, device="cuda")
        valid[0, :5] = False
        pos = torch.arange(64, device="cuda")
        full = F.scaled_dot_product_attention(q, k, v, attn_mask=visibility(pos, pos, valid, True, 9), scale=0.2)
        layout = ChunkLayout(64, 1, 0)
        for form in FORMS:
            out = context_attention(form, *(layout.split(t, 2) for t in (q, k, v)), layout, dist.group.WORLD,
                                    key_valid=valid, causal=True, window=9, scale=0.2)
            assert out.device.type == "cuda" and out.dtype == dtype, (form, out.device, out.dtype)
            error = float((out.float() - layout.split(full, 2).float()).abs().max() / full.float().abs().max())
            assert error < tol, (form, dtype, error)
            errors[f"{form} {dtype}"] = error
    return errors


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_attention_forms_on_one_gpu() -> None:
    run_distributed(_forms_on_one_gpu, 1, init_backend="nccl", timeout=300)


def _torch_engine_on_gpus() -> dict[str, float]:
    """A causal bf16 step without padding goes to torch's own engine (parallel/context/torch_ring.py),
    forward and backward, against SDPA over the whole sequence."""
    from lightning_parallel.parallel.context import torch_ring
    from lightning_parallel.parallel.context.step import ContextStep

    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    calls = [0]
    engine = torch_ring._TorchRing.apply

    def counted(*args: object) -> torch.Tensor:
        calls[0] += 1
        return engine(*args)

    torch_ring._TorchRing.apply = counted  # type: ignore[method-assign]
    errors = {}
    layout = ChunkLayout(128, cp, rank)
    for form in ("allgather", "ring"):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, grad = (torch.randn(2, h, 128, 64, device="cuda", generator=gen, dtype=torch.bfloat16) for h in (8, 2, 2, 8))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(full[0], full[1], full[2], is_causal=True, enable_gqa=True)
        out.backward(grad)
        local = [layout.split(t, 2).requires_grad_() for t in (q, k, v)]
        step = ContextStep(layout=layout, group=dist.group.WORLD, form=form)
        mine = step.attention(*local, causal=True, window=None, scale=64 ** -0.5)
        mine.backward(layout.split(grad, 2))
        for name, a, b in zip(("out", "dq", "dk", "dv"), (mine, *(t.grad for t in local)),
                              (out, *(t.grad for t in full))):
            b = layout.split(b, 2)
            errors[f"{form} {name}"] = float((a.float() - b.float()).abs().max() / b.float().abs().max())
    assert calls[0] == 2, calls
    return errors


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_torch_engine_takes_causal_half_precision_steps() -> None:
    world = min(GPUS, 2)
    for result in run_distributed(_torch_engine_on_gpus, world, init_backend="nccl", timeout=300):
        assert all(error < 3e-2 for error in result.values()), result


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA devices")
def test_cp2_on_nccl_matches_one_gpu() -> None:
    cases = [(label, dataclasses.replace(_cp(spec, form), trainer_kwargs={**spec.trainer_kwargs, **CUDA}))
             for label, spec, form in (("llama labels padding ring", _hf("llama", "labels", padding=True), "ring"),
                                       ("qwen2 logits allgather", _hf("qwen2"), "allgather"),
                                       ("llama labels ulysses", _hf("llama", "labels"), "ulysses"))]
    results = run_distributed(run_fits, 2, [spec for _, spec in cases], init_backend=None, timeout=900)
    for i, (label, spec) in enumerate(cases):
        reference = run_fit(dataclasses.replace(spec, strategy="auto", devices=1))
        _assert_cp_parity(label, [rank[i] for rank in results], spec, reference)
