"""Replay a Schedule over a Profile: the peak memory and recompute time of one training step.

This is the single source of truth every solver's answer is checked against. It follows what
non-reentrant `torch.utils.checkpoint` does at run time (torch 2.13; each rule checked against
memory measured with `torch.profiler` events, `tests/planner/test_inplace.py`):

- Forward runs node by node; a node's new storages are allocated when it runs. A storage is freed
  after the later of: its last reader; the node after which the model's own code dropped its last
  reference (`Node.releases`, recorded by running the step: a local variable holds a tensor until
  the function returns); the end of the backward of every autograd node that saved it (its
  formula's last op: the engine's sum of the node's gradient into one already waiting for the
  same input, `Node.accumulates`, runs after the formula returned and released the saved
  tensors, a replay's copies included); the end of the step for the loss and parameter
  gradients. A backward op's temporaries die where the recorded step saw them die
  (`Node.releases`: at the end of the C++ statement that made them, or at their last use in a
  custom Function's Python backward); in a profile without that record (a graph profile), when
  the formula returns, or at their last use in a Python backward (`Node.python_backward`).
- A checkpointed region keeps its arguments (the checkpoint frame holds them) until the last of
  its autograd nodes has run backward: the tensors its ops read from outside, whatever the
  call's arguments reach (`ModuleCall.holds`), and for a run of a traced forward's stages the
  call's arguments and earlier stages' values its nodes take, read by its ops or not, and what
  an object among them reaches (`ModuleCall.stage_args`). Tensors its ops would save are not
  kept, except the outputs of nodes marked saved (selective checkpointing), which are cached
  from forward.
  Any region's call, a nested one's too, and one run again inside a parent's replay, keeps its
  tensor arguments until it returns (checkpoint's own frames hold them), or until a replay's
  early stop unwinds it: past their last reader, where a run of traced stages or of a
  Sequential's children is a call the model's own code does not make.
- In backward, the first of the region's autograd nodes to unpack a saved tensor replays the
  region from its start up to its early stop (`solvers.chain.early_stops`: its last op that
  saves anything, or the op before it when that op saves only its inputs). Every op before the
  stop is replayed except the saved ones, even ops that only feed saved ones. A C++ formula
  unpacks its saved tensors before its first op, so the replay runs before anything that node
  allocates (IndexBackward0's zeros, made before the indices are read); a custom Function's
  Python backward, at its first op that reads one; the node of an in-place op on a view (its
  base's CopySlices), after it has copied the gradient into a tensor of the base's shape and
  cloned the slice (`Node.before_unpack`, `GraphIndex.bw_unpack`).
- Replayed tensors the region's autograd nodes need live until those nodes' formulas have
  returned (a node unpacks them into the formula's locals; the engine's reduction of a
  broadcast gradient after the formula, `Node.after_formula`, runs without them); the others
  die after their last replayed reader, or where the module's code drops them, or when the early
  stop unwinds the replay; what a replayed node that never runs backward saved lives as long as
  that node, as in forward (the replay's pack hook hands it back to the node). A cached (saved)
  output is consumed by the replay and dies after its last replayed reader unless a backward op
  needs it; one after the early stop is never consumed and lives in the frame's cache until the
  region's backward is done.
- A region with random ops stashes the CPU RNG state (`preserve_rng_state`) from its forward to
  its backward, and `fork_rng` keeps another copy for the whole of its replay. A region nested in
  a replayed one runs its checkpoint again inside the replay: the new frame (its own RNG state,
  and what it keeps by reference: the tensors the objects among its arguments reach, a cache,
  and tensor arguments its ops never read, `ModuleCall.holds`) lives until the replay
  returns; one whose call starts right after the replay's early stop makes it after the frees
  of the replay's last op (an argument of a call that has returned is gone) and before those
  of its return, as the stop fires when that call saves its arguments. (The RNG state is host
  memory on a GPU, counted on CPU only.) The parent's replay
  saves the nested call's tensor arguments for that frame; the nested region's own replay
  unpacks them as it starts and drops them as it returns (its early stop), so they live until
  then, or until the backward of its replayed ops that save them, or as long as a region nested
  in it that takes them needs them. One backward op can trigger a chain of replays (it unpacks
  what the innermost region saved, whose arguments the region around it saved): the outer
  replay runs first and returns before the inner one starts. A nested region that never
  replays (nothing it saves is read in backward) is left out, but its call still saves its
  tensor arguments to the parent's frame as it starts: the parent's replay runs up to it (one
  left out inside another saves them to that one's frame). What its own ops save goes to its
  own frame: it neither extends the parent's replay nor is held by it, and a replay running
  through the call stashes the RNG state for it when it draws random numbers. One none of
  whose ops runs backward but that packs tensors keeps its frame, RNG state and inputs, and a
  selective one its cached outputs, as long as its autograd graph lives.
- Under `torch.autocast`, a parameter cast to the lower precision is made by the first op that
  needs it and taken from autocast's cache by every later op of the same autocast block, until
  the block ends (`GraphIndex.autocast_casts`). A replay runs in an autocast block of its own:
  where its ops read a cast made outside the region (a module called several times with one set
  of weights), it casts again, as its first reader replays; that copy lives until the replay
  returns, or until the backward of the replayed nodes that save it, and the region's backward
  reads it, not the original. Such a cast is not one of the region's inputs. A cast its own
  replayed ops make (those of a region nested in it too) is in that cache as well: it lives
  until the replay returns, however early the code drops it (a run of traced stages does).
- A call with a region that is a run of its traced forward's stages (`planner.stages`) runs the
  generated code, in forward and in the run's replay: it drops a value after the last stage
  that reads it or is passed it (a stage: one call of the traced forward; an object holding it
  counts, `GraphIndex.stage_passed`), where the model's own code may have kept it longer in a
  local (`Node.releases` count no later than that stage, `_traced_calls`).
  What the code does not hold last is not dropped earlier: the values the model returns (the
  caller holds them) and autocast's cached casts, which the cache holds until the autocast
  block ends, in forward too (`GraphIndex.not_code_held`).
- A region whose calls update buffers in place (BatchNorm's running statistics) replays on
  copies of them, made as its replay starts (`planner.inplace`), so that the statistics move
  once per step; a copy a replayed op saves (batch norm saves the statistics it is given) lives
  until that op's backward, the others until the replay returns. Buffers a call reads again
  after updating them (`Region.restores`: spectral norm's vectors) are also copied as the
  region's checkpoint starts, in forward and again in a parent's replay; the frame keeps those
  copies until the region's backward is done (until the parent's replay returns), and the
  replay's copies are made from them.
- With an optimizer, the step ends with its update: parameters, gradients, optimizer state and the
  optimizer's transient memory.

Memory is the sum of live storages' bytes, fixed memory (parameters, buffers, inputs, optimizer
state) included, as `torch.cuda.max_memory_allocated` reports it. Op-internal workspace is
counted where the profile measured it (CPU measure mode).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from solvers.chain import early_stops
from solvers.errors import ScheduleError
from solvers.graph import graph_index
from solvers.profile import FIXED_PHASES, Profile, cached
from solvers.schedule import Region, Schedule

__all__ = ["MEMO_SIZE", "Simulation", "peak_breakdown", "simulate", "unsplittable_at_peak"]

MEMO_SIZE = 4096
"""Simulations kept per profile (`simulate` is pure: solvers re-check the same schedules across
methods and budgets), and likewise region replays; each memo is emptied when it reaches this
size."""


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
    peak_live: tuple[tuple[int, bool], ...] = field(repr=False, default=())
    """With `timeline`: the storages live at the peak, each with whether a replay made it."""
    peak_workspace_bytes: int = 0
    """With `timeline`: the workspace of the op at the peak (included in `peak_bytes`)."""


AFTER_REPLAYS = 1 << 30
"""Order of a node's own step among the steps at its index (the replays it triggers, by depth,
come first)."""


def _end_of_replay(g, r: _Reg) -> int:
    """A death at the end of region `r`'s replay, as `_Replay.held` encodes it (negative, below
    -1; node indices are the others): `r`'s span, which no other region of a schedule has."""
    return -2 - (r.nodes[0] * g.n + r.nodes[-1])


