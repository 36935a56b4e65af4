"""Gradient accumulation: what a plan made for single steps does to the micro-batches after the
first, and what `plan(..., grad_accumulation=True)` does instead.

    HF_HUB_OFFLINE=1 python benchmarks/accumulation.py [model ...] [--offline-only]

Offline (torch-free, the committed profiles of `profiles/`): for each, the plan at half the
activations (budget = fixed + 0.5 x activations of the first micro-batch, raised to the smallest
peak a single step reaches where that is higher), simulated on the step
a later micro-batch runs (`solvers.accumulation.holding_grads`): how far over the budget it goes,
and the plan made for that step instead, with its predicted extra time.

Measured (this CPU, `benchmarks/cpu_sizes.py`): the same two plans applied to the model and a
loop of three accumulated micro-batches run under `torch.profiler` (its running sum of
allocations plus what was held before: the loop's peak), beside the predictions. Prints
Markdown tables (benchmarks/RESULTS.md, "Gradient accumulation").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from solvers import Profile, simulate  # noqa: E402
from solvers.accumulation import holding_grads  # noqa: E402
from solvers.solve import smallest_peak, solve  # noqa: E402

MODELS = ("gpt_eager", "hf_gpt2", "hf_llama", "resnet_bn", "unet", "deep_narrow_cnn")
PROFILES = ("gpt2_small_h100", "llama7b_h100", "llama3_70b_lora16_seq4096")
MiB, GiB = 2**20, 2**30
FRACTION = 0.5


def _budget(prof: Profile, f: float = FRACTION) -> int:
    n = simulate(prof).peak_bytes
    return int(prof.fixed_bytes + f * (n - prof.fixed_bytes))


def offline(name: str) -> str:
    prof = Profile.load(ROOT / "profiles" / f"{name}.json.gz")
    held = holding_grads(prof)
    budget = max(_budget(prof), smallest_peak(prof))  # raised to where a single-step plan fits
    single = solve(prof, budget, method="auto", time_limit_s=20)
    later = simulate(held, single.regions).peak_bytes
    made = solve(held, budget, method="auto", time_limit_s=20)
    floor = smallest_peak(held)

    def pct(s) -> str:
        return f"{100 * s.predicted_recompute_ms / prof.step_ms:+.1f}%"

    ours = (f"{made.predicted_peak_bytes / GiB:.2f}, {pct(made)}" if made.feasible
            else f"none fits (smallest peak {floor / GiB:.2f})")
    return (f"| {name} | {prof.grad_bytes / GiB:.2f} | {budget / GiB:.2f} | "
            f"{single.predicted_peak_bytes / GiB:.2f}, {pct(single)} | {later / GiB:.2f} "
            f"({(later - budget) / GiB:+.2f}) | {ours} |")


def measured(name: str) -> str:
    import torch

    import planner
    from benchmarks import cpu_sizes
    from planner.api import plan_from_profile
    from planner.measurement import measure
    from tests.models import accumulated_loop_peak

    torch.manual_seed(0)
    model, x = getattr(cpu_sizes, name)()
    model.train()
    prof = planner.profile(model, x, repeats=1)
    held = holding_grads(prof)
    first = measure(model, x, repeats=0).peak_bytes
    later = measure(model, x, repeats=0, grads_held=True).peak_bytes
    looped = accumulated_loop_peak(model, x)
    budget = _budget(prof)
    cells = []
    for p in (prof, held):
        plan = plan_from_profile(model, p, budget_bytes=budget, method="auto")
        try:
            cells.append((plan.predicted_peak_bytes, accumulated_loop_peak(model, x),
                          100 * plan.schedule.predicted_recompute_ms / prof.step_ms))
        finally:
            planner.remove(model)
    (sp, sl, sx), (hp, hl, hx) = cells
    return (f"| {name} | {prof.grad_bytes / MiB:.1f} | {first / MiB:.1f} | "
            f"{later / MiB:.1f} ({simulate(held).peak_bytes - later:+d} B) | "
            f"{looped / MiB:.1f} | {budget / MiB:.1f} | {sl / MiB:.1f} ({(sl - budget) / MiB:+.1f})"
            f", {sx:+.1f}% | {hl / MiB:.1f} (pred {hp / MiB:.1f}), {hx:+.1f}% |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(MODELS))
    ap.add_argument("--offline-only", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    print(f"Offline, auto at fixed + {FRACTION} x activations of the first micro-batch, or its "
          "smallest peak where higher (GiB):\n")
    print("| profile | gradients | budget | single-step plan: peak, extra (pred) | its peak "
          "from the 2nd micro-batch (over) | plan for accumulation: peak, extra (pred) |")
    print("|---|---|---|---|---|---|")
    for name in PROFILES:
        print(offline(name), flush=True)
    if args.offline_only:
        return
    from benchmarks._cli import check_models_and_allocator

    check_models_and_allocator(ap, args.models, MODELS, "accumulation.py")
    print("\nMeasured on this CPU, three micro-batches accumulated (MiB):\n")
    print("| model | gradients | 1st micro-batch peak | later (prediction - measured) | loop "
          "of 3, unplanned | budget | single-step plan: loop peak (over), extra (pred) | "
          "plan for accumulation: loop peak, extra (pred) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        print(measured(name), flush=True)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
