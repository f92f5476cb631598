"""Choose tensor-, pipeline- and expert-parallel degrees for ``strategy="3d"`` from the world size and the model.

The rule, in the order Megatron-LM's and torchtitan's guides give it: data parallelism scales
best and talks least per byte of model, so the model-parallel axes get the *smallest* degree
greater than one that the model allows, and data parallelism takes every remaining process.

* tensor parallel first (it splits every layer, so it is the axis that relieves per-layer
  memory; it talks most, so it must stay inside a node): the smallest divisor ``t > 1`` of the
  processes per node (and of the world size) for which the model's tensor-parallel plan splits
  every planned module evenly (heads, k/v heads, hidden size, vocabulary), i.e. the plan
  resolves with ``strict_plan=True``;
* then pipeline parallel: the smallest divisor ``p > 1`` of ``world / t`` with at least ``p``
  blocks to cut into stages;
* data parallel: ``world / (t * p)``.

A model with MoE layers (4D): the pipeline degree comes first, then the smallest tensor-parallel
degree that still leaves at least two data-parallel ranks, and the experts are split over the
largest divisor of the data-parallel degree that divides every layer's expert count (``ep``;
1 for a dense model). Why this order: the experts hold most of an MoE model's parameters and
expert parallelism splits them at the cost of one all-to-all per layer, while tensor
parallelism leaves MoE layers whole (inside pipeline stages they run replicated over the
tensor-parallel ranks, :mod:`~lightning_parallel.parallel.pipeline_moe`). 4 processes: pp2 x
dp2 with ep2; 8: pp2 x tp2 x dp2 with ep2.

"3D" asks for the model-parallel axes: each gets a degree above one where the model and the
world size allow it. When only one of them can (two processes; heads that no degree divides;
MoE layers), the other stays 1 and the log line says why.
A model that allows neither a tensor- nor a pipeline-parallel degree above one is an error
listing every degree tried and why it failed, not a silent fallback to plain data parallelism.
Pure inspection of shapes and module structure: no process group, no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.expert_parallel import find_expert_modules
from lightning_parallel.parallel.pipeline_plan import plan_pipeline
from lightning_parallel.parallel.tp_plan import resolve_tp_plan


@dataclass(frozen=True)
class DegreeChoice:
    """The chosen degrees and, per degree tried, why it was taken or rejected (for the log line)."""

    dp: int
    tp: int
    pp: int
    tried: tuple[str, ...]
    ep: int = 1

    def explain(self) -> str:
        return f"3d degrees: dp={self.dp} x tp={self.tp} x pp={self.pp} (ep={self.ep}); " + "; ".join(self.tried)


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def _first_line(error: Exception) -> str:
    """The rule a nested config error states, without its field prefix and HINT."""
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    line = line.split(" is invalid: ", 1)[-1].split(". HINT:", 1)[0]
    return line[:200]


def _tp_fits(module: nn.Module, tp: int, user_plan: dict[str, str] | None) -> str | None:
    """None when every planned module splits evenly over ``tp`` ranks, else the reason it does not."""
    try:
        plan = resolve_tp_plan(module, tp, user_plan=user_plan, strict=True)
    except (ValueError, TypeError) as error:
        return _first_line(error)
    if plan.sharded_params == 0:
        return "the plan shards no parameter"
    return None


def _pp_fits(module: nn.Module, pp: int, virtual_stages: int, split_points: list[str] | None) -> str | None:
    try:
        plan_pipeline(module, pp, virtual_stages, style="single" if virtual_stages == 1 else "loop", split_points=split_points)
    except (ValueError, TypeError) as error:
        return _first_line(error)
    return None


def choose_3d_degrees(
    module: nn.Module,
    world_size: int,
    *,
    processes_per_node: int,
    data_parallel_size: int | str = "auto",
    tp_plan: dict[str, str] | None = None,
    virtual_stages: int = 1,
    split_points: list[str] | None = None,
) -> DegreeChoice:
    """Tensor, pipeline and expert degrees for ``module`` on ``world_size`` processes (see the module docstring).

    ``data_parallel_size``: an int fixes it (the model-parallel axes share ``world / dp``).
    """
    if not any(True for _ in module.parameters()):
        raise config_error(
            ValueError, "tensor_parallel_size / pipeline_parallel_size", '"auto"',
            "choosing 3D degrees reads the model's layers, and this model has none yet (built in configure_model?)",
            "give tensor_parallel_size and pipeline_parallel_size as ints",
        )
    if data_parallel_size != "auto":
        if not isinstance(data_parallel_size, int) or world_size % data_parallel_size:
            raise config_error(
                ValueError, "data_parallel_size", data_parallel_size, f"it must divide the world size {world_size}",
                'choose a divisor of the number of processes, or "auto"',
            )
    model_ranks = world_size // data_parallel_size if isinstance(data_parallel_size, int) else world_size
    experts = find_expert_modules(module)
    tried: list[str] = []
    failures: list[str] = []
    if experts:
        # 4D: pipeline first, then a tensor-parallel degree only where it leaves at least two
        # data-parallel ranks over which to split the experts.
        pp = _choose_pp(module, model_ranks, virtual_stages, split_points, tried, failures)
        keep = 2 if pp > 1 and data_parallel_size == "auto" else 1
        tp = _choose_tp(module, model_ranks // pp, processes_per_node, tp_plan, tried, failures, keep_data_ranks=keep)
    else:
        tp = _choose_tp(module, model_ranks, processes_per_node, tp_plan, tried, failures)
        pp = _choose_pp(module, model_ranks // tp, virtual_stages, split_points, tried, failures)
    if tp == 1 and pp == 1:
        raise config_error(
            ValueError, "tensor_parallel_size / pipeline_parallel_size", f'"auto" on {world_size} processes',
            f"strategy '3d' needs a tensor- or pipeline-parallel degree above 1 that {type(module).__name__} allows; tried: "
            + "; ".join(failures or ["no degree above 1 divides the processes"]),
            "give the degrees as ints, use more processes, or a data-parallel strategy ('dp', 'zero3')",
        )
    for axis, degree in (("tp", tp), ("pp", pp)):
        if degree == 1 and not any(t.startswith(f"{axis}=1") for t in tried):
            tried.append(f"{axis}=1: no degree above 1 fits the model in the processes left")
    dp = world_size // (tp * pp)
    ep = _choose_ep(module, experts, dp, tried)
    return DegreeChoice(dp=dp, tp=tp, pp=pp, ep=ep, tried=tuple(tried + [f"rejected: {f}" for f in failures]))


def _choose_tp(
    module: nn.Module, ranks: int, per_node: int, tp_plan: dict[str, str] | None, tried: list[str], failures: list[str],
    keep_data_ranks: int = 1,
) -> int:
    """The smallest tensor-parallel degree above 1 that fits a node and splits every planned module
    (and leaves ``keep_data_ranks`` of the ``ranks`` to data parallelism)."""
    for t in _divisors(ranks):
        if ranks // t < keep_data_ranks:
            failures.append(f"tp={t}: it would leave {ranks // t} data-parallel rank(s), and the experts need {keep_data_ranks} to be split")
            continue
        if per_node % t:
            failures.append(f"tp={t}: more than (or not a divisor of) the {per_node} processes per node")
            continue
        reason = _tp_fits(module, t, tp_plan)
        if reason is None:
            tried.append(f"tp={t}: every planned module splits evenly")
            return t
        failures.append(f"tp={t}: {reason}")
    return 1


def _choose_pp(module: nn.Module, ranks: int, virtual_stages: int, split_points: list[str] | None, tried: list[str], failures: list[str]) -> int:
    """The smallest pipeline degree above 1 with enough blocks for its stages."""
    for p in _divisors(ranks):
        reason = _pp_fits(module, p, virtual_stages, split_points)
        if reason is None:
            tried.append(f"pp={p}: enough blocks for {p * virtual_stages} stages")
            return p
        failures.append(f"pp={p}: {reason}")
    return 1


def _choose_ep(module: nn.Module, experts: dict[str, nn.Module], dp: int, tried: list[str]) -> int:
    """The largest divisor of ``dp`` that divides every experts module's expert count (1 without MoE)."""
    if not experts:
        return 1
    counts = [next(sub.parameters(recurse=False)).shape[0] for sub in experts.values()]
    ep = max(e for e in range(1, dp + 1) if dp % e == 0 and all(c % e == 0 for c in counts))
    tried.append(f"ep={ep}: the largest divisor of dp={dp} that divides every layer's expert count ({sorted(set(counts))})")
    return ep


__all__ = ["DegreeChoice", "choose_3d_degrees"]
