"""Peak memory per rank, during set-up and during training, for a GPT larger than one rank's share.

Not a timed test. One spawned group of ``--ranks`` gloo processes per layout trains the package's
GPT (default: fp32 parameters >= 1 GiB) for ``--steps`` SGD steps (no momentum: model state is
parameters + gradients). Layouts: Lightning's own ``ddp`` (the model built as usual, on every
rank) beside our ``zero3``, ``tp``, ``pp``, dp2 x tp2 and ``3d``, each built under
``Trainer.init_module(empty_init=True)`` (meta device; every rank allocates and initialises only
what it holds, see ``lightning_parallel/parallel/materialize.py``).

Measured on every rank, two points: at ``on_train_start`` (set-up done; pipelines build their
stages in the first step, so for them the second point includes it) and after the last step:

* tensor-accurate peak live bytes (``LiveBytes`` below: a dispatch mode that sees every tensor
  an op returns and every storage resize, and the storage's free), entered before the model is
  built; the set-up peak is reset at ``on_train_start`` so the second number is training's own;
* peak RSS growth over the process at start (``VmHWM`` after ``clear_refs``; includes the
  allocator's caching and everything that is not a tensor), and of it the growth of file-backed
  pages (``RssFile`` at the end over the start: libtorch's code and data paged in as kernels first
  run, the same pages in every rank of a node, which a cgroup charges once, not once per rank);
* the parameters and gradients each rank holds after the last step (local storage);
* the step time (mean after the first step), and with ``--compare-unpinned`` the same layout run
  again with glibc's dynamic mmap threshold (``parallel/allocator.py`` switched off): peak RSS and the
  step-time ratio, pinned / dynamic; with ``--compare-before`` once more without any of issue 29's
  measures (dynamic threshold, torch's huge pages off, pipeline stages' weight gradients through autograd's temporaries
  instead of ``parallel/pipeline/grad_accumulation.py``, FSDP2's host buffers allocated per unit and
  gloo's own reduce-scatter and all-gather instead of ``parallel/data/fsdp_host.py``'s): the
  step-time ratio now / before.

Per layout a second line gives the peak RSS growth per rank (the larger of set-up and training)
in units of the whole model's parameter bytes P, beside the tensor-exact training peak and the ideal
(share + activations), also in P.

Share per rank: ``(P + G) / ranks`` (``P + G`` for ``ddp``, which replicates). The ideal, as the
issue defines it, is the share plus the activations the layout keeps: measured per rank on the run
itself (``SavedActivations``: the peak bytes autograd saves for backward, parameters excluded),
so each layout's own batch split, tensor sharding and microbatches in flight count. Printed per
layout (worst rank): the set-up peak against the share (nothing is saved for backward there), the
training peak against the share and against the ideal, the activations, the held state. What a
training peak holds beyond its ideal is the layout's transient copies (FSDP2's gathered blocks
and unsharded gradients, pipeline buffers) and the step's temporaries.

Run: ``python benchmarks/bench_memory.py`` (default: P = 1025 MiB. Heavy: ``ddp`` peaks at 3.2 GiB
RSS per rank, 13 GiB for 4 ranks, our layouts at 0.9-2.7 GiB per rank; each layout took 1-4 min
on 2 shared cores; the README's table is this script's output. ``--layers 4 --width 128 --heads 4
--vocab 256`` for a quick check of the script).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import weakref
from pathlib import Path
from typing import Any, Iterator

import torch

from lightning_parallel.parallel.allocator import HUGE_PAGES_VARIABLE
from lightning_parallel.testing import run_distributed

HYBRID = "lightning_parallel:HybridParallelStrategy"
LAYOUTS: dict[str, Any] = {
    "ddp": "ddp",
    "zero3": "zero3",
    "zero3-sublayer": {"class": HYBRID, "zero_stage": 3, "fsdp_units": "sublayer"},
    "tp": "tp",
    "pp": "pp",
    "dp2xtp2": {"class": HYBRID, "tensor_parallel_size": 2, "zero_stage": 3},
    "3d": "3d",
    "zero2": "zero2",
    "zero3_offload": "zero3_offload",
}


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)
    except OSError:
        pass


def _site() -> str:
    """Where the program is (innermost frames of torch's FSDP, autograd, optimizers and this package):
    printed for the worst rank's training peak, to say what the transient copies at the peak are."""
    import traceback

    keep = ("lightning_parallel", "fsdp", "autograd", "optim", "pipelining")
    frames = [f for f in traceback.extract_stack()[:-2] if any(k in f.filename for k in keep)]
    return " < ".join(f"{Path(f.filename).name}:{f.name}" for f in reversed(frames[-4:]))


class LiveBytes:
    """Tensor-accurate live and peak CPU bytes: a dispatch mode that records the storage of every
    tensor an op returns (DTensors: their local tensor) until the storage is freed, plus storage
    resizes (FSDP2 frees and refills unsharded parameters with ``untyped_storage().resize_``).
    Written here because ``MemTracker``'s per-module attribution refuses Lightning's and the
    pipeline's call patterns (a module called twice in one step, hooks out of order)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        self.peak_site = ""
        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                for leaf in torch.utils._pytree.tree_leaves(out):
                    if isinstance(leaf, torch.Tensor):
                        tracker.track(leaf)
                return out

        self.mode = Mode()
        self._resize = torch.UntypedStorage.resize_

    def track(self, tensor: torch.Tensor) -> None:
        local = getattr(tensor, "_local_tensor", tensor)
        if local.device.type != "cpu" or local.is_meta:
            return
        storage = local.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        self._set(key, storage.nbytes())
        weakref.finalize(storage, self._set, key, 0)

    def _set(self, key: int, nbytes: int) -> None:
        self.current += nbytes - self.live.get(key, 0)
        if nbytes:
            self.live[key] = nbytes
        else:
            self.live.pop(key, None)
        if self.current > self.peak:
            self.peak = self.current
            self.peak_site = _site()

    def __enter__(self) -> LiveBytes:
        original, tracker = self._resize, self

        def resize(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            if storage._cdata in tracker.live or size:
                if storage._cdata not in tracker.live:
                    weakref.finalize(storage, tracker._set, storage._cdata, 0)
                tracker._set(storage._cdata, int(size))
            return result

        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]


class SavedActivations:
    """Peak bytes of what autograd keeps for backward, parameters excluded: the activations a
    layout keeps (the issue's "plus the activations the layout keeps"), measured on the run
    itself, so each layout's own batch split, tensor sharding and in-flight microbatches count.

    A ``saved_tensors_hooks`` pack hook sees every tensor saved for backward; its storage is
    counted once while it lives (DTensors: their local tensor). Parameters and views of them
    (a linear layer saves its weight; FSDP2's gathered parameters are ``nn.Parameter`` too) are
    model state or the layout's transient copies, not activations, and are left out."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if isinstance(tensor, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter):
            return tensor
        local = getattr(tensor, "_local_tensor", tensor)
        if local.device.type != "meta":
            storage = local.untyped_storage()
            key = storage._cdata
            if key not in self.live:
                self.live[key] = storage.nbytes()
                self.current += self.live[key]
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return tensor

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def switch_off_issue_29(unpinned: bool, before: bool) -> None:
    """In a benchmark rank, before the strategy exists: ``unpinned`` leaves glibc's dynamic mmap
    threshold as it is (``parallel/allocator.py`` off); ``before`` also takes away issue 29's other
    measures: pipeline stages' weight gradients through autograd's temporaries instead of
    ``parallel/pipeline/grad_accumulation.py``, and FSDP2's host buffers allocated per unit through
    gloo's own reduce-scatter and all-gather instead of ``parallel/data/fsdp_host.py``'s."""
    if unpinned or before:
        import lightning_parallel.parallel.allocator as allocator

        allocator.pin_host_allocator = lambda *a, **k: False  # type: ignore[assignment]
    if before:
        import lightning_parallel.parallel.data.fsdp_host as fsdp_host
        import lightning_parallel.parallel.pipeline.runtime as pipeline_runtime
        from lightning_parallel.parallel.data.host_buffers import HostBufferPool

        pipeline_runtime.gemm_accumulated_weight_grads = lambda enabled=True: contextlib.nullcontext()  # type: ignore[assignment]
        fsdp_host._is_gloo = lambda group: False  # type: ignore[assignment]
        HostBufferPool.take = lambda self, numel, dtype, device, allocate=None: torch.empty(numel, dtype=dtype, device=device)  # type: ignore[method-assign]


@contextlib.contextmanager
def ranks_environment(before: bool) -> Iterator[None]:
    """Around the spawn of a group of ranks: the ``before`` ranks start with torch's huge-page advice
    off (``THP_MEM_ALLOC_ENABLE=0``, which ``import lightning_parallel`` leaves as the user's choice,
    ``parallel/allocator.py``). torch reads it once, at a process's first CPU allocation, so it
    cannot be switched off inside the rank as :func:`switch_off_issue_29` switches off the rest."""
    saved = os.environ.get(HUGE_PAGES_VARIABLE)
    if before:
        os.environ[HUGE_PAGES_VARIABLE] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(HUGE_PAGES_VARIABLE, None)
        else:
            os.environ[HUGE_PAGES_VARIABLE] = saved


def _worker(args: argparse.Namespace, layout: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, DistributedSampler

    import lightning_parallel  # noqa: F401
    from lightning_parallel.models.gpt import GPT
    from lightning_parallel.testing.parity import _make_strategy, token_data

    torch.set_num_threads(1)
    switch_off_issue_29(unpinned=args.unpinned, before=args.before)
    _reset_peak_rss()
    base_rss, base_file = _status("VmRSS"), _status("RssFile")
    step_times: list[float] = []
    tracker = LiveBytes()
    saved = SavedActivations()
    points: dict[str, dict[str, Any]] = {}

    def snapshot() -> dict[str, Any]:
        return {"tracked": tracker.peak, "rss": _status("VmHWM") - base_rss, "activations": saved.peak,
                "site": tracker.peak_site}

    class Points(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            step_times.append(time.perf_counter() - self.t0)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            points["setup"] = snapshot()
            tracker.peak = tracker.current  # the training peak from here on
            _reset_peak_rss()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            from torch.distributed.tensor import DTensor

            local = [p.to_local() if isinstance(p, DTensor) else p for p in pl_module.parameters()]
            grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in pl_module.parameters()) if g is not None]
            points["state"] = {"params": sum(t.untyped_storage().nbytes() for t in {t.untyped_storage()._cdata: t for t in local}.values()),
                               "grads": sum(g.numel() * g.element_size() for g in grads)}

    kwargs = {"vocab_size": args.vocab, "block_size": args.block, "n_layer": args.layers, "n_head": args.heads,
              "n_embd": args.width, "lr": 1e-3}
    with tracker, saved:
        trainer = pl.Trainer(accelerator="cpu", devices=args.ranks, strategy=_make_strategy(LAYOUTS[layout]),
                             max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                             callbacks=[Points()])
        pl.seed_everything(0, verbose=False)
        if layout == "ddp":
            model = GPT(**kwargs)  # Lightning's ddp: the model as usual (empty_init there means garbage weights)
        else:
            with trainer.init_module(empty_init=True):
                model = GPT(**kwargs)
        if getattr(trainer.strategy, "lightning_module", "n/a") is None:
            trainer.strategy.connect(model)  # '3d' reads the model to choose its degrees
        sampler_kwargs = trainer.strategy.distributed_sampler_kwargs
        data = token_data(64, block_size=args.block, vocab_size=args.vocab)
        sampler = DistributedSampler(data, shuffle=False, drop_last=True, **sampler_kwargs)
        loader = DataLoader(data, batch_size=max(1, args.batch // sampler_kwargs["num_replicas"]), sampler=sampler)
        trainer.fit(model, loader)
    points["train"] = snapshot()
    points["file"] = _status("RssFile") - base_file  # file-backed pages stay mapped: the end is their peak
    dims = getattr(trainer.strategy, "parallel_dims", None)
    later = step_times[1:] or step_times  # the first step builds pipelines and warms up
    return {"points": points, "dims": dims.describe() if dims is not None else "ddp", "step_s": sum(later) / len(later),
            "loss": float(trainer.callback_metrics.get("train_loss", torch.tensor(float("nan"))))}


def _model_bytes(args: argparse.Namespace) -> int:
    from lightning_parallel.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="global batch")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--compare-unpinned", action="store_true",
                        help="run each layout again with glibc's dynamic mmap threshold (parallel/allocator.py off): RSS and step-time ratios")
    parser.add_argument("--compare-before", action="store_true",
                        help="run each layout again without issue 29's measures (dynamic threshold, autograd's weight-gradient "
                             "temporaries in pipeline stages, FSDP2's per-unit host buffers and gloo's own collectives): RSS and "
                             "the step-time ratio now / before")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    P = _model_bytes(args)
    mib = 2**20
    print(f"GPT {args.layers} x {args.width}, vocab {args.vocab}: fp32 parameters P = {P / mib:.0f} MiB; "
          f"{args.ranks} ranks, SGD (model state = P + grads)")
    print(f"{'layout':14} {'mesh':44} {'set-up MiB':>10} {'x share':>7} {'train MiB':>9} {'x share':>7} "
          f"{'activ. MiB':>10} {'x ideal':>7} {'params+grads MiB':>16} {'x share':>7} {'RSS set-up/train MiB':>20}")
    for layout in args.layouts.split(","):
        args.unpinned = args.before = False
        results = run_distributed(_worker, args.ranks, args, layout, init_backend=None, timeout=3000)
        share = 2 * P if layout == "ddp" else 2 * P / args.ranks  # params + grads per rank, ideally
        setup = max(r["points"]["setup"]["tracked"] for r in results)
        train = max(r["points"]["train"]["tracked"] for r in results)
        kept = max(r["points"]["train"]["activations"] for r in results)
        # ideal per rank: the share plus the activations that rank's layout keeps; worst rank's ratio
        ideal = max(r["points"]["train"]["tracked"] / (share + r["points"]["train"]["activations"]) for r in results)
        state = max(r["points"]["state"]["params"] + r["points"]["state"]["grads"] for r in results)
        rss = (max(r["points"]["setup"]["rss"] for r in results), max(r["points"]["train"]["rss"] for r in results))
        print(f"{layout:14} {results[0]['dims'][:44]:44} {setup / mib:10.0f} {setup / share:7.2f} {train / mib:9.0f} "
              f"{train / share:7.2f} {kept / mib:10.0f} {ideal:7.2f} {state / mib:16.0f} {state / share:7.2f} "
              f"{rss[0] / mib:9.0f}/{rss[1] / mib:.0f}   loss {results[0]['loss']:.4f}", flush=True)
        print(f"{'':14} peak RSS growth of each rank, MiB: {[round(r['points']['train']['rss'] / mib) for r in results]}", flush=True)
        worst = max(results, key=lambda r: r["points"]["train"]["tracked"])
        print(f"{'':14} training peak at: {worst['points']['train']['site']}", flush=True)
        rss_peak = max(max(r["points"]["setup"]["rss"], r["points"]["train"]["rss"]) for r in results)
        rss_ideal = max(share + r["points"]["train"]["activations"] for r in results)
        file_backed = max(r["points"]["file"] for r in results)
        step = max(r["step_s"] for r in results)
        line = (f"{'':14} peak RSS growth per rank {rss_peak / P:.2f} P (of it file-backed {file_backed / P:.2f} P; tensor-exact {train / P:.2f} P, ideal {rss_ideal / P:.2f} P;"
                f" x ideal {rss_peak / rss_ideal:.2f}), step {step:.2f} s")
        if args.compare_unpinned:
            args.unpinned = True
            other = run_distributed(_worker, args.ranks, args, layout, init_backend=None, timeout=3000)
            rss_other = max(max(r["points"]["setup"]["rss"], r["points"]["train"]["rss"]) for r in other)
            step_other = max(r["step_s"] for r in other)
            line += f"; glibc's dynamic threshold: {rss_other / P:.2f} P, step {step_other:.2f} s (pinned / dynamic step time {step / step_other:.2f})"
        if args.compare_before:
            args.unpinned = args.before = True
            with ranks_environment(before=True):
                other = run_distributed(_worker, args.ranks, args, layout, init_backend=None, timeout=3000)
            rss_other = max(max(r["points"]["setup"]["rss"], r["points"]["train"]["rss"]) for r in other)
            step_other = max(r["step_s"] for r in other)
            line += f"; before issue 29's measures: {rss_other / P:.2f} P, step {step_other:.2f} s (now / before step time {step / step_other:.2f})"
        print(line, flush=True)
    print("share = (P + grads) / ranks (ddp: P + grads, it replicates); activ. = peak bytes autograd saved for backward"
          " (parameters excluded); ideal = share + that rank's activations (the set-up keeps none: its ideal is the"
          " share); worst rank per column. The rest of a training peak is the layout's transient copies (FSDP2's"
          " gathered blocks and unsharded gradients, pipeline buffers) and the step's temporaries.")


if __name__ == "__main__":
    main()
