"""Our pipeline parallelism against a hand-written ``torch.distributed.pipelining`` loop (issue #5).

Not a timed test: run ``python benchmarks/bench_pipeline_vs_manual.py [--pp 2 4] [--microbatches 4 8]``.

Three ways to train the package's GPT (``--layers`` 8, ``--heads`` 4, ``--embd`` 128, block 64,
vocabulary 256, fp32, SGD with momentum 0.9) split into ``p`` stages, side by side in the same
processes, on the same cut (our planner's: the blocks split evenly, the embeddings with the first
stage, ``ln_f`` and ``lm_head`` with the last), the same initial weights, the same batches
(global batch ``--batch``, cut into ``m`` microbatches) and the same number of steps:

* **lightning**: what a user runs, ``Trainer(strategy=HybridParallelStrategy(pipeline_parallel_size=p,
  pipeline_schedule=..., microbatches=m))`` fitting an unchanged LightningModule whose
  ``training_step`` runs per microbatch as the loss: by default (``--module plain``) the GPT with
  a step that computes and logs the cross-entropy, what the other paths compute; ``--module
  package`` fits the package's GPT as it is, which also updates a torchmetrics accuracy per
  microbatch and logs with ``sync_dist=True`` (user code the other paths do not run).
  Step time = the time between consecutive ``on_train_batch_end`` calls (everything Lightning does
  per batch, data loading included).
* **engine**: our engine alone, no Lightning: ``trace_pipeline`` + ``build_pipeline`` +
  ``release_non_owned`` and ``PipelineRuntime.train_step`` with a plain cross-entropy loss, then
  ``SGD.step``. The difference to *lightning* is the Lightning/driver overhead; the difference to
  *manual* is the engine's (tracing frontend, shared-gradient bookkeeping, loss broadcast).
* **manual**: the loop a torch user writes by hand: each rank builds only its own stage as a
  small ``nn.Module`` (its embeddings/blocks/head, weights copied from the same seeded GPT),
  ``PipelineStage`` (manual frontend), ``ScheduleGPipe``/``Schedule1F1B``, ``SGD.step``.

Reported per configuration: the median step time after ``--warmup`` steps on each rank (the
table shows the slowest rank's median), the ratios to *manual* (target <= 1.05), the loss of the
last step of each path and the largest relative difference of any step's loss from *manual*'s
(they must agree: same weights, data and updates), and the model-state bytes each rank holds
under each path (parameters + gradients + optimizer state actually held,
after the last step; parameters our pipeline released count 0) against ``total / p``, total
being what one process holds for the whole model (target <= 1.1 for a balanced model).

The three paths run interleaved, step by step: after each of Lightning's steps (outside its
timing) a callback steps the manual loop and our engine once, alternating their order, so all
three see the same machine load at nearly the same moment (the machine may be shared). Each
path's step starts on every rank together (a barrier outside the timing), so a rank's step time
runs from the common start to that rank's end, and the slowest rank's is the step's critical
path; without it the last stage's rank, which finishes before rank 0 (rank 0 runs the final
backward), started the next path's step early and was charged the wait.
``--rounds`` repeats every configuration; each round's ratio compares the paths of that round (they
ran interleaved), and the table shows the median of the rounds' ratios (and each round's). With more
processes than free CPU cores (``p=4`` on 2 cores) ranks time-share cores and absolute times
mean little; the ratios still compare like with like.

Diagnostics: ``--profile PATH M SCHEDULE RANK`` prints cProfile's top 15 (cumulative; env
``BENCH_SORT``/``BENCH_TOP`` change the order and count, ``BENCH_CALLERS=regex`` adds the callers) of one path
on one rank over the steps after warm-up instead of the table. ``--codegen`` makes our traced
stage submodules run their generated Python code instead of ``torch.fx.Interpreter`` (see
:func:`_codegen`; the library is not changed by it), which shows how much of our overhead is
the interpreter: without it the traced forward costs about twice the hand-written one per
microbatch (backward is the same), hence engine/manual well above 1.05; with it, about 1.
Where the engine itself already switches its stages to generated code, ``--codegen`` changes nothing.

    python benchmarks/bench_pipeline_vs_manual.py                      # p=2, m=4 and 8, gpipe and 1f1b
    python benchmarks/bench_pipeline_vs_manual.py --pp 2 4 --steps 20
    python benchmarks/bench_pipeline_vs_manual.py --codegen            # the same with generated-code stages
    python benchmarks/bench_pipeline_vs_manual.py --profile engine 8 1f1b 0
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader, TensorDataset

import lightning_parallel  # noqa: F401  (registers the strategy names)
from lightning_parallel import HybridParallelStrategy
from lightning_parallel.callbacks.measure import model_state_bytes
from lightning_parallel.launcher import run_distributed
from lightning_parallel.models import GPT
from lightning_parallel.models.gpt import Block
from lightning_parallel.parallel.pipeline.runtime import build_pipeline
from lightning_parallel.parallel.pipeline.trace import trace_pipeline
from lightning_parallel.parallel.pipeline.plan import plan_pipeline
from lightning_parallel.parallel.pipeline.schedules import schedule_spec

MANUAL_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
LR, MOMENTUM = 0.1, 0.9


class PlainGPT(GPT):
    """The GPT whose training step computes what the other two paths compute: the cross-entropy,
    logged once per step (``--module plain``). The package's own GPT (``--module package``) also
    updates a torchmetrics accuracy on every microbatch and logs with ``sync_dist=True``: the
    user's code, which the hand-written loop does not run, not the strategy's overhead."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = _lm_loss(self(x), y)
        self.log("train_loss", loss)
        return loss


