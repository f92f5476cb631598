"""Trace an unchanged module into a ``Pipe`` cut at the plan's split points, and fix up its stages.

The model's own ``forward`` is traced by ``torch.distributed.pipelining``'s tracer frontend
(``torch.export`` + ``pipe_split`` markers), so no model code changes and parameter names stay
the original ones. ``torch.export`` hands the stages copies of tied tensors, so every stage tensor
is re-pointed at the original object by its FQN, and blocks the model (or the strategy's
``activation_checkpointing``) checkpoints get their recomputation back on the traced copies.
Errors about the model are raised here, identically on every rank, before any process communicates.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import fx, nn
from torch.distributed.pipelining import Pipe, pipe_split, pipeline

from lightning_parallel.compat import run_generated_code, tree_leaves
from lightning_parallel.parallel.blocks import find_repeated_blocks
from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.pipeline.eval_reuse import replace_stage_module, share_equal_stages
from lightning_parallel.parallel.pipeline.foreign import ForeignTrace, OtherRanksStage, foreign_blocks, foreign_calls, restore_forwards
from lightning_parallel.parallel.pipeline.fork_trace import run_in_child
from lightning_parallel.parallel.pipeline.moe import hold_unit_tensors, opaque_forwards, register_handles
from lightning_parallel.parallel.pipeline.plan import PipelinePlan, _compact
from lightning_parallel.parallel.pipeline.route_inputs import Routing, cut_source, routed
from lightning_parallel.parallel.pipeline.schedules import batch_size_of, microbatch_example


@contextmanager
def _split_markers(module: nn.Module, names: Sequence[str], foreign: ForeignTrace | None = None) -> Iterator[None]:
    """Make each named submodule call ``pipe_split()`` first (and tell ``foreign`` that the next
    stage begins); restore its ``forward`` on exit."""
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for name in names:
            sub = module.get_submodule(name)
            previous = sub.__dict__.get("forward")
            inner = sub.forward

            def forward(*args: Any, __inner: Any = inner, **kwargs: Any) -> Any:
                pipe_split()
                if foreign is not None:
                    foreign.split()
                return __inner(*args, **kwargs)

            sub.forward = forward  # type: ignore[method-assign]
            patched.append((sub, previous))
        yield
    finally:
        restore_forwards(patched)


def _root_cause(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def trace_pipe(
    module: nn.Module, mb_args: tuple[Any, ...], mb_kwargs: dict[str, Any], plan: PipelinePlan, training: bool,
    local_stages: Sequence[int] | None = None,
) -> tuple[Pipe, dict[int, str]]:
    """Trace ``module.forward`` on one microbatch in train or eval mode and cut it by ``plan``.

    ``local_stages``: the stages this rank builds; the repeated blocks the forward calls in the
    other stages are recorded as one opaque op each (:mod:`~lightning_parallel.parallel.pipeline.foreign`).
    Returns the pipe and the opaque calls' block names by op handle (empty when every stage is traced whole).
    """
    if local_stages is not None:
        try:
            return _trace_pipe(module, mb_args, mb_kwargs, plan, training, local_stages)
        except Exception:  # noqa: BLE001 - whatever the opaque calls broke, a whole trace decides (and words the error)
            pass
    return _trace_pipe(module, mb_args, mb_kwargs, plan, training, None)


def _trace_pipe(
    module: nn.Module, mb_args: tuple[Any, ...], mb_kwargs: dict[str, Any], plan: PipelinePlan, training: bool,
    local_stages: Sequence[int] | None,
) -> tuple[Pipe, dict[int, str]]:
    modes = {m: m.training for m in module.modules()}
    blocks = [n for n, _ in find_repeated_blocks(module)]
    try:
        module.train(training)
        routing = Routing()
        for _ in range(3):  # again, with the inputs a later stage reads or the outputs an earlier one computes copied (route_inputs.py)
            with routed(module, routing), foreign_blocks(module, blocks, plan.split_points, local_stages) as foreign, \
                    _split_markers(module, plan.split_points, foreign), opaque_forwards(module):
                pipe = pipeline(module, mb_args, mb_kwargs)
            if not (needed := Routing.needed(pipe)):
                break
            routing |= needed
    except Exception as error:  # export raises many types; all mean "cannot split this forward"
        raise config_error(
            ValueError,
            "module.forward",
            type(module).__name__,
            f"it cannot be captured as one graph to cut into stages ({_root_cause(error)}); "
            "data-dependent control flow (an `if` on a tensor's value) or a graph break is the usual reason",
            "make the branch depend on shapes or config only (or use torch.cond), or use a strategy without pipeline parallelism",
        ) from error
    finally:
        for m, mode in modes.items():
            m.training = mode
    if pipe.num_stages != plan.num_stages:
        raise config_error(
            ValueError,
            "split_points",
            list(plan.split_points),
            f"the traced forward has {pipe.num_stages} stages instead of {plan.num_stages}: "
            "each split point must be called exactly once per forward",
            "choose modules that forward calls once each, in order (not a module it skips or reuses)",
        )
    _check_stage_graph(pipe, plan)
    if foreign is None:
        return pipe, {}
    for k in local_stages or ():
        if foreign_calls(pipe.get_stage_module(k)):  # the stage counter and the split disagree: never build from this
            raise RuntimeError(f"stage {k} is built on this rank but holds opaque calls of other stages' blocks")
    return pipe, dict(foreign.blocks)


def _check_stage_graph(pipe: Pipe, plan: PipelinePlan) -> None:
    """Stage k may read earlier stages' outputs (stage 0: the batch; only stage k-1's under a schedule with
    several stages per rank); the model output is the last stage's."""
    graph = pipe.split_gm.graph
    calls = [n for n in graph.nodes if n.op == "call_module"]
    index = {n.name: i for i, n in enumerate(calls)}

    def where(k: int) -> str:
        return f"stage {k} ({_compact(plan.stages[k].modules)})"

    for k, node in enumerate(calls):
        for arg in tree_leaves((node.args, node.kwargs)):
            if not isinstance(arg, fx.Node):
                continue
            src = cut_source(arg)
            if src.op == "placeholder" and k > 0:  # not a tensor (copying routes tensors through stage 0)
                raise config_error(
                    ValueError,
                    "split_points",
                    list(plan.split_points),
                    f"forward input `{src.name}` is used by {where(k)}, but only stage 0 receives the batch, and it is not a tensor that stage 0 could send",
                    "use that input before the first cut only, or move the cuts after its last use",
                )
            if src.op == "call_module" and index[src.name] < k - 1 and plan.virtual_stages == 1:
                # Skips stages: Hugging Face decoders compute masks and rotary tables once, before the
                # first layer, and hand them to every layer. torch's stages send such a value straight
                # to each stage that reads it (pp4 matches one process, tests/test_hf_pp.py).
                continue
            if src.op == "call_module" and index[src.name] != k - 1:
                raise config_error(
                    ValueError,
                    "split_points",
                    list(plan.split_points),
                    f"a tensor computed on {where(index[src.name])} is used on {where(k)}, skipping the stages between: "
                    f"a schedule with {plan.virtual_stages} stages per rank sends only between adjacent stages",
                    "use a schedule with one stage per rank (1f1b, gpipe), pass such tensors through every block, or cut elsewhere",
                )
    output = next(n for n in graph.nodes if n.op == "output")
    for arg in tree_leaves(output.args):
        if isinstance(arg, fx.Node) and cut_source(arg) is not calls[-1]:
            raise config_error(
                ValueError,
                "module.forward",
                list(plan.split_points),
                f"forward returns a value computed before the last stage ({cut_source(arg).name}); only the last stage's result leaves the pipeline",
                "return only values computed from the last block onward",
            )


