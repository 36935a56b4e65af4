"""Turn a `Recording` of one training step into the torch-free `solvers.Profile`.

This is the one place where recorded ops become profile nodes, and where each module call gets
its verdict: can it be a checkpointed region, and if not, why (the `blocker` of `ModuleCall`).
"""

from __future__ import annotations

import bisect
import datetime
import json
from collections import Counter

from planner.capture.record import ModuleCall as RecordedCall
from planner.capture.record import OpRecord, Recording, Staged
from solvers.profile import FIXED_PHASES, ModuleCall, Node, Profile, ProfileMeta

__all__ = ["call_blockers", "call_restores", "to_profile"]


def _is_buffer(r: OpRecord) -> bool:
    """A module buffer's placeholder (not a constant tensor the model held elsewhere)."""
    return r.phase == "buffer" and r.module != "constant"


def call_blockers(rec: Recording) -> list[str]:
    """For each call of `rec.calls`: "" when running it under non-reentrant checkpoint replays
    exactly what ran, else the reason it would not.

    - A module called more than once per step (a layer whose weights are shared across depth)
      is not blocked for that: a region wraps the module, so its calls are regions only all
      together (`solvers.chain.shared_calls`). If any one of its calls is blocked, all are.

    Ops whose output shapes depend on tensor values (``nonzero``, boolean masks, MoE token
    routing) do not block a call: its replay runs them on the same inputs with the RNG restored,
    so it routes the same tokens, and non-reentrant checkpoint's determinism check raises if a
    recomputed tensor's shape differs from forward's. Their memory differs between batches;
    `planner.plan` keeps a measured margin for that (`ProfileMeta.data_dependent_ops`).
    - An in-place write to a tensor made before the call, other than a module buffer (buffers
      are swapped for copies during the replay): the replay would apply the write twice.
    - A tensor made inside the call and stored into an object the call was given (an HF
      ``DynamicCache`` under ``use_cache=True``, a list collecting hidden states): the replay
      would store it again.
    - A read of a tensor a module keeps in a plain attribute, replaced later in the step
      (Transformer-XL's memory of the last segment): the replay would read the new tensor.
    - A random op given a `torch.Generator` no module inside the call holds as an attribute:
      checkpoint restores only torch's default generators, and a region the generators its
      modules hold (``self.gen``), so the replay would draw anew.
    - Seeding torch's default generator (``torch.seed()``, as Reformer's layers do in every
      training forward): checkpoint restores the generator's state before a replay, but a
      replay that seeds it from a fresh draw of entropy draws other dropout masks than forward
      did, and nothing would notice (the shapes agree). A call that seeds it with
      ``torch.manual_seed`` looks the same to the recorder and is blocked too.
    - A module whose forward also runs during backward (a custom autograd Function that
      recomputes it there, as Reformer's reversible layers do, or torch's checkpoint in the
      model's own code): a region on it would checkpoint that call in backward too, which the
      cost model does not follow.
    - An op whose autograd node runs backward inside the step's forward or loss
      (``torch.autograd.grad`` there: forces as minus the energy's gradient by positions, a
      gradient penalty): the checkpoint would replay the call there, and the double-backward
      nodes would keep the replay's tensors, which the cost model does not follow.
    - A tensor with an autograd graph left in a plain attribute of a module inside the call,
      where ops behind it that save tensors never run backward (an attention map kept for
      inspection): its nodes keep the checkpoint's frame, and with it what the replay
      recomputed, as long as the attribute holds it. A stored tensor the loss reads (an
      auxiliary loss) does not block: the replay leaves forward's in the attribute.

    A module buffer the call reads and that is updated in place after (spectral norm's power
    iteration, an EMA codebook, a memory bank filled later) does not block it either: the region
    keeps a copy of it from its forward and replays from that copy (`call_restores`).
    """
    per_module = Counter(c.module for c in rec.calls)
    made_at, writes = _writes(rec)
    ran_backward = {r.grad_of for r in rec.ops if r.phase == "backward"}
    again = set(rec.called_in_backward)
    out = []
    for c in rec.calls:
        reason = ""
        for i, s in writes:
            if c.start <= i <= c.end and made_at.get(s, -1) < c.start:
                reason = f"writes in place to a tensor made before the call ({rec.ops[i].op})"
                break
        drawn = next((r for r in rec.ops[c.start:c.end + 1] if r.own_generator
                      and not _inside(r.own_generator, c.module)), None)
        if not reason and drawn:
            reason = (f"draws random numbers from a torch.Generator no module inside it holds "
                      f"({drawn.op}): checkpoint restores only torch's default generators and "
                      "a region the generators its modules hold, so a replay would draw other "
                      "numbers than forward did")
        if not reason and c.module in again:
            reason = ("its forward runs again during backward (recomputed there by a custom "
                      "autograd Function, as reversible layers do, or by torch's checkpoint in "
                      "the model's own code): a region would checkpoint that call too, which "
                      "the planner does not model")
        if not reason and any(c.start <= i <= c.end for i in rec.differentiated_in_forward):
            reason = ("is differentiated inside the step's forward or loss (torch.autograd.grad "
                      "there, as for forces or a gradient penalty): a checkpoint would replay "
                      "it there too, which the planner does not model")
        if not reason and c.reseeds:
            reason = ("seeds torch's random generator in its forward (torch.seed() or "
                      "torch.manual_seed): a replay would seed it again, from a new seed where "
                      "it is drawn anew, and draw other numbers than forward did")
        for i, attr, s in rec.attribute_stores:
            if not reason and c.start <= i <= c.end and \
                    _dead_saver_behind(rec, made_at.get(s, -1), c, ran_backward):
                reason = (f"stores a tensor on a module ({attr!r}) whose graph backward never "
                          "runs (an attention map kept for inspection): the checkpoint's frame "
                          "would keep the replay's tensors alive as long as the tensor lives")
        for i, attr in rec.attribute_rereads:
            if not reason and c.start <= i <= c.end:
                reason = (f"reads the tensor a module attribute ({attr!r}) held as it started, "
                          "which the step replaces later (a recurrent memory, as "
                          "Transformer-XL's): a replay would read the new one")
        if not reason and any(c.start <= made_at.get(s, -1) <= c.end for s in c.holds):
            reason = ("stores tensors it makes into an object it was given, where a replay would "
                      "store its recomputed ones (a KV cache: call the model with use_cache=False "
                      "for training; or states shared between layers, as Gemma3n's KV sharing)")
        out.append(reason)
    # One wrapper checkpoints every call of a module: a blocked call blocks them all.
    for m, n in per_module.items():
        if n < 2:
            continue
        ks = [k for k, c in enumerate(rec.calls) if c.module == m]
        first = next((out[k] for k in ks if out[k]), "")
        if first:
            for k in ks:
                out[k] = f"called {n} times in one step, and one call {first}"
    return out


