"""Every tensor handed to a collective is on the device its group serves in a CUDA run.

On CPU all tensors are on ``"cpu"``; ``lightning_parallel.testing.collective_recorder`` simulates
the CUDA run's devices (the root device is a stand-in ``cpu:0``; tensors a CUDA run would keep on
the CPU carry a mark propagated through ops) and records every collective with its call site.
First the recorder is shown to catch wrong devices (CPU-made tensors into ``all_reduce``, a
DTensor redistribution of a CPU shard, CPU gradients into the global-norm clipping on an
NCCL-only group) and to pass right ones; then one short fit per strategy (clipping on,
``sync_dist=True`` logging, checkpoint save and resume) must hand no CPU tensor to a group
without a CPU backend, and must reach the call sites listed in ``docs/collectives.md``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fit
from tests.test_strategy_tp import GPT_SPEC

HYBRID = "lightning_parallel:HybridParallelStrategy"
CLIP = {"gradient_clip_val": 0.05}  # below every step's norm: the clipping collectives really run
GPT = dataclasses.replace(GPT_SPEC, max_steps=2, trainer_kwargs=CLIP)  # the tp suite's GPT, clipping always on
MOE = dataclasses.replace(
    GPT,
    model="lightning_parallel.models:MoEGPT",
    model_kwargs={**GPT.model_kwargs, "num_experts": 4, "top_k": 2, "aux_loss_coef": 0.1, "z_loss_coef": 0.01},
)


def _hybrid(**kwargs: Any) -> dict[str, Any]:
    return {"class": HYBRID, **kwargs}


_SEEN_MODULE_DEVICES: list[str] = []


class SimulationProbe(pl.Callback):
    """Marks what a CUDA run keeps on the CPU, and records the LightningModule's device.

    Under ``cpu_offload`` FSDP2 keeps sharded gradients on the CPU in a CUDA run too: they are
    marked so before clipping and the non-finite check read them (Lightning calls this hook
    first). ``pl_module.device`` must be the root device: Lightning makes the tensors of
    ``self.log(<python number>, sync_dist=True)`` there, then reduces them."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _SEEN_MODULE_DEVICES.append(str(pl_module.device))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # What callbacks and modules call on the strategy: a Python number logged with sync_dist
        # (Lightning makes it a tensor on pl_module.device), a decision (ModelCheckpoint,
        # EarlyStopping), an all_gather (self.all_gather in a module).
        pl_module.log("probe_number", 1.0, sync_dist=True)
        trainer.strategy.reduce_boolean_decision(True)
        pl_module.all_gather(torch.ones(2, device=pl_module.device))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        from lightning_parallel.testing.collective_recorder import mark_cpu

        if getattr(trainer.strategy, "cpu_offload", False):
            for param in pl_module.parameters():
                if param.grad is not None:
                    mark_cpu(param.grad)


def _recorded_fits(cases: list[tuple[str, FitSpec]], injected: bool = False) -> dict[str, Any]:
    """Spawned worker: the injected cases (``injected``), then each fit under a fresh recorder;
    what was recorded, per fit."""
    from lightning_parallel.testing.collective_recorder import simulate_cuda_devices

    flagged = _injected_cases() if injected else {}
    out = []
    for label, spec in cases:
        _SEEN_MODULE_DEVICES.clear()
        spec = dataclasses.replace(spec, callbacks=[*spec.callbacks, (f"{__name__}:SimulationProbe", {})])
        with simulate_cuda_devices() as recorder:
            result = run_fit(spec)
        out.append({
            "label": label,
            "global_step": result["global_step"],
            "losses": result["losses"],
            "backend": recorder.cuda_backend,
            "module_devices": list(_SEEN_MODULE_DEVICES),
            "calls": [dataclasses.asdict(call) | {"violation": call.violation} for call in recorder.calls],
        })
    return {"injected": flagged, "fits": out}


