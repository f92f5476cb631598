"""Checkpoints survive a change of layout: train 3 steps under one layout, save, resume under
another, and the next 3 steps equal those of an uninterrupted single-process run.

The epoch is exactly 3 global batches and the first run stops at the end of its first epoch, so
the resumed run reads the same batches as the uninterrupted one. (A checkpoint written when
fit stopped at ``max_steps`` makes Lightning replay the epoch's first batches on resume, under
every strategy including its own: see the checkpoint issue's note.) SGD with momentum makes the
optimizer state matter: it is resharded too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback

from lightning_parallel.compat import tree_leaves
from lightning_parallel.export import export_state_dict, load_model_state
from lightning_parallel.strategies.checkpoint.resume import rng_state_for_rank
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fits
from tests.test_data_parallel import HYBRID
from tests.test_strategy_tp import GPT_SPEC as TP_GPT_SPEC

TINY = FitSpec(
    model="tests.tiny_models:TinyNet",
    model_kwargs={"momentum": 0.9, "lr": 0.2},
    data_kwargs={"num_samples": 48},
    global_batch=16,
    max_steps=6,
)
GPT = FitSpec(
    model="lightning_parallel.models:GPT",
    model_kwargs={"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32, "lr": 0.3, "momentum": 0.9},
    data="lightning_parallel.testing.parity:token_data",
    data_kwargs={"num_samples": 24},
    global_batch=8,
    max_steps=6,
)


def _strategy(kwargs: dict[str, Any], sharded: bool) -> dict[str, Any]:
    return {"class": HYBRID, "save_distributed_checkpoint": sharded, **kwargs}


def _phases(base: FitSpec, path: Path, first: dict[str, Any], second: dict[str, Any], sharded: bool) -> tuple[FitSpec, FitSpec]:
    a = dataclasses.replace(base, strategy=_strategy(first, sharded), max_steps=-1, max_epochs=1, save_to=str(path))
    b = dataclasses.replace(base, strategy=_strategy(second, sharded), max_steps=-1, max_epochs=2, resume_from=str(path))
    return a, b


def _run(specs: list[FitSpec], devices: int) -> list[dict[str, Any]]:
    return run_distributed(run_fits, devices, [dataclasses.replace(s, devices=devices) for s in specs],
                           init_backend=None, timeout=500)[0]


def _assert_continues(resumed: dict[str, Any], reference: dict[str, Any], label: str) -> None:
    assert len(resumed["losses"]) == 3, label
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(reference["losses"][3:]), rtol=1e-5, atol=0,
                               msg=lambda m: f"{label}: {m}")
    for name, ref in reference["params"].items():
        error = float((resumed["params"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert error <= 1e-5 or float(ref.norm()) < 1e-8, f"{label} {name}: relative error {error:.2e}"


class NoStateByObjectCollective(Callback):
    """A resume broadcasts no optimizer (or model) tensor inside an object collective: a consolidated
    file goes out tensor by tensor, and each rank keeps what it holds (ZeRO-1: its partition's
    states). Counts the floating-point bytes every ``broadcast_object_list`` delivers during set-up
    and restore; before, a ZeRO-1 rank received the whole consolidated optimizer state that way."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        import torch.distributed as dist

        self.original, self.floats = dist.broadcast_object_list, 0

        def counted(objects: list[Any], *args: Any, **kwargs: Any) -> Any:
            result = self.original(objects, *args, **kwargs)
            self.floats += sum(t.numel() * t.element_size() for t in tree_leaves(objects)
                               if isinstance(t, torch.Tensor) and t.is_floating_point())
            return result

        dist.broadcast_object_list = counted

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list = self.original
        assert self.floats == 0, f"{self.floats} bytes of floating-point tensors arrived through broadcast_object_list"


CASES_2 = [  # (label, first layout, second layout, sharded files)
    ("zero3->dp", {"zero_stage": 3}, {"zero_stage": 0}, True),
    ("dp->zero3 (full file)", {"zero_stage": 0}, {"zero_stage": 3}, False),
    ("zero1->zero2", {"zero_stage": 1}, {"zero_stage": 2}, True),  # ZeRO-1: each rank wrote its partition
    ("zero3->zero1", {"zero_stage": 3}, {"zero_stage": 1}, True),  # each ZeRO-1 rank reads its partition's states
    ("zero1->zero1", {"zero_stage": 1}, {"zero_stage": 1}, True),
    ("dp->zero1 (full file)", {"zero_stage": 0}, {"zero_stage": 1}, False),  # each ZeRO-1 rank keeps its partition's states
]


