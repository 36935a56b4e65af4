"""Per-rank profiles (`solvers.distributed.per_rank`), torch-free, on a committed profile.

What these check is bookkeeping: which memory is sharded, which events FSDP2 adds, that no region
spans two units. That the events match what FSDP2 and DDP allocate is measured on real ranks
(`tests/planner/test_distributed.py`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from solvers import Profile, ProfileError, ScheduleError, simulate, solve
from solvers.distributed import default_units, per_rank
from solvers.profile import COLLECTIVE_PREFIX
from solvers.solve import smallest_peak

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpt2():
    return Profile.load(ROOT / "profiles" / "gpt2_small_h100.json.gz")


def test_default_units_are_the_transformer_layers(gpt2):
    assert default_units(gpt2) == [f"transformer.h.{i}" for i in range(12)]


def test_ddp_adds_the_gradient_buckets_and_nothing_else(gpt2):
    q = per_rank(gpt2, world_size=8, sharding="ddp")
    assert q.meta.world_size == 8 and q.meta.sharding == "ddp"
    assert q.fixed_bytes == gpt2.fixed_bytes + gpt2.grad_bytes
    for regions in ((), solve(gpt2, 1 << 50, "per_block").regions):
        assert simulate(q, regions).peak_bytes == simulate(gpt2, regions).peak_bytes + \
            gpt2.grad_bytes


@pytest.mark.parametrize("world", [1, 2, 8])
def test_fsdp_shards_parameters_and_gradients(gpt2, world):
    q = per_rank(gpt2, world_size=world, sharding="fsdp")
    assert q.meta.shard_units == default_units(gpt2)
    assert q.param_bytes <= gpt2.param_bytes // world + len(
        [n for n in gpt2.nodes if n.phase == "param"])
    assert q.grad_bytes <= gpt2.grad_bytes // world + 13  # one rounding per unit and the root
    # the last node standing: sharded gradients only (every full gradient was reduce-scattered)
    grads = {q.nodes[q.index(g)].name for g in q.grads}
    assert all(g.startswith("fsdp.sharded_grads(") for g in grads)
    assert len(grads) == 13


def test_fsdp_events_bracket_every_unit(gpt2):
    q = per_rank(gpt2, world_size=4, sharding="fsdp")
    names = [n.name for n in q.nodes]
    for u in q.meta.shard_units:
        call = next(c for c in q.calls if c.module == u)
        a, b = names.index(call.start), names.index(call.end)
        assert names[a - 1] == f"fsdp.all_gather({u})"
        assert names[b + 1] == f"fsdp.reshard_after_forward({u})"
        # in backward: all-gathered (or prefetched) before, reduce-scattered after
        assert names.index(f"fsdp.unshard({u})") < names.index(f"fsdp.reduce_scatter({u})")
    # units run backward in reverse, each prefetching the one before it
    order = [n.name for n in q.nodes if n.op == "fsdp.unshard"]
    assert order == [f"fsdp.unshard({u})" for u in reversed(q.meta.shard_units)]


def test_no_region_spans_two_units(gpt2):
    q = per_rank(gpt2, world_size=8, sharding="fsdp")
    blocked = {c.module for c in q.calls if "FSDP units" in c.blocker}
    assert "transformer" in blocked and "" in blocked
    budget = (simulate(q).peak_bytes + smallest_peak(q)) // 2
    for method in ("auto", "per_block", "dp", "ilp", "nested", "every_k"):
        s = solve(q, budget, method)
        for r in s.regions:
            a, b = q.index(r.start), q.index(r.end)
            assert not any(n.op.startswith(COLLECTIVE_PREFIX) for n in q.nodes[a:b + 1]), \
                (method, r)
    assert solve(q, budget, "auto").feasible
    # segments of several blocks (uniform sqrt(N)) span units: refused, and auto passes them over
    with pytest.raises(ScheduleError, match="inside one fully_shard unit"):
        solve(q, budget, "sqrt_n")
    assert "FSDP" in solve(q, budget, "auto").stats["auto_tried"]["sqrt_n"]


def test_fsdp_peak_falls_with_more_ranks(gpt2):
    peaks = [simulate(per_rank(gpt2, world_size=w, sharding="fsdp")).peak_bytes
             for w in (1, 2, 4, 8)]
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0]
    # one rank of one: everything unsharded, plus the all-gather buffers and copies in flight
    assert peaks[0] > simulate(gpt2).peak_bytes


def test_misuse_is_refused_with_what_to_do(gpt2):
    with pytest.raises(ProfileError, match="positive integer"):
        per_rank(gpt2, world_size=0, sharding="fsdp")
    with pytest.raises(ProfileError, match="expected one of"):
        per_rank(gpt2, world_size=2, sharding="zero3")
    q = per_rank(gpt2, world_size=2, sharding="ddp")
    with pytest.raises(ProfileError, match="single-process profile"):
        per_rank(q, world_size=2, sharding="fsdp")
    with pytest.raises(ProfileError, match="not a module called"):
        per_rank(gpt2, world_size=2, sharding="fsdp", units=["transformer.h.99"])
    with pytest.raises(ProfileError, match="nest"):
        per_rank(gpt2, world_size=2, sharding="fsdp",
                 units=["transformer.h.0", "transformer.h.0.mlp"])
    traced = dataclasses.replace(gpt2, meta=dataclasses.replace(gpt2.meta, capture="graph"))
    with pytest.raises(ProfileError, match="recorded by running"):
        per_rank(traced, world_size=2, sharding="fsdp")


def test_per_rank_profile_round_trips_through_json(gpt2, tmp_path):
    q = per_rank(gpt2, world_size=8, sharding="fsdp")
    back = Profile.load(q.save(tmp_path / "rank.json.gz"))
    assert back.meta == q.meta
    assert simulate(back).peak_bytes == simulate(q).peak_bytes


# -- FSDP2's mixed precision ------------------------------------------------------------------------

MP = {"param_dtype": "bfloat16", "orig_dtype": "float32", "reduce_dtype": "float32"}


def _mixed(p: Profile, **mp: str) -> Profile:
    """`p` (recorded in bfloat16) as recorded for FSDP2's MixedPrecisionPolicy, with Adam."""
    return dataclasses.replace(p, optimizer_state_bytes=2 * p.grad_bytes,
                               meta=dataclasses.replace(p.meta, fsdp_mixed_precision={**MP, **mp}))


