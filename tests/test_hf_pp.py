"""Pipeline parallelism on real Hugging Face models, wrapped as their users write them.

``Trainer(strategy="pp", devices=2)`` on ``transformers`` causal LMs (tiny random configs) and
transformers image classifiers (ResNet, ViT), each in a plain LightningModule from ``lightning_parallel.testing.real_models``:
per-step losses and final parameters equal one process (fp32, relative 1e-5, 5 steps, clipping on).
The Hugging Face ways of writing it are covered across the cells: the loss from ``labels=``
inside ``self.model(...)`` (the step never calls ``self.forward``), the default ``use_cache=True``,
tied ``lm_head``/``wte`` on the first and last stage (GPT-2), ``config.base_model_pp_plan`` as
the cut, ``gradient_checkpointing_enable()``, and an ``attention_mask`` with padding.

Two cells cannot equal one full-batch step, by what they compute, and are compared with one
process accumulating over the same microbatches instead (ResNet-18 also runs with one microbatch,
where it equals one full-batch step) (batch / microbatches, ``accumulate_grad_batches
= microbatches``; each pipelined step's loss is the mean of two reference losses):

* ResNet-18: BatchNorm normalises each microbatch with that microbatch's statistics (and
  updates its running statistics once per microbatch);
* padding: a token-mean loss over the non-padded tokens of each microbatch (HF's loss and
  ``F.cross_entropy(ignore_index=-100)``) weights the microbatches equally, not by their tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_parallel.parallel.pipeline.trace import CheckpointedForward, trace_pipeline
from lightning_parallel.parallel.pipeline.plan import plan_pipeline
from lightning_parallel.strategies.pipeline.entry import Entry, split_kwargs, tracing_forward
from lightning_parallel.strategies.pipeline.logs import probe_entry_inputs
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.parity import FitSpec, run_fits
from lightning_parallel.testing.more_families import MORE_FAMILIES
from lightning_parallel.testing.real_models import HFCausalLM
from tests.test_data_parallel import assert_parity

RM = "lightning_parallel.testing.real_models"
T5 = MORE_FAMILIES["t5"]
CLIP = {"gradient_clip_val": 0.5}
MICROBATCHES = 2  # pp's default for 2 ranks


class ProbedHFCausalLM(HFCausalLM):
    """``HFCausalLM`` unchanged, plus a record (after fit, per rank) of what the pipeline did with
    it: how many traced layers recompute in backward, the value of the tied embedding this rank
    holds (GPT-2's ``wte`` = ``lm_head``, used on the first and the last stage), and how many
    parameter elements the rank keeps."""

    records: dict[str, Any] = {}

    def on_train_end(self) -> None:
        driver = getattr(self.trainer.strategy, "_pipeline", None)
        stages = driver.runtime.stage_modules() if driver is not None else []
        checkpointed = sum(isinstance(m.__dict__.get("forward"), CheckpointedForward) for s in stages for m in s.modules())
        head = self.model.get_output_embeddings().weight
        tied = head is self.model.get_input_embeddings().weight
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in self.parameters())
        ProbedHFCausalLM.records[self.family] = {
            "checkpointed": checkpointed, "tied": tied, "head": head.detach().clone() if head.numel() else None,
            "local_numel": local,  # what this rank holds after the layout (released copies count 0)
        }


def _lm(family: str, strategy: Any = "pp", devices: int = 2, data: str = "lightning_parallel.testing.parity:token_data",
        **kwargs: Any) -> FitSpec:
    return FitSpec(model="tests.test_hf_pp:ProbedHFCausalLM", model_kwargs={"family": family, **kwargs}, data=data,
                   strategy=strategy, devices=devices, global_batch=8, max_steps=5, trainer_kwargs=CLIP)


def _vision(arch: str, strategy: Any = "pp", **kwargs: Any) -> FitSpec:
    return FitSpec(model=f"{RM}:VisionClassifier", model_kwargs={"arch": arch, **kwargs}, data=f"{RM}:image_data",
                   strategy=strategy, devices=2, global_batch=8, max_steps=5, trainer_kwargs=CLIP)


# Naive layer placement (one microbatch): BatchNorm sees the whole batch, as in one process.
WHOLE_BATCH = {"class": "lightning_parallel:HybridParallelStrategy", "pipeline_parallel_size": 2, "pipeline_schedule": "gpipe",
               "microbatches": 1}


# label -> (spec, compared with one process accumulating over the microbatches?)
PP2_CELLS: dict[str, tuple[FitSpec, bool]] = {
    "llama labels= (self.model call, base_model_pp_plan)": (_lm("llama", loss="labels"), False),
    "qwen2": (_lm("qwen2"), False),
    "gpt2 tied lm_head + gradient checkpointing": (_lm("gpt2", gradient_checkpointing=True), False),
    "gpt_neox": (_lm("gpt_neox"), False),
    "qwen2_moe labels= (experts as opaque ops)": (_lm("qwen2_moe", loss="labels"), False),
    "vit": (_vision("vit"), False),
    "jamba (attention, Mamba, MoE layers in one list)": (
        _lm("JambaConfig/JambaForCausalLM", config={
            "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
            "intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "expert_layer_period": 2,
            "expert_layer_offset": 1, "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 8, "mamba_d_conv": 4,
            "mamba_expand": 2, "mamba_dt_rank": 4, "use_mamba_kernels": False}), False),
    "phi3 padding labels=": (_lm("phi3", loss="labels", padding=True, data=f"{RM}:padded_token_data"), True),
    # An encoder-decoder computing its loss inside: labels and the decoder inputs shifted from them are read
    # by the decoder's stage, the encoder's output is returned: all routed through stage 0 / the last stage.
    "t5 labels= (encoder-decoder)": (_lm(T5[0], loss="labels", config=T5[2]), False),
    # lr 0.01: at the default 0.1 the accumulating comparison reaches 2.4e-5 at step 5 (BatchNorm over
    # 4 samples of 1x1 maps in layer4 amplifies round-off; the same step at one microbatch stays ~1e-7).
    "resnet (BatchNorm per microbatch)": (_vision("resnet", lr=0.01), True),
    "resnet gpipe microbatches=1 (BatchNorm on the whole batch)": (_vision("resnet", WHOLE_BATCH), False),
}


def _single_process(spec: FitSpec, accumulating: bool) -> FitSpec:
    spec = dataclasses.replace(spec, strategy="auto", devices=1)
    if accumulating:
        spec = dataclasses.replace(spec, global_batch=spec.global_batch // MICROBATCHES,
                                   trainer_kwargs={**spec.trainer_kwargs, "accumulate_grad_batches": MICROBATCHES})
    return spec


def fit_and_validate(devices: int) -> dict[str, float]:
    """labels= models fitted with a validation loader, then ``trainer.validate``: the forward-only
    pipe serves ``validation_step``'s ``self.model(..., labels=...)`` (Llama: the loss of the merged
    batch; T5, whose last stage computes it: the mean of the microbatches' losses)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, Subset

    import lightning_parallel  # noqa: F401
    from lightning_parallel.testing.parity import token_data

    out: dict[str, float] = {}
    for family, config in (("llama", None), (T5[0], T5[2])):
        pl.seed_everything(3, verbose=False)
        model = HFCausalLM(family=family, loss="labels", config=config)
        data = token_data()
        train = DataLoader(Subset(data, range(0, 32)), batch_size=8, drop_last=True)
        val = DataLoader(Subset(data, range(64, 96)), batch_size=8, drop_last=True)
        trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="pp" if devices > 1 else "auto", max_epochs=1, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                             use_distributed_sampler=False, num_sanity_val_steps=0)
        trainer.fit(model, train, val)
        out.update({f"{family} fit {k}": float(v) for k, v in trainer.callback_metrics.items()})
        out.update({f"{family} validate {k}": v for k, v in trainer.validate(model, val, verbose=False)[0].items()})
    return out


