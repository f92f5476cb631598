"""Tensor-parallel collectives per training step, counted with ``CommDebugMode``, against the Megatron minimum.

Why: a tensor-parallel layout that computes the right numbers can still send far more than it
needs (issue 26, item 4): a region whose q, k and v projections each all-reduce their input
gradient in backward sends three all-reduces where one suffices. Parity tests cannot see that;
only counting can. This benchmark trains each model of the coverage matrix that ``tp`` runs
(``lightning_parallel.coverage.MODELS``: the Hugging Face families and ViT), the package's GPT
(separate q/k/v) and a nanoGPT-style GPT with a fused ``c_attn`` (defined here), unchanged,
through a Lightning ``Trainer`` with ``HybridParallelStrategy`` (``run_fit``, the path the parity
tests take), and counts the collectives of one step (the second: the first traces pipeline
stages) with torch's ``torch.distributed.tensor.debug.CommDebugMode``:

* **DTensor collectives** (functional collectives: what tensor parallelism issues), by kind and
  phase: forward (outside autograd) and backward (inside an autograd graph task);
* **plain ``torch.distributed`` calls** (c10d ops: logging with ``sync_dist``, the pipeline's
  point-to-point sends and receives, loss and log exchange), by kind, reported beside;
* **bytes**: per collective the larger of its input and output (the full tensor an all-reduce
  reduces, the gathered tensor of an all-gather, the unreduced input of a reduce-scatter).

Layouts: ``tp2`` (2 processes, eager tensor parallelism) and ``tp2 x pp2`` (4 processes;
tensor parallelism inside the traced pipeline stages), counts per stage and per forward, i.e.
the step's counts divided by the microbatches. Collectives after ``on_before_optimizer_step``
(clipping, the optimizer) are not part of forward + backward and are left out.

The minimum, per forward (Megatron, no sequence parallelism), ``R`` the tensor-parallel regions
this rank's stage computes (per block: the attention, and the feed-forward, a dense MLP or an MoE
layer, and a shared expert beside the routed ones as a region of its own, as Megatron-Core's
``SharedExpertMLP`` reduces its own output and input gradient, when the layout splits them),
``E`` = 1 if the stage runs a
vocabulary-parallel token embedding, ``H`` = 1 if it runs a column-parallel LM head whose output
is gathered:

    forward:  R + E all-reduces (each region's output, the embedding's output) + H all-gathers (the logits)
    backward: I + H all-reduces, I the distinct tensors the column-parallel layers read (one
              reduction of each one's gradient: q, k and v, or gate and up, sum theirs before it;
              so do a parallel block's attention and MLP, which read the same normalised input,
              and every decoder layer's cross-attention, which reads the one encoder output; an MoE
              layer's routed experts count once), from the forward the planner recorded; the LM head's input gradient
    bytes:    4 * N * C per all-reduce + 4 * N * V per all-gather (fp32; N tokens per forward,
              width C, vocabulary V)

So a 4-block Llama under tp2 needs 8 + 1 all-reduces and 1 all-gather forward, 8 + 1
all-reduces backward: 18 all-reduces + 1 all-gather per step. The printed ratio is measured /
minimum (counts of DTensor collectives, and bytes).

Run: ``python benchmarks/bench_tp_comms.py`` (every model, both layouts; ``--models llama,gpt2``,
``--layouts tp2``; ``--where MODEL`` also prints the per-module counts of one model under tp2,
from ``CommDebugMode``'s module tracker).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
import traceback
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.coverage import MODELS as COVERAGE_MODELS
from lightning_parallel.models.gpt import GPT, Block, CausalSelfAttention
from lightning_parallel.testing import run_distributed
from lightning_parallel.testing.comm_counts import MEASURED_STEP, RESULTS
from lightning_parallel.testing.parity import FitSpec, run_fit

HYBRID = "lightning_parallel:HybridParallelStrategy"
LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {  # name -> (strategy kwargs, processes)
    "tp2": ({"tensor_parallel_size": 2}, 2),
    "tp2 x pp2": ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 4),
    "tp2 sp": ({"tensor_parallel_size": 2, "sequence_parallel": True}, 2),
}
# ---------------------------------------------------------------- a nanoGPT-style GPT (fused c_attn)
class FusedCausalSelfAttention(CausalSelfAttention):
    """nanoGPT's attention: one ``c_attn`` Linear computing ``[q | k | v]``, split in the forward."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__(n_embd, n_head, dropout, bias)
        del self.q, self.k, self.v
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class FusedGPT(GPT):
    """The package's GPT with nanoGPT's fused ``c_attn`` in every block (same names otherwise)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for block in self.blocks:
            assert isinstance(block, Block)
            block.attn = FusedCausalSelfAttention(self.n_embd, self.n_head, self.dropout, self.bias)
        self.apply(self._init_weights)


def _gpt_spec(model: str) -> FitSpec:
    return FitSpec(model=model, model_kwargs={"vocab_size": 64, "block_size": 16, "n_layer": 4, "n_head": 4, "n_embd": 32},
                   data="lightning_parallel.testing.parity:token_data", global_batch=8)


def model_specs() -> dict[str, FitSpec]:
    """Every coverage model ``tp`` runs (ResNet has nothing to split), the GPT and the fused GPT."""
    specs = {name: spec for name, spec in COVERAGE_MODELS.items() if name != "resnet"}
    specs["gpt (package, q/k/v)"] = _gpt_spec("lightning_parallel.models:GPT")
    specs["gpt fused c_attn"] = _gpt_spec(f"{__name__}:FusedGPT")
    return specs


# ---------------------------------------------------------------- runs
def _worker(cases: list[tuple[str, str, FitSpec]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    out: list[dict[str, Any]] = []
    for model, layout, spec in cases:
        RESULTS.clear()
        try:
            run_fit(spec)
            out.append(RESULTS[-1] if RESULTS else {"model": model, "layout": layout, "error": "nothing measured"})
        except Exception as error:  # noqa: BLE001 - reported in the table
            out.append({"model": model, "layout": layout, "error": f"{type(error).__name__}: {error}".splitlines()[0][:200],
                        "trace": traceback.format_exc()[-3000:]})
    return out


def _case(model: str, base: FitSpec, layout: str, track_modules: bool = False) -> FitSpec:
    kwargs, devices = LAYOUTS[layout]
    return dataclasses.replace(
        base, strategy={"class": HYBRID, **kwargs}, devices=devices, max_steps=MEASURED_STEP + 1, trainer_kwargs={},
        callbacks=[("lightning_parallel.testing.comm_counts:CommCounter", {"model": model, "layout": layout, "track_modules": track_modules})],
    )


def _per_forward(counts: dict[str, int], key: str, microbatches: int) -> float:
    return counts.get(key, 0) / microbatches


def _fmt(x: float) -> str:
    return f"{x:g}" if x == int(x) else f"{x:.2f}"


def _other(counts: dict[str, int], microbatches: int) -> str:
    """DTensor kinds besides forward AR/AG and backward AR, and plain torch.distributed calls, per forward."""
    parts = []
    for key in sorted(counts):
        phase, source, kind = key.split("/")
        if kind == "bytes" or phase == "after" or (source == "dtensor" and (phase, kind) in (("fwd", "AR"), ("fwd", "AG"), ("bwd", "AR"))):
            continue
        parts.append(f"{phase if source == 'dtensor' else 'c10d'} {kind} {_fmt(counts[key] / microbatches)}")
    return ", ".join(parts) or "-"


def _minimum_text(m: dict[str, Any]) -> str:
    """``fwd AR + AG / bwd AR`` without sequence parallelism; with it every kind, per phase."""
    if not any(m.get(k) for k in ("fwd_RS", "bwd_AG", "bwd_RS")):
        return f"{m['fwd_AR']} + {m['fwd_AG']} / {m['bwd_AR']}"
    return " / ".join(", ".join(f"{kind} {m[f'{phase}_{kind}']}" for kind in ("AR", "AG", "RS") if m.get(f"{phase}_{kind}"))
                      for phase in ("fwd", "bwd"))


def format_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | layout (stage) | fwd AR | fwd AG | bwd AR | DTensor MiB | minimum fwd AR + AG / bwd AR | min MiB | ratio count | ratio bytes | other collectives |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['layout']} | error: {r['error'].replace('|', '/')} ||||||||| |")
            continue
        c, m = r["counts"], r["minimum"]
        mb = m["microbatches"]
        stage = "" if m["stage"] == "all" else f" ({m['stage']} stage, per microbatch of {mb})"
        fwd_ar = _per_forward(c, "fwd/dtensor/AR", mb)
        fwd_ag = _per_forward(c, "fwd/dtensor/AG", mb)
        bwd_ar = _per_forward(c, "bwd/dtensor/AR", mb)
        total = sum(v for k, v in c.items() if k.split("/")[1] == "dtensor" and k.split("/")[0] != "after"
                    and k.split("/")[2] != "bytes") / mb
        nbytes = sum(v for k, v in c.items() if k.endswith("dtensor/bytes") and not k.startswith("after")) / mb
        minimum = sum(m.get(f"{phase}_{kind}", 0) for phase in ("fwd", "bwd") for kind in ("AR", "AG", "RS"))
        ratio = f"{total / minimum:.2f}" if minimum else ("-" if not total else "inf")
        ratio_bytes = f"{nbytes / m['bytes']:.2f}" if m["bytes"] else "-"
        lines.append(
            f"| {r['model']} | {r['layout']}{stage} | {_fmt(fwd_ar)} | {_fmt(fwd_ag)} | {_fmt(bwd_ar)} | {nbytes / 2**20:.3f} "
            f"| {_minimum_text(m)} | {m['bytes'] / 2**20:.3f} | {ratio} | {ratio_bytes} | {_other(c, mb)} |"
        )
    return "\n".join(lines)


def _rows(per_rank: list[list[dict[str, Any]]], layout: str) -> list[dict[str, Any]]:
    """One row per model (tp2: rank 0) or per model and stage (tp2 x pp2: the first rank of each stage)."""
    ranks = [0, 2] if "pp2" in layout else [0]
    rows = []
    for i in range(len(per_rank[0])):
        for rank in ranks:
            rows.append(per_rank[rank][i])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    specs = model_specs()
    parser.add_argument("--models", help=f"comma-separated subset of {list(specs)} (prefix match)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {list(LAYOUTS)}")
    parser.add_argument("--where", help="also print one model's per-module counts (CommDebugMode's module tracker)")
    parser.add_argument("--where-layout", default="tp2", choices=[k for k, (_, n) in LAYOUTS.items() if n == 2],
                        help="the layout --where counts under")
    args = parser.parse_args(argv)
    names = list(specs)
    if args.models:
        wanted = [w.strip() for w in args.models.split(",") if w.strip()]
        names = [n for n in names if any(n == w or n.startswith(w + " ") for w in wanted)]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    for layout in layouts:
        cases = [(name, layout, _case(name, specs[name], layout)) for name in names]
        per_rank = run_distributed(_worker, LAYOUTS[layout][1], cases, init_backend=None, timeout=300.0 + 120.0 * len(cases))
        rows.extend(_rows(per_rank, layout))
    print("Minimum per forward (no sequence parallelism): forward R + E all-reduces + H all-gathers, backward R + H all-reduces;")
    print("R = split regions (attention, feed-forward per block), E = vocabulary-parallel embedding, H = gathered LM head;")
    print("with sequence parallelism (tp2 sp) per region an all-gather and a reduce-scatter each way, the stream's ends, and")
    print("one all-reduce per replicated parameter on the split stream (norms; Megatron-LM coalesces them into one);")
    print("bytes 4*N*C per activation collective + 4*N*V per logits all-gather (fp32). Measured: DTensor collectives of step 2")
    print("(forward + backward), per microbatch under pp; 'other': further DTensor kinds and plain torch.distributed (c10d) calls.")
    print(format_table(rows))
    sites: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        for site in row.get("sites", {}):
            sites[site].add(row["layout"])
    print("\nplain torch.distributed calls in the measured step (kind at caller: layouts):")
    for site, where in sorted(sites.items()):
        print(f"  {site}: {', '.join(sorted(where))}")
    for row in rows:
        if "trace" in row:
            print(f"\n--- {row['model']} {row['layout']}:\n{row['trace']}")
    if args.where:
        name = next(n for n in specs if n == args.where or n.startswith(args.where + " "))
        result = run_distributed(_worker, 2, [(name, args.where_layout, _case(name, specs[name], args.where_layout, track_modules=True))],
                                 init_backend=None, timeout=600.0)[0][0]
        print(f"\nper-module collectives of {name} under {args.where_layout} (rank 0; CommDebugMode module tracker; a parent counts its children's):")
        for module, entry in result.get("modules", {}).items():
            if re.search(r"\.[1-9]\d*(\.|$)", module):
                continue  # one block of each is enough
            fwd = ", ".join(f"{k} {v}" for k, v in entry.get("forward", {}).items())
            bwd = ", ".join(f"{k} {v}" for k, v in entry.get("backward", {}).items())
            if fwd or bwd:
                print(f"  {module}: forward [{fwd}] backward [{bwd}]")
    print(f"({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
