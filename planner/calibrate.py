"""What checkpointing itself costs on this device, measured: the host time that non-reentrant
`torch.utils.checkpoint` adds per region, per saved tensor, and per op of a selective region.

The per-op times of a profile say what recomputation costs; these say what the machinery around it
costs, which on a CPU (or with small kernels on a GPU) is not negligible. They are measured in
measure mode only (in estimate mode a GPU overlaps host work with kernels) and stored in
`ProfileMeta`, where `solvers.simulate` charges them.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch

from planner.capture.record import StepSpec, restoring, run_step
from planner.inplace import apply_schedule, remove
from solvers.chain import region, useful_calls
from solvers.profile import Profile
from solvers.schedule import Schedule
from solvers.simulate import simulate
from solvers.solve import finish

__all__ = ["checkpoint_costs", "region_cost_on_model", "selective_op_cost"]


_MEASURED: dict[tuple[str, int | None, int, int], tuple[float, float, float]] = {}
"""`checkpoint_costs` per (device, n, reps), measured once per process."""


def checkpoint_costs(device: torch.device, sync: Callable[[], None], n: int = 32,
                     reps: int = 30) -> tuple[float, float, float]:
    """(ms per region, ms per saved tensor, ms per selective-region op) on `device`.

    These are costs of torch's checkpoint machinery on the device, not of any model: measured on
    the first call for a device and the same figures returned after that (a process that
    profiles many models, or one model at several batches, does not re-measure them, and its
    profiles agree on them). The model-specific refinements (`selective_op_cost`,
    `region_cost_on_model`) run per profile.

    A chain of `n` tiny ops that each save their input is run plain, as one checkpointed region,
    and as 8 regions, alternating, `reps` times (medians). With r the chain's forward time:
    8 regions - 1 region = 7 per-region costs; 1 region - plain - per-region - r = n saved-tensor
    costs (pack in forward, pack again in the replay, unpack); a selective region that recomputes
    everything minus the plain region = n per-op costs of the selective dispatch mode."""
    key = (device.type, device.index, n, reps)
    if key not in _MEASURED:
        _MEASURED[key] = _measure_costs(device, sync, n, reps)
    return _MEASURED[key]


def _measure_costs(device: torch.device, sync: Callable[[], None], n: int,
                   reps: int) -> tuple[float, float, float]:
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


def _rounds(repeats: int) -> int:
    """Alternating rounds for the on-model calibrations (the first is a warm-up): at most 4 timed,
    so that a large `repeats` for the op times does not multiply these whole-model runs too."""
    return min(max(1, repeats), 3) + 2


def selective_op_cost(spec: StepSpec, repeats: int, sync: Callable[[], None]) -> float:
    """Host ms per op that a selective region adds, measured on this model's own forward.

    The forward runs plainly and under selective checkpointing's forward dispatch mode (every op
    recomputed), alternating; the difference per dispatched op, doubled for the replay, which
    goes through the same kind of mode. Real ops (several tensor and list arguments, views) cost
    the mode more than `checkpoint_costs`'s one-argument chain does. 0.0 if the mode cannot run."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    calls = [0]

    def policy(ctx, func, *a, **k):
        calls[0] += 1
        return CheckpointPolicy.PREFER_RECOMPUTE

    plain: list[float] = []
    sac: list[float] = []
    try:
        for r in range(_rounds(repeats)):
            calls[0] = 0
            for mode in (None, "sac"):
                with restoring(spec):
                    ctx = (create_selective_checkpoint_contexts(policy)[0] if mode
                           else contextlib.nullcontext())
                    sync()
                    t0 = time.perf_counter()
                    with ctx:
                        out = spec.call()
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


def region_cost_on_model(prof: Profile, spec: StepSpec, repeats: int,
                         sync: Callable[[], None]) -> float | None:
    """Host ms per checkpointed region on this model, measured: what a plan of many small regions
    (the innermost module calls that can save memory, disjoint) costs beyond the simulator's
    prediction with the chain-calibrated per-region cost left out, per region. None when the
    model has fewer than 4 such regions or the plan cannot run.

    `checkpoint_costs`'s regions take one small tensor; a model's regions take several inputs and
    run Python-level module code with autograd on, which the per-op times leave out. The model
    is left as it was: the plan is removed, buffers and RNG restored."""
    spans = sorted(useful_calls(prof), key=lambda s: (s.b - s.a, s.a))
    chosen: list = []
    taken: list[tuple[int, int]] = []
    for s in spans:
        if s.call.module == "" or any(not (s.b < a or s.a > b) for a, b in taken):
            continue
        chosen.append(s)
        taken.append((s.a, s.b))
    if len(chosen) < 4:
        return None
    chosen.sort(key=lambda s: s.a)
    regs = tuple(region(prof, s.a, s.b) for s in chosen)
    sched = finish(prof, Schedule(regions=regs, method="calibration"), 2**62)
    plain: list[float] = []
    planned: list[float] = []
    try:
        for r in range(_rounds(repeats)):
            for with_plan, out_list in ((False, plain), (True, planned)):
                if with_plan:
                    apply_schedule(spec.model, sched)
                try:
                    with restoring(spec):
                        sync()
                        t0 = time.perf_counter()
                        run_step(spec, None, hooks=False)
                        sync()
                        if r > 0:
                            out_list.append((time.perf_counter() - t0) * 1e3)
                finally:
                    remove(spec.model)
    except Exception:  # noqa: BLE001 - an optional refinement; the chain calibration stands
        return None
    predicted = simulate(prof, sched).recompute_ms - len(regs) * prof.meta.checkpoint_region_ms
    extra = statistics.median(planned) - statistics.median(plain)
    return round(max(0.0, (extra - predicted) / len(regs)), 5)
