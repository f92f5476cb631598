"""Record one forward of a model at the ATen level, with its linear layers as single nodes.

Why: which linears form a tensor-parallel pair is a property of the dataflow between them
(:mod:`~lightning_parallel.parallel.tensor.dataflow` reads it), not of their names. The forward
runs on fake tensors, over meta weights (a model built under ``init_module(empty_init=True)``)
or real ones (no arithmetic, no memory), so recording costs a few milliseconds per
block whatever the model's size. Ops that run inside a linear layer are not recorded; the
layer is one :class:`LinearCall` (input tensor -> output tensor) instead.

Inputs: a Hugging Face ``PreTrainedModel`` is called with its own ``dummy_inputs`` (token ids;
attention masks are dropped, since building a mask from values is data-dependent and meta
tensors have none), ``use_cache=False`` (a key/value cache is a second output the split keys
would reach) and, for an encoder-decoder that has none, the token ids as decoder inputs too; any
other module with Lightning's ``example_input_array``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from lightning_parallel.compat import FakeTensorMode, TorchDispatchMode, tree_flatten
from lightning_parallel.parallel.tensor.fused import is_linear_like


@dataclass(frozen=True)
class Ref:
    """A tensor in the recording: its identity in this run and its shape."""

    id: int
    shape: tuple[int, ...]


@dataclass
class OpCall:
    """One ATen call outside any linear layer: arguments with tensors as :class:`Ref` s."""

    func: Any
    args: tuple
    kwargs: dict
    outs: list[Ref | None]
    inputs: list[Ref] = field(default_factory=list)  # every tensor argument, flattened (read once per pass)


@dataclass
class LinearCall:
    """One call of a linear-like module (``nn.Linear``, Hugging Face ``Conv1D``)."""

    name: str
    input: Ref | None
    output: Ref | None


@dataclass
class Recording:
    """The calls of one forward in order, and the refs of what the forward returned."""

    calls: list[OpCall | LinearCall] = field(default_factory=list)
    outputs: list[Ref] = field(default_factory=list)


class _Recorder(TorchDispatchMode):
    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording
        self.keep: list[Tensor] = []  # every recorded tensor stays alive: ids are never reused
        self.inside_linear = 0

    def ref(self, value: Any) -> Any:
        if isinstance(value, Tensor):
            self.keep.append(value)
            return Ref(id(value), tuple(int(s) for s in value.shape))
        if isinstance(value, (list, tuple)):
            return type(value)(self.ref(v) for v in value)
        return value

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # Before the fake kernel, which refuses fp32 and has torch log each refusal at error level.
        out = _grouped_mm_shape(func, args)
        if out is None:
            out = func(*args, **kwargs)
        if not self.inside_linear:
            flat, _ = tree_flatten(out)
            inputs, _ = tree_flatten((args, kwargs))
            self.recording.calls.append(OpCall(
                func, self.ref(tuple(args)), {k: self.ref(v) for k, v in kwargs.items()},
                [self.ref(o) if isinstance(o, Tensor) else None for o in flat],
                [self.ref(t) for t in inputs if isinstance(t, Tensor)],
            ))
        return out


def _grouped_mm_shape(func: Any, args: tuple) -> Tensor | None:
    """An empty result of ``torch._grouped_mm`` (experts' grouped GEMM, GPT-OSS) where its fake kernel
    refuses the inputs (torch 2.13 accepts bf16 only there, while the CPU kernel runs fp32 too)."""
    if getattr(func, "__name__", "") != "_grouped_mm.default" or len(args) < 2:
        return None
    a, b = args[0], args[1]
    if a.dim() == 2 and b.dim() == 3:
        return a.new_empty((a.shape[0], b.shape[-1]))
    if a.dim() == 3 and b.dim() == 3:
        return a.new_empty((a.shape[0], a.shape[1], b.shape[-1]))
    return None


def _first_tensor(args: tuple, kwargs: dict) -> Tensor | None:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)


def _leaves(value: Any) -> list[Tensor]:
    """Tensors of a forward's output, Hugging Face ``ModelOutput`` (a dict) included."""
    if isinstance(value, dict):
        value = list(value.values())
    flat, _ = tree_flatten(value)
    out: list[Tensor] = []
    for leaf in flat:
        if isinstance(leaf, Tensor):
            out.append(leaf)
        elif isinstance(leaf, (dict, list, tuple)):
            out += _leaves(leaf)
    return out


def example_call(module: nn.Module) -> tuple[tuple, dict] | None:
    """(args, kwargs) to trace ``module`` with, or None when it offers none (see module doc)."""
    dummy = getattr(type(module), "dummy_inputs", None)
    if dummy is not None and any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__):
        try:
            inputs = module.dummy_inputs
        except Exception:  # noqa: BLE001 - a model whose dummy inputs cannot be built has none
            return None
        kwargs = {k: v for k, v in dict(inputs).items() if isinstance(v, Tensor) and "mask" not in k}
        accepted = inspect.signature(module.forward).parameters
        if "use_cache" in accepted:
            kwargs["use_cache"] = False
        if "decoder_input_ids" in accepted and "input_ids" in kwargs:  # an encoder-decoder needs both
            kwargs.setdefault("decoder_input_ids", kwargs["input_ids"])
        return (), kwargs
    example = getattr(module, "example_input_array", None)
    if example is None:
        return None
    if isinstance(example, dict):
        return (), dict(example)
    return (tuple(example) if isinstance(example, (tuple, list)) else (example,)), {}


def record_forward(module: nn.Module, args: tuple, kwargs: dict) -> Recording:
    """Run ``module(*args, **kwargs)`` without arithmetic and record its calls (see module doc).

    Raises whatever the forward raises (a data-dependent branch on meta values, say); the
    caller falls back to another way of planning.
    """
    recording = Recording()
    recorder = _Recorder(recording)
    names = {id(m): n for n, m in module.named_modules() if is_linear_like(m)}
    pending: dict[int, list[Ref | None]] = {}
    handles = []

    def pre(mod: nn.Module, a: tuple, kw: dict) -> None:
        x = _first_tensor(a, kw)
        pending.setdefault(id(mod), []).append(recorder.ref(x) if x is not None else None)
        recorder.inside_linear += 1

    def post(mod: nn.Module, a: tuple, kw: dict, out: Any) -> None:
        recorder.inside_linear -= 1
        y = out if isinstance(out, Tensor) else None
        recording.calls.append(LinearCall(names[id(mod)], pending[id(mod)].pop(), recorder.ref(y) if y is not None else None))

    for mod in module.modules():
        if id(mod) in names:
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(post, with_kwargs=True))
    params = list(module.parameters())
    device = params[0].device if params else torch.device("cpu")
    was_training = module.training
    try:
        module.eval()  # no dropout draws; the dataflow is the same
        # Fake tensors even over meta weights: models skip their value checks on them
        # (transformers' ``is_tracing``), which meta tensors would fail on.
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        args, kwargs = _to_device((args, kwargs), device, fake)
        with torch.no_grad(), fake, recorder:
            out = module(*args, **kwargs)
        recording.outputs = [recorder.ref(t) for t in _leaves(out)]
    finally:
        module.train(was_training)
        for h in handles:
            h.remove()
    return recording


def _to_device(value: Any, device: torch.device, fake: FakeTensorMode) -> Any:
    """The example inputs as fake tensors on the weights' device."""
    if isinstance(value, Tensor):
        return fake.from_tensor(value.to(device))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device, fake) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device, fake) for k, v in value.items()}
    return value
