"""`plan(model, budget_gb=...)`: profile, solve, and apply the schedule to the model in place.

    >>> p = planner.plan(model, budget_gb=20, example_inputs=batch)   # doctest: +SKIP
    >>> print(p.report()); p.verify()                                   # doctest: +SKIP
    >>> assert p.module is model                                        # train as usual

`budget_gb` is the peak memory of one training step: forward + backward (+ the optimizer step when
an optimizer is given), parameters and inputs included, as `torch.cuda.max_memory_allocated`
reports it. A number is GiB (2**30 bytes); a string may carry a unit ("16GB" is 16 * 10**9
bytes, "500MiB" is 500 * 2**20). The budget holds for every batch no larger in any dimension than
`example_inputs`: plan with the largest batch and sequence length you will train with.

The plan is put onto the model's own modules (`planner.inplace`): the object, its class,
parameters, `state_dict` keys and hooks stay as they are, any input shape runs, and
`planner.remove(model)` takes the plan off. Wrap with DDP, `fully_shard` or `torch.compile`
after planning, as torchtitan orders activation checkpointing, compile and FSDP.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from planner import compiled, inplace
from planner.capture.record import (
    ModelRunError,
    default_loss,
    inputs_as_given,
    put_back,
    python_state,
    seeded,
    seeds_running_all,
    split_inputs,
)
from planner.fsdp import fsdp_cast, mixed_precision
from planner.identity import differences, made_for
from planner.inplace import applied, apply_schedule
from planner.measurement import Measurement, measure
from planner.profiling import CHECK_TOLERANCE, check_dense_gradients, profile, step_spec
from solvers.accumulation import holding_grads
from solvers.distributed import per_rank
from solvers.errors import CkptPlannerError, ProfileError, ScheduleError
from solvers.profile import Profile
from solvers.schedule import Region, Schedule
from solvers.simulate import peak_breakdown, simulate, unsplittable_at_peak
from solvers.solve import BASELINES, FLOOR_TIME_LIMIT_S, lowest, solve
from solvers.units import format_bytes, parse_budget

__all__ = [
    "InfeasibleBudgetError",
    "NotReproducibleError",
    "Plan",
    "PlanNotEffectiveError",
    "Verification",
    "apply",
    "plan",
    "plan_from_profile",
    "remove",
    "unwrap",
    "verify_against",
]

SLACK_BYTES = 8 * 1024
"""Plans are solved for the budget minus this where they can be: a step also allocates a few small
tensors the profile does not see. Where no plan leaves this slack, one that the simulator says fits
the budget exactly is taken."""


class InfeasibleBudgetError(CkptPlannerError, ValueError):
    """No schedule fits the budget."""


class NotReproducibleError(CkptPlannerError, AssertionError):
    """`Plan.verify` cannot compare: the unplanned model's own step differs between two runs
    from the same seed."""


class PlanNotEffectiveError(CkptPlannerError, RuntimeError):
    """A plan with regions did not lower the measured peak: checkpointing silently did nothing."""


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

    @property
    def fits_budget(self) -> bool:
        """Whether the measured peak is within the budget (`verify` warns where it is not; for a
        plan made for `torch.compile` the budget is the compiled step's, and this the eager
        step's peak, so it neither warns nor need hold)."""
        return self.measured_peak_bytes <= self.budget_bytes


@dataclass(kw_only=True)
class Plan:
    """A checkpointing plan, applied to the model it was made for."""

    module: torch.nn.Module
    """The model the plan was made for, the very object passed to `plan` (now checkpointed; for a
    DistributedDataParallel model, the wrapper, whose inner module carries the plan)."""
    schedule: Schedule
    profile: Profile
    budget_bytes: int
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    example_inputs: Any = None
    optimizer: torch.optim.Optimizer | None = None
    autocast: torch.dtype | None = None
    """The dtype forward and loss run in under `torch.autocast` (as profiled), or None."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Where `plan` spent its time: ``profile``, ``solve``, ``apply``."""
    margin_bytes: int = 0
    """Left unused below the budget, measured: for memory that moves from batch to batch
    (value-dependent shapes, MoE routing), and for what torch.compile's regions keep beyond the
    eager prediction (`plan(..., compile=...)`)."""
    compiled_peak_bytes: int | None = None
    """With ``plan(..., compile=backend)``: the measured peak of the planned step compiled; with
    an optimizer, its state added, or its update's simulated peak where that is higher."""
    compiled_backend: str | None = None
    """The `torch.compile` backend the plan was fitted under, if any."""
    compile_memory_budget: float | None = None
    """With ``plan(..., compile=backend)``: the partitioner's ``activation_memory_budget`` the
    plan was fitted with (1.0: the compiler's default). Compile with `compile_backend`."""
    compile_search: list[dict] = field(default_factory=list)
    """With ``plan(..., compile=backend)``: every configuration the search compiled and stepped,
    in order (`planner.compiled.Candidate.summary`: partitioner budget, the eager budget a plan
    was solved for, peak, whether it fit, median step time), so a user can see what was tried."""
    local_profile: Profile | None = None
    """Under data parallelism (`profile` is one rank's: `solvers.distributed.per_rank`), the
    profile of the step as this process runs it before DDP or FSDP wraps the model."""
    mp_policy: Any = None
    """FSDP2's `MixedPrecisionPolicy` the plan was made for (``plan(..., mp_policy=...)``), or
    None. Until `fully_shard` shards the model, `verify` and `measure` run the step with its
    casts (`planner.fsdp.fsdp_cast`), the step the local profile recorded."""
    fsdp_units: tuple[str, ...] = ()
    _baselines: dict[str, Schedule] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        # not the dataclass's: that one prints the whole profile, every op of the step
        s = self.schedule
        return (f"Plan({type(self.module).__name__}, method {s.method!r}, {len(s.regions)} "
                f"regions, budget {format_bytes(self.budget_bytes)}, predicted peak "
                f"{format_bytes(s.predicted_peak_bytes)}, predicted extra time "
                f"{100 * self.predicted_overhead:.1f}%; plan.report() compares it)")

    @property
    def predicted_peak_bytes(self) -> int:
        return self.schedule.predicted_peak_bytes

    @property
    def compile_backend(self):
        """What to pass as ``torch.compile(model, backend=...)`` (or ``block.compile(backend=
        ...)``) for the compiled step this plan was fitted to: the backend's name, or, where the
        plan uses the partitioner's own recomputation, a backend that compiles with
        ``activation_memory_budget`` at `compile_memory_budget`."""
        if self.compiled_backend is None:
            raise CkptPlannerError("this plan was not fitted to a compiled step; plan with "
                                   "compile='inductor' (or your backend)")
        return compiled.compile_backend(self.compiled_backend, self.compile_memory_budget or 1.0)

    @property
    def predicted_overhead(self) -> float:
        """Extra step time from recomputation, as a fraction of the profiled step time."""
        return self.schedule.predicted_recompute_ms / max(self.profile.step_ms, 1e-9)

    def rank_offset_bytes(self) -> int:
        """What one rank holds beyond this process's unwrapped step under this schedule (DDP's
        buckets; FSDP's sharding, a negative number), by the prediction; 0 for one process."""
        if self.local_profile is None or self.local_profile is self.profile:
            return 0
        return self.predicted_peak_bytes - simulate(self.local_profile,
                                                    self.schedule.regions).peak_bytes

    def baselines(self) -> dict[str, Schedule]:
        """The baselines solved at the same budget (computed once)."""
        if not self._baselines:
            for m in BASELINES:
                try:
                    self._baselines[m] = solve(self.profile, self.budget_bytes, method=m)
                except ScheduleError:  # segments spanning FSDP units: no such plan exists
                    if self.profile.meta.sharding != "fsdp":
                        raise
        return self._baselines

    def report(self) -> str:
        """A table of this plan and the baselines at the same budget."""
        p = self.profile
        rows = [("plan: " + self.schedule.method, self.schedule)]
        rows += [(m, s) for m, s in self.baselines().items()]
        lines = [
            f"budget {format_bytes(self.budget_bytes)}; fixed memory {format_bytes(p.fixed_bytes)} "
            f"(params {format_bytes(p.param_bytes)}, inputs {format_bytes(p.input_bytes)}, "
            f"optimizer state {format_bytes(p.optimizer_state_bytes)}); activations saved "
            f"without checkpointing {format_bytes(p.saved_bytes)}; profiled step "
            f"{p.step_ms:.2f} ms ({p.meta.mode}, {p.meta.device_name})",
            *([f"one rank of {p.meta.world_size} under "
               + (f"FSDP2 ({len(p.meta.shard_units)} units besides the root, parameters, "
                  "gradients and optimizer state sharded"
                  + (", mixed precision: computing in {param_dtype}, stored in {orig_dtype}, "
                     "reduced in {reduce_dtype}".format(**p.meta.fsdp_mixed_precision)
                     if p.meta.fsdp_mixed_precision else "") + ")"
                  if p.meta.sharding == "fsdp"
                  else "DDP (full replicas plus gradient buckets)")
               + "; peaks are per rank"] if p.meta.sharding else []),
            *([f"gradient accumulation: every gradient held when the step starts "
               f"({format_bytes(p.grad_bytes)}, in fixed memory), as after the first "
               "micro-batch; the first peaks no higher"] if p.meta.grads_held else []),
            f"{'method':<22} {'status':<11} {'peak':>12} {'extra time':>18} {'regions':>8}",
        ]
        for name, s in rows:
            extra = s.predicted_recompute_ms
            note = "" if all(r.module is not None for r in s.regions) else \
                "  (segments span several modules: not applicable in place)"
            lines.append(
                f"{name:<22} {s.status:<11} {format_bytes(s.predicted_peak_bytes):>12} "
                f"{extra:>9.2f} ms {100 * extra / max(p.step_ms, 1e-9):>5.1f}% "
                f"{len(s.regions):>8}{note}"
            )
        labels = Counter(region_label(r) for r in self.schedule.regions)
        regions = ", ".join(name if n == 1 else f"{name} (each of its {n} calls)"
                            for name, n in labels.items()) or "none"
        lines.append(f"checkpointed modules: {regions}")
        if p.meta.outside_modules:
            more = f" (and {len(p.meta.outside_modules) - 3} more)" \
                if len(p.meta.outside_modules) > 3 else ""
            lines.append("modules the step runs that are not submodules of the model (their ops "
                         "count as their caller's; no region can be placed on them): "
                         + ", ".join(p.meta.outside_modules[:3]) + more + "; to let the plan "
                         "checkpoint them, make them submodules (attributes of the model or of "
                         "one of its modules)")
        blocked = [c for c in p.calls if c.blocker]
        if blocked:
            shown = "; ".join(f"{c.module or '(root)'}: {c.blocker}" for c in blocked[:5])
            more = f" (and {len(blocked) - 5} more)" if len(blocked) > 5 else ""
            lines.append(f"modules that cannot be regions: {shown}{more}")
        # the check is of this process's recording: per rank (DDP, FSDP2) the profile is derived
        recorded = self.local_profile if self.local_profile is not None else p
        checked = recorded.meta.measured_peak_bytes
        unplanned = simulate(recorded).peak_bytes
        if checked and abs(unplanned - checked) > CHECK_TOLERANCE * checked:
            lines.append(f"WARNING: the profiled step predicts {format_bytes(unplanned)} without "
                         f"checkpointing but measured {format_bytes(checked)}: the recording "
                         "missed something this model does; verify the plan (plan.verify())")
        if p.meta.data_dependent_ops:
            lines.append(f"value-dependent shapes ({p.meta.data_dependent_ops} ops, e.g. MoE "
                         f"routing): planned {format_bytes(self.margin_bytes)} below the budget, "
                         "the spread of the peak measured over other batches; replays re-route "
                         "the same tokens (torch checks the recomputed shapes)")
        if p.meta.random_skips:
            n = len(p.meta.random_skips)
            lines.append(f"modules skipped at random in training ({n}, e.g. "
                         f"{p.meta.random_skips[0]}: LayerDrop): profiled a draw that runs them "
                         "all, the most memory a step needs; steps that skip some need less")
        if self.compiled_backend is not None and self.compiled_peak_bytes is not None:
            m = self.compile_memory_budget or 1.0
            how = "torch.compile(model, backend=plan.compile_backend)" if m != 1.0 else \
                f"torch.compile(model, backend={self.compiled_backend!r})"
            with_opt = (" with the optimizer's state added (its update as simulated)"
                        if p.optimizer_state_bytes else "")
            lines.append(f"under torch.compile(backend={self.compiled_backend!r}) with "
                         f"activation_memory_budget {m:g}: measured peak{with_opt} "
                         f"{format_bytes(self.compiled_peak_bytes)} (the peaks above are eager "
                         f"predictions; the compiled step keeps what its partitioner decides, "
                         f"measured); compile with {how}")
            if self.compile_search:
                n = len(self.compile_search)
                lines.append(f"compiled configurations measured: {n}, "
                             f"{sum(c['fits'] for c in self.compile_search)} within the budget "
                             "(each in plan.compile_search)")
        if self.seconds:
            lines.append("planned in " + ", ".join(f"{k} {v:.2f} s"
                                                   for k, v in self.seconds.items()))
        return "\n".join(lines)

    def save(self, path: str | Path) -> Path:
        """Save the schedule (JSON) and, beside it, the profile (``<stem>.profile.json.gz``)."""
        path = Path(path)
        self.schedule.save(path)
        self.profile.save(path.with_name(path.stem + ".profile.json.gz"))
        return path

    def remove(self) -> torch.nn.Module:
        """Take the plan off the model (its modules' own forwards back)."""
        remove(unwrap(self.module))
        return self.module

    def verify(self, *, rtol: float = 1e-5, atol: float = 1e-6, repeats: int = 3) -> Verification:
        """Run the model without and with the plan on the example inputs: same loss, same
        gradients (allclose), measured peak against predicted and against the budget. Raises
        AssertionError on a mismatch and PlanNotEffectiveError if the plan has regions but the
        measured peak is not below the unplanned one. The model's parameters, buffers and RNG are
        left as they were, and the plan stays applied. Where the model skips layers at random,
        on a draw that runs every layer the profile ran."""
        model, planned = self.module, unwrap(self.module)
        if applied(planned) is None or applied(planned).schedule is not self.schedule:
            raise CkptPlannerError("this plan is no longer applied to its model; re-plan")

        @contextlib.contextmanager
        def unplanned():
            remove(planned)
            try:
                with self._as_sharded():
                    yield model
            finally:
                apply_schedule(planned, self.schedule)

        # Where the model skips layers at random, peaks are measured on a draw that runs every
        # layer the profile ran: the draw the prediction is for.
        draw = _profiled_draw(self.profile, planned, self.example_inputs, self.loss_fn,
                              self.autocast)

        @contextlib.contextmanager
        def with_plan():
            with self._as_sharded():
                yield model

        with seeded(draw) if draw is not None else contextlib.nullcontext():
            return verify_against(unplanned, with_plan(), self.example_inputs,
                                  self.loss_fn, self.schedule, self.budget_bytes, rtol=rtol,
                                  atol=atol, repeats=repeats, autocast=self.autocast,
                                  predicted_peak_bytes=self.predicted_peak_bytes_now(),
                                  optimizer=self.optimizer, held_bytes=self.profile.held_bytes,
                                  judge_budget=self.compiled_backend is None,
                                  grads_held=self.profile.meta.grads_held)

    def predicted_peak_bytes_now(self) -> int:
        """The predicted peak of the model as it is wrapped now: per rank once DDP wraps it or
        `fully_shard` has sharded it (as planned), else this process's unwrapped step."""
        meta = self.profile.meta
        if self.local_profile is None or not meta.sharding:
            return self.predicted_peak_bytes
        wrapped = type(self.module).__name__ == "DistributedDataParallel" if \
            meta.sharding == "ddp" else _fsdp_sharded(self.module)
        if wrapped:
            return self.predicted_peak_bytes
        return simulate(self.local_profile, self.schedule.regions).peak_bytes

    def measure(self, repeats: int = 5) -> Measurement:
        """Peak memory and step time of the planned model on the example inputs (one rank's,
        once the model is wrapped by DDP or sharded by `fully_shard`: compare with
        `predicted_peak_bytes_now`). With the optimizer's step when the plan was made with one,
        as its prediction, and with every gradient held when the step starts where the plan was
        made for gradient accumulation; the model and optimizer are left as they were. A plan
        for FSDP2's mixed precision runs with its casts until the model is sharded."""
        with self._as_sharded():
            return measure(self.module, self.example_inputs, self.loss_fn, repeats=repeats,
                           autocast=self.autocast, optimizer=self.optimizer,
                           held_bytes=self.profile.held_bytes,
                           grads_held=self.profile.meta.grads_held)

    def _as_sharded(self) -> contextlib.AbstractContextManager[None]:
        """The casts FSDP2 will make, while the model is not sharded yet (then FSDP2 makes them)."""
        if self.mp_policy is None or _fsdp_sharded(self.module):
            return contextlib.nullcontext()
        return fsdp_cast(unwrap(self.module), self.mp_policy, self.fsdp_units)


def region_label(r: Region) -> str:
    """A region as the report names it: the module path, and for a run of an `nn.Sequential`'s
    children or of a module's traced forward, which ones."""
    name = r.module or "(root)"
    if r.segment is None:
        return name
    i, j = r.segment
    return f"{name}[{'nodes' if r.staged else 'children'} {i}-{j}]"


def _sparse_values(name: str, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The values of two sparse gradients (``nn.Embedding(sparse=True)``), to compare where
    they touch the same rows; a dense copy of an embedding table's gradient could be larger
    than the step itself."""
    if a.layout != b.layout:
        raise AssertionError(f"gradient of {name} is {a.layout} unplanned, {b.layout} planned")
    a, b = a.coalesce(), b.coalesce()
    if not torch.equal(a.indices(), b.indices()):
        raise AssertionError(f"gradient of {name} touches other rows planned than unplanned")
    return a.values(), b.values()


def verify_against(reference: Callable[[], contextlib.AbstractContextManager[torch.nn.Module]]
                   | contextlib.AbstractContextManager[torch.nn.Module],
                   planned: contextlib.AbstractContextManager[torch.nn.Module],
                   example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                   schedule: Schedule, budget_bytes: int, *, rtol: float = 1e-5,
                   atol: float = 1e-6, repeats: int = 3,
                   planned_params: torch.nn.Module | None = None,
                   autocast: torch.dtype | None = None,
                   predicted_peak_bytes: int | None = None,
                   optimizer: torch.optim.Optimizer | None = None,
                   held_bytes: int = 0, judge_budget: bool = True,
                   grads_held: bool = False) -> Verification:
    """Compare one training step of the unplanned model (`reference`, a context that yields it)
    with the planned one (`planned`): loss, gradients, measured peak and time. The planned
    module's gradients are read from `planned_params` where it wraps the model (graph plans).
    Peaks and times are measured with `optimizer`'s step where the plan counts one, and count
    `held_bytes` (`Profile.held_bytes`) in fixed memory, and with every gradient held when the
    step starts where `grads_held` (gradient accumulation). Warns where the planned peak is above
    `budget_bytes`, unless `judge_budget` is False (a plan for `torch.compile`, whose budget
    holds for the compiled step, not the eager one measured here)."""
    loss_fn = loss_fn or default_loss
    b0: dict[str, torch.Tensor] = {}
    b1: dict[str, torch.Tensor] = {}
    with (reference() if callable(reference) else reference) as ref:
        l0, g0 = _one_step(ref, example_inputs, loss_fn, autocast=autocast, buffers_out=b0)
        m0 = measure(ref, example_inputs, loss_fn, repeats=repeats, autocast=autocast,
                     optimizer=optimizer, held_bytes=held_bytes, grads_held=grads_held)
    with planned as mod:
        # a graph plan's module (`planned_params`) names its buffers otherwise: not compared
        l1, g1 = _one_step(mod, example_inputs, loss_fn, planned_params, autocast,
                           buffers_out=b1 if planned_params is None else None)
        m1 = measure(mod, example_inputs, loss_fn, repeats=repeats, autocast=autocast,
                     optimizer=optimizer, held_bytes=held_bytes, grads_held=grads_held)
    if not torch.isfinite(l0).all():
        raise ModelRunError(
            f"the unplanned model's loss is {l0.item()} on the example inputs, so a planned step "
            "cannot be compared with it (and training on this batch would not be finite "
            "either): check the inputs (a row that is all padding makes a masked mean divide "
            "by zero) and the loss, then verify again")
    if not torch.allclose(l0, l1, rtol=rtol, atol=atol):
        with (reference() if callable(reference) else reference) as ref:
            again, _ = _one_step(ref, example_inputs, loss_fn, autocast=autocast)
        if not torch.allclose(l0, again, rtol=rtol, atol=atol):
            raise NotReproducibleError(
                f"the unplanned model's loss differs between two steps from the same seed "
                f"({l0.item()} vs {again.item()}): its step does not depend on torch's RNG "
                "state alone (it reseeds, e.g. torch.seed(), or draws from another generator), "
                "so a planned step cannot be compared with it. Make the model's randomness "
                "follow torch.manual_seed (or verify in eval-equivalent settings, dropout off)")
        raise AssertionError(f"loss differs: original {l0.item()} vs planned {l1.item()}")
    worst = 0.0
    for name, a in g0.items():
        b = g1.get(name)
        if b is None:
            raise AssertionError(f"parameter {name} got no gradient from the planned model")
        if a.layout != torch.strided or b.layout != torch.strided:
            a, b = _sparse_values(name, a, b)
        if a.shape != b.shape or not torch.allclose(a, b, rtol=rtol, atol=atol):
            raise AssertionError(f"gradient of {name} differs beyond rtol={rtol}")
        if a.numel() == 0:  # an empty parameter (memory slots configured to none)
            continue
        denom = a.abs().max().item() or 1.0
        worst = max(worst, (a - b).abs().max().item() / denom)
    for name in sorted(b0.keys() & b1.keys()):
        a, b = b0[name], b1[name]
        if a.layout != torch.strided or b.layout != torch.strided:  # a sparse adjacency
            a, b = a.to_dense(), b.to_dense()
        same = torch.equal(a, b) if not (a.is_floating_point() or a.is_complex()) \
            else a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol,
                                                        equal_nan=True)
        if not same:
            raise AssertionError(
                f"buffer {name} differs after the planned step (the unplanned step left "
                "another value): a region's replay updated it again, or from another state")
    if schedule.regions and m1.peak_bytes >= m0.peak_bytes:
        raise PlanNotEffectiveError(
            f"the plan has {len(schedule.regions)} checkpointed regions but the measured peak "
            f"({format_bytes(m1.peak_bytes)}) is not below the unplanned one "
            f"({format_bytes(m0.peak_bytes)}): checkpointing took no effect"
        )
    if judge_budget and m1.peak_bytes > budget_bytes:
        warnings.warn(
            f"the planned step measured {format_bytes(m1.peak_bytes)} ({m1.peak_bytes} bytes), "
            f"{m1.peak_bytes - budget_bytes} bytes above the budget {format_bytes(budget_bytes)} "
            f"(predicted {format_bytes(predicted_peak_bytes or schedule.predicted_peak_bytes)}): "
            "the profile missed memory this step allocates; plan again with the budget lowered "
            "by that much", stacklevel=3)
    return Verification(
        loss_original=l0.item(),
        loss_planned=l1.item(),
        max_grad_rel_err=worst,
        measured_peak_bytes=m1.peak_bytes,
        predicted_peak_bytes=schedule.predicted_peak_bytes if predicted_peak_bytes is None
        else predicted_peak_bytes,
        budget_bytes=budget_bytes,
        measured_none_peak_bytes=m0.peak_bytes,
        step_ms_original=m0.step_ms,
        step_ms_planned=m1.step_ms,
    )


def _one_step(module: torch.nn.Module, example_inputs: Any, loss_fn,
              owner: torch.nn.Module | None = None,
              autocast: torch.dtype | None = None,
              buffers_out: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict]:
    """Loss and gradients (of `owner`'s parameters, by default `module`'s) of one step from a
    fixed seed; parameters, buffers, grads restored. With `buffers_out`, also `owner`'s buffers
    as the step left them (BatchNorm's statistics), put there by name."""
    args, kwargs = split_inputs(example_inputs)
    owner = owner if owner is not None else module
    params = dict(owner.named_parameters())
    # tensors only: a module's extra state (`get_extra_state`: neuraloperator's FNO keeps its
    # metadata there) is not the step's to change
    state = copy.deepcopy({k: v.detach() for k, v in owner.state_dict().items()
                           if isinstance(v, torch.Tensor)})
    old = {k: p.grad for k, p in params.items()}
    with seeded(0), python_state(module), inputs_as_given(args, kwargs):
        for p in params.values():
            p.grad = None
        device = next((p.device.type for p in params.values()), "cpu")
        with torch.autocast(device, dtype=autocast) if autocast is not None \
                else contextlib.nullcontext():
            loss = loss_fn(module(*args, **kwargs))
        loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
    if buffers_out is not None:
        buffers_out.update((k, b.detach().clone()) for k, b in owner.named_buffers())
    with torch.no_grad():
        for k, v in owner.state_dict(keep_vars=True).items():  # the tensors, not views
            if k in state:
                put_back(v, state[k])
    for k, p in params.items():
        p.grad = old[k]
    return loss.detach(), grads


_DATA_PARALLEL = ("DistributedDataParallel", "DataParallel")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module a plan goes onto: the model itself, or the module inside (Distributed)
    DataParallel, whose gradient hooks a plan applied in place leaves untouched."""
    return model.module if type(model).__name__ in _DATA_PARALLEL else model


SPREAD_DRAWS = 4
"""Other random draws (dropout masks, noisy routing) of the example batch measured for the margin
when no other batches are given."""
MARGIN_ROUNDS = 3
"""Re-plans at most, each with the margin the measured peaks asked for."""


def _must_run(prof: Profile) -> list[str] | None:
    """Where the model skips modules at random, the modules the profiled draw ran."""
    return sorted({c.module for c in prof.calls}) if prof.meta.random_skips else None


def _profiled_draw(prof: Profile, model: torch.nn.Module, example_inputs: Any, loss_fn,
                   autocast: torch.dtype | None) -> int | None:
    """Where the model skips modules at random, a seed whose draw runs every module the profiled
    draw ran (the draw predictions are for); None otherwise, or where no such seed was found."""
    must = _must_run(prof)
    if not must:
        return None
    found = seeds_running_all(step_spec(model, example_inputs, loss_fn, autocast), must, 1)
    return found[0] if found else None


def _peaks(model: torch.nn.Module, example_inputs: Any, extra: list[Any], loss_fn,
           autocast: torch.dtype | None,
           optimizer: torch.optim.Optimizer | None = None,
           must_run: list[str] | None = None, held_bytes: int = 0,
           grads_held: bool = False) -> list[int]:
    """The planned step's measured peak on the example and each other batch, or on other random
    draws of the example: how much a value-dependent model's memory moves from batch to batch.
    With the optimizer's state and step, as the plan's budget counts them (restored after).
    Where the model skips modules at random, only draws that run every module of `must_run`
    (those the profiled draw ran): the spread of value-dependent memory, not of layers run."""
    peaks = []
    batches = [example_inputs, *extra]
    seeds = [1000 + k for k in range(max(len(batches), SPREAD_DRAWS))]
    if must_run:
        seeds = seeds_running_all(step_spec(unwrap(model), example_inputs, loss_fn, autocast),
                                  must_run, len(seeds)) or seeds
    for k, batch in enumerate(batches if extra else [example_inputs] * len(seeds)):
        with torch.random.fork_rng():
            torch.manual_seed(seeds[k % len(seeds)])
            peaks.append(measure(model, batch, loss_fn, optimizer=optimizer, repeats=1,
                                 autocast=autocast, held_bytes=held_bytes,
                                 grads_held=grads_held).peak_bytes)
    return peaks


def compiled_peak(module: torch.nn.Module, example_inputs: Any, loss_fn,
                  autocast: torch.dtype | None = None, held_bytes: int = 0,
                  grads_held: bool = False) -> Measurement:
    """One measured step of a compiled model (a copy of the user's, `planner.compiled`)."""
    return measure(module, example_inputs, loss_fn, repeats=1, autocast=autocast,
                   held_bytes=held_bytes, grads_held=grads_held)


def solve_within(profile: Profile, budget_bytes: int, method: str = "auto",
                 time_limit_s: float | None = None) -> Schedule:
    """The schedule `plan_from_profile` applies at `budget_bytes`: one that leaves `SLACK_BYTES`
    unused, else one the simulator says fits exactly (its measured peak may then exceed the
    budget by the few unprofiled bytes the slack is there for), else the infeasible one."""
    schedule = solve(profile, budget_bytes - SLACK_BYTES, method=method,
                     time_limit_s=time_limit_s)
    if not schedule.feasible:
        exact = solve(profile, budget_bytes, method=method, time_limit_s=time_limit_s)
        if exact.feasible:
            return exact
    return schedule


def _update_peak(prof: Profile) -> int | None:
    """The optimizer step's peak as the simulator has it (after backward, with no activation
    left to recompute: the same under any schedule), or None without an optimizer."""
    sim = simulate(prof, timeline=True)
    return next((mem + prof.fixed_bytes for where, mem in sim.timeline
                 if where == "optimizer.step"), None)


def _fit_compiled(model, p: Plan, prof: Profile, example_inputs, loss_fn, autocast, backend,
                  method, time_limit_s, memory_budgets: Sequence[float],
                  spread: int = 0, running=contextlib.nullcontext) -> Plan:
    """The fastest compiled configuration whose step peaks within the budget less the slack
    and `spread` (what the peak moves from batch to batch), measured (`planner.compiled`): our
    plan, the partitioner's ``activation_memory_budget`` among `memory_budgets`, or both. The
    copies are made and stepped inside `running()` (FSDP2's casts, `fsdp_cast`), the model
    planned outside it."""
    # Compiled peaks are this process's step; `offset` is what a rank holds beside it.
    budget, local, offset = p.budget_bytes, p.local_profile, p.rank_offset_bytes()
    # The compiled copies are stepped without the optimizer (it updates the model's own
    # parameters): its state, resident through the step, is kept free below the target, and its
    # update, which runs eagerly after backward, must fit on its own.
    state = (local if local is not None else prof).optimizer_state_bytes
    target = budget - SLACK_BYTES - offset - spread - state
    remove(model)  # the candidates are copies; the model is left as it was until one is chosen
    update = _update_peak(prof)
    if update is not None and update > budget:
        raise InfeasibleBudgetError(
            f"the optimizer's step alone peaks at {format_bytes(update)} (parameters, their "
            f"gradients, its state and its temporaries), above the budget {format_bytes(budget)}: "
            "no checkpointing lowers it. Raise the budget, or shard the optimizer state (FSDP2) "
            "or use a lighter optimizer")
    eager_none = simulate(local if local is not None else prof).peak_bytes

    def solve_at(variant: Profile, b: int) -> Schedule | None:
        s = solve_within(variant, b + offset, method, time_limit_s)
        return s if s.feasible else None

    def time_step(module: torch.nn.Module) -> float:
        return measure(module, example_inputs, loss_fn, repeats=2, warmup=0,
                       autocast=autocast).step_ms

    # Where the model skips layers at random, a compiled step is measured on a draw that runs
    # every layer the profile ran, as its eager peak is.
    draw = _profiled_draw(prof, model, example_inputs, loss_fn, autocast)

    def peak(c: torch.nn.Module) -> int:
        with seeded(draw):
            return compiled_peak(c, example_inputs, loss_fn, autocast, prof.held_bytes,
                                 prof.meta.grads_held).peak_bytes

    restore: dict[str, Any] = {}
    compiled.raise_recompile_limit(restore)
    try:
        with running():
            fits, tried = compiled.search(
                model, prof, target, backend=backend, eager_none=eager_none,
                solve_at=solve_at, step=peak, time_step=time_step,
                memory_budgets=memory_budgets)
        if not fits:
            shown = "; ".join(c.describe(backend) for c in tried)
            raise InfeasibleBudgetError(
                f"under torch.compile(backend={backend!r}) no plan fits {format_bytes(budget)}: "
                f"measured compiled peaks: {shown}. Raise the budget, or plan without compile= "
                "and check the compiled step yourself")
        with running():
            best = compiled.fastest(fits, time_step)
    finally:
        torch._dynamo.reset()
        compiled.restore_recompile_limit(restore)
    used = best.profile if best.profile is not None else prof
    schedule = best.schedule if best.schedule is not None else solve(prof, 2**62, "none")
    schedule = dataclasses.replace(schedule, made_for=made_for(model, used))
    apply_schedule(model, schedule)
    return dataclasses.replace(
        p, schedule=schedule, profile=used, budget_bytes=budget, local_profile=local,
        compiled_peak_bytes=max(best.peak_bytes + state, update or 0), compiled_backend=backend,
        compile_memory_budget=best.memory_budget,
        compile_search=[c.summary(best) for c in tried],
        margin_bytes=spread + (max(0, target - best.eager_budget)
                               if best.eager_budget is not None else 0))


def _fsdp_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP (FSDP2's `fully_shard` or the FullyShardedDataParallel wrapper) has sharded
    any module of `model`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return any(isinstance(m, FSDPModule) or type(m).__name__ == "FullyShardedDataParallel"
               for m in model.modules())


def _check_plannable(model: torch.nn.Module) -> None:
    """Refuse models whose wrapper or existing checkpointing a plan would silently change."""
    if not isinstance(model, torch.nn.Module):
        raise CkptPlannerError(f"model is a {type(model).__name__}, not a torch.nn.Module")
    cls = type(model).__name__
    if cls == "OptimizedModule":
        raise CkptPlannerError(
            "the model is already wrapped by torch.compile; plan the model first and compile "
            "after: plan(model, ...), then torch.compile(model) (or block.compile() per block)"
        )
    if _fsdp_sharded(model):
        raise CkptPlannerError(
            "the model is already sharded with FSDP; apply the plan before fully_shard, as "
            "torchtitan orders activation checkpointing and FSDP"
        )
    with warnings.catch_warnings():  # HF deprecates one of the two names, PEFT forwards both
        warnings.simplefilter("ignore", FutureWarning)
        flag = getattr(model, "is_activation_checkpointing", None)
        if flag is None:
            flag = getattr(model, "is_gradient_checkpointing", False)
    if flag:
        raise CkptPlannerError(
            f"{cls} has HF gradient checkpointing enabled; ckpt-planner places checkpoints "
            "itself. Call model.gradient_checkpointing_disable() before planning."
        )
    for name, m in model.named_modules():
        mcls = type(m).__name__
        if mcls == "CheckpointWrapper" or getattr(m, "_checkpoint_wrapped", 0):
            raise CkptPlannerError(
                f"module {name or '(root)'} is already wrapped for checkpointing ({mcls}); plan "
                "the unwrapped model (remove checkpoint_wrapper)"
            )
        if getattr(m, "gradient_checkpointing", False) is True:
            raise CkptPlannerError(
                f"module {name or '(root)'} has HF gradient checkpointing on; call "
                "model.gradient_checkpointing_disable() before planning"
            )
        if getattr(m, "grad_checkpointing", False) is True:
            raise CkptPlannerError(
                f"module {name or '(root)'} has timm's grad checkpointing on "
                "(model.set_grad_checkpointing(), timm's train.py --grad-checkpointing); "
                "ckpt-planner places checkpoints itself: call "
                "model.set_grad_checkpointing(False) before planning"
            )


def _infeasible(profile: Profile, budget: int, margin: int = 0) -> InfeasibleBudgetError:
    """The error for a budget (less `margin`, kept free for what other batches measured) below
    the smallest achievable peak: that peak, what it is made of (which no recomputation
    shrinks), and what would lower it."""
    least = lowest(profile)  # a schedule at the smallest peak the searches found
    peak = least.predicted_peak_bytes
    parts = peak_breakdown(profile, least)
    shown = "; ".join(f"{k} {format_bytes(v)}" for k, v in parts[:4]
                      if v >= peak // 100 and format_bytes(v) != format_bytes(0))
    names = " ".join(k for k, _ in parts[:4])
    advice = ["train on a smaller micro-batch or shorter sequences (and accumulate gradients)"]
    if "lm_head" in names or "loss" in names or "logits" in names:
        advice.append("compute the loss over the logits in chunks")
    if "workspace" in names:
        advice.append("pick a kernel with a smaller workspace for the op at the peak")
    if profile.meta.device != "cpu":
        advice.append("offload saved activations to host memory "
                      "(torch.autograd.graph.save_on_cpu)")
    if profile.optimizer_state_bytes:
        advice.append("shard the optimizer state (FSDP2) or use a lighter optimizer")
    what = f"budget {format_bytes(budget)}" if not margin else (
        f"budget {format_bytes(budget)}, less {format_bytes(margin)} kept free for other batches "
        "(measured with the plan on the other batches given, or on other random draws, the "
        f"step peaked higher or spread wider than on this one), leaves "
        f"{format_bytes(max(budget - margin, 0))}, which")
    unsplit = [(m, b, why) for m, b, why in unsplittable_at_peak(profile, least)
               if b >= peak // 100][:2]
    where = ""
    if unsplit:
        where = " Of these, " + "; ".join(
            f"{format_bytes(b)} {'are' if b != 1 else 'is'} made by the code of "
            f"{repr(m) if m else 'the root module'} itself, outside any submodule call, where "
            f"no region can go ({why})" for m, b, why in unsplit) + "."
        advice.insert(0, "move that code into submodules (an nn.Module per block), which the "
                         "planner can then recompute")
    if unsplit and profile.meta.outside_modules:
        advice.insert(0, "make the modules the step runs from outside the model ("
                      + ", ".join(profile.meta.outside_modules[:3]) + ") submodules of it, "
                      "so that regions can be placed on them")
    return InfeasibleBudgetError(
        f"{what} is below the smallest achievable peak for this model and "
        f"batch ({format_bytes(peak)}, with regions nested inside regions where that helps). At "
        f"that peak: {shown}; no schedule of regions shrinks these.{where} Raise the budget, or "
        + "; or ".join(advice) + "."
    )


def plan(
    model: torch.nn.Module,
    budget_gb: float | str | None = None,
    *,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    method: str = "auto",
    budget_bytes: int | None = None,
    time_limit_s: float | None = None,
    repeats: int = 3,
    autocast: torch.dtype | None = None,
    extra_inputs: Sequence[Any] = (),
    compile: str | None = None,
    compile_memory_budgets: Sequence[float] = compiled.MEMORY_BUDGETS,
    world_size: int | None = None,
    fsdp: bool = False,
    fsdp_units: Sequence[str] | None = None,
    mp_policy: Any = None,
    trace_forwards: bool = True,
    grad_accumulation: bool = False,
    progress: bool = False,
) -> Plan:
    """Plan activation checkpointing for `model` so that a training step fits the budget, and
    apply the plan to the model in place.

    Args:
        model: the model you train, in training mode. If a plan is already applied, it is removed
            and the model planned again.
        budget_gb: peak memory of one training step: GiB as a number, or a string with a unit
            ("24GiB", "16GB"); or pass `budget_bytes`; or neither, for the cheapest plan at the
            smallest peak this model and batch can reach.
        example_inputs: a tensor, a tuple of positional args or a dict of kwargs: the largest batch
            you will train with (the budget holds for every batch no larger).
        loss_fn: output -> scalar loss; default ``output.loss`` or the mean of the output. To use
            targets, close over them: ``loss_fn=lambda out: F.cross_entropy(out, targets)``.
        optimizer: include its state and step in the budget.
        method: a name from `solvers.available_methods()`; ``auto`` takes the best.
        autocast: the dtype you train forward and loss in under ``torch.autocast`` (bf16 or fp16
            mixed precision), backward outside it; plan outside your autocast block.
        extra_inputs: other batches, of the same structure and no larger, that the budget must
            hold for. Where the model's shapes depend on values (MoE routing, boolean masks),
            memory changes from batch to batch: the plan keeps a margin, the spread of the
            measured peak over these batches (or, without them, over other random draws).
        compile: the `torch.compile` backend you will train with (``"inductor"``); needs a
            budget. The budget is then the compiled step's, measured: copies of the model are compiled
            (whole-model) without a plan and with plans, the partitioner's
            ``activation_memory_budget`` at each of `compile_memory_budgets`, and the fastest
            that fits is applied (`planner.compiled`). Then compile the model yourself, as
            torchtitan does, with ``torch.compile(model, backend=p.compile_backend)`` (or
            ``block.compile(backend=p.compile_backend)``): the backend that carries the chosen
            ``activation_memory_budget`` (`Plan.compile_memory_budget`).
        compile_memory_budgets: the partitioner settings searched with `compile`; ``(1.0,)``
            keeps the compiler's default, compiles fewer copies, and leaves ``backend`` a name
            (so ``mode=`` and ``options=`` still apply).
        world_size: ranks of data parallelism; the budget is then one rank's, `example_inputs`
            one rank's micro-batch. Default: torch.distributed's world size where it is
            initialized, else 1. A DistributedDataParallel model is planned as DDP.
        fsdp: the model will be sharded with FSDP2 (`fully_shard` on each of `fsdp_units`, then
            on the root, after planning): parameters, gradients and optimizer state count 1/N,
            plus the all-gathered parameters of the units in flight. Without it and with more
            than one rank: DDP (full replicas plus its gradient buckets).
        fsdp_units: the modules you will `fully_shard` besides the root (default: each repeated
            block, e.g. every transformer layer); a region never spans two of them.
        mp_policy: with `fsdp`, the `MixedPrecisionPolicy` you will pass `fully_shard` (e.g.
            ``param_dtype=torch.bfloat16, reduce_dtype=torch.float32``, torchtitan's): the step
            is profiled as FSDP2 runs it, in ``param_dtype`` (`planner.fsdp`), and shards,
            sharded gradients and optimizer state are counted in the parameters' own dtype.
        trace_forwards: let regions start inside a module's forward, which is traced with
            `torch.fx` for that (`planner.stages`); False keeps every region a module call (or a
            run of an `nn.Sequential`'s children) and runs only your own forwards.
        grad_accumulation: you accumulate gradients over micro-batches (or zero them with
            ``set_to_none=False``): the budget then holds for a step that starts with every
            gradient held from the micro-batch before, which peaks higher than the first
            (`solvers.accumulation`). `verify` and `measure` step it so. Under FSDP2: with
            gradient sync on every micro-batch (FSDP2's default), each rank holding its
            sharded gradients; not with ``set_requires_gradient_sync(False)``.

    Under torch.distributed, `plan` is collective: call it on every rank (as `fully_shard` and
    DDP are); every rank applies rank 0's schedule.

    Raises:
        InfeasibleBudgetError: naming the smallest achievable peak and the largest activations.
        ModelRunError: the model's own training step raised (the message names the module).
    """
    if budget_gb is not None and budget_bytes is not None:
        raise CkptPlannerError("give exactly one of budget_gb (e.g. 8, '8GiB') or budget_bytes "
                               "(or neither, for the smallest achievable peak)")
    budget = None if budget_gb is None and budget_bytes is None else \
        parse_budget(budget_gb) if budget_gb is not None else \
        parse_budget(budget_bytes, name="budget_bytes", unit=1)
    if compile is not None and (not compile_memory_budgets or not all(
            isinstance(m, int | float) and 0.0 <= m <= 1.0 for m in compile_memory_budgets)):
        raise CkptPlannerError(
            f"compile_memory_budgets={tuple(compile_memory_budgets)!r}: give one or more "
            "values of activation_memory_budget between 0 and 1, e.g. (1.0,) or (1.0, 0.8, 0.5)")
    if compile is not None and budget is None:
        raise CkptPlannerError(
            f"compile={compile!r} needs a budget (budget_gb=...): a compiled plan is the "
            "fastest configuration measured to fit it on compiled copies of the model; the "
            "smallest-peak search without a budget is for the eager step (plan without "
            "compile= to see it, then plan again with a budget near it and compile=)")
    given, model = model, unwrap(model)
    _check_plannable(model)
    if applied(model) is not None:
        remove(model)
    if not model.training:
        raise CkptPlannerError(
            "the model is in eval mode; checkpointing is for training: call model.train() first"
        )
    world, sharding = _data_parallel(given, world_size, fsdp, fsdp_units)
    if sharding:
        check_dense_gradients(model, "under FSDP2 (it reduce-scatters dense gradients only)"
                              if sharding == "fsdp" else "under DDP (the all-reduced sparse "
                              "gradient holds every rank's rows)")
    if grad_accumulation:
        check_dense_gradients(model, "over accumulated micro-batches (sparse gradients add up "
                              "by concatenation, growing with each micro-batch)")
    if mp_policy is not None and sharding != "fsdp":
        raise CkptPlannerError(
            "mp_policy is FSDP2's mixed precision; pass fsdp=True with it (for one process or "
            "DDP, train under torch.autocast and plan with autocast=torch.bfloat16)")
    mp = mixed_precision(model, mp_policy) if mp_policy is not None else {}
    units = list(fsdp_units or ())  # the default units once the profile names them

    def as_sharded():
        """Where the step runs in this process: as FSDP2 will run it (its casts)."""
        return fsdp_cast(model, mp_policy, units) if mp else contextlib.nullcontext()
    t0 = time.perf_counter()
    local = profile(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                    repeats=repeats, autocast=autocast, trace_forwards=trace_forwards,
                    progress=progress, mp_policy=mp_policy if mp else None,
                    fsdp_units=units)
    first = local  # FSDP2 shards the first micro-batch's step, then holds the sharded gradients
    if grad_accumulation:  # the step of this process; DDP's buckets are added after (per_rank)
        local = holding_grads(local)
        if local.meta.measured_peak_bytes is not None:  # the report's check, on this step
            try:
                with as_sharded():
                    checked = measure(model, example_inputs, loss_fn, optimizer=optimizer,
                                      repeats=0, autocast=autocast, held_bytes=local.held_bytes,
                                      grads_held=True).peak_bytes
            except Exception:  # noqa: BLE001 - as profile's own check: skipped if it cannot run
                checked = None
            local = dataclasses.replace(local, meta=dataclasses.replace(
                local.meta, measured_peak_bytes=checked))
    prof = local
    if sharding:
        try:
            prof = per_rank(first if sharding == "fsdp" else local, world_size=world,
                            sharding=sharding,
                            units=list(fsdp_units) if fsdp_units is not None else None,
                            gloo=_distributed() and torch.distributed.get_backend() == "gloo")
            if grad_accumulation and sharding == "fsdp":
                prof = holding_grads(prof)
            units[:] = prof.meta.shard_units
        except ProfileError as e:
            raise CkptPlannerError(str(e)) from None
    try:
        p = plan_from_profile(model, prof, budget_bytes=budget, method=method,
                              time_limit_s=time_limit_s)  # budget None: the smallest peak
    except InfeasibleBudgetError:
        if compile is None:
            raise
        # Compiled, the step may keep less than any eager plan reaches: the budget is judged
        # on the compiled step (`_fit_compiled`), starting from the smallest eager peak.
        p = plan_from_profile(model, prof, budget_bytes=None, method=method,
                              time_limit_s=time_limit_s)
        p.budget_bytes = budget
    p.local_profile = local
    moves = prof.meta.data_dependent_ops or extra_inputs

    def spread(peaks: list[int]) -> int:
        """What other batches may add to the example's peak: with value-dependent memory, the
        spread of the measured peaks (batches not given move as much); else what the batches
        given peak above the example (their shapes fix their memory)."""
        return max(peaks) - (min(peaks) if prof.meta.data_dependent_ops else peaks[0])

    if budget is not None and compile is not None:
        # Memory that moves from batch to batch is kept free below the compiled budget: the
        # spread of the (eager) planned step's peak over other batches or random draws.
        with as_sharded():
            peaks = _peaks(model, example_inputs, list(extra_inputs), loss_fn, autocast,
                           optimizer, _must_run(prof), prof.held_bytes, prof.meta.grads_held) \
                if moves else [0]
        p = _fit_compiled(model, p, prof, example_inputs, loss_fn, autocast, compile, method,
                          time_limit_s, compile_memory_budgets, spread(peaks), as_sharded)
        p.local_profile = local
    elif budget is not None and moves:
        # Memory moves from batch to batch: measure the planned step on other batches (or other
        # random draws) and keep the overshoot, plus the spread of value-dependent memory,
        # below the budget.
        # Where the margin does not converge (a batch's peak does not fall with the plan's
        # regions: an op with more scratch memory on its shape), the lowest plan there is, if
        # it holds; else the budget is out of reach for those batches.
        margin = 0
        for k in range(MARGIN_ROUNDS + 2):
            with as_sharded():
                peaks = _peaks(model, example_inputs, list(extra_inputs), loss_fn, autocast,
                               optimizer, _must_run(prof), prof.held_bytes, prof.meta.grads_held)
            need = (p.rank_offset_bytes() + max(peaks)
                    + (max(peaks) - min(peaks) if prof.meta.data_dependent_ops else 0)
                    - (budget - SLACK_BYTES))
            if need <= 0:
                break
            remove(model)
            if k > MARGIN_ROUNDS:
                raise _batches_over_budget(budget, peaks, need, bool(extra_inputs))
            if k < MARGIN_ROUNDS:
                margin += need
                p = plan_from_profile(model, prof, budget_bytes=budget, method=method,
                                      time_limit_s=time_limit_s, margin_bytes=margin)
            else:
                p = plan_from_profile(model, prof, budget_bytes=None, method=method,
                                      time_limit_s=time_limit_s)
                p.budget_bytes = budget
            p.local_profile = local
    if _distributed() and world > 1:
        p = _agree(model, p)
    p.module, p.loss_fn, p.example_inputs, p.optimizer = given, loss_fn, example_inputs, optimizer
    p.autocast = autocast
    p.mp_policy, p.fsdp_units = (mp_policy, tuple(units)) if mp else (None, ())
    p.seconds = {"profile": time.perf_counter() - t0, **p.seconds}
    return p


def _batches_over_budget(budget: int, peaks: list[int], need: int,
                         given: bool) -> InfeasibleBudgetError:
    """The error for a budget that the smallest-peak plan holds on the example batch but not on
    another (`peaks`: the example's, then each other batch's or random draw's)."""
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    what = ("the example batch" if worst == 0 else f"extra_inputs[{worst - 1}]" if given
            else "another random draw of the example batch")
    return InfeasibleBudgetError(
        f"the budget {format_bytes(budget)} does not hold for {what}: with the plan at the "
        f"smallest peak, after {MARGIN_ROUNDS} re-plans keeping a margin free, its step measured "
        f"{format_bytes(peaks[worst])} ({format_bytes(peaks[0])} on the example batch), "
        f"{format_bytes(need)} more than the budget leaves. Its memory does not fall with "
        "the plan's regions (an op that takes more scratch memory on that batch's shape, or "
        f"memory that depends on values). A budget of {format_bytes(budget + need)} holds it; "
        "or plan for that batch's shape on its own.")


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _data_parallel(given: torch.nn.Module, world_size: int | None, fsdp: bool,
                   fsdp_units: Sequence[str] | None) -> tuple[int, str]:
    """(ranks, sharding) a plan is made for: ``fsdp``, ``ddp`` or "" (one process)."""
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        raise CkptPlannerError(f"world_size={world_size!r}: expected a positive number of ranks")
    if fsdp_units is not None and not fsdp:
        raise CkptPlannerError("fsdp_units is given but fsdp is False; pass fsdp=True")
    if isinstance(fsdp_units, str):
        raise CkptPlannerError("fsdp_units is a list of module names, e.g. ['model.layers.0', ...]")
    ddp = type(given).__name__ == "DistributedDataParallel"
    if fsdp and ddp:
        raise CkptPlannerError("the model is wrapped in DistributedDataParallel but fsdp=True; "
                               "plan the unwrapped model and shard it with fully_shard after")
    world = world_size if world_size is not None else (
        torch.distributed.get_world_size() if _distributed() else 1)
    if _distributed() and world_size is not None and world_size != \
            torch.distributed.get_world_size():
        warnings.warn(f"planning for world_size={world_size} while torch.distributed has "
                      f"{torch.distributed.get_world_size()} ranks", stacklevel=3)
    if fsdp:
        return world, "fsdp"
    return world, "ddp" if ddp or world > 1 else ""


def _agree(model: torch.nn.Module, p: Plan) -> Plan:
    """Every rank takes rank 0's schedule (profiled times differ from rank to rank, and with
    them, near a tie, the cheapest schedule)."""
    box = [p.schedule]
    torch.distributed.broadcast_object_list(box, src=0)
    if box[0].regions != p.schedule.regions:
        remove(model)
        apply_schedule(model, box[0])
        p.schedule = box[0]
    return p


def plan_from_profile(model: torch.nn.Module, profile: Profile, *, budget_bytes: int | None,
                      method: str = "auto", time_limit_s: float | None = None,
                      margin_bytes: int = 0, example_inputs: Any = None,
                      loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Plan:
    """Solve `profile` (recorded from `model`) for `budget_bytes` and apply the schedule to
    `model` in place. Leaves `SLACK_BYTES` (and `margin_bytes`) of the budget unused where a plan
    can. With `budget_bytes` None, the cheapest schedule at the smallest achievable peak
    (`solvers.solve.lowest`), its budget that peak plus `SLACK_BYTES`: the smallest budget at
    which a plan leaves the slack for what the profile does not see. `example_inputs` and
    `loss_fn` (those of the profile) let `Plan.verify` and `Plan.measure` run."""
    if profile.meta.fsdp_mixed_precision and profile.meta.sharding != "fsdp":
        raise CkptPlannerError(
            "this profile was recorded for FSDP2's mixed precision (parameters cast to "
            f"{profile.meta.fsdp_mixed_precision['param_dtype']}): plan one rank's profile, "
            "solvers.distributed.per_rank(profile, world_size=N, sharding='fsdp'), or "
            "planner.plan(model, ..., fsdp=True, mp_policy=...)")
    t0 = time.perf_counter()
    if budget_bytes is None:
        schedule = lowest(profile, time_limit_s if time_limit_s is not None
                          else FLOOR_TIME_LIMIT_S)
        schedule = dataclasses.replace(schedule, made_for=made_for(model, profile))
        apply_schedule(model, schedule)
        t1 = time.perf_counter()
        amp = getattr(torch, profile.meta.autocast) if profile.meta.autocast else None
        return Plan(module=model, schedule=schedule, profile=profile,
                    budget_bytes=schedule.predicted_peak_bytes + SLACK_BYTES, autocast=amp,
                    example_inputs=example_inputs, loss_fn=loss_fn,
                    seconds={"solve": t1 - t0, "apply": time.perf_counter() - t1})
    if margin_bytes:
        schedule = solve(profile, budget_bytes - SLACK_BYTES - margin_bytes, method=method,
                         time_limit_s=time_limit_s)
        if not schedule.feasible:
            raise _infeasible(profile, budget_bytes, margin_bytes)
    else:
        schedule = solve_within(profile, budget_bytes, method, time_limit_s)
    t1 = time.perf_counter()
    if not schedule.feasible and method != "auto":
        least = lowest(profile)
        if least.predicted_peak_bytes + SLACK_BYTES <= budget_bytes:
            reached = (f" (its lowest peak: {format_bytes(schedule.min_peak_bytes)})"
                       if schedule.min_peak_bytes else "")
            raise InfeasibleBudgetError(
                f"method {method!r} finds no schedule within budget {format_bytes(budget_bytes)}"
                f"{reached}; the other searches reach {format_bytes(least.predicted_peak_bytes)} "
                f"({least.method}): leave method='auto'")
    if not schedule.feasible:
        raise _infeasible(profile, budget_bytes)
    schedule = dataclasses.replace(schedule, made_for=made_for(model, profile))
    apply_schedule(model, schedule)
    amp = getattr(torch, profile.meta.autocast) if profile.meta.autocast else None
    return Plan(module=model, schedule=schedule, profile=profile, budget_bytes=budget_bytes,
                autocast=amp, margin_bytes=margin_bytes, example_inputs=example_inputs,
                loss_fn=loss_fn, seconds={"solve": t1 - t0, "apply": time.perf_counter() - t1})


def remove(model: torch.nn.Module) -> torch.nn.Module:
    """Take a plan off `model` (or off the module inside its DistributedDataParallel wrapper):
    every checkpointed module gets its own forward back. Returns `model`."""
    inplace.remove(unwrap(model))
    return model


def apply(model: torch.nn.Module, schedule: Schedule | str | Path) -> torch.nn.Module:
    """Apply a saved schedule (e.g. planned offline for this GPU) to `model` in place.

    The schedule names the modules it checkpoints; a schedule made for another model is refused
    with the modules this one lacks. Returns `model` itself."""
    if not isinstance(schedule, Schedule):
        schedule = Schedule.load(schedule)
    if not schedule.feasible:
        raise ScheduleError(f"the schedule's status is {schedule.status!r}: it does not fit its "
                            "budget; re-plan with a larger budget")
    inner = unwrap(model)
    _check_plannable(inner)
    diffs = differences(schedule.made_for, inner)
    torch_only = [d for d in diffs if d.startswith("the plan was made with torch")]
    if len(diffs) > len(torch_only):
        raise ScheduleError(
            "the schedule was made for another model: "
            + "; ".join(d for d in diffs if d not in torch_only)
            + "; re-plan for this model (planner.plan)"
        )
    for d in torch_only:
        warnings.warn(f"{d}: the plan may not hold; re-plan if the step's memory differs",
                      stacklevel=2)
    if applied(inner) is not None:
        remove(inner)
    apply_schedule(inner, schedule)
    return model
