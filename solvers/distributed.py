"""Per-rank profiles under data parallelism: what one rank of DDP or FSDP2 holds during a step.

A profile records one process's training step. Under data parallelism every rank runs that step
on its own micro-batch, and what a rank holds beside the step's activations depends on the engine
(torch 2.13's `DistributedDataParallel` and FSDP2's `fully_shard`, each rule checked against
memory measured on 2 gloo ranks in `tests/planner/test_distributed.py`):

- **DDP** keeps full parameters, gradients and optimizer state on every rank, plus its gradient
  buckets: a flat copy of the trainable parameters' gradients (``gradient_as_bucket_view=False``,
  the default), allocated when DDP wraps the model and held for good.
- **FSDP2** (`fully_shard` on each unit, then on the root) keeps 1/N of every parameter, gradient
  and optimizer state. Before a unit's forward it all-gathers the unit's parameters: an all-gather
  buffer, and the unsharded parameters copied out of it. The buffer lives until the next
  all-gather; the unsharded parameters until the unit's forward ends (``reshard_after_forward``;
  the root's stay until the end of backward). In backward, a unit's pre-backward hook all-gathers
  it again (or takes the buffer prefetched for it) and prefetches the unit that runs backward next;
  when the unit's backward is done its unsharded parameters are freed and its full gradients
  reduce-scattered into gradients of 1/N, the reduce-scatter input living until the next unit's.
  Under a `MixedPrecisionPolicy` (recorded in `ProfileMeta.fsdp_mixed_precision`: the step ran
  with parameters and inputs cast to ``param_dtype``) the all-gathered parameters and unsharded
  gradients are in ``param_dtype``, as recorded; the shards, sharded gradients and optimizer
  state in the parameters' own ``orig_dtype``; the reduce-scatter input and output in
  ``reduce_dtype`` (its output cast to ``orig_dtype`` where they differ). Where ``param_dtype``
  differs from ``orig_dtype`` each all-gather's input is the rank's shards cast into one flat
  tensor, alive while the collective runs, beside the all-gather buffer.
  FSDP2 shards each parameter along its first dimension, padded to a multiple of N rows
  (`Node.rows`): a parameter of one row (a ViT's class token) is held whole on every rank, and the
  all-gathered and reduce-scattered buffers carry the padding too. On gloo (CPU) each
  all-gather also holds a temporary of its output's size while it runs, and each reduce-scatter
  a copy of its input (``gloo=True``).

`per_rank` writes these events into the profile as nodes (ops named ``fsdp.*``, taking no time,
belonging to no module), so that the simulator and every solver price them like any other
allocation. A checkpointed region must lie inside one FSDP unit: a module call that spans a unit
boundary gets a blocker (a replay would re-run FSDP's hooks of the units inside it).
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from solvers.accumulation import refuse_fsdp
from solvers.chain import blocks
from solvers.errors import ProfileError
from solvers.profile import (
    COLLECTIVE_PREFIX,
    DTYPE_BYTES,
    FIXED_PHASES,
    ModuleCall,
    Node,
    Profile,
)

__all__ = ["SHARDINGS", "default_units", "per_rank"]

SHARDINGS = ("ddp", "fsdp")


def default_units(profile: Profile) -> list[str]:
    """The modules FSDP2 is usually applied to (torchtitan, HF accelerate): each repeated block
    (transformer layer) that runs once in the step."""
    once = {c.module for c in profile.calls} - {
        c.module for i, c in enumerate(profile.calls)
        if any(d.module == c.module for d in profile.calls[:i])
    }
    return [b.name for b in blocks(profile) if b.name in once]


def per_rank(profile: Profile, *, world_size: int, sharding: str,
             units: list[str] | None = None, gloo: bool = False) -> Profile:
    """The profile of one rank of `world_size` under `sharding` (``ddp`` or ``fsdp``), from the
    profile of one process's step on one rank's micro-batch. With ``fsdp``, `units` are the
    modules `fully_shard` is applied to before the root (default: `default_units`). `gloo`: the
    ranks communicate over gloo (CPU), whose all-gather copies its output through a temporary
    of the same size (flattened, then copied out) and whose reduce-scatter reduces a copy of its
    input, each counted as the collective's workspace; NCCL works in the buffers themselves."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ProfileError(f"world_size is {world_size!r}, expected a positive integer")
    if sharding not in SHARDINGS:
        raise ProfileError(f"sharding is {sharding!r}, expected one of {SHARDINGS}")
    if profile.meta.sharding:
        raise ProfileError(
            f"this profile already describes one rank of {profile.meta.world_size} under "
            f"{profile.meta.sharding}; start from the single-process profile"
        )
    if sharding == "ddp":
        if profile.meta.fsdp_mixed_precision:
            raise ProfileError(
                "this profile was recorded for FSDP2's mixed precision (parameters cast to "
                f"{profile.meta.fsdp_mixed_precision['param_dtype']}); DDP does not cast them: "
                "profile again without mp_policy (or with torch.autocast, as DDP trains)")
        return _ddp(profile, world_size)
    refuse_fsdp(profile)
    if profile.meta.capture != "run":
        raise ProfileError(
            "an FSDP per-rank profile needs the module calls of a profile recorded by running the "
            "step (planner.profile); this one was traced (capture 'graph')"
        )
    return _fsdp(profile, world_size, default_units(profile) if units is None else list(units),
                 gloo)


