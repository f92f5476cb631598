"""Packed projections of unequal parts (Phi-3's grouped-query ``qkv_proj``: 4 query heads, 2
key/value heads) split per part and stored in rank order (``parallel/tensor/rank_order.py``).

Inside a region the model's cuts of the output into its parts are answered from the local shard
with no collective, an elementwise op keeps the order, and any other use sees the value in the
model's order (gathered: slower, never wrong). Wherever values cross by name they are in the
model's order: a Phi-3 run under tp2 saved (sharded directory and consolidated file, SGD with
momentum so the optimizer state is reordered too) resumes on one process, and a one-process
checkpoint resumes under tp2, each continuing exactly as one uninterrupted process (fp32,
relative 1e-5). Meta-device materialisation and pretrained reads are covered beside the other
layouts (``tests/test_meta_init.py``, ``tests/test_pretrained.py``); the communication count
(the Megatron minimum under tp2 and tp2 x pp2) by ``tests/test_tp_comms.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_parallel.parallel.tensor.rank_order import RankOrder
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec
from tests.test_checkpoint_reshard import _assert_continues, _phases, _run

SIZES = (8, 4, 4)  # [q | k | v] along the last dim


def test_rank_order_round_trip_and_each_ranks_parts() -> None:
    natural = torch.randn(3, sum(SIZES))
    for ranks in (1, 2, 4):
        order = RankOrder(1, SIZES, ranks)
        stored = order.stored(natural)
        assert torch.equal(order.natural(stored), natural)
        for rank, block in enumerate(stored.chunk(ranks, dim=1)):  # Shard(1): rank r's block
            parts = order.local_parts(block)
            for part, whole in zip(parts, natural.split(list(SIZES), dim=1)):
                assert torch.equal(part, whole.chunk(ranks, dim=1)[rank])
        assert torch.equal(order.stored_index(), order.stored(torch.arange(sum(SIZES))))


def _region_worker() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_parallel.parallel.tensor.attention import ReplicateMixedMode
    from lightning_parallel.parallel.tensor.rank_order import mark, rank_order

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    natural = torch.randn(2, 3, sum(SIZES))
    order = RankOrder(2, SIZES, 2)
    leaf = distribute_tensor(order.stored(natural), mesh, [Shard(2)]).requires_grad_()
    x = mark(leaf * 1.0, order)  # a marked non-leaf, like a region's linear output
    expected = natural.split(list(SIZES), dim=2)
    out: dict[str, Any] = {}
    with ReplicateMixedMode():
        with CommDebugMode() as comm:
            q, k, v = x[..., :8], x[..., 8:12], x[..., 12:]
            split = torch.split(x, list(SIZES), dim=-1)
            clamped = x.clamp(-1.0, 1.0)
        out["cuts without communication"] = comm.get_total_counts() == 0
        out["cuts"] = all(torch.equal(a.full_tensor(), e) for a, e in zip((q, k, v, *split), expected * 2))
        out["cut placements"] = all(tuple(a.placements) == (Shard(2),) for a in (q, k, v))
        out["clamp keeps the order"] = rank_order(clamped) == order
        out["clamp"] = torch.equal(clamped[..., :8].full_tensor(), expected[0].clamp(-1.0, 1.0))
        # Not a cut into the parts: the value in the model's order, whole (one all-gather), exact.
        out["other slice"] = torch.equal(x[..., 4:10].full_tensor(), natural[..., 4:10])
        total = x.sum(dim=-1)
        out["reduction"] = torch.allclose(total.full_tensor(), natural.sum(dim=-1))
        (2 * q.to_local().sum() + 3 * v.to_local().sum() + total.to_local().sum() / 2).backward()
    grad = torch.full_like(natural, 0.5)
    grad[..., :8] += 2
    grad[..., 12:] += 3
    out["gradient"] = torch.allclose(order.natural(leaf.grad.full_tensor()), grad)
    return out


def test_region_cuts_locally_and_reads_anything_else_in_the_models_order() -> None:
    for result in run_distributed(_region_worker, 2, timeout=240):
        assert all(result.values()), result


PHI3 = FitSpec(
    model="lightning_parallel.testing.real_models:HFCausalLM",
    model_kwargs={"family": "phi3", "n_layer": 2, "lr": 0.3, "momentum": 0.9},
    data="lightning_parallel.testing.parity:token_data",
    data_kwargs={"num_samples": 24},
    global_batch=8,
    max_steps=6,
)
TP2 = {"tensor_parallel_size": 2}
TP_PP = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 2}


@pytest.mark.slow
def test_phi3_tp2_checkpoints_resume_in_other_layouts(tmp_path: Path) -> None:
    """tp2 and tp2 x pp2 -> one process (sharded directory, consolidated file); one process -> tp2
    (both) and tp2 x pp2 (file)."""
    reference = _run([PHI3], 1)[0]
    sharded_a, sharded_b = _phases(PHI3, tmp_path / "tp.ckpt", TP2, {}, True)
    full_a, full_b = _phases(PHI3, tmp_path / "tp-full.ckpt", TP2, {}, False)
    single_a, single_b = _phases(PHI3, tmp_path / "single.ckpt", {}, TP2, False)
    single_sharded_a, single_sharded_b = _phases(PHI3, tmp_path / "single-dir.ckpt", {}, TP2, True)
    _run([single_a, single_sharded_a], 1)
    saved = _run([sharded_a, full_a, single_b, single_sharded_b], 2)
    for label, result in zip(("tp2 (sharded save)", "tp2 (file save)"), saved[:2]):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"][:3]), rtol=1e-5,
                                   atol=0, msg=lambda m: f"{label}, first epoch: {m}")
    _assert_continues(saved[2], reference, "1 -> tp2 (file)")
    _assert_continues(saved[3], reference, "1 -> tp2 (sharded)")
    # tp2 x pp2 (the stages' own tensor parallelism: each stage's rank-ordered parameters and states,
    # saved from and loaded into the ranks keeping them): saves, and a one-process file resumed there.
    staged_a, staged_b = _phases(PHI3, tmp_path / "3d.ckpt", TP_PP, {}, True)
    staged_full_a, staged_full_b = _phases(PHI3, tmp_path / "3d-full.ckpt", TP_PP, {}, False)
    _, single_on_3d = _phases(PHI3, tmp_path / "single.ckpt", {}, TP_PP, False)
    staged = _run([staged_a, staged_full_a, single_on_3d], 4)
    _assert_continues(staged[2], reference, "1 -> tp2 x pp2 (file)")
    resumed = _run([sharded_b, full_b, staged_b, staged_full_b], 1)
    for result, label in zip(resumed, ("tp2 -> 1 (sharded)", "tp2 -> 1 (file)", "tp2 x pp2 -> 1 (sharded)",
                                       "tp2 x pp2 -> 1 (file)")):
        _assert_continues(result, reference, label)


class _SplitGroupedAttention(torch.nn.Module):
    """Grouped-query attention whose fused projection is clamped, then cut with ``split`` and sizes
    (DBRX's way; Phi-3 slices): 4 query heads, 2 key/value heads of 4 features."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(width, width + 16), torch.nn.Linear(width, width)
        self.example_input_array = torch.randn(2, 5, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).clamp(-8.0, 8.0).split([c, 8, 8], dim=-1)
        q = q.view(b, t, 4, 4).transpose(1, 2)
        k, v = (z.view(b, t, 2, 4).transpose(1, 2).repeat_interleave(2, dim=1) for z in (k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, c))


def test_unequal_parts_found_from_a_split_after_an_elementwise_op() -> None:
    import warnings

    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = resolve_tp_plan(_SplitGroupedAttention(), 2, fsdp_composable=False)
        beside_fsdp = resolve_tp_plan(_SplitGroupedAttention(), 2)
    assert alone.styles == {"qkv": "colwise", "out": "rowwise"}, alone.table()
    assert alone.packed_sizes == {"qkv": (16, 8, 8)}
    assert beside_fsdp.styles == alone.styles and beside_fsdp.packed_sizes == {}
