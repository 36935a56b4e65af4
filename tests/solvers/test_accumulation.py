"""`solvers.accumulation.holding_grads`, torch-free, on a committed profile.

Bookkeeping only: the gradients move into fixed memory and what backward makes for them stops
persisting. That the transformed step is the one a micro-batch after the first runs is measured
in `tests/planner/test_accumulation.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from solvers import Profile, ProfileError, simulate, solve
from solvers.accumulation import holding_grads
from solvers.solve import smallest_peak

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpt2():
    return Profile.load(ROOT / "profiles" / "gpt2_small_h100.json.gz")


def test_the_gradients_become_fixed_memory(gpt2):
    held = holding_grads(gpt2)
    assert gpt2.grad_bytes > 0 and gpt2.grads
    assert held.fixed_bytes == gpt2.fixed_bytes + gpt2.grad_bytes
    assert held.grads == () and held.meta.grads_held and not gpt2.meta.grads_held
    first, later = simulate(gpt2).peak_bytes, simulate(held).peak_bytes
    # GPT-2's peak is early in backward, before most gradients exist: nearly all of them add
    assert first < later <= first + gpt2.grad_bytes
    assert later - first > 0.9 * gpt2.grad_bytes


def test_every_solver_plans_the_step_with_gradients_held(gpt2):
    held = holding_grads(gpt2)
    budget = (smallest_peak(held) + simulate(held).peak_bytes) // 2
    for method in ("dp", "per_block"):
        s = solve(held, budget, method=method)
        if method == "dp":
            assert s.feasible
        if s.feasible:
            assert simulate(held, s.regions).peak_bytes <= budget
    # a schedule that fits the first micro-batch at that budget does not fit the later ones
    first = solve(gpt2, budget, method="dp")
    assert first.feasible and simulate(held, first.regions).peak_bytes > budget


def test_refused_twice_and_under_fsdp_composed_with_ddp(gpt2, tmp_path):
    from solvers.distributed import per_rank

    held = holding_grads(gpt2)
    with pytest.raises(ProfileError, match="already"):
        holding_grads(held)
    with pytest.raises(ProfileError, match="per_rank first"):
        per_rank(held, world_size=2, sharding="fsdp")
    # DDP: the held gradients beside its buckets, whichever transform comes first
    a = per_rank(held, world_size=2, sharding="ddp")
    b = holding_grads(per_rank(gpt2, world_size=2, sharding="ddp"))
    assert a.fixed_bytes == b.fixed_bytes == held.fixed_bytes + gpt2.grad_bytes
    assert simulate(a).peak_bytes == simulate(b).peak_bytes == simulate(held).peak_bytes \
        + gpt2.grad_bytes
    again = Profile.load(held.save(tmp_path / "held.json.gz"))
    assert again.meta.grads_held and simulate(again).peak_bytes == simulate(held).peak_bytes


def test_under_fsdp_each_rank_holds_its_sharded_gradients(gpt2):
    """FSDP2 (gradient sync on): a later micro-batch holds the sharded gradients from its start,
    and each unit's new sharded gradient dies once added into them."""
    from solvers.distributed import per_rank

    q = per_rank(gpt2, world_size=4, sharding="fsdp")
    held = holding_grads(q)
    assert held.meta.grads_held and held.grads == () and held.grad_bytes == q.grad_bytes
    assert held.fixed_bytes == q.fixed_bytes + q.grad_bytes
    names = [n.name for n in held.nodes]
    for g in q.grads:  # every new shard is released by the node after it
        n = held.nodes[names.index(g)]
        after = held.nodes[names.index(g) + 1]
        assert after.op == "fsdp.accumulate" and after.releases == n.new_storages
    first, later = simulate(q).peak_bytes, simulate(held).peak_bytes
    assert first < later <= first + q.grad_bytes
    # a quarter of the unsharded gradients: what a rank holds beside the step
    assert q.grad_bytes <= gpt2.grad_bytes // 4 + 13