def _inside(holder: str, module: str) -> bool:
    """Whether the module named `holder` ("?": none) is `module` or inside it."""
    if holder == "?":
        return False
    holder = "" if holder == "(the root module)" else holder
    return module == "" or holder == module or holder.startswith(module + ".")


def _dead_saver_behind(rec: Recording, made: int, c, ran_backward: set[int | None]) -> bool:
    """Whether the op that made a stored tensor, or one before it in call `c` reached only
    through ops that never run backward, never runs backward itself and saves tensors: its
    autograd node, kept by the stored tensor, keeps the checkpoint's frame and the tensors the
    replay recomputes for it."""
    todo, seen = [made], set()
    while todo:
        j = todo.pop()
        if j in seen or not c.start <= j <= c.end:
            continue
        seen.add(j)
        r = rec.ops[j]
        if r.phase != "forward" or j in ran_backward:
            continue
        if r.saves:
            return True
        todo.extend(r.inputs)
    return False


def call_restores(rec: Recording) -> list[tuple[str, ...]]:
    """For each call of `rec.calls`, the module buffers whose values its replay must start from
    as forward did, not as forward left them: those an op at or after the call's start writes
    in place (inside the call or later in the step) and whose value, read inside the call,
    reaches what the call's ops save for backward or read on the host (`_reaches_saved`).

    - Spectral norm's power iteration updates ``_u`` and ``_v``, then computes the weight from
      them; an EMA codebook (VQ-VAE, audio codecs) computes distances to its codes, then moves
      them; a fused QAT observer (``fused_moving_avg_obs_fake_quant``) reads its statistics,
      updates them and quantizes with the result, in one op.
    - A memory bank read by one module and filled by its parent after it (MoCo's queue): the
      replay in backward would read the codes enqueued since.

    Not restored: values that only feed their buffers' own updates. BatchNorm's training op
    reads its running statistics only to update them (its output does not depend on them), as
    InstanceNorm's repeated copies of them do; its replay runs on copies of the values forward
    left, which costs nothing from forward to backward."""
    buffers = {r.storage: r.name for r in rec.ops if _is_buffer(r)}
    last_write: dict[int, int] = {}  # buffer storage -> the last forward or loss op writing it
    for i, r in enumerate(rec.ops):
        if r.phase in ("forward", "loss"):
            for s in set(r.writes) & buffers.keys():
                last_write[s] = i
    reads = [_reads(rec, r) if r.phase == "forward" else set() for r in rec.ops]
    starts: dict[int, list[int]] = {}  # buffer storage -> forward ops reading it
    for j, r in enumerate(rec.ops):
        for s in reads[j] & last_write.keys():
            if not _updates_only(r, {s}):
                starts.setdefault(s, []).append(j)
    out = []
    for c in rec.calls:
        names = set()
        for s, js in starts.items():
            first = next((j for j in js if c.start <= j <= c.end), None)
            if first is not None and last_write[s] >= c.start and \
                    _reaches_saved(rec, reads, s, first, c.end):
                names.add(buffers[s])
        out.append(tuple(sorted(names)))
    return out


