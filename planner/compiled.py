"""Plans for a compiled training step: `plan(..., compile=backend)` and compare's
"ours + <backend>" rows.

A compiler changes what a step keeps, and by how much is measured here, never modelled: inductor
fuses ops and keeps less than eager; below ``activation_memory_budget`` 1 its partitioner also
recomputes cheap fused ops on its own; a compiled region may keep more than its eager replay.
Each candidate is a copy of the model, planned or not, compiled whole-model with the partitioner
at one ``activation_memory_budget`` of `MEMORY_BUDGETS`, and stepped once for its peak. Below 1
the partitioner is made to keep what eager checkpointing keeps around our regions
(`keep_region_boundaries`), so that its own recomputation composes with theirs.

For each partitioner budget, from the largest: the copy without a plan, and where that does not
fit, our plans at the eager budgets `compiled_budget` finds, under each of the backend's
`cost_models` (the eager profile's op times, and for inductor also one where fused pointwise
recomputation is cheap). The candidates that fit are timed in turn, the two fastest again while
they are within a few percent of each other; plans are searched at a lower partitioner budget
only while going down has measured faster, the copy without a plan at every one (`search`).
The pick is made after timing every fitting candidate side by side (`fastest`).
The plan is the fastest of our regions, the compiler's own recomputation, or both together.

Which of two candidates is faster is read from the rounds both were timed in, one ratio per
round (`_paired`), not from medians of samples taken minutes apart: a machine whose speed
drifts between two phases of the search would otherwise decide it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.inplace import apply_schedule
from solvers.chain import module_calls_only
from solvers.profile import Profile
from solvers.schedule import Schedule
from solvers.solve import finish

COMPILED_ROUNDS = 5
"""Eager budgets tried at most per partitioner budget; a budget giving a schedule already
measured costs no compilation."""
MEMORY_BUDGETS = (1.0, 0.8, 0.5, 0.2)
"""Partitioner settings (``torch._functorch.config.activation_memory_budget``) searched by
default, largest first; 1.0 is the compiler's default (no extra recomputation). At 0.2 the
compiled copy without a plan can be the only one that fits; lower settings are left out, as the
partitioner's peak rises again towards 0 (the `inductor(0)` rows of benchmarks/RESULTS.md)."""
TIMING_ROUNDS = 3
"""Rounds of timed steps over the fitting candidates (each round steps every one in turn, the
order reversed every other round)."""
CLOSE_CALL = 0.05
"""The two fastest candidates are told apart when, over at least `TIMING_ROUNDS` rounds both were
timed in, the median of their per-round ratios is further than this from 1 and `AGREE` of the
rounds say the same; until then both are timed again, in turn, up to `MAX_TIMING_ROUNDS` such
rounds."""
AGREE = 0.75
"""The fraction of paired rounds that must rank two candidates the same way for `CLOSE_CALL`'s
gap to settle them (a spike in one round cannot decide alone)."""
MAX_TIMING_ROUNDS = 9
"""Paired rounds past which a close call is left as measured (the median ratio decides)."""
_ROUND_IDS = itertools.count()
"""Identifies each timing round, so that two candidates' samples from the same round pair."""
FUSED_POINTWISE = 0.3
"""A search parameter, not a prediction: in the inductor cost model (`fused_pointwise`), the
fraction of its eager time that recomputing a forward op without FLOPs (pointwise, reduction,
view) costs. Inductor fuses such ops into the kernels around them, so the eager profile's times
overstate their recomputation and steer the solver toward recomputing matmuls instead. Plans
from both cost models are compiled and measured; which is kept is decided by measured time."""
RECOMPILE_LIMIT = 256
"""Compilations of the same code dynamo is allowed while candidates are measured (each compiled
copy of the model compiles its forward again)."""


