"""Pipeline engine parity: pp=2 and pp=4 train exactly like one process (pure torch, gloo).

Each rank also computes the single-process reference itself (same seed, same batches), so one
spawned run checks every schedule of a world size. Tracing is the slow part, so one trace per
(model, number of stages) serves every schedule with that many stages; the module's tensors
are reset in place between schedules (the stages hold the same Parameter objects).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.models.gpt import GPT
from lightning_parallel.models.mlp import DeepMLP, MLPClassifier
from lightning_parallel.parallel.dims import PP, ParallelDims
from lightning_parallel.parallel.pipeline.runtime import build_pipeline
from lightning_parallel.parallel.pipeline.trace import trace_pipeline
from lightning_parallel.parallel.pipeline.plan import plan_pipeline
from lightning_parallel.parallel.pipeline.schedules import merge_microbatch_outputs, resolve_virtual_stages, schedule_spec
from lightning_parallel.launcher import DistributedRunError
from lightning_parallel.testing import run_distributed

STEPS, BATCH, LR = 5, 8, 0.5
RTOL, ATOL = 1e-5, 1e-7


def make_model(kind: str, pp: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(vocab_size=32, block_size=8, n_layer=4 * pp // 2, n_head=2, n_embd=16)
    if kind == "mlp":
        return MLPClassifier(dims=[8] + [24] * (4 * pp // 2) + [4])
    return DeepMLP(in_dim=8, width=16, depth=4 * pp // 2, num_classes=4)


def make_batch(kind: str, step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "gpt":
        idx = torch.randint(0, 32, (BATCH, 8), generator=g)
        return idx, torch.roll(idx, -1, dims=1)
    return torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def loss_of(model: nn.Module, out: Tensor, y: Tensor) -> Tensor:
    return model.compute_loss(out, y)  # the user's own loss code


def reference(kind: str, pp: int, steps: int = STEPS) -> tuple[list[float], dict[str, Tensor]]:
    model = make_model(kind, pp)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = make_batch(kind, step)
        opt.zero_grad()
        loss = loss_of(model, model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def max_rel(a: Tensor, b: Tensor) -> float:
    """Worst excess over the allowed error, elementwise: <= 0 means within rtol/atol."""
    return float(((a - b).abs() - (ATOL + RTOL * b.abs())).max())


def _parity_worker(configs: list[tuple[str, str, int]]) -> list[dict[str, Any]]:
    pp = dist.get_world_size()
    results = []
    traces: dict[tuple[str, int, int], Any] = {}
    modules: dict[str, nn.Module] = {}
    for kind, name, microbatches in configs:
        spec = schedule_spec(name)
        virtual = resolve_virtual_stages(spec, "auto")
        if kind not in modules:
            modules[kind] = make_model(kind, pp)
        model = modules[kind]
        with torch.no_grad():  # back to the initial weights, in place (the stages share them)
            for p, q in zip(model.parameters(), make_model(kind, pp).parameters()):
                p.copy_(q)
                p.grad = None
        plan = plan_pipeline(model, pp, virtual, style=spec.style)
        key = (kind, plan.num_stages, microbatches)  # a trace fixes the microbatch shape
        if key not in traces:
            traces[key] = trace_pipeline(model, (make_batch(kind, 0)[0],), plan=plan, microbatches=microbatches, build_eval=False)
        batch: dict[str, Tensor] = {}
        runtime = build_pipeline(
            model,
            plan=plan,
            schedule=spec,
            microbatches=microbatches,
            loss_fn=lambda out, rows: loss_of(model, out, batch["y"][rows]),
            traced=traces[key],
            build_eval=False,
        )
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            x, batch["y"] = make_batch(kind, step)
            opt.zero_grad()
            losses.append(runtime.train_step(x).item())
            opt.step()
        ref_losses, ref_params = reference(kind, pp)
        owned = runtime.owned_parameter_names()
        params = dict(model.named_parameters())
        results.append(
            {
                "config": (kind, name, microbatches, virtual),
                "stages": runtime.stage_indices,
                "owned": sorted(owned),
                "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                "param_err": max(max_rel(params[n].detach(), ref_params[n]) for n in owned),
                "losses": losses,
            }
        )
    return results


def _check_parity(results: list[list[dict[str, Any]]], pp: int) -> None:
    all_names = {kind: {n for n, _ in make_model(kind, pp).named_parameters()} for kind in ("gpt", "mlp", "deep")}
    for index, per_rank in enumerate(zip(*results)):
        config = per_rank[0]["config"]
        for r in per_rank:
            assert r["loss_err"] <= RTOL, (config, r["loss_err"])
            assert r["param_err"] <= 0.0, (config, r["param_err"])
            assert r["losses"] == per_rank[0]["losses"], "every rank returns the same loss"
        owned = [set(r["owned"]) for r in per_rank]
        assert set().union(*owned) == all_names[config[0]], config  # every parameter has an owner
        assert sum(len(o) for o in owned) == len(all_names[config[0]]), config  # ... exactly one
        assert all(owned), config
        assert sorted(s for r in per_rank for s in r["stages"]) == list(range(pp * config[3]))


PP2 = [
    ("gpt", "gpipe", 4),
    ("gpt", "1f1b", 4),
    ("gpt", "interleaved_1f1b", 4),
    ("gpt", "zbv", 4),
    ("mlp", "gpipe", 1),  # naive layer placement
    ("mlp", "1f1b", 2),
    ("mlp", "interleaved_1f1b", 2),
    ("mlp", "interleaved_zb", 2),
]
PP4 = [
    ("gpt", "gpipe", 4),
    ("gpt", "1f1b", 4),
    ("gpt", "interleaved_1f1b", 4),
    ("gpt", "zbv", 8),
    ("deep", "1f1b", 8),
    ("deep", "interleaved_1f1b", 8),
    ("deep", "interleaved_zb", 8),
]


def test_pp2_schedules_match_single_process() -> None:
    _check_parity(run_distributed(_parity_worker, 2, PP2, timeout=240), 2)


@pytest.mark.slow
def test_pp4_schedules_match_single_process() -> None:
    _check_parity(run_distributed(_parity_worker, 4, PP4, timeout=300), 4)


class TiedLM(nn.Module):
    """Embedding and head share one weight: the head's stage is on another rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(16, 12)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(12, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: Tensor) -> Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class DroppingLM(TiedLM):
    """TiedLM with dropout after the embedding: its evaluation trace computes something else, so its
    evaluation stages are their own modules (parallel/pipeline/eval_reuse.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.drop(self.emb(idx))
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _tied_batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return torch.randint(0, 16, (BATCH, 5), generator=g), torch.randint(0, 16, (BATCH, 5), generator=g)


def _tied_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _features_worker() -> dict[str, Any]:
    """Tied weights, accumulation, clipping, eval, released params and bad input on 2 ranks."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    # ---- bad input raised here on every rank, before any send/recv ----
    spec = schedule_spec("1f1b")
    model = TiedLM()
    plan = plan_pipeline(model, 2)
    x0 = _tied_batch(0)[0]
    try:
        build_pipeline(model, (x0,), plan=plan, schedule=spec, microbatches=1, loss_fn=lambda o, t: o.sum())
    except ValueError as error:
        out["few_microbatches"] = str(error)
    batch: dict[str, Tensor] = {}
    dims = ParallelDims.resolve(2, pipeline_parallel_size=2)
    dims.build_mesh("cpu")
    runtime = build_pipeline(
        model, (x0,), plan=plan, schedule=spec, microbatches=2, loss_fn=lambda o, rows: _tied_loss(o, batch["y"][rows]), group=dims.axis(PP)
    )
    for bad, key in ((x0[:7], "indivisible"), (torch.cat([x0, x0]), "other_size")):
        try:
            runtime.train_step(bad)
        except ValueError as error:
            out[key] = str(error)
    # ---- forward-only evaluation: the merged output on the last stage's rank ----
    x = _tied_batch(9)[0]
    result = runtime.eval_step(x)
    out["eval_err"] = None if result is None else max_rel(result, TiedLM().eval()(x).detach())
    out["eval_shared"] = [a is b for a, b in zip(runtime.stages_submodules(train=True), runtime.stages_submodules(train=False), strict=True)]
    dropping = DroppingLM()
    other = build_pipeline(dropping, (x0,), plan=plan_pipeline(dropping, 2), schedule=spec, microbatches=2,
                           loss_fn=lambda o, rows: o.sum(), group=dims.axis(PP))
    result = other.eval_step(x)
    out["dropout_eval_err"] = None if result is None else max_rel(result, DroppingLM().eval()(x).detach())
    out["dropout_eval_shared"] = [a is b for a, b in zip(other.stages_submodules(train=True), other.stages_submodules(train=False), strict=True)]
    out["shared_owners"] = runtime.owners()["emb.weight"]
    out["released"] = runtime.release_non_owned()
    out["empty"] = sorted(n for n, p in model.named_parameters() if p.numel() == 0)
    # ---- 3 optimizer steps, each accumulating 2 batches, clipped by the global norm ----
    ref = TiedLM()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):
            x, batch["y"] = _tied_batch(2 * step + micro)
            losses.append(runtime.train_step(x).item())
            ref_loss = _tied_loss(ref(x), batch["y"])
            ref_loss.backward()
            ref_losses.append(ref_loss.item())
        norms.append(runtime.clip_grad_norm_(0.5).item())
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item())
        opt.step()
        ref_opt.step()
    ref_params = dict(ref.named_parameters())
    out["loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    out["norm_err"] = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    out["norms"] = norms
    out["param_err"] = max(max_rel(p.detach(), ref_params[n]) for n, p in model.named_parameters() if p.numel())
    out["rank"] = rank
    return out


def test_tied_weights_accumulation_clipping_eval_release_and_bad_input() -> None:
    results = run_distributed(_features_worker, 2, timeout=180)
    for r in results:
        assert "`microbatches`=1 is invalid: schedule '1f1b' needs at least as many microbatches as stages (2)" in r["few_microbatches"]
        assert "divisible by 2" in r["indivisible"] and "drop_last=True" in r["indivisible"]
        assert "traced for microbatches of 4 rows" in r["other_size"]
        assert r["shared_owners"] == {0, 1}  # the tied weight lives on both ranks
        assert r["loss_err"] <= RTOL and r["norm_err"] <= RTOL and r["param_err"] <= 0.0, r
        assert min(r["norms"]) > 0.5  # clipping was active in every step
        assert r["norms"] == results[0]["norms"]
    first, last = results
    assert first["empty"] == sorted(first["released"]) == [f"layers.{i}.0.{w}" for i in (2, 3) for w in ("bias", "weight")]
    assert last["empty"] == sorted(last["released"]) == [f"layers.{i}.0.{w}" for i in (0, 1) for w in ("bias", "weight")]
    assert first["released"]["layers.2.0.weight"] == torch.Size([12, 12])
    assert first["eval_err"] is None and last["eval_err"] is not None and last["eval_err"] <= 0.0
    assert first["dropout_eval_err"] is None and last["dropout_eval_err"] is not None and last["dropout_eval_err"] <= 0.0
    # No dropout: one module per stage serves both modes. DroppingLM's dropout is in the first stage only, so
    # that stage's evaluation module is its own and the last stage's is shared: the two modes mix across a cut.
    assert first["eval_shared"] == last["eval_shared"] == [True]
    assert first["dropout_eval_shared"] == [False] and last["dropout_eval_shared"] == [True]


class Branchy(nn.Module):
    """Data-dependent control flow: no single graph exists."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        x = self.blocks[0](x)
        if x.sum() > 0:
            x = -x
        return self.blocks[1](x)


class LongSkip(nn.Module):
    """The stem's output is added after the last block: it would have to skip stages."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        h = s = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return h + s


class ReadsLate(nn.Module):
    """Reads an input after the last block and returns the stem's output too (an encoder-decoder's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
        h = s = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return h * shift, s


def test_inputs_read_late_and_outputs_computed_early_pass_through_the_first_and_last_stage() -> None:
    torch.manual_seed(0)
    model, x, shift = ReadsLate(), torch.randn(4, 4), torch.randn(4, 4)
    traced = trace_pipeline(model, (x, shift), plan=plan_pipeline(model, 2), microbatches=1, build_eval=False)
    stages = [traced.train.get_stage_module(k) for k in range(2)]
    calls = [n for n in traced.train.split_gm.graph.nodes if n.op == "call_module"]
    assert all(a.op != "placeholder" for a in calls[1].all_input_nodes), "stage 1 reads only what stage 0 sends"
    out = stages[1](*stages[0](x, shift))
    torch.testing.assert_close(out, model(x, shift), rtol=0, atol=0)


def test_eval_outputs_merge_a_per_microbatch_loss_by_the_loss_reduction() -> None:
    chunks = [{"loss": torch.tensor(float(k)), "logits": torch.full((2, 3), float(k)), "n": 7} for k in (1, 3)]
    merged = merge_microbatch_outputs(chunks, "mean")
    assert merged["loss"].item() == 2.0 and merged["n"] == 7
    torch.testing.assert_close(merged["logits"], torch.cat([c["logits"] for c in chunks]))
    assert merge_microbatch_outputs(chunks, "sum")["loss"].item() == 4.0


class ReusedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        for block in (self.blocks[0], self.blocks[1], self.blocks[1], self.blocks[2]):
            x = block(x)
        return x


def test_forwards_that_cannot_be_split_are_clear_errors() -> None:
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"`module.forward`='Branchy' is invalid: it cannot be captured as one graph.*data-dependent control flow.*HINT"):
        trace_pipeline(Branchy(), (x,), plan=plan_pipeline(Branchy(), 2), microbatches=2)
    skip = LongSkip()
    # two stages: the skip crosses one cut, as the cut's input -> fine
    trace_pipeline(skip, (x,), plan=plan_pipeline(skip, 2), microbatches=2, build_eval=False)
    # four stages, one per rank: stage 0's value goes straight to stage 3 (torch's stages send it there)
    trace_pipeline(skip, (x,), plan=plan_pipeline(skip, 4), microbatches=2, build_eval=False)
    # two stages per rank: those schedules send only between adjacent stages
    with pytest.raises(ValueError, match=r"a tensor computed on stage 0 \(stem, blocks.0\) is used on stage 3.*2 stages per rank.*HINT: use a schedule with one stage per rank"):
        trace_pipeline(skip, (x,), plan=plan_pipeline(skip, 2, 2, style="loop"), microbatches=2, build_eval=False)
    reused = ReusedBlock()
    with pytest.raises(ValueError, match="traced forward has 4 stages instead of 3: each split point must be called exactly once"):
        trace_pipeline(reused, (x,), plan=plan_pipeline(reused, 3), microbatches=2, build_eval=False)
    # the split markers are gone after tracing, failed or not: a second trace works
    assert "forward" not in reused.blocks[1].__dict__
    trace_pipeline(skip, (x,), plan=plan_pipeline(skip, 2), microbatches=2, build_eval=False)


def _dying_last_stage() -> str:
    """pp=2, 1F1B: the last stage's process dies inside the loss of the first microbatch."""
    model = make_model("gpt", 2)
    plan = plan_pipeline(model, 2, 1, style="single")
    x, y = make_batch("gpt", 0)

    def loss(out: Tensor, rows: Tensor) -> Tensor:
        if dist.get_rank() == 1:
            os._exit(13)  # a crash mid-step: no exception, no cleanup
        return loss_of(model, out, y[rows])

    runtime = build_pipeline(model, (x,), plan=plan, schedule=schedule_spec("1f1b"), microbatches=2, loss_fn=loss, build_eval=False)
    runtime.train_step(x)
    return "finished"


def test_a_rank_dying_mid_step_fails_its_peer_instead_of_hanging() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_dying_last_stage, 2, timeout=120)
    elapsed = time.monotonic() - start
    first = str(info.value).split("--- rank 0")[1].split("--- rank 1")[0]
    assert "no result within" not in first and "Error" in first, first  # failed with an error, not killed
    assert elapsed < 90, elapsed
