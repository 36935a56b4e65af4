"""Solve times of every method on the committed profiles at 30%, 50% and 70% of the unchecked peak.

    python benchmarks/solve_times.py [PROFILE ...]

Uses profiles/*.json.gz, or the given files. Prints method, budget, status, predicted peak,
recompute time and wall-clock solve seconds (the first `dp` call on a profile includes building
its chain model and plan pool; later budgets reuse them).
"""

from __future__ import annotations

import glob
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solvers import Profile, available_methods, simulate, solve  # noqa: E402
from solvers.dp import chain_model, solve_chain  # noqa: E402

GIB = 2**30


def main(paths: list[str]) -> None:
    paths = paths or sorted(glob.glob("profiles/*.json.gz"))
    methods = [m for m in available_methods() if m != "auto"]
    for path in paths:
        p = Profile.load(path)
        none = simulate(p).peak_bytes
        t0 = time.perf_counter()
        m = chain_model(p)
        t_model = time.perf_counter() - t0
        t0 = time.perf_counter()
        solve_chain(m, 0.5 * none)
        t_dp = time.perf_counter() - t0
        n_fwd = sum(nd.phase == "forward" for nd in p.nodes)
        print(f"\n{path}: {len(p.nodes)} nodes ({n_fwd} forward), {len(m.cuts) - 2} candidate "
              f"cuts, none peak {none / GIB:.3f} GiB; chain model {t_model:.3f} s, "
              f"one DP solve {t_dp:.3f} s")
        print(f"{'method':<17} {'budget':>7} {'status':<11} {'peak GiB':>9} {'recompute ms':>13} "
              f"{'solve s':>8}")
        for frac in (0.3, 0.5, 0.7):
            budget = int(frac * none)
            for meth in methods:
                t0 = time.perf_counter()
                s = solve(p, budget, meth, time_limit_s=60)
                dt = time.perf_counter() - t0
                print(f"{meth:<17} {frac:>6.0%} {s.status:<11} "
                      f"{s.predicted_peak_bytes / GIB:>9.3f} {s.predicted_recompute_ms:>13.2f} "
                      f"{dt:>8.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
