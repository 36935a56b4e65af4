"""Generate the notebooks (``python notebooks/make_notebooks.py``) and optionally execute them
(``--execute``; set ``CKPT_SMALL=1`` for the small CI sizes). Edit the cells here, not the .ipynb."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SETUP = """\
import os
import sys
from pathlib import Path

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
SMALL = os.environ.get("CKPT_SMALL") == "1"   # CI: small sizes and few repeats
print("small sizes" if SMALL else "full sizes")"""


def quickstart() -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(
            "# Quickstart: plan activation checkpointing for an HF GPT-2\n\n"
            "Build a small GPT-2 from a config, ask `planner.plan` for a training step that fits "
            "half of its activation memory, read the report (our plan against the baselines at "
            "the same budget), and verify it: same loss and gradients, and the measured peak "
            "against the prediction and the budget."
        ),
        new_code_cell(SETUP),
        new_code_cell(
            """\
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import planner

torch.manual_seed(0)
layers, dim, batch, seq = (2, 64, 4, 64) if SMALL else (4, 128, 8, 128)
config = GPT2Config(vocab_size=1024, n_positions=seq, n_embd=dim, n_layer=layers, n_head=4,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config)
model.loss_type = "ForCausalLM"
model.train()
ids = torch.randint(0, config.vocab_size, (batch, seq))
inputs = {"input_ids": ids, "labels": ids, "use_cache": False}  # as training scripts call it
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")"""
        ),
        new_markdown_cell(
            "The budget is a number of bytes of peak memory for one training step. Here: the "
            "fixed memory (parameters, inputs) plus half of what activations take without "
            "checkpointing, measured."
        ),
        new_code_cell(
            """\
m0 = planner.measure(model, inputs, repeats=1)
budget = int(m0.fixed_bytes + 0.5 * (m0.peak_bytes - m0.fixed_bytes))
print(f"no checkpointing: peak {m0.peak_bytes / 2**20:.2f} MiB "
      f"(fixed {m0.fixed_bytes / 2**20:.2f} MiB); budget {budget / 2**20:.2f} MiB")
plan = planner.plan(model, budget_bytes=budget, example_inputs=inputs,
                    repeats=1 if SMALL else 3)
print(plan.report())"""
        ),
        new_code_cell(
            """\
v = plan.verify(repeats=1 if SMALL else 3)
print(f"loss: original {v.loss_original:.6f}, planned {v.loss_planned:.6f}")
print(f"largest relative gradient difference: {v.max_grad_rel_err:.2e}")
print(f"peak: predicted {v.predicted_peak_bytes / 2**20:.2f} MiB, measured "
      f"{v.measured_peak_bytes / 2**20:.2f} MiB ({100 * v.peak_error:+.2f}%), budget "
      f"{v.budget_bytes / 2**20:.2f} MiB, unplanned {v.measured_none_peak_bytes / 2**20:.2f} MiB")
print(f"step: original {v.step_ms_original:.1f} ms, planned {v.step_ms_planned:.1f} ms "
      f"({100 * v.overhead:+.1f}%; CPU timings move by 5-10 points between runs)")
over = v.measured_peak_bytes - v.budget_bytes
print("measured peak within the budget" if over <= 0 else
      f"measured peak OVER the budget by {over / 2**10:.1f} KiB")"""
        ),
        new_markdown_cell(
            "The plan is on `model` itself (`plan.module is model`): the checkpointed modules run "
            "under `torch.utils.checkpoint`, everything else is untouched, so the optimizer, "
            "`state_dict`, `save_pretrained` and `generate` work as before, and any batch no "
            "larger than the example trains within the budget. `planner.remove(model)` takes "
            "the plan off."
        ),
        new_code_cell(
            """\
assert plan.module is model
print("checkpointed:", [r.module for r in plan.schedule.regions])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(2):
    loss = model(**inputs).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(step, loss.item())
shorter = {"input_ids": ids[:2, : seq // 2], "labels": ids[:2, : seq // 2], "use_cache": False}
print("a shorter batch:", model(**shorter).loss.item())
planner.remove(model)"""
        ),
    ]
    return new_notebook(cells=cells)


