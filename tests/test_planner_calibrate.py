"""The measured CPU profile (planner/calibrate.py) and what the cost model does with it.

``derive`` must invert the cost model's own formulas (a drifted formula or a wrong inversion fails
here, not only in the ranking benchmark); each measured overhead must move the layout it belongs to
and no other; and one real 2-rank calibration must give finite, positive figures.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lightning_parallel.models import GPT
from lightning_parallel.planner.calibrate import LARGE_BYTES, SMALL_BYTES, calibrate_collectives, derive
from lightning_parallel.planner.hardware import PROFILES
from lightning_parallel.planner.search import SearchSpace, plan_layouts
from lightning_parallel.planner.cost import _ring

RAW = {  # seconds, the shape of measure_on_ranks' answer (figures of this machine's order)
    "all_reduce_small": 0.4e-3, "all_gather_small": 0.3e-3, "reduce_scatter_small": 0.35e-3,
    "all_reduce_large": 4.0e-3, "all_gather_large": 7.0e-3, "reduce_scatter_large": 5.0e-3,
    "fsdp_unit": {2: 2.0e-3, 3: 3.0e-3}, "fsdp_unit_wide": {2: 2.6e-3, 3: 3.9e-3}, "tp_pair": 5.0e-3, "overlap": 0.25, "world": 2, "broadcast_stream": 0.05e-3,
}


def _profile(**fields: object) -> object:
    return dataclasses.replace(PROFILES["cpu"], **fields)


def test_derive_inverts_the_ring_formula() -> None:
    d = derive(RAW)
    link = (d["intra_bandwidth"], d["intra_latency"])
    assert _ring(SMALL_BYTES, 2, link) == pytest.approx(RAW["all_reduce_small"], rel=0.01)
    assert _ring(LARGE_BYTES, 2, link) == pytest.approx(RAW["all_reduce_large"], rel=1e-9)
    ag = _ring(2 * LARGE_BYTES, 2, link, factor=1.0, scale=d["collective_scale"]["all_gather"])
    assert ag - link[1] == pytest.approx(RAW["all_gather_large"] - RAW["all_gather_small"], rel=1e-9)
    rs = _ring(LARGE_BYTES, 2, link, factor=1.0, scale=d["collective_scale"]["reduce_scatter"])
    assert rs - link[1] == pytest.approx(RAW["reduce_scatter_large"] - RAW["reduce_scatter_small"], rel=1e-9)
    # Overheads exclude the collective latencies the model prices on its own
    # Units of 2 and 8 tensors: 0.1 ms (zero2) and 0.15 ms (zero3) per tensor, the rest per unit
    assert d["fsdp_tensor_overhead"] == pytest.approx({2: 0.1e-3, 3: 0.15e-3})
    assert d["fsdp_unit_overhead"] == pytest.approx({2: 2.0e-3 - 0.2e-3 - 2 * 0.3e-3, 3: 3.0e-3 - 0.3e-3 - 3 * 0.3e-3})
    assert d["tp_pair_overhead"] == pytest.approx(5.0e-3 - 2 * 0.4e-3)
    assert d["comm_overlap"] == 0.25
    assert d["pipelined_latency"] == 0.05e-3


def _step_times(profile: object) -> dict[str, float]:
    with torch.device("meta"):
        model = GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    out = {}
    for name, tp, pp, zero in (("dp", 1, 1, 0), ("zero1", 1, 1, 1), ("zero2", 1, 1, 2), ("zero3", 1, 1, 3),
                               ("tp2", 2, 1, 0), ("pp2", 1, 2, 0)):
        space = SearchSpace(tensor_parallel_size=tp, pipeline_parallel_size=pp, zero_stages=(zero,),
                            activation_checkpointing=(False,), cpu_offload=(False,), hybrid_shard=(False,),
                            sequence_parallel=(False,), schedules=("1f1b",), microbatches=2 if pp > 1 else None)
        out[name] = plan_layouts(model, 2, global_batch=16, seq_len=64, hardware=profile, dtype="fp32",
                                 optimizer="sgd_momentum", space=space).ranked[0].step_time
    return out


def test_zero3_unit_overhead_is_never_below_zero2s() -> None:
    """A ZeRO-3 unit does a ZeRO-2 unit's work and gathers again: a noisy calibration that measures
    it cheaper is raised to ZeRO-2's figure, per unit and per tensor (only then)."""
    noisy = {**RAW, "fsdp_unit": {2: 3.0e-3, 3: 2.0e-3}, "fsdp_unit_wide": {2: 3.9e-3, 3: 2.3e-3}}
    d, clean = derive(noisy), derive(RAW)
    assert d["fsdp_unit_overhead"][3] == d["fsdp_unit_overhead"][2] > 0
    assert d["fsdp_tensor_overhead"][3] == d["fsdp_tensor_overhead"][2] > 0
    assert clean["fsdp_unit_overhead"][3] > clean["fsdp_unit_overhead"][2]  # untouched when already ordered