def _sizes(q: Profile, op: str) -> list[int]:
    return [q.storage_bytes[s] for n in q.nodes if n.op == op for s in n.new_storages]


@pytest.mark.parametrize("world", [1, 4])
def test_fsdp_mixed_precision_keeps_shards_in_the_parameters_dtype(gpt2, world):
    plain = per_rank(_mixed(gpt2, orig_dtype="bfloat16", reduce_dtype="bfloat16"),
                     world_size=world, sharding="fsdp")
    q = per_rank(_mixed(gpt2), world_size=world, sharding="fsdp")
    # all-gathered parameters and unsharded gradients as recorded, in bfloat16
    assert _sizes(q, "fsdp.all_gather") == _sizes(plain, "fsdp.all_gather")
    assert _sizes(q, "fsdp.unshard") == _sizes(plain, "fsdp.unshard")
    # shards, sharded gradients and Adam's state in float32: twice the bytes (less rounding)
    shard = [q.storage_bytes[n.storage] for n in q.nodes if n.phase == "param"]
    plain_shard = [plain.storage_bytes[n.storage] for n in plain.nodes if n.phase == "param"]
    assert all(0 <= a - 2 * b <= 2 for a, b in zip(shard, plain_shard, strict=True))
    assert 0 <= q.grad_bytes - 2 * plain.grad_bytes <= 2 * 13
    assert 0 <= q.optimizer_state_bytes - 2 * plain.optimizer_state_bytes <= 2
    # the reduce-scatter in float32, from the bfloat16 gradients
    assert _sizes(q, "fsdp.reduce_scatter") == [2 * b for b in _sizes(plain,
                                                                      "fsdp.reduce_scatter")]
    assert not _sizes(q, "fsdp.reduce_output")
    assert simulate(q).peak_bytes > simulate(plain).peak_bytes


