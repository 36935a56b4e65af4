"""Plans for FSDP2 with mixed precision, on test-zoo models, on 2 gloo ranks (CPU).

For each model: one rank's micro-batch profiled as FSDP2 runs it under torchtitan's policy
(``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``), a budget
halfway between the smallest per-rank peak and no checkpointing, `plan(..., fsdp=True,
mp_policy=...)`, then `fully_shard` on the plan's units and the root with that policy. Reports the
per-rank peak predicted against measured (torch.profiler memory events), the gradients of one
step against the same FSDP2 mixed-precision model unplanned, and what a plan made without
`mp_policy` (the float32 step) predicts at the same budget: its peak, and its extra time, the
recomputation it adds, and its peak measured under the policy.

    HF_HUB_OFFLINE=1 python benchmarks/fsdp_mixed_precision.py [--json OUT] [CASE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gloo_ranks import run_ranks  # noqa: E402

WORLD = 2
CASES = ["gpt2_padded", "llama_padded", "bert", "t5", "peft_lora_llama", "vit", "mixtral"]


def _policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _step(model, case, seed: int) -> None:
    from planner.capture.record import default_loss
    from tests.zoo import call

    torch.manual_seed(seed)
    out = call(model, case.inputs)
    (case.loss_fn or default_loss)(out).backward()


def _worker(rank: int, port: int, name: str, out: str) -> None:
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
        model = case.model
        local = planner.profile(model, case.inputs, loss_fn=case.loss_fn, repeats=1,
                                mp_policy=_policy())
        q = per_rank(local, world_size=WORLD, sharding="fsdp")
        box = [(simulate(q).peak_bytes + smallest_peak(q)) // 2]
        dist.broadcast_object_list(box, src=0)
        budget = box[0]
        t0 = time.perf_counter()
        p = planner.plan(model, budget_bytes=budget, example_inputs=case.inputs,
                         loss_fn=case.loss_fn, fsdp=True, repeats=1, mp_policy=_policy())
        plan_s = time.perf_counter() - t0
        # the plan a user gets without mp_policy (the float32 step, per rank), on a copy
        other = getattr(zoo, name)().model
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                u = planner.plan(other, budget_bytes=budget, example_inputs=case.inputs,
                                 loss_fn=case.loss_fn, fsdp=True, repeats=1)
        except planner.InfeasibleBudgetError:
            u = None
        # and that plan in the float32 run it was made for (FSDP2 without mixed precision)
        full = getattr(zoo, name)().model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f = planner.plan(full, budget_gb=64, example_inputs=case.inputs,
                             loss_fn=case.loss_fn, fsdp=True, repeats=1, method="none")
        mesh = init_device_mesh("cpu", (WORLD,))
        units = p.profile.meta.shard_units

        def shard(m, policy=None):
            policy = _policy() if policy is None else policy
            mods = dict(m.named_modules())
            for u in units:
                fully_shard(mods[u], mesh=mesh, mp_policy=policy)
            fully_shard(m, mesh=mesh, mp_policy=policy)

        shard(model)
        m = p.measure(repeats=1)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        shard(full, MixedPrecisionPolicy())
        fm = f.measure(repeats=1)
        if u is not None:
            shard(other)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # it warns that the policy is not the planned one
                um = u.measure(repeats=1)
        twin = getattr(zoo, name)().model
        shard(twin)
        for mod in (model, twin):
            mod.zero_grad(set_to_none=True)
            _step(mod, case, 7)
        worst = 0.0
        for a, b in zip(twin.parameters(), model.parameters(),
                        strict=True):
            if a.grad is None:
                continue
            ga, gb = a.grad.full_tensor(), b.grad.full_tensor()
            worst = max(worst, ((ga - gb).abs().max() / ga.abs().max().clamp_min(1e-30)).item())
        row = {
            "case": name, "units": len(units), "budget": budget,
            "predicted": p.predicted_peak_bytes_now(), "measured": m.peak_bytes,
            "regions": len(p.schedule.regions),
            "overhead_pred": p.predicted_overhead,
            "unaware_predicted": u.predicted_peak_bytes if u is not None else None,
            "unaware_measured": um.peak_bytes if u is not None else None,
            "unaware_overhead": u.predicted_overhead if u is not None else None,
            "unaware_regions": len(u.schedule.regions) if u is not None else None,
            "fp32_unplanned_predicted": f.predicted_peak_bytes_now(),
            "fp32_unplanned_measured": fm.peak_bytes,
            "unplanned": simulate(q).peak_bytes,
            "grad_rel_err": worst, "plan_s": plan_s,
        }
        if rank == 0:
            Path(out).write_text(json.dumps(row))
        dist.barrier()  # else gloo's teardown at times aborts a rank ("terminate called ...")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", default=CASES)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name in args.cases:
        try:
            rows.append(run_ranks(_worker, (name,), WORLD, name))
        except Exception as e:  # noqa: BLE001 - reported in the table
            rows.append({"case": name, "error": f"{type(e).__name__}: {str(e)[-300:]}"})
        print(json.dumps(rows[-1]), flush=True)
    mib = 2**20
    print(f"\n{'model':<16} {'units':>5} {'budget':>9} {'predicted':>10} {'measured':>10} "
          f"{'err':>7} {'extra':>7} {'grad err':>9} | without mp_policy: {'predicted':>10} "
          f"{'measured':>10} {'extra':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<16} {r['error']}")
            continue
        unaware = f"{'does not fit':>30}" if r["unaware_overhead"] is None else (
            f"{r['unaware_predicted'] / mib:>9.3f}M {r['unaware_measured'] / mib:>9.3f}M "
            f"{100 * r['unaware_overhead']:>+6.1f}%")
        print(f"{r['case']:<16} {r['units']:>5} {r['budget'] / mib:>8.2f}M "
              f"{r['predicted'] / mib:>9.3f}M {r['measured'] / mib:>9.3f}M "
              f"{100 * (r['predicted'] / r['measured'] - 1):>+6.2f}% "
              f"{100 * r['overhead_pred']:>+6.1f}% {r['grad_rel_err']:>9.1e} | "
              f"{'':>19}{unaware}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
