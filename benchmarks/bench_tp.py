"""Tensor parallelism: our ``tp`` strategy against Lightning's ``ModelParallelStrategy`` with a
hand-written ``parallelize_module`` plan, side by side in one run on the package's GPT.

Not a timed test. Both runs use the same processes (``--tp`` gloo ranks, data parallel size 1),
the same seed, data and SGD, and train ``--steps`` steps through a ``Trainer``. Printed per run:

* median step time (after ``--warmup`` steps) and the ratio ours / hand-written, and the same
  for the CPU time each rank's process spends per step (``time.process_time``): on a shared
  machine wall time moves with other people's load, CPU time much less. The fits alternate
  (ours, hand, ours, hand, ... ``--rounds`` times) so a change of load hits both sides;
* model-state bytes per rank, measured on the rank: parameters (local shards), gradients as
  they stand before the optimizer step, and optimizer state (SGD momentum), next to the
  planner's prediction ``sharded bytes / tp + replicated bytes`` (``tp_param_bytes``);
* the final loss of each run (the two layouts compute the same model, so they must agree).

What "hand-written" means here is what a Lightning user writes for this model today: a
``configure_model`` that calls ``parallelize_module`` with Colwise/Rowwise styles, and, because
the GPT's attention reshapes with the *global* head count, an attention forward rewritten to
reshape with ``-1`` on the local shards (the Lightning/torchtitan tutorials do the same). Ours
trains the GPT unchanged, with the inferred plan. Lightning's ``ModelParallelStrategy`` does run
on CPU with gloo (checked by this script: it would raise before the first step otherwise).

Run: ``python benchmarks/bench_tp.py`` (defaults: tp 2, a 4-layer 256-wide GPT, 20 steps);
``--loss-parallel`` runs ours with ``loss_parallel=True`` (cross-entropy on vocabulary shards).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_parallel.models.gpt import GPT, CausalSelfAttention
from lightning_parallel.testing import run_distributed


def _local_heads_forward(attn: CausalSelfAttention, x: Tensor) -> Tensor:
    """The attention forward a user rewrites for hand-written TP: ``-1`` heads, local shards."""
    B, T, _ = x.size()
    hd = attn.n_embd // attn.n_head
    q = attn.q(x).view(B, T, -1, hd).transpose(1, 2)
    k = attn.k(x).view(B, T, -1, hd).transpose(1, 2)
    v = attn.v(x).view(B, T, -1, hd).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attn.resid_drop(attn.proj(y.transpose(1, 2).reshape(B, T, -1)))


class HandWrittenTPGPT(GPT):
    """The GPT with the ``configure_model`` a user writes for Lightning's ModelParallelStrategy."""

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh["tensor_parallel"]
        plan: dict[str, Any] = {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        }
        for i, block in enumerate(self.blocks):
            plan.update({f"blocks.{i}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
            plan[f"blocks.{i}.attn.proj"] = RowwiseParallel()
            plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel()
            plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel()
            block.attn.forward = _local_heads_forward.__get__(block.attn)  # type: ignore[method-assign]
        parallelize_module(self, mesh, plan)


def _nbytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


class _Probe:
    """Callback: step times, and the bytes of parameters, gradients and optimizer state per rank."""

    def __new__(cls) -> Any:
        from lightning.pytorch import Callback

        class Probe(Callback):
            def __init__(self) -> None:
                self.times: list[float] = []
                self.cpu_times: list[float] = []
                self.cpu_start = 0.0
                self.start = 0.0
                self.bytes: dict[str, int] = {}
                self.loss = float("nan")

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                self.start = time.perf_counter()
                self.cpu_start = time.process_time()

            def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
                self.bytes["grads"] = _nbytes(p.grad for p in pl_module.parameters())

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
                self.times.append(time.perf_counter() - self.start)
                self.cpu_times.append(time.process_time() - self.cpu_start)
                self.loss = float(trainer.callback_metrics["train_loss"])
                self.bytes["params"] = _nbytes(pl_module.parameters())
                opt = trainer.optimizers[0]
                self.bytes["optimizer"] = _nbytes(v for state in opt.state.values() for v in state.values())

        return Probe()


def _fit(which: str, args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    import lightning_parallel  # noqa: F401  (registers "tp")
    from lightning_parallel.testing.parity import token_data

    pl.seed_everything(0, verbose=False)
    kwargs = dict(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                  n_embd=args.width, lr=0.05, momentum=0.9)
    if which == "ours":
        model: GPT = GPT(**kwargs)
        strategy: Any = lightning_parallel.HybridParallelStrategy(tensor_parallel_size=args.tp, loss_parallel=args.loss_parallel)
    else:
        model = HandWrittenTPGPT(**kwargs)
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=args.tp)
    probe = _Probe()
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.tp, strategy=strategy, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[probe],
    )
    data = token_data(num_samples=args.batch * args.steps, block_size=args.seq, vocab_size=args.vocab)
    trainer.fit(model, DataLoader(data, batch_size=args.batch, shuffle=False))
    return {"times": probe.times[args.warmup:], "cpu_times": probe.cpu_times[args.warmup:], "bytes": dict(probe.bytes),
            "loss": probe.loss}


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_parallel.parallel.tensor.plan import resolve_tp_plan
    from lightning_parallel.parallel.tensor.shards import tp_param_bytes

    with torch.device("meta"):
        meta = GPT(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    predicted = tp_param_bytes(meta, resolve_tp_plan(meta, args.tp))
    torch.set_num_threads(1)
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "hand": []}
    for _ in range(args.rounds):
        for which in ("ours", "hand"):
            runs[which].append(_fit(which, args))
    merged = {
        which: {"times": [t for r in rs for t in r["times"]], "cpu_times": [t for r in rs for t in r["cpu_times"]],
                "bytes": rs[-1]["bytes"], "loss": rs[-1]["loss"]}
        for which, rs in runs.items()
    }
    return {**merged, "predicted": predicted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="alternating (ours, hand) fits")
    parser.add_argument("--loss-parallel", action="store_true", help="ours with loss_parallel=True (sharded logits)")
    args = parser.parse_args()
    results = run_distributed(_worker, args.tp, args, init_backend=None, timeout=1200)
    pred = results[0]["predicted"]
    print(f"GPT {args.layers} layers x {args.width} wide, {args.heads} heads, vocab {args.vocab}, "
          f"batch {args.batch} x {args.seq} tokens, tp={args.tp} (gloo, CPU, 1 thread per rank)")
    print(f"predicted parameter bytes per rank: sharded {pred['sharded_bytes_per_rank']:,} + replicated "
          f"{pred['replicated_bytes_per_rank']:,} = {pred['total_bytes_per_rank']:,} "
          f"(unsharded {pred['unsharded_total_bytes']:,})")
    medians, cpu_medians = {}, {}
    ours_label = "ours: tp, unchanged GPT" + (", loss_parallel" if args.loss_parallel else "")
    for which, label in (("ours", ours_label), ("hand", "Lightning ModelParallelStrategy, hand-written")):
        times = [t for r in results for t in r[which]["times"]]
        medians[which] = statistics.median(times)
        cpu_medians[which] = statistics.median(t for r in results for t in r[which]["cpu_times"])
        b = results[0][which]["bytes"]
        print(f"{label:<48} step {1e3 * medians[which]:7.1f} ms (CPU {1e3 * cpu_medians[which]:6.1f} ms)  params {b['params']:,}  grads {b['grads']:,}  "
              f"optimizer {b['optimizer']:,} bytes/rank  final loss {results[0][which]['loss']:.5f}")
    print(f"step-time ratio ours / hand-written: {medians['ours'] / medians['hand']:.2f} "
          f"(CPU time per step: {cpu_medians['ours'] / cpu_medians['hand']:.2f})")
    ours = results[0]["ours"]["bytes"]["params"]
    print(f"measured / predicted parameter bytes (ours): {ours / pred['total_bytes_per_rank']:.3f}")


if __name__ == "__main__":
    main()
