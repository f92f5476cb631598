"""Expert parallelism on 4 gloo processes against a single-process reference.

One spawned run covers every layout (processes cost seconds to start): ep=4; ep=2 alone (two
independent pairs); ep=2 x dp=2; token dropping with a small capacity; third-party experts
modules found through ``config.base_model_ep_plan`` and through their ``num_experts`` layout;
under torch DDP (expert parameters ignored by DDP) and under FSDP2 (experts sharded over edp);
errors raised before any collective; and all-to-all traffic against the routing. Each worker
trains 5 SGD steps of the parallel model and of a single-process copy on the global batch and
returns the largest relative difference (max |a - b| / max |b|) per quantity; the parent
asserts they are below 1e-5.

Gradient reduction done here is the strategy's contract: non-expert gradients are averaged over
the data-parallel ranks, expert gradients over the ``edp`` ranks only.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lightning_parallel.nn import MoE, collect_moe_losses, collect_moe_stats, expert_capacity
from lightning_parallel.parallel.dims import DP, EDP, EP, ParallelDims
from lightning_parallel.parallel.experts.apply import all_to_all_traffic, apply_expert_parallel, expert_parameter_names
from lightning_parallel.testing import run_distributed

DIM, EXPERTS, BATCH, SEQ, STEPS, LR = 8, 8, 2, 6, 5, 0.5
TOL = 1e-5


class Net(nn.Module):
    """dense -> MoE (residual) -> dense: the MoE sits between data-parallel layers."""

    def __init__(self, **moe: Any) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = MoE(DIM, 2 * DIM, EXPERTS, **moe)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(h + self.moe(h))


class HFStyleExperts(nn.Module):
    """An experts module in the Hugging Face layout (written here): fused gate/up weights with a
    leading expert dim, a loop over experts, ``forward(hidden_states, top_k_index, top_k_weights)``."""

    def __init__(self, num_experts: int, dim: int, inter: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * inter, dim) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(num_experts, dim, inter) * 0.3)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, h)
        return out


class HFStyleBlock(nn.Module):
    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = HFStyleExperts(EXPERTS, DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, DIM)
        weights, index = torch.topk(torch.softmax(self.gate(flat).float(), dim=-1), self.top_k, dim=-1)
        if self.top_k > 1:  # like norm_topk_prob: a normalised top-1 weight is constant 1
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(flat, index, weights.to(flat.dtype)).reshape(x.shape)


class HFStyleModel(nn.Module):
    def __init__(self, top_k: int, declare_plan: bool) -> None:
        super().__init__()
        if declare_plan:
            self.config = SimpleNamespace(
                base_model_ep_plan={
                    "layers.*.mlp.gate": "ep_router",
                    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
                    "layers.*.mlp.experts.down_proj": "grouped_gemm",
                    "layers.*.mlp.experts": "moe_tp_experts",
                }
            )
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].mlp = HFStyleBlock(top_k)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(h + self.layers[0].mlp(h))


def _build(cfg: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    if cfg.get("model") == "hf_plan":
        return HFStyleModel(cfg["top_k"], declare_plan=True)
    if cfg.get("model") == "hf_attr":
        return HFStyleModel(cfg["top_k"], declare_plan=False)
    keys = ("top_k", "score_func", "capacity_factor", "activation", "shared_expert_hidden_dim", "aux_loss_coef", "z_loss_coef")
    return Net(**{k: cfg[k] for k in keys if k in cfg})


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _moe_layer(model: nn.Module) -> nn.Module:
    return model.moe if isinstance(model, Net) else model.layers[0].mlp


def _run_config(cfg: dict[str, Any], dims: dict[int, ParallelDims]) -> dict[str, Any]:
    """Train the parallel and the reference model side by side; return max relative errors."""
    ep = cfg["ep"]
    pd = dims[ep]
    ep_mesh = pd.axis(EP)
    ep_rank = ep_mesh.get_local_rank()
    if cfg["mode"] == "ep_only":  # each ep group is its own experiment
        data_group, dp_mesh, experiment = ep_mesh.get_group(), None, dist.get_rank() // ep
        groups, my_group, edp_group = ep, ep_rank, None
    else:
        dp = pd.axis(DP)
        data_group, dp_mesh, experiment = dp.get_group(), dp, 0
        groups, my_group = dp.size(), dp.get_local_rank()
        edp_group = pd.axis(EDP).get_group() if pd.dp // ep > 1 else None
    per_group = cfg.get("capacity_factor") is not None  # capacity is per group: reference runs group by group
    model, ref = _build(cfg), _build(cfg)
    expert_names = set(apply_expert_parallel(model, ep_mesh, dp_mesh, param_layout=cfg.get("layout", "dtensor")))
    assert expert_names == set(expert_parameter_names(model)) and expert_names
    wrap = cfg.get("wrap")
    runner: nn.Module = model
    if wrap == "ddp":  # DDP averages dense gradients over dp; expert ones are left to us (edp)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(expert_names))
        runner = DistributedDataParallel(model, process_group=data_group)
    elif wrap == "fsdp":  # ZeRO-3: experts sharded over edp on top of ep, the rest over dp
        fully_shard(_moe_layer(model).experts, mesh=pd.axis(EDP))
        fully_shard(model, mesh=pd.axis(DP))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    block = EXPERTS // ep
    errs: dict[str, float] = {}
    dropped_total = 0

    def note(key: str, value: float) -> None:
        errs[key] = max(errs.get(key, 0.0), value)

    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + 17 * experiment + 3)
        x = torch.randn(groups, BATCH, SEQ, DIM, generator=gen)
        y = torch.randn(groups, BATCH, SEQ, DIM, generator=gen)
        # parallel model: this rank's group only
        out = runner(x[my_group])
        task = F.mse_loss(out, y[my_group])
        losses = collect_moe_losses(model)
        (task + losses["moe_loss"] if losses else task).backward()
        # reference: the whole global batch on one process
        if per_group:
            ref_outs, ref_tasks = [], []
            for g in range(groups):
                ref_outs.append(ref(x[g]))
                ref_tasks.append(F.mse_loss(ref_outs[-1], y[g]))
                if g == my_group:
                    assert torch.equal(_moe_layer(model).last_dropped, _moe_layer(ref).last_dropped), "dropped tokens differ"
                    dropped_total += int(_moe_layer(ref).last_dropped.sum())
                    capacity = expert_capacity(BATCH * SEQ, cfg["top_k"], EXPERTS, cfg["capacity_factor"])
                    routing = _moe_layer(ref).router(torch.tanh(ref.inp(x[g])).reshape(-1, DIM))
                    kept = routing.indices[~_moe_layer(ref).last_dropped]
                    assert int(torch.bincount(kept, minlength=EXPERTS).max()) <= capacity
            ref_out, ref_task = torch.stack(ref_outs)[my_group], torch.stack(ref_tasks).mean()
            ref_loss = ref_task
        else:
            full = ref(x.reshape(groups * BATCH, SEQ, DIM))
            ref_out = full.reshape(groups, BATCH, SEQ, DIM)[my_group]
            ref_task = F.mse_loss(full, y.reshape(groups * BATCH, SEQ, DIM))
            ref_losses = collect_moe_losses(ref)
            ref_loss = ref_task + ref_losses["moe_loss"] if ref_losses else ref_task
            for key in ("moe_aux_loss", "moe_z_loss"):
                if key in ref_losses:
                    note(key, _rel(losses[key].detach(), ref_losses[key].detach()))
            if cfg.get("model") in ("hf_plan", "hf_attr"):
                counts = collect_moe_stats(model)
                flat = torch.tanh(ref.inp(x.reshape(-1, DIM)))
                ref_idx = torch.topk(ref.layers[0].mlp.gate(flat).float(), cfg["top_k"], dim=-1).indices
                expected = torch.bincount(ref_idx.reshape(-1), minlength=EXPERTS).float()
                got = torch.stack([counts[f"moe/layers.0.mlp.experts/expert_{e}_tokens"] for e in range(EXPERTS)])
                assert torch.equal(got, expected), (got, expected)
        ref_loss.backward()
        note("output", _rel(out.detach(), ref_out.detach()))
        mean_task = task.detach().clone()
        dist.all_reduce(mean_task, group=data_group)
        note("task_loss", _rel(mean_task / dist.get_world_size(data_group), ref_task.detach()))
        # the strategy's gradient reduction
        ref_params = dict(ref.named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                if wrap == "fsdp":  # FSDP reduced everything; compare the gathered gradient
                    note("grad_expert" if name in expert_names else "grad_dense", _rel(p.grad.full_tensor(), ref_params[name].grad))
                    continue
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if name in expert_names:
                    if edp_group is not None:
                        dist.all_reduce(grad, group=edp_group)
                        grad /= dist.get_world_size(edp_group)
                    ref_grad = ref_params[name].grad[ep_rank * block : (ep_rank + 1) * block]
                else:
                    if wrap != "ddp":
                        dist.all_reduce(grad, group=data_group)
                        grad /= dist.get_world_size(data_group)
                    ref_grad = ref_params[name].grad
                note("grad_expert" if name in expert_names else "grad_dense", _rel(grad, ref_grad))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        for name, p in model.named_parameters():
            if wrap == "fsdp":
                note("param", _rel(p.detach().full_tensor(), ref_params[name].detach()))
                continue
            local = p.to_local() if isinstance(p, DTensor) else p
            ref_p = ref_params[name][ep_rank * block : (ep_rank + 1) * block] if name in expert_names else ref_params[name]
            note("param", _rel(local.detach(), ref_p.detach()))
    layout = type(dict(model.named_parameters())[sorted(expert_names)[0]]).__name__
    return {"errs": errs, "dropped": dropped_total, "layout": layout}


def _traffic_check(dims: dict[int, ParallelDims]) -> dict[str, int]:
    """Bytes this rank sent to other ranks by the token all-to-alls, and the count implied by the
    routing that occurred: dispatch sends the rows routed to other ranks' experts, the combine
    returns the rows others routed here; the backward mirrors both."""
    pd = dims[4]
    ep_mesh = pd.axis(EP)
    model = _build({"top_k": 2, "ep": 4})
    apply_expert_parallel(model, ep_mesh, pd.axis(DP))
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().mean().backward()
    routing = model.moe.router(torch.tanh(model.inp(x)).reshape(-1, DIM))
    to_rank = torch.bincount(routing.indices.reshape(-1) // (EXPERTS // 4), minlength=4)
    matrix = [torch.zeros_like(to_rank) for _ in range(4)]
    dist.all_gather(matrix, to_rank, group=ep_mesh.get_group())
    me = ep_mesh.get_local_rank()
    sent = int(to_rank.sum() - to_rank[me])
    received = int(sum(row[me] for row in matrix) - to_rank[me])
    traffic = all_to_all_traffic(model)["moe.experts"]
    expected = (sent + received) * DIM * 4  # fp32 rows of DIM values
    return {"expected": expected, "forward_bytes": traffic.forward_bytes, "backward_bytes": traffic.backward_bytes, "calls": traffic.calls}


def _bad_input_on_rank0(dims: dict[int, ParallelDims]) -> dict[str, str]:
    """Only rank 0 calls: an error raised after any collective would hang or fail differently."""
    messages = {}
    if dist.get_rank() == 0:
        for label, model in (("dense", nn.Sequential(nn.Linear(DIM, DIM))), ("indivisible", nn.Sequential(MoE(DIM, DIM, num_experts=6, top_k=2)))):
            try:
                apply_expert_parallel(model, dims[4].axis(EP))
            except ValueError as err:
                messages[label] = str(err)
    dist.barrier()
    return messages


CONFIGS: list[dict[str, Any]] = [
    {"name": "ep4_top1", "ep": 4, "mode": "ep_dp", "top_k": 1},
    {"name": "ep4_top2_shared_swiglu", "ep": 4, "mode": "ep_dp", "top_k": 2, "shared_expert_hidden_dim": DIM, "activation": "swiglu"},
    {"name": "ep2_top1_local", "ep": 2, "mode": "ep_only", "top_k": 1, "layout": "local"},
    {"name": "ep2_top2", "ep": 2, "mode": "ep_only", "top_k": 2},
    {"name": "ep2xdp2_top2", "ep": 2, "mode": "ep_dp", "top_k": 2},
    {"name": "ep2xdp2_top1_sigmoid_local", "ep": 2, "mode": "ep_dp", "top_k": 1, "score_func": "sigmoid", "layout": "local"},
    {"name": "ep2xdp2_top2_ddp", "ep": 2, "mode": "ep_dp", "top_k": 2, "wrap": "ddp"},
    {"name": "ep2xdp2_top1_fsdp", "ep": 2, "mode": "ep_dp", "top_k": 1, "wrap": "fsdp"},
    {"name": "capacity_ep4_top2", "ep": 4, "mode": "ep_dp", "top_k": 2, "capacity_factor": 1.0, "aux_loss_coef": 0.0, "z_loss_coef": 0.0},
    {"name": "capacity_ep2xdp2_top1", "ep": 2, "mode": "ep_dp", "top_k": 1, "capacity_factor": 1.0, "aux_loss_coef": 0.0, "z_loss_coef": 0.0},
    {"name": "hf_plan_ep4_top2", "ep": 4, "mode": "ep_dp", "top_k": 2, "model": "hf_plan"},
    {"name": "hf_attr_ep2xdp2_top1", "ep": 2, "mode": "ep_dp", "top_k": 1, "model": "hf_attr"},
]


def _idle_expert_rank(dims: dict[int, ParallelDims]) -> float:
    """A router that sends every token to ep rank 0's experts (zero gate: ties pick experts 0, 1):
    ep rank 1 receives no rows, and both the HF-style experts module and ours return outputs that
    do not depend on their (empty) input. The backward must still reach rank 1's dispatch
    all-to-all, which rank 0 waits in for its tokens' gradients (this hung before the fix)."""
    errs = []
    for model_name in ("ours", "hf_attr"):
        cfg = {"top_k": 2} if model_name == "ours" else {"top_k": 2, "model": "hf_attr"}
        ref, par = _build(cfg), _build(cfg)
        for m in (ref, par):
            gate = m.moe.router.gate if isinstance(m, Net) else m.layers[0].mlp.gate
            with torch.no_grad():
                gate.weight.zero_()
        apply_expert_parallel(par, dims[2].axis(EP))
        x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(3))
        ref(x).square().mean().backward()
        par(x).square().mean().backward()
        dense = [(n, p) for n, p in par.named_parameters() if not isinstance(p, DTensor)]
        ref_params = dict(ref.named_parameters())
        errs += [_rel(p.grad, ref_params[n].grad) for n, p in dense]
    return max(errs)


