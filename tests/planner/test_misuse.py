"""Every misuse is refused or made right, with a message that says what to change.

One row per bad input or misuse a user meets: the call, the exception type, and words of the
message that tell the user what to do. The CLI rows check the same through `ckpt-planner`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import planner
from planner.inplace import PlanOutdatedWarning
from solvers import Schedule
from solvers.errors import CkptPlannerError, ProfileError, ScheduleError
from solvers.units import BudgetError
from tests.models import gpt_eager, hf_gpt2


def _gpt():
    torch.manual_seed(0)
    return gpt_eager(batch=2, seq=16, dim=32, heads=2, layers=2, vocab=64)


def _plan(model=None, x=None, **kw):
    m, x0 = _gpt()
    model = model if model is not None else m
    kw.setdefault("budget_gb", 1)
    kw.setdefault("repeats", 1)
    return planner.plan(model, example_inputs=x0 if x is None else x, **kw)


def _mp():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _mp_profile_one_process():
    from planner.api import plan_from_profile

    model, x = _gpt()
    return plan_from_profile(model, planner.profile(model, x, repeats=1, mp_policy=_mp()),
                             budget_bytes=2**40)


def _two_dtypes_mp():
    model, x = _gpt()
    model.wpe.to(torch.bfloat16)
    return _plan(model, x, fsdp=True, mp_policy=_mp())


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h if h.sum() > 0 else -h


def _frozen():
    m, x = _gpt()
    m.requires_grad_(False)
    return planner.plan(m, budget_gb=1, example_inputs=x, repeats=1)


def _eval_mode():
    m, x = _gpt()
    m.eval()
    return planner.plan(m, budget_gb=1, example_inputs=x, repeats=1)


def _compiled():
    m, x = _gpt()
    return planner.plan(torch.compile(m), budget_gb=1, example_inputs=x, repeats=1)


def _hf_checkpointing():
    m, x = hf_gpt2(batch=2, seq=16, layers=1, n_embd=32, n_head=2, vocab=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        getattr(m, "activation_checkpointing_enable", m.gradient_checkpointing_enable)()
        return planner.plan(m, budget_gb=1, example_inputs=x, repeats=1)


def _sparse_embedding():
    model = nn.Sequential(nn.Embedding(100, 16, sparse=True), nn.Linear(16, 4))
    return planner.plan(model, budget_gb=1, example_inputs=torch.randint(0, 100, (8, 5)),
                        repeats=1, grad_accumulation=True)


def _compile_without_budget():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    return planner.plan(model, None, example_inputs=torch.randn(4, 8), repeats=1,
                        compile="inductor")


def _checkpoint_wrapper():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    m, x = _gpt()
    m.blocks[0] = checkpoint_wrapper(m.blocks[0])
    return planner.plan(m, budget_gb=1, example_inputs=x, repeats=1)


class _SelfCheckpointing(nn.Module):
    """Checkpoints its own second layer, the way training scripts do by hand."""

    def __init__(self, reentrant: bool = False, offload: bool = False, flag: str = "",
                 on: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
                                    for _ in range(3))
        self.reentrant, self.offload, self.flag = reentrant, offload, flag
        if flag:  # a flag of the model turns it on, as timm's `grad_checkpointing` does
            setattr(self, flag, on)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i != 1 or (self.flag and not getattr(self, self.flag)):
                x = layer(x)
            elif self.offload:
                with torch.autograd.graph.save_on_cpu():
                    x = layer(x)
            else:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.reentrant)
        return x


def _own_checkpoint(**kw):
    return planner.plan(_SelfCheckpointing(**kw).train(), budget_gb=1,
                        example_inputs=torch.randn(4, 8), repeats=1)


def _profile_a_planned_model():
    m, x = _gpt()
    planner.plan(m, budget_gb=1, example_inputs=x, method="per_block", repeats=1)
    return planner.profile(m, x, repeats=1)


def _schedule_for_another_model():
    """A schedule made for a 2-layer model, applied to a 3-layer one."""
    m, x = _gpt()
    p = planner.plan(m, budget_gb=1, example_inputs=x, method="per_block", repeats=1)
    torch.manual_seed(0)
    other, _ = gpt_eager(batch=2, seq=16, dim=32, heads=2, layers=3, vocab=64)
    return planner.apply(other, p.schedule)


def _schedule_for_other_widths(tmp_path_factory=None):
    m, x = _gpt()
    p = planner.plan(m, budget_gb=1, example_inputs=x, method="per_block", repeats=1)
    torch.manual_seed(0)
    wider, _ = gpt_eager(batch=2, seq=16, dim=64, heads=2, layers=2, vocab=64)
    return planner.apply(wider, p.schedule)


def _node_range_schedule():
    from solvers import Region

    m, _ = _gpt()
    return planner.apply(m, Schedule(regions=(Region(start="a", end="b"),)))


def _infeasible_schedule():
    m, _ = _gpt()
    return planner.apply(m, Schedule(status="infeasible"))


def _loss_not_scalar():
    m, x = _gpt()
    return planner.plan(m, budget_gb=1, example_inputs=x, loss_fn=lambda out: out, repeats=1)


def _loss_not_callable():
    m, x = _gpt()
    return planner.plan(m, budget_gb=1, example_inputs=x, loss_fn="mse", repeats=1)


def _gradcache_loss():
    """A loss computed on detached outputs, whose hook runs the model's backward itself inside
    backward (GradCache, as sentence-transformers' Cached* losses do)."""
    m, x = _gpt()

    def loss_fn(out):
        logits = out.detach().requires_grad_()
        loss = logits.float().pow(2).mean().detach().requires_grad_()
        loss.register_hook(lambda g: out.backward(torch.ones_like(out) * g) or g)
        return loss

    return planner.plan(m, budget_gb=1, example_inputs=x, loss_fn=loss_fn, repeats=1)


def _model_raises():
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(16, 8))
    return planner.plan(m, budget_gb=1, example_inputs=torch.randn(4, 8), repeats=1)


