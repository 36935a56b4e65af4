"""Estimate mode (this code, this machine, no GPU) against the peaks a GPU run measured.

    HF_HUB_OFFLINE=1 python benchmarks/gpu/estimate_check.py [benchmarks/gpu/results/<run>]

For each model of the run, builds the same model on the meta device, profiles it in estimate mode
for the run's GPU (h200), and predicts the peak of each measured schedule there: the baselines
solved again on the run's measure-mode profile, our plans re-solved at the row's budget on it
(used only where the re-solved plan predicts the row's peak exactly, i.e. it is the same plan),
each carried over to the new profile by module path (`bench.carry_over`). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

import bench  # noqa: E402

import planner  # noqa: E402
from solvers import Profile, solve  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", default=str(HERE / "results" / "h200-2026-12-04"))
    ap.add_argument("--device", default="h200", help="estimate-mode device spec")
    a = ap.parse_args()
    run = Path(a.run)
    res = json.loads((run / "results.json").read_text())
    print(f"Estimate mode ({a.device}) at this commit against {run.name} "
          f"({res['meta'].get('device')}, torch {res['meta'].get('torch')})\n")
    print("| model | strategy | measured peak GiB | estimate now GiB | error | estimate in the run |")
    print("|---|---|---|---|---|---|")
    for name in res["models"]:
        spec = bench.GPU_MODELS[name]
        model, inputs = bench.build(spec, "meta", torch.bfloat16)
        est = planner.profile(model, inputs, mode="estimate", device=a.device)
        src = Profile.load(run / f"{name}.profile.json.gz")
        for r in res["rows"]:
            m, pred = r.get("measured_peak_bytes"), r.get("predicted_peak_bytes")
            if r["model"] != name or not m or not pred:
                continue
            st = r["strategy"]
            if st.startswith("ours@"):
                s = solve(src, r["budget_bytes"] or m + 1, r["method"], time_limit_s=10)
                if s.predicted_peak_bytes != pred:
                    print(f"| {name} | {st} | {m / 2**30:.2f} | re-solved plan differs |||")
                    continue
            else:
                s = solve(src, 2**62, st)
            try:
                p = bench.carry_over(s, src, est).predicted_peak_bytes
            except ValueError as ex:
                print(f"| {name} | {st} | {m / 2**30:.2f} | n/a: {str(ex)[:80]} |||")
                continue
            old = r.get("est_peak_bytes")
            then = f"{old / 2**30:.2f} ({100 * (old - m) / m:+.2f}%)" if old else ""
            print(f"| {name} | {st} | {m / 2**30:.2f} | {p / 2**30:.2f} | "
                  f"{100 * (p - m) / m:+.2f}% | {then} |")


if __name__ == "__main__":
    main()
