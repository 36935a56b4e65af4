"""Regions inside a module's forward (`planner.stages`): traced forwards cut into runs of nodes.

What tracing fixes is checked at every call; what it cannot see (a value-dependent branch, a
`torch.no_grad` block, `**kwargs`) gives no stages rather than wrong ones.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import planner
from planner.inplace import StagedForward, applied, apply_schedule, wrapper_of
from planner.measurement import Measurement
from planner.stages import call_pattern, stageable, trace
from solvers.chain import bind, candidate_calls, region
from solvers.errors import ScheduleError
from solvers.graph import graph_index
from solvers.schedule import Schedule
from solvers.simulate import simulate
from tests.models import gpt_eager
from tests.planner.test_inplace import assert_grads_close, loss_and_grads

pytestmark = pytest.mark.slow

GPT = dict(batch=2, seq=32, dim=32, heads=4, layers=2, vocab=64)


def _staged_schedule(prof, module: str) -> Schedule:
    """Every other useful run of two stages of `module`'s traced forward."""
    spans = [s for s in candidate_calls(prof) if s.call.module == module and s.staged
             and s.segment is not None]
    chosen, end = [], -1
    for s in sorted(spans, key=lambda s: (s.a, s.b)):
        if s.a > end and s.segment[1] - s.segment[0] >= 1:
            chosen.append(s)
            end = s.b
    assert len(chosen) >= 2, spans
    return Schedule(regions=bind(prof, tuple(region(prof, s.a, s.b) for s in chosen)))


def test_runs_inside_attention_train_identically_and_predict_the_peak():
    model, x = gpt_eager(**GPT)
    prof = planner.profile(model, x, repeats=1)
    attn = next(c for c in prof.calls if c.module == "blocks.0.attn")
    assert len(attn.stages) > 5
    _, g0 = loss_and_grads(model, x)
    sched = _staged_schedule(prof, "blocks.0.attn")
    apply_schedule(model, sched)
    try:
        assert isinstance(wrapper_of(model.blocks[0].attn), StagedForward)
        _, g1 = loss_and_grads(model, x)
        measured = planner.measure(model, x, repeats=1).peak_bytes
    finally:
        planner.remove(model)
    assert "forward" not in model.blocks[0].attn.__dict__
    assert_grads_close(g0, g1)
    predicted = simulate(prof, sched).peak_bytes
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def test_a_saved_staged_schedule_applies_to_a_fresh_model_and_a_deep_copy(tmp_path):
    model, x = gpt_eager(**GPT)
    prof = planner.profile(model, x, repeats=1)
    sched = _staged_schedule(prof, "blocks.1.attn")
    path = sched.save(tmp_path / "s.json")
    fresh, _ = gpt_eager(**GPT)
    _, g0 = loss_and_grads(fresh, x)
    planner.apply(fresh, path)
    assert applied(fresh).schedule.regions == sched.regions
    _, g1 = loss_and_grads(fresh, x)
    twin = copy.deepcopy(fresh)
    _, g2 = loss_and_grads(twin, x)
    assert wrapper_of(twin.blocks[1].attn).module is twin.blocks[1].attn
    assert_grads_close(g0, g1)
    assert_grads_close(g0, g2)


def test_calls_the_trace_was_not_made_for_run_the_modules_own_forward():
    model, x = gpt_eager(**GPT)
    prof = planner.profile(model, x, repeats=1)
    apply_schedule(model, _staged_schedule(prof, "blocks.0.attn"))
    attn = model.blocks[0].attn
    h = torch.randn(2, 16, 32)  # a shorter sequence: the trace does not depend on shapes
    with torch.random.fork_rng():
        torch.manual_seed(1)
        y_planned = attn(h)
    model.eval()  # another training flag than traced: the module's own forward
    assert not wrapper_of(attn).graph.matches(attn, (h,), {})
    y_eval = attn(h)
    model.train()
    planner.remove(model)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        y_own = attn(h)
    torch.testing.assert_close(y_planned, y_own)
    model.eval()
    torch.testing.assert_close(y_eval, attn(h))


def test_a_schedule_for_other_code_is_refused():
    model, x = gpt_eager(**GPT)
    prof = planner.profile(model, x, repeats=1)
    sched = _staged_schedule(prof, "blocks.0.attn")
    other, _ = gpt_eager(**GPT)

    class Changed(type(other.blocks[0].attn)):
        def forward(self, x):
            return super().forward(x) * 2

    other.blocks[0].attn.__class__ = Changed
    with pytest.raises(ScheduleError, match="no longer traces as it did"):
        apply_schedule(other, sched)
    assert applied(other) is None


class _NoGradInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            t = torch.sigmoid(self.b(h)) * 2
        return torch.tanh(h * t)


class _ValueBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if h.sum() > 0:  # tracing cannot take this branch
            h = h * 2
        return torch.tanh(h)


class _Kwargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x, **kwargs):
        return torch.tanh(self.a(x) * kwargs.get("scale", 1.0))


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.no_grad = _NoGradInside()
        self.branch = _ValueBranch()
        self.kw = _Kwargs()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.kw(self.branch(self.no_grad(F.gelu(x))), scale=0.5)
        return self.head(torch.tanh(h) * h)


def test_code_tracing_cannot_see_gives_no_stages():
    torch.manual_seed(0)
    model, x = _Outer(), torch.randn(8, 16)
    before = {n: set(m.__dict__) for n, m in model.named_modules()}
    prof = planner.profile(model, x, repeats=1)
    staged = {c.module for c in prof.calls if c.stages}
    assert "" in staged  # the root traces, its children are calls
    assert not staged & {"no_grad", "branch"}
    # what **kwargs takes is fixed by the call's pattern, as named arguments are
    assert "kw" in staged
    kw = model.kw
    sg = trace(kw, call_pattern(kw, (x,), {"scale": 0.5}))
    assert sg is not None and sg.matches(kw, (x,), {"scale": 0.5})
    assert not sg.matches(kw, (x,), {"scale": 2.0}) and not sg.matches(kw, (x,), {})
    # a keyword no wrapper parameter can be named after: not staged
    assert trace(kw, call_pattern(kw, (x,), {"not-a-name": 1.0})) is None
    with torch.no_grad():
        torch.testing.assert_close(sg.run(kw, (x,), {"scale": 0.5}), kw(x, scale=0.5))
    assert {n: set(m.__dict__) for n, m in model.named_modules()} == before
    # the root's runs still apply, with the no_grad child as one call inside them
    _, g0 = loss_and_grads(model, x)
    spans = [s for s in candidate_calls(prof) if s.call.module == "" and s.segment is not None]
    s = max(spans, key=lambda s: s.b - s.a)
    apply_schedule(model, Schedule(regions=bind(prof, (region(prof, s.a, s.b),))))
    _, g1 = loss_and_grads(model, x)
    planner.remove(model)
    assert_grads_close(g0, g1)