def test_fsdp_reduce_in_bfloat16_casts_the_reduced_shard(gpt2):
    q = per_rank(_mixed(gpt2, reduce_dtype="bfloat16"), world_size=4, sharding="fsdp")
    fp32 = per_rank(_mixed(gpt2), world_size=4, sharding="fsdp")
    assert [2 * b for b in _sizes(q, "fsdp.reduce_scatter")] == _sizes(fp32,
                                                                       "fsdp.reduce_scatter")
    reduced, sharded = _sizes(q, "fsdp.reduce_output"), _sizes(q, "fsdp.sharded_grads")
    assert len(reduced) == len(sharded) == 13
    assert all(0 <= s - 2 * r <= 2 for r, s in zip(reduced, sharded, strict=True))
    assert sharded == _sizes(fp32, "fsdp.sharded_grads") and q.grad_bytes == fp32.grad_bytes
    # each reduced shard dies at its cast
    for n in q.nodes:
        if n.op == "fsdp.sharded_grads":
            prev = q.nodes[q.index(n.name) - 1]
            assert prev.op == "fsdp.reduce_output" and n.releases == prev.new_storages


def test_fsdp_mixed_precision_is_checked_and_kept(gpt2, tmp_path):
    with pytest.raises(ProfileError, match="DDP does not cast"):
        per_rank(_mixed(gpt2), world_size=2, sharding="ddp")
    for bad in ({"param_dtype": "bfloat16"}, {**MP, "param_dtype": "int8"}, ["bfloat16"]):
        with pytest.raises(ProfileError, match="fsdp_mixed_precision"):
            dataclasses.replace(gpt2, meta=dataclasses.replace(gpt2.meta,
                                                               fsdp_mixed_precision=bad))
    q = per_rank(_mixed(gpt2), world_size=8, sharding="fsdp")
    back = Profile.load(q.save(tmp_path / "rank.json.gz"))
    assert back.meta.fsdp_mixed_precision == MP
    assert simulate(back).peak_bytes == simulate(q).peak_bytes


