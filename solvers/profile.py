"""The Profile: a torch-free record of one training step's joint (forward + backward) graph.

A profile is what the planner knows about a model. `planner.profile` records it by running one real
training step of the model (forward, loss, backward) and watching every aten op it dispatches; it is
plain data: it can be saved on a GPU box and planned anywhere, with no torch installed.

Memory is described at the level of storages, because that is what an allocator sees: views and
in-place ops create no storage, and one storage may be read through many nodes. Every node names the
storage its output lives in (`storage`) and the storages it allocates (`new_storages`); a forward node
lists the storages its autograd node saved for backward (`saves`); a backward node names the forward
node whose autograd node ran it (`grad_of`), whether that node's backward is Python code
(`python_backward`, a custom autograd.Function) and whether the op is the engine's sum of two
gradients after that node's formula returned (`accumulates`); a node lists the storages whose
last reference the model's own code dropped right after it ran (`releases`: autograd's saved
copies do not count).

`calls` lists every call of a module's `forward` as a span of forward nodes: the regions a plan
applied to the model's own modules can checkpoint.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from solvers.errors import ProfileError

__all__ = [
    "COLLECTIVE_PREFIX",
    "DTYPE_BYTES",
    "FIXED_PHASES",
    "PHASES",
    "SCHEMA",
    "SCHEMA_VERSION",
    "ModuleCall",
    "Node",
    "Profile",
    "ProfileMeta",
    "cached",
]

SCHEMA = "ckpt-planner/profile"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Version 1 profiles (from the make_fx tracer) have no `calls` and no `releases`; they still plan
offline with node-range regions."""

# Order of phases in a trace. "param", "buffer" and "input" nodes are placeholders (fixed memory);
# "forward" nodes are the model's forward (the only ones a schedule may checkpoint); "loss" nodes turn
# the model's output into the scalar loss; "backward" nodes are what autograd ran.
PHASES = ("param", "buffer", "input", "forward", "loss", "backward")
FIXED_PHASES = frozenset({"param", "buffer", "input"})

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the floating dtypes a profile's mixed-precision fields name."""

COLLECTIVE_PREFIX = "fsdp."
"""Ops of the nodes `solvers.distributed.per_rank` adds for FSDP2's all-gathers, reshards and
reduce-scatters: they run no kernel of the model and no region may contain one."""


