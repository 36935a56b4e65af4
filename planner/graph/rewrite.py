"""Turn a traced forward graph and a Schedule into a trainable, checkpointed `nn.Module`.

The forward part of the joint trace (see `planner.trace`) is copied into a new fx graph. Each region
of the schedule becomes a sub-GraphModule run under non-reentrant `torch.utils.checkpoint`:
- nodes the schedule saves inside a region go through a selective-checkpoint policy (MUST_SAVE for
  exactly those op invocations, counted per op in graph order);
- the RNG state is preserved for regions with random ops (dropout masks replay identically);
- ops that update module buffers in place (BatchNorm running statistics) are given clones of those
  buffers during the replay, so the statistics move once per step, as without checkpointing.
The module runs the user's own parameter and buffer tensors, so the user's optimizer, `state_dict`
and model object keep working, and returns the output in the model's own structure.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from planner.graph.trace import JointTrace
from planner.graph.trace import written_positions as _written_positions
from solvers.errors import ScheduleError
from solvers.schedule import Region, Schedule

__all__ = ["PlannedModule", "build_forward_graph", "rewrite"]

_state = threading.local()


def _recomputing() -> bool:
    return getattr(_state, "recomputing", 0) > 0


@contextlib.contextmanager
def _recompute_flag() -> Iterator[None]:
    _state.recomputing = getattr(_state, "recomputing", 0) + 1
    try:
        yield
    finally:
        _state.recomputing -= 1


class _BufferSafe:
    """Wraps an op that mutates module buffers: during a checkpoint replay the mutated buffers are
    replaced by clones, so running statistics are not updated a second time."""

    def __init__(self, target: Callable[..., Any], positions: list[int]):
        self.target = target
        self.positions = positions
        self.__name__ = f"buffer_safe_{getattr(target, '__name__', 'op')}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _recomputing():
            args = list(args)
            # Clone outside any dispatch mode: a selective-checkpoint replay must run exactly the
            # ops its forward ran, and an extra clone would not be found in its cache.
            with _disable_current_modes():
                for i in self.positions:
                    if i < len(args) and isinstance(args[i], torch.Tensor):
                        args[i] = args[i].clone()
        return self.target(*args, **kwargs)


class CheckpointRegion(torch.nn.Module):
    """One region: a sub-GraphModule run under non-reentrant checkpoint."""

    def __init__(
        self,
        gm: fx.GraphModule,
        saved_ops: list[tuple[Any, int]],
        random: bool,
        passthrough: list[int],
    ):
        super().__init__()
        self.body = gm
        # Buffers and constants reach the body directly rather than as checkpoint arguments: the
        # frame would save them, and an in-place update later in the step (BatchNorm's
        # num_batches_tracked += 1) would then fail autograd's version check at the replay.
        self.passthrough = passthrough
        self.saved_ops = set(saved_ops)
        self.preserve_rng_state = random

    def _context_fn(self):
        if not self.saved_ops:
            return contextlib.nullcontext(), _recompute_flag()
        counts: dict[bool, Counter] = {False: Counter(), True: Counter()}
        saved = self.saved_ops

        def policy(ctx, func, *args, **kwargs):
            c = counts[bool(ctx.is_recompute)]
            k = c[func]
            c[func] += 1
            if (func, k) in saved:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        fwd, rec = create_selective_checkpoint_contexts(policy)

        @contextlib.contextmanager
        def both():
            with rec, _recompute_flag():
                yield

        return fwd, both()

    def forward(self, *args: Any) -> Any:
        # The body's generated `forward`, not the GraphModule itself: its __call__ wraps every
        # call in a try/except that, on any exception, extracts the traceback (linecache, a stat
        # per frame) before re-raising; checkpoint's early stop ends every replay with one, which
        # cost more than the region's own checkpoint machinery on a CPU.
        run = self.body.forward
        if not torch.is_grad_enabled():
            return run(*args)
        if not self.passthrough:
            return checkpoint(
                run,
                *args,
                use_reentrant=False,
                preserve_rng_state=self.preserve_rng_state,
                context_fn=self._context_fn,
            )
        fixed = {i: args[i] for i in self.passthrough}
        rest = [a for i, a in enumerate(args) if i not in fixed]
        n = len(args)

        def body(*xs: Any) -> Any:
            it = iter(xs)
            return run(*[fixed[i] if i in fixed else next(it) for i in range(n)])

        return checkpoint(
            body,
            *rest,
            use_reentrant=False,
            preserve_rng_state=self.preserve_rng_state,
            context_fn=self._context_fn,
        )


def build_forward_graph(trace: JointTrace) -> fx.Graph:
    """The forward part of the joint graph: placeholders (params, buffers, inputs), forward ops,
    and the model's output leaves; ops only the backward needed (autograd's detach of saved outputs)
    are dropped by dead-code elimination, side-effecting ops (buffer updates) are kept."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in trace.gm.graph.nodes:
        if n.op == "placeholder" or n.op == "get_attr" or trace.phase.get(n.name) == "forward":
            env[n] = g.node_copy(n, lambda a: env[a])
    outs = {n.name: n for n in trace.gm.graph.nodes}
    g.output(tuple(env[outs[name]] for name in trace.model_outputs))
    g.eliminate_dead_code(
        is_impure_node=lambda n: n.op in ("placeholder", "output")
        or bool(_written_positions(n.target))
    )
    return g


