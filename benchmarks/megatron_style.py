"""Megatron-style selective recomputation, placed by hand, against our plan at the same peak.

    HF_HUB_OFFLINE=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
        python benchmarks/megatron_style.py [--rounds 5] [--json out.json]

On the eager-attention GPT at its benchmark size (`benchmarks.cpu_sizes.gpt_eager`), hand plans
in the manner of Megatron's selective recomputation (Korthikanti et al. 2022), written as
selective regions on the model's own modules:

- ``attention core``: each attention call checkpointed, keeping the QKV projection, the
  attention-times-V product and the output projection, so that only the core (QK^T, scale, mask,
  softmax) is replayed: Megatron's selective recomputation;
- ``core + gelu``: the same, and each MLP call keeping both of its matmuls (only the GELU is
  replayed);
- ``block, keep qkv/y/proj/fc1`` and ``block, keep qkv/y/proj``: each block checkpointed keeping
  those matmul outputs (the second also replays the MLP's first matmul).

Each runs eagerly and under ``torch.compile`` (inductor, partitioner budget 1, `planner.compiled`),
beside our plan solved at the hand plan's simulated peak (ILP; under inductor solved on the
fused-pointwise cost model, as `plan(..., compile=...)` does), and the two runs without a plan.
Peaks are measured (`planner.measurement.measure`), step times are medians of alternated rounds,
extra time is against the eager step without checkpointing.

What it answers: whether a hand plan reaches the eager-attention target (>= 65% less activation
memory at <= 5% extra step time, ANCHORS.md) where our plans do not, and whether ours is at least
as fast at the same memory.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_sizes import gpt_eager  # noqa: E402
from planner.compiled import compile_copy, fused_pointwise  # noqa: E402
from planner.inplace import apply_schedule  # noqa: E402
from planner.measurement import measure  # noqa: E402
from planner.profiling import profile  # noqa: E402
from solvers.profile import Profile  # noqa: E402
from solvers.schedule import Region, Schedule  # noqa: E402
from solvers.solve import finish, solve  # noqa: E402

MiB = 2**20
MATMULS = ("aten.addmm.default", "aten.bmm.default")
ROLES = ("qkv", "scores", "y", "proj", "fc1", "fc2")
"""The matmuls of one block, in forward order (the GPT of tests/models.py)."""


def _regions(prof: Profile, module_suffix: str, keep: tuple[str, ...]) -> tuple[Region, ...]:
    """One selective region per call of each block's `module_suffix` child ("" the block
    itself), keeping the outputs of the block matmuls named in `keep` (`ROLES`)."""
    fwd = [n for n in prof.nodes if n.phase == "forward"]
    names = [n.name for n in fwd]
    out = []
    for block in (c for c in prof.calls if c.module.startswith("blocks.")
                  and c.module.count(".") == 1):
        a, b = names.index(block.start), names.index(block.end)
        role = dict(zip(ROLES, (n.name for n in fwd[a:b + 1] if n.op in MATMULS), strict=True))
        call = next(c for c in prof.calls if c.module == block.module + module_suffix)
        lo, hi = names.index(call.start), names.index(call.end)
        saved = tuple(role[k] for k in keep if lo <= names.index(role[k]) <= hi)
        out.append(Region(start=call.start, end=call.end, saved=saved))
    return tuple(sorted(out, key=lambda r: names.index(r.start)))


def hand_plans(prof: Profile) -> dict[str, tuple[Region, ...]]:
    return {
        "attention core": _regions(prof, ".attn", ("qkv", "y", "proj")),
        "core + gelu": (_regions(prof, ".attn", ("qkv", "y", "proj"))
                        + _regions(prof, ".mlp", ("fc1", "fc2"))),
        "block, keep qkv/y/proj/fc1": _regions(prof, "", ("qkv", "y", "proj", "fc1")),
        "block, keep qkv/y/proj": _regions(prof, "", ("qkv", "y", "proj")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per candidate per round")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    model, x = gpt_eager()
    prof = profile(model, x, repeats=3)
    fused = fused_pointwise(prof)
    F = prof.fixed_bytes
    none_peak = finish(prof, Schedule(), 2**62).predicted_peak_bytes

    rows: list[dict] = []
    modules = {}

    def add(label: str, mode: str, schedule: Schedule | None) -> None:
        if mode == "eager":
            m = copy.deepcopy(model)
            if schedule is not None:
                apply_schedule(m, schedule)
        else:
            m = compile_copy(model, schedule, "inductor", 1.0)
        peak = measure(m, x, repeats=1).peak_bytes
        rows.append({
            "plan": label, "mode": mode,
            "regions": 0 if schedule is None else len(schedule.regions),
            "predicted_peak_bytes": None if schedule is None else schedule.predicted_peak_bytes,
            "predicted_extra_pct": None if schedule is None
            else 100 * schedule.predicted_recompute_ms / prof.step_ms,
            "measured_peak_bytes": peak,
            "less_activation_pct": 100 * (none_peak - peak) / (none_peak - F),
            "step_ms": [],
        })
        modules[len(rows) - 1] = m
        print(f"{label:28} {mode:8} peak {peak / MiB:7.2f} MiB", flush=True)

    add("none", "eager", None)
    add("none", "inductor", None)
    for label, regions in hand_plans(prof).items():
        hand = finish(prof, Schedule(regions=regions, method="hand"), 2**62)
        at = hand.predicted_peak_bytes
        ours = finish(prof, solve(prof, at, method="ilp"), at)
        ours_fused = finish(prof, solve(fused, at, method="ilp"), at)
        add(label, "eager", hand)
        add(f"ours at {label}", "eager", ours)
        add(label, "inductor", hand)
        add(f"ours at {label}", "inductor", ours_fused)

    order = list(range(len(rows)))
    for r in range(args.rounds):  # alternated: every other round in reverse
        for i in order if r % 2 == 0 else order[::-1]:
            rows[i]["step_ms"].append(measure(modules[i], x, repeats=args.steps,
                                              warmup=0).step_ms)
    base = statistics.median(rows[0]["step_ms"])
    print(f"\ngpt_eager, {len(model.blocks)} blocks: no-checkpoint "
          f"peak {none_peak / MiB:.2f} MiB, fixed {F / MiB:.2f} MiB; extra time against the "
          f"eager step without checkpointing ({base:.1f} ms)\n")
    print("| plan | mode | regions | predicted peak MiB | measured peak MiB | less activation "
          "memory | step ms (median) | extra time | predicted extra (eager) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        med = statistics.median(row["step_ms"])
        row["step_ms_median"] = med
        row["extra_pct"] = 100 * (med / base - 1)
        pred = row["predicted_peak_bytes"]
        pextra = row["predicted_extra_pct"]
        print(f"| {row['plan']} | {row['mode']} | {row['regions']} | "
              f"{'' if pred is None else f'{pred / MiB:.2f}'} | "
              f"{row['measured_peak_bytes'] / MiB:.2f} | {row['less_activation_pct']:.0f}% | "
              f"{med:.1f} | {row['extra_pct']:+.1f}% | "
              f"{'' if pextra is None else f'{pextra:+.1f}%'} |")
    if args.json:
        args.json.write_text(json.dumps({"model": "gpt_eager", "none_peak_bytes": none_peak,
                                         "fixed_bytes": F, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