class _WritesSavedInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.fc(x))
        y.clamp_(max=1.0)  # relu saved y for its backward: a real step raises in backward
        return y


def _writes_saved_in_place():
    return planner.plan(_WritesSavedInPlace(), budget_gb=1, example_inputs=torch.randn(4, 8),
                        repeats=1)


class _RoundSTE(torch.autograd.Function):
    """Straight-through rounding: a custom Function, which torch.fx tracing cannot keep."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class _BlocksInRootCode(nn.Module):
    """Its blocks are lines of the root's forward, not modules, so only the Linears are calls."""

    def __init__(self):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(16, 64) for _ in range(4))
        self.down = nn.ModuleList(nn.Linear(64, 16) for _ in range(4))

    def forward(self, x):
        for a, b in zip(self.up, self.down, strict=True):
            h = torch.tanh(a(x))
            x = x + b(_RoundSTE.apply(h) * h)
        return x


def _blocks_in_root_code():
    return planner.plan(_BlocksInRootCode(), budget_bytes=64 * 1024,
                        example_inputs=torch.randn(256, 16), repeats=1)


def _too_small_budget():
    m, x = _gpt()
    return planner.plan(m, budget_bytes=1024, example_inputs=x, repeats=1)


def _meta_model():
    with torch.device("meta"):
        m = nn.Linear(8, 8)
    return planner.profile(m, torch.randn(4, 8, device="meta"), repeats=1)


def _estimate_value_branch():
    return planner.profile(_Branchy(), torch.randn(4, 8), mode="estimate")


def _unknown_mode():
    m, x = _gpt()
    return planner.profile(m, x, mode="fast")