def stage_interface(pipe: Pipe) -> list[tuple[str, list[Any]]]:
    """The cut as the stages' communication sees it: per stage (and the model's output), where each
    input comes from: a forward input by name, or (stage, output index). Ranks that traced other
    stages' blocks as opaque calls must all see the same (compared in ``runtime.build_pipeline``)."""
    graph = pipe.split_gm.graph
    index = {n.name: i for i, n in enumerate(n for n in graph.nodes if n.op == "call_module")}

    def where(arg: Any) -> Any:
        if not isinstance(arg, fx.Node):
            return repr(arg)
        if arg.op == "call_function" and arg.target is operator.getitem:
            return (where(arg.args[0]), arg.args[1])
        return ("stage", index[arg.name]) if arg.op == "call_module" else (arg.op, str(arg.target))

    return [(str(n.target), [where(a) for a in tree_leaves((n.args, n.kwargs))]) for n in graph.nodes if n.op in ("call_module", "output")]


def _adopt_original_tensors(stage_module: nn.Module, module: nn.Module) -> None:
    """Point the stage's parameters and buffers at the original objects with the same FQN."""
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    for table, kind in ((params, "_parameters"), (buffers, "_buffers")):
        for name, tensor in list(getattr(stage_module, f"named{kind}")(remove_duplicate=False)):
            original = table.get(name)
            if original is not None and tensor is not original:
                parent_name, _, leaf = name.rpartition(".")
                parent = stage_module.get_submodule(parent_name)
                getattr(parent, kind)[leaf] = original


