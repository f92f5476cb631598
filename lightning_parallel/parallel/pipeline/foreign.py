"""While a rank traces the model, blocks of other ranks' stages are recorded as one opaque op each.

Why: a rank needs only its own stages' graphs, but the tracer (``torch.export`` then
``torch.distributed.pipelining``'s split) records the whole forward, node by node, to cut it, and
what it allocates stays resident after its objects die (freed pymalloc arenas between live ones are
not handed back to the OS). Measured on a 32-block GPT (width 512, meta-built) at pp4, one process
tracing train and eval pipes, after collection and trim: 75 MiB resident with every stage traced,
56 MiB with only rank 1's (the rest is ``torch.export``'s imports, the eval pipe and first-use
caches, see ``docs/memory.md``); the strategy's ``pp`` peak RSS per rank fell from 0.93 to 0.87 of
the model's fp32 parameters.

So while tracing, each block of the repeated stack (``blocks.0``, ``model.layers.3``, ...) that
the forward calls inside a stage this rank does not own runs its real ``forward`` on the
tracer's fake tensors *untraced* (proxy tracing off: the values' shapes and dtypes are computed,
nothing is recorded), and the graph gets one call of ``lightning_parallel_pp::foreign_block``
instead, whose outputs have those shapes. What the cut needs is kept: the split points stay
``pipe_split`` markers (called before a block's opaque call), the stage boundaries and the
tensors crossing them are the same values, so the checks on the stage graph still see which
stage reads what. Which stage a call is in is counted at trace time (the split markers advance
a counter), not guessed from the module tree, so a block runs traced wherever this rank owns it.

Parameter ownership: an opaque block's parameters are not graph inputs of the other stage, so
the tracer's stage module does not hold them; :func:`foreign_calls` maps each call to its block
and :mod:`~lightning_parallel.parallel.pipeline.trace` adds the block's parameters to that stage's
holders (canonical names), so the owners every rank computes are those of a whole trace.

The op never runs: other ranks' stage modules are not built here, and its kernel raises if one is.
Blocks that contain a split point, MoE units (opaque already, :mod:`~lightning_parallel.parallel.pipeline.moe`)
and calls without tensor inputs are traced as before; where tracing with opaque calls fails, or
the ranks' cuts differ, the whole model is traced as before (``trace.trace_pipe``, ``runtime.build_pipeline``).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.overrides import TorchFunctionMode

from lightning_parallel.compat import tree_flatten, tree_leaves, tree_unflatten

_LIB = torch.library.Library("lightning_parallel_pp", "DEF")
_LIB.define("foreign_block(Tensor[] inputs, int handle) -> Tensor[]")
_PENDING: dict[int, list[Tensor]] = {}  # handle -> the untraced run's outputs (fake), read by the shape rule
_handles = itertools.count()


def _never_runs(inputs: list[Tensor], handle: int) -> list[Tensor]:
    raise RuntimeError(
        "a block of another pipeline rank's stage ran here: its stage was traced as opaque calls and must not be built on this rank"
    )


class OtherRanksStage(nn.Module):
    """What a traced pipe holds in place of a stage another rank builds: that stage's module stays in the
    tracing child (what it holds is counted there), since nothing here runs it (issue 29: kept, the stage
    modules of the other ranks were 3 MiB of graphs per pipe on a ``pp4`` rank, held for the run)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"stage {self.index} is another pipeline rank's stage: it was traced as opaque calls and is not built on this rank")


def _shape_rule(inputs: list[Tensor], handle: int) -> list[Tensor]:
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in _PENDING[handle]]


_LIB.impl("foreign_block", _never_runs, "CompositeExplicitAutograd")
torch.library.register_fake("lightning_parallel_pp::foreign_block", _shape_rule, lib=_LIB)
FOREIGN_OP = torch.ops.lightning_parallel_pp.foreign_block.default


@dataclass
class ForeignTrace:
    """One trace's bookkeeping: the stage the forward is in, and block name by op handle."""

    local: frozenset[int]
    stage: int = 0
    blocks: dict[int, str] = field(default_factory=dict)

    def split(self) -> None:
        """A split marker ran: the forward enters the next stage."""
        self.stage += 1


