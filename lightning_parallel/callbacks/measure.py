"""What the parallelism monitor measures, without Lightning: state bytes and collective waits.

Model-state bytes count what *this rank* holds: the local shard of a DTensor (FSDP2 / ZeRO-2/3,
tensor parallel), the partition a ``ZeroRedundancyOptimizer`` keeps (ZeRO-1), every tensor
once even if shared (tied weights, a state tensor referenced twice).

Collective waits are the host time the training thread spends blocked in communication:

* every ``torch.distributed.<collective>`` called through the ``torch.distributed`` namespace
  (FSDP2's all-gather / reduce-scatter, ZeRO-1's broadcasts, Lightning's ``sync_dist``
  reductions, barriers): a synchronous call is timed whole, an asynchronous one from the
  moment its ``Work.wait()`` is called until it returns;
* DDP's bucketed all-reduce, which torch runs from C++: a comm hook (the default all-reduce
  hook, unchanged) marks when the last bucket was issued, and the time from there to the end of
  ``backward`` is the wait that was not hidden behind computation.

Limits, stated rather than guessed around: collectives issued from C++ other than DDP's (the
functional collectives of DTensor tensor parallelism) are not seen, so the share is a lower
bound under ``tp``; on NCCL a collective returns once enqueued, so host time underestimates
the GPU's waiting (use a profiler trace there).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.compat import local_tensor as _dtensor_local
from lightning_parallel.compat_lightning import unwrap_optimizer

COLLECTIVES: tuple[str, ...] = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
    "reduce", "gather", "scatter", "barrier", "send", "recv", "batch_isend_irecv", "all_reduce_coalesced",
    "all_gather_coalesced", "all_gather_object", "broadcast_object_list", "gather_object",
)
"""``torch.distributed`` functions timed by :class:`CollectiveTimer` (those that exist in this torch)."""


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` stored on this rank: a DTensor's local shard, else the tensor."""
    local = _dtensor_local(tensor)
    return local if isinstance(local, torch.Tensor) else tensor


def _bytes(tensors: Iterable[Any], seen: set[tuple[int, int, int]]) -> int:
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        local = local_tensor(tensor)
        if local.device.type == "meta":
            continue
        key = (local.data_ptr(), local.numel(), local.element_size())
        if key in seen and local.numel():
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def local_optimizer(optimizer: Any) -> Any:
    """Unwrap Lightning's ``LightningOptimizer`` and ZeRO-1's ``ZeroRedundancyOptimizer`` to the
    optimizer whose ``state`` this rank actually holds."""
    optimizer = unwrap_optimizer(optimizer)
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer keeps its partition here
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _state_tensors(optimizer: Any) -> Iterable[torch.Tensor]:
    for state in local_optimizer(optimizer).state.values():
        values = state.values() if isinstance(state, dict) else [state]
        yield from (v for v in values if isinstance(v, torch.Tensor))


