"""The simulator against measured memory (torch.profiler allocation events) on the CPU test models.

No checkpointing, random contiguous regions, and selective regions that keep matmul outputs: the
simulated peak must match the measured peak of the rewritten module (and the rewritten module must
give the original's gradients, which is what makes the comparison meaningful).
"""

from __future__ import annotations

import random

import pytest
import torch

from planner.api import _one_step
from planner.measure import measure
from planner.profiler import profile_with_trace
from planner.rewrite import PlannedModule, rewrite
from planner.trace import default_loss
from solvers.schedule import Region
from solvers.simulate import simulate
from solvers.solve import solve

try:
    from tests.models import TINY
except ImportError:  # pytest run from inside tests/
    from models import TINY

# Smaller than the defaults: these tests measure several schedules per model.
SIZES = {
    "mlp_dropout": dict(batch=512),
    "gpt_eager": dict(batch=4, layers=3),
    "hf_gpt2": dict(batch=4),
    "hf_llama": dict(batch=4),
    "resnet_bn": dict(batch=4),
    "unet": dict(batch=2),
    "ln_linear_stack": dict(batch=16),
    "deep_narrow_cnn": dict(batch=2, depth=16),
}


@pytest.fixture(scope="module", params=sorted(TINY))
def traced(request):
    name = request.param
    model, x = TINY[name](**SIZES.get(name, {}))
    return name, model, x, profile_with_trace(model, x, repeats=1)


def _check(model, x, pt, regions, tol):
    sim = simulate(pt.profile, regions)
    planned = PlannedModule(model, pt.trace, rewrite(pt.trace, regions))
    l0, g0 = _one_step(model, x, default_loss)
    l1, g1 = _one_step(planned, x, default_loss)
    torch.testing.assert_close(l1, l0)
    assert g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-6)
    measured = measure(planned, x, repeats=1).peak_bytes
    err = abs(sim.peak_bytes - measured) / measured
    assert err <= tol, (
        f"{len(regions)} regions: predicted {sim.peak_bytes} vs measured {measured} "
        f"({100 * err:.2f}%)"
    )


def test_none_peak_within_2_percent(traced):
    _name, model, x, pt = traced
    sim = simulate(pt.profile)
    measured = measure(model, x, repeats=1).peak_bytes
    assert abs(sim.peak_bytes - measured) <= 0.02 * measured


def test_random_regions_match_measured(traced):
    _name, model, x, pt = traced
    fw = [n.name for n in pt.profile.nodes if n.phase == "forward"]
    rng = random.Random(0)
    for k in (1, 2, 3):
        cuts = sorted(rng.sample(range(1, len(fw) - 1), 2 * k))
        regions = tuple(
            Region(start=fw[cuts[i]], end=fw[cuts[i + 1]]) for i in range(0, len(cuts), 2)
        )
        _check(model, x, pt, regions, tol=0.02)


def test_selective_regions_match_measured(traced):
    _name, model, x, pt = traced
    schedule = solve(pt.profile, 2**62, method="selective_matmul")
    assert any(r.saved for r in schedule.regions)
    _check(model, x, pt, schedule.regions, tol=0.02)
