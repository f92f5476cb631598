"""The house rules, checked on the source tree (no process group, no import of the package).

* The layers: the torch layer (``parallel/``) imports nothing from Lightning, the planner or the
  strategies; the planner imports nothing from the strategies or Lightning; models, data and
  ``nn`` import nothing from the strategies or the planner.
* Small files: no module passes ``MAX_LINES``.
* Rooms, not prefixes: ``parallel/`` and ``strategies/`` hold no flat ``tp_*``/``pipeline_*``/
  ``planner*`` files; each technique lives in its own subpackage.

Imports are read with ``ast`` wherever they are written (module level or inside a function),
so a deferred import cannot hide a crossing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_parallel"
MAX_LINES = 500

LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "lightning_parallel.compat_lightning")
STRATEGY_SIDE = ("lightning_parallel.strategies", "lightning_parallel.callbacks", "lightning_parallel.app",
                 "lightning_parallel.cli", "lightning_parallel.train", "lightning_parallel.testing")

# folder (relative to the package) -> module prefixes none of its files may import
NEVERS: dict[str, tuple[str, ...]] = {
    "parallel": LIGHTNING + STRATEGY_SIDE + ("lightning_parallel.planner", "lightning_parallel.plan"),
    "planner": LIGHTNING + STRATEGY_SIDE,
    "models": STRATEGY_SIDE + ("lightning_parallel.planner", "lightning_parallel.parallel"),
    "data": STRATEGY_SIDE + ("lightning_parallel.planner", "lightning_parallel.parallel"),
    "nn": LIGHTNING + STRATEGY_SIDE + ("lightning_parallel.planner", "lightning_parallel.parallel"),
}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth of its code (``from x import y`` gives ``x`` and ``x.y``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def crossings(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for name in sorted(imported_modules(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return found


@pytest.mark.parametrize("folder", sorted(NEVERS))
def test_layers_import_nothing_across_a_never(folder: str) -> None:
    assert (PACKAGE / folder).is_dir(), folder
    found = crossings(folder, NEVERS[folder])
    assert not found, f"{folder}/ must not import {NEVERS[folder]}:\n" + "\n".join(found)


def test_crossing_check_sees_deferred_imports(tmp_path: Path) -> None:
    """The check itself: an import inside a function is still an import."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from lightning.pytorch import Trainer\n    import lightning_parallel.strategies.hybrid\n")
    assert {"lightning.pytorch", "lightning.pytorch.Trainer", "lightning_parallel.strategies.hybrid"} <= imported_modules(module)


def test_no_module_passes_the_line_limit() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (limit {MAX_LINES} lines): {long}"


@pytest.mark.parametrize("folder", ["parallel", "strategies"])
def test_techniques_live_in_rooms_not_prefixes(folder: str) -> None:
    flat = sorted(p.name for p in (PACKAGE / folder).glob("*.py")
                  if p.name.startswith(("tp_", "pipeline_", "planner", "tensor_parallel", "expert_parallel", "data_parallel")))
    assert not flat, f"{folder}/ has flat technique files {flat}: put them in the technique's subpackage"


def test_each_technique_has_its_room() -> None:
    for room in ("parallel/data", "parallel/tensor", "parallel/pipeline", "parallel/experts", "planner",
                 "strategies/pipeline", "strategies/checkpoint"):
        assert (PACKAGE / room / "__init__.py").is_file(), room