def _run(cases: list[tuple[str, FitSpec]], devices: int, timeout: float, injected: bool = False) -> dict[str, Any]:
    """Spawn, fit, check every fit on every rank; the fits by label (a list per rank) and the
    injected cases' flags (True where any rank's recorder flagged the case)."""
    results = run_distributed(_recorded_fits, devices, cases, injected, init_backend=None, timeout=timeout)
    flagged = {label: any(r["injected"][label] for r in results) for label in results[0]["injected"]}
    by_label: dict[str, list[dict[str, Any]]] = {}
    for per_rank in results:
        for fit in per_rank["fits"]:
            by_label.setdefault(fit["label"], []).append(fit)
    for label, spec in cases:
        for rank, fit in enumerate(by_label[label]):
            bad = [c for c in fit["calls"] if c["violation"]]
            assert not bad, f"{label} rank {rank}: CPU tensors on a group without a CPU backend:\n" + "\n".join(
                f"  {c['op']} at {c['site']} (via {c['via']}) backend={c['backend']} devices={c['devices']}" for c in bad)
            assert fit["global_step"] == spec.max_steps, (label, fit["global_step"])
            assert fit["losses"] and all(torch.isfinite(torch.tensor(fit["losses"]))), label
            assert fit["module_devices"] == ["cpu:0"], f"{label}: pl_module.device is {fit['module_devices']}, not the root device"
    return {"fits": by_label, "injected": flagged}


def _sites(fits: list[dict[str, Any]]) -> set[str]:
    """``file:function`` of every recorded call site, the innermost lightning_parallel frame of each
    collective (line numbers dropped: they move with edits)."""
    out = set()
    for fit in fits:
        for call in fit["calls"]:
            path_line, _, function = call["site"].partition(" ")
            out.add(f"{path_line.rsplit(':', 1)[0]}:{function}")
    return out


# ---------------------------------------------------------------- the recorder catches wrong devices
def _injected_cases() -> dict[str, bool]:
    """In a spawned rank (2 ranks, before the fits): tensors made here, in scope like package code,
    handed to collectives under a simulated NCCL world; each label -> whether the recorder flagged it."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_parallel.parallel.clip import clip_grad_norm_
    from lightning_parallel.testing.collective_recorder import ROOT, mark_cpu, simulate_cuda_devices

    flagged: dict[str, bool] = {}

    def sharded_param(cpu_grad: bool, mesh: Any) -> torch.nn.Parameter:
        param = torch.nn.Parameter(DTensor.from_local(torch.ones(2, device=ROOT), mesh, [Shard(0)], run_check=False))
        param.grad = DTensor.from_local(torch.full((2,), 3.0, device=ROOT), mesh, [Shard(0)], run_check=False)
        if cpu_grad:
            mark_cpu(param.grad)  # what FSDP2's offload keeps on the CPU
        return param

    for backend in ("nccl", "cuda:nccl,cpu:gloo"):
        with simulate_cuda_devices(cuda_backend=backend, scope=(__file__,)) as recorder:
            mesh = init_device_mesh("cpu", (2,))
            gpu = torch.ones(3, device=ROOT)  # as a tensor on cuda:<rank>
            made = {
                "zeros()": lambda: torch.zeros(()),
                "device='cpu'": lambda: torch.zeros((), device="cpu"),
                "torch.device('cpu')": lambda: torch.ones(2, device=torch.device("cpu")),
                ".cpu()": lambda: gpu.sum().cpu(),
                ".to('cpu')": lambda: gpu.to("cpu"),
                "tensor(python float)": lambda: torch.tensor(float(gpu.sum())),
                "from_numpy": lambda: torch.from_numpy(gpu.numpy().copy()),
                "derived from cpu": lambda: torch.zeros(()) * 2 + 1,
                "ok: device=t.device": lambda: torch.zeros((), device=gpu.device),
                "ok: derived from gpu": lambda: gpu.sum() * 2,
                "ok: cpu scalar + gpu": lambda: torch.zeros(()) + gpu,
                "ok: cpu moved to gpu": lambda: torch.zeros(()).to(gpu.device),
                "ok: zeros_like(gpu)": lambda: torch.zeros_like(gpu),
            }
            for label, make in made.items():
                before = len(recorder.calls)
                dist.all_reduce(make())
                assert len(recorder.calls) == before + 1, label  # recorded once (nested calls are not)
                flagged[f"{backend} all_reduce {label}"] = recorder.calls[-1].violation
            for label, local in (("cpu shard", lambda: torch.ones(2)), ("ok: gpu shard", lambda: gpu[:2] * 1)):
                before = len(recorder.calls)
                float(DTensor.from_local(local(), mesh, [Shard(0)], run_check=False).full_tensor().sum())  # an all-gather
                flagged[f"{backend} redistribute {label}"] = any(c.violation for c in recorder.calls[before:])
            before = len(recorder.calls)
            float(funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD).sum())
            flagged[f"{backend} funcol.all_reduce cpu"] = any(c.violation for c in recorder.calls[before:])
            for label, cpu_grad in (("offloaded grads", True), ("ok: gpu grads", False)):
                before = len(recorder.calls)
                clip_grad_norm_([sharded_param(cpu_grad, mesh)], 0.1)  # the package's own call site
                calls = recorder.calls[before:]
                assert any(c.site.startswith("parallel/clip.py") and c.direct for c in calls), [c.describe() for c in calls]
                flagged[f"{backend} clip {label}"] = any(c.violation for c in calls)
            frozen = torch.nn.Parameter(torch.ones(2, device=ROOT))  # a pipeline stage of frozen layers: no gradient
            frozen.grad = torch.ones(2, device=ROOT) if dist.get_rank() == 0 else None
            before = len(recorder.calls)
            clip_grad_norm_([frozen], 0.1, extra_groups=[dist.group.WORLD])
            flagged[f"{backend} clip ok: a rank without gradients"] = any(c.violation for c in recorder.calls[before:])
    return flagged


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2-rank spawn for the injected cases and every 2-rank fit (start-up paid once)."""
    return _run(_two_rank_cases(tmp_path_factory.mktemp("collectives")), 2, timeout=500, injected=True)