def _ddp(p: Profile, world: int) -> Profile:
    """DDP: the step as one process runs it, plus the gradient buckets as fixed memory."""
    sid = len(p.storage_bytes)
    first = next((i for i, n in enumerate(p.nodes) if n.phase not in FIXED_PHASES), len(p.nodes))
    buckets = Node(name="ddp.gradient_buckets", op="placeholder", phase="buffer",
                   storage=sid, new_storages=(sid,))
    return dataclasses.replace(
        p, nodes=(*p.nodes[:first], buckets, *p.nodes[first:]),
        storage_bytes=(*p.storage_bytes, p.grad_bytes),
        meta=dataclasses.replace(p.meta, world_size=world, sharding="ddp", shard_units=[]),
    )


def _shard(nbytes: int, world: int) -> int:
    return math.ceil(nbytes / world)


def _padded(nbytes: int, rows: int, world: int) -> int:
    """Bytes of a tensor of `rows` rows padded, as FSDP2 pads it, to a multiple of `world` rows
    (`torch.chunk` along dim 0: each rank's shard is ceil(rows / world) rows); as is where the
    rows are unknown."""
    if rows <= 0 or nbytes % rows:
        return nbytes
    return math.ceil(rows / world) * world * (nbytes // rows)


def _check_units(p: Profile, units: list[str]) -> list[tuple[int, int, str]]:
    """(first node, last node, unit) of each unit's one call, in forward order."""
    calls: dict[str, list[ModuleCall]] = {}
    for c in p.calls:
        calls.setdefault(c.module, []).append(c)
    spans = []
    for u in units:
        if not isinstance(u, str) or not u:
            raise ProfileError(f"FSDP unit {u!r} is not a module name (the root is always a unit)")
        found = calls.get(u, [])
        if not found:
            known = [b.name for b in blocks(p)][:3]
            raise ProfileError(
                f"FSDP unit {u!r} is not a module called in this step"
                + (f" (e.g. {', '.join(known)})" if known else "")
            )
        if len(found) > 1:
            raise ProfileError(f"FSDP unit {u!r} is called {len(found)} times in the step; "
                               "fully_shard units are modelled as called once")
        for v in units:
            if v != u and u.startswith(v + "."):
                raise ProfileError(f"FSDP units {v!r} and {u!r} nest; give units that do not")
        spans.append((p.index(found[0].start), p.index(found[0].end), u))
    spans.sort()
    for (_, b0, u0), (a1, _, u1) in zip(spans, spans[1:], strict=False):
        if a1 <= b0:
            raise ProfileError(f"FSDP units {u0!r} and {u1!r} run interleaved; give units whose "
                               "forwards run one after the other")
    return spans


def _fsdp(p: Profile, world: int, units: list[str], gloo: bool = False) -> Profile:
    spans = _check_units(p, units)
    order = [u for _, _, u in spans]
    # Mixed precision: the step ran in param_dtype (q bytes an element); shards, sharded
    # gradients and optimizer state are in orig_dtype (o), the reduce-scatter in reduce_dtype (r).
    mp = p.meta.fsdp_mixed_precision
    q, o, r = (DTYPE_BYTES[mp[k]] for k in ("param_dtype", "orig_dtype", "reduce_dtype")) \
        if mp else (1, 1, 1)
    # Parameters cast for the step: each all-gather first copies the rank's shards into one
    # flat tensor in param_dtype, its input, which lives until the collective has run.
    casts = bool(mp) and mp["param_dtype"] != mp["orig_dtype"]
    starts = [a for a, _, _ in spans]
    nodes = p.nodes
    sizes = list(p.storage_bytes)

    def unit_of_node(i: int) -> str:
        """The unit whose forward span holds node index i ("" for the root)."""
        k = bisect.bisect_right(starts, i) - 1
        return spans[k][2] if k >= 0 and i <= spans[k][1] else ""

    # Parameters: every one is sharded; a unit all-gathers the parameters below its path.
    unit_set = set(order)
    param_bytes: dict[str, int] = dict.fromkeys(["", *order], 0)
    counted: set[int] = set()
    for n in nodes:
        if n.phase != "param" or n.storage is None or n.storage in counted:
            continue
        counted.add(n.storage)
        parts = n.name.split(".")
        owner = next((".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)
                      if ".".join(parts[:k]) in unit_set), "")
        param_bytes[owner] += _padded(sizes[n.storage], n.rows, world)
        sizes[n.storage] = _shard(_padded(sizes[n.storage] * o // q, n.rows, world), world)

    # Gradients: a parameter's gradient belongs to the unit whose op it is the gradient of.
    # FSDP2 reduce-scatters them padded as their parameters are.
    grad_storages: dict[str, list[int]] = {u: [] for u in param_bytes}
    grad_rows: dict[int, int] = {}
    for name in p.grads:
        n = nodes[p.index(name)]
        owner = unit_of_node(p.index(n.grad_of)) if n.grad_of is not None else ""
        grad_storages[owner] += [n.storage] if n.storage is not None else list(n.new_storages)
        if n.storage is not None:
            grad_rows[n.storage] = n.rows
    grad_bytes = {u: sum(_padded(sizes[s], grad_rows.get(s, 0), world) for s in set(ss))
                  for u, ss in grad_storages.items()}

    # Backward nodes of each unit: the ops its autograd nodes ran.
    bw_first: dict[str, int] = {}
    bw_last: dict[str, int] = {}
    first_fwd_bw = None
    for i, n in enumerate(nodes):
        if n.phase != "backward" or n.grad_of is None:
            continue
        f = p.index(n.grad_of)
        if nodes[f].phase == "forward" and first_fwd_bw is None:
            first_fwd_bw = i
        u = unit_of_node(f) if nodes[f].phase == "forward" else ""
        if u:
            bw_first.setdefault(u, i)
            bw_last[u] = i

    out: list[Node] = []
    new_grads: list[str] = []  # the sharded gradients replace every gradient

    def storage(nbytes: int) -> int:
        sizes.append(nbytes)
        return len(sizes) - 1

    def emit(name: str, phase: str, alloc: tuple[int, ...] = (), release: tuple[int, ...] = (),
             gathers: int | None = None, scatters: int | None = None) -> None:
        """A collective's node; `gathers`: the all-gather buffer it fills, `scatters`: the
        reduce-scatter input it reads (each with gloo's temporary of its size)."""
        label = name.split("(")[0]
        temp = 0
        if gathers is not None:
            temp += sizes[gathers] if gloo and world > 1 else 0
            temp += _shard(sizes[gathers], world) if casts else 0
        if scatters is not None:
            temp += sizes[scatters] if gloo and world > 1 else 0
        out.append(Node(name=name, op=label, phase=phase, new_storages=alloc,
                        storage=alloc[0] if alloc else None, releases=release,
                        workspace_bytes=temp))

    unit_end = {b: u for _, b, u in spans}
    unit_start = {a: u for a, _, u in spans}
    last_fwd = max(i for i, n in enumerate(nodes) if n.phase == "forward")
    first_fwd = min(i for i, n in enumerate(nodes) if n.phase == "forward")
    held_buf: int | None = None  # forward: the latest all-gather buffer
    pending: dict[str, int] = {}  # backward: prefetched all-gather buffers
    unsharded: dict[str, int] = {}  # unsharded parameters of a unit in backward
    rs_held: int | None = None  # the latest reduce-scatter input
    root_params = storage(param_bytes[""])
    has_bw = [u for u in order if u in bw_first]
    bw_done_at = {j: u for u, j in bw_last.items()}
    grads_released = {s for u, ss in grad_storages.items() if grad_bytes[u] for s in ss}

    def post_backward(u: str, tag: str) -> None:
        nonlocal rs_held
        rel = ([unsharded.pop(u)] if u in unsharded else []) + ([rs_held] if rs_held is not None
                                                                 else [])
        if u == "":
            rel.append(root_params)
        emit(f"fsdp.reshard({tag})", "backward", release=tuple(rel))
        rs_held = None
        if grad_bytes[u]:
            rs_in = storage(grad_bytes[u] * r // q)
            emit(f"fsdp.reduce_scatter({tag})", "backward", alloc=(rs_in,),
                 release=tuple(sorted(set(grad_storages[u]))))
            if r != o:  # the reduced shard, in reduce_dtype, is cast to orig_dtype
                reduced = storage(_shard(grad_bytes[u] * r // q, world))
                emit(f"fsdp.reduce_output({tag})", "backward", alloc=(reduced,), scatters=rs_in)
                emit(f"fsdp.sharded_grads({tag})", "backward",
                     alloc=(storage(_shard(grad_bytes[u] * o // q, world)),), release=(reduced,))
            else:
                emit(f"fsdp.sharded_grads({tag})", "backward",
                     alloc=(storage(_shard(grad_bytes[u] * o // q, world)),), scatters=rs_in)
            new_grads.append(out[-1].name)
            rs_held = rs_in

    for i, n in enumerate(nodes):
        if i == first_fwd:
            buf = storage(param_bytes[""])
            emit("fsdp.all_gather(root)", "forward", alloc=(buf, root_params), gathers=buf)
            held_buf = buf
        if i in unit_start:
            u = unit_start[i]
            buf, params = storage(param_bytes[u]), storage(param_bytes[u])
            emit(f"fsdp.all_gather({u})", "forward", alloc=(buf, params),
                 release=(held_buf,) if held_buf is not None else (), gathers=buf)
            held_buf = buf
            unsharded[u] = params
        if i == first_fwd_bw and has_bw:
            v = has_bw[-1]
            pending[v] = storage(param_bytes[v])
            emit(f"fsdp.prefetch({v})", "backward", alloc=(pending[v],), gathers=pending[v])
        if n.phase == "backward" and n.grad_of is not None:
            u = unit_of_node(p.index(n.grad_of)) if nodes[p.index(n.grad_of)].phase == \
                "forward" else ""
            if u and bw_first.get(u) == i:
                params = storage(param_bytes[u])
                buf = pending.pop(u, None)
                alloc = (params,) if buf is not None else (params, storage(param_bytes[u]))
                emit(f"fsdp.unshard({u})", "backward", alloc=alloc,
                     release=(buf if buf is not None else alloc[1],),
                     gathers=None if buf is not None else alloc[1])
                unsharded[u] = params
                k = has_bw.index(u)
                if k > 0 and has_bw[k - 1] not in pending:
                    v = has_bw[k - 1]
                    pending[v] = storage(param_bytes[v])
                    emit(f"fsdp.prefetch({v})", "backward", alloc=(pending[v],),
                         gathers=pending[v])
        if not grads_released.isdisjoint(n.releases):  # now released by their reduce-scatter
            n = dataclasses.replace(n, releases=tuple(s for s in n.releases
                                                      if s not in grads_released))
        out.append(n)
        if i in unit_end:
            u = unit_end[i]
            emit(f"fsdp.reshard_after_forward({u})", "forward", release=(unsharded.pop(u),))
        if i == last_fwd and held_buf is not None:
            emit("fsdp.root_post_forward", "forward", release=(held_buf,))
            held_buf = None
        if i in bw_done_at:
            post_backward(bw_done_at[i], bw_done_at[i])
    post_backward("", "root")
    if rs_held is not None:
        emit("fsdp.reduce_scatter_done(root)", "backward", release=(rs_held,))

    calls = []
    pos = {n.name: k for k, n in enumerate(out)}
    collective = [k for k, n in enumerate(out) if n.op.startswith(COLLECTIVE_PREFIX)]
    unit_pos = {u: pos[nodes[a].name] for a, _, u in spans}
    for c in p.calls:
        a, b = pos[c.start], pos[c.end]
        lo = bisect.bisect_right(collective, a)
        if c.blocker or lo >= len(collective) or collective[lo] >= b:
            calls.append(c)
            continue
        inside = [u for u in order if a <= unit_pos[u] <= b]
        what = ", ".join(inside[:3]) + (" ..." if len(inside) > 3 else "")
        calls.append(dataclasses.replace(c, blocker=(
            f"spans FSDP units ({what}): a region must lie inside one fully_shard unit"
            if inside else "spans an FSDP all-gather: a region must lie inside one unit")))
    trainable = sum(grad_bytes.values())
    return Profile(
        nodes=tuple(out),
        storage_bytes=tuple(sizes),
        model_outputs=p.model_outputs,
        loss=p.loss,
        grads=tuple(new_grads),
        grad_bytes=sum(_shard(b * o // q, world) for b in grad_bytes.values() if b),
        optimizer_state_bytes=_shard(p.optimizer_state_bytes * o // q, world) if trainable
        else 0,
        optimizer_step_bytes=_shard(p.optimizer_step_bytes * o // q, world),
        calls=tuple(calls),
        meta=dataclasses.replace(p.meta, world_size=world, sharding="fsdp", shard_units=order),
    )

