"""Llama-3-70B offline, from committed estimate-mode profiles and `solvers` alone (no torch, no GPU).

    python benchmarks/llama70b.py            # the table (README "Llama-3-70B offline")

The cases (profiles made by `benchmarks/make_profiles.py`, AdamW on what trains, bf16 weights,
batch 1, SDPA attention, HF `LlamaForCausalLM` with labels):

- LoRA r=16 on every attention and MLP projection, frozen base, one MI300X (192 GB), sequence
  4096 and 8192;
- full fine-tuning under FSDP2 (`fully_shard` on each of the 80 layers and the root), per rank of
  8 x MI300X and of 8 x H100 (80 GB), sequence 4096; on H100 with AdamW's default step on a GPU
  (foreach: temporaries as large as a rank's parameters) and with its fused step; on MI300X
  also with float32 weights under FSDP2's bf16 mixed precision (torchtitan's: the step in bf16,
  shards, gradients and AdamW state in float32).

For each, the peak and extra time of: no checkpointing; `gradient_checkpointing_enable()` (HF's
per-layer checkpointing, `per_block` here); uniform sqrt(N) segments (Chen et al. 2016; under FSDP
a segment would span several fully_shard units, which cannot be checkpointed as one region); and
the planner's cheapest plan at budgets from the device's memory down to the smallest peak it can
reach. Where nothing fits, the longest sequence that does, from profiles at shorter sequences.
Budgets are the device's memory as vendors quote it (10**9 bytes per GB); nothing is kept back
for the allocator's fragmentation or the CUDA/ROCm context, which a real run needs (a few GB).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from planner.devices import get_device  # noqa: E402  (torch-free)
from solvers import Profile, Schedule, ScheduleError, simulate, solve  # noqa: E402
from solvers.distributed import per_rank  # noqa: E402
from solvers.solve import smallest_peak  # noqa: E402
from solvers.units import format_bytes  # noqa: E402

PROFILES = ROOT / "profiles"
GIB = 2**30
TIME_LIMIT_S = 4.0
"""Seconds per `auto` solve (the ILP's share), so that the table's time does not hang on the MILP."""


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    profile: str
    device: str
    world_size: int = 1
    fsdp: bool = False
    shorter: tuple[str, ...] = ()
    """Profiles at shorter sequences, longest first, for "the longest that fits"."""


CASES = (
    Case("LoRA r=16, 1 x MI300X, seq 4096", "llama3_70b_lora16_seq4096", "mi300x"),
    Case("LoRA r=16, 1 x MI300X, seq 8192", "llama3_70b_lora16_seq8192", "mi300x",
         shorter=("llama3_70b_lora16_seq4096",)),
    Case("full FT, FSDP2 8 x MI300X, seq 4096", "llama3_70b_seq4096_mi300x", "mi300x", 8, True),
    Case("full FT, FSDP2 8 x MI300X, seq 4096, float32 weights, bf16 mixed precision",
         "llama3_70b_seq4096_mi300x_mp", "mi300x", 8, True),
    Case("full FT, FSDP2 8 x H100, seq 4096", "llama3_70b_seq4096_h100", "h100", 8, True),
    Case("full FT, FSDP2 8 x H100, seq 4096, fused AdamW", "llama3_70b_seq4096_h100_fused",
         "h100", 8, True, shorter=("llama3_70b_seq2048_h100_fused",)),
)


@dataclasses.dataclass
class Row:
    plan: str
    budget: int | None
    peak: int
    extra_ms: float
    step_ms: float
    fits: bool
    regions: int

    @property
    def extra(self) -> float:
        return self.extra_ms / self.step_ms


def load(case: Case, name: str | None = None) -> Profile:
    p = Profile.load(PROFILES / f"{name or case.profile}.json.gz")
    if case.world_size > 1 or case.fsdp:
        p = per_rank(p, world_size=case.world_size, sharding="fsdp" if case.fsdp else "ddp")
    return p


def _row(label: str, p: Profile, s: Schedule, capacity: int, budget: int | None = None) -> Row:
    return Row(label, budget, s.predicted_peak_bytes, s.predicted_recompute_ms, p.step_ms,
               s.predicted_peak_bytes <= capacity, len(s.regions))


def study(case: Case, budgets: int = 4) -> tuple[Profile, list[Row], dict]:
    """The rows of one case: the baselines, then the cheapest plan at `budgets` budgets from the
    device's memory down to the smallest reachable peak."""
    p = load(case)
    capacity = get_device(case.device).memory_bytes
    rows = [_row("no checkpointing", p, solve(p, 2**62, "none"), capacity)]
    per_block = solve(p, 2**62, "per_block")
    rows.append(_row("gradient_checkpointing_enable() (per layer)", p, per_block, capacity))
    try:
        rows.append(_row("uniform sqrt(N) segments", p, solve(p, 2**62, "sqrt_n"), capacity))
    except ScheduleError:  # FSDP: a segment of several layers spans fully_shard units
        pass
    least = smallest_peak(p, TIME_LIMIT_S)
    top = min(capacity, simulate(p).peak_bytes)
    targets = sorted({top, per_block.predicted_peak_bytes,
                      *(least + (top - least) * k // (budgets - 1) for k in range(budgets - 1))},
                     reverse=True)
    found: list[tuple[int, Schedule]] = []
    for b in sorted(targets):
        if b < least or b > capacity:
            continue
        s = solve(p, b, "auto", TIME_LIMIT_S)
        # A plan for a lower budget fits this one too: under the solve's time limit the search
        # at a higher budget can end on a dearer plan than one found below it.
        s = min([x for _, x in found] + ([s] if s.feasible else []),
                key=lambda x: x.predicted_recompute_ms, default=None)
        if s is not None:
            found.append((b, s))
    rows += [_row(f"planner at {format_bytes(b)}", p, s, capacity, b)
             for b, s in reversed(found)]
    info = {"capacity": capacity, "least": least, "fixed": p.fixed_bytes,
            "fits": any(r.fits for r in rows)}
    if not info["fits"]:
        for name in case.shorter:  # the longest sequence that fits
            q = load(case, name)
            s = solve(q, capacity, "auto", TIME_LIMIT_S)
            if s.feasible:
                info["fits_at"] = (name, s.predicted_peak_bytes, s.predicted_recompute_ms /
                                   q.step_ms)
                break
            info.setdefault("shorter_least", []).append((name, smallest_peak(q, TIME_LIMIT_S)))
    return p, rows, info


def table(rows: list[Row]) -> str:
    lines = [f"| {'plan':<46} | {'peak':>11} | {'extra time':>10} | fits |",
             f"|{'-' * 48}|{'-' * 13}|{'-' * 12}|------|"]
    for r in rows:
        lines.append(f"| {r.plan:<46} | {format_bytes(r.peak):>11} | {100 * r.extra:>9.1f}% | "
                     f"{'yes' if r.fits else 'no':<4} |")
    return "\n".join(lines)


def report(case: Case, p: Profile, rows: list[Row], info: dict) -> str:
    """One case's heading, its table, and where nothing fits, what would."""
    dev = get_device(case.device)
    lines = [f"### {case.name}", "",
             f"{dev.name}, {format_bytes(info['capacity'])} per device; fixed per device "
             f"{format_bytes(info['fixed'])} (weights, optimizer state, inputs); activations "
             f"saved without checkpointing {format_bytes(p.saved_bytes)}; smallest reachable "
             f"peak {format_bytes(info['least'])}; step {p.step_ms / 1e3:.2f} s (roofline "
             "estimate)", "", table(rows)]
    if not info["fits"]:
        fit = info.get("fits_at")
        lines += ["", "nothing fits" + (f"; the longest sequence that does: {fit[0]} at "
                                        f"{format_bytes(fit[1])}, +{100 * fit[2]:.1f}%"
                                        if fit else "")]
        lines += [f"at a shorter sequence ({name}) the smallest peak is still "
                  f"{format_bytes(least)}: what does not fit is not the activations"
                  for name, least in info.get("shorter_least", [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, default=4,
                    help="budgets per case between the device's memory and the smallest peak")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    for case in CASES:
        t1 = time.perf_counter()
        print("\n" + report(case, *study(case, args.budgets)))
        print(f"\n({time.perf_counter() - t1:.1f} s)")
    print(f"\nall cases in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
