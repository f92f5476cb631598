"""Measure this machine's collectives and the per-unit overheads of FSDP2 and DTensor, on real ranks.

Why a second calibration step beside :func:`~lightning_parallel.planner.hardware.calibrate_cpu`:
the costs that order layouts on a CPU machine are not FLOPs. Measured here (2 gloo ranks on 2
shared cores, ``benchmarks/bench_planner_rank.py``): a gloo collective of a few bytes takes
0.3-0.5 ms, forty times a socket round trip, so latencies taken from a socket pair predict every
collective free; each FSDP2 unit costs 3-4 ms per step in hooks, copies and waits on top of its
collectives; a column/row-parallel ``Linear`` pair costs DTensor dispatch and ``from_local`` /
``to_local`` conversions in forward and backward; and a collective issued asynchronously does not
hide under compute when the ranks already use every core. Each of these is measured directly,
as the quantity the cost model (:mod:`~lightning_parallel.planner.cost`) counts, on
small inputs chosen so that the effect measured dominates:

* latency and bus bandwidth from a small and a large ``all_reduce``; ``all_gather`` and
  ``reduce_scatter`` bandwidth as a factor of the all-reduce ring formula (gloo implements them
  with different algorithms: measured 2.5x and 1.4x slower per byte here);
* per FSDP2 unit, per step, the time beyond its collectives' latencies, for ZeRO-2
  (``reshard_after_forward=False``) and ZeRO-3, from stacks of tiny ``fully_shard`` units against
  the same stacks unwrapped, with units of 2 and of 8 parameter tensors: a fixed part per unit
  and a part per tensor (copy-in/out, views, hooks per parameter; a transformer block holds 12-16);
* per column+row parallel pair (the unit of the tensor-parallel plan, two per transformer block),
  the time beyond its two all-reduces, against the same two ``Linear`` layers unwrapped;
* the fraction of an asynchronous all-reduce that hides under a concurrent matmul;
* the cost of one small broadcast in a stream of asynchronous ones (ZeRO-1 broadcasts every
  parameter that way: measured about a third of a lone collective's latency here).

These are measurements of primitives, never of the layouts the benchmark then ranks: fitting the
model to the layouts it is judged on would prove nothing. The strategy never calls this (ranks
must agree on a plan without measuring); the dry run does, through ``hardware=calibrate``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

SMALL_BYTES = 4096
LARGE_BYTES = 4 * 1024 * 1024
STREAM = 32  # asynchronous broadcasts in the pipelined-latency measurement
WIDE_LINEARS = 4  # Linear layers per unit in the second FSDP2 measurement


def _best_pair(first: Callable[[], Any], second: Callable[[], Any], repeats: int,
               barrier: Callable[[], Any]) -> tuple[float, float]:
    """Least wall times of two functions measured alternately, so a slow spell of a shared
    machine cannot land on one of them only (their difference is what is wanted)."""
    best = [float("inf"), float("inf")]
    for fn in (first, second):
        fn()  # warm-up
    for _ in range(repeats):
        for i, fn in enumerate((first, second)):
            barrier()
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def _best_time(fn: Callable[[], Any], repeats: int, barrier: Callable[[], Any]) -> float:
    """Least wall time of ``fn`` over ``repeats`` runs, ranks aligned by a barrier before each.

    The least, not the median: on a shared machine a median measures the other jobs too (gloo's
    small all-reduce read 0.6 ms or 3.8 ms by median in back-to-back runs at load 4.6); the least
    disturbed run is the cost of the primitive itself, which is what the cost model prices.
    """
    best = float("inf")
    fn()  # warm-up: first-call allocations, lazy initialisation
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _collective_times(repeats: int) -> dict[str, float]:
    import torch.distributed as dist

    world = dist.get_world_size()
    out: dict[str, float] = {}
    for label, nbytes in (("small", SMALL_BYTES), ("large", LARGE_BYTES)):
        n = nbytes // 4
        x = torch.ones(n)
        gathered = torch.empty(world * n)
        scattered = torch.empty(n // world)
        out[f"all_reduce_{label}"] = _best_time(lambda: dist.all_reduce(x), repeats, dist.barrier)
        out[f"all_gather_{label}"] = _best_time(lambda: dist.all_gather_into_tensor(gathered, x), repeats, dist.barrier)
        out[f"reduce_scatter_{label}"] = _best_time(lambda: dist.reduce_scatter_tensor(scattered, x), repeats, dist.barrier)
    # Many small broadcasts issued asynchronously, then waited on together (what ZeRO-1's
    # ZeroRedundancyOptimizer does once per parameter): the cost of one in such a stream.
    tensors = [torch.ones(SMALL_BYTES // 4) for _ in range(STREAM)]

    def stream() -> None:
        works = [dist.broadcast(t, src=i % world, async_op=True) for i, t in enumerate(tensors)]
        for work in works:
            work.wait()

    out["broadcast_stream"] = _best_time(stream, repeats, dist.barrier) / STREAM
    return out


def _tiny_stack(units: int, width: int, linears: int = 1) -> nn.Sequential:
    """``units`` FSDP-unit candidates of ``linears`` tiny Linear layers each (2 parameter tensors per Linear)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(*[nn.Linear(width, width) for _ in range(linears)]) for _ in range(units)])


