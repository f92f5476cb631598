"""``torch.compile`` of the repeated blocks, one block at a time (the strategy's ``compile_blocks``).

Why per block and not the whole model: every block of a transformer has the same code, so one
compilation serves them all (dynamo inlines ``nn.Module``\\ s and takes their parameters as
inputs), compile time does not grow with depth, and what sits between blocks (FSDP2's unit
hooks, DDP's bucket hooks, the pipeline of the training step) stays eager. torchtitan compiles
the same way, for the same reasons.

Why ``nn.Module.compile`` (in place) and not ``torch.compile(module)``: the latter returns an
``OptimizedModule`` wrapper whose parameter names gain ``_orig_mod.``; compiling in place keeps
every name, so checkpoints, ``tp_plan`` globs, ``split_points`` and optimizer states are those of
the uncompiled model.

Order (``HybridParallelStrategy._apply_layout``): after tensor parallelism and activation
checkpointing (both are traced into the block's graph: DTensor ops and the checkpointed region),
before FSDP2 / DDP (whose hooks dynamo leaves eager: ``torch._dynamo.config.skip_fsdp_hooks``).
Pipelines are refused: their stages are graphs traced with ``torch.export`` from the first batch,
and a compiled block cannot be traced again (``compile_blocks`` with ``pipeline_parallel_size > 1``
is a typed error naming the fix). dp, ZeRO-1/2/3, HSDP, ep and tp (with or without sequence
parallelism, alone or under dp / FSDP2) compile.

Under tensor parallelism the block's graph breaks around each attention/MLP region
(``tp_attention.RegionForward`` is excluded from dynamo: measured, dynamo cannot trace
``implicit_replication``'s C setter ``_set_dtensor_allow_implicit_replication``), so what is
compiled is the rest of the block (norms, with their ``SequenceParallel`` hooks traced, and the
residual adds) and the regions, the bulk of a block's compute, run eagerly between the compiled
pieces; ``fullgraph=True`` is therefore refused with tp. What crosses into the compiled code
from the eager DTensor code (a region's output; a vocabulary-parallel embedding's output, the
input of a Llama's first decoder layer) is a plain tensor (``tp_attention.settled``). Before, the pending all-reduce's ``AsyncCollectiveTensor`` crossed,
and AOT autograd's backward sent its gradient as a plain tensor into DTensor's redistribute
backward (measured, torch 2.13, ``aot_eager``: ``'Tensor' object has no attribute
'_local_tensor'``), which is why tp used to be refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_parallel.errors import config_error

_COMPILE_PARAMS = frozenset(inspect.signature(torch.compile).parameters) - {"model"}


def compile_kwargs(option: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments ``compile_blocks=option`` asks for (None: no compile).

    ``True`` compiles with torch's defaults (inductor); a mapping passes its keys to
    ``torch.compile`` (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``).
    """
    if option is None or option is False:
        return None
    if option is True:
        return {}
    if isinstance(option, Mapping):
        unknown = sorted(set(option) - _COMPILE_PARAMS)
        if unknown:
            raise config_error(
                ValueError, "compile_blocks", dict(option), f"keys {unknown} are not torch.compile arguments",
                f"use only {sorted(_COMPILE_PARAMS)}, e.g. compile_blocks={{'backend': 'inductor', 'fullgraph': True}}",
            )
        return dict(option)
    raise config_error(
        TypeError, "compile_blocks", option, "it must be a bool or a mapping of torch.compile arguments",
        "pass compile_blocks=True, or e.g. compile_blocks={'backend': 'aot_eager'}",
    )


def check_compile_layout(kwargs: dict[str, Any] | None, pipeline_parallel_size: int, tensor_parallel_size: int = 1) -> None:
    """Refuse ``compile_blocks`` where the blocks are traced into pipeline stages (``torch.export``
    of the first batch cannot trace a compiled block again), and ``fullgraph=True`` with tensor
    parallelism: each attention/MLP region is a graph break by design (measured: dynamo raises
    ``Unsupported: Skip inlining torch.compiler.disable()d function`` in the first forward)."""
    if kwargs is None:
        return
    if pipeline_parallel_size > 1:
        raise config_error(
            ValueError, "compile_blocks", kwargs if kwargs else True,
            f"pipeline stages (pipeline_parallel_size={pipeline_parallel_size}) are graphs traced with torch.export"
            " from the first batch, and a compiled block cannot be traced again",
            "use compile_blocks=False with pipeline parallelism, or compile_blocks with dp, zero1-3, hsdp, tp or ep",
        )
    if tensor_parallel_size > 1 and kwargs.get("fullgraph"):
        raise config_error(
            ValueError, "compile_blocks", kwargs,
            f"with tensor_parallel_size={tensor_parallel_size} each attention/MLP region runs eagerly (DTensor"
            " dispatch modes dynamo cannot trace), so a block is several graphs and fullgraph=True cannot hold",
            "drop 'fullgraph' (or set it False) under tensor parallelism; the code between regions still compiles",
        )


def check_compile_model(kwargs: dict[str, Any] | None, module: nn.Module, tensor_parallel_size: int, sequence_parallel: bool) -> None:
    """Refuse ``compile_blocks`` where nothing of a block would compile: sequence parallelism over a
    Hugging Face model's block stacks runs each whole layer in DTensor semantics under a dispatch mode
    (``parallel/tensor/sequence_stacks.py``), which dynamo cannot trace, so the compiled blocks would
    silently run eagerly."""
    from lightning_parallel.parallel.tensor.sequence_stacks import reads_sequence_length

    if kwargs is None or tensor_parallel_size <= 1 or not sequence_parallel or not reads_sequence_length(module):
        return
    raise config_error(
        ValueError, "compile_blocks", kwargs if kwargs else True,
        f"with sequence_parallel=True on {type(module).__name__} (a Hugging Face model: its split spans the block stacks)"
        " every layer runs under a DTensor dispatch mode dynamo cannot trace, so no block would be compiled",
        "set compile_blocks=False, or sequence_parallel=False (tensor parallelism alone compiles the code between regions)",
    )


def apply_compile(blocks: Sequence[tuple[str, nn.Module]], kwargs: dict[str, Any]) -> list[str]:
    """Compile every block in place (names kept); return the names compiled."""
    for _, block in blocks:
        block.compile(**kwargs)
    return [name for name, _ in blocks]


__all__ = ["apply_compile", "check_compile_layout", "check_compile_model", "compile_kwargs"]
