"""The data-parallel view for data loaders: tensor and pipeline (and context) peers read the same samples.

Why: a dataset that shards itself asks ``torch.distributed`` (or the launcher's environment) for
its rank and world size. Under tensor, pipeline or context parallelism those are the *global*
ones, so ranks that must train on one batch (tp peers, pp stages) get different samples, and the
dp ranks together skip data. The strategy already gives Lightning's ``DistributedSampler`` the
data-parallel view (``distributed_sampler_kwargs``); this module gives it to the datasets that
shard themselves. Lightning's streaming library, litdata, is the prominent one: its
``StreamingDataset`` stores ``_DistributedEnv.detect()`` (global rank, world size, nodes) when it
is built and assigns chunks by it.

What sees the view, once :func:`with_data_parallel_view` has been applied to a ``DataLoader``:

* every litdata dataset reachable from ``loader.dataset`` (through ``CombinedStreamingDataset``,
  ``ParallelStreamingDataset``, ``ConcatDataset`` and ``ChainDataset``): its ``distributed_env``
  (a public attribute) is replaced, and being part of the dataset it travels into the loader's
  worker processes with it, forked or spawned;
* while the loader creates its iterator, yields a batch, or saves and loads its state (litdata's
  ``StreamingDataLoader``), in the calling thread only: ``torch.distributed.get_rank()`` and
  ``get_world_size()`` of the default group, and litdata's ``_DistributedEnv.detect()``. Only that
  thread, and only then, because the same process runs the training collectives between two
  batches, and other threads (a background checkpoint writer) may ask for their real rank;
* in each worker process, for its whole life (it runs nothing but the dataset): the same, and the
  environment variables ``RANK``, ``WORLD_SIZE`` and ``GLOBAL_RANK`` that datasets such as
  webdataset and litdata read before ``torch.distributed`` (``worker_init_fn``, the user's own
  still called after).

What cannot: a rank read before the loader reached the strategy (a dataset that computes its
shard in ``__init__`` from ``dist.get_rank()``); such code should take
``trainer.strategy.distributed_sampler_kwargs``. Collectives a dataset runs itself keep the global
group.
"""

from __future__ import annotations

import copy
import math
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.utils.data import ChainDataset, ConcatDataset, DataLoader

from lightning_parallel.compat import litdata_env_class, litdata_wrapped_datasets


@dataclass(frozen=True)
class DataParallelView:
    """What a rank's data should be sharded by: its data-parallel rank among ``num_replicas``.

    ``num_nodes`` is what litdata uses to keep a node's chunks on that node; it must divide
    ``num_replicas`` (any divisor keeps the shards disjoint and complete)."""

    num_replicas: int
    rank: int
    num_nodes: int = 1

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.num_replicas, self
        assert self.num_nodes >= 1 and self.num_replicas % self.num_nodes == 0, self


def data_parallel_view(num_replicas: int, rank: int, nodes: int = 1) -> DataParallelView | None:
    """The view for ``num_replicas``/``rank`` (a strategy's ``distributed_sampler_kwargs``) over
    ``nodes`` nodes, or ``None`` where it is the process group's own (pure data parallelism, or no
    group): then the datasets already see the right rank and nothing is changed."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    own = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if (num_replicas, rank) == (world, own):
        return None
    return DataParallelView(num_replicas, rank, math.gcd(num_replicas, max(1, nodes)))


# ------------------------------------------------------------------ the rank a caller is told
_local = threading.local()  # .view: the view of the thread inside a loader call
_process_view: DataParallelView | None = None  # a DataLoader worker's view, for every thread in it
_lock = threading.Lock()
_depth = 0  # views entered and not yet left, over all threads; the patches stay while > 0
_patched: list[tuple[Any, str, Any]] = []  # (owner, name, original) to put back


def current_view() -> DataParallelView | None:
    """The view the calling thread is inside, if any."""
    return getattr(_local, "view", None) or _process_view


def _viewed_dist(name: str, original: Callable[..., int]) -> Callable[..., int]:
    def viewed(*args: Any, **kwargs: Any) -> int:
        view = current_view()
        group = args[0] if args else kwargs.get("group")
        if view is None or (group is not None and group is not dist.group.WORLD):
            return original(*args, **kwargs)
        return view.rank if name == "get_rank" else view.num_replicas

    viewed.__wrapped__ = original  # type: ignore[attr-defined]
    viewed.__doc__ = original.__doc__
    return viewed


def _viewed_detect(original: Any) -> classmethod:
    def detect(cls: type) -> Any:
        view = current_view()
        if view is None:
            return original.__get__(None, cls)()
        return cls(world_size=view.num_replicas, global_rank=view.rank, num_nodes=view.num_nodes)

    return classmethod(detect)


def _install() -> None:
    global _depth
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        for name in ("get_rank", "get_world_size"):
            original = getattr(dist, name)
            _patched.append((dist, name, original))
            setattr(dist, name, _viewed_dist(name, original))
        env_class = litdata_env_class()  # only where litdata is imported: otherwise it has no object to serve
        if env_class is not None:
            original = env_class.__dict__["detect"]
            _patched.append((env_class, "detect", original))
            env_class.detect = _viewed_detect(original)


def _uninstall() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth > 0:
            return
        while _patched:
            owner, name, original = _patched.pop()
            setattr(owner, name, original)


@contextmanager
def rank_view(view: DataParallelView) -> Iterator[None]:
    """Inside, this thread's ``torch.distributed.get_rank()``/``get_world_size()`` (default group)
    and litdata's ``_DistributedEnv.detect()`` answer with ``view``; other threads, and calls that
    name another group, get the real answer. Outside, the original functions are back in place."""
    previous = getattr(_local, "view", None)
    _local.view = view
    _install()
    try:
        yield
    finally:
        _local.view = previous
        _uninstall()


def enter_worker_view(view: DataParallelView) -> None:
    """Put this whole process (a DataLoader worker) in ``view`` for good, environment included."""
    global _process_view
    _process_view = view
    os.environ.update(RANK=str(view.rank), GLOBAL_RANK=str(view.rank), WORLD_SIZE=str(view.num_replicas))
    _install()


class WorkerViewInit:
    """A ``worker_init_fn`` that enters the view, then calls the user's; picklable for spawned workers."""

    def __init__(self, view: DataParallelView, user_fn: Callable[[int], Any] | None) -> None:
        self.view = view
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        enter_worker_view(self.view)
        if self.user_fn is not None:
            self.user_fn(worker_id)


