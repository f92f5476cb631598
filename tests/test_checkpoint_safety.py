"""Checkpoints never run code (issue 28): every load is weights-only unless the user trusts the file.

A checkpoint carrying an executable pickle (the marker-file pattern: an object whose unpickling
touches a file) is refused under dp, zero1, zero3, tp, pp, ep and 3d, in both formats (one file;
a sharded directory, whose ``meta.pt``, DCP ``.metadata`` and DCP non-tensor entries are each
tried), for ``fit`` (resume) and ``validate``, and by ``lightning_parallel.export``. Every rank
raises the same typed error (none waits in a collective), and the marker never appears.
``weights_only=False`` (the user's trust) and ``torch.serialization.safe_globals`` still load a
trusted file with a custom class, the pipeline's deferred load at the first batch included; and
what the strategies write loads with plain ``torch.load(weights_only=True)``.

The cases share one spawned group per world size (2 ranks, then 4 for 3d): starting a rank costs
about 4 s, a refused load much less.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_parallel.errors import UnsafeCheckpointError
from lightning_parallel.export import export_state_dict, load_model_state, main as export_main
from lightning_parallel.strategies.checkpoint.files import META_FILENAME
from lightning_parallel.strategies.checkpoint.resume import RNG_KEY
from lightning_parallel.strategies.checkpoint.safe_load import dcp_load, read_metadata, refusal, weights_only_in_effect
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fits
from tests.test_data_parallel import HYBRID

GPT_KWARGS = {"vocab_size": 64, "block_size": 16, "n_layer": 4, "n_head": 4, "n_embd": 32, "lr": 0.5}
MOE_KWARGS = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32, "lr": 0.5, "num_experts": 4, "top_k": 2}
GPT, MOE = "lightning_parallel.models:GPT", "lightning_parallel.models:MoEGPT"
WRITE = FitSpec(model=GPT, model_kwargs=GPT_KWARGS, data="lightning_parallel.testing.parity:token_data",
                data_kwargs={"num_samples": 32}, global_batch=8, max_steps=2, devices=2)
REFUSED = "UnsafeCheckpointError"


class Payload:
    """Unpickling it touches ``marker``: what a malicious checkpoint does instead (``os.system``...)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


class TrustedLR(float):
    """A harmless custom class in a trusted file (a float, so the optimizer steps with it)."""


@dataclasses.dataclass
class Case:
    label: str
    strategy: str
    kind: str  # "fit" (resume) or "validate"
    checkpoint: str
    model: str = GPT
    weights_only: bool | None = None
    allow: bool = False  # run under torch.serialization.safe_globals([TrustedLR])


