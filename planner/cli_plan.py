"""`ckpt-planner plan PROFILE --budget-gb G`: solve a saved profile and compare with the baselines.

Imports only `solvers` (no torch), so it plans a profile recorded elsewhere; matplotlib is imported
only for `--plot`.
"""

from __future__ import annotations

import argparse
import sys
import time

from solvers import (
    Profile,
    ProfileError,
    Schedule,
    ScheduleError,
    available_methods,
    simulate,
    solve,
)
from solvers.accumulation import holding_grads
from solvers.distributed import per_rank
from solvers.simulate import peak_breakdown
from solvers.solve import BASELINES, FLOOR_TIME_LIMIT_S, lowest, pareto, smallest_peak
from solvers.units import BudgetError, format_bytes, parse_budget

__all__ = ["add_arguments", "run"]

_GIB = 2**30
SWEEP_POINTS = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", metavar="PROFILE", help="profile file (.json or .json.gz)")
    parser.add_argument(
        "--budget-gb", metavar="BUDGET",
        help="peak memory budget: GiB (2**30 bytes) as a number, or with a unit: 24GiB, 500MiB, "
             "16GB (10**9 bytes)")
    parser.add_argument("--budget-bytes", help="peak memory budget in bytes (or with a unit)")
    parser.add_argument(
        "--min", action="store_true",
        help="the smallest achievable peak, the cheapest schedule that reaches it, and the "
             "memory/time front from there to no checkpointing")
    parser.add_argument("--method", default="auto", help="solver method (default: auto)")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds per solve")
    parser.add_argument("-o", "--output", help="write the chosen schedule as JSON")
    parser.add_argument(
        "--sweep", action="store_true",
        help=f"evaluate every method over {SWEEP_POINTS} budgets, smallest peak to no checkpointing",
    )
    parser.add_argument("--plot", help="with --sweep: write the memory/time frontier as a PNG")
    parser.add_argument(
        "--world-size", type=int, default=None, metavar="N",
        help="plan one rank of N under data parallelism (the profile is one rank's micro-batch): "
             "DDP, or FSDP2 with --fsdp")
    parser.add_argument(
        "--fsdp", action="store_true",
        help="FSDP2: parameters, gradients and optimizer state sharded N ways, the units in "
             "flight all-gathered (fully_shard on each repeated block and the root)")
    parser.add_argument(
        "--grad-accumulation", action="store_true",
        help="plan a step that starts with every gradient held, as every micro-batch after the "
             "first does under gradient accumulation (or with zero_grad(set_to_none=False))")
    parser.add_argument(
        "--fsdp-units", metavar="MODULES",
        help="with --fsdp: comma-separated module names fully_shard is applied to besides the "
             "root (default: every repeated block)")


def _row(name: str, s: Schedule, step_ms: float, secs: float) -> list[str]:
    pct = 100 * s.predicted_recompute_ms / step_ms if step_ms > 0 else 0.0
    return [
        name,
        s.status,
        f"{s.predicted_peak_bytes / _GIB:.4f}",
        f"{s.predicted_recompute_ms:.2f}",
        f"{pct:.1f}",
        str(len(s.regions)),
        f"{secs:.3f}",
    ]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _timed(p: Profile, budget: int, method: str, limit: float | None) -> tuple[Schedule, float]:
    t0 = time.perf_counter()
    s = solve(p, budget, method, limit)
    return s, time.perf_counter() - t0


