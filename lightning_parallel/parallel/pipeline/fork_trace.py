"""Trace in a forked child process and ship the stage graphs back, so the tracer's heap never lands in the rank.

Why (issue 29): ``torch.export`` and the pipeline split leave resident memory behind that no
clean-up in the process gives back. Measured on a 32-block GPT (width 512, meta-built, pp4 rank 1,
one process): 56 MiB stays resident after the trace, of it 16 MiB the code of the ~370 modules
``torch.export`` imports on first use, ~13 MiB pymalloc arenas kept by fragmentation (deleting
the trace and clearing every cache frees nothing), the rest first-use caches. That put ``pp`` and
``3d`` at 0.87 of the model's fp32 parameters P per rank, against 0.75 P wanted. Traced in a child,
the same rank keeps 11 MiB (the shipped graphs), and the peaks fell to 0.77 P and 0.79 P
(docs/memory.md); the trace takes 0.7 s longer (pickling, code generated again here), once.

So the rank forks; the child traces (``fn``, any callable returning graphs and plain data) and
pickles the result into a pipe; the parent unpickles it, and the child exits, taking the
tracer's heap, imports and caches with it. What crosses the pipe:

* the module's own parameters, buffers and submodules travel by identity, not value: a forked
  child's objects have the parent's ``id``s, so the pickle names them by ``id`` and the parent
  puts its own objects back (nothing is copied, a real model's weights included);
* other tensors (constants, ``torch.export``'s copies of tied tensors) as their bytes;
* fx graphs as they are, nodes and the metadata read after the cut (not ``torch.export``'s
  provenance and debug records: :data:`_TRACE_ONLY_META`); a fake tensor in a node's ``meta["val"]`` arrives
  as a meta tensor of the same shape, strides and dtype (what the stages read from it), an ATen
  operator as its name, a ``GraphModule`` or ``torch.export`` ``InterpreterModule`` as its
  state, its code regenerated here (the child's generated functions cannot be pickled).

State the trace writes outside its result would be written in the child only: the caller registers
it first (MoE opaque op handles: :func:`~lightning_parallel.parallel.pipeline.moe.register_handles`),
or names the lists the traced forward fills (:func:`ship_back`: the output structure of a child
module's call the pipeline driver records), whose contents the child sends back with the result.
The other way round, the child must not act on the rank's own objects: the garbage collector is
frozen across the fork, so an earlier fit's process groups (whose sockets the child shares), data
loaders or files that are garbage now are not finalized in the child.

When not used (the caller then traces in-process, with the same results): not Linux (``fork``
is unsafe on macOS), CUDA initialised in this process (a forked child cannot use it), or
``LIGHTNING_PARALLEL_TRACE_IN_CHILD=0``. When the child fails, for whatever reason (an error in
the model's forward, something that cannot be pickled, killed, past ``timeout``), the caller
traces in-process, which raises the model's own error with its usual wording. A cluster's memory
limit counts the child too (its own heap: the pages it shares with the rank are not copied), but
only while it traces, before the rank holds gradients or activations; the job's peak moves only
where the tracer's heap (tens of MiB here) exceeds those.
"""

from __future__ import annotations

import gc
import io
import logging
import os
import pickle
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import fx, nn
from torch.export.unflatten import InterpreterModule

from lightning_parallel.compat import FakeTensor

log = logging.getLogger(__name__)
T = TypeVar("T")
ENV = "LIGHTNING_PARALLEL_TRACE_IN_CHILD"
_OVERLOAD = type(torch.ops.aten.linear.default)
_PACKET = type(torch.ops.aten.linear)
# GraphModule state that is the generated code or the fx machinery, rebuilt by GraphModule(root, graph);
# "forward": torch's Pipe replaces its split module's forward by a local function that refuses to run.
_GENERATED = frozenset({"forward", "_graph", "_code", "_lineno_map", "_prologue_start", "_tracer_cls", "_tracer_extras",
                        "_replace_hooks", "_create_node_hooks", "_erase_node_hooks", "_deepcopy_hooks", "shape_env"})