def _fsdp_unit_times(repeats: int, units: int = 8, width: int = 16, linears: int = 1) -> dict[int, float]:
    """Seconds per FSDP2 unit per forward+backward (root included), beyond the unwrapped stack,
    for units of ``linears`` Linear layers (FSDP2's per-unit work grows with the tensors it holds)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randn(4, width)

    def step(module: nn.Module) -> Callable[[], None]:
        return lambda: module(x).sum().backward()

    plain_stack = _tiny_stack(units, width, linears)
    out: dict[int, float] = {}
    for stage, reshard in ((2, False), (3, True)):
        stack = _tiny_stack(units, width, linears)
        for layer in stack:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(stack, mesh=mesh, reshard_after_forward=reshard)
        plain, wrapped = _best_pair(step(plain_stack), step(stack), repeats, dist.barrier)
        out[stage] = (wrapped - plain) / (units + 1)
    return out


def _tp_pair_time(repeats: int, pairs: int = 4, width: int = 32) -> float:
    """Seconds per column+row parallel ``Linear`` pair per forward+backward, beyond the plain pair."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randn(8, width)

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(2 * pairs)])

    plain = build()
    sharded = parallelize_module(build(), mesh, {
        str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(2 * pairs)
    })

    def step(module: nn.Module) -> Callable[[], None]:
        return lambda: module(x).sum().backward()

    base, wrapped = _best_pair(step(plain), step(sharded), repeats, dist.barrier)
    return (wrapped - base) / pairs


