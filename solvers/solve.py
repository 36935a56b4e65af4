"""One entry point for every method: `solve(profile, budget_bytes, method=...)`, and the registry.

Like networkx's flow functions, every method shares one signature, and every answer passes one
validator, `finish`, which simulates the schedule and sets its predicted peak, recompute time and
status. A method may claim `optimal`; `finish` downgrades it to `infeasible` when the simulator
says the schedule does not fit.
"""

from __future__ import annotations

import dataclasses
import math
import time

from solvers import baselines
from solvers.chain import applicable, bind, in_place
from solvers.dp import dp
from solvers.errors import ScheduleError, SolverUnavailableError
from solvers.nested import nested
from solvers.profile import Profile, cached
from solvers.schedule import Method, Schedule
from solvers.simulate import simulate

__all__ = [
    "AUTO_ILP_TIME_LIMIT_S",
    "BASELINES",
    "METHODS",
    "Method",
    "applicable",
    "available_methods",
    "finish",
    "lowest",
    "pareto",
    "smallest_peak",
    "solve",
]


def _ilp(profile: Profile, budget_bytes: int, time_limit_s: float | None = None) -> Schedule:
    """`solvers.ilp.ilp`, imported when first used: only this method needs PuLP, and importing
    it costs more than the rest of the package."""
    try:
        from solvers.ilp import ilp as milp
    except ImportError as e:
        raise SolverUnavailableError(
            f"method 'ilp' needs PuLP, which cannot be imported ({e}); install it with "
            "`pip install pulp highspy`"
        ) from None
    return milp(profile, budget_bytes, time_limit_s)


METHODS: dict[str, Method] = {
    **baselines.BY_NAME,
    "dp": dp,
    "nested": nested,
    "ilp": _ilp,
}
"""Every method `solve` knows, by name, in the order `auto` tries them; `auto` is not one of them
(it runs them all). To try another method, pass it as `solve(method=fn)`."""

BASELINES: tuple[str, ...] = tuple(baselines.BY_NAME)
"""The baselines' names: the methods `dp` and `ilp` are compared against."""
AUTO_ILP_TIME_LIMIT_S = 10.0
"""Seconds `auto` gives the ILP when no time limit is set (shorter than the ILP's own default,
`solvers.ilp.DEFAULT_TIME_LIMIT_S`: in `auto` it is one method of several)."""


def available_methods() -> list[str]:
    """Names accepted by `solve(method=...)`, `auto` first."""
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
    method: str | Method = "auto",
    time_limit_s: float | None = None,
) -> Schedule:
    """The schedule of `method` for `profile` under a peak of `budget_bytes` (fixed memory included).

    `method` is a name from `available_methods()`, or a function with the methods' signature
    (`Method`: ``fn(profile, budget_bytes, time_limit_s) -> Schedule``), as networkx's
    `flow_func` is: its answer is checked like every method's. Never raises for an infeasible
    budget: the status is then ``infeasible`` and `min_peak_bytes` holds the smallest peak the
    method found. `auto` runs every method of `METHODS` and returns the feasible schedule with the
    least recompute time (ties: the lower peak); where none fits a measured profile, it runs them
    again on `by_work`'s times (the floor search does too, so that a budget at the smallest peak
    reported gets a schedule).
    """
    budget_bytes = int(budget_bytes)
    if callable(method):
        return _run(profile, budget_bytes, method, _name_of(method), time_limit_s)
    if method == "auto":
        return _auto(profile, budget_bytes, time_limit_s)
    if method not in METHODS:
        raise ValueError(
            f"unknown method {method!r}; expected one of {', '.join(available_methods())} "
            "or a function fn(profile, budget_bytes, time_limit_s) -> Schedule"
        )
    return _run(profile, budget_bytes, METHODS[method], method, time_limit_s)


