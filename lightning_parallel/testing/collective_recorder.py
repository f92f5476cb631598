"""Which device each collective's tensors would live on in a CUDA run, checked on a CPU machine.

NCCL rejects CPU tensors. On a CPU test machine every tensor is on ``"cpu"``, so comparing
``tensor.device`` with the group's device proves nothing. This module simulates the CUDA run's
devices instead, in three parts:

1. **The root device becomes ``cpu:0``** (:data:`ROOT`), standing in for ``cuda:<local_rank>``:
   the strategy's ``root_device`` returns it, and ``tensor.device`` read *from lightning_parallel's
   own code* returns it for every tensor not marked CPU, so ``torch.zeros((), device=p.device)``
   or ``device=self.root_device`` is "on the GPU" while ``torch.zeros(())``, ``device="cpu"``,
   ``torch.device("cpu")`` and ``.cpu()`` are not, exactly as on CUDA. The torch call itself
   receives the plain CPU in ROOT's place (``.to(cpu:0)`` would copy a CPU tensor, untying tied
   weights, where the simulated move to the device a tensor is on is a no-op).
2. **A device mark propagated through ops** (:class:`DeviceTaintMode`, a ``TorchFunctionMode``):
   a tensor that a CUDA run would hold on the CPU carries the attribute ``_lp_would_be_cpu``.
   It is set where lightning_parallel creates a tensor without a device or with a plain CPU one
   (factories, ``torch.tensor``/``from_numpy``), by ``.cpu()`` anywhere, by ``.to(<cpu>)`` in
   lightning_parallel, and by :func:`mark_cpu` (the test marks offloaded gradients with it); every
   other op's result is CPU iff all its tensor inputs are (a CUDA op mixing a CPU scalar with a
   GPU tensor yields a GPU tensor). Tensors torch or Lightning create without a device inside
   their own code are taken to be where their authors put them on CUDA (their device argument
   comes from a mesh's ``device_type``, ``"cpu"`` here but ``"cuda"`` there): torch is tested on
   CUDA, this package is what is under test.
3. **Every collective entry point is wrapped** (:class:`CollectiveRecorder`): the
   ``torch.distributed`` functions (tensor, object, point-to-point and ``batch_isend_irecv``
   forms) and the functional collectives DTensor uses (``_functional_collectives``), recorded
   once per outermost call with the call site in lightning_parallel, the group's ranks, the
   simulated CUDA backend of the group (what ``default_backend`` would choose on CUDA:
   ``nccl``, or ``cuda:nccl,cpu:gloo`` with ``cpu_offload``; mesh sub-groups inherit it) and each
   tensor's would-be device. A CPU tensor on a group whose CUDA backend has no CPU backend is a
   violation.

Not seen: collectives torch issues from C++ (DDP's bucketed all-reduce, FSDP2 or DTensor paths
that call ``torch.ops._c10d_functional`` directly); their buffers are torch's own, on the
parameters' device. ``docs/collectives.md`` lists every call site and which test covers it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

from lightning_parallel.compat import (
    functional_collectives as funcol,
    local_tensor,
    parse_to,
    parse_to_device,
    resolve_process_group,
)
from lightning_parallel.strategies.process_group import backend_serves_cpu

ROOT = torch.device("cpu", 0)
"""Stands for ``cuda:<local_rank>``: an index tells it apart from a plain CPU device."""

MARK = "_lp_would_be_cpu"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TESTING = os.path.join(_PACKAGE, "testing") + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DEVICE_GETTER = torch.Tensor.device.__get__
_CPU = torch.device("cpu")
_KEEP_ROOT = (parse_to, torch.device)
"""Functions that see ROOT itself: a device built from ROOT, and ``parse_to`` (Lightning reads a
module's device from it); every other torch call gets the plain CPU in its place."""

C10D_COLLECTIVES: tuple[str, ...] = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_coalesced", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
    "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier", "monitored_barrier", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list", "gather_object",
    "scatter_object_list", "send_object_list", "recv_object_list",
)
"""``torch.distributed`` functions wrapped (those this torch has)."""

