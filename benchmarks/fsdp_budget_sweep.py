"""Per-rank peaks predicted against measured under FSDP2, across budgets, on 2 gloo ranks (CPU).

For each test-zoo model and each fraction f: one rank's step profiled as FSDP2 runs it (under
torchtitan's bf16 policy unless ``--float32``), a budget ``lo + f * (hi - lo)`` between the
smallest per-rank peak (lo) and no checkpointing (hi), `plan(..., fsdp=True)`, `fully_shard` on
the plan's units and the root, then the per-rank peak measured three times on each rank
(`Plan.measure`, torch.profiler memory events). Low fractions put the peak where recomputation
no longer lowers it, often at a collective; the three measurements show whether reading the
events is stable.

    HF_HUB_OFFLINE=1 python benchmarks/fsdp_budget_sweep.py [--float32] [--fractions 0.1,0.3]
        [--json OUT] [CASE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gloo_ranks import run_ranks  # noqa: E402

WORLD = 2
CASES = ["gpt2_padded", "llama_padded", "qwen2", "bert", "t5", "bart", "whisper",
         "peft_lora_llama", "vit", "mixtral"]


def _policy(float32: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy() if float32 else MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _worker(rank: int, port: int, name: str, frac: float, float32: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import planner
        from solvers.distributed import per_rank
        from solvers.simulate import simulate
        from solvers.solve import smallest_peak
        from tests import zoo

        case = getattr(zoo, name)()
        policy = None if float32 else _policy(False)
        local = planner.profile(case.model, case.inputs, loss_fn=case.loss_fn, repeats=1,
                                mp_policy=policy)
        q = per_rank(local, world_size=WORLD, sharding="fsdp", gloo=True)
        hi, lo = simulate(q).peak_bytes, smallest_peak(q)
        box = [int(lo + frac * (hi - lo))]
        dist.broadcast_object_list(box, src=0)
        p = planner.plan(case.model, budget_bytes=box[0], example_inputs=case.inputs,
                         loss_fn=case.loss_fn, fsdp=True, repeats=1, mp_policy=policy)
        mesh = init_device_mesh("cpu", (WORLD,))
        mods = dict(case.model.named_modules())
        for u in p.profile.meta.shard_units:
            fully_shard(mods[u], mesh=mesh, mp_policy=_policy(float32))
        fully_shard(case.model, mesh=mesh, mp_policy=_policy(float32))
        measured = [p.measure(repeats=0).peak_bytes for _ in range(3)]
        every = [None] * WORLD
        dist.all_gather_object(every, measured)
        if rank == 0:
            Path(out).write_text(json.dumps({
                "case": name, "fraction": frac, "float32": float32, "budget": box[0],
                "smallest": lo, "unplanned": hi, "regions": len(p.schedule.regions),
                "predicted": p.predicted_peak_bytes_now(), "measured": every}))
        dist.barrier()  # else gloo's teardown at times aborts a rank ("terminate called ...")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", default=CASES)
    ap.add_argument("--fractions", default="0.1,0.3,0.5")
    ap.add_argument("--float32", action="store_true", help="FSDP2 without mixed precision")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name in args.cases:
        for frac in (float(f) for f in args.fractions.split(",")):
            try:
                rows.append(run_ranks(_worker, (name, frac, args.float32), WORLD, name))
            except Exception as e:  # noqa: BLE001 - reported in the table
                rows.append({"case": name, "fraction": frac,
                             "error": f"{type(e).__name__}: {str(e)[-300:]}"})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'model':<16} {'f':>4} {'regions':>7} {'budget':>10} {'predicted':>10} "
          f"{'measured (max)':>14} {'over':>8} {'spread':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<16} {r['fraction']:>4} {r['error']}")
            continue
        flat = [m for ms in r["measured"] for m in ms]
        print(f"{r['case']:<16} {r['fraction']:>4} {r['regions']:>7} {r['budget']:>10} "
              f"{r['predicted']:>10} {max(flat):>14} {max(flat) - r['predicted']:>+8} "
              f"{max(flat) - min(flat):>7}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
