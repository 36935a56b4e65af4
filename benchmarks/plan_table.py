"""Measured peak and extra step time of our plan against per-block and uniform sqrt(N) checkpointing.

For each model of the TINY zoo and each budget ``F + f * (N - F)`` (``N`` the simulated peak without
checkpointing, ``F`` the fixed memory, ``f`` in 0.7, 0.5, 0.3; raised to the smallest feasible peak
where needed), every strategy is applied to the model in place and measured in this one process
with `planner.measure`
(``repeats=5``), alternating strategies and repeating the round 3 times; medians are reported.

    HF_HUB_OFFLINE=1 python benchmarks/plan_table.py [--sizes small|default] [--models a,b]

Prints a Markdown table. Peaks are CPU allocator peaks of one training step (forward + backward,
parameters and inputs included), as `planner.measure` defines them. A baseline whose segments
span several module calls (sqrt_n outside an nn.Sequential) cannot be applied in place: its row
shows the prediction only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner import measure, profile  # noqa: E402
from planner.api import SLACK_BYTES  # noqa: E402
from planner.inplace import applying  # noqa: E402
from solvers.simulate import simulate  # noqa: E402
from solvers.solve import applicable, smallest_peak, solve  # noqa: E402
from tests.models import TINY  # noqa: E402

MiB = 2**20
FRACTIONS = (0.7, 0.5, 0.3)
STRATEGIES = ("none", "ours", "per_block", "sqrt_n")

SMALL = {
    "mlp_dropout": dict(batch=1024),
    "gpt_eager": dict(batch=4, seq=64, dim=64, layers=2, vocab=256),
    "hf_gpt2": dict(batch=4, seq=64, layers=2, n_embd=64, vocab=512),
    "hf_llama": dict(batch=4, seq=64, layers=2, hidden=64, intermediate=172, vocab=512),
    "resnet_bn": dict(batch=4, width=16, blocks=(1, 1, 1), image=32),
    "unet": dict(batch=2, base=8, depth=2, image=32),
    "ln_linear_stack": dict(batch=16, seq=64, dim=128, n=8),
    "deep_narrow_cnn": dict(batch=2, channels=8, depth=8, image=32),
}
"""Sizes used by `--sizes small` (the default: the full-size zoo takes too long on 2 cores)."""


def run_model(name: str, kwargs: dict, method: str, rounds: int, repeats: int) -> list[dict]:
    model, x = TINY[name](**kwargs)
    model.train()
    prof = profile(model, x, repeats=3)
    n_peak = simulate(prof).peak_bytes
    least = smallest_peak(prof) + SLACK_BYTES  # the smallest budget plan() keeps its slack at
    rows = []
    for f in FRACTIONS:
        budget = max(int(prof.fixed_bytes + f * (n_peak - prof.fixed_bytes)), least)
        scheds = {
            # as planner.plan does: keep SLACK_BYTES for the few allocations the profile misses
            "ours": solve(prof, budget - SLACK_BYTES, method=method),
            "per_block": solve(prof, budget, method="per_block"),
            "sqrt_n": solve(prof, budget, method="sqrt_n"),
        }
        runnable = ["none", *(k for k, s in scheds.items() if applicable(s))]
        peaks: dict[str, list[int]] = {k: [] for k in STRATEGIES}
        times: dict[str, list[float]] = {k: [] for k in STRATEGIES}
        for _ in range(rounds):
            for k in runnable:
                if k == "none":
                    m = measure(model, x, repeats=repeats)
                else:
                    with applying(model, scheds[k]):
                        m = measure(model, x, repeats=repeats)
                peaks[k].append(m.peak_bytes)
                times[k].append(m.step_ms)
        med_t = {k: statistics.median(v) for k, v in times.items() if v}
        row = {
            "model": name,
            "f": f,
            "budget": budget,
            "none_peak": statistics.median(peaks["none"]),
            "none_ms": med_t["none"],
        }
        for k in ("ours", "per_block", "sqrt_n"):
            row[k] = {
                "peak": statistics.median(peaks[k]) if peaks[k] else None,
                "pred": scheds[k].predicted_peak_bytes,
                "extra": 100 * (med_t[k] / med_t["none"] - 1) if times[k] else None,
                "method": scheds[k].method,
                "status": scheds[k].status,
            }
        rows.append(row)
        print(f"# {name} f={f}: done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    out = [
        "| model | budget (MiB) | none: peak | ours: peak (pred), extra % | "
        "per_block: peak (pred), extra % | sqrt_n: peak (pred), extra % | fits? |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        fits = []
        for k in ("ours", "per_block", "sqrt_n"):
            c = r[k]
            if c["peak"] is None:
                cells.append(f"not in place ({c['pred'] / MiB:.1f} predicted)")
                fits.append(f"{k} n/a")
                continue
            cells.append(
                f"{c['peak'] / MiB:.1f} ({c['pred'] / MiB:.1f}), {c['extra']:+.0f}%"
            )
            fits.append(f"{k} {'yes' if c['peak'] <= r['budget'] else 'no'}")
        out.append(
            f"| {r['model']} | {r['budget'] / MiB:.1f} ({int(r['f'] * 100)}%) | "
            f"{r['none_peak'] / MiB:.1f} | " + " | ".join(cells) + f" | {'; '.join(fits)} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", choices=("small", "default"), default="small")
    ap.add_argument("--models", default=",".join(TINY))
    ap.add_argument("--method", default="auto", help="our solver (auto or dp)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    rows = []
    for name in a.models.split(","):
        kwargs = SMALL[name] if a.sizes == "small" else {}
        rows += run_model(name, kwargs, a.method, a.rounds, a.repeats)
    print(table(rows))
    print(
        f"\n{a.sizes} sizes; torch {torch.__version__}; {torch.get_num_threads()} threads; "
        f"{time.perf_counter() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()