def _name_of(fn: Method) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _run(profile: Profile, budget_bytes: int, fn: Method, name: str,
         time_limit_s: float | None) -> Schedule:
    """One method's answer, checked by `finish`, named `name`, with its solve time."""
    t0 = time.perf_counter()
    sched = fn(profile, budget_bytes, time_limit_s)
    if not isinstance(sched, Schedule):
        raise TypeError(
            f"method {name!r} returned a {type(sched).__name__}, expected a solvers.Schedule"
        )
    sched = finish(profile, dataclasses.replace(sched, method=name), budget_bytes)
    return dataclasses.replace(
        sched, stats={**sched.stats, "solve_time_s": time.perf_counter() - t0}
    )


def sharded(profile: Profile) -> bool:
    """Whether `profile` is one FSDP rank's, where methods that build segments of several
    blocks (`sqrt_n`, `chen_greedy`) give regions spanning fully_shard units: `solve` raises
    ScheduleError for those, and `auto` passes over them."""
    return profile.meta.sharding == "fsdp"


def _usable(profile: Profile, schedule: Schedule) -> bool:
    """A recorded profile's schedule must be applicable to the model's modules."""
    return not in_place(profile) or applicable(schedule)


def _auto(profile: Profile, budget_bytes: int, time_limit_s: float | None) -> Schedule:
    """`_auto_on` the profile; where nothing fits a measured profile, also on `by_work`'s times
    (as `_floors` does), so that a budget at or above the smallest peak `lowest` reports gets a
    schedule."""
    t0 = time.perf_counter()
    best = _auto_on(profile, budget_bytes, time_limit_s)
    if best.feasible or not _measured(profile):
        return best
    left = None if time_limit_s is None else max(0.0, time_limit_s - (time.perf_counter() - t0))
    other = _auto_on(_by_work(profile), budget_bytes, left)
    other = finish(profile, other, budget_bytes)
    if other.feasible:
        return dataclasses.replace(other, stats={**other.stats, "times": "by_work",
                                                 "solve_time_s": time.perf_counter() - t0})
    least = min(best.min_peak_bytes or math.inf, other.predicted_peak_bytes,
                other.min_peak_bytes or math.inf)
    return dataclasses.replace(best, min_peak_bytes=int(least))


def _measured(profile: Profile) -> bool:
    """Whether the profile's times were measured (they move from run to run): the searches then
    also run on `by_work`'s."""
    return profile.meta.mode == "measure"


def _by_work(profile: Profile) -> Profile:
    return cached(profile, "by_work", by_work)


def _auto_on(profile: Profile, budget_bytes: int, time_limit_s: float | None) -> Schedule:
    t0 = time.perf_counter()
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
        except ScheduleError:
            if not sharded(profile):
                raise
            tried[name] = "not applicable: spans FSDP units"
            continue
        if not _usable(profile, s):
            tried[name] = "not applicable in place"
            continue
        tried[name] = s.status
        min_peak = min(min_peak, s.predicted_peak_bytes, s.min_peak_bytes or math.inf)
        if _better(s, best):
            best = s
    assert best is not None  # `none` is always applicable
    stats = {**best.stats, "solve_time_s": time.perf_counter() - t0, "auto_tried": tried}
    if not best.feasible:
        return dataclasses.replace(best, min_peak_bytes=int(min_peak), stats=stats)
    return dataclasses.replace(best, stats=stats)


FLOOR_TIME_LIMIT_S = 30.0
"""Seconds each method may search for its lowest peak (`smallest_peak`, `lowest`) by default.
`nested` descends one step at a time towards a peak it cannot reach; on a model of many small
blocks the descent is long, and cut short it ends higher."""


WORK_FLOPS_PER_MS = 1e8
WORK_BYTES_PER_MS = 1e7
"""The rates of `by_work`'s roofline (100 GFLOP/s, 10 GB/s): what matters is that they are the
same for every profile, not that they match a device."""