def raise_recompile_limit(restore: dict[str, Any]) -> None:
    """Let dynamo compile the same code `RECOMPILE_LIMIT` times, and fail rather than run eager
    past that (a candidate would silently measure the eager model); `restore` keeps the values
    to put back (`restore_recompile_limit`)."""
    import torch._dynamo.config as dc

    want = {"recompile_limit": RECOMPILE_LIMIT, "cache_size_limit": RECOMPILE_LIMIT,
            "fail_on_recompile_limit_hit": True}
    for name, value in want.items():
        if hasattr(dc, name) and getattr(dc, name) != value:
            restore.setdefault(name, getattr(dc, name))
            setattr(dc, name, value)


def restore_recompile_limit(restore: dict[str, Any]) -> None:
    import torch._dynamo.config as dc

    for name, value in restore.items():
        setattr(dc, name, value)


def compile_backend(backend: str, memory_budget: float = 1.0):
    """What to pass as ``torch.compile(backend=...)`` for `backend` with the partitioner's
    ``activation_memory_budget`` at `memory_budget`: the name itself at 1.0 (so that ``mode=`` and
    ``options=`` still work with inductor), else a backend that compiles under that setting and,
    for inductor and aot_eager, partitions keeping our regions' boundaries
    (`keep_region_boundaries`) and forward's random draws (`keep_random_draws`). A distinct
    backend object per budget also makes dynamo keep one cache entry per budget (its guards
    check the backend). dynamo's ``"eager"`` (no partitioner, any budget) is replaced by
    `eager_checkpointing`, which replays a region's random draws as eager checkpointing does.

    A budget of 0 is passed as `LEAST_MEMORY_BUDGET`: at exactly 0 the partitioner saves only
    the graph's inputs, ignoring every must-save mark (region boundaries, random draws)."""
    if backend == "eager":
        return eager_checkpointing
    if memory_budget == 1.0:
        return backend
    import torch._functorch.config as fc

    inner = _keeping_boundaries(backend)
    memory_budget = max(memory_budget, LEAST_MEMORY_BUDGET)

    def ckpt_planner_compile_backend(gm, example_inputs):
        with fc.patch(activation_memory_budget=memory_budget):
            return inner(gm, example_inputs)

    return ckpt_planner_compile_backend


LEAST_MEMORY_BUDGET = 1e-6
"""The smallest ``activation_memory_budget`` `compile_backend` passes on (see there)."""


def torch_memory_budget(backend: str, memory_budget: float):
    """`backend` under torch's own ``activation_memory_budget`` knob at `memory_budget`, with
    nothing of ours: what compare's anchor rows at budget 0 compile with, where `compile_backend`
    would pass `LEAST_MEMORY_BUDGET` instead (and keep random draws, which torch's knob at 0
    recomputes)."""
    if memory_budget == 1.0:
        return backend
    import torch._functorch.config as fc
    from torch._dynamo import lookup_backend

    inner = lookup_backend(backend)

    def torch_activation_memory_budget(gm, example_inputs):
        with fc.patch(activation_memory_budget=memory_budget):
            return inner(gm, example_inputs)

    return torch_activation_memory_budget


def eager_checkpointing(gm: torch.fx.GraphModule, example_inputs) -> Callable[..., Any]:
    """dynamo's ``"eager"`` backend, with each checkpointed region run by
    ``torch.utils.checkpoint`` as in eager mode: non-reentrant, under the region's own
    ``context_fn`` (its selective policy), and preserving the RNG state. torch's implementation
    of a region traced by dynamo turns ``preserve_rng_state`` off, as it leaves replaying random
    ops to AOTAutograd, which ``"eager"`` does not run: a dropout inside a region would draw
    another mask in backward than in forward, and the gradients would be wrong with no error
    (measured on a tiny model, and on HF GPT-2 with a padded mask)."""
    hop = torch.ops.higher_order.tag_activation_checkpoint
    for g in gm.modules():  # regions nested in regions are calls in their bodies' graphs
        if isinstance(g, torch.fx.GraphModule):
            for n in g.graph.nodes:
                if n.op == "call_function" and n.target is hop:
                    n.target = _checkpoint_region
            g.recompile()
    return gm.forward


