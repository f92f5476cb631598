"""examples/larger_than_memory.py, the README's "larger than one device" demonstration, at a tiny
size so it cannot rot: the meta-built GPT trains under ``zero3`` and ``pp`` (both in one spawned
group), every rank holds only its part, losses are finite and the per-rank report prints."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType
from typing import Any

from lightning_parallel.testing import run_distributed

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "larger_than_memory.py"
SHAPE = {"layers": 2, "width": 64, "heads": 1, "vocab": 128, "block": 16, "steps": 3}


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("larger_than_memory", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _both(devices: int) -> list[tuple[dict[str, Any], str]]:
    example = _example()
    out = []
    for strategy in ("zero3", "pp"):
        result = example.train(strategy, devices=devices, **SHAPE)
        out.append((result, example.describe(strategy, result)))
    return out


def test_larger_than_memory_example_trains_under_zero3_and_pp() -> None:
    devices = 2
    results = run_distributed(_both, devices, devices, init_backend=None, timeout=300)
    whole = results[0][0][0]["params"] * 4  # fp32 bytes of the whole model
    for rank, per_rank in enumerate(results):
        for (result, line), strategy in zip(per_rank, ("zero3", "pp")):
            assert len(result["losses"]) == SHAPE["steps"], (strategy, result)
            assert all(math.isfinite(v) for v in result["losses"]), (strategy, result["losses"])
            # the layout's part only: zero3 a 1/2 shard, pp2 one stage (one block and an embedding or the head)
            assert 0 < result["params_held"] < 0.75 * whole, (strategy, rank, result["params_held"], whole)
            assert 0 < result["grads_held"] <= result["params_held"], (strategy, rank, result)
            assert line.startswith(f"{strategy} rank {result['rank']}: ") and "peak RSS" in line, line
    # both strategies train the same model from the same seed: first losses agree (the same initial weights)
    for rank_results in results:
        assert abs(rank_results[0][0]["losses"][0] - rank_results[1][0]["losses"][0]) < 1e-4, rank_results