def _sweep(p: Profile, args: argparse.Namespace) -> int:
    lo, hi = smallest_peak(p), simulate(p).peak_bytes
    budgets = [round(lo + (hi - lo) * k / (SWEEP_POINTS - 1)) for k in range(SWEEP_POINTS)]
    methods = available_methods()[1:]
    rows, points = [], {m: [] for m in methods}
    for b in budgets:
        for m in methods:
            try:
                s, _ = _timed(p, b, m, args.time_limit)
            except ScheduleError:  # under FSDP: segments of several units do not exist
                if p.meta.sharding != "fsdp":
                    raise
                continue
            rows.append([f"{b / _GIB:.4f}", m, s.status, f"{s.predicted_peak_bytes / _GIB:.4f}",
                         f"{s.predicted_recompute_ms:.2f}"])
            if s.feasible:
                points[m].append((b / _GIB, s.predicted_recompute_ms))
    print(_table(["budget GiB", "method", "status", "peak GiB", "extra ms"], rows))
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("ckpt-planner plan: --plot needs matplotlib; install it with "
                  "`pip install matplotlib` (or ckpt-planner[plot])", file=sys.stderr)
            return 2
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m, pts in points.items():
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m)
        ax.set_xlabel("peak memory budget (GiB)")
        ax.set_ylabel("recompute time (ms)")
        ax.set_title(f"memory/time frontier: {p.meta.model_class or args.profile}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        plt.close(fig)
        print(f"wrote {args.plot}")
    return 0


def _minimum(p: Profile, args: argparse.Namespace) -> int:
    """The smallest achievable peak, the schedule that reaches it, and the front above it."""
    limit = args.time_limit if args.time_limit is not None else FLOOR_TIME_LIMIT_S
    t0 = time.perf_counter()
    front = pareto(p, points=SWEEP_POINTS, time_limit_s=limit)
    secs = time.perf_counter() - t0
    best = front[0]
    none = simulate(p).peak_bytes
    act = none - p.fixed_bytes
    print(f"profile {args.profile}: smallest achievable peak {format_bytes(best.predicted_peak_bytes)}"
          f" ({100 * (best.predicted_peak_bytes - p.fixed_bytes) / max(act, 1):.0f}% of the "
          f"activation memory; no checkpointing {format_bytes(none)}), extra "
          f"{best.predicted_recompute_ms:.2f} ms ({100 * best.predicted_recompute_ms / max(p.step_ms, 1e-9):.1f}%)"
          f" with {best.method}; solved in {secs:.2f} s")
    print("at that peak: " + "; ".join(f"{k} {format_bytes(v)}"
                                       for k, v in peak_breakdown(p, best)[:5]))
    rows = [[format_bytes(s.predicted_peak_bytes), f"{s.predicted_recompute_ms:.2f}",
             f"{100 * s.predicted_recompute_ms / max(p.step_ms, 1e-9):.1f}", s.method,
             str(len(s.regions))] for s in front]
    print(_table(["peak", "extra ms", "extra %", "method", "regions"], rows))
    if args.output:
        best.save(args.output)
        print(f"wrote {args.output}")
    return 0


def _per_rank(p: Profile, args: argparse.Namespace) -> Profile:
    """The profile of one rank, as --world-size, --fsdp and --fsdp-units ask."""
    if args.fsdp_units and not args.fsdp:
        raise ValueError("--fsdp-units needs --fsdp")
    world = args.world_size if args.world_size is not None else 1
    if world < 1:
        raise ValueError(f"--world-size is {world}, expected a positive number of ranks")
    units = [u.strip() for u in args.fsdp_units.split(",") if u.strip()] \
        if args.fsdp_units else None
    q = per_rank(p, world_size=world, sharding="fsdp" if args.fsdp else "ddp", units=units)
    mp = q.meta.fsdp_mixed_precision
    what = (f"FSDP2 over {world} ranks, {len(q.meta.shard_units)} units besides the root"
            + (f", computing in {mp['param_dtype']}, stored in {mp['orig_dtype']}, reduced in "
               f"{mp['reduce_dtype']}" if mp else "")
            if args.fsdp else f"DDP over {world} ranks, gradient buckets "
            f"{format_bytes(p.grad_bytes)}")
    print(f"per rank: {what}; fixed memory {format_bytes(q.fixed_bytes)} "
          f"(one process: {format_bytes(p.fixed_bytes)})")
    return q


def run(args: argparse.Namespace) -> int:
    try:
        p = Profile.load(args.profile)
    except ProfileError as e:
        print(f"ckpt-planner plan: {e}", file=sys.stderr)
        return 2
    if p.meta.fsdp_mixed_precision and not p.meta.sharding and not args.fsdp:
        print("ckpt-planner plan: this profile was recorded for FSDP2's mixed precision "
              f"(parameters cast to {p.meta.fsdp_mixed_precision['param_dtype']}); plan it "
              "for the sharded run: add --fsdp --world-size N", file=sys.stderr)
        return 2
    if args.world_size is not None or args.fsdp or args.fsdp_units:
        try:
            p = _per_rank(p, args)
        except (ProfileError, ValueError) as e:
            print(f"ckpt-planner plan: {e}", file=sys.stderr)
            return 2
    if args.grad_accumulation:
        try:
            p = holding_grads(p)
        except ProfileError as e:
            print(f"ckpt-planner plan: {e}", file=sys.stderr)
            return 2
        print(f"gradient accumulation: every gradient held from the step's start "
              f"({format_bytes(p.grad_bytes)}); fixed memory {format_bytes(p.fixed_bytes)}")
    if args.method != "auto" and args.method not in available_methods():
        print(f"ckpt-planner plan: unknown method {args.method!r}; expected one of "
              f"{', '.join(available_methods())}", file=sys.stderr)
        return 2
    if args.sweep:
        return _sweep(p, args)
    if args.min:
        return _minimum(p, args)
    try:
        if args.budget_gb is not None and args.budget_bytes is not None:
            raise BudgetError("give one of --budget-gb and --budget-bytes, not both")
        if args.budget_bytes is not None:
            budget = parse_budget(args.budget_bytes, name="--budget-bytes", unit=1)
        elif args.budget_gb is not None:
            budget = parse_budget(args.budget_gb, name="--budget-gb")
        else:
            raise BudgetError("give a budget with --budget-gb (e.g. 24, 24GiB, 16GB) or "
                              "--budget-bytes, or use --min or --sweep")
    except BudgetError as e:
        print(f"ckpt-planner plan: {e}", file=sys.stderr)
        return 2
    chosen, secs = _timed(p, budget, args.method, args.time_limit)
    label = f"{args.method} ({chosen.method})" if args.method == "auto" else chosen.method
    rows = [_row(label, chosen, p.step_ms, secs)]
    for m in BASELINES:
        if m != chosen.method:
            try:
                s, t = _timed(p, budget, m, args.time_limit)
            except ScheduleError:  # under FSDP: segments of several units do not exist
                if p.meta.sharding != "fsdp":
                    raise
                rows.append([m, "n/a: spans FSDP units", "", "", "", "", ""])
                continue
            rows.append(_row(m, s, p.step_ms, t))
    print(f"profile {args.profile}: budget {budget / _GIB:.4f} GiB, no-checkpoint peak "
          f"{simulate(p).peak_bytes / _GIB:.4f} GiB, step {p.step_ms:.2f} ms")
    print(_table(["method", "status", "peak GiB", "extra ms", "extra %", "regions", "solve s"],
                 rows))
    if not chosen.feasible:
        best = lowest(p, args.time_limit if args.time_limit is not None else FLOOR_TIME_LIMIT_S)
        parts = "; ".join(f"{k} {format_bytes(v)}" for k, v in peak_breakdown(p, best)[:4])
        print(f"ckpt-planner plan: budget {format_bytes(budget)} is below the smallest "
              f"achievable peak for this profile ({format_bytes(best.predicted_peak_bytes)}, "
              f"with nested regions; at that peak: {parts}). Raise the budget (see "
              "`ckpt-planner plan PROFILE --min`) or lower the batch size.", file=sys.stderr)
        return 1
    if args.output:
        chosen.save(args.output)
        print(f"wrote {args.output}")
    return 0
