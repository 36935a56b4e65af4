"""The test zoo (`tests/zoo.py`: models nobody here wrote, called as people train them), planned at
0.75, 0.5 and 0.3 x its activation memory: predicted against measured peak, fit, gradients.

    HF_HUB_OFFLINE=1 python benchmarks/zoo_table.py          # a Markdown table, under a minute
    HF_HUB_OFFLINE=1 python benchmarks/zoo_table.py --outside   # the families outside the zoo
    HF_HUB_OFFLINE=1 python benchmarks/zoo_table.py --autocast bf16   # profiled and run under autocast

The same plans as `tests/planner/test_zoo.py`, which asserts them; this prints the figures.
``--outside`` plans the families of `benchmarks/outside_zoo.py` instead (asserted there too).
``--autocast bf16|fp16`` profiles, plans and verifies with forward and loss under
`torch.autocast`; a model whose own forward raises so gets a row saying why. The last column
runs each plan on the case's smaller batch (smaller in batch and sequence or image size, under
the same autocast): its measured peak against the budget, and its loss and gradients against the
unplanned model's on that batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import planner  # noqa: E402
from planner.api import SLACK_BYTES, plan_from_profile  # noqa: E402
from solvers.simulate import simulate  # noqa: E402
from solvers.solve import smallest_peak  # noqa: E402
from tests.zoo import CASES  # noqa: E402

FRACTIONS = (0.75, 0.5, 0.3)
KiB = 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outside", action="store_true", help="benchmarks/outside_zoo.py's families")
    ap.add_argument("--autocast", choices=("bf16", "fp16"),
                    help="profile, plan and verify under torch.autocast")
    args = ap.parse_args(argv)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.autocast]
    t0 = time.perf_counter()
    try:  # transformers' config notices would land in the table when stderr is redirected too
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    print("| model | family | budget | plan | predicted peak KiB | measured peak KiB | "
          "predicted - measured | fits | max grad rel err | smaller batch: peak KiB, grads |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    cases = CASES
    if args.outside:
        from benchmarks.outside_zoo import CASES as cases
    for name in sorted(cases):
        torch.manual_seed(0)
        case = cases[name]()
        try:
            prof = planner.profile(case.model, case.inputs, loss_fn=case.loss_fn, repeats=1,
                                   autocast=amp)
        except planner.CkptPlannerError as e:
            print(f"| {name} | {case.family} | | does not profile: "
                  f"{str(e).splitlines()[0][:120]} | | | | | | |")
            continue
        n, least = simulate(prof).peak_bytes, smallest_peak(prof)
        for f in FRACTIONS:
            budget = int(prof.fixed_bytes + f * (n - prof.fixed_bytes))
            head = f"| {name} | {case.family} | {f:g}x = {budget / KiB:.0f} KiB |"
            if budget < least + SLACK_BYTES:
                print(f"{head} none: smallest peak {least / KiB:.0f} KiB | | | | | | |")
                continue
            p = plan_from_profile(case.model, prof, budget_bytes=budget)
            p.loss_fn, p.example_inputs = case.loss_fn, case.inputs
            try:
                v = p.verify(repeats=1)
                small = _smaller_batch(case, amp, budget)
            finally:
                planner.remove(case.model)
            small = small if isinstance(small, str) else small()
            err = (v.predicted_peak_bytes - v.measured_peak_bytes) / v.measured_peak_bytes
            worst = max(worst, abs(err))
            print(f"{head} {p.schedule.method}, {len(p.schedule.regions)} regions | "
                  f"{v.predicted_peak_bytes / KiB:.1f} | {v.measured_peak_bytes / KiB:.1f} | "
                  f"{100 * err:+.3f}% | {'yes' if v.measured_peak_bytes <= budget else 'NO'} | "
                  f"{v.max_grad_rel_err:.1e} | {small} |")
    print(f"\nlargest |predicted - measured| / measured: {100 * worst:.3f}%; "
          f"{time.perf_counter() - t0:.0f} s")
    return 0


def _smaller_batch(case, amp, budget: int):
    """The planned model's step on the case's smaller batch (under the same autocast): its
    measured peak, then, once the caller has removed the plan, the unplanned step's loss and
    gradients compared with the planned one's. Returns the cell, or a callable that makes it
    after the removal."""
    from planner.api import _one_step
    from planner.capture.record import default_loss
    from planner.measurement import measure

    loss_fn = case.loss_fn or default_loss
    try:
        l1, g1 = _one_step(case.model, case.small_inputs, loss_fn, autocast=amp)
        peak = measure(case.model, case.small_inputs, loss_fn, repeats=1,
                       autocast=amp).peak_bytes
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"RAISES {type(e).__name__}: {str(e).splitlines()[0][:100]}"

    def equal(a, b) -> bool:
        (la, ga), (lb, gb) = a, b
        return ga.keys() == gb.keys() and torch.allclose(la, lb, rtol=1e-5, atol=1e-6) and all(
            torch.allclose(ga[k], gb[k], rtol=1e-5, atol=1e-6) for k in ga)

    def cell() -> str:
        unplanned = _one_step(case.model, case.small_inputs, loss_fn, autocast=amp)
        fits = "within budget" if peak <= budget else "OVER BUDGET"
        if equal((l1, g1), unplanned):
            return f"{peak / KiB:.1f}, {fits}, equal"
        # Some kernels' results depend on where their buffers lie (oneDNN's bf16 3-D
        # convolutions): then the unplanned step differs from itself as much.
        again = [_one_step(case.model, case.small_inputs, loss_fn, autocast=amp) for _ in range(3)]
        spread = max(float((unplanned[1][k] - a[1][k]).abs().max()) for a in again for k in g1)
        off = max(float((unplanned[1][k] - g1[k]).abs().max()) for k in g1)
        if not all(equal(unplanned, a) for a in again):
            return (f"{peak / KiB:.1f}, {fits}, grads differ by {off:.1e}; the unplanned step "
                    f"differs from itself by {spread:.1e}")
        return f"{peak / KiB:.1f}, {fits}, GRADS DIFFER"

    return cell


if __name__ == "__main__":
    raise SystemExit(main())
