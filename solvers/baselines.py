"""The baselines every solver is compared against; `solvers.solve` lists them by name (`BY_NAME`).

Each builds a schedule from the profile's units (`solvers.chain.units`: the repeated blocks, or
where no block repeats, the segments between candidate cut points) and takes the budget into
account only where its definition does (`chen_greedy`, `every_k`). `solve` simulates every answer
and sets its status against the budget.
"""

from __future__ import annotations

import math
from typing import Any

from solvers.chain import cut_points, live_bytes_across, region, selective_region, units
from solvers.graph import graph_index
from solvers.profile import Profile
from solvers.schedule import Method, Region, Schedule
from solvers.simulate import simulate

__all__ = [
    "BY_NAME",
    "chen_greedy",
    "chen_segments",
    "every_k",
    "none",
    "per_block",
    "selective_matmul",
    "sqrt_n",
]


def _pick(profile: Profile, budget_bytes: int,
          options: list[tuple[tuple[Region, ...], dict[str, Any]]], method: str) -> Schedule:
    """The option that fits with the least recompute time, else the one with the lowest peak."""
    best = None
    for regions, stats in options:
        sim = simulate(profile, regions)
        key = (sim.peak_bytes > budget_bytes, sim.recompute_ms if sim.peak_bytes <= budget_bytes
               else sim.peak_bytes, sim.peak_bytes)
        if best is None or key < best[0]:
            best = (key, regions, stats, sim.peak_bytes)
    assert best is not None
    min_peak = min(simulate(profile, r).peak_bytes for r, _ in options)
    return Schedule(regions=best[1], method=method, stats=best[2], min_peak_bytes=min_peak)


def none(profile: Profile, budget_bytes: int, time_limit_s: float | None = None) -> Schedule:
    """No checkpointing."""
    return Schedule(regions=(), method="none")


def per_block(profile: Profile, budget_bytes: int, time_limit_s: float | None = None) -> Schedule:
    """Every repeated module instance (each transformer layer) is one region."""
    regs = tuple(region(profile, a, b) for a, b in units(profile))
    return Schedule(regions=regs, method="per_block")


def sqrt_n(profile: Profile, budget_bytes: int, time_limit_s: float | None = None) -> Schedule:
    """Chen et al. 2016, section 4.1: about sqrt(N) segments of equal length over the N blocks.

    `torch.utils.checkpoint.checkpoint_sequential` leaves its last segment unchecked (its
    activations are needed first in backward anyway); we checkpoint every segment, as the paper's
    analysis does, so the peak bound O(sqrt(N)) holds for the whole chain.
    """
    us = units(profile)
    n = len(us)
    k = max(1, round(math.sqrt(n)))
    edges = [round(t * n / k) for t in range(k + 1)]
    regs = tuple(
        region(profile, us[edges[t]][0], us[edges[t + 1] - 1][1])
        for t in range(k)
        if edges[t + 1] > edges[t]
    )
    return Schedule(regions=regs, method="sqrt_n", stats={"segments": len(regs), "units": n})


def chen_segments(profile: Profile, threshold: float) -> tuple[list[tuple[int, int]], int, int]:
    """Chen et al. 2016, Algorithm 3 over the chain of candidate cuts: walk forward, accumulate the
    bytes each op saves for backward, and close a segment at the first cut after the running total
    exceeds `threshold`. Returns the segments (forward positions), x = the bytes kept at the chosen
    cuts (segment inputs) and y = the largest segment's saved bytes."""
    g = graph_index(profile)
    live = live_bytes_across(profile)
    cuts = {g.fwd_pos[i] for i in cut_points(profile)}
    fixed = g.fixed_storages
    n = len(g.forward)
    segs: list[tuple[int, int]] = []
    temp = x = y = 0
    start = 0
    for k, i in enumerate(g.forward):
        temp += sum(g.sbytes[s] for s in g.saves[i] if s not in fixed)
        if k == n - 1 or (k in cuts and temp > threshold):
            segs.append((start, k))
            y = max(y, temp)
            if k < n - 1:
                x += live[k]
            temp, start = 0, k + 1
    return segs, x, y


def chen_greedy(profile: Profile, budget_bytes: int, time_limit_s: float | None = None) -> Schedule:
    """Chen et al. 2016, Algorithm 3 with the threshold search of their Appendix A, as their MXNet
    code (`memonger.search_plan`) does it: three runs starting at b = 0, each setting
    b = sqrt(x * y / 2); then 6 thresholds evenly spaced from the smallest y seen to
    sqrt(2) times the last guess. Every segment is a region. Keeps the threshold whose schedule fits
    the budget with the least recompute time, else the one with the lowest peak."""
    options: list[tuple[tuple[Region, ...], dict[str, Any]]] = []
    b = 0.0
    min_y = math.inf

    def add(th: float) -> tuple[int, int]:
        segs, x, y = chen_segments(profile, th)
        regs = tuple(region(profile, a, e) for a, e in segs) if len(segs) > 1 else ()
        options.append((regs, {"threshold_bytes": int(th), "segments": len(segs)}))
        return x, y

    for _ in range(3):
        x, y = add(b)
        min_y = min(min_y, y)
        b = math.sqrt(x * y / 2)
    hi = b * math.sqrt(2)
    step = (hi - min_y) / 6
    if step > 0:
        for t in range(1, 7):
            add(min_y + t * step)
    return _pick(profile, budget_bytes, options, "chen_greedy")


def every_k(profile: Profile, budget_bytes: int, time_limit_s: float | None = None) -> Schedule:
    """Checkpoint every k-th block (torchtitan's ``selective_ac_option="k"``), each one region;
    k = 1 is `per_block`. Tries every k and keeps the fitting one with the least recompute time."""
    us = units(profile)
    options = [
        (tuple(region(profile, a, b) for t, (a, b) in enumerate(us) if t % k == 0), {"k": k})
        for k in range(1, max(2, len(us) + 1))
    ]
    return _pick(profile, budget_bytes, options, "every_k")


def selective_matmul(
    profile: Profile, budget_bytes: int, time_limit_s: float | None = None
) -> Schedule:
    """Per-block regions that keep the outputs of matmul-class ops from forward (torchtitan's
    selective op policy): only the cheap elementwise ops are recomputed."""
    regs = tuple(selective_region(profile, a, b) for a, b in units(profile))
    return Schedule(regions=regs, method="selective_matmul")


BY_NAME: dict[str, Method] = {
    "none": none,
    "per_block": per_block,
    "sqrt_n": sqrt_n,
    "chen_greedy": chen_greedy,
    "every_k": every_k,
    "selective_matmul": selective_matmul,
}
"""The baselines by method name, in the order `solve` lists them."""
