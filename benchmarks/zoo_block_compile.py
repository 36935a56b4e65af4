"""Compiled per block as torchtitan compiles: the test-zoo models, unplanned and planned.

Each repeated block (`solvers.distributed.default_units`) is compiled with
``block.compile(backend="aot_eager", fullgraph=True)``; the model is unplanned, or planned at half
its activation memory (or its floor). Three steps on the example batch and two on the smaller
one: the graph count after each (a second shape adds graphs; later steps must not), graph
breaks, and loss and gradients against an eager copy (the planned eager model for planned rows).
A row that fails unplanned fails for reasons of the model under dynamo, not of the plan.

    HF_HUB_OFFLINE=1 python benchmarks/zoo_block_compile.py [CASE ...]
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = ["gpt2_padded", "llama_padded", "mistral", "qwen2", "bloom_padded", "mixtral", "bert",
         "deberta_v2", "albert", "t5", "bart", "whisper", "vit", "convnext", "resnet_hf",
         "peft_lora_llama", "moe_top2", "value_branch"]


def _run(name: str, planned: bool) -> str:
    from torch._dynamo.utils import counters

    import planner
    from planner.api import SLACK_BYTES
    from solvers.distributed import default_units
    from solvers.simulate import simulate
    from solvers.solve import smallest_peak
    from tests.zoo import CASES as ZOO
    from tests.zoo import loss_and_grads

    torch.manual_seed(0)
    case = ZOO[name]()
    model = case.model
    prof = planner.profile(model, case.inputs, loss_fn=case.loss_fn, repeats=1)
    units = default_units(prof)
    regions: list[str] = []
    if planned:
        n, f = simulate(prof).peak_bytes, prof.fixed_bytes
        budget = max(int(f + 0.5 * (n - f)), smallest_peak(prof) + SLACK_BYTES)
        p = planner.plan_from_profile(model, prof, budget_bytes=budget)
        regions = [r.module for r in p.schedule.regions]
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    modules = dict(model.named_modules())
    for u in units:
        modules[u].compile(backend="aot_eager", fullgraph=True)
    graphs, loss_diff, grad_err = [], 0.0, 0.0
    batches = [case.inputs] * 3 + ([case.small_inputs] * 2 if case.small_inputs else [])
    for inputs in batches:
        l0, want = loss_and_grads(twin, inputs, case.loss_fn, twin)
        l1, got = loss_and_grads(model, inputs, case.loss_fn, model)
        loss_diff = max(loss_diff, float((l1 - l0).abs()))
        for k in want:
            grad_err = max(grad_err, ((got[k] - want[k]).abs().max()
                                      / want[k].abs().max().clamp_min(1e-30)).item())
        graphs.append(counters["stats"]["unique_graphs"])
    return (f"units={len(units)} regions={len(regions)} graphs={graphs} "
            f"breaks={sum(counters['graph_break'].values())} loss_diff={loss_diff:.1e} "
            f"grad_rel_err={grad_err:.1e}")


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    for name in sys.argv[1:] or CASES:
        for planned in (False, True):
            try:
                row = _run(name, planned)
            except Exception as e:  # noqa: BLE001 - reported
                lines = str(e).strip().splitlines()
                row = f"FAIL {type(e).__name__}: {lines[0][:160] if lines else ''}"
            print(f"{name:<16} {'planned' if planned else 'unplanned':<9} {row}", flush=True)


if __name__ == "__main__":
    main()
