"""Context parallelism: peak memory per rank and step time at 1K-16K tokens, cp 1 / 2 / 4 side by side.

Not a timed test (issue 27, item 5 and its memory "Done when"). A Hugging Face ``LlamaForCausalLM``
from a small random config (hidden 256, 8 heads, 2 key/value heads, 4 layers, vocab 512; built
offline) is trained through the real path: the package's ``HFCausalLM`` LightningModule (the
``labels=`` loss, as HF users write it; AdamW so the optimizer's state shows), Lightning's
Trainer, batch 1 of one sequence. One group of fresh spawned gloo processes per layout runs every
sequence length in turn (one ``Trainer.fit`` each):

* ``cp1``: one process, no strategy: HF's own SDPA attention (causal, no mask: torch's CPU flash
  kernel). The reference every ratio is taken to.
* ``cp2-allgather``, ``cp2-ring``, ``cp4-allgather``, ``cp4-ring``, ``cp2-ulysses``, ``cp4-ulysses``:
  ``HybridParallelStrategy`` with ``context_parallel_size`` 2/4 and each attention form; each rank
  holds ``S / cp`` tokens.
* ``tp2``: the layout without cp on the same number of ranks and the same batch of one sequence:
  tensor parallelism (heads and MLP columns split; data parallelism cannot split a batch of one).
  Sequence parallelism beside it, Megatron's way to cut the rest of the activations, is refused
  for Hugging Face models (they build masks and positions from the split length), and tp4 is
  refused for this model (2 key/value heads); on 4 ranks ``tp2xcp2`` (all-gather form) stands
  beside cp4.

Per rank, per sequence length: ``--warmup`` untimed steps, ``--steps`` timed steps, then one step
(forward, backward, optimizer) inside ``MemTracker`` (``torch.distributed._tools.mem_tracker``: a
dispatch mode that counts every CPU tensor storage exactly and files it as parameter, buffer,
gradient, optimizer state, activation (made in forward) or temporary (made in backward)):

* ``peak``: the step's peak of all tracked tensors; ``state``: parameters + buffers + gradients +
  optimizer state at that moment;
* ``activ.``: the step's peak of everything that is not state (activations + backward temporaries),
  the number the issue's targets are about; its ``fwd/bwd`` split at that moment;
* ``RSS``: peak resident set (``VmHWM`` after ``clear_refs``, Linux) of the timed steps: absolute,
  and its growth over the RSS at the step's start (coarse: the allocator's pages, not tensors);
* ``step``: median wall time of the timed steps (worst rank); ``CPU s``: the median CPU time
  (user + system) of a timed step on the worst rank: the machine is shared, and 4 ranks share 2
  cores, so a rank's CPU time is the steadier figure for its own work.

Worst rank per column. Ratios to ``cp1`` at the same length. With ``--explain`` (default: the
longest length) the largest groups of non-state tensors alive at the worst rank's activation peak
are printed: the op that made them, their shape, the module (layer index folded to ``*``).

Run (2 shared CPU cores, gloo). The whole grid in one invocation takes about an hour here (the
ring form runs 70-100 s a step at 8K tokens), so it is run in pieces of under 10 minutes that
append to one JSON file, and ``--merge`` prints them as one table::

    python benchmarks/bench_context_parallel.py --seqs 1024,2048 --out cp.json        # every layout
    python benchmarks/bench_context_parallel.py --seqs 4096 --steps 1 --out cp.json
    python benchmarks/bench_context_parallel.py --seqs 8192 --steps 1 --out cp.json \
        --layouts cp1,cp2-allgather,cp4-allgather,cp2-ulysses,cp4-ulysses,tp2,tp2xcp2
    python benchmarks/bench_context_parallel.py --seqs 8192 --steps 1 --layouts cp2-ring --out cp.json  # ~5 min
    python benchmarks/bench_context_parallel.py --seqs 8192 --steps 1 --layouts cp4-ring --out cp.json  # ~4 min
    python benchmarks/bench_context_parallel.py --seqs 8192 --steps 1 --layouts cp4-ring \
        --ring-tile-elements 1048576 --out cp.json        # what-if: the ring's query tile 16x smaller
    python benchmarks/bench_context_parallel.py --seqs 16384 --steps 1 --layouts cp1,cp2-allgather --out cp.json
    python benchmarks/bench_context_parallel.py --merge cp.json --explain 8192

Results and their reading: ``docs/context.md`` ("Memory and speed (measured)").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.utils.weak import WeakIdKeyDictionary

from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.real_models import HFCausalLM

HYBRID = "lightning_parallel:HybridParallelStrategy"
LLAMA = {"vocab_size": 512, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
         "num_hidden_layers": 4, "intermediate_size": 688, "max_position_embeddings": 32768}


def _cp(size: int, form: str) -> tuple[int, Any]:
    return size, {"class": HYBRID, "context_parallel_size": size, "context_parallel_attention": form}


def _tp(size: int, cp: int = 1) -> tuple[int, Any]:
    return size * cp, {"class": HYBRID, "tensor_parallel_size": size, "context_parallel_size": cp}


LAYOUTS: dict[str, tuple[int, Any]] = {
    "cp1": (1, "auto"),
    "cp2-allgather": _cp(2, "allgather"),
    "cp2-ring": _cp(2, "ring"),
    "cp4-allgather": _cp(4, "allgather"),
    "cp4-ring": _cp(4, "ring"),
    "cp2-ulysses": _cp(2, "ulysses"),
    "cp4-ulysses": _cp(4, "ulysses"),
    "tp2": _tp(2),
    "tp2xcp2": _tp(2, cp=2),
}
# the wrappers' path down to the LlamaForCausalLM (DDP or FSDPStepWrapper, the LightningModule, none at cp1)
ROOT = r"^(\w+\.module\.model\.|AdamLlama\.model\.|LlamaForCausalLM\.)"
STATE = (_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD, _MemRefType.OPT)


class AdamLlama(HFCausalLM):
    """``HFCausalLM`` with AdamW, so the optimizer's state appears beside parameters and gradients."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class StepTracker(MemTracker):
    """``MemTracker`` that also keeps the peak of the non-state tensors (activations and backward
    temporaries) and, at that peak, which groups of tensors (op, shape, dtype, module) made it up.

    Why a subclass: ``MemTracker`` reports categories at the moment of the *total* peak; the
    issue's target is the activation peak, and the question after it is which tensors dominate.
    And ``MemTracker`` files everything after the optimizer's step pre-hook as optimizer state,
    but Lightning runs the whole forward and backward inside ``optimizer.step(closure)``: here the
    optimizer's region starts at Lightning's ``on_before_optimizer_step`` (after the closure) and
    ends at the step's post-hook, as ``MemTracker``'s own does."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.activation_peak = 0
        self.split: dict[str, int] = {}
        self.contents: Counter[tuple[str, str]] = Counter()
        self.counts: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._func = func  # read by ``_track``, which labels a new storage before the peak is taken
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        super()._track(reftype, t)
        if t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        if storage not in self.labels:
            module = max(self._mod_tracker.parents, key=len)  # the innermost module running
            module = re.sub(r"\.\d+(\.|$)", r".*\1", re.sub(ROOT, "", module))
            dtype = str(t.dtype).replace("torch.", "")
            self.labels[storage] = f"{self._func} {list(t.shape)} {dtype} in {module}"

    def _register_global_optimizer_hook(self) -> None:
        super()._register_global_optimizer_hook()
        pre, post = self._optimizer_hook_handles or (None, None)
        if pre is not None:
            pre.remove()  # the region is opened by ``optimizer_begins`` instead

    def optimizer_begins(self) -> None:
        self._in_opt = True

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        snap = self._curr_mem_snap.get(torch.device("cpu"))
        if snap is None:
            return
        other = sum(v for k, v in snap.items() if k not in STATE and k != "Total")
        if other > self.activation_peak:
            self.activation_peak = other
            self.split = {"fwd": snap[_MemRefType.ACT], "bwd": snap[_MemRefType.TEMP]}
            self.contents, self.counts = Counter(), Counter()
            for storage, (info, _) in self._WINFO.items():
                if info.reftype not in STATE:
                    key = (str(info.reftype.value), self.labels.get(storage, "(no label)"))
                    self.contents[key] += info.mem_consumed
                    self.counts[key] += 1


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _cpu_s() -> float:
    """CPU seconds of this process (user + system, all threads): the machine is shared, so beside
    the wall time; system time counts the page faults of large fresh buffers."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS (Linux)
    except OSError:
        pass