def _run_generated_code(stage_module: nn.Module) -> None:
    """Run the traced submodules' generated Python code instead of ``torch.fx.Interpreter``.

    ``torch.export.unflatten`` rebuilds the module hierarchy from ``InterpreterModule``s, which
    by default execute graph nodes one by one through an interpreter; measured against a
    hand-written ``torch.distributed.pipelining`` loop (``benchmarks/bench_pipeline_vs_manual.py``)
    that made a stage's forward about twice as slow. The generated code runs the same graph.
    """
    run_generated_code(stage_module)


class CheckpointedForward:
    """A traced block's ``forward`` run through its model's own checkpoint function (recomputed in backward).

    Why: Hugging Face's ``gradient_checkpointing_enable()`` makes each decoder layer call
    ``torch.utils.checkpoint`` in its ``__call__``; ``torch.export`` traces through it, so the
    traced layer keeps its activations and the user's memory saving would silently vanish.
    The traced layer is a pure function of its inputs, so recomputing it is exact.
    """

    def __init__(self, forward: Callable[..., Any], checkpoint: Callable[..., Any]) -> None:
        self.inner, self.checkpoint = forward, checkpoint

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        return self.checkpoint(self.inner, *args, **kwargs)


def checkpointed_blocks(module: nn.Module) -> dict[str, Callable[..., Any]]:
    """Modules that checkpoint themselves when training (Hugging Face ``GradientCheckpointingLayer``
    with checkpointing enabled) -> their checkpoint function. Matched by class name, so that this
    layer imports nothing from ``transformers``; the model classes that carry the same flag (but
    only hand it to their layers) are not checkpoints themselves."""
    return {
        name: sub._gradient_checkpointing_func
        for name, sub in module.named_modules()
        if getattr(sub, "gradient_checkpointing", False) is True and callable(getattr(sub, "_gradient_checkpointing_func", None))
        and any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(sub).__mro__)
    }


def _non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint`` as Hugging Face's layers call it (non-reentrant: autocast state
    and keyword arguments are replayed in the recomputation)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def _honour_checkpointing(stage_module: nn.Module, blocks: dict[str, Callable[..., Any]]) -> list[str]:
    """Wrap the stage's traced copies of ``blocks`` in :class:`CheckpointedForward`; return their names."""
    wrapped = []
    for name, sub in stage_module.named_modules():
        if name in blocks and not isinstance(sub.__dict__.get("forward"), CheckpointedForward):
            sub.forward = CheckpointedForward(sub.forward, blocks[name])  # type: ignore[method-assign]
            wrapped.append(name)
    return wrapped


@dataclass(frozen=True)
class TracedPipeline:
    """The traced, cut model: one pipe per mode, their stage modules sharing the module's tensors.

    Tracing is the slow part (``torch.export``); several runtimes (schedules) may be built
    from one trace, as long as their plans cut at the same split points.
    """

    plan: PipelinePlan
    microbatch_size: int
    train: Pipe
    eval: Pipe | None
    holders_by_stage: tuple[frozenset[str], ...]
    used_anywhere: frozenset[int] | None = None  # ids of the module's tensors that some stage uses
    local_stages: frozenset[int] | None = None  # the stages traced whole (the others' blocks are opaque calls); None: all

    def traces_whole(self, stages: Sequence[int]) -> bool:
        """Whether every stage in ``stages`` was traced whole, so that it can be built from this trace."""
        return self.local_stages is None or set(stages) <= self.local_stages