def _checkpoint_region(body: torch.fx.GraphModule, *args, **kwargs):
    """One region dynamo traced (a ``tag_activation_checkpoint`` call), run by eager
    ``torch.utils.checkpoint`` (`eager_checkpointing`)."""
    from torch._higher_order_ops.wrap import TagActivationCheckpoint
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    options, body_kwargs = TagActivationCheckpoint.divide_kwargs(kwargs)
    options.update(use_reentrant=False, preserve_rng_state=True,
                   context_fn=body.meta.get("_checkpoint_context_fn", noop_context_fn))
    return checkpoint(body, *args, **options, **body_kwargs)


def keep_region_boundaries(joint: torch.fx.GraphModule, num_fwd_outputs: int) -> int:
    """Mark ``MUST_SAVE``, in a joint forward-backward graph, the forward values that cross a
    checkpointed region's boundary: what a region reads from forward ops outside it, and what
    forward ops outside a region read from it. Returns how many nodes were marked.

    Eager checkpointing keeps a region's inputs and, for the ops after it, its outputs; the
    partitioner marks every op inside a region must-recompute, so it can never save a region's
    output. At ``activation_memory_budget`` 1 its bans on recomputing "far apart" values keep the
    values around regions saved; below 1 it lifts them, and a value between two regions becomes
    recomputable from the region before, whose inputs are recomputable from the one before that:
    backward then recomputes a chain of regions at its start and holds it (measured: a planned
    step compiled at 0.5 peaking above the same plan at 1, and above no plan at 0.5). Kept at
    the boundaries, the partitioner's own recomputation is left to the ops outside regions."""
    import operator

    from torch._functorch.partitioners import must_recompute
    from torch.utils.checkpoint import CheckpointPolicy

    forward = _forward_nodes(joint, num_fwd_outputs)

    def readers(n: torch.fx.Node):  # through the getitems of multi-output ops
        for u in n.users:
            if u.target is operator.getitem and "ac_graph_id" not in u.meta:
                yield from readers(u)
            elif u in forward and u.op != "output":
                yield u

    def region(n: torch.fx.Node):  # the checkpoint a node was traced in, None outside any
        return n.meta.get("ac_graph_id")

    marked = []
    for n in joint.graph.nodes:
        if n not in forward or n.op != "call_function" or n.target is operator.getitem:
            continue
        if region(n) is not None:
            # an output of its region (what its selective policy saves is saved already)
            if must_recompute(n) and any(region(u) != region(n) for u in readers(n)):
                marked.append(n)
        elif (n.meta.get("recompute") != CheckpointPolicy.MUST_SAVE
              and any(region(u) is not None and must_recompute(u) for u in readers(n))):
            marked.append(n)  # an input of a region
    for n in marked:
        n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return len(marked)


def _forward_nodes(joint: torch.fx.GraphModule, num_fwd_outputs: int) -> set[torch.fx.Node]:
    """The nodes of a joint graph that its forward outputs depend on."""
    from torch.utils._pytree import arg_tree_leaves

    output = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    forward: set[torch.fx.Node] = set()
    todo = [a for a in arg_tree_leaves(*output.args)[:num_fwd_outputs]
            if isinstance(a, torch.fx.Node)]
    while todo:
        n = todo.pop()
        if n not in forward:
            forward.add(n)
            todo.extend(n.all_input_nodes)
    return forward


def keep_random_draws(joint: torch.fx.GraphModule, num_fwd_outputs: int) -> int:
    """Mark ``MUST_SAVE``, in a joint forward-backward graph, every forward op outside our
    regions that draws from a random generator (aten's dropout, ``rand_like``, ...; inductor's
    ``inductor_seeds``, from which its random kernels derive theirs). Returns how many.

    Below ``activation_memory_budget`` 1 the partitioner may choose to recompute such an op in
    backward, where it draws again: backward then differentiates through other dropout masks
    than forward used, with no error (pytorch/pytorch#190758; measured here under aot_eager
    and inductor, with and without our regions). Saved, the op runs once. Inside a region the
    op is must-recompute, and the partitioner replays it with forward's RNG state."""
    from torch._functorch.partitioners import must_recompute
    from torch.utils.checkpoint import CheckpointPolicy

    marked = 0
    for n in _forward_nodes(joint, num_fwd_outputs):
        if (n.op == "call_function" and _draws(n) and not must_recompute(n)
                and n.meta.get("recompute") != CheckpointPolicy.MUST_SAVE):
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            marked += 1
    return marked


