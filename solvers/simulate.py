"""Replay a Schedule over a Profile: the peak memory and recompute time of one training step.

This is the single source of truth every solver's answer is checked against. It follows what
non-reentrant `torch.utils.checkpoint` does at run time (torch 2.13; each rule checked against
memory measured with `torch.profiler` events, `tests/planner/test_inplace.py`):

- Forward runs node by node; a node's new storages are allocated when it runs. A storage is freed
  after the later of: its last reader; the node after which the model's own code dropped its last
  reference (`Node.releases`, recorded by running the step: a local variable holds a tensor until
  the function returns); the end of the backward of every autograd node that saved it (its last
  op, as backward formulas free their temporaries when they return); the end of the step for the
  loss and parameter gradients.
- A checkpointed region keeps its arguments (the checkpoint frame holds them) until the last of
  its autograd nodes has run backward: the tensors its ops read from outside, and whatever the
  call's arguments reach (`ModuleCall.holds`). Tensors its ops would save are not kept, except
  the outputs of nodes marked saved (selective checkpointing), which are cached from forward.
- In backward, the first op of the region's backward that unpacks a saved tensor replays the region
  from its start up to its early stop (`solvers.chain.early_stops`: its last op that saves
  anything, or the op before it when that op saves only its inputs). Every op before the stop is
  replayed except the saved ones, even ops that only feed saved ones.
- Replayed tensors the region's autograd nodes need live until those nodes have run; the others
  die after their last replayed reader, or where the module's code drops them, or when the early
  stop unwinds the replay. A cached (saved) output is consumed by the replay and dies after its
  last replayed reader unless a backward op needs it; one after the early stop is never consumed
  and lives in the frame's cache until the region's backward is done.
- With an optimizer, the step ends with its update: parameters, gradients, optimizer state and the
  optimizer's transient memory.

Memory is the sum of live storages' bytes, fixed memory (parameters, buffers, inputs, optimizer
state) included, as `torch.cuda.max_memory_allocated` reports it. Op-internal workspace is
counted where the profile measured it (CPU measure mode).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from solvers.chain import early_stops
from solvers.errors import ScheduleError
from solvers.graph import graph_index
from solvers.profile import FIXED_PHASES, Profile, cached
from solvers.schedule import Region, Schedule

__all__ = ["MEMO_SIZE", "Simulation", "simulate"]

MEMO_SIZE = 4096
"""Simulations kept per profile (`simulate` is pure: solvers re-check the same schedules across
methods and budgets); the memo is emptied when it reaches this size."""


@dataclass(frozen=True)
class Simulation:
    """What one training step under a schedule costs, as `simulate` predicts it."""

    peak_bytes: int
    """Peak memory of the step, fixed memory included."""
    recompute_ms: float
    """Extra time of the step: ops replayed, plus checkpoint's per-region and per-saved-tensor host
    cost when the profile carries a calibration."""
    peak_at: str
    """Label of the step where the peak occurs (a node name, or replay:<node>)."""
    timeline: list[tuple[str, int]] = field(repr=False, default_factory=list)
    """(label, bytes live after allocation) for every executed op, when asked for."""
    after_forward_bytes: int = 0
    """Bytes live when forward and loss are done (fixed memory excluded)."""


@dataclass
class _Reg:
    nodes: list[int]
    saved: set[int]
    early_stop: int
    trigger: int
    bw_end: int
    produced: set[int]
    holds: tuple[int, ...] = ()


def _resolve(p: Profile, regions: tuple[Region, ...]) -> list[_Reg]:
    """Check a schedule's regions against the profile and turn them into node-index sets."""
    g = graph_index(p)
    stop = early_stops(p)
    out: list[_Reg] = []
    last_end = -1
    for k, r in enumerate(regions):
        try:
            a, b = g.name_to_i[r.start], g.name_to_i[r.end]
        except KeyError as e:
            raise ScheduleError(
                f"region {k} names node {e.args[0]!r}, which is not in this profile; was the "
                "schedule made for another model or input shape?"
            ) from None
        if g.phase[a] != "forward" or g.phase[b] != "forward":
            raise ScheduleError(f"region {k} ({r.start}..{r.end}) must start and end on forward nodes")
        if a > b:
            raise ScheduleError(f"region {k} starts after it ends ({r.start} > {r.end})")
        if a <= last_end:
            raise ScheduleError(f"region {k} ({r.start}..{r.end}) overlaps the region before it")
        last_end = b
        nodes = [i for i in range(a, b + 1) if g.phase[i] == "forward"]
        saved = set()
        for name in r.saved:
            j = g.name_to_i.get(name)
            if j is None or not a <= j <= b:
                raise ScheduleError(f"region {k}: saved node {name!r} is not inside the region")
            saved.add(j)
        savers = [i for i in nodes if g.saves[i]]
        # The replay runs the region's ops up to the early stop (`solvers.chain.early_stops`); a
        # stop before the region's first node replays nothing.
        e = stop[g.fwd_pos[b]] if savers else -1
        early = g.forward[e] if e >= 0 else -1
        trigger = min((g.bw_first_read[i] for i in savers if i in g.bw_first_read), default=-1)
        bw_end = max((g.bw_end[i] for i in savers if i in g.bw_end), default=-1)
        produced = {s for i in nodes for s in g.new[i]}
        holds = g.call_holds.get((r.start, r.end), ()) if r.module is not None else ()
        out.append(_Reg(nodes, saved, early, trigger, bw_end, produced, holds))
    return out


