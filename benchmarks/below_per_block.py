"""Issue 13 on this CPU: below per-block checkpointing, on the six benchmark models.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 HF_HUB_OFFLINE=1 \
        python benchmarks/below_per_block.py [model ...] [--rounds 3] [--autocast bf16] [-o out.json]

For each model of `benchmarks/cpu_sizes.py`: per-block checkpointing (every repeated block one
region, as HF's `gradient_checkpointing_enable()` places them) applied in place and its peak
measured; the smallest peak the planner can reach (nested regions included); our plan at 20%
below per-block's measured peak, verified (gradients against the unplanned model, measured peak
against the budget and against the prediction). Step times: none, per-block and ours measured in
turn, `--rounds` rounds of one warm-up and two timed steps each; medians, as ratios to none's
median of the same run. Prints a Markdown table (benchmarks/RESULTS.md, "Below per-block").
"""

from __future__ import annotations

import argparse
import json
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
from planner.api import plan_from_profile  # noqa: E402
from planner.comparison import host_allocator  # noqa: E402
from planner.inplace import apply_schedule, remove  # noqa: E402
from planner.measurement import measure  # noqa: E402
from solvers import solve  # noqa: E402
from solvers.solve import lowest  # noqa: E402

MODELS = ("gpt_eager", "hf_gpt2", "hf_llama", "resnet_bn", "unet", "deep_narrow_cnn")
MiB = 2**20
BELOW = 0.20
"""How far below per-block's measured peak the plan's budget is."""


def study(name: str, rounds: int, autocast: torch.dtype | None = None) -> dict:
    torch.manual_seed(0)
    model, x = getattr(cpu_sizes, name)()
    model.train()
    t0 = time.perf_counter()
    prof = planner.profile(model, x, repeats=2, autocast=autocast)
    out: dict = {"model": name, "profile_s": round(time.perf_counter() - t0, 1),
                 "autocast": str(autocast).removeprefix("torch.") if autocast else ""}
    none = measure(model, x, repeats=1, autocast=autocast)
    per_block = solve(prof, 2**62, "per_block")
    out["blocks"] = len(per_block.regions)
    apply_schedule(model, per_block)
    try:
        pb = measure(model, x, repeats=1, autocast=autocast)
    finally:
        remove(model)
    least = lowest(prof, 30.0)
    out.update(none_peak=none.peak_bytes, per_block_peak=pb.peak_bytes,
               per_block_predicted=per_block.predicted_peak_bytes,
               smallest_peak=least.predicted_peak_bytes, smallest_regions=len(least.regions),
               smallest_below_per_block=least.predicted_peak_bytes < pb.peak_bytes)
    budget = int((1 - BELOW) * pb.peak_bytes)
    out["budget"] = budget
    try:
        p = plan_from_profile(model, prof, budget_bytes=budget, time_limit_s=30.0,
                              example_inputs=x)
    except planner.InfeasibleBudgetError as e:
        out["ours"] = f"infeasible: {e}"
        return out
    try:
        v = p.verify(repeats=1)
        ours = p.schedule
    finally:
        remove(model)
    out.update(ours="ok", ours_regions=len(ours.regions), ours_method=ours.method,
               ours_predicted=v.predicted_peak_bytes, ours_peak=v.measured_peak_bytes,
               fits=v.measured_peak_bytes <= budget, max_grad_rel_err=v.max_grad_rel_err,
               predicted_extra_pct=100 * ours.predicted_recompute_ms / prof.step_ms)
    # Step times, in turn: none, per-block, ours; medians of every timed step.
    times: dict[str, list[float]] = {"none": [], "per_block": [], "ours": []}
    schedules = {"none": None, "per_block": per_block, "ours": ours}
    for _ in range(rounds):
        for k, s in schedules.items():
            if s is not None:
                apply_schedule(model, s)
            try:
                times[k] += measure(model, x, repeats=2, autocast=autocast).step_ms_all
            finally:
                if s is not None:
                    remove(model)
    med = {k: statistics.median(v) for k, v in times.items()}
    out["step_ms"] = med
    out["extra_pct"] = {k: 100 * (med[k] / med["none"] - 1) for k in ("per_block", "ours")}
    return out


def table(rows: list[dict]) -> str:
    lines = ["| model | none: peak MiB, step ms | per-block: peak MiB (blocks), extra | budget "
             "(per-block - 20%) | ours: peak MiB (pred), extra (pred), regions | grads max rel "
             "err | smallest peak MiB (regions) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        step = r.get("step_ms", {}).get("none")
        head = (f"| {r['model']} | {r['none_peak'] / MiB:.1f}, "
                f"{'-' if step is None else f'{step:.0f}'} | "
                f"{r['per_block_peak'] / MiB:.1f} ({r['blocks']}), ")
        if r["ours"] != "ok":
            lines.append(head + f"- | {r['budget'] / MiB:.1f} | no plan: below the smallest "
                         f"peak | - | {r['smallest_peak'] / MiB:.1f} ({r['smallest_regions']}) |")
            continue
        lines.append(
            head + f"+{r['extra_pct']['per_block']:.1f}% | {r['budget'] / MiB:.1f} | "
            f"{r['ours_peak'] / MiB:.1f} ({r['ours_predicted'] / MiB:.1f}), "
            f"+{r['extra_pct']['ours']:.1f}% (+{r['predicted_extra_pct']:.1f}%), "
            f"{r['ours_regions']} | {r['max_grad_rel_err']:.1e} | "
            f"{r['smallest_peak'] / MiB:.1f} ({r['smallest_regions']}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(MODELS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-o", "--output", default=None, help="write the rows as JSON")
    ap.add_argument("--table", metavar="JSON", help="print the table of a saved run, measure nothing")
    ap.add_argument("--autocast", choices=("bf16", "fp16"),
                    help="profile, plan and measure with forward and loss under torch.autocast")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())["rows"]))
        return 0
    check_models_and_allocator(ap, args.models, MODELS, "below_per_block")
    rows = []
    for name in args.models:
        t0 = time.perf_counter()
        rows.append(study(name, args.rounds, {"bf16": torch.bfloat16, "fp16": torch.float16,
                                              None: None}[args.autocast]))
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(
            {"allocator": host_allocator(), "torch": torch.__version__,
             "autocast": args.autocast or "",
             "threads": torch.get_num_threads(), "rows": rows}, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
