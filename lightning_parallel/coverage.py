"""The model x strategy coverage table, generated: ``python -m lightning_parallel.coverage``.

Every cell trains one real library model (``lightning_parallel.testing.real_models``) under one
strategy and compares it with one process on the same global batch (fp32, five steps, gradient
clipping on): the cell shows the maximum relative difference of per-step losses and final
parameters, ``refused: <first line>`` for a typed configuration error raised before any
collective (allowed), ``n/a`` where the strategy does not apply (``ep`` on a dense model), or
``FAIL: <first line>`` for an internal error, a timeout, a mismatch above 1e-5 or a layout that
silently shards nothing. Any FAIL makes the exit status non-zero.

All cells of one world size run in one spawned group (start-up dominates a tiny fit); see
:mod:`lightning_parallel.testing.coverage_cells` for how a group that breaks part-way is resumed.

    python -m lightning_parallel.coverage --out coverage.md            # the full matrix
    python -m lightning_parallel.coverage --subset ci                  # every model and strategy once
    python -m lightning_parallel.coverage --models llama,gpt2 --strategies dp,tp
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_parallel.testing.coverage_cells import TOLERANCE, run_cells
from lightning_parallel.testing.parity import FitSpec, run_fit
from lightning_parallel.testing.more_families import MORE_FAMILIES
from lightning_parallel.testing.real_models import HF_FAMILIES, MOE_FAMILIES

_RM = "lightning_parallel.testing.real_models"
CLIP = 0.5
RESNET_LR = 0.02
COLLECTIVE_TIMEOUT_S = 120.0  # a cell stuck in a collective fails instead of holding the whole run

MODELS: dict[str, FitSpec] = {
    **{family: FitSpec(model=f"{_RM}:HFCausalLM", model_kwargs={"family": family},
                       data="lightning_parallel.testing.parity:token_data", global_batch=8, max_steps=5)
       for family in HF_FAMILIES},
    # sync_batchnorm: the one-process reference normalises over the global batch (see docs/coverage.md).
    # lr 0.02: at SGD lr 0.1 this tiny ResNet's zero-initialised BatchNorm biases amplify fp32
    # reduction-order round-off to ~1.1e-5 relative within five steps (dp and zero3 alike).
    "resnet": FitSpec(model=f"{_RM}:VisionClassifier", model_kwargs={"arch": "resnet", "lr": RESNET_LR},
                      data=f"{_RM}:image_data", global_batch=8, max_steps=5, trainer_kwargs={"sync_batchnorm": True}),
    "vit": FitSpec(model=f"{_RM}:VisionClassifier", model_kwargs={"arch": "vit"}, data=f"{_RM}:image_data",
                   global_batch=8, max_steps=5),
    # Families the tensor-parallel planner was not written against (issue 26): its plans come from the dataflow.
    **{name: FitSpec(model=f"{_RM}:HFCausalLM", model_kwargs={"family": family, "loss": loss, "config": config},
                     data="lightning_parallel.testing.parity:token_data", global_batch=8, max_steps=5)
       for name, (family, loss, config) in MORE_FAMILIES.items()},
}

# name -> world size; the strategy is the registered preset of that name.
STRATEGIES: dict[str, int] = {"dp": 2, "zero1": 2, "zero2": 2, "zero3": 2, "hsdp": 4, "tp": 2, "pp": 2, "ep": 2, "cp": 2,
                              "3d": 4}

# Every model and every strategy at least once (what CI's tests cover, as one command).
CI_SUBSET: list[tuple[str, str]] = [
    ("llama", "tp"), ("qwen2", "pp"), ("gpt2", "zero3"), ("gpt_neox", "zero1"), ("phi3", "zero2"),
    ("mixtral", "ep"), ("qwen2_moe", "ep"), ("resnet", "dp"), ("vit", "hsdp"), ("llama", "3d"), ("gpt2", "cp"),
    # tp2 x pp2 with a value crossing the cut as tp shards (T5's position bias, parallel/pipeline/shard_crossing.py)
    ("t5", "3d"),
    # The planner's dataflow plans under tp on every further family (mamba: a typed refusal, it splits too little).
    *[(name, "tp") for name in MORE_FAMILIES],
]


@dataclass
class Cell:
    model: str
    strategy: str
    kind: str = "pending"  # ok | mismatch | refused | error | n/a
    value: float | None = None
    message: str = ""
    dims: str | None = None  # the layout the strategy resolved to (e.g. "pp=2 x ... tp=1 (ep=1)")
    local_fraction: float | None = None  # of the parameters each rank holds (shown for tp: what the plan split)

    @property
    def id(self) -> str:
        return f"{self.model}__{self.strategy}"

    @property
    def failed(self) -> bool:
        return self.kind in ("mismatch", "error", "pending")

    def text(self) -> str:
        if self.kind == "ok":
            held = f" (holds {self.local_fraction:.0%})" if self.strategy == "tp" and self.local_fraction else ""
            return f"{self.value:.1e}{held}"
        if self.kind == "n/a":
            return "n/a"
        if self.kind == "refused":
            return f"refused: {_cell_escape(self.message)}"
        if self.kind == "mismatch":
            return f"FAIL: {self.value:.1e} > {TOLERANCE:.0e}"
        return f"FAIL: {_cell_escape(self.message or 'no result')}"


def _cell_escape(text: str, limit: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def applies(model: str, strategy: str) -> bool:
    return strategy != "ep" or model in MOE_FAMILIES


def cell_spec(model: str, strategy: str) -> FitSpec:
    base = MODELS[model]
    return dataclasses.replace(
        base,
        strategy={"class": "lightning_parallel.strategies.registry:strategy_from_name", "name": strategy,
                  "timeout": COLLECTIVE_TIMEOUT_S},
        devices=STRATEGIES[strategy],
        trainer_kwargs={**base.trainer_kwargs, "gradient_clip_val": CLIP},
    )


def reference_spec(model: str) -> FitSpec:
    """One process, plain Lightning (no sync_batchnorm: one process already sees the global batch)."""
    base = MODELS[model]
    kwargs = {k: v for k, v in base.trainer_kwargs.items() if k != "sync_batchnorm"}
    return dataclasses.replace(base, strategy="auto", devices=1, trainer_kwargs={**kwargs, "gradient_clip_val": CLIP})


def format_table(cells: list[Cell], models: list[str], strategies: list[str]) -> str:
    """Markdown: one row per model, one column per strategy (world size in the header)."""
    by_key = {(c.model, c.strategy): c for c in cells}
    header = "| model | " + " | ".join(f"{s} ({STRATEGIES.get(s, '?')})" for s in strategies) + " |"
    lines = [header, "|" + "---|" * (len(strategies) + 1)]
    for model in models:
        row = [by_key[(model, s)].text() if (model, s) in by_key else "" for s in strategies]
        lines.append(f"| {model} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def format_layouts(cells: list[Cell], strategies: list[str]) -> str:
    """Which layout each strategy resolved to (several where it depends on the model)."""
    lines = []
    for strategy in strategies:
        layouts: dict[str, list[str]] = {}
        for cell in cells:
            if cell.strategy == strategy and cell.dims:
                layouts.setdefault(cell.dims, []).append(cell.model)
        if layouts:
            shown = "; ".join(f"`{dims}`" + (f" ({', '.join(models)})" if len(layouts) > 1 else "")
                              for dims, models in layouts.items())
            lines.append(f"- {strategy}: {shown}")
    return "\n".join(lines)


def _run_group(world: int, cells: list[Cell], refs: dict[str, str], work: Path, timeout_per_cell: float) -> None:
    """Run ``cells`` on ``world`` ranks, restarting a fresh group after a cell that broke one."""
    from lightning_parallel.testing import DistributedRunError, run_distributed

    pending = [c for c in cells if c.kind == "pending"]
    while pending:
        jobs = [(c.id, cell_spec(c.model, c.strategy), c.strategy, refs[c.model]) for c in pending]
        error = ""
        try:
            run_distributed(run_cells, world, jobs, str(work), timeout_per_cell, init_backend=None,
                            timeout=60.0 + (timeout_per_cell + 30.0) * len(jobs))
        except DistributedRunError as exc:
            error = _first_error_line(str(exc))
        progressed = False
        for cell in pending:
            record_file, started = work / f"{cell.id}.json", work / f"{cell.id}.started"
            if record_file.exists():
                record = json.loads(record_file.read_text())
                cell.kind, cell.value, cell.message = record["kind"], record.get("value"), record.get("message", "")
                cell.dims, cell.local_fraction = record.get("dims"), record.get("local_fraction")
                progressed = True
            elif started.exists():  # began but never reported: it broke the group (or hung)
                cell.kind, cell.message = "error", error or "no result (the group stopped)"
                progressed = True
                break
        pending = [c for c in pending if c.kind == "pending"]
        if pending and not progressed:  # the group died before its first cell started
            for cell in pending:
                cell.kind, cell.message = "error", error or "the process group did not start"
            return


def _first_error_line(message: str) -> str:
    """The exception line of the first failed rank's traceback in a DistributedRunError message."""
    lines = message.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("--- rank") and "failed" in line:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("--- rank")), len(lines))
            body = [x for x in lines[i + 1:end] if x]
            for candidate in body:
                if candidate.startswith("RuntimeError: cell "):
                    return candidate.split(": ", 2)[-1]
            tail = [x for x in body if x[:1].isalpha() and ":" in x and not x.startswith("Traceback")]
            return tail[-1] if tail else line
        if "no result within" in line:
            return "timeout: " + line.strip("- ")
    return lines[0] if lines else "failed"


