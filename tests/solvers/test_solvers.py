"""Solvers on tiny hand-solved profiles, through the simulator; property tests on random ones."""

from __future__ import annotations

import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solvers import Region, Schedule, available_methods, simulate, solve
from solvers.baselines import region, units
from solvers.candidates import blocks, cut_points, live_bytes_across, valid_cuts
from solvers.simulate import graph_index
from solvers.solve import BASELINES, smallest_peak
from tests.solver_cases import CASES, MIB, Op, build, chain, chain4, residual, sqrt_n_trap

FIXED = MIB + 1024  # input + weight of every hand-built profile
METHODS = [m for m in available_methods() if m != "auto"]


def test_solvers_do_not_import_torch():
    assert "torch" not in sys.modules or "solvers" not in str(sys.modules.get("torch"))
    import subprocess

    code = "import solvers, solvers.dp, solvers.baselines, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- known optima, worked out by hand --------------------------------------------------------------
def test_chain4_by_hand():
    # No checkpointing: at b3, outputs of f0..f2 (12 MiB) + grad of f2 (4 MiB) + fixed.
    p = chain4()
    assert simulate(p).peak_bytes == 16 * MIB + FIXED + 8  # + the 4-byte loss and seed
    # Best under 13 MiB of activations: region f0..f1 drops f0's output; its replay re-runs f0 only
    # (f1 saves just its input, so early stop fires before it computes): 1 ms. Peak 12 MiB at b3
    # (f1, f2 outputs and f2's gradient) plus the loss and the backward seed, 4 bytes each.
    for m in ("dp", "auto"):
        s = solve(p, 12 * MIB + FIXED + 8, m)
        assert s.feasible and s.predicted_recompute_ms == pytest.approx(1.0)
        assert s.predicted_peak_bytes == 12 * MIB + FIXED + 8
    s = solve(p, 12 * MIB + FIXED, "dp")  # 8 bytes below the smallest peak
    assert s.status == "infeasible" and s.min_peak_bytes == 12 * MIB + FIXED + 8
    assert solve(p, 10**12, "dp").regions == ()


def test_residual_by_hand():
    # Exhaustive search over all region sets (see solver_cases) gives the frontier
    # 33 MiB -> 3 ms, 37 -> 2 ms, 41 -> 1 ms, 49 (no regions) -> 0 ms (activations + fixed).
    p = residual()
    for act_mib, best_ms in ((49, 0.0), (41, 1.0), (37, 2.0), (33, 3.0)):
        s = solve(p, act_mib * MIB + FIXED + 8, "dp")
        assert s.feasible, (act_mib, s)
        assert s.predicted_recompute_ms <= best_ms + 1.0  # dp is restricted to candidate cuts
    assert blocks(p)[0].name == "layers.0" and len(blocks(p)) == 2


def test_sqrt_n_is_wrong_on_the_trap():
    # sqrt(8) ~ 3 segments of 3, 2 and 3 blocks: the middle one holds the slow block 5 (100 ms of
    # its ops; early stop skips the last one) and pays it again in backward. At sqrt_n's own peak
    # the dp checkpoints the cheap blocks and keeps block 5.
    p = sqrt_n_trap()
    sq = solve(p, 10**12, "sqrt_n")
    assert len(sq.regions) == 3 and sq.predicted_recompute_ms > 50
    d = solve(p, sq.predicted_peak_bytes, "dp")
    assert d.feasible and d.predicted_recompute_ms < 20


def test_candidates():
    p = residual()
    g = graph_index(p)
    live = live_bytes_across(p)
    assert len(live) == len(g.forward) and all(v >= 0 for v in live)
    assert all(valid_cuts(p))
    cuts = cut_points(p)
    assert all(g.phase[i] == "forward" for i in cuts)
    # The boundary between the two blocks is always a candidate.
    assert blocks(p)[0].end in cuts