class _Stateful(nn.Module):
    """A forward that changes the module: fills a cache on first use, logs its calls, counts them."""

    def __init__(self, write: str):
        super().__init__()
        self.a, self.write = nn.Linear(4, 4), write
        self.memo: dict = {}
        self.log: list = []
        self.calls = 0

    def forward(self, x):
        n = x.shape[0]
        if self.write == "dict" and n not in self.memo:
            self.memo[n] = torch.arange(n)
        if self.write == "list":
            self.log.append(n)
        if self.write == "counter":
            self.calls += 1
        return self.a(x) * 2


@pytest.mark.parametrize("write", ["dict", "list", "counter"])
def test_a_forward_that_changes_its_module_is_not_traced_and_left_as_it_was(write):
    """The traced code would not make the change when it runs in place of the forward (and
    tracing it would leave proxies in the cache): no stages, and the module as it was."""
    m, x = _Stateful(write), torch.randn(3, 4)
    m(x)
    before = (dict(m.memo), list(m.log), m.calls)
    assert trace(m, call_pattern(m, (x,), {})) is None
    assert (m.memo, m.log, m.calls) == before
    assert all(type(k) is int for k in m.memo)
    assert trace(_Stateful("none"), call_pattern(m, (x,), {})) is not None


class _Scan(nn.Module):
    """Adds the state it kept from its last call, if any, and keeps its last row."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.state = None

    def forward(self, x):
        if self.state is not None:
            x = x + self.state
        h = torch.tanh(self.a(x))
        self.state = h[:, -1:]
        return h


class _Recurrent(nn.Module):
    """Empties its scan's state before each call, as RecurrentGemma's temporal block empties
    its RG-LRU's (``self.rg_lru.recurrent_states = None``)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.norm, self.scan = nn.LayerNorm(dim), _Scan(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        self.scan.state = None
        h = self.scan(self.norm(x))
        return x + self.down(F.gelu(self.up(h)))


def test_a_forward_that_sets_a_childs_attribute_is_not_traced():
    """Symbolic tracing runs ``self.scan.state = None`` once, at trace time, and the generated
    code never does: run in place of the forward, the scan read the state its last call left
    (RecurrentGemma: another branch, and a backward through the last step's freed graph; here
    other gradients with no error). Such a forward gets no stages, the child is left as it was,
    and a plan trains like the model step after step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Recurrent() for _ in range(4)], nn.Linear(16, 4))
    x = torch.randn(8, 12, 16)
    twin = copy.deepcopy(model)
    block = model[0]
    block(x)
    kept = block.scan.state
    assert kept is not None
    assert trace(block, call_pattern(block, (x,), {})) is None
    assert block.scan.state is kept
    p = planner.plan(model, None, example_inputs=x, repeats=1)
    assert p.schedule.regions
    assert not any(c.stages for c in p.profile.calls if c.module in {"0", "1", "2", "3"})
    for _ in range(3):
        assert_grads_close(loss_and_grads(twin, x)[1], loss_and_grads(model, x)[1],
                           rtol=0, atol=0)


def test_trace_fixes_non_tensor_arguments_and_checks_them():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x, mask=None, scale: float = 1.0):
            if mask is not None:
                x = x.masked_fill(mask, 0.0)
            return self.a(x) * scale

    m, x = M(), torch.randn(2, 4)
    pat = call_pattern(m, (x,), {"scale": 2.0})
    sg = trace(m, pat)
    assert sg is not None
    assert sg.matches(m, (x,), {"scale": 2.0})
    assert not sg.matches(m, (x,), {"scale": 3.0})
    assert not sg.matches(m, (x, torch.ones(2, 4, dtype=torch.bool)), {"scale": 2.0})
    torch.testing.assert_close(sg.run(m, (x,), {"scale": 2.0}), m(x, scale=2.0))
    assert call_pattern(m, (x, [1, 2]), {}) is None  # a list argument: not staged


def test_compiled_planning_falls_back_to_module_calls_when_staged_runs_do_not_fit(monkeypatch):
    """plan(compile=...) measures compiled peaks; where no plan with runs of traced forwards
    fits compiled (a compiled run can keep more than its eager replay), it searches again with
    module-call regions only. Compiled peaks are stubbed here: with runs too high, without them
    the plan's eager prediction."""
    import planner.api as api

    model, x = gpt_eager(**GPT)
    prof = planner.profile(model, x, repeats=1)
    n = simulate(prof).peak_bytes
    budget = int(prof.fixed_bytes + 0.8 * (n - prof.fixed_bytes))
    seen = []

    def fake_compiled_peak(m, *args, **kwargs):
        plan = applied(m._orig_mod)  # the compiled copy's model
        regions = plan.schedule.regions if plan is not None else ()
        staged = any(r.staged for r in regions)
        seen.append(staged)
        peak = n if not regions or staged else plan.schedule.predicted_peak_bytes
        return Measurement(peak_bytes=peak, retained_bytes=0, step_ms=1.0,
                           fixed_bytes=prof.fixed_bytes)

    monkeypatch.setattr(api, "compiled_peak", fake_compiled_peak)
    p = planner.plan(model, budget_bytes=budget, example_inputs=x, compile="aot_eager",
                     repeats=1)
    try:
        assert p.schedule.regions and not any(r.staged for r in p.schedule.regions)
        assert True in seen and seen[-1] is False  # runs were tried first, then module calls
        assert p.compiled_peak_bytes <= budget
    finally:
        planner.remove(model)


