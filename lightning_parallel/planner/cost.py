"""Per-rank memory and step time of one layout: the planner's cost model.

Memory (bytes on the busiest rank): parameters, gradients and optimizer state as the layout
shards them (tensor split from the tp plan, stage split from the pipeline plan, experts over
``ep``, ZeRO stage over the data-parallel shard axis, CPU offload), working copies FSDP gathers,
DDP's gradient buckets, activations of the microbatches a schedule keeps in flight (with or
without activation checkpointing; Korthikanti et al. 2022, arXiv 2205.05198, section 4, without
the dropout masks where the model has no dropout, plus ``a s^2 b / t`` softmax outputs where
attention keeps its scores: the math kernel, which tensor parallelism runs on CPU), and the
logits of the last stage. DDP adds no buckets (its gradients are bucket views). Checked against
an exact live-tensor-bytes count of six 2-rank layouts (tests/test_planner_peak_memory.py).

Step time (seconds, slowest rank): compute from FLOPs (``6 N`` per token for the matmuls the
rank runs plus ``12 s h`` per token per layer for attention, one more forward under activation
checkpointing), tensor-parallel all-reduces (4 per layer per microbatch, on the critical path),
expert all-to-alls, the pipeline bubble of the schedule (``(p - 1) / m`` of the pipelined time,
``/ v`` interleaved), point-to-point transfers, the data-parallel gradient reduction and ZeRO
gathers less what overlaps with the backward, the optimizer step (memory-bound) and CPU offload
transfers. A collective over ``n`` ranks costs ``2 (n-1)/n x bytes / bandwidth + 2 log2(n) x latency``
(ring all-reduce bandwidth; the latency of ``2 log2(n)`` steps,
as tree and hierarchical algorithms take at scale); the link is NVLink-class inside a node and the NIC across nodes, decided from
where the group's ranks sit in the mesh order ``pp, dp_replicate, dp_shard, cp, tp``.

Context parallelism (``cp``) prices every per-token quantity above at the rank's ``seq_len / cp``
tokens, attention as local queries over all keys, the gradient reduction and ZeRO over ``dp x cp``,
and adds the key/value exchange of each block (:mod:`~lightning_parallel.planner.context_cost`).

Costs a profile may carry beyond bandwidth and latency, measured on CPU machines by
:mod:`~lightning_parallel.planner.calibrate` (zero in the GPU profiles, whose published-run
checks were made without them): all-gather and reduce-scatter cost per byte against the ring
formula (``collective_scale``); each FSDP2 unit's own per-step work (``fsdp_unit_overhead`` per
unit plus ``fsdp_tensor_overhead`` per parameter tensor, not hidden by anything: it runs on the
training thread); each column+row tensor-parallel pair's
DTensor work (``tp_pair_overhead``); the latency of one of ZeRO-1's per-parameter broadcasts in
its asynchronous stream (``pipelined_latency``); and how much collective time hides under the
backward at all (``comm_overlap``: none when the ranks already use every core).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from lightning_parallel.planner.collectives import collective_time as _ring
from lightning_parallel.planner.context_cost import context_comm_time, context_memory
from lightning_parallel.planner.hardware import GiB, HardwareProfile
from lightning_parallel.planner.model import ModelFacts, RankShare

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 0, "sgd_momentum": 4}


@dataclass(frozen=True)
class Layout:
    """One candidate: every degree and option the strategy takes."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int = 1
    zero_stage: int = 0
    activation_checkpointing: bool = False
    microbatches: int = 1
    schedule: str = "none"
    virtual_stages: int = 1
    cpu_offload: bool = False
    sequence_parallel: bool = False
    # Block recomputation (Megatron-LM's ``--recompute-method block --recompute-num-layers``): only
    # the first k blocks of each pipeline rank are checkpointed. Our strategy checkpoints all blocks
    # or none, so the planner searches this only when asked (SearchSpace.partial_recompute), to
    # model engines that offer it; a layout with k > 0 has no strategy_kwargs equivalent.
    recompute_layers: int = 0
    # Context parallelism: ranks that split every sequence (they see the same samples, so ``dp`` stays
    # the sampler's count); ``world = dp x cp x tp x pp``; gradients and ZeRO over ``dp x cp``.
    cp: int = 1
    cp_attention: str = "allgather"  # the strategy's context_parallel_attention: "allgather" or "ring"

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def grad_ranks(self) -> int:
        """Ranks holding different gradients of the same parameters: ``dp x cp`` (the ``dp_cp`` axis)."""
        return self.dp * self.cp

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def model_axes(self) -> int:
        """How many model-parallel axes (tp, pp, ep) are above 1."""
        return sum(1 for d in (self.tp, self.pp, self.ep) if d > 1)

    def describe(self) -> str:
        dp = f"dp{self.dp}" if self.dp_replicate == 1 or self.dp_shard == 1 else f"dp{self.dp_replicate}x{self.dp_shard}"
        parts = [dp] + ([f"cp{self.cp}"] if self.cp > 1 else []) + [f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        text = " x ".join(parts) + f" zero{self.zero_stage}"
        if self.cp > 1:
            text += f" {self.cp_attention}"
        if self.sequence_parallel:
            text += " sp"
        if self.activation_checkpointing:
            text += " ac"
        elif self.recompute_layers:
            text += f" ac{self.recompute_layers}/rank"
        if self.cpu_offload:
            text += " offload"
        if self.pp > 1:
            text += f" {self.schedule}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "") + f" m{self.microbatches}"
        return text

    def strategy_kwargs(self) -> dict[str, object]:
        """The ``HybridParallelStrategy`` keyword arguments that give this layout."""
        out: dict[str, object] = {
            "data_parallel_size": self.dp, "tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp,
            "expert_parallel_size": self.ep, "zero_stage": self.zero_stage,
            "activation_checkpointing": self.activation_checkpointing, "cpu_offload": self.cpu_offload,
            "sequence_parallel": self.sequence_parallel,
        }
        if self.dp_replicate > 1 and self.dp_shard > 1:
            out.update(hybrid_shard=True, data_parallel_replicate_size=self.dp_replicate)
        if self.cp > 1:
            out.update(context_parallel_size=self.cp, context_parallel_attention=self.cp_attention)
        if self.pp > 1:
            out.update(pipeline_schedule=self.schedule, microbatches=self.microbatches, virtual_stages=self.virtual_stages)
        if self.recompute_layers and not self.activation_checkpointing:
            # Not an option of HybridParallelStrategy: kept so that passing these kwargs fails loudly
            # (TypeError) instead of silently training without the recomputation the prediction assumed.
            out["recompute_layers"] = self.recompute_layers
        return out


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes, and in which precision."""

    global_batch: int  # sequences (samples) per optimizer step
    seq_len: int
    dtype: str = "bf16"  # compute dtype
    param_dtype_bytes: int = 4  # master weights
    grad_bytes: int = 4  # gradients are reduced in fp32
    optimizer: str = "adamw"

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


@dataclass
class Prediction:
    """Predicted peak bytes per rank and step seconds, each with its parts (for the table and JSON)."""

    layout: Layout
    memory: dict[str, float]
    time: dict[str, float]
    model_flops: float  # 6N + attention per step, no recompute (MFU convention)
    world: int
    tokens: int
    fits: bool = True
    reason: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> float:
        return self.memory["total"]

    @property
    def step_time(self) -> float:
        return self.time["total"]

    @property
    def tflops_per_device(self) -> float:
        return self.model_flops / self.step_time / self.world / 1e12

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens / self.step_time / self.world

    def to_dict(self) -> dict[str, object]:
        return {
            "layout": asdict(self.layout), "describe": self.layout.describe(), "strategy_kwargs": self.layout.strategy_kwargs(),
            "fits": self.fits, "reason": self.reason, "peak_bytes_per_rank": self.peak_bytes,
            "peak_gib_per_rank": self.peak_bytes / GiB, "step_time_s": self.step_time,
            "tokens_per_s_per_device": self.tokens_per_second_per_device, "tflops_per_device": self.tflops_per_device,
            "memory_bytes": dict(self.memory), "time_s": dict(self.time),
        }


def inflight(schedule: str, pp: int, m: int, virtual: int, rank: int) -> float:
    """Microbatches whose activations pipeline rank ``rank`` holds at its peak (units of its layers)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if virtual > 1:  # Narayanan et al. 2021, section 2.2.2: p (1 + (p - 1) / (p v)) on the first rank
        return float(min(m, pp - rank) + (pp - 1 - rank) / virtual)
    return float(min(m, pp - rank))


def gradients_held_at_peak(layout: Layout, m: int, rank: int) -> bool:
    """Whether the gradients are alive at the activation peak (the start of backward).

    The strategies free the gradients Lightning's ``zero_grad`` would drop before the forward
    (strategies/early_zero_grad.py), so they are absent at the peak unless DDP keeps them (its
    buckets are the gradients: ZeRO-0/1 with data parallelism) or a pipeline rank runs a backward
    before it is back at its most microbatches in flight (1F1B-style schedules with more
    microbatches than that count). Measured: tests/test_planner_peak_memory.py.
    """
    if layout.zero_stage <= 1 and layout.grad_ranks > 1:
        return True
    if layout.pp == 1 or layout.schedule == "gpipe":
        return False
    return m > layout.pp - rank


def recomputed_layers(layout: Layout, layers: int) -> int:
    """Blocks of a rank whose activations are recomputed in backward: all under activation
    checkpointing, else the first ``recompute_layers`` (Megatron-LM's block recomputation)."""
    return layers if layout.activation_checkpointing else min(layout.recompute_layers, layers)


def bubble_factor(schedule: str, pp: int, m: int, virtual: int) -> float:
    """Pipelined time over ideal time: ``(m + (p - 1) / v) / m``."""
    if pp == 1:
        return 1.0
    return (m + (pp - 1) / max(1, virtual)) / m


def layer_activation_elements(facts: ModelFacts, tokens: int, seq: int, tp: int, scores: bool, sp: bool = False,
                              elem_bytes: int = 2) -> float:
    """Activation elements one block keeps for backward, for ``tokens`` tokens of sequences of ``seq``
    (``sp``: sequence parallelism splits the norm activations over ``tp`` too).

    Korthikanti et al. 2022 (arXiv 2205.05198), section 4.1, per token: the two norm inputs and
    the attention and MLP inputs (replicated over tp), q, k, v, the attention output and the
    output projection's input, the MLP's ``mlp_mats`` wide activations (split over tp), and where
    attention keeps its scores (the math kernel) ``a s`` softmax outputs. Dropout masks (one byte
    per element, and the dropped-out scores) only where the model has dropout: a GPT built with
    ``dropout=0`` stores none (measured: tests/test_planner_peak_memory.py).
    """
    h, a = facts.hidden, facts.heads
    replicated = 4.0 * tokens * h  # norm inputs and outputs
    if facts.dropout:
        replicated += 2.0 * tokens * h / elem_bytes  # masks after attention and MLP
    qkv = 1.0 + 2.0 * facts.kv_heads / a
    sharded = tokens * (h * (qkv + 1.0 + 1.0) + facts.mlp_mats * facts.ffn)
    score = 0.0
    if scores:
        score = a * seq * tokens * ((2.0 + 1.0 / elem_bytes) if facts.dropout else 1.0)
    return replicated / (tp if sp else 1) + (sharded + score) / tp


def busiest_ranks(shares: list[RankShare]) -> list[int]:
    """The pipeline ranks worth evaluating: the first (most microbatches in flight), the last (logits),
    the ones holding or computing most; exact for the maximum, and it keeps the search fast."""
    n = len(shares)
    picks = {0, n - 1, max(range(n), key=lambda i: shares[i].params),
             max(range(n), key=lambda i: shares[i].matmul_params + shares[i].expert_params)}
    return sorted(picks)


def predict(facts: ModelFacts, layout: Layout, shares: list[RankShare], work: Workload, hw: HardwareProfile) -> Prediction:
    """Memory and time of ``layout`` (see the module docstring); ``shares`` from ``facts.shares(...)``."""
    L = layout
    cb = DTYPE_BYTES[work.dtype]
    opt_bytes = OPTIMIZER_BYTES.get(work.optimizer, 8)
    per_dp_batch = work.global_batch // L.dp
    m = L.microbatches if L.pp > 1 else 1
    local_seq = work.seq_len // L.cp  # a context-parallel rank's share of each sequence (planner/context_cost.py)
    mb_tokens = per_dp_batch // m * local_seq
    dpn = hw.devices_per_node
    tp_link = hw.link(L.tp > dpn)
    cp_link = hw.link(L.tp * L.cp > dpn)
    dp_link = hw.link(L.tp * L.cp * L.dp > dpn)
    shard_link = hw.link(L.tp * L.cp * L.dp_shard > dpn)
    ep_link = hw.link(L.tp * L.ep > dpn)
    pp_link = hw.link(L.tp * L.cp * L.dp >= dpn)
    grad_ranks = L.grad_ranks  # gradients reduced, and ZeRO sharded, over dp x cp
    shard_ranks = L.dp_shard * L.cp
    top_frac = facts.top_k / max(facts.expert_counts) if facts.is_moe else 0.0
    ag_scale = hw.collective_scale.get("all_gather", 1.0)
    rs_scale = hw.collective_scale.get("reduce_scatter", 1.0)

    worst_mem: dict[str, float] = {"total": -1.0}
    worst_time: dict[str, float] = {"compute": 0.0}
    worst_rank_compute = 0.0
    model_state_max = 0.0
    cache = facts.__dict__.setdefault("_busiest", {})  # the search predicts thousands of layouts per shares list
    entry = cache.get(id(shares))
    if entry is None or entry[0] is not shares:
        entry = cache[id(shares)] = (shares, busiest_ranks(shares))
    for r in entry[1]:
        share = shares[r]
        params = share.params - share.expert_params + share.expert_params / L.ep
        shard = shard_ranks if L.zero_stage >= 2 else 1
        grads = params * work.grad_bytes / shard
        optim = params * opt_bytes / (grad_ranks if L.zero_stage >= 1 else 1)
        stored_params = params * work.param_dtype_bytes / shard  # FSDP2 keeps the sharded fp32 weights (ZeRO-2 and 3)
        per_block = share.params / max(1, share.layers) if share.layers else share.params
        if L.zero_stage == 3:
            working = 2 * per_block * cb  # the gathered unit and the one prefetched
        elif L.zero_stage == 2:
            working = params * cb  # unsharded after forward until the step ends
        else:
            working = 0.0
        if L.cpu_offload:
            grads = optim = stored_params = 0.0
        grads_at_peak = grads if gradients_held_at_peak(L, m, r) else 0.0
        buffers = 0.0  # DDP's buckets are the gradients (gradient_as_bucket_view=True, parallel/data/apply.py)
        scores = hw.attention_scores_stored or (L.tp > 1 and hw.tp_attention_scores_stored)
        scores = scores and not (L.cp > 1 and L.cp_attention == "ring")  # the ring's flash-style backward keeps none
        context = context_memory(facts, L.cp, L.cp_attention, mb_tokens, L.tp, cb)
        layer_act = layer_activation_elements(facts, mb_tokens, work.seq_len, L.tp, scores, L.sequence_parallel, cb) * cb
        layer_act += context.per_block
        held = inflight(L.schedule, L.pp, m, L.virtual_stages, r)
        ck = recomputed_layers(L, share.layers)
        block_input = mb_tokens * facts.hidden * cb / (L.tp if L.sequence_parallel else 1)
        acts = (share.layers - ck) * held * layer_act + ck * held * block_input + (layer_act if ck else 0.0)
        # Last stage: the final norm's input and output, and at the start of backward the fp32
        # log-softmax kept by the loss, its gradient and the logits' gradient (measured peak).
        logits = mb_tokens * (facts.vocab * (cb + 8) + 2 * facts.hidden * cb) if share.last else 0.0
        mem = {
            "params": stored_params, "grads": grads_at_peak, "optimizer": optim, "gathered_params": working,
            "comm_buffers": buffers, "activations": acts, "logits": logits, "reserved": float(hw.reserved_bytes),
            "context_kv": context.transient,
        }
        start_of_backward = sum(mem.values())
        # The gradients freed before the forward come back during backward, as the activations go;
        # the end of backward (all gradients, no activations) is the peak only for a tiny batch.
        end_of_backward = start_of_backward - grads_at_peak - acts - logits - context.transient + grads
        mem["total"] = max(start_of_backward, end_of_backward)
        mem["model_state"] = stored_params + grads + optim
        model_state_max = max(model_state_max, mem["model_state"])
        if mem["total"] > worst_mem["total"]:
            worst_mem = mem

        # ---- time of this pipeline rank for the whole step (all its microbatches)
        tokens_rank = per_dp_batch * local_seq  # attention below: local queries over all seq_len keys
        flops = 6.0 * tokens_rank * share.matmul_params + 6.0 * tokens_rank * share.expert_params * top_frac
        flops += 12.0 * tokens_rank * work.seq_len * facts.hidden * share.layers / L.tp
        frac = ck / share.layers if share.layers else 0.0  # of this rank's blocks, the recomputed share
        flops *= 1.0 + frac / 3.0  # one more forward of the recomputed blocks
        compute = flops / hw.flops(work.dtype)
        kernels = share.layers * m * (40 + 15 * frac) + (10 if share.last else 0) * m
        compute += kernels * hw.kernel_overhead
        if L.tp > 1:  # DTensor dispatch per sharded op (about 10 per block forward, twice that backward)
            compute += share.layers * m * (30 + 10 * frac) * hw.tp_op_overhead
            # Measured per column+row pair (attention, MLP: two per block), recomputed ones again
            compute += share.layers * m * 2 * (1 + frac / 2) * hw.tp_pair_overhead
        act_msg = mb_tokens * facts.hidden * cb
        per_layer_ar = 4 + 2 * frac
        tp_comm = share.layers * m * per_layer_ar * _ring(act_msg, L.tp, tp_link)
        if share.last and L.tp > 1:
            tp_comm += m * _ring(mb_tokens * facts.vocab * cb, L.tp, tp_link, factor=1.0, scale=ag_scale)
        ep_comm = share.moe_layers * m * 4 * _ring(act_msg * facts.top_k, L.ep, ep_link, factor=0.5) if L.ep > 1 else 0.0
        cp_comm = share.layers * m * context_comm_time(
            facts, L.cp, L.cp_attention, mb_tokens, L.tp, cb, cp_link, hw.flops(work.dtype), frac, hw.comm_overlap,
            ag_scale, rs_scale)
        rank_time = compute + tp_comm + ep_comm + cp_comm
        if rank_time > worst_rank_compute:
            worst_rank_compute = rank_time
            worst_time = {"compute": compute, "tp_comm": tp_comm, "ep_comm": ep_comm, "cp_comm": cp_comm, "_params": params}
    params = worst_time.pop("_params", 0.0)
    bubble = bubble_factor(L.schedule, L.pp, m, L.virtual_stages)
    pipelined = worst_rank_compute * bubble
    p2p = 0.0
    if L.pp > 1:
        p2p = 2 * m * L.virtual_stages * (mb_tokens * facts.hidden * cb / L.tp / pp_link[0] + pp_link[1])
    # ---- data-parallel reduction and ZeRO gathers, less what hides under the backward
    # Collectives are issued per bucket (DDP, 25 MB) or per FSDP unit (a block, plus the root):
    # their latencies add up, and each FSDP unit costs hooks and copies on top.
    grad_msg = params * work.grad_bytes
    layers = max(s.layers for s in shares)
    units = layers + 1
    if L.zero_stage <= 1:
        buckets = max(1, int(-(-grad_msg // 25e6)))
        dp_comm = _ring(grad_msg, grad_ranks, dp_link) + (buckets - 1) * 2 * math.ceil(math.log2(max(1, grad_ranks))) * dp_link[1]
        if L.zero_stage == 1 and grad_ranks > 1:
            dp_comm += _ring(params * work.param_dtype_bytes, grad_ranks, dp_link, factor=1.0, scale=ag_scale)  # updated shards re-gathered
        if L.zero_stage == 1 and grad_ranks > 1 and L.pp == 1:
            # ... one broadcast per parameter tensor (torch's ZeroRedundancyOptimizer without bucket views,
            # which the strategy uses without pipelines), issued asynchronously and waited on together:
            # each costs a pipelined latency
            stream = hw.pipelined_latency if hw.pipelined_latency and L.tp * grad_ranks <= dpn else dp_link[1]
            dp_comm += facts.param_tensors * math.ceil(math.log2(grad_ranks)) * stream
    else:
        gathers = 2 * m if L.zero_stage == 3 else 1
        dp_comm = _ring(grad_msg, shard_ranks, shard_link, factor=1.0, scale=rs_scale)
        dp_comm += gathers * _ring(params * cb, shard_ranks, shard_link, factor=1.0, scale=ag_scale)
        dp_comm += _ring(grad_msg / shard_ranks, L.dp_replicate, dp_link)
        per_unit = (1 + gathers) * (math.ceil(math.log2(max(1, shard_ranks))) * shard_link[1] + 10 * hw.kernel_overhead)
        dp_comm += (units - 1) * per_unit
    # Hooks, copy-in/copy-out and waits of each FSDP unit, per microbatch (measured by planner/calibrate.py):
    # work of the training thread itself, which nothing overlaps.
    fsdp_overhead = 0.0
    if L.zero_stage >= 2:  # a fixed part per unit and a part per parameter tensor this rank's stage holds
        fsdp_overhead = m * (units * hw.fsdp_unit_overhead.get(L.zero_stage, 0.0)
                             + facts.param_tensors / L.pp * hw.fsdp_tensor_overhead.get(L.zero_stage, 0.0))
    backward = worst_time["compute"] * 2.0 / 3.0
    window = backward / m if L.pp > 1 else backward
    if L.zero_stage == 3:
        window = worst_time["compute"]
    window *= hw.comm_overlap  # on CPU ranks that use every core, collectives hide under nothing
    exposed_dp = max(0.0, dp_comm - window) + (dp_link[1] * 2 if grad_ranks > 1 else 0.0)
    opt_params = params / (grad_ranks if L.zero_stage >= 1 else 1)
    optimizer = opt_params * 28 / hw.memory_bandwidth
    offload = 0.0
    if L.cpu_offload:
        shard_params = params / max(1, shard_ranks)
        offload = shard_params * (cb + work.grad_bytes) / hw.host_bandwidth + shard_params * 28 / 50e9
        offload += units * 2 * (hw.inter_latency + 10 * hw.kernel_overhead)  # copies in and out per unit
        optimizer = 0.0
    time = {
        "compute": worst_time["compute"], "tp_comm": worst_time["tp_comm"], "ep_comm": worst_time["ep_comm"],
        "cp_comm": worst_time["cp_comm"],
        "pipeline_bubble": pipelined - worst_rank_compute, "pp_p2p": p2p, "dp_comm_exposed": exposed_dp,
        "dp_comm_total": dp_comm, "fsdp_overhead": fsdp_overhead, "optimizer": optimizer, "cpu_offload": offload,
    }
    time["total"] = pipelined + p2p + exposed_dp + fsdp_overhead + optimizer + offload
    model_flops = 6.0 * work.tokens * (facts_matmul(facts) + facts_expert_active(facts)) + 12.0 * work.tokens * work.seq_len * facts.hidden * facts.n_blocks
    return Prediction(layout=L, memory=worst_mem, time=time, model_flops=model_flops, world=L.world, tokens=work.tokens,
                      extra={"model_state_max": model_state_max})


def facts_matmul(facts: ModelFacts) -> float:
    """Linear weights a forward runs once per token (dense part; the LM head included)."""
    if "_matmul" not in facts.__dict__:
        shares = facts.shares(1, 1, 1, "single")
        assert not isinstance(shares, str)
        facts.__dict__["_matmul"] = shares[0].matmul_params
        facts.__dict__["_expert"] = shares[0].expert_params
    return facts.__dict__["_matmul"]


def facts_expert_active(facts: ModelFacts) -> float:
    facts_matmul(facts)
    return facts.__dict__["_expert"] * (facts.top_k / max(facts.expert_counts) if facts.is_moe else 0.0)


__all__ = ["DTYPE_BYTES", "Layout", "Prediction", "Workload", "bubble_factor", "busiest_ranks", "inflight", "predict",
           "recomputed_layers"]
