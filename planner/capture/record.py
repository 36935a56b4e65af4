"""Record one real training step of the user's model: every aten op, forward and backward.

Nothing is traced: the model's own Python runs (data-dependent branches, `.item()`, HF's mask
code included), under three observers:

- a `TorchDispatchMode` that sees every aten op below autograd, forward and backward, with its
  tensor arguments and outputs: the storages it allocates (an output whose storage is not one of
  its inputs' is new; views and in-place results cost 0), FLOPs, bytes moved, time;
- `saved_tensors_hooks`: which storages autograd saves for which autograd node. The structure pass
  packs a *copy* of every saved tensor, so that the original storage dies when the model's own
  references to it do: that is when it dies inside a checkpointed region, where autograd keeps
  nothing. The autograd node of a forward op is the one created just before it dispatched
  (`torch.autograd._get_sequence_nr()`), and a backward op belongs to
  `torch._C._current_autograd_node()`;
- module hooks: the module path of every forward op, and every module call's span of ops, which
  are the regions a plan may checkpoint (`planner.apply` wraps exactly a module's `forward`).

Storage lifetimes come from weak references to the storages (PyTorch keeps a storage's Python
object for as long as the storage lives): the op after which each storage's last reference died
is recorded, which is how the simulator knows what the model's Python keeps alive.

This module knows nothing about solvers; `planner.assemble` turns a `Recording` into a `Profile`.
"""

from __future__ import annotations

import bisect
import collections
import collections.abc
import contextlib
import dataclasses
import functools
import gc
import random
import statistics
import sys
import time
import traceback
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)
from torch.utils.weak import WeakTensorKeyDictionary

from planner.stages import call_pattern, host_rng_state, set_host_rng_state, stageable, trace
from solvers.errors import CkptPlannerError

__all__ = [
    "ModelRunError",
    "ModuleCall",
    "OpRecord",
    "Recording",
    "StepSpec",
    "check_inputs",
    "default_loss",
    "end_of_autocast",
    "host_rng_state",
    "is_view",
    "op_name",
    "record_step",
    "seeded",
    "seeds_running_all",
    "set_host_rng_state",
    "restoring",
    "run_step",
    "split_inputs",
    "written_positions",
]

aten = torch.ops.aten

# FlopCounterMode counts the CUDA SDPA kernels but not the CPU flash kernel (torch 2.13).
_CPU_SDPA = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_SDPA_BWD = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
if _CPU_SDPA is not None and _CPU_SDPA.default not in flop_registry:
    with contextlib.suppress(RuntimeError):  # registered twice when the module is reloaded

        @register_flop_formula(_CPU_SDPA)
        def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kw):
            return sdpa_flop_count(query_shape, key_shape, value_shape)

        @register_flop_formula(_CPU_SDPA_BWD)
        def _cpu_sdpa_bwd_flop(grad_out_shape, query_shape, key_shape, value_shape, *a, **kw):
            return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


class ModelRunError(CkptPlannerError, RuntimeError):
    """The model's own training step raised; the message names the module it raised in."""


def default_loss(output: Any) -> torch.Tensor:
    """The loss used when none is given: ``output.loss`` where the output has one (HF models called
    with ``labels``), else the mean of the first floating-point tensor in the output, in float32."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.float().mean()
    raise CkptPlannerError(
        f"the model's output ({type(output).__name__}) holds no floating-point tensor to take a "
        "default loss from; pass loss_fn=..."
    )


_INPUT_FORMS = ("a tensor, a tuple of positional arguments, or a dict of keyword arguments "
                "(e.g. example_inputs={'input_ids': ids, 'labels': ids}); tensors may sit in "
                "dataclasses, dicts or plain objects among them")


def check_inputs(model: torch.nn.Module, example_inputs: Any) -> None:
    """Refuse example inputs that cannot be a training batch of `model`, before any work: None,
    no tensor anywhere, a keyword the forward does not take, more positional arguments than it
    takes. Raises CkptPlannerError saying what to pass instead."""
    import difflib
    import inspect

    if example_inputs is None:
        raise CkptPlannerError(
            f"example_inputs is None; pass the largest batch you will train with: {_INPUT_FORMS}")
    if not input_leaves(example_inputs):
        raise CkptPlannerError(
            f"example_inputs ({type(example_inputs).__name__}) holds no tensor; pass "
            f"{_INPUT_FORMS}")
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    params = list(sig.parameters.values())
    kinds = {p.kind for p in params}
    args, kwargs = split_inputs(example_inputs)
    known = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                   inspect.Parameter.KEYWORD_ONLY)}
    unknown = sorted(set(kwargs) - known)
    if unknown and inspect.Parameter.VAR_KEYWORD not in kinds:
        raise CkptPlannerError(
            f"{type(model).__name__}.forward takes no argument named {', '.join(unknown)}; "
            f"it takes {', '.join(sorted(known)) or 'no keyword arguments'}: fix the keys "
            "of example_inputs")
    for key in unknown:  # **kwargs swallows anything: a near miss is most likely a typo
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        if close:
            raise CkptPlannerError(
                f"{type(model).__name__}.forward takes no argument named {key!r} (did you mean "
                f"{close[0]!r}?); it would pass through **kwargs unused: fix the keys of "
                "example_inputs")
    if args and inspect.Parameter.VAR_POSITIONAL not in kinds:
        positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                      inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        if len(args) > len(positional):
            raise CkptPlannerError(
                f"example_inputs gives {len(args)} positional arguments but "
                f"{type(model).__name__}.forward takes {len(positional)} "
                f"({', '.join(p.name for p in positional)}); pass a tuple of that length or a "
                "dict of keyword arguments")


def split_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Normalise example inputs: a tensor, a tuple/list of positional args, or a dict of kwargs
    (or what a Hugging Face tokenizer returns, a `BatchEncoding`: a `UserDict`, passed as
    ``model(**batch)``, as training code does)."""
    if isinstance(example_inputs, dict | collections.UserDict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple | list):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


_UNANNOTATED_BN = {"aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm"}


def written_positions(target: Any) -> list[int]:
    """Positions of the arguments an aten op mutates in place."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return []
    if schema.name in _UNANNOTATED_BN:
        # these update running_mean/running_var (args 3, 4) in place, but their schemas do not say so
        return [3, 4]
    return [
        i
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


@dataclass
class OpRecord:
    """One recorded op (or a placeholder for a tensor that existed before the step)."""

    name: str
    op: str
    phase: str
    """param, buffer, input, forward, loss or backward."""
    inputs: list[int] = field(default_factory=list)
    """Indices of the records whose outputs this op reads."""
    module: str = ""
    storage: int | None = None
    storage_parts: list[int] = field(default_factory=list)
    """A sparse output's other storages (its indices'); `storage` is its values'."""
    new_storages: list[int] = field(default_factory=list)
    saves: set[int] = field(default_factory=set)
    grad_of: int | None = None
    python_backward: bool = False
    """Backward ops: run by an autograd node written in Python (a custom `autograd.Function`)."""
    flops: int = 0
    bytes_moved: int = 0
    time_ms: float = 0.0
    random: bool = False
    own_generator: str = ""
    """Where the op draws from a `torch.Generator` it is given, not torch's default one: the
    innermost module on the call stack holding it as an attribute, "?" where none does.
    Checkpoint preserves only the default generators' state; a region snapshots the generators
    its modules hold (`planner.inplace`), and a call drawing from another is blocked."""
    mutates_buffer: bool = False
    writes: list[int] = field(default_factory=list)
    """Storages the op mutates in place."""
    dynamic: str = ""
    """Why the op's outputs depend on tensor values ("" when they do not): its output shape
    (``nonzero``, boolean indexing) or a value read on the host (``.item()``)."""
    releases: list[int] = field(default_factory=list)
    """Storages whose last reference (autograd's saved copies aside) died after this op."""
    no_grad_storages: list[int] = field(default_factory=list)
    """Forward ops: storages of `new_storages` holding integer or boolean outputs."""
    detached_reads: list[int] = field(default_factory=list)
    """Forward ops: storages read only through tensors that do not require grad, or with grad
    mode off (`solvers.profile.Node.detached_reads`)."""
    workspace_bytes: int = 0
    """Bytes the op allocated and freed again while it ran (measured on CPU)."""
    rewrapped_bytes: int = 0
    """Python numbers the op takes where its schema has a tensor (``h * 0.5``): a plain step
    wraps them before the op runs, a step under the recorder's mode while it runs, so the
    workspace measured under the mode holds them and `_measure_workspace` takes them out."""
    view: bool = False
    """The op returns a view of an input (its schema says the output aliases it, read-only)."""
    dtype: str = ""
    """The dtype the op computes in (its first floating input's; its output's if none)."""
    grad_mode: bool = True
    """Whether gradients were enabled when the op ran (`torch.no_grad` blocks inside forward)."""
    fills: int | None = None
    """Backward ops of `_COMPLIANT_OUT_OF_PLACE`, and the engine's gradient accumulations: the
    storage of their ``self`` argument, which the in-place variant run outside the recorder
    writes into (`_undo_compliance`)."""
    accumulates: bool = False
    """The autograd engine's sum of two gradients for one input of a node (its ``InputBuffer``),
    not an op of a backward formula."""
    after_formula: bool = False
    """Backward ops the engine runs after the node's formula returned (outside the node's
    profiler scope, inside its ``evaluate_function``): `validate_outputs` reducing a broadcast
    gradient to its input's shape (``sum_to``) or casting it, and the `accumulates` sums."""
    before_unpack: bool = False
    """Backward ops a node runs before it unpacks its saved tensors (`_Recorder.unpack_at`):
    CopySlices' copies of the gradient, for an in-place op on a view, before the formula it
    wraps."""


@dataclass(frozen=True)
class ModuleCall:
    """One call of a module's `forward`, as a span of recorded forward ops (inclusive)."""

    module: str
    start: int
    end: int
    holds: frozenset[int] = frozenset()
    """Storages the objects among the call's arguments reach when the forward ends, or when
    the last call that took one returned if it died before (a KV cache object passed to every
    layer holds what later layers add to it): a checkpoint of this call keeps its arguments, so
    these live until the region's backward."""
    args: frozenset[int] = frozenset()
    """Storages of the tensors the call takes that `planner.inplace` passes to the checkpoint as
    inputs (positional and keyword tensors, the tensors of a plain tuple given by keyword)."""
    mirror: tuple[tuple, dict] | None = None
    """The call's (args, kwargs) with each tensor replaced by its storage (`StorageRef`) and
    every other value by None: where the call is staged, which storage each placeholder of the
    trace took (`planner.stages.StagedGraph.values`)."""
    reseeds: bool = False
    """Whether the call seeds torch's default generators (``torch.seed()``, as Reformer's layers
    do, or ``torch.manual_seed``): one of torch's seeding functions ran during it, or a default
    generator (CPU, or a CUDA one) had another initial seed when it returned than when it
    started (``Generator.seed()``)."""


@dataclass(frozen=True)
class StorageRef:
    """A tensor's storage id in `ModuleCall.mirror`."""

    sid: int


def _detached_reads(in_tensors: list[torch.Tensor], in_sids: list) -> list[int]:
    """`OpRecord.detached_reads`: an input's ``requires_grad`` is seen here, below autograd, as
    the op's autograd node will see it (a ``detach``ed alias of a tensor that requires grad
    does not)."""
    grad = torch.is_grad_enabled()
    held: set[int] = set()
    free: set[int] = set()
    for t, s in zip(in_tensors, in_sids, strict=True):
        (held if grad and t.requires_grad else free).update(s if isinstance(s, list) else (s,))
    return sorted(free - held)


@dataclass(frozen=True)
class Staged:
    """Where the nodes of a module's traced forward (`planner.stages`) start in the recording."""

    pattern: str
    """`planner.stages.Pattern` of the call, as JSON."""
    fingerprint: str
    nodes: tuple[int, ...]
    """Exec position of each stage's first node, then the number of exec nodes."""
    ops: tuple[int, ...]
    """Index in `Recording.ops` of each stage's first op, then one past the last stage's op."""
    arguments: tuple[tuple[int, ...], ...] = ()
    """For each stage, the storages of the call's tensor arguments its nodes read
    (`_stage_arguments`)."""


@dataclass
class Recording:
    """What one recorded training step ran."""

    ops: list[OpRecord]
    """Placeholders first (params, buffers, inputs, constants), then the step's ops in order."""
    storage_bytes: list[int]
    calls: list[ModuleCall]
    loss: int
    grads: list[int]
    outputs: list[int]
    param_names: list[str]
    trainable: dict[str, bool]
    input_shapes: dict[str, list[int]]
    module_paths: list[str]
    sequential: dict[str, list[str]] = field(default_factory=dict)
    """Modules whose forward is `nn.Sequential`'s: path -> children's names, in order."""
    staged: dict[str, Staged] = field(default_factory=dict)
    """Modules called once whose traced forward ran the recorded ops (`planner.stages`)."""
    step_ms: float | None = None
    """Wall time of one unrecorded step (median), when timed."""
    random_skips: list[str] = field(default_factory=list)
    """Modules the model skips at random in training (LayerDrop): the recorded step is a draw
    that runs every one of them."""
    attribute_stores: list[tuple[int, str, int]] = field(default_factory=list)
    """(op, ``module.attribute``, storage) where a forward call left a tensor with an autograd
    graph in a plain attribute of its module (the op: the call's last; the storage: the
    tensor's, -1 if unknown)."""
    attribute_rereads: list[tuple[int, str]] = field(default_factory=list)
    """(op, ``module.attribute``) where a forward op read the tensor a plain attribute of a
    module held as the module's call started, and the attribute holds another by the step's
    end (Transformer-XL's memory: read, then replaced by this segment's)."""
    called_in_backward: list[str] = field(default_factory=list)
    """Modules whose forward also ran during backward: recomputed there by a custom autograd
    Function (Reformer's reversible layers rebuild their inputs from their outputs) or by
    torch's checkpoint in the model's own code."""
    outside_modules: list[str] = field(default_factory=list)
    """Modules with parameters that forward ran but that are not the model's submodules, as
    ``Class (N calls, M ops)``, most ops first (`_Recorder.outside`)."""
    differentiated_in_forward: list[int] = field(default_factory=list)
    """Forward ops whose autograd node ran backward inside the step's forward or loss
    (``torch.autograd.grad`` there: forces as the energy's gradient by positions, a gradient
    penalty in the loss)."""
    rows: dict[int, int] = field(default_factory=dict)
    """Op index -> first dimension of its tensor, for parameters and the ops holding their
    gradients (`solvers.profile.Node.rows`: FSDP2 shards along it)."""


