"""Put a schedule onto the user's own modules, and take it off again.

Each region of a recorded profile's schedule is one module (`Region.module`); applying it sets that
module's `forward` (an instance attribute, so the class, parameters, buffers, `state_dict` keys and
hooks are untouched) to a wrapper that runs the original forward under non-reentrant
`torch.utils.checkpoint`:

- a selective policy keeps the outputs the schedule saves (`Region.save_ops`: the k-th op of an
  overload within one call, so the policy does not depend on input shapes);
- the RNG state is preserved where the region draws random numbers (dropout masks replay);
- buffers the region updates in place (BatchNorm statistics) are swapped for copies while the
  replay runs, so they move once per step, as without checkpointing.

With gradients disabled (evaluation, `generate`) the wrapper calls the original forward directly.
A region that is a run of an `nn.Sequential`'s children (`Region.segment`) sets the Sequential's
`forward` to one that runs its children in order, each run under its own checkpoint, as
`torch.utils.checkpoint.checkpoint_sequential` does. A region that is a run of the nodes of a
module's traced forward (`Region.staged`, `planner.stages`) sets its `forward` to the trace's
interpreter, with those runs checkpointed.

`remove(model)` restores every wrapped module's previous `forward`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _StopRecomputationError,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

from planner.capture.record import input_leaves, mutable_containers, op_name, set_contents
from planner.stages import Pattern, nest, trace
from solvers.errors import CkptPlannerError, ScheduleError
from solvers.schedule import Region, Schedule, policy_op

__all__ = ["AppliedPlan", "CheckpointedForward", "PlanOutdatedWarning", "SegmentedForward",
           "StagedForward", "applied", "apply_schedule", "applying", "remove", "wrapper_of"]

_ATTR = "_ckpt_planner_applied"


class PlanOutdatedWarning(UserWarning):
    """The model changed after planning (a module replaced or added, a parameter of another
    shape): it still trains correctly, but the plan's memory prediction no longer holds."""


_CHECKPOINT_FLAGS = ("gradient_checkpointing", "grad_checkpointing")
"""Module attributes by which a library checkpoints its own layers (HF's, timm's): turned on
after planning, they stack checkpoints on the plan's (`_warn_if_changed` warns)."""


@dataclass
class AppliedPlan:
    """What `apply_schedule` changed on a model, so that `remove` can undo it."""

    schedule: Schedule
    wrapped: dict[str, CheckpointedForward | SegmentedForward | StagedForward]
    """Module path -> the wrapper set as that module's `forward`."""
    changed: str = ""
    """What changed in the model since the plan was applied ("" while nothing did)."""
    warned: bool = False
    hook: Any = None
    end_hook: Any = None
    """The root's forward hook that ends the step's autocast check (`_forward_done`)."""
    largest: Any = None
    """A weak reference to the model's largest parameter, and its dtype when the plan was
    applied: `model.to(dtype)` / `.half()` change it in place, which no registration hook sees.
    (Its device may change: a plan made on one device for another is moved there to train.)"""
    largest_was: torch.dtype | None = None
    flags: list[tuple[str, Any, str]] | None = None
    """(path, weak reference, flag) of each module with one of `_CHECKPOINT_FLAGS` (HF layers'
    ``gradient_checkpointing``, which `gradient_checkpointing_enable()` and
    `TrainingArguments(gradient_checkpointing=True)` turn on; timm's ``grad_checkpointing``,
    which `set_grad_checkpointing()` turns on), found on the first step."""
    fsdp_groups: list[Any] | None = None
    """FSDP2's parameter groups of the sharded model (their ``reduce_grads`` is gradient sync),
    found on the first step after `fully_shard`."""

    def __getstate__(self) -> dict[str, Any]:
        # A copy (`copy.deepcopy`, `torch.save`) finds its own largest parameter and flagged
        # modules on its first step.
        state = dict(self.__dict__)
        state["largest"] = None
        state["flags"] = None
        state["fsdp_groups"] = None
        return state


SAC_CACHE_VERSION = "ckpt-planner-sac-2"
"""Part of the `cache_hash` of compiled selective regions: AOTAutograd's cache keys a compiled
region by it (a cache hit never calls the policy), so it changes whenever the policy's meaning
does."""


def _policy_keys(region: Region) -> str:
    """`Region.save_ops` as one sorted string (a constant dynamo can guard on), validated."""
    for key in region.save_ops:
        op, _, k = key.rpartition("#")
        if not op or not k.isdigit():
            raise ScheduleError(f"region of {region.module!r}: save_ops entry {key!r} is not "
                                "'<aten overload>#<k>'")
    return ",".join(sorted(region.save_ops))


@functools.cache
def _parse_save_ops(save_ops: str) -> dict[str, frozenset[int]]:
    keys: dict[str, set[int]] = {}
    for key in save_ops.split(",") if save_ops else ():
        op, _, k = key.rpartition("#")
        keys.setdefault(policy_op(op), set()).add(int(k))
    return {op: frozenset(ks) for op, ks in keys.items()}


def _selective_contexts(save_ops: str):
    """The selective-checkpoint contexts of one region call: MUST_SAVE for the k-th op of each
    overload named in `save_ops`. The counter is fresh per call (the policy sees one call's ops;
    under compile AOTAutograd calls this once per trace). A module-level function taking a string,
    so that `functools.partial(_selective_contexts, keys)` is a context_fn dynamo accepts and
    guards by value (regions with different saves get different compiled graphs)."""
    keys = _parse_save_ops(save_ops)
    counts: dict[str, int] = {}

    def policy(ctx, func, *args, **kwargs):
        name = policy_op(op_name(func))
        k = counts.get(name, 0)
        counts[name] = k + 1
        return CheckpointPolicy.MUST_SAVE if k in keys.get(name, ()) \
            else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _param_cast(func: Any, args: tuple) -> bool:
    """The op is a cast of a parameter (autocast's, which it caches for the rest of its block)."""
    return func is torch.ops.aten._to_copy.default and bool(args) \
        and isinstance(args[0], torch.nn.Parameter)


class _NotesParamCasts(TorchDispatchMode):
    """A selective region's forward mode (torch's caching mode, `inner`), noting in `cast` the
    parameters the region casts itself. Autocast casts a parameter at its first use in an
    autocast block and serves later uses from its cache: a region that reads a parameter cast
    before it runs no cast in forward, but its replay (in an autocast block of its own, its
    cache empty) casts it again (`_ReplayAgain` keeps those out of the replay's op count)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, inner: Any, cast: set[int]) -> None:
        super().__init__()
        self.inner, self.cast = inner, cast

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _param_cast(func, args):
            self.cast.add(id(args[0]))
        return self.inner.__torch_dispatch__(func, types, args, kwargs)


def _replayable(rec: Any, cast: set[int] | None = None) -> Any:
    """`rec`, torch's selective replay mode, able to replay again: in a second backward through
    the same graph (``retain_graph=True``, or a gradient penalty's ``create_graph=True`` gradient
    followed by ``backward()``) torch raises "backward an extra time", since the kept outputs were
    handed out in the first. Here an output already handed out is computed again instead: the
    replay restores the forward's RNG state, so running every op reproduces the forward. Kept
    outputs are still released at the first replay, as torch does (the simulator counts that).
    Torch versions whose mode stores outputs otherwise keep torch's behaviour."""
    ckpt = torch.utils.checkpoint
    consumed = getattr(ckpt, "_CONSUMED", None)
    key_of = getattr(ckpt, "_sac_storage_key", None)
    ignored = getattr(ckpt, "SAC_IGNORED_OPS", None)
    if consumed is None or key_of is None or ignored is None or \
            not isinstance(getattr(rec, "func_counter", None), dict):
        return rec
    return _ReplayAgain(rec, consumed, key_of, ignored, cast)


