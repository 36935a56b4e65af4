"""`nested`: regions inside regions, where one level of regions cannot reach the budget.

With one level, the floor of a plan is the regions' inputs (kept through backward) plus the
largest region's replay. Recomputing a recomputation goes lower (Chen et al. 2016, section 4;
the rotor/revolve line of Beaumont et al., the basis of Rockmate): inside a checkpointed block,
its attention and MLP are checkpointed too, so the block's replay keeps only their inputs, and
each of them replays in turn. non-reentrant `torch.utils.checkpoint` nests this way at run time
(`solvers.simulate` follows it), and `planner.apply` wraps the inner modules as well.

The method starts from `dp`'s schedule (its cheapest plan at the budget, or, when none fits,
each of its few plans of lowest peak in turn, keeping the best end) and, while the simulated
peak is above the budget, adds the module call that lowers it most: nested in a region,
wrapping regions, or beside them; the same call of every repeated block at once
(``model.layers.*.self_attn``) or one call, nearest the peak first. A run of a traced forward's
stages or of a Sequential's children counts as a call, and runs of one forward nest too (a
residual block checkpointed, and its first convolution inside it, so the block's replay does
not hold that convolution's output through the rest of its backward).
Where no call added lowers the peak, it drops the region whose removal lowers it most (a
replay can be what peaks) and goes on adding. Every step is judged by `simulate`; it stops when
the budget is met or nothing lowers the peak, and then drops the regions the budget does not
need, largest first.
"""

from __future__ import annotations

import time
from collections import defaultdict

from solvers.chain import (
    CallSpan,
    candidate_calls,
    region,
    shared_calls,
    shared_modules,
    useful,
    useful_calls,
)
from solvers.dp import dp, lowest_plans
from solvers.graph import graph_index
from solvers.profile import Profile
from solvers.schedule import Region, Schedule
from solvers.simulate import simulate

__all__ = ["nested"]

MAX_STEPS = 256
"""Nesting steps at most (each adds one call, or one child in every repeated region)."""


STARTS = 3
"""Where no schedule of dp's fits: the descent starts from this many of them (the lowest-peak one
of each number of regions, `solvers.dp.lowest_plans`) and keeps the best end. A greedy descent
can stall on a start that another start gets past."""


def nested(profile: Profile, budget_bytes: int, time_limit_s: float | None = None) -> Schedule:
    """dp's schedule, with module calls nested inside its regions while that lowers the simulated
    peak towards `budget_bytes` (see the module docstring)."""
    t0 = time.perf_counter()
    base = dp(profile, budget_bytes, time_limit_s)
    start = simulate(profile, base.regions)
    if start.peak_bytes <= budget_bytes:
        return Schedule(regions=base.regions, method="nested", status=base.status,
                        min_peak_bytes=base.min_peak_bytes, stats={"source": "dp"})
    deadline = None if time_limit_s is None else t0 + time_limit_s
    starts = [base.regions] + [r for r in lowest_plans(profile, budget_bytes, STARTS)
                               if r != base.regions]
    best = None
    for regs in starts[:STARTS]:
        end = _descend(profile, regs, budget_bytes, deadline)
        if end is None:  # dp's regions are not module calls (a graph profile)
            if best is None:
                return Schedule(regions=base.regions, method="nested", status="infeasible",
                                min_peak_bytes=start.peak_bytes, stats={"source": "dp"})
            continue
        if best is None or _better(end, best, budget_bytes):
            best = end
        if best[1] <= budget_bytes:
            break  # a start that fits: the one dp ranks best is the cheap one
    chosen, peak, ms, steps, n_base = best
    regions = _regions(profile, chosen)
    status = "feasible" if peak <= budget_bytes else "infeasible"
    return Schedule(regions=regions, method="nested", status=status,
                    min_peak_bytes=int(min(peak, start.peak_bytes)),
                    stats={"nesting_steps": steps, "nested": len(chosen) - n_base})


def _better(a, b, budget_bytes: int) -> bool:
    """Descent end `a` beats `b`: it fits and `b` does not, both fit and `a` recomputes less, or
    neither fits and `a` peaks lower (then recomputes less)."""
    fa, fb = a[1] <= budget_bytes, b[1] <= budget_bytes
    if fa != fb:
        return fa
    return (a[2], a[1]) < (b[2], b[1]) if fa else (a[1], a[2]) < (b[1], b[2])


