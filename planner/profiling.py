"""`profile(model, example_inputs)`: one training step of the user's model as a `solvers.Profile`.

The pipeline, each stage importing only the ones before it:
capture (`planner.capture.record`, estimate mode in `planner.capture.estimate`) -> assembly
(`planner.assemble`) -> calibration of checkpoint's own cost (`planner.calibrate`, which applies
a plan in place to time it) -> a check of the recording against one measured step
(`planner.measurement`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from planner.assemble import to_profile
from planner.calibrate import checkpoint_costs, region_cost_on_model, selective_op_cost
from planner.capture.estimate import (
    Faker,
    Shadows,
    gpu_kernels,
    roofline_times,
    transformers_values,
)
from planner.capture.record import (
    StepSpec,
    check_inputs,
    default_loss,
    input_leaves,
    record_step,
    seeded,
    split_inputs,
)
from planner.devices import DeviceSpec, get_device
from planner.fsdp import fsdp_cast, mixed_precision
from planner.measurement import measure
from solvers.errors import CkptPlannerError
from solvers.profile import Profile
from solvers.simulate import simulate

__all__ = ["check_autocast", "device_name", "dominant_dtype", "optimizer_bytes", "profile",
           "step_spec"]


def step_spec(model: torch.nn.Module, example_inputs: Any,
              loss_fn: Callable[[Any], torch.Tensor] | None = None,
              autocast: torch.dtype | None = None) -> StepSpec:
    """The training step the planner runs: ``loss_fn(model(*args, **kwargs))`` (under
    ``torch.autocast`` when `autocast` is a dtype) and the gradients of every parameter that
    requires grad, on the model's own tensors."""
    args, kwargs = split_inputs(example_inputs)
    return StepSpec(
        model=model, args=args, kwargs=kwargs, loss_fn=loss_fn or default_loss,
        params=dict(model.named_parameters()), buffers=dict(model.named_buffers()),
        call=lambda: model(*args, **kwargs), autocast=autocast,
        device_type=_device_of(model, example_inputs).type,
    )


def check_autocast(autocast: Any) -> None:
    """`autocast` is None or a floating dtype, and no autocast block is open around the call."""
    if autocast is not None and not (isinstance(autocast, torch.dtype)
                                     and autocast.is_floating_point):
        raise CkptPlannerError(f"autocast={autocast!r}: pass a dtype such as torch.bfloat16 "
                               "(or None for no mixed precision)")
    if any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        raise CkptPlannerError(
            "this runs inside a torch.autocast block; call it outside the block and pass "
            "autocast=<dtype> instead: the planner then runs forward and loss under autocast and "
            "backward outside it, as PyTorch's mixed-precision recipe (and your training step) does"
        )


def _device_of(model: torch.nn.Module, example_inputs: Any) -> torch.device:
    for t in [*model.parameters(), *model.buffers(),
              *[x for _, x in input_leaves(example_inputs)]]:
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


