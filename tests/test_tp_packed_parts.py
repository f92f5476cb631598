"""Packed projections split per part (issue 26, item 4): a ``_StridedShard(n)`` output cut into its
``n`` parts, whether by ``split``/``chunk`` (eager), the ``aten`` overloads a traced pipeline stage
calls, or a slice (Phi-3's ``qkv[..., :q_end]``), gives each rank its own part with no collective;
any other cut is left to DTensor. Plans: declared gather/split pairs run as column/row pairs, and
packed ``nn.Linear`` weights and biases keep their per-part split when no FSDP2 shards beside tp.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.real_models import HFCausalLM


def _parts_worker() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_parallel.compat import StridedShard
    from lightning_parallel.parallel.tensor.fused import slice_packed, split_packed

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    whole = torch.randn(2, 3, 24)  # [q | k | v], 8 features each
    x = distribute_tensor(whole, mesh, [StridedShard(2, split_factor=3)])
    aten = torch.ops.aten
    calls = {
        "Tensor.split": (lambda: split_packed(torch.Tensor.split, (x, 8), {"dim": 2}), whole.split(8, dim=2)),
        "torch.chunk": (lambda: split_packed(torch.chunk, (x, 3, -1), {}), whole.chunk(3, dim=-1)),
        "aten.split": (lambda: split_packed(aten.split.Tensor, (x, 8, 2), {}), whole.split(8, dim=2)),
        "aten.split_with_sizes": (lambda: split_packed(aten.split_with_sizes.default, (x, [8, 8, 8], 2), {}), whole.split(8, dim=2)),
        "aten.chunk": (lambda: split_packed(aten.chunk.default, (x, 3), {"dim": 2}), whole.chunk(3, dim=2)),
        "slice k": (lambda: (slice_packed(torch.Tensor.__getitem__, (x, (Ellipsis, slice(8, 16))), {}),), (whole[..., 8:16],)),
        "slice v": (lambda: (slice_packed(torch.Tensor.__getitem__, (x, (slice(None), slice(None), slice(16, None))), {}),), (whole[:, :, 16:],)),
        "aten.slice q": (lambda: (slice_packed(aten.slice.Tensor, (x, 2, 0, 8), {}),), (whole[..., :8],)),
    }
    out: dict[str, Any] = {}
    for name, (call, expected) in calls.items():
        with CommDebugMode() as comm:
            pieces = call()
        out[name] = {
            "comms": comm.get_total_counts(),
            "placements": [tuple(p.placements) == (Shard(2),) for p in pieces],
            "equal": all(torch.equal(p.full_tensor(), e) for p, e in zip(pieces, expected, strict=True)),
        }
    # Cuts that are not the parts: left to DTensor (None), which gathers and is exact.
    out["not parts"] = [
        split_packed(torch.Tensor.split, (x, 12), {"dim": 2}),
        split_packed(torch.Tensor.split, (x, [8, 16]), {"dim": 2}),
        split_packed(torch.Tensor.split, (x, 1), {"dim": 1}),
        slice_packed(torch.Tensor.__getitem__, (x, (Ellipsis, slice(4, 12))), {}),
        slice_packed(torch.Tensor.__getitem__, (x, (Ellipsis, slice(0, 16))), {}),
        slice_packed(torch.Tensor.__getitem__, (x, (Ellipsis, slice(0, 8, 2))), {}),
        slice_packed(torch.Tensor.__getitem__, (x, (slice(0, 1), slice(0, 8))), {}),
        slice_packed(torch.Tensor.__getitem__, (whole, (Ellipsis, slice(0, 8))), {}),
    ]
    # Gradients flow to the packed tensor's own shard.
    leaf = distribute_tensor(whole, mesh, [StridedShard(2, split_factor=3)]).requires_grad_()
    (q,) = (slice_packed(torch.Tensor.__getitem__, (leaf, (Ellipsis, slice(0, 8))), {}),)
    _, k, _ = split_packed(torch.Tensor.split, (leaf, 8), {"dim": 2})
    (2 * q.to_local().sum() + 3 * k.to_local().sum()).backward()
    grad = torch.zeros_like(whole)
    grad[..., :8], grad[..., 8:16] = 2, 3
    out["grad"] = isinstance(leaf.grad, DTensor) and torch.equal(leaf.grad.full_tensor(), grad)
    return out


def test_packed_parts_are_cut_locally_on_two_ranks() -> None:
    for result in run_distributed(_parts_worker, 2, timeout=240):
        for name, entry in result.items():
            if name in ("not parts", "grad"):
                continue
            assert entry["comms"] == 0 and entry["equal"] and all(entry["placements"]), (name, entry)
        assert result["not parts"] == [None] * 8
        assert result["grad"]


def test_declared_gather_split_pairs_run_as_column_row_pairs() -> None:
    """Phi-3 declares its packed ``gate_up_proj`` gathered and ``down_proj`` re-split: run as one
    column/row pair. Its ``qkv_proj`` packs q, k and v of unequal sizes (grouped-query attention:
    4 query heads, 2 key/value heads), found from the model's three slices: without FSDP2 beside tp
    it is split per part in rank order (``parallel/tensor/rank_order.py``), beside FSDP2 plainly
    (DTensor gathers where it is cut); either way the declared gather/re-split pair runs as colwise/rowwise."""
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan

    model = HFCausalLM(family="phi3", n_layer=2)
    mlp, attn = "model.model.layers.0.mlp", "model.model.layers.0.self_attn"
    for composable in (True, False):
        plan = resolve_tp_plan(model, 2, fsdp_composable=composable)
        assert plan.styles[f"{mlp}.gate_up_proj"] == "colwise" and plan.styles[f"{mlp}.down_proj"] == "rowwise"
        assert plan.styles[f"{attn}.qkv_proj"] == "colwise" and plan.styles[f"{attn}.o_proj"] == "rowwise"
        config = model.model.config
        head_dim = config.hidden_size // config.num_attention_heads
        sizes = (config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim, config.num_key_value_heads * head_dim)
        assert sizes[0] != sizes[1]
        assert plan.packed_sizes.get(f"{attn}.qkv_proj") == (None if composable else sizes), plan.packed_sizes
        assert plan.fraction_sharded > 0.95, plan.table()
        assert any("run as colwise/rowwise" in w for w in plan.warnings), plan.warnings
        # With FSDP2 beside tp a packed nn.Linear is split plainly (FSDP2 does not compose with the
        # per-part split of its own dim); without, its two parts are split each.
        assert plan.packed.get(f"{mlp}.gate_up_proj") == (None if composable else 2)
        assert plan.packed_biases_split is (not composable)


def test_packed_bias_is_split_only_without_fsdp() -> None:
    """GPT-2's ``c_attn`` bias: whole beside FSDP2 (its gradient is gathered each step), split per
    part otherwise, and counted as split in the plan's share."""
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan
    from lightning_parallel.parallel.tensor.shards import plan_param_shard

    model = HFCausalLM(family="gpt2", n_layer=1)
    c_attn = "model.transformer.h.0.attn.c_attn"
    beside_fsdp = resolve_tp_plan(model, 2)
    alone = resolve_tp_plan(model, 2, fsdp_composable=False)
    assert plan_param_shard(beside_fsdp, model, c_attn, "bias") is None
    assert plan_param_shard(alone, model, c_attn, "bias") == (0, 3)
    assert plan_param_shard(alone, model, c_attn, "weight") == plan_param_shard(beside_fsdp, model, c_attn, "weight") == (1, 3)
    assert alone.sharded_params == beside_fsdp.sharded_params + model.get_submodule(c_attn).bias.numel()
