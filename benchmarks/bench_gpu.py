"""GPU throughput, memory and MFU of every strategy beside plain Lightning, on the same GPT (issue #15, item 8).

For each strategy (and Lightning's own ``auto``/``ddp`` on the same model as the baseline), spawned
ranks train the package's GPT through ``Trainer`` for ``--steps`` steps in ``--precision``
(``bf16-mixed`` by default) with ``compile_blocks`` where the strategy allows it (dp, ZeRO, ep, tp;
not pp, which refuses it: see ``parallel/compile.py``). Per strategy it prints the median
step time after ``--warmup`` steps, tokens/s over all ranks, the busiest rank's
``torch.cuda.max_memory_allocated`` during training and beside it ``max_memory_reserved`` (the caching
allocator's hold; the strategies turn on expandable segments, see ``parallel/allocator.py``), MFU (model FLOPs ``6 N + 12 L h s`` per token
over the device's dense bf16 peak from ``planner/hardware.py``), and each ratio to the baseline.

One GPU runs every strategy that trains on one device (pipelines and tensor parallelism need two
ranks and are skipped there); two or more run each layout on all of them. Timing is for one run,
side by side; it is a measurement, never an assertion. On a machine without CUDA ``--device cpu``
runs the same code on a tiny model (the check that the script itself works).

    python benchmarks/bench_gpu.py                       # CUDA, all GPUs, ~125M-parameter GPT
    python benchmarks/bench_gpu.py --device cpu --tiny   # the same path on CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SIZES = {  # GPT-2 small shape (124M with a 50k vocabulary) and a tiny one for CPU checks
    "small": {"vocab_size": 32000, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768},
    "tiny": {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64},
}
# (label, strategy, compile allowed, minimum ranks)
LAYOUTS: list[tuple[str, Any, bool, int]] = [
    ("lightning", None, False, 1),  # Lightning's own: "auto" on one device, "ddp" on more
    ("dp", "dp", True, 1),
    ("zero1", "zero1", True, 2),
    ("zero2", "zero2", True, 1),
    ("zero3", "zero3", True, 1),
    ("tp", "tp", True, 2),
    ("pp", "pp", False, 2),
    ("3d", "3d", False, 4),
]


def _timer() -> Any:
    import lightning.pytorch as pl

    class StepTimer(pl.Callback):
        """Step wall times (synchronised with the device) and the training peak of device memory."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.peak = 0
            self._start = 0.0
            self.reserved = 0

        def _sync(self, device: torch.device) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(pl_module.device)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._sync(pl_module.device)
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self._sync(pl_module.device)
            self.times.append(time.perf_counter() - self._start)
            if pl_module.device.type == "cuda":
                self.peak = max(self.peak, torch.cuda.max_memory_allocated(pl_module.device))
                # reserved: what the caching allocator holds (allocated + its cache and fragmentation)
                self.reserved = max(self.reserved, torch.cuda.max_memory_reserved(pl_module.device))

    return StepTimer()


def _strategy(label: str, name: Any, compile_ok: bool, devices: int, args: argparse.Namespace) -> Any:
    if name is None:
        return "auto" if devices == 1 else "ddp"
    from lightning_parallel.strategies.registry import strategy_from_name

    options: dict[str, Any] = {}
    if compile_ok and args.compile:
        options["compile_blocks"] = {"backend": args.backend} if args.backend else True
    return strategy_from_name(name, **options)


