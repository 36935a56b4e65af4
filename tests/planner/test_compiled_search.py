"""`planner.compiled.search` and `fastest` (pure: compilation, peaks and step times are stubbed):
which partitioner budgets are searched, in what order, when the search stops, and which
configuration is chosen. The compiled runs themselves are in test_compile.py (slow)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

import planner.compiled as pc

EAGER_NONE = 220
UNPLANNED = {1.0: 200, 0.8: 150, 0.5: 120, 0.2: 115}
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


@dataclass(frozen=True)
class _Schedule:
    regions: tuple
    b: int
    stats: dict = field(default_factory=dict)
    budget_bytes: int = 0


def _solve_at(profile, b):
    return None if b < 80 else _Schedule(regions=(b,), b=b)  # no eager plan below 80


def _search(target, times, step=_step, **kw):
    prof = SimpleNamespace(calls=())
    kw.setdefault("costs", (pc.EAGER_COST,))
    kw.setdefault("memory_budgets", (1.0, 0.8, 0.5))
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


def test_every_configuration_tried_is_summarized_with_what_it_measured(compiles):
    """What compare's rows (`Row.searched`) and `Plan.compile_search` show: each configuration
    compiled, in order, with its peak, whether it fit, and its median time where it was timed."""
    times = {1.0: 10.0, 0.8: 9.0, 0.5: 9.5}
    fits, tried = _search(130, times)
    summaries = [c.summary() for c in tried]
    assert [s["peak_bytes"] for s in summaries] == [c.peak_bytes for c in tried]
    assert [s["fits"] for s in summaries] == [c.peak_bytes <= 130 for c in tried]
    assert any(not s["fits"] for s in summaries) and any(s["fits"] for s in summaries)
    for s, c in zip(summaries, tried, strict=True):
        assert s["memory_budget"] == c.memory_budget
        if c.schedule is None:
            assert (s["eager_budget_bytes"], s["cost_model"], s["regions"]) == (None, None, 0)
        else:
            assert s["eager_budget_bytes"] == c.eager_budget and s["regions"] == 1
            assert s["cost_model"] == pc.EAGER_COST.name
        # only what fits is timed; the chosen one's median is its summary's time
        assert (s["step_ms"] is None) == (not s["fits"])
        assert ("does not fit" in c.describe("inductor")) == (not s["fits"])
    assert {s["step_ms"] for s in summaries if s["fits"]} == {10.0, 9.0, 9.5}
    # every timed step is listed with its round, and the pick is marked once it is made
    for s, c in zip(summaries, tried, strict=True):
        assert [t for _, t in s["rounds"]] == c.step_ms and not s["picked"]
        assert [r for r, _ in s["rounds"]] == c.step_rounds
    best = pc.fastest(fits, lambda module: times[module.m])
    after = [c.summary(best) for c in tried]
    assert [s["picked"] for s in after] == [c is best for c in tried]
    assert best.memory_budget == 0.8 and sum(s["picked"] for s in after) == 1
    assert all(len(a["rounds"]) >= len(s["rounds"]) for a, s in zip(after, summaries,
                                                                     strict=True))


def test_below_a_budget_that_was_no_faster_only_the_compiler_alone_is_tried(compiles):
    """Once a lower partitioner budget measured no faster, no plan is searched below it; the
    copy without a plan still is, and is kept where it fits and is faster: the partitioner's
    step time is not monotone in its budget, so a slower 0.8 says nothing about 0.5 alone."""
    times = {1.0: 10.0, 0.8: 11.0, 0.5: 9.0}
    fits, _ = _search(130, times)  # inductor(0.5) alone peaks at 120: fits
    assert [(c.memory_budget, c.schedule is None) for c in fits] == \
        [(1.0, False), (0.8, False), (0.5, True)]
    assert [s for s, m in compiles if m == 0.5] == [None]  # no plan compiled at 0.5
    assert pc.fastest(fits, lambda module: times[module.m]).memory_budget == 0.5
    compiles.clear()
    fits, _ = _search(110, times)  # inductor(0.5) alone does not fit, and no plan is tried
    assert [c.memory_budget for c in fits] == [1.0, 0.8]
    assert [s for s, m in compiles if m == 0.5] == [None]
    assert pc.fastest(fits, lambda module: pytest.fail("timed together already")
                      ).memory_budget == 1.0


def test_where_the_compiler_alone_fits_no_plan_is_searched(compiles):
    """At 250 the copy without a plan fits at every partitioner budget: no plan is compiled,
    and every budget's copy is timed (its step time is not monotone in the budget)."""
    times = {1.0: 10.0, 0.8: 9.0, 0.5: 9.5}
    fits, tried = _search(250, times)
    assert [(c.memory_budget, c.schedule) for c in fits] == [(1.0, None), (0.8, None), (0.5, None)]
    assert all(s is None for s, _ in compiles) and len(tried) == 3
    assert pc.fastest(fits, lambda module: times[module.m]).memory_budget == 0.8
    compiles.clear()
    times = {1.0: 10.0, 0.8: 11.0, 0.5: 9.0}
    fits, _ = _search(250, times)
    assert [c.memory_budget for c in fits] == [1.0, 0.8, 0.5] and len(compiles) == 3
    assert pc.fastest(fits, lambda module: times[module.m]).memory_budget == 0.5
    untimed, _ = pc.search(object(), SimpleNamespace(calls=()), 250, backend="inductor",
                           eager_none=EAGER_NONE, solve_at=_solve_at, step=_step)
    assert len(untimed) == 1  # without timing, the first fit without a plan is the answer
    assert pc.fastest(untimed, lambda module: pytest.fail("one is not timed")) is untimed[0]


