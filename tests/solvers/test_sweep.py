"""The simulator's two sweeps agree: the vectorized one every solver calls, and the op-by-op one
that also records the timeline (`simulate(..., timeline=True)`), on nested, selective and random
schedules of hand-built and committed profiles."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from solvers import Profile, solve
from solvers.chain import region, selective_region, useful_calls
from solvers.distributed import per_rank
from solvers.graph import graph_index
from solvers.simulate import simulate

ROOT = Path(__file__).resolve().parents[2]


def _schedules(p: Profile, rng: random.Random) -> list[tuple]:
    out = [(), solve(p, 1 << 60, "per_block").regions, solve(p, 0, "nested").regions]
    g = graph_index(p)
    spans = [(s.a, s.b) for s in useful_calls(p)] if p.meta.capture == "run" else [
        (a, b) for a in range(len(g.forward)) for b in range(a, min(a + 4, len(g.forward)))]
    for _ in range(8):
        pick = sorted(rng.sample(spans, min(len(spans), rng.randint(1, 6))),
                      key=lambda t: (t[0], -t[1]))
        regs, end = [], -1
        for a, b in pick:
            if a > end:
                make = selective_region if rng.random() < 0.3 else region
                regs.append(make(p, a, b))
                end = b
        out.append(tuple(regs))
    return out


def _check(p: Profile, seed: int) -> None:
    for regs in _schedules(p, random.Random(seed)):
        fast = simulate(p, regs)
        slow = simulate(p, regs, timeline=True)
        assert (fast.peak_bytes, fast.peak_at, fast.after_forward_bytes) == \
            (slow.peak_bytes, slow.peak_at, slow.after_forward_bytes), regs
        assert fast.recompute_ms == pytest.approx(slow.recompute_ms, rel=1e-12)


def test_sweeps_agree_on_hand_built_profiles(solver_cases):
    for k, p in enumerate(solver_cases.values()):
        _check(p, k)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2_small_h100", "unet_h100"])
def test_sweeps_agree_on_committed_profiles(name):
    p = Profile.load(ROOT / "profiles" / f"{name}.json.gz")
    _check(p, 0)
    if name.startswith("gpt2"):
        _check(per_rank(p, world_size=4, sharding="fsdp"), 1)