def _method_short_of_the_budget():
    """per_block at a budget below its own peak that nested reaches: the error names the
    method, not the smallest achievable peak (which is below the budget)."""
    from planner.api import SLACK_BYTES, plan_from_profile
    from solvers import solve
    from solvers.solve import lowest

    m, x = _gpt()
    prof = planner.profile(m, x, repeats=1)
    low = lowest(prof).predicted_peak_bytes
    blocks = solve(prof, 2**62, "per_block").predicted_peak_bytes
    assert low + 2 * SLACK_BYTES < blocks  # room between the two
    return plan_from_profile(m, prof, budget_bytes=(low + blocks) // 2, method="per_block")


def _unknown_method():
    m, x = _gpt()
    return planner.plan(m, budget_gb=1, example_inputs=x, method="magic", repeats=1)


@dataclass(frozen=True)
class Row:
    name: str
    call: Callable[[], object]
    error: type[Exception]
    says: str
    """A regex the message must match: what to change."""


ROWS = [
    Row("budget string with a typo", lambda: _plan(budget_gb="8 gigs"), BudgetError,
        r"not an amount of memory; give .*'8GiB'"),
    Row("budget as a huge string", lambda: _plan(budget_gb="8" * 10_000), BudgetError,
        r"10000-character string; give"),
    Row("compile partitioner budgets empty",
        lambda: _plan(compile="aot_eager", compile_memory_budgets=()), CkptPlannerError,
        r"give one or more values of activation_memory_budget between 0 and 1"),
    Row("compile partitioner budget above 1",
        lambda: _plan(compile="aot_eager", compile_memory_budgets=(1.5,)), CkptPlannerError,
        r"between 0 and 1, e.g. \(1.0,\)"),
    Row("budget NaN", lambda: _plan(budget_gb=float("nan")), BudgetError, r"not finite; give"),
    Row("budget inf", lambda: _plan(budget_gb=float("inf")), BudgetError, r"not finite; give"),
    Row("budget negative", lambda: _plan(budget_gb=-1), BudgetError, r"not a positive amount"),
    Row("budget zero", lambda: _plan(budget_gb=0), BudgetError, r"not a positive amount"),
    Row("budget True", lambda: _plan(budget_gb=True), BudgetError, r"is a bool.*give"),
    Row("budget a list", lambda: _plan(budget_gb=[8]), BudgetError, r"is a list; give"),
    Row("budget_gb and budget_bytes", lambda: _plan(budget_gb=1, budget_bytes=2**30),
        CkptPlannerError, r"exactly one of budget_gb"),
    Row("budget too small", _too_small_budget, planner.InfeasibleBudgetError,
        r"smallest achievable peak.*Raise the budget, or train on a smaller micro-batch"),
    Row("example_inputs None", lambda: planner.plan(
        _gpt()[0], budget_gb=1, example_inputs=None), CkptPlannerError,
        r"example_inputs is None; pass the largest batch"),
    Row("example_inputs without tensors", lambda: _plan(x=["hello", "world"]), CkptPlannerError,
        r"holds no tensor; pass a tensor"),
    Row("a key forward does not take", lambda: planner.plan(
        hf_gpt2(batch=1, seq=8, layers=1, n_embd=16, n_head=2, vocab=32)[0], budget_gb=1,
        example_inputs={"input_ids": torch.zeros(1, 8, dtype=torch.long), "lables": None}),
        CkptPlannerError, r"no argument named 'lables' \(did you mean 'labels'\?\)"),
    Row("a key a plain forward does not take", lambda: _plan(x={"idx": torch.zeros(
        2, 16, dtype=torch.long), "targets": None}), CkptPlannerError,
        r"no argument named targets; it takes idx: fix the keys"),
    Row("too many positional inputs", lambda: _plan(x=(torch.zeros(2, 16, dtype=torch.long),) * 3),
        CkptPlannerError, r"3 positional arguments but GPT.forward takes 1"),
    Row("not a module", lambda: planner.plan(lambda x: x, budget_gb=1,
                                             example_inputs=torch.zeros(2)),
        CkptPlannerError, r"not a torch.nn.Module"),
    Row("model in eval mode", _eval_mode, CkptPlannerError, r"call model.train\(\) first"),
    Row("loss is a leaf whose hook runs backward (GradCache)", _gradcache_loss,
        CkptPlannerError, r"leaf tensor that requires grad.*GradCache.*lower that, or plan"),
    Row("no parameter requires grad", _frozen, CkptPlannerError,
        r"no parameter .* requires grad.*unfreeze"),
    Row("loss_fn returns a non-scalar", _loss_not_scalar, CkptPlannerError,
        r"loss_fn must return a scalar tensor"),
    Row("loss_fn not callable", _loss_not_callable, CkptPlannerError,
        r"pass a function of the model's output"),
    Row("model raises in its forward", _model_raises, planner.ModelRunError,
        r"in module '1'.*check that the example inputs"),
    Row("model writes in place to a tensor autograd saved", _writes_saved_in_place,
        planner.ModelRunError, r"_WritesSavedInPlace's training step raised: RuntimeError: one "
        r"of the variables .* modified by an inplace operation.*use the out-of-place op"),
    Row("budget below what code outside any submodule keeps", _blocks_in_root_code,
        planner.InfeasibleBudgetError, r"made by the code of the root module itself, outside any "
        r"submodule call.*does not trace with torch.fx.*move that code into submodules"),
    Row("torch.compile'd model", _compiled, CkptPlannerError,
        r"plan the model first and compile after"),
    Row("HF gradient checkpointing on", _hf_checkpointing, CkptPlannerError,
        r"gradient_checkpointing_disable\(\)"),
    Row("accumulating sparse gradients", _sparse_embedding, CkptPlannerError,
        r"^0 makes sparse gradients \(sparse=True\).*over accumulated micro-batches.*"
        r"Plan with sparse=False"),
    Row("compile without a budget", _compile_without_budget, CkptPlannerError,
        r"compile='inductor' needs a budget"),
    Row("checkpoint_wrapper inside", _checkpoint_wrapper, CkptPlannerError,
        r"already wrapped for checkpointing.*remove checkpoint_wrapper"),
    Row("the model calls torch.utils.checkpoint itself", _own_checkpoint, planner.ModelRunError,
        r"calls torch.utils.checkpoint itself, in layers.1:.*remove the model's own "
        r"checkpointing"),
    Row("the model calls reentrant checkpoint itself", lambda: _own_checkpoint(reentrant=True),
        planner.ModelRunError, r"checkpoint\(use_reentrant=True\) itself.*remove the model's "
        r"own checkpointing"),
    Row("a flag of the model turns its own checkpointing on",
        lambda: _own_checkpoint(flag="use_checkpoint"), planner.ModelRunError,
        r"calls torch.utils.checkpoint itself, in layers.1:.*likely model.use_checkpoint=True "
        r"\(set it to False"),
    Row("timm's grad checkpointing on", lambda: _own_checkpoint(flag="grad_checkpointing"),
        CkptPlannerError, r"timm's grad checkpointing on.*model.set_grad_checkpointing\(False\)"),
    Row("the model offloads activations itself", lambda: _own_checkpoint(offload=True),
        planner.ModelRunError, r"saved-tensor hooks of its own.*in layers.1:"),
    Row("profile of a model that carries a plan", _profile_a_planned_model,
        planner.ModelRunError, r"calls torch.utils.checkpoint itself.*planner.remove\(model\)"),
    Row("schedule for a 2-layer model on a 3-layer one", _schedule_for_another_model,
        ScheduleError, r"made for another model: this model has modules the plan does not "
        r"know: blocks.2.*re-plan for this model"),
    Row("schedule for other widths", _schedule_for_other_widths, ScheduleError,
        r"parameters differ: wte.weight \(\[64, 32\] float32 in the plan, \[64, 64\] "
        r"float32 here\)"),
    Row("node-range schedule applied in place", _node_range_schedule, ScheduleError,
        r"not a module call.*plan from a profile recorded by planner.profile"),
    Row("infeasible schedule applied", _infeasible_schedule, ScheduleError,
        r"does not fit its budget; re-plan with a larger budget"),
    Row("meta-device model in measure mode", _meta_model, CkptPlannerError,
        r"use mode='estimate'"),
    Row("value-dependent branch in estimate mode", _estimate_value_branch, planner.ModelRunError,
        r"Profile it in measure mode"),
    Row("unknown profiling mode", _unknown_mode, CkptPlannerError,
        r"expected 'measure' or 'estimate'"),
    Row("unknown solver method", _unknown_method, ValueError, r"expected one of auto, "),
    Row("a method that cannot reach a budget others reach", _method_short_of_the_budget,
        planner.InfeasibleBudgetError,
        r"method 'per_block' finds no schedule within budget .* the other searches reach "
        r".*leave method='auto'"),
    Row("FSDP2 mixed precision without fsdp=True", lambda: _plan(mp_policy=_mp()),
        CkptPlannerError, r"mp_policy is FSDP2's mixed precision; pass fsdp=True"),
    Row("mp_policy not a MixedPrecisionPolicy", lambda: _plan(fsdp=True,
                                                              mp_policy=torch.bfloat16),
        CkptPlannerError, r"pass the torch.distributed.fsdp.MixedPrecisionPolicy"),
    Row("a mixed-precision profile planned for one process", _mp_profile_one_process,
        CkptPlannerError, r"recorded for FSDP2's mixed precision.*per_rank"),
    Row("mp_policy on parameters of two dtypes", _two_dtypes_mp, CkptPlannerError,
        r"several floating dtypes \(bfloat16, float32\).*model.float\(\)"),
    Row("malformed profile file", lambda: Schedule.from_dict({"schema": "x"}), ScheduleError,
        r"not a ckpt-planner schedule"),
    Row("profile of another schema", lambda: __import__("solvers").Profile.from_dict(
        {"schema": "ckpt-planner/profile", "schema_version": 99}), ProfileError,
        r"re-record the profile with `ckpt-planner profile`"),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_misuse_is_refused_with_a_fix(row: Row):
    with pytest.raises(row.error, match=row.says):
        row.call()


def test_the_table_is_long_enough():
    assert len(ROWS) >= 25


def _outdated(step, times: int = 2) -> list[str]:
    """The PlanOutdatedWarning messages of `times` calls of `step` (one training step each)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(times):
            step()
    return [str(w.message) for w in seen if issubclass(w.category, PlanOutdatedWarning)]


def test_a_model_changed_after_planning_warns_once():
    model, x = _gpt()
    planner.plan(model, budget_gb=1, example_inputs=x, method="per_block", repeats=1)
    model.lm_head = nn.Linear(32, 64, bias=False)
    msgs = _outdated(lambda: model(x).sum().backward())
    assert len(msgs) == 1 and "module lm_head" in msgs[0]
    assert "re-plan" in msgs[0]


class _RefusesBool:
    def __bool__(self):
        raise RuntimeError("no truth value")


class _ElementwiseEq(nn.Module):
    """A module whose ``==`` compares elementwise and refuses ``bool()``, as tensordict's
    TensorDictParams (the module torchrl's losses keep their networks' parameters in) does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)

    def forward(self, x):
        return torch.tanh(self.fc(x)).pow(2)

    def __eq__(self, other):
        return _RefusesBool()

    __hash__ = nn.Module.__hash__


def test_a_module_whose_equality_refuses_bool_is_planned_watched_and_removed():
    """The planner notices a model changed after planning through a map of its modules, which
    compared modules with ``==``: removing the plan from such a model raised, and a change to
    it went unnoticed."""
    torch.manual_seed(0)
    model = nn.Sequential(_ElementwiseEq(), nn.Linear(64, 16), _ElementwiseEq(),
                          nn.Linear(64, 4)).train()
    x = torch.randn(32, 16)
    p = planner.plan(model, None, example_inputs=x, repeats=1)
    assert p.verify(repeats=1).max_grad_rel_err == 0.0
    model[0].fc = nn.Linear(16, 64)
    msgs = _outdated(lambda: model(x).sum().backward())
    assert len(msgs) == 1 and "module 0.fc" in msgs[0]
    planner.remove(model)
    assert "forward" not in model[0].__dict__


def test_a_model_converted_to_another_dtype_after_planning_warns_once():
    model, x = _gpt()
    planner.plan(model, budget_gb=1, example_inputs=x, method="per_block", repeats=1)
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanOutdatedWarning)
        model(x).sum().backward()  # as planned: no warning
        twin(x).sum().backward()  # a copy checks its own parameters
    model.to(torch.float64)
    msgs = _outdated(lambda: model(x).sum().backward())
    assert len(msgs) == 1 and "converted to torch.float64" in msgs[0] and "re-plan" in msgs[0]
    twin.double()
    with pytest.warns(PlanOutdatedWarning, match="converted to torch.float64"):
        twin(x).sum().backward()


