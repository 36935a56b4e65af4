"""Profile a make_fx trace of one training step (the graph path, `planner.graph`; measure mode).

The joint graph from `planner.graph.trace.trace_joint` is run op by op, and for every node we
record the storages it allocates (an output whose storage is one of its inputs' storages is a view
or an in-place result and costs 0 bytes), what autograd saves for it (the forward storages its
backward ops read), FLOPs, bytes moved, its workspace (CPU) and its median time. Checkpoint's own
host cost is calibrated as for recorded profiles (`planner.calibrate`). Estimate mode and every
profile `planner.plan` uses come from recording a real step instead (`planner.profiling`).
"""

from __future__ import annotations

import datetime
import operator
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.autograd.profiler import record_function
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import (
    FlopCounterMode,
)

from planner.calibrate import checkpoint_costs, selective_op_cost
from planner.capture.record import op_name, restoring, run_step
from planner.graph.trace import (
    JointTrace,
    preserved_rng,
    split_inputs,
    trace_joint,
    written_positions,
)
from planner.profiling import device_name, dominant_dtype, optimizer_bytes, step_spec
from solvers.errors import CkptPlannerError
from solvers.profile import Node, Profile, ProfileMeta

__all__ = ["ProfiledTrace", "profile_with_trace"]

aten = torch.ops.aten

def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


class _Runner:
    """Runs the joint graph op by op, tracking storages; optionally timing and counting FLOPs."""

    def __init__(self, trace: JointTrace, inputs: list[Any], sync: Callable[[], None]):
        self.trace = trace
        self.gm = trace.gm
        self.inputs = inputs
        self.sync = sync
        nodes = list(self.gm.graph.nodes)
        self.last_use: dict[fx.Node, int] = {}
        for i, n in enumerate(nodes):
            for inp in n.all_input_nodes:
                self.last_use[inp] = i

    def run(
        self, *, analyze: bool, timed: bool, count_flops: bool, marked: bool = False
    ) -> dict[str, Any]:
        nodes = list(self.gm.graph.nodes)
        env: dict[fx.Node, Any] = {}
        storage_of: dict[fx.Node, Any] = {}  # node -> storage id, or list of ids for tuples
        cdata_of: dict[fx.Node, Any] = {}
        storage_bytes: list[int] = []
        new_storages: dict[str, list[int]] = {}
        times: dict[str, float] = {}
        flops: dict[str, int] = {}
        moved: dict[str, int] = {}
        counter = FlopCounterMode(display=False) if count_flops else None
        it = iter(self.inputs)
        ctx = counter if counter is not None else _null()
        with ctx, torch.no_grad():
            for i, n in enumerate(nodes):
                if n.op == "placeholder":
                    env[n] = next(it)
                elif n.op == "call_function":
                    args = fx.node.map_arg(n.args, lambda a: env[a])
                    kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
                    before = counter.get_total_flops() if counter is not None else 0
                    if timed:
                        self.sync()
                        t0 = time.perf_counter()
                        out = n.target(*args, **kwargs)
                        self.sync()
                        times[n.name] = (time.perf_counter() - t0) * 1e3
                    elif marked:
                        with record_function(f"ckpt_node::{n.name}"):
                            out = n.target(*args, **kwargs)
                    else:
                        out = n.target(*args, **kwargs)
                    if counter is not None:
                        flops[n.name] = counter.get_total_flops() - before
                    env[n] = out
                    if analyze:
                        moved[n.name] = sum(
                            t.numel() * t.element_size() for t in _tensors((args, kwargs, out))
                        )
                elif n.op == "get_attr":
                    env[n] = fx.graph_module._get_attr(self.gm, n.target)
                elif n.op == "output":
                    break
                else:
                    raise CkptPlannerError(f"unexpected fx node kind {n.op!r} ({n.name})")
                if analyze:
                    self._storages(n, env, storage_of, cdata_of, storage_bytes, new_storages)
                for inp in n.all_input_nodes:
                    if self.last_use.get(inp) == i and inp.op != "placeholder":
                        env.pop(inp, None)
        return {
            "storage_of": storage_of,
            "storage_bytes": storage_bytes,
            "new_storages": new_storages,
            "times": times,
            "flops": flops,
            "moved": moved,
        }

    @staticmethod
    def _storages(n, env, storage_of, cdata_of, storage_bytes, new_storages) -> None:
        out = env[n]
        new_storages[n.name] = []
        if n.op == "call_function" and n.target is operator.getitem:
            src, idx = n.args
            storage_of[n] = storage_of[src][idx] if isinstance(storage_of[src], list) else None
            cdata_of[n] = cdata_of[src][idx] if isinstance(cdata_of[src], list) else None
            return
        live = {}
        for inp in n.all_input_nodes:
            c, s = cdata_of.get(inp), storage_of.get(inp)
            if isinstance(c, list):
                live.update({ci: si for ci, si in zip(c, s, strict=True) if ci is not None})
            elif c is not None:
                live[c] = s

        def one(t: Any):
            if not isinstance(t, torch.Tensor):
                return None, None
            c = t.untyped_storage()._cdata
            if c in live:
                return live[c], c
            sid = len(storage_bytes)
            storage_bytes.append(int(t.untyped_storage().nbytes()))
            live[c] = sid
            new_storages[n.name].append(sid)
            return sid, c

        if isinstance(out, tuple | list):
            pairs = [one(t) for t in out]
            storage_of[n] = [p[0] for p in pairs]
            cdata_of[n] = [p[1] for p in pairs]
        else:
            storage_of[n], cdata_of[n] = one(out)


