"""Pipeline checkpoints without full copies (issue #14, item 4).

Each pipeline rank saves the tensors its stages keep, as it holds them, and reads back only the
tensors its stages hold (``strategies/checkpoint/pipeline.py``). Checked here:

* while the strategy builds a sharded checkpoint's state dicts no collective runs at all, the
  whole save moves a small fraction of the model's bytes (the old path broadcast every full
  parameter to every rank), and each rank's DCP file holds only what its stages own;
* a resume under pp2 and under pp2 x tp2 continues exactly like one uninterrupted process, for
  SGD without state and for AdamW with two parameter groups and an LR scheduler (DESIGN.md: a
  large ``eps`` keeps AdamW comparable across layouts);
* checkpoints resume under another layout: pp2 -> zero3, zero1 -> pp2, one process -> pp2 x tp2
  from a consolidated file (pp -> one process and one process -> dp2 x tp2 x pp2:
  tests/test_checkpoint_reshard.py).

The epoch is 3 global batches; the first run stops at its end (a clean resume point, see
tests/test_checkpoint_reshard.py), the resumed run trains the next 3.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from lightning.pytorch import Callback
from torch.optim.lr_scheduler import StepLR

from lightning_parallel.models import GPT
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fits
from tests.test_data_parallel import HYBRID


class GPTTwoGroupsAdamW(GPT):
    """The package's GPT as a user configures AdamW: weight decay on matrices only (two parameter
    groups) and a step LR schedule that changes the rate inside the resumed epoch."""

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                      lr=self.lr, eps=1e-3)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": StepLR(optimizer, step_size=2, gamma=0.5), "interval": "step"}}


_C10D = ("broadcast", "all_gather", "all_gather_into_tensor", "gather", "scatter", "send", "recv", "isend", "irecv",
         "all_reduce", "reduce_scatter_tensor", "all_to_all_single")
_FUNCOL = ("all_gather_tensor", "all_reduce", "reduce_scatter_tensor", "all_to_all_single", "broadcast")


def _nbytes(value: Any) -> int:
    """Bytes of the floating-point tensors in ``value`` (what moving parameters or optimizer state
    costs; object collectives travel as uint8 tensors, counted by the number of calls instead)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() if value.is_floating_point() else 0
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class SaveTraffic(Callback):
    """Counts the collectives (calls, tensor bytes) this rank runs while the strategy builds a
    checkpoint's state dicts and while it saves; appends one JSON line per save to ``out``,
    with the parameters this rank's stages own."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.counts = {"calls": 0, "bytes": 0}
        self._depth = 0

    def _patch(self) -> list[tuple[Any, str, Any]]:
        patched = []
        for module, names in ((c10d, _C10D), (dist, _C10D), (funcol, _FUNCOL)):
            for name in names:
                original = getattr(module, name, None)
                if original is None or getattr(original, "_counted", False):
                    continue

                def counted(*args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                    if self._depth:  # inside another counted call (send runs isend): counted there
                        return __original(*args, **kwargs)
                    self.counts["calls"] += 1
                    self.counts["bytes"] += _nbytes(list(args) + list(kwargs.values()))
                    self._depth += 1
                    try:
                        return __original(*args, **kwargs)
                    finally:
                        self._depth -= 1

                counted._counted = True  # type: ignore[attr-defined]
                setattr(module, name, counted)
                patched.append((module, name, original))
        return patched

    def _counting(self, fn: Callable[..., Any], key: str, record: dict[str, Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            before = dict(self.counts)
            patched = self._patch()
            try:
                return fn(*args, **kwargs)
            finally:
                for module, name, original in patched:
                    setattr(module, name, original)
                record[key] = {k: record.get(key, {}).get(k, 0) + self.counts[k] - before[k] for k in self.counts}
        return run

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy = trainer.strategy
        record: dict[str, Any] = {}
        state_dict_hooks = {name: self._counting(getattr(strategy, name), "state_dicts", record)
                            for name in ("lightning_module_state_dict", "optimizer_state")}
        save = self._counting(strategy.save_checkpoint, "save", record)

        def save_checkpoint(*args: Any, **kwargs: Any) -> None:
            save(*args, **kwargs)  # (Lightning built the state dicts just before: dump_checkpoint)
            driver = strategy._pipeline
            owned = sorted(driver.runtime.owned_parameter_names()) if driver is not None and driver._runtime else []
            model_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.numel())
            with open(self.out, "a") as f:
                f.write(json.dumps({"rank": dist.get_rank(), "owned": owned, "model_bytes": model_bytes, **record}) + "\n")
            record.clear()

        for name, hook in state_dict_hooks.items():
            setattr(strategy, name, hook)
        strategy.save_checkpoint = save_checkpoint


def meta_built_hf_lm(**kwargs: Any) -> Any:
    """A Hugging Face causal LM wrapper built under ``torch.device("meta")``, as a model too large
    for one device is built: a pipeline rank allocates only its stages, after tracing."""
    from lightning_parallel.testing.real_models import HFCausalLM

    with torch.device("meta"):
        return HFCausalLM(**kwargs)


KWARGS = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32}
SGD = FitSpec(model="lightning_parallel.models:GPT", model_kwargs={**KWARGS, "lr": 0.5},
              data="lightning_parallel.testing.parity:token_data", data_kwargs={"num_samples": 24}, global_batch=8,
              trainer_kwargs={"gradient_clip_val": 0.5})
ADAMW = dataclasses.replace(SGD, model="tests.test_pipeline_checkpoint:GPTTwoGroupsAdamW", model_kwargs={**KWARGS, "lr": 0.01})
LLAMA = dataclasses.replace(SGD, model="lightning_parallel.testing.real_models:HFCausalLM",
                            model_kwargs={"family": "llama", "n_layer": 2})
META_LLAMA = dataclasses.replace(LLAMA, model="tests.test_pipeline_checkpoint:meta_built_hf_lm")
PP2 = {"pipeline_parallel_size": 2, "microbatches": 2}
TP2_PP2 = {"tensor_parallel_size": 2, **PP2}


def _first(spec: FitSpec, layout: dict[str, Any], path: Path, sharded: bool = True, traffic: Path | None = None) -> FitSpec:
    callbacks = [("tests.test_pipeline_checkpoint:SaveTraffic", {"out": str(traffic)})] if traffic else []
    return dataclasses.replace(spec, strategy={"class": HYBRID, "save_distributed_checkpoint": sharded, **layout},
                               max_steps=-1, max_epochs=1, save_to=str(path), callbacks=callbacks)


def _resume(spec: FitSpec, layout: dict[str, Any], path: Path) -> FitSpec:
    return dataclasses.replace(spec, strategy={"class": HYBRID, **layout}, max_steps=-1, max_epochs=2, resume_from=str(path))


def _run(specs: list[FitSpec], devices: int) -> list[dict[str, Any]]:
    return run_distributed(run_fits, devices, [dataclasses.replace(s, devices=devices) for s in specs],
                           init_backend=None, timeout=500)[0]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted single-process runs (6 steps, SGD and AdamW) and a consolidated AdamW
    checkpoint written by one process after its first epoch, in one spawn."""
    path = tmp_path_factory.mktemp("one") / "one.ckpt"
    sgd, adamw, llama, first = _run([dataclasses.replace(SGD, max_steps=-1, max_epochs=2),
                                     dataclasses.replace(ADAMW, max_steps=-1, max_epochs=2),
                                     dataclasses.replace(LLAMA, max_steps=-1, max_epochs=2),
                                     _first(ADAMW, {}, path, sharded=False)], 1)
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(adamw["losses"][:3]), rtol=1e-6, atol=0)
    return {"sgd": sgd, "adamw": adamw, "llama": llama, "path": path}