def attempt(case: Case, marker: str, devices: int) -> dict[str, Any]:
    """Run ``case`` on this rank; its outcome (the error's type and message, or the step reached)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, DistributedSampler

    import lightning_parallel  # noqa: F401  (registers the strategy names)
    from lightning_parallel.testing.parity import _load, token_data

    pl.seed_everything(0, verbose=False)
    model = _load(case.model)(**(MOE_KWARGS if case.model == MOE else GPT_KWARGS))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=case.strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, use_distributed_sampler=False, limit_val_batches=1)
    if getattr(trainer.strategy, "lightning_module", "n/a") is None:
        trainer.strategy.connect(model)  # '3d' reads the model to choose its degrees
    sampler_kwargs = trainer.strategy.distributed_sampler_kwargs
    loader = DataLoader(token_data(num_samples=32), batch_size=8 // sampler_kwargs["num_replicas"], drop_last=True,
                        sampler=DistributedSampler(token_data(num_samples=32), shuffle=False, drop_last=True, **sampler_kwargs))
    out: dict[str, Any] = {"error": None}
    try:
        with torch.serialization.safe_globals([TrustedLR] if case.allow else []):
            if case.kind == "fit":
                trainer.fit(model, train_dataloaders=loader, ckpt_path=case.checkpoint, weights_only=case.weights_only)
            else:
                trainer.validate(model, dataloaders=loader, ckpt_path=case.checkpoint, weights_only=case.weights_only,
                                 verbose=False)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        out = {"error": type(error).__name__, "message": str(error), "unpickling": isinstance(error, pickle.UnpicklingError),
               "refused": getattr(error, "refused", None)}
    out.update(step=trainer.global_step, marker=os.path.exists(marker))
    return out


def attempt_all(cases: list[Case], marker: str, devices: int) -> list[dict[str, Any]]:
    return [attempt(case, marker, devices) for case in cases]


# ---------------------------------------------------------------------------------- files
def _write_clean(tmp: Path) -> dict[str, Path]:
    """Checkpoints written by the strategies (2 ranks, 2 steps): both formats under zero1 and ep (a
    pipeline writes the same files: test_pipeline_checkpoint.py; resharding reads any of them anywhere)."""
    writers = {"zero1": ({"zero_stage": 1}, GPT), "ep": ({"expert_parallel_size": 2}, MOE)}
    specs, paths = [], {}
    for name, (kwargs, model) in writers.items():
        for sharded in (False, True):
            path = tmp / f"{name}-{'dir' if sharded else 'file'}.ckpt"
            specs.append(dataclasses.replace(WRITE, model=model, model_kwargs=MOE_KWARGS if model == MOE else GPT_KWARGS,
                                             strategy={"class": HYBRID, "save_distributed_checkpoint": sharded, **kwargs},
                                             save_to=str(path)))
            paths[path.stem] = path
    run_distributed(run_fits, 2, specs, init_backend=None, timeout=600)
    return paths


def _with_hparam(source: Path, target: Path, value: Any) -> Path:
    """A copy of ``source`` (file or directory) whose hyper-parameters hold ``value``."""
    if source.is_dir():
        shutil.copytree(source, target)
        meta = target / META_FILENAME
        checkpoint = torch.load(meta, weights_only=True)
        checkpoint["hyper_parameters"]["extra"] = value
        torch.save(checkpoint, meta)
    else:
        checkpoint = torch.load(source, weights_only=True)
        checkpoint["hyper_parameters"]["extra"] = value
        torch.save(checkpoint, target)
    return target


def _with_metadata_payload(source: Path, target: Path, marker: str) -> Path:
    """A copy of the sharded ``source`` whose DCP ``.metadata`` pickle carries the payload."""
    shutil.copytree(source, target)
    metadata = read_metadata(target, weights_only=True)
    metadata.planner_data = {"extra": Payload(marker)}
    with open(target / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    return target


def _with_entry(source: Path, target: Path, key: str, value: Any) -> Path:
    """A sharded copy of ``source`` (written again by one process) whose DCP entry ``key`` is ``value``."""
    metadata = read_metadata(source, weights_only=True).state_dict_metadata
    state: dict[str, Any] = {k: torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else 0.0
                             for k, m in metadata.items()}
    dcp_load(state, source, weights_only=True)
    state[key] = value
    dcp.save(state, checkpoint_id=str(target), no_dist=True)
    shutil.copy(source / META_FILENAME, target / META_FILENAME)
    return target


def _trusted(source: Path, target: Path) -> Path:
    """A copy of a consolidated file with TrustedLR as the hyper-parameter and optimizer learning rate."""
    checkpoint = torch.load(source, weights_only=True)
    checkpoint["hyper_parameters"]["lr"] = TrustedLR(0.5)
    checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] = TrustedLR(0.5)
    torch.save(checkpoint, target)
    return target


# ---------------------------------------------------------------------------------- checks
def _assert_refused(label: str, per_rank: list[dict[str, Any]], where: str, refused: str | None = None) -> None:
    for rank, out in enumerate(per_rank):
        assert out["error"] == REFUSED and out["unpickling"], f"{label} rank {rank}: {out}"
        message = out["message"]
        assert where in message, f"{label} rank {rank}: the file is not named: {message[:300]}"
        assert "is refused" in message and "weights_only=False" in message and "trainer.fit(" in message, message[:600]
        assert out["refused"] and f"`{out['refused']}`" in message, f"{label}: the refused object is not named: {message[:300]}"
        if refused is not None:
            assert out["refused"] == refused, f"{label}: {out['refused']}"
            assert f"add_safe_globals([{refused}])" in message, message[:600]
        assert not out["marker"], f"{label}: the payload ran on rank {rank}"


def _assert_loaded(label: str, per_rank: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(per_rank):
        assert out["error"] is None, f"{label} rank {rank}: {out.get('message', '')[:2000]}"
        assert not out["marker"]


def _by_case(cases: list[Case], results: list[list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    return {case.label: [rank[i] for rank in results] for i, case in enumerate(cases)}


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _write_clean(tmp_path_factory.mktemp("clean"))


def test_what_the_strategies_write_loads_weights_only(clean: dict[str, Path]) -> None:
    """Both formats' non-DCP files under plain ``torch.load(weights_only=True)``; DCP metadata under ours."""
    for name, path in clean.items():
        loaded = torch.load(path / META_FILENAME if path.is_dir() else path, weights_only=True)
        assert len(loaded[RNG_KEY]) == 2 and {"torch", "python", "numpy"} <= set(loaded[RNG_KEY][1]), name  # each rank's
        assert loaded["global_step"] == 2 and "fit_loop" in loaded["loops"], name
        assert loaded["hyper_parameters"]["lr"] == 0.5, name
        if path.is_dir():
            assert read_metadata(path, weights_only=True).state_dict_metadata, name
        else:
            assert loaded["optimizer_states"][0]["param_groups"], name


