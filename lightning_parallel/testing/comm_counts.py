"""Count one training step's collectives through the Trainer, against the Megatron minimum (issue 26, item 4).

Shared by ``benchmarks/bench_tp_comms.py`` (every coverage model, printed as a table) and
``tests/test_tp_comms.py`` (held to the minimum). :class:`CommCounter` is a Lightning callback:
at step :data:`MEASURED_STEP` (the second: the first traces pipeline stages) it enters
:class:`BytesCommDebugMode` (torch's ``CommDebugMode`` plus bytes, phase and the plain
``torch.distributed`` calls) and, at the batch's end, appends the counts and
:func:`stage_minimum` for this rank's stage to :data:`RESULTS`.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from lightning_parallel.compat import TorchDispatchMode, comm_mode_native_ops, in_backward, tree_flatten
from lightning_parallel.parallel.tensor.infer import recorded_linear_inputs
from lightning_parallel.parallel.tensor.styles import (
    COLWISE, COLWISE_GATHER, EMBEDDING_ROWWISE, EXPERTS, PACKED_COLWISE, ROWWISE, ROWWISE_SPLIT_INPUT,
)

MEASURED_STEP = 1  # the second step: the first traces the pipeline stages
_KINDS = {"all_reduce": "AR", "allreduce_": "AR", "allreduce_coalesced_": "AR", "all_reduce_coalesced": "AR",
          "all_gather_into_tensor": "AG", "all_gather_into_tensor_coalesced": "AG", "_allgather_base_": "AG",
          "allgather_": "AG", "allgather_coalesced_": "AG", "allgather_into_tensor_coalesced_": "AG",
          "reduce_scatter_tensor": "RS", "reduce_scatter_tensor_coalesced": "RS", "_reduce_scatter_base_": "RS",
          "reduce_scatter_": "RS", "reduce_scatter_tensor_coalesced_": "RS", "all_to_all_single": "A2A",
          "alltoall_": "A2A", "alltoall_base_": "A2A", "shard_dim_alltoall": "A2A", "broadcast": "BC",
          "broadcast_": "BC", "send": "send", "recv_": "recv", "recv_any_source_": "recv"}
_P2P = (torch.ops.c10d.send, torch.ops.c10d.recv_, torch.ops.c10d.recv_any_source_)
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor")
RESULTS: list[dict[str, Any]] = []  # what CommCounter measured in this process (read by the caller)

def _payload(value: Any) -> int:
    flat, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, Tensor))


class BytesCommDebugMode(CommDebugMode):
    """``CommDebugMode`` that also records, per collective, its bytes, its phase and whether it is a
    DTensor (functional) collective or a plain ``torch.distributed`` (c10d) one, plus the
    point-to-point sends and receives ``CommDebugMode`` does not count.

    ``track_modules=False`` leaves out ``CommDebugMode``'s module tracker (global module hooks
    that also wrap every module's inputs and outputs for backward hooks): the counts are then
    those of the code as it runs without the benchmark."""

    def __init__(self, track_modules: bool = False) -> None:
        super().__init__()
        self.track_modules = track_modules
        self.phase = "step"  # "step": forward and backward; "after": from on_before_optimizer_step on
        self.records: list[tuple[str, str, str, int]] = []  # (phase, source, kind, bytes)
        self.sites: dict[str, int] = defaultdict(int)  # plain torch.distributed calls by kind and caller

    def __enter__(self) -> BytesCommDebugMode:
        if self.track_modules:
            return super().__enter__()
        self.comm_counts.clear()
        self.advanced_module_tracker.name = "Global"
        self.advanced_module_tracker.module_parents_dict = {"Global": set()}
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args: Any) -> None:
        if self.track_modules:
            return super().__exit__(*args)
        TorchDispatchMode.__exit__(self, *args)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        packet = getattr(func, "overloadpacket", None)
        before = self.comm_counts.get(NATIVE_TO_PY.get(packet, packet), 0) if packet is not None else 0
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented or packet is None:
            return out
        counted = self.comm_counts.get(NATIVE_TO_PY.get(packet, packet), 0) != before
        if counted or packet in _P2P:
            namespace = func.namespace
            source = "dtensor" if namespace in _FUNCTIONAL_NAMESPACES else "c10d"
            phase = self.phase
            if phase == "step":  # plain calls (pipeline sends, log exchange) run between autograd passes: one phase
                phase = "step" if source == "c10d" else "bwd" if in_backward() else "fwd"
            kind = _KINDS.get(packet.__name__, packet.__name__)
            self.records.append((phase, source, kind, max(_payload(args), _payload(out))))
            if source == "c10d":
                self.sites[f"{kind} at {_call_site()}"] += 1
        return out


def _call_site() -> str:
    """The innermost caller in lightning_parallel or Lightning (what issued a plain torch.distributed call)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if ("lightning_parallel" in name or "lightning" + os.sep in name) and not name.endswith("bench_tp_comms.py"):
            short = name.split("site-packages" + os.sep)[-1].split("lightning_parallel" + os.sep)[-1]
            return f"{short}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


