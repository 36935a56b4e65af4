"""Measure one training step: peak memory, memory retained after forward, and step time.

On CPU the truth is the running sum of the allocator's ``[memory]`` events from `torch.profiler`
(``profile_memory=True``): process RSS says nothing about what tensors hold. On CUDA it is
`torch.cuda.max_memory_allocated`. The step is what a training loop does:

    loss = loss_fn(module(*args, **kwargs)); loss.backward()   # output dropped before backward
    (under torch.autocast, its cache of cast weights is dropped after the loss, as leaving a
    ``with torch.autocast(...)`` block around forward and loss does)
    optimizer.step(); optimizer.zero_grad(set_to_none=True)     # when an optimizer is given

Peak bytes count everything alive during the step, parameters, buffers and inputs included
(`fixed_bytes`), as `max_memory_allocated` does; gradients are set to None before the step, so they
are allocated inside it, or with ``grads_held=True`` to zeros, as a micro-batch after the first
under gradient accumulation finds them (held before the step: fixed memory).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from planner.capture.record import (
    default_loss,
    end_of_autocast,
    host_rng_state,
    input_leaves,
    inputs_as_given,
    put_back,
    python_state,
    set_host_rng_state,
    split_inputs,
    storages_of,
)

__all__ = ["Measurement", "ddp_bucket_bytes", "fixed_bytes", "measure", "peak_of"]


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One measured training step."""

    peak_bytes: int
    """Peak of everything allocated during the step, fixed memory included."""
    retained_bytes: int
    """Bytes still held after forward and loss (what autograd saved, plus the loss)."""
    step_ms: float
    """Median wall time of a step after warm-up."""
    step_ms_all: tuple[float, ...] = ()
    """Every timed step, for the spread."""
    fixed_bytes: int = 0
    """Parameters, buffers, inputs (and optimizer state, and ``held_bytes``) held before the
    step."""


def _storages_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if hasattr(t, "to_local"):  # a DTensor (FSDP2's sharded parameter): this rank's shard
            t = t.to_local()
        if t.device.type != "meta":
            for st in storages_of(t):
                seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def ddp_bucket_bytes(module: torch.nn.Module) -> int:
    """Bytes of DistributedDataParallel's gradient buckets (held from construction on, outside
    the step), as its reducer reports them; 0 for any other module."""
    get = getattr(module, "_get_ddp_logging_data", None)
    if get is None:
        return 0
    sizes = str(get().get("bucket_sizes", "") or "")
    return sum(int(b) for b in sizes.split(",") if b.strip().isdigit())