@dataclass
class _Reg:
    nodes: list[int]
    """Every forward node in the region's span, its children's included."""
    saved: set[int]
    early_stop: int
    """Node index: the replay runs the span's nodes up to here (-1: nothing)."""
    trigger: int
    bw_end: int
    produced: frozenset[int]
    holds: tuple[int, ...] = ()
    own: list[int] = field(default_factory=list)
    """The nodes in no child region: their saves belong to this region."""
    children: list[int] = field(default_factory=list)
    parent: int = -1
    depth: int = 0
    inputs: frozenset[int] = frozenset()
    """Storages its nodes read that it does not produce."""
    buffers: tuple[int, ...] = ()
    """Buffer storages its calls update in place, which its replay runs on copies of."""
    restores: tuple[int, ...] = ()
    """Those of `buffers` its checkpoint copies as it starts, for the replay to start from."""
    random: bool = False
    """Whether a node in its span draws random numbers (its replay restores the RNG state)."""
    idle: tuple[tuple[int, int, tuple[int, ...], bool], ...] = ()
    """Regions nested in it, with no kept region between, that never replay and are left out
    (`_resolve`): (first node, last node, tensor arguments, whether it draws random numbers)
    of each call, which still runs in its replay."""
    in_idle: frozenset[int] = frozenset()
    """The nodes of those calls: what they save goes to their own checkpoints' frames, which
    nothing unpacks, so this region's frame and replay keep none of it."""
    last_saver: int = -1
    """Its last own node that saves for backward (outside `in_idle`): the replay packs what it
    saves even where the early stop is the node before it (it saves only its inputs)."""
    traced: tuple[tuple[int, int, list[int], list[int]], ...] = ()
    """The calls that run their generated code under the schedule (`_traced_calls`: the call
    a run of stages is part of, and any such call in its span), each as (first node, last
    node, first and last node of each stage): in its replay too, they drop values after the
    stage that reads them last."""


def _resolve(p: Profile, regions: tuple[Region, ...]) -> list[_Reg]:
    """Check a schedule's regions against the profile and turn them into node-index sets: a
    forest, where a region inside another is its child (nested checkpoint). Regions that save
    nothing are left out (they never replay), their nodes belonging to their parent."""
    g = graph_index(p)
    stop = early_stops(p)
    spans: list[tuple[int, int, int]] = []
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
        c = bisect.bisect_left(g.collectives, a)
        if c < len(g.collectives) and g.collectives[c] <= b:
            raise ScheduleError(
                f"region {k} ({r.start}..{r.end}) holds {g.names[g.collectives[c]]}: under FSDP "
                "a region must lie inside one fully_shard unit"
            )
        spans.append((a, b, k))
    spans.sort(key=lambda t: (t[0], -t[1]))
    # Regions must be in order of their start, an outer region before the ones inside it; two
    # regions either nest or are disjoint.
    open_: list[tuple[int, int, int]] = []  # enclosing spans, innermost last
    last_end = -1
    parent_of: dict[int, int] = {}
    for a, b, k in spans:
        r = regions[k]
        while open_ and open_[-1][1] < a:
            open_.pop()
        if open_:
            pa, pb, pk = open_[-1]
            if b > pb or (a, b) == (pa, pb):
                raise ScheduleError(
                    f"region {k} ({r.start}..{r.end}) overlaps region {pk} without nesting in it"
                    if b > pb else f"region {k} ({r.start}..{r.end}) repeats region {pk}'s nodes"
                )
            parent_of[k] = pk
        elif a <= last_end:
            raise ScheduleError(f"region {k} ({r.start}..{r.end}) overlaps the region before it")
        last_end = max(last_end, b)
        open_.append((a, b, k))
    raw: dict[int, _Reg] = {}
    running = _traced_calls(g, regions)
    for a, b, k in spans:
        r = regions[k]
        span = g.spans.get((a, b))
        if span is None:  # the same span recurs in many schedules
            nodes = [i for i in range(a, b + 1) if g.phase[i] == "forward"]
            made = frozenset(s for i in nodes for s in g.new[i])
            # A parameter autocast cast outside the region is not an input: the replay casts
            # it again (`GraphIndex.autocast_casts`).
            span = g.spans[(a, b)] = (nodes, made,
                                      frozenset(s for i in nodes for s in g.reads[i]) - made
                                      - g.autocast_casts.keys(),
                                      tuple(sorted({s for ca, cb, sids, _ in g.buffer_calls
                                                    if a <= ca and cb <= b for s in sids})),
                                      tuple(sorted({s for ca, cb, _, rids in g.buffer_calls
                                                    if a <= ca and cb <= b for s in rids})),
                                      any(g.random[i] for i in nodes))
        nodes, produced, inputs, buffers, restores, random = span
        saved = set()
        for name in r.saved:
            j = g.name_to_i.get(name)
            if j is None or not a <= j <= b:
                raise ScheduleError(f"region {k}: saved node {name!r} is not inside the region")
            saved.add(j)
        holds = g.call_holds.get((r.start, r.end), ())  # the call this region is, if any
        traced = _traced_calls(g, (r,))
        if traced and (traced[0][0], traced[0][1]) in g.stage_args:
            # a run of stages is passed the call's arguments its nodes read, whether its ops
            # read them or not (an HF layer hands `position_ids` to its attention): its inputs
            ca, cb, firsts, lasts = traced[0]
            per_stage = g.stage_args[(ca, cb)]
            p0, p1 = firsts.index(a), lasts.index(b)
            inputs = inputs | ({x for k in range(p0, p1 + 1) for x in per_stage[k]} - produced)
        raw[k] = _Reg(nodes, saved, -1, -1, -1, produced, holds, inputs=inputs, buffers=buffers,
                      restores=restores, random=random,
                      traced=tuple(c for c in running if c[0] <= b and a <= c[1]))
    # A region that never replays (none of its saved tensors is read in backward) is left out,
    # its nodes belonging to its parent; leaving one out can change its parent, so repeat.
    # Its checkpoint still runs in its parent's replay, saving its tensor arguments to the
    # parent's frame as it starts: the parent's replay stops there at the earliest.
    keep = [k for _, _, k in spans]
    left: list[tuple[int, tuple[int, int, tuple[int, ...], bool]]] = []  # `_Reg.idle` entries
    while True:
        out = _forest(g, stop, [raw[k] for k in keep], keep, parent_of, left)
        idle = {keep[n] for n, r in enumerate(out) if r.trigger < 0}
        if not idle:
            return out
        left += [(k, (raw[k].nodes[0], raw[k].nodes[-1],
                      tuple(sorted(raw[k].inputs - set(raw[k].holds))), raw[k].random))
                 for k in idle]
        keep = [k for k in keep if k not in idle]


