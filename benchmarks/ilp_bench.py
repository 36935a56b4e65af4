"""Benchmark `ilp` against `dp` on the committed profiles at 30/50/70% of the `none` peak.

    python benchmarks/ilp_bench.py [--time-limit 60] [--fracs 0.3 0.5 0.7] [profiles/*.json.gz]

Prints, per profile and budget: nodes, candidate points (and the points the MILP kept), ilp's
status, the solver's status and MIP gap, solve time, and simulated recompute of ilp vs dp.
"""

from __future__ import annotations

import argparse
import glob
import time
from pathlib import Path

from solvers import Profile, simulate, solve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="*")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--fracs", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    args = ap.parse_args()
    paths = args.profiles or sorted(glob.glob(str(Path(__file__).parent.parent / "profiles" /
                                                  "*.json.gz")))
    head = (f"{'profile':<22}{'nodes':>6}{'cand':>6}{'pts':>5}{'budget':>7}  {'status':<11}"
            f"{'solver':<19}{'gap':>8}{'ilp s':>7}{'total s':>8}{'ilp ms':>9}{'dp ms':>9}  src")
    print(head)
    print("-" * len(head))
    for path in paths:
        p = Profile.load(path)
        none = simulate(p).peak_bytes
        for f in args.fracs:
            b = int(f * none)
            d = solve(p, b, "dp")
            t0 = time.perf_counter()
            s = solve(p, b, "ilp", args.time_limit)
            total = time.perf_counter() - t0
            st = s.stats
            gap = st.get("gap")
            gap_s = f"{100 * gap:.3f}%" if gap is not None else "-"
            ims = f"{s.predicted_recompute_ms:.3f}" if s.feasible else "-"
            dms = f"{d.predicted_recompute_ms:.3f}" if d.feasible else "-"
            print(f"{Path(path).name.split('.')[0]:<22}{len(p.nodes):>6}{st.get('candidates', 0):>6}"
                  f"{st.get('points', 0):>5}{int(100 * f):>6}%  {s.status:<11}"
                  f"{str(st.get('status'))[:18]:<19}{gap_s:>8}{st.get('solve_time_s', 0):>7.1f}"
                  f"{total:>8.1f}{ims:>9}{dms:>9}  {st.get('source', '-')}", flush=True)


if __name__ == "__main__":
    main()
