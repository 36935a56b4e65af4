"""Regions that start and end inside one module's `forward`: its code as a list of stages.

A region applied in place is a module call; the lowest peak such regions reach is set by the
largest call no smaller call splits (an attention that computes its scores, softmax and dropout
inline; a U-Net whose skip concatenations sit in the root's forward). To cut inside such a call,
its `forward` is traced with `torch.fx` symbolic tracing (Python-level, so it does not depend on
input shapes), every child module kept as one call. A region is then a run of consecutive nodes;
a planned module runs the traced code as generated Python (`StagedGraph.program`, which
`torch.compile` traces like any code), each run under checkpoint with the values it reads as
arguments and the values later nodes read as results.

Tracing only succeeds for code without branches on tensors or iteration over tensors; where it
fails the module simply has no stages. What tracing fixes at trace time is made explicit and
checked at every call (`Pattern`): which arguments are tensors, the values of the others (the
elements of a tuple, the keyword arguments a ``**kwargs`` parameter takes), and the module's
training flag. A call that differs runs the module's own `forward` (correct, without the inner
regions). A forward with ``**kwargs``, a tuple argument or a decorator that leaves it as it is
(every Hugging Face decoder layer of transformers 5 has all three) is traced through a wrapper
that takes one parameter per tensor or value the call passes and calls the forward as the call
did (`_slots`). The recorded step always runs the model's own
code; the stages are found by a second, light run through the interpreter whose op sequence
must equal the recorded one (`planner.capture.record`), so a trace that does not reproduce the
model's ops gives no stages.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import keyword
import operator
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

__all__ = ["Pattern", "StagedGraph", "call_pattern", "nest", "stageable", "trace"]

_TENSOR = "<tensor>"


def stageable(module: torch.nn.Module) -> bool:
    """Modules worth tracing: the user's and libraries' own (not `torch.nn`'s building blocks,
    whose forward is one op or a library call), with an undecorated forward of the class (no
    `forward` set on the instance)."""
    fwd = type(module).forward
    # `__module__` is None for code run by exec() without a `__name__`
    return (not (getattr(fwd, "__module__", None) or "").startswith("torch.")
            # a decorator (no_grad, autocast) changes what runs in ways tracing does not see;
            # one that only renames keyword arguments is traced through
            and (not hasattr(fwd, "__wrapped__") or _transparent(fwd))
            # a forward that checkpoints itself in Python (HF's gradient checkpointing, on)
            and getattr(module, "gradient_checkpointing", False) is not True
            and "forward" not in module.__dict__
            and not isinstance(module, torch.nn.Sequential))


_TRANSPARENT_DECORATORS = frozenset({"transformers.utils.deprecation",
                                     "transformers.modeling_layers"})
"""Modules whose decorators run the forward as it is: transformers' `deprecate_kwarg` renames
keyword arguments, and `GradientCheckpointingLayer` wraps every Hugging Face decoder layer's
forward in one that checkpoints it while the layer's `gradient_checkpointing` is on (then the
module is not staged) and else calls it."""


def _transparent(fwd: Callable[..., Any]) -> bool:
    while hasattr(fwd, "__wrapped__"):
        # `functools.wraps` copies `__module__`; the wrapper's globals are its own module's
        if getattr(fwd, "__globals__", {}).get("__name__") not in _TRANSPARENT_DECORATORS:
            return False
        fwd = fwd.__wrapped__
    return True


@dataclass(frozen=True)
class Pattern:
    """What a trace fixed: each parameter of `forward` that was passed, as ``<tensor>`` or its
    (JSON) value, and the module's training flag."""

    args: tuple[tuple[str, Any], ...]
    """(parameter, value): ``<tensor>``, a JSON scalar, for a tuple ``("<tuple>", value, ...)``
    and for the keyword arguments a ``**kwargs`` parameter takes
    ``("<kwargs>", (name, value), ...)`` (only where some are passed)."""
    training: bool

    def to_json(self) -> str:
        return json.dumps({"args": [list(a) for a in self.args], "training": self.training},
                          sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> Pattern:
        d = json.loads(s)
        return cls(tuple((k, _frozen(v)) for k, v in d["args"]), bool(d["training"]))


def _frozen(v: Any) -> Any:
    """JSON arrays back to the tuples `call_pattern` makes."""
    return tuple(_frozen(x) for x in v) if isinstance(v, list) else v


def _signature(module: torch.nn.Module) -> inspect.Signature | None:
    return _forward_signature(type(module).forward)


@functools.cache
def _forward_signature(forward: Callable[..., Any]) -> inspect.Signature | None:
    """The parameters of a class's `forward` without `self` (computed once per function: every
    call of a planned module checks its arguments against them; a decorator's wrapper is seen
    through); None with `*args`. A ``**kwargs`` parameter stays: what a call passes through it
    is part of the call's `Pattern`."""
    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())[1:]  # drop self
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sig.replace(parameters=params)