def _fresh(r: _Reg) -> _Reg:
    """A copy of `r` not linked into any forest (`dataclasses.replace` without its checks: this
    runs for every region of every schedule simulated)."""
    c = object.__new__(_Reg)
    c.__dict__.update(r.__dict__)
    c.children, c.parent = [], -1
    return c


def _forest(g, stop, regs: list[_Reg], keys: list[int], parent_of: dict[int, int],
            left: list[tuple[int, tuple[int, int, tuple[int, ...]]]] = ()) -> list[_Reg]:
    """Link `regs` (in span order, outer first; `keys` their schedule indices) into a forest and
    compute each region's own nodes, early stop, trigger and backward end, children first.
    `left`: (schedule index, `_Reg.idle` entry) of the regions left out (`_resolve`): a call
    with tensor arguments bounds its nearest kept ancestor's early stop."""
    at = {k: n for n, k in enumerate(keys)}
    out = [_fresh(r) for r in regs]

    def kept_parent(k: int) -> int:
        pk = parent_of.get(k, -1)
        while pk >= 0 and pk not in at:  # an ancestor left out: the next one up
            pk = parent_of.get(pk, -1)
        return at[pk] if pk >= 0 else -1

    for n, k in enumerate(keys):
        pn = kept_parent(k)
        if pn >= 0:
            out[n].parent = pn
            out[pn].children.append(n)
    idle_calls: dict[int, list[int]] = {}  # kept region -> first nodes of calls left out in it
    for k, call in left:
        pn = kept_parent(k)
        if pn >= 0:
            out[pn].idle += (call,)
            # one inside another call left out packs its arguments to that call's frame
            if call[2] and parent_of.get(k, -1) == keys[pn]:
                idle_calls.setdefault(pn, []).append(call[0])
    for r in out:
        r.depth = 0 if r.parent < 0 else out[r.parent].depth + 1
        if (r.children or r.parent >= 0) and r.saved:
            raise ScheduleError("a selective region (saved nodes) cannot nest or be nested")
    for n in range(len(out) - 1, -1, -1):
        r = out[n]
        key = (r.nodes[0], r.nodes[-1], r.idle,
               tuple((out[c].nodes[0], out[c].nodes[-1]) for c in r.children))
        own = g.own_nodes.get(key)
        if own is None:
            inner = {i for c in r.children for i in out[c].nodes}
            # What a call left out saves goes to its own checkpoint's frame, not to this one:
            # it neither extends this region's replay nor triggers it.
            in_idle = frozenset(i for a, b, *_ in r.idle for i in range(a, b + 1))
            mine = [i for i in r.nodes if i not in inner] if inner else r.nodes
            savers = [i for i in mine if g.saves[i] and i not in in_idle]
            if len(g.own_nodes) >= MEMO_SIZE:
                g.own_nodes.clear()
            own = g.own_nodes[key] = (
                mine, in_idle, savers,
                min((g.bw_unpack[i] for i in savers if i in g.bw_unpack), default=-1),
                max((g.bw_end[i] for i in savers if i in g.bw_end), default=-1))
        r.own, r.in_idle, savers, own_trigger, own_end = own
        r.last_saver = savers[-1] if savers else -1
        calls = [out[c].nodes[0] for c in r.children] + idle_calls.get(n, [])
        if not calls:
            # The replay runs the region's ops up to the early stop (`solvers.chain.early_stops`);
            # a stop before the region's first node replays nothing.
            e = stop[g.fwd_pos[r.nodes[-1]]] if savers else -1
            r.early_stop = g.forward[e] if e >= 0 else -1
        else:
            # A child's inputs count as tensors the parent saves, packed as the child starts: the
            # parent's replay stops at its last own saver (inside it, as for a flat region) or at
            # the start of its last child, before the child's ops.
            last_own = r.last_saver
            last_child = max(calls)
            if last_child > last_own:
                r.early_stop = last_child - 1
            else:
                r.early_stop = last_own if set(g.saves[last_own]) & set(g.new[last_own]) \
                    else last_own - 1
            while r.early_stop >= 0 and g.phase[r.early_stop] != "forward":
                r.early_stop -= 1
        triggers = [out[c].trigger for c in r.children if out[c].trigger >= 0]
        if own_trigger >= 0:
            triggers.append(own_trigger)
        r.trigger = min(triggers, default=-1)
        r.bw_end = max([own_end] + [out[c].bw_end for c in r.children])
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
    regs = _resolve(p, regions)
    # 1. Original instances: the node index after which each storage is freed (-1: none).
    last = _original_ends(g, regs, regions)

    # 2. Regions: inputs held by the (outermost) frame; selective saves held until the replay;
    # each region's replay, a parent's before its children's.
    replay_at: dict[int, list[int]] = {}
    replay_ops: dict[int, _Replay] = {}
    # Replay copies kept for backward: (storage, node index it dies at). A storage can have a
    # copy from each of several replays (a parent's replay re-runs a nested region, whose own
    # replay makes it again), each freed on its own.
    held: list[tuple[np.ndarray, np.ndarray]] = []
    replay_freed: set[int] = set()  # originals (selective saves) that die inside a replay

    def handed(c: int) -> set[int]:
        """The inputs region `c` takes from its parent's replay: the tensors `planner.inplace`
        passes to its checkpoint (positional and keyword tensors, those of a tuple given by
        keyword), which a nested checkpoint saves to its parent. What its frame keeps by
        reference from forward (`ModuleCall.holds`: tensors inside a list or dict argument, or
        reached through an object, a cache) its replay reads as the originals."""
        return regs[c].inputs - set(regs[c].holds)

    def keep_for(s: int, c: int) -> tuple[tuple[int, int], int]:
        """How long the copy of storage `s`, an input of region `c` made by its parent's replay,
        must live: until `c`'s replay returns (its checkpoint unpacks its arguments as the
        replay starts and drops them as it returns, before the replay of a region nested in
        it that the same backward op triggers), or until `c`'s own nodes that save it have run
        backward, or as long as a child of `c` that takes it as input needs it. Returns
        (order, death): `death` as `_Replay.held` encodes it, `order` sorting deaths in time."""
        r = regs[c]
        best = ((r.trigger, r.depth), _end_of_replay(g, r)) if r.trigger >= 0 else ((-1, -1), -1)
        for i in r.own:
            if s in g.saves[i] and i in g.bw_end and (g.apply_end[i], AFTER_REPLAYS) > best[0]:
                best = ((g.apply_end[i], AFTER_REPLAYS), g.apply_end[i])
        for d in r.children:
            if s in handed(d):
                best = max(best, keep_for(s, d), key=lambda x: x[0])
        return best

    sigs: dict[int, tuple] = {}

    def sig(k: int) -> tuple:
        """Region k's span, its early stop, the calls nested in it that never replay (which
        can move the early stop and hold their arguments in its replay), whether it runs
        traced code, and, recursively, those of the regions nested in it."""
        if k not in sigs:
            r = regs[k]
            sigs[k] = (r.nodes[0], r.nodes[-1], r.early_stop, r.idle,
                       tuple((c[0], c[1]) for c in r.traced),
                       tuple(sig(c) for c in r.children))
        return sigs[k]

    def snapshot(k: int) -> int:
        """Bytes of the buffer copies region k's checkpoint makes as it starts
        (`Region.restores`), which its frame keeps."""
        return sum(g.sbytes[s] for s in regs[k].restores)

    def calls_in(k: int) -> tuple[bool, list[tuple]]:
        """Whether region k's replay stashes the CPU RNG state (`fork_rng`), and the regions
        nested in it at any depth, each as (first node, random, storages its frame keeps by
        reference, `ModuleCall.holds`, bytes of its buffer snapshot, last node, its tensor
        arguments): their checkpoint calls run again inside k's replay, those left out
        (`_Reg.idle`) too."""
        out = [(a, rand, (), 0, b, args) for a, b, args, rand in regs[k].idle]
        todo = list(regs[k].children)
        while todo:
            d = todo.pop()
            todo.extend(regs[d].children)
            out.append((regs[d].nodes[0], regs[d].random, regs[d].holds, snapshot(d),
                        regs[d].nodes[-1], tuple(sorted(handed(d)))))
            out += [(a, rand, (), 0, b, args) for a, b, args, rand in regs[d].idle]
        return regs[k].random, sorted(out)

    recompute_ms = 0.0
    for k, r in enumerate(regs):
        replay_at.setdefault(r.trigger, []).append(k)
        if r.saved:
            recompute_ms += g.selective_op_ms * len(r.nodes)
        if r.parent < 0:  # the outermost frame keeps the region's inputs until its backward
            for s in r.inputs:
                if r.bw_end > last[s]:
                    last[s] = r.bw_end
        for s in r.holds:  # reached through the region's arguments, which the frame keeps
            if s not in g.fixed_storages and r.bw_end > last[s]:
                last[s] = r.bw_end
        if r.saved:
            rep = _replay(g, r, (handed, keep_for), last, replay_freed, calls_in(k),
                          with_ops=timeline)
        elif timeline:
            rep = _replay(g, r, (handed, keep_for), None, None, calls_in(k))
        else:
            # A region's replay depends only on its span and the regions nested in it (the
            # same in many schedules): computed once per profile.
            key = sig(k)
            rep = g.replays.get(key)
            if rep is None:
                if len(g.replays) >= MEMO_SIZE:
                    g.replays.clear()
                rep = g.replays[key] = _replay(g, r, (handed, keep_for), None, None,
                                               calls_in(k), with_ops=False)
        replay_ops[k] = rep
        held.append(rep.held_arrays)
        # the replayed ops, and checkpoint's own host cost: per region, per tensor it packs
        recompute_ms += rep.recompute_ms + g.region_ms + g.saved_tensor_ms * rep.packs
    # Copies that die as a nested region's replay returns (`keep_for`): freed after that
    # replay's last op, before the next replay at the same node.
    after_replay: dict[int, list[int]] = {}
    held_s = np.concatenate([s for s, _ in held]) if held else np.zeros(0, np.int64)
    held_t = np.concatenate([t for _, t in held]) if held else np.zeros(0, np.int64)
    returns = held_t < -1
    if returns.any():
        span_of = {_end_of_replay(g, r): k for k, r in enumerate(regs)}
        for s, t in zip(held_s[returns].tolist(), held_t[returns].tolist()):
            after_replay.setdefault(span_of[t], []).append(s)
        held_s, held_t = held_s[~returns], held_t[~returns]
    for at_node in replay_at.values():
        at_node.sort(key=lambda k: regs[k].depth)  # a parent replays before its children

    extra_alloc: dict[int, int] = {}
    extra_free: dict[int, int] = {}
    # A region that restores buffers copies them as its checkpoint starts; the frame keeps the
    # copies until the region's backward is done.
    for k, r in enumerate(regs):
        b = snapshot(k)
        if b:
            extra_alloc[r.nodes[0]] = extra_alloc.get(r.nodes[0], 0) + b
            extra_free[r.bw_end] = extra_free.get(r.bw_end, 0) + b
    if g.rng_state_bytes:
        for k, r in enumerate(regs):
            if regs[k].random:
                a = r.nodes[0]
                extra_alloc[a] = extra_alloc.get(a, 0) + g.rng_state_bytes
                extra_free[r.bw_end] = extra_free.get(r.bw_end, 0) + g.rng_state_bytes
    # A region none of whose ops runs backward (over an output the loss does not use) never
    # replays, but its checkpoint stashed the RNG state in forward, and where its ops pack
    # anything for backward (the packed tensors' hooks hold the frame) its frame keeps the
    # region's inputs: while the region's autograd graph lives (`GraphIndex.dead_ends`).
    dead = g.dead_ends()
    for r in regions if dead else ():
        i, j = g.name_to_i[r.start], g.name_to_i[r.end]
        nodes, _, inputs = g.spans[(i, j)][:3]  # filled by `_resolve`
        if not nodes or not all(k in dead for k in nodes):
            continue
        end = max(dead[k] for k in nodes)
        if g.rng_state_bytes and any(g.random[k] for k in nodes):
            extra_alloc[nodes[0]] = extra_alloc.get(nodes[0], 0) + g.rng_state_bytes
            extra_free[end] = extra_free.get(end, 0) + g.rng_state_bytes
        if any(g.saves[k] for k in nodes):
            # a selective region's cache of its saved ops' outputs lives in the same frame
            cached = [s for name in r.saved for s in g.new[g.name_to_i[name]]]
            for s in (*inputs, *cached):
                if s not in g.fixed_storages and end > last[s]:
                    last[s] = end

    if not timeline:
        return _sweep(g, last, (held_s, held_t), replay_at, replay_ops, replay_freed, extra_alloc,
                      extra_free, recompute_ms, after_replay)

    # 3. Sweep the timeline, op by op (`_sweep` computes the same without the timeline).
    free_orig: dict[int, list[int]] = {}
    for s, t in enumerate(last):
        if t >= 0:
            free_orig.setdefault(t, []).append(s)
    free_held: dict[int, list[int]] = {}
    for s, t in zip(held_s.tolist(), held_t.tolist()):
        free_held.setdefault(t, []).append(s)
    sb, ws = g.sbytes, g.ws
    names = g.names
    mem = peak = after_forward = 0
    peak_at = ""
    tl: list[tuple[str, int]] = []
    # With `timeline`, the live storages too (True: a replay's copy), for `peak_live`.
    live: dict[int, bool] = {}
    snap: tuple[tuple[tuple[int, bool], ...], int] = ((), 0)
    for i in range(g.n):
        if g.phase[i] in FIXED_PHASES:
            continue
        for k in replay_at.get(i, ()):
            rep = replay_ops[k]
            extra: dict[int, int] = {}
            for pos, b in rep.extra:
                extra[pos] = extra.get(pos, 0) + b
            for pos, (j, alloc, fr) in enumerate(rep.ops):
                mem += extra.get(pos, 0)
                for s in alloc:
                    mem += sb[s]
                    if timeline:
                        live[s] = True
                w = ws[j] if j is not None else 0
                name = f"replay:{names[j if j is not None else rep.ops[pos - 1][0]]}"
                if mem + w > peak:
                    peak, peak_at = mem + w, name
                    if timeline:
                        snap = (tuple(live.items()), w)
                if timeline:
                    tl.append((name, mem))
                for s in fr:
                    mem -= sb[s]
                    if timeline:
                        live.pop(s, None)
            mem -= sum(b for _, b in rep.extra)
            for s in after_replay.get(k, ()):
                mem -= sb[s]
                if timeline and live.get(s):
                    del live[s]
        for s in g.new[i]:
            mem += sb[s]
            if timeline:
                live[s] = False
        mem += extra_alloc.get(i, 0)
        if mem + ws[i] > peak:
            peak, peak_at = mem + ws[i], names[i]
            if timeline:
                snap = (tuple(live.items()), ws[i])
        if timeline:
            tl.append((names[i], mem))
        for s in free_orig.get(i, ()):
            mem -= sb[s]
            if timeline and live.get(s) is False:
                del live[s]
        for s in free_held.get(i, ()):
            mem -= sb[s]
            if timeline and live.get(s):
                del live[s]
        mem -= extra_free.get(i, 0)
        for s in g.new[i]:
            if last[s] < 0 and s not in replay_freed:  # nobody reads it: freed at once
                mem -= sb[s]
                if timeline:
                    live.pop(s, None)
        if i == g.fwd_end:
            after_forward = mem
    if g.has_optimizer:
        # The update runs with the gradients still live, plus its own temporaries.
        opt = mem + g.optimizer_step_bytes
        if opt > peak:
            peak, peak_at = opt, "optimizer.step"
            if timeline:
                snap = (tuple(live.items()), g.optimizer_step_bytes)
        if timeline:
            tl.append(("optimizer.step", opt))
    fixed = g.fixed_bytes
    return Simulation(
        peak_bytes=peak + fixed,
        recompute_ms=recompute_ms,
        peak_at=peak_at,
        timeline=[(label, b + fixed) for label, b in tl],
        after_forward_bytes=after_forward,
        peak_live=snap[0],
        peak_workspace_bytes=snap[1],
    )