def test_resume_across_data_parallel_layouts(tmp_path: Path) -> None:
    reference = _run([TINY], 1)[0]
    pairs = [_phases(TINY, tmp_path / f"c{i}.ckpt", a, b, sharded) for i, (_, a, b, sharded) in enumerate(CASES_2)]
    _run([a for a, _ in pairs], 2)
    # ZeRO-1's sharded save: each rank wrote the momentum of its own partition, none gathered the rest
    import torch.distributed.checkpoint as dcp

    from lightning_parallel.strategies.checkpoint.files import META_FILENAME, ZERO1_KEY

    zero1 = tmp_path / f"c{[label for label, *_ in CASES_2].index('zero1->zero1')}.ckpt"
    assert ZERO1_KEY not in torch.load(zero1 / META_FILENAME, weights_only=True)
    writers: dict[str, set[str]] = {}
    for index, info in dcp.FileSystemReader(str(zero1)).read_metadata().storage_data.items():
        if index.fqn.startswith("optimizer_0.state."):
            writers.setdefault(info.relative_path, set()).add(index.fqn)
    assert len(writers) == 2 and not set.intersection(*writers.values()), writers  # two ranks, disjoint states
    assert len(set.union(*writers.values())) == len(reference["params"]), writers  # every parameter's momentum
    watched = [(f"{__name__}:NoStateByObjectCollective", {})]
    resumed = _run([dataclasses.replace(b, callbacks=watched) for _, b in pairs], 2)
    for (label, *_), result in zip(CASES_2, resumed):
        _assert_continues(result, reference, label)
    # single process -> dp2 x zero3 as well
    a, b = _phases(TINY, tmp_path / "single.ckpt", {}, {"zero_stage": 3}, True)
    _run([a], 1)
    _assert_continues(_run([b], 2)[0], reference, "single->zero3")


@pytest.mark.slow
def test_resume_tensor_parallel_to_sharded_and_export(tmp_path: Path) -> None:
    reference = _run([GPT], 1)[0]
    a, b = _phases(GPT, tmp_path / "tp.ckpt", {"tensor_parallel_size": 2}, {"zero_stage": 3}, True)
    _run([a], 2)
    _assert_continues(_run([b], 2)[0], reference, "tp2->zero3")
    # Export the sharded tp checkpoint offline and load it into a fresh, unwrapped module.
    from lightning_parallel.models import GPT as GPTModel

    for suffix in (".pt", ".safetensors"):
        out = tmp_path / f"export{suffix}"
        export_state_dict(tmp_path / "tp.ckpt", out)
        fresh = GPTModel(**GPT.model_kwargs)
        if suffix == ".pt":
            state = torch.load(out, weights_only=True)  # plain tensors only
        else:
            from safetensors.torch import load_file

            state = load_file(str(out))
        fresh.load_state_dict(state, strict=True)
        assert set(state) == set(fresh.state_dict())


def test_shape_mismatch_names_the_parameter(tmp_path: Path) -> None:
    a = dataclasses.replace(TINY, strategy=_strategy({}, True), max_steps=1, save_to=str(tmp_path / "w32.ckpt"))
    _run([a], 1)
    assert "stem.weight" in load_model_state(tmp_path / "w32.ckpt")
    b = dataclasses.replace(TINY, model_kwargs={**TINY.model_kwargs, "width": 48}, strategy=_strategy({}, True),
                            resume_from=str(tmp_path / "w32.ckpt"))
    with pytest.raises(Exception, match=r"`stem.weight` has shape \(32, 16\) in the checkpoint and \(48, 16\) in the model"):
        _run([b], 1)


def _killed_save(path: str) -> None:
    """Rank 1 dies in the middle of a sharded save; rank 0 must fail, not hang, and leave the old one."""
    import os

    import lightning_parallel.strategies.checkpoint.files as ckpt

    original = ckpt.dcp.save

    def dying_save(*args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        if dist.get_rank() == 1:
            os._exit(17)
        return original(*args, **kwargs)

    ckpt.dcp.save = dying_save
    spec = dataclasses.replace(TINY, devices=2, strategy=_strategy({"zero_stage": 3, "timeout": 20}, True), max_steps=1,
                               resume_from=None, save_to=path)
    run_fits([spec])


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    first = dataclasses.replace(TINY, strategy=_strategy({"zero_stage": 3}, True), max_steps=1, save_to=str(path))
    _run([first], 2)
    before = load_model_state(path)
    with pytest.raises(Exception, match=r"rank 1|exited with code 17"):
        run_distributed(_killed_save, 2, str(path), init_backend=None, timeout=90)
    after = load_model_state(path)  # still the complete previous checkpoint
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0)
    from lightning_parallel.strategies.checkpoint.files import _scratch_names

    partial, _ = _scratch_names(path)
    assert partial.is_dir() and not (partial / "meta.pt").exists()  # the interrupted save left no checkpoint there
    assert "last" not in partial.name  # so Lightning's ckpt_path="last" can never pick it