def test_estimate_mode_stages_the_same_modules_as_measure_mode():
    """Estimate mode swaps parameters for fake plain tensors; they are read through the trace
    like parameters, so an offline (estimate) profile cuts inside the same forwards."""
    from tests.models import hf_llama

    m, x = hf_llama(batch=2, seq=32, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128,
                    vocab=128)
    measured = planner.profile(m, x, repeats=1)
    estimated = planner.profile(m, x, mode="estimate", device="H100")
    staged = {c.module: c.stage_nodes for c in measured.calls if c.stages}
    assert "model.layers.0.post_attention_layernorm" in staged
    assert {c.module: c.stage_nodes for c in estimated.calls if c.stages} == staged


def test_runs_of_a_traced_forward_compile_fullgraph_and_train_like_eager():
    """The staged forward is generated Python, so dynamo traces it whole: runs inside an
    attention, compiled with fullgraph=True, give the eager planned model's gradients and no
    graph break."""
    from torch._dynamo.utils import counters

    model, x = gpt_eager(**GPT)
    prof = planner.profile(model, x, repeats=1)
    apply_schedule(model, _staged_schedule(prof, "blocks.0.attn"))
    try:
        _, g_eager = loss_and_grads(model, x)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        _, g_compiled = loss_and_grads(compiled, x)
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        planner.remove(model)
        torch._dynamo.reset()
    assert_grads_close(g_eager, {k.removeprefix("_orig_mod."): v for k, v in g_compiled.items()})


def test_trace_forwards_false_keeps_regions_to_module_calls():
    model, x = gpt_eager(**GPT)
    before = {n: set(m.__dict__) for n, m in model.named_modules()}
    prof = planner.profile(model, x, repeats=1, trace_forwards=False)
    assert not any(c.stages for c in prof.calls)
    least = planner.plan(model, example_inputs=x, repeats=1, trace_forwards=False)
    try:
        assert least.schedule.regions
        assert not any(r.staged for r in least.schedule.regions)
    finally:
        planner.remove(model)
    assert {n: set(m.__dict__) for n, m in model.named_modules()} == before


@pytest.mark.parametrize("edit, message", [
    (lambda r: dataclasses.replace(r, segment=(0, 10_000)), "out of range .* traced nodes"),
    (lambda r: dataclasses.replace(r, staged="{not json"), "malformed 'staged' field"),
])
def test_an_edited_staged_schedule_is_refused_and_the_model_left_as_it_was(edit, message):
    model, x = gpt_eager(**GPT)
    prof = planner.profile(model, x, repeats=1)
    sched = _staged_schedule(prof, "blocks.0.attn")
    bad = dataclasses.replace(sched, regions=(edit(sched.regions[0]), *sched.regions[1:]))
    with pytest.raises(ScheduleError, match=message):
        apply_schedule(model, bad)
    assert applied(model) is None
    assert "forward" not in model.blocks[0].attn.__dict__


class _ScoresKeptByTheLoop(nn.Module):
    """Attention written in the loop of the root's forward, einsum in even layers and SDPA in
    odd ones: the even layers' score tensor ``s`` stays referenced by the loop's local until the
    next even layer assigns it again."""

    def __init__(self, d: int = 32, layers: int = 3):
        super().__init__()
        self.d = d
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        b, n, _ = x.shape
        for i, (qkv, o) in enumerate(zip(self.qkv, self.o, strict=True)):
            q, k, v = qkv(x).view(b, n, 3, 4, self.d // 4).unbind(2)
            if i % 2:
                a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                   v.transpose(1, 2), is_causal=True)
                a = a.transpose(1, 2)
            else:
                s = torch.einsum("blhd,bmhd->bhlm", q, k) / (self.d // 4) ** 0.5
                a = torch.einsum("bhlm,bmhd->blhd", s.softmax(-1), v)
            x = x + o(a.reshape(b, n, self.d))
        return x


def test_traced_code_frees_a_value_the_models_loop_keeps():
    """Under a plan with runs of the root's traced forward, the root runs the generated code,
    which drops each value after the last stage that reads it; the model's loop keeps the first
    layer's scores until the third layer assigns them again. Every run of the root's stages is
    predicted as measured (the simulator used to keep the scores as long as the loop did)."""
    torch.manual_seed(0)
    model, x = _ScoresKeptByTheLoop(), torch.randn(4, 64, 32)
    prof = planner.profile(model, x, repeats=1)
    spans = [s for s in candidate_calls(prof) if s.call.module == "" and s.staged]
    assert len(spans) >= 10
    for s in spans:
        sched = Schedule(regions=bind(prof, (region(prof, s.a, s.b),)))
        assert sched.regions[0].staged
        apply_schedule(model, sched)
        try:
            measured = planner.measure(model, x, repeats=1).peak_bytes
        finally:
            planner.remove(model)
        predicted = simulate(prof, sched).peak_bytes
        assert abs(predicted - measured) <= 64, (s.segment, predicted, measured)


class _NormCastingBack(nn.Module):
    """A norm that computes in float32 and casts back to its input's dtype, read as the first
    line (CohereLayerNorm, LlamaRMSNorm): symbolic tracing records ``x.dtype`` where it is used,
    by the final ``.to``, so the trace reads the input there."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, h):
        dt = h.dtype
        h = h.to(torch.float32)
        mean = h.mean(-1, keepdim=True)
        var = (h - mean).pow(2).mean(-1, keepdim=True)
        h = (h - mean) * torch.rsqrt(var + 1e-5)
        h = self.weight.to(torch.float32) * h
        return h.to(dt)


class _CastingBackModel(nn.Module):
    def __init__(self, d: int = 64, vocab: int = 512):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.norm = _NormCastingBack(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x, y):
        h = self.norm(self.fc(self.emb(x)))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_metadata_read_does_not_pass_its_tensor_into_a_run(dtype):
    """A run that holds ``h.dtype``'s node is passed the dtype, not ``h`` (a checkpoint holds
    its tensor arguments until its backward; the fc output would have been held with it), and
    every run of the norm's stages is predicted as measured. In bfloat16 both casts allocate, so
    a run may also end at the dtype's node, before the cast that reads it: the code around the
    run makes it, and the run's code must not make it again (it has no ``h`` to read it from:
    Qwen3's RMSNorm under autocast raised KeyError when applied)."""
    torch.manual_seed(0)
    model = _CastingBackModel().to(dtype)
    x, y = torch.randint(0, 512, (4, 64)), torch.randint(0, 512, (4, 64))
    sg = trace(model.norm, call_pattern(model.norm, (torch.randn(4, 64, 64),), {}))
    meta = next(k for k, n in enumerate(sg.exec) if n.target is getattr)
    assert meta > 5  # recorded where it is used, far from `h`'s last use by an op
    ins, _ = sg.io(meta - 1, len(sg.exec) - 1)
    assert [n.op for n in ins if n.op == "placeholder"] == []
    assert sg.exec[meta] in ins
    prof = planner.profile(model, (x, y), repeats=1)
    _, g0 = loss_and_grads(model, (x, y))
    spans = [s for s in candidate_calls(prof) if s.call.module == "norm" and s.staged]
    assert len(spans) >= 5
    if dtype == torch.bfloat16:
        assert any(sg.exec[s.segment[1]] is sg.exec[meta] for s in spans)
    _each_run_as_predicted(model, (x, y), prof, spans, g0)