def _fit(args: argparse.Namespace, layout: str, seq: int) -> dict[str, Any]:
    """One ``Trainer.fit`` of ``warmup + steps + 1`` steps at ``seq`` tokens; the last step is tracked."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_parallel.testing.parity import _make_strategy, token_data

    ranks, strategy = LAYOUTS[layout]
    tracked_at = args.warmup + args.steps
    times: list[float] = []
    cpu: list[float] = []
    rss: list[tuple[int, int]] = []
    result: dict[str, Any] = {}

    class Measure(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.tracker = None
            if batch_idx == tracked_at:
                self.tracker = StepTracker()
                self.tracker.track_external(pl_module, *trainer.optimizers)
                self.tracker.__enter__()
            _reset_peak_rss()
            self.rss0, self.t0, self.cpu0 = _status("VmRSS"), time.perf_counter(), _cpu_s()

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self.tracker is not None:
                self.tracker.optimizer_begins()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            elapsed, used, hwm = time.perf_counter() - self.t0, _cpu_s() - self.cpu0, _status("VmHWM")
            if self.tracker is not None:
                self.tracker.__exit__(None, None, None)
                t = self.tracker
                snap = t.get_tracker_snapshot("peak")[torch.device("cpu")]
                result.update(peak=snap["Total"], state=sum(snap[k] for k in STATE), activ=t.activation_peak,
                              split=t.split, contents=[(v, t.counts[k], *k) for k, v in t.contents.most_common(args.top)],
                              params=snap[_MemRefType.PARAM], grads=snap[_MemRefType.GRAD], opt=snap[_MemRefType.OPT])
            elif batch_idx >= args.warmup:
                times.append(elapsed)
                cpu.append(used)
                rss.append((hwm, hwm - self.rss0))

    trainer = pl.Trainer(accelerator="cpu", devices=ranks, strategy=_make_strategy(strategy), max_steps=tracked_at + 1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[Measure()])
    pl.seed_everything(0, verbose=False)
    model = AdamLlama(family="LlamaConfig/LlamaForCausalLM", config=LLAMA, loss="labels", lr=1e-4)
    sampler_kwargs = trainer.strategy.distributed_sampler_kwargs if ranks > 1 else {"num_replicas": 1, "rank": 0}
    data = token_data(tracked_at + 1, block_size=seq, vocab_size=LLAMA["vocab_size"])
    loader = DataLoader(data, batch_size=1, sampler=DistributedSampler(data, shuffle=False, **sampler_kwargs))
    trainer.fit(model, loader)
    dims = getattr(trainer.strategy, "parallel_dims", None)
    result.update(step_s=statistics.median(times), cpu_s=statistics.median(cpu), rss=max(r[0] for r in rss),
                  rss_growth=max(r[1] for r in rss), dims=dims.describe() if dims is not None else "1 process",
                  loss=float(trainer.callback_metrics["train_loss"]))
    return result


def _worker(args: argparse.Namespace, layout: str) -> list[dict[str, Any]]:
    from lightning_parallel.parallel.allocator import pin_host_allocator

    torch.set_num_threads(1)
    if args.ring_tile_elements:  # a what-if: the ring's query tile, a module constant of attention.py
        import lightning_parallel.parallel.context.attention as attention

        attention.TILE_ELEMENTS = args.ring_tile_elements
    pin_host_allocator()  # as every strategy does at set-up; here for cp1 too, so RSS compares alike
    return [_fit(args, layout, seq) for seq in args.seq_list]


def _worst(results: list[dict[str, Any]], key: str) -> Any:
    return max(r[key] for r in results)


def _code_version() -> str:
    """The commit measured, and whether the context-parallel code differs from it (the numbers
    belong to that code: attention.py's memory changes from commit to commit)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "lightning_parallel/parallel/context",
                                "lightning_parallel/strategies"], cwd=root, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" + local changes" if dirty else "")


