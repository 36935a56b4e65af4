"""Write the schedule snapshots that `test_snapshots.py` compares against.

For every committed profile (`profiles/*.json.gz`), every registered method (`auto` aside: it
picks among the others) and a few budgets at fixed fractions between the smallest peak and the
peak without checkpointing, the snapshot holds `Schedule.to_dict()` without the stats that depend
on wall-clock time. The calls are recorded with their order: `dp` keeps verified plans on the
profile between calls, so a schedule may depend on the calls made before it on the same profile
object; the test replays the same calls, in the same order, on a freshly loaded profile.

Regenerate only when a change is meant to change schedules, and say so in the commit message:

    .venv/bin/python tests/solvers/make_snapshots.py            # every profile
    .venv/bin/python tests/solvers/make_snapshots.py unet_h100  # one profile
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

# Names that the solvers had before and after their restructuring, so that this script runs on
# both (the snapshots were written by the code before it).
from solvers import Profile, Schedule, available_methods, simulate, solve  # noqa: E402
from solvers.solve import smallest_peak  # noqa: E402

PROFILES = ROOT / "profiles"
SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
SNAPSHOT_VERSION = 1

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""Budgets: smallest peak + f * (no-checkpoint peak - smallest peak) for each f."""
ILP_TIME_LIMIT_S = 300.0
"""The MILP's time limit in the snapshot: far beyond what it needs on the committed profiles, so
every round ends at HiGHS's optimality gap, not at the clock (a time limit would make the answer
depend on the machine's speed)."""
SKIP: dict[str, tuple[str, ...]] = {
    "gpt2_small_h100": ("ilp",), "llama7b_h100": ("ilp",), "resnet50_h100": ("ilp",)}
"""Methods left out per profile, to keep the torch-free lane within its time: `ilp` on the three
largest profiles (`dp`, which it builds on and falls back to, is kept). `ilp` is snapshotted on
the U-Net profile, where it re-solves after the simulator corrects the budget."""
TIMING_STATS = frozenset({"solve_time_s", "build_time_s", "dp_time_s"})
"""Stats that measure wall-clock time: left out of the comparison."""


SNAPSHOT_PROFILES = ("gpt2_small_h100", "llama7b_h100", "resnet50_h100", "unet_h100")
"""The committed profiles snapshotted (the 70B ones, tens of thousands of ops, would take the
torch-free lane past its time)."""


def profile_paths() -> list[Path]:
    return [PROFILES / f"{name}.json.gz" for name in SNAPSHOT_PROFILES]


def profile_name(path: Path) -> str:
    return path.name.removesuffix(".json.gz")


def comparable(schedule: Schedule) -> dict[str, Any]:
    """`schedule.to_dict()` without timing stats, as JSON would give it back."""
    d = schedule.to_dict()
    d["stats"] = {k: v for k, v in d["stats"].items() if k not in TIMING_STATS}
    return json.loads(json.dumps(d))


def time_limit(method: str) -> float | None:
    return ILP_TIME_LIMIT_S if method == "ilp" else None


def calls_for(path: Path) -> tuple[list[int], list[tuple[str, int]]]:
    """The budgets of a profile and the (method, budget) calls of its snapshot, in order."""
    probe = Profile.load(path)  # its own object: the snapshot's profile starts with no cache
    none_peak = simulate(probe).peak_bytes
    low = smallest_peak(probe)
    budgets = [low + int(f * (none_peak - low)) for f in FRACTIONS]
    skip = SKIP.get(profile_name(path), ())
    methods = [m for m in available_methods() if m != "auto" and m not in skip]
    return budgets, [(m, b) for m in methods for b in budgets]


def replay(path: Path, calls: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Solve `calls` in order on a freshly loaded profile."""
    profile = Profile.load(path)
    return [comparable(solve(profile, b, m, time_limit(m))) for m, b in calls]


def snapshot(path: Path) -> dict[str, Any]:
    budgets, calls = calls_for(path)
    schedules = replay(path, calls)
    limited = [f"{m} at {b}" for (m, b), s in zip(calls, schedules, strict=True)
               if s["status"] == "time_limit"]
    if limited:  # such an answer depends on the machine's speed: not a reproducible snapshot
        raise RuntimeError(f"{path.name}: hit the time limit: {', '.join(limited)}")
    return {
        "snapshot_version": SNAPSHOT_VERSION,
        "profile": str(path.relative_to(ROOT)),
        "fractions": list(FRACTIONS),
        "budgets": budgets,
        "skipped_methods": list(SKIP.get(profile_name(path), ())),
        "calls": [
            {"method": m, "budget_bytes": b, "schedule": s}
            for (m, b), s in zip(calls, schedules, strict=True)
        ],
    }


def snapshot_path(path: Path) -> Path:
    return SNAPSHOTS / f"{profile_name(path)}.json"


def main(argv: list[str]) -> int:
    SNAPSHOTS.mkdir(exist_ok=True)
    for path in profile_paths():
        if argv and profile_name(path) not in argv:
            continue
        out = snapshot_path(path)
        out.write_text(json.dumps(snapshot(path), indent=1, sort_keys=True) + "\n",
                       encoding="utf-8")
        print(f"{out.relative_to(ROOT)}: {len(json.loads(out.read_text())['calls'])} schedules")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