def _reads(rec: Recording, r: OpRecord) -> set[int]:
    """Storages op `r` reads (every output of an input op with several)."""
    out: set[int] = set()
    for j in r.inputs:
        q = rec.ops[j]
        if q.storage is not None:
            out.add(q.storage)
        else:
            out.update(q.new_storages)
    return out


def _updates_only(r: OpRecord, tainted: set[int]) -> bool:
    """Op `r` reads `tainted` storages only to write them in place: an in-place update of the
    buffer alone (``add_``), or a batch-norm op updating the running statistics it is given."""
    written = set(r.writes)
    return tainted <= written and (not r.new_storages or "batch_norm" in r.op)


def _reaches_saved(rec: Recording, reads: list[set[int]], s: int, first: int, end: int) -> bool:
    """Whether the value of storage `s` as op `first` reads it flows, through the forward ops
    up to `end`, into a tensor one of them saves for backward or into a read on the host: what
    a replay of those ops computes differently from another value of `s`."""
    taint = {s}
    for j in range(first, end + 1):
        r = rec.ops[j]
        got = reads[j] & taint
        if r.phase != "forward" or not got or _updates_only(r, got):
            continue
        if r.dynamic:
            return True
        new = set(r.new_storages) | set(r.writes)
        if r.saves & (taint | new):
            return True
        taint |= new
    return False


def _read_by(rec: Recording, c) -> set[int]:
    """Storages the forward ops of call `c` read. A tensor argument the call's ops never read
    is still kept by its checkpoint (an argument, saved as one), which the simulator counts only
    for what the region's ops read: such a tensor is counted as held instead."""
    return set().union(*(_reads(rec, r) for r in rec.ops[c.start:c.end + 1]))


def _writes(rec: Recording) -> tuple[dict[int, int], list[tuple[int, int]]]:
    """The op each storage is made at, and the forward ops' in-place writes (op, storage) to
    anything but a module buffer: a region holding such a write to a tensor made before it
    would apply it twice."""
    made_at: dict[int, int] = {}
    for i, r in enumerate(rec.ops):
        for s in r.new_storages:
            made_at[s] = i
    buffer_storages = {r.storage for r in rec.ops if _is_buffer(r)}
    writes = [(i, s) for i, r in enumerate(rec.ops) if r.phase == "forward" for s in r.writes
              if s not in buffer_storages]
    return made_at, writes


def _own_buffer_writes(rec: Recording, c: RecordedCall) -> list[tuple[int, int]]:
    """In-place writes (op, storage) to module buffers by call `c`'s own code, outside the
    submodule calls it makes: timm's BatchNormAct2d calls ``F.batch_norm`` on its own running
    statistics and increments ``num_batches_tracked`` in its forward. A run of the call's traced
    stages holding one would update the buffer again as it replays (a run gets no buffer
    copies: those are made per module call), and its checkpoint, passed the buffer as an
    argument, raises in backward that the buffer was modified in place."""
    buffers = {r.storage for r in rec.ops if _is_buffer(r)}
    inner = [(k.start, k.end) for k in rec.calls
             if k is not c and c.start <= k.start and k.end <= c.end]
    return [(i, s) for i in range(c.start, c.end + 1) if rec.ops[i].phase == "forward"
            for s in rec.ops[i].writes
            if s in buffers and not any(a <= i <= b for a, b in inner)]


def _stage_fields(rec: Recording, c: RecordedCall, st: Staged, names: list[str],
                  made_at: dict[int, int], writes: list[tuple[int, int]],
                  fixed: set[int]) -> dict:
    """The `ModuleCall` stage fields of staged call `c`: stage spans as node names, how far a
    region starting at each stage may reach before one of `writes` (`_writes`) to a tensor made
    before its start or one of the call's own writes to a buffer (`_own_buffer_writes`: no run
    holds one), and the call's tensor arguments each stage reads (not `fixed` ones)."""
    starts, stop = list(st.ops[:-1]), st.ops[-1]
    lasts = [nxt - 1 for nxt in (*starts[1:], stop)]
    inside = [(i, s) for i, s in writes if starts[0] <= i < stop]
    inside += [(i, -1) for i, _ in _own_buffer_writes(rec, c) if starts[0] <= i < stop]
    limits = []
    for k, a in enumerate(starts):
        first = min((i for i, s in inside if i >= a and made_at.get(s, -1) < a), default=stop)
        limits.append(max(k - 1, bisect.bisect_left(lasts, first) - 1))  # lasts ascend
    return dict(staged=json.dumps({"pattern": st.pattern, "fingerprint": st.fingerprint}),
                stages=tuple(names[i] for i in starts), stage_last=tuple(names[i] for i in lasts),
                stage_nodes=tuple(st.nodes), stage_limits=tuple(limits),
                stage_args=tuple(tuple(x for x in a if x not in fixed) for a in st.arguments))