def _worker() -> dict[str, Any]:
    dims = {ep: ParallelDims.resolve(4, expert_parallel_size=ep) for ep in (2, 4)}
    for pd in dims.values():
        pd.build_mesh("cpu")
    bad = _bad_input_on_rank0(dims)
    results = {cfg["name"]: _run_config(cfg, dims) for cfg in CONFIGS}
    return {"configs": results, "traffic": _traffic_check(dims), "bad": bad, "idle": _idle_expert_rank(dims)}


def test_a_rank_whose_experts_get_no_tokens_neither_hangs_nor_changes_gradients(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["idle"] <= TOL


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_worker, 4, timeout=240)


@pytest.mark.parametrize("name", [cfg["name"] for cfg in CONFIGS])
def test_parity_with_single_process(results: list[dict[str, Any]], name: str) -> None:
    for rank, res in enumerate(results):
        errs = res["configs"][name]["errs"]
        expected = {"output", "task_loss", "grad_dense", "grad_expert", "param"}
        assert expected <= set(errs), errs
        if not name.startswith(("capacity", "hf")):
            assert {"moe_aux_loss", "moe_z_loss"} <= set(errs)
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank} {name}: {bad}"


def test_expert_weights_are_dtensor_or_local_as_requested(results: list[dict[str, Any]]) -> None:
    assert results[0]["configs"]["ep4_top1"]["layout"] == "DTensor"
    for name in ("ep2_top1_local", "ep2xdp2_top1_sigmoid_local"):
        assert results[0]["configs"][name]["layout"] == "Parameter"


def test_small_capacity_drops_the_same_tokens_as_single_process(results: list[dict[str, Any]]) -> None:
    for name in ("capacity_ep4_top2", "capacity_ep2xdp2_top1"):
        assert sum(res["configs"][name]["dropped"] for res in results) > 0, "capacity 1.0 should drop tokens here"


def test_all_to_all_bytes_match_routing(results: list[dict[str, Any]]) -> None:
    for res in results:
        t = res["traffic"]
        assert t["calls"] == 1 and t["expected"] > 0
        assert t["forward_bytes"] == t["expected"], t
        assert t["backward_bytes"] == t["expected"], t


def test_bad_input_is_raised_before_any_collective(results: list[dict[str, Any]]) -> None:
    bad = results[0]["bad"]
    assert "has none" in bad["dense"] and "expert_parallel_size" in bad["dense"]
    assert "num_experts=6" in bad["indivisible"] and "divisible" in bad["indivisible"]