def test_a_small_all_reduce_as_slow_as_a_large_one_is_noise() -> None:
    """CI measured a small all-reduce at 2.06 ms on a loaded machine, as long as the large one: the
    latency it implies is not subtracted whole, and the bandwidth stays physical."""
    noisy = {**RAW, "all_reduce_small": 4.2e-3}
    d = derive(noisy)
    assert d["intra_bandwidth"] == pytest.approx(LARGE_BYTES / (RAW["all_reduce_large"] / 2))
    assert derive(RAW)["intra_bandwidth"] == pytest.approx(LARGE_BYTES / (RAW["all_reduce_large"] - RAW["all_reduce_small"]))


def test_each_measured_overhead_moves_its_own_layouts() -> None:
    base = _step_times(_profile())
    fsdp = _step_times(_profile(fsdp_unit_overhead={2: 1e-3, 3: 2e-3}, fsdp_tensor_overhead={2: 1e-4, 3: 2e-4}))
    units = 4 + 1  # blocks plus the root
    with torch.device("meta"):
        tensors = len(list(GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128).parameters()))
    assert fsdp["zero2"] - base["zero2"] == pytest.approx(units * 1e-3 + tensors * 1e-4, rel=1e-6)
    assert fsdp["zero3"] - base["zero3"] == pytest.approx(units * 2e-3 + tensors * 2e-4, rel=1e-6)
    assert all(fsdp[k] == base[k] for k in ("dp", "zero1", "tp2", "pp2"))
    tp = _step_times(_profile(tp_pair_overhead=1e-3))
    assert tp["tp2"] - base["tp2"] == pytest.approx(4 * 2 * 1e-3, rel=1e-6)  # two pairs per block
    assert all(tp[k] == base[k] for k in ("dp", "zero1", "zero2", "zero3", "pp2"))
    base = _step_times(_profile(comm_overlap=0.0))  # nothing hidden: every latency shows
    slow = _step_times(_profile(comm_overlap=0.0, intra_latency=1e-3))
    with torch.device("meta"):
        tensors = len(list(GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128).parameters()))
    # ZeRO-1's per-parameter broadcasts: one latency each on top of what dp pays
    gained = (slow["zero1"] - base["zero1"]) - (slow["dp"] - base["dp"])
    assert gained >= tensors * (1e-3 - PROFILES["cpu"].intra_latency) * 0.99
    hidden = _step_times(_profile(comm_overlap=1.0))
    exposed = _step_times(_profile(comm_overlap=0.0))
    assert exposed["dp"] > hidden["dp"] or math.isclose(exposed["dp"], hidden["dp"])
    assert exposed["zero3"] > hidden["zero3"]


def test_a_real_calibration_on_two_ranks() -> None:
    d = calibrate_collectives(2, repeats=3, timeout=120, trials=2)
    assert 0 < d["intra_latency"] < 0.1 and 1e6 < d["intra_bandwidth"] < 1e12
    assert all(v > 0 for v in d["collective_scale"].values())
    assert set(d["fsdp_unit_overhead"]) == {2, 3} and all(v >= 0 for v in d["fsdp_unit_overhead"].values())
    assert set(d["fsdp_tensor_overhead"]) == {2, 3} and all(v >= 0 for v in d["fsdp_tensor_overhead"].values())
    assert d["tp_pair_overhead"] >= 0 and 0.0 <= d["comm_overlap"] <= 1.0
    assert 0 < d["pipelined_latency"] <= d["intra_latency"]
