"""`ilp`: a MILP over the chain of candidate cuts with per-node selective saves (Checkmate-like).

Checkmate (Jain et al. 2020) chooses, for every op and stage, what to keep and recompute. Non-reentrant
`torch.utils.checkpoint` cannot execute arbitrary such plans: a region is replayed whole, up to its
early stop, at its first use in backward. So the MILP is restricted to what it can run: a partition
of the forward chain into intervals between candidate cuts, each kept or checkpointed, and inside a
checkpointed one-unit interval a choice of which matmul-class outputs to keep from forward.

Points: the candidate cuts of `solvers.chain.cut_points` as `solvers.dp.chain_model` indexes
them, coarsened to at most `MAX_POINTS` (dp's chosen cuts always kept, then block boundaries, then
the cuts with the fewest live bytes). A "unit" is the interval between two consecutive points.

Variables (binary unless stated):
- x[i, j, KEEP] for units only (consecutive kept units compose additively, as in dp);
- x[i, j, CKPT] for every i < j: interval i..j is one checkpointed region;
- x[i, j, SEL] for i < j - 1 where the interval holds a matmul: one region that keeps all its
  matmul outputs (dp's selective segment; on a unit this is CKPT plus every s below);
- s[u, v] for a matmul-class node v (mm, addmm, bmm, baddbmm, convolution, SDPA) of unit u whose
  replay costs time: keep v's output from forward; s[u, v] <= x[u, u + 1, CKPT];
- P[j] >= 0, continuous: bytes (MiB) kept through backward by everything before point j.

Constraints:
- flow: one interval leaves point 0, one enters the last point, in = out elsewhere, so the chosen
  intervals partition the chain;
- memory: P[j] = P[j - 1] + sum of add(i, j, t) x[i, j, t] over intervals ending at j
  + sum of w(v) s[j - 1, v]. This is the big-M-free form of "P_j >= P_i + kept(i, j) - M(1 - x)":
  since the chosen intervals partition the chain, P[j] is exactly the memory the chosen intervals
  before j keep, and the LP relaxation is much tighter than with big-M rows;
- backward peak, one row per point i (at most one interval leaves it):
  G + P[i] + sum_j own(i, j, t) x[i, j, t] + sum_v own_delta(v) s[i, v] <= budget' - c[i];
- forward peak: G_fwd + P[last] <= budget' - c[fwd];
- cuts added between rounds (below): no plan that starts with a rejected plan's steps, and
  after a plan fits, none that the model does not price below it.
Objective: recompute ms, sum time(i, j, t) x - sum t(v) s.

add/own/time/G are dp's `ChainModel` quantities (see `solvers.dp`); a selective save of v adds
w(v) to add, w(v) to own unless v's output is already held for the region's backward, and removes
t(v) from the replay when v is before the early stop (every other op before it still replays, as
`simulate` does). It is the same approximation of the simulator as dp's, without dp's memory
discretisation; so every answer is checked with `simulate` and the MILP re-solved (at most
`MAX_ROUNDS` times, within the time limit):
- a plan that overshoots is banned together with every plan sharing its steps up to the step the
  simulated peak is in (memory there depends on those steps only), and c of the row the peak is
  in rises to what the model under-counted there (the model's error is local: a skip connection
  held across that point, a replay's transient); where the row is not known, or once more than
  `LOCAL_OVERSHOOTS` plans in a row overshot with none that fits yet, budget' is lowered by the
  overshoot as well;
- after a plan fits, the MILP is solved again for a plan the model prices below it, with budget'
  back at the budget (and above it by the room the plan left, where the model is pessimistic),
  until none is left, the rounds or the time run out, or more than `LOCAL_OVERSHOOTS` plans in a
  row overshoot. The cheapest plan that fits is returned; `stats["stop"]` says why the search
  ended.
Lowering budget' for every row at each overshoot, as this solver first did, shut out cheaper
plans whose peak the model counts right (U-Net skip connections).
dp's answer warm-starts the solver and is returned instead when it is cheaper: `ilp` never costs
more than `dp`.

Solver: HiGHS through highspy (`pulp.HiGHS`, warm-started with `Highs.setSolution`) where
installed, else CBC (`pulp.PULP_CBC_CMD(warmStart=True)`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pulp

from solvers.chain import (
    block_spans,
    early_stops,
    first_savers,
    live_bytes_across,
    matmul_positions,
    region,
    selective_region,
)
from solvers.dp import CKPT, KEEP, SEL, ChainModel, chain_model, dp
from solvers.errors import SolverUnavailableError
from solvers.graph import graph_index
from solvers.profile import Profile
from solvers.schedule import Region, Schedule
from solvers.simulate import simulate

__all__ = ["DEFAULT_TIME_LIMIT_S", "LOCAL_OVERSHOOTS", "MAX_POINTS", "MAX_ROUNDS", "MIP_REL_GAP",
           "ilp"]

DEFAULT_TIME_LIMIT_S = 60.0
"""Wall-clock limit of one `ilp` call (dp's warm start and every MILP round together)."""
MAX_POINTS = 80
"""Candidate points kept for the MILP (dp's chosen cuts are always kept, even beyond this)."""
MAX_ROUNDS = 12
"""MILP solves per call at most: the first, and re-solves after the simulator rejected a plan
(or accepted one with room left), each within what is left of the time limit."""
LOCAL_OVERSHOOTS = 3
"""Overshoots in a row answered by lowering only the MILP row the peak is in. After that many, a
search that holds a plan that fits stops (the model keeps pricing plans below it that do not fit),
and one that holds none lowers the whole budget at each further overshoot, so that a budget below
what the model can reach ends in a few rounds instead of running them all."""
MIP_REL_GAP = 1e-3
"""Relative MIP gap (of the MILP's own objective) at which the solver stops and reports optimal."""
MIB = float(2**20)

PlanStep = tuple[int, int, int, list[int]]
"""(i, j, type, saved forward positions): an interval between coarsened points i < j."""
Plan = list[PlanStep]


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS prints its banner from C to file descriptor 1 even with output off; keep it out of
    the user's table (`msg=False` silences everything else)."""
    try:
        sys.stdout.flush()
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no real descriptor (e.g. a notebook)
        yield
        return
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


# -- solver selection ------------------------------------------------------------------------------
class _WarmHiGHS(pulp.HiGHS):
    """`pulp.HiGHS` (highspy) that passes the variables' initial values to HiGHS as a MIP start;
    PuLP's own HiGHS class ignores `warmStart`."""

    def __init__(self, warmStart: bool = False, **kw):
        super().__init__(**kw)
        self.warm_start = warmStart

    def callSolver(self, lp):  # noqa: N802 (PuLP's name)
        if self.warm_start:
            import highspy

            cols = sorted(lp.variables(), key=lambda v: v.index)
            sol = highspy.HighsSolution()
            sol.col_value = [float(v.varValue or 0.0) for v in cols]
            sol.value_valid = True
            lp.solverModel.setSolution(sol)
        lp.solverModel.run()


def _backend() -> str:
    if pulp.HiGHS().available():
        return "highs"
    if pulp.PULP_CBC_CMD(msg=False).available():
        return "cbc"
    raise SolverUnavailableError(
        "method 'ilp' needs a MILP solver: neither HiGHS (highspy) nor CBC is available to PuLP; "
        "install one with `pip install highspy`"
    )


# -- the model -------------------------------------------------------------------------------------
@dataclass
class _Unit:
    i: int
    """Index (into the coarsened points) of the unit's start point; it ends at i + 1."""
    sel: list[tuple[int, float, float, float]] = field(default_factory=list)
    """Selectable matmuls: (forward position, add bytes, own delta bytes, time saved ms)."""


@dataclass
class _Milp:
    prob: pulp.LpProblem
    x: dict[tuple[int, int, int], pulp.LpVariable]
    s: dict[tuple[int, int], pulp.LpVariable]
    p: list[pulp.LpVariable | None]


class _Chain:
    """The coarsened chain and its per-interval quantities (bytes in MiB)."""

    def __init__(self, profile: Profile, m: ChainModel, pts: list[int]):
        self.profile, self.m, self.pts = profile, m, pts
        g = graph_index(profile)
        fwd = g.forward
        n = len(fwd)
        self.n_pts = len(pts)
        stop = early_stops(profile)  # a matmul after the early stop is not replayed anyway
        q1 = first_savers(profile)
        self.units: list[_Unit] = []
        for u in range(len(pts) - 1):
            a, b = m.cuts[pts[u]] + 1, m.cuts[pts[u + 1]]
            unit = _Unit(u)
            for k in matmul_positions(profile, a, b):
                if k > stop[b] or g.time[fwd[k]] <= 0:
                    continue
                w = sum(g.sbytes[st] for st in g.new[fwd[k]])
                held = sum(g.sbytes[st] for st in g.new[fwd[k]] if q1.get(st, n) <= b)
                unit.sel.append((k, w / MIB, (w - held) / MIB, g.time[fwd[k]]))
            self.units.append(unit)
        self.g_mib = m.g_bytes / MIB
        none = simulate(profile)
        keep_all = float(m.add[0, len(m.cuts) - 1, KEEP])
        # Forward peak: fixed memory plus what the chain keeps plus what is live after forward
        # beyond it (the loss, the model output), calibrated on the unchecked step.
        self.g_fwd_mib = (g.fixed_bytes + max(0.0, none.after_forward_bytes - keep_all)) / MIB

    def arcs(self) -> Iterator[tuple[int, int, int, float, float, float]]:
        """(i, j, type) over coarsened point indices, with time ms, add and own MiB."""
        m, pts = self.m, self.pts
        for i in range(self.n_pts - 1):
            for j in range(i + 1, self.n_pts):
                oi, oj = pts[i], pts[j]
                types = [CKPT] if m.checkpointable(oi, oj) else []
                if j == i + 1:
                    types.append(KEEP)
                elif types and m.has_mm[oi, oj]:
                    types.append(SEL)
                for t in types:
                    yield i, j, t, float(m.time[oi, oj, t]), m.add[oi, oj, t] / MIB, \
                        m.own[oi, oj, t] / MIB

    def build(self, budget_bytes: float, banned: tuple[Plan, ...] = (),
              cutoff_ms: float | None = None, corr: dict[int, float] | None = None) -> _Milp:
        """The MILP at internal budget `budget_bytes`, without the plans of `banned` (each one's
        intervals and saves all together), and with `cutoff_ms`: only plans the model says cost
        less than it."""
        cap = budget_bytes / MIB - self.g_mib
        corr = corr or {}
        prob = pulp.LpProblem("ckpt", pulp.LpMinimize)
        x: dict[tuple[int, int, int], pulp.LpVariable] = {}
        cost: dict[tuple[int, int, int], float] = {}
        add: dict[tuple[int, int, int], float] = {}
        own: dict[tuple[int, int, int], float] = {}
        arcs = list(self.arcs())
        # The least any partition of the chain before point i keeps (a shortest path): an interval
        # whose own memory does not fit on top of it can never be chosen.
        n = self.n_pts
        least = [0.0] + [math.inf] * (n - 1)
        for i, j, _, _, ad, _ in sorted(arcs, key=lambda a: a[1]):
            least[j] = min(least[j], least[i] + ad)
        for i, j, t, ms, ad, ow in arcs:
            if least[i] + ow > cap + 1e-9:
                continue
            x[i, j, t] = prob.add_variable(f"x_{i}_{j}_{t}", cat="Binary")
            cost[i, j, t], add[i, j, t], own[i, j, t] = ms, ad, ow
        s: dict[tuple[int, int], pulp.LpVariable] = {}
        for unit in self.units:
            if (unit.i, unit.i + 1, CKPT) not in x:
                continue
            for k, *_ in unit.sel:
                s[unit.i, k] = prob.add_variable(f"s_{unit.i}_{k}", cat="Binary")
        p: list[pulp.LpVariable | None] = [None] + [
            prob.add_variable(f"P_{j}", lowBound=0) for j in range(1, n)
        ]
        sel = {u.i: u.sel for u in self.units}
        prob += pulp.lpSum(cost[a] * v for a, v in x.items() if cost[a]) - pulp.lpSum(
            tm * s[u.i, k] for u in self.units for k, _, _, tm in u.sel if (u.i, k) in s
        )
        out_of: list[list] = [[] for _ in range(n)]
        in_of: list[list] = [[] for _ in range(n)]
        for a, v in x.items():
            out_of[a[0]].append((a, v))
            in_of[a[1]].append((a, v))
        prob += pulp.lpSum(v for _, v in out_of[0]) == 1, "flow_start"
        prob += pulp.lpSum(v for _, v in in_of[n - 1]) == 1, "flow_end"
        for j in range(1, n - 1):
            prob += (pulp.lpSum(v for _, v in in_of[j]) == pulp.lpSum(v for _, v in out_of[j]),
                     f"flow_{j}")
        for j in range(1, n):
            prev = p[j - 1] if j > 1 else 0
            kept = pulp.lpSum(add[a] * v for a, v in in_of[j] if add[a]) + pulp.lpSum(
                w * s[j - 1, k] for k, w, _, _ in sel[j - 1] if (j - 1, k) in s
            )
            prob += p[j] == prev + kept, f"kept_{j}"
        for i in range(n - 1):
            lhs = pulp.lpSum(own[a] * v for a, v in out_of[i] if own[a]) + pulp.lpSum(
                d * s[i, k] for k, _, d, _ in sel[i] if (i, k) in s and d
            )
            if i > 0:
                lhs += p[i]
            prob += lhs <= cap - corr.get(i, 0.0), f"peak_{i}"
        prob += p[n - 1] <= budget_bytes / MIB - self.g_fwd_mib - corr.get(-1, 0.0), \
            "forward_peak"
        for (u, k), v in s.items():
            prob += v <= x[u, u + 1, CKPT], f"sel_{u}_{k}"
        for q, plan in enumerate(banned):
            used = [x[a] for a in ((i, j, t) for i, j, t, _ in plan) if a in x]
            saves = [(i, k) for i, _, _, saved in plan for k in saved]
            if len(used) < len(plan) or any(a not in s for a in saves):
                continue  # a part of it cannot be chosen at this budget anyway
            used += [s[a] for a in saves]
            prob += pulp.lpSum(used) <= len(used) - 1, f"banned_{q}"
        if cutoff_ms is not None:
            prob += prob.objective <= cutoff_ms - max(1e-3, 1e-4 * abs(cutoff_ms)), "cutoff"
        return _Milp(prob, x, s, p)

    # -- plans over coarsened point indices (`Plan`) -------------------------------------------------
    def model_peak(self, plan: Plan) -> tuple[float, list[float]]:
        """The model's peak (bytes) of a plan, and its P values (MiB)."""
        m, pts = self.m, self.pts
        sel = {u.i: {k: (w, d) for k, w, d, _ in u.sel} for u in self.units}
        kept, peak, ps = 0.0, 0.0, [0.0] * self.n_pts
        for i, j, t, saved in plan:
            own = m.own[pts[i], pts[j], t] / MIB + sum(sel[i][k][1] for k in saved)
            peak = max(peak, kept + own)
            kept += m.add[pts[i], pts[j], t] / MIB + sum(sel[i][k][0] for k in saved)
            for q in range(i + 1, j + 1):
                ps[q] = kept
        peak = max(peak + self.g_mib, kept + self.g_fwd_mib)
        return peak * MIB, ps

    def row_error(self, plan: Plan, sim: Any, k: int | None) -> tuple[int | None, float]:
        """Where the model under-counts `plan`'s simulated peak: the MILP row the peak is in
        (the start point of the step holding forward position `k` for a peak in backward, -1
        for one in forward) and by how many MiB; (None, 0) where that is not known."""
        if k is None:
            return None, 0.0
        m, pts = self.m, self.pts
        sel = {u.i: {v: (w, d) for v, w, d, _ in u.sel} for u in self.units}
        g = graph_index(self.profile)
        peak_name = sim.peak_at.removeprefix("replay:")
        in_forward = not sim.peak_at.startswith("replay:") and \
            g.name_to_i.get(peak_name) in g.fwd_pos
        kept = 0.0
        for i, j, t, saved in plan:
            a, b = m.cuts[pts[i]] + 1, m.cuts[pts[j]]
            if not in_forward and a <= k <= b:
                own = m.own[pts[i], pts[j], t] / MIB + sum(sel[i][v][1] for v in saved)
                return i, sim.peak_bytes / MIB - (self.g_mib + kept + own)
            kept += m.add[pts[i], pts[j], t] / MIB + sum(sel[i][v][0] for v in saved)
        if in_forward:
            return -1, sim.peak_bytes / MIB - (self.g_fwd_mib + kept)
        return None, 0.0

    def model_ms(self, plan: Plan) -> float:
        """The MILP objective of a plan: recompute ms as the model counts it."""
        m, pts = self.m, self.pts
        sel = {u.i: {k: tm for k, _, _, tm in u.sel} for u in self.units}
        return sum(float(m.time[pts[i], pts[j], t]) - sum(sel[i][k] for k in saved)
                   for i, j, t, saved in plan)

    def regions(self, plan: Plan) -> tuple[Region, ...]:
        names = graph_index(self.profile).forward_names
        m, pts = self.m, self.pts
        out = []
        for i, j, t, saved in plan:
            if t == KEEP:
                continue
            a, b = m.cuts[pts[i]] + 1, m.cuts[pts[j]]
            if t == SEL:
                out.append(selective_region(self.profile, a, b))
            else:
                out.append(region(self.profile, a, b, tuple(names[k] for k in sorted(saved))))
        return tuple(out)

    def plan_of(self, milp: _Milp) -> Plan | None:
        """The plan of the MILP's solution (None when its intervals do not chain up)."""
        plan: Plan = []
        i = 0
        nxt = {a[0]: a for a, v in milp.x.items() if (v.varValue or 0) > 0.5}
        while i < self.n_pts - 1:
            a = nxt.get(i)
            if a is None:
                return None
            saved = [k for (u, k), v in milp.s.items() if u == i and (v.varValue or 0) > 0.5]
            plan.append((a[0], a[1], a[2], saved if a[2] == CKPT and a[1] == i + 1 else []))
            i = a[1]
        return plan

    def plan_from_regions(self, regs: tuple[Region, ...]) -> Plan | None:
        """dp's schedule as a plan over the points, or None if it is not in the MILP's space."""
        g = graph_index(self.profile)
        m, pts = self.m, self.pts
        at = {m.cuts[o]: q for q, o in enumerate(pts)}
        sel = {u.i: {k for k, *_ in u.sel} for u in self.units}
        plan: Plan = []
        cur = 0
        for r in regs:
            a, b = g.position(r.start), g.position(r.end)
            i, j = at.get(a - 1), at.get(b)
            if i is None or j is None or i < cur:
                return None
            plan += [(q, q + 1, KEEP, []) for q in range(cur, i)]
            saved = {g.position(nm) for nm in r.saved}
            mms = set(matmul_positions(self.profile, a, b))
            if j == i + 1:
                if not saved <= mms:
                    return None
                plan.append((i, j, CKPT, sorted(saved & sel[i])))
            elif not saved:
                plan.append((i, j, CKPT, []))
            elif saved == mms:
                plan.append((i, j, SEL, []))
            else:
                return None
            cur = j
        plan += [(q, q + 1, KEEP, []) for q in range(cur, self.n_pts - 1)]
        return plan

    def set_initial(self, milp: _Milp, plan: Plan) -> None:
        """Make `plan` the MILP's starting solution."""
        for v in (*milp.x.values(), *milp.s.values()):
            v.setInitialValue(0)
        for i, j, t, saved in plan:
            if (i, j, t) in milp.x:
                milp.x[i, j, t].setInitialValue(1)
            for k in saved:
                if (i, k) in milp.s:
                    milp.s[i, k].setInitialValue(1)
        _, ps = self.model_peak(plan)
        for j in range(1, self.n_pts):
            milp.p[j].setInitialValue(ps[j])


def _peak_position(profile: Profile, peak_at: str) -> int | None:
    """The forward position whose forward or backward (or replay, inside its region) the peak
    `Simulation.peak_at` names is in; None for an op of neither (the loss's backward, a
    gradient's accumulation)."""
    g = graph_index(profile)
    i = g.name_to_i.get(peak_at.removeprefix("replay:"))
    if i is None:
        return None
    if i in g.fwd_pos:
        return g.fwd_pos[i]
    return g.fwd_pos.get(g.grad_of[i])


def _up_to_peak(chain: _Chain, plan: Plan, k: int | None) -> Plan:
    """The steps of `plan` that start at or before forward position `k` (all of it for None).
    Memory at a point of forward, and at a point of backward (the steps after it have run
    their backward and freed what they held), depends on these steps only: a plan that shares
    them reaches the same peak there."""
    if k is None:
        return plan
    return [st for st in plan if chain.m.cuts[chain.pts[st[0]]] + 1 <= k]


def _points(profile: Profile, m: ChainModel, keep: set[int]) -> list[int]:
    """At most MAX_POINTS of dp's cut indices (more only when `keep` needs them)."""
    k1 = len(m.cuts)
    chosen = set(keep) | {0, k1 - 1}
    if k1 <= MAX_POINTS:
        return list(range(k1))
    idx = {c: q for q, c in enumerate(m.cuts)}
    for a, e in block_spans(profile):
        for c in (a - 1, e):
            if c in idx and len(chosen) < MAX_POINTS:
                chosen.add(idx[c])
    live = live_bytes_across(profile)
    rest = sorted((live[m.cuts[q]], q) for q in range(1, k1 - 1) if q not in chosen)
    for _, q in rest:
        if len(chosen) >= MAX_POINTS:
            break
        chosen.add(q)
    return sorted(chosen)


def _run(chain: _Chain, budget: float, warms: list[Plan], time_left: float, backend: str,
         banned: tuple[Plan, ...] = (), cutoff_ms: float | None = None,
         corr: dict[int, float] | None = None) -> dict[str, Any]:
    """One MILP solve at internal budget `budget` (without `banned`, cheaper than `cutoff_ms`:
    `_Chain.build`), warm-started from the first plan of `warms` that is feasible for it."""
    t_build = time.perf_counter()
    milp = chain.build(budget, banned, cutoff_ms, corr)
    warm_ok = False
    for warm in warms:
        if all((i, j, t) in milp.x for i, j, t, _ in warm) and \
                chain.model_peak(warm)[0] <= budget + 1.0 and warm not in banned and \
                (cutoff_ms is None or chain.model_ms(warm) < cutoff_ms - 1e-3):
            chain.set_initial(milp, warm)
            warm_ok = True
            break
    tl = max(0.05, time_left)
    if backend == "highs":
        solver = _WarmHiGHS(warmStart=warm_ok, msg=False, timeLimit=tl, gapRel=MIP_REL_GAP)
    else:
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, math.ceil(tl)), gapRel=MIP_REL_GAP,
                                   warmStart=warm_ok)
    t0 = time.perf_counter()
    with _quiet_stdout():
        milp.prob.solve(solver)
    solve_s = time.perf_counter() - t0
    res = {
        "solve_time_s": solve_s, "build_time_s": t0 - t_build, "n_vars": len(milp.prob.variables()),
        "n_constraints": milp.prob.numConstraints(), "warm_started": bool(warm_ok), "plan": None,
        "gap": None, "bound": None, "objective": None,
    }
    if backend == "highs":
        import highspy

        hs = milp.prob.solverModel
        st = hs.getModelStatus()
        res["status"] = hs.modelStatusToString(st)
        res["optimal"] = st == highspy.HighsModelStatus.kOptimal
        res["time_limit"] = st == highspy.HighsModelStatus.kTimeLimit
        info = hs.getInfo()
        if info.primal_solution_status == 2:  # kSolutionStatusFeasible
            res["plan"] = chain.plan_of(milp)
            obj, bound = info.objective_function_value, info.mip_dual_bound
            res["objective"], res["bound"] = obj, bound
            if math.isfinite(bound):
                res["gap"] = max(0.0, obj - bound) / max(abs(obj), 1e-9) if obj > 1e-12 else 0.0
    else:
        res["status"] = pulp.LpStatus[milp.prob.status]
        res["optimal"] = milp.prob.sol_status == pulp.LpSolutionOptimal
        res["time_limit"] = not res["optimal"] and solve_s >= tl * 0.95
        if milp.prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            res["plan"] = chain.plan_of(milp)
            res["objective"] = pulp.value(milp.prob.objective) or 0.0
            res["gap"] = 0.0 if res["optimal"] else None
    return res


