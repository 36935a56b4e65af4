"""`ckpt-planner plan` on a saved hand-built profile (no torch)."""

from __future__ import annotations

import json

from planner.cli import main
from solvers.units import format_bytes
from tests.solver_cases import MIB

GIB = 2**30
FIXED = MIB + 1024


def test_plan_table_and_schedule(solver_cases, tmp_path, capsys):
    path = solver_cases["chain4"].save(tmp_path / "chain4.json")
    out = tmp_path / "schedule.json"
    budget = 12 * MIB + FIXED + 8  # the smallest peak, worked out in test_solvers
    rc = main(["plan", str(path), "--budget-bytes", str(budget), "--method", "dp", "-o", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    for word in ("method", "status", "peak GiB", "extra ms", "extra %", "regions", "solve s"):
        assert word in text
    for m in ("dp", "none", "per_block", "sqrt_n", "chen_greedy", "every_k", "selective_matmul"):
        assert m in text
    d = json.loads(out.read_text())
    assert d["method"] == "dp" and d["status"] in ("optimal", "feasible")
    assert d["predicted_recompute_ms"] == 1.0 and d["regions"][0]["end"] == "f1"


def test_plan_budget_gb_auto(solver_cases, tmp_path, capsys):
    path = solver_cases["chain4"].save(tmp_path / "chain4.json")
    assert main(["plan", str(path), "--budget-gb", "1"]) == 0
    assert "auto (" in capsys.readouterr().out


def test_plan_infeasible(solver_cases, tmp_path, capsys):
    path = solver_cases["chain4"].save(tmp_path / "chain4.json")
    rc = main(["plan", str(path), "--budget-gb", "0.001"])
    err = capsys.readouterr().err
    assert rc == 1
    smallest = format_bytes(12 * MIB + FIXED + 8)
    assert "below the smallest achievable peak" in err and f"({smallest}," in err


def test_plan_sweep_and_plot(solver_cases, tmp_path, capsys):
    path = solver_cases["chain4"].save(tmp_path / "chain4.json")
    png = tmp_path / "frontier.png"
    assert main(["plan", str(path), "--sweep", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "budget GiB" in text and text.count("\n") > 10
    assert png.stat().st_size > 1000


def test_plan_unknown_method(solver_cases, tmp_path, capsys):
    path = solver_cases["chain4"].save(tmp_path / "chain4.json")
    assert main(["plan", str(path), "--budget-gb", "1", "--method", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_plan_per_rank_under_fsdp_and_ddp(capsys):
    from pathlib import Path

    gpt2 = str(Path(__file__).resolve().parents[2] / "profiles" / "gpt2_small_h100.json.gz")
    assert main(["plan", gpt2, "--world-size", "8", "--fsdp", "--budget-gb", "12",
                 "--method", "per_block"]) == 0
    text = capsys.readouterr().out
    assert "per rank: FSDP2 over 8 ranks, 12 units besides the root" in text
    assert "n/a: spans FSDP units" in text  # sqrt_n's segments of several layers
    assert main(["plan", gpt2, "--world-size", "2", "--budget-gb", "40"]) == 0
    assert "per rank: DDP over 2 ranks, gradient buckets" in capsys.readouterr().out
    assert main(["plan", gpt2, "--fsdp-units", "transformer.h.0", "--budget-gb", "40"]) == 2
    assert "--fsdp-units needs --fsdp" in capsys.readouterr().err
    assert main(["plan", gpt2, "--fsdp", "--fsdp-units", "transformer.h.99",
                 "--budget-gb", "40"]) == 2
    assert "not a module called in this step" in capsys.readouterr().err
    # gradient accumulation under FSDP2: the sharded gradients held from the start
    assert main(["plan", gpt2, "--world-size", "8", "--fsdp", "--grad-accumulation",
                 "--min"]) == 0
    text = capsys.readouterr().out
    assert "per rank: FSDP2 over 8 ranks" in text and "every gradient held" in text
