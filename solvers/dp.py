"""`dp`: the cheapest schedule over a chain of candidate cuts, by dynamic programming (rotor-style).

Beaumont et al. (rotor, "Optimal checkpointing for heterogeneous chains", 2019/2021) solve a chain
exactly with a DP over (stage, memory) states. We do the same over the candidate cuts
c_0 = start < c_1 < ... < c_K < end of `solvers.chain.cut_points`: a plan splits the chain at
some of the cuts; each segment [a, b] (forward positions) is kept, checkpointed as one region, or
checkpointed selectively (keeping its matmul outputs, the torchtitan policy).

Memory model (all bytes, per segment S = [a, b]; w(s) = bytes of storage s, p(s) its producer,
q1(s) its first forward saver, lr(s) its last forward reader; fixed memory excluded):
- kept(S) when kept: what S's ops save, each storage counted at its first saver:
  sum of w(s) with q1(s) in [a, b];
- kept(S) when checkpointed: its inputs nobody saved earlier (p < a, q1 >= a, read in S) plus its
  outputs that its own ops save and later segments read (a <= p, q1 <= b < lr): those a later
  segment would otherwise count as already held;
- own(S): memory while S's backward runs: kept(S) plus, when checkpointed, the replayed storages
  its backward needs (a <= p, q1 <= b), less the matmul outputs a selective region did not drop.
Peak model: G + max over segments S of (sum of kept(S') over S' before S) + own(S), where
G = simulate(no checkpointing).peak - kept(whole chain kept) is calibrated on the unchecked step
(fixed memory, loss, activation gradients, workspace). Time: a checkpointed segment replays its ops
up to its last saving op (early stop, as `simulate` places it); a selective one skips its saved matmuls.

The model is an approximation (it ignores transient non-saved tensors during replay, and storages
read across several segments), so every answer is checked with `simulate`; when the simulated peak
overshoots a target, the DP is re-solved with its internal budget lowered by the overshoot
(`GRID_ITERS` times). Targets form a fixed grid per profile (`_pool`), so a larger budget never
costs more; the best plan that truly fits is returned, compared with the baselines' schedules (all
of which lie in the DP's search space when their cuts are candidates), so `dp` never does worse
than a baseline. Status `optimal` means: the DP's own optimum at the budget fitted on the first
try and nothing cheaper was found.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from solvers import baselines
from solvers.chain import (
    applicable,
    bind,
    cut_points,
    early_stops,
    first_savers,
    in_place,
    matmul_mask,
    region,
    selective_region,
    storage_positions,
    useful_calls,
)
from solvers.errors import ScheduleError
from solvers.graph import graph_index
from solvers.profile import Profile, cached
from solvers.schedule import Region, Schedule
from solvers.simulate import simulate

__all__ = [
    "CKPT",
    "GRID_ITERS",
    "GRID_POINTS",
    "KEEP",
    "MEMORY_BUCKETS",
    "POOL_BUCKETS",
    "SEL",
    "ChainModel",
    "Plan",
    "chain_model",
    "dp",
    "solve_chain",
]

MEMORY_BUCKETS = 1000
"""The DP's memory axis: the bytes available to activations, budget - G, is cut into this many
units u, and every segment's kept and own bytes are rounded UP to whole units. The DP therefore
never overestimates the budget: its answers are feasible for the model, and each segment of a plan
overstates memory by less than u = (budget - G) / 1000, i.e. a plan of n segments loses at most
n * 0.1% of the activation budget against the exact model optimum."""

KEEP, CKPT, SEL = 0, 1, 2
"""Segment types: kept (its ops save as usual), checkpointed (one region), selective (one region
that keeps its matmul-class outputs)."""

Plan = list[tuple[int, int, int]]
"""A plan over a ChainModel: (i, j, type) for each segment from cut i to cut j, in order."""


@dataclass
class ChainModel:
    """Per-segment quantities of the DP, for every pair of candidate cuts (i < j)."""

    cuts: list[int]
    """Forward positions of the cuts, starting with -1 (chain start) and ending with F - 1."""
    g_bytes: int
    """Calibrated constant G (see module docstring)."""
    time: np.ndarray
    """(K1, K1, 3) recompute ms of segment (i, j) by type."""
    add: np.ndarray
    """(K1, K1, 3) bytes the segment keeps through backward."""
    own: np.ndarray
    """(K1, K1, 3) bytes while the segment's backward runs."""
    has_mm: np.ndarray
    """(K1, K1) the segment holds a matmul-class op (selective is a distinct option)."""
    into: list[list[int]] | None = None
    """For a recorded profile: into[j] lists the cuts i for which segment (i, j) is a module call
    that can be checkpointed (the only segments a plan applied in place can checkpoint). None:
    every segment can (a traced profile's node ranges)."""

    host: np.ndarray | None = None
    """(K1, K1, 3) the part of `time` that is checkpoint's host cost (zero where not replayed);
    None: no part is."""

    time_rows: list[list[list[float]]] = field(init=False, repr=False)
    """`time` as nested lists, for the DP's inner loop (numpy scalars are slow to index there)."""

    def __post_init__(self) -> None:
        self.time_rows = self.time.tolist()

    def checkpointable(self, i: int, j: int) -> bool:
        """Segment (i, j) may be checkpointed (on a recorded profile: it is a useful call)."""
        return self.into is None or i in self.into[j]

    def without_host(self) -> ChainModel | None:
        """The same chain with checkpoint's host cost taken out of `time`; None where it has
        none. Its plans at a low budget are those of the least kernel time: the floor search
        (`_solve_pool`) tries both, since a calibrated host cost (a noisy measurement) decides
        among near-equal plans at the lowest budgets, and their simulated peaks differ."""
        if self.host is None or not self.host.any():
            return None
        return ChainModel(self.cuts, self.g_bytes, self.time - self.host, self.add, self.own,
                          self.has_mm, self.into)


