"""`ckpt-planner plan PROFILE --budget-gb G`: solve a saved profile and compare with the baselines.

Imports only `solvers` (no torch), so it plans a profile recorded elsewhere; matplotlib is imported
only for `--plot`.
"""

from __future__ import annotations

import argparse
import sys
import time

from solvers import Profile, ProfileError, Schedule, available_methods, simulate, solve
from solvers.solve import BASELINES, smallest_peak

__all__ = ["add_arguments", "run"]

_GIB = 2**30
SWEEP_POINTS = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", metavar="PROFILE", help="profile file (.json or .json.gz)")
    parser.add_argument("--budget-gb", type=float, help="peak memory budget in GiB (2**30 bytes)")
    parser.add_argument("--budget-bytes", type=int, help="peak memory budget in bytes")
    parser.add_argument("--method", default="auto", help="solver method (default: auto)")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds per solve")
    parser.add_argument("-o", "--output", help="write the chosen schedule as JSON")
    parser.add_argument(
        "--sweep", action="store_true",
        help=f"evaluate every method over {SWEEP_POINTS} budgets, smallest peak to no checkpointing",
    )
    parser.add_argument("--plot", help="with --sweep: write the memory/time frontier as a PNG")


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
            s, _ = _timed(p, b, m, args.time_limit)
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


def run(args: argparse.Namespace) -> int:
    try:
        p = Profile.load(args.profile)
    except ProfileError as e:
        print(f"ckpt-planner plan: {e}", file=sys.stderr)
        return 2
    if args.method != "auto" and args.method not in available_methods():
        print(f"ckpt-planner plan: unknown method {args.method!r}; expected one of "
              f"{', '.join(available_methods())}", file=sys.stderr)
        return 2
    if args.sweep:
        return _sweep(p, args)
    if args.budget_bytes is not None:
        budget = args.budget_bytes
    elif args.budget_gb is not None:
        budget = int(args.budget_gb * _GIB)
    else:
        print("ckpt-planner plan: give a budget with --budget-gb G or --budget-bytes B "
              "(or use --sweep)", file=sys.stderr)
        return 2
    chosen, secs = _timed(p, budget, args.method, args.time_limit)
    label = f"{args.method} ({chosen.method})" if args.method == "auto" else chosen.method
    rows = [_row(label, chosen, p.step_ms, secs)]
    for m in BASELINES:
        if m != chosen.method:
            s, t = _timed(p, budget, m, args.time_limit)
            rows.append(_row(m, s, p.step_ms, t))
    print(f"profile {args.profile}: budget {budget / _GIB:.4f} GiB, no-checkpoint peak "
          f"{simulate(p).peak_bytes / _GIB:.4f} GiB, step {p.step_ms:.2f} ms")
    print(_table(["method", "status", "peak GiB", "extra ms", "extra %", "regions", "solve s"],
                 rows))
    if not chosen.feasible:
        low = min(chosen.min_peak_bytes or chosen.predicted_peak_bytes, smallest_peak(p))
        print(f"ckpt-planner plan: budget {budget / _GIB:.4f} GiB is below the smallest "
              f"achievable peak for this profile ({low / _GIB:.4f} GiB); raise the budget or "
              "lower the batch size.", file=sys.stderr)
        return 1
    if args.output:
        chosen.save(args.output)
        print(f"wrote {args.output}")
    return 0