def test_a_checkpoint_that_would_run_code_is_refused_everywhere(clean: dict[str, Path], tmp_path: Path) -> None:
    marker = str(tmp_path / "PAYLOAD-RAN")
    bad = {
        "gpt-file": _with_hparam(clean["zero1-file"], tmp_path / "bad-gpt.ckpt", Payload(marker)),
        "gpt-dir": _with_hparam(clean["zero1-dir"], tmp_path / "bad-gpt-dir.ckpt", Payload(marker)),
        "moe-file": _with_hparam(clean["ep-file"], tmp_path / "bad-moe.ckpt", Payload(marker)),
        "moe-dir": _with_hparam(clean["ep-dir"], tmp_path / "bad-moe-dir.ckpt", Payload(marker)),
        "metadata": _with_metadata_payload(clean["zero1-dir"], tmp_path / "bad-metadata.ckpt", marker),
        "entry": _with_entry(clean["zero1-dir"], tmp_path / "bad-entry.ckpt", "optimizer_0.param_groups.0.lr", Payload(marker)),
        "trusted-file": _trusted(clean["zero1-file"], tmp_path / "trusted.ckpt"),
        "trusted-dir": _with_entry(clean["zero1-dir"], tmp_path / "trusted-dir.ckpt", "optimizer_0.param_groups.0.lr", TrustedLR(0.5)),
    }
    from omegaconf import OmegaConf

    bad["omegaconf"] = _with_hparam(clean["zero1-file"], tmp_path / "omegaconf.ckpt", OmegaConf.create({"lr": 0.5}))
    cases = [Case(f"{s} {kind} {fmt}", s, kind, str(bad[f"gpt-{fmt}"]))
             for s in ("dp", "zero1", "zero3", "tp", "pp") for fmt in ("file", "dir") for kind in ("fit", "validate")]
    cases += [Case(f"ep {kind} {fmt}", "ep", kind, str(bad[f"moe-{fmt}"]), MOE) for fmt in ("file", "dir") for kind in ("fit", "validate")]
    cases += [
        Case("dp fit .metadata", "dp", "fit", str(bad["metadata"])),
        Case("pp validate .metadata", "pp", "validate", str(bad["metadata"])),
        Case("zero1 fit DCP entry", "zero1", "fit", str(bad["entry"])),
        Case("pp fit DCP entry (deferred to the first batch)", "pp", "fit", str(bad["entry"])),
        Case("tp fit DCP entry", "tp", "fit", str(bad["entry"])),
        Case("dp omegaconf", "dp", "fit", str(bad["omegaconf"])),
        Case("lightning ddp omegaconf", "ddp", "fit", str(bad["omegaconf"])),
        Case("dp trusted file, refused by default", "dp", "fit", str(bad["trusted-file"])),
        Case("pp trusted dir, refused at the first batch", "pp", "fit", str(bad["trusted-dir"])),
        Case("dp trusted file, weights_only=False", "dp", "fit", str(bad["trusted-file"]), weights_only=False),
        Case("pp trusted dir, weights_only=False", "pp", "fit", str(bad["trusted-dir"]), weights_only=False),
        Case("zero3 trusted file, safe_globals", "zero3", "fit", str(bad["trusted-file"]), allow=True),
        Case("pp trusted dir, safe_globals", "pp", "validate", str(bad["trusted-dir"]), allow=True),
    ]
    results = _by_case(cases, run_distributed(attempt_all, 2, cases, marker, 2, init_backend=None, timeout=600))
    for case in cases[:24]:
        name = Path(case.checkpoint).name
        _assert_refused(case.label, results[case.label], name)
    _assert_refused("dp fit .metadata", results["dp fit .metadata"], "bad-metadata.ckpt/.metadata", "pathlib.Path.touch")
    _assert_refused("pp validate .metadata", results["pp validate .metadata"], "bad-metadata.ckpt/.metadata")
    for label in ("zero1 fit DCP entry", "pp fit DCP entry (deferred to the first batch)", "tp fit DCP entry"):
        _assert_refused(label, results[label], "bad-entry.ckpt (entry optimizer_0.param_groups.0.lr)")
    # Where Lightning needs weights_only=False (an OmegaConf container), we say so in torch's words, as it does.
    ours, lightning = results["dp omegaconf"][0], results["lightning ddp omegaconf"][0]
    _assert_refused("dp omegaconf", results["dp omegaconf"], "omegaconf.ckpt", "omegaconf.dictconfig.DictConfig")
    assert lightning["error"] == "UnpicklingError" and lightning["message"] in ours["message"], (lightning, ours["message"])
    _assert_refused("trusted", results["dp trusted file, refused by default"], "trusted.ckpt", f"{__name__}.TrustedLR")
    deferred = results["pp trusted dir, refused at the first batch"]
    _assert_refused("trusted dir", deferred, "trusted-dir.ckpt (entry optimizer_0.param_groups.0.lr)", f"{__name__}.TrustedLR")
    for label in ("dp trusted file, weights_only=False", "pp trusted dir, weights_only=False", "zero3 trusted file, safe_globals"):
        _assert_loaded(label, results[label])
        assert all(out["step"] == 3 for out in results[label]), (label, results[label])  # resumed at step 2, trained one
    _assert_loaded("pp trusted dir, safe_globals", results["pp trusted dir, safe_globals"])

    # 3d on four ranks (tp2 x pp2 for this GPT), both formats, fit and validate
    cases_3d = [Case(f"3d {kind} {fmt}", "3d", kind, str(bad[f"gpt-{fmt}"])) for fmt in ("file", "dir") for kind in ("fit", "validate")]
    results_3d = _by_case(cases_3d, run_distributed(attempt_all, 4, cases_3d, marker, 4, init_backend=None, timeout=600))
    for case in cases_3d:
        _assert_refused(case.label, results_3d[case.label], Path(case.checkpoint).name)

    # export, offline: both formats refused; the trusted file exports with the user's opt-in
    with pytest.raises(UnsafeCheckpointError, match=r"bad-gpt\.ckpt' is refused: .*export_state_dict\(checkpoint, out, weights_only=False\)"):
        export_state_dict(bad["gpt-file"], tmp_path / "out.safetensors")
    with pytest.raises(UnsafeCheckpointError, match=r"bad-metadata\.ckpt/\.metadata' is refused: it holds `pathlib\.Path\.touch`"):
        load_model_state(bad["metadata"])
    with pytest.raises(UnsafeCheckpointError, match=r"TrustedLR\]\)"):
        export_main([str(bad["trusted-file"]), str(tmp_path / "trusted.pt")])
    export_main([str(bad["trusted-file"]), str(tmp_path / "trusted.pt"), "--no-weights-only"])
    assert set(torch.load(tmp_path / "trusted.pt", weights_only=True)) == set(load_model_state(clean["zero1-file"]))
    assert not os.path.exists(marker)