def test_fsdp_pads_each_parameter_to_a_multiple_of_the_ranks(gpt2):
    """A parameter of r rows is held as ceil(r / N) rows on each rank (FSDP2's dim-0 padding),
    and gathered and reduce-scattered padded to N of those."""
    wpe = next(n for n in gpt2.nodes if n.name == "transformer.wpe.weight")  # root: 1024 rows
    layer = next(n for n in gpt2.nodes if n.name == "transformer.h.0.ln_1.weight")  # a unit's
    odd = {wpe.name: 1, layer.name: 3}  # as if it had 1 row, and 3 rows
    padded = dataclasses.replace(gpt2, nodes=tuple(
        dataclasses.replace(n, rows=odd[n.name]) if n.name in odd else n for n in gpt2.nodes))
    for world in (2, 4):
        q, plain = (per_rank(x, world_size=world, sharding="fsdp") for x in (padded, gpt2))
        size = {n.name: q.storage_bytes[n.storage] for n in q.nodes if n.phase == "param"}
        was = {n.name: plain.storage_bytes[n.storage] for n in plain.nodes if n.phase == "param"}
        full_wpe, full_ln = gpt2.storage_bytes[wpe.storage], gpt2.storage_bytes[layer.storage]
        assert size[wpe.name] == full_wpe  # one row: whole on every rank
        rows_each = -(-3 // world)  # 3 rows: 2 on each of 2 ranks, 1 on each of 4
        assert size[layer.name] == rows_each * (full_ln // 3)
        assert was[wpe.name] == full_wpe // world and was[layer.name] == -(-full_ln // world)
        gathered = _sizes(q, "fsdp.all_gather")
        assert gathered[0] - _sizes(plain, "fsdp.all_gather")[0] == (world - 1) * full_wpe
        # the unit's all-gather (buffer and parameters) carries the padded rows too
        extra = (rows_each * world - 3) * (full_ln // 3)
        assert gathered[2] - _sizes(plain, "fsdp.all_gather")[2] == extra


def test_gloo_collectives_work_through_temporaries(gpt2):
    """gloo (CPU) flattens an all-gather's output into a temporary and copies it out, and
    reduce-scatters by reducing a copy of the whole input: each all-gather holds its buffer's
    size once more while it runs, each reduce-scatter its input's (measured on 2 gloo ranks,
    `tests/planner/test_distributed.py`); NCCL works in the buffers themselves."""
    nccl = per_rank(gpt2, world_size=4, sharding="fsdp")
    gloo = per_rank(gpt2, world_size=4, sharding="fsdp", gloo=True)
    scatters = 0
    for k, (a, b) in enumerate(zip(nccl.nodes, gloo.nodes, strict=True)):
        if a.op in ("fsdp.all_gather", "fsdp.prefetch"):
            assert a.workspace_bytes == 0 and b.workspace_bytes == gloo.storage_bytes[b.storage]
        elif a.op == "fsdp.sharded_grads":  # the reduce-scatter's output, its input just before
            rs = gloo.nodes[k - 1]
            assert rs.op == "fsdp.reduce_scatter" and a.workspace_bytes == 0
            assert b.workspace_bytes == gloo.storage_bytes[rs.storage] > 0
            scatters += 1
        else:
            assert b.workspace_bytes == a.workspace_bytes, a.name
    assert scatters == len(default_units(gpt2)) + 1  # each unit's and the root's gradients
    assert simulate(gloo).peak_bytes >= simulate(nccl).peak_bytes
    one = per_rank(gpt2, world_size=1, sharding="fsdp", gloo=True)  # nothing to gather
    assert all(n.workspace_bytes == 0 for n in one.nodes if n.op.startswith(COLLECTIVE_PREFIX))


def test_cast_parameters_are_gathered_from_a_flat_copy_of_the_shards(gpt2):
    """Where FSDP2 casts parameters (param_dtype differs from theirs), each all-gather's input is
    the rank's shards copied into one flat tensor of param_dtype, alive while the collective
    runs: 1/N of what it gathers, beside gloo's temporary where there is one."""
    world = 4
    cast = per_rank(_mixed(gpt2), world_size=world, sharding="fsdp")
    same = per_rank(_mixed(gpt2, orig_dtype="bfloat16", reduce_dtype="bfloat16"), world_size=world,
                    sharding="fsdp")
    both = per_rank(_mixed(gpt2), world_size=world, sharding="fsdp", gloo=True)
    gathers = 0
    for a, b, c in zip(cast.nodes, same.nodes, both.nodes, strict=True):
        gathering = a.op in ("fsdp.all_gather", "fsdp.prefetch") or (
            a.op == "fsdp.unshard" and len(a.new_storages) == 2)
        if not gathering:
            assert a.workspace_bytes == b.workspace_bytes == 0, a.name
            continue
        gathers += 1
        gathered = cast.storage_bytes[a.storage]
        assert a.workspace_bytes == -(-gathered // world), a.name
        assert b.workspace_bytes == 0, a.name  # parameters already in param_dtype: no copy
        assert c.workspace_bytes == a.workspace_bytes + gathered, a.name
    units = len(default_units(gpt2))
    assert gathers == 1 + 2 * units  # the root's; each unit's in forward and in backward
