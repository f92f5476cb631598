"""torch's own ring-attention engine (parallel/context/torch_ring.py) on this package's chunks.

On CUDA the ``allgather`` and ``ring`` forms hand a purely causal step to torch's engine with the
GPU flash kernel; the same engine runs here with the CPU flash kernel, so its use of this
package's head-tail layout (which torch's load balancer must agree with), both key/value
rotations, grouped-query heads and the backward are checked against one process's full causal
attention on machines without a GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_parallel.parallel.context.chunks import ChunkLayout
from lightning_parallel.parallel.context.torch_ring import torch_ring_applies, torch_ring_attention
from lightning_parallel.testing import run_distributed

SEQ = 32


def _check(dtype: torch.dtype) -> list[tuple[str, int, float]]:
    rank, cp = dist.get_rank(), dist.get_world_size()
    layout = ChunkLayout(SEQ, cp, rank)
    results = []
    for kv_heads in (4, 2):
        gen = torch.Generator().manual_seed(3)
        q, k, v, grad = (torch.randn(2, h, SEQ, 16, generator=gen, dtype=torch.float64) for h in (4, kv_heads, kv_heads, 4))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        rep = 4 // kv_heads
        out = F.scaled_dot_product_attention(full[0], full[1].repeat_interleave(rep, 1), full[2].repeat_interleave(rep, 1), is_causal=True)
        out.backward(grad)
        reference = [layout.split(t, 2) for t in (out.detach(), *(t.grad for t in full))]
        for form in ("allgather", "ring"):
            local = [layout.split(t, 2).to(dtype).requires_grad_() for t in (q, k, v)]
            mine = torch_ring_attention(form, *local, dist.group.WORLD, 16 ** -0.5)
            mine.backward(layout.split(grad, 2).to(dtype))
            got = (mine.detach(), *(t.grad for t in local))
            worst = max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, reference))
            results.append((form, kv_heads, worst))
    return results


def _worker() -> dict[str, list[tuple[str, int, float]]]:
    return {str(dtype): _check(dtype) for dtype in (torch.float32, torch.float64)}


def test_torch_engine_on_head_tail_chunks_matches_full_causal_attention() -> None:
    for world in (2, 4):
        for rank, result in enumerate(run_distributed(_worker, world, init_backend="gloo", timeout=300)):
            for dtype, rows in result.items():
                for form, kv_heads, worst in rows:
                    # the engine merges blocks in fp32 (torch's convert_to_f32), so float64 inputs are fp32-exact too
                    assert worst < 1e-5, (world, rank, dtype, form, kv_heads, worst)


def test_the_engine_is_used_only_where_its_mask_and_kernel_apply() -> None:
    half = torch.empty(1, 4, 8, 64, dtype=torch.bfloat16, device="meta")
    as_cuda = type("Q", (), {"device": torch.device("cuda"), "dtype": torch.bfloat16, "size": half.size})()
    valid = torch.ones(1, 8, dtype=torch.bool)
    assert torch_ring_applies("ring", as_cuda, None, True, None)
    assert torch_ring_applies("allgather", as_cuda, None, True, None)
    assert not torch_ring_applies("ulysses", as_cuda, None, True, None)  # an all-to-all over heads, not a ring
    assert not torch_ring_applies("ring", as_cuda, valid, True, None)  # padding
    assert not torch_ring_applies("ring", as_cuda, None, True, 4)  # a sliding window
    assert not torch_ring_applies("ring", as_cuda, None, False, None)  # bidirectional
    assert not torch_ring_applies("ring", half, None, True, None)  # not CUDA
    fp32 = type("Q", (), {"device": torch.device("cuda"), "dtype": torch.float32, "size": half.size})()
    assert not torch_ring_applies("ring", fp32, None, True, None)  # the flash kernel takes half precision only
