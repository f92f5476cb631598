"""Context parallelism in the strategy's steps: cut the batch, activate the step, report the loss.

The torch layer (``parallel/context/``) knows chunks, attention and the model hooks; this file
is when they happen in a Lightning step. A training step stays active through its backward
(activation checkpointing recomputes attention there); an evaluation step only for itself.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_parallel.parallel.context.batch import split_batch
from lightning_parallel.parallel.context.options import check_context_combination
from lightning_parallel.parallel.context.step import ContextStep, activate, active_step, deactivate
from lightning_parallel.parallel.dims import CP, ParallelDims
from lightning_parallel.parallel.errors import config_error


def check_context_layout(dims: ParallelDims, compile_blocks: bool) -> None:
    """The resolved degrees' combinations context parallelism refuses (``parallel/context/options.py``)."""
    check_context_combination(dims.cp, dims.pp, compile_blocks, dims.tp, dims.ep)


def check_predict(dims: ParallelDims) -> None:
    """``predict_step`` runs whole sequences on every cp rank (its output is the user's, with no sequence
    dim to gather along); pipeline stages are traced for this rank's chunks, so under pp x cp it cannot."""
    if dims.cp > 1 and dims.pp > 1:
        raise config_error(
            ValueError, "predict_step", f"pipeline_parallel_size={dims.pp} x context_parallel_size={dims.cp}",
            "prediction runs whole sequences on every context-parallel rank, and the pipeline stages were traced"
            " for each rank's chunks of the sequence",
            "predict with a layout without pipelines or without context parallelism (e.g. load the checkpoint under"
            " strategy='cp' or 'pp')",
        )


def begin_step(dims: ParallelDims, form: str, batch_dims: dict[str, Any] | None, args: tuple) -> tuple:
    """Cut the step's batch (its first argument) and activate the step; returns the new arguments."""
    if dims.cp == 1 or not args:
        return args
    group = dims.axis(CP).get_group()
    local, layout = split_batch(args[0], dims.cp, dims.axis(CP).get_local_rank(), batch_dims)
    activate(ContextStep(layout=layout, group=group, form=form, pipelined=dims.pp > 1))
    return (local, *args[1:])


def end_step() -> None:
    deactivate()


def global_loss(output: Any) -> Any:
    """A step's returned loss with the whole sequence's value (see ``ContextStep.global_value``)."""
    step = active_step()
    if step is None:
        return output
    if isinstance(output, Tensor) and output.ndim == 0:
        return step.global_value(output)
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return {**output, "loss": step.global_value(output["loss"])}
    return output