def _descend(profile: Profile, base: tuple[Region, ...], budget_bytes: int,
             deadline: float | None):
    """From the schedule `base`, add the move that lowers the simulated peak most while it is
    above `budget_bytes`, then drop the regions the budget does not need. Returns (chosen
    calls, peak, recompute ms, steps, number of base regions), or None when a region of `base`
    is not a module call."""
    spans = {(s.a, s.b): s for s in candidate_calls(profile)}
    singles = [s for s in useful_calls(profile) if s.call.module or s.segment is not None]
    groups = [list(grp) for grp in shared_calls(profile)
              if any(useful(profile, s) for s in grp)]
    shared = shared_modules(profile)
    runs: dict[str, list[CallSpan]] = defaultdict(list)  # runs of each call's stages/children
    for s in spans.values():
        if s.segment is not None:
            runs[s.call.module].append(s)
    for rs in runs.values():  # longest first, as `_split` looks for the longest that fits
        rs.sort(key=lambda r: (-(r.b - r.a), r.a))
    chosen: list[CallSpan] = []
    for r in base:
        span = spans.get(_span_of(profile, r))
        if span is None:  # dp's regions are module calls on a recorded profile
            return None
        chosen.append(span)
    start = simulate(profile, _regions(profile, chosen))
    peak, ms = start.peak_bytes, start.recompute_ms
    at = start.peak_at
    steps = 0
    g = graph_index(profile)
    while peak > budget_bytes and steps < MAX_STEPS:
        if deadline is not None and time.perf_counter() > deadline:
            break
        best = None
        for drop, add in _moves(chosen, singles, _near(g, profile, at), groups, runs):
            if deadline is not None and time.perf_counter() > deadline:
                break  # the best move so far, if any
            trial = [c for c in chosen if all(c is not d for d in drop)] + add
            sim = simulate(profile, _regions(profile, trial))
            score = (sim.peak_bytes, sim.recompute_ms)
            if sim.peak_bytes < peak and (best is None or score < best[0]):
                best = (score, trial)
        if best is not None:
            (peak, ms), chosen = best
        else:
            # Stalled: a region whose replay is what peaks may be better gone (its inputs are
            # kept anyway); drop the one that lowers the peak most, then descend again.
            for unit in _units(chosen, shared):
                if deadline is not None and time.perf_counter() > deadline:
                    break
                trial = [c for c in chosen if all(c is not u for u in unit)]
                sim = simulate(profile, _regions(profile, trial))
                score = (sim.peak_bytes, sim.recompute_ms)
                if sim.peak_bytes < peak and (best is None or score < best[0]):
                    best = (score, trial)
            if best is None:
                break
            (peak, ms), chosen = best
        at = simulate(profile, _regions(profile, chosen)).peak_at
        steps += 1
    # Drop regions the budget does not need (largest first: they cost the most to replay).
    if peak <= budget_bytes:
        for unit in sorted(_units(chosen, shared), key=lambda u: -sum(s.b - s.a for s in u)):
            trial = [c for c in chosen if all(c is not u for u in unit)]
            sim = simulate(profile, _regions(profile, trial))
            if sim.peak_bytes <= budget_bytes and sim.recompute_ms <= ms:
                chosen, peak, ms = trial, sim.peak_bytes, sim.recompute_ms
    return chosen, peak, ms, steps, len(base)


def _units(chosen: list[CallSpan], shared: frozenset[str]) -> list[list[CallSpan]]:
    """`chosen` in the units a schedule can drop: every call of a module called more than once
    together (one wrapper checkpoints them all), any other span alone."""
    units: dict[object, list[CallSpan]] = {}
    for s in chosen:
        key = s.call.module if s.call.module in shared and s.segment is None else id(s)
        units.setdefault(key, []).append(s)
    return list(units.values())


def _near(g, profile: Profile, peak_at: str) -> int:
    """The forward position the peak is about: the replayed node, or the forward node whose
    backward holds the peak (the first forward node for anything else)."""
    name = peak_at.removeprefix("replay:")
    i = g.name_to_i.get(name, -1)
    if i < 0:
        return 0
    if g.phase[i] == "forward":
        return g.fwd_pos[i]
    f = g.grad_of[i]
    return g.fwd_pos.get(f, 0) if f >= 0 else 0


def _span_of(profile: Profile, r: Region) -> tuple[int, int]:
    g = graph_index(profile)
    return g.fwd_pos[g.name_to_i[r.start]], g.fwd_pos[g.name_to_i[r.end]]