def chain_model(profile: Profile) -> ChainModel:
    """The DP's per-segment quantities of a profile, computed once per profile."""
    return cached(profile, "chain_model", _chain_model)


def _chain_model(profile: Profile) -> ChainModel:
    """Every segment's quantities at once: prefix sums and 2-D difference arrays (numpy)."""
    g = graph_index(profile)
    fwd = g.forward
    n = len(fwd)
    into = None
    if in_place(profile):
        spans = useful_calls(profile)
        inner = {s.a - 1 for s in spans} | {s.b for s in spans}
        cuts = [-1, *sorted(inner - {-1, n - 1}), n - 1]
        at = {c: q for q, c in enumerate(cuts)}
        into = [[] for _ in cuts]
        for s in spans:
            into[at[s.b]].append(at[s.a - 1])
    else:
        cuts = [-1, *sorted({g.fwd_pos[i] for i in cut_points(profile, matmul_cuts=True)}
                         - {n - 1}), n - 1]
    k1 = len(cuts)
    starts = np.array([c + 1 for c in cuts])
    ends = np.array(cuts)
    # Per position.
    t = np.array([g.time[i] for i in fwd], dtype=float)
    mm = np.array(matmul_mask(profile), dtype=bool)
    stop = np.array(early_stops(profile), dtype=int)  # stop[b]: last op a region ending at b replays
    tcum = np.concatenate([[0.0], np.cumsum(t)])
    tnm = np.concatenate([[0.0], np.cumsum(np.where(mm, 0.0, t))])
    # Per storage: producer p, forward readers, first saver q1.
    prod, readers = storage_positions(profile)
    q1 = first_savers(profile)
    mm_bytes = np.zeros(n)
    for s, k in prod.items():
        if mm[k]:
            mm_bytes[k] += g.sbytes[s]
    mmcum = np.concatenate([[0.0], np.cumsum(mm_bytes)])
    q1_bytes = np.zeros(n)
    for s, k in q1.items():
        q1_bytes[k] += g.sbytes[s]
    q1cum = np.concatenate([[0.0], np.cumsum(q1_bytes)])
    # 2-D difference arrays over (start cut i, end position b): rows i with start_i <= p(s).
    d_out = np.zeros((k1 + 1, n + 1))
    d_hold = np.zeros((k1 + 1, n + 1))
    d_hold_nm = np.zeros((k1 + 1, n + 1))
    inputs_at: list[list[tuple[int, int]]] = [[] for _ in range(k1)]  # i -> (first reader >= a, w)
    for s, p in prod.items():
        w = g.sbytes[s]
        if w == 0:
            continue
        rmax = bisect.bisect_right(cuts, p - 1)  # rows 0..rmax-1 have start <= p
        rd = readers.get(s, [])
        lr = rd[-1] if rd else -1
        f = q1.get(s)
        if f is not None:
            for d in (d_hold, *((d_hold_nm,) if not mm[p] else ())):
                d[0, f] += w
                d[rmax, f] -= w
            if lr > f:
                d_out[0, f] += w
                d_out[rmax, f] -= w
                d_out[0, lr] -= w
                d_out[rmax, lr] += w
        # Inputs of segments starting after p, not saved before the segment starts.
        for i in range(rmax, k1):
            a = starts[i]
            if a > lr:
                break
            if f is not None and f < a:
                break
            r = rd[bisect.bisect_left(rd, a)]
            inputs_at[i].append((r, w))
    out2 = np.cumsum(np.cumsum(d_out, axis=0), axis=1)[:k1, ends]
    hold2 = np.cumsum(np.cumsum(d_hold, axis=0), axis=1)[:k1, ends]
    hold_nm2 = np.cumsum(np.cumsum(d_hold_nm, axis=0), axis=1)[:k1, ends]
    inp2 = np.zeros((k1, k1))
    for i, lst in enumerate(inputs_at):
        if lst:
            lst.sort()
            rs = np.array([r for r, _ in lst])
            cw = np.concatenate([[0.0], np.cumsum([w for _, w in lst])])
            inp2[i] = cw[np.searchsorted(rs, ends, side="right")]
    a_ = starts[:, None]
    b_ = ends[None, :]
    e_ = stop[ends][None, :]
    replays = e_ >= a_
    e_safe = np.maximum(e_, a_ - 1)
    # checkpoint's host cost of a replayed region (as `simulate` adds it): per region, plus per
    # tensor its ops save
    nsv = np.concatenate([[0.0], np.cumsum([len(g.saves[i]) for i in fwd])])
    host = g.region_ms + g.saved_tensor_ms * (nsv[b_ + 1] - nsv[a_])
    time = np.zeros((k1, k1, 3))
    hosts = np.zeros((k1, k1, 3))
    hosts[:, :, CKPT] = np.where(replays, host, 0.0)
    sel_host = g.selective_op_ms * (b_ + 1 - a_)  # selective regions: a dispatch mode per op
    hosts[:, :, SEL] = np.where(replays, host + sel_host, 0.0)
    time[:, :, CKPT] = np.where(replays, tcum[e_safe + 1] - tcum[a_], 0.0) + hosts[:, :, CKPT]
    time[:, :, SEL] = np.where(replays, tnm[e_safe + 1] - tnm[a_], 0.0) + hosts[:, :, SEL]
    keep = q1cum[b_ + 1] - q1cum[a_]
    ck = inp2 + out2
    add = np.zeros((k1, k1, 3))
    own = np.zeros((k1, k1, 3))
    add[:, :, KEEP] = own[:, :, KEEP] = keep
    add[:, :, CKPT] = ck
    own[:, :, CKPT] = ck + hold2
    add[:, :, SEL] = ck + (mmcum[b_ + 1] - mmcum[a_])
    own[:, :, SEL] = add[:, :, SEL] + hold_nm2
    has_mm = (mmcum[b_ + 1] - mmcum[a_]) > 0
    g_bytes = simulate(profile).peak_bytes - int(q1cum[-1])
    return ChainModel(cuts, g_bytes, time, add, own, has_mm, into, hosts)


