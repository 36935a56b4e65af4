"""`compare(model, example_inputs)`: measure our plans against the alternatives, side by side.

In one process, on one machine, with the strategies alternated round-robin (a first, untimed
round compiles each strategy and measures its peak; the timed rounds come after every strategy,
ours included, exists, so that each round times all of them within minutes of each other):

- ``none``: the original model;
- every baseline in `solvers.solve.BASELINES` (``per_block``, ``sqrt_n``, ``chen_greedy``,
  ``every_k``, ``selective_matmul``); the budget-dependent ones (``chen_greedy``, ``every_k``) are
  solved at the 0.5 budget;
- ``torch.compile(model, backend=...)`` for each of `compile_backend` (``aot_eager`` by default,
  ``inductor`` where a C++ compiler is available) with
  ``torch._functorch.config.activation_memory_budget`` set to each of `compile_budgets`;
- ours (``solve(method="auto")``): at the budget equal to each baseline's *measured* peak
  (iso-memory) and over a sweep of activation-budget fractions.

Budgets: with N the measured no-checkpoint peak and F the fixed bytes (parameters, buffers,
inputs), the budget at fraction f is ``F + f * (N - F)``: f times the activation memory.

    >>> res = compare(model, batch, progress=True)   # doctest: +SKIP
    >>> print(res.table()); res.plot("pareto.png"); res.to_json("results.json")   # doctest: +SKIP
    >>> for target, ok, detail in res.checks(): print(ok, target, detail)   # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from planner.api import SLACK_BYTES, InfeasibleBudgetError, solve_within
from planner.compiled import (
    EAGER_COST,
    MEMORY_BUDGETS,
    compile_backend,
    compile_copy,
    raise_recompile_limit,
    torch_memory_budget,
)
from planner.compiled import fastest as compiled_fastest
from planner.compiled import search as compiled_search
from planner.inplace import applied, apply_schedule, remove
from planner.measurement import measure
from planner.profiling import profile
from solvers.errors import CkptPlannerError
from solvers.profile import Profile
from solvers.schedule import Schedule
from solvers.simulate import simulate
from solvers.solve import BASELINES, applicable, smallest_peak, solve

__all__ = ["CompareOptions", "CompareResult", "Row", "compare"]

MiB = 2**20
_BUDGET_DEPENDENT = ("chen_greedy", "every_k")
_SDPA = ("scaled_dot_product",)


@dataclass(kw_only=True)
class Row:
    """One strategy as measured."""

    strategy: str
    """``none``, a baseline name, ``compile(b)``, ``ours@f`` (sweep) or ``ours=<baseline>``."""
    kind: str
    """``none``, ``baseline``, ``compile``, ``ours_sweep``, ``ours_iso``, ``ours_compiled``
    (ours + torch.compile) or ``graph_sweep`` (make_fx graph plans)."""
    budget_bytes: int | None = None
    """The budget this strategy was solved or planned for (None: no budget in its definition)."""
    fraction: float | None = None
    """For ``ours_sweep``: the activation-budget fraction."""
    method: str | None = None
    """The solver that produced the schedule (ours: what ``auto`` picked)."""
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    step_ms: float | None = None
    """Median of every timed step, over all rounds."""
    step_ms_min: float | None = None
    step_ms_max: float | None = None
    samples_ms: list[float] = field(default_factory=list)
    extra_pct: float | None = None
    """Extra step time against ``none``, in percent (median against median)."""
    predicted_extra_pct: float | None = None
    """The schedule's predicted recompute time (host cost of checkpointing included) as a percent
    of the profiled step time (None for ``none`` and torch.compile)."""
    fits: bool | None = None
    """Measured peak within `budget_bytes` (None where there is no budget)."""
    status: str = "ok"
    """``ok``, ``does not fit (smallest peak ...)``, or ``error: ...``."""
    regions: int | None = None
    searched: list[dict] = field(default_factory=list)
    """For ``ours_compiled``: every configuration the compiled search compiled and stepped, in
    order (`planner.compiled.Candidate.summary`): partitioner budget, eager budget planned for
    and cost model (None: no plan), regions, measured peak, whether it fits, and its median
    step time in the search's own timing (None: not timed, as it does not fit)."""

    @property
    def measured(self) -> bool:
        return self.measured_peak_bytes is not None and self.step_ms is not None