def rewrite(trace: JointTrace, schedule: Schedule | tuple[Region, ...]) -> fx.GraphModule:
    """The forward graph with each region of `schedule` run under checkpoint."""
    regions = schedule.regions if isinstance(schedule, Schedule) else tuple(schedule)
    fwd = build_forward_graph(trace)
    order = {n.name: i for i, n in enumerate(trace.gm.graph.nodes)}
    buffer_names = {n for n, ph in trace.phase.items() if ph == "buffer"}
    nodes = list(fwd.nodes)
    member: dict[str, int] = {}
    for k, r in enumerate(regions):
        if r.start not in order or r.end not in order:
            missing = r.start if r.start not in order else r.end
            raise ScheduleError(
                f"region {k} names node {missing!r}, which is not in the traced graph; the schedule "
                "was made for another model, input shape or torch version: re-plan"
            )
        a, b = order[r.start], order[r.end]
        for n in nodes:
            if n.op == "call_function" and a <= order[n.name] <= b:
                member[n.name] = k
    for k, r in enumerate(regions):
        for name in r.saved:
            if member.get(name) != k:
                raise ScheduleError(f"region {k}: saved node {name!r} is not inside the region")

    root = torch.nn.Module()
    for n in nodes:
        if n.op == "get_attr":
            setattr(root, n.target, fx.graph_module._get_attr(trace.gm, n.target))
    users_after: dict[fx.Node, list[fx.Node]] = {n: list(n.users) for n in nodes}
    last_of_region: dict[int, str] = {}
    for n in nodes:
        if n.name in member:
            last_of_region[member[n.name]] = n.name

    top = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        k = member.get(n.name)
        if k is None:
            if n.op == "output":
                top.output(fx.node.map_arg(n.args[0], lambda a: env[a]))
            else:
                new = top.node_copy(n, lambda a: env[a])
                if n.op == "call_function" and _buffer_written(n, buffer_names):
                    new.target = _BufferSafe(n.target, _written_positions(n.target))
                env[n] = new
            continue
        if n.name != last_of_region[k]:
            continue
        body_nodes = [m for m in nodes if member.get(m.name) == k]
        sub, inputs, outputs, saved_ops, random = _region_graph(
            body_nodes, member, k, users_after, regions[k], buffer_names
        )
        name = f"region_{k}"
        passthrough = [
            j for j, a in enumerate(inputs) if a.op == "get_attr" or a.name in buffer_names
        ]
        root.add_module(
            name,
            CheckpointRegion(
                fx.GraphModule(torch.nn.Module(), sub), saved_ops, random, passthrough
            ),
        )
        call = top.call_module(name, tuple(env[i] for i in inputs))
        for j, o in enumerate(outputs):
            env[o] = top.call_function(operator.getitem, (call, j))
    gm = fx.GraphModule(root, top)
    return gm