class _ReplayAgain(TorchDispatchMode):
    """See `_replayable`."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, rec: Any, consumed: Any, key_of: Any, ignored: Any,
                 cast: set[int] | None = None) -> None:
        super().__init__()
        self.rec, self._consumed, self._key_of, self._ignored = rec, consumed, key_of, ignored
        self._cast = cast

    def __enter__(self):
        self.rec.func_counter.clear()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._cast is not None and _param_cast(func, args) and id(args[0]) not in self._cast:
            # autocast's cast of a parameter forward took from its cache, cast before the
            # region (`_NotesParamCasts`): no op of the forward, so not one the policy counts
            return func(*args, **(kwargs or {}))
        if func not in self._ignored:
            key = self._key_of(func, args)
            storage = self.rec.storage.get(key)
            if storage is not None and \
                    storage.get(self.rec.func_counter[key]) is self._consumed:
                self.rec.func_counter[key] += 1
                return func(*args, **(kwargs or {}))
        return self.rec.__torch_dispatch__(func, types, args, kwargs)


class _ReplayContext:
    """The context a region's replay runs in: the state its forward ran on (`_as_in_forward`),
    buffer copies (if the region updates buffers), then the selective replay mode. An object, not a generator, because every backward through the
    graph that replays the region enters it again (``retain_graph=True``). `start` holds the
    values forward started from of the buffers the region restores (`Region.restores`)."""

    def __init__(self, slots: list[tuple[torch.nn.Module, str]], rec: Any,
                 start: dict[tuple[int, str], torch.Tensor] | None = None,
                 read: list[tuple[dict[str, Any], str, weakref.ref]] = (),
                 scalars: list[tuple[torch.nn.Module, str, Any]] = (),
                 modules: list[torch.nn.Module] = (),
                 generators: list[tuple[torch.Generator, bytes]] = (),
                 given: list[tuple[list | dict, list]] = ()) -> None:
        self._slots, self._rec, self._start, self._read = slots, rec, start, read
        self._scalars, self._modules, self._generators = scalars, modules, generators
        self._given = given
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        with stack:  # copies first: the selective replay must not see the clones among its ops
            if self._given:
                stack.enter_context(_given_as_in_forward(self._given))
            if self._generators:
                stack.enter_context(_generators_as_in_forward(self._generators))
            if self._read or self._scalars or self._modules:
                stack.enter_context(_as_in_forward(self._read, self._scalars, self._modules))
            if self._slots:
                stack.enter_context(_buffer_copies(self._slots, self._start))
            stack.enter_context(self._rec)
            self._stacks.append(stack.pop_all())

    def __exit__(self, *exc: Any) -> bool:
        return bool(self._stacks.pop().__exit__(*exc))


_PLAIN = (torch.Tensor, int, float, bool, str, torch.Size, torch.dtype, torch.device)
"""Argument types that hold no list or dict a replay would start from (`_RegionRunner.run`)."""

_SCALARS = (int, float, bool)
"""Types of the module attributes a replay starts from as forward did (`_as_in_forward`)."""

_ABSENT = object()

_REGISTRIES = frozenset({"_parameters", "_buffers", "_modules"})
"""A module's own dicts of parameters, buffers and children: a replay's buffer copies are put
back by `_buffer_copies`, and FSDP2 swaps parameters in and out of `_parameters` itself."""


def _scalar_slots(modules: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, str]]:
    """(module, name) of every int, float, bool and None attribute of `modules`, listed as a
    region first runs: an attribute a forward creates later is not among them."""
    return [(m, k) for m in modules for k, v in m.__dict__.items()
            if v is None or type(v) in _SCALARS]


@contextlib.contextmanager
def _as_in_forward(read: list[tuple[dict[str, Any], str, weakref.ref]],
                   scalars: list[tuple[torch.nn.Module, str, Any]] = (),
                   modules: list[torch.nn.Module] = ()) -> Iterator[None]:
    """Run a replay on the state its region's forward ran on, and leave the state as it was:

    - the parameters and buffers forward read, where the modules hold others now and those are
      still alive: a step through `torch.func.functional_call` (MAML, stateless training) runs
      forward on the tensors it is given, and by backward the module has its own again;
    - the modules' int, float and bool attributes as forward started: a forward that advances
      a Python counter (a temperature annealed by step) would advance it again in the replay
      and compute with the next value; the training flag, if set otherwise since; and those
      that were None: a forward that starts a recurrence from an empty state and stores its
      last one there (RecurrentGemma's RG-LRU) would replay from that state, another branch
      (torch's metadata check raised);
    - the tensors the `modules` hold in plain attributes, as forward left them: a forward that
      stores a tensor it computes on its module (an MoE layer's auxiliary loss, an attention
      map kept for inspection) would leave the replay's there, with the replay's graph;
    - likewise the contents of the lists and dicts the `modules` hold in plain attributes,
      where the replay put tensors in or took them out: MONAI's DynUNet stores each deep
      supervision head's output in a list its modules share (``self.heads[i] = ...``), and
      the replay's, graph and all, stayed there into the next step.

    Without it a replay recomputes from another state and gives other gradients, as torch's own
    `checkpoint` does. (A region never reads a tensor attribute the step replaces after: such
    a call is blocked, `Recording.attribute_rereads`.)"""
    kept = [(m.__dict__, dict(m.__dict__)) for m in modules]
    held: dict[int, tuple[list | dict, list | dict]] = {}  # id -> (container, its contents)
    for m in modules:
        for k, v in m.__dict__.items():
            if type(v) in (list, dict) and id(v) not in held and k not in _REGISTRIES:
                held[id(v)] = (v, v.copy())
    swapped = []
    for d, name, ref in read:
        t = ref()
        if t is not None and d.get(name) is not t:
            swapped.append((d, name, d.get(name)))
            d[name] = t
    for m, k, v in scalars:
        now = m.__dict__.get(k, _ABSENT)
        if v is _ABSENT or not (v is None or type(v) in _SCALARS):  # a tensor since
            continue
        if now is _ABSENT or type(now) is not type(v) or (v is not None and now != v):
            swapped.append((m.__dict__, k, now))
            m.__dict__[k] = v
    try:
        yield
    finally:
        for d, name, was in reversed(swapped):
            if was is _ABSENT:
                d.pop(name, None)
            else:
                d[name] = was
        for d, was in kept:
            for k in [k for k, v in d.items() if was.get(k, _ABSENT) is not v]:
                old = was.get(k, _ABSENT)
                if isinstance(d[k], torch.Tensor) or isinstance(old, torch.Tensor):
                    if old is _ABSENT:
                        del d[k]
                    else:
                        d[k] = old
            for k in was.keys() - d.keys():
                if isinstance(was[k], torch.Tensor):
                    d[k] = was[k]
        for c, was in held.values():
            _put_back(c, was)


def _put_back(c: list | dict, was: list | dict) -> None:
    """Give container `c` its contents `was` again where they differ in a tensor."""
    now = list(c.items()) if isinstance(c, dict) else list(enumerate(c))
    old = list(was.items()) if isinstance(was, dict) else list(enumerate(was))
    if len(now) == len(old) and all(k == j and v is w for (k, v), (j, w) in zip(now, old)):
        return
    if any(isinstance(v, torch.Tensor) for _, v in (*now, *old)):
        set_contents(c, was)


def _contents(c: list | dict) -> list[tuple[Any, Any, bool]]:
    """(key or index, value, whether the value is held weakly) of each item of `c`: a tensor by
    a weak reference, so that what the caller drops from its dict after forward is not kept
    alive until the region's backward (memory the prediction does not count)."""
    items = c.items() if isinstance(c, dict) else enumerate(c)
    return [(k, weakref.ref(v), True) if isinstance(v, torch.Tensor) else (k, v, False)
            for k, v in items]


@contextlib.contextmanager
def _given_as_in_forward(given: list[tuple[list | dict, list]]) -> Iterator[None]:
    """Run a replay with the lists and dicts the region was called with holding what they held
    as its forward started (`_contents`), and give them back what they hold now afterwards.

    A forward that writes its result into the dict it is given (sentence-transformers' modules
    put ``token_embeddings`` and ``sentence_embedding`` into their ``features``) or appends to a
    list it is given would otherwise replay on the dict as forward left it: BERT then received
    the results as keyword arguments it passes down to its attention, whose nested region took
    them as two more inputs, and torch's check of the replay failed; and the replay's results,
    graph and all, stayed in the caller's dict. A tensor that died since forward stays as it is
    now (nothing holds it: the replay cannot read it)."""
    now = [(c, c.copy()) for c, _ in given]
    for c, was in given:
        old: dict[Any, Any] = {}
        for k, v, weak in was:
            if weak:
                v = v()
                if v is None:
                    if isinstance(c, dict) and k in c:
                        old[k] = c[k]
                    elif isinstance(c, list) and k < len(c):
                        old[k] = c[k]
                    continue
            old[k] = v
        set_contents(c, old if isinstance(c, dict) else [old[k] for k in sorted(old)])
    try:
        yield
    finally:
        for c, was in now:
            set_contents(c, was)


def _generator_state(g: torch.Generator) -> bytes:
    """A generator's state as bytes: a state tensor kept from forward to backward would be
    memory the prediction does not count (the transient one is a few KiB)."""
    return g.get_state().numpy().tobytes()


@contextlib.contextmanager
def _generators_as_in_forward(generators: list[tuple[torch.Generator, bytes]]
                              ) -> Iterator[None]:
    """Run a replay with the `torch.Generator`s its modules hold in the state forward started
    from (checkpoint preserves only torch's default generators), and leave them as they were:
    a block drawing dropout masks or noise from ``self.gen`` draws the same numbers again."""
    now = [(g, _generator_state(g)) for g, _ in generators]
    for g, state in generators:
        g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    try:
        yield
    finally:
        for g, state in now:
            g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


@contextlib.contextmanager
def _buffer_copies(slots: list[tuple[torch.nn.Module, str]],
                   start: dict[tuple[int, str], torch.Tensor] | None = None) -> Iterator[None]:
    """Swap buffers for copies while a replay runs: its in-place updates land on the copies. A
    buffer in `start` (by module id and name) is copied from the value there, the one forward
    started from, instead of the one forward left."""
    saved = []
    for mod, attr in slots:
        b = mod._buffers.get(attr)
        if b is not None:
            saved.append((mod, attr, b))
            first = start.get((id(mod), attr)) if start else None
            mod._buffers[attr] = (first if first is not None else b).clone()
    try:
        yield
    finally:
        for mod, attr, b in saved:
            mod._buffers[attr] = b


def _tensors_as_inputs(fn, args: tuple[Any, ...], kwargs: dict[str, Any]
                       ) -> tuple[Any, tuple[Any, ...]]:
    """`fn` as a function of `args` followed by the keyword tensors of `kwargs` (a tensor value,
    or the tensors of a plain tuple value), and those arguments. The checkpoint saves its tensor
    inputs, so a nested checkpoint hands them to its parent, whose replay recomputes them: bound
    into the function instead (HF's ``hidden_states=``, ``position_embeddings=(cos, sin)``),
    they would stay alive from forward until the region's backward. Every other value (a list
    the call may append to, a cache, a ``torch.Size``) is passed as the very object it was."""
    if not kwargs:
        return fn, args
    tensors: list[torch.Tensor] = []
    plan: list[tuple[str, Any]] = []  # (name, value | marker of what to rebuild)
    for name, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            plan.append((name, _TENSOR))
            tensors.append(v)
        elif type(v) is tuple and any(isinstance(x, torch.Tensor) for x in v):
            plan.append((name, tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in v)))
            tensors.extend(x for x in v if isinstance(x, torch.Tensor))
        else:
            plan.append((name, v))
    if not tensors:
        return functools.partial(fn, **kwargs), args
    n = len(args)

    def call(*given: Any) -> Any:
        it = iter(given[n:])
        kw = {}
        for name, v in plan:
            if v is _TENSOR:
                kw[name] = next(it)
            elif type(v) is tuple and any(x is _TENSOR for x in v):
                kw[name] = tuple(next(it) if x is _TENSOR else x for x in v)
            else:
                kw[name] = v
        return fn(*given[:n], **kw)

    return call, (*args, *tensors)


_TENSOR = object()
"""Marks where `_tensors_as_inputs` puts a keyword tensor back."""


def _once_each(fn, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """`fn` and `args` with each tensor passed once: a tensor given in several positions
    (self-attention's ``query``, ``key``, ``value``) reaches `fn` as one object in all of them.
    A checkpoint nested in a replayed one gets its arguments back from saved tensors, one
    object per position, and code that tests ``query is key`` (`nn.MultiheadAttention`) would
    replay another path than its forward took."""
    where: list[int] = []
    kept: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            # `is`, not `id()`: dynamo resolves identity while tracing, but guards an `id()` of
            # a compiled frame's input on that object, recompiling on every call
            k = next((j for j, b in enumerate(kept) if b is a), len(kept))
            if k == len(kept):
                kept.append(a)
            where.append(k)
        else:
            where.append(len(kept))
            kept.append(a)
    if len(kept) == len(args):
        return fn, args

    def call(*given: Any) -> Any:
        return fn(*(given[k] for k in where))

    return call, tuple(kept)


class _RegionRunner:
    """Runs a function under non-reentrant checkpoint as a region says: selective policy, RNG
    preservation, buffer copies during the replay.

    Under `torch.compile` the region reaches dynamo in the form it supports: no `context_fn` when
    nothing is saved, else `functools.partial(_selective_contexts, keys)`. Compiled replays are the
    partitioner's recomputation inside the backward graph, which does not replay buffer
    mutations and draws dropout masks from the functionalized RNG, so neither the buffer copies
    nor `preserve_rng_state` are needed there.
    """

    _restores: list[tuple[torch.nn.Module, str]] = []
    """(module, buffer name) of `Region.restores`; the class default serves runners pickled
    before the field existed."""

    def __init__(self, region: Region, root: torch.nn.Module):
        self.region = region
        self._keys = _policy_keys(region)
        self._compiled_context = None
        if self._keys:
            ctx = functools.partial(_selective_contexts, self._keys)
            ctx.cache_hash = f"{SAC_CACHE_VERSION}:{self._keys}"  # type: ignore[attr-defined]
            self._compiled_context = ctx
        self._slots = []
        self._restores = []  # an instance list: the class's default stays empty
        for name in region.buffers:
            prefix, _, attr = name.rpartition(".")
            try:
                owner = root.get_submodule(prefix) if prefix else root
            except AttributeError:
                raise ScheduleError(
                    f"region of {region.module!r} updates buffer {name!r}, which this model does "
                    "not have: the schedule was made for another model"
                ) from None
            self._slots.append((owner, attr))
            if name in region.restores:
                self._restores.append((owner, attr))
        # The modules whose state a replay starts from as forward did (`_as_in_forward`): the
        # region's module, or what the wrapper names with `narrow`.
        self._home = root.get_submodule(region.module) if region.module else root
        self._owners = [self._home]
        self._shallow: list[torch.nn.Module] = []  # modules whose own slots count, not children's
        self._modules_in = None  # owners and their submodules, listed on first use, with:
        self._read: list[tuple[dict[str, Any], str]] = []  # their parameter and buffer slots
        self._scalar_slots: list[tuple[torch.nn.Module, str]] = []  # their int/float/bool
        self._script: bool | None = None  # whether they hold a ScriptModule (on first run)
        self._generators: list[torch.Generator] = []  # those they (and the region's module) hold

    def __getstate__(self) -> dict[str, Any]:
        # `_read` holds the modules' own parameter dicts; a pickle would hold copies of them
        state = dict(self.__dict__)
        state["_modules_in"], state["_read"], state["_scalar_slots"] = None, [], []
        state["_generators"], state["_given"] = [], ()
        return state

    def remap(self, memo: dict[int, Any]) -> _RegionRunner:
        new = _RegionRunner.__new__(_RegionRunner)
        new.__dict__.update(self.__dict__)
        new._slots = [(memo.get(id(m), m), a) for m, a in self._slots]
        new._restores = [(memo.get(id(m), m), a) for m, a in self._restores]
        new._owners = [memo.get(id(m), m) for m in self.__dict__.get("_owners", ())]
        new._home = memo.get(id(self._home), self._home) if "_home" in self.__dict__ else None
        new._shallow = [memo.get(id(m), m) for m in self.__dict__.get("_shallow", ())]
        new._modules_in = None
        new._script = None
        return new

    def narrow(self, deep: list[torch.nn.Module], shallow: list[torch.nn.Module]) -> None:
        """The region reads the parameters, buffers and attributes of `deep` and their
        submodules, and of `shallow` without theirs (a run of traced code: the modules it calls,
        the modules whose tensors it reads), not those of its whole module."""
        self._owners, self._shallow = list(deep), list(shallow)
        self._modules_in = self._script = None

    def _eager_context(self):
        # Called as the region's checkpoint starts: the buffers it restores are copied now, as
        # forward starts from them, and the frame keeps the copies until the region's backward.
        start = {(id(m), a): m._buffers[a].detach().clone() for m, a in self._restores
                 if m._buffers.get(a) is not None}
        if self.__dict__.get("_modules_in") is None:
            mods = [sub for m in self.__dict__.get("_owners", []) for sub in m.modules()]
            mods += self.__dict__.get("_shallow", [])
            self._modules_in = list({id(m): m for m in mods}.values())
            self._read = [(d, name) for sub in self._modules_in
                          for d in (sub._parameters, sub._buffers)
                          if isinstance(d, dict)  # a ScriptModule's are C++ wrappers
                          for name in d]
            self._scalar_slots = _scalar_slots(self._modules_in)
            home = self.__dict__.get("_home")  # absent in runners pickled before it existed
            held = [*self._modules_in, *([] if home is None else [home])]
            self._generators = [g for m in held for g in m.__dict__.values()
                                if isinstance(g, torch.Generator)]
        gens = [(g, _generator_state(g)) for g in self.__dict__.get("_generators", ())]
        given = [(c, _contents(c)) for c in self.__dict__.get("_given", ())]
        self._given = ()
        # Weak: what a module held in forward and drops before backward (offloading hooks)
        # is not kept alive for the replay.
        read = [(d, name, weakref.ref(t)) for d, name in self._read
                if (t := d.get(name)) is not None]
        scalars = [(m, k, m.__dict__.get(k, _ABSENT)) for m, k in self._scalar_slots]
        if not self._keys:
            return contextlib.nullcontext(), _ReplayContext(
                self._slots, contextlib.nullcontext(), start, read, scalars, self._modules_in,
                gens, given)
        fwd, rec = _selective_contexts(self._keys)
        cast: set[int] = set()
        return _NotesParamCasts(fwd, cast), _ReplayContext(
            self._slots, _replayable(rec, cast), start, read, scalars, self._modules_in, gens,
            given)

    def run(self, fn, *args: Any, given: tuple[Any, ...] = ()) -> Any:
        """`fn(*args)` under the region's checkpoint; `given` are the call's other arguments
        (bound into `fn`), whose lists and dicts the replay starts from as forward did."""
        fn, args = _once_each(fn, args)
        if torch.compiler.is_compiling():
            if self._restores:
                # Compiled, the partitioner's recomputation reads the buffers as forward left
                # them (torch 2.13: a compiled `checkpoint` of a spectral-normed layer gets
                # other gradients, as eager `checkpoint` does), and dynamo fails on two
                # nested ones; the region runs uncheckpointed, which `plan(..., compile=)`
                # measures.
                return fn(*args)
            extra = {} if self._compiled_context is None else \
                {"context_fn": self._compiled_context}
            return checkpoint(fn, *args, use_reentrant=False,
                              preserve_rng_state=self.region.preserve_rng, **extra)
        if _AUTOCAST_DUE is not None:  # eager only: dynamo never reads the global
            _check_autocast(args)
        script = self.__dict__.get("_script")
        if script is None:
            script = self._script = any(isinstance(sub, torch.jit.ScriptModule)
                                        for m in self.__dict__.get("_owners", [])
                                        for sub in m.modules())
        # A replay stops early by raising from a saved-tensor hook; raised inside a
        # ScriptModule's op, the TorchScript interpreter turns it into a RuntimeError that
        # checkpoint does not catch, and backward fails: such a region replays to its end.
        # read by `_eager_context`, which checkpoint calls as it starts
        held = [v for v in (*args, *given) if v is not None and not isinstance(v, _PLAIN)]
        self._given = mutable_containers(held) if held else ()
        with set_checkpoint_early_stop(False) if script else contextlib.nullcontext():
            return checkpoint(_stop_passes(fn), *args, use_reentrant=False,
                              preserve_rng_state=self.region.preserve_rng,
                              context_fn=self._eager_context)


def _stop_passes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, raising checkpoint's early stop of a replay as itself where code between wrapped
    it in another exception: einx (x-transformers' rearranges and masks) runs each operation
    in a try block and raises its own error from whatever the op raised, and the stop is raised
    from the pack hook of the replay's last saving op, which may be one of those."""

    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except _StopRecomputationError:
            raise
        except Exception as e:
            stop = _unchained_stop(e)
            if stop is None:
                raise
            try:
                raise stop from None
            finally:
                stop = None  # this frame is in the stop's traceback: no cycle through it

    return call


def _unchained_stop(e: BaseException) -> _StopRecomputationError | None:
    """The early stop `e` was raised from, if any, with the exceptions between unlinked and
    their tracebacks dropped: a chain that leads back to the stop is a reference cycle, and the
    tracebacks' frames hold the replay's tensors, which would then live until the garbage
    collector runs."""
    chain, seen = [], set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen and not isinstance(x, _StopRecomputationError):
        seen.add(id(x))
        chain.append(x)
        x = x.__cause__ or x.__context__
    if not isinstance(x, _StopRecomputationError):
        return None
    for y in chain:
        y.__cause__ = y.__context__ = y.__traceback__ = None
    return x


class CheckpointedForward:
    """A module's `forward`, run under non-reentrant checkpoint as its region says.

    An object rather than a closure so that `copy.deepcopy(model)` gives the copy a wrapper of
    its own module (a closure would keep running the original's) and pickling keeps it; set on
    the root, `inspect.signature(model.forward)` still shows the original signature
    (`__wrapped__`), which HF's `Trainer` reads to drop unused columns.
    """

    def __init__(self, module: torch.nn.Module, region: Region, root: torch.nn.Module,
                 previous: Any = None):
        self.module = module
        self.region = region
        self.previous = previous
        """The instance-level `forward` the module had before (accelerate's hooks), or None."""
        self._orig = previous if previous is not None else type(module).forward.__get__(module)
        functools.update_wrapper(self, self._orig)
        self._runner = _RegionRunner(region, root)

    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointedForward:
        module = memo.get(id(self.module), self.module)
        new = CheckpointedForward.__new__(CheckpointedForward)
        new.__dict__.update(self.__dict__)
        new.module = module
        new._orig = type(module).forward.__get__(module) if self.previous is None else \
            self.previous
        new.__wrapped__ = new._orig
        new._runner = self._runner.remap(memo)
        return new

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._orig(*args, **kwargs)
        fn, tensors = _tensors_as_inputs(self._orig, args, kwargs)
        return self._runner.run(fn, *tensors, given=tuple(kwargs.values()))


class SegmentedForward:
    """An `nn.Sequential`'s forward that runs some runs of its children as checkpointed regions
    (`checkpoint_sequential`'s segments, chosen by the plan)."""

    def __init__(self, module: torch.nn.Sequential, regions: list[Region], root: torch.nn.Module):
        self.module = module
        self.previous = None
        self.region = regions[0]
        self.regions = sorted(regions, key=lambda r: r.segment)
        self._runners = _segment_runners(self.regions, len(module), 2, "children",
                                         repr(regions[0].module), root)
        children = list(module._modules.values())
        for i, j, runner in self._runners:
            runner.narrow(children[i:j + 1], [])
        self._items = nest(0, len(module) - 1, self._runners)
        functools.update_wrapper(self, type(module).forward.__get__(module))

    def __deepcopy__(self, memo: dict[int, Any]) -> SegmentedForward:
        new = SegmentedForward.__new__(SegmentedForward)
        new.__dict__.update(self.__dict__)
        new.module = memo.get(id(self.module), self.module)
        new._runners = [(i, j, r.remap(memo)) for i, j, r in self._runners]
        new._items = nest(0, len(self.module) - 1, new._runners)  # new.module: half-copied
        new.__wrapped__ = type(new.module).forward.__get__(new.module)
        return new

    def __call__(self, input: Any) -> Any:
        children = list(self.module._modules.values())
        if not torch.is_grad_enabled():
            for m in children:
                input = m(input)
            return input
        return _run_children(children, self._items, input)


class StagedForward:
    """A module's forward run through its trace (`planner.stages`), with runs of its nodes
    (`Region.segment`) as checkpointed regions. A call the trace was not made for (other
    argument kinds or values, the other training mode), and any call without gradients, runs
    the module's own forward."""

    def __init__(self, module: torch.nn.Module, regions: list[Region], root: torch.nn.Module):
        self.module = module
        self.previous = None
        self.region = regions[0]
        self.regions = sorted(regions, key=lambda r: r.segment)
        where = f"module {regions[0].module!r} ({type(module).__name__})"
        try:
            info = json.loads(self.region.staged)
            pattern = Pattern.from_json(info["pattern"])
        except (ValueError, KeyError, TypeError):
            raise ScheduleError(f"region of {where}: malformed 'staged' field") from None
        if any(r.staged != self.region.staged for r in self.regions):
            raise ScheduleError(f"regions of {where} disagree on its trace")
        self.graph = trace(module, pattern)
        if self.graph is None or self.graph.fingerprint != info["fingerprint"]:
            raise ScheduleError(
                f"the schedule cuts inside the forward of {where}, whose code no longer traces "
                "as it did when planned: the schedule was made for another model; re-plan")
        self._runners = _segment_runners(self.regions, len(self.graph.exec), 1, "traced nodes",
                                         where, root)
        for i, j, runner in self._runners:
            nodes = self.graph.exec[i:j + 1]
            runner.narrow([module.get_submodule(n.target) for n in nodes if n.op == "call_module"],
                          [module] + [module.get_submodule(n.target.rpartition(".")[0])
                                      for n in nodes if n.op == "get_attr"])
        self._build()
        functools.update_wrapper(self, type(module).forward.__get__(module))

    def _build(self) -> None:
        self._program = self.graph.program(
            self.module, [(i, j, rr.run) for i, j, rr in self._runners])

    def __deepcopy__(self, memo: dict[int, Any]) -> StagedForward:
        new = StagedForward.__new__(StagedForward)
        new.__dict__.update(self.__dict__)
        new.module = memo.get(id(self.module), self.module)
        new._runners = [(i, j, r.remap(memo)) for i, j, r in self._runners]
        new._build()
        new.__wrapped__ = type(new.module).forward.__get__(new.module)
        return new

    def __getstate__(self) -> dict[str, Any]:
        # Pickling the model (`torch.save(model)`): the trace and the code generated from it
        # are made again from the module on the first call after loading, as `__init__` made
        # them (the module may not be whole yet while its attributes are unpickled).
        state = dict(self.__dict__)
        state["graph"] = state["_program"] = None
        return state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.graph is None:
            self.graph = trace(self.module, Pattern.from_json(
                json.loads(self.region.staged)["pattern"]))
            if self.graph is None or self.graph.fingerprint != json.loads(
                    self.region.staged)["fingerprint"]:
                raise ScheduleError(
                    f"the schedule cuts inside the forward of module {self.region.module!r}, "
                    "whose code no longer traces as it did when planned (loaded with other "
                    "code?); call planner.remove(model) and re-plan")
            self._build()
        if not torch.is_grad_enabled() or not self.graph.matches(self.module, args, kwargs):
            return type(self.module).forward(self.module, *args, **kwargs)
        return self._program(*args, **kwargs)


def _segment_runners(regions: list[Region], n: int, least: int, of: str, where: str,
                     root: torch.nn.Module) -> list[tuple[int, int, _RegionRunner]]:
    """(first position, last position, runner) of each segment region, checked to lie within
    `n` items (`of`: children, traced nodes), to span at least `least` of them, and to nest in
    or be disjoint from each other (a segment inside another is a nested checkpoint)."""
    spans = sorted((r.segment for r in regions), key=lambda ij: (ij[0], -ij[1]))
    open_: list[tuple[int, int]] = []
    for i, j in spans:
        while open_ and open_[-1][1] < i:
            open_.pop()
        if not (0 <= i and i + least - 1 <= j < n) or (
                open_ and (j > open_[-1][1] or (i, j) == open_[-1])):
            raise ScheduleError(
                f"segments {[r.segment for r in regions]} of {where} overlap or are out of range "
                f"for its {n} {of}: the schedule was made for another model; re-plan")
        open_.append((i, j))
    return [(*r.segment, _RegionRunner(r, root)) for r in regions]


def _run_children(children: list[torch.nn.Module], items: tuple, input: Any) -> Any:
    """The children in `items` (`planner.stages.nest`'s tree) in order, each segment under its
    runner."""
    for item in items:
        if isinstance(item, int):
            input = children[item](input)
        else:
            (_, _, runner), inner = item
            input = runner.run(functools.partial(_run_children, children, inner), input)
    return input


def applied(model: torch.nn.Module) -> AppliedPlan | None:
    """The plan applied to `model` by `apply_schedule`, or None."""
    return model.__dict__.get(_ATTR)


def apply_schedule(model: torch.nn.Module, schedule: Schedule) -> torch.nn.Module:
    """Wrap each region's module of `schedule` in place; returns `model` itself.

    Raises ScheduleError for a region that is not a module call (a node range of a traced
    profile, or a baseline segment spanning several modules), for a module path the model does
    not have, and when a plan is already applied (call `remove` first)."""
    if applied(model) is not None:
        raise CkptPlannerError(
            "a plan is already applied to this model; call planner.remove(model) before "
            "applying another"
        )
    targets: dict[str, tuple[torch.nn.Module, list[Region]]] = {}
    for k, r in enumerate(schedule.regions):
        if r.module is None:
            raise ScheduleError(
                f"region {k} ({r.start}..{r.end}) is not a module call, so it cannot be applied to "
                f"the model in place (schedule method {schedule.method!r}); plan from a profile "
                "recorded by planner.profile, with a method whose regions are module calls"
            )
        try:
            module = model.get_submodule(r.module) if r.module else model
        except AttributeError:
            raise ScheduleError(
                f"region {k} wraps module {r.module!r}, which this model does not have: the "
                "schedule was made for another model; re-plan"
            ) from None
        if r.segment is not None and not r.staged \
                and not isinstance(module, torch.nn.Sequential):
            raise ScheduleError(f"region {k} is a segment of {r.module!r}, which is a "
                                f"{type(module).__name__}, not an nn.Sequential")
        if r.module in targets:
            others = targets[r.module][1]
            whole = r.segment is None and all(o.segment is None for o in others)
            if whole and all(o.save_ops == r.save_ops and (o.start, o.end) != (r.start, r.end)
                             for o in others):
                others.append(r)  # the calls of a module called more than once: one wrapper
            elif r.segment is None or any(o.segment is None for o in others):
                raise ScheduleError(
                    f"module {r.module!r} is the region of two regions of the schedule")
            else:
                others.append(r)
        else:
            targets[r.module] = (module, [r])
    # Every wrapper is made before any is set: a schedule that cannot be applied (a region
    # that does not trace as planned) leaves the model as it was.
    wrapped: dict[str, CheckpointedForward | SegmentedForward | StagedForward] = {}
    for path, (module, regions) in targets.items():
        previous = module.__dict__.get("forward")
        if wrapper_of(module) is not None:
            raise CkptPlannerError(f"module {path!r} is already checkpointed by ckpt-planner")
        if regions[0].segment is not None:
            if previous is not None:
                raise CkptPlannerError(
                    f"module {path!r} has a forward of its own set on the instance; its children "
                    "cannot be checkpointed as segments"
                )
            wrapper: CheckpointedForward | SegmentedForward | StagedForward = (
                StagedForward(module, regions, model) if regions[0].staged
                else SegmentedForward(module, regions, model))
        else:
            # One region per call of the module (several where it is called more than once):
            # the wrapper checkpoints every call, with the RNG and buffers any of them needs.
            r = dataclasses.replace(
                regions[0], preserve_rng=any(x.preserve_rng for x in regions),
                buffers=tuple(sorted({b for x in regions for b in x.buffers})),
                restores=tuple(sorted({b for x in regions for b in x.restores})))
            wrapper = CheckpointedForward(module, r, model, previous)
        wrapped[path] = wrapper
    for path, wrapper in wrapped.items():
        module = targets[path][0]
        # A submodule gets the wrapper's bound `__call__`: dynamo guards a forward set on an
        # instance by the code of a method's function, by identity otherwise, so with the
        # object itself every block compiled per block (`block.compile()`) would compile a
        # graph of its own and a model of more blocks than dynamo's cache holds would fail
        # under fullgraph=True. The root keeps the object, whose `__wrapped__` shows the
        # model's signature (HF's Trainer reads it).
        module.__dict__["forward"] = wrapper if module is model else wrapper.__call__
    plan = AppliedPlan(schedule=schedule, wrapped=wrapped)
    largest = max(model.parameters(), key=lambda p: p.numel(), default=None)
    if largest is not None:
        plan.largest = weakref.ref(largest)
        plan.largest_was = largest.dtype
    plan.hook = model.register_forward_pre_hook(_warn_if_changed, with_kwargs=True)
    plan.end_hook = model.register_forward_hook(_forward_done)
    model.__dict__[_ATTR] = plan
    _watch(model, plan)
    if schedule.regions:
        _let_dynamo_trace_regions()
    return model


def wrapper_of(module: torch.nn.Module) -> CheckpointedForward | SegmentedForward | \
        StagedForward | None:
    """The ckpt-planner wrapper set as `module`'s forward (the object, or its bound `__call__`),
    or None."""
    fwd = module.__dict__.get("forward")
    if isinstance(fwd, types.MethodType):
        fwd = fwd.__self__
    return fwd if isinstance(fwd, CheckpointedForward | SegmentedForward | StagedForward) \
        else None


def _let_dynamo_trace_regions() -> None:
    """Let dynamo trace a region whose forward changes Python state outside it.

    Dynamo refuses to trace a checkpoint whose forward mutates a Python object from outside its
    scope, because eager recomputation would replay that mutation, and breaks the graph there,
    recompiling on every step. Hugging Face layers do this wherever the `kernels` package is
    installed (transformers 5.25 requires it): its hub-kernel layers set a context variable's
    global in forward. A compiled region's recomputation is the partitioner's, inside the
    backward graph, which replays no Python at all; so the mutation happening once, in forward,
    is what compiled regions do anyway, and dynamo's switch for that
    (``skip_fwd_side_effects_in_bwd_under_checkpoint``) is turned on once a plan has regions.
    Eager steps are unaffected."""
    import torch._dynamo.config as dc

    if hasattr(dc, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        dc.skip_fwd_side_effects_in_bwd_under_checkpoint = True


# -- noticing a model that changed after planning --------------------------------------------------
# Global registration hooks see every module, parameter or buffer assigned anywhere; a weak map
# from each planned model's modules to their plan finds the ones that matter in O(1).
class _ByIdentity:
    """A weak map keyed by object identity. `weakref.WeakKeyDictionary` compares keys with
    ``==``, which a module may define elementwise: tensordict's `TensorDictParams` (the module
    torchrl's losses keep their networks' parameters in) returns a TensorDict that refuses
    ``bool()``, and removing a plan from such a model raised."""

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref, Any]] = {}

    def __setitem__(self, key: Any, value: Any) -> None:
        k, d = id(key), self._d

        def gone(r: weakref.ref, k: int = k) -> None:
            if k in d and d[k][0] is r:
                del d[k]

        d[k] = (weakref.ref(key, gone), value)

    def get(self, key: Any) -> Any:
        e = self._d.get(id(key))
        return e[1] if e is not None and e[0]() is key else None

    def pop(self, key: Any) -> None:
        if self.get(key) is not None:
            del self._d[id(key)]


_MEMBERS = _ByIdentity()
"""Each planned model's modules: (a weak reference to its plan, the module's path)."""
_HOOKS: list[Any] = []


def _watch(model: torch.nn.Module, plan: AppliedPlan) -> None:
    ref = weakref.ref(plan)
    for path, m in model.named_modules():
        _MEMBERS[m] = (ref, path)
    if not _HOOKS:
        mm = torch.nn.modules.module
        _HOOKS.append(mm.register_module_module_registration_hook(_on_module))
        _HOOKS.append(mm.register_module_parameter_registration_hook(_on_tensor))
        _HOOKS.append(mm.register_module_buffer_registration_hook(_on_tensor))


def _unwatch(model: torch.nn.Module) -> None:
    for m in model.modules():
        _MEMBERS.pop(m)


def _changed(owner: torch.nn.Module, name: str, what: str) -> None:
    if torch.compiler.is_compiling():
        # Under torch.compile a model that sets attributes in forward (a rotary embedding's
        # buffers) would have dynamo guard on this weak map, whose size changes as modules die:
        # the guard fails inside its own frame. Changes made while compiling go unnoticed.
        return
    entry = _MEMBERS.get(owner)
    plan = entry[0]() if entry is not None else None
    if plan is not None and not plan.changed:
        path = entry[1]
        plan.changed = f"{what} {path + '.' if path else ''}{name}"


def _on_module(module: torch.nn.Module, name: str, submodule: Any) -> None:
    """Called before `module.name = submodule` takes effect."""
    if module._modules.get(name) is not submodule:
        _changed(module, name, "module")


def _on_tensor(module: torch.nn.Module, name: str, value: Any) -> None:
    """Called before a parameter or buffer is assigned: a new one, or one of another shape or
    dtype, changes what the plan was made for (a reloaded weight of the same shape does not)."""
    old = module._parameters.get(name)
    if old is None:
        old = module._buffers.get(name)
    if old is None or not isinstance(value, torch.Tensor) or old.shape != value.shape \
            or old.dtype != value.dtype:
        _changed(module, name, "tensor")


def _warn_if_changed(model: torch.nn.Module, args: Any, kwargs: Any) -> None:
    """At each training step: warn once if the model changed since planning, or if the batch is
    larger in some dimension than the example the plan was made for."""
    if torch.compiler.is_compiling():  # no guards on the plan's flags; eager steps warn
        return
    plan = applied(model)
    if plan is None or plan.warned or not torch.is_grad_enabled():
        return
    if plan.changed:
        plan.warned = True
        warnings.warn(PlanOutdatedWarning(
            f"the model changed after planning ({plan.changed} was replaced or added): it "
            "trains correctly, but the plan's peak memory prediction no longer holds; re-plan "
            "(planner.plan(model, ...)) for the model as it is now"), stacklevel=2)
        return
    if plan.largest is None and plan.largest_was is not None:
        plan.largest = weakref.ref(max(model.parameters(), key=lambda p: p.numel()))
    largest = plan.largest() if plan.largest is not None else None
    if largest is not None and largest.dtype != plan.largest_was and str(largest.dtype) != \
            "torch." + plan.schedule.made_for.get("fsdp_param_dtype", "-"):  # FSDP2's casts
        plan.warned = True
        warnings.warn(PlanOutdatedWarning(
            f"the model's parameters were converted to {largest.dtype} after planning (planned "
            f"in {plan.largest_was}): it trains correctly, but the plan's peak memory "
            "prediction no longer holds; re-plan (planner.plan(model, ...)) after converting "
            "the model"), stacklevel=2)
        return
    if plan.flags is None:
        plan.flags = [(path, weakref.ref(m), flag) for path, m in model.named_modules()
                      for flag in _CHECKPOINT_FLAGS if isinstance(getattr(m, flag, None), bool)]
    on, flag = next(((path, flag) for path, ref, flag in plan.flags
                     if getattr(ref(), flag, False) is True), (None, None))
    if on is not None and flag == "grad_checkpointing":
        plan.warned = True
        warnings.warn(PlanOutdatedWarning(
            f"timm's grad checkpointing was turned on after planning (module {on or '(root)'}; "
            "model.set_grad_checkpointing() and timm's train.py --grad-checkpointing do this): "
            "its blocks are now checkpointed on top of the plan. It trains correctly, but "
            "recomputes what the plan keeps and the plan's predictions no longer hold; turn it "
            "off (model.set_grad_checkpointing(False)): the plan places the checkpoints"),
            stacklevel=2)
        return
    if on is not None:
        plan.warned = True
        warnings.warn(PlanOutdatedWarning(
            f"HF gradient checkpointing was turned on after planning (module "
            f"{on or '(root)'}; TrainingArguments(gradient_checkpointing=True) and "
            "model.gradient_checkpointing_enable() do this): every layer is now checkpointed on "
            "top of the plan. It trains correctly, but recomputes what the plan keeps and the "
            "plan's predictions no longer hold; turn it off (gradient_checkpointing=False, or "
            "model.gradient_checkpointing_disable()): the plan places the checkpoints"),
            stacklevel=2)
        return
    if "fsdp_param_dtype" in plan.schedule.made_for and (
            _fsdp_mismatch(model, plan) or _fsdp_sync_off(model, plan)):
        return
    if "autocast" in plan.schedule.made_for:
        global _AUTOCAST_DUE
        _AUTOCAST_DUE = plan  # checked by the step's first region, inside forward, where an
        # autocast a wrapper enters (accelerate's, HF Trainer's bf16=True) is already on
    if plan.schedule.made_for.get("input_shapes"):
        from planner.identity import larger_inputs

        shapes = {path: list(leaf.shape) for path, leaf in input_leaves((args, kwargs))}
        larger = larger_inputs(plan.schedule.made_for, shapes)
        if larger:
            plan.warned = True
            warnings.warn(PlanOutdatedWarning(
                f"this batch is larger than the one the plan was made for: {', '.join(larger)}; "
                "the budget holds for batches no larger than the example: re-plan with the "
                "largest batch you train with"), stacklevel=2)


def _fsdp_mismatch(model: torch.nn.Module, plan: AppliedPlan) -> bool:
    """Warn (once) and say so if `fully_shard` sharded the model with another mixed precision
    than the plan was made for (`plan(..., fsdp=True, mp_policy=...)`): its activations are then
    of another size than planned."""
    state = getattr(model, "_get_fsdp_state", None)
    policy = getattr(state(), "_mp_policy", None) if callable(state) else None
    if policy is None:  # not sharded (yet), or an FSDP2 that keeps its policy elsewhere
        return False
    own = plan.largest_was
    if own is None:
        return False
    d = policy.param_dtype
    now = "" if d is None or d == own else str(d).removeprefix("torch.")
    was = plan.schedule.made_for["fsdp_param_dtype"]
    planned_dtype = getattr(torch, was, None) if was else own
    if not isinstance(planned_dtype, torch.dtype) or (d or own).itemsize == planned_dtype.itemsize:
        return False  # the same activation sizes (or a schedule file naming no torch dtype)
    plan.warned = True
    planned = f"MixedPrecisionPolicy(param_dtype=torch.{was})" if was else "no mixed precision"
    sharded = f"MixedPrecisionPolicy(param_dtype=torch.{now})" if now else "no mixed precision"
    smaller = (d or own).itemsize < planned_dtype.itemsize
    warnings.warn(PlanOutdatedWarning(
        f"the model was sharded by fully_shard with {sharded}, and the plan was made for "
        f"{planned}: its activations are {'smaller' if smaller else 'larger'} than planned "
        "for, so " + ("it recomputes more than it needs to" if smaller else
                      "the step's peak can pass the budget")
        + "; plan with planner.plan(model, ..., fsdp=True, mp_policy=<the policy you pass "
        "fully_shard>) before sharding"), stacklevel=3)
    return True


def _fsdp_sync_off(model: torch.nn.Module, plan: AppliedPlan) -> bool:
    """Warn (once) and say so if FSDP2's gradient sync is off for this step
    (``set_requires_gradient_sync(False)``, between micro-batches): FSDP2 then keeps every
    layer's unsharded gradients until a step that syncs, which the plan does not count."""
    if plan.fsdp_groups is None:
        if not callable(getattr(model, "_get_fsdp_state", None)):
            return False  # not sharded (yet)
        plan.fsdp_groups = [g for m in model.modules() if callable(getattr(
            m, "_get_fsdp_state", None)) for g in getattr(m._get_fsdp_state(),
                                                          "_fsdp_param_groups", ())]
    if all(getattr(g, "reduce_grads", True) for g in plan.fsdp_groups):
        return False
    plan.warned = True
    warnings.warn(PlanOutdatedWarning(
        "FSDP2's gradient sync is off for this step (set_requires_gradient_sync(False)): FSDP2 "
        "keeps every layer's unsharded gradients until a step that syncs, which the plan does "
        "not count, so the step's peak can pass the budget. Keep gradient sync on for every "
        "micro-batch (FSDP2's default; plan with grad_accumulation=True), or lower the budget "
        "by the unsharded gradients' size"), stacklevel=3)
    return True


_AUTOCAST_DUE: AppliedPlan | None = None
"""The plan whose step began (its root's forward pre-hook ran) and whose autocast the step's
first region has yet to compare with the one it was planned under (`_check_autocast`)."""


def _forward_done(model: torch.nn.Module, *_: Any) -> None:
    """The root's forward returned: a check its regions did not make is not left for another
    model's."""
    global _AUTOCAST_DUE
    if not torch.compiler.is_compiling() and _AUTOCAST_DUE is not None \
            and _AUTOCAST_DUE is model.__dict__.get(_ATTR):
        _AUTOCAST_DUE = None


def _check_autocast(args: tuple[Any, ...]) -> None:
    """Warn once if this step's autocast is not the one the plan was made for: activations of
    another size than planned (smaller, so the plan recomputes more than needed, or larger, so
    the peak can pass the budget)."""
    global _AUTOCAST_DUE
    plan, _AUTOCAST_DUE = _AUTOCAST_DUE, None
    if plan is None or plan.warned:
        return
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    try:
        now = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    except RuntimeError:  # a device type autocast does not know (meta): nothing to compare
        return
    was = plan.schedule.made_for.get("autocast") or ""
    planned = getattr(torch, was, None) if was else None
    if was and not isinstance(planned, torch.dtype):
        return  # a schedule file naming no dtype torch has: nothing to compare with
    if (now and now.itemsize) == (planned and planned.itemsize):
        return
    plan.warned = True
    if planned is None:
        what = (f"this step runs under torch.autocast({now}), and the plan was made for steps "
                "without autocast: it trains correctly, but its activations are smaller than "
                "planned for, so it recomputes more than it needs to; re-plan under the same "
                f"autocast: planner.plan(model, ..., autocast={now}) (HF Trainer's bf16=True "
                "and accelerate's mixed precision run forward under autocast)")
    elif now is None:
        what = (f"this step runs without torch.autocast, and the plan was made for steps under "
                f"torch.autocast({planned}): its activations are larger than planned for, so "
                "the step's peak can pass the budget; run forward under torch.autocast("
                f"{device!r}, dtype={planned}), or re-plan without autocast")
    else:
        what = (f"this step runs under torch.autocast({now}), and the plan was made under "
                f"torch.autocast({planned}): the plan's peak memory prediction no longer holds; "
                f"re-plan with planner.plan(model, ..., autocast={now})")
    warnings.warn(PlanOutdatedWarning(what), stacklevel=3)


@contextlib.contextmanager
def applying(model: torch.nn.Module, schedule: Schedule) -> Iterator[torch.nn.Module]:
    """Apply `schedule` for the duration of a block (measuring one plan among several)."""
    apply_schedule(model, schedule)
    try:
        yield model
    finally:
        remove(model)


def remove(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `apply_schedule`: every wrapped module gets its previous `forward` back. A model with
    no plan applied is returned unchanged."""
    plan = model.__dict__.pop(_ATTR, None)
    if plan is None:
        return model
    for hook in (plan.hook, plan.end_hook):
        if hook is not None:
            hook.remove()
    global _AUTOCAST_DUE
    if _AUTOCAST_DUE is plan:
        _AUTOCAST_DUE = None
    _unwatch(model)
    for wrapper in plan.wrapped.values():
        module = wrapper.module
        if wrapper_of(module) is wrapper:
            if wrapper.previous is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = wrapper.previous
    return model
