"""The make_fx graph path, an explicit option: plans whose regions are any node ranges of a traced
graph (op-granular cuts), run by a module that replays the trace (`PlannedModule`).

It exists for what in-place plans cannot express (a region that starts or ends inside a module's
forward, a baseline segment spanning several modules outside an `nn.Sequential`) and to measure
those against in-place plans (`planner.compare(..., graph=True)`). It fails where `make_fx`
cannot trace the model (value-dependent code, HF mask code) and the module it returns accepts only
the traced input shapes, so `planner.plan` never takes this path on its own.

    >>> gp = plan_graph(model, budget_bytes, example_inputs=batch)   # doctest: +SKIP
    >>> gp.verify(); out = gp.module(batch)                          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from planner.api import SLACK_BYTES, InfeasibleBudgetError, Verification, verify_against
from planner.graph.profiler import ProfiledTrace, profile_with_trace
from planner.graph.rewrite import PlannedModule, rewrite
from solvers.profile import Profile
from solvers.schedule import Schedule
from solvers.solve import smallest_peak, solve
from solvers.units import format_bytes

__all__ = ["GraphPlan", "plan_from_trace", "plan_graph"]


@dataclass(kw_only=True)
class GraphPlan:
    """A graph plan: `module` replays the traced step with the schedule's regions checkpointed,
    on the user's parameters (`module.model`)."""

    module: PlannedModule
    schedule: Schedule
    profile: Profile
    budget_bytes: int
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    example_inputs: Any = None

    def verify(self, *, rtol: float = 1e-5, atol: float = 1e-6, repeats: int = 3) -> Verification:
        """Same loss and gradients as the model; measured peak against predicted and budget."""
        return verify_against(contextlib.nullcontext(self.module.model),
                              contextlib.nullcontext(self.module), self.example_inputs,
                              self.loss_fn, self.schedule, self.budget_bytes, rtol=rtol,
                              atol=atol, repeats=repeats, planned_params=self.module.model)

    @property
    def predicted_peak_bytes(self) -> int:
        return self.schedule.predicted_peak_bytes


def plan_from_trace(model: torch.nn.Module, traced: ProfiledTrace, budget_bytes: int, *,
                    method: str = "auto", time_limit_s: float | None = None) -> GraphPlan:
    """Solve a traced profile for `budget_bytes` and build the checkpointed graph module."""
    prof = traced.profile
    schedule = solve(prof, budget_bytes - SLACK_BYTES, method=method, time_limit_s=time_limit_s)
    if not schedule.feasible:
        exact = solve(prof, budget_bytes, method=method, time_limit_s=time_limit_s)
        if exact.feasible:
            schedule = exact
    if not schedule.feasible:
        least = schedule.min_peak_bytes or smallest_peak(prof)
        raise InfeasibleBudgetError(
            f"budget {format_bytes(budget_bytes)} is below the smallest peak a graph plan "
            f"reaches for this model and batch ({format_bytes(least)}); raise the budget"
        )
    module = PlannedModule(model, traced.trace, rewrite(traced.trace, schedule))
    return GraphPlan(module=module, schedule=schedule, profile=prof, budget_bytes=budget_bytes)


def plan_graph(model: torch.nn.Module, budget_bytes: int, *, example_inputs: Any,
               loss_fn: Callable[[Any], torch.Tensor] | None = None, method: str = "auto",
               time_limit_s: float | None = None, repeats: int = 3) -> GraphPlan:
    """Trace `model` with make_fx, profile the trace, and plan it for `budget_bytes`."""
    traced = profile_with_trace(model, example_inputs, loss_fn=loss_fn, repeats=repeats)
    gp = plan_from_trace(model, traced, budget_bytes, method=method, time_limit_s=time_limit_s)
    gp.loss_fn, gp.example_inputs = loss_fn, example_inputs
    return gp