@dataclass(frozen=True)
class _Replay:
    """What one region's replay runs: (op, storages it allocates, storages freed after it;
    listed for the timeline sweep only), the replay copies kept for backward (storage -> node
    index they die at, or the end of a nested region's replay: `_end_of_replay`), the replayed
    ops' time, and the same ops as arrays for `_sweep` (bytes
    allocated, freed, workspace, op)."""

    ops: list[tuple[int, list[int], list[int]]]
    held: dict[int, int]
    recompute_ms: float
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    packs: int
    """Tensors the region's own ops save (checkpoint packs each one)."""
    extra: tuple[tuple[int, int], ...] = ()
    """(position, bytes) of host state allocated before that op (position len(ran): at the
    replay's return, after its last op) and freed as the replay returns."""
    held_arrays: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    """`held` as two arrays, storages and deaths, in its order (for `_simulate`)."""


def _replay(g, r: _Reg, nested: tuple[Callable, Callable] | None, last: list[int] | None,
            replay_freed: set[int] | None,
            calls: tuple[bool, list[tuple]] = (False, []),
            with_ops: bool = True) -> _Replay:
    """The replay of region `r`. A selective region (saved nodes) also updates `last` and
    `replay_freed` for its cached outputs; a region with children keeps each child's inputs
    (`nested`: `_simulate`'s ``handed`` and ``keep_for``) as long as the child needs them.

    `calls` (`_simulate`'s ``calls_in``): whether the replay stashes the RNG state, and the
    regions nested in `r`. A nested region whose call starts in the replay runs its checkpoint
    again, making a new frame that lives until the replay returns (the replay's autograd graph
    holds it): the frame keeps what the call's arguments hold by reference (`ModuleCall.holds`)
    and its buffer snapshot (`Region.restores`), and, for a random region, a copy of the CPU RNG
    state, as `fork_rng` keeps one for the whole
    replay of a random region. A nested call starting right after the early stop stashes its copy and
    unwinds at once. The call keeps its tensor arguments until it returns (or the early stop
    unwinds it), past their last reader.

    `with_ops`: also list the replayed ops one by one (`_Replay.ops`, for the timeline sweep);
    `_sweep` reads the arrays only.
    """
    hold: dict[int, int] = {}  # storages this replay keeps for backward, until when
    for i in r.own:
        if i in r.in_idle:
            continue
        for s in g.saves[i]:
            if s in r.produced and i in g.bw_end:
                hold[s] = max(hold.get(s, -1), g.apply_end[i])
    if nested is not None:
        handed, keep_for = nested
        order = {s: (t, AFTER_REPLAYS) for s, t in hold.items()}
        for c in r.children:  # a child's inputs made here: kept until the child has them
            for s in handed(c) & r.produced:
                key, death = keep_for(s, c)
                if key > order.get(s, (-1, -1)):
                    order[s], hold[s] = key, death
    reads, rels, made_pos, made_s, made_cut, time_upto = _span_reads(g, r)
    n_ran = bisect.bisect_right(r.nodes, r.early_stop)  # `r.nodes` ascend: `ran` is a prefix
    ran = r.nodes[:n_ran]
    if n_ran == len(r.nodes):
        read_pos = {s: ps[-1] for s, ps in reads.items()}
    else:
        read_pos = {}
        for s, ps in reads.items():
            if ps[0] < n_ran:
                read_pos[s] = ps[-1] if ps[-1] < n_ran else ps[bisect.bisect_left(ps, n_ran) - 1]
    random, nested_calls = calls
    rng = g.rng_state_bytes
    # Position len(ran) is the replay's return (or its early stop unwinding it): a step after
    # the last op that only frees, except that a nested call starting right after the early
    # stop makes its frame there first (the stop fires as it saves its arguments).
    ret = len(ran)
    extra: list[tuple[int, int]] = []  # (position, bytes): RNG states, freed as the replay ends
    if ran and rng and random:
        extra.append((0, rng))
    for first, rand, kw, snap, end, args in nested_calls:
        if ran and first <= r.early_stop:
            for s in kw:  # bound in the new frame's function until the replay returns
                if s in r.produced:
                    read_pos[s] = ret
            returns = bisect.bisect_right(ran, end) - 1 if end <= r.early_stop else ret
            for s in args:  # held by the call (checkpoint's own frames) until it returns
                if s in r.produced and returns > read_pos.get(s, -1):
                    read_pos[s] = returns
        if ran and rand and rng and first <= r.early_stop + 1:
            extra.append((bisect.bisect_left(ran, first), rng))
        if ran and snap and first <= r.early_stop + 1:
            extra.append((bisect.bisect_left(ran, first), snap))
    # The replay runs the module's own code: what it holds past the last reader lives until
    # it is dropped there too (`_span_reads`), or until the early stop unwinds the replay.
    for s, rel, at in rels:
        pos = at if rel <= r.early_stop else ret
        if pos > read_pos.get(s, -1):
            read_pos[s] = pos
    # A replayed op that never runs backward (its output does not reach the loss) keeps what
    # it saves while its replayed autograd node lives, as in forward: the replay's pack hook
    # hands the tensor back to the node whether or not the frame wants it. Inside a nested
    # region's call (one left out too) the new frame's hook packs it instead, and nothing
    # keeps it.
    dead = g.dead_saver_ends()
    if dead and ran:
        own = set(r.own) - r.in_idle
        for i in ran:
            e = dead.get(i)
            if e is None or i not in own or i in r.saved:
                continue
            pos = bisect.bisect_right(ran, e) - 1 if e <= r.early_stop else ret
            for s in g.saves[i]:
                if s in r.produced and pos > read_pos.get(s, -1):
                    read_pos[s] = pos
    frees: dict[int, list[int]] = {}
    ops = []
    held: dict[int, int] = {}
    recompute_ms = 0.0
    # Parameters autocast cast outside the region: the replay casts each again as its first
    # replayed reader runs (its autocast block starts with an empty cache); autocast's cache
    # keeps the copy until the replay returns, and the replayed ops that save it until their
    # backward.
    recast: dict[int, list[int]] = {}  # position of the first replayed reader -> storages
    if g.autocast_casts:
        first: dict[int, int] = {}
        for pos, i in enumerate(ran):
            if i in r.saved:
                continue
            for s in g.reads[i]:
                if s in g.autocast_casts and s not in r.produced:
                    first.setdefault(s, pos)
        for s, pos in first.items():
            recast.setdefault(pos, []).append(s)
            recompute_ms += g.time[g.autocast_casts[s]]
            end = max((g.apply_end[i] for i in r.own if s in g.saves[i] and i in g.bw_end),
                      default=-1)
            if end >= 0:
                held[s] = end
            else:
                frees.setdefault(ret, []).append(s)
    # Buffers the region updates in place (BatchNorm statistics): the replay runs on copies
    # made as it starts; a copy its replayed ops save (batch norm saves its running statistics)
    # lives until their backward, the others until the replay returns. The region's last saver
    # packs what it saves even where the stop is the op before it (it saves only its inputs:
    # batch norm's saves belong to the last getitem of its results).
    if ran and r.buffers:
        recast.setdefault(0, []).extend(r.buffers)
        for s in r.buffers:
            end = max((g.apply_end[i] for i in r.own
                       if (i <= r.early_stop or i == r.last_saver) and s in g.saves[i]
                       and i in g.bw_end), default=-1)
            if end >= 0:
                held[s] = end
            else:
                frees.setdefault(ret, []).append(s)
    if not r.saved and not with_ops:  # the same as the loop below, by span facts
        if recompute_ms == 0.0:
            recompute_ms = time_upto[n_ran]
        else:
            for i in ran:
                recompute_ms += g.time[i]
        k = made_cut[n_ran]
        for pos, s in zip(made_pos[:k], made_s[:k]):
            if s in hold:
                held[s] = hold[s]
            else:
                frees.setdefault(read_pos.get(s, pos), []).append(s)
        ran_all = ()
    else:
        ran_all = ran
    for pos, i in enumerate(ran_all):
        if i in r.saved:
            # Selective saves are cached from forward; the replay consumes the cache entry, so
            # an output no backward op needs dies after its last replayed reader.
            assert last is not None and replay_freed is not None
            for s in g.new[i]:
                if s in hold:
                    last[s] = max(last[s], hold[s])
                elif last[s] < r.trigger:
                    last[s] = -1
                    replay_freed.add(s)
                    frees.setdefault(read_pos.get(s, pos), []).append(s)
            # not replayed, but the copies the replay makes as it starts (buffers) still are
            if with_ops:
                ops.append((i, recast.get(pos, [])))
            continue
        recompute_ms += g.time[i]
        if with_ops:
            ops.append((i, g.new[i] + recast.get(pos, [])))
        for s in g.new[i]:
            if s in hold:
                held[s] = hold[s]
            else:
                frees.setdefault(read_pos.get(s, pos), []).append(s)
    # the return: a step of no op (None), when something happens there
    tail = bool(ran) and (ret in frees or any(pos == ret for pos, _ in extra))
    out = [(i, alloc, frees.get(pos, [])) for pos, (i, alloc) in enumerate(ops)] if with_ops else []
    if with_ops and tail:
        out.append((None, [], frees.get(ret, [])))
    if r.saved:
        assert last is not None
        for i in r.saved:
            # Never replayed (after the early stop): nothing consumes its cache entry, which the
            # checkpoint frame holds until the region's backward is done.
            if i > r.early_stop:
                for s in g.new[i]:
                    last[s] = max(last[s], hold.get(s, r.bw_end))
    a = g.arrays()
    idx = np.asarray(ran, dtype=np.int64)
    plus = a.alloc[idx]
    if r.saved:
        plus[[pos for pos, i in enumerate(ran) if i in r.saved]] = 0  # cached, not replayed
    for pos, casts in recast.items():
        plus[pos] += sum(g.sbytes[s] for s in casts)
    ws = a.ws[idx]
    if tail:  # the return's step: no op, no workspace, named after the last op
        idx = np.append(idx, idx[-1])
        plus = np.append(plus, 0)
        ws = np.append(ws, 0)
    minus = np.zeros(len(plus), dtype=np.int64)
    if frees:
        fpos: list[int] = []
        fst: list[int] = []
        for pos, fr in frees.items():
            fpos += [pos] * len(fr)
            fst += fr
        at = np.asarray(fpos, dtype=np.int64)
        inside = at < len(minus)
        np.add.at(minus, at[inside], a.sbytes[np.asarray(fst, dtype=np.int64)[inside]])
    for pos, b in extra:
        plus[pos] += b
        minus[-1] += b
    return _Replay(out, held, recompute_ms, (plus, minus, ws, -1 - idx),
                   sum(len(g.saves[i]) for i in r.own), tuple(extra),
                   (np.fromiter(held.keys(), np.int64, len(held)),
                    np.fromiter(held.values(), np.int64, len(held))))


