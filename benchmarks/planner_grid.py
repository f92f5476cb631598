"""The layout planner's first choice over a grid of model sizes x device counts (seeds, section 5.1).

The seeds advise: small models, data parallelism; large ones, FSDP or model parallelism; very
large ones, hybrids. Nothing here states that rule: each cell is the planner's fastest fitting
layout (planner/search.py) for a GPT of that size on that many A100-80GB devices (8 per node),
a global batch of 4 sequences of 2,048 tokens per device, bf16, AdamW. Prints a markdown table
(docs/planner.md, "What the planner picks by model size and device count") and, with ``--plot FILE``, draws it with matplotlib.

    python benchmarks/planner_grid.py [--hardware a100-80gb] [--plot docs/planner_grid.png]
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_parallel.models import GPT
from lightning_parallel.planner.search import SearchSpace, plan_layouts

# (label, layers, hidden, heads): GPT-2 small/XL, then GPT-3-like widths.
SIZES = [("125M", 12, 768, 12), ("1.3B", 24, 2048, 16), ("6.7B", 32, 4096, 32), ("13B", 40, 5120, 40),
         ("30B", 48, 7168, 56), ("70B", 80, 8192, 64), ("175B", 96, 12288, 96)]
DEVICES = [8, 32, 128, 512]


def family(layout: object) -> str:
    """A coarse name for the table: data parallel, sharded, model parallel, or a hybrid."""
    tp, pp, dp, zero = layout.tp, layout.pp, layout.dp, layout.zero_stage  # type: ignore[attr-defined]
    if tp == 1 and pp == 1:
        return "DP" if zero == 0 else f"ZeRO-{zero}"
    model = "TP" if pp == 1 else "PP" if tp == 1 else "TPxPP"
    return model if dp == 1 else f"DP x {model}" + (f" (ZeRO-{zero})" if zero else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="a100-80gb")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    space = SearchSpace(cpu_offload=(False,), hybrid_shard=(False,), virtual_stages=(2,))
    grid: dict[tuple[str, int], str] = {}
    start = time.perf_counter()
    for label, layers, hidden, heads in SIZES:
        with torch.device("meta"):
            model = GPT(vocab_size=51200, block_size=2048, n_layer=layers, n_head=heads, n_embd=hidden)
        for devices in DEVICES:
            try:
                chosen = plan_layouts(model, devices, global_batch=4 * devices, hardware=args.hardware, space=space).chosen
                grid[(label, devices)] = f"{family(chosen.layout)}: {chosen.layout.describe()}"
            except ValueError:
                grid[(label, devices)] = "does not fit"
    print(f"| model | " + " | ".join(f"{d} devices" for d in DEVICES) + " |")
    print("|---|" + "---|" * len(DEVICES))
    for label, *_ in SIZES:
        print(f"| {label} | " + " | ".join(grid[(label, d)] for d in DEVICES) + " |")
    print(f"\n({args.hardware}, 8 per node, batch 4 x 2048 tokens per device; {time.perf_counter() - start:.0f} s)")
    if args.plot:
        _plot(grid, args.plot)


def _plot(grid: dict[tuple[str, int], str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({cell.split(":")[0] for cell in grid.values()})
    colours = {n: i for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    data = [[colours[grid[(s[0], d)].split(":")[0]] for d in DEVICES] for s in SIZES]
    ax.imshow(data, cmap="tab10", aspect="auto", vmin=0, vmax=9)
    for i, size in enumerate(SIZES):
        for j, d in enumerate(DEVICES):
            ax.text(j, i, grid[(size[0], d)].split(":")[0], ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(DEVICES)), [str(d) for d in DEVICES])
    ax.set_yticks(range(len(SIZES)), [s[0] for s in SIZES])
    ax.set_xlabel("devices")
    ax.set_ylabel("GPT parameters")
    ax.set_title("planner's first choice (predicted fastest that fits)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