class _FirstReads(TorchFunctionMode):
    """The block's input tensors that its torch calls read, in the order first read.

    Why: the opaque call must take exactly the inputs the traced block would read, in that order.
    The split lists a stage's outputs in the order later nodes first use them, so an input the
    block ignores (a Hugging Face layer's ``position_ids`` beside its position embeddings) would
    become an extra value crossing the cut, and a different order a different output numbering:
    the ranks' views of the cut would disagree (``runtime.build_pipeline`` compares them). A call
    reads its tensor arguments when it returns a tensor; ``x.shape`` or ``x.dtype`` read nothing,
    as in the export graph, where static shapes are constants."""

    def __init__(self, inputs: list[Tensor]) -> None:
        super().__init__()
        self.index = {id(t): i for i, t in enumerate(inputs)}
        self.order: list[int] = []

    def read(self, values: Any) -> None:
        for x in tree_leaves(values):
            i = self.index.get(id(x)) if isinstance(x, Tensor) else None
            if i is not None and i not in self.order:
                self.order.append(i)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(isinstance(x, Tensor) for x in tree_leaves(out)):
            self.read((args, kwargs or {}))
        return out


def _opaque(trace: ForeignTrace, name: str, inner: Any) -> Any:
    def forward(*args: Any, **kwargs: Any) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        inputs = [x for x in flat if isinstance(x, Tensor)]
        if trace.stage in trace.local or not inputs:
            return inner(*args, **kwargs)
        reads = _FirstReads(inputs)
        with disable_proxy_modes_tracing(), reads:  # the block's ops run on fake tensors, unrecorded: shapes only
            shaped = inner(*args, **kwargs)
        out_flat, out_spec = tree_flatten(shaped)
        reads.read(out_flat)  # an input returned as it is: the call's result must still come from it
        handle = next(_handles)
        _PENDING[handle] = [x for x in out_flat if isinstance(x, Tensor)]
        trace.blocks[handle] = name
        results = iter(FOREIGN_OP([inputs[i] for i in reads.order], handle))
        return tree_unflatten([next(results) if isinstance(x, Tensor) else x for x in out_flat], out_spec)

    return forward


@contextmanager
def foreign_blocks(module: nn.Module, blocks: Sequence[str], split_points: Collection[str], local: Collection[int] | None) -> Iterator[ForeignTrace | None]:
    """While tracing, ``blocks`` called in a stage outside ``local`` are one opaque op each (see the
    module doc); yields the trace's bookkeeping (advance it with :meth:`ForeignTrace.split` at each
    split marker), or None when ``local`` is None (every stage traced whole). Restored on exit."""
    if local is None:
        yield None
        return
    trace = ForeignTrace(frozenset(local))
    inside = [b for b in blocks if any(p.startswith(f"{b}.") for p in split_points)]
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for name in blocks:
            sub = module.get_submodule(name)
            if name in inside:  # its inner split marker must be traced
                continue
            patched.append((sub, sub.__dict__.get("forward")))
            sub.forward = _opaque(trace, name, sub.forward)  # type: ignore[method-assign]
        yield trace
    finally:
        restore_forwards(patched)
        _PENDING.clear()


def restore_forwards(patched: list[tuple[nn.Module, Any]]) -> None:
    """Undo ``forward`` patches, last first: a module without an instance ``forward`` before gets its class's back."""
    for sub, previous in reversed(patched):
        if previous is None:
            del sub.forward
        else:
            sub.forward = previous  # type: ignore[method-assign]


def foreign_calls(stage_module: nn.Module) -> list[int]:
    """Handles of the opaque block calls in ``stage_module``'s graphs."""
    handles = []
    for sub in stage_module.modules():
        graph = getattr(sub, "graph", None)
        if isinstance(graph, fx.Graph):
            handles.extend(n.args[1] for n in graph.nodes if n.op == "call_function" and n.target is FOREIGN_OP)
    return handles


__all__ = ["FOREIGN_OP", "ForeignTrace", "foreign_blocks", "foreign_calls"]