def _assert_continues(resumed: dict[str, Any], reference: dict[str, Any], label: str) -> None:
    assert len(resumed["losses"]) == 3, label
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(reference["losses"][3:]), rtol=1e-5, atol=0,
                               msg=lambda m: f"{label}: {m}")
    assert resumed["params"].keys() == reference["params"].keys(), label
    for name, ref in reference["params"].items():
        assert resumed["params"][name].numel() > 0, f"{label}: {name} is a freed pipeline copy"
        error = float((resumed["params"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
        # (The attention key bias gets no gradient, only round-off: it stays ~0, its relative error is noise.)
        assert error <= 1e-5 or float(ref.norm()) < 1e-8, f"{label} {name}: relative error {error:.2e}"


def _file_keys(path: Path) -> dict[str, set[str]]:
    """DCP file name -> the model parameter names whose bytes it holds."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    files: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("state_dict."):
            files.setdefault(info.relative_path, set()).add(index.fqn[len("state_dict."):])
    return files


def test_pipeline_save_writes_own_stages_and_resumes_in_any_layout(tmp_path: Path, one_process: dict[str, Any]) -> None:
    """pp2: the sharded save gathers nothing; pp2 -> pp2 (SGD, AdamW, a meta-built HF Llama), pp2 ->
    zero3 and zero1 -> pp2 continue like the uninterrupted single process."""
    traffic = tmp_path / "traffic.jsonl"
    ref_sgd, ref_adamw = one_process["sgd"], one_process["adamw"]
    results = _run([
        _first(SGD, PP2, tmp_path / "sgd.ckpt", traffic=traffic),
        _first(ADAMW, PP2, tmp_path / "adamw.ckpt", traffic=traffic),
        _first(ADAMW, {"zero_stage": 1}, tmp_path / "zero1.ckpt"),
        _resume(SGD, PP2, tmp_path / "sgd.ckpt"),
        _resume(ADAMW, PP2, tmp_path / "adamw.ckpt"),
        _resume(ADAMW, {"zero_stage": 3}, tmp_path / "adamw.ckpt"),
        _resume(ADAMW, PP2, tmp_path / "zero1.ckpt"),
        _first(LLAMA, PP2, tmp_path / "llama.ckpt"),
        _resume(META_LLAMA, PP2, tmp_path / "llama.ckpt"),
    ], 2)
    for result, reference, label in ((results[0], ref_sgd, "pp2 SGD, first epoch"), (results[1], ref_adamw, "pp2 AdamW, first epoch"),
                                      (results[2], ref_adamw, "zero1 AdamW, first epoch")):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"][:3]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{label}: {m}")
    _assert_continues(results[3], ref_sgd, "pp2 -> pp2, SGD (no optimizer state)")
    _assert_continues(results[4], ref_adamw, "pp2 -> pp2, AdamW 2 groups + StepLR")
    _assert_continues(results[5], ref_adamw, "pp2 -> zero3, AdamW")
    # ZeRO-1 wrote each rank's partition of the optimizer state: each stage reads the states of its parameters.
    _assert_continues(results[6], ref_adamw, "zero1 -> pp2, AdamW")
    # Built on the meta device: the load waits for the stages, then fills what each rank allocated.
    _assert_continues(results[8], one_process["llama"], "pp2 -> pp2, Llama built on the meta device")

    records = [json.loads(line) for line in traffic.read_text().splitlines()]
    assert len(records) == 4  # two saves on two ranks
    for record in records:
        assert record["state_dicts"]["calls"] == 0, f"state dicts of a sharded pipeline save ran collectives: {record}"
        # (Lightning builds the state dicts just before the save; the old path broadcast every parameter there:
        # 69 collectives, the whole model to each rank.) The write itself exchanges DCP's plans and the RNG
        # states, object collectives (uint8): no floating-point tensor moves.
        assert record["save"]["bytes"] == 0, record
    owned = {r["rank"]: set(r["owned"]) for r in records}
    for name in ("sgd.ckpt", "adamw.ckpt"):
        files = _file_keys(tmp_path / name)
        assert set(files) == {"__0_0.distcp", "__1_0.distcp"}, files
        for rank in (0, 1):
            assert files[f"__{rank}_0.distcp"] <= owned[rank], f"{name}: rank {rank} wrote tensors of another stage"
        assert files["__0_0.distcp"].isdisjoint(files["__1_0.distcp"])


def test_resume_tp2_x_pp2_sharded_and_from_a_consolidated_file(tmp_path: Path, one_process: dict[str, Any]) -> None:
    """pp2 x tp2 (AdamW, two groups, StepLR): save sharded and resume; resume from one process's
    consolidated file (rank 0 broadcasts it, each rank keeps its tensor-parallel slices of its
    stages): the next steps equal one process. (The consolidated tp2 x pp2 save and tp2 x pp2 ->
    one process: tests/test_checkpoint_reshard.py.)"""
    reference = one_process["adamw"]
    results = _run([
        _first(ADAMW, TP2_PP2, tmp_path / "3d.ckpt"),
        _resume(ADAMW, TP2_PP2, tmp_path / "3d.ckpt"),
        _resume(ADAMW, TP2_PP2, one_process["path"]),
    ], 4)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(reference["losses"][:3]), rtol=1e-5, atol=0)
    _assert_continues(results[1], reference, "pp2 x tp2 -> pp2 x tp2")
    _assert_continues(results[2], reference, "1 -> pp2 x tp2 (consolidated file, broadcast from rank 0)")