def _fits(span: CallSpan, chosen: list[CallSpan]) -> bool:
    """`span` can join `chosen`: nested in, containing, or disjoint from every region, never
    the same nodes as one, and not a module another region already wraps whole (segments of one
    module may all be regions, nested or disjoint, but not beside a region of its whole call)."""
    for c in chosen:
        if c.call.module == span.call.module and (c.segment is None or span.segment is None):
            return False
        if (c.a, c.b) == (span.a, span.b):
            return False
        disjoint = span.b < c.a or span.a > c.b
        nests = (c.a <= span.a and span.b <= c.b) or (span.a <= c.a and c.b <= span.b)
        if not (disjoint or nests):
            return False
    return True


def _pattern(span: CallSpan) -> tuple[str, tuple[int, int] | None]:
    """The module path with integer components starred (``model.layers.*.mlp``): the same call
    in every repeated block."""
    parts = ["*" if x.isdigit() else x for x in span.call.module.split(".")]
    return ".".join(parts), span.segment


MAX_SINGLES = 96
"""Single-call moves tried per step at most (the calls nearest the peak's region first)."""


Move = tuple[list[CallSpan], list[CallSpan]]
"""A step of the descent: the chosen spans it drops, the spans it adds."""


def _moves(chosen: list[CallSpan], spans: list[CallSpan], near: int,
           shared: list[list[CallSpan]] = (), runs: dict[str, list[CallSpan]] | None = None
           ) -> list[Move]:
    """Candidate steps: every call of a starred path that fits (the same child of every
    repeated block at once), every call of a module called more than once (`shared`: regions
    only together), then single calls, those whose span is nearest forward position `near`
    (where the peak's region is) first. A run of a module's stages (or children) cannot sit
    beside a region of the module's whole call; such a run comes as a split (`_split`): the
    whole call's region traded for the longest run of the same module around it."""
    groups: dict[tuple, list[CallSpan]] = defaultdict(list)
    split_groups: dict[tuple, list[Move]] = defaultdict(list)
    singles: list[tuple[CallSpan, Move]] = []
    for s in spans:
        if _fits(s, chosen):
            groups[_pattern(s)].append(s)
            singles.append((s, ([], [s])))
        elif runs is not None:
            split = _split(s, chosen, runs)
            if split is not None:
                split_groups[_pattern(s)].append(split)
                singles.append((s, split))
    moves: list[Move] = [([], g) for g in groups.values() if len(g) > 1 and _compatible(g)]
    moves += [([], grp) for grp in shared if all(_fits(s, chosen) for s in grp)]
    for splits in split_groups.values():
        drop = [d for dr, _ in splits for d in dr]
        add = [a for _, ad in splits for a in ad]
        if len(splits) > 1 and len({id(d) for d in drop}) == len(drop) and _compatible(add):
            moves.append((drop, add))
    singles.sort(key=lambda sm: 0 if sm[0].a <= near <= sm[0].b
                 else min(abs(sm[0].a - near), abs(sm[0].b - near)))
    return moves + [m for _, m in singles[:MAX_SINGLES]]


def _split(s: CallSpan, chosen: list[CallSpan], runs: dict[str, list[CallSpan]]
           ) -> Move | None:
    """Run `s` where only a region of its module's whole call keeps it out: that region traded
    for the longest run of the same module that holds `s` (`s` itself if none is longer), and
    `s` nested in it. A whole call and runs of its forward cannot both be regions (one
    `forward` per module is replaced), and the run around `s` keeps nearly what the whole
    call kept. None where anything else keeps `s` out."""
    if s.segment is None:
        return None
    whole = [c for c in chosen if c.call.module == s.call.module and c.segment is None]
    if len(whole) != 1:
        return None
    rest = [c for c in chosen if c is not whole[0]]
    if not _fits(s, rest):
        return None
    around = next((r for r in runs.get(s.call.module, ()) if r.a <= s.a and s.b <= r.b
                   and r is not s and _fits(r, rest) and _fits(s, rest + [r])), None)
    if around is None:  # runs come longest first, then by start (`_descend`)
        return [whole[0]], [s]
    return [whole[0]], [around, s]


def _compatible(group: list[CallSpan]) -> bool:
    return all(_fits(s, [t for t in group if t is not s]) for s in group)


def _regions(profile: Profile, chosen: list[CallSpan]) -> tuple[Region, ...]:
    return tuple(region(profile, s.a, s.b) for s in sorted(chosen, key=lambda s: (s.a, -s.b)))
