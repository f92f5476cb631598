"""Checkpoint reads that never run code: ``weights_only`` on every load, as torch and Lightning do.

Why: a checkpoint is a pickle, and unpickling may call any function the file names
(``os.system`` included). Checkpoints come from hubs, colleagues and shared disks, so since
torch 2.6 ``torch.load`` reads only tensors, primitives and containers unless told
``weights_only=False``, and Lightning 2.6 passes ``Trainer.fit/validate/test/predict(...,
weights_only=...)`` on to the strategy's ``load_checkpoint``. ``None`` means torch's default
(weights-only, unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says otherwise), ``False`` is the
user's explicit trust in the file. Every file this package reads goes through one of three
readers here, each given that value:

* files written by ``torch.save`` (a consolidated checkpoint, a sharded directory's ``meta.pt``,
  ``pytorch_model.bin``): ``torch.load(weights_only=...)`` (:func:`load_file`);
* DCP's ``.metadata``, which torch (2.13, ``FileSystemReader.read_metadata``) reads with plain
  ``pickle.load``: here an unpickler that admits only DCP's metadata classes, ``torch.Size``,
  dtypes, layouts and paths, plus what the user allowed with ``add_safe_globals``
  (:class:`SafeFileSystemReader`; torch's own weights-only unpickler cannot read it: the file is
  pickle protocol 4, whose FRAME opcode it refuses);
* DCP's non-tensor entries (optimizer hyper-parameters), which torch's ``DefaultLoadPlanner``
  reads with ``torch.load(weights_only=False)``: here with the caller's value (:func:`dcp_load`).

A refusal is :class:`~lightning_parallel.errors.UnsafeCheckpointError` (a ``pickle.UnpicklingError``,
what torch raises): it names the file, the refused object, torch's own words, and the two ways
forward: ``weights_only=False`` for a trusted file, or ``torch.serialization.add_safe_globals``.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, Metadata, ReadItem
from torch.distributed.checkpoint.metadata import StorageMeta

from lightning_parallel.errors import UnsafeCheckpointError

T = TypeVar("T")
# How a user trusts a file where it is loaded (the first way forward of a refusal).
TRAINER_HOW = ("load it with weights_only=False: `trainer.fit(model, ckpt_path=..., weights_only=False)` (likewise"
               " validate, test and predict)")
_TRUE = ("1", "y", "yes", "true")
_REFUSED_GLOBAL = (re.compile(r"GLOBAL (\S+) was not an allowed global"), re.compile(r"unsupported GLOBAL (\S+) whose module"))


def weights_only_in_effect(weights_only: bool | None) -> bool:
    """What ``torch.load(weights_only=weights_only)`` does (torch 2.13 ``serialization.load``): ``None``
    is weights-only unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set; ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
    makes every load weights-only. Needed where this package unpickles without ``torch.load`` (DCP
    metadata), so that one setting means the same everywhere."""
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
        return True
    if weights_only is None:
        return os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in _TRUE
    return bool(weights_only)


def refusal(source: str, message: str, how: str = TRAINER_HOW) -> UnsafeCheckpointError:
    """The error for a weights-only load of ``source`` that ``message`` (torch's) refused."""
    refused = next((m.group(1) for pattern in _REFUSED_GLOBAL if (m := pattern.search(message))), None)
    named = f"`{refused}`" if refused else "an object"
    if "is blocked" in message:  # os, subprocess, sys...: torch admits them under no allowlist
        allow = f"no allowlist admits {named}: torch blocks its module outright; only a trusted file may hold it"
    else:
        allow = (f"to keep loading weights-only, allow the class once you know it is harmless: "
                 f"`torch.serialization.add_safe_globals([{refused or '<the class>'}])` in every process, before the load")
    return UnsafeCheckpointError(
        f"`checkpoint`={source!r} is refused: it holds {named}, which weights-only loading does not unpickle (unpickling"
        f" can run code). HINT: (1) if you trust the file, {how}; (2) {allow}."
        f" torch says: {message}",
        source=source,
        refused=refused,
    )


def load_file(path: str | Path, weights_only: bool | None, how: str = TRAINER_HOW, mmap: bool = False) -> Any:
    """``torch.load`` of a ``torch.save`` file onto the CPU; a refused object raises :func:`refusal`'s error."""
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except pickle.UnpicklingError as err:
        if not weights_only_in_effect(weights_only):
            raise  # a damaged file, not a refusal
        raise refusal(str(path), str(err), how) from None


# ---------------------------------------------------------------------------------- DCP metadata
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # returns a layout (torch.strided, ...) by name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: a dataclass tree of chunk offsets and sizes. Every global must be
    one of DCP's metadata classes, a dtype/layout/memory format, an entry of ``_ALLOWED`` or a global
    the user allowed with ``torch.serialization.add_safe_globals``; a module is imported only after
    its name passed, so a refused name runs nothing."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == _METADATA_MODULE:
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == _METADATA_MODULE:  # defined there, not imported
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        for entry in torch.serialization.get_safe_globals():
            allowed, qualified = entry if isinstance(entry, tuple) else (entry, f"{entry.__module__}.{entry.__qualname__}")
            if qualified == f"{module}.{name}":
                return allowed
        raise pickle.UnpicklingError(
            f"Unsupported global: GLOBAL {module}.{name} was not an allowed global by default (DCP's .metadata holds"
            " only its own metadata classes, torch.Size, dtypes and paths)."
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader whose ``read_metadata`` unpickles weights-only (see the module doc), unless
    ``weights_only`` is ``False`` (or torch's environment says so) and the user trusts the directory."""

    def __init__(self, path: str | Path, weights_only: bool | None, how: str = TRAINER_HOW) -> None:
        super().__init__(str(path))
        self.weights_only, self.how = weights_only, how

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if not weights_only_in_effect(self.weights_only):
            return super().read_metadata(*args, **kwargs)
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            try:
                metadata = _MetadataUnpickler(file).load()
            except pickle.UnpicklingError as err:
                raise refusal(str(path), str(err), self.how) from None
        if not isinstance(metadata, Metadata):
            raise refusal(str(path), f"it unpickles to {type(metadata).__name__}, not DCP's Metadata", self.how)
        if getattr(metadata, "storage_meta", None) is None:  # as torch's reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: str | Path, weights_only: bool | None, how: str = TRAINER_HOW) -> Metadata:
    """A sharded checkpoint's DCP metadata (entry names, shapes, chunks), read weights-only."""
    return SafeFileSystemReader(path, weights_only, how).read_metadata()


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but its non-tensor entries are read with the caller's ``weights_only``."""

    def __init__(self, source: str, weights_only: bool | None, how: str) -> None:
        super().__init__()
        self.source, self.weights_only, self.how = source, weights_only, how

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=self.weights_only)
        except pickle.UnpicklingError as err:
            if not weights_only_in_effect(self.weights_only):
                raise
            raise refusal(f"{self.source} (entry {read_item.dest_index.fqn})", str(err), self.how) from None
        super().load_bytes(read_item, _saved(loaded))


def _saved(value: Any) -> io.BytesIO:
    """``value`` as the bytes torch's planner reads back (with ``weights_only=False``: here it holds
    only what the weights-only load above already admitted, or what the user trusts)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def read_on_rank0(path: str | Path, read: Callable[[], T], header: Callable[[T], Any]) -> tuple[T | None, Any]:
    """Rank 0 runs ``read`` (a checkpoint file it alone opens) and broadcasts ``header(value)``; returns
    (the value on rank 0, ``None`` elsewhere; the header on every rank). One process: no broadcast.

    Why: the other ranks wait in the broadcast for rank 0's header, so a failure there (a refused
    object, a damaged file) must travel in its place, or they hang until the process-group timeout.
    Every rank raises together: a refusal as the same :class:`UnsafeCheckpointError`, anything else as
    the original on rank 0 and a ``RuntimeError`` naming it elsewhere.
    """
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not distributed:
        value = read()
        return value, header(value)
    value, box, failure = None, [None], None
    if dist.get_rank() == 0:
        try:
            value = read()
            box = [(True, header(value))]
        except Exception as err:  # noqa: BLE001 - sent to every rank, raised below
            failure = err
            box = [(False, err if isinstance(err, UnsafeCheckpointError) else f"{type(err).__name__}: {err}")]
    dist.broadcast_object_list(box, src=0)
    ok, payload = box[0]
    if ok:
        return value, payload
    if failure is not None:
        raise failure
    if isinstance(payload, UnsafeCheckpointError):
        raise payload
    raise RuntimeError(f"Reading checkpoint {path} failed on rank 0 ({payload}); see rank 0's error. HINT: fix what rank 0 reports.")


def dcp_load(state: dict[str, Any], path: str | Path, weights_only: bool | None, how: str = TRAINER_HOW) -> None:
    """``dcp.load(state, path)`` with weights-only metadata and entries. A refusal on any rank reaches
    every rank: DCP gathers each rank's failure in the same collective (``CheckpointException``), and
    the refusal is raised from it everywhere."""
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path, weights_only, how),
                 planner=_WeightsOnlyLoadPlanner(str(path), weights_only, how))
    except CheckpointException as err:
        refused = next((exc for exc, _ in err.failures.values() if isinstance(exc, UnsafeCheckpointError)), None)
        if refused is not None:
            raise refused from None
        raise


__all__ = ["TRAINER_HOW", "SafeFileSystemReader", "dcp_load", "load_file", "read_metadata", "read_on_rank0", "refusal",
           "weights_only_in_effect"]
