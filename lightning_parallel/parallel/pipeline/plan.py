"""Where to cut an unchanged model into pipeline stages, decided from its module tree alone.

The plan needs no process group and no real weights (it works on a meta-device model), so
every rank computes the same plan and a dry run can print it before anything is launched.

How the cut points are found, in order of precedence:
1. ``split_points`` from the config: module names, each the first module of a new stage.
2. A Hugging Face model's declared pipeline plan (``config.base_model_pp_plan`` / ``_pp_plan``):
   its ``nn.ModuleList`` entry is the block stack.
3. Otherwise the repeated block stack found by :func:`find_repeated_blocks` (the container
   whose same-class children hold the most parameters: ``blocks``, ``layers``, ``h``, or the
   ``Linear`` layers of an ``nn.Sequential``).
The stack is cut into ``pp_size * virtual_stages`` contiguous runs of blocks that minimise the
largest stage cost. What runs before the stack (embeddings) goes with the first stage and what
runs after it (final norm, head, and the loss) with the last, and their cost counts there.
Cost is the parameter count, or a measured time per block (``block_costs``).

Modules are listed in definition order; a module defined after the stack but executed before
it (a parameter-free rotary embedding, say) is listed on the last stage although the tracer
runs it where it is called. The stages the engine builds are authoritative for ownership.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_parallel.parallel.blocks import find_repeated_blocks
from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.pipeline.schedules import StageStyle, stage_to_rank


@dataclass(frozen=True)
class StagePlan:
    """One stage: the pipeline rank that runs it, its modules and its share of the cost."""

    index: int
    rank: int
    modules: tuple[str, ...]
    num_params: int
    cost: float
    share: float


@dataclass(frozen=True)
class PipelinePlan:
    """Stages in model order; ``split_points[k]`` is the first module of stage ``k + 1``."""

    pp_size: int
    virtual_stages: int
    style: StageStyle
    source: str
    blocks: tuple[str, ...]
    split_points: tuple[str, ...]
    stages: tuple[StagePlan, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stages_for_rank(self, pp_rank: int) -> list[int]:
        """Stage indices that pipeline rank ``pp_rank`` runs (several for virtual stages)."""
        return [s.index for s in self.stages if s.rank == pp_rank]

    def table(self) -> str:
        """The dry-run printout: one row per stage with its rank, cost share and modules."""
        head = (
            f"pipeline plan: {self.num_stages} stages on {self.pp_size} ranks "
            f"({self.virtual_stages} per rank, {self.style} placement), cut by {self.source}"
        )
        rows = [("stage", "rank", "params", "share", "modules")]
        for s in self.stages:
            rows.append((str(s.index), str(s.rank), f"{s.num_params:,}", f"{100 * s.share:.1f}%", _compact(s.modules)))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [head] + ["  ".join(r[i].rjust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
        return "\n".join(lines)


def _compact(names: Sequence[str]) -> str:
    """``blocks.0, blocks.1, blocks.2`` -> ``blocks.0..2`` so a 48-layer row stays readable."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None
    for name in list(names) + [""]:
        match = re.fullmatch(r"(.*)\.(\d+)", name)
        if run and match and match.group(1) == run[0] and int(match.group(2)) == run[2] + 1:
            run = (run[0], run[1], int(match.group(2)))
            continue
        if run:
            out.append(f"{run[0]}.{run[1]}" if run[1] == run[2] else f"{run[0]}.{run[1]}..{run[2]}")
            run = None
        if match:
            run = (match.group(1), int(match.group(2)), int(match.group(2)))
        elif name:
            out.append(name)
    return ", ".join(out)