def run_matrix(pairs: list[tuple[str, str]], *, timeout_per_cell: float = 300.0, work_dir: str | None = None) -> list[Cell]:
    """Run every (model, strategy) pair; references in this process, cells grouped per world size."""
    cells = [Cell(m, s) if applies(m, s) else Cell(m, s, kind="n/a") for m, s in pairs]
    with tempfile.TemporaryDirectory(prefix="lp_coverage_") as tmp:
        work = Path(work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        refs: dict[str, str] = {}
        for model in sorted({c.model for c in cells if c.kind == "pending"}):
            reference = run_fit(reference_spec(model))
            refs[model] = str(work / f"reference_{model}.pt")
            torch.save(reference, refs[model])
        for world in sorted({STRATEGIES[c.strategy] for c in cells}):
            _run_group(world, [c for c in cells if STRATEGIES[c.strategy] == world], refs, work, timeout_per_cell)
    return cells


def select(models: list[str], strategies: list[str], subset: str | None) -> list[tuple[str, str]]:
    if subset == "ci":
        return [(m, s) for m, s in CI_SUBSET if m in models and s in strategies]
    return [(m, s) for m in models for s in strategies]


def _names(value: str | None, known: list[str], what: str) -> list[str]:
    if not value:
        return known
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; choose from {known}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_parallel.coverage", description=__doc__.split("\n")[0])
    parser.add_argument("--models", help=f"comma-separated subset of {list(MODELS)}")
    parser.add_argument("--strategies", help=f"comma-separated subset of {list(STRATEGIES)}")
    parser.add_argument("--subset", choices=["ci"], help="a covering subset: every model and strategy at least once")
    parser.add_argument("--out", help="write the markdown table to this file (it is printed either way)")
    parser.add_argument("--timeout-per-cell", type=float, default=300.0, help="seconds before a cell counts as hung")
    parser.add_argument("--work-dir", help="keep the per-cell records (JSON, tracebacks) here instead of a temp dir")
    args = parser.parse_args(argv)
    models = _names(args.models, list(MODELS), "models")
    strategies = _names(args.strategies, list(STRATEGIES), "strategies")
    start = time.monotonic()
    cells = run_matrix(select(models, strategies, args.subset), timeout_per_cell=args.timeout_per_cell, work_dir=args.work_dir)
    used_models = [m for m in models if any(c.model == m for c in cells)]
    used_strategies = [s for s in strategies if any(c.strategy == s for c in cells)]
    table = format_table(cells, used_models, used_strategies)
    layouts = format_layouts(cells, used_strategies)
    if layouts:
        table += "\n\nLayouts the presets resolved to (mesh `pp x dp_replicate x dp_shard x tp`, experts `ep`):\n\n" + layouts
    failed = [c for c in cells if c.failed]
    summary = (f"{len(cells)} cells, {sum(c.kind == 'ok' for c in cells)} match, {sum(c.kind == 'refused' for c in cells)}"
               f" refused, {sum(c.kind == 'n/a' for c in cells)} n/a, {len(failed)} failed"
               f" ({time.monotonic() - start:.0f} s)")
    print(table)
    print(summary)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