def _marker(v: Any) -> Any:
    """A value's entry in a `Pattern` (tensors as ``<tensor>``), or `_NO` where a call with it
    cannot be staged."""
    if isinstance(v, torch.Tensor):
        return _TENSOR
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return _NO


_NO = object()
_TUPLE, _KWARGS = "<tuple>", "<kwargs>"


def call_pattern(module: torch.nn.Module, args: tuple, kwargs: dict,
                 sig: inspect.Signature | None = None) -> Pattern | None:
    """The pattern of one call: None where an argument is neither a tensor nor a JSON scalar
    (a cache object, a list of tensors), so the call cannot be staged. `sig`: the forward's
    signature where the caller holds it (planned calls, under torch.compile too)."""
    sig = sig if sig is not None else _signature(module)
    if sig is None:
        return None
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return None
    out: list[tuple[str, Any]] = []
    for name, v in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD:
            # what the forward passes on (an HF layer's **kwargs to its attention)
            entry: Any = (_KWARGS, *((k, _marker(x)) for k, x in v.items()))
            if any(m is _NO for _, m in entry[1:]):
                return None
        elif type(v) is tuple:
            # (cos, sin): the rotary embeddings HF models pass to every layer
            entry = (_TUPLE, *(_marker(x) for x in v))
            if any(m is _NO for m in entry[1:]):
                return None
        else:
            entry = _marker(v)
            if entry is _NO:
                return None
        out.append((name, entry))
    return Pattern(tuple(out), bool(module.training))