def _listed(units: Sequence[tuple[str, nn.Module]]) -> tuple[str, ...]:
    """Names worth printing: stateless modules (metrics, dropout) only between stateful ones."""
    stateful = [i for i, (_, m) in enumerate(units) if any(True for _ in m.parameters()) or any(True for _ in m.buffers())]
    if not stateful:
        return ()
    return tuple(name for name, _ in units[stateful[0]:stateful[-1] + 1])


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def declared_block_stack(module: nn.Module) -> list[str] | None:
    """Block names from a Hugging Face pipeline plan (``base_model_pp_plan``), if one is declared.

    HF declares, per base model, ``{"embed_tokens": ..., "layers": ..., "norm": ...}`` in
    execution order; the entry that is an ``nn.ModuleList`` is the block stack. The plan may
    sit on a submodule (a LightningModule holding ``self.model = AutoModelForCausalLM(...)``).
    """
    for prefix, sub in module.named_modules():
        plans: list[tuple[str, Any]] = []
        own = getattr(sub, "_pp_plan", None)
        if isinstance(own, dict):
            plans.append(("", own))
        config_plan = getattr(getattr(sub, "config", None), "base_model_pp_plan", None)
        if isinstance(config_plan, dict):
            base_name = getattr(sub, "base_model_prefix", "")
            base_name = base_name if isinstance(base_name, str) and hasattr(sub, base_name) and base_name else ""
            plans.append((base_name, config_plan))
        for base_name, plan in plans:
            for key in plan:
                rel = f"{base_name}.{key}" if base_name else str(key)
                try:
                    stack = sub.get_submodule(rel)
                except AttributeError:
                    continue
                if isinstance(stack, nn.ModuleList) and len(stack) > 0:
                    full = f"{prefix}.{rel}" if prefix else rel
                    return [f"{full}.{child}" for child, _ in stack.named_children()]
    return None


