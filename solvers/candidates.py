"""Where a schedule may cut the forward chain: repeated blocks, live bytes, and candidate cut points.

A cut "after forward node i" is a boundary between two consecutive forward nodes; regions start just
after one cut and end on another. A cut is cheap when few bytes are live across it (a checkpointed
region keeps its inputs, which are exactly what crosses its first cut), and it is valid when no
in-place op after it mutates a storage produced before it: the region that holds the in-place op
would replay the mutation on a tensor it does not own.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from solvers.profile import Profile
from solvers.simulate import graph_index

__all__ = ["MATMUL_OPS", "Block", "blocks", "cut_points", "is_matmul", "live_bytes_across",
           "valid_cuts"]

MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_")
"""Ops whose outputs torchtitan's selective policy saves (op name after ``aten.``, prefix match for
the SDPA kernels); `cut_points` can also cut after each of them."""


def is_matmul(op: str) -> bool:
    """A profile op name (``aten.addmm.default``) is one of `MATMUL_OPS`."""
    name = op.split(".")[1] if op.startswith("aten.") else op
    return any(name == m or (m.endswith("_") and name.startswith(m)) for m in MATMUL_OPS)


MAX_CUTS = 200
"""At most this many candidate cuts overall (block boundaries always kept)."""
MAX_CUTS_PER_BLOCK = 4
"""At most this many live-bytes minima inside one block."""


@dataclass(frozen=True, kw_only=True)
class Block:
    """One instance of a repeated module (``transformer.h.3``), as a range of forward nodes."""

    name: str
    start: int
    """Profile node index of the block's first forward node."""
    end: int
    """Profile node index of the block's last forward node (inclusive)."""


def _is_int(s: str) -> bool:
    return s.isdigit()


def blocks(profile: Profile) -> list[Block]:
    """Repeated module instances, in forward order.

    A prefix qualifies when it has at least two integer children (``layers.0``, ``layers.1``) of
    which at least two run the same sequence of ops (so ``stem.0/1/2`` = conv, bn, relu does not).
    Prefixes are taken greedily by how many forward nodes they cover, skipping any nested inside (or
    containing) one already taken: a GPT gives ``transformer.h.*``; a ResNet gives the instances of
    every ``layerN.*``, not only of the largest stage. Instances whose node ranges overlap an earlier
    one (ops interleaved across instances) are skipped.
    """
    g = graph_index(profile)
    children: dict[str, set[str]] = defaultdict(set)
    members: dict[str, list[int]] = defaultdict(list)  # instance path -> forward node indices
    for i in g.forward:
        parts = profile.nodes[i].module.split(".") if profile.nodes[i].module else []
        for k, part in enumerate(parts):
            if _is_int(part):
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
    return out


def _storage_positions(profile: Profile):
    """Per non-fixed forward-produced storage: producer position, forward reader positions."""
    g = graph_index(profile)
    pos = g.fwd_pos
    prod: dict[int, int] = {}
    readers: dict[int, list[int]] = defaultdict(list)
    for k, i in enumerate(g.forward):
        for s in g.new[i]:
            prod[s] = k
        for s in g.reads[i]:
            readers[s].append(k)
    del pos
    return prod, readers


def live_bytes_across(profile: Profile) -> list[int]:
    """For every forward position k, the bytes of non-fixed storages produced at or before forward
    node k and read by a forward node after it (what a region starting at k + 1 would keep)."""
    g = graph_index(profile)
    n = len(g.forward)
    diff = np.zeros(n + 1, dtype=np.int64)
    prod, readers = _storage_positions(profile)
    for s, p in prod.items():
        r = readers.get(s)
        if r and r[-1] > p:
            diff[p] += g.sbytes[s]
            diff[r[-1]] -= g.sbytes[s]
    return np.cumsum(diff)[:n].tolist()


def valid_cuts(profile: Profile) -> list[bool]:
    """valid[k]: a region boundary after forward position k does not split an in-place op from the
    producer of the storage it mutates (buffer updates such as BatchNorm's are ignored)."""
    g = graph_index(profile)
    n = len(g.forward)
    prod, _ = _storage_positions(profile)
    diff = np.zeros(n + 1, dtype=np.int64)
    for k, i in enumerate(g.forward):
        nd = profile.nodes[i]
        opname = nd.op.split(".")[1] if nd.op.count(".") >= 1 else nd.op
        if not opname.endswith("_") or nd.mutates_buffer:
            continue
        s = nd.storage
        if s is None or s in g.fixed_storages or s not in prod:
            continue
        if prod[s] < k:  # cuts prod[s] .. k-1 separate the producer from the mutation
            diff[prod[s]] += 1
            diff[k] -= 1
    bad = np.cumsum(diff)[:n]
    return [bool(b == 0) for b in bad]


def cut_points(profile: Profile, *, matmul_cuts: bool = False) -> list[int]:
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
    g = graph_index(profile)
    n = len(g.forward)
    if n <= 1:
        return []
    live = live_bytes_across(profile)
    valid = valid_cuts(profile)
    pos = g.fwd_pos
    chosen: set[int] = set()
    blks = blocks(profile)
    block_of = [-1] * n
    for b_i, b in enumerate(blks):
        for k in range(pos[b.start], pos[b.end] + 1):
            block_of[k] = b_i
        for k in (pos[b.start] - 1, pos[b.end]):
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
        for k in range(n - 1):
            if len(chosen) >= MAX_CUTS:
                break
            if valid[k] and is_matmul(profile.nodes[g.forward[k]].op):
                chosen.add(k)
    return [g.forward[k] for k in sorted(chosen)]