def _span_reads(g, r: _Reg) -> tuple[dict[int, list[int]], list[tuple[int, int, int]],
                                     list[int], list[int], list[int], list[float]]:
    """What `_replay` needs of region `r`'s span whatever its early stop and nested regions,
    computed once per span and set of traced calls (`GraphIndex.span_reads`): for each storage
    the region makes, the positions in `r.nodes` of the nodes that read it (ascending);
    (storage, node after which the model's code drops it, that node's position in `r.nodes`)
    for those it drops; the storages its nodes make as two lists, position and storage, in
    the order the nodes make them; for each prefix of `r.nodes`, how many of those its nodes
    make, and the sum of their times (added up in node order, as `_replay` adds them).

    In a call running its traced code (`r.traced`) a value no later stage reads is dropped
    after the stage that reads it last (the generated code's `x = None`), not where the model's
    code did; what the code does not hold last (autocast's cached casts, what the model
    returns) is held by something else, as `_original_ends` has it."""
    key = (r.nodes[0], r.nodes[-1], tuple((c[0], c[1]) for c in r.traced))
    got = g.span_reads.get(key)
    if got is not None:
        return got
    produced = r.produced
    reads: dict[int, list[int]] = {}
    for pos, i in enumerate(r.nodes):
        for s in g.reads[i]:
            if s in produced:
                reads.setdefault(s, []).append(pos)
    fwd_read = g.last_forward_read() if r.traced else {}
    maker = g.arrays().maker
    rels: list[tuple[int, int, int]] = []
    for s in produced:
        rel = g.release.get(s)
        if rel is None:
            continue
        if r.traced and fwd_read.get(s, -1) <= r.nodes[-1] and s not in g.not_code_held:
            m = int(maker[s])
            n = max(fwd_read.get(s, -1), m)
            for ca, cb, firsts, lasts in r.traced:
                if ca <= m <= cb and ca <= rel <= cb:
                    k = bisect.bisect_right(firsts, n) - 1
                    rel = min(rel, lasts[k] if k >= 0 and n <= lasts[k] else n)
        rels.append((s, rel, bisect.bisect_right(r.nodes, rel) - 1))
    made_pos: list[int] = []
    made_s: list[int] = []
    made_cut = [0]
    time_upto = [0.0]
    for pos, i in enumerate(r.nodes):
        made_pos += [pos] * len(g.new[i])
        made_s += g.new[i]
        made_cut.append(len(made_s))
        time_upto.append(time_upto[-1] + g.time[i])
    if len(g.span_reads) >= MEMO_SIZE:
        g.span_reads.clear()
    got = g.span_reads[key] = (reads, rels, made_pos, made_s, made_cut, time_upto)
    return got


