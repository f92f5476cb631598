"""Every config group option composes and instantiates (no process group, no training), and the
SLURM launcher config composes with the submitit plugin without submitting anything."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_parallel.train import CONF_DIR

import lightning_parallel  # noqa: F401  (registers strategy names)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


def _compose(overrides: list[str], return_hydra_config: bool = False):  # type: ignore[no-untyped-def]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=return_hydra_config)


def _resolvable(cfg, tmp: Path):  # type: ignore[no-untyped-def]
    """Let ``${hydra:runtime.output_dir}`` resolve, as it does inside a running job."""
    from hydra.core.hydra_config import HydraConfig

    OmegaConf.set_struct(cfg, False)
    cfg.hydra.runtime.output_dir = str(tmp)
    HydraConfig.instance().set_config(cfg)
    return cfg


@pytest.mark.parametrize("name", _options("strategy"))
def test_each_strategy_config_instantiates(name: str) -> None:
    cfg = _compose([f"strategy={name}"])
    strategy = instantiate(cfg.strategy)
    if not hasattr(strategy, "resolve_dims"):
        return
    if cfg.strategy.get("tensor_parallel_size") == "auto" and cfg.strategy.get("pipeline_parallel_size") == "auto":
        # '3d' chooses its degrees from the model, on at least 4 processes (as the app checks it).
        from lightning_parallel.train import _check_degrees

        dims_cfg = _compose([f"strategy={name}", "trainer.devices=4"])
        _check_degrees(dims_cfg, strategy, 4)
        assert (strategy.resolve_dims(4).tp, strategy.resolve_dims(4).pp) == (2, 2)
        return
    strategy.resolve_dims(2)  # the default 2 processes fit every other preset


def test_compare_experiment_model_per_strategy() -> None:
    """experiment=compare runs every strategy on the GPT except `ep` (MoE layers needed, and
    pipelines cannot trace MoE dispatch): the app swaps in model=moe_gpt for that job only."""
    from lightning_parallel.train import _model_for_strategy

    for strategy, target in (("ep", "MoEGPT"), ("3d", "GPT"), ("dp", "GPT")):
        cfg = _compose(["experiment=compare", f"strategy={strategy}"])
        OmegaConf.set_struct(cfg, False)
        _model_for_strategy(cfg, strategy)
        assert cfg.model._target_.rsplit(".", 1)[1] == target
        assert cfg.model.block_size == cfg.data.block_size  # interpolations resolve in the job's config
    assert cfg.compare_devices_by_strategy["3d"] == 4 and cfg.run_test is False and cfg.data.eval_drop_last is True
    cfg.compare_model_by_strategy = {"dp": "moe_gtp"}
    with pytest.raises(ValueError, match=r"compare_model_by_strategy.dp`='moe_gtp' is not a model config.*moe_gpt"):
        _model_for_strategy(cfg, "dp")


@pytest.mark.parametrize("name", _options("model"))
def test_each_model_config_instantiates(name: str) -> None:
    import torch

    cfg = _compose([f"model={name}"])
    with torch.device("meta"):  # the large MLP would take 250 MB otherwise
        model = instantiate(cfg.model)
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("name", _options("data"))
def test_each_data_config_instantiates(name: str) -> None:
    instantiate(_compose([f"data={name}"]).data)


@pytest.mark.parametrize("group", ["trainer", "callbacks", "logger", "experiment"])
def test_other_groups_compose_and_instantiate(group: str, tmp_path: Path) -> None:
    for name in _options(group):
        cfg = _resolvable(_compose([f"{group}={name}"], return_hydra_config=True), tmp_path)
        for key in ("callbacks", "logger"):
            for node in (cfg.get(key) or {}).values():
                if node is not None:
                    instantiate(node)
        if cfg.trainer.accelerator == "gpu" and not __import__("torch").cuda.is_available():
            assert cfg.trainer.precision == "bf16-mixed"  # composed; a Trainer needs the GPU it asks for
            continue
        instantiate(cfg.trainer, strategy="auto", logger=False, enable_checkpointing=False)


def test_slurm_launcher_config_composes() -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cfg = _compose(["hydra/launcher=slurm", "trainer.devices=8", "trainer.num_nodes=2"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)