def compare_nb() -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(
            "# Compare: our plans against the baselines and torch.compile's budget\n\n"
            "`planner.compare` measures, in one process with the strategies alternated: "
            "no checkpointing, per-block, uniform sqrt(N) segments, Chen's greedy, every-k, "
            "torchtitan-style selective checkpointing (save matmul outputs), "
            "`torch.compile(backend='aot_eager')` with `activation_memory_budget` in "
            "{0.8, 0.5, 0.2, 0}, and our plans at each baseline's measured peak (iso-memory) and "
            "over a sweep of budgets (fractions of the activation memory). CPU step times move "
            "by 5-10 points between runs: the table gives medians and their spread.\n\n"
            "Full sizes are `benchmarks/cpu_sizes.py` (a step takes 0.06-0.5 s on the 2-core "
            "development CPU); measuring them all takes about 40 minutes "
            "(`benchmarks/run_compare.sh`, which also measures `torch.compile(backend="
            "'inductor')`, our plans compiled, and the make_fx graph plans). At full sizes this "
            "notebook shows those committed measurements (`benchmarks/compare/<model>/"
            "results.json`); set `CKPT_MEASURE=1` to measure here instead, under tcmalloc for "
            "steady CPU timings (`LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "
            "jupyter ...`). At CI's small sizes it always measures."
        ),
        new_code_cell(SETUP),
        new_code_cell(
            """\
import time

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from planner.comparison import CompareResult, compare, host_allocator
from tests import models

MEASURE = SMALL or os.environ.get("CKPT_MEASURE") == "1"

if SMALL:
    cases = {
        "GPT, eager attention": (models.gpt_eager, dict(batch=2, seq=32, dim=64, layers=2)),
        "HF GPT-2 (SDPA)": (models.hf_gpt2, dict(batch=2, seq=32, n_embd=64, layers=2)),
        "ResNet-like CNN": (models.resnet_bn, dict(batch=2, image=16, width=8)),
        "U-Net": (models.unet, dict(batch=1, image=32, base=8, depth=2)),
    }
    opts = dict(repeats=1, inner_repeats=1, fractions=(0.5,), include_compile=False,
                iso=False, profile_repeats=1, time_limit_s=5)
else:
    from benchmarks.cpu_sizes import SIZES

    cases = {
        "GPT, eager attention": (models.gpt_eager, SIZES["gpt_eager"]),
        "HF GPT-2 (SDPA)": (models.hf_gpt2, SIZES["hf_gpt2"]),
        "ResNet-like CNN": (models.resnet_bn, SIZES["resnet_bn"]),
        "U-Net": (models.unet, SIZES["unet"]),
    }
    opts = dict(repeats=2, time_limit_s=10)
saved = {"GPT, eager attention": "gpt_eager", "HF GPT-2 (SDPA)": "hf_gpt2",
         "ResNet-like CNN": "resnet_bn", "U-Net": "unet"}
print("measuring here; C allocator:", host_allocator() if MEASURE else
      "showing the committed measurements of benchmarks/run_compare.sh")
results = {}"""
        ),
    ]
    for name in ("GPT, eager attention", "HF GPT-2 (SDPA)", "ResNet-like CNN", "U-Net"):
        cells.append(new_markdown_cell(f"## {name}"))
        cells.append(new_code_cell(
            f"""\
name = {name!r}
if MEASURE:
    build, sizes = cases[name]
    model, inputs = build(**sizes)
    t0 = time.perf_counter()
    res = results[name] = compare(model, inputs, name=name, **opts)
    print(f"measured in {{time.perf_counter() - t0:.0f}} s")
else:
    res = results[name] = CompareResult.load(
        ROOT / "benchmarks" / "compare" / saved[name] / "results.json")
    print(f"measured on {{res.meta.get('date', '?')[:10]}}, {{res.meta.get('machine', '?')}}, "
          f"allocator {{res.meta.get('malloc', '?')}}")
display(Markdown(res.table()))
print(res.checks_text())
res.plot()
plt.show()"""
        ))
    return new_notebook(cells=cells)