def test_by_default_the_compiler_alone_is_tried_down_to_0_2(compiles):
    """At 116 only inductor(0.2) without a plan fits among the copies without one (115): the
    default search reaches it even after going down stopped paying at 0.8, and keeps it where
    it is the fastest; no plan is compiled below 0.8."""
    assert pc.MEMORY_BUDGETS[-1] == 0.2
    times = {1.0: 10.0, 0.8: 11.0, 0.5: 12.0, 0.2: 9.0}
    fits, tried = _search(116, times, memory_budgets=pc.MEMORY_BUDGETS)
    assert [c.memory_budget for c in tried if c.schedule is None] == [1.0, 0.8, 0.5, 0.2]
    assert [(c.memory_budget, c.schedule is None) for c in fits] == \
        [(1.0, False), (0.8, False), (0.2, True)]
    assert [s for s, m in compiles if m in (0.5, 0.2)] == [None, None]
    assert pc.fastest(fits, lambda module: times[module.m]).memory_budget == 0.2


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


def test_a_close_call_is_timed_again_until_it_is_settled(compiles):
    """Noise can put the slower of two near-tied candidates first over 3 rounds: while the two
    fastest medians are within CLOSE_CALL, both are timed again, in turn, up to
    MAX_TIMING_ROUNDS samples each; a clear gap costs no extra round."""
    late = pc.MAX_TIMING_ROUNDS - pc.TIMING_ROUNDS
    # inductor(0.8) is 4% slower, but its first three steps happened to run fast
    samples = {1.0: iter([10.0] * pc.MAX_TIMING_ROUNDS),
               0.8: iter([9.8, 9.9, 9.7] + [10.4] * late)}
    fits, _ = pc.search(object(), SimpleNamespace(calls=()), 250, backend="inductor",
                        eager_none=EAGER_NONE, solve_at=_solve_at, step=_step,
                        time_step=lambda module: next(samples[module.m]),
                        memory_budgets=(1.0, 0.8))
    assert [len(c.step_ms) for c in fits] == [pc.MAX_TIMING_ROUNDS] * 2
    # settling times the same compiled copies again: nothing is compiled twice
    assert [m for _, m in compiles] == [1.0, 0.8]
    assert pc.fastest(fits, lambda module: pytest.fail("settled already")).memory_budget == 1.0
    compiles.clear()
    fits, _ = _search(250, {1.0: 10.0, 0.8: 12.0}, memory_budgets=(1.0, 0.8))
    assert [len(c.step_ms) for c in fits] == [pc.TIMING_ROUNDS] * 2


