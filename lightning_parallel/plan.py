"""``python -m lightning_parallel.plan``: print the parallel layout of a config without running it.

Same overrides as ``python -m lightning_parallel.train`` (the project's ``conf/``), e.g.::

    python -m lightning_parallel.plan model=gpt strategy=tp strategy.tensor_parallel_size=4
    python -m lightning_parallel.plan model=gpt strategy=tp strategy.tensor_parallel_size=2 \\
        strategy.pipeline_parallel_size=2 +world_size=4

Why a dry run: a layout is decided from the module tree alone (tensor-parallel plan, pipeline
cut points), so what a job would shard, what stays replicated and how many bytes each rank
holds can be read before asking for machines. The model is built on the meta device (no
weights, no memory, no process group), with the same planners the strategy calls in
``setup_environment()``, so the printout is what the job will do and a config the job would
refuse (e.g. ``strict_plan=true`` with a size that does not divide the heads) fails here with
the same message and a non-zero exit status.

Degrees: the strategy's own. The dry run builds the strategy from the config, hands it what the
Trainer would (processes per node, device type, precision plugin) and the meta-device model, and
runs the part of its ``setup_environment()`` before the process group (:func:`resolve_for`), so
"auto" degrees (``3d``'s planner choice included) are what the job chooses on that world size, and
a world with no layout is the strategy's error, led by the world size.

World size: ``+world_size=N`` if given; else the trainer's processes when they hold the layout;
else the product of the explicit degrees (a dry run may plan for more devices than this
machine has).

Search mode (``--search``): rank every layout of the model with the layout planner
(:mod:`lightning_parallel.planner.search`) for a cluster given by flags, without starting
any process, e.g.::

    python -m lightning_parallel.plan --search --world-size 64 --devices-per-node 8 \
        --hardware h100-80gb --device-memory-gib 80 --global-batch 512 --seq-len 2048 model=gpt
    python -m lightning_parallel.plan --search --nodes 2 --json model=moe_gpt   # machine-readable

Flags: ``--world-size N`` (else ``--nodes x --devices-per-node``, else as above),
``--nodes``, ``--devices-per-node``, ``--hardware`` (``a100-80gb``, ``h100-80gb``, ``h200``,
``cpu``, ``calibrate``: measure this machine), ``--device-memory-gib``, ``--global-batch``
(sequences per step; default ``data.batch_size x world size``), ``--seq-len`` (default the
data's or model's ``block_size``), ``--dtype`` (``bf16``, ``fp16``, ``fp32``), ``--optimizer``
(``adamw``, ``sgd``, ``sgd_momentum``), ``--3d`` (only the layouts ``strategy="3d"`` would choose
from), ``--partial-recompute`` (also search Megatron-style block recomputation, which this project's
strategy does not run: for comparing with engines that do), ``--context-parallel N`` (fix the
context-parallel degree; 1: none), ``--context-parallel-always`` (rank layouts with ``cp > 1`` beside
those without; by default they are searched only when nothing without context parallelism fits, as at
long sequences), ``--top K`` rows, ``--json`` (the keys are listed in docs/planner.md, "The planner").
Layouts that split sequences show ``cpN`` and their attention form (``allgather``/``ring``), and the
table adds their key/value exchange time.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_parallel.parallel.dims import ParallelDims
from lightning_parallel.errors import config_error

if TYPE_CHECKING:
    from lightning_parallel.strategies.preflight import Preflight

_DEGREES = ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size")


def compose_config(overrides: Sequence[str]) -> DictConfig:
    """The job's config as ``lightning_parallel.train`` would see it (Hydra compose, no run dir)."""
    from hydra import compose, initialize_config_dir

    from lightning_parallel.train import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _trainer_processes(cfg: DictConfig) -> int | None:
    devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
    return int(devices) * int(nodes) if isinstance(devices, int) and isinstance(nodes, int) else None


