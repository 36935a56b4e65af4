"""Estimate mode against measure mode, family by family, on this CPU: does the fake-tensor step
record the real one?

    HF_HUB_OFFLINE=1 python benchmarks/estimate_vs_measure.py [-o out.jsonl] [family ...]

For every case of `tests.zoo` and `benchmarks.outside_zoo` (or the families named): a measure-mode
profile (one real step) and an estimate-mode profile for a CPU spec (fake tensors, the same
kernels), then whether they record the same ops, and the simulated peak of each without
checkpointing. Estimate mode does not see a kernel's scratch memory (CPU convolutions measure
theirs in measure mode), so convolutional models differ by that. Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.outside_zoo import CASES as OUTSIDE  # noqa: E402
from planner import profile  # noqa: E402
from planner.devices import cpu_spec  # noqa: E402
from solvers import simulate  # noqa: E402
from tests.zoo import CASES as ZOO  # noqa: E402


def compare(build) -> dict:
    case = build()
    measured = profile(case.model, case.inputs, loss_fn=case.loss_fn, repeats=1)
    r = {"measure_peak": simulate(measured).peak_bytes,
         "workspace": max((n.workspace_bytes for n in measured.nodes), default=0)}
    try:
        est = profile(case.model, case.inputs, loss_fn=case.loss_fn, mode="estimate",
                      device=cpu_spec(measure=False))
    except Exception as ex:  # noqa: BLE001 - the planner's own error says why
        r["estimate_error"] = f"{type(ex).__name__}: {ex}"
        return r
    r["estimate_peak"] = simulate(est).peak_bytes
    r["same_ops"] = [n.op for n in est.nodes] == [n.op for n in measured.nodes]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*")
    ap.add_argument("-o", "--out", help="also write one JSON line per family")
    a = ap.parse_args()
    cases = {**{f"zoo:{k}": v for k, v in ZOO.items()},
             **{f"outside:{k}": v for k, v in OUTSIDE.items()}}
    names = a.families or list(cases)
    out = open(a.out, "w") if a.out else None
    print("| family | same ops | measure peak B | estimate peak B | difference | note |")
    print("|---|---|---|---|---|---|")
    for name in names:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                r = compare(cases[name])
            except Exception as ex:  # noqa: BLE001 - a model whose real step fails
                r = {"measure_error": f"{type(ex).__name__}: {ex}"}
        r.update(family=name, seconds=round(time.perf_counter() - t0, 1))
        if out:
            out.write(json.dumps(r) + "\n")
            out.flush()
        m, e = r.get("measure_peak"), r.get("estimate_peak")
        note = (r.get("estimate_error") or r.get("measure_error") or "")[:140].replace("|", "/")
        if m and e and m != e and r["workspace"]:
            note = f"measure mode counts {r['workspace']:,} B of kernel scratch memory"
        diff = f"{100 * (e - m) / m:+.2f}%" if m and e else ""
        print(f"| {name} | {r.get('same_ops', '')} | {m or ''} | {e or ''} | {diff} | {note} |",
              flush=True)


if __name__ == "__main__":
    main()