def test_inplace_cut_is_invalid():
    from solvers import Node, Profile

    base = build([Op(MIB), Op(MIB), Op(MIB)])
    nodes = list(base.nodes)
    k = next(i for i, n in enumerate(nodes) if n.name == "f2")
    s1 = nodes[k - 1].storage
    # f2 becomes an in-place op on f0's output: no cut may fall between f0 and f2.
    f0s = next(n for n in nodes if n.name == "f0").storage
    nodes[k] = Node(name="f2", op="aten.mul_.Tensor", phase="forward", inputs=("f0", "f1"),
                    storage=f0s, saves=(s1,), time_ms=1.0)
    p = Profile(nodes=tuple(nodes), storage_bytes=base.storage_bytes, loss=base.loss)
    assert valid_cuts(p) == [False, False, True]
    assert all(graph_index(p).fwd_pos[i] >= 2 for i in cut_points(p))


# -- every method on every case -------------------------------------------------------------------
def _budgets(p):
    none = simulate(p).peak_bytes
    low = smallest_peak(p)
    return [low - 1, low, (low + none) // 2, none, 2 * none]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_method_every_case(case):
    p = CASES[case]()
    for b in _budgets(p):
        results = {m: solve(p, b, m) for m in METHODS}
        for m, s in results.items():
            sim = simulate(p, s)
            assert s.method == m or m == "auto"
            assert s.predicted_peak_bytes == sim.peak_bytes
            assert s.predicted_recompute_ms == pytest.approx(sim.recompute_ms)
            if s.feasible:
                assert sim.peak_bytes <= b
            else:
                assert s.status == "infeasible" and s.min_peak_bytes is not None
                assert s.min_peak_bytes > b
            Schedule.from_dict(s.to_dict())  # JSON round trip
        d = results["dp"]
        for m in BASELINES:
            if results[m].feasible:
                assert d.feasible
                assert d.predicted_recompute_ms <= results[m].predicted_recompute_ms + 1e-9
        a = solve(p, b, "auto")
        assert a.feasible == any(s.feasible for s in results.values())


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown method 'nope'.*dp"):
        solve(chain4(), 10**9, "nope")


def test_baseline_shapes():
    p = sqrt_n_trap()
    assert len(units(p)) == 8
    assert len(solve(p, 10**12, "per_block").regions) == 8
    assert len(solve(p, 10**12, "sqrt_n").regions) == 3
    sel = solve(p, 10**12, "selective_matmul")
    assert all(r.saved for r in sel.regions)
    assert isinstance(region(p, 0, 1), Region)


# -- properties on random profiles -----------------------------------------------------------------
@st.composite
def random_profiles(draw):
    n = draw(st.integers(3, 12))
    ops = []
    per = draw(st.sampled_from([0, 2, 3]))
    for k in range(n):
        ins = None
        if k >= 2 and draw(st.booleans()):
            ins = (k - 1, draw(st.integers(-1, k - 2)))  # a skip connection: a DAG
        ops.append(Op(draw(st.integers(1, 16)) * MIB // 4, draw(st.floats(0.1, 5.0)), ins,
                      f"layers.{k // per}" if per else ""))
    return build(ops)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_profiles(), st.floats(0.0, 1.2))
def test_random_profiles_feasible_or_correctly_infeasible(p, frac):
    none = simulate(p).peak_bytes
    b = int(FIXED + frac * (none - FIXED))
    for m in ("dp", "auto", "chen_greedy", "every_k"):
        s = solve(p, b, m)
        if s.feasible:
            assert simulate(p, s).peak_bytes <= b
        else:
            assert s.min_peak_bytes > b
    big = solve(p, none, "dp")
    assert big.feasible and big.regions == ()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_profiles())
def test_dp_time_non_increasing_in_budget(p):
    none = simulate(p).peak_bytes
    low = smallest_peak(p)
    prev = None
    for k in range(8):
        s = solve(p, low + (none - low) * k // 7, "dp")
        assert s.feasible
        if prev is not None:
            assert s.predicted_recompute_ms <= prev + 1e-9
        prev = s.predicted_recompute_ms


def test_chain_helper():
    p = chain([1, 2, 3], per_block=1)
    assert len(blocks(p)) == 3