def by_work(profile: Profile) -> Profile:
    """`profile` with every op's time replaced by a roofline of its FLOPs and bytes moved at
    fixed rates, and checkpoint's host costs zero: times that are the same on every profile of
    a model (the measured ones move from run to run, the host costs most)."""
    nodes = tuple(dataclasses.replace(n, time_ms=max(n.flops / WORK_FLOPS_PER_MS,
                                                     n.bytes_moved / WORK_BYTES_PER_MS))
                  if n.time_ms else n for n in profile.nodes)
    meta = dataclasses.replace(profile.meta, checkpoint_region_ms=0.0,
                               checkpoint_saved_tensor_ms=0.0, checkpoint_selective_op_ms=0.0)
    return dataclasses.replace(profile, nodes=nodes, meta=meta)


def _floors(profile: Profile, time_limit_s: float | None) -> list[Schedule]:
    """Each method's schedule at a budget of 0 (the lowest peak it finds); on a recorded profile,
    only those that can be applied in place. Methods whose solver is not installed are left out.

    The searches weigh peak against time where plans tie on peak, so the lowest peak they reach
    depends on the times. On a measured profile they also run on `by_work`'s times, and those
    schedules join the others (simulated on the measured profile): the floor is then no higher
    than one the timer's noise cannot move."""
    out = []
    for p in (profile, *((_by_work(profile),) if _measured(profile) else ())):
        for name in METHODS:
            try:
                s = solve(p, 0, name, time_limit_s)
            except SolverUnavailableError:
                continue
            except ScheduleError:
                if not sharded(profile):
                    raise
                continue
            if p is not profile:
                s = finish(profile, s, 0)
            if _usable(profile, s):
                out.append(s)
    return out


def smallest_peak(profile: Profile, time_limit_s: float | None = FLOOR_TIME_LIMIT_S) -> int:
    """The lowest simulated peak any method of `METHODS` reaches (for "raise the budget"
    messages); on a recorded profile, among schedules that can be applied in place. Methods whose
    solver is not installed are left out. Searches under a time limit (`nested` on a model of
    many blocks) may end higher on a slower run: `lowest` gives the schedule with its peak."""
    return min(s.predicted_peak_bytes for s in _floors(profile, time_limit_s))


def lowest(profile: Profile, time_limit_s: float | None = FLOOR_TIME_LIMIT_S) -> Schedule:
    """The cheapest schedule that reaches the smallest achievable peak (`smallest_peak`): what
    `planner.plan(..., budget_gb=None)` applies. On a recorded profile, among schedules that can
    be applied in place. The peak is the one found by the searches run here: `auto` at that
    peak gives the cheapest schedule when it gets there within the time limit, else the
    schedule that found the peak is returned (a search under a time limit is not run twice
    hoping to end at the same place)."""
    floors = _floors(profile, time_limit_s)
    found = min(floors, key=lambda s: (s.predicted_peak_bytes, s.predicted_recompute_ms))
    least = found.predicted_peak_bytes
    best = solve(profile, least, "auto", time_limit_s)
    if best.feasible and best.predicted_recompute_ms <= found.predicted_recompute_ms:
        return best
    return finish(profile, found, least)


def pareto(profile: Profile, points: int = 10, time_limit_s: float | None = FLOOR_TIME_LIMIT_S
           ) -> list[Schedule]:
    """The memory/time front from the smallest achievable peak to no checkpointing: `auto`'s
    schedule at `points` budgets evenly spaced between the two, dominated ones left out (a
    schedule another one beats in both peak and time), by increasing peak."""
    none = solve(profile, 2**62, "none")
    front = [lowest(profile, time_limit_s)]
    least = front[0].predicted_peak_bytes
    for k in range(1, points):
        budget = least + (none.predicted_peak_bytes - least) * k // max(1, points - 1)
        front.append(solve(profile, budget, "auto", time_limit_s))
    front = [s for s in front if s.feasible]
    kept: list[Schedule] = []
    for s in sorted(front, key=lambda s: (s.predicted_peak_bytes, s.predicted_recompute_ms)):
        if not kept or s.predicted_recompute_ms < kept[-1].predicted_recompute_ms:
            kept.append(s)
    return kept
