"""The dry run prints the degrees the strategy itself resolves, for every preset and world size.

Why: the dry run once resolved the degrees on its own from the preset's values, so for ``3d``
(tensor and pipeline degrees "auto", chosen by the strategy from the model) it printed pp=8
on 8 processes and failed with "8 stages > 4 blocks", while the job would run dp2 x tp2 x pp2.

The reference here is independent of the dry run's code: a real ``pl.Trainer`` prepares the
strategy from the same config (devices, nodes, precision plugin), the meta-device model is
connected, and the strategy resolves its degrees and checks its plans as ``setup_environment()``
does (``resolve_dims``, ``check_context_layout``, ``_resolve_plans``). No process group, no spawned rank.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from lightning_parallel.plan import compose_config, main, resolve_for
from lightning_parallel.strategies.context import check_context_layout

ALL_WORLDS = (1, 2, 3, 4, 6, 8, 16, 64, 512)
FEW_WORLDS = (2, 3, 8, 64)
CASES = [
    # (preset, model, worlds): '3d' is the preset whose automatic degrees the dry run once got wrong
    ("3d", "gpt", ALL_WORLDS),
    ("3d", "moe_gpt", ALL_WORLDS),
    ("tp", "gpt", FEW_WORLDS),
    ("pp", "gpt", FEW_WORLDS),
    ("zero1", "gpt", FEW_WORLDS),
    ("hsdp", "gpt", FEW_WORLDS),
    ("ep", "moe_gpt", FEW_WORLDS),
    ("cp", "gpt", FEW_WORLDS),
]


def _meta_model(cfg: DictConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return instantiate(cfg.model)


def _strategy_resolves(cfg: DictConfig, world: int) -> tuple[str, Any]:
    """What the strategy resolves on ``world`` processes, prepared by a real Trainer: ("ok", dims) or ("error", exc)."""
    nodes = int(cfg.trainer.num_nodes)
    trainer = pl.Trainer(
        strategy=instantiate(cfg.strategy), accelerator=cfg.trainer.accelerator, devices=world // nodes, num_nodes=nodes,
        precision=cfg.trainer.precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    strategy = trainer.strategy
    strategy.connect(_meta_model(cfg))
    try:
        strategy._dims = strategy.resolve_dims()  # devices x num_nodes, as in setup_environment()
        check_context_layout(strategy._dims, bool(strategy.compile_blocks))
        strategy._resolve_plans()
    except (ValueError, TypeError) as err:
        return "error", err
    return "ok", strategy._dims


def _dry_run_resolves(cfg: DictConfig, world: int) -> tuple[str, Any]:
    try:
        return "ok", resolve_for(cfg, _meta_model(cfg), world).dims
    except (ValueError, TypeError) as err:
        return "error", err


def _agree(cfg: DictConfig, world: int) -> str:
    with warnings.catch_warnings():  # plan notes (modules kept whole) and Lightning's CPU hints are not the subject
        warnings.simplefilter("ignore")
        want, expected = _strategy_resolves(cfg, world)
        got, actual = _dry_run_resolves(cfg, world)
    assert got == want, f"world {world}: strategy {want} {expected}, dry run {got} {actual}"
    if want == "error":
        assert type(actual) is type(expected) and str(expected) in str(actual), (expected, actual)
        assert str(actual).startswith(f"world size {world} "), actual  # the world the automatic degrees came from
        return "error"
    assert (actual.shape, actual.ep, actual.describe()) == (expected.shape, expected.ep, expected.describe())
    return actual.describe()


@pytest.mark.parametrize(("preset", "model", "worlds"), CASES, ids=[f"{p}-{m}" for p, m, _ in CASES])
def test_dry_run_degrees_are_the_strategys(preset: str, model: str, worlds: tuple[int, ...]) -> None:
    cfg = compose_config([f"strategy={preset}", f"model={model}"])
    outcomes = {world: _agree(cfg, world) for world in worlds}
    if preset == "3d":  # the sample of the issue: a layout exists on 8 and 64 processes, with both model axes
        assert all("tp=2" in outcomes[w] and "pp=2" in outcomes[w] for w in (8, 64)), outcomes
        assert outcomes[1] == "error", outcomes


@pytest.mark.parametrize("overrides", [["trainer.precision=64-true"], ["trainer.num_nodes=2"]], ids=["fp64", "two-nodes"])
def test_dry_run_gives_the_strategy_what_the_trainer_would(overrides: list[str]) -> None:
    """Precision (pipelines refuse 64-true, so '3d' picks another layout) and processes per node enter the choice."""
    cfg = compose_config(["strategy=3d", "model=gpt", *overrides])
    chosen = _agree(cfg, 16)
    if "64-true" in overrides[0]:
        assert "pp=1" in chosen, chosen


@pytest.mark.parametrize("world", [8, 64])
def test_printout_of_3d_shows_the_choice(world: int, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m lightning_parallel.plan model=gpt strategy=3d +world_size=N``: the issue's command."""
    cfg = compose_config(["strategy=3d", "model=gpt"])
    _, dims = _strategy_resolves(cfg, world)
    code = main(["model=gpt", "strategy=3d", f"+world_size={world}"])
    out, err = capsys.readouterr()
    assert code == 0, err
    first = out.splitlines()[0]
    assert f"world size {world} from +world_size: {dims.describe()}" in first, first
    assert f"3d degrees: dp={dims.dp} x tp={dims.tp} x pp={dims.pp}" in out
    assert "Tensor-parallel plan (tp=2" in out and "pipeline plan: 2 stages on 2 ranks" in out


def test_a_world_without_a_layout_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    """One process cannot hold a model-parallel degree above 1: a typed error with the world and the rule."""
    cfg = compose_config(["strategy=3d", "model=gpt"])
    with pytest.raises(ValueError, match=r"world size 1 \(from \+world_size\).*needs at least 2 processes.*HINT"):
        resolve_for(cfg, _meta_model(cfg), 1)
    code = main(["model=gpt", "strategy=3d", "+world_size=1"])
    _, err = capsys.readouterr()
    assert code == 2 and "world size 1" in err and "at least 2 processes" in err and "Traceback" not in err
    # More stages than blocks (pp takes every process): refused with the world it came from, before any process.
    code = main(["model=gpt", "strategy=pp", "+world_size=8"])
    _, err = capsys.readouterr()
    assert code == 2 and "world size 8" in err and "more stages than blocks" in err and "HINT" in err
