"""Estimate-mode profile of a Llama-style 7B on the meta device: nothing materialised, sizes right.

Run in a fresh subprocess so that its peak RSS is its own, not whatever earlier tests left behind.
How long it takes and how much memory it needs is measured by `benchmarks/profile_7b.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.profile_7b import BUILD

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = BUILD + r"""
import json, resource, time
from planner.profiling import profile

ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
n_params = sum(p.numel() for p in model.parameters())
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
p = profile(model, {"input_ids": ids, "labels": ids}, mode="estimate", device="h100")
seconds = time.perf_counter() - t0
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("RESULT " + json.dumps({
    "seconds": seconds,
    "rss_growth_bytes": (rss1 - rss0) * 1024,  # ru_maxrss is KiB on Linux
    "n_params": n_params,
    "param_bytes": p.param_bytes,
    "grad_bytes": p.grad_bytes,
    "saved_bytes": p.saved_bytes,
    "step_ms": p.step_ms,
    "n_nodes": len(p.nodes),
    "n_forward": sum(n.phase == "forward" for n in p.nodes),
    "dtype": p.meta.dtype,
}))
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units are KiB on Linux only")
def test_llama7b_estimate_profile_sizes():
    pytest.importorskip("transformers")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    assert 6.5e9 < r["n_params"] < 7e9
    assert r["param_bytes"] == 2 * r["n_params"]
    assert r["grad_bytes"] == 2 * r["n_params"]
    assert r["dtype"] == "bfloat16"
    # 32 decoder layers' activations at seq 4096, bf16: tens of GiB, far above the weights.
    assert 10 * 2**30 < r["saved_bytes"] < 60 * 2**30, r
    assert r["step_ms"] > 0 and r["n_forward"] > 32 * 20