def test_a_machine_slowing_down_between_budgets_does_not_decide(compiles):
    """Candidates of different partitioner budgets are timed minutes apart. Here the machine
    runs 1.5x slower from the moment inductor(0.5) alone is timed: its samples are all slow,
    while the plan at 0.8 has nine fast ones from before. By medians over all samples the plan
    (10.6 ms median) would beat inductor(0.5) alone (12 ms), though in every round both ran in,
    inductor(0.5) alone took 0.75x the plan's time. Paired rounds choose inductor(0.5)."""
    base = {(1.0, False): 11.0, (0.8, False): 10.6, (0.5, True): 8.0}
    fast_steps = 2 * pc.MAX_TIMING_ROUNDS  # the two plans, timed until their close call ends
    calls: list = []

    def time_step(module):
        calls.append(module.m)
        slow = 1.5 if len(calls) > fast_steps else 1.0
        return slow * base[(module.m, module.schedule is None)]

    fits, _ = pc.search(object(), SimpleNamespace(calls=()), 130, backend="inductor",
                        eager_none=EAGER_NONE, solve_at=_solve_at, step=_step,
                        time_step=time_step, memory_budgets=(1.0, 0.8, 0.5),
                        costs=(pc.EAGER_COST,))
    assert [(c.memory_budget, c.schedule is None) for c in fits] == \
        [(1.0, False), (0.8, False), (0.5, True)]
    plan, alone = fits[1], fits[2]
    # the 4% close call between the two plans was timed to MAX_TIMING_ROUNDS, all fast
    assert calls[:fast_steps].count(0.5) == 0 and 0.5 in calls[fast_steps:]
    assert len(plan.step_ms) > len(alone.step_ms) and pc._median(plan) < pc._median(alone)
    assert pc._paired(alone, plan) == [pytest.approx(8.0 / 10.6)] * len(alone.step_ms)
    best = pc.fastest(fits, time_step)  # still slow: all three side by side
    assert (best.memory_budget, best.schedule) == (0.5, None)
    assert len(pc._common_rounds(fits)) == pc.TIMING_ROUNDS


def test_the_pick_is_timed_side_by_side_not_read_from_a_chain_of_pairs():
    """A search times each budget's candidates with the best before them: here A (10 ms) lost
    to B in B's rounds (B's steps ran fast by chance), and B lost to C in C's: read along that
    chain, C (10.8 ms) wins, though it never ran beside A. `fastest` times all three side by
    side first, and A, the fastest, is picked; the close call between A and B is timed again
    until their paired rounds agree."""
    true_ms = {"A": 10.0, "B": 10.5, "C": 10.8}

    def timed(name: str, rounds: list[int], times: list[float]) -> pc.Candidate:
        return pc.Candidate(None, 1.0, 0, SimpleNamespace(name=name), fits=True,
                            step_ms=list(times), step_rounds=list(rounds))

    a = timed("A", [-1, -2, -3], [10.0] * 3)
    b = timed("B", [-1, -2, -3, -4, -5, -6], [9.5] * 3 + [10.5] * 3)
    c = timed("C", [-4, -5, -6], [10.0] * 3)
    assert pc._tournament([a, b, c]) is c  # the chain alone
    best = pc.fastest([a, b, c], lambda module: true_ms[module.name])
    assert best is a
    assert len(pc._common_rounds([a, b, c])) == pc.TIMING_ROUNDS
    assert len(pc._paired(a, b)) == pc.MAX_TIMING_ROUNDS


def test_rounds_that_disagree_are_timed_again(compiles):
    """inductor(0.8) is 20% faster in two of three rounds and 10% slower in the third: the
    median ratio is past CLOSE_CALL, but fewer than AGREE of the rounds say so, so one more
    round is timed; with three of four agreeing, the call is made."""
    samples = {1.0: iter([10.0] * 20), 0.8: iter([8.0, 8.0, 11.0] + [8.0] * 20)}
    fits, _ = pc.search(object(), SimpleNamespace(calls=()), 250, backend="inductor",
                        eager_none=EAGER_NONE, solve_at=_solve_at, step=_step,
                        time_step=lambda module: next(samples[module.m]),
                        memory_budgets=(1.0, 0.8))
    assert [len(c.step_ms) for c in fits] == [pc.TIMING_ROUNDS + 1] * 2
    assert pc.fastest(fits, lambda module: pytest.fail("settled already")).memory_budget == 0.8


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