def _worker(specs: list[FitSpec], validate: bool = False) -> dict[str, Any]:
    fits = run_fits(specs)
    validated = fit_and_validate(specs[0].devices) if validate else None
    return {"fits": fits, "records": ProbedHFCausalLM.records, "validated": validated}


def _per_step(losses: list[float]) -> list[float]:
    return torch.tensor(losses).view(-1, MICROBATCHES).mean(1).tolist()


def check_cells(cells: dict[str, tuple[FitSpec, bool]], world_size: int, timeout: float, validate: bool = False) -> list[dict[str, Any]]:
    """Run every cell in one spawned group and compare each rank with its single-process reference
    (with ``validate``, also :func:`fit_and_validate`)."""
    per_rank = run_distributed(_worker, world_size, [spec for spec, _ in cells.values()], validate, init_backend=None,
                               timeout=timeout)
    reference_run = run_distributed(_worker, 1, [_single_process(s, acc) for s, acc in cells.values()], validate,
                                    init_backend=None, timeout=timeout)[0]
    references = reference_run["fits"]
    if validate:
        for rank, result in enumerate(per_rank):
            assert result["validated"].keys() == reference_run["validated"].keys()
            for key, value in reference_run["validated"].items():
                assert result["validated"][key] == pytest.approx(value, rel=1e-5), (rank, key)
    for (label, (spec, accumulating)), reference in zip(cells.items(), references):
        assert max(reference["grad_norms"]) > CLIP["gradient_clip_val"], f"{label}: clipping must be active"
        if accumulating:
            reference = {**reference, "losses": _per_step(reference["losses"])}
        index = list(cells).index(label)
        for rank, result in enumerate(per_rank):
            fit = result["fits"][index]
            # Data-parallel ranks log their own batch's loss (the step does not sync it): compare the mean.
            losses = [sum(values) / len(values) for values in zip(*(r["fits"][index]["losses"] for r in per_rank))]
            assert_parity({**fit, "losses": losses}, reference, f"{label} (rank {rank})", metrics=False)
    return per_rank