def _each_run_as_predicted(model, inputs, prof, spans, reference) -> None:
    """Each span of `spans` alone as the schedule: gradients equal to `reference`, the step's
    measured peak within 64 B of the prediction."""
    for s in spans:
        sched = Schedule(regions=bind(prof, (region(prof, s.a, s.b),)))
        apply_schedule(model, sched)
        try:
            measured = planner.measure(model, inputs, repeats=1).peak_bytes
            _, g1 = loss_and_grads(model, inputs)
        finally:
            planner.remove(model)
        assert_grads_close(reference, g1)
        predicted = simulate(prof, sched).peak_bytes
        assert abs(predicted - measured) <= 64, (s.segment, predicted, measured)


class _TypeAsNorm(nn.Module):
    """Gemma's RMSNorm: computes in float32 and ends with ``.type_as(x)``, which reads only
    ``x``'s dtype but takes ``x`` itself."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * (1.0 + self.weight.float())).type_as(x)


def test_a_run_ending_in_type_as_is_passed_the_dtype_not_the_tensor():
    """A run of the norm's last stages reads ``x`` only through ``.type_as(x)``. The trace
    reads ``x.device`` and ``x.dtype`` there instead (`stages._read_metadata_only`), which
    the code around the run reads: the run's checkpoint is not passed ``x`` and does not keep
    it until its backward. Every run is predicted as measured (those ending at ``type_as``
    were under on Gemma-2 in bfloat16 before the profile kept which call arguments each stage
    reads, and that rule is still what a run of another kind of reader relies on)."""
    torch.manual_seed(0)
    model = _CastingBackModel().to(torch.bfloat16)
    model.norm = _TypeAsNorm(64).to(torch.bfloat16)
    x, y = torch.randint(0, 512, (4, 64)), torch.randint(0, 512, (4, 64))
    sg = trace(model.norm, call_pattern(model.norm, (torch.randn(4, 64, 64),), {}))
    assert "type_as" not in {n.target for n in sg.exec}
    assert all(p not in sg.io(k, len(sg.exec) - 1)[0] for p in sg.placeholders
               for k in range(2, len(sg.exec)))  # after x.float(), no run is passed x
    prof = planner.profile(model, (x, y), repeats=1)
    _, g0 = loss_and_grads(model, (x, y))
    spans = [s for s in candidate_calls(prof) if s.call.module == "norm" and s.staged]
    assert len(spans) >= 5
    _each_run_as_predicted(model, (x, y), prof, spans, g0)


class _ModulatedNorm(nn.Module):
    """Wan's VACE block: the residual stream normalised in float32, modulated, and cast back
    with ``.type_as(h)``, where ``h`` is made inside the forward; the output reshaped with
    ``.view_as(h)``. A run from the norm to the cast reads ``h`` only for its dtype."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.mod = nn.Parameter(torch.zeros(2, d))
        self.out = nn.Linear(d, d)

    def forward(self, x):
        h = self.fc(x)[..., ::2]
        scale, shift = self.mod.float().unbind(0)
        n = (F.layer_norm(h.float(), h.shape[-1:]) * (1.0 + scale) + shift).type_as(h)
        return self.out(n).reshape(-1).view_as(h)


def test_a_run_is_not_passed_a_tensor_made_in_the_forward_whose_dtype_it_reads():
    """Before `stages._read_metadata_only`, a run ending at ``.type_as(h)`` was passed ``h`` and
    its checkpoint kept ``h`` (the layer's input to the cast, made in its forward, read by no
    op of the run) until its backward, unseen by the profile: Wan VACE's smallest-peak plan
    under bfloat16 measured above its prediction."""
    torch.manual_seed(0)
    model = _CastingBackModel().to(torch.bfloat16)
    model.norm = _ModulatedNorm(64).to(torch.bfloat16)
    x, y = torch.randint(0, 512, (4, 64)), torch.randint(0, 512, (4, 64))
    sg = trace(model.norm, call_pattern(model.norm, (torch.randn(4, 64, 64),), {}))
    assert not {"type_as", "view_as"} & {n.target for n in sg.exec}
    prof = planner.profile(model, (x, y), repeats=1)
    _, g0 = loss_and_grads(model, (x, y))
    spans = [s for s in candidate_calls(prof) if s.call.module == "norm" and s.staged]
    assert len(spans) >= 5
    _each_run_as_predicted(model, (x, y), prof, spans, g0)


def test_a_forward_from_code_run_by_exec_is_stageable():
    """Code run by ``exec`` with globals that have no ``__name__`` (a generated or notebook-
    built module class) leaves its functions' ``__module__`` None: it is the user's code."""
    namespace = {"nn": nn, "F": F}
    exec("class Block(nn.Module):\n"  # noqa: S102 - the point of the test
         "    def __init__(self):\n"
         "        super().__init__()\n"
         "        self.lin = nn.Linear(4, 4)\n"
         "    def forward(self, x):\n"
         "        return F.relu(self.lin(x))\n", namespace)
    block = namespace["Block"]()
    assert type(block).forward.__module__ is None
    assert stageable(block)


def _first_call(model: nn.Module, module: nn.Module, inputs) -> tuple[tuple, dict]:
    """The arguments `module` is called with when `model` runs on `inputs`."""
    seen: list[tuple[tuple, dict]] = []
    h = module.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)) and None,
                                         with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        h.remove()
    return seen[0]


