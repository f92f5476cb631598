"""Hardware profiles for the layout planner: what one device computes and how fast its links move bytes.

The planner (:mod:`lightning_parallel.planner.search`) turns FLOPs and message sizes into
seconds with these numbers. Peak figures are the vendors' dense (no sparsity) datasheet values;
``compute_efficiency`` is the fraction of that peak a large transformer's matrix multiplies
sustain in practice, and the link bandwidths are what a collective achieves per device (NCCL
"bus bandwidth"), not the marketing aggregate. These two are judgement calls, written down once
here, and the published-configuration test (tests/test_planner.py) checks the whole model
against measured runs on real clusters.

Why fixed profiles serve the strategy: every rank must choose the same layout without talking
to the others (the choice is made before the process group exists), so the strategy never
measures anything; :func:`calibrate_cpu` measures this machine for the dry run only.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import dataclass, field

import torch

from lightning_parallel.parallel.errors import config_error

GiB = 1024**3


@dataclass(frozen=True)
class HardwareProfile:
    """One device type and the links between devices (inside a node and across nodes)."""

    name: str
    peak_flops: dict[str, float]  # dtype name -> dense FLOP/s
    memory_bytes: int
    devices_per_node: int
    intra_bandwidth: float  # bytes/s per device, collective bus bandwidth inside a node
    intra_latency: float  # seconds per collective step inside a node
    inter_bandwidth: float  # bytes/s per device across nodes (one NIC per device)
    inter_latency: float
    memory_bandwidth: float  # device memory bytes/s (the optimizer step is bound by it)
    compute_efficiency: float = 0.6  # sustained fraction of peak for large matmuls
    host_bandwidth: float = 25e9  # device <-> host bytes/s (cpu_offload)
    kernel_overhead: float = 0.0  # seconds of fixed cost per kernel/op that the device cannot hide
    tp_op_overhead: float = 0.0  # extra seconds per tensor-parallel (DTensor) op: dispatch a CPU cannot hide
    reserved_bytes: int = 0  # runtime context, allocator slack: not available to tensors
    attention_scores_stored: bool = False  # False: fused (flash) attention keeps no s x s scores
    tp_attention_scores_stored: bool = False  # under tensor parallelism (on CPU the strategy runs the math kernel)
    # Measured by planner/calibrate.py on this machine's real ranks; the defaults price nothing
    # extra, which is what the published-configuration tests of the GPU profiles were checked with.
    collective_scale: dict[str, float] = field(default_factory=dict)  # per-byte cost vs the ring formula
    fsdp_unit_overhead: dict[int, float] = field(default_factory=dict)  # ZeRO stage -> s per FSDP unit per step
    fsdp_tensor_overhead: dict[int, float] = field(default_factory=dict)  # ZeRO stage -> s per parameter tensor per step
    tp_pair_overhead: float = 0.0  # s per column+row parallel pair per forward+backward, beyond its all-reduces
    comm_overlap: float = 1.0  # fraction of an asynchronous collective that hides under compute
    pipelined_latency: float = 0.0  # s per small collective in a stream of asynchronous ones (0: intra_latency)
    notes: str = field(default="", compare=False)

    def flops(self, dtype: str) -> float:
        """Sustained FLOP/s for ``dtype`` (``bf16``, ``fp16``, ``fp32``)."""
        peak = self.peak_flops.get(dtype)
        if peak is None:
            raise config_error(
                ValueError, "dtype", dtype, f"profile {self.name!r} has peak FLOP/s for {sorted(self.peak_flops)}",
                f"use one of {sorted(self.peak_flops)}",
            )
        return peak * self.compute_efficiency

    def link(self, crosses_nodes: bool) -> tuple[float, float]:
        """(bandwidth, latency) of a collective whose group spans nodes or stays inside one."""
        return (self.inter_bandwidth, self.inter_latency) if crosses_nodes else (self.intra_bandwidth, self.intra_latency)

    def with_overrides(self, **changes: object) -> HardwareProfile:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


# Datasheets: A100 SXM 80GB (312 TFLOP/s bf16 dense, 19.5 fp32, NVLink3 600 GB/s bidirectional,
# 2.04 TB/s HBM2e); H100 SXM (989 TFLOP/s bf16 dense, 67 fp32, NVLink4 900 GB/s bidirectional,
# 3.35 TB/s HBM3); H200 (H100 compute, 141 GB HBM3e at 4.8 TB/s). Across nodes one 200 Gb/s (HDR)
# or 400 Gb/s (NDR) NIC per GPU. Bus bandwidths below are ~80% of the per-direction link rate.
PROFILES: dict[str, HardwareProfile] = {
    "a100-80gb": HardwareProfile(
        name="a100-80gb", peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12, "tf32": 156e12},
        memory_bytes=80 * GiB, devices_per_node=8, intra_bandwidth=240e9, intra_latency=8e-6,
        inter_bandwidth=20e9, inter_latency=15e-6, memory_bandwidth=2.0e12, compute_efficiency=0.7,
        host_bandwidth=25e9, kernel_overhead=0.0, reserved_bytes=2 * GiB,
    ),
    "h100-80gb": HardwareProfile(
        name="h100-80gb", peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 494e12, "fp8": 1979e12},
        memory_bytes=80 * GiB, devices_per_node=8, intra_bandwidth=360e9, intra_latency=8e-6,
        inter_bandwidth=40e9, inter_latency=15e-6, memory_bandwidth=3.35e12, compute_efficiency=0.55,
        host_bandwidth=50e9, kernel_overhead=0.0, reserved_bytes=2 * GiB,
    ),
    "h200": HardwareProfile(
        name="h200", peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 494e12, "fp8": 1979e12},
        memory_bytes=141 * 10**9, devices_per_node=8, intra_bandwidth=360e9, intra_latency=8e-6,
        inter_bandwidth=40e9, inter_latency=15e-6, memory_bandwidth=4.8e12, compute_efficiency=0.55,
        host_bandwidth=50e9, kernel_overhead=0.0, reserved_bytes=2 * GiB,
    ),
    # Nominal CPU processes talking over gloo (TCP loopback): fixed numbers so every rank of a
    # job computes the same plan; `calibrate_cpu()` measures this machine instead.
    "cpu": HardwareProfile(
        name="cpu", peak_flops={"fp32": 50e9, "bf16": 10e9, "fp16": 5e9},
        memory_bytes=16 * GiB, devices_per_node=64, intra_bandwidth=2e9, intra_latency=50e-6,
        inter_bandwidth=1e9, inter_latency=100e-6, memory_bandwidth=10e9, compute_efficiency=1.0,
        host_bandwidth=10e9, kernel_overhead=20e-6, tp_op_overhead=100e-6, reserved_bytes=0, attention_scores_stored=False,
        tp_attention_scores_stored=True,  # the CPU flash kernel keeps no scores; it has no DTensor rule, so tp runs math
    ),
}
ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h200-141gb": "h200"}


def get_profile(name: str | HardwareProfile) -> HardwareProfile:
    """A built-in profile by name (``a100-80gb``, ``h100-80gb``, ``h200``, ``cpu``), or ``calibrate``."""
    if isinstance(name, HardwareProfile):
        return name
    key = str(name).lower()
    key = ALIASES.get(key, key)
    if key in ("calibrate", "cpu-measured"):
        return calibrate_cpu()
    if key not in PROFILES:
        raise config_error(
            ValueError, "hardware", name, f"unknown hardware profile; built in: {sorted(PROFILES)}",
            "pick one of those, 'calibrate' (measure this machine), or pass a HardwareProfile",
        )
    return PROFILES[key]


def _timed(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Best-of wall time of ``fn`` (best, not mean: the least-disturbed run on a shared machine)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _socket_round_trip(rounds: int = 200) -> float:
    """One-way latency of a local socket message: what a gloo collective step pays at minimum."""
    a, b = socket.socketpair()
    try:
        start = time.perf_counter()
        for _ in range(rounds):
            a.sendall(b"x")
            b.recv(1)
            b.sendall(b"y")
            a.recv(1)
        return (time.perf_counter() - start) / (2 * rounds)
    finally:
        a.close()
        b.close()


def calibrate_cpu(size: int = 256, repeats: int = 5, processes: int = 2) -> HardwareProfile:
    """Measure this machine: fp32 matmul FLOP/s, memory-copy bandwidth, op overhead, socket latency,
    and with ``processes >= 2`` the collectives, FSDP2 and DTensor overheads on that many spawned gloo
    ranks (:func:`~lightning_parallel.planner.calibrate.calibrate_collectives`, about 10 s).

    Without processes it takes well under a second but prices collectives from a socket round
    trip, which a gloo collective exceeds forty-fold. Not used by the strategy (ranks would
    measure different numbers and could choose different layouts); the dry run uses it with
    ``hardware=calibrate``.
    """
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    flops = 2 * size**3 / _timed(lambda: torch.mm(a, b), repeats)
    big = torch.empty(8 * 1024 * 1024 // 4)
    out = torch.empty_like(big)
    copy_bw = 2 * big.numel() * 4 / _timed(lambda: out.copy_(big), repeats)
    tiny = torch.ones(4)
    overhead = _timed(lambda: [tiny.add(1.0) for _ in range(100)], repeats) / 100
    latency = _socket_round_trip()
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    memory = int(pages * os.sysconf("SC_PAGE_SIZE")) if pages else PROFILES["cpu"].memory_bytes
    nominal = PROFILES["cpu"]
    ranks: dict[str, object] = {}
    if processes >= 2:
        from lightning_parallel.planner.calibrate import calibrate_collectives

        ranks = calibrate_collectives(processes)
        # The tp pair's measured overhead includes DTensor's dispatch: the nominal per-op guess goes.
        ranks["tp_op_overhead"] = 0.0
    profile = nominal.with_overrides(
        name="cpu-calibrated",
        peak_flops={"fp32": flops, "bf16": flops / 5, "fp16": flops / 10},
        memory_bytes=memory, intra_bandwidth=copy_bw / 4, inter_bandwidth=copy_bw / 8,
        intra_latency=max(latency, 1e-6), inter_latency=max(2 * latency, 1e-6), memory_bandwidth=copy_bw,
        kernel_overhead=overhead, devices_per_node=os.cpu_count() or 1,
        notes=f"measured: {flops / 1e9:.1f} GFLOP/s fp32 ({size}x{size} mm), {copy_bw / 1e9:.1f} GB/s copy, "
        f"{overhead * 1e6:.1f} us per op, {latency * 1e6:.1f} us socket latency",
    )
    if not ranks:
        return profile
    fsdp = ranks["fsdp_unit_overhead"]
    assert isinstance(fsdp, dict)
    notes = (f"{profile.notes}; {processes} gloo ranks: {float(ranks['intra_latency']) * 1e3:.2f} ms collective latency, "  # type: ignore[arg-type]
             f"{float(ranks['intra_bandwidth']) / 1e9:.2f} GB/s, FSDP2 unit {fsdp[2] * 1e3:.2f}/{fsdp[3] * 1e3:.2f} ms "  # type: ignore[arg-type]
             f"(zero2/zero3) + {ranks['fsdp_tensor_overhead'][2] * 1e3:.2f}/{ranks['fsdp_tensor_overhead'][3] * 1e3:.2f} ms per tensor, tp pair {float(ranks['tp_pair_overhead']) * 1e3:.2f} ms, overlap {float(ranks['comm_overlap']):.2f}, "  # type: ignore[arg-type]
             f"{float(ranks['pipelined_latency']) * 1e3:.3f} ms per streamed broadcast")  # type: ignore[arg-type]
    return profile.with_overrides(inter_latency=2 * float(ranks["intra_latency"]),  # type: ignore[arg-type]
                                  inter_bandwidth=float(ranks["intra_bandwidth"]) / 2, notes=notes, **ranks)  # type: ignore[arg-type]


def profile_for_device(device: torch.device) -> HardwareProfile:
    """The built-in profile matching ``device`` (CUDA by name and memory; CPU: the nominal one)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return PROFILES["cpu"]
    props = torch.cuda.get_device_properties(device)
    name = props.name.lower()
    base = PROFILES["h200"] if "h200" in name else PROFILES["h100-80gb"] if "h100" in name else PROFILES["a100-80gb"]
    return base.with_overrides(memory_bytes=int(props.total_memory), name=f"{base.name} ({props.name})")


__all__ = ["GiB", "HardwareProfile", "PROFILES", "calibrate_cpu", "get_profile", "profile_for_device"]