def test_pp2_on_real_models_matches_single_process() -> None:
    per_rank = check_cells(PP2_CELLS, 2, timeout=600, validate=True)
    for rank, result in enumerate(per_rank):
        gpt2 = result["records"]["gpt2"]
        assert gpt2["tied"], "lm_head and wte stay one parameter"
        assert gpt2["checkpointed"] == 2, f"rank {rank}: each rank's two GPT-2 blocks recompute in backward"
        assert result["records"]["llama"]["checkpointed"] == 0
    # The tied weight lives on both stages: each rank's copy got the summed gradient, so they stay equal.
    torch.testing.assert_close(per_rank[0]["records"]["gpt2"]["head"], per_rank[1]["records"]["gpt2"]["head"], rtol=0, atol=0)


PP4 = {"class": "lightning_parallel:HybridParallelStrategy", "pipeline_parallel_size": 4}


def test_pp4_sends_values_past_stages() -> None:
    """Hugging Face decoders compute the attention mask and the rotary tables once, before the first
    layer, and hand them to every layer: under pp4, stage 0's values reach stages 2 and 3 directly
    (refused until 2026-12-04, so pp above 2 never ran these models). GPT-2's tied head: its gradient
    summed over the first and the last stage, the two ranks between sending zeros."""
    cells = {"llama pp4 (mask and rotary past stages)": (_lm("llama", strategy=PP4, devices=4), False),
             "gpt2 pp4 (tied head across the stages between)": (_lm("gpt2", strategy=PP4, devices=4), False)}
    per_rank = check_cells(cells, 4, timeout=600)
    assert per_rank[0]["records"]["gpt2"]["tied"]
    torch.testing.assert_close(per_rank[0]["records"]["gpt2"]["head"], per_rank[3]["records"]["gpt2"]["head"], rtol=0, atol=0)


# ---------------------------------------------------------------- no process group
def test_training_step_calling_self_model_is_the_entry_and_labels_stay_out_of_the_trace() -> None:
    torch.manual_seed(0)
    module = HFCausalLM(family="llama", loss="labels")
    x = torch.randint(0, 64, (4, 16))
    name, args, kwargs = probe_entry_inputs(module, "training_step", ((x, x), 0), {})  # type: ignore[misc]
    assert name == "model" and args == () and set(kwargs) == {"input_ids", "labels"}
    traced, loss = split_kwargs(Entry(name), module, {**kwargs, "use_cache": True})
    assert set(traced) == {"input_ids"} and set(loss) == {"labels"}
    assert module.model.config.use_cache is True  # the default; off only while tracing
    with tracing_forward(module, Entry(name)):
        assert module.model.config.use_cache is False
    assert module.model.config.use_cache is True and "forward" not in module.__dict__


class _LabelsChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc(x)