@pytest.mark.parametrize("case, layer", [
    # decorated forward (deprecate_kwarg, GradientCheckpointingLayer), **kwargs, and the
    # rotary (cos, sin) tuple as position_embeddings
    ("llama", "model.layers.0"),
    # position_ids passed through **kwargs to the attention
    ("gpt2_sdpa", "transformer.h.0"),
])
def test_hugging_face_decoder_layers_are_staged_and_their_runs_train_identically(case, layer):
    """transformers 5's decoder layers have a decorated forward with ``**kwargs`` and take
    tuples: they are traced through a wrapper with one parameter per tensor the call passes,
    and a run of their stages (the attention half of a layer, say) trains as the model does,
    predicted as measured."""
    from tests.zoo import CASES

    c = CASES[case]()
    model, x = c.model, c.inputs
    block = model.get_submodule(layer)
    args, kwargs = _first_call(model, block, x)
    assert stageable(block)
    pattern = call_pattern(block, args, kwargs)
    assert pattern is not None
    sg = trace(block, pattern)
    assert sg is not None and sg.matches(block, args, kwargs)
    assert not sg.matches(block, args, {**kwargs, "output_attentions": True})
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(3)
        traced = sg.run(block, args, kwargs)
        torch.manual_seed(3)
        own = type(block).forward(block, *args, **kwargs)
    torch.testing.assert_close(traced, own, rtol=0, atol=0)

    prof = planner.profile(model, x, repeats=1)
    runs = [s for s in candidate_calls(prof) if s.call.module == layer and s.staged]
    assert len(runs) >= 3
    _, g0 = loss_and_grads(model, x)
    for s in (runs[0], max(runs, key=lambda s: s.b - s.a)):
        sched = Schedule(regions=bind(prof, (region(prof, s.a, s.b),)))
        apply_schedule(model, sched)
        try:
            assert isinstance(wrapper_of(block), StagedForward)
            measured = planner.measure(model, x, repeats=1).peak_bytes
            _, g1 = loss_and_grads(model, x)
        finally:
            planner.remove(model)
        assert_grads_close(g0, g1)
        assert abs(simulate(prof, sched).peak_bytes - measured) <= 64, s.segment


def test_a_schedule_that_fails_on_a_later_module_leaves_every_module_as_it_was():
    """A region that cannot be applied (here: a trace that no longer matches) raises before any
    module's forward is replaced, so the model stays usable and a corrected plan applies."""
    model, x = gpt_eager(**GPT)
    prof = planner.profile(model, x, repeats=1)
    first = next(s for s in candidate_calls(prof) if s.call.module == "blocks.0")
    sched = _staged_schedule(prof, "blocks.1.attn")
    bad = [dataclasses.replace(r, staged=r.staged.replace('"fingerprint": "', '"fingerprint": "x'))
           for r in sched.regions]
    regions = bind(prof, (region(prof, first.a, first.b),)) + tuple(bad)
    with pytest.raises(ScheduleError, match="no longer traces"):
        apply_schedule(model, Schedule(regions=regions))
    assert applied(model) is None
    assert not any("forward" in m.__dict__ for m in model.modules())
    apply_schedule(model, sched)
    planner.remove(model)


def test_a_module_called_with_an_object_of_tensors_records_and_plans():
    """The recorder notes which storage each tensor argument of a call is (for the runs of a
    staged call) without rebuilding the arguments: an LSTM called on a PackedSequence (a
    named tuple that checks what it is made of) raised inside the step when its arguments
    were mapped leaf by leaf."""
    from benchmarks.training_code_probe import PackedTagger

    torch.manual_seed(0)
    model = PackedTagger()
    ids, lengths = torch.randint(1, 500, (8, 24)), torch.tensor([24, 20, 18, 15, 12, 9, 6, 3])
    p = planner.plan(model, None, example_inputs=(ids, lengths),
                     loss_fn=lambda out: out.square().mean())
    v = p.verify(repeats=1)
    planner.remove(model)
    assert v.max_grad_rel_err <= 1e-5
    assert abs(v.predicted_peak_bytes - v.measured_peak_bytes) <= 1024


def test_under_autocast_runs_of_a_traced_root_keep_the_casts_and_outputs_code_does_not_drop():
    """BLOOM under bf16: its root, layers and attention trace. A run of the root's stages (the
    LM head and the loss's preparation) makes the generated code drop values after their last
    stage, but not autocast's cached weight casts (the layers' and the LM head's: the cache
    holds them to the end of forward) nor the logits the model returns. With a layer
    checkpointed (its attention a run inside it), forward holds the peak: it is predicted
    exactly (it was under-predicted), and the smallest-peak plan holds its budget."""
    from solvers.chain import bind, candidate_calls
    from solvers.nested import _regions
    from tests.zoo import CASES

    case = CASES["bloom_padded"]()
    p = planner.plan(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn,
                     autocast=torch.bfloat16)
    staged = {c.module for c in p.profile.calls if c.stages}
    assert {"", "transformer.h.1", "transformer.h.1.self_attention"} <= staged
    pos = graph_index(p.profile).position
    calls = {c.module: c for c in p.profile.calls}
    spans = candidate_calls(p.profile)
    # The root's run from the LM head up to the loss; the longest run of layer 1's attention.
    head = max((s for s in spans if s.call.module == "" and s.a == pos(calls["lm_head"].start)
                and s.b < pos(calls[""].stages[-1])), key=lambda s: s.b)
    attention = max((s for s in spans if s.call.module == "transformer.h.1.self_attention"
                     and s.segment is not None), key=lambda s: s.b - s.a)
    layer = next(s for s in spans if s.call.module == "transformer.h.1" and s.segment is None)
    regions = bind(p.profile, _regions(p.profile, [layer, attention, head]))
    v = p.verify(repeats=1)
    planner.remove(case.model)
    assert v.measured_peak_bytes <= p.budget_bytes
    assert abs(v.predicted_peak_bytes - v.measured_peak_bytes) <= 1024
    planner.apply(case.model, dataclasses.replace(p.schedule, regions=regions))
    m = p.measure(repeats=1)
    planner.remove(case.model)
    assert abs(simulate(p.profile, regions).peak_bytes - m.peak_bytes) <= 1024