@dataclass(frozen=True, kw_only=True)
class StepSpec:
    """How to run one training step of a model: the call, the loss, and what to differentiate."""

    model: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any], torch.Tensor]
    params: dict[str, torch.Tensor]
    """Name -> tensor the step uses for each parameter (the model's own, or fakes)."""
    buffers: dict[str, torch.Tensor]
    call: Callable[[], Any]
    """Runs the model's forward on the inputs and returns its output."""
    autocast: torch.dtype | None = None
    """Run forward and loss under ``torch.autocast(device_type, dtype=autocast)`` and backward
    outside it, as PyTorch's mixed-precision recipe does."""
    device_type: str = "cpu"
    seed: int | None = None
    """Seed every run of the step with this (`restoring`) instead of the caller's RNG state: the
    draw chosen where the model skips modules at random (`_all_modules_seed`)."""


class _Packed:
    """What a saved-tensor pack hook returns: the copy autograd uses, and the original storage."""

    __slots__ = ("sids", "tensor")

    def __init__(self, tensor: torch.Tensor, sids: list[int]):
        self.tensor = tensor
        self.sids = sids  # one per storage of the tensor (`storages_of`)


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


_OPAQUE = (str, bytes, int, float, complex, bool, type(None), torch.Size, torch.dtype,
           torch.device, torch.nn.Module, type)
"""Values an example input's walk does not look into (`input_leaves`)."""

_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)
"""Callables an input may be (a callback): not looked into. Other callable objects are (PyG's
`Data` is callable)."""


def _held_by(v: Any) -> list[tuple[str, Any]]:
    """(key as written after a path, value) of what `v`, an object pytree takes as one leaf,
    holds: a dataclass's fields, a mapping's items, a plain object's attributes (PyG's `Data`
    keeps its tensors in a mapping among its attributes). Functions and modules hold none."""
    if isinstance(v, _OPAQUE + _FUNCTIONS):
        return []
    if dataclasses.is_dataclass(v):
        return [(f".{f.name}", getattr(v, f.name, None)) for f in dataclasses.fields(v)]
    if isinstance(v, collections.abc.Mapping):
        return [(f"[{k!r}]", x) for k, x in v.items()]
    if isinstance(v, list | tuple):
        return [(f"[{i}]", x) for i, x in enumerate(v)]
    d = getattr(v, "__dict__", None)
    return [(f".{k}", x) for k, x in d.items()] if isinstance(d, dict) else []


def input_leaves(tree: Any, depth: int = 6) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor of example inputs `tree`: pytree's leaves, and the
    tensors objects pytree takes as leaves hold (`_held_by`, up to `depth` deep): a batch
    dataclass, a `torch_geometric.data.Data`. Paths of pytree's leaves are `pytree.keystr`'s."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    todo = [(pytree.keystr(p), leaf, 0) for p, leaf in pytree.tree_flatten_with_path(tree)[0]]
    todo.reverse()
    while todo:
        path, v, d = todo.pop()
        if isinstance(v, torch.Tensor):
            out.append((path, v))
        elif d < depth and id(v) not in seen:
            seen.add(id(v))
            todo.extend(reversed([(path + k, x, d + 1) for k, x in _held_by(v)]))
    return out


def reachable_tensors(obj: Any, depth: int = 4) -> list[torch.Tensor]:
    """The tensors `obj` reaches through containers and plain objects' attributes, up to
    `depth` references deep (modules excepted: their own tensors are parameters and buffers).
    What a checkpoint keeps by reference when it is given `obj` as an argument."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    todo = [(obj, 0)]
    while todo:
        o, d = todo.pop()
        if id(o) in seen or d > depth:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            todo.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list | tuple | set):
            todo.extend((v, d + 1) for v in o)
        elif isinstance(o, torch.nn.Module):
            continue
        elif hasattr(o, "__dict__"):
            todo.extend((v, d + 1) for v in vars(o).values())
    return out


_SPARSE_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def storages_of(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding `t`'s memory: a dense tensor's own; a sparse tensor's values' and
    its indices' (a graph's adjacency in ``torch.sparse.mm``), values first. A sparse tensor
    has no storage of its own; one made from tensors the step has (``torch.sparse_coo_tensor
    (indices, values)``) holds theirs, and whatever keeps it (autograd saving it) keeps them."""
    if t.layout == torch.strided:
        return [t.untyped_storage()]
    with torch._C._DisableTorchDispatch():  # not an op of the step: the recorder's own look
        if t.layout == torch.sparse_coo:
            parts = (t._values(), t._indices())
        elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
            parts = (t.values(), t.crow_indices(), t.col_indices())
        elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
            parts = (t.values(), t.ccol_indices(), t.row_indices())
        else:
            return [t.untyped_storage()]  # raises for layouts without one, naming the layout
        return [x.untyped_storage() for x in parts]


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage that stands for `t` where one does: a sparse tensor's values'."""
    return t.untyped_storage() if t.layout == torch.strided else storages_of(t)[0]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s storage, or of a sparse tensor's values and indices."""
    return sum(int(st.nbytes()) for st in storages_of(t))


def _moved(t: torch.Tensor) -> int:
    """Bytes an op reading or writing `t` moves: its elements, or a sparse tensor's stored
    values and indices."""
    return t.numel() * t.element_size() if t.layout == torch.strided else tensor_bytes(t)


_ZERO_FACTORIES = frozenset({"aten.new_zeros.default", "aten.zeros.default",
                             "aten.zeros_like.default"})
_COMPLIANT_OUT_OF_PLACE = frozenset({"aten.scatter_add.default", "aten.index_add.default",
                                     "aten.index_put.default", "aten.put.default"})
"""Ops that autograd's C++ formulas run out of place only when a tensor is "subclass-like",
which every tensor is while a dispatch mode is active, and in place otherwise:
``grad.new_zeros(size).scatter_add_(...)`` (`gather`'s backward), ``index_add_``
(`index_select`'s), ``_index_put_impl_`` (indexing's, ``x[idx]``), ``put_`` (`take`'s). Under
the recorder they allocate a second buffer that a real step does not."""