def ilp(profile: Profile, budget_bytes: int, time_limit_s: float | None = None) -> Schedule:
    """The cheapest schedule the MILP finds within `time_limit_s` (None: `DEFAULT_TIME_LIMIT_S`)
    that the simulator says fits; never worse than `dp`'s."""
    backend = _backend()
    t0 = time.perf_counter()
    limit = DEFAULT_TIME_LIMIT_S if time_limit_s is None else float(time_limit_s)
    deadline = t0 + limit

    d = dp(profile, budget_bytes, None)
    d_sim = simulate(profile, d.regions)
    d_fits = d_sim.peak_bytes <= budget_bytes
    dp_s = time.perf_counter() - t0

    m = chain_model(profile)
    idx = {c: q for q, c in enumerate(m.cuts)}
    g = graph_index(profile)
    keep: set[int] = set()
    for r in d.regions if d_fits else ():
        for c in (g.position(r.start) - 1, g.position(r.end)):
            if c in idx:
                keep.add(idx[c])
    chain = _Chain(profile, m, _points(profile, m, keep))
    warm = chain.plan_from_regions(d.regions)

    stats: dict[str, Any] = {
        "backend": backend, "candidates": len(m.cuts) - 2, "points": chain.n_pts,
        "dp_time_s": dp_s, "dp_recompute_ms": d_sim.recompute_ms if d_fits else None,
        "warm_start_ms": d_sim.recompute_ms if (d_fits and warm is not None) else None,
        "solve_time_s": 0.0, "build_time_s": 0.0, "rounds": 0,
    }
    internal = float(budget_bytes)
    if d_fits and warm is not None:
        internal = max(internal, chain.model_peak(warm)[0])  # the model may be pessimistic here
    best: tuple[float, int, tuple[Region, ...], int] | None = None  # (ms, peak, regions, round)
    best_model_ms = math.inf  # the MILP objective of `best`'s plan
    min_peak = d.min_peak_bytes if d.min_peak_bytes is not None else math.inf
    min_regs = d.regions
    hi = internal  # the budget the MILP starts from
    fit_internal = -math.inf  # the highest internal budget at which a plan fitted
    banned: list[Plan] = []  # plans the simulator says overshoot
    corr: dict[int, float] = {}  # MiB the model under-counted at a peak row
    first_ok = False
    results: list[dict[str, Any]] = []
    any_time_limit = False
    warms = [warm] if (d_fits and warm is not None) else []  # plans that truly fit
    in_a_row = 0  # overshoots since the last plan that fitted
    stop = "rounds"  # why the search ended, in stats
    for rnd in range(MAX_ROUNDS):
        left = deadline - time.perf_counter()
        if rnd > 0 and left < 0.05:
            stop = "time"
            break
        res = _run(chain, internal, warms, left, backend, tuple(banned),
                   best_model_ms if best is not None else None, corr)
        results.append(res)
        stats["rounds"] = rnd + 1
        stats["solve_time_s"] += res["solve_time_s"]
        stats["build_time_s"] += res["build_time_s"]
        any_time_limit |= res["time_limit"]
        plan = res["plan"]
        if plan is None:
            stop = "no cheaper plan"  # nothing (cheaper than the best so far) within this budget
            break
        regs = chain.regions(plan)
        sim = simulate(profile, regs)
        if sim.peak_bytes < min_peak:
            min_peak, min_regs = sim.peak_bytes, regs
        if sim.peak_bytes <= budget_bytes:
            in_a_row = 0
            warms.insert(0, plan)
            if best is None or (sim.recompute_ms, sim.peak_bytes) < best[:2]:
                best = (sim.recompute_ms, sim.peak_bytes, regs, rnd)
                best_model_ms = min(best_model_ms, chain.model_ms(plan))
            if rnd == 0:
                first_ok = res["optimal"]
            if not res["optimal"]:
                stop = "time"  # out of time: keep what fits
                break
            fit_internal = max(fit_internal, internal)
            # Look for a cheaper plan that the model placed above `internal`: back up to the
            # budget where an overshoot lowered it, and beyond by the room this plan left where
            # the model is pessimistic. Only plans cheaper than the best qualify from now on.
            slack = budget_bytes - sim.peak_bytes
            nxt = max(hi, internal + slack) if slack > 0.005 * budget_bytes else hi
            if nxt <= internal:
                stop = "no cheaper plan"
                break
            internal = nxt
            continue
        # The model under-counts this plan's peak: never again (nor any plan that shares its
        # steps up to where the peak is), and the budget of the MILP row the peak is in lowered
        # by the error there; where that row is not known, or after `LOCAL_OVERSHOOTS` in a
        # row, the whole budget by the overshoot (not below one where a plan fitted).
        in_a_row += 1
        if (best is not None or d_fits) and in_a_row > LOCAL_OVERSHOOTS:
            stop = "overshoots"  # a plan that fits is in hand; the model keeps pricing wrong
            break  # ones below it
        banned.append(_up_to_peak(chain, plan, _peak_position(profile, sim.peak_at)))
        row, err = chain.row_error(plan, sim, _peak_position(profile, sim.peak_at))
        if row is not None and err > 0:
            corr[row] = max(corr.get(row, 0.0), err)  # that row's budget, lowered by the error
        if row is None or err <= 0 or in_a_row > LOCAL_OVERSHOOTS:
            internal = max(internal - (sim.peak_bytes - budget_bytes), fit_internal)
    stats["stop"] = stop
    stats["banned"] = len(banned)
    stats["corrected_rows"] = len(corr)
    # The MILP's figures of the round whose plan is returned (else of the last round); a later
    # round that found nothing cheaper ends "Infeasible" by design, as `last_status` says.
    last = results[best[3]] if best is not None else (results[-1] if results else {})
    stats["last_status"] = results[-1].get("status") if results else None
    stats.update({
        "status": last.get("status"), "gap": last.get("gap"), "bound_ms": last.get("bound"),
        "objective_ms": last.get("objective"), "n_vars": last.get("n_vars"),
        "n_constraints": last.get("n_constraints"), "warm_started": last.get("warm_started"),
    })
    if best is not None and d_fits and d_sim.recompute_ms < best[0] - 1e-9 * max(1.0, best[0]):
        best = None  # dp's answer is strictly cheaper
        stats["source"] = "dp"
    if best is None and d_fits:
        stats["source"] = "dp"
        return Schedule(regions=d.regions, method="ilp",
                        status="time_limit" if any_time_limit else "feasible",
                        min_peak_bytes=int(min(min_peak, d_sim.peak_bytes)), stats=stats)
    if best is None:
        return Schedule(regions=min_regs, method="ilp", status="infeasible",
                        min_peak_bytes=int(min_peak), stats=stats)
    ms, peak, regs, rnd = best
    stats["source"] = "ilp"
    if rnd == 0 and first_ok:
        status = "optimal"
    elif any_time_limit:
        status = "time_limit"
    else:
        status = "feasible"
    return dataclasses.replace(
        Schedule(regions=regs, method="ilp", min_peak_bytes=int(min(min_peak, peak)), stats=stats),
        status=status,
    )