def simulate(p: Profile, schedule: Schedule | tuple[Region, ...] = (), *,
             timeline: bool = False) -> Simulation:
    """Peak bytes and recompute time of one training step of `p` under `schedule` (a Schedule or
    its regions); with `timeline`, also the bytes live after every op.

    Raises `ScheduleError` when a region does not fit the profile (unknown node, not a forward
    node, overlapping the region before it, a saved node outside it).
    """
    regions = schedule.regions if isinstance(schedule, Schedule) else tuple(schedule)
    if timeline:
        return _simulate(p, regions, timeline=True)
    memo: dict[tuple[Region, ...], Simulation] = cached(p, "simulations", lambda _: {})
    try:
        sim = memo.get(regions)
    except TypeError:  # a region built with lists instead of tuples: not hashable
        return _simulate(p, regions, timeline=False)
    if sim is None:
        sim = _simulate(p, regions, timeline=False)
        if len(memo) >= MEMO_SIZE:
            memo.clear()
        memo[regions] = sim
    return sim


def _simulate(p: Profile, regions: tuple[Region, ...], *, timeline: bool) -> Simulation:
    g = graph_index(p)
    regs = [r for r in _resolve(p, regions) if r.trigger >= 0]  # others never replay
    region_of = {i: k for k, r in enumerate(regs) for i in r.nodes}

    # 1. Original instances: the node index after which each storage is freed.
    last: dict[int, int] = {}
    for i in range(g.n):
        gf = g.grad_of[i]
        k = region_of.get(gf) if gf >= 0 else None
        for s in g.reads[i]:
            if k is not None and s in regs[k].produced:
                continue  # this backward op reads the replay's copy
            last[s] = i
    for s, i in g.release.items():  # held by the model's code beyond its last reader
        if s not in g.fixed_storages and i > last.get(s, -1):
            last[s] = i
    for s in g.persist:
        last[s] = g.end
    # A backward formula runs in C++: temporaries it creates live until the formula returns, so
    # storages made by one autograd node's backward die no earlier than its last op.
    for i in range(g.fwd_end + 1, g.n):
        gf = g.grad_of[i]
        if gf >= 0:
            for s in g.new[i]:
                if s in last and g.bw_end[gf] > last[s]:
                    last[s] = g.bw_end[gf]
    for f in range(g.n):
        if f in region_of or f not in g.bw_end:
            continue
        for s in g.saves[f]:  # saved by an op outside any region: kept until its backward ran
            if s not in g.fixed_storages and g.bw_end[f] > last.get(s, -1):
                last[s] = g.bw_end[f]

    # 2. Regions: inputs held by the frame; selective saves held until the replay; replay copies.
    replay_at: dict[int, list[int]] = {}
    replay_ops: dict[int, list[tuple[int, list[int], list[int]]]] = {}
    held: dict[int, int] = {}  # replay copies kept for backward: storage -> node index it dies at
    replay_freed: set[int] = set()  # originals (selective saves) that die inside a replay
    recompute_ms = 0.0
    for k, r in enumerate(regs):
        replay_at.setdefault(r.trigger, []).append(k)
        # checkpoint's own host cost: per region, and per tensor it packs (ProfileMeta)
        recompute_ms += g.region_ms + g.saved_tensor_ms * sum(len(g.saves[i]) for i in r.nodes)
        if r.saved:
            recompute_ms += g.selective_op_ms * len(r.nodes)
        for i in r.nodes:
            for s in g.reads[i]:
                if s not in r.produced and r.bw_end > last.get(s, -1):
                    last[s] = r.bw_end
        for s in r.holds:  # reached through the region's arguments, which the frame keeps
            if s not in g.fixed_storages and r.bw_end > last.get(s, -1):
                last[s] = r.bw_end
        hold: dict[int, int] = {}  # storages the region's autograd nodes need, until when
        for i in r.nodes:
            for s in g.saves[i]:
                if s in r.produced and i in g.bw_end:
                    hold[s] = max(hold.get(s, -1), g.bw_end[i])
        ran = [i for i in r.nodes if i <= r.early_stop]
        read_pos: dict[int, int] = {}
        for pos, i in enumerate(ran):
            for s in g.reads[i]:
                if s in r.produced:
                    read_pos[s] = pos
        # The replay runs the module's own code: what it holds past the last reader lives until
        # it is dropped there too, or until the early stop unwinds the replay.
        for s in r.produced:
            rel = g.release.get(s)
            if rel is not None:
                pos = bisect.bisect_right(ran, rel) - 1 if rel <= r.early_stop else len(ran) - 1
                if pos > read_pos.get(s, -1):
                    read_pos[s] = pos
        frees: dict[int, list[int]] = {}
        ops = []
        for pos, i in enumerate(ran):
            if i in r.saved:
                # Selective saves are cached from forward; the replay consumes the cache entry, so
                # an output no backward op needs dies after its last replayed reader.
                for s in g.new[i]:
                    if s in hold:
                        last[s] = max(last.get(s, -1), hold[s])
                    elif last.get(s, -1) < r.trigger:
                        last.pop(s, None)
                        replay_freed.add(s)
                        frees.setdefault(read_pos.get(s, pos), []).append(s)
                ops.append((i, []))
                continue
            recompute_ms += g.time[i]
            ops.append((i, g.new[i]))
            for s in g.new[i]:
                if s in hold:
                    held[s] = hold[s]
                else:
                    frees.setdefault(read_pos.get(s, pos), []).append(s)
        replay_ops[k] = [(i, alloc, frees.get(pos, [])) for pos, (i, alloc) in enumerate(ops)]
        for i in r.saved:
            # Never replayed (after the early stop): nothing consumes its cache entry, which the
            # checkpoint frame holds until the region's backward is done.
            if i > r.early_stop:
                for s in g.new[i]:
                    last[s] = max(last.get(s, -1), hold.get(s, r.bw_end))

    extra_alloc: dict[int, int] = {}
    extra_free: dict[int, int] = {}
    if g.rng_state_bytes:
        for r in regs:
            if any(g.random[i] for i in r.nodes):
                a = r.nodes[0]
                extra_alloc[a] = extra_alloc.get(a, 0) + g.rng_state_bytes
                extra_free[r.bw_end] = extra_free.get(r.bw_end, 0) + g.rng_state_bytes

    # 3. Sweep the timeline.
    free_orig: dict[int, list[int]] = {}
    for s, t in last.items():
        free_orig.setdefault(t, []).append(s)
    free_held: dict[int, list[int]] = {}
    for s, t in held.items():
        free_held.setdefault(t, []).append(s)
    sb, ws = g.sbytes, g.ws
    names = g.names
    mem = peak = after_forward = 0
    peak_at = ""
    tl: list[tuple[str, int]] = []
    for i in range(g.n):
        if g.phase[i] in FIXED_PHASES:
            continue
        for k in replay_at.get(i, ()):
            for j, alloc, fr in replay_ops[k]:
                for s in alloc:
                    mem += sb[s]
                if mem + ws[j] > peak:
                    peak, peak_at = mem + ws[j], f"replay:{names[j]}"
                if timeline:
                    tl.append((f"replay:{names[j]}", mem))
                for s in fr:
                    mem -= sb[s]
        for s in g.new[i]:
            mem += sb[s]
        mem += extra_alloc.get(i, 0)
        if mem + ws[i] > peak:
            peak, peak_at = mem + ws[i], names[i]
        if timeline:
            tl.append((names[i], mem))
        for s in free_orig.get(i, ()):
            mem -= sb[s]
        for s in free_held.get(i, ()):
            mem -= sb[s]
        mem -= extra_free.get(i, 0)
        for s in g.new[i]:
            if s not in last and s not in replay_freed:  # nobody reads it: freed at once
                mem -= sb[s]
        if i == g.fwd_end:
            after_forward = mem
    if g.has_optimizer:
        # The update runs with the gradients still live, plus its own temporaries.
        opt = mem + g.optimizer_step_bytes
        if opt > peak:
            peak, peak_at = opt, "optimizer.step"
        if timeline:
            tl.append(("optimizer.step", opt))
    fixed = g.fixed_bytes
    return Simulation(
        peak_bytes=peak + fixed,
        recompute_ms=recompute_ms,
        peak_at=peak_at,
        timeline=[(label, b + fixed) for label, b in tl],
        after_forward_bytes=after_forward,
    )