def _traced_calls(g, regions: tuple[Region, ...]) -> list[tuple[int, int, list[int], list[int]]]:
    """The calls of `GraphIndex.traced_calls` that run their traced code under `regions`: those
    with a region that is a run of their stages (inside the call, from a stage's first node to
    a stage's last; the whole call is a run only where the region says so, `Region.staged`)."""
    out: list[tuple[int, int, list[int], list[int]]] = []
    if not g.traced_calls:
        return out
    seen: set[int] = set()
    for r in regions:
        key = (r.start, r.end, r.module, r.staged)
        mine = g.traced_of.get(key)
        if mine is None:
            mine = []
            a, b = g.name_to_i[r.start], g.name_to_i[r.end]
            for t in g.traced_by_first.get(a, ()):
                ca, cb, _, lasts = g.traced_calls[t]
                if t in mine or not (ca <= a and b <= cb) or b not in lasts:
                    continue
                if r.module is not None and (r.module or r.staged):  # bound (`chain.bind`)
                    staged = bool(r.staged) and g.call_span.get(r.module) == (ca, cb)
                else:  # a span that is a module call is that call (`chain.candidate_calls`)
                    staged = (a, b) not in g.call_spans
                if staged:
                    mine.append(t)
            g.traced_of[key] = mine
        for t in mine:
            if t not in seen:
                seen.add(t)
                out.append(g.traced_calls[t])
    return out