@dataclass(kw_only=True)
class CompareResult:
    """Every strategy measured in one run; `table`, `to_json`, `plot`, `checks`."""

    model: str
    rows: list[Row]
    none_peak_bytes: int
    fixed_bytes: int
    fractions: tuple[float, ...]
    budgets: dict[float, int]
    eager_attention: bool
    meta: dict[str, Any] = field(default_factory=dict)

    # -- helpers ------------------------------------------------------------------------------
    @property
    def activation_bytes(self) -> int:
        return self.none_peak_bytes - self.fixed_bytes

    def row(self, strategy: str) -> Row | None:
        return next((r for r in self.rows if r.strategy == strategy), None)

    def activation_saving(self, r: Row) -> float | None:
        """Fraction of the no-checkpoint activation memory this row saves (measured)."""
        if r.measured_peak_bytes is None or self.activation_bytes <= 0:
            return None
        return 1.0 - (r.measured_peak_bytes - self.fixed_bytes) / self.activation_bytes

    def _fits_fractions(self, r: Row) -> str:
        if r.measured_peak_bytes is None:
            return ""
        ok = [f for f in self.fractions if r.measured_peak_bytes <= self.budgets[f]]
        return ", ".join(f"{f:g}" for f in ok) or "-"

    # -- outputs ------------------------------------------------------------------------------
    def table(self) -> str:
        """A Markdown table of every row."""
        b = ", ".join(f"{f:g}x = {self.budgets[f] / MiB:.2f} MiB" for f in self.fractions)
        head = (
            f"**{self.model}**: no-checkpoint peak {self.none_peak_bytes / MiB:.2f} MiB, fixed "
            f"(params, buffers, inputs) {self.fixed_bytes / MiB:.2f} MiB, activations "
            f"{self.activation_bytes / MiB:.2f} MiB; budgets {b}\n\n"
        )
        cols = ["strategy", "budget MiB", "method", "predicted peak MiB", "measured peak MiB",
                "activations saved", "step ms (median)", "spread ms", "extra time",
                "predicted extra", "fits its budget", "fits fractions", "status"]
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

        def mib(x):
            return "" if x is None else f"{x / MiB:.2f}"

        for r in self.rows:
            sav = self.activation_saving(r)
            cells = [
                r.strategy,
                mib(r.budget_bytes),
                r.method or "",
                mib(r.predicted_peak_bytes),
                mib(r.measured_peak_bytes),
                "" if sav is None else f"{100 * sav:.0f}%",
                "" if r.step_ms is None else f"{r.step_ms:.1f}",
                "" if r.step_ms_min is None else f"{r.step_ms_min:.1f}-{r.step_ms_max:.1f}",
                "" if r.extra_pct is None else f"{r.extra_pct:+.1f}%",
                "" if r.predicted_extra_pct is None else f"{r.predicted_extra_pct:+.1f}%",
                "" if r.fits is None else ("yes" if r.fits else "**no**"),
                self._fits_fractions(r),
                r.status,
            ]
            lines.append("| " + " | ".join(cells) + " |")
        return head + "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "none_peak_bytes": self.none_peak_bytes,
            "fixed_bytes": self.fixed_bytes,
            "fractions": list(self.fractions),
            "budgets": {str(f): b for f, b in self.budgets.items()},
            "eager_attention": self.eager_attention,
            "meta": self.meta,
            "rows": [asdict(r) for r in self.rows],
            "checks": [
                {"target": t, "passed": ok, "detail": d} for t, ok, d in self.checks()
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompareResult:
        """Inverse of `to_dict` (the checks are recomputed from the rows, not read)."""
        known = {f.name for f in fields(Row)}
        return cls(
            model=d["model"],
            rows=[Row(**{k: v for k, v in r.items() if k in known}) for r in d["rows"]],
            none_peak_bytes=d["none_peak_bytes"],
            fixed_bytes=d["fixed_bytes"],
            fractions=tuple(d["fractions"]),
            budgets={float(f): b for f, b in d["budgets"].items()},
            eager_attention=d["eager_attention"],
            meta=d.get("meta", {}),
        )

    @classmethod
    def load(cls, path: str | Path) -> CompareResult:
        """Read a ``results.json`` written by `to_json` (``ckpt-planner compare``)."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    def plot(self, path: str | Path | None = None, *, ax=None):
        """Pareto plot: measured peak (MiB) against step time relative to ``none``; every strategy
        a labelled marker, ours a line through the sweep points. Returns the figure."""
        import matplotlib

        if path is not None and ax is None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        none = self.row("none")
        base = none.step_ms if none is not None and none.step_ms else None
        if ax is None:
            fig, ax = plt.subplots(figsize=(8, 5))
        else:
            fig = ax.figure
        if base is None:
            return fig
        style = {"none": ("k", "o"), "baseline": ("tab:blue", "s"), "compile": ("tab:orange", "^"),
                 "compile_other": ("tab:red", "v"), "ours_iso": ("tab:green", "*")}
        for r in self.rows:
            if not r.measured or r.kind in ("ours_sweep", "ours_compiled", "graph_sweep"):
                continue
            c, mk = style[_style_key(r)]
            x, y = r.measured_peak_bytes / MiB, r.step_ms / base
            err = [[y - r.step_ms_min / base], [r.step_ms_max / base - y]]
            ax.errorbar([x], [y], yerr=err, fmt=mk, color=c, ms=9 if mk == "*" else 6,
                        capsize=2, alpha=0.9)
            ax.annotate(r.strategy, (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color=c)
        lines = [("ours_sweep", None, "-D", "tab:green", "ours (sweep of budgets)")]
        for backend in sorted({r.method.split(",")[0] for r in self.rows
                               if r.kind == "ours_compiled" and r.method}):
            color = "tab:purple" if backend == "inductor" else "tab:brown"
            lines.append(("ours_compiled", backend, "-P", color, f"ours + {backend}"))
        lines.append(("graph_sweep", None, "--x", "tab:gray", "make_fx graph plans"))
        for kind, backend, fmt, color, label in lines:
            sweep = sorted((r for r in self.rows if r.kind == kind and r.measured and (
                backend is None or (r.method or "").startswith(backend))),
                key=lambda r: r.measured_peak_bytes)
            if not sweep:
                continue
            xs = [r.measured_peak_bytes / MiB for r in sweep]
            ys = [r.step_ms / base for r in sweep]
            ax.plot(xs, ys, fmt, color=color, label=label)
            for r, x, y in zip(sweep, xs, ys):
                ax.annotate(r.strategy, (x, y), textcoords="offset points", xytext=(4, -10),
                            fontsize=7, color=color)
        for f in self.fractions:
            ax.axvline(self.budgets[f] / MiB, color="grey", ls=":", lw=0.8)
            ax.text(self.budgets[f] / MiB, ax.get_ylim()[1], f" {f:g}x", fontsize=7,
                    color="grey", va="top")
        ax.axhline(1.0, color="grey", lw=0.5)
        other = sorted({r.method for r in self.rows
                        if r.kind == "compile" and _style_key(r) == "compile_other"})
        legend = [("none", "none"), ("baseline", "checkpoint baselines"),
                  ("compile", "torch.compile(aot_eager) activation_memory_budget")]
        if other:
            legend.append(("compile_other",
                           f"torch.compile({', '.join(other)}) activation_memory_budget"))
        legend.append(("ours_iso", "ours at a baseline's measured peak"))
        for kind, label in legend:
            c, mk = style[kind]
            ax.plot([], [], mk, color=c, label=label)
        ax.set_xlabel("measured peak memory of a training step (MiB)")
        ax.set_ylabel("step time relative to no checkpointing")
        ax.set_title(f"{self.model}: memory/time (lower left is better)")
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
            plt.close(fig)
        return fig

    # -- targets ------------------------------------------------------------------------------
    def anchors(self, leave_out: Sequence[str] = ()) -> list[Row]:
        """Measured baseline and torch.compile rows, less those whose method is in `leave_out`
        (``("inductor",)``: the eager-execution anchors only)."""
        return [r for r in self.rows if r.kind in ("baseline", "compile") and r.measured
                and r.method not in leave_out]

    def fastest_fitting_anchor(self, f: float, leave_out: Sequence[str] = ()) -> Row | None:
        """The anchor with the least extra time among those that fit the budget of fraction f."""
        fitting = [a for a in self.anchors(leave_out)
                   if a.measured_peak_bytes <= self.budgets[f]]
        return min(fitting, key=lambda a: a.extra_pct) if fitting else None

    def checks(self, leave_out: Sequence[str] = ()) -> list[tuple[str, bool, str]]:
        """The issue's targets, evaluated on the measurements: (target, passed, detail). Anchors
        whose method is in `leave_out` do not count (by default every anchor does)."""
        out: list[tuple[str, bool, str]] = []
        anchors = self.anchors(leave_out)
        for f in self.fractions:
            budget = self.budgets[f]
            ours = next((r for r in self.rows if r.kind == "ours_sweep" and r.fraction == f), None)
            fitting = [a for a in anchors if a.measured_peak_bytes <= budget]
            ours_fits = ours is not None and ours.measured and ours.measured_peak_bytes <= budget
            names = ", ".join(a.strategy for a in fitting) or "none"
            if ours is None:
                continue
            ours_desc = (
                f"ours {ours.measured_peak_bytes / MiB:.2f} MiB" if ours.measured
                else f"ours: {ours.status}"
            )
            out.append((
                f"{f:g}x: our plan fits wherever any strategy fits",
                ours_fits or not fitting,
                f"budget {budget / MiB:.2f} MiB; {ours_desc}; anchors that fit: {names}",
            ))
            best = self.fastest_fitting_anchor(f, leave_out)
            if best is None:
                continue
            if not ours_fits:
                out.append((f"{f:g}x: extra time vs fastest fitting anchor", False,
                            f"fastest fitting anchor {best.strategy} {best.extra_pct:+.1f}%; "
                            "our plan does not fit"))
                continue
            limit = best.extra_pct / 2 if best.extra_pct >= 10 else best.extra_pct
            rule = "half of" if best.extra_pct >= 10 else "at most"
            out.append((
                f"{f:g}x: extra time {rule} the fastest fitting anchor",
                ours.extra_pct <= limit,
                f"ours {ours.extra_pct:+.1f}% (spread {ours.step_ms_min:.0f}-"
                f"{ours.step_ms_max:.0f} ms) vs {best.strategy} {best.extra_pct:+.1f}% "
                f"(limit {limit:+.1f}%)",
            ))
        out += self._compiled_checks()
        if self.eager_attention:
            ours = [r for r in self.rows if r.kind.startswith("ours") and r.measured]
            good = [r for r in ours if (self.activation_saving(r) or 0) >= 0.65]
            if good:
                best = min(good, key=lambda r: r.extra_pct)
                ok = best.extra_pct <= 5.0
                detail = (f"{best.strategy}: {100 * self.activation_saving(best):.0f}% less "
                          f"activation memory at {best.extra_pct:+.1f}% step time")
            else:
                ok = False
                top = max(ours, key=lambda r: self.activation_saving(r) or 0, default=None)
                detail = ("no plan of ours saved 65%" + (
                    f"; the most: {top.strategy} {100 * self.activation_saving(top):.0f}%"
                    if top else ""))
            out.append(("eager-attention transformer: >=65% less activation memory at <=5% "
                        "extra step time", ok, detail))
        return out

    def _compiled_checks(self, backend: str = "inductor") -> list[tuple[str, bool, str]]:
        """Issue 10's targets for ours + `backend` at each fraction: it fits wherever any
        strategy fits; it is at least as fast as the fastest fitting `backend(b)` row; where that
        row costs +10% or more over `backend(1)` (the backend without extra recomputation), ours
        costs at most half as much over `backend(1)`."""
        out: list[tuple[str, bool, str]] = []
        label = "compile" if backend == "aot_eager" else backend
        plain = self.row(f"{label}(1)")
        fitting_any = [r for r in self.rows if r.measured and r.kind != "none"]
        for f in self.fractions:
            budget = self.budgets[f]
            ours = next((r for r in self.rows if r.kind == "ours_compiled" and r.fraction == f
                         and (r.method or "").startswith(backend)), None)
            if ours is None:
                continue
            fits = ours.measured and ours.measured_peak_bytes <= budget
            any_fit = [r.strategy for r in fitting_any if r.measured_peak_bytes <= budget]
            out.append((f"{f:g}x: ours + {backend} fits wherever any strategy fits",
                        fits or not any_fit,
                        f"ours {ours.measured_peak_bytes / MiB:.2f} MiB" if ours.measured
                        else f"ours: {ours.status}"))
            rivals = [r for r in self.rows if r.kind == "compile" and r.method == backend
                      and r.measured and r.measured_peak_bytes <= budget]
            if not fits or not rivals:
                continue
            best = min(rivals, key=lambda r: r.extra_pct)
            out.append((f"{f:g}x: ours + {backend} at least as fast as the fastest fitting "
                        f"{label}(b)", ours.extra_pct <= best.extra_pct,
                        f"ours {ours.extra_pct:+.1f}% vs {best.strategy} {best.extra_pct:+.1f}%"
                        + self._per_round(ours, best)))
            if plain is None or not plain.measured:
                continue
            # Extra time over backend(1) itself, as a percentage of its step time.
            best_over = 100 * (best.step_ms / plain.step_ms - 1)
            ours_over = 100 * (ours.step_ms / plain.step_ms - 1)
            if best_over >= 10:
                out.append((f"{f:g}x: ours + {backend} costs at most half of {best.strategy}'s "
                            f"extra over {plain.strategy}", ours_over <= best_over / 2,
                            f"ours {ours_over:+.1f}% over {plain.strategy}, {best.strategy} "
                            f"{best_over:+.1f}%, limit {best_over / 2:+.1f}%"))
        return out

    def _per_round(self, a: Row, b: Row) -> str:
        """a's step time over b's round by round (each round steps every row in turn, so the
        two were timed minutes apart at most), as text for a check's detail: the median ratio
        and the rounds a was faster in. Empty where a and b are one measurement or their
        rounds cannot be paired."""
        inner = int(self.meta.get("inner_repeats") or 0)
        sa, sb = a.samples_ms, b.samples_ms
        if inner <= 0 or not sa or sa == sb or len(sa) != len(sb) or len(sa) % inner:
            return ""
        rounds = [(statistics.median(sa[k:k + inner]), statistics.median(sb[k:k + inner]))
                  for k in range(0, len(sa), inner)]
        ratios = [x / y for x, y in rounds]
        return (f"; per round, {a.strategy} / {b.strategy} median {statistics.median(ratios):.3f}"
                f", faster in {sum(q < 1 for q in ratios)} of {len(ratios)}")

    def checks_text(self) -> str:
        return "\n".join(f"[{'PASS' if ok else 'FAIL'}] {t}: {d}" for t, ok, d in self.checks())


# -- running ------------------------------------------------------------------------------------
class _Say:
    def __init__(self, on: bool):
        self.on = on
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.on:
            print(f"[compare {time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr,
                  flush=True)


def _pred_pct(s, prof: Profile) -> float:
    return 100 * s.predicted_recompute_ms / max(prof.step_ms, 1e-9)


def _style_key(r: Row) -> str:
    """Plot style of a row: its kind, with compile rows of backends other than aot_eager apart."""
    if r.kind == "compile" and r.method not in ("aot_eager", None):
        return "compile_other"
    return r.kind


def _eager_attention(profile: Profile) -> bool:
    """A transformer with eager attention: softmax and batched matmuls in forward, no SDPA."""
    ops = {n.op for n in profile.nodes if n.phase == "forward"}
    has = lambda s: any(s in o for o in ops)  # noqa: E731
    return has("softmax") and (has("bmm") or has("matmul")) and not any(has(s) for s in _SDPA)


def _caches_off() -> None:
    try:
        import torch._inductor.config as ic

        if hasattr(ic, "fx_graph_cache"):
            ic.fx_graph_cache = False
    except Exception:  # noqa: BLE001 - inductor missing is fine for aot_eager
        pass
    import torch._functorch.config as fc

    if hasattr(fc, "enable_autograd_cache"):
        fc.enable_autograd_cache = False


class _Entry:
    """One strategy to measure: a module to call, and a schedule applied to the user's model in
    place around each measurement (in-place plans and baselines), or a torch.compile budget."""

    def __init__(self, row: Row, module: torch.nn.Module | None, *,
                 schedule: Schedule | None = None, budget: float | None = None):
        self.row = row
        self.module = module
        self.schedule = schedule
        self.compile_budget = budget
        self.peaks: list[int] = []
        self.samples: list[float] = []
        self.alias: _Entry | None = None  # same schedule as another entry: share its measurement


def _measure_entry(e: _Entry, model: torch.nn.Module, example_inputs, loss_fn,
                   inner: int, held_bytes: int = 0) -> None:
    import torch._functorch.config as fc

    if e.schedule is not None:
        apply_schedule(model, e.schedule)
    try:
        if e.compile_budget is not None:
            with fc.patch(activation_memory_budget=e.compile_budget):
                m = measure(e.module, example_inputs, loss_fn, repeats=inner,
                            held_bytes=held_bytes)
        else:
            m = measure(e.module, example_inputs, loss_fn, repeats=inner, held_bytes=held_bytes)
    finally:
        if e.schedule is not None:
            remove(model)
    e.peaks.append(m.peak_bytes)
    e.samples.extend(m.step_ms_all)


def _schedule_key(s) -> tuple:
    return tuple((r.start, r.end, tuple(sorted(r.saved))) for r in s.regions)


@dataclass(frozen=True, kw_only=True)
class CompareOptions:
    """What `compare` measures and how often: the options that travel together from the CLI,
    the notebooks and the benchmarks to one `compare` call."""

    fractions: tuple[float, ...] = (0.75, 0.5, 0.3)
    """Activation-budget fractions for our sweep: budget = F + f * (N - F), where F is fixed
    memory and N the measured peak without checkpointing."""
    repeats: int = 3
    """Timed round-robin rounds; every round measures every strategy once, in turn, after an
    untimed setup round (compilation, peaks, the plans of ours)."""
    inner_repeats: int = 2
    """Timed steps per strategy and round, after one warm-up step."""
    profile_repeats: int = 2
    """Timed repeats per op when profiling the model (`planner.profile`'s ``repeats``)."""
    time_limit_s: float | None = 30.0
    """Seconds per solve of ours (``auto`` runs every solver, the ILP included)."""
    iso: bool = True
    """Also plan ours at each baseline's measured peak (iso-memory)."""
    graph: bool = False
    """Also trace the model with make_fx (`planner.graph`, where it traces) and measure its
    op-granular plans at the same fractions (rows ``graph@f``), and the baselines whose segments
    span several modules, which cannot be applied in place."""
    include_compile: bool = True
    """Measure the torch.compile entries at all."""
    compile_budgets: tuple[float, ...] = (1.0, 0.8, 0.5, 0.2, 0.0)
    """Values of ``torch._functorch.config.activation_memory_budget`` (1.0: the backend without
    extra recomputation, the reference for compiled rows)."""
    compile_memory_budgets: tuple[float, ...] = MEMORY_BUDGETS
    """The partitioner settings "ours + backend" searches, as ``plan(..., compile=backend)``
    does (`planner.compiled`)."""
    compile_backend: str | tuple[str, ...] = "aot_eager"
    """``aot_eager``, ``inductor`` (needs a C++ compiler on CPU), or several, each measured at
    every budget; aot_eager rows are named ``compile(b)``, other backends' ``<backend>(b)``."""
    eager_attention: bool | None = None
    """Evaluate the eager-attention target; None detects it from the profile (softmax and
    batched matmuls, no SDPA)."""


def compare(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    options: CompareOptions | None = None,
    progress: bool = False,
    name: str | None = None,
    **overrides: Any,
) -> CompareResult:
    """Measure no checkpointing, the baselines, torch.compile's activation budget and our plans.

    Our plans and the baselines are applied to `model` in place for their measurements and taken
    off again; the model is left as it was.

    Args:
        model: an eager model in training mode, with no plan applied.
        example_inputs: a tensor, a tuple of positional args or a dict of kwargs.
        loss_fn: output -> scalar loss, as for `planner.plan`.
        options: what to measure and how often (`CompareOptions`); any of its fields can also
            be given as a keyword (``compare(m, x, repeats=2)``), which overrides `options`.
        progress: print progress lines to stderr.
        name: the model's name in the table and plot (default: its class name).
    """
    try:
        opts = replace(options or CompareOptions(), **overrides)
    except TypeError:
        known = {f.name for f in fields(CompareOptions)}
        raise TypeError(f"compare() got unknown option(s) {sorted(set(overrides) - known)}; "
                        f"CompareOptions has {sorted(known)}") from None
    fractions, repeats, inner_repeats = opts.fractions, opts.repeats, opts.inner_repeats
    profile_repeats, time_limit_s, iso, graph = (opts.profile_repeats, opts.time_limit_s,
                                                 opts.iso, opts.graph)
    include_compile, compile_budgets, backend_names = (opts.include_compile,
                                                       opts.compile_budgets, opts.compile_backend)
    compile_memory_budgets = opts.compile_memory_budgets
    eager_attention = opts.eager_attention
    say = _Say(progress)
    name = name or type(model).__name__
    backends = (backend_names,) if isinstance(backend_names, str) else tuple(backend_names)
    if include_compile and not backends:
        raise ValueError("compile_backend names no backend; pass include_compile=False instead")
    if applied(model) is not None:
        raise CkptPlannerError("compare measures the model without a plan applied; call "
                               "planner.remove(model) first")
    fractions = tuple(fractions)
    t_start = time.perf_counter()
    say(f"{name}: profiling")
    prof = profile(model, example_inputs, loss_fn=loss_fn, repeats=profile_repeats)
    eager = _eager_attention(prof) if eager_attention is None else eager_attention
    gpt = None
    if graph:
        say(f"{name}: tracing with make_fx for the graph plans")
        try:
            from planner.graph.profiler import profile_with_trace

            gpt = profile_with_trace(model, example_inputs, loss_fn=loss_fn,
                                     repeats=profile_repeats)
        except Exception as ex:  # noqa: BLE001 - the graph path is optional; record why
            say(f"make_fx tracing failed ({type(ex).__name__}): graph rows left out")

    entries: list[_Entry] = []

    def add(row: Row, module, **kw) -> _Entry:
        e = _Entry(row, module, **kw)
        entries.append(e)
        return e

    def measure_entry(e: _Entry) -> None:
        _measure_entry(e, model, example_inputs, loss_fn, inner_repeats, prof.held_bytes)

    def step_peak(module: torch.nn.Module) -> int:
        return measure(module, example_inputs, loss_fn, repeats=1,
                       held_bytes=prof.held_bytes).peak_bytes

    def time_step(module: torch.nn.Module) -> float:
        return measure(module, example_inputs, loss_fn, repeats=inner_repeats, warmup=0).step_ms

    # none first: its measured peak sets the budgets
    none = add(Row(strategy="none", kind="none", method="none", regions=0), model)
    say("measuring none (sets the budgets)")
    measure_entry(none)
    N = none.peaks[0]
    F = prof.fixed_bytes
    none.row.predicted_peak_bytes = solve(prof, 2**62, "none").predicted_peak_bytes
    budgets = {f: int(F + f * (N - F)) for f in fractions}
    plan_fractions = list(fractions)
    if eager and 0.35 not in plan_fractions:
        plan_fractions.append(0.35)  # the ">= 65% less activation memory" point
        budgets[0.35] = int(F + 0.35 * (N - F))
    mid = budgets.get(0.5, int(F + 0.5 * (N - F)))
    say(f"N = {N / MiB:.2f} MiB, F = {F / MiB:.2f} MiB; budgets "
        + ", ".join(f"{f:g}x {b / MiB:.2f} MiB" for f, b in budgets.items()))

    # baselines: in place where their regions are module calls, else through the graph rewriter
    built: dict[tuple, _Entry] = {}
    for m in BASELINES:
        if m == "none":
            continue
        budget = mid if m in _BUDGET_DEPENDENT else None
        s = solve(prof, budget if budget is not None else 2**62, m)
        row = Row(strategy=m, kind="baseline", budget_bytes=budget, method=m,
                  predicted_peak_bytes=s.predicted_peak_bytes, regions=len(s.regions),
                  predicted_extra_pct=_pred_pct(s, prof))
        if applicable(s):
            built.setdefault(_schedule_key(s), add(row, model, schedule=s))
            continue
        if gpt is None:
            row.status = ("not applicable in place: its segments span several module calls"
                          + ("" if graph else " (graph=True measures it through make_fx)"))
            add(row, None)
            continue
        try:
            from planner.graph.rewrite import PlannedModule, rewrite

            gs = solve(gpt.profile, budget if budget is not None else 2**62, m)
            row.strategy = f"{m} (graph)"
            row.predicted_peak_bytes = gs.predicted_peak_bytes
            row.predicted_extra_pct = _pred_pct(gs, gpt.profile)
            add(row, PlannedModule(model, gpt.trace, rewrite(gpt.trace, gs)))
        except Exception as ex:  # noqa: BLE001 - record, do not crash
            row.status = f"error: {type(ex).__name__}: {ex}"[:200]
            add(row, None)

    # torch.compile with activation_memory_budget
    restore: dict[str, Any] = {}
    if include_compile:
        _caches_off()
        import torch._functorch.config as fc

        if not hasattr(fc, "activation_memory_budget"):
            say("this torch has no activation_memory_budget: compile entries skipped")
        else:
            torch._dynamo.reset()
            # Every compiled row compiles the same forward code again (another backend or
            # budget): past dynamo's recompile limit (8) it would silently run eager.
            raise_recompile_limit(restore)
            for backend in backends:
                for b in compile_budgets:
                    label = "compile" if backend == "aot_eager" else backend
                    row = Row(strategy=f"{label}({b:g})", kind="compile", method=backend)
                    try:
                        torch._dynamo.reset()  # no reuse of another budget's graphs
                        # budget 0: torch's knob as is (compile_backend would raise it to
                        # LEAST_MEMORY_BUDGET so that its marks hold); elsewhere the same
                        # setting, random draws kept (on models without any, the knob as is)
                        cm = torch.compile(model, backend=compile_backend(backend, b) if b > 0
                                           else torch_memory_budget(backend, b))
                    except Exception as ex:  # noqa: BLE001
                        row.status = f"error: {type(ex).__name__}: {ex}"[:200]
                        add(row, None)
                        continue
                    add(row, cm, budget=b)

    # the setup round of the anchors: compiles, and gives the measured peaks the iso plans need
    for e in entries[1:]:
        if e.module is None:
            continue
        say(f"setup: {e.row.strategy}")
        try:
            measure_entry(e)
        except Exception as ex:  # noqa: BLE001
            e.row.status = f"error: {type(ex).__name__}: {ex}"[:200]
            e.module = None

    # ours: iso-memory and sweep
    by_budget: dict[int, _Entry] = {}

    def plan_at(row: Row, budget: int) -> None:
        prev = by_budget.get(budget)
        if prev is not None:  # same budget as an earlier plan of ours: same schedule
            row.method, row.regions = prev.row.method, prev.row.regions
            row.predicted_peak_bytes, row.status, row.fits = (
                prev.row.predicted_peak_bytes, prev.row.status, prev.row.fits)
            row.predicted_extra_pct = prev.row.predicted_extra_pct
            e = add(row, None)
            e.alias = (prev.alias or prev) if prev.row.status == "ok" else None
            return
        try:
            s = solve_within(prof, budget, "auto", time_limit_s)
        except Exception as ex:  # noqa: BLE001
            row.status = f"error: {type(ex).__name__}: {ex}"[:200]
            add(row, None)
            return
        if not s.feasible:
            least = s.min_peak_bytes or smallest_peak(prof)
            row.status = f"does not fit (smallest peak {least / MiB:.2f} MiB)"
            row.predicted_peak_bytes = least
            row.fits = False
            by_budget[budget] = add(row, None)
            return
        row.method = s.method
        row.predicted_peak_bytes = s.predicted_peak_bytes
        row.predicted_extra_pct = _pred_pct(s, prof)
        row.regions = len(s.regions)
        e = add(row, model, schedule=s)
        by_budget[budget] = e
        key = _schedule_key(s)
        if key in built:
            e.alias = built[key]
            e.module = e.schedule = None
        else:
            built[key] = e

    for e in list(entries):
        if iso and e.row.kind == "baseline" and e.peaks:
            say(f"planning ours at {e.row.strategy}'s measured peak")
            plan_at(Row(strategy=f"ours={e.row.strategy}", kind="ours_iso",
                        budget_bytes=e.peaks[0]), e.peaks[0])
    for f in plan_fractions:
        say(f"planning ours at {f:g}x")
        plan_at(Row(strategy=f"ours@{f:g}", kind="ours_sweep", budget_bytes=budgets[f],
                    fraction=f), budgets[f])
    if gpt is not None:
        from planner.graph.api import plan_from_trace

        for f in plan_fractions:
            row = Row(strategy=f"graph@{f:g}", kind="graph_sweep", budget_bytes=budgets[f],
                      fraction=f)
            try:
                gp = plan_from_trace(model, gpt, budgets[f], time_limit_s=time_limit_s)
            except InfeasibleBudgetError:
                row.status = "does not fit"
                row.fits = False
                add(row, None)
                continue
            except Exception as ex:  # noqa: BLE001
                row.status = f"error: {type(ex).__name__}: {ex}"[:200]
                add(row, None)
                continue
            row.method = gp.schedule.method
            row.predicted_peak_bytes = gp.schedule.predicted_peak_bytes
            row.predicted_extra_pct = _pred_pct(gp.schedule, gpt.profile)
            row.regions = len(gp.schedule.regions)
            add(row, gp.module)
    if include_compile and hasattr(torch._functorch.config, "activation_memory_budget"):
        # ours + torch.compile: what plan(..., compile=backend) picks (`planner.compiled`):
        # copies of the model, planned or not, compiled whole-model at each partitioner budget,
        # the fastest that fits; "no plan" at budget b is the backend(b) row itself.
        raise_recompile_limit(restore)
        eager_none = simulate(prof).peak_bytes

        def solve_feasible(variant: Profile, b: int) -> Schedule | None:
            s = solve_within(variant, b, "auto", time_limit_s)
            return s if s.feasible else None
        for backend in backends:
            label = "compile" if backend == "aot_eager" else backend
            rows_at = {e.compile_budget: e for e in entries if e.row.kind == "compile"
                       and e.row.method == backend and e.peaks and e.module is not None}
            own: dict[float, tuple[int, torch.nn.Module]] = {}

            def unplanned(m: float, backend=backend, rows_at=rows_at, own=own):
                if m in rows_at and m > 0:  # the same compiled configuration (above)
                    return rows_at[m].peaks[0], rows_at[m].module
                if m not in own:
                    module = compile_copy(model, None, backend, m)
                    own[m] = (step_peak(module), module)
                return own[m]

            # each compiled search compiles the model several times; at the ">= 65% less"
            # point too where it applies, so that the target reads every plan of ours there
            for f in plan_fractions:
                row = Row(strategy=f"ours+{backend}@{f:g}", kind="ours_compiled",
                          budget_bytes=budgets[f], fraction=f, method=backend)
                say(f"planning ours + {backend} at {f:g}x")
                try:
                    fits, tried = compiled_search(
                        model, prof, budgets[f] - SLACK_BYTES, backend=backend,
                        eager_none=eager_none, unplanned=unplanned, step=step_peak,
                        time_step=time_step, solve_at=solve_feasible,
                        memory_budgets=compile_memory_budgets)
                except Exception as ex:  # noqa: BLE001 - record, do not crash
                    row.status = f"error: {type(ex).__name__}: {ex}"[:200]
                    add(row, None)
                    continue
                # Summarized after the pick: its final side-by-side rounds are in the medians.
                best = compiled_fastest(fits, time_step) if fits else None
                row.searched = [c.summary(best) for c in tried]
                for c in tried:
                    say(f"  searched {c.describe(label)}{'  <- picked' if c is best else ''}")
                if best is None:
                    planned = [c for c in tried if c.schedule is not None]
                    if planned:
                        row.status = "does not fit compiled: measured " + ", ".join(
                            f"{c.peak_bytes / MiB:.2f} MiB ({c.label(label)}, planned for "
                            f"{c.eager_budget / MiB:.2f})" for c in planned)
                    else:
                        least = smallest_peak(prof)
                        row.status = f"does not fit (smallest peak {least / MiB:.2f} MiB)"
                        row.fits = False
                    add(row, None)
                    continue
                row.method = f"{backend}({best.memory_budget:g}), " + (
                    best.schedule.method if best.schedule is not None else "none")
                if best.schedule is not None and best.cost_model != EAGER_COST.name:
                    row.method += f" ({best.cost_model})"
                if best.schedule is None:
                    row.regions, row.predicted_extra_pct = 0, 0.0
                    e = add(row, None)
                    e.alias = rows_at.get(best.memory_budget)
                    if e.alias is None:  # measured here, not a row of its own
                        e.module = best.module
                    continue
                s = best.schedule
                row.predicted_peak_bytes = s.predicted_peak_bytes
                row.predicted_extra_pct = _pred_pct(s, prof)
                row.regions = len(s.regions)
                if best.eager_budget > budgets[f] - SLACK_BYTES:
                    row.status = (f"ok (planned for {best.eager_budget / MiB:.2f} MiB eager; "
                                  f"{label}({best.memory_budget:g}) without a plan peaks at "
                                  f"{unplanned(best.memory_budget)[0] / MiB:.2f} MiB)")
                add(row, best.module)
    for e in entries:
        if e.row.kind in ("ours_iso", "ours_sweep", "graph_sweep", "ours_compiled") \
                and e.module is not None:
            say(f"setup: {e.row.strategy}")
            measure_entry(e)
    # The setup round's step times are not kept: none was stepped before anything was planned,
    # the anchors before our plans were searched (minutes, on a machine whose load drifts), so
    # they were not taken alternated with ours. Its peaks are kept.
    for e in entries:
        e.samples.clear()

    # the timed rounds: every strategy once per round, in turn
    for k in range(1, repeats + 1):
        for e in entries:
            if e.module is None:
                continue
            say(f"round {k}/{repeats}: {e.row.strategy}")
            try:
                measure_entry(e)
            except Exception as ex:  # noqa: BLE001
                e.row.status = f"error in round {k}: {type(ex).__name__}: {ex}"[:200]

    if include_compile:
        torch._dynamo.reset()
    for setting, value in restore.items():
        setattr(torch._dynamo.config, setting, value)

    # rows
    base = statistics.median(none.samples)
    for e in entries:
        src = e.alias or e
        r = e.row
        if not src.samples:
            continue
        r.measured_peak_bytes = max(src.peaks)
        r.samples_ms = list(src.samples)
        r.step_ms = statistics.median(src.samples)
        r.step_ms_min, r.step_ms_max = min(src.samples), max(src.samples)
        r.extra_pct = 100 * (r.step_ms / base - 1)
        if r.budget_bytes is not None:
            r.fits = r.measured_peak_bytes <= r.budget_bytes
        if e.alias is not None and e.alias.row.kind == "compile":
            r.status = f"ok ({e.alias.row.strategy} without a plan is the fastest that fits)"
        elif e.alias is not None:
            r.status = f"ok (same schedule as {e.alias.row.strategy})"
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": _cpu_name(),
        "malloc": host_allocator(),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "setup_round_timed": False,
        "inner_repeats": inner_repeats,
        "graph": graph,
        "compile_backend": ",".join(backends) if include_compile else None,
        "profile_step_ms": prof.step_ms,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    say(f"done in {meta['seconds']} s")
    return CompareResult(
        model=name, rows=[e.row for e in entries], none_peak_bytes=N, fixed_bytes=F,
        fractions=fractions, budgets=budgets, eager_attention=eager, meta=meta,
    )


def host_allocator() -> str:
    """The C allocator this process runs on: ``tcmalloc``, ``jemalloc``, ``mimalloc`` (preloaded
    or linked), ``glibc`` on other Linux, ``unknown`` elsewhere.

    It matters on CPU: with glibc's malloc, large tensors freed and allocated again come back as
    fresh pages, whose first touch costs more than the op that fills them (benchmarks/RESULTS.md
    has the figures). Checkpointing frees and reallocates more than no checkpointing does, so
    glibc inflates its measured cost; PyTorch's CPU tuning guide recommends tcmalloc or jemalloc.
    """
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for name in ("tcmalloc", "jemalloc", "mimalloc"):
        if name in maps:
            return name
    return "glibc" if platform.system() == "Linux" else "unknown"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
