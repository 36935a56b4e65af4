"""What `plan(..., compile="inductor")` picks for one benchmark model at one budget, and whether
its pick holds when every fitting candidate is timed again.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 HF_HUB_OFFLINE=1 \\
        python benchmarks/compiled_pick.py gpt_eager 267548202

The second argument is the budget in bytes (compare's budget for a cell: `budgets` in
`benchmarks/compare/<model>/results.json`). Prints each fitting candidate of the search with its
measured peak and step-time samples, the pick, then every candidate re-timed `--rounds` rounds
in turn (2 steps each), so that a pick can be told from a tie, together with inductor(1) without
a plan (whether or not it fits: the reference of issue 10's half rule), each round's times also
given as ratios to it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import planner
import planner.compiled as pc
from benchmarks import cpu_sizes
from planner.measurement import measure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a model of benchmarks/cpu_sizes.py, e.g. gpt_eager")
    ap.add_argument("budget_bytes", type=int)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    made = getattr(cpu_sizes, args.model)()
    model, x = made[0], made[1]
    loss_fn = made[2] if len(made) > 2 else None
    model.train()

    reference = pc.compile_copy(model, None, "inductor", 1.0)  # before plan() changes model
    measure(reference, x, loss_fn, repeats=1, warmup=1)  # compiles it
    seen: list[pc.Candidate] = []
    search_fastest = pc.fastest

    def fastest(candidates, time_step, rounds=pc.TIMING_ROUNDS):
        best = search_fastest(candidates, time_step, rounds)
        for c in candidates:
            print(f"candidate {c.label('inductor')} ({c.cost_model}): peak {c.peak_bytes} B, "
                  f"median {statistics.median(c.step_ms):.1f} ms of "
                  f"{[round(t, 1) for t in c.step_ms]}")
        print(f"picked {best.label('inductor')} ({best.cost_model})", flush=True)
        seen.extend(candidates)
        return best

    pc.fastest = fastest  # the search calls it through the module
    t0 = time.perf_counter()
    planner.plan(model, budget_bytes=args.budget_bytes, example_inputs=x, loss_fn=loss_fn,
                 compile="inductor")
    print(f"plan: {time.perf_counter() - t0:.0f} s")
    samples: dict[int, list[float]] = {id(c): [] for c in seen}
    ref: list[float] = []
    for r in range(args.rounds):
        order = [None, *seen] if r % 2 == 0 else [*seen[::-1], None]
        for c in order:
            ms = measure(reference if c is None else c.module, x, loss_fn, repeats=2,
                         warmup=0).step_ms
            (ref if c is None else samples[id(c)]).append(ms)
    print(f"re-timed inductor(1) without a plan: median {statistics.median(ref):.1f} ms, "
          f"{min(ref):.1f}-{max(ref):.1f}")
    for c in seen:
        s = samples[id(c)]
        ratios = [t / q for t, q in zip(s, ref)]
        print(f"re-timed {c.label('inductor')} ({c.cost_model}): median "
              f"{statistics.median(s):.1f} ms, {min(s):.1f}-{max(s):.1f}; over inductor(1), "
              f"per round: median {statistics.median(ratios):.3f}, "
              f"{min(ratios):.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