def _original_ends(g, regs: list[_Reg], regions: tuple[Region, ...]) -> list[int]:
    """For every storage, the node index after which its original instance is freed (-1: no
    rule keeps it, `g.end`: the end of the step), before the regions' own rules; vectorized over
    the profile's (reader, storage) and (saver, storage) pairs (`GraphIndex.arrays`). `regions`
    are the schedule's, those that never replay included."""
    a = g.arrays()
    region_node = np.full(g.n, -1, dtype=np.int64)
    produced_in = np.full(len(g.sbytes), -1, dtype=np.int64)
    for k, r in enumerate(regs):
        if r.parent < 0:
            nodes, produced, _ = _span_arrays(g, r.nodes[0], r.nodes[-1])
            region_node[nodes] = k
            produced_in[produced] = k
    last = np.full(len(g.sbytes), -1, dtype=np.int64)
    # The last reader; a backward op reads the replay's copy of what its outermost region made.
    k = np.where(a.read_gradof >= 0, region_node[a.read_gradof], -1)
    keep = ~((k >= 0) & (k == produced_in[a.read_storage]))
    if g.autocast_casts:  # a region's backward reads its replay's own cast of a parameter
        cast = np.zeros(len(g.sbytes), dtype=bool)
        cast[list(g.autocast_casts)] = True
        keep &= ~((k >= 0) & cast[a.read_storage])
    np.maximum.at(last, a.read_storage[keep], a.read_node[keep])
    # Held by the model's code beyond its last reader; in a call that runs its traced code (a
    # run of its stages is a region), by the generated code, which drops a value after the
    # stage that reads it last (a stage: one call of the traced forward, a child module's or a
    # function's), where the model's own forward may have kept it in a local for longer.
    release = a.release
    for ca, cb, firsts, lasts in _traced_calls(g, regions):
        release = release.copy() if release is a.release else release
        made = np.flatnonzero((a.maker >= ca) & (a.maker <= cb) & (release >= ca)
                              & (release <= cb) & ~a.not_code_held)
        if not len(made):
            continue
        # the last reader, a stage passed it (`GraphIndex.stage_passed`), or the maker
        r = np.maximum(np.maximum(last[made], a.stage_passed[made]), a.maker[made])
        k = np.searchsorted(firsts, r, side="right") - 1  # the stage it is in, if any
        stage_last = np.asarray(lasts, dtype=np.int64)[np.maximum(k, 0)]
        end = np.where((k >= 0) & (r <= stage_last), stage_last, r)
        release[made] = np.minimum(release[made], end)
    np.maximum(last, release, out=last)
    last[a.persist] = g.end  # the loss and parameter gradients
    # Where the profile did not see a backward temporary die (a graph profile), it lives until
    # its formula returns: a C++ formula frees its temporaries no later than that (a custom
    # Function's Python backward frees them at their last use). A recorded step saw each die,
    # often sooner: at the end of the statement that made it (DivBackward's `-grad * (a / b) / b`
    # frees three before it computes the other input's gradient).
    np.maximum(last, np.where((last >= 0) & (a.release < 0), a.formula_end, -1), out=last)
    # Saved by an op outside any region: kept until its backward ran.
    out = region_node[a.save_node] < 0
    np.maximum.at(last, a.save_storage[out], a.save_end[out])
    # Saved by an op that never runs backward (its output does not reach the loss): kept while
    # its autograd node lives, unless a checkpoint (any region, replayed or not) packed it.
    if len(a.dead_save_node):
        inside = np.zeros(g.n, dtype=bool)
        for r in regions:
            inside[g.name_to_i[r.start]:g.name_to_i[r.end] + 1] = True
        out = ~inside[a.dead_save_node]
        np.maximum.at(last, a.dead_save_storage[out], a.dead_save_end[out])
    # A region's call keeps its tensor arguments until it returns (checkpoint's frames hold
    # them), past their last reader: a run of traced stages or of a Sequential's children is
    # a call the model's own code does not make.
    for r in regions:
        i, j = g.name_to_i[r.start], g.name_to_i[r.end]
        span = g.spans.get((i, j))
        if span is None or not span[0]:
            continue
        inputs = _span_arrays(g, i, j)[2]
        last[inputs] = np.maximum(last[inputs], span[0][-1])
    return last.tolist()


