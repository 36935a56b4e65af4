"""Schedules near the planner's own, applied and measured against the simulator (the thirteenth
probe): the search only ever meets schedules the simulator prices, so a rule it gets wrong shows
where the search goes, not where the tests look.

    HF_HUB_OFFLINE=1 python benchmarks/schedule_fuzz.py                 # every case, 40 each
    HF_HUB_OFFLINE=1 python benchmarks/schedule_fuzz.py value_branch mixtral -n 150

For each model (the test zoo's cases, `benchmarks/outside_zoo.py`'s, and with ``--sparse``
`benchmarks/sparse_probe.py`'s, named ``sparse:<its name>``), `plan(model, None)`
gives the smallest-peak schedule; each trial drops 0 to 3 of its regions and adds 1 to 4
random candidate regions (module calls, runs of a Sequential's children or of a traced
forward's stages) that nest in or are disjoint from the others, applies the schedule in place,
measures one step's peak with `torch.profiler` memory events and compares it with `simulate`.
Modules called more than once are left out (their calls are regions only all together). A
difference within 1 KiB counts as equal (the few scalars no profile records). Prints one
Markdown row per model and, for each schedule beyond that, its regions.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import planner  # noqa: E402
from benchmarks.outside_zoo import CASES as OUTSIDE  # noqa: E402
from benchmarks.sparse_probe import cases as sparse_cases  # noqa: E402
from planner.api import region_label  # noqa: E402
from solvers.chain import bind, candidate_calls, shared_calls  # noqa: E402
from solvers.errors import CkptPlannerError  # noqa: E402
from solvers.nested import _fits, _regions, _span_of  # noqa: E402
from solvers.simulate import simulate  # noqa: E402
from tests.zoo import CASES as ZOO  # noqa: E402

EQUAL_BYTES = 1024


SPARSE = {f"sparse:{name}": build for name, build in sparse_cases()}


def _build(name: str):
    """(model, inputs, loss_fn) of a case."""
    if name in SPARSE:
        return SPARSE[name]()
    case = (ZOO.get(name) or OUTSIDE[name])()
    return case.model, case.inputs, case.loss_fn


def fuzz(name: str, trials: int, seed: int, out: list[str], autocast=None) -> str:
    model, inputs, loss_fn = _build(name)
    t0 = time.perf_counter()
    try:
        p = planner.plan(model, None, example_inputs=inputs, loss_fn=loss_fn, autocast=autocast)
    except CkptPlannerError as e:
        return f"| {name} | does not plan: {str(e).splitlines()[0][:100]} | | | | | | |"
    prof = p.profile
    shared = {s.call.module for grp in shared_calls(prof) for s in grp}
    spans = [s for s in candidate_calls(prof) if s.call.module not in shared]
    keyed = {(s.a, s.b): s for s in spans}
    base = [keyed[_span_of(prof, r)] for r in p.schedule.regions if _span_of(prof, r) in keyed]
    rng = random.Random(seed)
    diffs: list[int] = []
    failed: list[str] = []
    for _ in range(trials):
        chosen = list(base)
        for _ in range(rng.randint(0, 3)):
            if chosen:
                chosen.pop(rng.randrange(len(chosen)))
        want = len(chosen) + rng.randint(1, 4)
        for s in rng.sample(spans, len(spans)):
            if len(chosen) >= want:
                break
            if _fits(s, chosen):
                chosen.append(s)
        regions = bind(prof, _regions(prof, chosen))
        planner.remove(model)
        try:
            planner.apply(model, dataclasses.replace(p.schedule, regions=regions))
            d = simulate(prof, regions).peak_bytes - p.measure(repeats=1).peak_bytes
        except Exception as e:  # noqa: BLE001 - a schedule that does not run is a finding
            failed.append(f"- {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}: "
                          + ", ".join(region_label(r) for r in regions))
            continue
        diffs.append(d)
        if abs(d) > EQUAL_BYTES:
            out.append(f"- {name}: predicted - measured {d:+d} B: "
                       + ", ".join(region_label(r) for r in regions))
    planner.remove(model)
    out.extend(failed)
    off = [d for d in diffs if abs(d) > EQUAL_BYTES]
    under = [d for d in off if d < 0]
    return (f"| {name} | {len(diffs)} | {len(failed)} | {len(off)} | {len(under)} | "
            f"{min(under, default=0):+d} | {max((d for d in off if d > 0), default=0):+d} | "
            f"{time.perf_counter() - t0:.0f} |")


HEADER = (f"| model | schedules measured | failed to run | differ by > {EQUAL_BYTES} B | "
          "under | worst under B | worst over B | s |\n|---|---|---|---|---|---|---|---|")
"""The header of the table `fuzz` gives the rows of."""


def dtype_row(name: str, trials: int, out: list[str], autocast=None) -> str:
    """`fuzz`'s row for `name`, the model named with its dtype, or a row saying what raised
    (for the probes that run it on each model in fp32 and under autocast)."""
    dtype = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[autocast]
    try:
        row = fuzz(name, trials, 7, out, autocast=autocast)
    except Exception as e:  # noqa: BLE001 - reported as the row
        row = f"| {name} | raises {type(e).__name__}: {str(e).splitlines()[0][:100]} |"
    return row.replace(f"| {name} |", f"| {name} {dtype} |", 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="cases (default: the zoo's and outside_zoo's)")
    ap.add_argument("-n", "--trials", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--sparse", action="store_true", help="add sparse_probe.py's models")
    ap.add_argument("--autocast", choices=("bf16", "fp16"),
                    help="plan and measure forward and loss under torch.autocast")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    known = [*ZOO, *OUTSIDE, *SPARSE]
    names = args.names or [*ZOO, *OUTSIDE, *(SPARSE if args.sparse else ())]
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {known}")
    print(HEADER)
    details: list[str] = []
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.autocast]
    for name in names:
        print(fuzz(name, args.trials, args.seed, details, autocast=autocast), flush=True)
    if details:
        print()
        print("\n".join(details))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
