"""`plan(model, budget_gb=...)`: profile, solve, rewrite; and `apply` for a saved schedule.

    >>> p = planner.plan(model, budget_gb=20, example_inputs=batch)   # doctest: +SKIP
    >>> print(p.report()); p.verify()                                   # doctest: +SKIP
    >>> model = p.module                                                # train as usual

`budget_gb` is GiB (2**30 bytes) of the peak memory of one training step: forward + backward (+ the
optimizer step when an optimizer is given), parameters and inputs included, as
`torch.cuda.max_memory_allocated` reports it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from planner.measure import Measurement, measure
from planner.profiler import ProfiledTrace, profile_with_trace
from planner.rewrite import PlannedModule, rewrite
from planner.trace import default_loss, preserved_rng, split_inputs, trace_joint
from solvers.errors import CkptPlannerError
from solvers.profile import Profile
from solvers.schedule import Schedule
from solvers.solve import BASELINES, smallest_peak, solve

__all__ = [
    "InfeasibleBudgetError",
    "Plan",
    "PlanNotEffectiveError",
    "Verification",
    "apply",
    "plan",
]

GiB = 2**30

SLACK_BYTES = 8 * 1024
"""Plans are solved for the budget minus this where they can be: a step also allocates a few small
tensors the profile does not see; measured on the test models, 4 B to 4.5 KiB. Where no plan leaves
this slack, one that the simulator says fits the budget exactly is taken."""


class InfeasibleBudgetError(CkptPlannerError, ValueError):
    """No schedule fits the budget."""


class PlanNotEffectiveError(CkptPlannerError, RuntimeError):
    """A plan with regions did not lower the measured peak: checkpointing silently did nothing."""


def _gib(b: float) -> str:
    return f"{b / GiB:.3f} GiB" if b >= 0.1 * GiB else f"{b / 2**20:.2f} MiB"


@dataclass(frozen=True, kw_only=True)
class Verification:
    """What `Plan.verify` measured."""

    loss_original: float
    loss_planned: float
    max_grad_rel_err: float
    measured_peak_bytes: int
    predicted_peak_bytes: int
    budget_bytes: int
    measured_none_peak_bytes: int
    step_ms_original: float
    step_ms_planned: float

    @property
    def peak_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def overhead(self) -> float:
        return self.step_ms_planned / self.step_ms_original - 1.0


@dataclass(kw_only=True)
class Plan:
    """A checkpointing plan for one model, input shape and budget."""

    module: PlannedModule
    """The model, run through its checkpointed graph in training mode (same parameter tensors)."""
    schedule: Schedule
    profile: Profile
    budget_bytes: int
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    example_inputs: Any = None
    optimizer: torch.optim.Optimizer | None = None
    _baselines: dict[str, Schedule] = field(default_factory=dict, repr=False)

    @property
    def predicted_peak_bytes(self) -> int:
        return self.schedule.predicted_peak_bytes

    @property
    def predicted_overhead(self) -> float:
        """Extra step time from recomputation, as a fraction of the profiled step time."""
        return self.schedule.predicted_recompute_ms / max(self.profile.step_ms, 1e-9)

    def baselines(self) -> dict[str, Schedule]:
        """The baselines solved at the same budget (computed once)."""
        if not self._baselines:
            for m in BASELINES:
                self._baselines[m] = solve(self.profile, self.budget_bytes, method=m)
        return self._baselines

    def report(self) -> str:
        """A table of this plan and the baselines at the same budget."""
        p = self.profile
        rows = [("plan: " + self.schedule.method, self.schedule)]
        rows += [(m, s) for m, s in self.baselines().items()]
        lines = [
            f"budget {_gib(self.budget_bytes)}; fixed memory {_gib(p.fixed_bytes)} "
            f"(params {_gib(p.param_bytes)}, inputs {_gib(p.input_bytes)}, optimizer state "
            f"{_gib(p.optimizer_state_bytes)}); activations saved without checkpointing "
            f"{_gib(p.saved_bytes)}; profiled step {p.step_ms:.2f} ms ({p.meta.mode}, "
            f"{p.meta.device_name})",
            f"{'method':<22} {'status':<11} {'peak':>12} {'extra time':>18} {'regions':>8}",
        ]
        for name, s in rows:
            extra = s.predicted_recompute_ms
            lines.append(
                f"{name:<22} {s.status:<11} {_gib(s.predicted_peak_bytes):>12} "
                f"{extra:>9.2f} ms {100 * extra / max(p.step_ms, 1e-9):>5.1f}% "
                f"{len(s.regions):>8}"
            )
        return "\n".join(lines)

    def save(self, path: str | Path) -> Path:
        """Save the schedule (JSON) and, beside it, the profile (``<stem>.profile.json.gz``)."""
        path = Path(path)
        self.schedule.save(path)
        self.profile.save(path.with_name(path.stem + ".profile.json.gz"))
        return path

    def verify(self, *, rtol: float = 1e-5, atol: float = 1e-6, repeats: int = 3) -> Verification:
        """Run the original and the planned module on the example inputs: same loss, same gradients
        (allclose), measured peak against predicted and against the budget. Raises AssertionError
        on a mismatch and PlanNotEffectiveError if the plan has regions but the measured peak is not
        below the unplanned one. The model's parameters, buffers and RNG are left as they were."""
        model = self.module.model
        loss_fn = self.loss_fn or default_loss
        l0, g0 = _one_step(model, self.example_inputs, loss_fn)
        l1, g1 = _one_step(self.module, self.example_inputs, loss_fn)
        if not torch.allclose(l0, l1, rtol=rtol, atol=atol):
            raise AssertionError(f"loss differs: original {l0.item()} vs planned {l1.item()}")
        worst = 0.0
        for name, a in g0.items():
            b = g1.get(name)
            if b is None:
                raise AssertionError(f"parameter {name} got no gradient from the planned module")
            if not torch.allclose(a, b, rtol=rtol, atol=atol):
                raise AssertionError(f"gradient of {name} differs beyond rtol={rtol}")
            denom = a.abs().max().item() or 1.0
            worst = max(worst, (a - b).abs().max().item() / denom)
        m0 = measure(model, self.example_inputs, loss_fn, repeats=repeats)
        m1 = measure(self.module, self.example_inputs, loss_fn, repeats=repeats)
        if self.schedule.regions and m1.peak_bytes >= m0.peak_bytes:
            raise PlanNotEffectiveError(
                f"the plan has {len(self.schedule.regions)} checkpointed regions but the measured "
                f"peak ({_gib(m1.peak_bytes)}) is not below the unplanned one "
                f"({_gib(m0.peak_bytes)}): checkpointing took no effect"
            )
        return Verification(
            loss_original=l0.item(),
            loss_planned=l1.item(),
            max_grad_rel_err=worst,
            measured_peak_bytes=m1.peak_bytes,
            predicted_peak_bytes=self.predicted_peak_bytes,
            budget_bytes=self.budget_bytes,
            measured_none_peak_bytes=m0.peak_bytes,
            step_ms_original=m0.step_ms,
            step_ms_planned=m1.step_ms,
        )

    def measure(self, repeats: int = 5) -> Measurement:
        return measure(self.module, self.example_inputs, self.loss_fn, repeats=repeats)


