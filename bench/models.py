"""The benchmarks' models: factories the other scripts name, and the throughput of model variants.

Factories: ``bench/train.py`` (and ``bench/recovery.py`` through it) name ``bench.models:mlp``,
``bench.models:uneven`` and ``bench.models:regression``. The workers of a cellmesh job import
them by name, and the torch peers build the same modules from the same functions (seeded
alike, see ``coordinator.runtime.factories.build_model``), so every configuration of a
benchmark trains the same model from the same initial parameters on the same samples.

Run as a script, it trains every model variant of :data:`VARIANTS` on one embedded harness of
two workers, as a pipeline of 2 stages (1F1B, 4 microbatches, the cut the planner chooses)
and as data parallel 2, and prints their samples/s side by side, with the loss after the last
step (both plans train the same batches, so the losses agree). The variants: the GPT-style
model of ``examples/gpt.py``, built from ready-made cells (cut between cells), and the same GPT
written as one plain ``nn.Module`` (:class:`PlainGPT`), which torch.fx traces into nodes and the
planner cuts inside. A variant is one more entry of :data:`VARIANTS`: a key, a label and its
factories with their keywords. Every round runs
every variant and plan once, the plans' order swapped round by round; the table shows the
median over rounds and the spread (min-max).

    python bench/models.py [--steps 10] [--warmup 3] [--rounds 3] [--quick] [--only gpt-cells]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.rounds import parse_rounds, round_parser
from services.compute.cell import Cell

__all__ = ["PLANS", "UNEVEN_LAYERS", "VARIANTS", "WIDTH", "PlainGPT", "Variant", "block", "gpt_plain", "mlp",
           "regression", "uneven"]

WIDTH = 1024
# Linear+GELU layers per cell of the uneven model: 12 layers in 8 cells, the heavy ones last.
# An even split by cells ([4, 4]) gives the stages 4 and 8 layers; the best cut ([6, 2]) 6 and 6.
UNEVEN_LAYERS = (1, 1, 1, 1, 1, 1, 3, 3)


def block(num_layers: int = 1, width: int = WIDTH) -> nn.Sequential:
    """``num_layers`` x (Linear(width, width) + GELU)."""
    layers: list[nn.Module] = []
    for _ in range(num_layers):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def mlp(num_cells: int = 8, width: int = WIDTH) -> list[Cell]:
    """The benchmarks' baseline: 8 cells of Linear(1024, 1024) + GELU (8.4 M parameters)."""
    return [Cell(f"block{i}", block(1, width)) for i in range(num_cells)]


def uneven(layers: tuple[int, ...] | list[int] = UNEVEN_LAYERS, width: int = WIDTH) -> list[Cell]:
    """Cells of unequal cost: cell ``i`` is ``layers[i]`` x (Linear + GELU); ``[B, width]`` crosses cuts."""
    return [Cell(f"block{i}", block(n, width)) for i, n in enumerate(layers)]


