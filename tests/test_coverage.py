"""The coverage table script: cell texts, the markdown layout, group restarts, exit status, and
one tiny real run (a matching cell and a refused one in one spawned group)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightning_parallel import coverage
from lightning_parallel.coverage import Cell, format_table
from lightning_parallel.testing import DistributedRunError
from lightning_parallel.testing.coverage_cells import first_line, is_refusal, relative_difference


def test_cell_texts_and_table_layout() -> None:
    cells = [Cell("llama", "dp", "ok", 1.234e-7), Cell("llama", "ep", "n/a"),
             Cell("gpt2", "dp", "refused", message="ValueError: `x`=1 is | bad. HINT: y"),
             Cell("gpt2", "ep", "mismatch", 3e-3), Cell("resnet", "dp", "error", message="IndexError: out of range")]
    table = format_table(cells, ["llama", "gpt2", "resnet"], ["dp", "ep"])
    assert table.splitlines() == [
        "| model | dp (2) | ep (2) |",
        "|---|---|---|",
        "| llama | 1.2e-07 | n/a |",
        "| gpt2 | refused: ValueError: `x`=1 is \\| bad. HINT: y | FAIL: 3.0e-03 > 1e-05 |",
        "| resnet | FAIL: IndexError: out of range |  |",
    ]
    assert [c.failed for c in cells] == [False, False, False, True, True]
    assert len(Cell("a", "dp", "error", message="x" * 500).text()) < 200


def test_refusals_are_typed_config_errors_only() -> None:
    from lightning_parallel.errors import config_error

    assert is_refusal(config_error(ValueError, "f", 1, "rule", "fix"))
    assert not is_refusal(ValueError("min() arg is an empty sequence"))  # an internal error, not a refusal
    assert not is_refusal(RuntimeError("HINT: but not a config error type"))
    assert first_line(IndexError("Dimension out of range\nmore")) == "IndexError: Dimension out of range"


def test_relative_difference_checks_steps_names_and_values() -> None:
    import torch

    ref = {"losses": [1.0] * 5, "params": {"w": torch.ones(3)}}
    assert relative_difference([1.0] * 5, {"w": torch.ones(3)}, ref) == (0.0, 0.0, None)
    loss, param, reason = relative_difference([1.0] * 4 + [1.1], {"w": torch.ones(3) * 1.01}, ref)
    assert reason is None and loss == pytest.approx(0.1) and param == pytest.approx(0.01)
    assert relative_difference([1.0] * 4, {"w": torch.ones(3)}, ref)[2] is not None
    assert "names differ" in str(relative_difference([1.0] * 5, {"v": torch.ones(3)}, ref)[2])


def test_a_cell_that_breaks_its_group_fails_and_the_rest_run_in_a_fresh_group(tmp_path: Path, monkeypatch: Any) -> None:
    import lightning_parallel.testing as testing

    calls: list[list[str]] = []

    def fake_run_distributed(fn: Any, world: int, jobs: list[Any], out_dir: str, *_: Any, **__: Any) -> None:
        calls.append([job[0] for job in jobs])
        for cell_id, *_ in jobs:
            (Path(out_dir) / f"{cell_id}.started").write_text("")
            if cell_id == "gpt2__dp" and len(calls) == 1:
                raise DistributedRunError("distributed run failed:\n--- rank 1 failed:\nTraceback ...\n"
                                          "IndexError: Dimension out of range\n--- rank 0: no result within 9s (killed)")
            (Path(out_dir) / f"{cell_id}.json").write_text(json.dumps({"kind": "ok", "value": 1e-7}))

    monkeypatch.setattr(testing, "run_distributed", fake_run_distributed)
    cells = [Cell("llama", "dp"), Cell("gpt2", "dp"), Cell("vit", "dp")]
    coverage._run_group(2, cells, {"llama": "", "gpt2": "", "vit": ""}, tmp_path, 10.0)
    assert calls == [["llama__dp", "gpt2__dp", "vit__dp"], ["vit__dp"]]
    assert [(c.kind, c.message) for c in cells] == [("ok", ""), ("error", "IndexError: Dimension out of range"), ("ok", "")]


class HangingModule:
    """Stands in for a cell that hangs outside any collective (the watchdog's case)."""

    def __init__(self) -> None:
        import time

        time.sleep(120)


def test_a_hanging_cell_is_recorded_as_a_timeout(tmp_path: Path) -> None:
    from lightning_parallel.testing import run_distributed
    from lightning_parallel.testing.coverage_cells import run_cells
    from lightning_parallel.testing.parity import FitSpec

    jobs = [("llama__dp", FitSpec(model=f"{__name__}:HangingModule"), "dp", "")]
    with pytest.raises(DistributedRunError, match="exited with code 3"):
        run_distributed(run_cells, 1, jobs, str(tmp_path), 3.0, init_backend=None, timeout=90)
    assert json.loads((tmp_path / "llama__dp.json").read_text()) == {"kind": "error", "message": "timeout: the cell ran past 3 s"}


def test_main_exit_status_and_output_file(tmp_path: Path, monkeypatch: Any) -> None:
    results = {"ok": [Cell("llama", "dp", "ok", 1e-7), Cell("llama", "ep", "n/a")],
               "broken": [Cell("llama", "dp", "error", message="RuntimeError: boom"), Cell("llama", "ep", "n/a")]}
    for name, cells in results.items():
        monkeypatch.setattr(coverage, "run_matrix", lambda pairs, cells=cells, **_: cells)
        out = tmp_path / f"{name}.md"
        status = coverage.main(["--models", "llama", "--strategies", "dp,ep", "--out", str(out)])
        assert status == (0 if name == "ok" else 1)
        assert out.read_text().startswith("| model | dp (2) | ep (2) |")
    with pytest.raises(SystemExit, match="unknown models"):
        coverage.main(["--models", "llama,nonesuch"])
    assert {m for m, _ in coverage.CI_SUBSET} == set(coverage.MODELS)
    assert {s for _, s in coverage.CI_SUBSET} == set(coverage.STRATEGIES)


def test_tiny_real_run_one_matching_cell_and_one_refused_cell() -> None:
    # vit under dp matches one process; resnet (BatchNorm, sync_batchnorm=True) under pp is
    # refused before any collective: BatchNorm in pipeline stages normalises each microbatch.
    cells = coverage.run_matrix([("vit", "dp"), ("resnet", "pp")], timeout_per_cell=200)
    by_strategy = {c.strategy: c for c in cells}
    assert by_strategy["dp"].kind == "ok" and by_strategy["dp"].value is not None and by_strategy["dp"].value <= 1e-5
    assert by_strategy["pp"].kind == "refused" and "sync_batchnorm" in by_strategy["pp"].message
