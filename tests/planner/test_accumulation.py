"""Gradient accumulation: a micro-batch after the first starts with every gradient held.

The prediction for that step (`solvers.accumulation.holding_grads`) is checked against memory
measured two ways: `measure(..., grads_held=True)`, and a plain training loop that accumulates
over three micro-batches under `torch.profiler`, which shares no code with the planner's
measurement of held gradients.
"""

from __future__ import annotations

import pytest
import torch

import planner
from planner.api import plan_from_profile
from planner.measurement import fixed_bytes, measure
from planner.profiling import profile
from solvers.accumulation import holding_grads
from solvers.errors import ProfileError
from solvers.profile import Profile
from solvers.simulate import simulate
from solvers.solve import smallest_peak
from tests.models import accumulated_loop_peak
from tests.planner.test_capture import build

MODELS = ["gpt_eager", "hf_llama", "resnet_bn", "ln_linear_stack"]


def gpt():
    """A GPT whose activations outweigh its parameters enough that plans exist with every
    gradient held (at test_capture's size, the parameters and their gradients are most of it)."""
    from tests.models import gpt_eager

    torch.manual_seed(0)
    model, x = gpt_eager(batch=4, seq=64, dim=64, heads=4, layers=3, vocab=128)
    return model.train(), x


@pytest.mark.parametrize("name", MODELS)
def test_the_step_with_gradients_held_is_predicted(name):
    """Unplanned and planned halfway down to its smallest peak: the simulated step with every gradient
    held equals the measured one (within 1%), and peaks above the first micro-batch's by at
    most the gradients' bytes."""
    torch.manual_seed(0)
    model, x = build(name)
    prof = profile(model, x, repeats=1)
    held = holding_grads(prof)
    assert held.fixed_bytes == prof.fixed_bytes + prof.grad_bytes
    assert held.meta.grads_held and not held.grads
    first = simulate(prof).peak_bytes
    predicted = simulate(held).peak_bytes
    measured = measure(model, x, repeats=0, grads_held=True).peak_bytes
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)
    assert first <= predicted <= first + prof.grad_bytes
    budget = (smallest_peak(held) + predicted) // 2
    p = plan_from_profile(model, held, budget_bytes=budget, method="auto")
    p.example_inputs = x
    try:
        assert p.schedule.regions
        measured = p.measure(repeats=0).peak_bytes  # with the gradients held, as planned
        assert abs(p.predicted_peak_bytes - measured) <= 0.01 * measured
        assert measured <= budget
    finally:
        planner.remove(model)


def test_a_plan_for_accumulation_holds_in_a_loop_that_accumulates():
    """Planned at a budget below what the unplanned loop needs: the plan made for gradient
    accumulation keeps a loop of three micro-batches within it (measured by the profiler around
    the loop itself); the plan made for single steps fits its first micro-batch only."""
    model, x = gpt()
    first = measure(model, x, repeats=0).peak_bytes
    looped = accumulated_loop_peak(model, x)
    assert looped > first  # the later micro-batches hold every gradient
    budget = first - (first - fixed_bytes(model, x)) // 4
    single = planner.plan(model, budget_bytes=budget, example_inputs=x, repeats=1)
    assert single.measure(repeats=0).peak_bytes <= budget
    single_loop = accumulated_loop_peak(model, x)
    p = planner.plan(model, budget_bytes=budget, example_inputs=x, repeats=1,
                     grad_accumulation=True)
    try:
        assert p.profile.meta.grads_held and "gradient accumulation" in p.report()
        assert single_loop > budget  # the single-step plan does not hold for accumulation
        accumulated = accumulated_loop_peak(model, x)
        assert accumulated <= budget
        assert abs(p.predicted_peak_bytes - accumulated) <= 0.01 * accumulated
        v = p.verify(repeats=1)
        assert v.max_grad_rel_err <= 1e-5 and v.measured_peak_bytes <= budget
    finally:
        planner.remove(model)


