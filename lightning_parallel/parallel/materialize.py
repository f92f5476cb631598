"""Materialise a model built on the meta device after its layout: each rank allocates what it holds.

A model that no single device can hold is built on the meta device (``Trainer.init_module(
empty_init=True)`` or ``with torch.device("meta")``): parameters have shapes and no storage.
The layout (tensor-parallel plan, expert sharding, FSDP2 wrapping) is applied to those meta
parameters, then :func:`materialize_meta_module` gives every meta tensor local storage of
the size this rank holds (``to_empty``: a shard for FSDP2 / DTensor parameters) and fills it.

What fills it, and what "the same init as one process" means. The initialisation replays
what one process does when it builds the model eagerly: modules in construction order
(children in registration order, then the module itself, as ``__init__`` runs), each running
its ``reset_parameters()`` (the convention Lightning's FSDP and ModelParallel strategies
follow; ``nn.MultiheadAttention``'s ``_reset_parameters``), a Hugging Face ``PreTrainedModel``
running its own ``_init_weights`` over its sub-tree once its children are built (what
``post_init`` does, nested models included, ``_is_hf_initialized`` flags respected), and a
plain module's ``init_weights()``. Every random draw happens on a *full-size temporary* of
the module's own tensors, with the random state the process had when the model was built, so
every rank draws the numbers one process draws, in the same order, and keeps its slice of
them (``distribute_tensor(..., src_data_rank=None)``: no communication). Consequences:

* every layout (dp, zero1-3, hsdp, tp, dp x tp, ep, pipeline stages) gets bit-for-bit the
  parameters of one process that builds the model eagerly from the same random state, for
  models whose construction-time init is made of those hooks (every ``torch.nn`` layer,
  Hugging Face models);
* a constructor that initialises outside those hooks (torchvision's ResNet loop of
  ``kaiming_normal_``, a zoo GPT's ``self.apply(self._init_weights)``) gets each layer's
  ``reset_parameters()`` instead: finite and standard, not the eager values;
* a tensor nothing initialises (a bare ``nn.Parameter`` in a module without
  ``reset_parameters``, a buffer computed in ``__init__``) is a ``TypeError`` naming it,
  never silent garbage (float tensors are poisoned with NaN; integer ones with a sentinel).

Why not DTensor's own random ops: on CUDA its offset-based generator gives each shard the
numbers of the full tensor, but on CPU (and for init code that is not a DTensor op) it gives
every rank the *same* numbers for its shard: the column shards of a tensor-parallel layer
would be copies of each other, halving the model's effective width. The temporaries cost
one module's own tensors at a time (the largest is usually the token embedding), never the
model; a user ``reset_parameters`` / ``init_weights`` that initialises its children gets its
sub-tree as temporaries (define it per block, not on the root, for models larger than a device).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_parallel.compat import DeviceContext, device_constructors, multihead_attention_init
from lightning_parallel.parallel.blocks import is_hf_model
from lightning_parallel.parallel.errors import config_error
from lightning_parallel.parallel.tensor.rank_order import stored_whole

_UNWRITTEN = "never initialised"
_NAN = "left NaN"


@dataclass(frozen=True)
class RngSnapshot:
    """The random state at model construction: the CPU generator and, on an accelerator, its device's."""

    cpu: Tensor
    device_type: str | None = None
    device_index: int | None = None
    device_state: Tensor | None = None

    @classmethod
    def capture(cls, device: torch.device | None = None) -> RngSnapshot:
        if device is not None and device.type == "cuda" and torch.cuda.is_available():
            index = device.index if device.index is not None else torch.cuda.current_device()
            return cls(torch.get_rng_state(), "cuda", index, torch.cuda.get_rng_state(index))
        return cls(torch.get_rng_state())

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Run with this random state; the caller's state is restored afterwards (training's
        random stream is the one it would be without the materialisation)."""
        devices = [self.device_index] if self.device_type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device_type or "cuda"):
            torch.set_rng_state(self.cpu)
            if self.device_type == "cuda" and self.device_state is not None:
                torch.cuda.set_rng_state(self.device_state, self.device_index)
            yield


@dataclass
class MaterializeReport:
    """What :func:`materialize_meta_module` did: per tensor, the hook that filled it."""

    sources: dict[str, str] = field(default_factory=dict)
    peak_temporary_bytes: int = 0
    local_bytes: int = 0
    replaced: dict[Tensor, Tensor] = field(default_factory=dict)  # in_place: tensors that had to be new objects


def _inside_metric(depth: int = 40) -> bool:
    """Whether a ``torchmetrics.Metric`` method is on the call stack (its ``__init__`` creating states)."""
    metric_cls = getattr(sys.modules.get("torchmetrics"), "Metric", None)
    if metric_cls is None:
        return False
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if isinstance(frame.f_locals.get("self"), metric_cls):
            return True
        frame = frame.f_back
    return False


class MetaInitContext(DeviceContext):
    """``torch.device("meta")`` for the model, except metric states: a torchmetrics ``Metric`` built
    inside gets its states (and the defaults ``reset()`` restores) on ``fallback`` with their values;
    they are small, no init hook would recompute them, and they are not parameters or buffers."""

    def __init__(self, fallback: torch.device) -> None:
        super().__init__("meta")
        self.fallback = torch.device(fallback)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in device_constructors() and kwargs.get("device") is None and _inside_metric():
            kwargs["device"] = self.fallback
        return super().__torch_function__(func, types, args, kwargs)


def _check_metrics(module: nn.Module) -> None:
    metric_cls = getattr(sys.modules.get("torchmetrics"), "Metric", None)
    if metric_cls is None:
        return
    for name, sub in module.named_modules():
        if isinstance(sub, metric_cls) and any(isinstance(v, Tensor) and v.is_meta for v in sub._defaults.values()):
            raise config_error(
                TypeError, "meta-device model", f"{name} ({type(sub).__name__})",
                "this torchmetrics metric was built on the meta device, so its states' initial values are lost",
                "build the module under trainer.init_module(empty_init=True) (metrics get real states there), "
                "or build the metric outside the meta-device context",
            )


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module))


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for a module that may hold meta tensors: those stay meta."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


def _tensors(module: nn.Module) -> Iterable[Tensor]:
    yield from module.parameters()
    yield from (b for b in module.buffers() if b is not None)


def _own_tensors(module: nn.Module) -> list[tuple[str, str, Tensor]]:
    """``(kind, local name, tensor)`` of the tensors registered directly on ``module``."""
    out = [("_parameters", n, t) for n, t in module._parameters.items() if t is not None]
    return out + [("_buffers", n, t) for n, t in module._buffers.items() if t is not None]


def _poison(temp: Tensor) -> Tensor:
    if temp.is_floating_point() or temp.is_complex():
        return temp.fill_(float("nan"))
    if temp.dtype != torch.bool:
        return temp.fill_(torch.iinfo(temp.dtype).min)
    return temp.zero_()


def _written_mask(temp: Tensor) -> Tensor | None:
    """Elements an init wrote (no longer the poison value); None for bool tensors (no poison exists)."""
    if temp.is_floating_point() or temp.is_complex():
        return ~temp.isnan()
    if temp.dtype != torch.bool:
        return temp != torch.iinfo(temp.dtype).min
    return None


class _Materializer:
    """One replay over a module tree; see the module docstring for the order and the rules."""

    def __init__(self, root: nn.Module, meta_names: set[str], full_shapes: dict[str, torch.Size] | None = None) -> None:
        self.root = root
        self.full_shapes = dict(full_shapes or {})  # released pipeline tensors: their shape before release
        self.paths = {id(m): p for p, m in root.named_modules(remove_duplicate=True)}
        # A tied tensor keeps the value its first owner (in module order) gives it; later owners'
        # inits still run, on a throw-away copy, so the random stream is the eager one.
        self.canonical: dict[int, str] = {}
        for path, mod in root.named_modules(remove_duplicate=False):
            for kind, name, tensor in _own_tensors(mod):
                self.canonical.setdefault(id(tensor), _join(path, name))
        canonical_names = set(self.canonical.values())
        self.meta_names = {name for name in meta_names if name in canonical_names}
        self.status: dict[str, str] = {}
        self.report = MaterializeReport()
        self._live_bytes = 0
        self._visited: set[int] = set()

    # -------------------------------------------------------------- temporaries
    @contextlib.contextmanager
    def full_copies(self, modules: list[nn.Module], source: str) -> Iterator[None]:
        """Swap the own tensors of ``modules`` for full-size poisoned temporaries; on exit copy
        each into this rank's part of the real tensor (meta-born tensors only) and put the real
        ones back."""
        saved: list[tuple[nn.Module, str, str, Tensor, Tensor]] = []
        nbytes = 0
        for mod in modules:
            for kind, name, real in _own_tensors(mod):
                local_device = real.to_local().device if isinstance(real, DTensor) else real.device
                shape = self.full_shapes.get(_join(self.paths.get(id(mod), "?"), name), real.shape)
                temp = _poison(torch.empty(shape, dtype=real.dtype, device=local_device))
                getattr(mod, kind)[name] = temp
                saved.append((mod, kind, name, real, temp))
                nbytes += temp.numel() * temp.element_size()
        self._live_bytes += nbytes
        self.report.peak_temporary_bytes = max(self.report.peak_temporary_bytes, self._live_bytes)
        try:
            yield
        finally:
            for mod, kind, name, real, _ in saved:
                getattr(mod, kind)[name] = real
            self._live_bytes -= nbytes
        for mod, _, name, real, temp in saved:  # not reached when the init raised
            fqn = _join(self.paths.get(id(mod), "?"), name)
            if fqn in self.meta_names and self.canonical.get(id(real)) == fqn:
                self._keep(fqn, real, temp, source)

    def _keep(self, fqn: str, real: Tensor, temp: Tensor, source: str) -> None:
        """Copy what the init wrote into this rank's part of ``real``. A tensor the init did not
        touch keeps its earlier value (a parent's init sees its children's tensors too); one it
        wrote in part (a padding row) gets that part; one never written whole is an error."""
        if (real.to_local() if isinstance(real, DTensor) else real).numel() == 0 and temp.numel() > 0:
            self.status[fqn] = "ok"  # released: another pipeline stage owns it (its init still ran, for the stream)
            return
        written = _written_mask(temp)
        if written is None or bool(written.all()):
            _copy_into(real, temp)
            self.status[fqn] = "ok"
            self.report.sources[fqn] = source
        elif bool(written.any()):
            _copy_into(real, temp, written)
            self.status[fqn] = self.status.get(fqn, _NAN)
            self.report.sources.setdefault(fqn, source)

    def subtree(self, module: nn.Module) -> list[nn.Module]:
        return list({id(m): m for m in module.modules()}.values())

    # -------------------------------------------------------------- replay
    def replay(self, module: nn.Module) -> None:
        if id(module) in self._visited:  # a module registered twice is built once
            return
        self._visited.add(id(module))
        for child in module.children():
            self.replay(child)
        kind = type(module).__name__
        reset = _callable_without_args(module, "reset_parameters")
        if isinstance(module, nn.MultiheadAttention):  # torch's own init is private here
            reset = multihead_attention_init(module)
        if (constructor := _CONSTRUCTOR_INITS.get(f"{type(module).__module__}.{type(module).__qualname__}")) is not None:
            reset = lambda: constructor(module)  # noqa: E731
        if reset is not None:
            deep = any(True for c in module.children() for _ in _tensors(c))
            with self.full_copies(self.subtree(module) if deep else [module], f"{kind}.reset_parameters"):
                reset()
        if is_hf_model(module):
            self.hf_init(module)
        elif (init := _callable_without_args(module, "init_weights")) is not None and not _is_lightning_module(module):
            with self.full_copies(self.subtree(module), f"{kind}.init_weights"):
                init()

    def hf_init(self, model: nn.Module) -> None:
        """What ``PreTrainedModel.post_init`` -> ``initialize_weights`` does, one module at a time:
        children before parents, a nested model's own ``_init_weights`` in its sub-tree, modules
        flagged ``_is_hf_initialized`` (by a nested model's earlier init) skipped."""
        from transformers import initialization as hf_initialization

        custom = bool(getattr(model, "is_custom_code", lambda: False)())

        def visit(mod: nn.Module, owner: nn.Module) -> None:
            for child in mod.children():
                visit(child, child if is_hf_model(child) else owner)
            if getattr(mod, "_is_hf_initialized", False):
                return
            # An init may write its direct children's tensors (GPT-2's attention scales c_proj.weight,
            # MultiheadAttention zeroes out_proj.bias); containers and nested models do not.
            container = isinstance(mod, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or is_hf_model(mod)
            scope = [mod] if container else [mod, *mod.children()]
            with self.full_copies(scope, f"{type(owner).__name__}._init_weights"):
                owner._initialize_weights(mod, custom)

        with hf_initialization.guard_torch_init_functions():
            visit(model, model)


def _conv1d_init(module: nn.Module) -> None:
    """``transformers.pytorch_utils.Conv1D.__init__`` (GPT-2's linear layers): zeros bias, then
    ``normal_(weight, std=0.02)``, in its constructor rather than in a ``reset_parameters``."""
    nn.init.zeros_(module.bias)
    nn.init.normal_(module.weight, std=0.02)


# Library layers whose constructor draws its init outside any hook: replayed as written there.
_CONSTRUCTOR_INITS: dict[str, Callable[[nn.Module], None]] = {"transformers.pytorch_utils.Conv1D": _conv1d_init}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _callable_without_args(module: nn.Module, name: str) -> Callable[[], object] | None:
    fn = getattr(module, name, None)
    if not callable(fn):
        return None
    try:
        required = [p for p in inspect.signature(fn).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return fn
    return None if required else fn


def _is_lightning_module(module: nn.Module) -> bool:
    return any(c.__name__ == "LightningModule" for c in type(module).__mro__)


def _copy_into(real: Tensor, full: Tensor, mask: Tensor | None = None) -> None:
    """Write this rank's part of ``full`` (where ``mask``, if given) into ``real``: a plain tensor,
    or a DTensor of any placements (FSDP2 shards, tensor-parallel shards, expert blocks, replicas)."""
    with torch.no_grad():
        if isinstance(real, DTensor):
            mesh, placements = real.device_mesh, real.placements
            # A rank-ordered parameter (Phi-3's qkv_proj under tp) takes its rows in its stored order.
            part = distribute_tensor(stored_whole(real, full), mesh, placements, src_data_rank=None).to_local()
            target = real.to_local()
            if mask is not None:
                split_mask = distribute_tensor(stored_whole(real, mask), mesh, placements, src_data_rank=None)
                part = torch.where(split_mask.to_local(), part, target)
            target.copy_(part)
        else:
            real.copy_(full if mask is None else torch.where(mask, full, real))


def _tied_groups(module: nn.Module) -> list[list[tuple[str, str, str]]]:
    """``(module path, kind, name)`` groups that share one tensor."""
    owners: dict[int, list[tuple[str, str, str]]] = {}
    for path, mod in module.named_modules(remove_duplicate=False):
        for kind, name, tensor in _own_tensors(mod):
            owners.setdefault(id(tensor), []).append((path, kind, name))
    return [group for group in owners.values() if len(group) > 1]


def _retie(module: nn.Module, groups: list[list[tuple[str, str, str]]]) -> None:
    for (path, kind, name), *others in groups:
        shared = getattr(module.get_submodule(path), kind)[name]
        for other_path, other_kind, other_name in others:
            getattr(module.get_submodule(other_path), other_kind)[other_name] = shared


def _allocate_in_place(module: nn.Module, device: torch.device, also: Sequence[nn.Module]) -> dict[Tensor, Tensor]:
    """Give every meta tensor storage on ``device`` keeping its Python object (``swap_tensors``), so
    every holder (pipeline stage modules, an optimizer built before, tied aliases) sees it. A tensor
    that cannot be swapped (a weak reference to it exists) is replaced by a new one in ``module``
    and ``also``; the returned ``{old: new}`` tells the caller what else to re-point (optimizers)."""
    replaced: dict[Tensor, Tensor] = {}
    for tensor in {id(t): t for t in _tensors(module)}.values():
        if not tensor.is_meta:
            continue
        new = torch.empty_like(tensor, device=device)
        if isinstance(tensor, nn.Parameter):
            new = nn.Parameter(new, requires_grad=tensor.requires_grad)
        try:
            torch.utils.swap_tensors(tensor, new)
        except RuntimeError:
            replaced[tensor] = new
    if replaced:
        by_id = {id(old): new for old, new in replaced.items()}
        for root in (module, *also):
            for mod in root.modules():
                for kind in ("_parameters", "_buffers"):
                    slots = getattr(mod, kind)
                    for name, value in slots.items():
                        if value is not None and id(value) in by_id:
                            slots[name] = by_id[id(value)]
    return replaced


def materialize_meta_module(
    module: nn.Module, device: torch.device, rng: RngSnapshot | None = None, buffer_device: torch.device | None = None,
    in_place: bool = False, also: Sequence[nn.Module] = (), full_shapes: dict[str, torch.Size] | None = None,
) -> MaterializeReport:
    """Allocate this rank's part of every meta tensor of ``module`` on ``device`` and initialise
    it as one process building the model eagerly would (see the module docstring).

    ``rng``: the random state the model was built with (the strategy records it when its
    ``tensor_init_context`` is entered); default, the current state. ``buffer_device``: where
    buffers live when parameters do not (FSDP2 CPU offload: parameters on the CPU, buffers on
    the accelerator); default ``device``. ``in_place``: keep each tensor's Python object (for
    pipeline stages sharing the module's parameters; not for FSDP2 modules, whose ``_apply``
    re-registers its shards); ``also``: other module trees holding the same tensors (pipeline
    stages), updated where a tensor had to be replaced (``report.replaced``); ``full_shapes``: the
    shapes of tensors a pipeline rank released (their init still runs, on full-size temporaries). Tensors whose local part is empty (released by a pipeline rank)
    stay empty. A no-op without meta
    tensors. Runs no collective; raises ``TypeError`` naming every tensor nothing initialised.
    """
    report = MaterializeReport()
    if not has_meta_tensors(module):
        return report
    _check_metrics(module)
    born_meta = {_join(p, n) for p, m in module.named_modules(remove_duplicate=False) for _, n, t in _own_tensors(m) if t.is_meta}
    replaced: dict[Tensor, Tensor] = {}
    if in_place:
        replaced = _allocate_in_place(module, device, also)
    else:
        ties = _tied_groups(module)
        module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
        _retie(module, ties)  # _apply allocates per owner: a tied parameter would become two
    work = _Materializer(module, born_meta, full_shapes)  # tensor identities are read after _apply (buffers are new objects)
    work.report.replaced = replaced
    for mod in module.modules():  # what a nested Hugging Face model's init marks done
        mod.__dict__.pop("_is_hf_initialized", None)
    with (rng or RngSnapshot.capture(device)).applied(), torch.no_grad():
        work.replay(module)
    bad = {name: work.status.get(name, _UNWRITTEN) for name in sorted(work.meta_names)}
    bad = {name: why for name, why in bad.items() if why != "ok"}
    if bad:
        owners = sorted({type(module.get_submodule(n.rpartition(".")[0])).__name__ for n in bad})
        raise config_error(
            TypeError, "meta-device model", type(module).__name__,
            f"tensors {list(bad.items())[:6]} ({len(bad)} in all, in modules {owners[:6]}) are not initialised by any "
            "reset_parameters(), Hugging Face _init_weights or init_weights() after the model was built on the meta device",
            f"give {owners[0]} a reset_parameters() that initialises its own parameters and buffers (Lightning's "
            "convention), build the model without init_module(empty_init=True), or load weights after set-up",
        )
    if buffer_device is not None and buffer_device != device:
        for mod in module.modules():
            for name, buf in mod._buffers.items():
                if buf is not None and not isinstance(buf, DTensor):
                    mod._buffers[name] = buf.to(buffer_device)
    work.report.local_bytes = sum(
        (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().nbytes() for t in {id(t): t for t in _tensors(module)}.values()
    )
    return work.report


__all__ = ["MaterializeReport", "MetaInitContext", "RngSnapshot", "has_meta_tensors", "materialize_meta_module", "move_real_tensors"]