def _units(module: nn.Module, anchors: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The module tree flattened just enough that every anchor is an entry, in definition order."""
    ancestors = {".".join(a.split(".")[:i]) for a in anchors for i in range(len(a.split(".")))}

    def walk(prefix: str, mod: nn.Module) -> list[tuple[str, nn.Module]]:
        out: list[tuple[str, nn.Module]] = []
        for name, child in mod.named_children():
            full = f"{prefix}.{name}" if prefix else name
            out.extend(walk(full, child) if full in ancestors else [(full, child)])
        return out

    return walk("", module)


def _check_split_points(module: nn.Module, split_points: Any, num_stages: int) -> list[str]:
    if isinstance(split_points, str) or not isinstance(split_points, Sequence) or not all(isinstance(s, str) for s in split_points):
        raise config_error(TypeError, "split_points", split_points, "it is a list of module names", 'pass e.g. split_points=["blocks.4"]')
    names = dict(module.named_modules())
    for point in split_points:
        if point not in names or point == "":
            close = difflib.get_close_matches(point, [n for n in names if n], n=3)
            raise config_error(ValueError, "split_points", list(split_points), f"the model has no module {point!r}", f"use module names such as {close or sorted(names)[1:4]}")
    if len(split_points) != num_stages - 1:
        raise config_error(
            ValueError,
            "split_points",
            list(split_points),
            f"{num_stages} stages (pipeline_parallel_size x virtual_stages) need {num_stages - 1} split points, got {len(split_points)}",
            f"give exactly {num_stages - 1} module names, each the first module of a stage",
        )
    return list(split_points)


def _min_max_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Start indices of ``parts`` contiguous non-empty groups minimising the largest group sum."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-cost of splitting costs[:i] into k groups; cut[k][i]: start of the last.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def plan_pipeline(
    module: nn.Module,
    pp_size: int,
    virtual_stages: int = 1,
    *,
    style: StageStyle = "single",
    split_points: Sequence[str] | None = None,
    block_costs: Sequence[float] | None = None,
) -> PipelinePlan:
    """Plan ``pp_size * virtual_stages`` stages for ``module`` (any device, meta included)."""
    num_stages = pp_size * virtual_stages
    if split_points is not None and block_costs is not None:
        raise config_error(
            ValueError, "block_costs", list(block_costs), "measured costs balance automatic cuts; split_points fix the cuts already", "pass one of split_points and block_costs"
        )
    if split_points is not None:
        points = _check_split_points(module, split_points, num_stages)
        blocks, source = tuple(points), "split_points"
    else:
        declared = declared_block_stack(module)
        blocks_list = declared if declared is not None else [name for name, _ in find_repeated_blocks(module)]
        source = "base_model_pp_plan" if declared is not None else "repeated blocks"
        if not blocks_list:
            # No stack (e.g. the seeds' fc1/fc2/fc3 model): its top-level layers, in definition order.
            blocks_list = [name for name, child in module.named_children() if _num_params(child) > 0]
            blocks_list = blocks_list if len(blocks_list) >= 2 else []
            source = "top-level layers"
        if not blocks_list:
            raise config_error(
                ValueError,
                "module",
                type(module).__name__,
                "no repeated block stack (an nn.ModuleList or nn.Sequential of same-class layers) and fewer than"
                " two top-level layers with parameters to cut into stages",
                'name the first module of each stage with split_points=["...", ...]',
            )
        if len(blocks_list) < num_stages:
            raise config_error(
                ValueError,
                "pipeline_parallel_size * virtual_stages",
                f"{pp_size} * {virtual_stages} = {num_stages}",
                f"more stages than blocks: the model has {len(blocks_list)} blocks ({_compact(blocks_list)})",
                f"use at most {len(blocks_list)} stages in all, or give split_points inside the blocks",
            )
        blocks = tuple(blocks_list)
        points = []
    units = _units(module, blocks)
    order = {name: i for i, (name, _) in enumerate(units)}
    positions = [order[b] for b in blocks]
    if any(b <= a for a, b in zip(positions, positions[1:])):
        field = "split_points" if split_points is not None else "module"
        raise config_error(ValueError, field, list(blocks), "the names must follow the model's definition order, one per stage", "list them from input to output")
    params = [_num_params(m) for _, m in units]
    if split_points is None:
        # Each unit goes to the block at or before it; what precedes the first block joins it.
        owner = [max(0, sum(1 for p in positions if p <= i) - 1) for i in range(len(units))]
        weights = [0.0] * len(blocks)
        for i, n in enumerate(params):
            weights[owner[i]] += n
        if block_costs is not None:
            weights = _measured_weights(blocks, params, positions, owner, block_costs)
        starts = _min_max_partition(weights, num_stages)
        points = [blocks[s] for s in starts[1:]]
    cuts = [order[p] for p in points]
    bounds = [0] + cuts + [len(units)]
    for k in range(num_stages):
        if not _listed(units[bounds[k]:bounds[k + 1]]):
            raise config_error(
                ValueError,
                "split_points",
                list(points),
                f"stage {k} would hold no module with parameters or buffers (it would only pass tensors on)",
                "move the split points so that every stage owns at least one layer",
            )
    ranks = stage_to_rank(num_stages, pp_size, style)
    costs = [float(sum(params[bounds[k]:bounds[k + 1]])) for k in range(num_stages)]
    if block_costs is not None and split_points is None:
        per_unit = _unit_costs(params, owner, weights)
        costs = [float(sum(per_unit[bounds[k]:bounds[k + 1]])) for k in range(num_stages)]
    total = sum(costs) or 1.0
    stages = tuple(
        StagePlan(
            index=k,
            rank=ranks[k],
            modules=_listed(units[bounds[k]:bounds[k + 1]]),
            num_params=sum(params[bounds[k]:bounds[k + 1]]),
            cost=costs[k],
            share=costs[k] / total,
        )
        for k in range(num_stages)
    )
    return PipelinePlan(pp_size, virtual_stages, style, source, blocks, tuple(points), stages)


def _measured_weights(
    blocks: Sequence[str], params: Sequence[int], positions: Sequence[int], owner: Sequence[int], block_costs: Any
) -> list[float]:
    """Block weights from measured times; non-block modules are costed at the blocks' time per parameter."""
    if isinstance(block_costs, str) or not isinstance(block_costs, Sequence) or len(block_costs) != len(blocks):
        raise config_error(ValueError, "block_costs", block_costs, f"one cost per block is needed ({len(blocks)} blocks)", f"pass {len(blocks)} non-negative numbers, one per block in order")
    if any(isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0 for c in block_costs):
        raise config_error(ValueError, "block_costs", list(block_costs), "costs are non-negative numbers", "pass measured times in seconds")
    block_params = sum(params[p] for p in positions) or 1
    per_param = sum(block_costs) / block_params
    weights = [float(c) for c in block_costs]
    for i, n in enumerate(params):
        if i not in positions:
            weights[owner[i]] += n * per_param
    return weights


def _unit_costs(params: Sequence[int], owner: Sequence[int], weights: Sequence[float]) -> list[float]:
    """Spread each block's weight over the units it owns, proportionally to their parameters."""
    owned: dict[int, int] = {}
    for i, n in enumerate(params):
        owned[owner[i]] = owned.get(owner[i], 0) + n
    counts: dict[int, int] = {}
    for o in owner:
        counts[o] = counts.get(o, 0) + 1
    return [
        weights[owner[i]] * (n / owned[owner[i]] if owned[owner[i]] else 1.0 / counts[owner[i]])
        for i, n in enumerate(params)
    ]
