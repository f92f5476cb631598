"""Models built on the meta device train under every eager layout with one process's init.

``with trainer.init_module(empty_init=True): Module()`` (Lightning's way for models too big for
one device) and ``with torch.device("meta"): Module()`` keep parameters without storage until
the layout is applied; then each rank allocates only its part and initialises it as an eager
build would (see :mod:`lightning_parallel.parallel.materialize`). Checked per layout, against
one process that builds the same module eagerly from the same seed and trains it:

* the initial parameters are bit-for-bit the eager ones (gathered before the first optimizer step);
* per-step losses and final parameters match (parity, relative 1e-5);
* each rank's materialised storage is its share (shards, not the model), and the largest
  initialisation temporary is one module's own tensors, far below the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from lightning_parallel.parallel.materialize import materialize_meta_module
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, _load, _make_strategy, _Recorder, full_parameters
from lightning_parallel.testing.real_models import build_hf_model
from tests.test_data_parallel import HYBRID, _reference, assert_parity

HF = "lightning_parallel.testing.real_models:HFCausalLM"
TOKENS = "lightning_parallel.testing.parity:token_data"


def _hf(family: str, strategy: Any, devices: int, **kwargs: Any) -> FitSpec:
    return FitSpec(model=HF, model_kwargs={"family": family, **kwargs}, data=TOKENS, strategy=strategy, devices=devices,
                   global_batch=8, max_steps=5, trainer_kwargs={"gradient_clip_val": 0.5})


def run_meta_fit(spec: FitSpec, build: str) -> dict[str, Any]:
    """``run_fit`` with the module built inside ``trainer.init_module(empty_init=True)`` (``build=
    "init_module"``) or ``torch.device("meta")`` (``"meta"``); also returns the initial parameters
    and what materialisation held on this rank."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, DistributedSampler

    import lightning_parallel  # noqa: F401

    recorder = _Recorder()
    initial: dict[str, torch.Tensor] = {}

    class Initial(pl.Callback):  # before the first update (pipelines materialise their stages in the first step)
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if not initial:
                initial.update(full_parameters(pl_module))

    trainer = pl.Trainer(accelerator="cpu", devices=spec.devices, strategy=_make_strategy(spec.strategy),
                         max_steps=spec.max_steps, use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[recorder, Initial()], **spec.trainer_kwargs)
    pl.seed_everything(spec.seed, verbose=False)
    if build == "init_module":
        with trainer.init_module(empty_init=True):
            model = _load(spec.model)(**spec.model_kwargs)
    else:
        with torch.device("meta"):
            model = _load(spec.model)(**spec.model_kwargs)
    assert all(p.is_meta for p in model.parameters())
    dataset = _load(spec.data)(**spec.data_kwargs)
    kwargs = trainer.strategy.distributed_sampler_kwargs
    sampler = DistributedSampler(dataset, shuffle=False, drop_last=True, **kwargs)
    loader = DataLoader(dataset, batch_size=spec.global_batch // kwargs["num_replicas"], sampler=sampler, drop_last=True)
    trainer.fit(model, train_dataloaders=loader)
    report = trainer.strategy._meta_report
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
    return {"losses": recorder.losses, "params": full_parameters(model), "initial": initial, "metrics": metrics,
            "local_bytes": report.local_bytes, "peak_temporary_bytes": report.peak_temporary_bytes}


def run_meta_fits(cases: list[tuple[FitSpec, str]]) -> list[dict[str, Any]]:
    return [run_meta_fit(spec, build) for spec, build in cases]


def _eager_initial(spec: FitSpec) -> dict[str, torch.Tensor]:
    import lightning.pytorch as pl

    pl.seed_everything(spec.seed, verbose=False)
    return {n: p.detach().clone() for n, p in _load(spec.model)(**spec.model_kwargs).named_parameters()}


def _largest_scope_bytes(spec: FitSpec) -> int:
    """The most bytes one initialisation scope of the eager model holds: a module's own tensors and
    its direct children's (see ``parallel/materialize.py``)."""
    with torch.device("meta"):
        model = _load(spec.model)(**spec.model_kwargs)

    def own(module: nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in [*module._parameters.values(), *module._buffers.values()] if t is not None)

    return max(own(m) + sum(own(c) for c in m.children()) for m in model.modules())


def _check(cases: list[tuple[str, FitSpec, str, float]], devices: int) -> None:
    """Each case: (label, spec, build, the share of the model a rank may hold at most)."""
    results = run_distributed(run_meta_fits, devices, [(spec, build) for _, spec, build, _ in cases], init_backend=None,
                              timeout=600)
    for index, (label, spec, _, share) in enumerate(cases):
        eager = _eager_initial(spec)
        reference = _reference(spec)
        total = sum(t.numel() * t.element_size() for t in eager.values())
        # HFCausalLM logs its rank's loss (no sync_dist): the global batch's loss is the mean over ranks
        # (tensor-parallel peers log the same value, so the mean over all ranks is the mean over dp).
        losses = torch.tensor([r[index]["losses"] for r in results]).mean(0).tolist()
        for rank, rank_results in enumerate(results):
            result = rank_results[index]
            assert result["initial"].keys() == eager.keys(), label
            for name, value in eager.items():
                assert torch.equal(result["initial"][name], value), f"{label}: initial {name} differs from the eager build"
            # TinyNet's torchmetrics accuracy: its states are built real (not meta) inside init_module
            assert_parity({**result, "losses": losses}, reference, label, per_tensor=True,
                          metrics="train_acc" in reference["metrics"])
            assert result["local_bytes"] <= share * total + 4096, f"{label} rank {rank}: {result['local_bytes']} of {total} bytes"
            # one module's tensors (with its direct children's, for inits that write them) at a time: never the model
            assert result["peak_temporary_bytes"] <= _largest_scope_bytes(spec) < total / 2, label


def test_meta_init_two_ranks_every_layout() -> None:
    tiny = FitSpec(model="tests.tiny_models:TinyNet", strategy="dp", devices=2, max_steps=5,
                   trainer_kwargs={"gradient_clip_val": 0.3})
    cases = [
        ("dp TinyNet", tiny, "init_module", 1.0),
        ("zero1 TinyNet", dataclasses.replace(tiny, strategy="zero1"), "init_module", 1.0),
        ("zero3 llama", _hf("llama", "zero3", 2), "init_module", 0.55),
        ("zero2 gpt2 (tied embeddings)", _hf("gpt2", "zero2", 2), "init_module", 0.55),
        ("tp2 llama", _hf("llama", "tp", 2), "meta", 0.6),
        # Phi-3's qkv_proj stored in rank order (parallel/tensor/rank_order.py): initialised in the model's order
        ("tp2 phi3", _hf("phi3", "tp", 2), "init_module", 0.6),
        ("ep2 mixtral", _hf("mixtral", {"class": HYBRID, "expert_parallel_size": 2}, 2), "init_module", 0.85),
        ("pp2 llama (traced on meta, own stage only)", _hf("llama", "pp", 2), "init_module", 0.62),
    ]
    _check(cases, 2)


@pytest.mark.slow
def test_meta_init_four_ranks_dp_x_tp_hsdp_and_pipelines() -> None:
    cases = [
        ("dp2 x tp2 zero3 qwen2", _hf("qwen2", {"class": HYBRID, "tensor_parallel_size": 2, "zero_stage": 3}, 4),
         "init_module", 0.3),
        ("hsdp 2 x 2 llama", _hf("llama", {"class": HYBRID, "zero_stage": 3, "hybrid_shard": True,
                                            "data_parallel_replicate_size": 2}, 4), "init_module", 0.55),
        ("pp2 x tp2 llama", _hf("llama", {"class": HYBRID, "pipeline_parallel_size": 2, "tensor_parallel_size": 2}, 4),
         "init_module", 0.35),
        # ZeRO on pipeline stages: traced on meta, this rank's stage materialised, then sharded by FSDP2
        ("dp2 x pp2 zero1 llama", _hf("llama", {"class": HYBRID, "pipeline_parallel_size": 2, "zero_stage": 1}, 4),
         "init_module", 0.62),
        ("dp2 x pp2 zero3 llama", _hf("llama", {"class": HYBRID, "pipeline_parallel_size": 2, "zero_stage": 3}, 4),
         "init_module", 0.62),
        # Experts on pipeline stages: traced on meta (MoE units as opaque ops), this stage's experts split over ep
        # while meta, then materialised. One block per stage (2 layers: every path, less CPU time); a stage is half
        # the model, its experts 82% of it: a rank holds 0.29; one that allocated the model (1.0, what this layout
        # did before) or its whole stage (0.5) before splitting the experts exceeds 0.35.
        ("pp2 x ep2 mixtral", _hf("mixtral", {"class": HYBRID, "pipeline_parallel_size": 2, "expert_parallel_size": 2}, 4,
                                  n_layer=2), "init_module", 0.35),
    ]
    _check(cases, 4)


def test_metric_built_on_meta_is_a_typed_error() -> None:
    from tests.tiny_models import TinyNet

    with torch.device("meta"):
        model = TinyNet()
    with pytest.raises(TypeError, match=r"train_acc \(MulticlassAccuracy\).*HINT: build the module under trainer.init_module"):
        materialize_meta_module(model, torch.device("cpu"))


def test_uninitialised_tensor_is_a_typed_error() -> None:
    class Bare(nn.Module):  # a parameter no reset_parameters() covers
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.fc = nn.Linear(4, 4)

    with torch.device("meta"):
        model = Bare()
    with pytest.raises(TypeError, match=r"scale.*never initialised.*HINT: give Bare a reset_parameters"):
        materialize_meta_module(model, torch.device("cpu"))


@pytest.mark.parametrize("model", ["zoo MoEGPT", "mixtral"])
def test_meta_output_forward_runs_moe_units_as_opaque_ops(model: str) -> None:
    """The forward-count probe's meta forward of an MoE model (pipelines with ep trace meta-built
    models): the MoE layers' internals, which have no faithful meta kernels (``nonzero`` in the
    zoo's dispatch, a bf16-only ``grouped_mm`` meta kernel in Mixtral's experts), are not run; each
    unit answers with its input's shape, as in the traced stages. The units' own forwards come back."""
    from lightning_parallel.models import MoEGPT
    from lightning_parallel.parallel.pipeline.meta import meta_output_forward
    from lightning_parallel.parallel.pipeline.moe import opaque_units
    from lightning_parallel.testing.real_models import VOCAB, HFCausalLM
    from tests.test_strategy_ep import MOE_SPEC

    with torch.device("meta"):
        module = MoEGPT(**MOE_SPEC.model_kwargs) if model == "zoo MoEGPT" else HFCausalLM("mixtral")
    units = opaque_units(module)
    assert units, model
    x = torch.randint(0, VOCAB, (4, 16))
    with meta_output_forward(module, (x,), {}, torch.device("cpu")):
        out = module(x)
    logits = out[0] if isinstance(out, tuple) else out
    assert logits.device.type == "cpu" and logits.shape == (4, 16, VOCAB) and not logits.any(), model
    assert all("forward" not in unit.__dict__ for unit in units.values()), model
    assert all(p.is_meta for p in module.parameters()), model


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3", "gpt_neox", "qwen2_moe"])
def test_one_process_materialisation_equals_the_eager_build(family: str) -> None:
    """Rotary ``inv_freq`` buffers (non-persistent), tied embeddings, GPT-2's Conv1D and scaled
    ``c_proj`` init, nested ``post_init``: the meta-built model materialises to the eager values."""
    torch.manual_seed(3)
    eager = build_hf_model(family)
    torch.manual_seed(3)
    with torch.device("meta"):
        model = build_hf_model(family)
    state = torch.get_rng_state()
    materialize_meta_module(model, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state), "materialisation must leave the training RNG stream alone"
    expected = eager.state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in eager.named_parameters()]  # ties kept