NATIVE_TO_PY: dict[Any, Any] = comm_mode_native_ops()


class CommCounter(pl.Callback):
    """Counts one training step's collectives (``MEASURED_STEP``) and the minimum for this rank's stage."""

    def __init__(self, model: str, layout: str, track_modules: bool = False) -> None:
        self.model, self.layout, self.track_modules = model, layout, track_modules
        self.mode: BytesCommDebugMode | None = None
        self.minimum: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx != MEASURED_STEP:
            return
        self.minimum = stage_minimum(trainer, pl_module, batch)
        self.mode = BytesCommDebugMode(self.track_modules)
        self.mode.__enter__()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.mode is not None:
            self.mode.phase = "after"

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.mode is None:
            return
        self.mode.__exit__(None, None, None)
        counts: dict[str, int] = defaultdict(int)
        for phase, source, kind, nbytes in self.mode.records:
            counts[f"{phase}/{source}/{kind}"] += 1
            counts[f"{phase}/{source}/bytes"] += nbytes
        modules = {}
        if self.track_modules:
            modules = {name: {key: {str(op).split(".")[-1]: n for op, n in ops.items()} for key, ops in entry.items()}
                       for name, entry in self.mode.comm_module_counts.items()}
        RESULTS.append({"model": self.model, "layout": self.layout, "counts": dict(counts), "minimum": self.minimum,
                         "rank": trainer.global_rank, "modules": modules, "sites": dict(self.mode.sites)})
        self.mode = None


