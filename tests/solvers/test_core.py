"""The solver core: the chain vocabulary worked out by hand, the per-profile cache, the method
table and plugged-in methods, and the package's shape (public API, types, imports)."""

from __future__ import annotations

import ast
import dataclasses
import graphlib
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import solvers
from solvers import (
    BASELINES,
    Profile,
    Region,
    Schedule,
    ScheduleError,
    available_methods,
    simulate,
    solve,
)
from solvers.chain import early_stops, first_savers, selective_region, storage_positions
from solvers.profile import cached
from solvers.solve import METHODS
from tests.solver_cases import MIB

FIXED = MIB + 1024  # input + weight of every hand-built profile
SOLVERS = Path(solvers.__file__).resolve().parent
TESTS = Path(__file__).resolve().parent


# -- the chain vocabulary, by hand -----------------------------------------------------------------
def test_early_stop_when_the_last_saver_saves_only_inputs(solver_cases):
    # Every op of chain4 saves only what it reads: the replay of a region ending at f_b stops
    # before f_b (f0 saves the fixed input, so a region ending at f0 replays nothing).
    assert early_stops(solver_cases["chain4"]) == (-1, 0, 1, 2)


def test_early_stop_when_the_last_saver_saves_its_output(solver_cases):
    # Make f1 save its own output as well: a region ending at f1 now replays f1 too, and one
    # ending at f2 (which saves only its input) still stops after f1.
    p = solver_cases["chain4"]
    nodes = tuple(
        dataclasses.replace(n, saves=(*n.saves, n.storage)) if n.name == "f1" else n
        for n in p.nodes
    )
    q = dataclasses.replace(p, nodes=nodes)
    assert early_stops(q) == (-1, 1, 1, 2)
    # The simulator replays what the rule says: f0..f1 now recomputes both 1 ms ops.
    assert simulate(q, (Region(start="f0", end="f1"),)).recompute_ms == pytest.approx(2.0)
    assert simulate(p, (Region(start="f0", end="f1"),)).recompute_ms == pytest.approx(1.0)


def test_first_savers_and_storage_positions(solver_cases):
    # Storages: 0 = w, 1 = x (fixed), then one per forward op: f0 -> 2, ..., f3 -> 5. Each op
    # saves the storage it reads, so f_k's output is first saved by f_k+1.
    p = solver_cases["chain4"]
    assert first_savers(p) == {2: 1, 3: 2, 4: 3}
    prod, readers = storage_positions(p)
    assert prod == {2: 0, 3: 1, 4: 2, 5: 3}
    assert readers == {2: [1], 3: [2], 4: [3]}
    # diamond: f0 feeds f1 and f2, both saved by f3's inputs; f0's output first saved by f1.
    d = solver_cases["diamond"]
    assert first_savers(d)[2] == 1
    assert storage_positions(d)[1][2] == [1, 2]


def test_selective_region_keeps_the_matmuls(solver_cases):
    # `build` makes even forward ops mm and odd ones relu.
    p = solver_cases["chain4"]
    assert selective_region(p, 0, 3) == Region(start="f0", end="f3", saved=("f0", "f2"))
    assert selective_region(p, 1, 1).saved == ()


# -- the per-profile cache -------------------------------------------------------------------------
def test_cached_builds_once_per_profile(solver_cases):
    p = solver_cases["chain4"]
    calls = []

    def build(profile: Profile) -> list[str]:
        calls.append(profile)
        return [n.name for n in profile.nodes]

    first = cached(p, "test_core.names", build)
    assert cached(p, "test_core.names", build) is first and len(calls) == 1
    q = dataclasses.replace(p, loss=p.loss)  # an equal profile, another object: its own cache
    assert q == p and cached(q, "test_core.names", build) == first and len(calls) == 2
    # The cache is no field: not compared, printed or saved.
    solve(p, 10**12, "dp")
    assert Profile.from_dict(p.to_dict()) == p
    assert "_derived" not in repr(p) and "_derived" not in p.to_dict()


# -- the method table and plugged-in methods -------------------------------------------------------
def test_method_table():
    assert available_methods() == ["auto", *METHODS]
    assert list(METHODS)[: len(BASELINES)] == list(BASELINES)
    assert {"dp", "ilp"} <= set(METHODS) and "auto" not in METHODS
    assert BASELINES == ("none", "per_block", "sqrt_n", "chen_greedy", "every_k",
                         "selective_matmul")


def test_a_plugged_in_method_is_checked_like_the_others(solver_cases):
    p = solver_cases["chain4"]
    seen = []

    def first_two(profile: Profile, budget_bytes: int, time_limit_s: float | None) -> Schedule:
        seen.append((budget_bytes, time_limit_s))
        return Schedule(regions=(Region(start="f0", end="f1"),), status="optimal")

    # The same region dp finds at the smallest peak (test_solvers.test_chain4_by_hand).
    fits = 12 * MIB + FIXED + 8
    s = solve(p, fits, first_two, time_limit_s=3.0)
    assert seen == [(fits, 3.0)]
    assert s.method == "first_two" and s.status == "optimal"
    assert s.predicted_peak_bytes == fits and s.predicted_recompute_ms == pytest.approx(1.0)
    assert "solve_time_s" in s.stats
    # `finish` does not take the method's word for it: below its peak the status is infeasible.
    low = solve(p, fits - 1, first_two)
    assert low.status == "infeasible" and low.min_peak_bytes == fits


