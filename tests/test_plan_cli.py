"""The dry run ``python -m lightning_parallel.plan``: plan tables and per-rank bytes, no processes.

The expected numbers are computed here from the GPT's shapes (not from ``tp_param_bytes``), so
a planner or byte count that drifted would fail: in the package's GPT every weight is split by
the tensor-parallel plan except the position embedding, the norms and the row-parallel biases.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest

from lightning_parallel.plan import compose_config, main

GPT_TP4 = ["model=gpt", "strategy=tp", "strategy.tensor_parallel_size=4"]


def _gpt_sizes() -> dict[str, int]:
    """Element counts of the configured GPT: total and replicated under tensor parallelism."""
    m = compose_config(GPT_TP4).model
    layers, width, vocab, block = int(m.n_layer), int(m.n_embd), int(m.vocab_size), int(m.block_size)
    per_layer = 4 * (width * width + width) + 2 * (4 * width * width) + 4 * width + width + 2 * 2 * width
    total = 2 * vocab * width + block * width + layers * per_layer + 2 * width
    replicated = block * width + (2 * layers + 1) * 2 * width + 2 * layers * width  # pos_emb, norms, row biases
    return {"total": total, "replicated": replicated}


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_tp4_plan_fraction_and_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(GPT_TP4, capsys)
    assert code == 0, err
    sizes = _gpt_sizes()
    sharded = sizes["total"] - sizes["replicated"]
    assert "Tensor-parallel plan (tp=4, source=inferred)" in out
    assert f"sharded {sharded:,} of {sizes['total']:,} parameters ({100 * sharded / sizes['total']:.1f}%)" in out
    per_rank = 4 * (sharded // 4 + sizes["replicated"])  # fp32 bytes
    assert (
        f"parameter bytes per tensor-parallel rank: {per_rank:,}" in out
        and f"sharded {4 * sharded // 4:,}" in out
        and f"replicated {4 * sizes['replicated']:,}" in out
    ), out
    assert re.search(r"blocks\.\*\.attn\.q\s+colwise\s+x4", out) and re.search(r"blocks\.\*\.mlp\.proj\s+rowwise\s+x4", out)
    replicated_block = out.split("replicated on every tensor-parallel rank:")[1]
    for name in ("pos_emb", "blocks.*.ln_1", "ln_f"):
        assert f"  {name}: " in replicated_block, name
    assert "world size 4" in out and "tp=4" in out


def test_tp_and_pp_together_split_the_bytes_by_stage(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["model=gpt", "strategy=tp", "strategy.tensor_parallel_size=2", "strategy.pipeline_parallel_size=2"], capsys)
    assert code == 0, err
    assert "Tensor-parallel plan (tp=2" in out and "pipeline plan: 2 stages on 2 ranks" in out
    tp_rank_bytes = int(re.search(r"parameter bytes per tensor-parallel rank: ([\d,]+)", out).group(1).replace(",", ""))
    stage_bytes = [int(b.replace(",", "")) for b in re.findall(r"pipeline rank \d: ([\d,]+) parameter bytes", out)]
    assert len(stage_bytes) == 2 and all(b > 0 for b in stage_bytes)
    assert sum(stage_bytes) == tp_rank_bytes  # the stages partition the tensor-parallel rank's bytes


def test_pipeline_only(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["model=gpt", "strategy=zero3", "strategy.pipeline_parallel_size=2", "+world_size=4"], capsys)
    assert code == 0, err
    assert "Tensor-parallel plan" not in out and "pipeline plan: 2 stages on 2 ranks" in out
    assert "pp=2 x dp_replicate=1 x dp_shard=2" in out and "dp_shard=2 ranks" in out


def test_non_strict_plan_keeps_attention_replicated_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(UserWarning, match="not divisible"):
        code, out, err = _run(["model=gpt", "strategy=tp", "strategy.tensor_parallel_size=8"], capsys)
    assert code == 0, err
    assert re.search(r"blocks\.\*\.attn\.q: attention heads 4 % tp 8 != 0", out), out


def test_bad_world_size_and_degrees_exit_non_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["model=gpt", "strategy=tp", "strategy.tensor_parallel_size=4", "+world_size=6"], capsys)
    assert code == 2 and "6" in err and "HINT" in err
    code, _, err = _run(["model=gpt", "strategy=no_such_strategy"], capsys)
    assert code == 2 and "no_such_strategy" in err


def test_strict_plan_error_as_a_subprocess() -> None:
    """The real entry point: a size that does not divide the heads fails with the module's name."""
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_parallel.plan", "model=gpt", "strategy=tp",
         "strategy.tensor_parallel_size=8", "strategy.strict_plan=true"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "blocks.0.attn" in proc.stderr and "attention heads=4" in proc.stderr and "HINT" in proc.stderr
    assert "Tensor-parallel plan" not in proc.stdout


# ---------------------------------------------------------------- --search: the layout planner's ranking
def test_search_ranks_layouts_for_a_cluster_without_processes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["--search", "--world-size", "16", "--devices-per-node", "8", "--hardware", "a100-80gb",
                           "--global-batch", "32", "--top", "5", "model=gpt"], capsys)
    assert code == 0, err
    assert out.startswith("planner: ") and " on 16 x a100-80gb (80.0 GiB each)" in out
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+[* ] dp", line)]
    assert len(rows) == 5 and "*" in rows[0][:5]  # fastest first, the choice marked
    assert re.search(r"\d+ of \d+ layouts fit; \d+ rejected", out)


def test_search_json_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    code, out, err = _run(["--search", "--json", "--nodes", "2", "--devices-per-node", "4", "--hardware", "h100",
                           "--device-memory-gib", "4", "--3d", "--dtype", "bf16", "model=gpt"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["world_size"] == 8 and data["devices_per_node"] == 4 and data["device_memory_bytes"] == 4 * 1024**3
    assert data["hardware"] == "h100-80gb" and data["require_model_parallel"] is True
    chosen = data["chosen"]["layout"]
    assert chosen["tp"] * chosen["pp"] > 1 and data["chosen"]["peak_bytes_per_rank"] <= 4 * 1024**3
    assert data["counts"]["fit"] == len(data["ranked"]) or data["counts"]["fit"] > len(data["ranked"])


def test_search_flag_errors_exit_non_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["--search", "--world-size", "x", "model=gpt"], capsys)
    assert code == 2 and "--world-size" in err
    code, _, err = _run(["--search", "--hardware", "tpu", "--world-size", "4", "model=gpt"], capsys)
    assert code == 2 and "unknown hardware profile" in err
    code, _, err = _run(["--search", "--bogus", "model=gpt"], capsys)
    assert code == 2 and "--bogus" in err


def test_search_partial_recompute_flag_reaches_the_planner(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_parallel.planner.search as planner

    seen: list[Any] = []
    real = planner.plan_layouts

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["space"])
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_layouts", spy)
    for extra, expected in (([], False), (["--partial-recompute"], True)):
        code, _, err = _run(["--search", "--world-size", "8", "--hardware", "h100", *extra, "model=gpt"], capsys)
        assert code == 0, err
        assert seen[-1].partial_recompute is expected
