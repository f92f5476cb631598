"""Expert parallelism: communication volume and memory against theory, and time against
replicated experts (what a user would run instead: plain data parallelism, every rank holding
every expert).

Not a timed test. For each expert-parallel size it trains a few steps of an MoE MLP stack on
``--world`` gloo processes and prints, per step and rank:

* all-to-all bytes this rank sent to other ranks (forward and backward), measured by the
  dispatcher's counters, next to the value implied by the routing that occurred (rows routed
  to experts on other ranks + rows returned to them, times ``dim * 4`` bytes, both ways);
* expert-parameter bytes held by the rank next to ``total expert bytes / ep``;
* mean step time, and its ratio to the replicated-experts baseline (all-reduce of all grads).

Run: ``python benchmarks/bench_ep.py --world 4 --ep 2 4``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel.nn import MoE, collect_moe_losses
from lightning_parallel.parallel.dims import DP, EDP, EP, ParallelDims
from lightning_parallel.parallel.experts.apply import all_to_all_traffic, apply_expert_parallel
from lightning_parallel.testing import run_distributed


class MoEStack(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoE(dim, 4 * dim, experts, top_k) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))

    def forward(self, x: Tensor) -> Tensor:
        for norm, moe in zip(self.norms, self.layers):
            x = x + moe(norm(x))
        return x


def _expected_bytes(model: MoEStack, x: Tensor, ep_mesh: Any, row_bytes: int) -> int:
    """Bytes implied by the routing of the last step: every layer's router is re-run on its
    own input (captured by hooks) and its per-destination counts are exchanged."""
    inputs: list[Tensor] = []
    hooks = [moe.register_forward_pre_hook(lambda _m, a: inputs.append(a[0].detach())) for moe in model.layers]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    ep, me = ep_mesh.size(), ep_mesh.get_local_rank()
    total = 0
    for moe, inp in zip(model.layers, inputs):
        indices = moe.router(inp.reshape(-1, inp.shape[-1])).indices.reshape(-1)
        to_rank = torch.bincount(indices // (moe.num_experts // ep), minlength=ep)
        rows = [torch.zeros_like(to_rank) for _ in range(ep)]
        dist.all_gather(rows, to_rank, group=ep_mesh.get_group())
        total += int(to_rank.sum() - to_rank[me]) + int(sum(r[me] for r in rows) - to_rank[me])
    return total * row_bytes


def _bench(cfg: dict[str, Any]) -> dict[str, Any]:
    world, ep = dist.get_world_size(), cfg["ep"]
    torch.manual_seed(0)
    model = MoEStack(cfg["dim"], cfg["experts"], cfg["top_k"], cfg["layers"])
    expert_total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    dims = ParallelDims.resolve(world, expert_parallel_size=ep)
    dims.build_mesh("cpu")
    dp_group = dims.axis(DP).get_group()
    edp_group = dims.axis(EDP).get_group() if ep > 1 and dims.dp // ep > 1 else None
    expert_names: set[str] = set()
    if ep > 1:
        expert_names = set(apply_expert_parallel(model, dims.axis(EP), dims.axis(DP)))
    params = dict(model.named_parameters())
    expert_local = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for n, p in params.items() if ".experts." in n
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    times, measured, expected = [], [], []
    for step in range(cfg["steps"] + 1):
        x = torch.randn(cfg["tokens"] // 64, 64, cfg["dim"], generator=gen)
        for t in all_to_all_traffic(model).values():
            t.reset()
        start = time.perf_counter()
        out = model(x)
        (out.square().mean() + collect_moe_losses(model)["moe_loss"]).backward()
        with torch.no_grad():
            for name, p in params.items():
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                group = edp_group if name in expert_names else dp_group
                if group is not None:
                    dist.all_reduce(grad, group=group)
                    grad /= dist.get_world_size(group)
        opt.step()
        opt.zero_grad()
        if step > 0:  # the first step warms up
            times.append(time.perf_counter() - start)
        if ep > 1:
            traffic = all_to_all_traffic(model).values()
            measured.append((sum(t.forward_bytes for t in traffic), sum(t.backward_bytes for t in traffic)))
            expected.append(_expected_bytes(model, x, dims.axis(EP), cfg["dim"] * 4))
    return {
        "step_s": sum(times) / len(times),
        "measured": measured,
        "expected": expected,
        "expert_bytes_local": expert_local,
        "expert_bytes_total": expert_total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank per step (multiple of 64)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    base = {"dim": args.dim, "experts": args.experts, "top_k": args.top_k, "layers": args.layers, "tokens": args.tokens, "steps": args.steps}
    baseline = run_distributed(_bench, args.world, {**base, "ep": 1}, timeout=600)
    base_s = max(r["step_s"] for r in baseline)
    print(f"replicated experts (ep=1, dp={args.world}): step {base_s * 1e3:.1f} ms, expert bytes/rank {baseline[0]['expert_bytes_local']}")
    for ep in args.ep:
        results = run_distributed(_bench, args.world, {**base, "ep": ep}, timeout=600)
        step_s = max(r["step_s"] for r in results)
        print(f"\nep={ep} x edp={args.world // ep}: step {step_s * 1e3:.1f} ms ({step_s / base_s:.2f}x replicated)")
        for rank, r in enumerate(results):
            ok = all(f == e and b == e for (f, b), e in zip(r["measured"], r["expected"]))
            share = r["expert_bytes_total"] / ep
            print(
                f"  rank {rank}: all-to-all bytes/step fwd,bwd = {[m for m in r['measured']]} expected {r['expected']} -> "
                f"{'equal' if ok else 'DIFFERENT'}; expert bytes {r['expert_bytes_local']} = total/ep {share:.0f}: "
                f"{'yes' if r['expert_bytes_local'] == share else 'NO'}"
            )


if __name__ == "__main__":
    main()