def trace_pipeline(
    module: nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    plan: PipelinePlan,
    microbatches: int,
    build_eval: bool = True,
    checkpoint_blocks: Sequence[str] = (),
    local_stages: Sequence[int] | None = None,
) -> TracedPipeline:
    """Trace ``module`` on one microbatch of the full-batch example and cut it by ``plan`` (no process group needed).

    ``checkpoint_blocks``: FQNs of blocks whose traced copies recompute their activations in
    backward (a strategy's ``activation_checkpointing=True``), beside those the model checkpoints itself.
    ``local_stages``: the stages this rank will build (``plan.stages_for_rank``); the blocks of the
    others are traced as opaque calls (:mod:`~lightning_parallel.parallel.pipeline.foreign`: a quarter
    of the graphs' resident heap on 4 stages), their owners still counted, and their stage modules are
    left behind (:class:`~lightning_parallel.parallel.pipeline.foreign.OtherRanksStage` in their place).
    None: every stage whole. A stage whose two modes compute the same is one module in both pipes
    (:mod:`~lightning_parallel.parallel.pipeline.eval_reuse`).
    The pipes are traced in a forked child where that is available, so that the tracer's heap does not
    stay in this process (:mod:`~lightning_parallel.parallel.pipeline.fork_trace`); in-process otherwise.
    """
    mb_args, mb_kwargs = microbatch_example(tuple(example_args), dict(example_kwargs or {}), microbatches)
    canonical = {id(p): n for n, p in module.named_parameters()}
    Traced = tuple[Pipe | None, dict[int, str]]

    def pipes() -> tuple[Traced, Traced, dict[int, tuple[frozenset[str], frozenset[int]]]]:
        train = trace_pipe(module, mb_args, mb_kwargs, plan, training=True, local_stages=local_stages)
        evaluation: Traced = (None, {})
        if build_eval:
            evaluation = trace_pipe(module, mb_args, mb_kwargs, plan, training=False, local_stages=local_stages)
            # one module where both modes compute the same (eval_reuse.py); only for the stages this rank builds
            share_equal_stages(train[0], evaluation[0], local_stages)  # type: ignore[arg-type]
        if local_stages is None or not (train[1] or evaluation[1]):
            return train, evaluation, {}
        # Another rank's stage: what it holds is counted here (in the child), and its module stays behind.
        # torch's stages keep their pipe's split module, so a module shipped back would stay for the run (issue 29).
        others: dict[int, tuple[frozenset[str], frozenset[int]]] = {}
        mine = {id(t) for t in (*module.parameters(), *module.buffers())}
        for k in sorted(set(range(plan.num_stages)) - set(local_stages)):
            names, ids = _holdings(train[0].get_stage_module(k), module, train[1], canonical)  # type: ignore[union-attr]
            if evaluation[0] is not None:
                ids |= _holdings(evaluation[0].get_stage_module(k), module, evaluation[1], canonical)[1]
            others[k] = (names, frozenset(ids & mine))
            for pipe in (train[0], evaluation[0]):
                if pipe is not None:
                    replace_stage_module(pipe, k, OtherRanksStage(k))
        return train, evaluation, others

    register_handles(module)  # global state the child's trace would otherwise write where this process cannot see it
    (train, train_blocks), (evaluation, eval_blocks), others = run_in_child(pipes, module) or pipes()  # the tracer's heap stays in the child
    checkpointed = {name: _non_reentrant_checkpoint for name in checkpoint_blocks} | checkpointed_blocks(module)
    holders = []
    used: set[int] = set()
    for k in range(plan.num_stages):
        if k in others:
            holders.append(others[k][0])
            used.update(others[k][1])
            continue
        for pipe, opaque in ((train, train_blocks), (evaluation, eval_blocks)):
            if pipe is None or (pipe is evaluation and pipe.get_stage_module(k) is train.get_stage_module(k)):
                continue  # no evaluation pipe, or the training stage serves evaluation too: fixed up once
            stage_module = pipe.get_stage_module(k)
            names, ids = _holdings(stage_module, module, opaque, canonical)
            used.update(ids)
            if pipe is train:
                holders.append(names)
            if not foreign_calls(stage_module):  # traced whole: a stage this rank may build
                _run_generated_code(stage_module)
                if pipe is train:
                    _honour_checkpointing(stage_module, checkpointed)
    local = frozenset(local_stages) if local_stages is not None and (train_blocks or eval_blocks) else None
    return TracedPipeline(plan, batch_size_of(mb_args, mb_kwargs), train, evaluation, tuple(holders), frozenset(used), local)


def _holdings(stage_module: nn.Module, module: nn.Module, opaque: dict[int, str], canonical: dict[int, str]) -> tuple[frozenset[str], set[int]]:
    """Point a stage's tensors at the module's own objects; return the canonical names of the parameters it
    holds and the ids of every tensor it uses (an opaque block's included: another rank's stage)."""
    hold_unit_tensors(stage_module, module)  # MoE layers are opaque ops: their tensors are not graph inputs
    _adopt_original_tensors(stage_module, module)
    tensors = [*stage_module.parameters(), *stage_module.buffers()]
    params = list(stage_module.parameters())
    for block in (module.get_submodule(opaque[h]) for h in foreign_calls(stage_module)):  # its tensors are not graph inputs here
        tensors += [*block.parameters(), *block.buffers()]
        params += list(block.parameters())
    return frozenset(canonical[id(p)] for p in params), {id(t) for t in tensors}