def test_hf_gradient_checkpointing_turned_on_after_planning_warns_once():
    # what TrainingArguments(gradient_checkpointing=True) does to a model it is given
    model, x = hf_gpt2(batch=2, seq=16, layers=2, n_embd=32, n_head=2, vocab=64)
    planner.plan(model, budget_gb=1, example_inputs=x, method="per_block", repeats=1)
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanOutdatedWarning)
        model(**x).loss.backward()  # as planned: no warning
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        model.gradient_checkpointing_enable()
    msgs = _outdated(lambda: model(**x).loss.backward())
    assert len(msgs) == 1 and "gradient checkpointing was turned on after planning" in msgs[0]
    assert "gradient_checkpointing_disable()" in msgs[0]
    with warnings.catch_warnings():  # the copy has flags of its own, still off
        warnings.simplefilter("error", PlanOutdatedWarning)
        twin(**x).loss.backward()


def test_timm_grad_checkpointing_turned_on_after_planning_warns_once():
    # what timm's train.py --grad-checkpointing does: model.set_grad_checkpointing(True)
    torch.manual_seed(0)
    model, x = _SelfCheckpointing(flag="grad_checkpointing", on=False).train(), torch.randn(4, 8)
    planner.plan(model, budget_gb=1, example_inputs=x, method="per_block", repeats=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanOutdatedWarning)
        model(x).sum().backward()  # as planned: no warning
    model.set_grad_checkpointing(True)
    msgs = _outdated(lambda: model(x).sum().backward())
    assert len(msgs) == 1 and "timm's grad checkpointing was turned on after planning" in msgs[0]
    assert "set_grad_checkpointing(False)" in msgs[0]