def test_lora_gradients_held_are_the_adapters_only():
    """With the base frozen (PEFT LoRA), the gradients held are the adapters': the prediction
    stays exact and moves by their bytes only."""
    pytest.importorskip("peft")
    from tests.zoo import peft_lora_llama

    case = peft_lora_llama()
    prof = profile(case.model, case.inputs, loss_fn=case.loss_fn, repeats=1)
    trainable = sum(q.numel() * q.element_size() for q in case.model.parameters()
                    if q.requires_grad)
    assert prof.grad_bytes == trainable
    predicted = simulate(holding_grads(prof)).peak_bytes
    measured = measure(case.model, case.inputs, case.loss_fn, repeats=0,
                       grads_held=True).peak_bytes
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)
    looped = accumulated_loop_peak(case.model, case.inputs, case.loss_fn)
    assert abs(predicted - looped) <= 0.01 * looped, (predicted, looped)


def test_gradient_accumulation_under_fsdp_holds_the_sharded_gradients():
    """Planned for FSDP2 with accumulation, a rank's step holds its sharded gradients from the
    start (measured on 2 gloo ranks: tests/planner/test_distributed.py, fsdp+accumulation)."""
    from solvers.accumulation import HELD_GRADS

    model, x = build("ln_linear_stack")
    p = planner.plan(model, budget_gb=1, example_inputs=x, grad_accumulation=True,
                     fsdp=True, world_size=2, repeats=1)
    q = p.profile
    assert q.meta.grads_held and q.meta.sharding == "fsdp"
    held = next(n for n in q.nodes if n.name == HELD_GRADS)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert q.storage_bytes[held.storage] == q.grad_bytes
    assert grads // 2 <= q.grad_bytes <= grads // 2 + 64  # each half, rounded up per unit
    assert p.local_profile.meta.grads_held  # unsharded, this process holds every gradient
    # one per unit with gradients (this model's root has no parameters of its own)
    assert sum(n.op == "fsdp.accumulate" for n in q.nodes) == \
        sum(n.op == "fsdp.sharded_grads" for n in q.nodes) == len(q.meta.shard_units)


@pytest.mark.slow
def test_a_compiled_plan_for_accumulation_holds_in_a_compiled_loop():
    """With compile=, the compiled copies are measured with every gradient held: the model
    compiled with the plan's backend keeps a loop of three accumulated micro-batches within the
    budget, where the unplanned compiled loop does not."""
    torch._dynamo.reset()
    model, x = gpt()
    prof = holding_grads(profile(model, x, repeats=1))
    n, f = simulate(prof).peak_bytes, prof.fixed_bytes
    budget = int(f + 0.6 * (n - f))
    assert accumulated_loop_peak(torch.compile(model, backend="aot_eager"), x) > budget
    torch._dynamo.reset()
    p = planner.plan(model, budget_bytes=budget, example_inputs=x, repeats=1,
                     compile="aot_eager", compile_memory_budgets=(1.0,), grad_accumulation=True)
    try:
        assert p.compiled_peak_bytes is not None and p.compiled_peak_bytes <= budget
        assert accumulated_loop_peak(torch.compile(model, backend=p.compile_backend), x) <= budget
    finally:
        planner.remove(model)
        torch._dynamo.reset()


def test_holding_gradients_is_a_profile_transform_saved_with_the_profile(tmp_path):
    """A profile transform: applied once (again is refused), kept through save and load, refused on
    an FSDP2 rank's profile."""
    from solvers.distributed import per_rank

    model, x = build("ln_linear_stack")
    prof = profile(model, x, repeats=1)
    held = holding_grads(prof)
    with pytest.raises(ProfileError, match="already"):
        holding_grads(held)
    again = Profile.load(held.save(tmp_path / "held.json"))
    assert again.meta.grads_held and simulate(again).peak_bytes == simulate(held).peak_bytes
    with pytest.raises(ProfileError, match="per_rank first"):
        per_rank(held, world_size=2, sharding="fsdp")


def test_the_cli_plans_a_saved_profile_for_accumulation(tmp_path, capsys):
    from planner.cli import main

    model, x = build("ln_linear_stack")
    path = profile(model, x, repeats=1).save(tmp_path / "p.json")
    held = holding_grads(Profile.load(path))
    budget = simulate(held).peak_bytes
    assert main(["plan", str(path), "--budget-bytes", str(budget), "--grad-accumulation",
                 "-o", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "gradient accumulation: every gradient held" in out
    from solvers.schedule import Schedule

    s = Schedule.load(tmp_path / "s.json")
    assert simulate(held, s.regions).peak_bytes <= budget