def test_a_replay_runs_the_generated_code_of_the_calls_inside_it():
    """GPT-2 under bf16, the whole transformer checkpointed and, inside it, a run of layer 1's
    attention half: layer 1 runs its generated code in forward and in the transformer's replay
    too, which drops the attention probabilities after the attention's stage (GPT2Block keeps
    them in `outputs` to its end). The replay's peak was over-predicted; now exact."""
    from solvers.nested import _regions
    from tests.zoo import CASES

    case = CASES["gpt2_eager"]()
    p = planner.plan(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn,
                     autocast=torch.bfloat16)
    planner.remove(case.model)
    pos = graph_index(p.profile).position
    calls = {c.module: c for c in p.profile.calls}
    assert calls["transformer.h.1"].stages
    spans = candidate_calls(p.profile)
    whole = next(s for s in spans if s.call.module == "transformer" and s.segment is None)
    half = max((s for s in spans if s.call.module == "transformer.h.1" and s.segment is not None
                and s.a == pos(calls["transformer.h.1.ln_1"].start)
                and s.b < pos(calls["transformer.h.1.ln_2"].start)), key=lambda s: s.b)
    regions = bind(p.profile, _regions(p.profile, [whole, half]))
    planner.apply(case.model, dataclasses.replace(p.schedule, regions=regions))
    m = p.measure(repeats=1)
    planner.remove(case.model)
    assert abs(simulate(p.profile, regions).peak_bytes - m.peak_bytes) <= 1024


class _GatedMLP(nn.Module):
    """Zamba2's MLP: the sum's halves indexed where they are used (``state[0]`` in the
    activation's call, ``state[1]`` in the product), so a run starting at the activation is
    passed `torch.chunk`'s tuple, not its tensors."""

    def __init__(self, d: int = 64, h: int = 128):
        super().__init__()
        self.gate_up, self.adapter = nn.Linear(d, 2 * h), nn.Linear(d, 2 * h, bias=False)
        self.act, self.down = nn.GELU(), nn.Linear(h, d)

    def forward(self, x):
        state = torch.chunk(self.gate_up(x) + self.adapter(x), 2, dim=-1)
        return self.down(self.act(state[0]) * state[1])


class _SharedBlockLayer(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(d), nn.Linear(d, d)
        self.pre_ff_norm, self.feed_forward = nn.LayerNorm(d), _GatedMLP(d)

    def forward(self, x):
        h = F.dropout(self.attn(self.norm(x)), 0.1, self.training)
        return self.feed_forward(self.pre_ff_norm(h))


def test_a_run_nested_in_a_checkpointed_run_is_passed_a_tuples_tensors():
    """A run of the layer's stages that calls the MLP, and inside it a run of the MLP from
    its activation on: the inner run's argument is the chunk's tuple. Given as an object,
    the inner checkpoint's frame kept it by reference (and the sum its halves view) until the
    run's backward, though nested its tensor arguments go to the outer frame, which drops
    them: the step measured the sum above the prediction. Now each tuple is passed element by
    element and rebuilt inside the run: predicted = measured, gradients unchanged."""

    torch.manual_seed(0)
    model = nn.Sequential(*[_SharedBlockLayer() for _ in range(3)]).train()
    x = torch.randn(2, 32, 64)
    loss0, want = loss_and_grads(model, x, seed=0)
    p = planner.plan(model, None, example_inputs=x)
    planner.remove(model)
    prof = p.profile
    pos = graph_index(prof).position
    calls = {c.module: c for c in prof.calls}
    assert calls["1"].stages and calls["1.feed_forward"].stages
    spans = candidate_calls(prof)
    outer = [s for s in spans if s.call.module == "1" and s.segment is not None
             and s.a <= pos(calls["1.feed_forward"].start) and s.b >= pos(calls["1"].end)]
    inner = [s for s in spans if s.call.module == "1.feed_forward" and s.segment is not None
             and s.a == pos(calls["1.feed_forward.act"].start)]
    assert outer and inner
    for o in outer[:2]:
        for i in inner:
            _exact_and_equal(model, x, p, [o, i], loss0, want)


def _exact_and_equal(model, x, p, spans, loss0, want) -> None:
    """`spans` applied as regions: the predicted peak is the measured one, and loss and
    gradients are the unplanned model's (`loss0`, `want`)."""
    from solvers.nested import _regions

    regions = bind(p.profile, _regions(p.profile, spans))
    planner.apply(model, dataclasses.replace(p.schedule, regions=regions))
    try:
        m = p.measure(repeats=1)
        loss, got = loss_and_grads(model, x, seed=0)
    finally:
        planner.remove(model)
    assert simulate(p.profile, regions).peak_bytes == m.peak_bytes, [s.segment for s in spans]
    assert torch.equal(loss, loss0)
    assert_grads_close(got, want)


class _Residual(nn.Module):
    """x-transformers' residual: takes every earlier layer's output and ignores them."""

    def forward(self, x, residual, layer_hiddens=None):
        return x + residual


class _HiddensEncoder(nn.Module):
    """x-transformers' layer loop: each layer's input goes into a list that every residual
    is handed, so a run of later layers is passed earlier layers' outputs its ops never
    read."""

    def __init__(self, d: int = 64, depth: int = 4):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(depth))
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.residuals = nn.ModuleList(_Residual() for _ in range(depth))

    def forward(self, x):
        hiddens = []
        for norm, block, residual in zip(self.norms, self.blocks, self.residuals, strict=True):
            hiddens.append(x)
            x = residual(torch.tanh(block(norm(x))), x, layer_hiddens=list(hiddens))
        return x


def test_a_run_keeps_earlier_stages_outputs_it_is_passed_but_never_reads():
    """Two runs of the encoder's stages, both checkpointed: the later run is passed the
    first layer's output (in the residuals' list), which its frame keeps until its backward
    though no op of it reads it, and with the first run checkpointed nothing else keeps it.
    The prediction took a run's inputs to be only what its ops read and the call's own
    arguments, and the step measured that output above it. Now the stage run notes which
    earlier stage made each value a run takes: predicted = measured on every pair."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), _HiddensEncoder(), nn.Linear(64, 512)).train()
    _pairs_of_runs_exact(model, "1")


def _pairs_of_runs_exact(model: nn.Module, module: str) -> None:
    """Plan `model`; `module`'s later stages must be passed earlier stages' values; then each
    pair of runs (one from the first stage, one of every stage after it), both checkpointed,
    is predicted = measured with the unplanned gradients."""
    x = torch.randn(4, 48, 64)
    loss0, want = loss_and_grads(model, x, seed=0)
    p = planner.plan(model, None, example_inputs=x)
    planner.remove(model)
    prof = p.profile
    call = next(c for c in prof.calls if c.module == module)
    assert call.stages and any(call.stage_args[1:])
    spans = [s for s in candidate_calls(prof) if s.call.module == module and s.segment is not None]
    last = max(s.segment[1] for s in spans)
    pairs = [(s, t) for s in spans for t in spans if s.segment[0] == 0
             and t.segment == (s.segment[1] + 1, last)]
    assert len(pairs) >= 8
    for s, t in pairs:
        _exact_and_equal(model, x, p, [s, t], loss0, want)


@dataclasses.dataclass
class _AttnIntermediates:
    """What x-transformers' attention returns beside its output: its queries, keys and
    scores, for a caller that asks for them."""

    q: torch.Tensor
    k: torch.Tensor
    scores: torch.Tensor


@dataclasses.dataclass
class _LayerIntermediates:
    hiddens: list
    attn: list


class _Attn(nn.Module):
    def __init__(self, d: int, heads: int = 4) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.heads = heads

    def forward(self, x):
        b, n, d = x.size(0), x.size(1), x.size(2)
        qkv = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        scores = q @ k.transpose(-1, -2)
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
        return self.out(out), _AttnIntermediates(q, k, scores)


class _IntermediatesEncoder(nn.Module):
    """x-transformers' layer loop with ``return_hiddens``: each attention's intermediates
    object is collected, and the last traced node builds the object that holds them all, which
    the caller drops."""

    def __init__(self, d: int = 64, depth: int = 3):
        super().__init__()
        self.attns = nn.ModuleList(_Attn(d) for _ in range(depth))
        self.ffs = nn.ModuleList(nn.Sequential(nn.Linear(d, 8 * d), nn.GELU(), nn.Linear(8 * d, d))
                                 for _ in range(depth))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        hiddens, inters = [], []
        for attn, ff in zip(self.attns, self.ffs, strict=True):
            hiddens.append(x)
            out, inter = attn(x)
            inters.append(inter)
            x = x + out
            x = x + ff(x)
        return self.norm(x), _LayerIntermediates(hiddens=hiddens, attn=inters)


class _DropsIntermediates(nn.Module):
    """`pooled`: a head whose weight's gradient outweighs its output. `keep`: the forward holds
    the encoder's intermediates until it returns; otherwise they die as the encoder returns."""

    def __init__(self, pooled: bool = False, keep: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.enc = _IntermediatesEncoder()
        self.head = nn.Linear(64, 8192 if pooled else 512)
        self.pooled, self.keep = pooled, keep

    def forward(self, x):
        if self.keep:
            out, intermediates = self.enc(self.inp(x))
        else:
            out = self.enc(self.inp(x))[0]
        return self.head(out.mean(1) if self.pooled else out)


def _encoder_runs(model: nn.Module, x: torch.Tensor):
    """The unplanned loss and gradients, the smallest-peak plan (removed), and the candidate
    runs of the encoder's stages by (first, last) position."""
    loss0, want = loss_and_grads(model, x, seed=0)
    p = planner.plan(model, None, example_inputs=x)
    planner.remove(model)
    assert next(c for c in p.profile.calls if c.module == "enc").stages
    runs = {s.segment: s for s in candidate_calls(p.profile)
            if s.call.module == "enc" and s.segment is not None}
    return loss0, want, p, runs


def test_a_run_keeps_the_objects_it_is_passed_and_what_they_hold():
    """A run of the encoder's last stages builds the object holding every attention's
    intermediates (queries, keys, scores) from the objects the attentions returned: its
    checkpoint frame keeps those objects, and the tensors in them, until its backward, though
    the caller drops them as its forward returns. The stage run took a value's tensors to be
    only those it is or contains as a tuple or list, and the step measured the earlier
    attentions' intermediates above the prediction. Now what an object result reaches as the
    call returns counts."""
    torch.manual_seed(0)
    model = _DropsIntermediates(keep=True).train()
    x = torch.randn(4, 48, 64)
    loss0, want, p, runs = _encoder_runs(model, x)
    last = max(b for _, b in runs)
    tails = [s for (a, b), s in runs.items() if b == last and a > 0]
    assert len(tails) >= 4
    for s in tails:
        _exact_and_equal(model, x, p, [s], loss0, want)


def test_generated_code_holds_the_objects_later_stages_are_passed():
    """The encoder's call drops the intermediates object as it returns, and a stage reads the
    tensors in it no later than the attention that made them. The generated code still holds
    the object, and so those tensors, until the last stage passed it is done, in forward and in
    a run's replay (until the replay returns). The prediction dropped them after the attention's
    stage, and the step measured them above it. Each run, with the run of every stage after
    it."""
    torch.manual_seed(0)
    model = _DropsIntermediates(pooled=True).train()
    x = torch.randn(4, 128, 64)
    loss0, want, p, runs = _encoder_runs(model, x)
    last = max(b for _, b in runs)
    pairs = [(s, runs[(b + 1, last)]) for (_, b), s in runs.items() if (b + 1, last) in runs]
    assert len(pairs) >= 8
    for pair in pairs:
        _exact_and_equal(model, x, p, list(pair), loss0, want)


class _NormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d in short: batch norm written out in the module's own forward (its
    running statistics and counter updated by its own code, not by a submodule's), with ops
    before and after it that a run of stages could hold."""

    def forward(self, x):
        x = x * 2.0
        x = x.sin()
        self.num_batches_tracked.add_(1)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True,
                         0.1, self.eps)
        x = F.gelu(x)
        return x.cos() + 1.0


def test_no_run_holds_a_forwards_own_update_of_its_buffers():
    """A run holding the module's own in-place update of a buffer would update it again as it
    replays (runs get no buffer copies) and, passed the buffer as an argument, its checkpoint
    raised in backward that it had been modified in place. Every run of stages left must train
    as the unplanned model does, statistics updated once per step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), _NormAct(8), nn.Conv2d(8, 4, 3)).train()
    x = torch.randn(2, 3, 12, 12)
    prof = planner.profile(model, x, repeats=1)
    call = next(c for c in prof.calls if c.module == "1")
    assert call.staged and len(call.stages) >= 4
    runs = [s for s in candidate_calls(prof) if s.call.module == "1" and s.staged
            and s.segment is not None]
    assert runs  # runs before and after the update remain
    twin = copy.deepcopy(model)
    _, g0 = loss_and_grads(twin, x)
    for s in runs:
        planned = copy.deepcopy(model)
        apply_schedule(planned, Schedule(regions=bind(prof, (region(prof, s.a, s.b),))))
        _, g1 = loss_and_grads(planned, x)
        assert_grads_close(g0, g1)
        for k, b in twin.named_buffers():
            assert torch.equal(dict(planned.named_buffers())[k], b), (s.segment, k)