def _fit(label: str, name: Any, compile_ok: bool, devices: int, args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_parallel.models import GPT
    from lightning_parallel.testing.parity import token_data

    kw = SIZES[args.size]
    torch.manual_seed(0)
    timer = _timer()
    trainer = pl.Trainer(
        accelerator=args.device, devices=devices, strategy=_strategy(label, name, compile_ok, devices, args),
        precision=args.precision, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
        default_root_dir=f"{args.root}/{label}",
    )
    model = GPT(**kw, optimizer="adamw", lr=1e-4)
    if devices > 1 and getattr(trainer.strategy, "lightning_module", "n/a") is None:
        trainer.strategy.connect(model)  # '3d' reads the model to choose its degrees
    replicas = trainer.strategy.distributed_sampler_kwargs["num_replicas"] if devices > 1 else 1
    seq = kw["block_size"]
    data = token_data(args.batch * args.steps, seq, kw["vocab_size"])
    trainer.fit(model, DataLoader(data, batch_size=args.batch // replicas))
    params = sum(p.numel() for p in GPT(**kw).parameters()) if trainer.global_rank == 0 else 0
    return {"times": timer.times, "peak": timer.peak, "reserved": timer.reserved, "params": params}


def _run(label: str, name: Any, compile_ok: bool, devices: int, args: argparse.Namespace) -> dict[str, Any]:
    from lightning_parallel.launcher import run_distributed

    per_rank = run_distributed(_fit, devices, label, name, compile_ok, devices, args, init_backend=None, timeout=args.timeout)
    step = statistics.median(per_rank[0]["times"][args.warmup:])
    kw = SIZES[args.size]
    tokens = args.batch * kw["block_size"]
    flops_per_token = 6 * per_rank[0]["params"] + 12 * kw["n_layer"] * kw["n_embd"] * kw["block_size"]
    return {"step_s": step, "tokens_per_s": tokens / step, "peak_bytes": max(r["peak"] for r in per_rank),
            "reserved_bytes": max(r["reserved"] for r in per_rank),
            "model_flops_per_s": flops_per_token * tokens / step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--devices", type=int, default=0, help="ranks (0: every GPU; 2 on CPU)")
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--tiny", action="store_true", help="same as --size tiny")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: inductor)")
    parser.add_argument("--only", nargs="*", default=None, help="labels to run (default: all that fit)")
    parser.add_argument("--timeout", type=float, default=400.0)
    parser.add_argument("--root", default="/tmp/bench_gpu")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.tiny:
        args.size = "tiny"
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu --tiny to check the script itself")
    devices = args.devices or (torch.cuda.device_count() if args.device == "cuda" else 2)
    peak = None
    if args.device == "cuda":
        from lightning_parallel.planner.hardware import profile_for_device

        peak = profile_for_device(torch.device("cuda", 0)).peak_flops.get("bf16")
    results: dict[str, dict[str, Any]] = {}
    for label, name, compile_ok, minimum in LAYOUTS:
        if devices < minimum or (args.only and label not in args.only and label != "lightning"):
            continue
        try:
            results[label] = _run(label, name, compile_ok, devices, args)
        except Exception as error:  # one layout failing must not hide the others' numbers
            results[label] = {"error": str(error).strip().splitlines()[-1][:300]}
    base = results.get("lightning", {})
    print(f"GPT {args.size} on {devices} x {args.device}, {args.precision}, global batch {args.batch}, compile={args.compile}")
    print(f"{'layout':10} {'step ms':>9} {'tokens/s':>11} {'vs L':>6} {'peak GiB':>9} {'vs L':>6} {'MFU':>6} {'reserved GiB':>12} {'res/alloc':>9}")
    for label, r in results.items():
        if "error" in r:
            print(f"{label:10} failed: {r['error']}")
            continue
        speed = r["tokens_per_s"] / base["tokens_per_s"] if "tokens_per_s" in base else float("nan")
        memory = r["peak_bytes"] / base["peak_bytes"] if base.get("peak_bytes") else float("nan")
        mfu = r["model_flops_per_s"] / devices / peak if peak else float("nan")
        print(f"{label:10} {r['step_s'] * 1e3:9.1f} {r['tokens_per_s']:11.0f} {speed:6.2f} {r['peak_bytes'] / 2**30:9.2f}"
              f" {memory:6.2f} {mfu:6.1%} {r['reserved_bytes'] / 2**30:12.2f} {r['reserved_bytes'] / max(1, r['peak_bytes']):9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