class _Proxy(fx.Proxy):
    """A traced value that notes each attribute the forward sets on it (x-transformers sets
    ``intermediates.logits = ...`` on the object its layers return): the graph records no such
    write, so the generated code would return the object without it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in ("tracer", "node"):
            self.tracer.value_sets.append(name)
        object.__setattr__(self, name, value)


class _Tracer(fx.Tracer):
    """Every submodule is one call; buffers (and parameters that are plain tensors) are read
    through the graph (so slicing a causal mask by a traced length works)."""

    def __init__(self) -> None:
        super().__init__()
        self.value_sets: list[str] = []
        """Attributes the forward set on traced values (`_Proxy`)."""

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return True

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if isinstance(attr_val, torch.Tensor) and not isinstance(attr_val, torch.nn.Parameter):
            # a buffer, or a parameter swapped for a plain tensor (estimate mode's fakes)
            for name, b in (*self.root.named_buffers(), *self.root.named_parameters()):
                if b is attr_val:
                    return self.create_proxy("get_attr", name, (), {})
        return super().getattr(attr, attr_val, parameter_proxy_cache)


_EXEC = ("call_module", "call_function", "call_method", "get_attr")
_META_ATTRS = frozenset({"dtype", "device", "shape", "ndim", "layout", "is_cuda", "is_sparse",
                         "is_quantized", "is_meta", "requires_grad"})
_META_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "element_size",
                           "is_floating_point", "is_complex", "get_device"})


def _is_meta(node: fx.Node) -> bool:
    """A node that reads a tensor's metadata (``x.dtype``, ``x.size(-1)``): no op runs, and it
    holds no tensor. Symbolic tracing records an attribute read where it is first used, which
    may be many nodes after the tensor's last use (a norm's ``dt = x.dtype`` read by its final
    ``.to(dt)``)."""
    if node.op == "call_function":
        return node.target is getattr and len(node.args) == 2 and node.args[1] in _META_ATTRS
    return node.op == "call_method" and node.target in _META_METHODS


class StagedGraph:
    """A module's traced `forward` for one `Pattern`: an interpreter that runs it node by node
    (to find where each node's ops start), and `program`, the same code as generated Python with
    runs of nodes under a region runner (what a plan runs)."""

    def __init__(self, pattern: Pattern, graph: fx.Graph, signature: inspect.Signature,
                 wrapped: bool = False):
        self.pattern = pattern
        self.graph = graph
        self.signature = signature  # of the traced forward, held (not looked up per call)
        self.wrapped = wrapped
        """Traced through a wrapper (`_slots`): placeholders are the call's flat arguments."""
        nodes = list(graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.exec = [n for n in nodes if n.op in _EXEC]
        self.output = next(n for n in nodes if n.op == "output")
        # last exec position reading each node (len(exec) for the output)
        self.last_use: dict[fx.Node, int] = {}
        for k, n in enumerate(self.exec):
            for a in n.all_input_nodes:
                self.last_use[a] = k
        for a in self.output.all_input_nodes:
            self.last_use[a] = len(self.exec)
        self.frees: list[list[fx.Node]] = [[] for _ in self.exec]
        for n, k in self.last_use.items():
            if k < len(self.exec):
                self.frees[k].append(n)
        self.fingerprint = hashlib.sha1(
            "\n".join(f"{n.op} {_target(n.target)} {len(n.args)}" for n in nodes).encode()
        ).hexdigest()[:16]
        self._io: dict[tuple[int, int], tuple[list[fx.Node], list[fx.Node]]] = {}

    def matches(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
        return call_pattern(module, args, kwargs, self.signature) == self.pattern

    def _bind(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[fx.Node, Any]:
        return dict(zip(self.placeholders, self.values(args, kwargs), strict=True))

    def values(self, args: tuple, kwargs: dict) -> list[Any]:
        """The placeholders' values for a call that `matches` (or for a mirror of its
        arguments, `planner.capture.record.ModuleCall.mirror`)."""
        bound = self.signature.bind(*args, **kwargs)
        if not self.wrapped:
            bound.apply_defaults()
            return list(bound.arguments.values())
        out: list[Any] = []
        for name, v in self.pattern.args:
            given = bound.arguments[name]
            if type(v) is tuple and v[0] == _KWARGS:
                out.extend(given[k] for k, _ in v[1:])
            elif type(v) is tuple and v[0] == _TUPLE:
                out.extend(given)
            else:
                out.append(given)
        return out

    def hoisted(self, i: int, j: int) -> list[fx.Node]:
        """Metadata reads (`_is_meta`) among nodes i..j of values made before i: run before the
        segment, in the code around it, so that the segment is passed the dtype or shape, not
        the tensor. A checkpoint holds its tensor arguments until its backward, and the model
        (as the planner's cost model) holds no tensor for a metadata read. Only reads of values
        no other node of the segment reads: those are arguments anyway, and one of those nodes
        could change the metadata in place (``x.unsqueeze_(0)``)."""
        made_before = set(self.placeholders) | set(self.exec[:i])
        seg = self.exec[i:j + 1]
        read = {a for n in seg if not _is_meta(n) for a in n.all_input_nodes}
        return [n for n in seg if _is_meta(n) and all(
            a in made_before and a not in read for a in n.all_input_nodes)]

    def io(self, i: int, j: int) -> tuple[list[fx.Node], list[fx.Node]]:
        """Nodes made before exec position i, or hoisted out of the segment (`hoisted`), that
        nodes i..j read (the segment's arguments), and nodes made in i..j that later nodes or
        the output read (its results)."""
        key = (i, j)
        if key not in self._io:
            hoisted = set(self.hoisted(i, j))
            inside = set(self.exec[i:j + 1]) - hoisted
            ins: dict[fx.Node, None] = {}
            for n in self.exec[i:j + 1]:
                if n in hoisted:
                    continue
                for a in n.all_input_nodes:
                    if a not in inside:
                        ins[a] = None
            outs = [n for n in self.exec[i:j + 1]
                    if n not in hoisted and self.last_use.get(n, -1) > j]
            self._io[key] = (list(ins), outs)
        return self._io[key]

    def run(self, module: torch.nn.Module, args: tuple, kwargs: dict, *,
            on_node: Callable[[int], None] | None = None,
            on_result: Callable[[int, Any], None] | None = None) -> Any:
        """Run the forward node by node (the stage run of `planner.capture.record`), calling
        `on_node(k)` before exec node k runs and `on_result(k, value)` after."""
        env = self._bind(module, args, kwargs)
        for k, node in enumerate(self.exec):
            if on_node is not None:
                on_node(k)
            env[node] = _execute(node, env, module)
            if on_result is not None:
                on_result(k, env[node])
            for a in self.frees[k]:
                env.pop(a, None)
        return fx.node.map_arg(self.output.args[0], lambda a: env[a])


    def program(self, module: torch.nn.Module,
                segments: list[tuple[int, int, Callable]]) -> Callable[..., Any]:
        """The forward as generated Python (`torch.fx` code generation), each segment (first and
        last exec position, runner) a call of ``runner(segment_fn, *arguments)``: plain code that
        `torch.compile` traces (an interpreter over fx nodes it would not). Segments either nest
        or are disjoint; a segment inside another is called from the outer one's code, so its
        checkpoint runs inside the outer one's (and inside its replay). Takes the forward's
        arguments bound in signature order; reads submodules and attributes from `module` at
        every call."""
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for p in self.placeholders:
            env[p] = g.placeholder(p.name)
        self._emit(g, env, nest(0, len(self.exec) - 1, list(segments)), module)
        g.output(fx.node.map_arg(self.output.args[0], lambda a: env[a]))
        fn = _compile(g, module)
        values = self.values

        def forward(*args: Any, **kwargs: Any) -> Any:
            return fn(*values(args, kwargs))

        return forward

    def _emit(self, g: fx.Graph, env: dict[fx.Node, fx.Node], items: tuple,
              module: torch.nn.Module, skip: frozenset[fx.Node] = frozenset()) -> None:
        """Exec nodes of `items` (`nest`'s tree) into `g`, each segment as one call. `skip`:
        inside a segment, the nodes hoisted out of it that it does not read (the code around
        it made them; those it reads are its arguments, in `env`)."""
        for item in items:
            if isinstance(item, int):
                if self.exec[item] not in env and self.exec[item] not in skip:
                    env[self.exec[item]] = g.node_copy(self.exec[item], lambda a: env[a])
                continue
            (i, j, runner), inner = item
            for n in self.hoisted(i, j):
                if n not in env and n not in skip:
                    env[n] = g.node_copy(n, lambda a: env[a])
            ins, outs = self.io(i, j)
            call = g.call_function(
                _segment_call(self._segment_code(module, i, j, inner), runner, i, j),
                tuple(env[a] for a in ins))
            for idx, o in enumerate(outs):
                env[o] = g.call_function(operator.getitem, (call, idx))

    def _segment_code(self, module: torch.nn.Module, i: int, j: int,
                      inner: tuple) -> Callable[..., Any]:
        ins, outs = self.io(i, j)
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {a: g.placeholder(a.name) for a in ins}
        self._emit(g, env, inner, module, frozenset(self.hoisted(i, j)))
        g.output(tuple(env[o] for o in outs))
        return _compile(g, module)


def nest(lo: int, hi: int, segments: list[tuple[int, int, Any]]) -> tuple:
    """Positions lo..hi as a tree: a position in no segment among `segments` (each (first,
    last, payload), all inside lo..hi, nested or disjoint) as itself, each outermost segment as
    ((first, last, payload), the tree of its positions)."""
    out: list = []
    k = lo
    while k <= hi:
        starting = [s for s in segments if s[0] == k]
        if not starting:
            out.append(k)
            k += 1
            continue
        i, j, payload = max(starting, key=lambda s: s[1])
        inner = [s for s in segments if i <= s[0] and s[1] <= j and (s[0], s[1]) != (i, j)]
        out.append(((i, j, payload), nest(i, j, inner)))
        k = j + 1
    return tuple(out)


def _compile(g: fx.Graph, module: torch.nn.Module) -> Callable[..., Any]:
    """Python for graph `g`, `self` bound to `module` (live attribute reads, no copies).

    Modules whose graphs print the same source share one code object: dynamo guards the
    function a compiled block calls by its code, so alike blocks compiled one by one
    (`block.compile()`) then share one graph."""
    code = g.python_code(root_module="self")
    scope = dict(code.globals)
    exec(_code_of(code.src, f"<ckpt-planner staged {type(module).__name__}>"), scope)
    return functools.partial(scope["forward"], module)


@functools.cache
def _code_of(src: str, filename: str) -> Any:
    return compile(src, filename, "exec")


def _segment_call(fn: Callable[..., Any], runner: Callable, i: int, j: int
                  ) -> Callable[..., Any]:
    def segment(*args: Any) -> Any:
        if not any(type(a) is tuple for a in args):
            return runner(fn, *args)
        # A tuple among the run's values (``torch.chunk``'s, indexed inside the run) would
        # reach the checkpoint as an object, which its frame keeps by reference with the
        # tensors in it: inside a checkpointed parent, for as long as this run's autograd
        # graph lives, where its tensor arguments are saved to the parent's frame, which drops
        # them. Passed element by element, each tuple is rebuilt inside the run.
        sizes = [len(a) if type(a) is tuple else -1 for a in args]
        flat = [x for a in args for x in (a if type(a) is tuple else (a,))]

        def rebuilt(*given: Any) -> Any:
            out, k = [], 0
            for n in sizes:
                out.append(given[k] if n < 0 else tuple(given[k:k + n]))
                k += 1 if n < 0 else n
            return fn(*out)

        return runner(rebuilt, *flat)

    segment.__name__ = segment.__qualname__ = f"ckpt_segment_{i}_{j}"
    return segment


def _target(t: Any) -> str:
    if isinstance(t, str):
        return t
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', repr(t))}"


def _execute(node: fx.Node, env: dict, module: torch.nn.Module) -> Any:
    args = fx.node.map_arg(node.args, lambda a: env[a])
    kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a])
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, node.target)(*rest, **kwargs)
    if node.op == "call_module":
        return module.get_submodule(node.target)(*args, **kwargs)
    return _resolves(module, node.target)  # get_attr (checked to resolve when traced)


@contextlib.contextmanager
def _attribute_sets(module: torch.nn.Module, sets: list[str]) -> Iterator[None]:
    """Notes in `sets` each attribute set on `module` or a module inside it while the block
    runs (through `torch.nn.Module.__setattr__`)."""
    inside = {id(m): name for name, m in module.named_modules()}
    original = torch.nn.Module.__setattr__

    def noted(self: torch.nn.Module, name: str, value: Any) -> None:
        where = inside.get(id(self))
        if where is not None:
            sets.append(f"{where}.{name}" if where else name)
        original(self, name, value)

    torch.nn.Module.__setattr__ = noted
    try:
        yield
    finally:
        torch.nn.Module.__setattr__ = original


def trace(module: torch.nn.Module, pattern: Pattern) -> StagedGraph | None:
    """The module's forward traced for `pattern`, or None where symbolic tracing fails or the
    forward changes the module (sets an attribute of it or of a module inside it, even to the
    value it holds, makes a tensor constant, or writes into a
    dict, list or set it holds, as a cache filled on first use does): the traced code would not
    make that change when it runs in place of the forward. The module is put back as it was."""
    sig = _signature(module)
    if sig is None:
        return None
    slots = _slots(sig, pattern, type(module).forward)
    if slots is None:
        concrete = {k: v for k, v in pattern.args if v != _TENSOR}
        # parameters not passed keep their defaults: trace them as concrete too
        for name, p in sig.parameters.items():
            if name not in dict(pattern.args):
                if p.default is inspect.Parameter.empty:
                    return None
                if not (p.default is None or isinstance(p.default, bool | int | float | str)):
                    return None
                concrete[name] = p.default
        n_placeholders = len(sig.parameters)
    else:
        if not slots:
            return None  # nothing passed, or arguments no wrapper can take by name
        concrete = {k: v for k, v in slots if v != _TENSOR}
        n_placeholders = len(slots)
    saved = dict(module.__dict__)
    held = {k: c for k, c in ((k, _contents(v)) for k, v in saved.items()) if c is not None}
    # the children's attributes too: the forward may set one (RecurrentGemma's temporal block
    # empties its RG-LRU's state), which tracing does for real, once
    children = [(m, dict(m.__dict__)) for m in module.modules() if m is not module]
    tracer = _Tracer()
    host_rng = host_rng_state()
    cls = type(module)
    sets: list[str] = []
    try:
        module.training = pattern.training  # this module's flag only; children are calls
        if slots is not None:
            module.__class__ = _wrapper_class(cls, sig, pattern, [k for k, _ in slots])
        with torch.no_grad(), _attribute_sets(module, sets):
            graph = tracer.trace(module, concrete_args=concrete or None)
    except Exception:  # noqa: BLE001 - any failure of symbolic tracing means "no stages"
        return None
    finally:
        if type(module) is not cls:
            module.__class__ = cls
        added = set(module.__dict__) - set(saved)
        for k in added:
            del module.__dict__[k]
        rebound = [k for k, v in saved.items() if module.__dict__[k] is not v]
        module.__dict__.update(saved)
        for m, d in children:
            for k in set(m.__dict__) - set(d):
                del m.__dict__[k]
            m.__dict__.update(d)
        written = [k for k, c in held.items() if _put_back(saved[k], c)]
        drew = _drew(host_rng)
    if added or rebound or written or drew or sets or tracer.value_sets:
        # `sets`: the forward sets an attribute of the module or a child (to the value it
        # holds, even), which the generated code would not do; `tracer.value_sets`, one of
        # an object it computed or a call returned
        # `drew`: the forward drew from Python's `random` or numpy's RNG (stochastic depth
        # written in Python): a trace would fix one draw's branches for every call
        return None
    if sum(1 for n in graph.nodes if n.op == "placeholder") != n_placeholders:
        return None  # the trace flattened an argument: calls could not be bound to it
    for n in graph.nodes:
        if n.op == "get_attr" and _resolves(module, n.target) is None:
            return None
        if n.op == "call_function" and n.target in (operator.setitem,):
            return None  # in-place Python writes into arguments
    _read_metadata_only(graph)
    return StagedGraph(pattern, graph, sig, wrapped=slots is not None)


_SHAPED_AS = {"view_as": "view", "expand_as": "expand", "reshape_as": "reshape"}


def _read_metadata_only(graph: fx.Graph) -> None:
    """Rewrite ``x.type_as(y)`` as ``x.to(device=y.device, dtype=y.dtype)`` and ``x.view_as(y)``
    (``expand_as``, ``reshape_as``) as ``x.view(y.size())``, as ATen itself defines them: the
    rewritten nodes read only ``y``'s metadata (`_is_meta`), so a run that ends in Gemma's
    ``.type_as(x)`` or Wan's ``.type_as(control_hidden_states)`` is passed the dtype
    (`StagedGraph.hoisted`), not the tensor, which its checkpoint would hold until its backward
    though none of its ops reads it."""
    for n in list(graph.nodes):
        if (n.op != "call_method" or len(n.args) != 2 or n.kwargs
                or not isinstance(n.args[1], fx.Node)):
            continue
        x, y = n.args
        with graph.inserting_before(n):
            if n.target == "type_as":
                device = graph.call_function(getattr, (y, "device"))
                dtype = graph.call_function(getattr, (y, "dtype"))
                new = graph.call_method("to", (x,), {"device": device, "dtype": dtype})
            elif n.target in _SHAPED_AS:
                new = graph.call_method(_SHAPED_AS[n.target], (x, graph.call_method("size", (y,))))
            else:
                continue
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        graph.erase_node(n)


def _slots(sig: inspect.Signature, pattern: Pattern, forward: Callable[..., Any]
           ) -> list[tuple[str, Any]] | None:
    """Where the forward cannot be traced as it is (a tuple argument, a ``**kwargs``
    parameter, a decorator that renames arguments), the flat parameters of a wrapper traced in
    its place: one per argument the call passes, per tensor of a tuple, per keyword argument
    passed through ``**kwargs``, each (name, ``<tensor>`` or its fixed value); empty where the
    call passes nothing or some name is not a Python identifier (no stages). None where the
    forward is traced as it is."""
    if (not hasattr(forward, "__wrapped__")
            and not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
            and not any(type(v) is tuple for _, v in pattern.args)):
        return None
    out: list[tuple[str, Any]] = []
    for name, v in pattern.args:
        if type(v) is tuple and v[0] == _TUPLE:
            out.extend((f"{name}_{k}", x) for k, x in enumerate(v[1:]))
        elif type(v) is tuple and v[0] == _KWARGS:
            out.extend(v[1:])
        else:
            out.append((name, v))
    names = [k for k, _ in out]
    if len(set(names)) != len(names) or not all(
            k.isidentifier() and not keyword.iskeyword(k) and k not in ("self", "_forward")
            for k in names):
        return []
    return out


def _wrapper_class(cls: type, sig: inspect.Signature, pattern: Pattern, names: list[str]
                   ) -> type:
    """A subclass of `cls` whose `forward` takes the flat parameters `names` (`_slots`) and
    calls `cls.forward` as the call of `pattern` did: what the tracer traces in its place."""
    it = iter(names)
    call: list[str] = []
    for name, v in pattern.args:
        kind = sig.parameters[name].kind
        if type(v) is tuple and v[0] == _KWARGS:
            call.extend(f"{k}={next(it)}" for k, _ in v[1:])
            continue
        if type(v) is tuple and v[0] == _TUPLE:
            value = "(" + "".join(f"{next(it)}, " for _ in v[1:]) + ")"
        else:
            value = next(it)
        call.append(value if kind == inspect.Parameter.POSITIONAL_ONLY else f"{name}={value}")
    return _wrapper_type(cls, cls.forward, f"def forward(self, {', '.join(names)}):\n"
                                           f"    return _forward(self, {', '.join(call)})\n")


@functools.cache
def _wrapper_type(cls: type, forward: Callable[..., Any], src: str) -> type:
    """One subclass per class, forward and wrapper source: a class's `__init_subclass__` (HF's
    `GradientCheckpointingLayer` wraps the new `forward`, as it is meant to) runs once for it."""
    scope: dict[str, Any] = {"_forward": forward}
    exec(compile(src, f"<ckpt-planner trace of {cls.__name__}>", "exec"), scope)
    return type(cls.__name__, (cls,), {"forward": scope["forward"],
                                      "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})


def _contents(v: Any) -> list | None:
    """What a dict (its items), list or set attribute holds, to compare after a trace."""
    if isinstance(v, dict):
        return list(v.items())
    if isinstance(v, list | set):
        return list(v)
    return None


def _put_back(v: Any, before: list) -> bool:
    """Whether the container `v` holds other objects than `before` (compared by identity);
    if so, puts `before` back."""
    now = _contents(v)
    if now is not None and len(now) == len(before) and all(
            (a[0] is b[0] and a[1] is b[1]) if isinstance(v, dict) else a is b
            for a, b in zip(now, before, strict=True)):
        return False
    v.clear()
    if isinstance(v, list):
        v.extend(before)
    else:  # a dict takes back its (key, value) pairs, a set its items
        v.update(before)
    return True


def host_rng_state() -> tuple[Any, Any]:
    """The state of the host's other random streams a model's Python may draw from (`random`,
    and numpy's global one when numpy is loaded): torch's RNG state does not cover them."""
    np = sys.modules.get("numpy")
    return random.getstate(), (np.random.get_state() if np is not None else None)


def set_host_rng_state(state: tuple[Any, Any]) -> None:
    random.setstate(state[0])
    np = sys.modules.get("numpy")
    if np is not None and state[1] is not None:
        np.random.set_state(state[1])


def _drew(before: tuple[Any, Any]) -> bool:
    """Whether either stream moved since `before`; puts both back."""
    after = host_rng_state()
    moved = after[0] != before[0] or (
        before[1] is not None and (after[1][2:] != before[1][2:]
                                   or (after[1][1] != before[1][1]).any()))
    set_host_rng_state(before)
    return bool(moved)


def _resolves(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj
