"""Issue 9 on this CPU: in-place plans against the make_fx graph plans, paired, many rounds.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 HF_HUB_OFFLINE=1 \
        python benchmarks/inplace_vs_graph.py [model ...] [--rounds 12] [-o out.json]

`compare` measures each strategy once per round in a fixed order, with a dozen strategies
between two measurements of the same plan; on a machine whose speed drifts by tens of percent
within minutes, the in-place and graph rows of one budget can differ by more than the schedules
do. Here only the three strategies of a cell are stepped together, back to back, the order
reversed every other round (none, in place, graph; then graph, in place, none), so that each
round gives one paired ratio in place / graph taken under the same machine state.

For each model of `benchmarks/cpu_sizes.py` that make_fx can trace, at 0.75, 0.5 and 0.3 x the
unplanned activation peak (budget = F + f (N - F), as `compare`): our in-place plan (`solve_within`
on the profile of one real step, applied to the model's modules) and the graph plan
(`plan_from_trace`: op-granular regions, the model replaced by a replay of the trace), both
solved with the same time limit, their peaks measured; then `--rounds` rounds of one warm-up and
two timed steps per strategy. Reported per cell: measured and predicted extra time of each
against none (medians of all timed steps), the median of the per-round ratios in place / graph
and in how many rounds in place was faster, with the two-sided sign-test p-value.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import planner  # noqa: E402
from benchmarks import cpu_sizes  # noqa: E402
from benchmarks._cli import check_models_and_allocator  # noqa: E402
from planner.api import InfeasibleBudgetError, solve_within  # noqa: E402
from planner.comparison import host_allocator  # noqa: E402
from planner.graph.api import plan_from_trace  # noqa: E402
from planner.graph.profiler import profile_with_trace  # noqa: E402
from planner.inplace import apply_schedule, remove  # noqa: E402
from planner.measurement import measure  # noqa: E402

MODELS = ("gpt_eager", "resnet_bn", "unet", "deep_narrow_cnn")
"""The benchmark models make_fx traces (HF GPT-2 and Llama do not: no graph plan to compare)."""
FRACTIONS = (0.75, 0.5, 0.3)
MiB = 2**20


def sign_test_p(wins: int, n: int) -> float:
    """Two-sided sign-test p-value of `wins` successes in `n` fair coin flips."""
    if n == 0:
        return 1.0
    k = min(wins, n - wins)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def _pct(schedule, prof) -> float:
    return 100 * schedule.predicted_recompute_ms / prof.step_ms


def study(name: str, fractions: tuple[float, ...], rounds: int, time_limit_s: float) -> dict:
    torch.manual_seed(0)
    model, x = getattr(cpu_sizes, name)()
    model.train()
    prof = planner.profile(model, x, repeats=2)
    traced = profile_with_trace(model, x, repeats=2)
    none_peak = measure(model, x, repeats=1, held_bytes=prof.held_bytes).peak_bytes
    F = prof.fixed_bytes
    out: dict = {"model": name, "none_peak": none_peak, "fixed": F, "cells": []}
    for f in fractions:
        budget = int(F + f * (none_peak - F))
        cell: dict = {"fraction": f, "budget": budget}
        out["cells"].append(cell)
        s = solve_within(prof, budget, "auto", time_limit_s)
        if not s.feasible:
            cell["status"] = "in place does not fit"
            continue
        try:
            gp = plan_from_trace(model, traced, budget, time_limit_s=time_limit_s)
        except InfeasibleBudgetError:
            cell["status"] = "graph plan does not fit"
            continue
        cell.update(status="ok", inplace_regions=len(s.regions), graph_regions=len(gp.schedule.regions),
                    inplace_method=s.method, graph_method=gp.schedule.method,
                    inplace_pred_pct=_pct(s, prof), graph_pred_pct=_pct(gp.schedule, traced.profile))
        apply_schedule(model, s)
        try:
            cell["inplace_peak"] = measure(model, x, repeats=1, held_bytes=prof.held_bytes).peak_bytes
        finally:
            remove(model)
        cell["graph_peak"] = measure(gp.module, x, repeats=1, held_bytes=prof.held_bytes).peak_bytes
        cell["_plans"] = (s, gp.module)

    for cell in out["cells"]:
        if cell["status"] != "ok":
            continue
        s, graph_module = cell.pop("_plans")

        def step(which: str, s=s, graph_module=graph_module) -> list[float]:
            if which == "graph":
                return measure(graph_module, x, repeats=2).step_ms_all
            if which == "inplace":
                apply_schedule(model, s)
            try:
                return measure(model, x, repeats=2).step_ms_all
            finally:
                if which == "inplace":
                    remove(model)

        samples: dict[str, list[list[float]]] = {"none": [], "inplace": [], "graph": []}
        order = ["none", "inplace", "graph"]
        for r in range(rounds):
            for which in (order if r % 2 == 0 else order[::-1]):
                samples[which].append(step(which))
        med = {k: statistics.median(t for rnd in v for t in rnd) for k, v in samples.items()}
        ratios = [statistics.median(a) / statistics.median(b)
                  for a, b in zip(samples["inplace"], samples["graph"])]
        wins = sum(q < 1 for q in ratios)
        cell.update(
            samples_ms=samples, step_ms=med,
            inplace_extra_pct=100 * (med["inplace"] / med["none"] - 1),
            graph_extra_pct=100 * (med["graph"] / med["none"] - 1),
            paired_ratio_median=statistics.median(ratios),
            inplace_faster_rounds=wins, rounds=len(ratios),
            sign_test_p=sign_test_p(wins, len(ratios)))
    return out


def table(rows: list[dict]) -> str:
    lines = ["| model | budget | in place: peak MiB, extra (pred), regions | graph: peak MiB, extra "
             "(pred), regions | paired in place / graph: median, rounds in place faster, p |",
             "|---|---|---|---|---|"]
    for r in rows:
        for c in r["cells"]:
            head = f"| {r['model']} | {c['fraction']:g}x = {c['budget'] / MiB:.1f} MiB | "
            if c["status"] != "ok":
                lines.append(head + f"{c['status']} | | |")
                continue
            lines.append(
                head + f"{c['inplace_peak'] / MiB:.1f}, {c['inplace_extra_pct']:+.1f}% "
                f"({c['inplace_pred_pct']:+.1f}%), {c['inplace_regions']} | "
                f"{c['graph_peak'] / MiB:.1f}, {c['graph_extra_pct']:+.1f}% "
                f"({c['graph_pred_pct']:+.1f}%), {c['graph_regions']} | "
                f"{c['paired_ratio_median']:.3f}, {c['inplace_faster_rounds']} of {c['rounds']}, "
                f"{c['sign_test_p']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(MODELS))
    ap.add_argument("--fractions", type=lambda s: tuple(float(v) for v in s.split(",")),
                    default=FRACTIONS)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds per solve")
    ap.add_argument("-o", "--output", default=None, help="write the rows as JSON")
    ap.add_argument("--table", metavar="JSON", help="print the table of a saved run, measure nothing")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())["rows"]))
        return 0
    check_models_and_allocator(ap, args.models, MODELS, "inplace_vs_graph")
    rows = []
    t_all = time.perf_counter()
    for name in args.models:
        t0 = time.perf_counter()
        rows.append(study(name, args.fractions, args.rounds, args.time_limit))
        rows[-1]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {rows[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
        if args.output:  # after each model: a long run stopped early keeps what it measured
            Path(args.output).write_text(json.dumps(
                {"allocator": host_allocator(), "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "rounds": args.rounds,
                 "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "seconds": round(time.perf_counter() - t_all, 1), "rows": rows}, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