def fixed_bytes(
    module: torch.nn.Module, example_inputs: Any, optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Bytes held before a step starts: parameters (a sharded parameter's local shard),
    buffers, input tensors, optimizer state, and DDP's gradient buckets."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [x for _, x in input_leaves(example_inputs)]
    if optimizer is not None:
        for st in optimizer.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return _storages_bytes(tensors) + ddp_bucket_bytes(module)


def _step(module, args, kwargs, loss_fn, optimizer, marker: Callable[[], None] | None,
          amp: tuple[str, torch.dtype] | None = None):
    end_of_autocast()
    with torch.autocast(amp[0], dtype=amp[1]) if amp is not None else contextlib.nullcontext():
        loss = loss_fn(module(*args, **kwargs))
    end_of_autocast()
    if marker is not None:
        marker()
    loss.backward()
    del loss
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _zero_grads(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def _hold_grads(module: torch.nn.Module) -> None:
    """Every trainable parameter's gradient held, as zeros, as the micro-batches before would
    have left them under gradient accumulation."""
    for p in module.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
        else:
            p.grad = None


def measure(
    module: torch.nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    repeats: int = 5,
    warmup: int = 1,
    restore: bool = True,
    autocast: torch.dtype | None = None,
    held_bytes: int = 0,
    grads_held: bool = False,
) -> Measurement:
    """Measure one training step of `module` (peak and retained memory, median step time).

    With ``restore=True`` (default) parameters, buffers, gradients, RNG state, the optimizer's
    state and the modules' attributes `python_state` covers are put back afterwards, so
    measuring does not train the model (the optimizer's state is kept on the host meanwhile, so
    that the copy costs no device memory).
    With `autocast` a dtype, forward and loss run under ``torch.autocast``, backward outside it.
    `held_bytes`: tensors the model holds outside its parameters and buffers that the step reads
    (a cache: `Profile.held_bytes`), counted in fixed memory as a profile counts them; nothing
    here can find them. `grads_held`: every step starts with each trainable parameter's
    gradient held (zeros), as under gradient accumulation after the first micro-batch
    (`solvers.accumulation`); they count in fixed memory.
    """
    loss_fn = loss_fn or default_loss
    args, kwargs = split_inputs(example_inputs)
    # An input that requires grad (one the model marks, to differentiate by it) gets a gradient
    # from every step: each step starts without it, as a fresh batch would.
    leaves = [x for _, x in input_leaves((args, kwargs)) if x.is_leaf]
    input_grads = [x.grad for x in leaves]
    model_reset = _hold_grads if grads_held else _zero_grads

    def reset(m: torch.nn.Module) -> None:
        model_reset(m)
        for x in leaves:
            x.grad = None

    params = list(module.parameters())
    saved_state = (
        [p.detach().clone() for p in params],
        [b.detach().clone() for b in module.buffers()],
    ) if restore else None
    saved_opt = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True),
                                     optimizer.state_dict()) \
        if restore and optimizer is not None else None
    saved_grads = [p.grad for p in params]
    dev = next((p.device for p in params), torch.device("cpu"))
    cuda = dev.type == "cuda"
    amp = (dev.type, autocast) if autocast is not None else None
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(dev) if cuda else None
    host_rng = host_rng_state()

    def same_draw() -> None:
        """Every step draws what the first did (dropout masks, LayerDrop's skips): the step
        measured is the one the caller's RNG state gives."""
        torch.random.set_rng_state(rng)
        set_host_rng_state(host_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, dev)

    def same_buffers() -> None:
        """Every step starts from the buffer values the first did: a step's memory can depend
        on them (the Routing Transformer's k-means centroids, which a backward hook moves every
        step, route tokens). A buffer the warm-up gave its shape (a quantization observer's
        statistics start empty) keeps it, as in the profile's recorded step."""
        if saved_state is not None:
            with torch.no_grad():
                for b, v in zip(module.buffers(), saved_state[1], strict=True):
                    if b.shape == v.shape:
                        b.copy_(v)

    with python_state(module) if restore else contextlib.nullcontext():
        try:
            for _ in range(warmup):
                reset(module)
                with inputs_as_given(args, kwargs):
                    _step(module, args, kwargs, loss_fn, optimizer, None, amp)
                same_draw()
                same_buffers()
            reset(module)
            fixed = fixed_bytes(module, example_inputs, optimizer) + held_bytes + (
                _storages_bytes([p.grad for p in params]) if grads_held else 0)
            # No collection during the measured step: one its allocations happen to trigger could
            # free what reference cycles hold from before the profiler started (the warm-up's, the
            # caller's), lowering the running sum, or the step's own cycles, which the profile keeps
            # to the step's end. (A full collection here instead costs as much as the whole
            # process's objects, on every call.)
            collecting = gc.isenabled()
            gc.disable()
            try:
                if cuda:
                    peak, retained = _measure_cuda(module, args, kwargs, loss_fn, optimizer, amp)
                else:
                    peak, retained = _measure_cpu(module, args, kwargs, loss_fn, optimizer, amp,
                                                  same_draw, reset)
            finally:
                if collecting:
                    gc.enable()
            times = []
            for _ in range(repeats):
                same_draw()
                reset(module)
                with inputs_as_given(args, kwargs):  # its copies made outside the timer
                    if cuda:
                        torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    _step(module, args, kwargs, loss_fn, optimizer, None, amp)
                    if cuda:
                        torch.cuda.synchronize(dev)
                    times.append((time.perf_counter() - t0) * 1e3)
        finally:
            same_draw()
            if saved_state is not None:
                with torch.no_grad():
                    for p, v in zip(params, saved_state[0], strict=True):
                        p.copy_(v)
                    for b, v in zip(module.buffers(), saved_state[1], strict=True):
                        put_back(b, v)
            if saved_opt is not None:
                optimizer.load_state_dict(saved_opt)
            for p, g in zip(params, saved_grads, strict=True):
                p.grad = g
            for x, g in zip(leaves, input_grads, strict=True):
                x.grad = g
    return Measurement(
        peak_bytes=fixed + peak,
        retained_bytes=retained,
        step_ms=statistics.median(times) if times else float("nan"),
        step_ms_all=tuple(round(t, 3) for t in times),
        fixed_bytes=fixed,
    )


DISTRIBUTED_STEPS = 6
"""Steps profiled on CPU when torch.distributed is initialized (see `_measure_cpu`)."""


def _measure_cpu(module, args, kwargs, loss_fn, optimizer, amp,
                 same_draw: Callable[[], None] = lambda: None,
                 reset: Callable[[torch.nn.Module], None] = _zero_grads) -> tuple[int, int]:
    """Peak (above what existed before) and retained-after-forward bytes from memory events.

    Under torch.distributed (gloo), some frees run on gloo's worker threads, which the profiler
    does not record: a step then reads as ending above where it started, by the tensors whose
    frees it missed, and its running sum is too high from the first missed free on. A missed
    free can only raise a step's reading, and every step holds the same memory (the same draw),
    so `DISTRIBUTED_STEPS` steps are profiled and the lowest reading of each is the step's
    (a step whose frees were all recorded, or were missed after its peak, reads exactly)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def marker():
        with record_function("ckpt_planner::forward_done"):
            pass

    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    peaks, kept = [], []
    for _ in range(DISTRIBUTED_STEPS if dist else 1):
        same_draw()
        reset(module)  # with an optimizer, its zero_grad left them None after the step before
        with inputs_as_given(args, kwargs), \
                profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _step(module, args, kwargs, loss_fn, optimizer, marker, amp)
        peak, retained = _peak_and_retained(prof, "ckpt_planner::forward_done")
        peaks.append(peak)
        kept.append(retained)
    return min(peaks), min(kept)


def peak_of(prof: Any) -> int:
    """The peak, above where it started, of what a `torch.profiler` run with
    ``profile_memory=True`` allocated."""
    return _peak_and_retained(prof, "")[0]


def _peak_and_retained(prof: Any, mark: str) -> tuple[int, int]:
    """Walk the profiler's event tree: allocation events carry signed sizes (frees negative);
    their running sum in time order is the memory the step holds above its start. Returns
    (peak, retained after `mark`).

    A free the profiler did not record (one run on a thread it does not follow) shows when the
    block's address is allocated again: the block is dropped from the sum there, the latest it
    can have been freed."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, int]] = []
    marks: list[int] = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
        elif e.name == mark:
            marks.append(e.start_time_ns)
        todo.extend(e.children)
    events.sort()
    mark_t = min(marks) if marks else None
    cur = peak = 0
    retained = None
    live: dict[int, int] = {}  # address -> bytes of the blocks allocated in the step
    for t, delta, ptr in events:
        if mark_t is not None and retained is None and t > mark_t:
            retained = cur
        if delta > 0:
            cur -= live.pop(ptr, 0)  # its free was not recorded
            live[ptr] = delta
        else:
            live.pop(ptr, None)
        cur += delta
        peak = max(peak, cur)
    return peak, retained if retained is not None else cur


def _measure_cuda(module, args, kwargs, loss_fn, optimizer, amp) -> tuple[int, int]:
    with inputs_as_given(args, kwargs):  # its copies made before the count starts
        return _measure_cuda_step(module, args, kwargs, loss_fn, optimizer, amp)


def _measure_cuda_step(module, args, kwargs, loss_fn, optimizer, amp) -> tuple[int, int]:
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    box: dict[str, int] = {}

    def marker():
        torch.cuda.synchronize(dev)
        box["retained"] = torch.cuda.memory_allocated(dev) - base

    _step(module, args, kwargs, loss_fn, optimizer, marker, amp)
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - base, box.get("retained", 0)