def world_size_for(cfg: DictConfig) -> tuple[int, str]:
    """The world size to plan for, and where it came from (printed, so the user can check it)."""
    requested = cfg.get("world_size")
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise config_error(ValueError, "world_size", requested, "must be a positive int", "pass e.g. +world_size=8")
        return requested, "+world_size"
    strategy = cfg.get("strategy") or {}
    explicit = math.prod(int(strategy.get(k, 1)) for k in _DEGREES[:3] if isinstance(strategy.get(k, 1), int))
    procs = _trainer_processes(cfg)
    if procs is not None and procs % explicit == 0:
        return procs, "trainer.devices x trainer.num_nodes"
    return explicit, "product of the explicit degrees (set +world_size=N to plan for another)"


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:,.0f} {unit}" if unit == "B" else f"{nbytes:,.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _folded(reasons: dict[str, str]) -> list[str]:
    """``module: reason`` lines, repeated layers folded as in the plan table (``blocks.*.ln_1 x4``)."""
    from lightning_parallel.parallel.tensor.plan import fold_layer_index

    counts: dict[tuple[str, str], int] = {}
    for name, reason in reasons.items():
        key = (fold_layer_index(name), reason)
        counts[key] = counts.get(key, 0) + 1
    return [f"  {name}: {reason}" + (f"  x{n}" if n > 1 else "") for (name, reason), n in counts.items()]


def _module_bytes(per_module: dict[str, int], modules: Sequence[str]) -> int:
    """Bytes of the parameter-owning modules at or below any of ``modules``."""
    return sum(b for name, b in per_module.items() if any(name == m or name.startswith(f"{m}.") for m in modules))


def resolve_for(cfg: DictConfig, model: nn.Module, world: int, origin: str = "+world_size") -> Preflight:
    """The degrees the job's strategy resolves on ``world`` processes, asked of the strategy itself.

    Why not ``ParallelDims.resolve`` on the preset's values: automatic degrees are the strategy's
    decision (``3d`` asks the layout planner with the model, the processes per node, the device
    type and the Trainer's precision), so the dry run builds the strategy from the config, gives
    it what the Trainer would, and runs the steps of its ``setup_environment()`` that come before
    the process group (:func:`~lightning_parallel.strategies.preflight.preflight`). An error names
    the world size and where it came from, then the strategy's own rule and fix.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from lightning_parallel.strategies.hybrid import HybridParallelStrategy
    from lightning_parallel.strategies.preflight import Preflight, preflight

    trainer = cfg.get("trainer") or {}
    nodes = trainer.get("num_nodes", 1) or 1
    try:
        strategy = instantiate(cfg.strategy)  # the option checks of __init__, as the job runs them
        if not isinstance(strategy, HybridParallelStrategy):  # Lightning's ddp / single: every rank a replica
            dims = ParallelDims.resolve(world, num_nodes=int(nodes))
            return Preflight(dims=dims, choice=None, tp_plan=None, processes_per_node=max(1, world // int(nodes)), device_type="cpu")
        return preflight(
            strategy, model, world, num_nodes=nodes, accelerator=trainer.get("accelerator"),
            precision=trainer.get("precision"), sync_batchnorm=bool(trainer.get("sync_batchnorm", False)),
        )
    except InstantiationException as err:
        cause = err.__cause__
        if not isinstance(cause, (ValueError, TypeError)):
            raise
        raise type(cause)(str(cause)) from err  # the constructor's own message, without Hydra's wrapper
    except (ValueError, TypeError) as err:
        raise _naming_world(err, world, origin) from err


def _naming_world(err: ValueError | TypeError, world: int, origin: str) -> Exception:
    """``err`` (same type) led by the world size it was planned for: an automatic degree's value comes from it."""
    return (ValueError if isinstance(err, ValueError) else TypeError)(f"world size {world} (from {origin}): {err}")


def describe(cfg: DictConfig) -> str:
    """The whole printout for a composed config: degrees, TP plan and bytes, pipeline plan."""
    from hydra.utils import instantiate

    from lightning_parallel.parallel.pipeline.plan import plan_pipeline
    from lightning_parallel.parallel.pipeline.schedules import resolve_virtual_stages, schedule_spec
    from lightning_parallel.parallel.tensor.plan import fold_layer_index, resolve_tp_plan
    from lightning_parallel.parallel.tensor.shards import tp_param_bytes
    from lightning_parallel.parallel.tensor.split_share import DEFAULT_MIN_SPLIT, check_split_share
    from lightning_parallel.strategies.auto_layout import planning_view

    strategy: dict[str, Any] = OmegaConf.to_container(cfg.strategy, resolve=True)  # type: ignore[assignment]
    world, origin = world_size_for(cfg)
    zero_stage = int(strategy.get("zero_stage", 0) or 0)
    with torch.device("meta"):
        model: nn.Module = instantiate(cfg.model)
    resolved = resolve_for(cfg, model, world, origin)
    dims = resolved.dims
    model = planning_view(model)  # layers built in configure_model(): planned on a meta-device twin, as the strategy does
    total = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    lines = [
        f"{type(model).__name__}: {total:,} parameter bytes ({_human(total)}); world size {world} from {origin}: {dims.describe()}, "
        f"zero_stage={zero_stage}"
    ]
    if resolved.choice is not None:  # "auto" degrees: the planner's choice, as the strategy logs it on rank 0
        lines += ["", resolved.choice.explain()]
        if resolved.device_type == "cuda" and not torch.cuda.is_available():
            lines.append("  (no GPU visible here: chosen with the nominal cpu profile; on the job's GPUs the choice may differ)")
    per_module: dict[str, int] | None = None
    if dims.tp > 1:
        plan = resolved.tp_plan  # planned and checked by the strategy's own _resolve_plans()
        if plan is None:  # layers built in configure_model(): the strategy plans them in setup(), on every rank
            plan = resolve_tp_plan(
                model, dims.tp, user_plan=strategy.get("tp_plan") or None, strict=bool(strategy.get("strict_plan", False)),
                split_experts=dims.ep == 1,
            )
            # The strategy's refusal of a plan that splits too little, here too (before any process starts).
            check_split_share(model, plan, float(strategy.get("tensor_parallel_min_split", DEFAULT_MIN_SPLIT)), dims.ep)
        sizes = tp_param_bytes(model, plan)
        per_module = sizes["per_module_bytes_per_rank"]  # type: ignore[assignment]
        sharded, replicated = sizes["sharded_bytes_per_rank"], sizes["replicated_bytes_per_rank"]
        lines += [
            "",
            plan.table(),
            f"parameter bytes per tensor-parallel rank: {sizes['total_bytes_per_rank']:,} ({_human(sizes['total_bytes_per_rank'])})"  # type: ignore[arg-type]
            f" = sharded {sharded:,} ({_human(sharded)}, 1/{dims.tp} of each split tensor)"  # type: ignore[arg-type]
            f" + replicated {replicated:,} ({_human(replicated)}); unsharded model {total:,}",  # type: ignore[arg-type]
            "replicated on every tensor-parallel rank:",
        ]
        lines += _folded(plan.replicated) or ["  (nothing)"]
        if strategy.get("sequence_parallel"):
            norms = ", ".join(dict.fromkeys(fold_layer_index(n) for n in plan.norms))
            lines.append(f"sequence_parallel: norms {norms} run on a sequence slice (weights replicated)")
    if dims.pp > 1:
        spec = schedule_spec(strategy.get("pipeline_schedule") or "1f1b")
        virtual = resolve_virtual_stages(spec, strategy.get("virtual_stages") or "auto")
        try:  # the strategy cuts the stages in setup(): the same planner, the same refusal
            pplan = plan_pipeline(model, dims.pp, virtual, style=spec.style, split_points=strategy.get("split_points"))
        except (ValueError, TypeError) as err:
            raise _naming_world(err, world, origin) from err
        lines += ["", f"schedule {spec.name}: " + pplan.table()]
        if per_module is None:
            per_module = {}
            for name, mod in model.named_modules():
                own = sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
                if own:
                    per_module[name] = own
        for rank in range(dims.pp):
            modules = [m for s in pplan.stages if s.rank == rank for m in s.modules]
            nbytes = _module_bytes(per_module, modules)
            lines.append(f"pipeline rank {rank}: {nbytes:,} parameter bytes per rank ({_human(nbytes)})" + (
                " with its tensor-parallel split" if dims.tp > 1 else ""))
    if dims.tp == 1 and dims.pp == 1:
        lines.append("tensor_parallel_size and pipeline_parallel_size are 1: every rank holds whole layers (nothing to plan)")
    if zero_stage == 3 and dims.dp_shard > 1:
        lines.append(f"zero_stage=3 further shards these parameter bytes over dp_shard={dims.dp_shard} ranks")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plan for the overrides in ``argv``; exit status 2 on a config the job would refuse."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        if "--search" in args:
            flags, overrides = _split_flags(args)
            print(search(compose_config(overrides), flags))
            return 0
        print(describe(compose_config(args)))
    except (ValueError, TypeError, HydraException, OmegaConfBaseException) as err:
        print(f"lightning_parallel.plan: error: {err}", file=sys.stderr)
        return 2
    return 0


_FLAGS = {
    "--world-size": int, "--nodes": int, "--devices-per-node": int, "--hardware": str, "--device-memory-gib": float,
    "--global-batch": int, "--seq-len": int, "--dtype": str, "--optimizer": str, "--top": int, "--context-parallel": int,
}
_SWITCHES = ("--search", "--json", "--3d", "--partial-recompute", "--context-parallel-always")


def _split_flags(args: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """``--flag value`` pairs and switches for the search; everything else is a Hydra override."""
    flags: dict[str, Any] = {}
    overrides: list[str] = []
    items = list(args)
    while items:
        arg = items.pop(0)
        name, _, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name in _SWITCHES:
            flags[name] = True
        elif name in _FLAGS:
            raw = inline or (items.pop(0) if items else "")
            try:
                flags[name] = _FLAGS[name](raw)
            except ValueError:
                raise config_error(ValueError, name, raw, f"it must be a {_FLAGS[name].__name__}", f"pass e.g. {name} 8") from None
        elif arg.startswith("--"):
            raise config_error(ValueError, "flag", arg, f"unknown; search flags are {sorted(_FLAGS) + list(_SWITCHES)}", "see --help")
        else:
            overrides.append(arg)
    return flags, overrides


def search(cfg: DictConfig, flags: dict[str, Any]) -> str:
    """The ranked layout table (or its JSON) for the composed model on the cluster the flags describe."""
    import json

    from hydra.utils import instantiate

    from lightning_parallel.planner.hardware import GiB, get_profile
    from lightning_parallel.planner.search import SearchSpace, plan_layouts

    profile = get_profile(flags.get("--hardware", "cpu"))
    per_node = flags.get("--devices-per-node")
    nodes = flags.get("--nodes")
    if "--world-size" in flags:
        world = flags["--world-size"]
    elif nodes is not None:
        world = nodes * (per_node or profile.devices_per_node)
    else:
        world = world_size_for(cfg)[0]
    if per_node is None and nodes is not None:
        per_node = max(1, world // nodes)
    with torch.device("meta"):
        model: nn.Module = instantiate(cfg.model)
    data = cfg.get("data") or {}
    seq = flags.get("--seq-len") or data.get("block_size") or cfg.model.get("block_size")
    batch = flags.get("--global-batch") or int(data.get("batch_size", 1)) * world
    memory = flags.get("--device-memory-gib")
    result = plan_layouts(
        model, world, global_batch=batch, seq_len=int(seq) if seq else None, hardware=profile, devices_per_node=per_node,
        device_memory=int(memory * GiB) if memory else None, dtype=flags.get("--dtype", "bf16"),
        optimizer=flags.get("--optimizer", "adamw"),
        space=SearchSpace(require_model_parallel=bool(flags.get("--3d")), partial_recompute=bool(flags.get("--partial-recompute")),
                          context_parallel_size=flags.get("--context-parallel"),
                          context_parallel="always" if flags.get("--context-parallel-always") else "when_needed"),
    )
    top = flags.get("--top", 15)
    if flags.get("--json"):
        return json.dumps(result.to_json(top), indent=2)
    return result.explain() + "\n\n" + result.table(top)


if __name__ == "__main__":
    sys.exit(main())