def regression(num_samples: int = 256, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and targets, ``[num_samples, width]`` each (float32)."""
    return torch.randn(num_samples, width), torch.randn(num_samples, width)


# -- the model variants' throughput ------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = 2
GLOBAL_BATCH = 32
SEED = 0
GPT_SIZE = {"width": 128, "heads": 4, "blocks": 4, "seq": 64}


class PlainGPT(nn.Module):
    """``examples/gpt.py``'s model written as one plain ``nn.Module``, without cells: token and position
    embeddings, a ``ModuleList`` of the same transformer blocks, the same head. torch.fx traces it into
    7 nodes (the embedding with the position add, 4 blocks, the head's norm and its linear layer), and
    the planner cuts it where its profile says, not where cells say."""

    def __init__(self, vocab: int, width: int, heads: int, blocks: int, seq: int) -> None:
        super().__init__()
        from services.compute.library import LMHead, TransformerBlock

        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)
        # the library's block and head modules, unwrapped: no Cell anywhere in this model
        self.blocks = nn.ModuleList(TransformerBlock(f"b{i}", width, heads).module for i in range(blocks))
        head = LMHead("head", width, vocab).module
        self.norm, self.out = head.norm, head.out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.out(self.norm(x))
        return out


def gpt_plain(width: int = 96, heads: int = 4, blocks: int = 4, seq: int = 64) -> PlainGPT:
    """The plain-module GPT of :class:`PlainGPT` at ``examples/gpt.py``'s sizes (vocabulary 256: bytes)."""
    return PlainGPT(256, width, heads, blocks, seq)


@dataclass(frozen=True)
class Variant:
    """One model to measure: its factories (``module:function`` names) and their keywords."""

    key: str
    label: str
    model: str
    data: str
    loss: str
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    data_kwargs: Mapping[str, Any] = field(default_factory=dict)


VARIANTS = (
    Variant("gpt-cells", "GPT of ready-made cells (examples/gpt.py)", "examples.gpt:model",
            "examples.gpt:data", "examples.gpt:loss", GPT_SIZE, {"seq": GPT_SIZE["seq"]}),
    Variant("gpt-plain", "the same GPT as one plain nn.Module, cut by torch.fx", "bench.models:gpt_plain",
            "examples.gpt:data", "examples.gpt:loss", GPT_SIZE, {"seq": GPT_SIZE["seq"]}),
)
PLANS: dict[str, tuple[str, dict[str, Any]]] = {
    "pp2": ("2 stages, 1F1B x 4", dict(data_parallel=1, num_stages=2, num_microbatches=4, schedule="1f1b")),
    "dp2": ("data parallel 2", dict(data_parallel=2, num_stages=1, num_microbatches=1)),
}


def make_job(variant: Variant, plan: Mapping[str, Any]) -> Any:
    """``variant`` as a cellmesh job on ``plan``'s fields (AdamW, global batch 32, float32)."""
    from coordinator.planning.resources import Resources
    from coordinator.runtime.job import Job

    return Job(model=variant.model, data=variant.data, loss=variant.loss,
               model_kwargs=dict(variant.model_kwargs), data_kwargs=dict(variant.data_kwargs),
               optimizer="AdamW", optimizer_kwargs={"lr": 1e-3}, global_batch=GLOBAL_BATCH, seed=SEED,
               resources=Resources.local(WORKERS), step_timeout_s=120, **plan)


def measure(job: Any, harness: Any, steps: int, warmup: int) -> dict[str, float]:
    """Seconds per step over ``steps`` steps after ``warmup``, and the loss of the last one.

    A step's request commits the previous step, so the first step after the warm-up is left out
    of the timing (as ``bench/train.py`` does): each timed step carries one commit.
    """
    with job.attach(harness):
        job.fit(max(0, warmup - 1))
        records = job.fit(steps + 1).steps[1:]
    return {"step_s": (records[-1].end - records[0].start) / steps, "loss": records[-1].loss}


def _cell(values: list[float], fmt: str = ".1f", unit: str = "") -> str:
    """Median (min-max); one value if they all print alike."""
    low, mid, high = (format(v, fmt) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid}{unit}" if low == high else f"{mid}{unit} ({low}-{high})"


def report(rounds: list[dict[tuple[str, str], dict[str, float]]], jobs: Mapping[tuple[str, str], Any],
           args: argparse.Namespace, elapsed: float) -> str:
    from coordinator.runtime.factories import build_model, unwrapped

    out = [f"# model variants: 2 pipeline stages against data parallel {WORKERS}, on {WORKERS} local workers",
           "",
           f"date {dt.date.today()}, {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}; "
           f"global batch {GLOBAL_BATCH}, float32, AdamW, 1 thread per worker; {len(rounds)} rounds x "
           f"{args.steps} timed steps after {args.warmup} warm-up steps (run took {elapsed:.0f} s); "
           "median (min-max) over rounds", "",
           "| model | parameters | plan | cut | samples/s | ms/step | pipeline / data parallel "
           "| loss after last step |",
           "|---|---|---|---|---|---|---|---|"]
    for variant in (v for v in VARIANTS if any(k[0] == v.key for k in jobs)):
        params = sum(p.numel() for p in unwrapped(build_model(variant.model, variant.model_kwargs,
                                                                   SEED)).parameters())
        for plan_key, (plan_label, _) in PLANS.items():
            key = (variant.key, plan_key)
            steps = [r[key]["step_s"] for r in rounds]
            ratio = ""
            if plan_key == "pp2":
                ratios = [r[(variant.key, "dp2")]["step_s"] / r[key]["step_s"] for r in rounds]
                ratio = _cell(ratios, ".2f", "x")
            plan = jobs[key].plan()
            out.append(f"| {variant.label} | {params / 1e6:.2f} M | {plan_label} | {list(plan.bounds)} "
                       f"| {_cell([GLOBAL_BATCH / s for s in steps])} | {_cell([s * 1e3 for s in steps])} "
                       f"| {ratio} | {_cell([r[key]['loss'] for r in rounds], '.4f')} |")
    return "\n".join(out)


def main() -> None:
    parser = round_parser(__doc__, "variant, plan")
    parser.add_argument("--only", default="", help="comma-separated variant keys (default: all)")
    args = parse_rounds(parser)
    from coordinator.runtime.factories import job_factories
    from coordinator.runtime.harness import LocalHarness

    variants = [v for v in VARIANTS if not args.only or v.key in args.only.split(",")]
    started = time.monotonic()
    jobs = {(v.key, p): make_job(v, fields) for v in variants for p, (_, fields) in PLANS.items()}
    for (variant, plan_key), job in jobs.items():
        print(f"[plan] {variant} {plan_key}: {job.plan().summary()}, cut {list(job.plan().bounds)}",
              file=sys.stderr)
    factories = sorted({name for job in jobs.values() for name in job_factories(job.config)})
    rounds: list[dict[tuple[str, str], dict[str, float]]] = []
    with LocalHarness([f"local-{i}" for i in range(WORKERS)], job="bench-models", threads=1,
                      python_path=[ROOT], lease_ttl=timedelta(seconds=5), factories=factories) as harness:
        for i in range(args.rounds):
            measured: dict[tuple[str, str], dict[str, float]] = {}
            for key in sorted(jobs, reverse=bool(i % 2)):
                measured[key] = measure(jobs[key], harness, args.steps, args.warmup)
                print(f"[round {i + 1}/{args.rounds}] {key[0]} {key[1]}: "
                      f"{measured[key]['step_s'] * 1e3:.1f} ms/step", file=sys.stderr)
            rounds.append(measured)
    print(report(rounds, jobs, args, time.monotonic() - started))


if __name__ == "__main__":
    main()