def test_recorder_flags_cpu_tensors_on_an_nccl_group(two_rank_run: dict[str, Any]) -> None:
    flagged = two_rank_run["injected"]
    wrong = {label: value for label, value in flagged.items() if value != (label.startswith("nccl ") and " ok: " not in label)}
    assert not wrong, f"flagged where it should not be (True) / missed (False): {wrong}"
    assert sum(flagged.values()) == 11  # 8 CPU-made tensors, a CPU shard, funcol, offloaded clip: all under nccl only


def test_cpu_offload_refuses_a_backend_without_cpu_before_any_collective() -> None:
    from lightning_parallel.strategies.process_group import check_backend, default_backend

    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"process_group_backend.*'nccl'.*NCCL rejects CPU tensors.*cuda:nccl,cpu:gloo"):
        check_backend("nccl", cuda, cpu_offload=True)
    check_backend(default_backend(cuda, cpu_offload=True), cuda, cpu_offload=True)  # the default pair passes
    check_backend("nccl", cuda, cpu_offload=False)
    check_backend("gloo", torch.device("cpu"), cpu_offload=True)
    assert default_backend(cuda, cpu_offload=True) == "cuda:nccl,cpu:gloo" and default_backend(cuda, cpu_offload=False) == "nccl"


# ---------------------------------------------------------------- every strategy, one short fit each
TIED_LLAMA = dataclasses.replace(
    GPT, model="lightning_parallel.testing.real_models:HFCausalLM",
    model_kwargs={"family": "llama", "n_layer": 2, "config": {"tie_word_embeddings": True}},
)


def _two_rank_cases(tmp: Path) -> list[tuple[str, FitSpec]]:
    pp = _hybrid(pipeline_parallel_size=2, pipeline_schedule="1f1b", microbatches=2)
    pp_full = {**pp, "save_distributed_checkpoint": False}
    zero3_full = _hybrid(zero_stage=3, save_distributed_checkpoint=False)
    return [
        ("dp", dataclasses.replace(GPT, strategy=_hybrid(), devices=2)),
        ("zero1", dataclasses.replace(GPT, strategy=_hybrid(zero_stage=1), devices=2)),
        ("zero2", dataclasses.replace(GPT, strategy=_hybrid(zero_stage=2), devices=2)),
        ("zero3 cpu_offload", dataclasses.replace(GPT, strategy=_hybrid(zero_stage=3, cpu_offload=True), devices=2)),
        ("zero3 save", dataclasses.replace(GPT, strategy=_hybrid(zero_stage=3), devices=2, save_to=str(tmp / "zero3.ckpt"))),
        ("zero3 resume", dataclasses.replace(GPT, strategy=_hybrid(zero_stage=3), devices=2, max_steps=3,
                                             resume_from=str(tmp / "zero3.ckpt"))),
        ("tp loss_parallel", dataclasses.replace(GPT, strategy=_hybrid(tensor_parallel_size=2, loss_parallel=True), devices=2)),
        ("ep", dataclasses.replace(MOE, strategy=_hybrid(expert_parallel_size=2), devices=2)),
        ("pp save", dataclasses.replace(GPT, strategy=pp, devices=2, save_to=str(tmp / "pp.ckpt"))),
        ("pp resume", dataclasses.replace(GPT, strategy=pp, devices=2, max_steps=3, resume_from=str(tmp / "pp.ckpt"))),
        ("pp tied llama", dataclasses.replace(TIED_LLAMA, strategy=pp, devices=2)),  # embedding and head on two stages
        # one-file checkpoints: stages sent to rank 0, then broadcast tensor by tensor on resume
        ("pp consolidated save", dataclasses.replace(GPT, strategy=pp_full, devices=2, save_to=str(tmp / "pp_full.ckpt"))),
        ("pp consolidated resume", dataclasses.replace(GPT, strategy=pp_full, devices=2, max_steps=3,
                                                       resume_from=str(tmp / "pp_full.ckpt"))),
        ("zero3 consolidated save", dataclasses.replace(GPT, strategy=zero3_full, devices=2, save_to=str(tmp / "z3_full.ckpt"))),
        ("zero3 consolidated resume", dataclasses.replace(GPT, strategy=zero3_full, devices=2, max_steps=3,
                                                          resume_from=str(tmp / "z3_full.ckpt"))),
    ]