def offline() -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(
            "# Offline planning: a 7B model for 24, 40 and 80 GiB GPUs, without torch\n\n"
            "`profiles/llama7b_h100.json.gz` was recorded once (estimate mode, H100 roofline). "
            "`solvers` plans it anywhere: this notebook never imports torch."
        ),
        new_code_cell(SETUP),
        new_code_cell(
            """\
from solvers import Profile, simulate, solve
from solvers.solve import BASELINES, smallest_peak

GiB = 2**30
p = Profile.load(ROOT / "profiles" / "llama7b_h100.json.gz")
none_peak = simulate(p).peak_bytes
print(f"{p.meta.model_class}: {len(p.nodes)} nodes, fixed {p.fixed_bytes / GiB:.2f} GiB, "
      f"no-checkpoint peak {none_peak / GiB:.2f} GiB, step {p.step_ms:.1f} ms "
      f"({p.meta.mode} on {p.meta.device_name})")
assert "torch" not in sys.modules, "offline planning must not import torch"
"""
        ),
        new_code_cell(
            """\
limit = 5 if SMALL else 20
for gb in (24, 40, 80):
    s = solve(p, gb * GiB, "auto", time_limit_s=limit)
    if s.feasible:
        print(f"{gb} GiB: {s.method}, {len(s.regions)} regions, predicted peak "
              f"{s.predicted_peak_bytes / GiB:.2f} GiB, extra time {s.predicted_recompute_ms:.1f} ms "
              f"({100 * s.predicted_recompute_ms / p.step_ms:.1f}% of the step)")
    else:
        print(f"{gb} GiB: does not fit; the smallest achievable peak is "
              f"{(s.min_peak_bytes or s.predicted_peak_bytes) / GiB:.2f} GiB "
              f"(fixed memory alone is {p.fixed_bytes / GiB:.2f} GiB): lower the batch or shard")
assert "torch" not in sys.modules"""
        ),
        new_markdown_cell(
            "The memory/time frontier: every method over a sweep of budgets from the smallest "
            "achievable peak to the no-checkpoint peak (predicted by the simulator)."
        ),
        new_code_cell(
            """\
import matplotlib.pyplot as plt

low = smallest_peak(p, time_limit_s=limit)
k = 4 if SMALL else 10
budgets = [int(low + (none_peak - low) * i / (k - 1)) for i in range(k)]
methods = ["dp", *[m for m in BASELINES if m != "none"]]
points = {m: [] for m in methods}
for b in budgets:
    for m in methods:
        s = solve(p, b, m, time_limit_s=limit)
        if s.feasible:
            points[m].append((s.predicted_peak_bytes / GiB, 100 * s.predicted_recompute_ms / p.step_ms))
fig, ax = plt.subplots(figsize=(8, 5))
for m, pts in points.items():
    if pts:
        pts = sorted(set(pts))
        ax.plot(*zip(*pts), "-o" if m == "dp" else "o", label=m, lw=2 if m == "dp" else 1)
ax.axvline(none_peak / GiB, color="grey", ls=":", label="no checkpointing")
ax.axvline(24, color="red", ls="--", lw=0.8, label="24 GiB")
ax.set_xlabel("predicted peak (GiB)")
ax.set_ylabel("extra step time (% of step)")
ax.set_title("Llama-7B, batch 1 x 4096, bf16, H100 estimate")
ax.legend(fontsize=8)
plt.show()
assert "torch" not in sys.modules"""
        ),
    ]
    return new_notebook(cells=cells)


def llama70b_nb() -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(
            "# Llama-3-70B offline: LoRA on one MI300X, full fine-tuning under FSDP2\n\n"
            "Plans from the committed estimate-mode profiles (`profiles/llama3_70b_*.json.gz`, "
            "made by `benchmarks/make_profiles.py`), with `solvers` alone: no torch, no GPU. "
            "The cases and the table are `benchmarks/llama70b.py`'s. Peaks and times are the "
            "simulator's predictions from roofline op times, not measurements."
        ),
        new_code_cell(SETUP),
        new_code_cell(
            """\
from benchmarks.llama70b import CASES, report, study

cases = CASES[:1] if SMALL else CASES
results = {}
for case in cases:
    p, rows, info = study(case, budgets=2 if SMALL else 4)
    results[case.name] = (rows, info)
    print(report(case, p, rows, info) + "\\n")
assert "torch" not in sys.modules, "offline planning must not import torch"
"""
        ),
        new_markdown_cell(
            "Peak against extra time for each case: the planner's plans (line), HF's per-layer "
            "checkpointing and uniform sqrt(N) segments (markers), the device's memory (dashed)."
        ),
        new_code_cell(
            """\
import matplotlib.pyplot as plt

GiB = 2**30
fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False)
for ax, (name, (rows, info)) in zip(axes[0], results.items()):
    ours = sorted((r.peak / GiB, 100 * r.extra) for r in rows if r.plan.startswith("planner"))
    if ours:
        ax.plot(*zip(*ours), "-o", label="planner", lw=2)
    for r in rows:
        if not r.plan.startswith("planner") and r.plan != "no checkpointing":
            ax.plot(r.peak / GiB, 100 * r.extra, "s", label=r.plan.split(" (")[0][:26])
    ax.axvline(info["capacity"] / GiB, color="red", ls="--", lw=0.8, label="device memory")
    ax.set_title(name, fontsize=8)
    ax.set_xlabel("predicted peak (GiB)")
    ax.set_ylabel("extra step time (%)")
    ax.legend(fontsize=6)
plt.tight_layout()
plt.show()"""
        ),
    ]
    return new_notebook(cells=cells)


NOTEBOOKS = {"quickstart.ipynb": quickstart, "compare.ipynb": compare_nb, "offline.ipynb": offline,
             "llama70b.ipynb": llama70b_nb}


def execute(path: Path, timeout: int = 3600) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--execute", action="store_true", help="execute and store the outputs")
    ap.add_argument("names", nargs="*", help="notebooks to write (default: all)")
    args = ap.parse_args(argv)
    for name, build in NOTEBOOKS.items():
        if args.names and name not in args.names:
            continue
        nb = build()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        path = HERE / name
        nbformat.write(nb, path)
        if args.execute:
            print(f"executing {name} (CKPT_SMALL={os.environ.get('CKPT_SMALL', '')})",
                  file=sys.stderr)
            nbformat.write(execute(path), path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