def test_labels_outside_hf_causal_lms_stay_in_the_trace_and_router_logits_are_a_typed_error() -> None:
    holder = nn.Module()
    holder.net = _LabelsChild()
    traced, loss = split_kwargs(Entry("net"), holder, {"x": torch.ones(2, 4), "labels": torch.ones(2), "use_cache": True})
    assert set(traced) == {"x", "labels"} and loss == {}  # the model's own loss, in its last stage
    moe = HFCausalLM(family="mixtral", loss="labels", n_layer=2, config={"output_router_logits": True})
    with pytest.raises(ValueError, match=r"output_router_logits.*router logits on the last stage"):
        split_kwargs(Entry("model"), moe, {"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.ones(2, 4)})


def test_inputs_read_after_the_first_cut_and_outputs_computed_before_the_last_are_routed(monkeypatch: pytest.MonkeyPatch) -> None:
    """T5 with labels=: the decoder's stage reads the labels (its inputs shifted from them, and the
    loss); the forward returns the encoder's output. The trace copies them in stage 0 and in the last
    stage; each stage's graph then equals the one-process forward. A model that needs no routing is
    traced once per pipe."""
    from lightning_parallel.parallel.pipeline import trace as trace_module

    monkeypatch.setenv("LIGHTNING_PARALLEL_TRACE_IN_CHILD", "0")  # count the traces here
    torch.manual_seed(0)
    module = HFCausalLM(family=T5[0], loss="labels", config=T5[2])
    x = torch.randint(0, 64, (4, 16))
    plan = plan_pipeline(module, 2)
    calls = [0]
    original = trace_module.pipeline
    trace_module.pipeline = lambda *a, **k: (calls.__setitem__(0, calls[0] + 1), original(*a, **k))[1]
    try:
        with tracing_forward(module, Entry("model")):
            traced = trace_pipeline(module, (), {"input_ids": x, "labels": x}, plan=plan, microbatches=1, build_eval=False)
        assert calls[0] == 2, "traced, then again with the labels copied in stage 0 and the encoder output copied last"
        first, last = traced.train.get_stage_module(0), traced.train.get_stage_module(1)
        graph = traced.train.split_gm.graph
        stage_calls = [n for n in graph.nodes if n.op == "call_module"]
        assert all(a.op != "placeholder" for a in stage_calls[1].all_input_nodes), "the decoder's stage reads only stage 0's values"
        out = last(*first(input_ids=x, labels=x))
        reference = module.model(input_ids=x, labels=x)
        torch.testing.assert_close(out[0], reference.loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(out[1], reference.logits, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(out[2], reference.encoder_last_hidden_state, rtol=1e-6, atol=1e-7)
        calls[0] = 0
        llama = HFCausalLM(family="llama", n_layer=2)
        trace_pipeline(llama, (x,), {}, plan=plan_pipeline(llama, 2), microbatches=1, build_eval=False)
        assert calls[0] == 1
    finally:
        trace_module.pipeline = original


def test_hf_gradient_checkpointing_recomputes_traced_layers() -> None:
    """export traces through HF's checkpoint call; the stage's layers are re-wrapped and recompute in backward."""
    torch.manual_seed(0)
    module = HFCausalLM(family="llama", n_layer=2, gradient_checkpointing=True)
    x = torch.randint(0, 64, (4, 16))
    plan = plan_pipeline(module, 2)
    assert plan.source == "base_model_pp_plan"
    with tracing_forward(module, Entry("")):
        traced = trace_pipeline(module, (x,), {}, plan=plan, microbatches=1, build_eval=False)
    stages = [traced.train.get_stage_module(k) for k in range(2)]
    layers = [m for s in stages for m in s.modules() if isinstance(m.__dict__.get("forward"), CheckpointedForward)]
    assert len(layers) == 2
    calls = [0]
    for layer in layers:
        inner = layer.forward.inner
        layer.forward.inner = lambda *a, __inner=inner, **k: (calls.__setitem__(0, calls[0] + 1), __inner(*a, **k))[1]
    hidden = stages[0](x)
    out = stages[1](*hidden) if isinstance(hidden, tuple) else stages[1](hidden)
    assert calls[0] == 2
    out.float().pow(2).mean().backward()
    assert calls[0] == 4, "each checkpointed layer ran again in backward"
    reference = module(x)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)



class _HeadOutsideForward(nn.Module):
    """A step that calls ``self(x)`` and then a child with parameters outside ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.head(self(batch)).sum()


def test_a_child_called_beside_the_entry_is_found() -> None:
    from lightning_parallel.strategies.pipeline.logs import model_calls, other_calls_error

    module = _HeadOutsideForward()
    assert model_calls(module, "training_step", (torch.ones(2, 4), 0), {}) == (1, ["head"])
    x = torch.randint(0, 64, (2, 8))
    for loss, entry in (("logits", ""), ("labels", "model")):  # self.model runs inside forward, or is the entry
        assert model_calls(HFCausalLM(family="llama", n_layer=2, loss=loss), "training_step", ((x, x), 0), {}, entry=entry) == (1, [])
    with pytest.raises(ValueError, match=r"calls self.head besides forward.*HINT: call those modules inside forward"):
        raise other_calls_error("training_step", "forward", ["head"])
