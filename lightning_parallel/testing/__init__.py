"""Helpers for multi-process tests that cannot use Lightning's own launcher (see ``spawn``)."""

from lightning_parallel.launcher import DistributedRunError, free_port, run_distributed

__all__ = ["DistributedRunError", "free_port", "run_distributed"]