def test_a_plugged_in_method_with_a_bad_answer(solver_cases):
    p = solver_cases["chain4"]
    with pytest.raises(TypeError, match="returned a tuple, expected a solvers.Schedule"):
        solve(p, 10**9, lambda profile, budget, limit: ())
    with pytest.raises(ScheduleError, match="not in this profile"):
        solve(p, 10**9, lambda profile, budget, limit: Schedule(
            regions=(Region(start="f0", end="nope"),)))


# -- the package's shape ---------------------------------------------------------------------------
def _modules() -> list[str]:
    return sorted(f"solvers.{m.name}" for m in pkgutil.iter_modules([str(SOLVERS)]))


def _imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom | ast.Import)]


def test_public_api():
    for name in ("Profile", "Node", "ModuleCall", "ProfileMeta", "Schedule", "Region",
                 "Simulation", "simulate", "solve", "available_methods", "smallest_peak",
                 "parse_budget", "format_bytes", "Method", "CkptPlannerError", "ProfileError",
                 "ScheduleError", "SolverUnavailableError", "BudgetError"):
        assert name in solvers.__all__, name
    for module in ["solvers", *_modules()]:
        mod = importlib.import_module(module)
        assert hasattr(mod, "__all__"), f"{module} has no __all__"
        for name in mod.__all__:
            assert hasattr(mod, name), f"{module}.__all__ lists {name!r}, which it lacks"


def _untyped(fn: object) -> list[str]:
    sig = inspect.signature(fn)
    missing = [p.name for p in sig.parameters.values()
               if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def test_every_public_function_has_types():
    untyped = []
    for module in _modules():
        mod = importlib.import_module(module)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isfunction(obj) and obj.__module__ == module:
                untyped += [f"{module}.{name}: {m}" for m in _untyped(obj)]
            elif inspect.isclass(obj) and obj.__module__ == module:
                for attr, member in vars(obj).items():
                    fn = member.fget if isinstance(member, property) else member
                    fn = fn.__func__ if isinstance(fn, classmethod | staticmethod) else fn
                    if inspect.isfunction(fn) and (not attr.startswith("_") or attr == "__init__"):
                        untyped += [f"{module}.{name}.{attr}: {m}" for m in _untyped(fn)]
    assert not untyped, "missing annotations:\n" + "\n".join(untyped)


def test_no_private_names_cross_modules():
    found = []
    for path in [*SOLVERS.glob("*.py"), *TESTS.glob("*.py"), TESTS.parent / "solver_cases.py"]:
        for node in _imports(path):
            names = [a.name for a in node.names]
            if isinstance(node, ast.Import):
                names = [n.rsplit(".", 1)[-1] for n in names]
            found += [f"{path.name}: {n}" for n in names if n.startswith("_")
                      and not n.startswith("__")]
    assert not found


def test_solver_modules_import_each_other_without_cycles():
    graph: dict[str, set[str]] = {}
    for module in _modules():
        deps = set()
        for node in _imports(SOLVERS / f"{module.split('.')[1]}.py"):
            if isinstance(node, ast.ImportFrom) and node.module == "solvers":
                deps |= {f"solvers.{a.name}" for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("solvers."):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("solvers.")}
        graph[module] = deps - {module}
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError
    # The methods know nothing of the table that lists them.
    for method in ("solvers.baselines", "solvers.dp", "solvers.ilp"):
        assert "solvers.solve" not in graph[method], method
    assert order.index("solvers.chain") < order.index("solvers.simulate")


def test_a_gpu_profiles_attention_kernel_is_saved_under_the_fused_attention_name():
    """The H200 run's profile (cuDNN attention) and a CPU or estimate-mode profile (flash for
    CPU) name the attention kernel differently; a selective region names both alike, so a plan
    saves the attention output whichever kernel runs where it is applied."""
    from solvers import Profile, solve
    from solvers.schedule import FUSED_ATTENTION, policy_op

    root = Path(__file__).resolve().parents[2]
    prof = Profile.load(root / "benchmarks/gpu/results/h200-2026-12-04/gpt2m.profile.json.gz")
    assert any(n.op == "aten._scaled_dot_product_cudnn_attention.default" for n in prof.nodes)
    sched = solve(prof, 2**62, "selective_matmul")
    keys = {k for r in sched.regions for k in r.save_ops}
    assert f"{FUSED_ATTENTION}#0" in keys
    assert not any("cudnn" in k for k in keys)
    assert policy_op("aten._scaled_dot_product_flash_attention_for_cpu.default") == FUSED_ATTENTION
    assert policy_op("aten.mm.default") == "aten.mm.default"


@pytest.mark.parametrize("made", [
    [0] * 1000,  # every stage makes only empty storages
    [(i * 7919) % 100_003 for i in range(5000)],
    [10**9] + [0] * 999,  # one stage makes every byte
    [0] * 999 + [10**9],
], ids=["empty", "mixed", "first", "last"])
def test_a_staged_call_of_many_stages_starts_runs_at_a_bounded_ascending_set(made):
    """Past `MAX_STAGE_STARTS` allocating stages, runs start at the first stage and at stages
    spaced by the bytes before them: never more than the bound, whatever the bytes (all zero
    included), ascending, each an allocating stage."""
    from solvers.chain import MAX_STAGE_STARTS, stage_starts

    allocates = [i % 3 != 1 for i in range(len(made))]
    starts, coarse = stage_starts(made, allocates)
    assert coarse
    assert starts[0] == 0 and starts == sorted(set(starts))
    assert len(starts) <= MAX_STAGE_STARTS
    assert all(allocates[i] for i in starts[1:])
    few = [False] * len(made)
    few[5] = few[9] = True
    assert stage_starts(made, few) == ([0, 5, 9], False)
