"""The vocabulary the solvers share: regions over the forward chain, and the module calls a region
may be.

A schedule's region is a range of forward nodes. On a profile recorded by running the step
(``meta.capture == "run"``), `planner.apply` can only checkpoint a module's `forward`, so the
regions a solver may choose are the profile's module calls that have no blocker
(`candidate_calls`); `bind` gives each region the module it wraps and what the applier needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from solvers.errors import ScheduleError
from solvers.profile import ModuleCall, Profile
from solvers.schedule import Region

__all__ = [
    "MATMUL_OPS",
    "CallSpan",
    "bind",
    "candidate_calls",
    "in_place",
    "is_matmul",
    "region",
    "useful_calls",
]

MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_")
"""Ops whose outputs torchtitan's selective policy saves (op name after ``aten.``, prefix match for
the SDPA kernels)."""


def is_matmul(op: str) -> bool:
    """A profile op name (``aten.addmm.default``) is one of `MATMUL_OPS`."""
    name = op.split(".")[1] if op.startswith("aten.") else op
    return any(name == m or (m.endswith("_") and name.startswith(m)) for m in MATMUL_OPS)


def in_place(profile: Profile) -> bool:
    """Regions of this profile are module calls applied in place (a recorded profile), rather than
    node ranges of a traced graph."""
    return profile.meta.capture == "run"


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


def _forward_positions(profile: Profile) -> dict[str, int]:
    cache = profile.__dict__.get("_fwd_positions")
    if cache is None:
        fwd = [n.name for n in profile.nodes if n.phase == "forward"]
        cache = {name: k for k, name in enumerate(fwd)}
        object.__setattr__(profile, "_fwd_positions", cache)
    return cache


def candidate_calls(profile: Profile) -> list[CallSpan]:
    """The spans a region may be: module calls with no blocker, and runs of two or more
    consecutive children of an `nn.Sequential` none of which is blocked. Where several span the
    same nodes (a module whose forward only calls its child), the outermost whole call."""
    cache = profile.__dict__.get("_candidate_calls")
    if cache is not None:
        return cache
    pos = _forward_positions(profile)
    by_module = {c.module: c for c in profile.calls}
    seen: set[tuple[int, int]] = set()
    out = []
    segments = []
    for c in profile.calls:  # ordered by start, outer first
        a, b = pos[c.start], pos[c.end]
        if not c.blocker and (a, b) not in seen:
            seen.add((a, b))
            out.append(CallSpan(c, a, b, None, c.buffers))
        if c.children:
            segments.extend(_segments(c, by_module, pos))
    for span in segments:
        if (span.a, span.b) not in seen:
            seen.add((span.a, span.b))
            out.append(span)
    out.sort(key=lambda s: (s.a, -s.b))
    object.__setattr__(profile, "_candidate_calls", out)
    return out


def _segments(c: ModuleCall, by_module: dict[str, ModuleCall], pos: dict[str, int]
              ) -> list[CallSpan]:
    """Runs of two or more consecutive children of Sequential call `c` that can be one region:
    every child in the run unblocked (a child without ops, an Identity, has no call and is
    fine inside a run), the first and last with ops."""
    kids: list[ModuleCall | None] = []
    lo, hi = pos[c.start], pos[c.end]
    for name in c.children:
        kc = by_module.get(f"{c.module}.{name}" if c.module else name)
        if kc is not None and not lo <= pos[kc.start] <= pos[kc.end] <= hi:
            kc = None  # not called inside this call
        kids.append(kc)
    out = []
    for i, first in enumerate(kids):
        if first is None or first.blocker:
            continue
        buffers = set(first.buffers)
        for j in range(i + 1, len(kids)):
            kc = kids[j]
            if kc is None:
                continue
            if kc.blocker:
                break
            buffers |= set(kc.buffers)
            out.append(CallSpan(c, pos[first.start], pos[kc.end], (i, j), tuple(sorted(buffers))))
    return out


def region(profile: Profile, a: int, b: int, saved: tuple[str, ...] = ()) -> Region:
    """The region over forward positions a..b (inclusive), as node names."""
    fwd = _forward_nodes(profile)
    return Region(start=fwd[a], end=fwd[b], saved=saved)


def _forward_nodes(profile: Profile) -> list[str]:
    cache = profile.__dict__.get("_fwd_names")
    if cache is None:
        cache = [n.name for n in profile.nodes if n.phase == "forward"]
        object.__setattr__(profile, "_fwd_names", cache)
    return cache


def bind(profile: Profile, regions: tuple[Region, ...]) -> tuple[Region, ...]:
    """Regions of a recorded profile with the module each one wraps, the selective policy's keys,
    and whether its replay needs the RNG state or copies of buffers. A region that is no
    candidate module call stays a node range (module None): it can be simulated but not applied.
    Regions of a traced profile are returned as they are."""
    if not in_place(profile):
        return regions
    fwd = _forward_nodes(profile)
    spans = {(fwd[s.a], fwd[s.b]): s for s in candidate_calls(profile)}
    index = {n.name: i for i, n in enumerate(profile.nodes)}
    out = []
    for r in regions:
        span = spans.get((r.start, r.end))
        if span is None:
            out.append(dataclasses.replace(r, module=None, save_ops=(), preserve_rng=False,
                                           buffers=(), segment=None))
            continue
        lo, hi = index[r.start], index[r.end]
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
            k = counts.get(nd.op, 0)
            counts[nd.op] = k + 1
            keys[nd.name] = f"{nd.op}#{k}"
        try:
            save_ops = tuple(keys[name] for name in r.saved)
        except KeyError as e:
            raise ScheduleError(
                f"region {r.start}..{r.end}: saved node {e.args[0]!r} is not an op of "
                f"the region of module {span.call.module!r}"
            ) from None
        out.append(dataclasses.replace(r, module=span.call.module, save_ops=save_ops,
                                       preserve_rng=random, buffers=span.buffers,
                                       segment=span.segment))
    return tuple(out)


def useful_calls(profile: Profile) -> list[CallSpan]:
    """Candidate calls whose checkpointing can lower memory: some op inside saves a storage made
    inside the call. (A call that saves only its inputs, a Linear or an activation module on its
    own, keeps exactly as much as it drops.)"""
    cache = profile.__dict__.get("_useful_calls")
    if cache is not None:
        return cache
    fwd = [i for i, n in enumerate(profile.nodes) if n.phase == "forward"]
    made = {}
    for k, i in enumerate(fwd):
        for s in profile.nodes[i].new_storages:
            made[s] = k
    # first[k]: smallest producer position among storages saved by forward position k and made
    # in forward; a call [a, b] is useful iff some k in [a, b] saves s with a <= made[s] <= k.
    out = []
    saved_made = [
        [made[s] for s in profile.nodes[i].saves if s in made] for i in fwd
    ]
    for span in candidate_calls(profile):
        if any(span.a <= p for k in range(span.a, span.b + 1) for p in saved_made[k]):
            out.append(span)
    object.__setattr__(profile, "_useful_calls", out)
    return out