@dataclass(frozen=True, kw_only=True)
class Node:
    """One aten op (or placeholder) of the joint graph."""

    name: str
    """Unique fx node name, e.g. ``addmm_3``."""
    op: str
    """The aten overload (``aten.addmm.default``), ``getitem``, or ``placeholder``."""
    phase: str
    """One of `PHASES`."""
    inputs: tuple[str, ...] = ()
    """Names of the nodes whose outputs this node reads (tensor arguments only)."""
    module: str = ""
    """Dotted path of the module that issued the op (forward nodes), e.g. ``transformer.h.3.attn``."""
    storage: int | None = None
    """Id of the storage this node's output tensor lives in; None for tuple or non-tensor outputs."""
    storage_parts: tuple[int, ...] = ()
    """For a sparse output: the storages of its indices (`storage` is its values'). An op that
    reads the output reads them all (a checkpoint that takes it as input keeps them all)."""
    new_storages: tuple[int, ...] = ()
    """Storages this node allocates (empty for views, in-place ops and getitem)."""
    saves: tuple[int, ...] = ()
    """Forward nodes: storages that this node's autograd node keeps for backward."""
    grad_of: str | None = None
    """Backward nodes: the forward node whose autograd node ran this op (None for the seed)."""
    python_backward: bool = False
    """Backward nodes: the autograd node that ran this op is written in Python (a custom
    `torch.autograd.Function`), so what the op makes dies at its last reference, as Python
    frees it, not when the backward formula returns as a C++ formula's temporaries do."""
    accumulates: bool = False
    """Backward nodes: the autograd engine's sum of two gradients for one input (`InputBuffer`),
    run after the formula of `grad_of`'s node returned. That node's saved tensors were released
    before it (`GraphIndex.bw_end` ends the node's backward at its last other op)."""
    after_formula: bool = False
    """Backward nodes: run by the engine after the formula of `grad_of`'s node returned, before
    the node's saved tensors are released: `validate_outputs` reducing a broadcast gradient to
    its input's shape (``sum_to``) or casting it. A region's replayed copies the node unpacked
    died as the formula returned (`GraphIndex.apply_end`); what it saves itself lives through
    these."""
    before_unpack: bool = False
    """Backward nodes: run by `grad_of`'s autograd node before it unpacked its saved tensors,
    so before a region that saved them replays: CopySlices' copies of the gradient (the node of
    an in-place op on a view), which its wrapped formula unpacks after. Absent from older
    profiles, where a C++ node is taken to unpack before its first op."""
    workspace_bytes: int = 0
    """Bytes the op allocates and frees again while it runs (beyond its outputs); measured on
    CPU from allocation events, 0 where unknown (estimate mode)."""
    flops: int = 0
    """Floating-point operations (FlopCounterMode's count; 0 for elementwise ops)."""
    bytes_moved: int = 0
    """Bytes read plus bytes written (inputs and outputs), for a roofline estimate."""
    time_ms: float = 0.0
    """Run time of this op: measured median, or a roofline estimate (see `ProfileMeta.mode`)."""
    random: bool = False
    """The op draws from the RNG (dropout): replaying it needs the RNG state restored."""
    mutates_buffer: bool = False
    """The op updates a module buffer in place (BatchNorm running statistics)."""
    fills_saved: bool = False
    """Forward nodes: the op writes in place into a tensor it saves, other than its output
    (``rrelu_with_noise`` fills the ``noise`` it is given). Its autograd node saves the tensor
    before the kernel runs, so a replay that stops there (`solvers.chain.early_stops`) hands
    backward the tensor unwritten (pytorch/pytorch#193671)."""
    releases: tuple[int, ...] = ()
    """Storages whose last reference held by the model's code (not by autograd) died right after
    this node ran. A storage no node releases dies after its last reader."""
    no_grad_storages: tuple[int, ...] = ()
    """Forward nodes: storages of `new_storages` holding integer or boolean outputs (`topk`'s
    indices), which have no `grad_fn`: they do not keep this node's autograd node alive."""
    detached_reads: tuple[int, ...] = ()
    """Forward nodes: storages the op read only through tensors that do not require grad (a
    ``detach``ed alias, a value computed from one) or with grad mode off. Its autograd node
    holds no edge to their makers' nodes, so it does not keep a node that never runs backward
    alive (`GraphIndex.dead_ends`). Empty where unknown (profiles saved before it was
    recorded): every read is then taken to hold one."""
    rows: int = 0
    """Parameters, and the backward nodes holding their gradients (`Profile.grads`): the size of
    the tensor's first dimension, along which FSDP2 shards it, padding it to a multiple of the
    ranks (`solvers.distributed.per_rank`); 0 where unknown or a scalar."""


@dataclass(frozen=True, kw_only=True)
class ModuleCall:
    """One call of a module's `forward` during the step: a span of forward nodes."""

    module: str
    """Dotted module path (``model.layers.3.self_attn``); "" is the root module."""
    start: str
    """First forward node of the call."""
    end: str
    """Last forward node of the call (inclusive)."""
    blocker: str = ""
    """Why this call cannot be a checkpointed region ("" when it can), e.g. an in-place write to
    a tensor made before the call, or a KV cache it stores into. The calls of a module called
    more than once in the step (weights shared across depth) are regions only all together
    (`solvers.chain.shared_calls`); profiles recorded before that was supported block them."""
    buffers: tuple[str, ...] = ()
    """Buffers the call updates in place (BatchNorm running statistics), by dotted name."""
    restores: tuple[str, ...] = ()
    """Those of `buffers` that the call reads again after updating them (spectral norm's power
    iteration): its output depends on the values it started from, so a region over the call
    keeps a copy of them from its forward (`Region.restores`) and replays from that copy."""
    holds: tuple[int, ...] = ()
    """Storages a checkpoint of the call keeps by reference beyond the tensors its ops read:
    what the objects among its arguments reach when forward ends (a KV cache passed to every
    layer holds what later layers add), and tensor arguments its ops never read. They live
    until the region's backward."""
    children: tuple[str, ...] = ()
    """For a module whose forward is `torch.nn.Sequential`'s (each child's output is the next
    child's input, nothing in between): its children's names, in order. Any run of consecutive
    children can then be one region (`checkpoint_sequential`'s segments)."""
    staged: str = ""
    """For a module whose forward traces (`planner.stages`): the traced call's pattern and the
    trace's fingerprint, as JSON; "" otherwise. Any run of consecutive stages (`stages`) can then
    be one region, which `planner.apply` runs through the trace."""
    stages: tuple[str, ...] = ()
    """First forward node of each stage (a node of the traced forward that ran ops)."""
    stage_last: tuple[str, ...] = ()
    """Last forward node of each stage."""
    stage_nodes: tuple[int, ...] = ()
    """Position of each stage's first node among the trace's nodes, then their number."""
    stage_limits: tuple[int, ...] = ()
    """For each stage, the last stage a region starting there may reach (an in-place write to a
    tensor made before the region's start ends it; one less than the stage: none)."""
    stage_args: tuple[tuple[int, ...], ...] = ()
    """For each stage, the storages of the values its trace nodes take from outside it: the
    call's tensor arguments and earlier stages' results, and the tensors an object among them
    reaches. A run of stages is passed them (and its checkpoint keeps them) whether its ops
    read them or not, and the generated code holds them until the last stage passed them is
    done. Empty in profiles recorded before it was kept."""