def _workspace_cpu(runner: _Runner) -> dict[str, int]:
    """Bytes each op allocates and frees again while it runs (its workspace), measured on CPU from
    the profiler's allocation events inside a per-node `record_function` window: the peak of the
    running sum within the window minus what is still held at its end (the op's outputs)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.run(analyze=False, timed=False, count_flops=False, marked=True)
    out: dict[str, int] = {}

    def allocations(e, acc):
        for c in e.children:
            if c.tag == _EventType.Allocation:
                acc.append((c.start_time_ns, c.extra_fields.alloc_size))
            else:
                allocations(c, acc)
        return acc

    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.name.startswith("ckpt_node::"):
            cur = peak = 0
            for _, delta in sorted(allocations(e, [])):
                cur += delta
                peak = max(peak, cur)
            ws = peak - max(cur, 0)
            if ws > 0:
                out[e.name.removeprefix("ckpt_node::")] = ws
        else:
            todo.extend(e.children)
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class ProfiledTrace:
    """A profile together with the trace it came from (the rewriter needs the graph)."""

    def __init__(self, profile: Profile, trace: JointTrace):
        self.profile = profile
        self.trace = trace


def profile_with_trace(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    repeats: int = 5,
    progress: bool = False,
) -> ProfiledTrace:
    """Trace `model`'s step with make_fx and profile the trace in measure mode. The model is not
    modified (buffers are cloned, RNG is restored); raises TraceError where make_fx cannot trace."""
    say = _Progress(progress)
    t_start = time.perf_counter()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    args, kwargs = split_inputs(example_inputs)
    if any(t.device.type == "meta" for t in [*params.values(), *buffers.values()]):
        raise CkptPlannerError(
            "the model has parameters on the meta device, which cannot be run; use "
            "planner.profile(..., mode='estimate') to profile it without materialising weights"
        )
    # The weights themselves (no copy); buffers cloned so BatchNorm statistics do not move.
    t_buffers = {k: v.clone() for k, v in buffers.items()}
    say("tracing the training step (make_fx over forward, loss and autograd.grad)")
    with preserved_rng():
        trace = trace_joint(model, args, kwargs, loss_fn=loss_fn, params=params,
                            buffers=t_buffers)
        flat_inputs = [
            *[v.detach().requires_grad_(False) if v.is_floating_point() else v
              for v in params.values()],
            *t_buffers.values(),
            *[x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)],
        ]
        dev = _device_of(flat_inputs)
        sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
        runner = _Runner(trace, flat_inputs, sync)
        say(f"traced {len(trace.gm.graph.nodes)} nodes; analysing storages and counting FLOPs")
        info = runner.run(analyze=True, timed=False, count_flops=True)
        if dev.type == "cpu":
            info["workspace"] = _workspace_cpu(runner)
        runs = []
        for _ in range(max(1, repeats) + 1):
            runs.append(runner.run(analyze=False, timed=True, count_flops=False)["times"])
        runs = runs[1:]
        times = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        spec = step_spec(model, example_inputs, loss_fn)
        step_ms = _time_eager_step(spec, repeats, sync)
        region_ms, tensor_ms, sel_ms = checkpoint_costs(dev, sync)
        info["ckpt_cost"] = (region_ms, tensor_ms,
                             max(sel_ms, selective_op_cost(spec, repeats, sync)))
    opt_state, opt_step = optimizer_bytes(optimizer)
    prof = _build_profile(trace, info, times, dtype=dominant_dtype(model), model=model,
                          inputs=(args, kwargs), device=dev, step_ms=step_ms,
                          optimizer_state_bytes=opt_state, optimizer_step_bytes=opt_step)
    say(f"profiled in {time.perf_counter() - t_start:.1f} s")
    return ProfiledTrace(prof, trace)


class _Progress:
    def __init__(self, on: bool):
        self.on = on
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.on:
            print(f"[{time.perf_counter() - self.t0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


def _time_eager_step(spec, repeats: int, sync) -> float:
    """Median time of the model's own eager step (`planner.capture.record.run_step`), with its
    state left unchanged."""
    samples = []
    for _ in range(max(1, repeats) + 1):
        with restoring(spec):
            sync()
            t0 = time.perf_counter()
            run_step(spec, None, hooks=False)
            sync()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples[1:])


def _build_profile(
    trace: JointTrace,
    info: dict[str, Any],
    times: dict[str, float],
    *,
    dtype: str,
    model: torch.nn.Module,
    inputs: Any,
    device: torch.device,
    step_ms: float | None,
    optimizer_state_bytes: int,
    optimizer_step_bytes: int,
) -> Profile:
    gm_nodes = [n for n in trace.gm.graph.nodes if n.op != "output"]
    storage_of = info["storage_of"]
    phase = trace.phase

    def sid(n: fx.Node) -> int | None:
        s = storage_of.get(n)
        return s if isinstance(s, int) else None

    # What autograd saves for forward node f: the forward storages read by f's backward ops.
    forward_storages = {
        s
        for n in gm_nodes
        if phase[n.name] != "backward"
        for s in info["new_storages"].get(n.name, [])
    }
    saves: dict[str, set[int]] = {}
    for n in gm_nodes:
        f = trace.grad_of.get(n.name)
        if f is None:
            continue
        for inp in n.all_input_nodes:
            s = storage_of.get(inp)
            for si in s if isinstance(s, list) else [s]:
                if si in forward_storages:
                    saves.setdefault(f, set()).add(si)

    buffer_storages = {sid(n) for n in gm_nodes if phase[n.name] == "buffer"}
    records = []
    for n in gm_nodes:
        ph = phase[n.name]
        flops = int(info["flops"].get(n.name, 0))
        moved = int(info["moved"].get(n.name, 0))
        t = 0.0 if n.op in ("placeholder", "get_attr") else float(times.get(n.name, 0.0))
        target = n.target
        mutates = False
        for pos in written_positions(target):
            if pos < len(n.args) and isinstance(n.args[pos], fx.Node):
                if sid(n.args[pos]) in buffer_storages:
                    mutates = True
        records.append(
            Node(
                name=n.name,
                op=n.op if n.op in ("placeholder", "get_attr") else op_name(target),
                phase=ph,
                inputs=tuple(i.name for i in n.all_input_nodes),
                module=trace.module.get(n.name, ""),
                storage=sid(n),
                new_storages=tuple(info["new_storages"].get(n.name, ())),
                saves=tuple(sorted(saves.get(n.name, ()))),
                grad_of=trace.grad_of.get(n.name),
                flops=flops,
                bytes_moved=moved,
                workspace_bytes=int(info.get("workspace", {}).get(n.name, 0)),
                time_ms=round(t, 6),
                random=torch.Tag.nondeterministic_seeded in getattr(target, "tags", ()),
                mutates_buffer=mutates,
            )
        )
    # Constants (get_attr) sit where make_fx put them; they are fixed memory, so list them first.
    records.sort(key=lambda r: r.phase not in ("param", "buffer", "input"))
    args, kwargs = inputs
    shapes = {}
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            shapes[pytree.keystr(path)] = list(leaf.shape)
    grad_bytes = sum(
        p.numel() * p.element_size()
        for p, tr in zip(dict(model.named_parameters()).values(), trace.trainable, strict=True)
        if tr
    )
    meta = ProfileMeta(
        model_class=f"{type(model).__module__}.{type(model).__qualname__}",
        device=device.type,
        device_name=device_name(device),
        mode="measure",
        dtype=dtype,
        torch_version=torch.__version__,
        input_shapes=shapes,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        step_ms_measured=None if step_ms is None else round(step_ms, 3),
        checkpoint_region_ms=info.get("ckpt_cost", (0.0, 0.0, 0.0))[0],
        checkpoint_saved_tensor_ms=info.get("ckpt_cost", (0.0, 0.0, 0.0))[1],
        checkpoint_selective_op_ms=info.get("ckpt_cost", (0.0, 0.0, 0.0))[2],
    )
    return Profile(
        nodes=tuple(records),
        storage_bytes=tuple(info["storage_bytes"]),
        model_outputs=tuple(trace.model_outputs),
        loss=trace.loss,
        grads=tuple(trace.grads),
        grad_bytes=grad_bytes,
        optimizer_state_bytes=optimizer_state_bytes,
        optimizer_step_bytes=optimizer_step_bytes,
        meta=meta,
    )