def test_refusal_names_the_file_the_object_and_both_ways_forward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit checks of the error (no process group): a blocked module (``os.system``) has no allowlist
    way forward; the error survives the pickling a collective gives it; DCP metadata refuses a payload."""
    marker = tmp_path / "ran"
    blocked = tmp_path / "blocked.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"x": _System(f"touch {marker}")}}, blocked)
    from lightning_parallel.strategies.checkpoint.safe_load import load_file

    with pytest.raises(UnsafeCheckpointError) as info:
        load_file(blocked, None)
    error = info.value
    assert error.source == str(blocked) and error.refused == "posix.system", error
    assert "no allowlist admits `posix.system`" in str(error) and "weights_only=False" in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is UnsafeCheckpointError and str(again) == str(error) and again.refused == error.refused
    made = refusal("x.ckpt", "Unsupported global: GLOBAL a.B was not an allowed global by default.")
    assert "`torch.serialization.add_safe_globals([a.B])`" in str(made) and isinstance(made, pickle.UnpicklingError)
    assert not marker.exists()
    # None is torch's default (weights-only) and follows torch's environment switches, as torch.load does
    assert weights_only_in_effect(None) and weights_only_in_effect(True) and not weights_only_in_effect(False)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert not weights_only_in_effect(None) and weights_only_in_effect(True)
    # Lightning drops the Trainer's weights_only for strategies restoring after setup; we read it from
    # Trainer._run (compat_lightning.trainer_call_weights_only), which must keep that argument
    import inspect

    from lightning.pytorch import Trainer

    assert "weights_only" in inspect.signature(Trainer._run).parameters


class _System:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (self.command,)