def _print(rows: list[dict[str, Any]], explain: set[int]) -> None:
    """The table (ratios to cp1 at the same length, where cp1 is among ``rows``) and the peak contents."""
    mib = 2**20
    base = {row["seq"]: row["ranks"] for row in rows if row["layout"] == "cp1"}
    print(f"\nLlama {LLAMA}, batch 1, AdamW, fp32, gloo, {os.cpu_count()} CPU cores; worst rank per column; MiB;"
          f" code: {', '.join(sorted({row['code'] for row in rows}))}")
    print(f"{'seq':>6} {'layout':22} {'peak':>6} {'state':>5} {'activ.':>6} {'fwd/bwd':>9} {'x cp1':>5} "
          f"{'RSS':>5} {'RSS grow':>8} {'step s':>7} {'x cp1':>5} {'CPU s':>6}  loss")
    order = list(LAYOUTS)
    for row in sorted(rows, key=lambda r: (r["seq"], order.index(r["layout"].split()[0]), r["layout"])):
        rs, cp1 = row["ranks"], base.get(row["seq"])
        activ, step = _worst(rs, "activ"), _worst(rs, "step_s")
        worst = max(rs, key=lambda r: r["activ"])
        ratio = f"{activ / _worst(cp1, 'activ'):5.2f}" if cp1 else f"{'':5}"
        t_ratio = f"{step / _worst(cp1, 'step_s'):5.2f}" if cp1 else f"{'':5}"
        split = f"{worst['split']['fwd'] / mib:.0f}/{worst['split']['bwd'] / mib:.0f}"
        print(f"{row['seq']:>6} {row['layout']:22} {_worst(rs, 'peak') / mib:6.0f} {_worst(rs, 'state') / mib:5.0f} "
              f"{activ / mib:6.0f} {split:>9} {ratio} {_worst(rs, 'rss') / mib:5.0f} {_worst(rs, 'rss_growth') / mib:8.0f} "
              f"{step:7.2f} {t_ratio} {_worst(rs, 'cpu_s'):6.2f}  {rs[0]['loss']:.4f}")
    for row in rows:
        if row["seq"] in explain:
            worst = max(row["ranks"], key=lambda r: r["activ"])
            print(f"\nAt the activation peak: {row['layout']}, {row['seq']} tokens, {worst['activ'] / mib:.0f} MiB"
                  " (worst rank; Activation = made in forward, Temp = in backward):")
            for nbytes, count, kind, label in worst["contents"]:
                print(f"  {nbytes / mib:7.1f} MiB {count:3d} x {kind:10} {label}")
            rest = worst["activ"] - sum(c[0] for c in worst["contents"])
            print(f"  {rest / mib:7.1f} MiB       everything else")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="1024,2048,4096,8192", help="sequence lengths, comma-separated")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per length (median)")
    parser.add_argument("--ring-tile-elements", type=int, default=0,
                        help="what-if: set the ring's TILE_ELEMENTS (scores per query tile; 0 = as shipped, 2**24)")
    parser.add_argument("--top", type=int, default=6, help="groups of tensors printed at the activation peak")
    parser.add_argument("--explain", default="", help="lengths whose peak contents are printed (default: the longest)")
    parser.add_argument("--out", help="also append this run's rows to a JSON file (runs split by length add up)")
    parser.add_argument("--merge", help="print the table of JSON files written by --out (comma-separated); runs nothing")
    args = parser.parse_args()
    if args.merge:
        rows = [row for path in args.merge.split(",") for row in json.loads(Path(path).read_text())]
        explain = {int(s) for s in args.explain.split(",") if s} or {max(r["seq"] for r in rows)}
        _print(rows, explain)
        return
    if args.steps < 1:
        parser.error("--steps must be at least 1 (the timed steps; the tracked step comes after them)")
    args.seq_list = [int(s) for s in args.seqs.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    suffix = f" tile={args.ring_tile_elements}" if args.ring_tile_elements else ""
    rows, code = [], _code_version()
    for layout in args.layouts.split(","):
        started, load = time.perf_counter(), os.getloadavg()[0]
        per_rank = run_distributed(_worker, LAYOUTS[layout][0], args, layout, init_backend=None, timeout=3000,
                                   fresh_process=True)
        load_end = os.getloadavg()[0]
        rows += [{"seq": seq, "layout": layout + suffix, "ranks": [r[i] for r in per_rank], "load": [load, load_end],
                  "code": code}
                 for i, seq in enumerate(args.seq_list)]
        print(f"# {layout}: {per_rank[0][0]['dims']}, {time.perf_counter() - started:.0f} s, load average"
              f" {load:.1f} -> {load_end:.1f}", flush=True)
    if args.out:
        old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else []
        Path(args.out).write_text(json.dumps(old + rows))
    _print(rows, {int(s) for s in args.explain.split(",") if s} or {max(args.seq_list)})


if __name__ == "__main__":
    main()
