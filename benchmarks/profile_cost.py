"""Profiling time of each test model relative to one eager training step.

    HF_HUB_OFFLINE=1 python benchmarks/profile_cost.py [--repeats 5]

`profile()` (measure mode) times every op `repeats` times, measures op workspace, times the eager
step and calibrates checkpoint's host cost; the eager step time is the profile's own measurement
(median of `repeats` steps after warm-up).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.profiling import profile  # noqa: E402
from tests.models import TINY  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("| model | nodes | profile() s | eager step ms | profile / step |")
    print("|---|---|---|---|---|")
    for name, build in TINY.items():
        model, x = build()
        t0 = time.perf_counter()
        prof = profile(model, x, repeats=args.repeats)
        wall = time.perf_counter() - t0
        step = prof.meta.step_ms_measured or float("nan")
        print(f"| {name} | {len(prof.nodes)} | {wall:.2f} | {step:.1f} | "
              f"{1e3 * wall / step:.0f}x |")


if __name__ == "__main__":
    main()