def _span_arrays(g, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The forward nodes of span (a, b) of `GraphIndex.spans`, the storages they make, and
    the storages they read from outside but the fixed ones, as arrays (computed once)."""
    got = g.span_arrays.get((a, b))
    if got is None:
        nodes, made, inputs = g.spans[(a, b)][:3]
        got = g.span_arrays[(a, b)] = (
            np.asarray(nodes, dtype=np.int64),
            np.fromiter(made, np.int64, len(made)),
            np.asarray([s for s in inputs if s not in g.fixed_storages], dtype=np.int64))
    return got


def _sweep(g, last: list[int], held: tuple[np.ndarray, np.ndarray],
           replay_at: dict[int, list[int]],
           replay_ops: dict[int, _Replay],
           replay_freed: set[int], extra_alloc: dict[int, int], extra_free: dict[int, int],
           recompute_ms: float, after_replay: dict[int, list[int]]) -> Simulation:
    """The peak of the step as `_simulate`'s op-by-op sweep finds it, with arrays: every step
    (a replayed op, or an op of the step) allocates, is checked against the peak with its
    workspace, then frees."""
    a = g.arrays()
    sb = a.sbytes
    last_a = np.asarray(last, dtype=np.int64)
    frees = np.zeros(g.n + 1, dtype=np.int64)  # index g.n: the end of the step (never freed)
    live = last_a >= 0
    np.add.at(frees, last_a[live], sb[live])
    if len(held[0]):  # replay copies kept for backward: (storages, the node each dies at)
        np.add.at(frees, held[1], sb[held[0]])
    once = (last_a < 0) & (a.maker >= 0)  # nobody reads it: freed after the op that made it
    if replay_freed:
        once[list(replay_freed)] = False
    np.add.at(frees, a.maker[once], sb[once])
    plus = a.alloc.copy()
    for i, b in extra_alloc.items():
        plus[i] += b
    for i, b in extra_free.items():
        frees[i] += b
    frees = frees[:g.n]
    frees[a.is_fixed] = 0  # placeholders are fixed memory, counted apart
    # Steps in order: at each trigger, the replays (a parent's first), then the op itself.
    parts_plus, parts_free, parts_ws, parts_id = [], [], [], []
    prev = 0
    for t in sorted(replay_at):
        parts_plus.append(plus[prev:t])
        parts_free.append(frees[prev:t])
        parts_ws.append(a.ws[prev:t])
        parts_id.append(np.arange(prev, t))
        for k in replay_at[t]:  # ids -1 - j: a replay of node j
            rp, rf, rw, ri = replay_ops[k].arrays
            parts_plus.append(rp)
            parts_free.append(rf)
            parts_ws.append(rw)
            parts_id.append(ri)
            if k in after_replay:  # a step that only frees: never above the step before it
                parts_plus.append(np.zeros(1, np.int64))
                parts_free.append(np.array([int(sb[after_replay[k]].sum())], np.int64))
                parts_ws.append(np.zeros(1, np.int64))
                parts_id.append(np.array([-1 - t], np.int64))
        prev = t
    parts_plus.append(plus[prev:])
    parts_free.append(frees[prev:])
    parts_ws.append(a.ws[prev:])
    parts_id.append(np.arange(prev, g.n))
    p_ = np.concatenate(parts_plus)
    f_ = np.concatenate(parts_free)
    w_ = np.concatenate(parts_ws)
    ids = np.concatenate(parts_id)
    after = np.cumsum(p_ - f_)
    cand = after + f_ + w_  # live after allocating, plus the op's workspace
    cand[(ids >= 0) & a.is_fixed[np.maximum(ids, 0)]] = np.iinfo(np.int64).min  # placeholders
    peak, peak_at = 0, ""
    if len(cand):
        at = int(np.argmax(cand))
        if cand[at] > 0:
            peak = int(cand[at])
            j = int(ids[at])
            peak_at = g.names[j] if j >= 0 else f"replay:{g.names[-1 - j]}"
    mem = int(after[-1]) if len(after) else 0
    at_fwd_end = np.flatnonzero(ids == g.fwd_end) if g.fwd_end >= 0 else ()
    after_forward = int(after[at_fwd_end[0]]) if len(at_fwd_end) else 0
    if g.has_optimizer and mem + g.optimizer_step_bytes > peak:
        peak, peak_at = mem + g.optimizer_step_bytes, "optimizer.step"
    return Simulation(peak_bytes=peak + g.fixed_bytes, recompute_ms=recompute_ms,
                      peak_at=peak_at, after_forward_bytes=after_forward)


def unsplittable_at_peak(p: Profile, schedule: Schedule | tuple[Region, ...] = ()
                         ) -> list[tuple[str, int, str]]:
    """Forward activations kept at the peak of `schedule` that no region can recompute, by the
    module whose own code (not a submodule call) made them: (module, bytes, why), largest
    first. Regions are module calls, or runs of a traced forward (`ModuleCall.staged`); the ops
    of a forward that did not trace, of a module no region may wrap (the root, or a call with
    a `ModuleCall.blocker`), can only be recomputed with a module call around them."""
    sim = _simulate(p, schedule.regions if isinstance(schedule, Schedule) else tuple(schedule),
                    timeline=True)
    g = graph_index(p)
    maker: dict[int, int] = {}
    for i in g.forward:
        for s in g.new[i]:
            maker[s] = i
    calls: dict[str, list] = {}
    for c in p.calls:
        calls.setdefault(c.module, []).append(c)
    out: dict[str, list] = {}
    for s, replayed in sim.peak_live:
        i = maker.get(s, -1)
        if replayed or i < 0 or s in g.fixed_storages:
            continue
        m = p.nodes[i].module
        cs = calls.get(m, [])
        if not cs or any(c.staged for c in cs):
            continue
        if m == "":
            why = "its forward does not trace with torch.fx, so it cannot be cut into runs"
        elif any(c.blocker for c in cs):
            why = next(c.blocker for c in cs if c.blocker)
        else:
            continue
        out.setdefault(m, [0, why])[0] += g.sbytes[s]
    return sorted(((m, b, why) for m, (b, why) in out.items()), key=lambda t: -t[1])


def peak_breakdown(p: Profile, schedule: Schedule | tuple[Region, ...] = (),
                   depth: int = 3) -> list[tuple[str, int]]:
    """What the peak of `schedule` is made of, largest first: ``fixed`` (parameters, buffers,
    inputs, optimizer state), the op's workspace, and live storages grouped by where they come
    from: ``<module>`` for forward activations kept (module path cut to `depth` components),
    ``recomputed in <module>`` for a replay's copies, ``loss`` for what the loss function made
    (the logits' log-softmax), ``parameter gradients``, and ``backward of <module>`` for the
    gradients and temporaries of that module's backward."""
    sim = _simulate(p, schedule.regions if isinstance(schedule, Schedule) else tuple(schedule),
                    timeline=True)
    g = graph_index(p)
    maker: dict[int, int] = {}
    for i in range(g.n):
        for s in g.new[i]:
            maker[s] = i
    grads = set(g.persist)

    def cut(module: str) -> str:
        return ".".join(module.split(".")[:depth]) or "(top level)"

    parts: dict[str, int] = {"fixed": g.fixed_bytes}
    if sim.peak_workspace_bytes:
        parts["workspace of the op at the peak"] = sim.peak_workspace_bytes
    for s, replayed in sim.peak_live:
        i = maker.get(s, -1)
        phase = g.phase[i] if i >= 0 else "backward"
        if replayed:
            key = f"recomputed in {cut(p.nodes[i].module)}"
        elif phase == "forward":
            key = cut(p.nodes[i].module)
        elif phase == "backward" and s in grads:
            key = "parameter gradients"
        elif phase == "backward" and g.grad_of[i] >= 0:
            key = f"backward of {cut(p.nodes[g.grad_of[i]].module)}"
        else:
            key = phase
        parts[key] = parts.get(key, 0) + g.sbytes[s]
    return sorted(parts.items(), key=lambda kv: -kv[1])