MOE = FitSpec(
    model="lightning_parallel.models:MoEGPT",
    model_kwargs={"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32, "lr": 0.3, "momentum": 0.9,
                  "num_experts": 4, "top_k": 2},
    data="lightning_parallel.testing.parity:token_data",
    data_kwargs={"num_samples": 24},
    global_batch=8,
    max_steps=6,
    strategy={"class": HYBRID},
)


@pytest.mark.slow
def test_resume_expert_parallel_on_one_process(tmp_path: Path) -> None:
    """ep2 (experts split over two ranks) -> one process holding every expert."""
    reference = _run([MOE], 1)[0]
    a, b = _phases(MOE, tmp_path / "ep.ckpt", {"expert_parallel_size": 2}, {}, True)
    _run([a], 2)
    _assert_continues(_run([b], 1)[0], reference, "ep2->ep1")


TINY_DROPOUT = dataclasses.replace(TINY, model_kwargs={**TINY.model_kwargs, "dropout": 0.3})
# test_strategy_tp's GPT (with gradient clipping), plus momentum and dropout, on 3 batches an epoch.
GPT_DROPOUT = dataclasses.replace(TP_GPT_SPEC, model_kwargs={**TP_GPT_SPEC.model_kwargs, "momentum": 0.9, "dropout": 0.1},
                                  data_kwargs={"num_samples": 24}, max_steps=6)
EXACT_LAYOUTS = [  # (label, spec, layout): every one on 2 processes
    ("dp", TINY_DROPOUT, {"zero_stage": 0}),
    ("zero3", TINY_DROPOUT, {"zero_stage": 3}),
    ("tp2", GPT_DROPOUT, {"tensor_parallel_size": 2}),
    ("pp2", GPT_DROPOUT, {"pipeline_parallel_size": 2, "microbatches": 2}),
]
MID_EPOCH = ((2, "epoch=0-step=2.ckpt"), (4, "epoch=1-step=4.ckpt"))


def test_exact_resume_from_mid_epoch_model_checkpoints(tmp_path: Path) -> None:
    """ModelCheckpoint every 2 steps in 3-batch epochs: steps 2 and 4 are mid-epoch. Resuming from
    either continues with exactly the losses of the uninterrupted run (Lightning alone would
    restart the epoch's data from its first batch), under data parallel, ZeRO-3, tensor and
    pipeline parallel layouts. Dropout makes each rank's RNG stream matter: pipeline stages draw
    for their own layers only, so their streams differ. All fits share one spawned group: the
    uninterrupted runs write the checkpoints the later fits resume from."""
    full = [dataclasses.replace(spec, strategy=_strategy(layout, True), checkpoint_every=2,
                                checkpoint_dir=str(tmp_path / label))
            for label, spec, layout in EXACT_LAYOUTS]
    resumes = [dataclasses.replace(spec, strategy=_strategy(layout, True), resume_from=str(tmp_path / label / name))
               for label, spec, layout in EXACT_LAYOUTS for _, name in MID_EPOCH]
    results = _run(full + resumes, 2)
    uninterrupted, resumed = results[:len(full)], iter(results[len(full):])
    for (label, *_), reference in zip(EXACT_LAYOUTS, uninterrupted):
        assert len(reference["losses"]) == 6, label
        for start, _ in MID_EPOCH:
            result = next(resumed)
            where = f"{label}, resumed at step {start}"
            torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"][start:]),
                                       rtol=1e-6, atol=0, msg=lambda m: f"{where}: {m}")
            assert result["params"].keys() == reference["params"].keys(), where
            for name, ref in reference["params"].items():
                assert ref.numel() > 0, f"{where}: {name} is a freed pipeline copy, not the parameter"
                torch.testing.assert_close(result["params"][name], ref, rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"{where}, {name}: {m}")