@dataclass(frozen=True, kw_only=True)
class ProfileMeta:
    """What a profile was measured on."""

    model_class: str = ""
    device: str = "cpu"
    """Device type the times refer to (``cpu``, ``cuda``)."""
    device_name: str = ""
    """Human name of the device, e.g. ``NVIDIA H100 SXM`` or the CPU model."""
    mode: str = "measure"
    """``measure`` (times measured by running every op) or ``estimate`` (roofline, fake tensors)."""
    dtype: str = "float32"
    torch_version: str = ""
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    created: str = ""
    step_ms_measured: float | None = None
    """Median measured time of one eager training step of the original model, when measured."""
    checkpoint_region_ms: float = 0.0
    """Host time non-reentrant checkpoint adds per region (frame, hooks, early stop), calibrated on
    the device in measure mode; 0 in estimate mode (on a GPU it overlaps with kernels)."""
    checkpoint_saved_tensor_ms: float = 0.0
    """Host time per tensor a region saves (pack and unpack hooks, twice), calibrated likewise."""
    checkpoint_selective_op_ms: float = 0.0
    """Host time per op of a selective region (its dispatch mode sees every op in forward and in
    the replay), calibrated likewise and on the model's own forward (the larger of the two)."""
    autocast: str = ""
    """The dtype forward and loss ran in under `torch.autocast` (``bfloat16``, ``float16``); ""
    when the step ran without autocast."""
    data_dependent_ops: int = 0
    """Forward ops whose output shapes depend on tensor values (``nonzero``, boolean indexing,
    MoE routing): memory then differs from batch to batch, and the profile is exact only for the
    batch it recorded."""
    random_skips: list[str] = field(default_factory=list)
    """Modules the model skips at random in training (LayerDrop): the profiled step is a random
    draw that runs every one of them, the most memory any draw needs."""
    outside_modules: list[str] = field(default_factory=list)
    """Modules with parameters the step's forward ran that are not submodules of the model (as
    ``Class (N calls, M ops)``): their ops count as their caller's, and no region can be placed
    on them (torchrl's losses keep their networks outside their module tree)."""
    capture: str = "graph"
    """How the step was captured: ``run`` (`planner.profile` ran one real step; regions are module
    calls, applied to the model in place) or ``graph`` (a traced graph, version 1 profiles, or a
    profile built by hand; regions are any node ranges)."""
    world_size: int = 1
    """Ranks of data parallelism the profile describes one of (`solvers.distributed.per_rank`);
    1 for a single process."""
    sharding: str = ""
    """``ddp`` (full parameters and gradients on every rank, plus DDP's gradient buckets),
    ``fsdp`` (FSDP2 `fully_shard`: parameters, gradients and optimizer state sharded, the units
    in flight all-gathered), or "" for a single process."""
    shard_units: list[str] = field(default_factory=list)
    """With ``fsdp``: the modules `fully_shard` is applied to besides the root, in forward order."""
    fsdp_mixed_precision: dict[str, str] = field(default_factory=dict)
    """FSDP2's `MixedPrecisionPolicy` the step was recorded for ({} for none): ``param_dtype``,
    what the parameters (and floating inputs) were cast to for the recorded step, as FSDP2
    all-gathers them; ``orig_dtype``, what they are stored, sharded and stepped in; and
    ``reduce_dtype``, what gradients are reduce-scattered in. Dtype names as in `DTYPE_BYTES`.
    `solvers.distributed.per_rank` sizes the shards, sharded gradients and optimizer state in
    ``orig_dtype`` and the reduce-scatter in ``reduce_dtype``."""
    grads_held: bool = False
    """Every trainable parameter's gradient is held when the step starts (a micro-batch after the
    first under gradient accumulation: `solvers.accumulation.holding_grads`); False for a step
    that starts with none, as recorded."""
    measured_peak_bytes: int | None = None
    """Measure mode: the peak of one plain step of the model as profiled (no plan), measured
    (`planner.measure`) to check the recording against; None where not measured (estimate mode,
    several processes, random skipping)."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    """A training step's joint graph with per-node memory and time. Construct with `Profile.load`
    or `planner.profile`; direct construction validates everything."""

    nodes: tuple[Node, ...]
    storage_bytes: tuple[int, ...]
    """Bytes of every storage, indexed by storage id."""
    model_outputs: tuple[str, ...] = ()
    """Forward nodes that are the model's outputs, flattened."""
    loss: str = ""
    """The node holding the scalar loss."""
    grads: tuple[str, ...] = ()
    """Backward nodes holding parameter gradients (kept until the optimizer step)."""
    grad_bytes: int = 0
    """Bytes of parameter gradients (trainable parameters only), alive after backward."""
    optimizer_state_bytes: int = 0
    """Optimizer state held between steps (Adam: two fp32 tensors per trainable parameter)."""
    optimizer_step_bytes: int = 0
    """Transient bytes the optimizer's step allocates on top of its state."""
    calls: tuple[ModuleCall, ...] = ()
    """Every module `forward` call of the step, in order of their first node (outer first)."""
    meta: ProfileMeta = field(default_factory=ProfileMeta)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _validate(self)
        # What `cached` derives from this profile; not a field (not compared, printed or saved).
        object.__setattr__(self, "_derived", {})

    # -- derived quantities ------------------------------------------------------------------
    def index(self, name: str) -> int:
        """Position of the node called `name` in `nodes`."""
        try:
            return cached(self, "node_index", _node_index)[name]
        except KeyError:
            raise KeyError(f"no node named {name!r} in this profile") from None

    def phase_bytes(self, *phases: str) -> int:
        """Bytes of the storages allocated by nodes of the given phases."""
        return sum(
            self.storage_bytes[s] for n in self.nodes if n.phase in phases for s in n.new_storages
        )

    @property
    def param_bytes(self) -> int:
        return self.phase_bytes("param")

    @property
    def buffer_bytes(self) -> int:
        return self.phase_bytes("buffer")

    @property
    def input_bytes(self) -> int:
        return self.phase_bytes("input")

    @property
    def held_bytes(self) -> int:
        """Bytes of tensors the step reads that the model holds outside its parameters and
        buffers (a cached position index or mask, a tensor attribute): counted in
        `buffer_bytes`, as they are held before the step; `planner.measure` cannot see them
        and takes them as ``held_bytes``."""
        return sum(self.storage_bytes[s] for n in self.nodes
                   if n.phase == "buffer" and n.module == "constant" for s in n.new_storages)

    @property
    def fixed_bytes(self) -> int:
        """Memory held before the step starts: parameters, buffers, inputs, optimizer state."""
        return self.param_bytes + self.buffer_bytes + self.input_bytes + self.optimizer_state_bytes

    @property
    def forward_indices(self) -> list[int]:
        """Positions of the nodes a schedule may checkpoint, in execution order."""
        return [i for i, n in enumerate(self.nodes) if n.phase == "forward"]

    @property
    def saved_storages(self) -> set[int]:
        """Storages kept for backward by forward and loss nodes, fixed memory excluded."""
        fixed = {s for n in self.nodes if n.phase in FIXED_PHASES for s in n.new_storages}
        return {s for n in self.nodes for s in n.saves} - fixed

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd keeps for backward after a forward pass with no checkpointing."""
        return sum(self.storage_bytes[s] for s in self.saved_storages)

    def saved_bytes_by_module(self, depth: int = 3) -> dict[str, int]:
        """Saved-activation bytes by the module whose op allocated each storage, module paths cut
        to their first `depth` components (``transformer.h.3``); "" is the top level."""
        allocator = {s: n.module for n in self.nodes for s in n.new_storages}
        totals: dict[str, int] = {}
        for s in self.saved_storages:
            mod = ".".join(allocator.get(s, "").split(".")[:depth])
            totals[mod] = totals.get(mod, 0) + self.storage_bytes[s]
        return totals

    @property
    def step_ms(self) -> float:
        """Sum of all op times: forward, loss and backward."""
        return sum(n.time_ms for n in self.nodes)

    @property
    def forward_ms(self) -> float:
        return sum(n.time_ms for n in self.nodes if n.phase == "forward")

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        defaults = {f.name: f.default for f in dataclasses.fields(Node)}
        nodes = []
        for n in self.nodes:
            d = {}
            for k, v in dataclasses.asdict(n).items():
                if k in ("name", "op", "phase") or v != defaults[k]:
                    d[k] = list(v) if isinstance(v, tuple) else v
            nodes.append(d)
        return {
            "schema": SCHEMA,
            "schema_version": self.schema_version,
            "meta": dataclasses.asdict(self.meta),
            "model_outputs": list(self.model_outputs),
            "loss": self.loss,
            "grads": list(self.grads),
            "grad_bytes": self.grad_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "optimizer_step_bytes": self.optimizer_step_bytes,
            "storage_bytes": list(self.storage_bytes),
            "calls": [
                {k: (list(v) if isinstance(v, tuple) else v)
                 for k, v in dataclasses.asdict(c).items() if k in ("module", "start", "end") or v}
                for c in self.calls
            ],
            "nodes": nodes,
        }

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "profile") -> Profile:
        if not isinstance(d, dict):
            raise ProfileError(f"{source}: expected a JSON object, found {type(d).__name__}")
        if d.get("schema") != SCHEMA:
            raise ProfileError(
                f"{source}: field 'schema' is {d.get('schema')!r}, expected {SCHEMA!r}; "
                "is this a ckpt-planner profile?"
            )
        version = d.get("schema_version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise ProfileError(
                f"{source}: schema_version {version!r} is not supported (this ckpt-planner reads "
                f"versions {', '.join(map(str, READABLE_VERSIONS))}); re-record the profile with "
                "`ckpt-planner profile`"
            )
        for key in ("nodes", "storage_bytes"):
            if key not in d:
                raise ProfileError(f"{source}: missing field {key!r}")
            if not isinstance(d[key], list):
                raise ProfileError(
                    f"{source}: field {key!r} is a {type(d[key]).__name__}, expected a list"
                )
        if not isinstance(d.get("meta", {}), dict):
            raise ProfileError(f"{source}: field 'meta' is not an object")
        known = {f.name for f in dataclasses.fields(Node)}
        nodes = []
        for i, nd in enumerate(d["nodes"]):
            if not isinstance(nd, dict):
                raise ProfileError(f"{source}: nodes[{i}] is not an object")
            for key in ("name", "op", "phase"):
                if key not in nd:
                    raise ProfileError(f"{source}: nodes[{i}] is missing field {key!r}")
            unknown = set(nd) - known
            if unknown:
                raise ProfileError(
                    f"{source}: nodes[{i}] ({nd['name']!r}) has unknown fields {sorted(unknown)}"
                )
            kw = {k: tuple(v) if isinstance(v, list) else v for k, v in nd.items()}
            for key in ("inputs", "new_storages", "saves", "releases", "no_grad_storages",
                        "storage_parts", "detached_reads"):
                if key in kw and not isinstance(kw[key], tuple):
                    raise ProfileError(
                        f"{source}: nodes[{i}] ({nd['name']!r}): field {key!r} is "
                        f"{kw[key]!r}, expected a list"
                    )
            try:
                nodes.append(Node(**kw))
            except TypeError as e:
                raise ProfileError(f"{source}: nodes[{i}]: {e}") from None
        meta_d = dict(d.get("meta", {}))
        if version == 1:
            meta_d.setdefault("capture", "graph")
        meta_known = {f.name for f in dataclasses.fields(ProfileMeta)}
        try:
            meta = ProfileMeta(**{k: v for k, v in meta_d.items() if k in meta_known})
        except TypeError as e:
            raise ProfileError(f"{source}: meta: {e}") from None
        calls_d = d.get("calls", [])
        if not isinstance(calls_d, list):
            raise ProfileError(f"{source}: field 'calls' is not a list")
        calls = []
        call_known = {f.name for f in dataclasses.fields(ModuleCall)}
        for i, c in enumerate(calls_d):
            if not isinstance(c, dict) or set(c) - call_known:
                raise ProfileError(
                    f"{source}: calls[{i}] is not an object with fields {sorted(call_known)}"
                )
            try:
                calls.append(ModuleCall(**{k: _tuples(v) if isinstance(v, list) else v
                                           for k, v in c.items()}))
            except TypeError as e:
                raise ProfileError(f"{source}: calls[{i}]: {e}") from None
        try:
            return cls(
                nodes=tuple(nodes),
                storage_bytes=tuple(d["storage_bytes"]),
                model_outputs=tuple(d.get("model_outputs", ())),
                loss=d.get("loss", ""),
                grads=tuple(d.get("grads", ())),
                grad_bytes=d.get("grad_bytes", 0),
                optimizer_state_bytes=d.get("optimizer_state_bytes", 0),
                optimizer_step_bytes=d.get("optimizer_step_bytes", 0),
                calls=tuple(calls),
                meta=meta,
                schema_version=version,
            )
        except ProfileError as e:
            raise ProfileError(f"{source}: {e}") from None

    def save(self, path: str | Path) -> Path:
        """Write compact JSON; a path ending in ``.gz`` is gzip-compressed."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), separators=(",", ":"))
        if path.suffix == ".gz":
            with gzip.open(path, "wt", encoding="utf-8") as f:
                f.write(text)
        else:
            path.write_text(text, encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile written by `save`; raises `ProfileError` on anything malformed."""
        path = Path(path)
        try:
            if path.suffix == ".gz":
                with gzip.open(path, "rt", encoding="utf-8") as f:
                    d = json.load(f)
            else:
                d = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ProfileError(f"{path}: no such profile file") from None
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
            raise ProfileError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, source=str(path))


_T = TypeVar("_T")


def cached(profile: Profile, key: str, build: Callable[[Profile], _T]) -> _T:
    """`build(profile)`, computed on the first call for this profile object and kept on it.

    A Profile is frozen, so whatever the solvers derive from it (the simulator's integer index,
    the candidate cuts, dp's segment model, simulations of schedules) can be computed once and
    shared by every method and every budget. This is the one place that stores such values: each
    `key` has one builder, and a profile made with `dataclasses.replace` starts with none.
    """
    store: dict[str, Any] = profile._derived  # type: ignore[attr-defined]
    if key not in store:
        store[key] = build(profile)
    return store[key]


def _node_index(profile: Profile) -> dict[str, int]:
    return {n.name: i for i, n in enumerate(profile.nodes)}


def _tuples(v: list) -> tuple:
    """A JSON array as a tuple, arrays inside it too (`ModuleCall.stage_args`)."""
    return tuple(_tuples(x) if isinstance(x, list) else x for x in v)


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _validate(p: Profile) -> None:
    """Check everything a solver relies on; raise ProfileError naming the field."""
    n_st = len(p.storage_bytes)
    for s, b in enumerate(p.storage_bytes):
        if not _is_count(b):
            raise ProfileError(f"storage_bytes[{s}] is {b!r}, expected a non-negative integer")
    for key in ("grad_bytes", "optimizer_state_bytes", "optimizer_step_bytes"):
        v = getattr(p, key)
        if not _is_count(v):
            raise ProfileError(f"{key} is {v!r}, expected a non-negative integer")
    ws = p.meta.world_size
    if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
        raise ProfileError(f"meta.world_size is {ws!r}, expected a positive integer")
    if p.meta.sharding not in ("", "ddp", "fsdp"):
        raise ProfileError(f"meta.sharding is {p.meta.sharding!r}, expected 'ddp', 'fsdp' or ''")
    if not isinstance(p.meta.shard_units, list) or not all(
            isinstance(u, str) for u in p.meta.shard_units):
        raise ProfileError("meta.shard_units is not a list of module names")
    mp = p.meta.fsdp_mixed_precision
    if not isinstance(mp, dict) or (mp and (
            set(mp) != {"param_dtype", "orig_dtype", "reduce_dtype"}
            or not all(v in DTYPE_BYTES for v in mp.values()))):
        raise ProfileError(
            f"meta.fsdp_mixed_precision is {mp!r}, expected {{}} or param_dtype, orig_dtype and "
            f"reduce_dtype, each one of {sorted(DTYPE_BYTES)}")
    seen: dict[str, int] = {}
    owner: dict[int, str] = {}
    last_phase = 0
    for i, n in enumerate(p.nodes):
        where = f"nodes[{i}] ({n.name!r})"
        for key in ("name", "op", "phase"):
            if not isinstance(getattr(n, key), str):
                raise ProfileError(f"{where}: field {key!r} is not a string")
        if not all(isinstance(x, str) for x in n.inputs):
            raise ProfileError(f"{where}: inputs must be a list of node names")
        if not _is_count(n.rows):
            raise ProfileError(f"{where}: rows is {n.rows!r}, expected a non-negative integer")
        if n.grad_of is not None and not isinstance(n.grad_of, str):
            raise ProfileError(f"{where}: grad_of must be a node name or null")
        if not isinstance(n.python_backward, bool):
            raise ProfileError(f"{where}: python_backward must be true or false")
        if n.python_backward and n.phase != "backward":
            raise ProfileError(f"{where}: python_backward is set on a {n.phase!r} node")
        if not isinstance(n.accumulates, bool):
            raise ProfileError(f"{where}: accumulates must be true or false")
        if n.accumulates and n.phase != "backward":
            raise ProfileError(f"{where}: accumulates is set on a {n.phase!r} node")
        if not isinstance(n.after_formula, bool):
            raise ProfileError(f"{where}: after_formula must be true or false")
        if n.after_formula and (n.grad_of is None or n.accumulates):
            raise ProfileError(f"{where}: after_formula is set on a node that is not one of an "
                               "autograd node's backward ops (grad_of), or one that accumulates")
        if not isinstance(n.before_unpack, bool):
            raise ProfileError(f"{where}: before_unpack must be true or false")
        if n.before_unpack and (n.grad_of is None or n.accumulates):
            raise ProfileError(f"{where}: before_unpack is set on a node that is not one of an "
                               "autograd node's backward ops (grad_of), or one that accumulates")
        if n.name in seen:
            raise ProfileError(f"{where}: duplicate node name (first at nodes[{seen[n.name]}])")
        if n.phase not in PHASES:
            raise ProfileError(f"{where}: phase {n.phase!r} is not one of {PHASES}")
        ph = PHASES.index(n.phase)
        if ph < last_phase and not (n.phase in FIXED_PHASES and last_phase < 3):
            raise ProfileError(
                f"{where}: phase {n.phase!r} comes after a {PHASES[last_phase]!r} node; "
                "nodes must be in execution order (placeholders, forward, loss, backward)"
            )
        last_phase = max(last_phase, ph)
        for inp in n.inputs:
            if inp not in seen:
                if any(m.name == inp for m in p.nodes[i:]):
                    raise ProfileError(
                        f"{where}: input {inp!r} comes later in the graph; the nodes form a "
                        "cycle or are not in execution order"
                    )
                raise ProfileError(f"{where}: input {inp!r} is not a node of this profile")
        for key in ("flops", "bytes_moved", "workspace_bytes"):
            v = getattr(n, key)
            if not _is_count(v):
                raise ProfileError(f"{where}: {key} is {v!r}, expected a non-negative integer")
        t = n.time_ms
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ProfileError(f"{where}: time_ms is {t!r}, expected a finite number >= 0")
        if not set(n.no_grad_storages) <= set(n.new_storages):
            raise ProfileError(f"{where}: no_grad_storages {list(n.no_grad_storages)} are not "
                               "among the storages it allocates (new_storages)")
        if n.storage_parts and n.storage is None:
            raise ProfileError(f"{where}: storage_parts without a storage")
        for s in (*n.new_storages, *n.saves, *n.releases, *n.storage_parts, *n.detached_reads,
                  *(() if n.storage is None else (n.storage,))):
            if not _is_count(s) or s >= n_st:
                raise ProfileError(
                    f"{where}: storage id {s!r} is out of range (storage_bytes has {n_st} entries)"
                )
        for s in n.new_storages:
            if s in owner:
                raise ProfileError(
                    f"{where}: allocates storage {s}, already allocated by {owner[s]!r}"
                )
            owner[s] = n.name
        if n.storage is not None and n.storage not in owner:
            raise ProfileError(f"{where}: output storage {n.storage} is not allocated before it")
        for s in n.saves:
            if s not in owner:
                raise ProfileError(f"{where}: saves storage {s}, which no earlier node allocates")
        if n.saves and n.phase not in ("forward", "loss"):
            raise ProfileError(f"{where}: only forward and loss nodes save tensors for backward")
        if n.grad_of is not None:
            if n.phase != "backward":
                raise ProfileError(f"{where}: grad_of is set on a {n.phase!r} node")
            if n.grad_of not in seen:
                raise ProfileError(f"{where}: grad_of {n.grad_of!r} is not an earlier node")
            if p.nodes[seen[n.grad_of]].phase not in ("forward", "loss"):
                raise ProfileError(
                    f"{where}: grad_of {n.grad_of!r} is not a forward or loss node"
                )
        seen[n.name] = i
    for name in p.model_outputs:
        if name not in seen:
            raise ProfileError(f"model_outputs names {name!r}, which is not a node")
    for name in p.grads:
        if name not in seen:
            raise ProfileError(f"grads names {name!r}, which is not a node")
    if p.loss and p.loss not in seen:
        raise ProfileError(f"loss names {p.loss!r}, which is not a node")
    for k, c in enumerate(p.calls):
        for key in ("module", "start", "end", "blocker"):
            if not isinstance(getattr(c, key), str):
                raise ProfileError(f"calls[{k}]: field {key!r} is not a string")
        if not isinstance(c.buffers, tuple) or not all(isinstance(b, str) for b in c.buffers):
            raise ProfileError(f"calls[{k}]: field 'buffers' is not a list of names")
        if not isinstance(c.restores, tuple) or not set(c.restores) <= set(c.buffers):
            raise ProfileError(f"calls[{k}]: field 'restores' is not a list of names among "
                               "its 'buffers'")
        if not isinstance(c.children, tuple) or not all(isinstance(x, str) for x in c.children):
            raise ProfileError(f"calls[{k}]: field 'children' is not a list of names")
        if not isinstance(c.holds, tuple) or not all(
                _is_count(h) and h < n_st for h in c.holds):
            raise ProfileError(f"calls[{k}]: field 'holds' is not a list of storage ids")
        for key in ("start", "end"):
            name = getattr(c, key)
            if name not in seen or p.nodes[seen[name]].phase != "forward":
                raise ProfileError(f"calls[{k}] ({c.module!r}): {key} {name!r} is not a forward node")
        if seen[c.start] > seen[c.end]:
            raise ProfileError(f"calls[{k}] ({c.module!r}): starts after it ends")
        if c.stages:
            n = len(c.stages)
            ok = (isinstance(c.staged, str) and len(c.stage_last) == n
                  and len(c.stage_nodes) == n + 1 and len(c.stage_limits) == n
                  and all(isinstance(x, str) and x in seen for x in c.stages + c.stage_last)
                  and all(_is_count(x) for x in c.stage_nodes)
                  and all(isinstance(x, int) for x in c.stage_limits)
                  and list(c.stage_nodes) == sorted(set(c.stage_nodes))
                  and all(seen[c.start] <= seen[a] <= seen[b] <= seen[c.end]
                          for a, b in zip(c.stages, c.stage_last, strict=True))
                  and all(i - 1 <= lim < n for i, lim in enumerate(c.stage_limits))
                  and (not c.stage_args or (
                      len(c.stage_args) == n and all(
                          isinstance(a, tuple) and all(_is_count(x) and x < n_st for x in a)
                          for a in c.stage_args))))
            if not ok:
                raise ProfileError(f"calls[{k}] ({c.module!r}): malformed stages")