def test_inductor_searches_a_plan_per_cost_model_and_keeps_the_faster(compiles, monkeypatch):
    """Under inductor the search also plans on the fused-pointwise profile; where that gives
    other regions, both plans are compiled and timed, the faster is kept, and the schedule it
    came from is re-simulated on the eager profile (its predicted time is the eager one's)."""
    assert [c.name for c in pc.cost_models("inductor")] == ["eager", pc.INDUCTOR_COST.name]
    assert pc.cost_models("aot_eager") == (pc.EAGER_COST,)
    fused = SimpleNamespace(calls=(), fused=True)
    cheap = pc.CostModel("cheap", lambda variant: fused)
    on_eager: list = []

    def refinish(variant, s, budget):
        assert budget == s.budget_bytes  # the budget it was solved for, not another
        on_eager.append((variant, s.regions))
        return s

    monkeypatch.setattr(pc, "finish", refinish)

    def solve_at(profile, b):  # the cheap model recomputes other ops: other regions
        return _Schedule(regions=("fused", b) if profile is fused else (b,), b=b,
                         budget_bytes=b - 1)

    times = {"eager": 10.0, "cheap": 9.0}

    def time_step(module):
        return times[module.schedule.stats.get("cost_model", "eager")]

    prof = SimpleNamespace(calls=())
    fits, tried = pc.search(object(), prof, 130, backend="inductor", eager_none=EAGER_NONE,
                            solve_at=solve_at, step=_step, time_step=time_step,
                            memory_budgets=(1.0,), costs=(pc.EAGER_COST, cheap))
    assert [c.cost_model for c in fits] == ["eager", "cheap"]
    assert all(c.peak_bytes <= 130 and c.step_ms for c in fits)  # both fit, both timed
    assert on_eager and all(variant is prof and regions[0] == "fused"
                            for variant, regions in on_eager)
    assert fits[1].profile is prof  # the candidate reports the eager profile, not the fused one
    best = pc.fastest(fits, lambda module: pytest.fail("timed already"))
    assert best.cost_model == "cheap" and best.schedule.stats["cost_model"] == "cheap"
    times["cheap"] = 11.0
    compiles.clear()
    fits, _ = pc.search(object(), prof, 130, backend="inductor", eager_none=EAGER_NONE,
                        solve_at=solve_at, step=_step, time_step=time_step,
                        memory_budgets=(1.0,), costs=(pc.EAGER_COST, cheap))
    assert pc.fastest(fits, time_step).cost_model == "eager"


def test_cost_models_giving_the_same_regions_compile_once(compiles):
    """Where the fused-pointwise profile gives the regions the eager one gave, nothing more is
    compiled and the one candidate is kept once."""
    same = pc.CostModel("same", lambda variant: variant)
    fits, tried = _search(130, {1.0: 10.0}, memory_budgets=(1.0,),
                          costs=(pc.EAGER_COST, same))
    planned = [s.regions for s, _ in compiles if s is not None]
    assert len(planned) == len(set(planned))
    assert len(fits) == 1 and fits[0].cost_model == "eager"


def test_fused_pointwise_scales_only_forward_ops_without_flops():
    from pathlib import Path

    from solvers.profile import Profile
    from solvers.simulate import simulate

    prof = Profile.load(Path(__file__).parents[2] / "profiles" / "gpt2_small_h100.json.gz")
    out = pc.fused_pointwise(prof, 0.5)
    kinds = set()
    for a, b in zip(prof.nodes, out.nodes, strict=True):
        cheap = a.phase == "forward" and a.flops == 0
        kinds.add(cheap)
        assert b.time_ms == pytest.approx(a.time_ms * (0.5 if cheap else 1.0))
        assert (b.new_storages, b.saves, b.releases) == (a.new_storages, a.saves, a.releases)
    assert kinds == {True, False}
    assert simulate(out).peak_bytes == simulate(prof).peak_bytes


def test_the_profile_a_cost_model_plans_on_is_made_once_per_search(compiles, monkeypatch):
    """Solvers cache on the profile object (dp's pool): the fused-pointwise profile is made once
    and solved on at every partitioner budget, not rebuilt per budget."""
    monkeypatch.setattr(pc, "finish", lambda variant, s, budget: s)
    made: list = []

    def plan_on(variant):
        made.append(variant)
        return SimpleNamespace(calls=())

    seen: set[int] = set()

    def solve_at(profile, b):
        seen.add(id(profile))
        return _Schedule(regions=(b,), b=b, budget_bytes=b)

    pc.search(object(), SimpleNamespace(calls=()), 100, backend="inductor",
              eager_none=EAGER_NONE, solve_at=solve_at, step=lambda module: 10**9,
              memory_budgets=(1.0, 0.8, 0.5), costs=(pc.EAGER_COST, pc.CostModel("c", plan_on)),
              rounds=2)
    assert {m for _, m in compiles} == {1.0, 0.8, 0.5}  # nothing fits: every budget searched
    assert len(made) == 1 and len(seen) == 2