def model_state_bytes(module: nn.Module, optimizers: Iterable[Any] = ()) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank (call between
    backward and ``zero_grad`` to see gradients; after a step to see optimizer state)."""
    seen: set[tuple[int, int, int]] = set()
    params = list(module.parameters())
    out = {
        "parameters": _bytes(params, seen),
        "gradients": _bytes((p.grad for p in params if p.grad is not None), seen),
        "optimizer_state": _bytes((t for opt in optimizers for t in _state_tensors(opt)), seen),
    }
    out["total"] = sum(out.values())
    return out


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes, what it is): CUDA max allocated on a GPU, the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_memory_allocated"
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024), "cpu_peak_rss"


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _peak_rss_now() -> int | None:
    """The process's RSS high-water mark (``VmHWM``, Linux), or ``None`` where there is none."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakWindow:
    """Peak memory between :meth:`start` and :meth:`read` (one window at a time per process).

    On a GPU, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``: every tensor
    allocated at some point of the window, including those alive when it opened; beside it
    :meth:`read_reserved` (``max_memory_reserved``) and, on every device, :meth:`read_host` (the
    process's peak RSS). On the CPU,
    the peak resident set: Linux resets the high-water mark ``VmHWM`` to the current RSS when
    ``5`` is written to ``/proc/self/clear_refs``, so the figure is the largest RSS seen inside the
    window (what was resident when it opened included). Where that reset is not possible the
    process's peak since it started is reported, and the kind says so (``..._since_start``):
    a set-up peak is then a true upper bound, a training peak may include set-up.
    """

    def __init__(self) -> None:
        self._kind: str | None = None
        self._host_reset = False

    def start(self, device: torch.device) -> None:
        host = self._reset_host()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._kind = "cuda_max_memory_allocated"
            return
        self._kind = "cpu_peak_rss" if host else "cpu_peak_rss_since_start"

    def _reset_host(self) -> bool:
        """Reset the process's RSS high-water mark (also on a GPU: host staging lives there); True if reset."""
        try:
            _CLEAR_REFS.write_text("5")
        except OSError:
            self._host_reset = False
        else:
            self._host_reset = _peak_rss_now() is not None
        return self._host_reset

    @property
    def started(self) -> bool:
        return self._kind is not None

    def read(self, device: torch.device) -> tuple[int, str]:
        """(peak bytes since :meth:`start`, what it is)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device)), "cuda_max_memory_allocated"
        peak = _peak_rss_now() if self._kind == "cpu_peak_rss" else None
        if peak is None:
            return peak_memory_bytes(device)[0], "cpu_peak_rss_since_start"
        return peak, "cpu_peak_rss"

    def read_host(self) -> tuple[int, str]:
        """(peak RSS of the process since :meth:`start`, its kind), on any device: the number a
        cluster's memory limit kills a process by, allocator caching and non-tensor memory included."""
        peak = _peak_rss_now() if self._host_reset else None
        if peak is None:
            return peak_memory_bytes(torch.device("cpu"))[0], "cpu_peak_rss_since_start"
        return peak, "cpu_peak_rss"

    @staticmethod
    def read_reserved(device: torch.device) -> int | None:
        """CUDA: the caching allocator's peak reserved bytes since :meth:`start` (what the device really
        gave the process; above ``max_memory_allocated`` by the allocator's cache and fragmentation)."""
        if device.type != "cuda":
            return None
        return int(torch.cuda.max_memory_reserved(device))


class _TimedWork(dist.distributed_c10d.Work):
    """A ``Work`` whose ``wait()`` is timed; a real ``Work`` subclass, so FSDP2's
    ``isinstance(work, Work)`` checks still hold, and C++ callers reach the wrapped methods."""

    def __init__(self, work: Any, timer: CollectiveTimer) -> None:
        super().__init__()
        self._work, self._timer = work, timer

    def wait(self, timeout: Any = None) -> bool:  # noqa: D102
        start = time.perf_counter()
        try:
            return self._work.wait() if timeout is None else self._work.wait(timeout)
        finally:
            self._timer.seconds += time.perf_counter() - start

    def get_future(self) -> Any:  # noqa: D102
        return self._work.get_future()

    def is_completed(self) -> bool:  # noqa: D102
        return self._work.is_completed()

    def is_success(self) -> bool:  # noqa: D102
        return self._work.is_success()

    def exception(self) -> Any:  # noqa: D102
        return self._work.exception()

    def result(self) -> Any:  # noqa: D102
        return self._work.result()


class CollectiveTimer:
    """Accumulates the seconds this process spends blocked in collectives while installed.

    Install once per fit (``install`` / ``uninstall``); nested collectives (an object
    collective calling a tensor one) are counted once.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._originals: dict[str, Callable[..., Any]] = {}
        self._local = threading.local()
        self._last_ddp_issue: float | None = None
        self.ddp_hooked = False

    def install(self) -> None:
        if self._originals:
            return
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(dist, name, self._wrap(original))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0):
                return fn(*args, **kwargs)
            self._local.depth = 1
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                self._local.depth = 0
                self.seconds += time.perf_counter() - start
                self.calls += 1
            if isinstance(result, dist.distributed_c10d.Work) and not isinstance(result, _TimedWork):
                return _TimedWork(result, self)
            return result

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    # ---- DDP: its all-reduce runs from C++, so mark the last bucket and time the tail of backward
    def hook_ddp(self, ddp_model: nn.Module) -> bool:
        """Register the default all-reduce as a comm hook that records issue times; False if the
        model already has a comm hook (then DDP's wait is not measured)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects non-GradBucket annotations
            self._last_ddp_issue = time.perf_counter()
            return default_hooks.allreduce_hook(state, bucket)

        try:
            ddp_model.register_comm_hook(ddp_model.process_group, hook)  # type: ignore[operator]
        except RuntimeError:
            return False
        self.ddp_hooked = True
        return True

    def end_of_backward(self) -> None:
        """Call when ``backward`` has returned: adds the exposed DDP all-reduce wait of this step."""
        if self._last_ddp_issue is not None:
            self.seconds += max(0.0, time.perf_counter() - self._last_ddp_issue)
            self._last_ddp_issue = None