# Per-step LayerDrop decisions: random, but the same on every rank, so they can continue exactly
# after a change of world size (per-sample dropout masks cannot: see strategies/checkpoint/resume.py).
LAYER_DROP = dataclasses.replace(TINY, model_kwargs={**TINY.model_kwargs, "layer_drop": 0.5}, checkpoint_every=2)


def test_rng_streams_after_a_change_of_world_size(tmp_path: Path) -> None:
    """dp2 -> 1 process and 1 process -> dp2, from a mid-epoch checkpoint (step 2): rank r restores
    saved stream r mod the saved count, so the LayerDrop decisions of the resumed steps are those
    the uninterrupted run made, and losses and parameters equal it (parity tolerance: the layout
    changes). Leaving the streams as seeded would replay the decisions of the first steps."""
    single_dir, dp_dir = tmp_path / "single", tmp_path / "dp2"
    plain = _strategy({}, True)
    single = _run([dataclasses.replace(LAYER_DROP, strategy=plain, checkpoint_dir=str(single_dir)),
                   dataclasses.replace(LAYER_DROP, strategy=plain, resume_from=str(single_dir / "epoch=0-step=2.ckpt"))], 1)
    dp = _run([dataclasses.replace(LAYER_DROP, strategy=plain, checkpoint_dir=str(dp_dir)),
               dataclasses.replace(LAYER_DROP, strategy=plain, resume_from=str(dp_dir / "epoch=0-step=2.ckpt")),
               dataclasses.replace(LAYER_DROP, strategy=plain, resume_from=str(single_dir / "epoch=0-step=2.ckpt"))], 2)
    shrunk = _run([dataclasses.replace(LAYER_DROP, strategy=plain, resume_from=str(dp_dir / "epoch=0-step=2.ckpt"))], 1)
    reference = single[0]
    assert len(reference["losses"]) == 6
    resumed = [("1->1", single[1]), ("dp2->dp2", dp[1]), ("1->dp2", dp[2]), ("dp2->1", shrunk[0])]
    for label, result in [("dp2 uninterrupted", dp[0])] + resumed:
        start = 0 if "uninterrupted" in label else 2
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"][start:]),
                                   rtol=1e-5, atol=0, msg=lambda m: f"{label}: {m}")
        for name, ref in reference["params"].items():
            error = float((result["params"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
            assert error <= 1e-5, f"{label} {name}: relative error {error:.2e}"


def test_rng_stream_for_each_rank() -> None:
    """The rule without a process group: own stream under the same world size, ``r % n`` otherwise."""
    saved = [{"torch": torch.tensor([r], dtype=torch.uint8), "python": None} for r in range(2)]
    assert [rng_state_for_rank(saved, r)["torch"].item() for r in range(4)] == [0, 1, 0, 1]
    assert rng_state_for_rank(saved[:1], 1)["torch"].item() == 0
    assert rng_state_for_rank(None, 0) is None and rng_state_for_rank([], 3) is None
    with pytest.raises(TypeError, match=r"`lightning_parallel_rng` must be a list .* got dict\. HINT: delete"):
        rng_state_for_rank({"torch": saved[0]["torch"]}, 0)
    with pytest.raises(TypeError, match=r"must be a list with one dict of RNG states per saved rank"):
        rng_state_for_rank([saved[0], "not a state"], 1)


# ---------------------------------------------------------------- tensor x pipeline parallel (3D)
# Pipeline stages are traced on the first batch: then each rank frees the parameters other
# stages own and, under tp, turns the ones it keeps into DTensors (the optimizer follows). A
# checkpoint must hold every parameter and momentum buffer once, full-sized, under its name.
TP_PP = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 2}
DP_TP_PP = {"data_parallel_size": 2, **TP_PP}


def _export_cli(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    """Run ``python -m lightning_parallel.export`` as a user would, load the file into a fresh,
    unwrapped GPT (strict) and return what it loaded."""
    import subprocess
    import sys

    from lightning_parallel.models import GPT as GPTModel

    done = subprocess.run([sys.executable, "-m", "lightning_parallel.export", str(checkpoint), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"to {out}" in done.stdout
    if out.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(out))
    else:
        state = torch.load(out, weights_only=True)  # plain tensors only
    fresh = GPTModel(**GPT.model_kwargs)
    fresh.load_state_dict(state, strict=True)
    return dict(fresh.state_dict())


@pytest.mark.slow
def test_resume_tp2_x_pp2_on_one_process_and_export(tmp_path: Path) -> None:
    """tp2 x pp2 -> one process, from a sharded directory and from a consolidated file (which
    must hold the optimizer state of every stage, not only rank 0's); both, exported offline with
    the CLI, equal the parameters the tp2 x pp2 run gathered."""
    reference = _run([GPT], 1)[0]
    sharded_a, sharded_b = _phases(GPT, tmp_path / "3d.ckpt", TP_PP, {}, True)
    full_a, full_b = _phases(GPT, tmp_path / "3d-full.ckpt", TP_PP, {}, False)
    saved = _run([sharded_a, full_a], 4)
    for label, result in zip(("sharded", "full file"), saved):  # the first epoch itself matches one process
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"][:3]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"tp2 x pp2 ({label}), first epoch: {m}")
    assert (tmp_path / "3d.ckpt").is_dir() and (tmp_path / "3d-full.ckpt").is_file()
    resumed = _run([sharded_b, full_b], 1)
    _assert_continues(resumed[0], reference, "tp2 x pp2 -> 1 (sharded)")
    _assert_continues(resumed[1], reference, "tp2 x pp2 -> 1 (full file)")
    gathered = saved[0]["params"]
    torch.testing.assert_close(saved[1]["params"], gathered, rtol=0, atol=0)  # both runs trained alike
    for source, suffix in (("3d.ckpt", ".pt"), ("3d.ckpt", ".safetensors"), ("3d-full.ckpt", ".pt")):
        state = _export_cli(tmp_path / source, tmp_path / f"{source}{suffix}")
        assert gathered.keys() <= state.keys(), suffix
        for name, value in gathered.items():
            assert value.numel() > 0, f"{name} is a freed pipeline copy, not the parameter"
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=lambda m: f"{source} -> {suffix} {name}: {m}")


def _saved_momenta(path: Path) -> dict[str, torch.Tensor]:
    """Every momentum buffer of a sharded checkpoint, read offline under its parameter's name."""
    import torch.distributed.checkpoint as dcp

    prefix, suffix = "optimizer_0.state.", ".momentum_buffer"
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in metadata.items() if key.startswith(prefix) and key.endswith(suffix)}
    dcp.load(state, checkpoint_id=str(path))
    return {key[len(prefix):-len(suffix)]: value for key, value in state.items()}


@pytest.mark.slow
def test_resume_one_process_on_dp2_x_tp2_x_pp2(tmp_path: Path) -> None:
    """One process -> dp2 x tp2 x pp2 (8 processes; ZeRO 0 and 3): the loaded full tensors are split into
    stages, and tensor shards with their momentum buffers, when the first batch is traced. The
    resumed run saves again: its momentum buffers must be the uninterrupted run's. (Every rank
    restored every buffer; the stages that released a parameter hold a stale copy of its
    buffer, which must not reach the checkpoint.)"""
    plain = dataclasses.replace(GPT, strategy=_strategy({}, True), save_to=str(tmp_path / "reference.ckpt"))
    single_a, b = _phases(GPT, tmp_path / "single.ckpt", {}, DP_TP_PP, True)
    _, b_zero3 = _phases(GPT, tmp_path / "single.ckpt", {}, {**DP_TP_PP, "zero_stage": 3}, True)
    reference, _ = _run([plain, single_a], 1)
    # ZeRO-3 too: the momentum, laid out for tensor parallelism first, is then sharded for FSDP2.
    resumed = _run([dataclasses.replace(b, save_to=str(tmp_path / "3d.ckpt")),
                    dataclasses.replace(b_zero3, save_to=str(tmp_path / "3d-zero3.ckpt"))], 8)
    expected = _saved_momenta(tmp_path / "reference.ckpt")
    for result, saved_to, label in zip(resumed, ("3d.ckpt", "3d-zero3.ckpt"), ("dp2 x tp2 x pp2", "dp2 x tp2 x pp2 zero3")):
        _assert_continues(result, reference, f"1 -> {label}")
        saved = _saved_momenta(tmp_path / saved_to)
        assert saved.keys() == expected.keys() == reference["params"].keys()
        for name, ref in expected.items():  # the attention key bias has zero gradient: its momentum is round-off
            error = float((saved[name] - ref).norm() / ref.norm().clamp_min(1e-12))
            assert error <= 1e-5 or float(ref.norm()) < 1e-8, f"momentum of {name} under {label}: relative error {error:.2e}"