# Node metadata nothing reads once the stages are cut (torch.export's provenance and debug records, read by
# unflatten inside the trace; fx's shape-propagation record). Kept: "val" (torch's stages size their receive
# buffers from it), "stage_idx" (the split's) and anything else.
_TRACE_ONLY_META = frozenset({"from_node", "stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "eager_input_vals", "tensor_meta"})
_SHIP_BACK: list[list[Any]] = []  # the lists ship_back names, innermost last


@contextmanager
def ship_back(*lists: list[Any]) -> Iterator[None]:
    """Inside: a trace run in a child sends back what it put in ``lists``; they are filled here the same."""
    _SHIP_BACK.extend(lists)
    try:
        yield
    finally:
        del _SHIP_BACK[len(_SHIP_BACK) - len(lists):]


def available() -> bool:
    """Whether this process may trace in a forked child (see the module docstring)."""
    return (sys.platform.startswith("linux") and hasattr(os, "fork") and os.environ.get(ENV, "1") != "0"
            and not torch.cuda.is_initialized())


def _operator(namespace: str, name: str, overload: str | None) -> Any:
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def _meta_value(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, requires_grad: bool) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta").requires_grad_(requires_grad)


def _tensor_value(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool, parameter: bool) -> torch.Tensor:
    value = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if raw else torch.empty(shape, dtype=dtype)
    return nn.Parameter(value, requires_grad) if parameter else value.requires_grad_(requires_grad)


def _graph_module(state: dict[str, Any], graph: fx.Graph, class_name: str) -> fx.GraphModule:
    root = nn.Module()
    root.__dict__.update(state)
    module = fx.GraphModule(root, graph, class_name)
    module.__dict__.update(state)  # meta, training, hooks: as the child's module had them
    return module


def _interpreter_module(state: dict[str, Any], finalized: bool) -> InterpreterModule:
    module = InterpreterModule.__new__(InterpreterModule)
    module.__dict__.update(state)
    module.graph.owning_module = module
    if finalized:  # containers the stage never calls (``blocks``) never were
        module.finalize()  # regenerates graph_module and its code
    return module


def _new(cls: type) -> Any:
    return cls.__new__(cls)


class _Shipper(pickle.Pickler):
    def __init__(self, file: io.BytesIO, known: dict[int, Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.known = known

    def persistent_id(self, obj: Any) -> int | None:
        return id(obj) if id(obj) in self.known and self.known[id(obj)] is obj else None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _OVERLOAD):
            name, overload = obj.__name__.rsplit(".", 1)
            return _operator, (obj.namespace, name, overload)
        if isinstance(obj, _PACKET):
            namespace, name = str(obj).split(".", 1)
            return _operator, (namespace, name, None)
        if isinstance(obj, FakeTensor):
            return _meta_value, (tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.requires_grad)
        if type(obj) in (torch.Tensor, nn.Parameter) and obj.device.type == "cpu":  # a constant or export's copy of a tied
            # tensor: its bytes (torch's own reduction would torch.load them here with weights_only=False)
            flat = obj.detach().reshape(-1).contiguous()
            raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return _tensor_value, (raw, obj.dtype, tuple(obj.shape), obj.requires_grad, isinstance(obj, nn.Parameter))
        if isinstance(obj, fx.GraphModule):
            state = {k: v for k, v in vars(obj).items() if k not in _GENERATED}
            name = type(obj).__name__
            return _graph_module, (state, obj.graph, "GraphModule" if name == "GraphModuleImpl" else name)
        if isinstance(obj, InterpreterModule):
            state = {k: v for k, v in vars(obj).items() if k != "graph_module"}
            return _interpreter_module, (state, obj.__dict__.get("graph_module") is not None)
        if isinstance(obj, fx.Node):  # pickled as usual, less what only the trace read (the child's copy: gone when it exits)
            for key in _TRACE_ONLY_META.intersection(obj.meta):
                del obj.meta[key]
            return NotImplemented
        if isinstance(obj, fx.Graph):  # its module is rebuilt around it (above); state after creation: nodes point back at it
            return _new, (fx.Graph,), {k: v for k, v in vars(obj).items() if k != "_owning_module"}
        return NotImplemented


class _Receiver(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, known: dict[int, Any]) -> None:
        super().__init__(file)
        self.known = known

    def persistent_load(self, pid: Any) -> Any:
        return self.known[pid]


def _known(module: nn.Module) -> dict[int, Any]:
    objects = [*module.modules(), *(t for _, t in module.named_parameters(remove_duplicate=False)), *(t for _, t in module.named_buffers(remove_duplicate=False))]
    return {id(o): o for o in objects}


def _read(fd: int, pid: int, timeout: float) -> bytes | None:
    """Everything the child writes, or None (after killing it) past ``timeout`` seconds."""
    chunks, deadline = [], time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)
            return None
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def run_in_child(fn: Callable[[], T], module: nn.Module, timeout: float = 600.0) -> T | None:
    """``fn()`` computed in a forked child; None when that is not available or the child failed (the caller
    then runs ``fn`` itself). ``module``: the model the result refers to (its objects travel by identity)."""
    if not available():
        return None
    known = _known(module)
    read_fd, write_fd = os.pipe()
    # Garbage that exists now stays this process's: frozen objects are never collected in the child, so no
    # finalizer of this process's objects (a process group's, a data loader's) runs there.
    gc.freeze()
    try:
        pid = os.fork()
    except BaseException:
        gc.unfreeze()
        raise
    if pid != 0:
        gc.unfreeze()
    if pid == 0:  # the child: never returns, never runs the parent's exit handlers
        status = 1
        try:
            os.close(read_fd)
            buffer = io.BytesIO(b"\0")
            buffer.seek(1)
            try:
                _Shipper(buffer, known).dump((fn(), [list(filled) for filled in _SHIP_BACK]))
            except BaseException as error:  # noqa: BLE001 - any failure: the parent traces in-process (and raises the model's error)
                buffer = io.BytesIO(b"\1" + f"{type(error).__name__}: {error}"[:2000].encode(errors="replace"))
            view = memoryview(buffer.getbuffer())
            while view:
                view = view[os.write(write_fd, view):]
            status = 0  # everything written
        finally:
            os._exit(status)
    os.close(write_fd)
    try:
        data = _read(read_fd, pid, timeout)
    except BaseException:  # interrupted here: the child must not outlive the wait
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    if not data or data[:1] != b"\0" or status != 0:
        why = data[1:].decode(errors="replace") if data and data[:1] == b"\1" else f"exit status {status}, {len(data or b'')} bytes"
        log.debug("tracing in a child process failed (%s); tracing in-process", why)
        return None
    try:
        with warnings.catch_warnings():  # torch's pytree warns when its own LeafSpec is rebuilt (unpickled)
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            result, filled = _Receiver(io.BytesIO(data[1:]), known).load()
    except Exception as error:  # noqa: BLE001 - what the child sent cannot be rebuilt here: trace in-process
        log.debug("the child's trace could not be rebuilt (%s: %s); tracing in-process", type(error).__name__, error)
        return None
    for target, items in zip(_SHIP_BACK, filled, strict=True):
        target[:] = items
    return result
