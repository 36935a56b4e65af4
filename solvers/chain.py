"""The forward chain: the vocabulary that the simulator, the baselines, dp and ilp share.

A schedule's region is a range of forward nodes, written here in forward positions (indices into
`GraphIndex.forward`). This module says where a region may start and end (repeated blocks and the
units the baselines use, candidate cut points, and on a recorded profile the module calls a
region may be), what replaying it runs (the early stop), which op outputs a selective policy keeps
(`is_matmul`), and where a storage is first saved for backward (`first_savers`). Everything it
derives from a profile is computed once per profile (`solvers.profile.cached`).

On a profile recorded by running the step (``meta.capture == "run"``), `planner.apply` can only
checkpoint a module's `forward`, so the regions a solver may choose are the profile's module calls
that have no blocker (`candidate_calls`), and the calls of a module called more than once all
together (`shared_calls`); `bind` gives each region the module it wraps and what the applier
needs.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from solvers.errors import ScheduleError
from solvers.graph import graph_index
from solvers.profile import COLLECTIVE_PREFIX, ModuleCall, Profile, cached
from solvers.schedule import Region, Schedule, policy_op

__all__ = [
    "MATMUL_OPS",
    "MAX_CUTS",
    "MAX_CUTS_PER_BLOCK",
    "Block",
    "CallSpan",
    "applicable",
    "bind",
    "block_spans",
    "blocks",
    "candidate_calls",
    "cut_points",
    "early_stops",
    "first_savers",
    "in_place",
    "is_matmul",
    "live_bytes_across",
    "matmul_mask",
    "matmul_positions",
    "region",
    "selective_region",
    "shared_calls",
    "shared_modules",
    "storage_positions",
    "units",
    "useful",
    "useful_calls",
    "valid_cuts",
]


# -- regions over forward positions ----------------------------------------------------------------
def region(profile: Profile, a: int, b: int, saved: tuple[str, ...] = ()) -> Region:
    """The region over forward positions a..b (inclusive), as node names."""
    names = graph_index(profile).forward_names
    return Region(start=names[a], end=names[b], saved=saved)


# -- op classes ------------------------------------------------------------------------------------
MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_")
"""Ops whose outputs torchtitan's selective policy saves (op name after ``aten.``, prefix match for
the SDPA kernels); `cut_points` can also cut after each of them."""


def is_matmul(op: str) -> bool:
    """A profile op name (``aten.addmm.default``) is one of `MATMUL_OPS`."""
    name = op.split(".")[1] if op.startswith("aten.") else op
    return any(name == m or (m.endswith("_") and name.startswith(m)) for m in MATMUL_OPS)


def matmul_mask(profile: Profile) -> tuple[bool, ...]:
    """Per forward position: the op is matmul-class (`is_matmul`) and no later forward op writes
    its output in place. Selective checkpointing keeps such an output from forward for the
    replay, and refuses one written since ("Tensor cached during selective activation
    checkpoint has been mutated": HF Longformer's sliding-window scores, filled in place)."""
    return cached(profile, "matmul_mask", _matmul_mask)


def _writes_in_place(nd) -> bool:
    """The node writes its output storage (`Node.storage`) in place: an in-place op (name
    ending in ``_``) or an ``out=`` overload, buffer updates (BatchNorm's) left out."""
    parts = nd.op.split(".")
    name = parts[1] if len(parts) > 1 else nd.op
    return (name.endswith("_") or parts[-1] == "out") and not nd.mutates_buffer \
        and nd.storage is not None


def _matmul_mask(profile: Profile) -> tuple[bool, ...]:
    g = graph_index(profile)
    written: dict[int, int] = {}  # storage -> the last forward position writing it in place
    for k, i in enumerate(g.forward):
        if _writes_in_place(profile.nodes[i]):
            written[profile.nodes[i].storage] = k
    return tuple(is_matmul(profile.nodes[i].op)
                 and all(written.get(s, -1) <= k for s in g.new[i])
                 for k, i in enumerate(g.forward))


def matmul_positions(profile: Profile, a: int, b: int) -> list[int]:
    """Forward positions of the matmul-class ops in a..b (inclusive)."""
    mask = matmul_mask(profile)
    return [k for k in range(a, b + 1) if mask[k]]


def selective_region(profile: Profile, a: int, b: int) -> Region:
    """The region over forward positions a..b that keeps every matmul-class output from forward
    (torchtitan's selective op policy) but those written in place later (`matmul_mask`): its
    replay recomputes only the other ops."""
    names = graph_index(profile).forward_names
    return region(profile, a, b, tuple(names[k] for k in matmul_positions(profile, a, b)))


# -- what a replay runs and what the chain holds ---------------------------------------------------
def early_stops(profile: Profile) -> tuple[int, ...]:
    """stop[b]: forward position of the last op that the replay of a region ending at forward
    position b runs. A region a..b replays ops a..stop[b] when stop[b] >= a, and nothing else.

    Non-reentrant checkpoint stops a replay as soon as the region's last saving op has packed
    what it saves (early stop). Ops pack their saved inputs before they compute and their saved
    outputs after, so a last saver that saves only its inputs (mm saving its operands, mul saving
    a dropout mask) is not computed: the stop is the op before it. Every op before the stop is
    replayed, even ops that only feed saved ones.
    """
    return cached(profile, "early_stops", _early_stops)


def _early_stops(profile: Profile) -> tuple[int, ...]:
    g = graph_index(profile)
    stop = []
    cur = -1
    for k, i in enumerate(g.forward):
        if g.saves[i]:
            cur = k if set(g.saves[i]) & set(g.new[i]) else k - 1
        stop.append(cur)
    return tuple(stop)


def first_savers(profile: Profile) -> dict[int, int]:
    """Storage -> forward position of the first op whose autograd node saves it, for storages
    that are not fixed memory: a chain kept whole holds the storage for backward from there."""
    return cached(profile, "first_savers", _first_savers)


def _first_savers(profile: Profile) -> dict[int, int]:
    g = graph_index(profile)
    q1: dict[int, int] = {}
    for k, i in enumerate(g.forward):
        for s in g.saves[i]:
            if s not in g.fixed_storages and s not in q1:
                q1[s] = k
    return q1


def storage_positions(profile: Profile) -> tuple[dict[int, int], dict[int, list[int]]]:
    """For the storages forward ops make: the forward position of the producer, and the forward
    positions that read each (non-fixed) storage, ascending."""
    return cached(profile, "storage_positions", _storage_positions)


def _storage_positions(profile: Profile) -> tuple[dict[int, int], dict[int, list[int]]]:
    g = graph_index(profile)
    prod: dict[int, int] = {}
    readers: dict[int, list[int]] = defaultdict(list)
    for k, i in enumerate(g.forward):
        for s in g.new[i]:
            prod[s] = k
        for s in g.reads[i]:
            readers[s].append(k)
    return prod, dict(readers)


# -- repeated blocks and the baselines' units ------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Block:
    """One instance of a repeated module (``transformer.h.3``), as a range of forward nodes."""

    name: str
    start: int
    """Profile node index of the block's first forward node."""
    end: int
    """Profile node index of the block's last forward node (inclusive)."""


def blocks(profile: Profile) -> tuple[Block, ...]:
    """Repeated module instances, in forward order.

    A prefix qualifies when it has at least two integer children (``layers.0``, ``layers.1``) of
    which at least two run the same sequence of ops (so ``stem.0/1/2`` = conv, bn, relu does not).
    Prefixes are taken greedily by how many forward nodes they cover, skipping any nested inside (or
    containing) one already taken: a GPT gives ``transformer.h.*``; a ResNet gives the instances of
    every ``layerN.*``, not only of the largest stage. Instances whose node ranges overlap an earlier
    one (ops interleaved across instances) are skipped.
    """
    return cached(profile, "blocks", _blocks)


def _blocks(profile: Profile) -> tuple[Block, ...]:
    g = graph_index(profile)
    children: dict[str, set[str]] = defaultdict(set)
    members: dict[str, list[int]] = defaultdict(list)  # instance path -> forward node indices
    for i in g.forward:
        parts = profile.nodes[i].module.split(".") if profile.nodes[i].module else []
        for k, part in enumerate(parts):
            if part.isdigit():
                prefix = ".".join(parts[:k])
                children[prefix].add(part)
                members[".".join(parts[: k + 1])].append(i)

    def inst_of(pre: str) -> list[str]:
        return [f"{pre}.{c}" if pre else c for c in children[pre]]

    def repeated(pre: str) -> bool:  # two instances run the same sequence of ops
        sigs = [tuple(profile.nodes[i].op for i in members[m]) for m in inst_of(pre)]
        return len(set(sigs)) < len(sigs)

    qualified = [pre for pre, ch in children.items() if len(ch) >= 2 and repeated(pre)]

    cover = {pre: sum(len(members[m]) for m in inst_of(pre)) for pre in qualified}
    taken: list[str] = []

    def nested(a: str, b: str) -> bool:  # is prefix a inside an instance of prefix b, or b in a?
        return any(a.startswith(m + ".") or a == m for m in inst_of(b)) or any(
            b.startswith(m + ".") or b == m for m in inst_of(a)
        )

    for pre in sorted(qualified, key=lambda p: (-cover[p], p)):
        if not any(nested(pre, t) for t in taken):
            taken.append(pre)
    spans = []
    for pre in taken:
        for inst in inst_of(pre):
            idx = members[inst]
            spans.append((min(idx), max(idx), inst))
    spans.sort()
    out: list[Block] = []
    for a, b, name in spans:
        if out and a <= out[-1].end:
            continue
        out.append(Block(name=name, start=a, end=b))
    return tuple(out)


def block_spans(profile: Profile) -> tuple[tuple[int, int], ...]:
    """The repeated blocks as forward-position ranges (first, last), in forward order."""
    pos = graph_index(profile).fwd_pos
    return tuple((pos[b.start], pos[b.end]) for b in blocks(profile))


def units(profile: Profile) -> tuple[tuple[int, int], ...]:
    """The baselines' units, forward-position ranges: the repeated blocks; where fewer than two
    blocks repeat, the segments between consecutive candidate cut points. On a recorded profile a
    unit must be a module call that can be checkpointed: the repeated blocks that are, else the
    outermost candidate calls below the root, in order."""
    return cached(profile, "units", _units)


def _units(profile: Profile) -> tuple[tuple[int, int], ...]:
    spans = block_spans(profile)
    if in_place(profile):
        calls = candidate_calls(profile)
        allowed = {(s.a, s.b) for s in calls}
        spans = tuple(sp for sp in spans if sp in allowed)
        if len(spans) >= 2:
            return spans
        out: list[tuple[int, int]] = []
        for s in sorted(calls, key=lambda s: (s.a, -s.b)):
            is_root = s.call.module == "" and s.segment is None
            if not is_root and (not out or s.a > out[-1][1]):
                out.append((s.a, s.b))
        return tuple(out)
    if len(spans) >= 2:
        return spans
    g = graph_index(profile)
    cuts = [g.fwd_pos[i] for i in cut_points(profile)]
    bounds = [-1, *cuts, len(g.forward) - 1]
    return tuple((bounds[k] + 1, bounds[k + 1]) for k in range(len(bounds) - 1))


# -- candidate cut points --------------------------------------------------------------------------
# A cut "after forward position k" is a boundary between two consecutive forward nodes; regions
# start just after one cut and end on another. A cut is cheap when few bytes are live across it (a
# checkpointed region keeps its inputs, which are exactly what crosses its first cut), and it is
# valid when no in-place op after it mutates a storage produced before it: the region that holds
# the in-place op would replay the mutation on a tensor it does not own.

MAX_CUTS = 200
"""At most this many candidate cuts overall (block boundaries always kept)."""
MAX_CUTS_PER_BLOCK = 4
"""At most this many live-bytes minima inside one block."""


def live_bytes_across(profile: Profile) -> tuple[int, ...]:
    """For every forward position k, the bytes of non-fixed storages produced at or before forward
    node k and read by a forward node after it (what a region starting at k + 1 would keep)."""
    return cached(profile, "live_bytes_across", _live_bytes_across)


def _live_bytes_across(profile: Profile) -> tuple[int, ...]:
    g = graph_index(profile)
    n = len(g.forward)
    diff = np.zeros(n + 1, dtype=np.int64)
    prod, readers = storage_positions(profile)
    for s, p in prod.items():
        r = readers.get(s)
        if r and r[-1] > p:
            diff[p] += g.sbytes[s]
            diff[r[-1]] -= g.sbytes[s]
    return tuple(np.cumsum(diff)[:n].tolist())


def valid_cuts(profile: Profile) -> tuple[bool, ...]:
    """valid[k]: a region boundary after forward position k does not split an op that writes in
    place (`_writes_in_place`: buffer updates such as BatchNorm's are ignored) from the producer
    of the storage it writes."""
    return cached(profile, "valid_cuts", _valid_cuts)


def _valid_cuts(profile: Profile) -> tuple[bool, ...]:
    g = graph_index(profile)
    n = len(g.forward)
    prod, _ = storage_positions(profile)
    diff = np.zeros(n + 1, dtype=np.int64)
    for k, i in enumerate(g.forward):
        nd = profile.nodes[i]
        if not _writes_in_place(nd):
            continue
        s = nd.storage
        if s in g.fixed_storages or s not in prod:
            continue
        if prod[s] < k:  # cuts prod[s] .. k-1 separate the producer from the mutation
            diff[prod[s]] += 1
            diff[k] -= 1
    bad = np.cumsum(diff)[:n]
    return tuple(bool(b == 0) for b in bad)


def cut_points(profile: Profile, *, matmul_cuts: bool = False) -> tuple[int, ...]:
    """Profile node indices of forward nodes after which a region boundary is allowed and cheap.

    Valid block boundaries always; then local minima of `live_bytes_across` (all of a flat one),
    lowest first, at most `MAX_CUTS_PER_BLOCK` inside a block; then, with `matmul_cuts`, a cut
    after every matmul/convolution (`is_matmul`), in forward order; `MAX_CUTS` overall. The chain's
    start and end are implicit (not listed).

    Matmul cuts let a plan recompute the cheap ops between two matmuls (a LayerNorm and the
    matmul that reads it, a GELU and the matmul after it) as plain regions of their own, which
    keeps the matmul outputs without a selective region's per-op dispatch cost. The solvers use
    them; the baselines' units do not (they are defined on the blocks and live-bytes minima).
    """
    key = "cut_points+matmul" if matmul_cuts else "cut_points"
    return cached(profile, key, lambda p: _cut_points(p, matmul_cuts))


def _cut_points(profile: Profile, matmul_cuts: bool) -> tuple[int, ...]:
    g = graph_index(profile)
    n = len(g.forward)
    if n <= 1:
        return ()
    live = live_bytes_across(profile)
    valid = valid_cuts(profile)
    chosen: set[int] = set()
    block_of = [-1] * n
    for b_i, (a, e) in enumerate(block_spans(profile)):
        for k in range(a, e + 1):
            block_of[k] = b_i
        for k in (a - 1, e):
            if 0 <= k < n - 1 and valid[k]:
                chosen.add(k)
    # Local minima over valid positions, one per plateau of equal live bytes (its last position).
    inf = float("inf")
    val = [live[k] if valid[k] else inf for k in range(n - 1)]
    minima: list[int] = []
    k = 0
    while k < n - 1:
        j = k
        while j + 1 < n - 1 and val[j + 1] == val[k]:
            j += 1
        left = val[k - 1] if k > 0 else inf
        right = val[j + 1] if j + 1 < n - 1 else inf
        if val[k] < inf and val[k] <= left and val[k] <= right:
            minima.extend(range(k, j + 1))  # a flat minimum: every position is as cheap
        k = j + 1
    per_block: dict[int, int] = defaultdict(int)
    for k in sorted(minima, key=lambda k: (live[k], k)):
        if len(chosen) >= MAX_CUTS:
            break
        if k in chosen:
            continue
        b_i = block_of[k]
        if b_i >= 0 and per_block[b_i] >= MAX_CUTS_PER_BLOCK:
            continue
        per_block[b_i] += 1
        chosen.add(k)
    if matmul_cuts:
        mask = matmul_mask(profile)
        for k in range(n - 1):
            if len(chosen) >= MAX_CUTS:
                break
            if valid[k] and mask[k]:
                chosen.add(k)
    return tuple(g.forward[k] for k in sorted(chosen))


# -- module calls (recorded profiles) --------------------------------------------------------------
def in_place(profile: Profile) -> bool:
    """Regions of this profile are module calls applied in place (a recorded profile), rather than
    node ranges of a traced graph."""
    return profile.meta.capture == "run"


def applicable(schedule: Schedule | Iterable[Region]) -> bool:
    """Every region is a module call (or there is none): `planner.apply` can put the schedule onto
    the model's own modules. Regions get their module from `bind`."""
    regions = schedule.regions if isinstance(schedule, Schedule) else schedule
    return all(r.module is not None for r in regions)


@dataclass(frozen=True)
class CallSpan:
    """A region a plan applied in place can checkpoint, as forward positions (indices into the
    profile's forward nodes): one module call, or a run of an `nn.Sequential`'s children."""

    call: ModuleCall
    """The module call (for a segment: the Sequential's)."""
    a: int
    """Forward position of the span's first node."""
    b: int
    """Forward position of the span's last node (inclusive)."""
    segment: tuple[int, int] | None = None
    """Children `segment[0]..segment[1]` of the Sequential `call.module`; None: the whole call."""
    buffers: tuple[str, ...] = ()
    """Buffers updated in place inside the span."""
    restores: tuple[str, ...] = ()
    """Those of `buffers` read again after their update inside one call (`ModuleCall.restores`)."""
    staged: str = ""
    """For a run of a staged call's stages: the call's `ModuleCall.staged`; the segment is then
    a range of the trace's node positions."""


def candidate_calls(profile: Profile) -> tuple[CallSpan, ...]:
    """The spans a region may be: module calls with no blocker, and runs of two or more
    consecutive children of an `nn.Sequential` none of which is blocked. Where several span the
    same nodes (a module whose forward only calls its child), the outermost whole call."""
    return cached(profile, "candidate_calls", _candidate_calls)


def _candidate_calls(profile: Profile) -> tuple[CallSpan, ...]:
    pos = graph_index(profile).position
    by_module = {c.module: c for c in profile.calls}
    shared = shared_modules(profile)
    seen: set[tuple[int, int]] = set()
    out = []
    segments = []
    for c in profile.calls:  # ordered by start, outer first
        if c.module in shared:  # only all its calls together (`shared_calls`)
            continue
        a, b = pos(c.start), pos(c.end)
        if not c.blocker and (a, b) not in seen:
            seen.add((a, b))
            out.append(CallSpan(c, a, b, None, c.buffers, restores=c.restores))
        if c.children:
            segments.extend(_segments(profile, c, by_module))
        elif c.stages and not c.blocker:
            segments.extend(_stage_spans(profile, c))
    for span in segments:
        if (span.a, span.b) not in seen:
            seen.add((span.a, span.b))
            out.append(span)
    out = [s for s in out if not _holds_collective(profile, s) and not _stops_unfilled(profile, s)]
    out.sort(key=lambda s: (s.a, -s.b))
    return tuple(out)


def _stops_unfilled(profile: Profile, span: CallSpan) -> bool:
    """Whether the span's replay stops right before an op that saves only tensors it was given
    and fills one of them in place (`Node.fills_saved`, RReLU's noise): the early stop packs the
    tensor unwritten, and backward gets other values (pytorch/pytorch#193671)."""
    g = graph_index(profile)
    stop = early_stops(profile)[span.b]
    last = stop + 1  # the span's last saver, when the stop is the op before it
    if stop < span.a - 1 or last > span.b:
        return False
    node = profile.nodes[g.forward[last]]
    return node.fills_saved and bool(node.saves) and not set(node.saves) & set(g.new[g.forward[last]])


def _holds_collective(profile: Profile, span: CallSpan) -> bool:
    """Under FSDP (`solvers.distributed`) no region may hold a unit's all-gather or reshard."""
    coll = cached(profile, "collective_positions", lambda p: [
        k for k, i in enumerate(graph_index(p).forward)
        if p.nodes[i].op.startswith(COLLECTIVE_PREFIX)])
    return bisect.bisect_left(coll, span.a) != bisect.bisect_right(coll, span.b)


def shared_modules(profile: Profile) -> frozenset[str]:
    """Modules called more than once in the step (a layer whose weights are shared across depth,
    as ALBERT's): one wrapper checkpoints every call, so their calls are never candidates alone."""
    return cached(profile, "shared_modules", lambda p: frozenset(
        m for m, n in Counter(c.module for c in p.calls).items() if n > 1))


def shared_calls(profile: Profile) -> tuple[tuple[CallSpan, ...], ...]:
    """For each module called more than once whose calls can be regions (none blocked, none
    inside another, none holding an FSDP collective): its calls' spans, which are regions only
    all together. Where the calls span the same nodes as an outer module's (a module whose
    forward only calls its child), the outer module's."""
    return cached(profile, "shared_calls", _shared_calls)


def _shared_calls(profile: Profile) -> tuple[tuple[CallSpan, ...], ...]:
    pos = graph_index(profile).position
    shared = shared_modules(profile)
    by_module: dict[str, list[ModuleCall]] = {}
    for c in profile.calls:  # ordered by start, outer first
        if c.module in shared:
            by_module.setdefault(c.module, []).append(c)
    seen: set[tuple[tuple[int, int], ...]] = set()
    out = []
    for calls in by_module.values():
        if any(c.blocker for c in calls):
            continue
        spans = tuple(CallSpan(c, pos(c.start), pos(c.end), None, c.buffers, restores=c.restores)
                      for c in calls)
        key = tuple((s.a, s.b) for s in spans)
        if key in seen or any(s.b >= t.a for s, t in zip(spans, spans[1:], strict=False)) \
                or any(_holds_collective(profile, s) or _stops_unfilled(profile, s)
                       for s in spans):
            continue
        seen.add(key)
        out.append(spans)
    return tuple(out)


def _segments(profile: Profile, c: ModuleCall, by_module: dict[str, ModuleCall]
              ) -> list[CallSpan]:
    """Runs of two or more consecutive children of Sequential call `c` that can be one region:
    every child in the run unblocked (a child without ops, an Identity, has no call and is
    fine inside a run), the first and last with ops.

    A child's call spans its `forward`; a segment runs ``child(input)``, its hooks too. Ops
    between two children's calls (or before the first, after the last) are hooks' (old-style
    ``torch.nn.utils.spectral_norm`` and ``weight_norm`` compute the weight in a forward
    pre-hook), which a run starting or ending there would hold at run time but not in the span:
    no run starts after, or ends before, such ops."""
    pos = graph_index(profile).position
    kids: list[ModuleCall | None] = []
    lo, hi = pos(c.start), pos(c.end)
    for name in c.children:
        kc = by_module.get(f"{c.module}.{name}" if c.module else name)
        if kc is not None and not lo <= pos(kc.start) <= pos(kc.end) <= hi:
            kc = None  # not called inside this call
        kids.append(kc)
    spans = [(k, pos(kc.start), pos(kc.end)) for k, kc in enumerate(kids) if kc is not None]
    hooked_before: set[int] = set()  # children with ops right before their call
    hooked_after: set[int] = set()  # ... right after it
    for n, (k, a, b) in enumerate(spans):
        if a - (spans[n - 1][2] if n else lo - 1) > 1:
            hooked_before.add(k)
        if (spans[n + 1][1] if n + 1 < len(spans) else hi + 1) - b > 1:
            hooked_after.add(k)
    out = []
    for i, first in enumerate(kids):
        if first is None or first.blocker or i in hooked_before:
            continue
        buffers, restores = set(first.buffers), set(first.restores)
        for j in range(i + 1, len(kids)):
            kc = kids[j]
            if kc is None:
                continue
            if kc.blocker:
                break
            buffers |= set(kc.buffers)
            restores |= set(kc.restores)
            if j in hooked_after:
                continue
            out.append(CallSpan(c, pos(first.start), pos(kc.end), (i, j), tuple(sorted(buffers)),
                                restores=tuple(sorted(restores))))
    return out


MAX_STAGE_STARTS = 128
"""At most this many stages of one staged call start runs (`_stage_spans`). A forward that loops
in Python over thousands of small ops (pykan's symbolic layer) would otherwise offer millions of
runs; past this many, runs start at stages spaced by the bytes their ops allocate, and end where
a kept start begins or at their limit."""


def _stage_spans(profile: Profile, c: ModuleCall) -> list[CallSpan]:
    """Runs of consecutive stages of a staged call (`planner.stages`) that can be one region:
    within the stage's limit, and not the whole call (that is the call's own span). A stage that
    allocates nothing (views, reshapes) joins the stage after it: a run starting or ending at it
    keeps and replays the same bytes as the run moved to the next allocating stage. Runs start
    at no more than `MAX_STAGE_STARTS` stages."""
    g = graph_index(profile)
    pos = g.position
    n = len(c.stages)
    starts = [pos(x) for x in c.stages]
    lasts = [pos(x) for x in c.stage_last]
    made = [sum(g.sbytes[s] for k in range(a, b + 1) for s in g.new[g.forward[k]])
            for a, b in zip(starts, lasts, strict=True)]
    allocates = [any(g.new[g.forward[k]] for k in range(a, b + 1))
                 for a, b in zip(starts, lasts, strict=True)]
    within = [(pos(k.start), pos(k.end), k.buffers) for k in profile.calls
              if k.buffers and starts[0] <= pos(k.start) and pos(k.end) <= lasts[-1]]
    kept, coarse = stage_starts(made, allocates)
    out = []
    for i in kept:
        limit = c.stage_limits[i]
        ends = (sorted({k - 1 for k in kept if i < k <= limit + 1} | {limit}) if coarse
                else range(i, limit + 1))
        for j in ends:
            if j < i or (j + 1 < n and not allocates[j + 1]):
                continue
            a, b = starts[i], lasts[j]
            buffers = sorted({x for ka, kb, bs in within if a <= ka and kb <= b for x in bs})
            out.append(CallSpan(c, a, b, (c.stage_nodes[i], c.stage_nodes[j + 1] - 1),
                                tuple(buffers), staged=c.staged))
    return out


def stage_starts(made: list[int], allocates: list[bool]) -> tuple[list[int], bool]:
    """The stages runs may start at, and whether they are fewer than every one a run could start
    at: the first and every stage that allocates, or where those are more than
    `MAX_STAGE_STARTS`, the first and the allocating stages at which the bytes allocated before
    them pass each of `MAX_STAGE_STARTS` equal steps."""
    every = [0] + [i for i in range(1, len(made)) if allocates[i]]
    if len(every) <= MAX_STAGE_STARTS:
        return every, False
    weight = [m + 1 for m in made]  # a byte more per stage: stages of empty storages count too
    step = sum(weight) / MAX_STAGE_STARTS
    out, before, nxt = [0], 0, step
    for i in range(1, len(made)):
        before += weight[i - 1]
        if allocates[i] and before >= nxt:
            out.append(i)
            nxt = (before // step + 1) * step
    return out, True


def module_calls_only(profile: Profile) -> Profile:
    """`profile` without the stages of traced forwards: regions are then module calls and runs of
    `nn.Sequential` children only."""
    calls = tuple(dataclasses.replace(c, staged="", stages=(), stage_last=(), stage_nodes=(),
                                      stage_limits=(), stage_args=()) for c in profile.calls)
    return dataclasses.replace(profile, calls=calls)


def bind(profile: Profile, regions: tuple[Region, ...]) -> tuple[Region, ...]:
    """Regions of a recorded profile with the module each one wraps, the selective policy's keys,
    and whether its replay needs the RNG state or copies of buffers. A region that is no
    candidate module call stays a node range (module None): it can be simulated but not applied.
    Regions of a traced profile are returned as they are."""
    if not in_place(profile):
        return regions
    g = graph_index(profile)
    fwd = g.forward_names
    # The calls of a module called more than once bind only all together: one wrapper
    # checkpoints every call, so a schedule with some of them is not what would run.
    have = {(r.start, r.end) for r in regions}
    spans = {(fwd[s.a], fwd[s.b]): s for grp in shared_calls(profile)
             if all((fwd[t.a], fwd[t.b]) in have for t in grp) for s in grp}
    spans.update({(fwd[s.a], fwd[s.b]): s for s in candidate_calls(profile)})
    out = []
    for r in regions:
        span = spans.get((r.start, r.end))
        if span is None:
            out.append(dataclasses.replace(r, module=None, save_ops=(), preserve_rng=False,
                                           buffers=(), restores=(), segment=None, staged=""))
            continue
        lo, hi = g.name_to_i[r.start], g.name_to_i[r.end]
        counts: dict[str, int] = {}
        keys: dict[str, str] = {}
        random = False
        for i in range(lo, hi + 1):
            nd = profile.nodes[i]
            if nd.phase != "forward":
                continue
            random = random or nd.random
            if nd.op == "getitem":
                continue
            op = policy_op(nd.op)
            k = counts.get(op, 0)
            counts[op] = k + 1
            keys[nd.name] = f"{op}#{k}"
        try:
            save_ops = tuple(keys[name] for name in r.saved)
        except KeyError as e:
            raise ScheduleError(
                f"region {r.start}..{r.end}: saved node {e.args[0]!r} is not an op of "
                f"the region of module {span.call.module!r}"
            ) from None
        out.append(dataclasses.replace(r, module=span.call.module, save_ops=save_ops,
                                       preserve_rng=random, buffers=span.buffers,
                                       restores=span.restores, segment=span.segment,
                                       staged=span.staged))
    return tuple(out)


def useful_calls(profile: Profile) -> tuple[CallSpan, ...]:
    """Candidate calls whose checkpointing can lower memory: some op inside saves a storage made
    inside the call. (A call that saves only its inputs, a Linear or an activation module on its
    own, keeps exactly as much as it drops.)"""
    return cached(profile, "useful_calls", _useful_calls)


def _useful_calls(profile: Profile) -> tuple[CallSpan, ...]:
    return tuple(span for span in candidate_calls(profile) if useful(profile, span))


def useful(profile: Profile, span: CallSpan) -> bool:
    """Checkpointing `span` can lower memory (`useful_calls`)."""
    # saved_made[k]: producer positions of the forward-made storages that position k saves; a
    # span [a, b] is useful iff some k in [a, b] saves s with a <= made[s]: iff the latest
    # producer saved anywhere in [a, b] is at or after a (a range maximum, from a sparse table).
    table = cached(profile, "saved_made_max", _saved_made_max)
    if span.b < span.a:
        return False
    j = (span.b - span.a + 1).bit_length() - 1
    return max(table[j][span.a], table[j][span.b - (1 << j) + 1]) >= span.a


def _saved_made_max(profile: Profile) -> list[np.ndarray]:
    """Sparse table of range maxima: level j, entry k is the latest producer position saved at
    any forward position in [k, k + 2**j) (-1: none)."""
    level = np.array([max(ps, default=-1) for ps in _saved_made(profile)], dtype=np.int64)
    table = [level]
    while (1 << len(table)) <= len(level):
        prev, half = table[-1], 1 << (len(table) - 1)
        table.append(np.maximum(prev[:-half], prev[half:]))
    return table


def _saved_made(profile: Profile) -> list[list[int]]:
    g = graph_index(profile)
    made, _ = storage_positions(profile)
    return [[made[s] for s in profile.nodes[i].saves if s in made] for i in g.forward]
