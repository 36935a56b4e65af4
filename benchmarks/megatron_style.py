"""Megatron-style selective recomputation expressed as regions, on the eager-attention GPT.

    HF_HUB_OFFLINE=1 python benchmarks/megatron_style.py

Checkpoints only the attention core of each block (from the first op after the QKV projection to
the attention-times-V matmul, which saves only its inputs, so the replay stops before it), only the
GELU of each MLP, or both, and prints the simulated peak and extra time (the profile's op times,
measured on this device) next to what `dp` finds at the same peak.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.profiling import profile  # noqa: E402
from solvers.schedule import Region  # noqa: E402
from solvers.simulate import simulate  # noqa: E402
from solvers.solve import solve  # noqa: E402
from tests.models import gpt_eager  # noqa: E402


def main() -> None:
    model, x = gpt_eager()
    prof = profile(model, x, repeats=3)
    fwd = [n for n in prof.nodes if n.phase == "forward"]
    names = [n.name for n in fwd]

    def find(op: str, start: int) -> int:
        return next(k for k in range(start, len(fwd)) if fwd[k].op == op)

    attention, mlp = [], []
    k = 0
    for _ in range(len(model.blocks)):
        first = find("aten.clone.default", find("aten.addmm.default", k))  # after the QKV matmul
        scores = find("aten.bmm.default", first)
        mix = find("aten.bmm.default", scores + 1)  # attention @ V: saves only its inputs
        attention.append(Region(start=names[first], end=names[mix]))
        fc = find("aten.addmm.default", find("aten.native_layer_norm.default", mix))
        gelu = find("aten.gelu.default", fc)
        proj = find("aten.addmm.default", gelu)
        mlp.append(Region(start=names[gelu], end=names[proj]))
        k = proj + 1
    none = simulate(prof).peak_bytes
    act = none - prof.fixed_bytes
    for label, regions in (("attention core", attention), ("gelu", mlp),
                           ("both", attention + mlp)):
        regions = sorted(regions, key=lambda r: names.index(r.start))
        sim = simulate(prof, tuple(regions))
        ours = solve(prof, sim.peak_bytes, method="dp")
        print(
            f"{label:15s} peak {sim.peak_bytes / 2**20:6.2f} MiB "
            f"({100 * (none - sim.peak_bytes) / act:3.0f}% less activation memory), "
            f"extra {100 * sim.recompute_ms / prof.step_ms:5.1f}% | dp at that peak: "
            f"{ours.predicted_peak_bytes / 2**20:6.2f} MiB, extra "
            f"{100 * ours.predicted_recompute_ms / prof.step_ms:5.1f}%"
        )


if __name__ == "__main__":
    main()