def _buffer_written(n: fx.Node, buffer_names: set[str]) -> bool:
    return any(
        pos < len(n.args) and isinstance(n.args[pos], fx.Node) and n.args[pos].name in buffer_names
        for pos in _written_positions(n.target)
    )


def _region_graph(body_nodes, member, k, users_after, region: Region, buffer_names):
    inside = set(body_nodes)
    inputs: list[fx.Node] = []
    for m in body_nodes:
        for a in m.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [m for m in body_nodes if any(u not in inside for u in users_after[m])]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
    counts: Counter = Counter()
    saved_ops: list[tuple[Any, int]] = []
    saved = set(region.saved)
    random = False
    for m in body_nodes:
        new = sub.node_copy(m, lambda a: env[a])
        if isinstance(m.target, torch._ops.OpOverload):
            if m.name in saved:
                saved_ops.append((m.target, counts[m.target]))
            counts[m.target] += 1
            if torch.Tag.nondeterministic_seeded in m.target.tags:
                random = True
            if _buffer_written(m, buffer_names):
                new.target = _BufferSafe(m.target, _written_positions(m.target))
        env[m] = new
    sub.output(tuple(env[o] for o in outputs))
    return sub, inputs, outputs, saved_ops, random


class PlannedModule(torch.nn.Module):
    """The user's model, run through its checkpointed traced graph in training mode.

    Parameters and buffers are the model's own tensors (``self.model`` is the user's module). In
    eval mode, or when called with inputs of another structure or shape than planned for, it
    refuses or falls back as documented in `forward`.
    """

    def __init__(self, model: torch.nn.Module, trace: JointTrace, gm: fx.GraphModule):
        super().__init__()
        self.model = model
        self.graph_module = gm
        self._trace = trace
        # (owner module, attribute) of every parameter and buffer the graph takes, resolved once:
        # `named_parameters()` walks every module on each call (milliseconds a step on a large
        # CNN), while getattr on the owner is cheap and still sees a tensor the user replaced.
        self._slots = [_owner(model, n) for n in (*trace.param_names, *trace.buffer_names)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Train-mode calls run the checkpointed graph; eval-mode calls run the original model
        (no backward, nothing to checkpoint)."""
        if not self.training:
            return self.model(*args, **kwargs)
        tr = self._trace
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != tr.input_spec:
            raise ScheduleError(
                "the planned module was called with inputs of another structure than it was "
                f"planned for (expected {tr.input_spec}, got {spec}); plan again for these inputs"
            )
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        planned = [tuple(s) for s in _planned_shapes(tr)]
        got = [tuple(t.shape) for t in tensors]
        if got != planned:
            raise ScheduleError(
                f"the planned module was traced for input shapes {planned}, got {got}; shapes are "
                "part of the plan (memory scales with them): call planner.plan again for this shape"
            )
        flat = self.graph_module(*[getattr(m, a) for m, a in self._slots], *tensors)
        it = iter(flat)
        out_leaves = [next(it) if c is None else c for c in tr.out_constants]
        return pytree.tree_unflatten(out_leaves, tr.out_spec)


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The module that holds the parameter or buffer called `name` (dotted), and its attribute."""
    prefix, _, attr = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), attr


def _planned_shapes(tr: JointTrace) -> list[tuple[int, ...]]:
    shapes = tr.__dict__.get("_input_shapes")
    if shapes is None:
        shapes = [
            tuple(n.meta["val"].shape)
            for n in tr.gm.graph.nodes
            if n.op == "placeholder" and tr.phase[n.name] == "input" and "val" in n.meta
        ]
        tr.__dict__["_input_shapes"] = shapes
    return shapes

