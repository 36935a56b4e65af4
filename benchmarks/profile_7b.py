"""Estimate-mode profile of a Llama-style 7B (bf16, seq 4096, batch 1) on this machine: seconds
and peak RSS, in a fresh process each, with the model on the meta device.

    HF_HUB_OFFLINE=1 python benchmarks/profile_7b.py

Two rows: token ids on the meta device (no values), and real token ids on the CPU (their values
known to estimate mode, as when a user passes a real batch). `tests/planner/test_profile_7b.py` checks the
profile's sizes; how long it takes and how much memory it needs is measured here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BUILD = r"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
)
cfg._attn_implementation = "sdpa"
with torch.device("meta"):
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
"""
"""The model, in the source of a fresh process (`tests/planner/test_profile_7b.py` runs it too)."""

SCRIPT = BUILD + r"""
import json, resource, sys, time
from planner.profiling import profile
from solvers import simulate
ids = torch.zeros(1, 4096, dtype=torch.long, device=sys.argv[1])
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
p = profile(model, {"input_ids": ids, "labels": ids}, mode="estimate", device="h100")
seconds = time.perf_counter() - t0
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("RESULT " + json.dumps({"seconds": seconds, "peak_rss_bytes": rss1 * 1024,
                              "rss_growth_bytes": (rss1 - rss0) * 1024, "nodes": len(p.nodes),
                              "peak_bytes": simulate(p).peak_bytes}))
"""


def main() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    print("| token ids | profile() s | peak RSS GiB | RSS growth GiB | nodes | predicted peak GiB |")
    print("|---|---|---|---|---|---|")
    for device in ("meta", "cpu"):
        proc = subprocess.run([sys.executable, "-c", SCRIPT, device], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            print(f"| {device} | failed: {proc.stderr.strip().splitlines()[-1]} |||||")
            continue
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        r = json.loads(line.removeprefix("RESULT "))
        print(f"| {device} | {r['seconds']:.1f} | {r['peak_rss_bytes'] / 2**30:.2f} | "
              f"{r['rss_growth_bytes'] / 2**30:.2f} | {r['nodes']} | "
              f"{r['peak_bytes'] / 2**30:.2f} |")


if __name__ == "__main__":
    main()
