"""The rank side of the coverage matrix: run many (model, strategy) cells in one process group.

Start-up (imports, process group) costs more than a tiny model's five steps, so one spawned
group runs every cell of its world size in turn. Each cell is a parity fit; its outcome is
written by rank 0 to ``out_dir/<cell>.json`` as soon as it is known, and a ``<cell>.started``
marker before it begins, so a group that dies or hangs part-way (an internal error on one rank
leaves its peers in a collective) still tells the parent which cells finished and which one
broke; the parent starts a fresh group for the rest.

Outcome kinds:

* ``ok`` / ``mismatch``: the fit ran; ``value`` is the maximum relative difference from the
  one-process reference (per-step losses ``|a - b| / |b|``, parameters ``||a - b|| / ||b||`` per
  tensor), ``ok`` when it is at most ``TOLERANCE`` over at least ``MIN_STEPS`` steps;
* ``refused``: a typed configuration error (``ValueError``/``TypeError`` in the project's
  ``config_error`` layout, with its ``HINT``), raised before any collective: allowed;
* ``error``: anything else, including a layout that silently shards nothing.
"""

from __future__ import annotations

import json
import os
import threading
import traceback
from pathlib import Path
from typing import Any

import torch

from lightning_parallel.testing.parity import FitSpec, run_fit

TOLERANCE = 1e-5
MIN_STEPS = 5
# A strategy that claims to split parameters must hold at most this fraction of them per rank.
SHARDING_STRATEGIES = {"zero2": 0.75, "zero3": 0.75, "hsdp": 0.75, "tp": 0.9}


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (what a table cell has room for)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def is_refusal(exc: BaseException) -> bool:
    """A typed configuration error in the project's layout (field, value, rule, ``HINT``)."""
    return isinstance(exc, (ValueError, TypeError)) and "HINT" in str(exc)


ROUND_OFF_NORM = 1e-8
"""A parameter whose norm stays below this in both runs is round-off around zero (as in ``assert_parity``)."""


def relative_difference(losses: list[float], params: dict[str, Any], reference: dict[str, Any]) -> tuple[float, float, str | None]:
    """Max relative difference of the per-step losses and of the parameters (per tensor), or a
    reason the fits cannot be compared."""
    ref_losses = reference["losses"]
    if len(losses) != len(ref_losses) or len(losses) < MIN_STEPS:
        return float("inf"), float("inf"), f"{len(losses)} logged steps, reference {len(ref_losses)} (need >= {MIN_STEPS})"
    if params.keys() != reference["params"].keys():
        missing = sorted(set(reference["params"]) ^ set(params))[:3]
        return float("inf"), float("inf"), f"parameter names differ from one process: {missing}"
    loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    param_diff = 0.0
    for name, ref in reference["params"].items():
        got = params[name].to(ref.dtype)
        if got.shape != ref.shape:
            return float("inf"), float("inf"), f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
        if max(float(got.norm()), float(ref.norm())) < ROUND_OFF_NORM:
            continue  # a zero that round-off moved (a key bias's true gradient is zero): equal, not 100% apart
        param_diff = max(param_diff, float((got - ref).norm() / ref.norm().clamp_min(1e-12)))
    return loss_diff, param_diff, None


def global_batch_losses(losses: list[float]) -> list[float]:
    """Per-step loss of the global batch: the mean of what every rank logged.

    A user's ``self.log("train_loss", loss)`` without ``sync_dist`` logs the rank's own batch
    mean; with equal per-rank denominators the global batch mean is the mean over data-parallel
    ranks, and tensor/pipeline peers log their data rank's value, so the mean over the world is
    the same number. (A loss averaged over a per-rank count of unpadded tokens is a mean of
    per-rank means under data parallelism, as in every DDP: compare such runs per rank.)
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return losses
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)
    if any(len(g) != len(losses) for g in gathered):
        return losses
    return [sum(step) / len(step) for step in zip(*gathered)]


def _sharding_problem(strategy: str, result: dict[str, Any]) -> str | None:
    limit = SHARDING_STRATEGIES.get(strategy)
    total = sum(p.numel() for p in result["params"].values())
    local = result["layout"].get("local_param_numel", total)
    if limit is not None and total and local > limit * total:
        return f"silent no-op: {strategy} holds {local / total:.0%} of the parameters per rank (limit {limit:.0%})"
    if strategy == "ep" and local >= total:
        return "silent no-op: ep holds every expert on every rank"
    return None


def _write(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.rename(path)


def run_cell(spec: FitSpec, strategy: str, reference_file: str) -> dict[str, Any]:
    """One cell on this rank: fit, then compare with the reference (every rank compares)."""
    try:
        result = run_fit(spec)
    except Exception as exc:  # noqa: BLE001 - every outcome is a table cell
        kind = "refused" if is_refusal(exc) else "error"
        return {"kind": kind, "message": first_line(exc), "traceback": traceback.format_exc()[-4000:]}
    losses = global_batch_losses(result["losses"])
    reference = torch.load(reference_file, weights_only=False)
    loss_diff, param_diff, reason = relative_difference(losses, result["params"], reference)
    value = max(loss_diff, param_diff)
    problem = reason or _sharding_problem(strategy, result)
    record: dict[str, Any] = {"kind": "ok" if value <= TOLERANCE else "mismatch", "value": value,
                              "loss_diff": loss_diff, "param_diff": param_diff,
                              "clipped": bool(reference["grad_norms"]) and max(reference["grad_norms"]) > spec.trainer_kwargs.get(
                                  "gradient_clip_val", float("inf")),
                              "dims": result["layout"].get("dims"),
                              "local_fraction": result["layout"].get("local_param_numel", 0)
                              / max(1, sum(p.numel() for p in result["params"].values()))}
    if problem is not None:
        record.update(kind="error", message=problem)
    return record


def _watchdog(seconds: float, cell_id: str, out: Path, rank: int) -> threading.Timer:
    """End this rank if the cell runs past ``seconds`` (a hang outside any collective timeout);
    rank 0 first records the timeout, so the parent shows it and resumes with the next cell."""

    def fire() -> None:
        if rank == 0:
            _write(out / f"{cell_id}.json", {"kind": "error", "message": f"timeout: the cell ran past {seconds:.0f} s"})
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def run_cells(cells: list[tuple[str, FitSpec, str, str]], out_dir: str, timeout_per_cell: float = 300.0) -> int:
    """Run ``(cell_id, spec, strategy_name, reference_file)`` cells in order on every rank.

    After an internal error the ranks may no longer agree on where they are (one raised, a
    peer waits in a collective): the group stops there, and the parent restarts the rest.
    """
    import torch.distributed as dist

    out = Path(out_dir)
    rank = int(os.environ.get("RANK", "0"))
    done = 0
    for cell_id, spec, strategy, reference_file in cells:
        if rank == 0:
            (out / f"{cell_id}.started").write_text("")
        timer = _watchdog(timeout_per_cell, cell_id, out, rank)
        try:
            record = run_cell(spec, strategy, reference_file)
        finally:
            timer.cancel()
        if rank == 0:
            _write(out / f"{cell_id}.json", record)
        done += 1
        if record["kind"] == "error" and "traceback" in record:
            raise RuntimeError(f"cell {cell_id} failed on rank {rank}: {record['message']}\n{record['traceback']}")
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # the next cell starts together (a Trainer's set-up waits on its peers anyway)
    return done
