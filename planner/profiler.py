"""`profile(model, example_inputs)`: record one training step as a torch-free `solvers.Profile`.

This is the one place where fx nodes become profile records. The joint graph from
`planner.trace.trace_joint` is run op by op (real tensors in ``mode="measure"``, fake tensors in
``mode="estimate"``), and for every node we record:
- the storages it allocates: an output whose storage is one of its inputs' storages is a view or an
  in-place result and costs 0 bytes; anything else is a new storage of ``untyped_storage().nbytes()``;
- what autograd saves for it: the forward storages its backward ops read;
- FLOPs from `FlopCounterMode` (plus the CPU flash-attention kernels it misses) and bytes moved;
- its time: the median of `repeats` timed runs, or a roofline estimate from a `DeviceSpec`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import operator
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.profiler import record_function
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import (
    FlopCounterMode,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from planner.devices import DeviceSpec, cpu_spec, get_device, roofline_ms
from planner.trace import (
    JointTrace,
    preserved_rng,
    split_inputs,
    trace_joint,
    written_positions,
)
from solvers.errors import CkptPlannerError
from solvers.profile import Node, Profile, ProfileMeta

__all__ = ["profile", "ProfiledTrace", "profile_with_trace"]

aten = torch.ops.aten

# FlopCounterMode counts the CUDA SDPA kernels but not the CPU flash kernel (torch 2.13).
_CPU_SDPA = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_SDPA_BWD = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
if _CPU_SDPA is not None:
    try:

        @register_flop_formula(_CPU_SDPA)
        def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kw):
            return sdpa_flop_count(query_shape, key_shape, value_shape)

        @register_flop_formula(_CPU_SDPA_BWD)
        def _cpu_sdpa_bwd_flop(grad_out_shape, query_shape, key_shape, value_shape, *a, **kw):
            return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    except RuntimeError:  # already registered (module reloaded)
        pass

_RANDOM_OPS = {
    "bernoulli",
    "bernoulli_",
    "native_dropout",
    "rand",
    "rand_like",
    "randn",
    "randn_like",
    "randint",
    "randint_like",
    "randperm",
    "normal",
    "normal_",
    "uniform_",
    "exponential_",
    "multinomial",
}


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.__name__}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


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


def _calibrate_checkpoint(device: torch.device, sync: Callable[[], None],
                          n: int = 32, reps: int = 30) -> tuple[float, float, float]:
    """(ms per region, ms per saved tensor, ms per selective-region op) that non-reentrant
    checkpoint adds on this device.

    A chain of `n` tiny ops that each save their input is run plain, as one checkpointed region,
    and as 8 regions, alternating, `reps` times (medians). With r the chain's forward time:
    8 regions - 1 region = 7 per-region costs; 1 region - plain - per-region - r = n saved-tensor
    costs (pack in forward, pack again in the replay, unpack); a selective region that recomputes
    everything minus the plain region = n per-op costs of the selective dispatch mode."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    x = torch.randn(64, device=device, requires_grad=True)

    def chain(t, k):
        for _ in range(k):
            t = torch.sin(t)
        return t

    def ckpt(t, k):
        return checkpoint(chain, t, k, use_reentrant=False, preserve_rng_state=False)

    def recompute_all(ctx, func, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    def sac():
        checkpoint(
            chain, x, n, use_reentrant=False, preserve_rng_state=False,
            context_fn=lambda: create_selective_checkpoint_contexts(recompute_all),
        ).sum().backward()

    def eight():
        y = x
        for _ in range(8):
            y = ckpt(y, n // 8)
        y.sum().backward()

    fns = {
        "plain": lambda: chain(x, n).sum().backward(),
        "fwd": lambda: chain(x, n),
        "one": lambda: ckpt(x, n).sum().backward(),
        "eight": eight,
        "sac": sac,
    }
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(reps + 3):
        for k, f in fns.items():
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            if r >= 3:
                times[k].append((time.perf_counter() - t0) * 1e3)
    m = {k: statistics.median(v) for k, v in times.items()}
    per_region = max(0.0, (m["eight"] - m["one"]) / 7)
    per_tensor = max(0.0, (m["one"] - m["plain"] - per_region - m["fwd"]) / n)
    per_op = max(0.0, (m["sac"] - m["one"]) / n)
    return round(per_region, 5), round(per_tensor, 6), round(per_op, 6)


def _is_view(target: Any) -> bool:
    """getitem and ops whose output aliases an input without writing it (view, t, expand...)."""
    if target is operator.getitem:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


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


def profile(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    mode: str = "measure",
    device: str | DeviceSpec | None = None,
    repeats: int = 5,
    progress: bool = False,
) -> Profile:
    """Profile one training step of `model` on `example_inputs`.

    Args:
        model: any eager ``nn.Module``; it is not modified (buffers are cloned, RNG is restored).
        example_inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments.
        loss_fn: maps the model's output to a scalar loss. Default: ``output.loss`` where the output
            has one (HF models given ``labels``), else the float mean of the first output tensor.
        optimizer: when given, its state (e.g. Adam: two tensors per parameter) and the transient
            memory of its step are part of the profile and of every budget.
        mode: ``"measure"`` runs every op on the model's device and times it (median of `repeats`);
            ``"estimate"`` traces with fake tensors (no memory for weights or activations) and
            estimates times by roofline on `device`.
        device: estimate mode: a name from `planner.devices.DEVICES` (``"h100"``) or a DeviceSpec.
        progress: print what it is doing to stderr.

    Returns:
        a `solvers.Profile`.
    """
    return profile_with_trace(
        model,
        example_inputs,
        loss_fn=loss_fn,
        optimizer=optimizer,
        mode=mode,
        device=device,
        repeats=repeats,
        progress=progress,
    ).profile


def profile_with_trace(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    mode: str = "measure",
    device: str | DeviceSpec | None = None,
    repeats: int = 5,
    progress: bool = False,
) -> ProfiledTrace:
    """`profile`, also returning the joint trace (used by `planner.plan`)."""
    if mode not in ("measure", "estimate"):
        raise ValueError(f"mode={mode!r}: expected 'measure' or 'estimate'")
    say = _Progress(progress)
    t_start = time.perf_counter()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    args, kwargs = split_inputs(example_inputs)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False) if mode == "estimate" else None

    if fake_mode is not None:
        conv = _Faker(fake_mode)
        t_params = {k: conv(v) for k, v in params.items()}
        t_buffers = {k: conv(v) for k, v in buffers.items()}
        t_inputs = pytree.tree_map(lambda x: conv(x) if isinstance(x, torch.Tensor) else x,
                                   (args, kwargs))
        spec = device if isinstance(device, DeviceSpec) else get_device(device or "h100")
    else:
        if any(t.device.type == "meta" for t in [*params.values(), *buffers.values()]):
            raise CkptPlannerError(
                "the model has parameters on the meta device, which cannot be run; use "
                "mode='estimate' to profile it without materialising weights"
            )
        # Detached aliases share the weights (no copy); buffers are cloned so that BatchNorm
        # statistics of the user's model do not move while we profile.
        t_params = dict(params)
        t_buffers = {k: v.clone() for k, v in buffers.items()}
        t_inputs = (args, kwargs)
        spec = device if isinstance(device, DeviceSpec) else None

    say("tracing the training step (make_fx over forward, loss and autograd.grad)")
    ctx = fake_mode if fake_mode is not None else _null()
    gpu_attention = (
        _fused_attention_with_dropout()
        if fake_mode is not None and spec.kind != "cpu"
        else contextlib.nullcontext()
    )
    with preserved_rng(), ctx, gpu_attention:
        trace = trace_joint(
            model, *t_inputs, loss_fn=loss_fn, params=t_params, buffers=t_buffers
        )
        flat_inputs = [
            *[
                v.detach().requires_grad_(False) if v.is_floating_point() else v
                for v in t_params.values()
            ],
            *t_buffers.values(),
            *[x for x in pytree.tree_leaves(t_inputs) if isinstance(x, torch.Tensor)],
        ]
        dev = _device_of(flat_inputs)
        sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
        runner = _Runner(trace, flat_inputs, sync)
        n_nodes = len(trace.gm.graph.nodes)
        say(f"traced {n_nodes} nodes; analysing storages and counting FLOPs")
        info = runner.run(analyze=True, timed=False, count_flops=True)
        times: dict[str, float] = {}
        step_ms = None
        if mode == "measure" and dev.type == "cpu":
            say("measuring op workspace from allocation events")
            info["workspace"] = _workspace_cpu(runner)
        if mode == "measure":
            runs = []
            for r in range(max(1, repeats) + 1):
                say(f"timing every op: run {r + 1} of {max(1, repeats) + 1} (first is warm-up)")
                runs.append(runner.run(analyze=False, timed=True, count_flops=False)["times"])
            runs = runs[1:]
            times = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            step_ms = _time_eager_step(model, example_inputs, loss_fn, repeats, sync)
            say("calibrating checkpoint's per-region and per-saved-tensor cost")
            region_ms, tensor_ms, sel_ms = _calibrate_checkpoint(dev, sync)
            say("measuring the selective policy's per-op cost on this model's forward")
            sel_model = _selective_op_cost(model, example_inputs, repeats, sync)
            info["ckpt_cost"] = (region_ms, tensor_ms, max(sel_ms, sel_model))
            if spec is None:
                spec = cpu_spec(measure=False) if dev.type == "cpu" else None

    opt_state, opt_step = _optimizer_bytes(optimizer, params, mode)
    prof = _build_profile(
        trace,
        info,
        times,
        spec=spec,
        mode=mode,
        dtype=_dominant_dtype(params),
        model=model,
        inputs=(args, kwargs),
        device=dev,
        step_ms=step_ms,
        optimizer_state_bytes=opt_state,
        optimizer_step_bytes=opt_step,
    )
    if mode == "measure":
        say("measuring checkpoint's per-region cost on this model (a plan of many regions)")
        region_ms = _region_cost_on_model(prof, trace, model, example_inputs, loss_fn, repeats,
                                          sync)
        if region_ms is not None and region_ms > prof.meta.checkpoint_region_ms:
            prof = dataclasses.replace(
                prof, meta=dataclasses.replace(prof.meta, checkpoint_region_ms=region_ms))
    say(f"profiled in {time.perf_counter() - t_start:.1f} s")
    return ProfiledTrace(prof, trace)


class _Progress:
    def __init__(self, on: bool):
        self.on = on
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.on:
            print(f"[{time.perf_counter() - self.t0:6.1f} s] {msg}", file=sys.stderr, flush=True)


class _Faker:
    """Real or meta tensors -> fake tensors of the same shape and dtype, without allocating."""

    def __init__(self, mode: FakeTensorMode):
        self.mode = mode

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            with self.mode:
                return torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return self.mode.from_tensor(t)


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


def _dominant_dtype(params: dict[str, torch.Tensor]) -> str:
    counts: dict[str, int] = {}
    for p in params.values():
        k = str(p.dtype).removeprefix("torch.")
        counts[k] = counts.get(k, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else "float32"


def _calibration_rounds(repeats: int) -> int:
    """Alternating rounds for the on-model calibrations (the first is a warm-up): at most 4 timed,
    so that a large `repeats` for the op times does not multiply these whole-model runs too."""
    return min(max(1, repeats), 3) + 2


def _detached_state(model) -> dict[str, torch.Tensor]:
    """Parameters (detached leaves, same requires_grad) and buffer clones for `functional_call`:
    a step run with them leaves the model's own tensors, BatchNorm statistics included, as
    they were."""
    params = {k: v.detach().requires_grad_(v.requires_grad) for k, v in model.named_parameters()}
    return {**params, **{k: v.clone() for k, v in model.named_buffers()}}


def _time_eager_step(model, example_inputs, loss_fn, repeats, sync) -> float:
    """Median time of the original model's eager step, with the model's own state left unchanged."""
    from planner.trace import default_loss

    loss_fn = loss_fn or default_loss
    args, kwargs = split_inputs(example_inputs)
    state = _detached_state(model)
    wrt = [p for p in state.values() if p.requires_grad]
    samples = []
    for _ in range(max(1, repeats) + 1):
        sync()
        t0 = time.perf_counter()
        out = torch.func.functional_call(model, state, args, kwargs)
        torch.autograd.grad(loss_fn(out), wrt, allow_unused=True)
        del out
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples[1:])


def _selective_op_cost(model, example_inputs, repeats, sync) -> float:
    """Host ms per op that a selective region adds, measured on this model's own forward.

    The forward runs plainly and under selective checkpointing's forward dispatch mode (every op
    recomputed), alternating; the difference per dispatched op, doubled for the replay, which
    goes through the same kind of mode. Real ops (several tensor and list arguments, views) cost
    the mode 2-3x what `_calibrate_checkpoint`'s one-argument chain does: 28 us per op on the
    development CPU for a GPT's forward, against 9 us there. 0.0 if the mode cannot run."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    args, kwargs = split_inputs(example_inputs)
    state = _detached_state(model)
    calls = [0]

    def policy(ctx, func, *a, **k):
        calls[0] += 1
        return CheckpointPolicy.PREFER_RECOMPUTE

    plain: list[float] = []
    sac: list[float] = []
    try:
        for r in range(_calibration_rounds(repeats)):
            calls[0] = 0
            for mode in (None, "sac"):
                sync()
                t0 = time.perf_counter()
                if mode is None:
                    out = torch.func.functional_call(model, state, args, kwargs)
                else:
                    fwd, _ = create_selective_checkpoint_contexts(policy)
                    with fwd:
                        out = torch.func.functional_call(model, state, args, kwargs)
                del out
                sync()
                if r > 0:
                    (plain if mode is None else sac).append((time.perf_counter() - t0) * 1e3)
    except Exception:  # noqa: BLE001 - an optional refinement; the chain calibration stands
        return 0.0
    if not calls[0]:
        return 0.0
    per_op = (statistics.median(sac) - statistics.median(plain)) / calls[0]
    return round(max(0.0, 2 * per_op), 6)


def _region_cost_on_model(prof: Profile, trace: JointTrace, model, example_inputs, loss_fn,
                          repeats: int, sync) -> float | None:
    """Host ms per checkpointed region on this model, measured: what a plan of many small regions
    (one between every two of dp's candidate cuts) costs beyond the simulator's prediction with
    the chain-calibrated per-region cost left out, per region. None when the model has fewer than
    4 such regions or the plan cannot run.

    `_calibrate_checkpoint`'s regions take one small tensor; a model's regions take several
    inputs and replay real Python-level ops with autograd on, which the per-op times (measured
    under no_grad) leave out. On the development CPU a GPT's regions measured 0.34 ms each
    against 0.08 ms from the chain, before the rewriter stopped paying for a traceback at every
    early stop; a 161-region CNN plan measures ~0.1 ms now. The model's parameters, buffers and
    RNG state are restored afterwards."""
    from planner.rewrite import PlannedModule, rewrite
    from planner.trace import default_loss
    from solvers.baselines import region
    from solvers.candidates import cut_points
    from solvers.schedule import Schedule
    from solvers.simulate import graph_index, simulate

    g = graph_index(prof)
    last = len(g.forward) - 1
    bounds = [-1, *sorted({g.fwd_pos[i] for i in cut_points(prof, matmul_cuts=True)} - {last}),
              last]
    regs = tuple(region(prof, bounds[k] + 1, bounds[k + 1]) for k in range(len(bounds) - 1))
    if len(regs) < 4:
        return None
    loss_fn = loss_fn or default_loss
    args, kwargs = split_inputs(example_inputs)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    grads = {k: p.grad for k, p in model.named_parameters()}
    wrt = [p for p in model.parameters() if p.requires_grad]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    plain: list[float] = []
    planned: list[float] = []
    try:
        mod = PlannedModule(model, trace, rewrite(trace, Schedule(regions=regs, method="calib")))
        for r in range(_calibration_rounds(repeats)):
            for m, out_list in ((model, plain), (mod, planned)):
                sync()
                t0 = time.perf_counter()
                torch.autograd.grad(loss_fn(m(*args, **kwargs)), wrt, allow_unused=True)
                sync()
                if r > 0:
                    out_list.append((time.perf_counter() - t0) * 1e3)
    except Exception:  # noqa: BLE001 - an optional refinement; the chain calibration stands
        return None
    finally:
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
        for k, p in model.named_parameters():
            p.grad = grads[k]
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    predicted = simulate(prof, regs).recompute_ms - len(regs) * prof.meta.checkpoint_region_ms
    extra = statistics.median(planned) - statistics.median(plain)
    return round(max(0.0, (extra - predicted) / len(regs)), 5)


def _optimizer_bytes(optimizer, params, mode) -> tuple[int, int]:
    """(state bytes held between steps, transient bytes of one step) for a known optimizer."""
    if optimizer is None:
        return 0, 0
    trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    pbytes = sum(p.numel() * p.element_size() for p in trainable)
    name = type(optimizer).__name__
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax"):
        # exp_avg and exp_avg_sq, each like the parameter (Kingma & Ba 2015); `step` is a scalar.
        state = 2 * pbytes
    elif name == "SGD":
        state = pbytes if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    elif name in ("Adagrad", "RMSprop"):
        state = pbytes
    else:
        raise CkptPlannerError(
            f"optimizer {name} is not modelled; supported: Adam, AdamW, NAdam, RAdam, Adamax, "
            "SGD, Adagrad, RMSprop (or pass optimizer=None and add its state to the budget)"
        )
    # The foreach implementations allocate temporaries for a whole parameter group at once (Adam:
    # the denominator sqrt(exp_avg_sq) + eps, one tensor per parameter); we take the largest
    # group's parameter bytes as the transient. An estimate: on the test models the step's peak
    # lies in backward, where it is exact (tests/test_plan.py).
    step = max(
        (sum(p.numel() * p.element_size() for p in g["params"] if p.requires_grad)
         for g in optimizer.param_groups),
        default=0,
    )
    return state, step


def _build_profile(
    trace: JointTrace,
    info: dict[str, Any],
    times: dict[str, float],
    *,
    spec: DeviceSpec | None,
    mode: str,
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
        if n.op in ("placeholder", "get_attr"):
            t = 0.0
        elif mode == "measure":
            t = float(times.get(n.name, 0.0))
        else:
            t = 0.0 if _is_view(n.target) else roofline_ms(spec, flops, moved, dtype)
        target = n.target
        base = getattr(getattr(target, "overloadpacket", None), "__name__", "")
        mutates = False
        for pos in written_positions(target):
            if pos < len(n.args) and isinstance(n.args[pos], fx.Node):
                if sid(n.args[pos]) in buffer_storages:
                    mutates = True
        records.append(
            Node(
                name=n.name,
                op=n.op if n.op in ("placeholder", "get_attr") else _op_name(target),
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
                random=base in _RANDOM_OPS,
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
        device=spec.kind if (mode == "estimate" and spec is not None) else device.type,
        device_name=(spec.name if spec is not None else _device_name(device)),
        mode=mode,
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
        storage_bytes=tuple(
            _gpu_dropout_masks(gm_nodes, info["storage_bytes"], sid)
            if mode == "estimate" and spec is not None and spec.kind != "cpu"
            else info["storage_bytes"]
        ),
        model_outputs=tuple(trace.model_outputs),
        loss=trace.loss,
        grads=tuple(trace.grads),
        grad_bytes=grad_bytes,
        optimizer_state_bytes=optimizer_state_bytes,
        optimizer_step_bytes=optimizer_step_bytes,
        meta=meta,
    )


@contextlib.contextmanager
def _fused_attention_with_dropout():
    """Estimate mode for a GPU: route `F.scaled_dot_product_attention` with dropout to the fused
    (flash-style) kernel. On fake CPU tensors, dropout sends SDPA down its math path, which keeps
    the (seq x seq) probabilities and mask; CUDA's flash and memory-efficient kernels apply dropout
    inside the kernel and keep only the output and log-sum-exp, as the fused CPU kernel does."""
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if dropout_p > 0 and not enable_gqa and query.dim() == 4 and key.shape == value.shape:
            out, _lse = aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )
            return out
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _gpu_dropout_masks(nodes: list[fx.Node], storage_bytes: list[int], sid) -> list[int]:
    """Estimate mode traces fake CPU tensors, and the CPU decomposes dropout into
    ``empty_like -> bernoulli_ -> div_ -> mul`` with a mask of the input's dtype; CUDA and ROCm run
    ``native_dropout``, whose saved mask is bool (1 byte per element). Size those masks as the GPU
    keeps them."""
    out = list(storage_bytes)
    bernoulli = {aten.bernoulli_.float, aten.bernoulli_.Tensor}
    for n in nodes:
        if n.op == "call_function" and n.target in bernoulli:
            src = n.args[0]
            val = src.meta.get("val") if isinstance(src, fx.Node) else None
            s = sid(src) if isinstance(src, fx.Node) else None
            if (
                s is not None
                and getattr(src, "target", None) is aten.empty_like.default
                and isinstance(val, torch.Tensor)
            ):
                out[s] = val.numel()
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"