def solve_chain(m: ChainModel, budget_bytes: float, buckets: int = MEMORY_BUCKETS) -> Plan | None:
    """The minimum-time plan whose model peak is at most `budget_bytes`, or None when none is."""
    cap = budget_bytes - m.g_bytes
    if cap <= 0:
        return None
    k1 = len(m.cuts)
    u = cap / buckets
    add_u = np.ceil(m.add / u - 1e-9).astype(np.int64)
    own_u = np.ceil(m.own / u - 1e-9).astype(np.int64)
    inf = math.inf
    cost = np.full((k1, buckets + 1), inf)
    par = np.full((k1, buckets + 1), -1, dtype=np.int64)  # i * 3 + type
    cost[0, 0] = 0.0
    first = [0] + [buckets + 1] * (k1 - 1)  # smallest finite memory state per cut
    times = m.time_rows
    for j in range(1, k1):
        cj, pj = cost[j], par[j]
        sources = range(j) if m.into is None else sorted({j - 1, *m.into[j]})
        for i in sources:
            lo = first[i]
            if lo > buckets:
                continue
            for typ in (KEEP, CKPT, SEL):
                if typ == KEEP and i != j - 1:
                    continue  # kept segments compose additively: one cut at a time suffices
                if typ != KEEP and not m.checkpointable(i, j):
                    continue
                if typ == SEL and not m.has_mm[i, j]:
                    continue
                o, ad = int(own_u[i, j, typ]), int(add_u[i, j, typ])
                top = buckets - o  # states m with m + own <= buckets
                if top < lo:
                    continue
                src = cost[i, lo : top + 1] + times[i][j][typ]
                dst = cj[lo + ad : top + 1 + ad]
                better = src < dst
                if better.any():
                    dst[better] = src[better]
                    pj[lo + ad : top + 1 + ad][better] = i * 3 + typ
        finite = np.flatnonzero(cj < inf)
        if finite.size:
            first[j] = int(finite[0])
    end = cost[k1 - 1]
    if not np.isfinite(end).any():
        return None
    mem = int(np.argmin(end))
    plan = []
    j = k1 - 1
    while j > 0:
        code = int(par[j, mem])
        i, typ = divmod(code, 3)
        plan.append((i, j, typ))
        mem -= int(add_u[i, j, typ])
        j = i
    plan.reverse()
    return plan