def _one_step(module: torch.nn.Module, example_inputs: Any, loss_fn) -> tuple[torch.Tensor, dict]:
    """Loss and gradients of one step from a fixed seed; parameters, buffers, grads restored."""
    args, kwargs = split_inputs(example_inputs)
    owner = module.model if isinstance(module, PlannedModule) else module
    params = dict(owner.named_parameters())
    state = copy.deepcopy({k: v.detach() for k, v in module.state_dict().items()})
    old = {k: p.grad for k, p in params.items()}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for p in params.values():
            p.grad = None
        loss = loss_fn(module(*args, **kwargs))
        loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
    with torch.no_grad():
        for k, v in module.state_dict().items():
            v.copy_(state[k])
    for k, p in params.items():
        p.grad = old[k]
    return loss.detach(), grads


def _check_not_wrapped(model: torch.nn.Module) -> None:
    flag = getattr(model, "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(model, "is_gradient_checkpointing", False)
    if flag:
        raise CkptPlannerError(
            f"{type(model).__name__} has HF gradient checkpointing enabled; ckpt-planner places "
            "checkpoints itself. Call model.gradient_checkpointing_disable() before planning."
        )
    for name, m in model.named_modules():
        cls = type(m).__name__
        if cls in ("CheckpointWrapper", "PlannedModule") or getattr(m, "_checkpoint_wrapped", 0):
            raise CkptPlannerError(
                f"module {name or '(root)'} is already wrapped for checkpointing ({cls}); plan the "
                "unwrapped model (remove checkpoint_wrapper / use the original module)"
            )


def _budget(budget_gb: float | None, budget_bytes: int | None) -> int:
    if (budget_gb is None) == (budget_bytes is None):
        raise ValueError("give exactly one of budget_gb (GiB) or budget_bytes")
    b = int(budget_gb * GiB) if budget_gb is not None else int(budget_bytes)
    if b <= 0:
        raise ValueError(f"the budget must be positive, got {b} bytes")
    return b


def _infeasible(profile: Profile, budget: int, schedule: Schedule) -> InfeasibleBudgetError:
    least = schedule.min_peak_bytes or smallest_peak(profile)
    by_module = profile.saved_bytes_by_module()
    top = sorted(by_module.items(), key=lambda kv: -kv[1])[:3]
    tops = ", ".join(f"{m or '(top level)'} {_gib(b)}" for m, b in top)
    return InfeasibleBudgetError(
        f"budget {_gib(budget)} is below the smallest achievable peak for this model and batch"
        f" ({_gib(least)}, of which {_gib(profile.fixed_bytes)} is parameters, buffers, inputs and "
        f"optimizer state; largest activations: {tops}); raise the budget or lower the batch size"
    )


def plan(
    model: torch.nn.Module,
    budget_gb: float | None = None,
    *,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    method: str = "auto",
    budget_bytes: int | None = None,
    time_limit_s: float | None = None,
    repeats: int = 3,
    progress: bool = False,
) -> Plan:
    """Plan activation checkpointing for `model` so that a training step fits the budget.

    Args:
        model: an eager model in training mode; not modified.
        budget_gb: peak memory of one training step in GiB (or pass `budget_bytes`).
        example_inputs: a tensor, a tuple of positional args or a dict of kwargs, of the shapes
            you will train with (the plan is specific to them).
        loss_fn: output -> scalar loss; default ``output.loss`` or the mean of the output.
        optimizer: include its state and step in the budget.
        method: a name from `solvers.available_methods()`; ``auto`` takes the best.

    Raises:
        InfeasibleBudgetError: naming the smallest achievable peak and the largest activations.
        TraceError: the model cannot be traced (names the module and op).
    """
    budget = _budget(budget_gb, budget_bytes)
    _check_not_wrapped(model)
    if not model.training:
        raise CkptPlannerError(
            "the model is in eval mode; checkpointing is for training: call model.train() first"
        )
    pt: ProfiledTrace = profile_with_trace(
        model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, repeats=repeats,
        progress=progress,
    )
    return _plan_from(model, pt, budget, example_inputs, loss_fn, optimizer, method, time_limit_s)


def _plan_from(model, pt, budget, example_inputs, loss_fn, optimizer, method, time_limit_s):
    schedule = solve(pt.profile, budget - SLACK_BYTES, method=method, time_limit_s=time_limit_s)
    if not schedule.feasible:
        # No plan leaves the slack: take one the simulator says fits exactly (its measured peak
        # may then exceed the budget by the few unprofiled bytes SLACK_BYTES is there for).
        exact = solve(pt.profile, budget, method=method, time_limit_s=time_limit_s)
        if exact.feasible:
            schedule = dataclasses.replace(exact, stats={**exact.stats, "slack_bytes": 0})
    if not schedule.feasible:
        raise _infeasible(pt.profile, budget, schedule)
    module = PlannedModule(model, pt.trace, rewrite(pt.trace, schedule))
    return Plan(
        module=module,
        schedule=schedule,
        profile=pt.profile,
        budget_bytes=budget,
        loss_fn=loss_fn,
        example_inputs=example_inputs,
        optimizer=optimizer,
    )


def apply(
    model: torch.nn.Module,
    schedule: Schedule | str | Path,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> PlannedModule:
    """Rebuild the checkpointed module from a saved schedule (e.g. planned offline for this GPU).

    The model is traced again on `example_inputs` (no timing); the schedule's node names must exist
    in the new trace, which holds for the same model code, input shapes and torch version.
    """
    if not isinstance(schedule, Schedule):
        schedule = Schedule.load(schedule)
    _check_not_wrapped(model)
    args, kwargs = split_inputs(example_inputs)
    with preserved_rng():
        trace = trace_joint(
            model, args, kwargs, loss_fn=loss_fn,
            buffers={k: v.clone() for k, v in model.named_buffers()},
        )
    # rewrite raises ScheduleError naming any node of the schedule that is not in this trace
    return PlannedModule(model, trace, rewrite(trace, schedule))
