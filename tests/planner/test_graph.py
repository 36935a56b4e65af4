"""The make_fx graph path (`planner.graph`), kept as an explicit option for op-granular regions and
for measuring baselines whose segments span several modules: it still trains like the model and
keeps its prediction, on a model make_fx can trace."""

from __future__ import annotations

import pytest
import torch

from planner.api import SLACK_BYTES
from planner.capture.record import default_loss
from planner.graph.api import plan_from_trace
from planner.graph.profiler import profile_with_trace
from planner.measurement import measure
from solvers import solve
from solvers.simulate import simulate
from tests.planner.test_capture import build


@pytest.mark.parametrize("name", ["gpt_eager", "resnet_bn"])
def test_graph_plan_trains_like_the_model_and_keeps_its_prediction(name):
    model, x = build(name)
    pt = profile_with_trace(model, x, repeats=1)
    prof = pt.profile
    assert prof.meta.capture == "graph" and not prof.calls
    n = simulate(prof).peak_bytes
    # no lower than what dp, the method planned with, reaches (the smallest peak of all
    # methods can be below it)
    budget = max(int(prof.fixed_bytes + 0.4 * (n - prof.fixed_bytes)),
                 solve(prof, 0, "dp").predicted_peak_bytes + SLACK_BYTES)
    p = plan_from_trace(model, pt, budget, method="dp")
    p.example_inputs = x
    assert p.schedule.regions and all(r.module is None for r in p.schedule.regions)
    v = p.verify(repeats=1)
    assert v.max_grad_rel_err <= 1e-5
    assert v.measured_peak_bytes <= budget
    assert abs(v.predicted_peak_bytes - v.measured_peak_bytes) <= 0.02 * v.measured_peak_bytes
    assert torch.isfinite(default_loss(p.module(x)))
    assert measure(p.module, x, repeats=1).peak_bytes < n
