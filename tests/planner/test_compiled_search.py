"""`planner.compiled.search` and `fastest` (pure: compilation, peaks and step times are stubbed):
which partitioner budgets are searched, in what order, when the search stops, and which
configuration is chosen. The compiled runs themselves are in test_compile.py (slow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import planner.compiled as pc

EAGER_NONE = 220
UNPLANNED = {1.0: 200, 0.8: 150, 0.5: 120}
"""Compiled peak without a plan at each partitioner budget: a plan keeps the same saving."""


@pytest.fixture
def compiles(monkeypatch):
    made: list[tuple[object, float]] = []

    def fake_copy(model, schedule, backend, m):
        made.append((schedule, m))
        return SimpleNamespace(schedule=schedule, m=m)

    monkeypatch.setattr(pc, "compile_copy", fake_copy)
    return made


def _step(module) -> int:
    if module.schedule is None:
        return UNPLANNED[module.m]
    return module.schedule.b - (EAGER_NONE - UNPLANNED[module.m])


def _solve_at(profile, b):
    return None if b < 80 else SimpleNamespace(regions=(b,), b=b)  # no eager plan below 80


def _search(target, times, step=_step, **kw):
    prof = SimpleNamespace(calls=())
    return pc.search(object(), prof, target, backend="inductor", eager_none=EAGER_NONE,
                     solve_at=_solve_at, step=step,
                     time_step=lambda module: times[module.m], **kw)


def test_goes_down_while_faster(compiles):
    times = {1.0: 10.0, 0.8: 9.0, 0.5: 9.5}
    fits, tried = _search(130, times)
    assert [(c.memory_budget, c.schedule is None) for c in fits] == \
        [(1.0, False), (0.8, False), (0.5, True)]
    # planned at the budget raised by what compiling saves: fewer regions at a lower budget
    assert [c.eager_budget for c in fits[:2]] == [150, 200]
    assert all(c.peak_bytes <= 130 for c in fits)
    assert {c.memory_budget for c in tried if c.peak_bytes > 130} == {1.0, 0.8}
    best = pc.fastest(fits, lambda module: times[module.m])
    assert best.memory_budget == 0.8
    assert all(c.step_ms for c in fits)  # all three timed, in turn


def test_stops_going_down_once_a_lower_budget_is_no_faster(compiles):
    times = {1.0: 10.0, 0.8: 11.0, 0.5: 1.0}
    fits, _ = _search(130, times)
    assert [c.memory_budget for c in fits] == [1.0, 0.8]
    assert all(m != 0.5 for _, m in compiles)  # 0.5 never compiled
    assert pc.fastest(fits, lambda module: times[module.m]).memory_budget == 1.0


def test_where_the_compiler_alone_fits_no_plan_is_searched(compiles):
    """At 250 the copy without a plan fits at every partitioner budget: no plan is compiled;
    the lower budget is tried only while faster (recomputing more can be faster)."""
    fits, tried = _search(250, {1.0: 10.0, 0.8: 9.0, 0.5: 9.5})
    assert [(c.memory_budget, c.schedule) for c in fits] == [(1.0, None), (0.8, None), (0.5, None)]
    assert all(s is None for s, _ in compiles) and len(tried) == 3
    assert pc.fastest(fits, lambda module: pytest.fail("timed already")).memory_budget == 0.8
    compiles.clear()
    fits, _ = _search(250, {1.0: 10.0, 0.8: 11.0})
    assert [c.memory_budget for c in fits] == [1.0, 0.8] and len(compiles) == 2
    untimed, _ = pc.search(object(), SimpleNamespace(calls=()), 250, backend="inductor",
                           eager_none=EAGER_NONE, solve_at=_solve_at, step=_step)
    assert len(untimed) == 1  # without timing, the first fit without a plan is the answer
    assert pc.fastest(untimed, lambda module: pytest.fail("one is not timed")) is untimed[0]


def test_rows_already_measured_are_reused_and_nothing_fitting_returns_no_candidate(compiles):
    """compare passes the backend(b) rows it measured as `unplanned`: no copy is compiled
    without a plan. Where no plan reaches the target, nothing fits and `tried` says what was
    measured."""
    given = {m: (peak, SimpleNamespace(schedule=None, m=m)) for m, peak in UNPLANNED.items()}

    def keeps_more(module) -> int:  # a compiled plan keeps twice its eager budget
        return 2 * module.schedule.b

    fits, tried = _search(100, {}, step=keeps_more, unplanned=given.__getitem__,
                          memory_budgets=(0.8, 1.0), rounds=2)
    assert fits == []
    assert compiles and all(s is not None for s, _ in compiles)
    assert [c.memory_budget for c in tried if c.schedule is None] == [1.0, 0.8]
    planned = [c for c in tried if c.schedule is not None]
    assert all(c.peak_bytes > 100 and c.module is None for c in planned)  # not kept


def test_the_backend_is_a_name_at_the_default_budget():
    assert pc.compile_backend("inductor", 1.0) == "inductor"
    assert callable(pc.compile_backend("inductor", 0.5))


def test_a_schedule_is_compiled_once_per_partitioner_budget_across_variants(compiles,
                                                                           monkeypatch):
    """Both profile variants (with runs of traced forwards, then module calls only) can give
    the same schedule: it is compiled once, and listed once among what was measured."""
    monkeypatch.setattr(pc, "compile_variants", lambda prof: [prof, prof])

    def keeps_more(module) -> int:
        return UNPLANNED[module.m] if module.schedule is None else 2 * module.schedule.b

    fits, tried = _search(100, {}, step=keeps_more, memory_budgets=(1.0,), rounds=2)
    assert fits == []
    planned = [s.regions for s, _ in compiles if s is not None]
    assert planned and len(planned) == len(set(planned))
    assert len([c for c in tried if c.schedule is not None]) == len(planned)
