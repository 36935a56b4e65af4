"""How long planning takes: `solve(method="auto")` on a freshly profiled 2-layer HF Llama (the
test zoo's `hf_llama`) and on the committed 7B profile at 27 GiB, each on a freshly loaded
profile (no cached chain model or plans), and `plan()`'s own breakdown of where its time went.

    HF_HUB_OFFLINE=1 python benchmarks/solve_times.py [--all]

`--all` also prints every method on every committed profile at 30%, 50% and 70% of the peak
without checkpointing.
"""

from __future__ import annotations

import argparse
import glob
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from solvers import Profile, available_methods, simulate, solve  # noqa: E402

GIB = 2**30


def _cold(path: Path, budget: int, method: str = "auto") -> tuple[float, object]:
    p = Profile.load(path)  # a fresh object: nothing cached from earlier solves
    t0 = time.perf_counter()
    s = solve(p, budget, method)
    return time.perf_counter() - t0, s


def llama_2_layers() -> None:
    import planner
    from tests.models import hf_llama

    model, x = hf_llama()
    prof = planner.profile(model, x, repeats=3)
    none, fixed = simulate(prof).peak_bytes, prof.fixed_bytes
    print(f"2-layer hf_llama: {len(prof.nodes)} profiled ops, eager step "
          f"{prof.meta.step_ms_measured:.1f} ms")
    with tempfile.TemporaryDirectory() as tmp:
        path = prof.save(Path(tmp) / "llama.json.gz")
        for f in (0.75, 0.5, 0.3):
            secs, s = _cold(path, int(fixed + f * (none - fixed)))
            print(f"  auto at {f:g}x of activations: {s.status} ({s.method}), solve {secs:.3f} s")
    budget = int(fixed + 0.5 * (none - fixed))
    t0 = time.perf_counter()
    p = planner.plan(model, budget_bytes=budget, example_inputs=x, repeats=3)
    total = time.perf_counter() - t0
    print(f"  plan() at 0.5x: {total:.2f} s in all; "
          + ", ".join(f"{k} {v:.3f} s" for k, v in p.seconds.items()))


def llama_7b() -> None:
    path = ROOT / "profiles" / "llama7b_h100.json.gz"
    secs, s = _cold(path, 27 * GIB)
    print(f"llama7b_h100 at 27 GiB: {s.status} ({s.method}), predicted peak "
          f"{s.predicted_peak_bytes / GIB:.2f} GiB, solve {secs:.2f} s (cold)")


def every_method(paths: list[str]) -> None:
    methods = [m for m in available_methods() if m != "auto"]
    for path in paths:
        p = Profile.load(path)
        none = simulate(p).peak_bytes
        print(f"\n{path}: {len(p.nodes)} nodes, none peak {none / GIB:.3f} GiB")
        print(f"{'method':<17} {'budget':>7} {'status':<11} {'peak GiB':>9} {'recompute ms':>13} "
              f"{'solve s':>8}")
        for frac in (0.3, 0.5, 0.7):
            budget = int(frac * none)
            for meth in methods:
                t0 = time.perf_counter()
                s = solve(p, budget, meth, time_limit_s=60)
                dt = time.perf_counter() - t0
                print(f"{meth:<17} {frac:>6.0%} {s.status:<11} "
                      f"{s.predicted_peak_bytes / GIB:>9.3f} {s.predicted_recompute_ms:>13.2f} "
                      f"{dt:>8.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="every method on every committed profile")
    a = ap.parse_args(argv)
    llama_2_layers()
    llama_7b()
    if a.all:
        every_method(sorted(glob.glob(str(ROOT / "profiles" / "*.json.gz"))))


if __name__ == "__main__":
    main()
