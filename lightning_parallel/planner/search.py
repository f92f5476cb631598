"""The layout planner: enumerate every layout a model allows on a cluster, predict, keep what fits, rank.

A layout is ``dp_replicate x dp_shard x cp x tp x pp (x ep)`` with a ZeRO stage, activation
checkpointing, CPU offload, for pipelines a schedule and a number of microbatches, and for context
parallelism (``cp``) the attention form. For each
the planner asks the same planners the strategy applies (the tensor-parallel plan must split
every planned module, the stage split must find enough blocks, the experts must divide by
``ep``; :mod:`~lightning_parallel.planner.model`), predicts per-rank memory and step
time (:mod:`~lightning_parallel.planner.cost`) with a hardware profile
(:mod:`~lightning_parallel.planner.hardware`), drops what does not fit in device memory and
ranks the rest by predicted step time. Every layout left out carries its reason ("does not fit
by 3.1 GiB", "attention heads=4 ... not divisible by the tensor-parallel size 8").

Pure computation on a (meta-device) model: no process group, no allocation, no collective.
``require_model_parallel`` is what ``strategy="3d"`` asks: among the layouts that fit, only those
with the most model-parallel axes (tensor, pipeline, expert) above 1, fastest first.

Context parallelism is searched when it is needed (``SearchSpace.context_parallel="when_needed"``):
only if no layout without it is left to choose from (at long sequences every rank holding whole
sequences runs out of memory) are layouts with ``cp > 1`` enumerated, with both attention forms. So
the choices at ordinary lengths stay what they were, and at long lengths the cost model, not a
threshold, decides the degree. ``"always"`` enumerates them beside ``cp = 1`` (to compare), an int
``context_parallel_size`` fixes the degree. Degrees are tried in increasing order until two in a row
are predicted slower than the best (``STOP_AFTER``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

from lightning_parallel.parallel.errors import config_error
from lightning_parallel.planner.hardware import GiB, HardwareProfile, get_profile
from lightning_parallel.parallel.pipeline.schedules import check_microbatches, schedule_spec
from lightning_parallel.planner.context_cost import FORMS
from lightning_parallel.planner.cost import Layout, Prediction, Workload, predict
from lightning_parallel.planner.model import ModelFacts, model_facts

LayoutCheck = Callable[[Layout], "str | None"]


@dataclass(frozen=True)
class SearchSpace:
    """What the planner may choose; a fixed value (an int, a one-element tuple) is kept as given."""

    data_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    expert_parallel_size: int | None = None
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    activation_checkpointing: tuple[bool, ...] = (False, True)
    cpu_offload: tuple[bool, ...] = (False, True)
    hybrid_shard: tuple[bool, ...] = (False, True)
    sequence_parallel: tuple[bool, ...] = (False, True)
    schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b", "gpipe")
    virtual_stages: int | tuple[int, ...] = (2, 4)  # stages per rank tried for interleaved schedules
    microbatches: int | Callable[[int, str], int] | None = None  # None: every divisor of the per-rank batch
    # the schedule accepts; a callable maps (pp, schedule) to the count (the strategy's "auto" rule)
    require_model_parallel: bool = False
    # Where a layout without checkpointing does not fit, also try checkpointing only the fewest
    # blocks per pipeline rank that make it fit (Megatron-LM's block recomputation). Off by
    # default: this project's strategy checkpoints every block or none.
    partial_recompute: bool = False
    # Context parallelism: an int fixes the degree; None searches it as ``context_parallel`` says:
    # "when_needed" (only if nothing without it can be chosen: see the module docstring) or "always".
    context_parallel_size: int | None = None
    context_parallel: str = "when_needed"
    context_parallel_attention: tuple[str, ...] = FORMS


@dataclass(frozen=True)
class Rejection:
    """A layout (or a degree, for structural refusals) left out, and why."""

    what: str
    reason: str
    prediction: Prediction | None = None

    def to_dict(self) -> dict[str, object]:
        return {"layout": self.what, "reason": self.reason,
                "predicted_step_time_s": self.prediction.step_time if self.prediction else None,
                "predicted_peak_gib_per_rank": self.prediction.peak_bytes / GiB if self.prediction else None}


@dataclass
class PlanResult:
    """Ranked layouts that fit (fastest first), the rejected ones, and the choice."""

    model: str
    world_size: int
    hardware: HardwareProfile
    device_memory: int
    workload: Workload
    ranked: list[Prediction]
    rejected: list[Rejection]
    require_model_parallel: bool = False
    evaluated: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def candidates(self) -> list[Prediction]:
        """The ranked layouts the choice is made from (only those with the most model axes under ``3d``)."""
        if not self.require_model_parallel or not self.ranked:
            return self.ranked
        most = max(p.layout.model_axes for p in self.ranked)
        return [p for p in self.ranked if p.layout.model_axes == most] if most > 0 else []

    @property
    def chosen(self) -> Prediction:
        pool = self.candidates
        if not pool:
            ordered = [r for r in self.rejected if r.prediction is None] + [r for r in self.rejected if r.prediction is not None]
            reasons = "; ".join(dict.fromkeys(f"{r.what}: {r.reason}" for r in ordered[:16]))
            rule = "no layout with a tensor-, pipeline- or expert-parallel degree above 1 fits" if (
                self.require_model_parallel and self.ranked) else "no layout fits"
            raise config_error(
                ValueError, "tensor_parallel_size / pipeline_parallel_size", f'"auto" on {self.world_size} devices',
                f"{rule} for {self.model} ({self.hardware.name}, {self.device_memory / GiB:.1f} GiB per device); tried: {reasons or 'nothing'}",
                "give the degrees as ints, use more devices or a smaller batch, or a data-parallel strategy ('dp', 'zero3')",
            )
        return pool[0]

    @property
    def runner_up(self) -> Prediction | None:
        pool = self.candidates
        return pool[1] if len(pool) > 1 else None

    def faster_rejected(self, limit: int = 3) -> list[Rejection]:
        """Rejected layouts predicted faster than the choice: what memory or the engine ruled out."""
        best = self.chosen.step_time
        timed = sorted((r for r in self.rejected if r.prediction is not None and r.prediction.step_time < best),
                       key=lambda r: r.prediction.step_time)  # type: ignore[union-attr]
        return timed[:limit]

    def structural(self, limit: int = 6) -> list[Rejection]:
        """Degrees the model or the batch refuses, one per distinct reason."""
        seen: dict[str, Rejection] = {}
        for r in self.rejected:
            if r.prediction is None:
                seen.setdefault(r.reason.split(":")[0], r)
        return list(seen.values())[:limit]

    def explain(self) -> str:
        """The rank-0 log text: choice, runner-up, why faster layouts were rejected."""
        c = self.chosen
        head = (f"planner: {c.layout.describe()} for {self.model} on {self.world_size} x {self.hardware.name} "
                f"({self.device_memory / GiB:.1f} GiB each): predicted {_size(c.peak_bytes)} per rank, "
                f"step {_seconds(c.step_time)} ({c.tokens_per_second_per_device:,.0f} tokens/s per device)")
        lines = [head]
        r = self.runner_up
        if r is not None:
            lines.append(f"  runner-up: {r.layout.describe()}: {_size(r.peak_bytes)}, step {_seconds(r.step_time)}")
        for rej in self.faster_rejected():
            lines.append(f"  faster but rejected: {rej.what} (step {_seconds(rej.prediction.step_time)}): {rej.reason}")  # type: ignore[union-attr]
        for rej in self.structural():
            lines.append(f"  not possible: {rej.what}: {rej.reason}")
        if self.require_model_parallel and self.ranked and self.ranked[0] is not c:
            best = self.ranked[0]
            lines.append(f"  ('3d' keeps the layouts with the most model-parallel axes; fastest of all: "
                         f"{best.layout.describe()}, step {_seconds(best.step_time)})")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def table(self, limit: int = 15) -> str:
        """Ranked layouts, fastest first, with the parts of their predictions."""
        shown = self.ranked[:limit]
        cp = any(p.layout.cp > 1 for p in shown)  # a cp column only where a listed layout splits sequences
        parts = "compute / tp / cp / bubble / dp" if cp else "compute / tp / bubble / dp"
        header = f"{'#':>3}  {'layout':<44} {'GiB/rank':>9} {'step':>10} {'tok/s/dev':>10} {'TFLOP/s':>8}  {parts}"
        rows = [header]
        for i, p in enumerate(shown, 1):
            t = p.time
            mark = "*" if p is self.chosen else " "
            cp_part = f" / {_seconds(t['cp_comm'])}" if cp else ""
            rows.append(
                f"{i:>3}{mark} {p.layout.describe():<44} {p.peak_bytes / GiB:>9.2f} {_seconds(p.step_time):>10} "
                f"{p.tokens_per_second_per_device:>10,.0f} {p.tflops_per_device:>8.1f}  "
                f"{_seconds(t['compute'])} / {_seconds(t['tp_comm'])}{cp_part} / {_seconds(t['pipeline_bubble'])} / {_seconds(t['dp_comm_exposed'])}"
            )
        rows.append(f"{len(self.ranked)} of {self.evaluated} layouts fit; {len(self.rejected)} rejected")
        return "\n".join(rows)

    def to_json(self, limit: int = 20) -> dict[str, object]:
        """Machine-readable form (keys documented in docs/planner.md, "Dry run")."""
        runner = self.runner_up
        return {
            "model": self.model, "world_size": self.world_size, "hardware": self.hardware.name,
            "devices_per_node": self.hardware.devices_per_node, "device_memory_bytes": self.device_memory,
            "global_batch": self.workload.global_batch, "seq_len": self.workload.seq_len, "dtype": self.workload.dtype,
            "require_model_parallel": self.require_model_parallel,
            "chosen": self.chosen.to_dict(), "runner_up": runner.to_dict() if runner else None,
            "ranked": [p.to_dict() for p in self.ranked[:limit]],
            "faster_rejected": [r.to_dict() for r in self.faster_rejected()],
            "rejected": [r.to_dict() for r in self.rejected[:limit]],
            "counts": {"evaluated": self.evaluated, "fit": len(self.ranked), "rejected": len(self.rejected)},
        }

    def dumps(self, limit: int = 20) -> str:
        return json.dumps(self.to_json(limit), indent=2)


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= 0.1 * GiB else f"{nbytes / 2**20:.1f} MiB"


def _seconds(t: float) -> str:
    return f"{t:.2f} s" if t >= 1 else f"{t * 1e3:.1f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} us"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fixed(value: int | None, options: Sequence[int]) -> list[int]:
    return list(options) if value is None else [value]


def plan_layouts(
    model: nn.Module | ModelFacts,
    world_size: int,
    *,
    global_batch: int,
    seq_len: int | None = None,
    hardware: str | HardwareProfile = "cpu",
    devices_per_node: int | None = None,
    device_memory: int | None = None,
    dtype: str = "bf16",
    optimizer: str = "adamw",
    space: SearchSpace = SearchSpace(),
    check: LayoutCheck | None = None,
) -> PlanResult:
    """Enumerate, predict, filter and rank the layouts of ``model`` on ``world_size`` devices.

    ``global_batch`` sequences of ``seq_len`` tokens per optimizer step (``seq_len`` defaults to
    the model's maximum, e.g. ``block_size``); ``check`` adds rules of the engine that runs the
    layout (the strategy passes its option validation) and returns a reason or None.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise config_error(ValueError, "world_size", world_size, "it must be a positive int", "pass e.g. world_size=8")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise config_error(ValueError, "global_batch", global_batch, "it must be a positive int (sequences per step)", "pass e.g. global_batch=64")
    facts = model if isinstance(model, ModelFacts) else model_facts(model)
    hw = get_profile(hardware)
    if devices_per_node is not None:
        hw = hw.with_overrides(devices_per_node=devices_per_node)
    memory = int(device_memory) if device_memory is not None else hw.memory_bytes
    seq = seq_len or facts.max_seq
    if not seq:
        raise config_error(ValueError, "seq_len", seq_len, f"{facts.name} declares no maximum sequence length", "pass seq_len=...")
    work = Workload(global_batch=global_batch, seq_len=seq, dtype=dtype, optimizer=optimizer)
    result = PlanResult(facts.name, world_size, hw, memory, work, [], [], space.require_model_parallel)
    _check_context_space(space)
    if space.context_parallel_size is not None:
        _search(facts, world_size, hw, memory, work, space, check, result, _context_degrees([space.context_parallel_size], seq, result))
    else:
        more = _context_degrees([d for d in _divisors(world_size) if d > 1], seq, result)
        _search(facts, world_size, hw, memory, work, space, check, result, [1])
        needed = not result.candidates
        if more and (needed or space.context_parallel == "always"):
            searched, best = _search_context_degrees(facts, world_size, hw, memory, work, space, check, result, more)
            why = f"no layout without context parallelism fits sequences of {seq:,} tokens: " if needed else ""
            stop = (f"; stopped after cp{' and cp'.join(map(str, searched[-STOP_AFTER:]))} were predicted slower than cp{best}"
                    if len(searched) < len(more) else "")
            result.notes.append(f"{why}searched cp in {searched} (each rank holds 1/cp of every sequence){stop}")
            _drop_repeated(result)
    result.ranked.sort(key=lambda p: (p.step_time, p.peak_bytes))
    result.rejected.sort(key=lambda r: (r.prediction is None, r.prediction.step_time if r.prediction else 0.0))
    return result


def _check_context_space(space: SearchSpace) -> None:
    cp = space.context_parallel_size
    if cp is not None and (isinstance(cp, bool) or not isinstance(cp, int) or cp < 1):
        raise config_error(ValueError, "context_parallel_size", cp, "it must be a positive int, or None to search it",
                           "pass e.g. SearchSpace(context_parallel_size=2)")
    if space.context_parallel not in ("when_needed", "always"):
        raise config_error(ValueError, "context_parallel", space.context_parallel, "it is 'when_needed' or 'always'",
                           "pass context_parallel='always' to rank layouts with and without it together")
    unknown = [f for f in space.context_parallel_attention if f not in FORMS]
    if unknown or not space.context_parallel_attention:
        raise config_error(ValueError, "context_parallel_attention", space.context_parallel_attention,
                           f"the forms are {list(FORMS)}", "pass e.g. context_parallel_attention=('allgather',)")


# Context-parallel degrees are searched in increasing order until this many in a row are predicted slower than
# the best so far: below the best degree memory forces recomputation or smaller pipelines, above it the key/value
# exchange grows and each rank's share of a sequence shrinks, so the fastest time per degree falls, then rises
# (Llama 3 405B at 131,072 tokens on 16,384 H100: 24.0, 15.7, 12.3, 13.1, 14.6, 16.3, ... s for cp 4, 8, 16, 32,
# 64, 128, ...; cp 2 does not fit). Without the stop, degrees up to the world size (8 tokens per rank) cost 3x
# the search time for layouts nobody would run.
STOP_AFTER = 2


def _search_context_degrees(facts: ModelFacts, world: int, hw: HardwareProfile, memory: int, work: Workload,
                            space: SearchSpace, check: LayoutCheck | None, result: PlanResult,
                            degrees: list[int]) -> tuple[list[int], int]:
    """Search ``degrees`` (cp > 1, increasing) one at a time; returns those searched and the fastest one."""
    best, best_cp, slower, searched = math.inf, degrees[0], 0, []
    for cp in degrees:
        before = len(result.ranked)
        _search(facts, world, hw, memory, work, space, check, result, [cp])
        searched.append(cp)
        fastest = min((p.step_time for p in result.ranked[before:]), default=math.inf)
        if fastest < best:
            best, best_cp, slower = fastest, cp, 0
        elif best < math.inf:  # a degree with nothing that fits, after one that fits, counts as slower
            slower += 1
            if slower >= STOP_AFTER:
                break
    return searched, best_cp


def _context_degrees(candidates: list[int], seq: int, result: PlanResult) -> list[int]:
    """The cp degrees that cut ``seq`` into ``2 cp`` equal chunks (head-tail balancing); the rest rejected."""
    out = []
    for cp in candidates:
        if cp > 1 and seq % (2 * cp):
            result.rejected.append(Rejection(f"cp={cp}", f"sequences of {seq} tokens do not split into 2 x cp = {2 * cp} equal chunks"))
        else:
            out.append(cp)
    return out


def _drop_repeated(result: PlanResult) -> None:
    """Structural refusals of tp or pp degrees are found again by the second (cp) pass: keep each once."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for r in result.rejected:
        key = (r.what, r.reason)
        if r.prediction is None and key in seen:
            continue
        seen.add(key)
        kept.append(r)
    result.rejected[:] = kept


def _search(facts: ModelFacts, world: int, hw: HardwareProfile, memory: int, work: Workload, space: SearchSpace,
            check: LayoutCheck | None, result: PlanResult, cps: Sequence[int] = (1,)) -> None:
    usable = memory - hw.reserved_bytes
    for tp in _fixed(space.tensor_parallel_size, _divisors(world)):
        if world % tp:
            result.rejected.append(Rejection(f"tp={tp}", f"it does not divide the world size {world}"))
            continue
        if tp > hw.devices_per_node and space.tensor_parallel_size is None:
            if tp <= 64:
                result.rejected.append(Rejection(f"tp={tp}", f"tensor parallelism stays inside a node ({hw.devices_per_node} devices per node)"))
            continue
        reason = facts.tp_reason(tp)
        if reason:
            result.rejected.append(Rejection(f"tp={tp}", reason))
            continue
        for pp in _fixed(space.pipeline_parallel_size, _divisors(world // tp)):
            if (world // tp) % pp:
                result.rejected.append(Rejection(f"tp={tp} x pp={pp}", f"it does not divide the world size {world}"))
                continue
            for cp in cps:
                if (world // (tp * pp)) % cp:
                    if len(cps) == 1 and cp > 1:
                        result.rejected.append(Rejection(f"cp={cp} (tp={tp} x pp={pp})", f"it does not divide the world size {world}"))
                    continue
                dp = world // (tp * pp * cp)
                if space.data_parallel_size is not None and dp != space.data_parallel_size:
                    continue
                if work.global_batch % dp:
                    degrees = f"cp={cp} x tp={tp} x pp={pp}" if cp > 1 else f"tp={tp} x pp={pp}"
                    result.rejected.append(Rejection(f"dp={dp} ({degrees})", f"global batch {work.global_batch} is not divisible by dp {dp}"))
                    continue
                _pipeline_options(facts, tp, pp, dp, hw, usable, work, space, check, result, cp)


def _pipeline_options(facts: ModelFacts, tp: int, pp: int, dp: int, hw: HardwareProfile, usable: int, work: Workload,
                      space: SearchSpace, check: LayoutCheck | None, result: PlanResult, cp: int = 1) -> None:
    per_dp = work.global_batch // dp
    schedules = ["none"] if pp == 1 else list(space.schedules)
    options = space.virtual_stages if isinstance(space.virtual_stages, tuple) else (space.virtual_stages,)
    combos = [(n, 1 if n == "none" or schedule_spec(n).style == "single" else (2 if schedule_spec(n).style == "v" else v))
              for n in schedules for v in options]
    for name, virtual in dict.fromkeys(combos):
        spec = schedule_spec(name) if pp > 1 else None
        shares = facts.shares(tp, pp, virtual, spec.style if spec else "single")
        if isinstance(shares, str):
            result.rejected.append(Rejection(f"tp={tp} x pp={pp}" + (f" {name} v{virtual}" if virtual > 1 else ""), shares))
            continue
        if pp == 1:
            counts = [1]
        else:
            fixed = space.microbatches(pp, name) if callable(space.microbatches) else space.microbatches
            counts = [fixed] if fixed is not None else _divisors(per_dp)
        for m in counts:
            if pp > 1:
                if per_dp % m:
                    result.rejected.append(Rejection(f"pp={pp} m{m}", f"the per-rank batch {per_dp} does not split into {m} microbatches"))
                    continue
                try:
                    check_microbatches(spec, pp, virtual, m)  # type: ignore[arg-type]
                except (ValueError, TypeError):
                    continue
            for ep in _expert_degrees(facts, dp, space, result, cp):
                for form in space.context_parallel_attention if cp > 1 else FORMS[:1]:
                    base = Layout(1, dp, tp, pp, ep, 0, False, m, name, virtual, cp=cp, cp_attention=form)
                    _options(facts, base, shares, hw, usable, work, space, check, result)


def _expert_degrees(facts: ModelFacts, dp: int, space: SearchSpace, result: PlanResult, cp: int = 1) -> list[int]:
    if not facts.is_moe:
        if space.expert_parallel_size not in (None, 1):
            result.rejected.append(Rejection(f"ep={space.expert_parallel_size}", f"{facts.name} has no MoE layers"))
            return []
        return [1]
    if cp > 1:  # experts come from the data-parallel ranks; under cp the strategy keeps them whole, and so does the model
        if space.expert_parallel_size not in (None, 1):
            result.rejected.append(Rejection(f"ep={space.expert_parallel_size} x cp={cp}",
                                             "expert parallelism with context parallelism is not modelled (the strategy refuses it)"))
            return []
        return [1]
    out = []
    for e in _fixed(space.expert_parallel_size, _divisors(dp)):
        if dp % e:
            result.rejected.append(Rejection(f"ep={e}", f"expert-parallel ranks come from the data-parallel ones; {e} does not divide dp {dp}"))
        elif any(c % e for c in facts.expert_counts):
            result.rejected.append(Rejection(f"ep={e}", f"expert counts {sorted(set(facts.expert_counts))} are not divisible by {e}"))
        else:
            out.append(e)
    return out


def _options(facts: ModelFacts, base: Layout, shares: list, hw: HardwareProfile, usable: int, work: Workload,  # type: ignore[type-arg]
             space: SearchSpace, check: LayoutCheck | None, result: PlanResult) -> None:
    import dataclasses

    dp, dpn = base.dp, hw.devices_per_node
    for zero in space.zero_stages:
        if zero > 0 and base.grad_ranks == 1 and len(space.zero_stages) > 1:
            continue  # nothing to shard over (ZeRO shards over dp x cp): the same layout as zero 0
        replicates = [1]
        if zero >= 2 and True in space.hybrid_shard and dp > 1:
            in_node = max(1, dpn // (base.tp * base.cp))  # data-parallel ranks inside a node
            if base.tp * base.cp * dp > dpn and dp % in_node == 0 and in_node > 1:
                replicates.append(dp // in_node)
        if False not in space.hybrid_shard:
            replicates = [r for r in replicates if r > 1] or replicates
        for replicate in replicates:
            shard = dp // replicate if zero >= 2 else 1
            for offload in space.cpu_offload if zero >= 2 else (False,):
                for ac, sp in [(a, q) for a in space.activation_checkpointing for q in (space.sequence_parallel if base.tp > 1 else (False,))]:
                    layout = dataclasses.replace(base, dp_replicate=dp // shard, dp_shard=shard, zero_stage=zero,
                                                 activation_checkpointing=ac, cpu_offload=offload, sequence_parallel=sp)
                    result.evaluated += 1
                    pred = predict(facts, layout, shares, work, hw)
                    if not ac and space.partial_recompute and pred.peak_bytes > usable + hw.reserved_bytes:
                        partial = _fewest_recomputed(facts, layout, shares, hw, work, usable + hw.reserved_bytes)
                        if partial is not None:
                            result.evaluated += 1
                            _keep(partial, check, usable, hw, result)
                    _keep(pred, check, usable, hw, result)


def _keep(pred: Prediction, check: LayoutCheck | None, usable: int, hw: HardwareProfile, result: PlanResult) -> None:
    """Rank ``pred`` or reject it (the engine refuses it, or it does not fit)."""
    layout = pred.layout
    reason = check(layout) if check is not None else None
    if reason:
        result.rejected.append(Rejection(layout.describe(), reason, pred))
    elif pred.peak_bytes > usable + hw.reserved_bytes:
        over = (pred.peak_bytes - usable - hw.reserved_bytes) / GiB
        pred.fits, pred.reason = False, f"does not fit by {over:.2f} GiB"
        result.rejected.append(Rejection(layout.describe(), pred.reason, pred))
    else:
        result.ranked.append(pred)


def _fewest_recomputed(facts: ModelFacts, layout: Layout, shares: list, hw: HardwareProfile, work: Workload,  # type: ignore[type-arg]
                       limit: float) -> Prediction | None:
    """``layout`` with the fewest recomputed blocks per rank that fit in ``limit`` bytes (bisection:
    memory falls as k grows), or None when even all but one do not fit (full checkpointing is its own option)."""
    import dataclasses

    most = max(s.layers for s in shares)
    lo, hi, best = 1, most - 1, None
    while lo <= hi:
        k = (lo + hi) // 2
        pred = predict(facts, dataclasses.replace(layout, recompute_layers=k), shares, work, hw)
        if pred.peak_bytes <= limit:
            best, hi = pred, k - 1
        else:
            lo = k + 1
    return best


__all__ = ["Layout", "PlanResult", "Prediction", "Rejection", "SearchSpace", "Workload", "plan_layouts"]
