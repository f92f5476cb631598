"""Lightning callbacks: the parallelism monitor (throughput, memory per rank, communication share)."""

from lightning_parallel.callbacks.measure import CollectiveTimer, model_state_bytes, peak_memory_bytes
from lightning_parallel.callbacks.monitor import RESULT_FILE, ParallelismMonitor, data_parallel_replicas

__all__ = [
    "RESULT_FILE",
    "CollectiveTimer",
    "ParallelismMonitor",
    "data_parallel_replicas",
    "model_state_bytes",
    "peak_memory_bytes",
]
