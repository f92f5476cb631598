"""Kept for the tests' imports: the launcher lives in :mod:`lightning_parallel.launcher`."""

from lightning_parallel.launcher import DistributedRunError, free_port, run_distributed, worker_environment

__all__ = ["DistributedRunError", "free_port", "run_distributed", "worker_environment"]