def test_a_step_under_another_autocast_than_planned_warns_once():
    model, x = _gpt()
    planner.plan(model, budget_gb=1, example_inputs=x, method="per_block", repeats=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().sum()
            loss.backward()
    msgs = [str(w.message) for w in seen if issubclass(w.category, PlanOutdatedWarning)]
    assert len(msgs) == 1 and "made for steps without autocast" in msgs[0]
    assert "autocast=torch.bfloat16" in msgs[0]

    model, x = _gpt()
    planner.plan(model, budget_gb=1, example_inputs=x, method="per_block", repeats=1,
                 autocast=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanOutdatedWarning)
        with torch.autocast("cpu", dtype=torch.float16):  # another dtype of the same size
            loss = model(x).float().sum()
        loss.backward()
    msgs = _outdated(lambda: model(x).sum().backward())
    assert len(msgs) == 1 and "can pass the budget" in msgs[0]


def test_a_planned_model_runs_on_the_meta_device():
    # shape inference on a copy moved to meta: a device autocast does not know
    model, x = _gpt()
    planner.plan(model, budget_gb=1, example_inputs=x, method="per_block", repeats=1)
    twin = copy.deepcopy(model).to("meta")
    out = twin(x.to("meta"))
    out.sum().backward()
    assert out.device.type == "meta" and out.shape == (2, 16, 64)


def test_a_reloaded_weight_of_the_same_shape_does_not_warn():
    model, x = _gpt()
    planner.plan(model, budget_gb=1, example_inputs=x, method="per_block", repeats=1)
    w = model.blocks[0].mlp.c_fc.weight
    model.blocks[0].mlp.c_fc.weight = nn.Parameter(w.detach().clone())
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanOutdatedWarning)
        model(x).sum().backward()


