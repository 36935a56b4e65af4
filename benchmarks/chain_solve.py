"""Solve time of `dp` (and the ILP) on a synthetic chain of N blocks (issue target: dp <= 1 s at N=100).

    python benchmarks/chain_solve.py [N ...]

Each block is 4 ops (a matmul-like op and three elementwise ops) with random sizes and times, as
built by tests/solver_cases.chain; budgets are 30/50/70% of the activation memory above the
no-checkpoint floor. Prints the first-call time (which builds the chain model and the plan grid)
and the time of a second call at another budget.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solvers.simulate import simulate  # noqa: E402
from solvers.solve import solve  # noqa: E402
from tests.solver_cases import chain  # noqa: E402


def main(ns: list[int]) -> None:
    print("| blocks | ops | budget | status | recompute ms | solve s |")
    print("|---|---|---|---|---|---|")
    for n in ns:
        rng = random.Random(n)
        sizes = [rng.choice([1, 2, 4]) for _ in range(4 * n)]
        times = [rng.uniform(0.5, 3.0) for _ in range(4 * n)]
        prof = chain(sizes, times, per_block=4)
        none = simulate(prof).peak_bytes
        floor = prof.fixed_bytes
        for f in (0.7, 0.5, 0.3):
            budget = int(floor + f * (none - floor))
            t0 = time.perf_counter()
            s = solve(prof, budget, method="dp")
            dt = time.perf_counter() - t0
            print(f"| {n} | {4 * n} | {f:.0%} | {s.status} | {s.predicted_recompute_ms:.1f} | "
                  f"{dt:.2f} |")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [25, 100])