class _Intermediates:
    """What x-transformers' layers return beside their output: an object the caller adds to."""

    def __init__(self, hidden):
        self.hidden = hidden
        self.extra = None


class _Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        h = self.fc(x)
        return h, _Intermediates(h)


class _SetsOnReturned(nn.Module):
    """Sets an attribute on the object a child returned, as x-transformers' TransformerWrapper
    sets ``intermediates.initial_embeds``: symbolic tracing records no such write."""

    def __init__(self):
        super().__init__()
        self.a, self.body, self.b, self.c = (nn.Linear(32, 32), _Body(), nn.Linear(32, 32),
                                             nn.Linear(32, 32))

    def forward(self, x):
        h, inter = self.body(self.a(x).relu())
        y = self.b(h).sin()
        inter.extra = self.c(y).tanh()
        return y, inter


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)) * 2.0 + 1.0)


def test_a_forward_that_sets_an_attribute_on_a_value_is_not_traced():
    """The generated code would return the object without the attribute: the loss below would
    lose its second term, or read a value an earlier call left. Such a forward gets no stages;
    the model's other forwards still do, and a plan trains like the model."""
    torch.manual_seed(0)
    model = nn.Sequential(_Mlp(), _SetsOnReturned()).train()
    x = torch.randn(16, 32)
    block = model[1]
    assert trace(block, call_pattern(block, (x,), {})) is None

    def loss_fn(out):
        y, inter = out
        return y.pow(2).mean() + inter.extra.pow(2).mean()

    twin = copy.deepcopy(model)
    p = planner.plan(model, None, example_inputs=x, loss_fn=loss_fn, repeats=1)
    calls = {c.module: c for c in p.profile.calls}
    assert not calls["1"].stages and calls["0"].stages
    v = p.verify(repeats=1)
    assert v.max_grad_rel_err == 0.0
    planner.remove(model)
    out0, out1 = twin(x), model(x)
    torch.testing.assert_close(out0[1].extra, out1[1].extra)


def test_a_run_of_the_roots_stages_keeps_earlier_stages_outputs_it_is_passed():
    """The same encoder as the model itself: its forward is the step's first call, so the
    stage run notes the values its stages make from its first op on. The recorder's map of
    which op made each storage was still empty as the root's traced forward started, and the
    stage run read a fresh dict in its place: no earlier stage's value was a run's argument,
    and the runs' frames were predicted to keep none of those they never read."""
    torch.manual_seed(0)
    _pairs_of_runs_exact(_HiddensEncoder().train(), "")


class _PairLoop(nn.Module):
    """A forward that loops in Python over small ops, one pair of input and output at a time,
    as pykan's symbolic layer does: hundreds of stages in one traced call."""

    def __init__(self, d_in: int = 12, d_out: int = 24) -> None:
        super().__init__()
        self.affine = nn.Parameter(torch.randn(d_out, d_in, 2))
        self.d_in, self.d_out = d_in, d_out

    def forward(self, x):
        cols = []
        for j in range(self.d_out):
            acc = 0
            for i in range(self.d_in):
                acc = acc + torch.tanh(x[:, i:i + 1] * self.affine[j, i, 0] + self.affine[j, i, 1])
            cols.append(acc)
        return torch.cat(cols, 1)


def test_a_forward_of_many_small_ops_offers_a_bounded_number_of_runs():
    """Every run of consecutive stages of a forward of a thousand stages would be a candidate,
    hundreds of thousands of them (pykan's symbolic layer, with more stages still, offered so
    many that the planner never finished listing them). Runs start at no more than
    `MAX_STAGE_STARTS` stages, spaced by the bytes they allocate; the runs kept replay as
    predicted and train as the model does, and a plan at the smallest peak fits."""
    from solvers.chain import MAX_STAGE_STARTS, _saved_made, useful

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 12), _PairLoop(), nn.Linear(24, 4)).train()
    x = torch.randn(64, 16)
    prof = planner.profile(model, x, repeats=1)
    (call,) = [c for c in prof.calls if c.module == "1"]
    assert len(call.stages) > 4 * MAX_STAGE_STARTS
    runs = [s for s in candidate_calls(prof) if s.call.module == "1" and s.segment is not None]
    starts = {s.segment[0] for s in runs}
    assert 0 < len(starts) <= MAX_STAGE_STARTS
    assert len(runs) <= MAX_STAGE_STARTS * (MAX_STAGE_STARTS + 1)
    assert call.stage_nodes[0] in starts
    # `useful` answers from a table of range maxima what its definition says
    saved_made = _saved_made(prof)
    for s in candidate_calls(prof):
        assert useful(prof, s) == any(s.a <= p for k in range(s.a, s.b + 1)
                                      for p in saved_made[k]), (s.a, s.b)
    _, g0 = loss_and_grads(model, x)
    by_length = sorted(runs, key=lambda s: s.b - s.a)
    _each_run_as_predicted(model, x, prof, [by_length[0], by_length[len(runs) // 2],
                                            by_length[-1]], g0)
    p = planner.plan(model, None, example_inputs=x, repeats=1)
    v = p.verify(repeats=1)
    assert v.max_grad_rel_err == 0.0
    assert v.measured_peak_bytes <= p.budget_bytes
    assert v.predicted_peak_bytes == v.measured_peak_bytes