FUNCTIONAL_COLLECTIVES: tuple[str, ...] = (
    "all_reduce", "all_reduce_inplace", "all_reduce_coalesced", "all_gather_tensor", "all_gather_tensor_autograd",
    "all_gather_single", "all_gather_single_autograd", "all_gather_inplace", "all_gather_tensor_inplace",
    "all_gather_into_tensor_coalesced", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
    "reduce_scatter_single", "reduce_scatter_single_autograd", "reduce_scatter_tensor_coalesced", "all_to_all_single",
    "all_to_all_single_autograd", "broadcast", "permute_tensor",
)
"""``torch.distributed._functional_collectives`` functions wrapped (DTensor's redistributions)."""


def mark_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` (and a DTensor's local shard) as held on the CPU in a CUDA run (offload)."""
    setattr(tensor, MARK, True)
    local = local_tensor(tensor)
    if isinstance(local, torch.Tensor):
        setattr(local, MARK, True)
    return tensor


def would_be_cpu(tensor: torch.Tensor) -> bool:
    """Whether a CUDA run would hold ``tensor`` on the CPU (per the marks above)."""
    if getattr(tensor, MARK, False):
        return True
    local = local_tensor(tensor)
    return isinstance(local, torch.Tensor) and bool(getattr(local, MARK, False))


_WRAPPERS = tuple(os.path.join(_TORCH, *f.split("/")) for f in (
    "_tensor.py", "overrides.py", "functional.py", "nn/functional.py", "_jit_internal.py", "_ops.py", "utils/_device.py",
    "fx/experimental/proxy_tensor.py", "_export/non_strict_utils.py",
))
"""torch's Python wrappers between a caller and the mode (``Tensor.__add__``, ``F.cross_entropy``,
``handle_torch_function``, other modes' handlers): the caller is the frame above them."""


def _caller_file() -> str:
    """File of the code that called the torch function the mode is handling."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return ""
        name = frame.f_code.co_filename
        if name != __file__ and name not in _WRAPPERS:
            return name
        frame = frame.f_back
    return ""


def _tensors(values: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


class DeviceTaintMode(TorchFunctionMode):
    """Propagates the would-be-CPU mark and answers ``tensor.device`` as a CUDA run would (see
    the module docstring). ``scope``: path prefixes of the code under test (lightning_parallel
    without its ``testing`` helpers, unless more are given)."""

    def __init__(self, scope: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.scope = (_PACKAGE, *scope)

    def in_scope(self, filename: str) -> bool:
        if not filename.startswith(self.scope):
            return False
        return not filename.startswith(_TESTING) or any(filename.startswith(s) for s in self.scope[1:])

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func == _DEVICE_GETTER:
            device = func(*args)
            if device.type == "cpu" and self.in_scope(_caller_file()):
                return _CPU if would_be_cpu(args[0]) else ROOT
            return device
        if func not in _KEEP_ROOT and any(a == ROOT for a in (*args, *kwargs.values()) if isinstance(a, torch.device)):
            # the real call gets the plain CPU: ``.to(cpu:0)`` would copy a CPU tensor (and untie
            # tied weights) where the simulated CUDA move to the device it is on is a no-op
            args = tuple(_CPU if isinstance(a, torch.device) and a == ROOT else a for a in args)
            kwargs = {k: _CPU if isinstance(v, torch.device) and v == ROOT else v for k, v in kwargs.items()}
            root_move = True
        else:
            root_move = False
        out = func(*args, **kwargs)
        outs = [out] if isinstance(out, torch.Tensor) else _tensors([out]) if isinstance(out, (list, tuple)) else []
        if not outs:
            return out
        inputs = _tensors(args) + _tensors(kwargs.values())
        cpu = False if root_move and ("device" in kwargs or _is_move(func)) else self._result_is_cpu(func, args, kwargs, inputs)
        if cpu is None:
            return out
        if any(o is i for o in outs for i in inputs):
            if _is_move(func) and args and out is args[0] and would_be_cpu(out) != cpu:
                if isinstance(out, torch.nn.Parameter):
                    return out  # Module.to swaps .data in place: a copy would untie tied weights
                out = out.clone()  # a CUDA move copies; a no-op move here would re-mark its source
            else:
                return out  # in place: the tensor stays where it is
        for tensor in ([out] if isinstance(out, torch.Tensor) else outs):
            if cpu:
                setattr(tensor, MARK, True)
            elif getattr(tensor, MARK, False):
                setattr(tensor, MARK, False)
        return out

    def _result_is_cpu(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: list[torch.Tensor]) -> bool | None:
        """True / False: the result's would-be device; None: leave the result unmarked as is."""
        name = getattr(func, "__name__", "")
        if name == "cpu" and inputs:
            return True
        device: Any = kwargs.get("device")
        if name == "to" and inputs and args and args[0] is inputs[0]:
            try:
                device = parse_to_device(*args[1:], **kwargs)
            except (TypeError, RuntimeError):
                device = None
        if device is not None:
            cpu = self._device_is_cpu(device)
            if cpu is not None:
                return cpu
        if not inputs:  # a factory with no device: the default device, the CPU on CUDA too
            return True if self.in_scope(_caller_file()) and torch.get_default_device().type == "cpu" else None
        return all(would_be_cpu(t) for t in inputs)

    def _device_is_cpu(self, device: Any) -> bool | None:
        if isinstance(device, int):
            return False  # a CUDA ordinal
        try:
            device = torch.device(device)
        except (TypeError, RuntimeError):
            return None
        if device.type != "cpu":
            return False  # meta (or an accelerator): not a host tensor
        if device.index is not None:
            return False  # ROOT: the simulated GPU
        return True if self.in_scope(_caller_file()) else None  # torch's "cpu" is a mesh's device_type


def _is_move(func: Any) -> bool:
    return getattr(func, "__name__", "") in ("cpu", "to")


@dataclass
class CollectiveCall:
    """One recorded collective (outermost call only)."""

    op: str  # "torch.distributed.all_reduce", "funcol.all_gather_tensor", ...
    site: str  # innermost frame in lightning_parallel ("strategies/collectives.py:60 reduce_boolean_decision")
    direct: bool  # the collective was called from that frame itself (not through torch/Lightning)
    via: str  # the frame that called the collective
    ranks: tuple[int, ...]
    backend: str  # the group's simulated CUDA backend
    devices: tuple[str, ...]  # each tensor's would-be device: "cuda" or "cpu"
    shapes: tuple[tuple[int, ...], ...] = field(default_factory=tuple)

    @property
    def violation(self) -> bool:
        """A CPU tensor handed to a group that has no CPU backend on CUDA."""
        return "cpu" in self.devices and not backend_serves_cpu(self.backend)

    def describe(self) -> str:
        return f"{self.op} at {self.site} (via {self.via}) ranks={list(self.ranks)} backend={self.backend} devices={list(self.devices)}"


def _frame_name(frame: Any) -> str:
    name = frame.f_code.co_filename
    short = name[len(_PACKAGE):] if name.startswith(_PACKAGE) else name.split("site-packages" + os.sep)[-1]
    return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"


def _outside_recorder(frame: Any) -> Any:
    """The first frame not in this module (a collective torch runs inside the mode's handler)."""
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame


def _group_ranks(group: Any) -> tuple[int, ...]:
    try:
        if group is None:
            return tuple(range(dist.get_world_size()))
        if isinstance(group, dist.ProcessGroup):
            return tuple(dist.get_process_group_ranks(group))
        if isinstance(group, tuple) and len(group) == 2:  # DTensor: (mesh, mesh_dim)
            return tuple(dist.get_process_group_ranks(group[0].get_group(group[1])))
        if isinstance(group, str):
            return tuple(dist.get_process_group_ranks(resolve_process_group(group)))
        if hasattr(group, "get_group"):  # a 1-D DeviceMesh
            return tuple(dist.get_process_group_ranks(group.get_group()))
        if isinstance(group, list):
            return tuple(int(r) for r in group)
    except Exception:  # a group this rank is not in, a torch-version difference: ranks unknown
        pass
    return ()


class CollectiveRecorder:
    """Wraps every collective entry point and records :class:`CollectiveCall` s (see module doc).

    ``cuda_backend``: the world's backend in the simulated CUDA run; None takes what the
    strategy's ``default_backend`` would choose for CUDA (captured when it is called)."""

    def __init__(self, cuda_backend: str | None = None) -> None:
        self.cuda_backend = cuda_backend
        self.calls: list[CollectiveCall] = []
        self._local = threading.local()
        self._undo: list[Callable[[], None]] = []

    # -------------------------------------------------------------- patching
    def _patch(self, owner: Any, name: str, value: Any) -> None:
        old = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def install(self) -> None:
        for name in C10D_COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = self._wrap(original, f"torch.distributed.{name}")
            self._patch(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                self._patch(dist, name, wrapped)
        for name in FUNCTIONAL_COLLECTIVES:
            original = getattr(funcol, name, None)
            if original is not None:
                self._patch(funcol, name, self._wrap(original, f"funcol.{name}"))
        self._capture_default_backend()

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _capture_default_backend(self) -> None:
        """The strategy asks ``default_backend(root_device, cpu_offload)``; record what the same
        call answers for a CUDA device, and return the real answer for this machine."""
        from lightning_parallel.strategies import hybrid, process_group

        original = process_group.default_backend

        def default_backend(device: torch.device, cpu_offload: bool) -> str:
            if self.cuda_backend is None:
                self.cuda_backend = original(torch.device("cuda", 0), cpu_offload)
            return original(torch.device("cpu") if device.type == "cpu" else device, cpu_offload)

        self._patch(hybrid, "default_backend", default_backend)

    # -------------------------------------------------------------- recording
    def _wrap(self, original: Callable[..., Any], label: str) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self._record(label, signature, args, kwargs, sys._getframe(1))
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        return wrapper

    def _record(self, label: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any], caller: Any) -> None:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = dict(kwargs)
        tensors: list[torch.Tensor] = []
        group = bound.get("group", bound.get("pg"))
        for key, value in bound.items():
            if key in ("group", "pg") or key.endswith("_list") and "object" in label:
                continue
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, torch.Tensor):
                        tensors.append(item)
                    elif isinstance(item, dist.P2POp):
                        tensors.append(item.tensor)
                        group = item.group if group is None else group
                    elif isinstance(item, (list, tuple)):
                        tensors.extend(t for t in item if isinstance(t, torch.Tensor))
        site, direct = self._site(caller)
        self.calls.append(CollectiveCall(
            op=label, site=site, direct=direct, via=_frame_name(_outside_recorder(caller)), ranks=_group_ranks(group),
            backend=self._backend(),
            devices=tuple("cpu" if would_be_cpu(t) else "cuda" for t in tensors),
            shapes=tuple(tuple(t.shape) for t in tensors),
        ))

    def _backend(self) -> str:
        if self.cuda_backend is not None:
            return self.cuda_backend
        return str(dist.get_backend()) if dist.is_initialized() else "unknown"

    @staticmethod
    def _site(caller: Any) -> tuple[str, bool]:
        frame, direct = caller, True
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(_PACKAGE) and not name.endswith("collective_recorder.py"):
                return _frame_name(frame), direct
            direct = False
            frame = frame.f_back
        return "outside lightning_parallel", False

    def violations(self) -> list[CollectiveCall]:
        return [call for call in self.calls if call.violation]


_UNSEEN_FACTORIES = ("from_numpy", "frombuffer")


def _marking_factory(factory: Callable[..., torch.Tensor], mode: DeviceTaintMode) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = factory(*args, **kwargs)
        if mode.in_scope(_caller_file()):
            setattr(out, MARK, True)  # host memory, in a CUDA run as well
        return out

    return wrapper


@contextlib.contextmanager
def simulate_cuda_devices(cuda_backend: str | None = None, scope: tuple[str, ...] = ()) -> Iterator[CollectiveRecorder]:
    """Record collectives as a CUDA run would see them, for the code run inside (one process).

    Installs the recorder, gives ``HybridParallelStrategy`` the simulated GPU :data:`ROOT` as its
    root device and enters :class:`DeviceTaintMode` (on this thread)."""
    from lightning_parallel.strategies.hybrid import HybridParallelStrategy

    recorder = CollectiveRecorder(cuda_backend)
    recorder.install()
    recorder._patch(HybridParallelStrategy, "root_device", property(lambda self: ROOT))
    mode = DeviceTaintMode(scope)
    for name in _UNSEEN_FACTORIES:  # factories a TorchFunctionMode does not see
        recorder._patch(torch, name, _marking_factory(getattr(torch, name), mode))
    try:
        with mode:
            yield recorder
    finally:
        recorder.uninstall()