_ACCUMULATE = "aten.add.Tensor"
"""The op the autograd engine sums two gradients of one node input with (``InputBuffer``): in
place into the first (``old.add_(new)``) when that is dense and the engine holds its last
reference, unless either is "subclass-like", which under a dispatch mode both always are."""


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill a block of memory without gaps or overlaps in some order of
    its dimensions (ATen's ``is_non_overlapping_and_dense``)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _sole_holder(t: torch.Tensor) -> bool:
    """No other tensor (a view) holds `t`'s storage: its only references are `t`'s and the
    storage object this asks through."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2


def op_name(func: Any) -> str:
    """The profile's name of an op: ``aten.addmm.default`` (namespace, overload packet, overload)."""
    if isinstance(func, torch._ops.OpOverload):
        if func.namespace == "aten":
            return f"aten.{func.__name__}"
        return f"{func.namespace}.{func.__name__}"
    return getattr(func, "__name__", str(func))


def _compute_dtype(inputs: list[torch.Tensor], out: Any) -> str:
    for t in [*inputs, *_tensors(out)]:
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return ""


def is_view(func: Any) -> bool:
    """The op returns a view of an input (its schema: the output aliases it, read-only)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


def _dynamic_reason(func: Any) -> str:
    tags = getattr(func, "tags", ())
    if torch.Tag.dynamic_output_shape in tags:
        return f"output shape depends on values ({op_name(func)})"
    if torch.Tag.data_dependent_output in tags:
        return f"reads a tensor value on the host ({op_name(func)})"
    return ""


_SAVES_SCALAR_OTHER = frozenset({
    "aten.mul.Tensor", "aten.mul_.Tensor", "aten.div.Tensor", "aten.div_.Tensor",
    "aten.div.Tensor_mode", "aten.div_.Tensor_mode"})
"""Ops whose backward for `self` reads `other`, which autograd saves when `self` requires grad."""

_WRAPPED_BYTES = {bool: 1, int: 8, float: 8, complex: 16}


def _number_bytes(value: Any) -> int:
    """Bytes of the 0-dim tensor torch wraps a Python number in (float64, int64, ...)."""
    return 0 if isinstance(value, torch.Tensor) else _WRAPPED_BYTES.get(type(value), 0)


def _rewrapped_bytes(func: Any, args: tuple, kwargs: dict) -> int:
    """`OpRecord.rewrapped_bytes`: the numbers among the op's arguments typed ``Tensor``."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return 0
    total = 0
    for i, a in enumerate(schema.arguments):
        if str(a.type) == "Tensor":
            total += _number_bytes(args[i] if i < len(args) else kwargs.get(a.name))
    return total


def _saved_wrapped_number(func: Any, args: tuple, phase: str) -> int:
    """Bytes of the number autograd saves for this op outside the saved-tensor hooks, else 0.

    ``h * 0.5`` (PEFT's LoRA scaling, diffusers' ``/ rescale_output_factor``) passes the
    Python number to `mul.Tensor` as a wrapped 0-dim CPU tensor (float64, int64, ...): the
    dispatcher hands this mode a plain number, and autograd saves the tensor for the
    backward of `h` without calling the pack hook (wrapped numbers never go through it). On
    CPU it is memory of the step, held until that backward runs; on a GPU it is host memory
    and costs the device nothing.
    """
    if (phase not in ("forward", "loss") or not torch.is_grad_enabled() or len(args) < 2
            or op_name(func) not in _SAVES_SCALAR_OTHER):
        return 0
    this = args[0]
    if not isinstance(this, torch.Tensor) or not this.requires_grad or this.device.type != "cpu":
        return 0
    return _number_bytes(args[1])


_PASS_THROUGH = frozenset({"profiler", "prim"})
"""Op namespaces not recorded: the profiler's markers, and metadata queries (``prim.device``) that
fake tensors dispatch."""


def _fake_counterparts(tensors: list[torch.Tensor], sids: list[Any]) -> dict[int, int]:
    """On fake tensors (estimate mode), a real tensor from before the step that an op reads (a
    constant a module cached in an earlier run) is converted to a fake by the fake mode, once
    (it memoises the conversion): a view of it lands on the fake's storage, which is the
    constant's, not a new one. Storage key of each such fake -> the constant's storage id."""
    from torch._subclasses.fake_tensor import FakeTensor

    real = [(t, s) for t, s in zip(tensors, sids, strict=True) if not isinstance(t, FakeTensor)]
    mode = torch._guards.detect_fake_mode() if real else None
    if mode is None:
        return {}
    return {storage_of(mode.from_tensor(t))._cdata: s[0] if isinstance(s, list) else s
            for t, s in real}


@dataclass
class _Watched:
    """A tensor a module's plain attribute held as a call of the module started."""

    label: str
    module: weakref.ref
    attr: str
    tensor: weakref.ref
    reads: list[int] = field(default_factory=list)


def _attribute_rereads(rec: _Recorder) -> list[tuple[int, str]]:
    """(op, ``module.attribute``) for each read of a watched tensor whose attribute holds
    another one now (or none): a replay of a call around the read would read the new one."""
    out = set()
    for ws in rec.watched.values():
        for w in ws:
            mod = w.module()
            if w.reads and (mod is None or vars(mod).get(w.attr) is not w.tensor()):
                out.update((i, w.label) for i in w.reads)
    rec.watched.clear()
    return sorted(out)


class _Recorder(TorchDispatchMode):
    """Records every aten op below autograd; see the module docstring."""

    def __init__(self, *, timed: bool = False, sync: Callable[[], None] = lambda: None,
                 structure: bool = True, marked: bool = False):
        super().__init__()
        self.structure = structure
        self.timed = timed
        self.marked = marked
        self.sync = sync
        self.suspended = 0
        self.fake = False  # recording a step on fake tensors (estimate mode)
        # the first forward op on a sparse tensor, on fake tensors: (op, module); estimate mode
        # cannot size it (`_sparse_estimate_error`)
        self.sparse_forward: tuple[str, str] | None = None
        self.phase = "forward"
        self.ops: list[OpRecord] = []
        self.placeholders: list[OpRecord] = []
        self.storage_bytes: list[int] = []
        self.sid_of: dict[int, int] = {}  # id(storage object) -> storage id, while it lives
        self.owner: dict[int, int] = {}  # storage id -> record index of the tensor that is it
        self.times: list[float] = []
        self.names: list[str] = []
        self.grad_modes: list[bool] = []
        self.phases: list[str] = []
        self.module_stack: list[str] = []
        self.calls: list[ModuleCall] = []
        self.call_args: list[tuple[list[int], list[int], list[weakref.ref], Any]] = []
        self.reach_seen: dict[int, frozenset[int]] = {}
        """By the `id` of the weak reference to an object among a call's arguments (one per
        object: `weakref.ref` gives the same one while it lives): the storages it reached as the
        last call that took it returned, for an object that dies before forward ends (HF
        Gemma3n's KV-sharing dict, made and dropped by the model's forward)."""
        self.attribute_stores: list[tuple[int, str, int]] = []
        """(last op of the call, ``module.attribute``, storage) for each forward call that left
        a tensor with an autograd graph in a plain attribute of its module (RecurrentGemma's
        ``self.recurrent_states = ...``)."""
        self.attribute_rereads: list[tuple[int, str]] = []  # `Recording.attribute_rereads`
        self.modules_by_name: dict[str, torch.nn.Module] = {}  # set by `module_hooks`
        self.watched: dict[int, list[_Watched]] = {}
        """Storage (``_cdata``) -> the tensors held in modules' plain attributes as their calls
        started, whose reads are noted (`attribute_rereads`)."""
        self.raised_in: dict[int, str] = {}
        self.seq_owner: dict[int, int] = {}  # autograd node sequence number -> forward op index
        self.last_seq = torch.autograd._get_sequence_nr()
        # Sequence numbers skipped by the last forward op (made before it dispatched) and who
        # may claim them: see `_own_nodes`.
        self.skipped: list[int] = []
        self.in_place_op: int | None = None  # the last forward op, if it wrote in place
        self.packs: list[tuple[int, int]] = []  # (sequence number, storage id)
        self.unpack_at: dict[int, int] = {}
        """Forward op -> the number of ops recorded when its node first unpacked a saved
        tensor in backward: a node wrapped by CopySlices (an in-place op on a view) copies the
        gradient before the formula it wraps unpacks."""
        self.function_saves: dict[int, tuple[weakref.ref, int, int]] = {}
        """id of a tensor a custom Function's forward passed to ``ctx.save_for_backward`` ->
        (a weak reference to it, the Function's node's sequence number, the depth of nested
        applies), until that apply returns (`_noting_function_saves`)."""
        self.release_at: dict[int, int] = {}
        self.wrapped: dict[int, int] = {}
        """Storage id -> the forward op whose node saves it: a number wrapped as a tensor that
        autograd saves without the pack hook (`_saved_wrapped_number`)."""
        self.counts: dict[str, int] = {}
        self.placeholder_names: set[str] = set()
        self.fixed_kind: dict[int, str] = {}  # storage id -> "param"/"buffer"/"input"
        self.buffer_sids: set[int] = set()
        self.entered: set[str] = set()
        """Every module whose forward was called."""
        self.outside: dict[str, list[int]] = {}
        """Class name -> [calls, forward ops] of the modules forward ran that are not the
        model's submodules (outermost calls only): no region can be placed on them."""
        self.differentiated: set[int] = set()
        """Forward ops whose node ran backward during the forward or loss phase."""
        self.called_in_backward: set[str] = set()
        """Modules whose forward ran during backward (`Recording.called_in_backward`)."""
        self.applied: int | None = None
        """Sequence number of the autograd node whose formula has just returned: the ops that
        follow under it, until the next node runs, are the engine's accumulations."""
        self.foreign_hooks: dict[str, str] = {}
        """Module -> the saved-tensor pack hook the model's own code put above the recorder's
        (its own checkpointing or offloading), where a forward op ran under one."""
        self.made_by: dict[int, tuple[int, int]] | None = None
        """In the stage run (`_find_stages`) only: storage object (``id``, while it lives) ->
        (light op index, position among the op's tensor outputs) of the op that first returned
        it."""

    # -- storages -----------------------------------------------------------------------------
    def _released(self, key: int, sid: int) -> None:
        if self.sid_of.get(key) == sid:
            del self.sid_of[key]
        # after the last op recorded so far (placeholders count as position -1)
        self.release_at[sid] = len(self.ops) - 1

    def _unalias(self, key: int, sid: int) -> None:
        if self.sid_of.get(key) == sid:
            del self.sid_of[key]

    def _alias(self, st: torch.UntypedStorage, sid: int) -> None:
        """Another storage object that stands for storage `sid` (autograd's copy of a saved
        tensor), for as long as it lives."""
        key = id(st)
        if key not in self.sid_of:
            self.sid_of[key] = sid
            weakref.finalize(st, self._unalias, key, sid)

    def _new_storage(self, st: torch.UntypedStorage) -> int:
        sid = len(self.storage_bytes)
        self.storage_bytes.append(int(st.nbytes()))
        key = id(st)
        self.sid_of[key] = sid
        weakref.finalize(st, self._released, key, sid)
        return sid

    def register_fixed(self, kind: str, name: str, t: torch.Tensor) -> None:
        """A tensor that exists before the step: parameter, buffer or input."""
        sts = storages_of(t)
        if id(sts[0]) in self.sid_of:
            return  # shares storage with one already registered (tied weights)
        new = [self._new_storage(st) for st in sts if id(st) not in self.sid_of]
        sid = new[0]
        for k in new:
            self.fixed_kind[k] = kind
            if kind == "buffer":
                self.buffer_sids.add(k)
        rec = OpRecord(name=name, op="placeholder", phase=kind, module=name, storage=sid,
                       new_storages=new)
        self.placeholder_names.add(name)
        self.owner[sid] = -1 - len(self.placeholders)
        self.placeholders.append(rec)

    def sid(self, t: torch.Tensor) -> int:
        """The storage id of a tensor; a tensor from before the step that is not a parameter,
        buffer or input (a cached mask, a module attribute) becomes a constant placeholder."""
        if t.layout != torch.strided:
            return self.sids(t)[0]
        st = t.untyped_storage()
        sid = self.sid_of.get(id(st))
        if sid is None:
            sid = self._constant([st])[0]
        return sid

    def sids(self, t: torch.Tensor) -> list[int]:
        """`sid` of each of the tensor's storages (`storages_of`: a sparse tensor's values and
        indices), those unknown made constants as `sid` does."""
        sts = storages_of(t)
        unknown = [st for st in sts if id(st) not in self.sid_of]
        if unknown:
            self._constant(unknown)
        return [self.sid_of[id(st)] for st in sts]

    def _constant(self, sts: list[torch.UntypedStorage]) -> list[int]:
        new = [self._new_storage(st) for st in sts]
        for k in new:
            self.fixed_kind[k] = "buffer"
        rec = OpRecord(name=f"constant_{len(self.placeholders)}", op="placeholder",
                       phase="buffer", module="constant", storage=new[0], new_storages=new)
        for k in new:
            self.owner[k] = -1 - len(self.placeholders)
        self.placeholders.append(rec)
        return new

    def _name(self, base: str) -> str:
        """A fresh node name: the op's name, numbered, never a placeholder's (a parameter the
        model calls ``cos`` or ``embedding``)."""
        k = self.counts.get(base, 0)
        while True:
            name = f"{base}_{k}" if k else base
            k += 1
            if name not in self.placeholder_names:
                self.counts[base] = k
                return name

    # -- ops ----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.suspended or getattr(func, "namespace", "") in _PASS_THROUGH:
            return func(*args, **kwargs)
        if not self.structure:
            return self._light(func, args, kwargs)
        if self.phase in ("forward", "loss"):
            self._check_hooks()
        seq = torch.autograd._get_sequence_nr()
        node = torch._C._current_autograd_node() if self.phase == "backward" else None
        if self.phase in ("forward", "loss"):
            inner = torch._C._current_autograd_node()
            if inner is not None:  # torch.autograd.grad in the model's forward or its loss
                owner = self.seq_owner.get(inner._sequence_nr())
                if owner is not None:
                    self.differentiated.add(owner)
        in_tensors = _tensors((args, kwargs))
        if (func is torch.ops.aten.lift_fresh.default and in_tensors
                and id(in_tensors[0].untyped_storage()) not in self.sid_of):
            # ``torch.tensor(data)`` in the model's code: made in this step (a tensor the model
            # kept from its warm-up step would be known), so an allocation of this op, not a
            # constant held before the step
            in_tensors = []
        in_sids = [self.sid(t) if t.layout == torch.strided else self.sids(t) for t in in_tensors]
        if self.watched and self.phase == "forward":
            for t in in_tensors:
                for w in self.watched.get(storage_of(t)._cdata, ()):
                    if w.tensor() is not None:
                        w.reads.append(len(self.ops))
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, in_tensors, in_sids, out, seq, node)
        return out

    def _generator_holder(self, gen: torch.Generator | None) -> str:
        """`OpRecord.own_generator` of an op drawing from `gen`."""
        if gen is None:
            return ""
        for name in reversed(self.module_stack):
            m = self.modules_by_name.get(name)
            if m is not None and any(isinstance(v, torch.Generator) and v._cdata == gen._cdata
                                     for v in vars(m).values()):
                return name or "(the root module)"
        return "?"

    def _check_hooks(self) -> None:
        """Note the current module if saved-tensor hooks other than the recorder's are on top
        (`foreign_hooks`); checked as each module is entered and as each forward op runs."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] != self.pack:
            where = self.module_stack[-1] if self.module_stack else ""
            self.foreign_hooks.setdefault(where or "(the root module)",
                                          getattr(top[0], "__qualname__", repr(top[0])))

    def _light(self, func, args, kwargs):
        """Timing or marking pass: only the op's name and time."""
        if self.marked:
            with torch.autograd.profiler.record_function(f"ckpt_op::{len(self.names)}"):
                out = func(*args, **kwargs)
            self.names.append(op_name(func))
            return out
        self.sync()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        self.sync()
        self.times.append((time.perf_counter() - t0) * 1e3)
        if self.made_by is not None:
            self._note_made(out)
        self.names.append(op_name(func))
        self.grad_modes.append(torch.is_grad_enabled())
        self.phases.append(self.phase)
        return out

    def _note_made(self, out: Any) -> None:
        """`made_by` for the tensor outputs of the op about to be named (a view returns its
        input's storage, already noted or not the step's)."""
        made = self.made_by
        outs = out if isinstance(out, tuple | list) else (out,)
        for pos, t in enumerate(t for t in outs if isinstance(t, torch.Tensor)):
            if t.layout != torch.strided:
                continue
            st = t.untyped_storage()
            key = id(st)
            if key not in made:
                made[key] = (len(self.names), pos)
                weakref.finalize(st, made.pop, key, None)

    def _record(self, func, args, kwargs, in_tensors, in_sids, out, seq, node) -> None:
        """`in_sids`: each input's storage id, or a sparse input's list of them."""
        idx = len(self.ops)
        if self.fake and not self.sparse_forward and self.phase in ("forward", "loss") and any(
                t.layout != torch.strided for t in (*in_tensors, *_tensors(out))):
            self.sparse_forward = (op_name(func),
                                   self.module_stack[-1] if self.module_stack else "")
        in_cdata: dict[int, int] = {}
        for t, s in zip(in_tensors, in_sids, strict=True):
            if isinstance(s, list):
                in_cdata.update((st._cdata, k) for st, k in zip(storages_of(t), s, strict=True))
            else:
                in_cdata[t.untyped_storage()._cdata] = s
        if self.fake:
            in_cdata.update(_fake_counterparts(in_tensors, in_sids))
        detached = _detached_reads(in_tensors, in_sids) if self.phase == "forward" else []
        in_sids = [k for s in in_sids for k in (s if isinstance(s, list) else (s,))]
        outs = out if isinstance(out, tuple | list) else (out,)
        out_sids: list[int | None] = []
        out_parts: list[list[int]] = []  # per tensor output, its storages beyond the first
        new: list[int] = []
        no_grad: list[int] = []  # integer and boolean outputs: never a grad_fn
        for t in outs:
            if not isinstance(t, torch.Tensor):
                out_sids.append(None)
                out_parts.append([])
                continue
            parts = []
            for k, st in enumerate(storages_of(t)):
                s = in_cdata.get(st._cdata)
                if s is None and func is torch.ops.aten.lift_fresh.default and in_sids:
                    # a known tensor lifted: a real step returns it, fake tensors a fake copy
                    s = in_sids[0]
                if s is None:
                    s = self._new_storage(st)
                    new.append(s)
                    if k or not (t.is_floating_point() or t.is_complex()):
                        no_grad.append(s)  # a sparse tensor's indices too
                else:  # a view or an in-place result of an input: map this storage object too
                    self._alias(st, s)
                parts.append(s)
            out_sids.append(parts[0])
            out_parts.append(parts[1:])
        wrapped = _saved_wrapped_number(func, args, self.phase)
        if wrapped:
            s = len(self.storage_bytes)
            self.storage_bytes.append(wrapped)
            self.wrapped[s] = idx
            new.append(s)
            no_grad.append(s)
        packet = getattr(func, "overloadpacket", None)
        base = getattr(packet, "__name__", None) or op_name(func).split(".")[-1]
        writes = []
        positions = written_positions(func)
        schema_args = func._schema.arguments if positions else []
        for pos in positions:
            # an ``out=`` tensor is keyword-only: in `kwargs`, not `args`
            a = args[pos] if pos < len(args) else kwargs.get(schema_args[pos].name)
            if isinstance(a, torch.Tensor):
                writes.append(self.sid(a))
        flops = 0
        if packet in flop_registry:
            with contextlib.suppress(Exception):  # a formula that cannot take these arguments
                flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
        rec = OpRecord(
            name=self._name(base),
            op=op_name(func),
            phase=self.phase,
            inputs=sorted({self.owner.get(s, -1) for s in in_sids if s in self.owner}),
            module=self.module_stack[-1] if self.module_stack and self.phase == "forward" else "",
            storage=out_sids[0] if not isinstance(out, tuple | list) else None,
            storage_parts=out_parts[0] if not isinstance(out, tuple | list) else [],
            new_storages=new,
            no_grad_storages=no_grad if self.phase == "forward" else [],
            flops=flops,
            bytes_moved=sum(_moved(t) for t in in_tensors) + sum(_moved(t) for t in _tensors(out)),
            random=torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()),
            own_generator=self._generator_holder(_own_generator(args, kwargs)),
            mutates_buffer=any(s in self.buffer_sids for s in writes),
            writes=writes,
            dynamic=_dynamic_reason(func),
            view=is_view(func),
            dtype=_compute_dtype(in_tensors, out),
            grad_mode=torch.is_grad_enabled(),
            detached_reads=detached,
            rewrapped_bytes=_rewrapped_bytes(func, args, kwargs),
        )
        if (self.phase == "backward" and rec.op in _COMPLIANT_OUT_OF_PLACE and args
                and isinstance(args[0], torch.Tensor)):
            rec.fills = self.sid(args[0])
        if node is not None and rec.op == _ACCUMULATE and self.applied == node._sequence_nr():
            # after the node's formula returned (`applied`): the engine summing its outputs
            rec.accumulates = True
            old = args[0] if len(args) == 2 and not kwargs else None
            if (isinstance(old, torch.Tensor) and old.layout == torch.strided and _dense(old)
                    and _sole_holder(old)):
                rec.fills = self.sid(old)
        if self.phase in ("forward", "loss") and any(o is not None for o in out_sids):
            self._own_nodes(seq, idx, bool(writes), rec.op)
        elif node is not None:
            owner = self.seq_owner.get(node._sequence_nr())
            rec.grad_of = owner
            rec.python_backward = isinstance(node, torch.autograd.function.BackwardCFunction)
        self.ops.append(rec)
        if isinstance(out, tuple | list):
            for s, parts in zip(out_sids, out_parts, strict=True):
                if s is None:
                    continue
                g = OpRecord(name=self._name("getitem"), op="getitem", phase=self.phase,
                             inputs=[idx], module=rec.module, storage=s, storage_parts=parts,
                             grad_of=rec.grad_of, python_backward=rec.python_backward)
                self.ops.append(g)
                for part in (s, *parts):
                    if part in new:
                        self.owner[part] = len(self.ops) - 1
        else:
            for s in new:
                self.owner[s] = idx

    def _own_nodes(self, seq: int, idx: int, in_place: bool, op: str = "") -> None:
        """Which forward op made which autograd node. An op that made nodes since the last one
        owns node seq - 1. An in-place op whose backward needs the value it overwrites
        (``w /= w.sum()``) makes its node first, then autograd clones the original (a `clone`
        with a node of its own) and only then does the op itself dispatch, with no new number:
        the number skipped before the clone's is the in-place op's, which comes next.

        An in-place op on a view (``h.relu_()`` where ``h`` is a Linear's 3-D output, a view of
        its 2-D matmul) makes its node as it dispatches, and after it returns autograd makes the
        base's CopySlices (whose backward runs that node's formula, unpacking what the op saved)
        and the view's new grad_fn: the numbers skipped before the next op's node are the
        in-place op's, unless that next op is the clone above."""
        skipped, self.skipped = self.skipped, []
        if seq != self.last_seq:
            self.seq_owner.setdefault(seq - 1, idx)
            new = [s for s in range(self.last_seq, seq - 1) if s not in self.seq_owner]
            if new and self.in_place_op is not None and op != "aten.clone.default":
                for s in new:
                    self.seq_owner.setdefault(s, self.in_place_op)
                new = []
            self.skipped = new
            self.last_seq = seq
            self.in_place_op = None
        elif in_place:
            for s in skipped:
                self.seq_owner.setdefault(s, idx)
        if in_place:
            self.in_place_op = idx

    # -- saved tensors ------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> _Packed:
        """Autograd saves `t` for the node being created (sequence number - 1): keep a copy, so
        that the original storage lives only as long as the model's own references do. An input
        is saved before its op runs: one from before the step that no op has read yet (a tensor
        the model keeps) becomes its constant placeholder here, so that the backward's reads of
        the copy are reads of it. (The hooks are on for forward and loss only: what a backward
        saves, a Python backward that recomputes its forward as Reformer's does, is held by
        autograd as in any step, and dies where the recording sees it die.)"""
        self.suspended += 1
        try:
            sids = self.sids(t)
            sid = sids[0]
            seq = torch.autograd._get_sequence_nr() - 1
            noted = self.function_saves.get(id(t))
            if noted is not None and noted[0]() is t:
                # a custom Function saving it as its apply returns: its own node, which the
                # latest sequence number is not when its forward made autograd nodes
                seq = noted[1]
                # its node took its number before its forward ran: the node is the last op
                # that forward ran (none of the numbers its ops took)
                self.seq_owner[seq] = len(self.ops) - 1
            made = self.owner.get(sid, -1)
            if self.seq_owner.get(seq, made) < made:
                # the node saving it was made after the op its number went to (a custom
                # Function whose forward ran its ops without gradients): the node is the last
                # op's so far, after the saved tensor was made
                self.seq_owner[seq] = len(self.ops) - 1
            self.packs.extend((seq, k) for k in sids)
            if t.device.type == "cuda":
                copy = t.detach().to("cpu")
            else:
                copy = t.detach().clone()
            return _Packed(copy, sids)
        finally:
            self.suspended -= 1

    def unpack(self, p: _Packed) -> torch.Tensor:
        self.suspended += 1
        try:
            t = p.tensor
            if self._device is not None and t.device != self._device:
                t = t.to(self._device)
            # backward ops read the copy: they read the original storages
            for st, sid in zip(storages_of(t), p.sids, strict=True):
                self._alias(st, sid)
            node = torch._C._current_autograd_node() if self.phase == "backward" else None
            owner = self.seq_owner.get(node._sequence_nr()) if node is not None else None
            if owner is not None:  # the step's backward only (autograd.grad in forward unpacks too)
                self.unpack_at.setdefault(owner, len(self.ops))
            return t
        finally:
            self.suspended -= 1

    _device: torch.device | None = None

    # -- modules ------------------------------------------------------------------------------
    def _argument_refs(self, args: Any
                       ) -> tuple[list[int], list[int], list[weakref.ref], Any]:
        """What a checkpoint of this call gets (`planner.inplace`): the storages of the tensors
        it takes as inputs (positional tensors, keyword tensors and the tensors of a plain tuple
        given by keyword: a nested checkpoint hands them to its parent), the storages of the
        tensors it keeps by reference inside the other values (a list, a dict), and weak
        references to the objects among those values (a cache object), whose tensors are looked
        up when forward ends."""
        positional, keywords = args
        inputs: list[int] = []
        held: list[int] = []
        objs: list[weakref.ref] = []

        def by_reference(value: Any) -> None:
            for leaf in pytree.tree_leaves(value):
                if isinstance(leaf, torch.Tensor):
                    held.append(self.sid(leaf))
                elif not isinstance(leaf, int | float | bool | str | bytes | type(None)
                                    | torch.dtype | torch.device):
                    with contextlib.suppress(TypeError):  # objects without weakref support
                        objs.append(weakref.ref(leaf))

        for v in positional:
            if isinstance(v, torch.Tensor):
                inputs.append(self.sid(v))
            else:
                by_reference(v)
        for v in keywords.values():
            if isinstance(v, torch.Tensor):
                inputs.append(self.sid(v))
            elif type(v) is tuple and any(isinstance(x, torch.Tensor) for x in v):
                for x in v:
                    if isinstance(x, torch.Tensor):
                        inputs.append(self.sid(x))
                    else:
                        by_reference(x)
            else:
                by_reference(v)
        return inputs, held, objs, self._mirror(positional, keywords)

    def _mirror(self, positional: tuple, keywords: dict) -> tuple[tuple, dict]:
        """`ModuleCall.mirror`: tensors as `StorageRef`, plain tuples of them as tuples, every
        other value None (no object of the model's is rebuilt: a PackedSequence checks what it
        is made of)."""
        def ref(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return StorageRef(self.sid(v))
            if type(v) is tuple:
                return tuple(StorageRef(self.sid(x)) if isinstance(x, torch.Tensor) else None
                             for x in v)
            return None

        return tuple(ref(v) for v in positional), {k: ref(v) for k, v in keywords.items()}

    def resolve_holds(self) -> None:
        """Storages each call's arguments reach now (at the end of forward), or as the last
        call that took them returned, for objects that died since (`reach_seen`)."""
        reach: dict[int, frozenset[int]] = {}
        for k, (sids, by_ref, objs, mirror) in enumerate(self.call_args):
            held: set[int] = set(by_ref)
            for r in objs:
                obj = r()
                if obj is None:  # died before forward ended: what it held as it was last used
                    held |= self.reach_seen.get(id(r), frozenset())
                    continue
                key = id(obj)
                if key not in reach:
                    reach[key] = frozenset(self._reachable_storages(obj))
                held |= reach[key]
            c = self.calls[k]
            self.calls[k] = ModuleCall(c.module, c.start, c.end, frozenset(held), frozenset(sids),
                                       mirror, c.reseeds)

    def _reachable_storages(self, obj: Any) -> set[int]:
        return {sid for t in reachable_tensors(obj)
                for sid in (self.sid_of.get(id(storage_of(t))),) if sid is not None}

    def _outside_hooks(self, inside: set[int]) -> list[Any]:
        """Global hooks noting the outermost calls, in forward, of modules with parameters that
        are not the model's submodules (`outside`): torchrl's losses keep their networks out
        of their module tree and swap the parameters in for each call; a network kept in a
        plain list is outside too. The report says why such a forward has no regions. (A
        frozen teacher run without gradients saves nothing, and is not noted.)"""
        open_: list[tuple[int, int]] = []  # (id of the module, ops before its call)

        def pre(mod, args):
            if open_ or id(mod) in inside or self.phase != "forward" or \
                    not torch.is_grad_enabled() or next(mod.parameters(), None) is None:
                return
            open_.append((id(mod), len(self.ops)))

        def post(mod, args, out):
            if open_ and open_[-1][0] == id(mod):
                _, start = open_.pop()
                seen = self.outside.setdefault(type(mod).__name__, [0, 0])
                seen[0] += 1
                seen[1] += len(self.ops) - start

        g = torch.nn.modules.module
        return [g.register_module_forward_pre_hook(pre),
                g.register_module_forward_hook(post, always_call=True)]

    @contextlib.contextmanager
    def module_hooks(self, model: torch.nn.Module) -> Iterator[None]:
        """Per-module hooks marking each call's `forward` span: the pre-hook runs after the
        module's own pre-hooks, the post-hook before its own forward hooks."""
        handles = []
        starts: list[int] = []
        self.modules_by_name = dict(model.named_modules())

        args_of: list[tuple[list[int], list[int], list[weakref.ref]]] = []
        attrs_of: list[dict[str, int]] = []
        seeds_of: list[tuple[tuple[int, ...], int]] = []
        seedings = [0]  # calls of torch's seeding functions so far (`_seeding_counted`)

        def tensor_attrs(mod: torch.nn.Module) -> dict[str, int]:
            return {k: id(v) for k, v in vars(mod).items() if isinstance(v, torch.Tensor)}

        def pre(name):
            def hook(mod, args, kwargs):
                self.module_stack.append(name)
                self.entered.add(name)
                if self.structure and self.phase == "forward":
                    self._check_hooks()
                starts.append(len(self.ops))
                args_of.append(self._argument_refs((args, kwargs)))
                attrs_of.append(tensor_attrs(mod))
                seeds_of.append((_initial_seeds(), seedings[0]))
                if self.structure and self.phase == "forward":
                    for k, v in vars(mod).items():
                        if isinstance(v, torch.Tensor) and v.device.type != "meta":
                            self.watched.setdefault(storage_of(v)._cdata, []).append(
                                _Watched(f"{name}.{k}", weakref.ref(mod), k, weakref.ref(v)))
            return hook

        def post(name):
            def hook(mod, args, out):
                exc = sys.exc_info()[1]
                if exc is not None and id(exc) not in self.raised_in:
                    self.raised_in[id(exc)] = name  # the innermost module it raised in
                if self.module_stack and self.module_stack[-1] == name:
                    self.module_stack.pop()
                    start = starts.pop()
                    refs = args_of.pop()
                    before = attrs_of.pop()
                    seeded = seeds_of.pop() != (_initial_seeds(), seedings[0])
                    if self.phase == "forward" and len(self.ops) > start:
                        self.calls.append(ModuleCall(name, start, len(self.ops) - 1,
                                                     reseeds=seeded))
                        self.call_args.append(refs)
                        if self.structure:
                            for r in refs[2]:
                                obj = r()
                                if obj is not None:
                                    self.reach_seen[id(r)] = frozenset(
                                        self._reachable_storages(obj))
                        for k, v in vars(mod).items():
                            if isinstance(v, torch.Tensor) and v.grad_fn is not None \
                                    and before.get(k) != id(v):
                                self.attribute_stores.append(
                                    (len(self.ops) - 1, f"{name}.{k}",
                                     self.sid_of.get(id(storage_of(v)), -1)))
            return hook

        for name, m in model.named_modules():
            if isinstance(m, torch.jit.ScriptModule):
                # TorchScript takes no hooks: its ops are its caller's, and it is no region
                continue
            handles.append(m.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(m.register_forward_hook(post(name), prepend=True, always_call=True))
        if self.structure:
            handles += self._outside_hooks({id(m) for m in self.modules_by_name.values()})
        try:
            with _seeding_counted(seedings):
                yield
        finally:
            for h in handles:
                h.remove()


def end_of_autocast() -> None:
    """Where a training step's ``with torch.autocast(...)`` block starts and ends (before forward;
    after the loss, before backward): drop autocast's cache of weights cast to the lower
    precision, as entering and leaving that block does. Inside an enclosing autocast context
    (planning or measuring within the user's own block) the cache would otherwise outlive a step,
    and its hits would hide casts from the next one (a selective region's replay would then not
    find the casts its forward ran)."""
    if any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        torch.clear_autocast_cache()


def _check_loss(loss: Any, finite: bool = False) -> torch.Tensor:
    """`loss` if it can be a training step's loss, else CkptPlannerError saying why. With
    `finite` (the warm-up step, which no recorder sees: the check is an op), warn if it is
    not finite."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise CkptPlannerError(
            f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    if loss.grad_fn is None and loss.requires_grad:
        raise CkptPlannerError(
            "the loss is a leaf tensor that requires grad (no grad_fn): the model computes its "
            "gradients itself, in a hook on the loss that runs forward and backward again "
            "inside backward, as GradCache does (sentence-transformers' Cached* losses); no "
            "checkpoint placed in forward acts there. GradCache already bounds activation "
            "memory by its mini-batch size: lower that, or plan the model under the loss it "
            "caches (MultipleNegativesRankingLoss for CachedMultipleNegativesRankingLoss)")
    if loss.grad_fn is None:
        raise CkptPlannerError(
            "the loss does not depend on any trainable parameter (it has no grad_fn): check that "
            "some parameters have requires_grad=True, that the model is not run under "
            "torch.no_grad(), and that the loss uses the model's output"
        )
    if finite and type(loss) is torch.Tensor and loss.device.type != "meta" and \
            not torch.isfinite(loss.detach()).item():
        warnings.warn(
            f"the example step's loss is {loss.item()}: the plan's memory figures hold, but its "
            "gradients are not finite and plan.verify() cannot compare them; check the example "
            "inputs (a row that is all padding makes a masked mean divide by zero) and the loss",
            stacklevel=2)
    return loss


@contextlib.contextmanager
def _noting_function_saves(rec: _Recorder) -> Iterator[None]:
    """`rec`'s saved-tensor hooks, and ``ctx.save_for_backward`` of custom Functions noting
    their node's sequence number for the tensors it is given (`_Recorder.function_saves`):
    autograd packs them as the Function's apply returns, when the latest sequence number is
    that of the last node its forward made (torchdiffeq's adjoint solver makes some), not its
    own. The notes of one apply end with it: a Function that gets no node (no input requires
    grad) packs nothing, and a later op saving the same tensor saves it for itself."""
    fctx = torch.autograd.function.FunctionCtx
    function = torch.autograd.Function
    original_save = fctx.save_for_backward
    original_apply = function.__dict__["apply"]
    depth = 0

    def save_for_backward(ctx: Any, *tensors: Any) -> None:
        seq = getattr(ctx, "_sequence_nr", None)
        if callable(seq):
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    rec.function_saves[id(t)] = (weakref.ref(t), seq(), depth)
        original_save(ctx, *tensors)

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal depth
        depth += 1
        try:
            return original_apply.__func__(cls, *args, **kwargs)
        finally:
            ended = depth
            depth -= 1
            for k in [k for k, v in rec.function_saves.items() if v[2] == ended]:
                del rec.function_saves[k]

    fctx.save_for_backward = save_for_backward
    function.apply = classmethod(apply)
    try:
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
            yield
    finally:
        fctx.save_for_backward = original_save
        function.apply = original_apply
        rec.function_saves.clear()


def run_step(spec: StepSpec, rec: _Recorder | None, hooks: bool,
             finite: bool = False) -> tuple[list[int], int, list]:
    """One forward, loss and backward of `spec`. Returns (storage ids of the output leaves, of
    the loss, and the gradients' storage ids) when recording structure."""
    wrt = [p for p in spec.params.values() if p.requires_grad]
    if not wrt:
        raise CkptPlannerError(
            "no parameter of the model requires grad, so there is no backward to plan; "
            "unfreeze some parameters (or add adapters) first"
        )
    pack_ctx = (
        _noting_function_saves(rec)
        if rec is not None and rec.structure
        else contextlib.nullcontext()
    )
    mod_ctx = rec.module_hooks(spec.model) if rec is not None and hooks else contextlib.nullcontext()
    out_sids: list[int] = []
    amp = (torch.autocast(spec.device_type, dtype=spec.autocast) if spec.autocast is not None
           else contextlib.nullcontext())
    end_of_autocast()  # a step starts with an empty cast cache, as a fresh autocast block does
    with pack_ctx:
        with amp:
            if rec is not None:
                rec.phase = "forward"
            with mod_ctx:
                out = spec.call()
            if rec is not None:
                rec.phase = "loss"
                if rec.structure:
                    out_sids = [rec.sid(t) for t in _tensors(out)]
                    if hooks:
                        rec.resolve_holds()
            loss = _check_loss(spec.loss_fn(out), finite)
            del out  # a training loop drops the output once the loss is computed
        end_of_autocast()
        loss_sid = rec.sid(loss) if rec is not None and rec.structure else -1
    if rec is not None:
        rec.phase = "backward"
    with (_watch_nodes(rec, loss.grad_fn) if rec is not None and rec.structure
          else contextlib.nullcontext()), \
            (_called_in_backward(rec, spec.model) if rec is not None and rec.structure
             else contextlib.nullcontext()):
        # and the other leaves that require grad, as `loss.backward()` writes theirs too: an
        # input the model makes require grad to differentiate by it (forces as minus the
        # energy's gradient by positions), an embedding output PEFT's
        # `enable_input_require_grads` marks. Their backward runs, and what it reads lives.
        others = _other_leaves(loss, wrt)
        grads = torch.autograd.grad(loss, wrt + others, allow_unused=True)
    grad_sids = []
    if rec is not None and rec.structure:
        grad_sids = [rec.sid(g) for g in grads[:len(wrt)] if g is not None]
        rec.phase = "done"
        rec._final_refs = (loss, grads)  # held until the recording is assembled
    del loss, grads
    return out_sids, loss_sid, grad_sids


def _graph_nodes(root: Any) -> Iterator[Any]:
    """Every node of the autograd graph behind `root` (a ``grad_fn``), once each."""
    seen, stack = set(), [root]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)  # held, so that nodes stay alive (and distinct) while the walk lasts
        yield n
        stack.extend(f for f, _ in n.next_functions)


def _other_leaves(loss: torch.Tensor, wrt: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors other than `wrt` whose gradient ``loss.backward()`` would accumulate: the
    variables of the AccumulateGrad nodes of `loss`'s graph. Their gradients are held to the
    end of the step, as the tensor's ``.grad`` holds them."""
    params = {id(p) for p in wrt}
    return [n.variable for n in _graph_nodes(loss.grad_fn)
            if type(n).__name__ == "AccumulateGrad" and id(n.variable) not in params]


@contextlib.contextmanager
def _called_in_backward(rec: _Recorder, model: torch.nn.Module) -> Iterator[None]:
    """Notes in `rec.called_in_backward` the model's modules whose forward runs during backward
    (a custom autograd Function, or torch's checkpoint in the model's code, recomputing them)."""
    names = {id(m): n for n, m in model.named_modules()}

    def hook(mod: torch.nn.Module, _args: Any) -> None:
        name = names.get(id(mod))
        if name is not None:
            rec.called_in_backward.add(name)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _watch_nodes(rec: _Recorder, root: Any) -> Iterator[None]:
    """A post hook on every node of the step's autograd graph, which runs when the node's
    formula has returned and before the engine adds its outputs into the next nodes' inputs:
    from there until the next node runs, `rec.applied` names it."""
    def hook(seq: int, *_: Any) -> None:
        rec.applied = seq

    handles = [n.register_hook(functools.partial(hook, n._sequence_nr()))
               for n in _graph_nodes(root)
               if type(n).__name__ != "AccumulateGrad"]  # writes a leaf's gradient, adds nothing
    try:
        yield
    finally:
        rec.applied = None
        for h in handles:
            h.remove()


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Put every random stream a step may draw from (torch's, CUDA's, Python's `random`,
    numpy's) back as it was after the block; with `seed`, seed them all for it."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    host = host_rng_state()
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
            random.seed(seed)
            if sys.modules.get("numpy") is not None:
                sys.modules["numpy"].random.seed(seed)
        try:
            yield
        finally:
            set_host_rng_state(host)


_SEEDING = (("torch", "manual_seed"), ("torch", "seed"), ("torch.random", "manual_seed"),
            ("torch.random", "seed"), ("torch.cuda", "manual_seed"),
            ("torch.cuda", "manual_seed_all"), ("torch.cuda", "seed"), ("torch.cuda", "seed_all"))
"""torch's functions that seed its default generators."""


@contextlib.contextmanager
def _seeding_counted(count: list[int]) -> Iterator[None]:
    """Counts in ``count[0]`` the calls of torch's seeding functions (`_SEEDING`): a call that
    seeds with the seed the generator already had leaves its initial seed as it was."""
    import importlib

    saved = []
    for mod_name, attr in _SEEDING:
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, attr, None)
        if fn is None:
            continue

        def counted(*args, _fn=fn, **kwargs):
            count[0] += 1
            return _fn(*args, **kwargs)

        saved.append((mod, attr, fn))
        setattr(mod, attr, counted)
    try:
        yield
    finally:
        for mod, attr, fn in reversed(saved):
            setattr(mod, attr, fn)


def _initial_seeds() -> tuple[int, ...]:
    """The initial seeds of torch's default generators (CPU, and CUDA's where initialised)."""
    return (torch.default_generator.initial_seed(), *(
        g.initial_seed() for g in (torch.cuda.default_generators
                                   if torch.cuda.is_initialized() else ())))


def _own_generator(args: tuple, kwargs: dict | None) -> torch.Generator | None:
    """The `torch.Generator` an op's arguments pass, other than torch's default ones."""
    gen = next((a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Generator)),
               None)
    if gen is None:
        return None
    # compared by their C++ object: the dispatcher hands a mode a new Python wrapper
    defaults = {g._cdata for g in (torch.default_generator, *(
        torch.cuda.default_generators if torch.cuda.is_initialized() else ()))}
    return None if gen._cdata in defaults else gen


_ABSENT = object()


def put_back(dst: torch.Tensor, value: torch.Tensor) -> None:
    """Write `value` into `dst` in place, whatever shape `dst` has now: a buffer may be resized
    by the step itself (a quantization observer's statistics start empty and take their shape
    on the first call)."""
    if dst.shape != value.shape:
        dst.resize_(value.shape)
    dst.copy_(value)


def mutable_containers(tree: Any, depth: int = 6) -> list[list | dict]:
    """The plain lists and dicts in `tree`, nested in each other, in tuples and in mappings
    (HF's `BatchEncoding`), and the attribute dicts of the objects it holds (a batch
    dataclass's fields, PyG's `Data`'s storage), each once. Subclasses of list and dict are
    looked into but not listed: HF's `ModelOutput` refuses to be cleared."""
    found: dict[int, list | dict] = {}
    seen: set[int] = set()
    todo = [(tree, 0)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, torch.Tensor) or d > depth or id(v) in seen:
            continue
        seen.add(id(v))
        if type(v) in (list, dict):
            found[id(v)] = v
            todo.extend((x, d + 1) for x in (v.values() if type(v) is dict else v))
            continue
        held = _held_by(v)
        attrs = getattr(v, "__dict__", None)
        if held and isinstance(attrs, dict) and not isinstance(v, list | tuple | dict):
            found[id(attrs)] = attrs  # the object's attributes, and through them its mapping's
            seen.add(id(attrs))
            todo.extend((x, d + 1) for x in attrs.values())
        todo.extend((x, d + 1) for _, x in held)
    return list(found.values())


def set_contents(c: list | dict, contents: list | dict) -> None:
    """Make list or dict `c` hold `contents` (the same objects), if it holds anything else."""
    if isinstance(c, dict):
        if c.keys() != contents.keys() or any(c[k] is not v for k, v in contents.items()):
            c.clear()
            c.update(contents)
    elif len(c) != len(contents) or any(a is not b for a, b in zip(c, contents)):
        c[:] = contents


@contextlib.contextmanager
def inputs_as_given(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """Give a step's inputs back what they held before it: every step the planner runs
    (warm-up, recording, measuring) starts from the inputs as the user gave them, as each step
    of training starts from a fresh batch.

    - The contents of their lists and dicts (and their objects' attributes): sentence-
      transformers' modules write their outputs into the ``features`` dict they are called
      with, and the model passes that dict's keys on as keyword arguments: a second step on
      the same dict would call BERT with the first step's embeddings, held from one step to the
      next; a step that pops its labels from the batch would fail the second time.
    - The values of their tensors, where the step wrote one in place (a forward that
      normalizes its batch with ``x.mul_(...)``): each step would see another batch, and
      `verify` would compare an unplanned step with a planned one on other inputs. Each tensor
      is copied to host memory as the step starts (outside any measured window: callers enter
      this before they start a timer or a memory count) and written back only if its version
      moved; one a step left unwritten is not copied again (`_NOT_WRITTEN`)."""
    was = [(c, c.copy()) for c in mutable_containers((args, kwargs))]
    kept = []
    for _, t in input_leaves((args, kwargs)):
        if t.requires_grad or t.layout != torch.strided or type(t) is not torch.Tensor \
                or t.device.type == "meta":
            continue  # an in-place write to a leaf that requires grad raises; fakes, subclasses
        if _NOT_WRITTEN.get(t) == t._version:
            kept.append((t, t._version, None))  # a step before left it unwritten: no copy
            continue
        with torch.no_grad():  # on the host: no device memory the step would not have
            kept.append((t, t._version, t.detach().to("cpu", copy=True)))
    try:
        yield
    finally:
        for c, old in was:
            set_contents(c, old)
        with torch.no_grad():
            for t, version, value in kept:
                if t._version == version:
                    _NOT_WRITTEN[t] = version
                    continue
                _NOT_WRITTEN.pop(t, None)
                if value is not None:
                    t.copy_(value)
                else:
                    warnings.warn(
                        f"this step wrote an input tensor of shape {tuple(t.shape)} in place, "
                        "which the steps before it did not: it could not be put back, and the "
                        "steps after it see the value it wrote", stacklevel=3)


_NOT_WRITTEN: Any = WeakTensorKeyDictionary()
"""Input tensor -> its version after a step that did not write it (`inputs_as_given`): the
next step on it copies nothing (a model writes its inputs on every step or on none)."""


@contextlib.contextmanager
def python_state(model: torch.nn.Module) -> Iterator[None]:
    """Put back, as they were, the attributes of the model's modules that steps change and
    training would not see changed: steps the planner runs are not steps of training.

    - Int, float and tensor attributes: a step may advance a counter (a memory bank's write
      position, the step an annealed temperature reads) or replace a recurrent memory
      (Transformer-XL's last segment).
    - Any attribute left holding a tensor with an autograd graph (an auxiliary loss, an
      attention map kept for inspection): it would hold the planner's step's graph.

    Flags (bools) and other attributes a step sets or creates stay: they mark one-time work
    done (transformers' flag that its output-capturing hooks are installed, a cache built on
    the first call, which the warm-up step builds on purpose), and putting them back would do
    it again."""
    mods = list(model.modules())
    before = [dict(m.__dict__) for m in mods]
    try:
        yield
    finally:
        for m, was in zip(mods, before, strict=True):
            d = m.__dict__
            for k, v in list(d.items()):
                old = was.get(k, _ABSENT)
                if v is old or type(v) is bool:
                    continue
                counts = (type(v) in (int, float) or isinstance(v, torch.Tensor)) and \
                    (type(old) in (int, float) or isinstance(old, torch.Tensor))
                if counts or (isinstance(v, torch.Tensor) and v.grad_fn is not None):
                    if old is _ABSENT:
                        del d[k]
                    else:
                        d[k] = old


@contextlib.contextmanager
def restoring(spec: StepSpec) -> Iterator[None]:
    """Leave the model's buffers (BatchNorm statistics), parameters' gradients, the attributes
    `python_state` puts back and the RNG streams (`seeded`) as they were; with `spec.seed`, seed
    them for the run. Gradients are None during the run, as after ``zero_grad()``: `run_step`
    takes them with `torch.autograd.grad`, but a model may call ``backward()`` itself
    (Reformer's reversible layers, in their backward), which would accumulate into the user's
    ``.grad``."""
    saved = {k: v.detach().clone() for k, v in spec.buffers.items() if v.device.type != "meta"}
    leaves = {k for k, v in spec.buffers.items() if v.grad_fn is None and not v.requires_grad}
    grads = {k: p.grad for k, p in spec.params.items()}
    for p in spec.params.values():
        p.grad = None
    with seeded(spec.seed), python_state(spec.model), inputs_as_given(spec.args, spec.kwargs):
        try:
            yield
        finally:
            with torch.no_grad():
                for k, v in saved.items():
                    put_back(spec.buffers[k], v)
            for k in leaves:
                # The stage run (`_find_stages`) runs traced code, which drops the forward's
                # `torch.no_grad()` blocks: an in-place update there (an EMA codebook's) made
                # the buffer a non-leaf of the step's graph.
                b = spec.buffers[k]
                if b.grad_fn is not None or b.requires_grad:
                    b.detach_()
                    b.requires_grad_(False)
            for k, g in grads.items():
                spec.params[k].grad = g


def _sparse_estimate_error(spec: StepSpec, rec: _Recorder) -> CkptPlannerError:
    op, where = rec.sparse_forward
    return CkptPlannerError(
        f"{type(spec.model).__name__}'s forward computes with sparse tensors ({op} in "
        f"{where or 'the root module'}), which estimate mode cannot size: how many elements a "
        "sparse result stores depends on values fake tensors do not have, and sparse kernels "
        "take scratch memory they do not show. Profile in measure mode, on the target device "
        "or at a smaller size here (sparse gradients of embeddings alone are fine: their size "
        "follows from the number of lookups)")


def _warm_up(spec: StepSpec) -> Exception | None:
    """One unrecorded step first, so that the recorded one is a step of training and not its
    first call: what a model computes once and keeps (an `lru_cache`d position index, as BEiT's
    relative position bias; a lazily built buffer) then exists before the recorded step, held
    beside the weights as it is in every later step, instead of being counted as the step's own
    memory. Buffers, gradients and random streams are put back (`restoring`). Returns what the
    step raised: the recorded run raises it again, with where it happened, except where only
    a step outside the recorder fails (`_failed_outside_recorder`)."""
    try:
        with restoring(spec):
            run_step(spec, None, hooks=False, finite=True)
    except Exception as e:  # noqa: BLE001 - see above
        return e
    return None


def _failed_outside_recorder(spec: StepSpec, e: Exception) -> ModelRunError:
    """The plain step raised where the recorded one ran: the recorder keeps copies of the
    tensors autograd saves, so autograd's check that a saved tensor was not written in place
    since (its version counter) cannot fire under it."""
    hint = (" (a tensor autograd saved was written in place: use the out-of-place op there, "
            "or write to a .clone())" if "modified by an inplace operation" in str(e) else "")
    return ModelRunError(
        f"{type(spec.model).__name__}'s training step raised: {type(e).__name__}: {e}. A plain "
        "step (model(**inputs), loss_fn, backward) fails the same way outside the planner: fix "
        f"the model{hint} and plan again.")


def _where(rec: _Recorder, e: BaseException) -> str:
    """The innermost module the exception `e` raised in."""
    if id(e) in rec.raised_in:
        return rec.raised_in[id(e)] or "(the root module)"
    return rec.module_stack[-1] if rec.module_stack else "(outside any module)"


def record_step(
    spec: StepSpec,
    *,
    fake: bool = False,
    timing_repeats: int = 0,
    workspace: bool = False,
    device: torch.device | None = None,
    stages: bool = True,
) -> Recording:
    """Run the step of `spec` once under the recorder (structure, FLOPs, lifetimes), then
    `timing_repeats` more times timing every op (median), and, with `workspace`, once under
    `torch.profiler` to measure each op's transient allocations. The model's buffers and the RNG
    are restored before every run, so every run draws the same dropout masks and runs the same
    ops; the user's model is left as it was. With `stages`, one more light run finds where
    the nodes of each module's traced forward start (`_find_stages`)."""
    sync = (lambda: torch.cuda.synchronize()) if device is not None and device.type == "cuda" \
        else (lambda: None)
    rec = _Recorder(sync=sync)
    rec._device = device
    rec.fake = fake
    for name, p in spec.params.items():
        rec.register_fixed("param", name, p)
    for name, b in spec.buffers.items():
        rec.register_fixed("buffer", name, b)
    input_shapes: dict[str, list[int]] = {}
    for key, leaf in input_leaves((spec.args, spec.kwargs)):
        input_shapes[key] = list(leaf.shape)
        rec.register_fixed("input", f"input{key}", leaf)
    warm_up_error = None if fake else _warm_up(spec)
    if not fake:
        # a buffer the warm-up's forward registered (built on first call: litgpt's LoRA index)
        # is held before every later step, beside the others, not a constant the model holds
        # elsewhere (`Profile.held_bytes`, which `measure` adds to the module's buffers)
        for name, b in spec.model.named_buffers():
            if name not in spec.buffers:
                rec.register_fixed("buffer", name, b)
    with restoring(spec):
        try:
            with rec:
                out_sids, loss_sid, grad_sids = run_step(spec, rec, hooks=True)
            _grown_buffers(rec, spec)
            rec.attribute_rereads = _attribute_rereads(rec)
        except CkptPlannerError:
            raise
        except Exception as e:  # noqa: BLE001 - the model's own error, with where it happened
            if rec.sparse_forward:
                raise _sparse_estimate_error(spec, rec) from e
            raise _run_error(spec, rec, e, fake) from e
    if rec.sparse_forward:
        raise _sparse_estimate_error(spec, rec)
    if warm_up_error is not None:
        raise _failed_outside_recorder(spec, warm_up_error) from warm_up_error
    if rec.foreign_hooks:
        raise _foreign_hooks_error(spec, rec.foreign_hooks)
    # The loss and gradients die now, after every recorded op, as at the step's end; so does
    # what only reference cycles kept (they would wait for the garbage collector in training too).
    refs = rec.__dict__.pop("_final_refs", None)
    rec.grad_rows = [int(g.shape[0]) if g.dim() else 0 for g in refs[1] if g is not None] \
        if refs is not None else []
    del refs
    if _unreleased(rec):
        gc.collect()  # a full collection costs in proportion to the whole process's objects
    recording = _assemble(spec, rec, out_sids, loss_sid, grad_sids, input_shapes)
    routed = _routing_modules(recording.ops)
    groups = (_skipped_siblings(spec.model, rec.entered, routed)
              if spec.seed is None and not fake else [])
    if groups:
        found = _all_modules_seed(spec, groups, rec.entered, routed)
        if found is not None:
            recording = record_step(dataclasses.replace(spec, seed=found[0]), timing_repeats=
                                    timing_repeats, workspace=workspace, device=device,
                                    stages=stages)
            recording.random_skips = found[1]
            return recording
    if stages:
        recording.staged = _find_stages(spec, recording)
    if timing_repeats > 0 and not fake:
        _time_ops(spec, recording, timing_repeats, sync)
    if workspace and not fake and (device is None or device.type == "cpu"):
        _measure_workspace(spec, recording)
    return recording


def _grown_buffers(rec: _Recorder, spec: StepSpec) -> None:
    """A buffer the step resized in place counts at the size it has after the step: a
    quantization observer's statistics start empty and take their shape on the first call,
    and the recorded step starts from the buffers as they were before the warm-up
    (`restoring`), while every step of training after the first finds them grown."""
    for b in spec.buffers.values():
        st = storage_of(b)
        sid = rec.sid_of.get(id(st))
        if sid is not None and sid in rec.buffer_sids:
            rec.storage_bytes[sid] = max(rec.storage_bytes[sid], int(st.nbytes()))


RANDOM_SKIP_DRAWS = 64
"""Random draws tried for one that runs every module a model skips at random (LayerDrop with
probability p over L layers runs them all with probability (1 - p) ** L: 0.28 at 0.1 over 12)."""

DESIGN_DRAWS = 8
"""Draws after which a module that none of them, nor the recorded step, called is taken to be
left out by design, not skipped at random (a layer LayerDrop keeps with probability 1 - p is
skipped by nine draws in a row with probability p ** 9)."""


def _routing_modules(ops: list[OpRecord]) -> set[str]:
    """Modules whose own forward decides by the values of the data (reads on the host, or
    shapes set by values, of tensors computed from inputs or parameters) and never by a random
    draw alone: MoE routers. LayerDrop's decision (``torch.rand([]) < p``, read on the host) is
    a read of a value made from the RNG only; one made with Python's `random` reads nothing."""
    kind: list[str] = []  # per record: "data", "rng" (random draws and constants only), "const"
    by_data: set[str] = set()
    by_rng: set[str] = set()
    for r in ops:
        if r.op == "placeholder":
            kind.append("const" if r.module == "constant" else "data")
            continue
        got = {kind[i] for i in r.inputs if 0 <= i < len(kind)}
        k = "data" if "data" in got else "rng" if r.random or "rng" in got else "const"
        kind.append(k)
        if r.phase == "forward" and r.dynamic:
            (by_data if k == "data" else by_rng if k == "rng" else set()).add(r.module)
    return by_data - by_rng


def _skipped_siblings(model: torch.nn.Module, entered: set[str],
                      routed: set[str] = frozenset()) -> list[list[str]]:
    """Groups of same-class children of one module (the layers of a `ModuleList`) of which the
    step called some but not all: LayerDrop skipped them, or a forward leaves them out by
    design. Not where the module that calls them routes by value (`routed`, `_routing_modules`):
    MoE experts no token chose, whose memory `planner.plan`'s measured margin covers."""
    found = []
    modules = dict(model.named_modules())
    # A router's class routes in every instance, those the step skipped too (a layer LayerDrop
    # dropped never ran its router, so only its class tells).
    kinds = {type(modules[n]) for n in routed if n in modules}
    for name, m in modules.items():
        caller = name.rpartition(".")[0] if isinstance(m, torch.nn.ModuleList | torch.nn.ModuleDict) \
            else name
        # a ModuleDict may route in its own forward
        if caller in routed or name in routed or type(m) in kinds \
                or type(modules.get(caller)) in kinds:
            continue
        groups: dict[type, list[str]] = {}
        for child, c in m.named_children():
            groups.setdefault(type(c), []).append(f"{name}.{child}" if name else child)
        for paths in groups.values():
            if len(paths) > 1 and any(p in entered for p in paths) \
                    and not all(p in entered for p in paths):
                found.append(paths)
    return found


def _entered(spec: StepSpec, seed: int) -> set[str] | None:
    """The modules a forward of `spec` calls when the RNG is seeded with `seed` (no gradients
    kept; buffers and RNG restored); None if the forward raises."""
    entered: set[str] = set()
    handles = [m.register_forward_pre_hook(lambda *_, n=name: entered.add(n))
               for name, m in spec.model.named_modules()]
    amp = (torch.autocast(spec.device_type, dtype=spec.autocast) if spec.autocast is not None
           else contextlib.nullcontext())
    try:
        with restoring(dataclasses.replace(spec, seed=seed)), torch.no_grad(), amp:
            spec.call()
    except Exception:  # noqa: BLE001 - the recorded step ran; this draw only informs the search
        return None
    finally:
        for h in handles:
            h.remove()
        end_of_autocast()
    return entered


def seeds_running_all(spec: StepSpec, modules: list[str], count: int, first: int = 1000) -> list[int]:
    """Up to `count` seeds from `first` on whose draw of the step's forward calls every one of
    `modules` (a model's randomly skipped layers), trying at most `RANDOM_SKIP_DRAWS`."""
    want, seeds = set(modules), []
    for seed in range(first, first + RANDOM_SKIP_DRAWS):
        got = _entered(spec, seed)
        if got is not None and want <= got:
            seeds.append(seed)
            if len(seeds) == count:
                break
    return seeds


def _all_modules_seed(spec: StepSpec, groups: list[list[str]], entered: set[str],
                      routed: set[str]) -> tuple[int, list[str]] | None:
    """Where the recorded step skipped modules of `groups` that other random draws call
    (LayerDrop, stochastic depth by module), a seed whose draw calls every module the recorded
    one did and every module of `groups`: the step that needs the most memory; with the modules
    seen skipped in some draw. None where the skipping does not depend on the RNG (a forward
    that leaves a layer out by design) or the forward does not run without gradients; raises
    where it does and no draw of `RANDOM_SKIP_DRAWS` calls all."""
    watched = {p for g in groups for p in g}
    skipped = sorted(watched - entered)
    seen_other = False
    ever = set(entered)
    for seed in range(RANDOM_SKIP_DRAWS):
        got = _entered(spec, seed)
        if got is None:
            if seed == 0:
                return None  # its forward does not run without gradients: cannot tell
            continue
        ever |= got
        for g in _skipped_siblings(spec.model, got, routed):
            watched.update(g)  # another group some draw skips in
        # Beside the layers a draw skips, a sibling no draw calls is left out by design (an
        # optional projection x-transformers builds in every attention layer and never calls
        # unless configured): after `DESIGN_DRAWS` draws, those are not waited for.
        need = watched if seed < DESIGN_DRAWS else watched & ever
        if need | entered <= got:
            return seed, sorted(need)
        seen_other = seen_other or (got & watched) != (entered & watched)
        if seed >= 1 and not seen_other:
            return None  # three draws (the recorded one too) skip the same: not random
    names = ", ".join(skipped[:4]) + (f" (and {len(skipped) - 4} more)" if len(skipped) > 4
                                      else "")
    raise ModelRunError(
        f"{type(spec.model).__name__} skips modules at random in training (LayerDrop or "
        f"stochastic depth: {names} did not run in the profiled step, their siblings did), and "
        f"none of {RANDOM_SKIP_DRAWS} random draws ran all of them, so the step that needs the "
        "most memory cannot be profiled. Plan with layer dropping off (Hugging Face: "
        "config.layerdrop, encoder_layerdrop or decoder_layerdrop = 0 when building the model), "
        "then turn it back on: a step that skips layers needs no more memory than one that "
        "runs them all.")


def _unreleased(rec: _Recorder) -> bool:
    """Whether a storage made by the step is still alive after the step (held by a reference
    cycle until the garbage collector runs, or by something outside the step)."""
    done = rec.release_at
    return any(sid not in done and sid not in rec.fixed_kind
               for sid in range(len(rec.storage_bytes)))


_OWN_CHECKPOINT = ("ckpt-planner places checkpoints itself: remove the model's own "
                   "checkpointing (or call planner.remove(model) if it carries a plan) and plan "
                   "again")


def _foreign_hooks_error(spec: StepSpec, found: dict[str, str]) -> CkptPlannerError:
    """The model's forward ran under saved-tensor hooks of its own: autograd then saves through
    them, not through the recorder, so the profile could not say what the step keeps."""
    root = "(the root module)"
    outer = [m for m in found  # the outermost modules: their submodules ran under the same hooks
             if not any(a != m and (a == root or m.startswith(a + ".")) for a in found)]
    where = ", ".join(outer[:4]) + (f" (and {len(outer) - 4} more)" if len(outer) > 4 else "")
    hooks = set(found.values())
    if any("_checkpoint_hook" in h for h in hooks):
        what = "calls torch.utils.checkpoint itself"
    else:
        what = ("saves activations through saved-tensor hooks of its own ("
                + ", ".join(sorted(hooks)[:2]) + "; e.g. CPU offloading)")
    flags = _own_checkpoint_flags(spec.model, outer) if what.startswith("calls") else []
    hint = (" The flag that turns it on is likely " + ", ".join(f"{f}=True" for f in flags[:2])
            + " (set it to False; timm: model.set_grad_checkpointing(False))."
            if flags else "")
    return ModelRunError(
        f"{type(spec.model).__name__} {what}, in {where}: what autograd keeps there is hidden "
        f"from the profile.{hint} {_OWN_CHECKPOINT}.")


_OWN_CHECKPOINT_FLAGS = ("grad_checkpointing", "gradient_checkpointing", "use_checkpoint",
                         "memory_efficient", "checkpoint_activations", "activation_checkpointing",
                         "use_checkpointing", "checkpointing")
"""Attributes by which models turn on their own checkpointing: timm's ``grad_checkpointing``,
DenseNet's ``memory_efficient``, Swin's and many research repositories' ``use_checkpoint``."""


def _own_checkpoint_flags(model: torch.nn.Module, paths: list[str]) -> list[str]:
    """``path.attr`` of each boolean attribute of `_OWN_CHECKPOINT_FLAGS` that is True on a
    module where the model checkpointed itself, or on one of its ancestors (timm keeps the
    flag on the model or the stage, and checkpoints its blocks)."""
    named = dict(model.named_modules())
    out: list[str] = []
    for path in paths:
        parts = [] if path.startswith("(") else path.split(".")
        for n in range(len(parts), -1, -1):
            at = ".".join(parts[:n])
            m = named.get(at)
            for attr in _OWN_CHECKPOINT_FLAGS:
                name = f"{at}.{attr}" if at else f"model.{attr}"
                if m is not None and getattr(m, attr, None) is True and name not in out:
                    out.append(name)
    return out


def _run_error(spec: StepSpec, rec: _Recorder, e: Exception,
               fake: bool = False) -> CkptPlannerError:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    where = _where(rec, e)
    if isinstance(e, DataDependentOutputException | DynamicOutputShapeException):
        frames = [f.filename.replace("\\", "/") for f in traceback.extract_tb(e.__traceback__)]
        validating = any("/torch/distributions/" in f for f in frames)
        return ModelRunError(
            f"estimate mode cannot run {type(spec.model).__name__}: in module {where!r}, the "
            f"model's code needs tensor values ({type(e).__name__}: {e}), which fake tensors do "
            "not have. Profile it in measure mode (on a machine that can run one step of it, "
            "possibly at a smaller batch), or make that branch depend on shapes only."
            + (" Here it is torch.distributions checking the values of a distribution's "
               "parameters: torch.distributions.Distribution.set_default_validate_args(False) "
               "before profiling skips that check." if validating else "")
        )
    if "use_reentrant=True" in str(e):
        return ModelRunError(
            f"{type(spec.model).__name__} calls torch.utils.checkpoint(use_reentrant=True) "
            f"itself, which cannot be profiled ({type(e).__name__}: {e}). {_OWN_CHECKPOINT}.")
    grouped_mm = fake and any("grouped_mm" in f.name
                              for f in traceback.extract_tb(e.__traceback__))
    phase = {"forward": "forward", "loss": "loss_fn", "backward": "backward"}.get(rec.phase,
                                                                                   rec.phase)
    said = (f"{type(spec.model).__name__}'s training step raised in its {phase}"
            + (f", in module {where!r}" if phase == "forward" else "")
            + f": {type(e).__name__}: {str(e).rstrip('.')}.")
    if fake and "data is not allocated" in str(e):
        return ModelRunError(
            f"estimate mode cannot run {type(spec.model).__name__}: in module {where!r}, the "
            "model's code reads a tensor's data outside torch's operators (torch.tensor() of a "
            "list of tensors, .numpy(), a custom kernel), which a fake tensor cannot answer "
            f"({type(e).__name__}: {str(e).splitlines()[0]}). Profile it in measure mode (on a "
            "machine that can run one step of it, possibly at a smaller batch).")
    if grouped_mm:
        return ModelRunError(
            f"{said} It ran on fake tensors (estimate mode), whose kernel for grouped_mm (the "
            "experts' grouped matrix multiply of MoE layers) takes bfloat16 only: estimate the "
            "model with bfloat16 weights (model.to(torch.bfloat16)), as it trains on a GPU.")
    return ModelRunError(
        f"{said} The planner runs one step (model(**inputs), loss_fn, backward) exactly as "
        "training would: check that the example inputs are what the model takes and that "
        "loss_fn returns a scalar."
        + (" This step ran on fake tensors (estimate mode), where torch's fake kernels can pick "
           "another path than a real step (attention backends, fused kernels): if one real step "
           "of the model runs, profile it in measure mode (possibly at a smaller batch)."
           if fake else "")
    )


def _undo_compliance(ops: list[OpRecord], owner: dict[int, int], n_ph: int,
                     storage_bytes: list[int]) -> None:
    """Make the recording's memory that of a real step where the recorder changed it. Outside
    the recorder these run in place: an op of `_COMPLIANT_OUT_OF_PLACE` whose ``self`` is a
    zero-filled buffer made for it by the same autograd formula, read by nothing else and dying
    at it; and the engine's sum of two gradients for one input (`_ACCUMULATE`) where the first
    dies at it (the engine held its last reference: no other input, view or hook kept it).
    The output becomes that buffer (as an in-place result is): the storage it allocated is never
    allocated, and the buffer lives as long as the output did. Ops of custom
    `autograd.Function` backwards are left as recorded: their Python chose out of place
    itself.

    An output that becomes its buffer is renamed in every later op, lazily: each op takes the
    renames made so far when the loop reaches it, so that a step of many ops with many such
    outputs costs one pass."""
    renamed: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for j, r in enumerate(ops):
        for x in r.inputs:
            readers.setdefault(x, []).append(j)
    for i, r in enumerate(ops):
        if renamed:
            _rename_storages(r, renamed)
        sid = r.fills
        if (sid is None or (r.python_backward and not r.accumulates) or sid not in r.releases
                or sid not in owner or len(r.new_storages) != 1
                or r.storage != r.new_storages[0]
                or storage_bytes[r.storage] != storage_bytes[sid]):
            continue
        f = owner[sid] + n_ph if owner[sid] >= 0 else -1
        if not n_ph <= f < i:
            continue
        made = ops[f]
        if not r.accumulates and (made.op not in _ZERO_FACTORIES or made.grad_of != r.grad_of
                                  or _read_between(readers.get(f, []), f, i)):
            continue
        out = r.storage
        r.releases.remove(sid)
        r.new_storages = []
        storage_bytes[out] = 0
        renamed[out] = sid
        _rename_storages(r, {out: sid})


def _read_between(readers: list[int], f: int, i: int) -> bool:
    """Whether an op strictly between `f` and `i` is in `readers` (ascending op indices)."""
    k = bisect.bisect_right(readers, f)
    return k < len(readers) and readers[k] < i


def _rename_storages(r: OpRecord, renamed: dict[int, int]) -> None:
    """Storage numbers of `r` that `renamed` maps, replaced (its inputs are op indices)."""
    if r.storage in renamed:
        r.storage = renamed[r.storage]
    for field_ in (r.releases, r.writes):
        if any(s in renamed for s in field_):
            field_[:] = [renamed.get(s, s) for s in field_]
    if r.fills in renamed:
        r.fills = renamed[r.fills]
    for out in [s for s in r.saves if s in renamed]:
        r.saves.discard(out)
        r.saves.add(renamed[out])


def _rows(spec, rec: _Recorder, ops: list[OpRecord], grad_sids: list[int], owner_of
          ) -> dict[int, int]:
    """First dimensions of the parameters and of their gradients, by op index."""
    def first(t: torch.Tensor) -> int:
        return int(t.shape[0]) if t.dim() else 0

    rows = {i: first(spec.params[r.name]) for i, r in enumerate(ops)
            if r.phase == "param" and r.name in spec.params}
    grad_rows = getattr(rec, "grad_rows", [])
    if len(grad_rows) == len(grad_sids):
        rows.update({owner_of(s): n for s, n in zip(grad_sids, grad_rows, strict=True)})
    return rows


def _release_wrapped(rec: _Recorder) -> None:
    """Where each saved wrapped number (`_Recorder.wrapped`) dies: with its node's saved
    variables, as the node's formula returns (its last op but the engine's accumulations); a
    node whose backward never ran dies with its output."""
    if not rec.wrapped:
        return
    formula_end: dict[int, int] = {}
    for j, r in enumerate(rec.ops):
        if r.grad_of is not None and not r.accumulates:
            formula_end[r.grad_of] = j
    for sid, f in rec.wrapped.items():
        out = rec.ops[f].storage
        fallback = rec.release_at.get(out, len(rec.ops) - 1) if out is not None else len(rec.ops) - 1
        rec.release_at[sid] = formula_end.get(f, fallback)


def _assemble(spec, rec: _Recorder, out_sids, loss_sid, grad_sids, input_shapes) -> Recording:
    """Placeholders first, then ops; record indices shifted accordingly; saves and releases."""
    n_ph = len(rec.placeholders)

    def shift(i: int) -> int:
        return i + n_ph if i >= 0 else -1 - i  # placeholders: owner index -1 - k

    ops = rec.placeholders + rec.ops
    _release_wrapped(rec)
    for k, r in enumerate(rec.ops):
        if r.phase == "backward" and r.grad_of is not None and not r.accumulates:
            r.before_unpack = k < rec.unpack_at.get(r.grad_of, -1)
    for r in rec.ops:
        r.inputs = [shift(i) for i in r.inputs]
        if r.grad_of is not None:
            r.grad_of = shift(r.grad_of)
    for seq, sid in rec.packs:
        f = rec.seq_owner.get(seq)
        if f is not None and rec.ops[f].op == "aten.clone.default" and rec.owner.get(sid) == f:
            # The original an in-place op overwrites, which its backward needs (``w /= s``
            # with `s` requiring grad saves a clone of `w`): autograd clones it after making
            # the op's node, so the clone's own node number is current when the copy is saved;
            # the op's node (the number before) saves it and holds it until its backward.
            g = rec.seq_owner.get(seq - 1)
            if g is not None and g > f and rec.ops[g].writes:
                f = g
        if f is not None:
            rec.ops[f].saves.add(sid)
    last = len(ops) - 1
    for sid in range(len(rec.storage_bytes)):
        if sid in rec.fixed_kind:
            continue
        # never released: something outside the step holds it (a cache on a module)
        pos = rec.release_at.get(sid, last - n_ph)
        target = min(max(pos + n_ph, n_ph), last)
        ops[target].releases.append(sid)
    _undo_compliance(ops, rec.owner, n_ph, rec.storage_bytes)

    def owner_of(sid: int) -> int:
        return shift(rec.owner[sid])

    calls = [ModuleCall(c.module, c.start + n_ph, c.end + n_ph, c.holds, c.args, c.mirror,
                        c.reseeds) for c in rec.calls]
    # by first op, the outer of two calls first (also where they span the same ops)
    calls.sort(key=lambda c: (c.start, -c.end, c.module.count(".") + (c.module != "")))
    named = dict(spec.model.named_parameters())
    return Recording(
        ops=ops,
        storage_bytes=rec.storage_bytes,
        calls=calls,
        loss=owner_of(loss_sid),
        grads=[owner_of(s) for s in grad_sids],
        rows=_rows(spec, rec, ops, grad_sids, owner_of),
        outputs=[owner_of(s) for s in out_sids if s in rec.owner],
        param_names=list(spec.params),
        trainable={k: bool(named[k].requires_grad) if k in named else bool(v.requires_grad)
                   for k, v in spec.params.items()},
        input_shapes=input_shapes,
        module_paths=[n for n, _ in spec.model.named_modules()],
        attribute_stores=[(i + n_ph, a, sid) for i, a, sid in rec.attribute_stores],
        attribute_rereads=[(i + n_ph, a) for i, a in rec.attribute_rereads],
        called_in_backward=sorted(rec.called_in_backward),
        outside_modules=[f"{k} ({c} call{'s' if c != 1 else ''}, {n} ops)"
                         for k, (c, n) in sorted(rec.outside.items(), key=lambda kv: -kv[1][1])],
        differentiated_in_forward=sorted(shift(i) for i in rec.differentiated),
        sequential={
            n: list(m._modules)
            for n, m in spec.model.named_modules()
            if isinstance(m, torch.nn.Sequential) and type(m).forward is torch.nn.Sequential.forward
            and "forward" not in m.__dict__
        },
    )


_ALIGN_SKIP = frozenset({"aten.detach.default"})
"""Ops that autograd issues or not depending on whether saved-tensor hooks are set (saved outputs
are detached for the unpack): left out when runs are matched op for op; they cost nothing."""


def _align(ops: list[OpRecord], names: list[str]) -> list[int | None] | None:
    """For each op of the structure pass, its position in a light pass's `names`; None when the
    light pass ran another sequence of ops (value-dependent code taking another branch)."""
    mine = [k for k, r in enumerate(ops) if r.op not in _ALIGN_SKIP]
    theirs = [j for j, n in enumerate(names) if n not in _ALIGN_SKIP]
    if [ops[k].op for k in mine] != [names[j] for j in theirs]:
        return None
    out: list[int | None] = [None] * len(ops)
    for k, j in zip(mine, theirs, strict=True):
        out[k] = j
    return out


MATCH_WINDOW = 64
"""How far ahead `_match` looks, in each run, for the two runs' ops to agree again."""
MATCH_RUN = 4
"""Ops in a row that must agree for `_match` to take up matching again after a difference."""
MATCH_LEAST = 0.95
"""The share of ops `_match` must pair for a light pass to count at all."""


def _match(ops: list[OpRecord], names: list[str]) -> list[int | None] | None:
    """As `_align`, tolerating a few ops that one pass ran and the other did not: where the
    sequences differ, matching resumes at the nearest point (within `MATCH_WINDOW` ops of
    either) from which `MATCH_RUN` ops agree, and the ops skipped on the way are unmatched
    (None). The structure pass's backward may run an op the light passes do not (a clone in
    Autoformer's FFT backward, likely where the recorder holds a reference the autograd engine
    then sees); `_align` would drop the whole pass for it. None when fewer than `MATCH_LEAST` of the ops pair up (value-
    dependent code taking another branch). For op times and workspaces only: stages need
    `_align`'s exact match."""
    exact = _align(ops, names)
    if exact is not None:
        return exact
    mine = [k for k, r in enumerate(ops) if r.op not in _ALIGN_SKIP]
    theirs = [j for j, n in enumerate(names) if n not in _ALIGN_SKIP]
    a, b = [ops[k].op for k in mine], [names[j] for j in theirs]
    out: list[int | None] = [None] * len(ops)
    i = j = paired = 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            out[mine[i]] = theirs[j]
            paired += 1
            i, j = i + 1, j + 1
            continue
        step = next(((di, d - di) for d in range(1, 2 * MATCH_WINDOW + 1)
                     for di in range(max(0, d - MATCH_WINDOW), min(d, MATCH_WINDOW) + 1)
                     if a[i + di:i + di + MATCH_RUN] == b[j + d - di:j + d - di + MATCH_RUN]
                     and len(a[i + di:i + di + MATCH_RUN]) == MATCH_RUN), None)
        if step is None:
            break
        i, j = i + step[0], j + step[1]
    return out if paired >= MATCH_LEAST * max(len(a), 1) else None


class _StagingForward:
    """During the stage run: a module's forward run through its trace, noting the light
    recorder's op count before each node, and for each node's tensor results the light op that
    made each one's storage (`_Recorder.made_by`; None for one no op of the step made)."""

    def __init__(self, name: str, module: torch.nn.Module, rec: _Recorder,
                 found: dict[str, tuple[Any, list[tuple[int, int]],
                                        dict[int, list[tuple[int, int] | None]]]]):
        self.name, self.module, self.rec, self.found = name, module, rec, found
        self.orig = type(module).forward.__get__(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        pattern = call_pattern(self.module, args, kwargs)
        sg = None
        if pattern is not None and self.name not in self.found:
            self.rec.suspended += 1  # tracing runs no op of the step
            try:
                sg = trace(self.module, pattern)
            finally:
                self.rec.suspended -= 1
        if sg is None:
            return self.orig(*args, **kwargs)
        marks: list[tuple[int, int]] = []
        made: dict[int, list[tuple[int, int] | None]] = {}
        objects: dict[int, Any] = {}
        # the recorder's own dict, filled as ops run: empty (falsy) where this forward is the
        # step's first call (the root's), so `or {}` would have read a dict nothing fills
        names = self.rec.names
        made_by = self.rec.made_by if self.rec.made_by is not None else {}

        def makers(tensors: list[torch.Tensor]) -> list[tuple[int, int] | None]:
            return [made_by.get(id(t.untyped_storage())) for t in tensors
                    if t.layout == torch.strided]

        def on_result(k: int, value: Any) -> None:
            made[k] = makers(_tensors(value))
            if not isinstance(value, torch.Tensor):
                objects[k] = value

        out = sg.run(self.module, args, kwargs, on_node=lambda k: marks.append((k, len(names))),
                     on_result=on_result)
        # A result that is an object (x-transformers' attention intermediates, a list filled
        # later in the call) reaches tensors a run given it keeps by reference until its
        # backward: what it reaches as the call returns, as `ModuleCall.holds` for a call.
        for k, value in objects.items():
            made[k] = list(dict.fromkeys(made[k] + makers(reachable_tensors(value))))
        objects.clear()
        marks.append((len(sg.exec), len(names)))
        self.found[self.name] = (sg, marks, made)
        return out


def _find_stages(spec: StepSpec, recording: Recording) -> dict[str, Staged]:
    """Run the step once more, light, with every stageable module called once in the step
    running its traced forward (`planner.stages`), and map each node's first op to the
    recording.

    Tracing does not see context managers (a `torch.no_grad()` block, a decorated helper): a
    staged module whose forward ops ran with another grad mode than recorded is left out (the
    innermost staged call around such an op; its callers still stage it as one call) and the
    run is repeated without it. Nothing is staged when the run's op sequence still differs from
    the recording's (a trace that does not reproduce the model's code) or it raises."""
    per_module: dict[str, int] = {}
    for c in recording.calls:
        per_module[c.module] = per_module.get(c.module, 0) + 1
    call_of = {c.module: c for c in recording.calls if per_module[c.module] == 1}
    allowed = {name: m for name, m in spec.model.named_modules()
               if name in call_of and stageable(m)}
    ops = [r for r in recording.ops if r.phase in ("forward", "loss", "backward")
           and r.op != "getitem"]
    fwd_ops = [r for r in ops if r.phase == "forward"]
    for _ in range(4):
        if not allowed:
            return {}
        rec = _Recorder(structure=False)
        rec.made_by = {}
        found: dict[str, tuple[Any, list[tuple[int, int]],
                               dict[int, list[tuple[int, int] | None]]]] = {}
        for name, m in allowed.items():
            m.__dict__["forward"] = _StagingForward(name, m, rec, found)
        try:
            with restoring(spec), rec:
                run_step(spec, rec, hooks=False)
        except Exception:  # noqa: BLE001 - a trace that cannot run the step gives no stages
            return {}
        finally:
            for m in allowed.values():
                m.__dict__.pop("forward", None)
        fwd_idx = [j for j, ph in enumerate(rec.phases) if ph == "forward"]
        wf = _align(fwd_ops, [rec.names[j] for j in fwd_idx])
        if wf is None:
            return {}
        bad = [fwd_idx[j] for k, j in enumerate(wf)
               if j is not None and rec.grad_modes[fwd_idx[j]] != fwd_ops[k].grad_mode]
        if not bad:
            break
        spans = sorted(((marks[0][1], marks[-1][1], name) for name, (_, marks, _) in found.items()),
                       key=lambda t: t[1] - t[0])
        culprits = {next((name for a, b, name in spans if a <= j < b), None) for j in bad}
        if None in culprits:
            return {}
        for name in culprits:
            del allowed[name]
    else:
        return {}
    where = _align(ops, rec.names)
    if where is None:
        return {}
    index = {id(r): i for i, r in enumerate(recording.ops)}
    # light op j -> index in recording.ops of the first recorded op at or after it
    first_at: dict[int, int] = {}
    for k in range(len(ops) - 1, -1, -1):
        if where[k] is not None:
            first_at[where[k]] = index[id(ops[k])]
    n_light = len(rec.names)
    nxt = len(recording.ops)
    at = [0] * (n_light + 1)
    at[n_light] = nxt
    for j in range(n_light - 1, -1, -1):
        nxt = first_at.get(j, nxt)
        at[j] = nxt
    light_at = {j: index[id(ops[k])] for k, j in enumerate(where) if j is not None}

    def storage(j: int, pos: int) -> int | None:
        """The recording's storage id of tensor output `pos` of light op `j`."""
        i = light_at.get(j)
        if i is None:
            return None
        rops = recording.ops
        if rops[i].storage is not None:
            return rops[i].storage if pos == 0 else None
        k = i + 1 + pos  # a tuple's tensors follow the op as getitems, in order
        ok = k < len(rops) and all(g.op == "getitem" and g.inputs == [i] for g in rops[i + 1:k + 1])
        return rops[k].storage if ok else None

    out = {}
    for name, (sg, marks, made) in found.items():
        c = call_of[name]
        nodes, starts = [], []
        for (k, j), (_, j_next) in zip(marks, marks[1:], strict=False):
            if j_next > j and c.start <= at[j] <= c.end and (not starts or at[j] > starts[-1]):
                nodes.append(k)
                starts.append(at[j])
        end = at[marks[-1][1]]
        if len(starts) < 2 or end > c.end + 1:
            continue
        results = {sg.exec[k]: [s for jp in v if jp is not None
                                for s in (storage(*jp),) if s is not None]
                   for k, v in made.items()}
        out[name] = Staged(sg.pattern.to_json(), sg.fingerprint, (*nodes, len(sg.exec)),
                           (*starts, end),
                           _stage_arguments(sg, c, (*nodes, len(sg.exec)), results))
    return out


def _stage_arguments(sg: Any, c: ModuleCall, nodes: tuple[int, ...],
                     results: dict[Any, list[int]]) -> tuple[tuple[int, ...], ...]:
    """For each stage, the storages of the tensors its nodes take (as values, not only their
    metadata) from outside it: the call's arguments, and the results of earlier stages
    (`results`: an exec node's tensor results' storages). A run of stages is passed those,
    whether its ops read them or not: an HF layer hands `position_ids` to its attention, which
    reads none; x-transformers passes every earlier layer's output in a list its residual
    ignores."""
    ref: dict[Any, Any] = {}
    if c.mirror is not None:
        with contextlib.suppress(TypeError):
            ref = dict(zip(sg.placeholders, sg.values(*c.mirror), strict=True))
    out = []
    for i, j in zip(nodes, nodes[1:], strict=False):
        ins, _ = sg.io(i, j - 1)
        out.append(tuple(sorted({ref[a].sid for a in ins if isinstance(ref.get(a), StorageRef)}
                                | {s for a in ins for s in results.get(a, ())})))
    return tuple(out)


def _time_ops(spec: StepSpec, recording: Recording, repeats: int, sync) -> None:
    """Median time of every op over `repeats` runs (after one warm-up), set on the records. A
    run that dispatches another sequence of ops than the structure pass (value-dependent code
    taking another branch) is left out."""
    ops = [r for r in recording.ops if r.phase in ("forward", "loss", "backward")
           and r.op != "getitem"]
    runs: list[list[float | None]] = []
    for k in range(repeats + 1):
        rec = _Recorder(timed=True, structure=False, sync=sync)
        with restoring(spec), rec:
            run_step(spec, rec, hooks=False)
        where = _match(ops, rec.names)
        if k == 0 or where is None:
            continue
        runs.append([None if j is None else rec.times[j] for j in where])
    if not runs:
        return
    for j, r in enumerate(ops):
        # an op no light pass ran (`_match`'s unmatched ops): detach, which costs nothing, or
        # a clone only the structure pass made
        times = [run[j] for run in runs if run[j] is not None]
        r.time_ms = round(statistics.median(times), 6) if times else 0.0
    # one unrecorded step, for the step time the overheads are relative to
    plain = []
    for _ in range(max(2, repeats) + 1):
        with restoring(spec):
            sync()
            t0 = time.perf_counter()
            run_step(spec, None, hooks=False)
            sync()
            plain.append((time.perf_counter() - t0) * 1e3)
    recording.step_ms = round(statistics.median(plain[1:]), 3)


_EVALUATE = "autograd::engine::evaluate_function: "
"""The profiler scope the autograd engine opens around each node's whole evaluation (its
formula runs in a scope named after the node, inside it)."""


def _measure_workspace(spec: StepSpec, recording: Recording) -> None:
    """Bytes each op allocates and frees again while it runs (beyond its outputs), from the
    profiler's allocation events inside a per-op `record_function` window: the peak of the
    running sum within the window minus what is still held at its end."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ops = [r for r in recording.ops if r.phase in ("forward", "loss", "backward")
           and r.op != "getitem"]
    rec = _Recorder(structure=False, marked=True)
    with restoring(spec), torch_profile(activities=[ProfilerActivity.CPU],
                                         profile_memory=True) as prof, rec:
        run_step(spec, rec, hooks=False)
    where = _match(ops, rec.names)
    if where is None:
        return
    at = {j: k for k, j in enumerate(where) if j is not None}

    def allocations(e, acc):
        for c in e.children:
            if c.tag == _EventType.Allocation:
                acc.append((c.start_time_ns, c.extra_fields.alloc_size))
            else:
                allocations(c, acc)
        return acc

    todo = [(e, "") for e in prof.profiler.kineto_results.experimental_event_tree()]
    while todo:
        e, node = todo.pop()
        if e.name.startswith("ckpt_op::"):
            if node.startswith(_EVALUATE):
                # directly in the engine's scope for the node, not in the node's own (its
                # formula): run after the formula returned
                k = at.get(int(e.name.removeprefix("ckpt_op::")))
                if k is not None and ops[k].phase == "backward":
                    ops[k].after_formula = True
            cur = peak = 0
            for _, delta in sorted(allocations(e, [])):
                cur += delta
                peak = max(peak, cur)
            k = at.get(int(e.name.removeprefix("ckpt_op::")))
            if k is not None:
                ops[k].workspace_bytes = max(peak - max(cur, 0) - ops[k].rewrapped_bytes, 0)
        else:
            # the innermost engine scope above, or the node's own scope inside it
            inner = e.name if e.name.startswith(_EVALUATE) or (
                node.startswith(_EVALUATE) and e.name == node.removeprefix(_EVALUATE)) else node
            todo.extend((c, inner) for c in e.children)

