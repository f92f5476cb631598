"""FSDP2 on the CPU (``parallel/data/fsdp_host.py``, ``parallel/data/host_buffers.py``): the pooled
all-gather buffers are handed out again only once nothing else holds them, gloo's reduce-scatter
done as the in-place all-reduce it is made of and the all-gather as one broadcast per rank give
gloo's results bit for bit, and a sharded model
trains to the same parameters with these comms as with FSDP2's own, reusing its buffers."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.launcher import run_distributed
from lightning_parallel.parallel.data.host_buffers import HostBufferPool

CPU = torch.device("cpu")


def test_a_kept_buffer_is_handed_out_again_only_once_nothing_else_holds_its_storage() -> None:
    pool = HostBufferPool(per_key=2)
    first = pool.take(1000, torch.float32, CPU)
    view = first[10:20]  # a view alone keeps it busy, as gloo's work and FSDP2's copy-out views do
    del first
    second = pool.take(1000, torch.float32, CPU)
    assert second.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    del view
    again = pool.take(1000, torch.float32, CPU)
    assert (pool.fresh, pool.reused) == (2, 1)
    assert again.untyped_storage().data_ptr() not in {second.untyped_storage().data_ptr()}  # second is still held
    del again, second
    assert pool.take(1000, torch.float32, CPU) is not None and pool.reused == 2
    assert pool.kept_bytes() == 2 * 4000


def test_the_pool_keeps_per_key_buffers_per_size_and_dtype_and_serves_the_rest_fresh() -> None:
    pool = HostBufferPool(per_key=1)
    held = [pool.take(256, torch.float32, CPU) for _ in range(3)]  # all in use: one kept, two not
    assert pool.fresh == 3 and pool.kept_bytes() == 1024
    other = pool.take(256, torch.bfloat16, CPU)  # another key
    assert other.dtype == torch.bfloat16 and pool.kept_bytes() == 1024 + 512
    del held
    pool.take(256, torch.float32, CPU)
    assert pool.reused == 1
    pool.clear()
    assert pool.kept_bytes() == 0


def _collectives() -> dict[str, Any]:
    from lightning_parallel.parallel.data.fsdp_host import PooledAllGather, ReleasingReduceScatter

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {}
    for op_name in ("SUM", "AVG"):
        op = getattr(dist.ReduceOp, op_name)
        grads = torch.randn(world * 1000, generator=gen) * 1e3
        expected = torch.empty(1000)
        dist.reduce_scatter_tensor(expected, grads.clone(), op=op)
        comm, got = ReleasingReduceScatter(), torch.empty(1000)
        given = comm.allocate((world * 1000,), dtype=torch.float32, device=CPU)
        given.copy_(grads)
        comm(got, given, dist.group.WORLD, op)
        out[op_name] = (torch.equal(got, expected), given.untyped_storage().nbytes())
    pool = HostBufferPool()
    gather = PooledAllGather(pool)
    for async_op in (True, True, False):
        mine = torch.randn(500, generator=gen)
        expected = torch.empty(world * 500)
        dist.all_gather_into_tensor(expected, mine)
        output = gather.allocate((world * 500,), dtype=torch.float32, device=CPU)
        output.view(world, -1)[rank].copy_(mine)  # FSDP2's copy-in
        work = gather(output, output.view(world, -1)[rank], dist.group.WORLD, async_op=async_op)
        if async_op:
            work.wait()
        out.setdefault("gathered", []).append(torch.equal(output, expected))
        del output, work
    out["pool"] = (pool.fresh, pool.reused)
    return out


def test_gloo_collectives_in_place_are_bitwise_gloos_the_input_is_freed_and_all_gathers_reuse_one_buffer() -> None:
    for result in run_distributed(_collectives, 2, timeout=120):
        assert result["SUM"] == (True, 0) and result["AVG"] == (True, 0)
        assert result["gathered"] == [True, True, True]
        fresh, reused = result["pool"]  # gloo's worker may still hold a finished work for a moment: then a second
        assert fresh + reused == 3 and fresh <= 2 and reused >= 1


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64)) for _ in range(4))
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _train(host_buffers: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_parallel.parallel.data.fsdp_host import release_host_buffers

    torch.manual_seed(0)
    model = Blocks()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    pool = release_host_buffers([m for m in model.modules() if hasattr(m, "set_custom_all_gather")], CPU) if host_buffers else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        x = torch.randn(16, 64, generator=gen)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "pool": None if pool is None else (pool.fresh, pool.reused, pool.kept_bytes())}


def _both() -> dict[str, Any]:
    return {"default": _train(False), "host": _train(True)}


def test_fsdp2_trains_bitwise_as_with_its_own_comms_and_its_all_gathers_reuse_one_buffer_per_unit_size() -> None:
    for result in run_distributed(_both, 2, timeout=180):
        default, host = result["default"], result["host"]
        assert host["losses"] == default["losses"]
        assert all(torch.equal(host["params"][n], p) for n, p in default["params"].items())
        fresh, reused, kept = host["pool"]
        # two unit sizes (the 4 identical blocks; the root's head), the blocks gathered in forward and
        # backward, the root once per step (FSDP2 keeps the root gathered for backward): 3 x (4 + 4 + 1)
        # requests, from at most 2 kept buffers per size
        assert fresh + reused == 27 and fresh <= 4 and reused >= 23
        block = sum(p.numel() for p in Blocks().blocks[0].parameters()) * 4
        assert kept <= 2 * (block + (64 * 8 + 8) * 4)