def _overlap_fraction(repeats: int, size: int = 192) -> float:
    """How much of an asynchronous all-reduce hides under a matmul issued after it (0: none)."""
    import torch.distributed as dist

    a = torch.randn(size, size)
    x = torch.ones(LARGE_BYTES // 4)

    def compute() -> None:
        for _ in range(8):
            torch.mm(a, a)

    def comm() -> None:
        dist.all_reduce(x)

    def both() -> None:
        work = dist.all_reduce(x, async_op=True)
        compute()
        work.wait()

    t_compute = _best_time(compute, repeats, dist.barrier)
    t_comm = _best_time(comm, repeats, dist.barrier)
    t_both = _best_time(both, repeats, dist.barrier)
    hidden = t_compute + t_comm - t_both
    return min(1.0, max(0.0, hidden / max(1e-9, min(t_compute, t_comm))))


def measure_on_ranks(repeats: int) -> dict[str, Any]:
    """Every measurement, on the calling rank (run it on every rank of a gloo group)."""
    import torch.distributed as dist

    out: dict[str, Any] = dict(_collective_times(repeats))
    out["fsdp_unit"] = _fsdp_unit_times(repeats)  # 2 parameter tensors per unit
    out["fsdp_unit_wide"] = _fsdp_unit_times(repeats, linears=WIDE_LINEARS)  # 2 x WIDE_LINEARS per unit
    out["tp_pair"] = _tp_pair_time(repeats)
    out["overlap"] = _overlap_fraction(repeats)
    out["world"] = dist.get_world_size()
    return out


def derive(measured: dict[str, Any]) -> dict[str, Any]:
    """Profile fields from the raw times, inverting the cost model's formulas for 2 ranks.

    ``planner_cost._ring`` prices an all-reduce over ``n`` ranks at ``2 (n-1)/n B / bw + 2 log2(n) lat``
    and a gather at half that; with ``n = 2`` a small all-reduce gives ``lat = t / 2`` and a large one
    ``bw = B / (t - 2 lat)``. FSDP and DTensor overheads exclude the collectives' latencies that the
    cost model prices separately (a ZeRO-2 unit gathers once and reduce-scatters once per step, a ZeRO-3
    unit gathers twice; a tp pair all-reduces once in forward and once in backward).
    """
    world = int(measured["world"])
    frac = (world - 1) / world
    latency = max(1e-6, measured["all_reduce_small"] / 2)
    # A large all-reduce is bandwidth-bound: at most half of it is charged to latency. On a loaded
    # machine the small all-reduce's time can reach the large one's (CI, 2 shared cores: 2.06 ms),
    # and subtracting it whole left 1e-9 s, a bandwidth of 2e15 B/s that ranked every layout wrong.
    ar_time = max(measured["all_reduce_large"] - 2 * latency, measured["all_reduce_large"] / 2, 1e-9)
    bandwidth = 2 * frac * LARGE_BYTES / ar_time

    def gather_scale(kind: str, full_bytes: float) -> float:
        base = frac * full_bytes / bandwidth  # the ring formula's bandwidth term, factor 1
        spent = measured[f"{kind}_large"] - measured[f"{kind}_small"]
        return max(0.1, spent / base)

    one = measured["all_gather_small"]
    # Per unit a + b x tensors: two unit sizes (2 and 2 x WIDE_LINEARS tensors) give both
    extra = 2 * (WIDE_LINEARS - 1)
    per_tensor = {k: max(0.0, (measured["fsdp_unit_wide"][k] - measured["fsdp_unit"][k]) / extra) for k in (2, 3)}
    fsdp = {
        2: max(0.0, measured["fsdp_unit"][2] - 2 * per_tensor[2] - 2 * one),
        3: max(0.0, measured["fsdp_unit"][3] - 2 * per_tensor[3] - 3 * one),
    }
    # A ZeRO-3 unit does all a ZeRO-2 unit does per step (hooks, copy-in and copy-out, its gather
    # and reduce-scatter) and gathers again in backward: its cost beyond the collectives is never
    # less. A calibration that measures it less is noise (seen: 1.04 vs 1.42 ms), and taken as is it
    # ranked zero3 before zero2.
    per_tensor[3] = max(per_tensor[3], per_tensor[2])
    fsdp[3] = max(fsdp[3], fsdp[2])
    return {
        "intra_latency": latency,
        "intra_bandwidth": bandwidth,
        "collective_scale": {
            "all_gather": gather_scale("all_gather", world * LARGE_BYTES),
            "reduce_scatter": gather_scale("reduce_scatter", LARGE_BYTES),
        },
        "fsdp_unit_overhead": fsdp,
        "fsdp_tensor_overhead": per_tensor,
        "tp_pair_overhead": max(0.0, measured["tp_pair"] - 2 * measured["all_reduce_small"]),
        "pipelined_latency": min(latency, measured["broadcast_stream"]),
        "comm_overlap": float(measured["overlap"]),
    }


def _trials_on_ranks(repeats: int, trials: int) -> list[dict[str, Any]]:
    return [measure_on_ranks(repeats) for _ in range(trials)]


def _merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Slowest rank's figure per measurement (a collective ends when its last rank does)."""
    merged: dict[str, Any] = {}
    for key, value in per_rank[0].items():
        if isinstance(value, dict):
            merged[key] = {k: max(r[key][k] for r in per_rank) for k in value}
        elif key == "overlap":
            merged[key] = min(r[key] for r in per_rank)
        else:
            merged[key] = max(r[key] for r in per_rank)
    return merged


def _median_fields(fields: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in fields[0].items():
        if isinstance(value, dict):
            out[key] = {k: statistics.median(f[key][k] for f in fields) for k in value}
        else:
            out[key] = statistics.median(f[key] for f in fields)
    return out


def calibrate_collectives(world_size: int = 2, repeats: int = 25, timeout: float = 180.0, trials: int = 3) -> dict[str, Any]:
    """Spawn ``world_size`` gloo ranks, measure ``trials`` times, and return the median over trials
    of each profile field of :func:`derive` (one trial's least times still moved by 2x between
    calibrations on this shared machine: the DTensor pair read 1.3 ms or 2.6 ms)."""
    from lightning_parallel.launcher import run_distributed

    per_rank = run_distributed(_trials_on_ranks, world_size, repeats, trials, timeout=timeout)
    derived = [derive(_merge_ranks([rank[t] for rank in per_rank])) for t in range(trials)]
    return _median_fields(derived)


__all__ = ["calibrate_collectives", "derive", "measure_on_ranks"]
