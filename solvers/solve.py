"""One entry point for every method: `solve(profile, budget_bytes, method=...)`, and the registry.

Like networkx's flow functions, every method shares one signature, and every answer passes one
validator, `finish`, which simulates the schedule and sets its predicted peak, recompute time and
status. A method may claim `optimal`; `finish` downgrades it to `infeasible` when the simulator
says the schedule does not fit.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import time
from collections.abc import Callable

from solvers.chain import bind, in_place
from solvers.errors import SolverUnavailableError
from solvers.profile import Profile
from solvers.schedule import Schedule
from solvers.simulate import simulate

__all__ = ["METHODS", "applicable", "available_methods", "finish", "register", "smallest_peak",
           "solve"]

Method = Callable[[Profile, int, "float | None"], Schedule]
METHODS: dict[str, Method] = {}
"""Registered methods by name; `auto` is not one of them (it runs them all)."""

BASELINES = ("none", "per_block", "sqrt_n", "chen_greedy", "every_k", "selective_matmul")
AUTO_ILP_TIME_LIMIT_S = 10.0
"""`auto` gives the ILP this long when no time limit is set (the ILP alone defaults to 60 s)."""
_OPTIONAL = ("solvers.ilp",)  # registered on import when their dependencies are installed
_loaded = False


def register(name: str) -> Callable[[Method], Method]:
    """Decorator: make `fn(profile, budget_bytes, time_limit_s) -> Schedule` available by name."""

    def deco(fn: Method) -> Method:
        METHODS[name] = fn
        return fn

    return deco


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    importlib.import_module("solvers.baselines")
    importlib.import_module("solvers.dp")
    for mod in _OPTIONAL:
        try:
            importlib.import_module(mod)
        except ImportError:
            pass


def available_methods() -> list[str]:
    """Names accepted by `solve(method=...)`, `auto` first."""
    _load()
    return ["auto", *METHODS]


def finish(profile: Profile, schedule: Schedule, budget_bytes: int) -> Schedule:
    """Simulate `schedule` and set its predictions and status: the one check every answer passes."""
    schedule = dataclasses.replace(schedule, regions=bind(profile, schedule.regions))
    sim = simulate(profile, schedule)
    fits = sim.peak_bytes <= budget_bytes
    if fits:
        status = schedule.status if schedule.status != "infeasible" else "feasible"
        min_peak = schedule.min_peak_bytes
    else:
        status = "infeasible"
        found = [sim.peak_bytes]
        if schedule.min_peak_bytes is not None:
            found.append(schedule.min_peak_bytes)
        min_peak = min(found)
    return dataclasses.replace(
        schedule,
        status=status,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_recompute_ms=sim.recompute_ms,
        min_peak_bytes=min_peak,
        stats={**schedule.stats, "peak_at": sim.peak_at},
    )


def applicable(schedule: Schedule) -> bool:
    """Every region of `schedule` is a module call (or it has none): `planner.apply` can put it
    onto the model's own modules."""
    return all(r.module is not None for r in schedule.regions)


def _better(a: Schedule, b: Schedule | None) -> bool:
    """Is `a` a better answer than `b`: feasible first, then less recompute, then lower peak."""
    if b is None:
        return True
    if a.feasible != b.feasible:
        return a.feasible
    if a.feasible:
        return (a.predicted_recompute_ms, a.predicted_peak_bytes) < (
            b.predicted_recompute_ms,
            b.predicted_peak_bytes,
        )
    return a.predicted_peak_bytes < b.predicted_peak_bytes


def solve(
    profile: Profile,
    budget_bytes: int,
    method: str = "auto",
    time_limit_s: float | None = None,
) -> Schedule:
    """The schedule of `method` for `profile` under a peak of `budget_bytes` (fixed memory included).

    Never raises for an infeasible budget: the status is then ``infeasible`` and `min_peak_bytes`
    holds the smallest peak the method found. `auto` runs every registered method and returns the
    feasible schedule with the least recompute time (ties: the lower peak).
    """
    _load()
    if method != "auto" and method not in METHODS:
        raise ValueError(
            f"unknown method {method!r}; expected one of {', '.join(available_methods())}"
        )
    budget_bytes = int(budget_bytes)
    t0 = time.perf_counter()
    if method != "auto":
        sched = METHODS[method](profile, budget_bytes, time_limit_s)
        sched = finish(profile, dataclasses.replace(sched, method=method), budget_bytes)
        return dataclasses.replace(
            sched, stats={**sched.stats, "solve_time_s": time.perf_counter() - t0}
        )
    best: Schedule | None = None
    tried: dict[str, str] = {}
    min_peak = math.inf
    for name in METHODS:
        left = None if time_limit_s is None else max(0.0, time_limit_s - (time.perf_counter() - t0))
        if name == "ilp" and left is None:
            left = AUTO_ILP_TIME_LIMIT_S
        try:
            s = solve(profile, budget_bytes, name, left)
        except SolverUnavailableError:
            tried[name] = "unavailable"
            continue
        if in_place(profile) and not applicable(s):
            tried[name] = "not applicable in place"
            continue
        tried[name] = s.status
        min_peak = min(min_peak, s.predicted_peak_bytes, s.min_peak_bytes or math.inf)
        if _better(s, best):
            best = s
    assert best is not None
    stats = {**best.stats, "solve_time_s": time.perf_counter() - t0, "auto_tried": tried}
    if not best.feasible:
        return dataclasses.replace(best, min_peak_bytes=int(min_peak), stats=stats)
    return dataclasses.replace(best, stats=stats)


def smallest_peak(profile: Profile, time_limit_s: float | None = 10.0) -> int:
    """The lowest simulated peak any registered method reaches (for "raise the budget" messages);
    on a recorded profile, among schedules that can be applied in place."""
    _load()
    best = math.inf
    for name in METHODS:
        s = solve(profile, 0, name, time_limit_s)
        if in_place(profile) and not applicable(s):
            continue
        best = min(best, s.predicted_peak_bytes, s.min_peak_bytes or math.inf)
    return int(best)
