"""Which values crossing a pipeline cut carry a gradient (``parallel/pipeline/cut_grads.py``).

Single process: the analysis reads traced stages and needs no process group. A Hugging Face decoder
hands each later stage the rotary ``cos``/``sin`` and the attention mask beside the hidden states;
only the hidden states carry a gradient. The analysis may over-approximate, never drop a gradient
that exists: a value made from a parameter through a module called with keyword arguments, or
from a stage input that carries one, is kept. The rank-local summaries resolved along the pipe's
wiring agree with a whole trace. The multi-process runs of every pipelined strategy (parity in
``test_hf_pp.py``, ``test_strategy_pp.py``, ``test_strategy_3d.py``; counts in ``test_tp_comms.py``)
build their stages from these flags."""

from __future__ import annotations

import torch
from torch import nn

from lightning_parallel.coverage import MODELS
from lightning_parallel.parallel.pipeline.cut_grads import resolve_cut_gradients, stage_dependencies
from lightning_parallel.parallel.pipeline.plan import plan_pipeline
from lightning_parallel.parallel.pipeline.trace import trace_pipeline
from lightning_parallel.testing.parity import _load


def _flags(model: nn.Module, x: torch.Tensor, pp: int, local: bool = False) -> dict[int, tuple[list[bool], list[bool]]]:
    plan = plan_pipeline(model, pp)
    if not local:
        traced = trace_pipeline(model, (x,), plan=plan, microbatches=2, build_eval=False)
        return resolve_cut_gradients(traced.train, {k: stage_dependencies(traced.train.get_stage_module(k)) for k in range(pp)})
    deps, pipe = {}, None
    for rank in range(pp):  # each rank's own stages, as the ranks exchange them
        traced = trace_pipeline(model, (x,), plan=plan, microbatches=2, build_eval=False, local_stages=plan.stages_for_rank(rank))
        deps.update({k: stage_dependencies(traced.train.get_stage_module(k)) for k in plan.stages_for_rank(rank)})
        pipe = traced.train
    return resolve_cut_gradients(pipe, deps)


def test_rotary_tables_and_masks_carry_no_gradient() -> None:
    for name in ("llama", "qwen2_moe"):
        spec = MODELS[name]
        torch.manual_seed(0)
        model = _load(spec.model)(**spec.model_kwargs)
        x = torch.randint(0, 32, (4, 16))
        flags = _flags(model, x, 2)
        assert flags[0] == ([False], [True, False, False, False]), (name, flags)  # hidden, cos, sin, mask
        assert flags[1] == ([True, False, False, False], [True]), (name, flags)
        assert _flags(model, x, 2, local=True) == flags, name


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.register_buffer("table", torch.arange(8.0))

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor) -> torch.Tensor:
        return x * self.scale + shift


class _Net(nn.Module):
    """Stage 0 sends: h (from a parameter), t (from a buffer only), s (a parameter through a keyword call)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.scaled = _Scaled()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        t = self.scaled.table.expand(*ids.shape, 8) * 2  # no parameter: no gradient
        s = self.scaled(torch.zeros_like(h), shift=t)  # zeros * scale + t: depends on a parameter
        for i, layer in enumerate(self.layers):
            h = layer(h) + (t if i < 2 else s)
        return h.sum(-1)


def test_parameters_behind_keyword_calls_and_buffers() -> None:
    torch.manual_seed(0)
    model = _Net()
    flags = _flags(model, torch.randint(0, 16, (4, 6)), 2)
    needs_in, needs_out = flags[1]
    sent = flags[0][1]
    assert needs_in == sent and len(sent) >= 2, flags
    # whatever the cut carries: the hidden stream and s need a gradient; the buffer-only t does not
    assert sent.count(False) == 1 and sent.count(True) == len(sent) - 1, flags
    assert needs_out == [True], flags