def _gpt(args: argparse.Namespace, lightning: bool = False) -> GPT:
    torch.manual_seed(0)
    cls = PlainGPT if lightning and args.module == "plain" else GPT
    return cls(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd,
               lr=LR, optimizer="sgd", momentum=MOMENTUM)


def _data(args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    """``steps`` batches of ``(idx, targets)``, identical on every rank and for every path."""
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, args.vocab, (args.steps * args.batch, args.block + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


# ----------------------------------------------------------------------------- manual (hand-written)
class ManualStage(nn.Module):
    """One rank's slice of the GPT, written by hand: what a torch user builds per rank.

    Submodule names follow the GPT's (``tok_emb``, ``blocks.4``, ``lm_head`` ...) so the weights
    load from its state dict; only this stage's modules are ever allocated here.
    """

    def __init__(self, args: argparse.Namespace, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb = nn.Embedding(args.vocab, args.embd)
            self.pos_emb = nn.Embedding(args.block, args.embd)
        self.blocks = nn.ModuleDict({str(i): Block(args.embd, args.heads) for i in layers})
        if last:
            self.ln_f = nn.LayerNorm(args.embd)
            self.lm_head = nn.Linear(args.embd, args.vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def _manual_stage(args: argparse.Namespace, rank: int, pp: int) -> ManualStage:
    gpt = _gpt(args)  # the same seeded weights as the other paths (as if loaded from a checkpoint)
    modules = plan_pipeline(gpt, pp).stages[rank].modules  # the same cut as ours
    layers = [int(name.split(".")[1]) for name in modules if name.startswith("blocks.")]
    assert set(modules) - {f"blocks.{i}" for i in layers} <= {"tok_emb", "pos_emb", "drop", "ln_f", "lm_head"}, modules
    stage = ManualStage(args, layers, "tok_emb" in modules, "lm_head" in modules)
    full = gpt.state_dict()
    stage.load_state_dict({k: full[k] for k in stage.state_dict()}, strict=True)
    return stage


def _lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class _Runner:
    """One training loop stepped from outside, so the paths can run interleaved step by step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.x_all, self.y_all = _data(args)
        self.times: list[float] = []
        self.cpu: list[float] = []  # this process's CPU time per step (all its threads; waits in collectives excluded)
        self.losses: list[float] = []
        self.prof: Any = None  # a cProfile.Profile enabled around the steps after warm-up

    def batch(self, i: int) -> tuple[Tensor, Tensor]:
        b = self.args.batch
        return self.x_all[i * b:(i + 1) * b], self.y_all[i * b:(i + 1) * b]

    def run(self, i: int) -> None:
        x, y = self.batch(i)
        profiling = self.prof is not None and i >= self.args.warmup
        if profiling:
            self.prof.enable()
        dist.barrier()  # every path's step starts on all ranks together (see _Interleave)
        start, cpu = time.perf_counter(), time.process_time()
        loss = self.step(x, y)
        self.times.append(time.perf_counter() - start)
        self.cpu.append(time.process_time() - cpu)
        if profiling:
            self.prof.disable()
        if loss is not None:
            self.losses.append(loss)

    def step(self, x: Tensor, y: Tensor) -> float | None:
        raise NotImplementedError

    def state(self) -> dict[str, int]:
        raise NotImplementedError


class ManualRunner(_Runner):
    """The hand-written loop: this rank's ``ManualStage``, ``PipelineStage``, torch's schedule, SGD."""

    def __init__(self, args: argparse.Namespace, m: int, schedule: str) -> None:
        super().__init__(args)
        self.rank, self.pp = dist.get_rank(), dist.get_world_size()
        self.module = _manual_stage(args, self.rank, self.pp)
        stage = PipelineStage(self.module, self.rank, self.pp, torch.device("cpu"))
        self.schedule = MANUAL_SCHEDULES[schedule](stage, n_microbatches=m, loss_fn=_lm_loss)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=MOMENTUM)

    def step(self, x: Tensor, y: Tensor) -> float | None:
        self.opt.zero_grad(set_to_none=True)
        losses: list[Tensor] = []
        if self.rank == 0:
            self.schedule.step(x)
        elif self.rank == self.pp - 1:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        self.opt.step()
        return float(torch.stack([l.detach() for l in losses]).mean()) if losses else None

    def state(self) -> dict[str, int]:
        return model_state_bytes(self.module, [self.opt])


class EngineRunner(_Runner):
    """Our engine without Lightning: trace, build this rank's stages, release the rest, SGD."""

    def __init__(self, args: argparse.Namespace, m: int, schedule: str) -> None:
        super().__init__(args)
        pp = dist.get_world_size()
        self.model = _gpt(args)
        plan = plan_pipeline(self.model, pp)
        self.y: Tensor | None = None
        traced = trace_pipeline(self.model, (self.x_all[: args.batch],), plan=plan, microbatches=m, build_eval=False)
        self.runtime = build_pipeline(self.model, plan=plan, schedule=schedule_spec(schedule), microbatches=m,
                                      loss_fn=self._loss, traced=traced, build_eval=False)
        self.runtime.release_non_owned()
        self.opt = torch.optim.SGD(self.runtime.owned_parameters(), lr=LR, momentum=MOMENTUM)

    def _loss(self, out: Tensor, rows: Tensor) -> Tensor:
        assert self.y is not None
        return _lm_loss(out, self.y[rows])

    def step(self, x: Tensor, y: Tensor) -> float | None:
        self.opt.zero_grad(set_to_none=True)
        self.y = y
        loss = self.runtime.train_step(x)
        self.opt.step()
        return float(loss) if self.runtime.holds_last else None

    def state(self) -> dict[str, int]:
        return model_state_bytes(self.model, [self.opt])


# ----------------------------------------------------------------------------- Lightning + our strategy
class _Interleave(pl.Callback):
    """Times Lightning's steps; after each one (outside its timing) steps the other loops once."""

    def __init__(self, others: list[_Runner], warmup: int) -> None:
        self.others, self.warmup = others, warmup
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float] = []
        self.prof: Any = None
        self._last = self._last_cpu = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last, self._last_cpu = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.times.append(time.perf_counter() - self._last)  # data loading and every Lightning hook included
        self.cpu.append(time.process_time() - self._last_cpu)
        if self.prof is not None:
            self.prof.disable()
        self.losses.append(float(outputs["loss"]))
        order = self.others if batch_idx % 2 == 0 else self.others[::-1]  # no path always runs right after another
        for runner in order:
            runner.run(batch_idx)
        # All ranks start the next step together: without this a path's step on the last stage's
        # rank would include the previous path's skew (that rank finishes its step before rank 0,
        # which runs the final backward), and a step ending in a collective would be charged it.
        dist.barrier()
        if self.prof is not None and batch_idx + 1 >= self.warmup:  # the timed window: data loading included
            self.prof.enable()
        self._last, self._last_cpu = time.perf_counter(), time.process_time()


def run_lightning(args: argparse.Namespace, m: int, schedule: str, others: list[_Runner],
                  prof: Any = None) -> dict[str, Any]:
    pp = dist.get_world_size()
    x_all, y_all = _data(args)
    model = _gpt(args, lightning=True)
    callback = _Interleave(others, args.warmup)
    callback.prof = prof
    trainer = pl.Trainer(
        accelerator="cpu", devices=pp, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[callback],
        use_distributed_sampler=False,  # every pipeline rank reads the same batches, in order
        strategy=HybridParallelStrategy(pipeline_parallel_size=pp, pipeline_schedule=schedule, microbatches=m),
        default_root_dir=args.out,
    )
    loader = DataLoader(TensorDataset(x_all, y_all), batch_size=args.batch, shuffle=False, drop_last=True)
    trainer.fit(model, loader)
    return {"times": callback.times, "cpu": callback.cpu, "losses": callback.losses if dist.get_rank() == pp - 1 else [],
            "state": model_state_bytes(model, trainer.optimizers)}


PATHS = ("manual", "engine", "lightning")


def _codegen(args: argparse.Namespace) -> None:
    """``--codegen``: stage submodules traced from now on run their generated code, not ``fx.Interpreter``.

    A diagnostic, not a fix in the library: the tracer frontend rebuilds the module hierarchy
    with ``torch.export.unflatten.InterpreterModule``, which by default executes every graph
    node through ``torch.fx.Interpreter`` (per node: Python dispatch, context managers, and a
    tqdm object per submodule call); the flag is read when those modules are created.
    """
    if args.codegen:  # the module, not the function ``torch.export.unflatten`` that shadows its name
        importlib.import_module("torch.export.unflatten").RUN_WITH_INTERPRETER = False


def run_config(args: argparse.Namespace, m: int, schedule: str, profile: tuple[str, Any] | None = None) -> dict[str, Any]:
    """The three paths on one configuration, interleaved step by step inside Lightning's loop."""
    runners: dict[str, _Runner] = {"manual": ManualRunner(args, m, schedule), "engine": EngineRunner(args, m, schedule)}
    if profile is not None and profile[0] in runners:
        runners[profile[0]].prof = profile[1]
    lightning = run_lightning(args, m, schedule, list(runners.values()),
                              prof=profile[1] if profile is not None and profile[0] == "lightning" else None)
    out = {name: {"times": r.times, "cpu": r.cpu, "losses": r.losses, "state": r.state()} for name, r in runners.items()}
    out["lightning"] = lightning
    return out


def _worker(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    _codegen(args)
    pl.seed_everything(0, verbose=False)
    rows = []
    for r in range(args.rounds):
        for m in args.microbatches:
            for schedule in args.schedules:
                dist.barrier()
                results = run_config(args, m, schedule)
                for name in PATHS:
                    result = results[name]
                    rows.append({"round": r, "m": m, "schedule": schedule, "path": name,
                                 "median": statistics.median(result["times"][args.warmup:]),
                                 "cpu": statistics.median(result["cpu"][args.warmup:]),
                                 "steps": result["times"][args.warmup:],
                                 "losses": result["losses"], "state": result["state"]})
    return rows


def _profile_worker(args: argparse.Namespace, path: str, m: int, schedule: str, rank: int) -> str:
    """cProfile of one path on one rank over its steps after warm-up (top 15 by cumulative time)."""
    import cProfile
    import io
    import pstats

    torch.set_num_threads(1)
    _codegen(args)
    prof = cProfile.Profile() if dist.get_rank() == rank else None
    run_config(args, m, schedule, profile=(path, prof) if prof is not None else None)
    if prof is None:
        return ""
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats(os.environ.get("BENCH_SORT", "cumulative")).print_stats(int(os.environ.get("BENCH_TOP", "15")))
    if os.environ.get("BENCH_CALLERS"):
        pstats.Stats(prof, stream=text).print_callers(os.environ["BENCH_CALLERS"])
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=sorted(MANUAL_SCHEDULES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="global batch (samples per step), cut into m microbatches")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="repeat every configuration; ratios are the median over rounds")
    parser.add_argument("--module", choices=("plain", "package"), default="plain",
                        help="the LightningModule of the lightning path: plain (cross-entropy, logged) or the package's GPT"
                             " (adds a torchmetrics accuracy per microbatch and sync_dist logging)")
    parser.add_argument("--codegen", action="store_true",
                        help="diagnostic: run our traced stages with generated code instead of fx.Interpreter (see _codegen)")
    parser.add_argument("--profile", nargs=4, metavar=("PATH", "M", "SCHEDULE", "RANK"),
                        help="instead of the table: cProfile one path on one rank at pp=--pp[0], e.g. engine 8 1f1b 0")
    parser.add_argument("--out", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_pipeline_vs_manual"))
    args = parser.parse_args()

    if args.profile:
        path, m, schedule, rank = args.profile
        print(run_distributed(_profile_worker, args.pp[0], args, path, int(m), schedule, int(rank), timeout=900)[int(rank)])
        return

    model = _gpt(args)
    total_params = sum(p.numel() * p.element_size() for p in model.parameters())
    total = 3 * total_params  # one process: parameters + gradients + SGD momentum, all fp32
    print(f"CPU cores available: {len(os.sched_getaffinity(0))}; GPT n_layer={args.layers} n_head={args.heads} "
          f"n_embd={args.embd} vocab={args.vocab} block={args.block}; global batch {args.batch}; fp32, SGD momentum "
          f"{MOMENTUM}; median of steps {args.warmup + 1}-{args.steps}, slowest rank; {args.rounds} round(s)"
          f"{'; --codegen: our stages run generated code, not fx.Interpreter' if args.codegen else ''}")
    print(f"single-process model state (params + grads + momentum): {total / 2**20:.3f} MiB")
    header = (f"{'p':>2} {'m':>2} {'schedule':>8} {'manual ms':>10} {'engine ms':>10} {'lightning ms':>13} "
              f"{'engine/man':>10} {'light/man':>10} {'light/man per round':>34} {'eng steps':>10} {'light steps':>10} "
              f"{'eng cpu':>10} {'light cpu':>10} {'loss manual':>12} {'loss light':>12} {'max rel diff':>13}")
    table, per_rank_lines, states = [header], [], {}
    for pp in args.pp:
        per_rank = run_distributed(_worker, pp, args, timeout=1800)
        # per (m, schedule, path): one entry per round, each the slowest rank's median step (wall and CPU)
        rounds: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
        for i, row in enumerate(per_rank[0]):
            key = (row["m"], row["schedule"], row["path"])
            rounds.setdefault(key, []).append({
                "median": max(r[i]["median"] for r in per_rank), "cpu": max(r[i]["cpu"] for r in per_rank),
                "steps": [max(step) for step in zip(*(r[i]["steps"] for r in per_rank))],  # slowest rank, per step
                "losses": next(r[i]["losses"] for r in per_rank if r[i]["losses"]),  # the last stage's rank has them
                "per_rank": [r[i]["median"] for r in per_rank]})
            states[(pp, row["path"])] = [r[i]["state"] for r in per_rank]  # independent of m and the schedule
        for m in args.microbatches:
            for schedule in args.schedules:
                man, eng, lig = (rounds[(m, schedule, p)] for p in PATHS)

                def ratio(path: list[dict[str, Any]], field: str = "median") -> list[float]:
                    # per round, against the manual loop of the same round (they ran interleaved, step by step)
                    return [a[field] / b[field] for a, b in zip(path, man)]

                def mid(path: list[dict[str, Any]]) -> float:
                    return statistics.median(r["median"] for r in path)

                def paired_steps(path: list[dict[str, Any]]) -> float:
                    # every timed step against the manual step run next to it, pooled over the rounds
                    return statistics.median(a / b for r, ref in zip(path, man) for a, b in zip(r["steps"], ref["steps"]))

                light_rounds = ratio(lig)
                diff = max(abs(a - b) / abs(b) for path in (eng, lig) for r, ref in zip(path, man)
                           for a, b in zip(r["losses"], ref["losses"]))
                table.append(
                    f"{pp:>2} {m:>2} {schedule:>8} {1e3 * mid(man):>10.1f} {1e3 * mid(eng):>10.1f} {1e3 * mid(lig):>13.1f} "
                    f"{statistics.median(ratio(eng)):>10.3f} {statistics.median(light_rounds):>10.3f} "
                    f"{' '.join(f'{x:.3f}' for x in light_rounds):>34} {paired_steps(eng):>10.3f} {paired_steps(lig):>10.3f} "
                    f"{statistics.median(ratio(eng, 'cpu')):>10.3f} {statistics.median(ratio(lig, 'cpu')):>10.3f} "
                    f"{man[-1]['losses'][-1]:>12.6f} {lig[-1]['losses'][-1]:>12.6f} {diff:>13.1e}")
                for name, res in zip(PATHS, (man, eng, lig)):
                    per = "; ".join(" ".join(f"{1e3 * t:.1f}" for t in r["per_rank"]) for r in res)
                    per_rank_lines.append(f"  p={pp} m={m} {schedule:>5} {name:>9}: {per}")
    print("\nstep time: median over rounds of the slowest rank's median step. Ratios to the manual loop (target <= 1.05):"
          " engine/man, light/man: per round (the paths of a round ran interleaved), median over rounds (each round's"
          " light/man listed); 'steps': every timed step (slowest rank) against the manual step run beside it, median"
          " over all steps of all rounds; 'cpu': per round, each process's CPU time per step (waits in collectives"
          " excluded), median over rounds. Losses of the last step; max rel diff: largest relative difference of"
          " engine's and lightning's per-step losses from manual's")
    print("\n".join(table))
    print("\nper-rank median step ms (rank 0 .. p-1; rounds separated by ';')")
    print("\n".join(per_rank_lines))
    print("\nmodel-state bytes per rank (params + grads + optimizer state held after the last step) vs total / p "
          "(target <= 1.1)")
    print(f"{'p':>2} {'path':>9} {'rank':>4} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} {'total MiB':>10} "
          f"{'/ (total/p)':>12}")
    for (pp, name), per_rank_state in states.items():
        for rank, s in enumerate(per_rank_state):
            print(f"{pp:>2} {name:>9} {rank:>4} {s['parameters'] / 2**20:>11.3f} {s['gradients'] / 2**20:>10.3f} "
                  f"{s['optimizer_state'] / 2**20:>10.3f} {s['total'] / 2**20:>10.3f} {s['total'] / (total / pp):>12.3f}")


if __name__ == "__main__":
    main()