def test_a_larger_batch_than_planned_warns_once():
    model, x = _gpt()
    planner.plan(model, budget_gb=1, example_inputs=x, method="per_block", repeats=1)
    same = torch.zeros(2, 16, dtype=torch.long)
    bigger = torch.cat([x, x])  # batch 4 instead of 2
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(same).sum().backward()  # same size: no warning
        model(bigger).sum().backward()
        model(bigger).sum().backward()
    msgs = [str(w.message) for w in seen if issubclass(w.category, PlanOutdatedWarning)]
    assert len(msgs) == 1 and "larger than the one the plan was made for" in msgs[0]
    assert "[4, 16] (planned for [2, 16])" in msgs[0]


def test_a_saved_schedule_applies_to_the_same_model_built_again(tmp_path):
    model, x = _gpt()
    p = planner.plan(model, budget_gb=1, example_inputs=x, method="per_block", repeats=1)
    path = p.save(tmp_path / "s.json")
    fresh, _ = _gpt()
    assert planner.apply(fresh, path) is fresh
    assert Schedule.load(path).made_for["modules"] == [n for n, _ in fresh.named_modules()]


def test_budget_strings_with_units_are_accepted():
    model, x = _gpt()
    p = planner.plan(model, budget_gb="500MiB", example_inputs=x, repeats=1)
    assert p.budget_bytes == 500 * 2**20
    q = planner.plan(model, budget_gb="2GB", example_inputs=x, repeats=1)
    assert q.budget_bytes == 2 * 10**9