def _regions(profile: Profile, m: ChainModel, plan: Plan) -> tuple[Region, ...]:
    regs = []
    for i, j, typ in plan:
        if typ == KEEP:
            continue
        a, b = m.cuts[i] + 1, m.cuts[j]
        regs.append(selective_region(profile, a, b) if typ == SEL else region(profile, a, b))
    return tuple(regs)


def _incumbents(profile: Profile, budget_bytes: int) -> list[tuple[str, tuple[Region, ...]]]:
    """The baselines' schedules that a plan of this profile could be (on a recorded profile,
    those whose regions are all module calls)."""
    out = []
    for name, method in baselines.BY_NAME.items():
        try:
            regs = method(profile, budget_bytes, None).regions
        except ScheduleError:  # one FSDP rank's profile: segments spanning units do not exist
            continue
        if in_place(profile) and not applicable(bind(profile, regs)):
            continue
        out.append((name, regs))
    return out


GRID_POINTS = 24
"""Targets, evenly spaced from the smallest peak the DP reaches to the no-checkpoint peak."""
POOL_BUCKETS = 250
"""`MEMORY_BUCKETS` for the pool's solves: a coarser memory axis, so each solve is cheaper (the
error per segment stays below 1/250 of the activation budget)."""
GRID_ITERS = 3
"""Re-solves per target after the simulation overshoots it."""
FLOOR_POINTS = 16
FLOOR_BAND = 0.25
"""The floor sweep: `FLOOR_POINTS` model budgets evenly spaced over the lowest `FLOOR_BAND` of
the range from the smallest model budget with a plan to the no-checkpoint peak."""


def _pool(profile: Profile) -> list[tuple[int, float, tuple[Region, ...]]]:
    """Verified DP plans, (peak, recompute ms, regions), for every target of a fixed grid (the
    smallest peak the DP reaches to the unchecked peak), solved once per profile. The pool does
    not depend on the budget, so `dp`'s answer never costs more at a larger budget (the property
    `solve` promises), and is the same whatever was solved on the profile before. A plan solved
    for a target above the budget may still fit it (the chain model errs both ways)."""
    return cached(profile, "dp_pool", _solve_pool)


def _solve_pool(profile: Profile) -> list[tuple[int, float, tuple[Region, ...]]]:
    m, none_peak = chain_model(profile), simulate(profile).peak_bytes
    found: dict[tuple[Region, ...], tuple[int, float]] = {}

    def sim(plan: Plan) -> int:
        regs = _regions(profile, m, plan)
        if regs not in found:
            r = simulate(profile, regs)
            found[regs] = (r.peak_bytes, r.recompute_ms)
        return found[regs][0]

    # The smallest model budget with a plan, by bisection, then a sweep of model budgets above
    # it: the chain model errs most there (a plan it puts MBs above another may simulate below
    # it), and the lowest plans found are where `nested` and `ilp` start from. On the chain
    # without checkpoint's host cost too (a calibrated figure that decides among near-equal plans
    # at the lowest budgets); every plan is simulated with the host cost all the same.
    for chain in (m, m.without_host()):
        if chain is None:
            continue
        lo, hi = float(chain.g_bytes), float(none_peak)
        for _ in range(10):
            mid = (lo + hi) / 2
            plan = solve_chain(chain, mid, POOL_BUCKETS)
            if plan is None:
                lo = mid
            else:
                sim(plan)
                hi = mid
        for k in range(1, FLOOR_POINTS + 1):
            plan = solve_chain(chain, hi + (none_peak - hi) * FLOOR_BAND * k / FLOOR_POINTS,
                               POOL_BUCKETS)
            if plan is not None:
                sim(plan)
    floor = min((pk for pk, _ in found.values()), default=none_peak)
    for k in range(GRID_POINTS + 1):
        target = floor + (none_peak - floor) / GRID_POINTS * k
        internal = target
        for _ in range(GRID_ITERS):
            plan = solve_chain(m, internal, POOL_BUCKETS)
            if plan is None:
                break
            peak = sim(plan)
            if peak <= target:
                break
            internal -= peak - target
    return [(pk, ms, regs) for regs, (pk, ms) in found.items()]