def to_profile(
    rec: Recording,
    *,
    model_class: str,
    device: str,
    device_name: str,
    mode: str,
    dtype: str,
    torch_version: str,
    grad_bytes: int,
    optimizer_state_bytes: int = 0,
    optimizer_step_bytes: int = 0,
    storage_bytes: list[int] | None = None,
) -> Profile:
    """The Profile of a recorded step (times, FLOPs and bytes as recorded; `storage_bytes`
    overrides the recorded sizes, for estimate mode's GPU corrections)."""
    names = [r.name for r in rec.ops]
    nodes = []
    for r in rec.ops:
        nodes.append(
            Node(
                name=r.name,
                op=r.op,
                phase=r.phase,
                inputs=tuple(names[i] for i in r.inputs),
                module=r.module,
                storage=r.storage,
                storage_parts=tuple(r.storage_parts),
                new_storages=tuple(r.new_storages),
                saves=tuple(sorted(r.saves)) if r.phase in ("forward", "loss") else (),
                grad_of=names[r.grad_of] if r.grad_of is not None else None,
                python_backward=r.python_backward,
                accumulates=r.accumulates and r.phase == "backward",
                after_formula=r.after_formula and r.phase == "backward"
                and r.grad_of is not None and not r.accumulates,
                before_unpack=r.before_unpack and r.phase == "backward",
                workspace_bytes=int(r.workspace_bytes),
                flops=int(r.flops),
                bytes_moved=int(r.bytes_moved),
                time_ms=0.0 if r.phase in FIXED_PHASES else float(r.time_ms),
                random=r.random,
                mutates_buffer=r.mutates_buffer,
                fills_saved=r.phase == "forward" and any(
                    s in r.saves and s != r.storage for s in r.writes),
                releases=tuple(sorted(r.releases)),
                no_grad_storages=tuple(r.no_grad_storages),
                detached_reads=tuple(r.detached_reads),
                rows=rec.rows.get(len(nodes), 0),
            )
        )
    blockers = call_blockers(rec)
    restores = call_restores(rec)
    made_at, writes = _writes(rec)
    buffer_name = {r.storage: r.name for r in rec.ops if _is_buffer(r)}
    fixed = {s for r in rec.ops if r.phase in FIXED_PHASES for s in r.new_storages}
    calls = []
    for c, b, rs in zip(rec.calls, blockers, restores, strict=True):
        # A call that restores buffers is not run through its trace: its regions are whole calls
        # and Sequential segments, which `planner.inplace` snapshots.
        st = rec.staged.get(c.module) if not b and not rs else None
        calls.append(ModuleCall(
            module=c.module, start=names[c.start], end=names[c.end], blocker=b,
            buffers=tuple(sorted({buffer_name[s] for r in rec.ops[c.start:c.end + 1]
                                  for s in r.writes if s in buffer_name} | set(rs))),
            restores=rs,
            holds=tuple(sorted((c.holds | (c.args - _read_by(rec, c))) - fixed)),
            children=tuple(rec.sequential.get(c.module, ())),
            **(_stage_fields(rec, c, st, names, made_at, writes, fixed)
               if st is not None else {}),
        ))
    meta = ProfileMeta(
        model_class=model_class,
        device=device,
        device_name=device_name,
        mode=mode,
        dtype=dtype,
        torch_version=torch_version,
        input_shapes=dict(rec.input_shapes),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        step_ms_measured=rec.step_ms,
        capture="run",
        data_dependent_ops=sum(1 for r in rec.ops if r.phase == "forward"
                               and r.dynamic.startswith("output shape")),
        random_skips=list(rec.random_skips),
        outside_modules=list(rec.outside_modules),
    )
    return Profile(
        nodes=tuple(nodes),
        storage_bytes=tuple(storage_bytes if storage_bytes is not None else rec.storage_bytes),
        model_outputs=tuple(names[i] for i in rec.outputs),
        loss=names[rec.loss],
        grads=tuple(names[i] for i in rec.grads),
        grad_bytes=grad_bytes,
        optimizer_state_bytes=optimizer_state_bytes,
        optimizer_step_bytes=optimizer_step_bytes,
        calls=tuple(calls),
        meta=meta,
    )