# ------------------------------------------------------------------ giving a loader the view
def _datasets(dataset: Any) -> Iterator[Any]:
    """``dataset`` and every dataset it wraps (litdata's wrappers, ConcatDataset, ChainDataset)."""
    seen: set[int] = set()
    todo = [dataset]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, (ConcatDataset, ChainDataset)):
            todo.extend(current.datasets)
        todo.extend(litdata_wrapped_datasets(current))


def set_litdata_views(dataset: Any, view: DataParallelView) -> int:
    """Replace the ``distributed_env`` of every litdata dataset in ``dataset`` by ``view``; returns
    how many. A copy, not an edit: the object may be shared with code that wants the global one."""
    count = 0
    for current in _datasets(dataset):
        env = getattr(current, "distributed_env", None)
        if env is not None and all(hasattr(env, a) for a in ("world_size", "global_rank", "num_nodes")):
            env = copy.copy(env)
            env.world_size, env.global_rank, env.num_nodes = view.num_replicas, view.rank, view.num_nodes
            current.distributed_env = env
            count += 1
    return count


class _ViewedIterator:
    """A loader's iterator whose every ``next`` runs inside the view."""

    def __init__(self, iterator: Iterator[Any], view: DataParallelView) -> None:
        self._iterator = iterator
        self._view = view

    def __iter__(self) -> _ViewedIterator:
        return self

    def __next__(self) -> Any:
        with rank_view(self._view):
            return next(self._iterator)

    def __getattr__(self, name: str) -> Any:  # len(), _shutdown_workers(), ... of the loader's iterator
        if name == "_iterator":  # not yet set (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._iterator, name)


def _in_view(method: Callable[..., Any]) -> Callable[..., Any]:
    def viewed(self: Any, *args: Any, **kwargs: Any) -> Any:
        with rank_view(self._lp_data_view):
            return method(self, *args, **kwargs)

    viewed.__name__, viewed.__doc__ = method.__name__, method.__doc__
    return viewed


def with_data_parallel_view(loader: object, view: DataParallelView | None) -> object:
    """Give ``loader`` (in place: Lightning keeps using the same object) the data-parallel ``view``:
    see the module docstring for what sees it. ``None`` or an iterable that is not a
    ``DataLoader`` is returned unchanged; applying again replaces the view."""
    if view is None or not isinstance(loader, DataLoader):
        return loader
    set_litdata_views(loader.dataset, view)
    user_fn = loader.worker_init_fn
    loader.worker_init_fn = WorkerViewInit(view, user_fn.user_fn if isinstance(user_fn, WorkerViewInit) else user_fn)
    if not getattr(loader, "_lp_data_view", None):
        base = type(loader)

        def __iter__(self: Any) -> Any:  # noqa: N807
            with rank_view(self._lp_data_view):
                iterator = base.__iter__(self)  # num_workers=0: the dataset's own __iter__ runs here
            return _ViewedIterator(iterator, self._lp_data_view)

        methods: dict[str, Any] = {"__iter__": __iter__}
        for name in ("state_dict", "load_state_dict"):  # litdata's StreamingDataLoader detects the world there
            if callable(getattr(base, name, None)):
                methods[name] = _in_view(getattr(base, name))
        loader.__class__ = type(base.__name__, (base,), methods)
    loader._lp_data_view = view
    return loader