def _options(profile: Profile, budget_bytes: int
             ) -> list[tuple[int, float, tuple[Region, ...], str]]:
    """(peak, recompute ms, regions, source) of every schedule `dp` chooses among at
    `budget_bytes`: the pool and the baselines' schedules, simulated once per profile and
    budget (`dp` and `nested` at one budget share them)."""
    per_budget = cached(profile, "dp_options", lambda _: {})
    if budget_bytes not in per_budget:
        options = [(pk, ms, regs, "dp") for pk, ms, regs in _pool(profile)]
        for name, regs in _incumbents(profile, budget_bytes):
            r = simulate(profile, regs)
            options.append((r.peak_bytes, r.recompute_ms, regs, name))
        per_budget[budget_bytes] = options
    return per_budget[budget_bytes]


def lowest_plans(profile: Profile, budget_bytes: int, count: int) -> list[tuple[Region, ...]]:
    """Where none fits, the starting points `nested` tries: among the schedules `dp` chooses
    among at `budget_bytes`, by simulated peak (then least recompute), the lowest of each number
    of regions, `count` of them. A greedy descent's end depends on its start more than on the
    start's peak: a start of fewer, larger regions can end below the lowest start's end, where
    the lowest few plans of the pool often descend to the same end."""
    options = _options(profile, budget_bytes)
    out: list[tuple[Region, ...]] = []
    sizes: set[int] = set()
    for _, _, regs, _ in sorted(options, key=lambda o: (o[0], o[1], len(o[2]))):
        if len(regs) not in sizes:
            out.append(regs)
            sizes.add(len(regs))
        if len(out) == count:
            break
    return out


def dp(profile: Profile, budget_bytes: int, time_limit_s: float | None = None) -> Schedule:
    """The cheapest schedule over the chain of candidate cuts that the simulator says fits.

    The answer is the best schedule that fits among the DP's verified plans for a fixed grid of
    targets (`_pool`) and the baselines' schedules. The DP is also solved at the budget itself:
    when that plan fits and nothing found is cheaper, the status is `optimal` (optimal for the
    chain model over the candidate cuts, to within `MEMORY_BUCKETS`).
    """
    m = chain_model(profile)
    stats: dict[str, Any] = {"candidates": len(m.cuts) - 2, "g_bytes": m.g_bytes}
    none_peak = simulate(profile).peak_bytes
    if none_peak <= budget_bytes:  # nothing to recompute: no regions is optimal
        return Schedule(regions=(), method="dp", status="optimal", stats=stats)
    options = _options(profile, budget_bytes)
    min_peak, _, min_regs, _ = min(options, key=lambda o: (o[0], o[1]))
    fits = [o for o in options if o[0] <= budget_bytes]
    stats["pool"] = len(options)
    if not fits:
        return Schedule(regions=min_regs, method="dp", status="infeasible",
                        min_peak_bytes=int(min_peak), stats=stats)
    peak, ms, regs, source = min(fits, key=lambda o: (o[1], o[0], len(o[2])))
    stats["source"] = source
    status = "feasible"
    plan = solve_chain(m, budget_bytes)
    if plan is not None:
        r = simulate(profile, _regions(profile, m, plan))
        stats["direct_ms"] = r.recompute_ms if r.peak_bytes <= budget_bytes else None
        if r.peak_bytes <= budget_bytes and r.recompute_ms <= ms + 1e-9:
            status = "optimal"
    return Schedule(regions=regs, method="dp", status=status, min_peak_bytes=int(min_peak),
                    stats=stats)


_solve_chain = solve_chain  # the name `benchmarks/solve_times.py` imports; use `solve_chain`