TWO_RANK_SITES = {
    "parallel/clip.py:total_norm",  # sharded (zero2/3, tp, ep) and pipeline global norms
    "parallel/pipeline/runtime.py:train_step",  # step-loss broadcast
    "parallel/pipeline/runtime.py:_sum_shared_grads",  # tied embedding / head gradients across stages
    "parallel/experts/apply.py:__call__", "parallel/experts/apply.py:forward", "parallel/experts/apply.py:backward",
    "nn/moe.py:_statistics",
    "strategies/nonfinite.py:step_is_finite",
    "strategies/collectives.py:reduce", "strategies/collectives.py:all_gather", "strategies/collectives.py:reduce_boolean_decision",
    "strategies/collectives.py:barrier", "strategies/collectives.py:broadcast",
    "strategies/checkpoint/files.py:begin_sharded_save", "strategies/checkpoint/files.py:save_sharded",
    "strategies/checkpoint/resume.py:gather_rng_states",
    "strategies/pipeline/driver.py:_build", "strategies/pipeline/log_exchange.py:__call__",
    "strategies/pipeline/state.py:gather_state",
    "strategies/checkpoint/pipeline.py:_to_rank0", "strategies/checkpoint/pipeline.py:receive",
    "parallel/data/fsdp_host.py:__call__",
}
"""Call sites in lightning_parallel the 2-rank fits must reach (``docs/collectives.md`` lists all)."""


def test_two_rank_strategies_hand_collectives_tensors_on_their_device(two_rank_run: dict[str, Any]) -> None:
    fits = two_rank_run["fits"]
    assert fits["zero3 cpu_offload"][0]["backend"] == "cuda:nccl,cpu:gloo"
    assert fits["dp"][0]["backend"] == "nccl"
    offload = [c for c in fits["zero3 cpu_offload"][0]["calls"] if c["site"].startswith("parallel/clip.py")]
    assert offload and all(set(c["devices"]) == {"cpu"} for c in offload), "offloaded gradients reach the clipping as CPU tensors"
    reached = _sites([fit for per_rank in fits.values() for fit in per_rank])
    assert TWO_RANK_SITES <= reached, f"call sites not reached: {sorted(TWO_RANK_SITES - reached)}; reached: {sorted(reached)}"


def test_four_rank_hsdp_and_3d_hand_collectives_tensors_on_their_device() -> None:
    cases = [
        ("hsdp", dataclasses.replace(GPT, strategy=_hybrid(zero_stage=3, hybrid_shard=True, data_parallel_replicate_size=2),
                                     devices=4)),
        ("pp2 x tp2", dataclasses.replace(GPT, strategy=_hybrid(pipeline_parallel_size=2, tensor_parallel_size=2), devices=4)),
        ("dp2 x pp2", dataclasses.replace(GPT, strategy=_hybrid(pipeline_parallel_size=2, data_parallel_size=2), devices=4,
                                          validate=True)),  # and the evaluation step's broadcast
        ("ep2 x edp2", dataclasses.replace(MOE, strategy=_hybrid(expert_parallel_size=2), devices=4)),
    ]
    fits = _run(cases, 4, timeout=500)["fits"]
    assert any(len(c["ranks"]) == 2 for c in fits["hsdp"][0]["calls"]), "hsdp's sub-groups are recorded"
    reached = _sites([fit for per_rank in fits.values() for fit in per_rank])
    expected = {"strategies/pipeline/driver.py:_average_over_data_parallel", "strategies/pipeline/driver.py:_broadcast",
                "strategies/experts.py:reduce_expert_grads",
                "parallel/pipeline/tensor.py:_reduced", "parallel/pipeline/shard_crossing.py:agree_shard_crossings"}
    assert expected <= reached, f"call sites not reached: {sorted(expected - reached)}"