def test_verify_warns_where_the_measured_peak_is_above_the_budget():
    model, x = _gpt()
    p = planner.plan(model, example_inputs=x, repeats=1)  # the smallest peak
    assert p.budget_bytes == p.predicted_peak_bytes + planner.api.SLACK_BYTES
    assert p.verify(repeats=1).fits_budget
    p.budget_bytes = p.predicted_peak_bytes - 2**20  # as if the profile had missed 1 MiB
    with pytest.warns(UserWarning, match="above the budget .*plan again with the budget lowered"):
        v = p.verify(repeats=1)
    assert not v.fits_budget
    # made for torch.compile, the budget is the compiled step's: the eager step is not judged
    p.compiled_backend = "inductor"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert not p.verify(repeats=1).fits_budget


class _WithExtraState(nn.Module):
    """Keeps a dict in its state_dict (`get_extra_state`), as neuraloperator's FNO keeps its
    metadata."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)
        self.meta = {"n_modes": (8, 8)}

    def get_extra_state(self):
        return self.meta

    def set_extra_state(self, state):
        self.meta = state

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


def test_verify_takes_a_model_with_extra_state():
    """verify's reference step snapshots the state_dict to put it back; it called ``detach``
    on the extra state's dict and raised."""
    model = nn.Sequential(_WithExtraState(), _WithExtraState(), nn.Linear(64, 1))
    p = planner.plan(model, example_inputs=torch.randn(128, 64), repeats=1)
    try:
        v = p.verify(repeats=1)
        assert v.max_grad_rel_err == 0 and v.fits_budget
        assert model.state_dict()["0._extra_state"] == {"n_modes": (8, 8)}
    finally:
        planner.remove(model)


