"""Seconds of one collective or one point-to-point transfer over a link: the cost model's two primitives.

Kept apart from :mod:`~lightning_parallel.planner.cost` so that the parts of the cost model that live in
their own files (:mod:`~lightning_parallel.planner.context_cost`) price their messages with the same
formulas, without importing the whole model.
"""

from __future__ import annotations

import math

Link = tuple[float, float]  # (bytes/s per device, seconds per step)


def collective_time(nbytes: float, n: int, link: Link, factor: float = 2.0, scale: float = 1.0) -> float:
    """All-reduce (``factor=2``) or all-gather / reduce-scatter (``factor=1``) of ``nbytes`` (the whole,
    gathered message) over ``n`` ranks; ``scale``: the measured per-byte cost of this collective against
    the ring formula (gloo's all-gather and reduce-scatter are slower per byte than its all-reduce; 1 on
    NCCL profiles)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = link
    steps = math.ceil(math.log2(n))  # latency of tree/hierarchical algorithms (NCCL's choice at scale)
    return factor * (n - 1) / n * nbytes / bandwidth * scale + factor * steps * latency


def p2p_time(nbytes: float, link: Link) -> float:
    """One send of ``nbytes`` to a neighbour (and the matching receive, which runs at the same time)."""
    if nbytes <= 0:
        return 0.0
    bandwidth, latency = link
    return nbytes / bandwidth + latency


__all__ = ["Link", "collective_time", "p2p_time"]