def _draws(n: torch.fx.Node) -> bool:
    """Whether op `n` draws random numbers: its op is tagged ``nondeterministic_seeded``, less
    the attention kernels called with ``dropout_p`` 0 (tagged for their dropout, which is off;
    marking them would keep the partitioner from recomputing attention)."""
    if torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()):
        return False
    schema = getattr(n.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    p = n.args[i] if i < len(n.args) else n.kwargs.get("dropout_p", 0.0)
    return not isinstance(p, (int, float)) or p != 0


def keep_updated_input_readers(joint: torch.fx.GraphModule, num_fwd_outputs: int) -> int:
    """Mark ``MUST_SAVE``, in a joint forward-backward graph, every forward op outside our
    regions that reads a graph input the graph also writes in place (a buffer updated in
    forward: spectral norm's power-iteration vectors). Returns how many.

    The write lands on the input itself as forward ends, so an op the partitioner recomputes in
    backward (below ``activation_memory_budget`` 1) reads the updated value: measured on a
    spectral-norm discriminator, other gradients under aot_eager and inductor (benchmarks/RESULTS.md).
    Batch norm is left alone: in training its outputs other than the new statistics do not
    depend on the statistics it reads."""
    from torch._functorch.partitioners import must_recompute
    from torch.utils.checkpoint import CheckpointPolicy

    copy_ = torch.ops.aten.copy_.default
    written = {n.args[0] for n in joint.graph.nodes
               if n.op == "call_function" and n.target is copy_ and n.args
               and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder"}
    if not written:
        return 0
    marked = 0
    for n in _forward_nodes(joint, num_fwd_outputs):
        if (n.op == "call_function" and n.target is not copy_ and not must_recompute(n)
                and "batch_norm" not in str(n.target)
                and n.meta.get("recompute") != CheckpointPolicy.MUST_SAVE
                and any(a in written for a in n.all_input_nodes)):
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            marked += 1
    return marked


def _partition_keeping_boundaries(joint, joint_inputs, *, num_fwd_outputs: int, **kwargs):
    """The min-cut partitioner (inductor's and aot_eager's) after `keep_region_boundaries`,
    `keep_random_draws` and `keep_updated_input_readers`."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    keep_region_boundaries(joint, num_fwd_outputs)
    keep_random_draws(joint, num_fwd_outputs)
    keep_updated_input_readers(joint, num_fwd_outputs)
    return min_cut_rematerialization_partition(joint, joint_inputs,
                                               num_fwd_outputs=num_fwd_outputs, **kwargs)


def _keeping_boundaries(backend: str) -> Callable[..., Any]:
    """`backend` as a compiler function whose partitioner keeps region boundaries: inductor
    with `_partition_keeping_boundaries` as its ``custom_partitioner_fn`` (its joint-graph passes
    still run first; a partitioner the user set there is left alone), aot_eager rebuilt with it;
    any other backend as dynamo has it."""
    from torch._dynamo import lookup_backend

    if backend == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        # dynamo's aot_eager with our partitioner
        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                            partition_fn=_partition_keeping_boundaries,
                            keep_inference_input_mutations=True)
    inner = lookup_backend(backend)
    if backend != "inductor":
        return inner
    import torch._inductor.config as ic

    def inductor(gm, example_inputs):
        if ic.custom_partitioner_fn is not None:  # the user's own partitioner stays in charge
            return inner(gm, example_inputs)
        with ic.patch(custom_partitioner_fn=_keep_boundaries_partitioner()):
            return inner(gm, example_inputs)

    return inductor


@functools.cache
def _keep_boundaries_partitioner() -> Any:
    """Inductor's partitioner hook (``custom_partitioner_fn``) running
    `_partition_keeping_boundaries`; made on first use, as importing inductor takes a second."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files

    class KeepRegionBoundaries(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            return _partition_keeping_boundaries(gm, joint_inputs, **kwargs)

        def uuid(self) -> Any:
            return get_hash_for_files((__file__,))

        def __reduce__(self):  # inductor pickles its config into cache keys
            return _keep_boundaries_partitioner, ()

    return KeepRegionBoundaries()


def compiled_budget(budget: int, eager_none: int, unplanned: int,
                    try_at: Callable[[int], int | None], rounds: int) -> int | None:
    """The eager budget to plan at so that the step, compiled, peaks within `budget`.

    The search starts from `budget` raised by what compiling saves on the unplanned step
    (`eager_none`, the eager unplanned peak, less `unplanned`, the compiled one), so that a plan
    does not recompute what the compiler already saves, and lowers it by each measured overshoot
    while that stays above `budget` and the compiled peak keeps falling; then (the saving did not
    carry over to the plan) it goes on from `budget` itself, lowered likewise. `try_at(b)` plans
    at eager budget b, compiles, measures, and returns the compiled peak (None: no plan reaches
    b). Returns the eager budget whose compiled plan fit, or None after `rounds` tries (one more
    where the first is raised)."""
    raised = budget + max(0, eager_none - unplanned)
    b = min(raised, eager_none - 1)
    last = None
    for _ in range(rounds + (b > budget)):
        peak = try_at(b)
        if peak is None:
            return None
        if peak <= budget:
            return b
        over = peak - budget
        if b > budget:
            falling = last is None or peak < last
            b = b - over if falling and b - over > budget else budget
        else:
            b -= over
        last = peak
    return None


def compile_variants(prof: Profile) -> list[Profile]:
    """The profiles a compiled-budget search plans from, in turn: `prof`, then, where it has
    runs of traced forwards, `prof` with module-call regions only. Inductor can keep more of a
    run than its eager replay, so where no plan with runs fits compiled, one without may."""
    return [prof, module_calls_only(prof)] if any(c.stages for c in prof.calls) else [prof]


def fused_pointwise(prof: Profile, factor: float = FUSED_POINTWISE) -> Profile:
    """`prof` with every forward op that has no FLOPs timed at `factor` of its measured time:
    the profile the inductor cost model plans on. Memory is unchanged, so a schedule's simulated
    peak is the same on both profiles."""
    nodes = tuple(dataclasses.replace(n, time_ms=n.time_ms * factor)
                  if n.phase == "forward" and n.flops == 0 else n for n in prof.nodes)
    return dataclasses.replace(prof, nodes=nodes)


@dataclass(frozen=True)
class CostModel:
    """A cost model the compiled search plans under: the profile the solver sees."""

    name: str
    plan_on: Callable[[Profile], Profile] | None = None
    """The profile to solve on, from the profile variant (None: the variant itself). A schedule
    solved on another profile is re-simulated on the variant, so that its predicted time is the
    eager profile's."""


EAGER_COST = CostModel("eager")
INDUCTOR_COST = CostModel(f"fused pointwise x{FUSED_POINTWISE:g}", fused_pointwise)


def cost_models(backend: str) -> tuple[CostModel, ...]:
    """The cost models the compiled search plans under for `backend`: the eager profile's
    times, and for inductor (which fuses pointwise ops) also `fused_pointwise`'s."""
    return (EAGER_COST, INDUCTOR_COST) if backend == "inductor" else (EAGER_COST,)


def compile_copy(model: torch.nn.Module, schedule: Schedule | None, backend: str,
                 memory_budget: float) -> torch.nn.Module:
    """A deep copy of `model` (unplanned) with `schedule` applied, under ``torch.compile``."""
    twin = copy.deepcopy(model)
    if schedule is not None and schedule.regions:
        apply_schedule(twin, schedule)
    return torch.compile(twin, backend=compile_backend(backend, memory_budget))


@dataclass(eq=False)
class Candidate:
    """One compiled configuration, measured."""

    schedule: Schedule | None
    """Our regions (None: no plan, the compiler's recomputation alone)."""
    memory_budget: float
    """The partitioner's ``activation_memory_budget``."""
    peak_bytes: int
    """The compiled step's measured peak."""
    module: torch.nn.Module | None
    """The compiled model to time."""
    profile: Profile | None = None
    """The profile `schedule` was solved from (one of `compile_variants`)."""
    eager_budget: int | None = None
    """The eager budget `schedule` was solved for."""
    cost_model: str = EAGER_COST.name
    """The cost model `schedule` was solved under (`cost_models`)."""
    step_ms: list[float] = field(default_factory=list)
    step_rounds: list[int] = field(default_factory=list)
    """The timing round of each of `step_ms` (`_ROUND_IDS`)."""

    fits: bool = False
    """Its measured peak is within the search's target."""

    def label(self, backend: str) -> str:
        regions = "no plan" if self.schedule is None else f"{len(self.schedule.regions)} regions"
        return f"{backend}({self.memory_budget:g}) with {regions}"

    def summary(self, picked: Candidate | None = None) -> dict[str, Any]:
        """What was tried and measured, as JSON: for the compare rows and the plan's report.
        `rounds` lists (timing round, step ms) in the order timed: a candidate's median mixes
        rounds minutes apart, and the pick (`picked`: this is the one `fastest` chose) reads the
        rounds two candidates share, so the rounds are what tells why one was picked."""
        return {
            "memory_budget": self.memory_budget,
            "eager_budget_bytes": self.eager_budget,
            "cost_model": self.cost_model if self.schedule is not None else None,
            "regions": len(self.schedule.regions) if self.schedule is not None else 0,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "step_ms": _median(self) if self.step_ms else None,
            "rounds": [[r, round(t, 3)] for r, t in zip(self.step_rounds, self.step_ms,
                                                         strict=True)],
            "picked": picked is self,
        }

    def describe(self, backend: str) -> str:
        """One line: `label`, what the plan was solved for, the peak, and the median time."""
        mib = 2**20
        planned = "" if self.schedule is None or self.eager_budget is None else (
            f", planned for {self.eager_budget / mib:.2f} MiB eager ({self.cost_model})")
        timed = (f", {_median(self):.1f} ms (median of {len(self.step_ms)} steps)"
                 if self.step_ms else "")
        return (f"{self.label(backend)}{planned}: {self.peak_bytes / mib:.2f} MiB"
                f"{'' if self.fits else ', does not fit'}{timed}")


def search(model: torch.nn.Module, prof: Profile, target: int, *, backend: str,
           eager_none: int, solve_at: Callable[[Profile, int], Schedule | None],
           step: Callable[[torch.nn.Module], int],
           time_step: Callable[[torch.nn.Module], float] | None = None,
           unplanned: Callable[[float], tuple[int, torch.nn.Module | None]] | None = None,
           memory_budgets: Sequence[float] = MEMORY_BUDGETS,
           rounds: int = COMPILED_ROUNDS,
           costs: Sequence[CostModel] | None = None) -> tuple[list[Candidate], list[Candidate]]:
    """The compiled configurations within `target` bytes, and every one measured.

    `model` is unplanned and left so. `solve_at(profile, b)` is the schedule planned at eager
    budget b (None: none fits b); `step(compiled)` steps a compiled model once and returns its
    measured peak; `unplanned(m)`, where given, is the compiled model without a plan at
    partitioner budget m, already measured (its peak and the module to time). At each
    partitioner budget, one plan is searched per cost model (`costs`, default
    `cost_models(backend)`), each from the first profile variant that gives one that fits.
    Schedules are compiled once per partitioner budget however many eager budgets, variants or
    cost models give them. Where the copy without a plan fits at a partitioner budget, no plan is
    searched there. Partitioner budgets below the first are searched with at most 3 eager
    budgets each. With `time_step` (a step's time in ms), the candidates are timed in turn at
    each partitioner budget, and plans are searched at the next one only while its fastest
    configuration measured faster than every one before (recomputing more in the compiler can
    be faster, moving fewer bytes); the copy without a plan is tried at every partitioner
    budget all the same, as the partitioner's step time is not monotone in its budget (one
    more compilation per budget, none where `unplanned` has it measured). Without
    `time_step`, the search stops at the first budget where the copy without a plan fits."""
    fits: list[Candidate] = []
    tried: list[Candidate] = []
    # dynamo's "eager" backend runs the captured graph as is: no partitioner to set
    ordered = [1.0] if backend == "eager" else sorted(set(memory_budgets), reverse=True)
    models = tuple(costs) if costs is not None else cost_models(backend)
    # per cost model, (variant, the profile solved on) pairs: made once, on first need, so that
    # what solvers cache on a profile (dp's pool) is reused at every partitioner budget
    plans_on: list[tuple[CostModel, list[tuple[Profile, Profile]]]] = []
    planning = True  # False once a lower partitioner budget stopped paying: no plan below it
    for m in ordered:
        found: list[Candidate] = []
        if unplanned is not None:
            peak, module = unplanned(m)
        else:
            module = compile_copy(model, None, backend, m)
            peak = step(module)
        none = Candidate(None, m, peak, module if peak <= target else None, fits=peak <= target)
        tried.append(none)
        if peak <= target:
            found.append(none)
        if planning and not found and not plans_on:
            variants = compile_variants(prof)
            plans_on = [(c, [(v, v if c.plan_on is None else c.plan_on(v)) for v in variants])
                        for c in models]
        for cost, pairs in plans_on if planning and not found else ():
            for variant, planned_on in pairs:
                seen: dict[int, Candidate] = {}

                def try_at(b: int, variant: Profile = variant, planned_on: Profile = planned_on,
                           cost: CostModel = cost, seen: dict[int, Candidate] = seen,
                           m: float = m) -> int | None:
                    s = solve_at(planned_on, b)
                    if s is None:
                        return None
                    # a schedule already compiled at m (by this or another variant or cost
                    # model) is not again
                    c = next((c for c in tried if c.memory_budget == m and c.schedule is not None
                              and c.schedule.regions == s.regions), None)
                    if c is None:
                        if planned_on is not variant:  # predictions on the eager profile
                            s = finish(variant, s, s.budget_bytes)
                            s = dataclasses.replace(s, stats={**s.stats,
                                                              "cost_model": cost.name})
                        compiled = compile_copy(model, s, backend, m)
                        c = Candidate(s, m, step(compiled), compiled, variant, b, cost.name)
                        c.fits = c.peak_bytes <= target
                        if not c.fits:
                            c.module = None  # only the fitting copies are kept, to be timed
                        tried.append(c)
                    seen[b] = c
                    return c.peak_bytes

                b = compiled_budget(target, eager_none, peak, try_at,
                                    rounds if m == ordered[0] else min(rounds, 3))
                if b is not None:
                    if all(seen[b] is not c for c in found):
                        found.append(seen[b])
                    break
        if not found:
            continue
        before = list(fits)
        fits.extend(found)
        if time_step is None and found[0].schedule is None:
            break  # the compiler alone fits; untimed, a lower budget is not worth compiling
        if time_step is not None and len(fits) > 1:
            timed = [c for c in before if c.step_ms]
            now = ([_best(timed)] if timed else []) + [c for c in fits
                                                                  if not c.step_ms]
            _time(now, time_step, TIMING_ROUNDS)
            _settle(now, time_step)
            if before and _faster(_best(found), _best(before)) not in found:
                planning = False  # recomputing more in the compiler stopped paying
    return fits, tried


def _time(candidates: Sequence[Candidate], time_step: Callable[[torch.nn.Module], float],
          rounds: int) -> None:
    """`rounds` rounds, each stepping every candidate once in turn (the order reversed every
    other round, so that a machine slowing down within a round favours none of them)."""
    for _ in range(rounds):
        r = next(_ROUND_IDS)
        for c in (candidates if r % 2 == 0 else candidates[::-1]):
            c.step_ms.append(time_step(c.module))
            c.step_rounds.append(r)


def _paired(a: Candidate, b: Candidate) -> list[float]:
    """a's step time over b's, one ratio per round both were timed in."""
    of_b = dict(zip(b.step_rounds, b.step_ms))
    return [t / of_b[r] for r, t in zip(a.step_rounds, a.step_ms) if r in of_b]


def _faster(a: Candidate, b: Candidate) -> Candidate:
    """a where it is strictly faster than b: by the median of their paired rounds' ratios, or
    by median step times where they were never timed in the same round; else b."""
    ratios = _paired(a, b)
    if ratios:
        return a if statistics.median(ratios) < 1 else b
    return a if _median(a) < _median(b) else b


def _tournament(candidates: Sequence[Candidate]) -> Candidate:
    """Each candidate, in order, against the fastest so far (`_faster`). `search` times each
    partitioner budget's candidates together with the fastest before them, so along this order
    every comparison has paired rounds to read, however the machine's speed drifted between
    budgets (medians over all samples would mix fast and slow minutes)."""
    best = candidates[0]
    for c in candidates[1:]:
        best = _faster(c, best)
    return best


def _pair(candidates: Sequence[Candidate]) -> tuple[Candidate, Candidate, list[float]]:
    """The two fastest timed candidates, the faster of them first as their own paired rounds
    say, and its per-round ratios to the other. Where at least `TIMING_ROUNDS` rounds timed
    every one of them, the two are those with the least median, over those rounds, of their
    time over the round's median time; else the winners of `_tournament`."""
    timed = [c for c in candidates if c.step_ms]
    common = _common_rounds(timed)
    if len(common) >= TIMING_ROUNDS:
        def score(c: Candidate) -> float:
            return statistics.median(dict(zip(c.step_rounds, c.step_ms))[r] / typical[r]
                                     for r in common)

        typical = {r: statistics.median(dict(zip(c.step_rounds, c.step_ms))[r] for c in timed)
                   for r in common}
        a, b = sorted(timed, key=score)[:2]
    else:
        a = _tournament(timed)
        b = _tournament([c for c in timed if c is not a])
    if _faster(b, a) is b:
        a, b = b, a
    return a, b, _paired(a, b)


def _common_rounds(candidates: Sequence[Candidate]) -> set[int]:
    """The timing rounds every one of `candidates` was timed in."""
    return set.intersection(*(set(c.step_rounds) for c in candidates)) if candidates else set()


def _best(candidates: Sequence[Candidate]) -> Candidate:
    """The fastest of `candidates` as timed so far (`_pair`), timing nothing."""
    timed = [c for c in candidates if c.step_ms]
    return timed[0] if len(timed) == 1 else _pair(timed)[0]


def _settle(candidates: Sequence[Candidate],
            time_step: Callable[[torch.nn.Module], float]) -> None:
    """Time the two fastest of `candidates` again, in turn, one round at a time, until their
    paired rounds tell them apart (`CLOSE_CALL`, `AGREE`) or number `MAX_TIMING_ROUNDS`."""
    while len(candidates) > 1:
        _, _, ratios = _pair(candidates)
        n = len(ratios)
        if n >= MAX_TIMING_ROUNDS or (
                n >= TIMING_ROUNDS and statistics.median(ratios) * (1 + CLOSE_CALL) < 1
                and sum(q < 1 for q in ratios) >= AGREE * n):
            return
        _time(_pair(candidates)[:2], time_step, 1)


def _median(c: Candidate) -> float:
    return statistics.median(c.step_ms)


def fastest(candidates: Sequence[Candidate], time_step: Callable[[torch.nn.Module], float],
            rounds: int = TIMING_ROUNDS) -> Candidate:
    """The fastest candidate: all of them timed together, in turn, for `rounds` rounds unless
    that many rounds timed them all already, the two fastest over those rounds timed again
    while a close call (`_settle`), and of those two the one their paired rounds rank first.
    With one candidate, that one, untimed.

    `search` times each partitioner budget's candidates with the fastest before them, so across
    budgets its rounds link the candidates in a chain of pairs; a noisy round in any link
    would decide between two candidates that never ran side by side. The final rounds time
    them all side by side."""
    if len(candidates) == 1:
        return candidates[0]
    if len(_common_rounds(candidates)) < rounds:
        _time(candidates, time_step, rounds)
    _settle(candidates, time_step)
    return _best(candidates)