class _Reseeding(nn.Module):
    """Draws its dropout mask after reseeding from the OS (as Reformer's `torch.seed()`)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        torch.seed()
        return self.b(torch.nn.functional.dropout(self.a(x).relu(), 0.5)).pow(2).mean()


def test_verify_says_when_the_unplanned_model_is_not_reproducible():
    model, x = _Reseeding(), torch.randn(32, 64)
    p = planner.plan(model, example_inputs=x, repeats=1)
    with pytest.raises(planner.NotReproducibleError, match="reseeds"):
        p.verify(repeats=1)


# -- the same misuses through the command line -------------------------------------------------------
@dataclass(frozen=True)
class CliRow:
    name: str
    argv: list[str]
    code: int
    says: str


def _profile_file(tmp_path_factory) -> str:
    from tests.solver_cases import chain4

    path = tmp_path_factory.mktemp("cli") / "p.json"
    chain4().save(path)
    return str(path)


CLI_ROWS = [
    CliRow("budget NaN", ["plan", "{p}", "--budget-gb", "nan"], 2, r"not an amount of memory"),
    CliRow("budget with a typo", ["plan", "{p}", "--budget-gb", "8 gigs"], 2,
           r"give a number of GiB .*'8GiB'"),
    CliRow("budget negative", ["plan", "{p}", "--budget-gb", "-3"], 2, r"not an amount of memory"),
    CliRow("budget zero", ["plan", "{p}", "--budget-gb", "0"], 2, r"not a positive amount"),
    CliRow("two budgets", ["plan", "{p}", "--budget-gb", "1", "--budget-bytes", "5"], 2,
           r"one of --budget-gb and --budget-bytes"),
    CliRow("no budget", ["plan", "{p}"], 2, r"give a budget with --budget-gb .* or use --min"),
    CliRow("budget too small", ["plan", "{p}", "--budget-bytes", "1KiB"], 1,
           r"below the smallest achievable peak.*Raise the budget"),
    CliRow("unknown method", ["plan", "{p}", "--budget-gb", "1", "--method", "magic"], 2,
           r"unknown method 'magic'; expected one of auto"),
    CliRow("missing profile", ["plan", "/nowhere/p.json", "--budget-gb", "1"], 2,
           r"no such profile file"),
    CliRow("profile spec without a colon", ["profile", "tests.models", "-o", "/tmp/x.json"], 2,
           r"no 'module:function' form"),
    CliRow("profile spec of a missing function", ["profile", "tests.models:gpt2_tiny", "-o",
                                                  "/tmp/x.json"], 2,
           r"has no function 'gpt2_tiny'.*e.g. tests.models:hf_gpt2"),
    CliRow("show a missing file", ["show", "/nowhere/p.json"], 2, r"no such profile file"),
]


@pytest.mark.parametrize("row", CLI_ROWS, ids=[r.name for r in CLI_ROWS])
def test_cli_misuse_is_refused_with_a_fix(row: CliRow, tmp_path_factory, capsys):
    import re

    from planner.cli import main

    argv = [a.replace("{p}", _profile_file(tmp_path_factory)) for a in row.argv]
    assert main(argv) == row.code
    err = capsys.readouterr().err
    assert re.search(row.says, err), err


def test_profiling_for_fsdp_mixed_precision_puts_the_model_back():
    """The step is recorded with the parameters cast in place (as FSDP2 all-gathers them): the
    same Parameter objects come back in their dtype with their values and gradients, also where
    the step raises."""
    model, x = _gpt()
    params = dict(model.named_parameters())
    before = {k: p.detach().clone() for k, p in params.items()}
    for p in params.values():
        p.grad = torch.full_like(p, 0.5)
    grads = {k: p.grad for k, p in params.items()}
    prof = planner.profile(model, x, repeats=1, mp_policy=_mp())
    assert prof.meta.fsdp_mixed_precision == {
        "param_dtype": "bfloat16", "orig_dtype": "float32", "reduce_dtype": "float32"}
    assert prof.meta.dtype == "bfloat16"
    assert prof.param_bytes * 2 == sum(p.numel() * 4 for p in params.values())
    for k, p in model.named_parameters():
        assert p is params[k] and p.dtype == torch.float32 and p.grad is grads[k]
        assert torch.equal(p, before[k]), k

    def boom(_m, _a):
        assert model.wte.weight.dtype == torch.bfloat16  # raised inside the cast step
        raise RuntimeError("boom")

    h = model.blocks[1].register_forward_pre_hook(boom)
    with pytest.raises(planner.ModelRunError, match="boom"):
        planner.profile(model, x, repeats=1, mp_policy=_mp())
    h.remove()
    for k, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is grads[k] and torch.equal(p, before[k]), k
    # a policy that casts nothing records the step as it is
    from torch.distributed.fsdp import MixedPrecisionPolicy

    same = planner.profile(model, x, repeats=1, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.float32))
    assert same.meta.fsdp_mixed_precision == {} and same.param_bytes == 2 * prof.param_bytes
