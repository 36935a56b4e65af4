"""The Schedule: which forward node ranges run as checkpointed regions, and what they keep."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from solvers.errors import ScheduleError
from solvers.profile import Profile

__all__ = ["Method", "Region", "Schedule", "STATUSES", "SCHEDULE_SCHEMA", "SCHEDULE_VERSION",
           "policy_op"]

FUSED_ATTENTION = "aten._scaled_dot_product_fused_attention"
"""The name `policy_op` gives every fused SDPA kernel."""
_FUSED_ATTENTION_OPS = frozenset(
    f"aten._scaled_dot_product_{k}.default" for k in (
        "flash_attention", "flash_attention_for_cpu", "efficient_attention", "cudnn_attention",
        "fused_attention_overrideable"))


def policy_op(op: str) -> str:
    """The name a selective policy counts op `op` by (`Region.save_ops`): its own, except that the
    fused attention kernels are one. Which of them SDPA runs depends on the device, dtype and
    inputs (flash for CPU here, cuDNN or flash on a GPU, memory-efficient with a mask), not on
    the model, so a plan made from a CPU or estimate-mode profile saves the attention output on
    the GPU it is applied on. All of them keep the output and the log-sum-exp for backward."""
    return FUSED_ATTENTION if op in _FUSED_ATTENTION_OPS else op


SCHEDULE_SCHEMA = "ckpt-planner/schedule"
SCHEDULE_VERSION = 1

# Like cvxpy's solution statuses: a schedule always carries one.
STATUSES = ("optimal", "feasible", "time_limit", "infeasible")


@dataclass(frozen=True, kw_only=True)
class Region:
    """A contiguous range of forward nodes run under non-reentrant `torch.utils.checkpoint`.

    On a profile recorded by running the step, a region is one call of a module's `forward`
    (`module`), and `planner.apply` wraps that module; the remaining fields say how, so that a
    schedule applies to a model without its profile. On a traced (version 1) profile, `module` is
    None and the region is a node range of the traced graph.
    """

    start: str
    """Name of the first forward node of the region."""
    end: str
    """Name of the last forward node of the region (inclusive)."""
    saved: tuple[str, ...] = ()
    """Nodes inside the region whose outputs are kept from forward (selective checkpointing,
    MUST_SAVE); everything else the region saves is recomputed."""
    module: str | None = None
    """Dotted path of the module whose call this region is ("" is the root module); None for a
    node-range region."""
    save_ops: tuple[str, ...] = ()
    """`saved` as the selective policy sees them: ``<aten overload>#<k>``, the k-th op of that
    overload in one call of the module (independent of input shapes); the fused attention
    kernels count as one overload (`policy_op`)."""
    preserve_rng: bool = False
    """The region draws random numbers (dropout): its replay restores the RNG state."""
    buffers: tuple[str, ...] = ()
    """Buffers the region updates in place (BatchNorm statistics): copies take the replay's
    updates, so they move once per step."""
    restores: tuple[str, ...] = ()
    """Those of `buffers` the region reads again after updating them (spectral norm's power
    iteration): the region keeps a copy of them from its forward until its backward, and its
    replay starts from that copy, as forward did."""
    segment: tuple[int, int] | None = None
    """For a `torch.nn.Sequential` `module`: the region is its children `segment[0]` to
    `segment[1]` (inclusive, by position), run as one checkpoint (`checkpoint_sequential`'s
    segments); for a staged module (`staged`), the nodes `segment[0]` to `segment[1]` of its
    traced forward; None when the region is the whole module call."""
    staged: str = ""
    """For a run of a module's traced forward (`planner.stages`): the call pattern the trace is
    made for and its fingerprint, as JSON (`ModuleCall.staged`)."""


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """A solver's answer. `regions` is empty for "no checkpointing"."""

    regions: tuple[Region, ...] = ()
    method: str = ""
    status: str = "feasible"
    budget_bytes: int | None = None
    predicted_peak_bytes: int = 0
    predicted_recompute_ms: float = 0.0
    min_peak_bytes: int | None = None
    """Smallest peak the method could reach (set when the status is infeasible)."""
    stats: dict[str, Any] = field(default_factory=dict)
    """Solver statistics: solve_time_s, gap, nodes, candidates, ..."""
    made_for: dict[str, Any] = field(default_factory=dict)
    """What the plan was made for, set by `planner.plan`: the model's class, module paths and
    parameters (``name shape dtype``), the example inputs' shapes, dtype, autocast and torch
    version. `planner.apply` refuses a model that differs, saying how."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ScheduleError(f"status {self.status!r} is not one of {STATUSES}")

    @property
    def feasible(self) -> bool:
        return self.status in ("optimal", "feasible", "time_limit")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["regions"] = [_region_dict(r) for r in self.regions]
        if not d["made_for"]:
            del d["made_for"]
        return {"schema": SCHEDULE_SCHEMA, "schema_version": SCHEDULE_VERSION, **d}

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "schedule") -> Schedule:
        if not isinstance(d, dict) or d.get("schema") != SCHEDULE_SCHEMA:
            raise ScheduleError(f"{source}: not a ckpt-planner schedule (field 'schema')")
        if d.get("schema_version") != SCHEDULE_VERSION:
            raise ScheduleError(
                f"{source}: schema_version {d.get('schema_version')!r} is not supported "
                f"(expected {SCHEDULE_VERSION})"
            )
        try:
            regions = tuple(
                Region(
                    start=r["start"],
                    end=r["end"],
                    saved=tuple(r.get("saved", ())),
                    module=r.get("module"),
                    save_ops=tuple(r.get("save_ops", ())),
                    preserve_rng=bool(r.get("preserve_rng", False)),
                    buffers=tuple(r.get("buffers", ())),
                    restores=tuple(r.get("restores", ())),
                    segment=tuple(r["segment"]) if r.get("segment") is not None else None,
                    staged=str(r.get("staged", "")),
                )
                for r in d.get("regions", [])
            )
            kw = {k: d[k] for k in (f.name for f in dataclasses.fields(cls)) if k in d}
            kw["regions"] = regions
            return cls(**kw)
        except (KeyError, TypeError) as e:
            raise ScheduleError(f"{source}: malformed schedule ({e})") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        path = Path(path)
        try:
            d = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ScheduleError(f"{path}: cannot read schedule ({e})") from None
        return cls.from_dict(d, source=str(path))


Method = Callable[[Profile, int, float | None], Schedule]
"""The one signature every solver method has, `method(profile, budget_bytes, time_limit_s)`: the
schedule it proposes for a peak of `budget_bytes` (fixed memory included), taking at most about
`time_limit_s` seconds when that is not None. `solvers.solve` checks every answer."""


def _region_dict(r: Region) -> dict[str, Any]:
    d: dict[str, Any] = {"start": r.start, "end": r.end, "saved": list(r.saved)}
    if r.module is not None:
        d.update(module=r.module, save_ops=list(r.save_ops), preserve_rng=r.preserve_rng,
                 buffers=list(r.buffers))
        if r.segment is not None:
            d["segment"] = list(r.segment)
        if r.staged:
            d["staged"] = r.staged
        if r.restores:
            d["restores"] = list(r.restores)
    return d