def dominant_dtype(model: torch.nn.Module) -> str:
    """The dtype most of the model's parameter elements have (``float32``, ``bfloat16``)."""
    counts: dict[str, int] = {}
    for p in model.parameters():
        k = str(p.dtype).removeprefix("torch.")
        counts[k] = counts.get(k, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else "float32"


def device_name(device: torch.device) -> str:
    """A human name for the device: the GPU's, or the CPU's model name."""
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


ADAM_FAMILY = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax")


def optimizer_bytes(optimizer: torch.optim.Optimizer | None, *,
                    on_gpu: bool | None = None) -> tuple[int, int]:
    """(state bytes held between steps, transient bytes of one step) for a known optimizer.

    The transient depends on the implementation the step runs (measured on CPU with profiler
    memory events): ``fused=True`` allocates nothing beyond its state; ``foreach`` (torch's
    default where every parameter is on a GPU) one temporary per parameter of a group at once,
    the group's bytes; the for-loop (the default elsewhere) two temporaries of one parameter at
    a time (Adam). `on_gpu` says where the step will run (estimate mode: the target device);
    None: where the parameters are.
    """
    if optimizer is None:
        return 0, 0
    trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    pbytes = sum(p.numel() * p.element_size() for p in trainable)
    name = type(optimizer).__name__
    if name in ADAM_FAMILY:
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
    if on_gpu is None:
        on_gpu = bool(trainable) and all(p.device.type in ("cuda", "xpu") for p in trainable)
    step = 0
    for g in optimizer.param_groups:
        params = [p for p in g["params"] if p.requires_grad]
        if not params or g.get("fused"):
            continue
        sizes = [p.numel() * p.element_size() for p in params]
        foreach = g.get("foreach")
        if foreach if foreach is not None else on_gpu:
            step = max(step, sum(sizes))
        else:
            step = max(step, (2 if name in ADAM_FAMILY else 1) * max(sizes))
    return state, step


class _Progress:
    def __init__(self, on: bool):
        self.on = on
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.on:
            print(f"[{time.perf_counter() - self.t0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def profile(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    mode: str = "measure",
    device: str | DeviceSpec | None = None,
    repeats: int = 5,
    autocast: torch.dtype | None = None,
    trace_forwards: bool = True,
    progress: bool = False,
    mp_policy: Any = None,
    fsdp_units: Sequence[str] = (),
) -> Profile:
    """Profile one training step of `model` on `example_inputs`.

    The model's own code runs once under the recorder (forward, ``loss_fn``, backward), then, in
    measure mode, `repeats` more times to time every op; its parameters, buffers (BatchNorm
    statistics), gradients and RNG are left as they were.

    Args:
        model: the model you train, in training mode.
        example_inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments:
            the largest batch you will train with (memory is planned for it).
        loss_fn: maps the model's output to a scalar loss. Default: ``output.loss`` where the output
            has one (HF models given ``labels``), else the float mean of the first output tensor.
        optimizer: when given, its state (e.g. Adam: two tensors per parameter) and the transient
            memory of its step are part of the profile and of every budget.
        mode: ``"measure"`` runs on the model's device and times every op (median of `repeats`);
            ``"estimate"`` runs on fake tensors (no memory for weights or activations; a model on
            the meta device works) and estimates times by roofline on `device`.
        device: estimate mode: a name from `planner.devices.DEVICES` (``"h100"``) or a DeviceSpec.
        autocast: a dtype (``torch.bfloat16``) to run forward and loss under ``torch.autocast``,
            backward outside, as you train with mixed precision; None for no autocast.
        trace_forwards: trace each module's forward with `torch.fx` (one more light run of the
            step) so that regions can start inside it (`planner.stages`); False: regions are
            module calls and runs of `nn.Sequential` children only.
        progress: print what it is doing to stderr.
        mp_policy: the FSDP2 `MixedPrecisionPolicy` you will `fully_shard` with: the step is
            recorded as FSDP2 runs it (parameters and the inputs of the root and of
            `fsdp_units` cast to its ``param_dtype``, `planner.fsdp`), and the profile records
            the policy for `solvers.distributed.per_rank`.
        fsdp_units: with `mp_policy`, the modules you will `fully_shard` besides the root, whose
            floating inputs FSDP2 casts too.
    """
    if mode not in ("measure", "estimate"):
        raise CkptPlannerError(f"mode={mode!r}: expected 'measure' or 'estimate'")
    if not isinstance(model, torch.nn.Module):
        raise CkptPlannerError(f"model is a {type(model).__name__}, not a torch.nn.Module")
    check_inputs(model, example_inputs)
    check_autocast(autocast)
    if loss_fn is not None and not callable(loss_fn):
        raise CkptPlannerError(f"loss_fn is a {type(loss_fn).__name__}; pass a function of the "
                               "model's output that returns a scalar tensor")
    mp = mixed_precision(model, mp_policy) if mp_policy is not None else {}
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    # FSDP2 casts the inputs of every module it shards. Without units named, the default
    # units (each repeated block, `solvers.distributed.default_units`) are known only from the
    # profile: the step is recorded with the children of every ModuleList cast (where such
    # blocks live), and again with the default units cast if those differ where it matters.
    guess = list(fsdp_units) or [f"{name}.{child}" if name else child
                                 for name, m in model.named_modules()
                                 if isinstance(m, torch.nn.ModuleList) for child in m._modules]
    uncast: set[str] = set()
    casted: set[str] = set()
    # the user's RNG streams do not move
    with torch.random.fork_rng(devices=devices), fsdp_cast(
            model, mp_policy, guess, uncast, casted) if mp else contextlib.nullcontext():
        prof = _profile(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, mode=mode,
                        device=device, repeats=repeats, autocast=autocast,
                        trace_forwards=trace_forwards, progress=progress)
    if mp and not fsdp_units and (uncast or casted):
        from solvers.distributed import default_units

        units = default_units(prof)
        if uncast.intersection(units) or casted.difference(units):
            with torch.random.fork_rng(devices=devices), fsdp_cast(model, mp_policy, units):
                prof = _profile(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                                mode=mode, device=device, repeats=repeats, autocast=autocast,
                                trace_forwards=trace_forwards, progress=progress)
    if autocast is not None:
        prof = dataclasses.replace(prof, meta=dataclasses.replace(
            prof.meta, autocast=str(autocast).removeprefix("torch.")))
    if mp:
        prof = dataclasses.replace(prof, meta=dataclasses.replace(
            prof.meta, fsdp_mixed_precision=mp))
    return prof


def sparse_gradient_modules(model: torch.nn.Module) -> list[str]:
    """Embeddings that make sparse gradients (``sparse=True``)."""
    return [name or "(the root module)" for name, m in model.named_modules()
            if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.sparse]


def check_dense_gradients(model: torch.nn.Module, why: str) -> None:
    """Refuse embeddings with sparse gradients where the planner cannot count them (`why`)."""
    sparse = sparse_gradient_modules(model)
    if sparse:
        raise CkptPlannerError(
            f"{', '.join(sparse[:3])}{' and others' if len(sparse) > 3 else ''} "
            f"make{'s' if len(sparse) == 1 else ''} sparse gradients (sparse=True), which "
            f"the planner cannot count {why}. Plan with sparse=False on these modules: the "
            "regions are the same modules, and the plan then counts each embedding's gradient "
            "as a dense table, more than the sparse one takes")


def _profile(model, example_inputs, *, loss_fn, optimizer, mode, device, repeats, autocast,
             trace_forwards, progress) -> Profile:
    say = _Progress(progress)
    dtype = dominant_dtype(model)
    target = device if isinstance(device, DeviceSpec) else get_device(device or "h100")
    opt_state, opt_step = optimizer_bytes(
        optimizer, on_gpu=target.kind != "cpu" if mode == "estimate" else None)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    model_class = f"{type(model).__module__}.{type(model).__qualname__}"
    if mode == "estimate":
        spec_dev = device if isinstance(device, DeviceSpec) else get_device(device or "h100")
        fake_mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
        shadows = Shadows(fake_mode)
        fake = Faker(fake_mode, shadows)
        params = {k: fake(v) for k, v in model.named_parameters()}
        buffers = {k: fake(v, shadow=True) for k, v in model.named_buffers()}
        args, kwargs = split_inputs(example_inputs)
        args, kwargs = pytree.tree_map(
            lambda x: fake(x, shadow=True) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        state = {**params, **buffers}
        spec = StepSpec(
            model=model, args=args, kwargs=kwargs, loss_fn=loss_fn or default_loss,
            params=params, buffers=buffers,
            call=lambda: torch.func.functional_call(model, state, args, kwargs),
            # the fakes live on the CPU: autocast for the CPU casts them as a GPU's would
            autocast=autocast, device_type="cpu",
        )
        say(f"recording one step on fake tensors ({spec_dev.name} estimate)")
        kernels = gpu_kernels() if spec_dev.kind != "cpu" else contextlib.nullcontext()
        with fake_mode, shadows, transformers_values(shadows), kernels:
            rec = record_step(spec, fake=True, stages=trace_forwards)
        roofline_times(rec.ops, spec_dev, dtype)  # each op at its own dtype, else the model's
        say(f"recorded {len(rec.ops)} ops")
        return to_profile(
            rec, model_class=model_class, device=spec_dev.kind, device_name=spec_dev.name,
            mode=mode, dtype=dtype, torch_version=torch.__version__, grad_bytes=grad_bytes,
            optimizer_state_bytes=opt_state, optimizer_step_bytes=opt_step,
        )

    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        raise CkptPlannerError(
            "the model has parameters on the meta device, which cannot be run; use "
            "mode='estimate' to profile it without materialising weights"
        )
    dev = _device_of(model, example_inputs)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    spec = step_spec(model, example_inputs, loss_fn, autocast)
    say("recording one training step (forward, loss, backward)")
    rec = record_step(spec, timing_repeats=max(1, repeats), workspace=dev.type == "cpu",
                      device=dev, stages=trace_forwards)
    say(f"recorded {len(rec.ops)} ops; calibrating checkpoint's own cost")
    prof = to_profile(
        rec, model_class=model_class, device=dev.type, device_name=device_name(dev),
        mode=mode, dtype=dtype, torch_version=torch.__version__, grad_bytes=grad_bytes,
        optimizer_state_bytes=opt_state, optimizer_step_bytes=opt_step,
    )
    # The calibrations leave the random streams as they found them, so that the check below
    # measures the draw the recorded step made (which layers LayerDrop skipped).
    with seeded(None):
        region_ms, tensor_ms, sel_ms = checkpoint_costs(dev, sync)
        sel_model = selective_op_cost(spec, repeats, sync)
    prof = dataclasses.replace(prof, meta=dataclasses.replace(
        prof.meta, checkpoint_region_ms=region_ms, checkpoint_saved_tensor_ms=tensor_ms,
        checkpoint_selective_op_ms=max(sel_ms, sel_model)))
    say("measuring checkpoint's per-region cost on this model")
    with seeded(None):
        on_model = region_cost_on_model(prof, spec, repeats, sync)
    if on_model is not None and on_model > prof.meta.checkpoint_region_ms:
        prof = dataclasses.replace(
            prof, meta=dataclasses.replace(prof.meta, checkpoint_region_ms=on_model))
    prof = _checked(prof, model, example_inputs, loss_fn, optimizer, autocast)
    say("profiled")
    return prof


CHECK_TOLERANCE = 0.02
"""How far the simulated peak of the step as profiled may be from the measured one before
`profile` warns that the recording missed something."""


def _checked(prof: Profile, model, example_inputs, loss_fn, optimizer, autocast) -> Profile:
    """The profile with one plain step of the unplanned model measured beside its prediction
    (`ProfileMeta.measured_peak_bytes`), and a warning where they differ by more than
    `CHECK_TOLERANCE`: what the recorder did not see (work run outside it, on another thread)
    would otherwise pass silently into every plan. Skipped with several processes and where
    the model skips layers at random (the profiled draw is a seeded one)."""
    if prof.meta.random_skips or (torch.distributed.is_available()
                                  and torch.distributed.is_initialized()):
        return prof
    try:
        # with an optimizer, one step first creates its state (restored afterwards), so that
        # the step measured has it before it starts, as the profile counts it
        m = measure(model, example_inputs, loss_fn, optimizer=optimizer, repeats=0,
                    warmup=0 if optimizer is None else 1, autocast=autocast,
                    held_bytes=prof.held_bytes)
    except Exception:  # noqa: BLE001 - the recorded step ran; a check that cannot run is skipped
        return prof
    prof = dataclasses.replace(prof, meta=dataclasses.replace(
        prof.meta, measured_peak_bytes=m.peak_bytes))
    predicted = simulate(prof).peak_bytes
    if abs(predicted - m.peak_bytes) > CHECK_TOLERANCE * m.peak_bytes:
        warnings.warn(
            f"the recorded step of {prof.meta.model_class} predicts a peak of {predicted:,} "
            f"bytes without checkpointing, but a measured step peaked at {m.peak_bytes:,} "
            f"({100 * (predicted / m.peak_bytes - 1):+.1f}%): the recording missed something "
            "this model does (work outside the recorder, on another thread), so plans for it "
            "may not hold their budget. Verify any plan (`plan.verify()`) and please report "
            "the model.", stacklevel=3)
    return prof