def stage_minimum(trainer: Any, pl_module: nn.Module, batch: Any) -> dict[str, Any]:
    """The Megatron minimum (``benchmarks/bench_tp_comms.py``'s docstring) for what this rank's stage computes, per forward."""
    strategy = trainer.strategy
    plan = strategy.tensor_parallel_plan
    driver = getattr(strategy, "_pipeline", None)
    dims = strategy.parallel_dims
    microbatches, first, last = 1, True, True
    owned: set[str] | None = None
    if driver is not None:
        microbatches = int(driver.config.microbatches)
        pp_rank, pp = dims.axis("pp").get_local_rank(), dims.pp
        first, last = pp_rank == 0, pp_rank == pp - 1
        owned = driver.runtime.owned_parameter_names()
    split = {id(p) for n, p in pl_module.named_parameters() if isinstance(p, DTensor) and (owned is None or n in owned)}
    modules = dict(pl_module.named_modules())

    def is_split(module: nn.Module) -> bool:
        return any(id(p) in split for p in module.parameters())

    # A region ends in one row-parallel reduction: count the split row-parallel layers, and an MoE layer
    # with split experts once. A shared expert beside the routed ones is a region of its own: Megatron-Core's
    # SharedExpertMLP reduces its own output (its row-parallel fc2; reduce_from_tensor_model_parallel_region
    # when overlapped) and its input gradient (copy_to_tensor_model_parallel_region), and MoELayer adds it
    # to the routed experts' combined output (megatron/core/transformer/moe/shared_experts.py, moe_layer.py).
    def present(name: str) -> bool:
        return name in modules and is_split(modules[name])

    moe_layers = {name.rpartition(".")[0] for name, style in plan.styles.items() if style == EXPERTS and present(name)}
    rows = [name for name, style in plan.styles.items() if style in (ROWWISE, ROWWISE_SPLIT_INPUT) and present(name)]
    regions = len(moe_layers) + len(rows)
    # Backward: one reduction per distinct tensor the column-parallel layers read (q, k and v share
    # the normalised hidden states; a parallel block's attention and MLP share them too; every
    # decoder layer's cross-attention reads the one encoder output), from the forward the planner
    # recorded. Without a recording, one per region (the parent module of the layers).
    read = recorded_linear_inputs(pl_module)
    gathered_heads = {name for name in plan.lm_heads if plan.styles.get(name) == COLWISE_GATHER}
    columns = [name for name, style in plan.styles.items()
               if style in (COLWISE, PACKED_COLWISE, COLWISE_GATHER) and name not in gathered_heads and present(name)]
    read_once = {f"id:{i}" for name in columns for i in read.get(name, ())}
    read_once |= {f"module:{name.rpartition('.')[0]}" for name in columns if name not in read}
    embeddings = sum(1 for name, style in plan.styles.items() if style == EMBEDDING_ROWWISE and first and present(name))
    heads = sum(1 for name in gathered_heads if last and present(name))
    config = getattr(getattr(pl_module, "model", None), "config", None)
    width = int(getattr(config, "hidden_size", 0) or getattr(pl_module, "n_embd", 0))
    vocab = int(getattr(config, "vocab_size", 0) or getattr(pl_module, "vocab_size", 0))
    inputs = batch[0]
    if inputs.ndim == 4:  # images: ViT's patches plus the class token
        tokens_per_row = (inputs.shape[-1] // config.patch_size) ** 2 + 1
    else:
        tokens_per_row = inputs.shape[1]
    tokens = inputs.shape[0] * tokens_per_row // microbatches
    inputs_reduced = len(moe_layers) + len(read_once)
    counts = {"fwd_AR": regions + embeddings, "fwd_AG": heads, "fwd_RS": 0,
              "bwd_AR": inputs_reduced + heads, "bwd_AG": 0, "bwd_RS": 0}
    norm_params = norm_elements = 0
    if getattr(strategy, "sequence_parallel", False):
        counts, norm_params, norm_elements = _sequence_parallel_minimum(pl_module, plan, regions, inputs_reduced, embeddings, heads)
    # Every collective moves one activation (N x C) but the logits' all-gathers (N x V) and the norms' gradients.
    activations = sum(counts.values()) - heads - norm_params
    return {"regions": regions, "region_inputs": len(read_once), "embeddings": embeddings, "heads": heads, **counts,
            "bytes": 4 * (tokens * (width * activations + vocab * heads) + norm_elements),
            "microbatches": microbatches, "stage": "first" if first and not last else "last" if last and not first else "all",
            "tokens": tokens, "width": width, "vocab": vocab}


def _sequence_parallel_minimum(pl_module: nn.Module, plan: Any, regions: int, inputs: int, embeddings: int,
                               heads: int) -> tuple[dict[str, int], int, int]:
    """Megatron's sequence-parallel minimum for this rank's model (no pipeline: sequence parallelism is
    refused with one), and the count and elements of the replicated parameters whose gradients are all-reduced.

    Per region a reduce-scatter of its output (an all-gather of its gradient in backward), and per
    distinct tensor the regions read an all-gather of the sequence (a reduce-scatter of its gradient):
    a parallel block's attention and MLP gather their one input once. Where the stream is split: from
    the embedding (its reduce-scatter, gathered before the LM head), or, for models that read the
    sequence length, over each block stack (``sequence_stacks``: the embedding all-reduces, each
    stack's last layer gathers, each first layer's slice gathers its gradient).
    Every replicated parameter on the split stream (norms) has a partial gradient to all-reduce: one each
    here; Megatron-LM coalesces them into one flat all-reduce per step (``_allreduce_layernorm_grads`` in
    ``megatron/core/distributed/finalize_model_grads.py``), with the same bytes."""
    from torch.distributed.tensor import DTensor

    from lightning_parallel.parallel.tensor.sequence_stacks import reads_sequence_length, stack_span, whole_blocks

    if reads_sequence_length(pl_module):
        # An MoE layer with split experts runs on the gathered sequence too (``span.gathered``): a region
        # (counted in R and I) whose replicated parameters (router) compute on whole tokens. Its experts
        # all-reduce where Megatron reduce-scatters (flattened tokens): the minimum keeps Megatron's kinds.
        span = stack_span(pl_module, plan.regions, [name for name, style in plan.styles.items() if style == EXPERTS])
        whole = whole_blocks(pl_module, span.stacks, plan.regions)  # kept whole: gather their input, and its gradient, once
        replicated = [p for n, p in pl_module.named_parameters() if p.requires_grad and not isinstance(p, DTensor)
                      and n.rpartition(".")[0] in span.split]
        ends = len(span.stacks)
        # An encoder-decoder's encoder output (gathered at its stack's end) is read whole by every cross-attention:
        # its gradient is all-reduced, not reduce-scattered.
        cross = int(bool(getattr(getattr(getattr(pl_module, "model", None), "config", None), "is_encoder_decoder", False)))
        counts = {"fwd_AR": embeddings, "fwd_AG": inputs - cross + ends + heads + len(whole), "fwd_RS": regions,
                  "bwd_AR": heads + cross + len(replicated), "bwd_AG": regions + ends + len(whole), "bwd_RS": inputs - cross}
    else:
        replicated = [p for name in plan.norms for p in pl_module.get_submodule(name).parameters() if p.requires_grad]
        counts = {"fwd_AR": 0, "fwd_AG": inputs + 1 + heads, "fwd_RS": regions + embeddings,
                  "bwd_AR": len(replicated), "bwd_AG": regions + 1, "bwd_RS": inputs + heads}
    return counts, len(replicated), sum(p.numel() for p in replicated)
