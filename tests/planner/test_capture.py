"""`planner.profile` (one real step, recorded) against the truth: measured memory, FlopCounterMode,
the model's own state, and the errors a user meets.

Every TINY model is profiled once in measure mode (``repeats=1``) and shared by the tests below.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from benchmarks.training_code_probe import SpectralDisc
from planner import InfeasibleBudgetError, ModelRunError, plan, profile, remove
from planner.capture.record import split_inputs
from planner.devices import cpu_spec
from planner.inplace import apply_schedule
from planner.measurement import measure
from solvers import Profile, Region, Schedule
from solvers.chain import (
    bind,
    candidate_calls,
    region,
    selective_region,
    shared_calls,
    shared_modules,
    useful_calls,
)
from solvers.errors import CkptPlannerError
from solvers.simulate import simulate
from solvers.solve import smallest_peak
from tests.models import TINY, hf_gpt2, hf_llama, mlp_dropout
from tests.zoo import CASES, loss_and_grads

NAMES = list(TINY)
MATMUL_OPS = (
    "aten.mm.",
    "aten.addmm.",
    "aten.bmm.",
    "aten.baddbmm.",
    "aten.convolution.",
    "aten._scaled_dot_product_flash_attention_for_cpu.",
)
SIZES = {
    "mlp_dropout": dict(batch=256, dim=64, depth=3),
    "gpt_eager": dict(batch=2, seq=32, dim=64, heads=4, layers=2, vocab=128),
    "hf_gpt2": dict(batch=2, seq=32, layers=2, n_embd=64, n_head=4, vocab=256),
    "hf_llama": dict(batch=2, seq=32, layers=2, hidden=64, heads=4, kv_heads=2,
                     intermediate=128, vocab=256),
    "resnet_bn": dict(batch=4, width=8, blocks=(1, 1), image=32),
    "unet": dict(batch=2, base=4, depth=2, image=32),
    "ln_linear_stack": dict(batch=8, seq=32, dim=64, n=4),
    "deep_narrow_cnn": dict(batch=2, channels=4, depth=8, image=32),
}


def build(name: str):
    model, x = TINY[name](**SIZES[name])
    model.train()
    return model, x


@functools.cache
def _profiled(name: str):
    model, x = build(name)
    return model, x, profile(model, x, repeats=1)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **{f"p:{k}": v.detach().clone() for k, v in model.named_parameters()},
        **{f"b:{k}": v.detach().clone() for k, v in model.named_buffers()},
    }


# -- memory ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_unplanned_peak_matches_measured(name):
    """The recorded lifetimes (what the model's code and autograd keep alive) reproduce the
    allocator's peak of the eager step."""
    model, x, prof = _profiled(name)
    measured = measure(model, x, repeats=1).peak_bytes
    assert abs(simulate(prof).peak_bytes - measured) <= 0.005 * measured


@pytest.mark.parametrize("name", NAMES)
def test_saved_bytes_match_measured_retained(name):
    model, x, prof = _profiled(name)
    retained = measure(model, x, repeats=1).retained_bytes
    assert prof.saved_bytes > 0
    assert abs(prof.saved_bytes - retained) / retained < 0.02, (prof.saved_bytes, retained)


def test_releases_record_what_python_keeps_alive():
    """A tensor the module's code keeps in a local past its last reader lives until the local
    goes: the recorded release is after the last reader, and the simulated peak sees it."""

    class Holds(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)

        def forward(self, x):
            big = torch.cat([x] * 8, dim=1)  # 8x wider, read once, kept in a local
            y = self.a(big[:, :64].relu())
            z = self.b(y).relu()
            return z + y, big.shape  # `big` dies when forward returns

    model, x = Holds(), torch.randn(256, 64)
    prof = profile(model, x, loss_fn=lambda out: out[0].sum(), repeats=1)
    cat = next(n for n in prof.nodes if n.op == "aten.cat.default")
    (s,) = cat.new_storages
    released_at = next(i for i, n in enumerate(prof.nodes) if s in n.releases)
    last_reader = max(i for i, n in enumerate(prof.nodes) if cat.name in n.inputs)
    assert released_at > last_reader
    measured = measure(model, x, lambda out: out[0].sum(), repeats=1).peak_bytes
    assert simulate(prof).peak_bytes == pytest.approx(measured, rel=0.005)


_PICKS = {
    "gather": lambda h, i: torch.gather(h, 1, i[None].expand(h.shape[0], -1)),
    "index_select": lambda h, i: h.index_select(1, i),
    "indexing": lambda h, i: h[:, i],
}


@pytest.mark.parametrize("pick", sorted(_PICKS))
def test_backward_of_a_pick_costs_one_buffer_as_in_a_real_step(pick):
    """The backward of gather, index_select and ``h[:, idx]`` fills a zero buffer the size of
    ``h`` in place; under any dispatch mode (the recorder's) autograd runs the out-of-place
    variant, which allocates a second buffer. The profile counts the buffer once, as a real step
    does: here that buffer is the step's peak (DeBERTa's relative attention, MoE routing)."""

    class Pick(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(16, 2048)
            self.register_buffer("idx", torch.arange(0, 2048, 256))

        def forward(self, x):
            return _PICKS[pick](self.up(x), self.idx)

    torch.manual_seed(0)
    model, x = Pick(), torch.randn(64, 16)
    prof = profile(model, x, repeats=1)
    measured = measure(model, x, repeats=1).peak_bytes
    assert simulate(prof).peak_bytes == pytest.approx(measured, rel=0.005)


class _Scan(nn.Module):
    """A recurrence over time steps that reads its input at one position per step
    (``h[:, t]``), as the reference selective scan of HF's Mamba and hand-written RNN cells do:
    backward sums one ``select_backward`` buffer per step into one gradient."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 512)

    def forward(self, x):
        h = self.up(x).view(x.shape[0], 64, 8)
        state, outs = torch.zeros_like(h[:, 0]), []
        for t in range(h.shape[1]):
            state = state * 0.9 + h[:, t]
            outs.append(state)
        return torch.stack(outs, 1)


class _TwoReaders(nn.Module):
    """One 3-D activation read by two matmuls: each gradient reaches it as a view of a 2-D `mm`
    result that the view keeps alive, so the engine cannot sum into it in place."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.wa = nn.Parameter(torch.randn(64, 64) / 8)
        self.wb = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x):
        h = self.up(x)
        return (h @ self.wa.T).relu() + (h @ self.wb.T)


def _engine_sums(model: nn.Module, x) -> tuple[list[bool], list[bool]]:
    """The autograd engine's sums of two gradients for one input, in order, each True where it
    ran in place: as recorded (``add`` that allocates nothing once assembled), and in a real
    step under `torch.profiler` (``aten::add_`` rather than ``aten::add`` directly under an
    ``evaluate_function``)."""
    from planner.capture.record import default_loss, record_step
    from planner.profiling import step_spec

    rec = record_step(step_spec(model, x), stages=False)
    recorded = [not r.new_storages for r in rec.ops if r.accumulates]
    args, kwargs = split_inputs(x)
    loss = default_loss(model(*args, **kwargs))
    with torch.profiler.profile() as prof:
        loss.backward()
    model.zero_grad(set_to_none=True)
    real = [e.name == "aten::add_" for e in prof.events()
            if e.name in ("aten::add", "aten::add_") and e.cpu_parent is not None
            and e.cpu_parent.name.startswith("autograd::engine::evaluate_function")]
    return recorded, real


_SUMS = {
    "scan": lambda: (_Scan(), torch.randn(64, 16)),
    "two_readers": lambda: (_TwoReaders(), torch.randn(8, 32, 16)),
    "hf_llama": lambda: hf_llama(**SIZES["hf_llama"]),
}


@pytest.mark.parametrize("name", sorted(_SUMS))
def test_gradient_sums_run_in_place_where_a_real_step_runs_them_in_place(name):
    """Where two gradients meet, the engine sums the second into the first in place when it
    holds that buffer's last reference, but never under a dispatch mode (the recorder's), which
    makes every tensor "subclass-like". The recording keeps the out-of-place sum only where a
    real step runs it too."""
    torch.manual_seed(0)
    model, x = _SUMS[name]()
    model.train()
    recorded, real = _engine_sums(model, x)
    assert real and recorded == real
    if name != "two_readers":
        assert any(real)
    else:
        assert not any(real)


def test_gradient_summed_at_every_step_of_a_scan_costs_one_buffer():
    """`_Scan`'s backward keeps one gradient buffer for ``h`` however many steps add into it,
    as a real step does; recorded out of place, every step's sum held a second one."""
    torch.manual_seed(0)
    model, x = _Scan(), torch.randn(64, 16)
    prof = profile(model, x, repeats=1)
    measured = measure(model, x, repeats=1).peak_bytes
    assert simulate(prof).peak_bytes == pytest.approx(measured, rel=0.005)


class _WeightsInLoss(nn.Module):
    """Attention whose returned weights (after dropout) enter the loss: the dropout output's
    gradient is the sum of two, the engine's, after the attention output's BmmBackward."""

    def __init__(self, d: int = 32, n: int = 3):
        super().__init__()
        self.att = nn.ModuleList(nn.MultiheadAttention(d, 4, dropout=0.1, batch_first=True)
                                 for _ in range(n))

    def forward(self, x):
        ws = []
        for att in self.att:
            a, w = att(x, x, x, need_weights=True)
            x = x + a
            ws.append(w)
        return x, ws


def _weights_loss(out) -> torch.Tensor:
    x, ws = out
    return x.square().mean() + sum(w.square().mean() for w in ws)


@pytest.mark.parametrize("calls", [(2,), (0, 1, 2), ()])
def test_a_nodes_saved_tensors_die_before_the_engine_sums_its_gradients(calls):
    """BmmBackward of ``attn @ v`` releases its saved tensors (the replay's copy of ``attn``
    under a checkpoint) when its formula returns, before the engine adds its gradient to the
    one the weights' path left for ``attn``. The simulator held them through that sum, and
    over-predicted the peaks where it falls there."""
    torch.manual_seed(0)
    model, x = _WeightsInLoss(), torch.randn(8, 32, 32)
    prof = profile(model, x, loss_fn=_weights_loss, repeats=1)
    assert any(nd.accumulates for nd in prof.nodes)
    spans = [c for c in prof.calls if c.module.startswith("att.")]
    regions = bind(prof, tuple(Region(start=spans[k].start, end=spans[k].end) for k in calls))
    predicted = simulate(prof, regions).peak_bytes
    apply_schedule(model, Schedule(regions=regions))
    try:
        measured = measure(model, x, _weights_loss, repeats=1).peak_bytes
    finally:
        remove(model)
    # within the few bytes of wrapped Python scalars autograd saves, which no op records
    assert measured - 64 <= predicted <= measured, (predicted, measured)


class _Buckets(nn.Module):
    """Reorders its rows by bucket, the bucket from a fixed random projection (LSH-style: no
    gradient through the sort). In backward its only autograd node with anything saved is
    IndexBackward0, whose formula unpacks the indices (replaying the block, the projection a
    wide temporary) and only then allocates the zeros it scatters the gradient into."""

    def __init__(self, d: int = 64, buckets: int = 1024):
        super().__init__()
        self.register_buffer("proj", torch.randn(d, buckets))

    def forward(self, x):
        return x[(x @ self.proj).argmax(-1).argsort()]


class _BucketStack(nn.Module):
    """`_Buckets` blocks, each followed by a residual linear mix outside it."""

    def __init__(self, d: int = 64, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(_Buckets(d) for _ in range(n))
        self.mix = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for block, mix in zip(self.blocks, self.mix, strict=True):
            x = x + mix(block(x))
        return x


@pytest.mark.parametrize("calls", [(2,), (0, 1, 2)])
def test_a_replay_runs_before_the_formula_that_unpacks_allocates(calls):
    """The replay of a region whose last saving op is an index runs as IndexBackward0 starts,
    before its zeros are allocated; the simulator had replayed at the first op that reads the
    indices (after the zeros), over-predicting the peak there by the zeros' size."""
    torch.manual_seed(0)
    model, x = _BucketStack(), torch.randn(512, 64, requires_grad=True)
    prof = profile(model, x, repeats=1)
    spans = [c for c in prof.calls if c.module.startswith("blocks.")]
    regions = bind(prof, tuple(Region(start=spans[k].start, end=spans[k].end) for k in calls))
    sim = simulate(prof, regions)
    assert sim.peak_at.startswith("replay:")
    apply_schedule(model, Schedule(regions=regions))
    try:
        measured = measure(model, x, repeats=1).peak_bytes
    finally:
        remove(model)
    assert measured - 64 <= sim.peak_bytes <= measured, (sim.peak_bytes, measured)


def test_a_tensor_held_by_a_reference_cycle_lives_to_the_end_of_the_step():
    """A tensor that only a reference cycle keeps (an object pointing at itself) dies when the
    garbage collector runs, not at its last reader: the profile keeps it to the end of the step,
    as training would, and the simulated peak is the measured one."""

    class Cyclic(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)

        def forward(self, x):
            box: dict = {"wide": torch.cat([x] * 8, dim=1)}
            box["self"] = box  # a cycle: `wide` outlives the forward until a collection
            return self.b(self.a(box["wide"][:, :64]).relu())

    model, x = Cyclic(), torch.randn(256, 64)
    gc.collect()
    gc.disable()  # no automatic collection in the middle of the step
    try:
        prof = profile(model, x, repeats=1)
        measured = measure(model, x, repeats=1).peak_bytes
    finally:
        gc.enable()
    cat = next(n for n in prof.nodes if n.op == "aten.cat.default")
    (s,) = cat.new_storages
    released_at = next(i for i, n in enumerate(prof.nodes) if s in n.releases)
    assert released_at == len(prof.nodes) - 1
    assert simulate(prof).peak_bytes == pytest.approx(measured, rel=0.005)


class _TanhGelu(torch.autograd.Function):
    """tanh-GELU with a hand-written backward, as HF Bloom's `GeLUFunction`: its backward makes
    about a dozen elementwise temporaries in Python."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)
        return ff * g


class _GeluMLP(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(_TanhGelu.apply(self.up(x)))


def test_custom_function_backward_frees_temporaries_at_last_use():
    """A custom Function's backward is Python: its temporaries die at their last use, not when
    the formula returns as a C++ formula's do. Before the profile told them apart, this model's
    peak was predicted far above the measured one, and budgets it meets were called
    infeasible."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_GeluMLP(), _GeluMLP()).train(), torch.randn(8, 64, 64)

    def loss_fn(out):
        return out.pow(2).mean()

    prof = profile(model, x, loss_fn=loss_fn, repeats=1)
    python_bw = [n for n in prof.nodes if n.python_backward]
    assert python_bw and all(n.phase == "backward" for n in python_bw)
    assert any(n.python_backward is False and n.phase == "backward" for n in prof.nodes)
    none = measure(model, x, loss_fn, repeats=1).peak_bytes
    assert simulate(prof).peak_bytes == pytest.approx(none, rel=0.005)
    # Planned below the unplanned peak, with the Function replayed inside regions.
    budget = (smallest_peak(prof) + none) // 2
    p = plan(model, budget_bytes=budget, example_inputs=x, loss_fn=loss_fn, repeats=1)
    try:
        assert p.schedule.regions
        v = p.verify(repeats=1)
        assert v.measured_peak_bytes <= budget
        assert v.predicted_peak_bytes == pytest.approx(v.measured_peak_bytes, rel=0.005)
    finally:
        remove(model)


class _Quotient(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.num, self.den = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.num(x) / (self.den(x).exp() + 1.0)


def test_backward_temporaries_die_where_the_formula_frees_them():
    """A C++ backward formula frees a temporary at the end of the statement that made it, not
    when the formula returns: DivBackward computes the denominator's gradient as
    ``-grad * ((a / b) / b)`` and frees its three temporaries before the numerator's. The
    recorded step saw each die; held to the formula's end instead, this model's peak (and
    DeBERTa's, whose LayerNorm is written in Python) was predicted above the measured one."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_Quotient(), _Quotient()).train(), torch.randn(16, 64, 64)

    def loss_fn(out):
        return out.pow(2).mean()

    prof = profile(model, x, loss_fn=loss_fn, repeats=1)
    measured = measure(model, x, loss_fn, repeats=1).peak_bytes
    assert simulate(prof).peak_bytes == pytest.approx(measured, rel=1e-3)


class _LazyIndex(nn.Module):
    """Gathers rows of a table through an index it builds on first use and keeps, as BEiT's
    `lru_cache`d relative position index is kept."""

    def __init__(self, d: int = 64, rows: int = 512):
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, d))
        self.proj = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.built: dict[int, torch.Tensor] = {}

    def forward(self, x):
        n = self.table.shape[0]
        if n not in self.built:
            self.built[n] = torch.arange(n).flip(0).repeat(2)
        return self.proj(x) + self.table[self.built[n]].sum(0)


def test_what_the_first_call_builds_and_keeps_is_fixed_memory():
    """What a model builds on its first call and keeps exists before every later step, like a
    weight: the profile records a step after a warm-up one, counts it in fixed memory
    (`Profile.held_bytes`) whether or not the model had run before, and predicts the peak
    `measure` finds with it counted."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_LazyIndex(), _LazyIndex()).train(), torch.randn(512, 64)
    fresh = profile(model, x, repeats=1)
    kept = sum(t.untyped_storage().nbytes() for m in model for t in m.built.values())
    assert kept and fresh.held_bytes == kept
    again = profile(model, x, repeats=1)
    assert (again.held_bytes, again.fixed_bytes) == (kept, fresh.fixed_bytes)
    assert simulate(again).peak_bytes == simulate(fresh).peak_bytes
    m = measure(model, x, repeats=1, held_bytes=fresh.held_bytes)
    assert m.fixed_bytes == fresh.fixed_bytes
    assert fresh.meta.measured_peak_bytes == pytest.approx(m.peak_bytes, rel=1e-3)
    assert simulate(fresh).peak_bytes == pytest.approx(m.peak_bytes, rel=1e-3)
    budget = (smallest_peak(fresh) + simulate(fresh).peak_bytes) // 2
    p = plan(model, budget_bytes=budget, example_inputs=x, repeats=1)
    try:
        v = p.verify(repeats=1)
        assert v.measured_peak_bytes <= budget
        assert v.predicted_peak_bytes == pytest.approx(v.measured_peak_bytes, rel=1e-3)
    finally:
        remove(model)


class _LazyBuffer(_LazyIndex):
    """Registers its index as a buffer on first use, as litgpt's LoRA layers do (``_lora_ind``),
    and reads a clone of it every call."""

    def forward(self, x):
        if not hasattr(self, "index"):
            self.register_buffer("index", torch.arange(self.table.shape[0]).flip(0),
                                 persistent=False)
        return self.proj(x) + self.table[self.index.clone()].sum(0)


def test_a_buffer_registered_on_the_first_call_is_counted_once():
    """A buffer the warm-up step registers is a buffer of the recorded step, not a constant the
    model holds elsewhere: `measure` counts the module's buffers and adds `held_bytes`, so as a
    constant it was counted twice, and the measured peak read above the prediction by the
    buffers' bytes."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_LazyBuffer(), _LazyBuffer()).train(), torch.randn(512, 64)
    prof = profile(model, x, repeats=1)
    assert prof.held_bytes == 0
    m = measure(model, x, repeats=1, held_bytes=prof.held_bytes)
    assert m.fixed_bytes == prof.fixed_bytes
    assert simulate(prof).peak_bytes == m.peak_bytes


# -- FLOPs -----------------------------------------------------------------------------------------
def test_cpu_sdpa_flop_formula_is_registered():
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        pytest.skip("this torch has no CPU flash-attention kernel")
    assert op.default in flop_registry or op in flop_registry


@pytest.mark.parametrize("name", NAMES)
def test_forward_flops_match_flop_counter(name):
    model, x, prof = _profiled(name)
    forward = [n for n in prof.nodes if n.phase == "forward"]
    ours = sum(n.flops for n in forward if n.op.startswith(MATMUL_OPS))
    assert ours == sum(n.flops for n in forward), "FLOPs on an op that is not a matmul/conv"
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    args, kwargs = split_inputs(x)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        torch.func.functional_call(model, {**dict(model.named_parameters()), **buffers},
                                   args, kwargs)
    assert ours == counter.get_total_flops() > 0


# -- structure -------------------------------------------------------------------------------------
def test_module_calls_and_blocks():
    _, _, prof = _profiled("hf_llama")
    mods = [c.module for c in prof.calls]
    assert "model.layers.0" in mods and "model.layers.1.mlp" in mods
    layer = next(c for c in prof.calls if c.module == "model.layers.0")
    assert not layer.blocker
    names = [n.name for n in prof.nodes]
    inside = prof.nodes[names.index(layer.start):names.index(layer.end) + 1]
    assert all(n.phase == "forward" and n.module.startswith("model.layers.0") for n in inside
               if n.op != "getitem")


def test_use_cache_blocks_layers_that_store_into_the_cache():
    """With use_cache=True an HF layer stores its keys and values into the cache object it is
    given: replaying it would store them again, so it cannot be a region."""
    model, x = hf_llama(batch=2, seq=16, layers=2, hidden=32, heads=2, kv_heads=1,
                        intermediate=64, vocab=64)
    x = {**x, "use_cache": True}
    prof = profile(model, x, repeats=1)
    blocked = {c.module: c.blocker for c in prof.calls if c.blocker}
    assert "use_cache=False" in blocked["model.layers.0"]
    assert "model.layers.0.mlp" not in blocked  # the MLP does not touch the cache


def test_module_called_twice_is_a_region_only_with_both_calls():
    """A module called twice (shared weights) is one wrapper at run time: its calls are never
    candidates alone, only as a group; a blocked call blocks the group."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = nn.Sequential(nn.Linear(16, 16), nn.GELU())
            self.g = nn.Linear(16, 16)
            self.h = _AddOne()

        def forward(self, x):
            y = self.h(self.f(x), inplace=False)
            return self.g(self.h(self.f(y).clone(), inplace=True))

    prof = profile(Twice(), torch.randn(32, 16), repeats=1)
    calls_f = [c for c in prof.calls if c.module == "f"]
    assert len(calls_f) == 2 and not any(c.blocker for c in calls_f)
    assert shared_modules(prof) == {"f", "f.0", "f.1", "h"}
    assert not any(s.call.module.startswith("f") for s in candidate_calls(prof))
    (group, *_) = shared_calls(prof)
    assert [s.call.module for s in group] == ["f", "f"] and group[0].b < group[1].a
    assert not next(c for c in prof.calls if c.module == "g").blocker

    # h's second call writes in place to its argument, so neither call can be a region.
    blocked = [c.blocker for c in prof.calls if c.module == "h"]
    assert blocked == ["called 2 times in one step, and one call writes in place to a tensor "
                       "made before the call (aten.add_.Tensor)"] * 2
    assert all(grp[0].call.module != "h" for grp in shared_calls(prof))


class _SpectralNet(nn.Module):
    def __init__(self):
        super().__init__()
        sn = nn.utils.parametrizations.spectral_norm
        self.body = nn.Sequential(sn(nn.Linear(32, 64)), nn.Tanh(), sn(nn.Linear(64, 32)))
        self.head = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))

    def forward(self, x):
        return self.head(self.body(x))


def test_a_buffer_read_after_its_update_is_restored_for_the_replay():
    """Spectral norm's power iteration updates its vectors with ``out=`` (keyword-only: missed
    once, when its replay updated them a second time every step and gave other gradients) and
    reads them again, so a replay must start from the values forward started from: a call
    holding both restores them (`ModuleCall.restores`, copied as a region over it starts);
    calls that hold neither restore nothing. The plan trains like the model and leaves the
    vectors as they were."""
    torch.manual_seed(0)
    model, x = _SpectralNet().train(), torch.randn(256, 32)
    prof = profile(model, x, repeats=1)
    assert any(n.op == "aten.div.out" and n.mutates_buffer for n in prof.nodes)
    calls = {c.module: c for c in prof.calls}
    assert not any(c.blocker for c in prof.calls)
    vectors = {f"body.{k}.parametrizations.weight.0._{w}" for k in (0, 2) for w in "uv"}
    assert set(calls["body"].restores) == vectors
    assert set(calls["body.0"].restores) == {v for v in vectors if v.startswith("body.0.")}
    assert not calls["body.1"].restores and not calls["head"].restores
    assert Profile.from_dict(prof.to_dict()).calls == prof.calls  # saved profiles keep them
    u = [b.clone() for b in model.buffers()]
    p = plan(model, None, example_inputs=x, repeats=1)  # the smallest peak
    try:
        assert any(r.restores for r in p.schedule.regions)
        assert Schedule.from_dict(p.schedule.to_dict()).regions == p.schedule.regions
        v = p.verify(repeats=1)  # same loss and gradients as the unplanned model
        assert abs(v.measured_peak_bytes - v.predicted_peak_bytes) <= 64
        assert all(torch.equal(a, b) for a, b in zip(u, model.buffers(), strict=True))
    finally:
        remove(model)


def test_a_segment_does_not_start_or_end_at_a_childs_hooks():
    """A child's call spans its forward; a Sequential segment runs ``child(input)``, hooks
    included. A segment starting at a child whose pre-hook runs ops (old-style spectral norm's
    power iteration) held them at run time but not in its span: its replay ran the power
    iteration from the updated vectors, with no copy, and the gradients differed. No segment starts after, or ends before, such ops now; the plan at the
    smallest peak trains like the model."""
    torch.manual_seed(0)
    # old-style torch.nn.utils.spectral_norm: the power iteration runs in a forward pre-hook
    model, x = SpectralDisc(old=True, channels=8, depth=3).train(), torch.randn(8, 3, 16, 16)
    prof = profile(model, x, repeats=1)
    hooked = {f"body.{k}" for k in range(3)}  # each starts with its conv's pre-hook
    assert not [s for s in candidate_calls(prof)
                if s.segment is not None and s.call.module in hooked]
    p = plan(model, None, example_inputs=x, repeats=1)
    try:
        assert p.schedule.regions
        v = p.verify(repeats=1)  # raises where a gradient differs
        assert v.max_grad_rel_err <= 1e-5
        assert v.measured_peak_bytes <= v.predicted_peak_bytes + 64
    finally:
        remove(model)


def _square_mean(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def test_no_region_stops_its_replay_before_rrelu_fills_its_noise():
    """``rrelu_with_noise`` saves the ``noise`` tensor it is given, then fills it. A region whose
    last saver it is (RReLU's own call) early-stops its replay right after packing the tensor,
    before the kernel writes it: backward gets an unwritten noise and wrong gradients (torch's
    own checkpoint does the same, pytorch/pytorch#193671). Such spans are no candidates; the
    blocks around RReLU still are, and the plan trains like the model."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.RReLU(), nn.Linear(128, 32))
                            for _ in range(3)]).train()
    x = torch.randn(64, 32)
    prof = profile(model, x, repeats=1)
    assert [n.fills_saved for n in prof.nodes if n.op.startswith("aten.rrelu_with_noise.")] \
        == [True] * 3
    modules = {s.call.module for s in candidate_calls(prof) if s.segment is None}
    assert {"0", "1", "2"} <= modules and not {"0.1", "1.1", "2.1"} & modules
    # what the excluded span does: RReLU's own call as a region
    call = next(c for c in prof.calls if c.module == "0.1")
    region = Region(start=call.start, end=call.end, module="0.1", preserve_rng=True)
    _, g0 = loss_and_grads(model, x, _square_mean, model)
    apply_schedule(model, Schedule(regions=(region,)))
    try:
        _, g1 = loss_and_grads(model, x, _square_mean, model)
    finally:
        remove(model)
    assert not torch.allclose(g1["0.0.weight"], g0["0.0.weight"], rtol=1e-3)
    p = plan(model, None, example_inputs=x, repeats=1)
    try:
        assert p.schedule.regions
        assert p.verify(repeats=1).max_grad_rel_err <= 1e-5
    finally:
        remove(model)


class _InPlaceOnAView(nn.Module):
    """``nn.ReLU(inplace=True)`` after a Linear on 3-D input: the Linear's output is a view of
    its 2-D matmul, so the ReLU writes in place into a view."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 128), nn.ReLU(inplace=True), nn.Linear(128, 32))
            for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def test_an_in_place_op_on_a_view_owns_the_nodes_autograd_makes_after_it():
    """After an in-place op on a view dispatches, autograd makes the base's CopySlices (whose
    backward runs the op's formula and unpacks what it saved) and the view's new grad_fn. They
    had no owner, so the ReLU's save of its output was nobody's and its backward read the
    output as if from outside every region: each block region was predicted to keep it to the
    end of backward (over the measured peak, and plans that saved little)."""
    torch.manual_seed(0)
    model, x = _InPlaceOnAView().train(), torch.randn(8, 64, 32)
    prof = profile(model, x, repeats=1)
    relus = [n for n in prof.nodes if n.op == "aten.relu_.default"]
    assert len(relus) == 3 and all(n.saves for n in relus)
    assert all(n.grad_of is not None for n in prof.nodes
               if n.op == "aten.threshold_backward.default")
    calls = {c.module: c for c in prof.calls}
    for blocks in (["blocks.1"], ["blocks.0", "blocks.1", "blocks.2"]):
        regions = bind(prof, tuple(Region(start=calls[k].start, end=calls[k].end)
                                   for k in blocks))
        apply_schedule(model, Schedule(regions=regions))
        try:
            measured = measure(model, x, repeats=1).peak_bytes
        finally:
            remove(model)
        assert abs(simulate(prof, regions).peak_bytes - measured) <= 64, blocks


def test_torchscript_submodules_profile_as_their_callers_ops():
    """A TorchScript module takes no hooks (registering one raised, and the error blamed the
    inputs): its ops are its caller's, it is no region, and the peak is predicted."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    model = nn.Sequential(torch.jit.script(mlp), nn.Tanh(), nn.Linear(64, 64)).train()
    x = torch.randn(256, 64)
    prof = profile(model, x, repeats=1)
    assert not any(c.module == "0" or c.module.startswith("0.") for c in prof.calls)
    assert any(n.op == "aten.gelu.default" for n in prof.nodes)
    assert simulate(prof).peak_bytes == pytest.approx(measure(model, x, repeats=1).peak_bytes,
                                                      rel=1e-3)


class _ExpTwice(torch.autograd.Function):
    """exp(x) * 2, saving its output: a tensor made inside its forward."""

    @staticmethod
    def forward(ctx, x):
        out = x.exp() * 2
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * out


def test_a_custom_function_that_saves_what_its_forward_made():
    """A custom Function's autograd node is numbered when `apply` starts, before its forward
    runs its ops: its saves went to the forward's first op, which predates the tensor saved,
    and the profile was refused as malformed ("saves storage ..., which no earlier node
    allocates"). The node is now the last op's before the save."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)

        def forward(self, x):
            return self.b(_ExpTwice.apply(self.a(x) * 0.01))

    torch.manual_seed(0)
    model, x = M(), torch.randn(512, 64)
    prof = profile(model, x, repeats=1)
    saver = next(n for n in prof.nodes if n.saves and n.op == "aten.mul.Tensor"
                 and n.module == "")
    assert prof.storage_bytes[saver.storage] == 512 * 256 * 4
    assert simulate(prof).peak_bytes == pytest.approx(measure(model, x, repeats=1).peak_bytes,
                                                      rel=1e-3)


class _Reversible(torch.autograd.Function):
    """y = x + f(x) with f run without gradients; the backward runs f again and calls
    ``backward()`` on it, so that f's parameters' gradients accumulate into ``.grad`` (what
    Reformer's reversible layers do)."""

    @staticmethod
    def forward(ctx, x, f):
        ctx.f = f
        with torch.no_grad():
            y = x + f(x)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            (x + ctx.f(x)).backward(g)
        return x.grad, None


class _RevNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.fs = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3))

    def forward(self, x):
        x = self.inp(x)
        for f in self.fs:
            x = _Reversible.apply(x, f)
        return x


def test_a_model_that_calls_backward_itself_profiles_from_cleared_gradients():
    """Profiling runs the step from gradients set to None, as after ``zero_grad()``, and puts the
    user's ``.grad`` back: before, the warm-up's gradients stayed in ``.grad`` (the user's model
    changed) and the recorded step accumulated into them, predicting above a measured step."""
    torch.manual_seed(0)
    model, x = _RevNet(), torch.randn(512, 64)
    model.inp.weight.grad = torch.ones_like(model.inp.weight)
    prof = profile(model, x, repeats=1)
    assert torch.equal(model.inp.weight.grad, torch.ones_like(model.inp.weight))
    assert all(p.grad is None for p in model.fs.parameters())
    measured = measure(model, x, repeats=1).peak_bytes
    assert simulate(prof).peak_bytes == pytest.approx(measured, rel=1e-3)
    assert prof.meta.measured_peak_bytes == measured


def test_a_recording_that_differs_from_a_measured_step_is_flagged(monkeypatch):
    """`profile` measures one plain step beside the recorded one (`measured_peak_bytes`); where
    the recording missed work the model does (here: a measured step 10% higher than any
    recording could see), it warns, and the plan's report says so."""
    import planner.profiling as profiling

    torch.manual_seed(0)
    model, x = mlp_dropout(batch=256, dim=64, depth=3)
    prof = profile(model, x, repeats=1)
    assert prof.meta.measured_peak_bytes == simulate(prof).peak_bytes
    real = profiling.measure

    def more(*args, **kwargs):
        m = real(*args, **kwargs)
        return dataclasses.replace(m, peak_bytes=int(m.peak_bytes * 1.1))

    monkeypatch.setattr(profiling, "measure", more)
    with pytest.warns(UserWarning, match="the recording missed something"):
        missed = profile(model, x, repeats=1)
    assert missed.meta.measured_peak_bytes == int(simulate(prof).peak_bytes * 1.1)
    p = plan(model, budget_bytes=simulate(prof).peak_bytes * 2, example_inputs=x, repeats=1)
    try:
        assert "WARNING: the profiled step predicts" in p.report()
    finally:
        remove(model)


class _AddOne(nn.Module):
    def forward(self, x, inplace: bool):
        return x.add_(1) if inplace else x + 1


# -- no side effects -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp_dropout", "resnet_bn", "hf_gpt2"])
def test_profile_does_not_change_model_or_rng(name):
    model, x = build(name)
    before = _state(model)
    torch.manual_seed(1234)
    rng = torch.random.get_rng_state()
    profile(model, x, repeats=1)
    assert torch.equal(torch.random.get_rng_state(), rng)
    after = _state(model)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert model.training
    assert all("forward" not in m.__dict__ for m in model.modules())


# -- value-dependent code --------------------------------------------------------------------------
class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # data-dependent Python control flow
            return self.b(h)
        return h * float(h.abs().max().item())


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Branchy()

    def forward(self, x):
        return self.inner(x)


def test_value_dependent_model_profiles_in_measure_mode():
    prof = profile(_Outer(), torch.randn(4, 8), repeats=1)
    assert any(n.op == "aten._local_scalar_dense.default" for n in prof.nodes)
    assert not next(c for c in prof.calls if c.module == "inner").blocker


class _MovingThreshold(nn.Module):
    """Keeps the activations above a threshold it raises after every step (as the Routing
    Transformer's backward hook moves its k-means centroids): how much a step keeps depends on
    the buffer's value."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 1024)
        self.register_buffer("threshold", torch.zeros(()))
        self.lin.register_full_backward_hook(self._raise)

    def _raise(self, *_):
        self.threshold.add_(1.0)

    def forward(self, x):
        h = self.lin(x)
        return h.sum() + h[h > self.threshold].square().sum()


def test_the_step_measured_starts_from_the_buffers_the_profile_started_from():
    """measure's warm-up step moves the threshold; the step it measures then kept less than
    the one profiled (a peak below the prediction, unplanned). Every measured step starts from
    the buffers' values at the call, as the profile's recorded step does."""
    torch.manual_seed(0)
    model = _MovingThreshold()
    x = torch.randn(256, 64)
    prof = profile(model, x, repeats=1)
    assert model.threshold.item() == 0.0
    assert simulate(prof).peak_bytes == measure(model, x, repeats=1).peak_bytes
    assert model.threshold.item() == 0.0


def test_value_dependent_model_in_estimate_mode_names_the_module():
    with pytest.raises(ModelRunError, match=r"estimate mode.*'inner'.*measure mode"):
        profile(_Outer(), torch.randn(4, 8), mode="estimate")


def test_model_error_names_the_module_and_keeps_the_cause():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(8, 8)
            self.dec = nn.Linear(16, 8)  # wrong width

        def forward(self, x):
            return self.dec(self.enc(x))

    with pytest.raises(ModelRunError, match=r"in module 'dec'.*RuntimeError") as info:
        profile(Bad(), torch.randn(4, 8), repeats=1)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_measure_mode_on_meta_model_raises():
    with torch.device("meta"):
        model = nn.Linear(8, 8)
    with pytest.raises(CkptPlannerError, match="meta device.*estimate"):
        profile(model, torch.randn(4, 8, device="meta"), repeats=1)


def test_frozen_model_is_refused():
    model = nn.Linear(8, 8).requires_grad_(False)
    with pytest.raises(CkptPlannerError, match="requires grad"):
        profile(model, torch.randn(4, 8), repeats=1)


# -- estimate mode ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp_dropout", "resnet_bn", "gpt_eager"])
def test_estimate_mode_matches_measure_mode_memory(name):
    """On fake tensors the same ops run and allocate the same storages."""
    model, x, measured = _profiled(name)
    est = profile(model, x, mode="estimate", device=cpu_spec(measure=False))
    assert est.storage_bytes == measured.storage_bytes
    assert est.saved_bytes == measured.saved_bytes
    assert [n.name for n in est.nodes] == [n.name for n in measured.nodes]
    assert [n.flops for n in est.nodes] == [n.flops for n in measured.nodes]
    assert est.meta.mode == "estimate" and est.meta.step_ms_measured is None
    compute = [n for n in est.nodes if n.phase == "forward" and n.op.startswith(MATMUL_OPS)]
    assert compute and all(n.time_ms > 0 for n in compute)


@pytest.mark.parametrize("name", ["gpt2_sdpa", "llama", "llama_padded", "qwen2", "bert", "t5",
                                  "deberta_v2", "whisper", "peft_lora_llama"])
def test_estimate_mode_reads_the_values_of_masks_and_ids_as_a_real_step_does(name):
    """Transformers reads token ids, masks and position ids on the host (packed sequences? any
    padding?) and skips the (seq x seq) mask when it may; on a tensor it cannot read it builds
    the mask. Estimate mode knows those values (they come from the example inputs, not from the
    weights), so it records the step a real one runs: the same ops, storages and saves."""

    case = CASES[name]()
    measured = profile(case.model, case.inputs, loss_fn=case.loss_fn, repeats=1)
    est = profile(case.model, case.inputs, loss_fn=case.loss_fn, mode="estimate",
                  device=cpu_spec(measure=False))
    assert [n.op for n in est.nodes] == [n.op for n in measured.nodes]
    assert est.storage_bytes == measured.storage_bytes
    assert est.saved_bytes == measured.saved_bytes
    assert simulate(est).peak_bytes == simulate(measured).peak_bytes


def test_estimate_mode_still_refuses_a_branch_on_activation_values():
    """What a step computes from the weights has no values in estimate mode: a branch on it is
    refused with the module named, as before, even though the inputs' values are known."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, ids):
            h = self.lin(F.one_hot(ids, 8).float())
            return h if h.sum() > 0 else -h

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = Gate()

        def forward(self, ids):
            n = int((ids > 3).sum())  # a value of the inputs: known
            return self.gate(ids[:, : max(n, 1)])

    with pytest.raises(ModelRunError, match=r"in module 'gate'.*needs tensor values"):
        profile(Net(), torch.randint(0, 8, (4, 6)), mode="estimate")


class _GaussianHead(nn.Module):
    """A forecasting head as HF's time-series models have: a Normal over the targets."""

    def __init__(self):
        super().__init__()
        self.loc, self.scale = nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x, y):
        dist = torch.distributions.Normal(self.loc(x), F.softplus(self.scale(x)) + 1e-3)
        return -dist.log_prob(y).mean()


def test_estimate_mode_names_distribution_validation_as_the_value_read_and_its_switch():
    model, x, y = _GaussianHead(), torch.randn(16, 8), torch.randn(16, 1)
    validate = torch.distributions.Distribution._validate_args
    # torch's default; dynamo turns it off for the whole process on its first use
    # (torch/_dynamo/eval_frame.py), so a compile test run before this one would
    torch.distributions.Distribution.set_default_validate_args(True)
    try:
        with pytest.raises(ModelRunError, match=r"set_default_validate_args\(False\)"):
            profile(model, (x, y), loss_fn=lambda out: out, mode="estimate")
        torch.distributions.Distribution.set_default_validate_args(False)
        est = profile(model, (x, y), loss_fn=lambda out: out, mode="estimate")
    finally:
        torch.distributions.Distribution.set_default_validate_args(validate)
    assert any(n.op == "aten.log.default" for n in est.nodes)


def test_estimate_mode_runs_moe_routing_through_grouped_mm_in_bfloat16():
    """Mixtral's experts run as one grouped matrix multiply: token routing changes the offsets'
    values, not any shape, so estimate mode records the step a real one runs (bfloat16: torch's
    fake grouped_mm takes nothing else, which the error for float32 says)."""

    case = CASES["mixtral"]()
    with pytest.raises(ModelRunError, match=r"grouped_mm .* takes bfloat16 only"):
        profile(case.model, case.inputs, mode="estimate", device=cpu_spec(measure=False))
    model = case.model.to(torch.bfloat16)
    measured = profile(model, case.inputs, repeats=1)
    est = profile(model, case.inputs, mode="estimate", device=cpu_spec(measure=False))
    assert any("grouped_mm" in n.op for n in est.nodes)
    assert [n.op for n in est.nodes] == [n.op for n in measured.nodes]
    assert simulate(est).peak_bytes == simulate(measured).peak_bytes


class _CachedIndex(nn.Module):
    """Makes an index on its first call and keeps it (not a buffer), as BEiT and Data2Vec-Vision
    cache their relative position index; every call reads a view of it."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(256, 8))
        self.index = None

    def forward(self, x):
        if self.index is None:
            self.index = torch.arange(256).flip(0).reshape(16, 16)
        return x @ self.table[self.index.view(-1)].T


def test_estimate_mode_counts_a_tensor_cached_before_the_step_as_measure_mode_does():
    """The cached index is a constant of the step in both modes: its view is no new storage
    (on fake tensors it was one, and the index op's saved copy of it was counted twice)."""
    model, x = _CachedIndex(), torch.randn(32, 8)
    measured = profile(model, x, repeats=1)  # its warm-up step makes the cache
    assert model.index is not None
    est = profile(model, x, mode="estimate", device=cpu_spec(measure=False))
    assert est.storage_bytes == measured.storage_bytes
    assert est.saved_bytes == measured.saved_bytes
    assert simulate(est).peak_bytes == simulate(measured).peak_bytes


class _CTCHead(nn.Module):
    """A speech model's head and CTC loss (wav2vec2, WavLM, HuBERT): frames -> log-probs."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 12)

    def forward(self, frames, targets, frame_lengths, target_lengths):
        logp = self.proj(frames).log_softmax(-1).transpose(0, 1)  # (T, B, C)
        return F.ctc_loss(logp, targets, frame_lengths, target_lengths)


class _MaskedRows(nn.Module):
    """Rows picked by a padding mask, as MoE auxiliary losses weigh router outputs (Doge,
    Mixtral's load-balancing loss with an attention mask)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, mask):
        return self.lin(x)[mask].square().mean()


@pytest.mark.parametrize("name", ["ctc", "masked_rows"])
def test_estimate_mode_takes_an_output_shape_from_known_arguments(name):
    """CTC's buffers and a masked selection have shapes set by the targets, lengths and mask,
    which come from the example: estimate mode records them at the real step's shapes (before,
    it refused both: their fake kernels cannot know the shapes)."""
    torch.manual_seed(0)
    if name == "ctc":
        model = _CTCHead()
        inputs = (torch.randn(3, 40, 16), torch.randint(1, 12, (3, 9)),
                  torch.tensor([40, 33, 25]), torch.tensor([9, 7, 4]))
    else:
        model = _MaskedRows()
        mask = torch.ones(4, 10, dtype=torch.bool)
        mask[1, 6:] = mask[3, 2:] = False
        inputs = (torch.randn(4, 10, 16), mask)
    measured = profile(model, inputs, loss_fn=lambda out: out, repeats=1)
    est = profile(model, inputs, loss_fn=lambda out: out, mode="estimate",
                  device=cpu_spec(measure=False))

    def forward_sizes(p):
        return [p.storage_bytes[s] for n in p.nodes if n.phase == "forward"
                for s in n.new_storages]

    assert forward_sizes(est) == forward_sizes(measured)
    assert est.saved_bytes == measured.saved_bytes
    if name == "masked_rows":  # CTC's backward kernels take scratch memory only measured
        assert simulate(est).peak_bytes == simulate(measured).peak_bytes


class _StepCounter(nn.Module):
    """Counts its calls in a buffer, in place (as BatchNorm's num_batches_tracked does)."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, ids):
        self.calls += 1
        ids.clamp_(max=3)  # writes its input, as some preprocessing in forward does
        return self.norm(self.lin(x)) * (1 + self.calls.float() / 1000) + ids.float().mean()


def test_estimate_mode_leaves_the_models_tensors_and_the_inputs_as_they_were():
    """The values of the buffer and of the integer input are known in estimate mode (their
    in-place updates are re-run on real values), on copies: neither the user's model nor the
    example inputs are touched."""
    model = _StepCounter().train()
    ids = torch.arange(16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile(model, (torch.randn(16, 8), ids), mode="estimate")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(ids, torch.arange(16))


class _ReadsItsConstant(nn.Module):
    """Reads the values of a tensor it keeps as a plain attribute (not a buffer)."""

    def __init__(self, build_list: bool = False):
        super().__init__()
        self.lin, self.sizes, self.build_list = nn.Linear(8, 8), torch.tensor([2, 3]), build_list

    def forward(self, ids):
        if self.build_list:  # torch.tensor of 0-d tensors reads their data outside any op
            ids = ids[:, : int(torch.tensor([ids.max(), ids.min()]).sum())]
        keep = int(self.sizes.sum())  # a constant's value: known in estimate mode too
        return self.lin(F.one_hot(ids[:, :keep], 8).float())


def test_estimate_mode_reads_a_constant_the_model_keeps():
    est = profile(_ReadsItsConstant(), torch.randint(0, 8, (4, 9)), mode="estimate")
    assert any(n.op == "aten.mm.default" for n in est.nodes)


def test_estimate_mode_names_a_read_of_data_outside_torchs_operators():
    with pytest.raises(ModelRunError, match=r"reads a tensor's data outside torch's operators"):
        profile(_ReadsItsConstant(build_list=True), torch.randint(1, 8, (4, 9)), mode="estimate")


def test_estimate_mode_forgets_the_values_of_a_mask_written_from_activations():
    """A mask known from the inputs, then written in place from an activation, has no known
    values any more: reading it is refused, not answered from the stale copy."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, ids):
            h = self.lin(F.one_hot(ids, 8).float())[..., 0]
            keep = ids >= 0  # all True, known
            keep[:, 0] = h[:, 0] > 0
            return h.sum() if bool(keep.all()) else h.mean()

    with pytest.raises(ModelRunError, match=r"needs tensor values"):
        profile(Net(), torch.randint(0, 8, (4, 6)), mode="estimate")


def test_estimate_for_gpu_keeps_dropout_masks_as_bool():
    """On CUDA/ROCm dropout runs ``native_dropout``, which keeps a 1-byte mask; the CPU's
    ``bernoulli_`` mask has the input's dtype."""
    model, x = mlp_dropout(batch=64, dim=32, depth=2)
    cpu = profile(model, x, mode="estimate", device=cpu_spec(measure=False))
    gpu = profile(model, x, mode="estimate", device="h100")
    drops = [n for n in gpu.nodes if n.op == "aten.native_dropout.default"]
    assert drops and not any(n.op == "aten.native_dropout.default" for n in cpu.nodes)
    masks = [gpu.storage_bytes[s] for n in drops for s in n.new_storages]
    assert 64 * 32 in masks  # one byte per element
    assert gpu.saved_bytes < cpu.saved_bytes


def test_estimate_for_gpu_fuses_attention_with_dropout():
    """With attention dropout a CPU tensor takes SDPA's math path (seq x seq probabilities); a GPU
    estimate keeps the fused kernel, as CUDA does."""
    softmax = ("aten._softmax.default", "aten._safe_softmax.default")
    model, x = hf_gpt2(batch=2, seq=32, layers=1, n_embd=64, n_head=4, vocab=128)
    for mod in model.modules():
        if hasattr(mod, "attn_dropout"):
            mod.attn_dropout.p = 0.1
    model.config.attn_pdrop = 0.1
    cpu = profile(model, x, mode="estimate", device=cpu_spec(measure=False))
    gpu = profile(model, x, mode="estimate", device="h100")
    assert any(n.op in softmax for n in cpu.nodes)
    assert any("_scaled_dot_product_flash_attention" in n.op for n in gpu.nodes)
    assert not any(n.op in softmax for n in gpu.nodes)
    assert gpu.saved_bytes < cpu.saved_bytes


def test_estimate_for_gpu_fuses_grouped_query_attention_with_dropout():
    """Llama with 2 key/value heads for 4 query heads and attention dropout: a GPU's fused kernel
    takes the keys and values as they are (no repeat_kv copies, no probabilities kept)."""

    case = CASES["llama"]()
    cfg = case.model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads and cfg.attention_dropout > 0
    gpu = profile(case.model, case.inputs, mode="estimate", device="h100")
    attn = [n for n in gpu.nodes if n.module.endswith("self_attn") and n.phase == "forward"]
    fused = [n for n in attn if "_scaled_dot_product_flash_attention" in n.op]
    assert fused and not any("softmax" in n.op or n.op == "aten.clone.default" for n in attn)
    k_proj = next(n for n in gpu.nodes if n.module.endswith("self_attn.k_proj")
                  and n.op == "aten.mm.default")
    q_proj = next(n for n in gpu.nodes if n.module.endswith("self_attn.q_proj")
                  and n.op == "aten.mm.default")
    k_bytes = gpu.storage_bytes[k_proj.new_storages[0]]
    assert 2 * k_bytes == gpu.storage_bytes[q_proj.new_storages[0]]  # keys stay at 2 heads


def test_estimate_for_gpu_runs_attention_whose_mask_is_trained():
    """A trained attention bias (Swin's relative positions) passed as SDPA's mask, with dropout:
    the CPU's fused kernel takes no gradient for the mask, so the GPU estimate keeps the path a
    real step takes instead of failing in the model's forward."""

    class BiasedAttention(nn.Module):
        def __init__(self, heads: int = 4, seq: int = 16, dim: int = 32):
            super().__init__()
            self.qkv = nn.Linear(dim, 3 * dim)
            self.bias = nn.Parameter(torch.zeros(heads, seq, seq))
            self.heads = heads

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, dropout_p=0.1)
            return out.transpose(1, 2).reshape(b, t, d)

    model, x = BiasedAttention().train(), torch.randn(2, 16, 32)
    est = profile(model, x, mode="estimate", device="h100")
    assert est.meta.mode == "estimate" and est.saved_bytes > 0
    grads = [n for n in est.nodes if n.phase == "backward"]
    assert grads, "the estimate recorded no backward"


def test_estimate_mode_takes_a_loss_that_closes_over_real_targets():
    """``loss_fn=lambda out: F.cross_entropy(out, targets)`` with real targets: the estimate
    runs it on fake outputs (the targets become fake constants), as measure mode runs it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)).train()
    x, targets = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def loss_fn(out):
        return F.cross_entropy(out, targets)

    est = profile(model, x, loss_fn=loss_fn, mode="estimate", device=cpu_spec(measure=False))
    real = profile(model, x, loss_fn=loss_fn, repeats=1)
    assert simulate(est).peak_bytes == simulate(real).peak_bytes


def test_estimate_mode_bf16_param_bytes():
    model, x = mlp_dropout(batch=64, dim=64, depth=2)
    model = model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    p = profile(model, x.to(torch.bfloat16), mode="estimate", device="h100")
    assert p.param_bytes == p.grad_bytes == 2 * n_params
    assert p.meta.dtype == "bfloat16" and p.step_ms > 0


def test_estimate_meta_device_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    n_params = sum(p.numel() for p in model.parameters())
    kw = {"input_ids": ids, "labels": ids, "use_cache": False}
    p = profile(model, kw, mode="estimate", device="h100")
    assert p.param_bytes == 2 * n_params
    assert p.input_bytes == ids.numel() * 8  # input_ids and labels: one storage
    assert p.saved_bytes > 0 and p.step_ms > 0
    # Same architecture on real weights: identical memory picture.
    real, inputs = hf_llama(batch=2, seq=64, layers=2, hidden=64, heads=4, kv_heads=2,
                            intermediate=172, vocab=512)
    real = real.to(torch.bfloat16)
    q = profile(real, inputs, mode="estimate", device="h100")
    assert q.saved_bytes == p.saved_bytes


@pytest.mark.parametrize("name", NAMES)
def test_profile_records_step_time_and_checkpoint_costs(name):
    _, _, prof = _profiled(name)
    assert prof.meta.mode == "measure" and prof.meta.capture == "run"
    assert prof.meta.step_ms_measured is not None and prof.meta.step_ms_measured > 0
    assert prof.meta.checkpoint_region_ms > 0
    assert prof.step_ms > 0


class _DroppedBranch(nn.Module):
    """A classifier that also computes a per-position output it drops (CANINE's final
    character encoder under a sequence-classification head): the branch's autograd nodes never
    run backward, but they keep what they saved until the branch's output dies."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.branch = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256),
                                    nn.Dropout(0.1), nn.Linear(256, 64))
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        h = self.trunk(x)
        per_position = self.branch(h)  # noqa: F841  (computed, never used by the loss)
        return self.head(h.mean(dim=0))


def test_a_branch_the_loss_does_not_use_keeps_its_saves_until_it_dies():
    """What a dropped branch saved lives until the end of forward (the model drops the output
    there): predicted to the measured peak, unplanned and planned (a region over the branch
    frees its saves at once, as checkpoint packs them, but it never replays and its frame keeps
    the RNG state it stashed while the branch lives)."""
    torch.manual_seed(0)
    model, x = _DroppedBranch().train(), torch.randn(128, 64)
    prof = profile(model, x, repeats=1)
    branch = [n for n in prof.nodes if n.module.startswith("branch") and n.saves]
    assert branch and not any(n.name in {m.grad_of for m in prof.nodes} for n in branch)
    assert simulate(prof).peak_bytes == pytest.approx(measure(model, x, repeats=1).peak_bytes,
                                                      rel=1e-3)
    calls = {s.call.module: s for s in useful_calls(prof) if s.segment is None}
    for mods in (["branch"], ["trunk", "branch"]):
        sched = Schedule(regions=bind(prof, tuple(region(prof, calls[m].a, calls[m].b)
                                                  for m in mods)))
        apply_schedule(model, sched)
        try:
            measured = measure(model, x, repeats=1).peak_bytes
        finally:
            remove(model)
        assert simulate(prof, sched).peak_bytes == pytest.approx(measured, rel=1e-4), mods


class _KeepsState(nn.Module):
    """Stores its last hidden state on itself, graph and all (RecurrentGemma's
    ``self.recurrent_states = ...`` in training)."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(32, 128), nn.Linear(128, 32)
        self.state = None

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        self.state = h.mean(dim=0, keepdim=True)
        return self.out(h)


def test_a_call_that_stores_a_tensor_with_its_graph_on_a_module_is_a_region():
    """Found on RecurrentGemma: a replay stores the recomputed state, which would keep the
    replay's tensors alive, so such calls were blocked. The replay now puts the module's tensor
    attributes back as forward left them (`planner.inplace._as_in_forward`): the calls are
    regions, the plan fits as predicted, and the state kept after a step is forward's."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                        nn.Linear(512, 32))
    model = nn.Sequential(nn.Linear(32, 32), _KeepsState(), nn.GELU(), _KeepsState(), mlp
                          ).train()
    x = torch.randn(1024, 32)
    prof = profile(model, x, repeats=1)
    assert not any(c.blocker for c in prof.calls)
    assert model[1].state is None  # planning's steps leave no graph on the model
    budget = (smallest_peak(prof) + simulate(prof).peak_bytes) // 2
    p = plan(model, budget_bytes=budget, example_inputs=x, repeats=1)
    try:
        assert p.schedule.regions
        v = p.verify(repeats=1)
        assert v.measured_peak_bytes <= budget
        assert v.measured_peak_bytes <= v.predicted_peak_bytes <= 1.01 * v.measured_peak_bytes
        out = model(x)
        kept = model[1].state, model[3].state
        out.square().mean().backward()
        assert model[1].state is kept[0] and model[3].state is kept[1]  # not a replay's
    finally:
        remove(model)


class _StoresInList(nn.Module):
    """MONAI DynUNet's deep supervision: a block stores its head's output in a list it shares
    with its parent (``self.heads[i] = ...``)."""

    def __init__(self, heads: list, i: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 32))
        self.head = nn.Linear(32, 32)
        self.heads, self.i = heads, i

    def forward(self, x):
        y = self.body(x) + x
        self.heads[self.i] = self.head(y)
        return y


class _DeepSupervised(nn.Module):
    """Returns its output stacked with every block's stored head output."""

    def __init__(self):
        super().__init__()
        self.heads = [torch.zeros(1)] * 3
        self.blocks = nn.Sequential(*[_StoresInList(self.heads, i) for i in range(3)])

    def forward(self, x):
        out = self.blocks(x)
        return torch.stack([out, *self.heads], dim=1)


def test_a_replay_leaves_the_lists_its_modules_hold_as_forward_left_them():
    """Found on MONAI's DynUNet: a replay stored its recomputed head output in the shared
    list, graph and all, where it stayed into the next step (the measured peak then moved
    from step to step). The replay now puts back the contents of its modules' list and dict
    attributes: after a planned step the list holds forward's tensors, and the plan trains
    like the model."""
    torch.manual_seed(0)
    model, x = _DeepSupervised().train(), torch.randn(1024, 32)

    def loss_fn(out):
        return out.square().mean()

    def step():
        out = model(x)
        kept = list(model.heads)
        loss_fn(out).backward()
        return kept

    step()
    want = [q.grad.clone() for q in model.parameters()]
    model.zero_grad()
    p = plan(model, None, example_inputs=x, loss_fn=loss_fn, repeats=1)
    try:
        assert {r.start for r in p.schedule.regions} & {
            c.start for c in p.profile.calls if c.module.startswith("blocks.")}
        kept = step()
        assert all(a is b for a, b in zip(kept, model.heads, strict=True))  # not a replay's
        for g, w in zip((q.grad for q in model.parameters()), want, strict=True):
            torch.testing.assert_close(g, w)
        v = p.verify(repeats=1)
        assert v.measured_peak_bytes <= v.predicted_peak_bytes
    finally:
        remove(model)


def test_parameters_named_like_ops_profile():
    """Node names are op names, numbered; a top-level parameter called ``cos`` or ``exp`` (its
    node is named after it) made the first ``cos`` op's node a duplicate, and the profile was
    refused as malformed."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.cos = nn.Parameter(torch.randn(64))
            self.exp = nn.Parameter(torch.randn(64))
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            return self.lin(x * torch.cos(self.cos) + torch.exp(self.exp).sin())

    model, x = M(), torch.randn(256, 64)
    prof = profile(model, x, repeats=1)
    names = [n.name for n in prof.nodes]
    assert len(names) == len(set(names)) and {"cos", "exp"} <= set(names)
    assert simulate(prof).peak_bytes == pytest.approx(measure(model, x, repeats=1).peak_bytes,
                                                      rel=1e-3)


class _AutoCorrelation(nn.Module):
    """Autoformer's autocorrelation: FFT of queries and keys, their product, inverse FFT. The
    FFTs' backward conjugates gradients, and the autograd engine clones one where another
    reference to it is alive: the structure pass, which holds such references, runs a clone
    that the timing and workspace passes do not."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.q, self.k, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        q = torch.fft.rfft(self.q(x).permute(0, 2, 1).contiguous(), dim=-1)
        k = torch.fft.rfft(self.k(x).permute(0, 2, 1).contiguous(), dim=-1)
        corr = torch.fft.irfft(q * torch.conj(k), n=x.shape[1], dim=-1)
        return self.o(corr.permute(0, 2, 1))


def test_passes_that_run_a_clone_fewer_still_time_every_op_and_find_workspaces():
    """The timing and workspace passes are matched to the recording op by op; a pass that ran
    a backward clone fewer was dropped whole, leaving every op's time at 0 and no workspace
    (Autoformer's step was predicted low: its circular convolution's workspace was missed).
    Now the ops on either side of the clone are matched."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_AutoCorrelation(), _AutoCorrelation()).train(), torch.randn(4, 48, 32)
    prof = profile(model, x, repeats=1)
    compute = [n for n in prof.nodes if n.op in ("aten.addmm.default", "aten.mm.default",
                                                  "aten._fft_r2c.default", "aten._fft_c2r.default")]
    assert len(compute) >= 10
    assert all(n.time_ms > 0 for n in compute), [n.name for n in compute if n.time_ms <= 0]
    assert any(n.workspace_bytes > 0 for n in prof.nodes if n.op.startswith("aten._fft"))
    # Not below the measured peak. Above it on this toy by about one weight gradient (cause
    # not yet known, benchmarks/RESULTS.md), so not asserted exact.
    predicted, measured = simulate(prof).peak_bytes, measure(model, x, repeats=1).peak_bytes
    assert 0 <= predicted - measured <= 0.02 * measured, (predicted, measured)


def test_matching_passes_pairs_around_a_missing_op_and_refuses_another_branch():
    from types import SimpleNamespace

    from planner.capture.record import _match

    names = [f"aten.op{i % 7}.default" for i in range(200)]
    ops = [SimpleNamespace(op=n) for n in names]
    light = names[:120] + names[121:]  # the light pass ran op 120 (a clone) fewer
    where = _match(ops, light)
    assert where is not None and where[120] is None
    assert all(light[where[k]] == names[k] for k in range(200) if k != 120)
    assert where[121] == 120 and where[199] == 198
    other = names[:100] + [f"aten.other{i}.default" for i in range(100)]  # another branch
    assert _match(ops, other) is None


class _ProbSparse(nn.Module):
    """Informer's ProbSparse attention, reduced: scores of every query against sampled keys pick
    the top queries by value (`topk`), and only those attend. The sampled scores' autograd
    nodes never run backward; what they saved (the queries, the sampled keys) dies as the
    module returns, although `topk`'s indices live on until backward: integer tensors have no
    `grad_fn`, so they keep no autograd node alive."""

    def __init__(self, d: int = 32, top: int = 8):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.top = top

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        sample = torch.randint(x.shape[1], (self.top,))
        m = (q @ k[:, sample].transpose(1, 2)).amax(-1)
        idx = m.topk(self.top, dim=-1).indices
        rows = torch.arange(x.shape[0])[:, None]
        att = (q[rows, idx] @ k.transpose(1, 2)).softmax(-1) @ v
        out = v.mean(1, keepdim=True).expand(-1, x.shape[1], -1).clone()
        out[rows, idx] = att
        return self.o(out)


def test_what_a_node_that_never_runs_backward_saved_dies_with_its_float_outputs():
    torch.manual_seed(0)
    model, x = nn.Sequential(_ProbSparse(), _ProbSparse()).train(), torch.randn(4, 64, 32)
    prof = profile(model, x, repeats=1)
    assert any(n.no_grad_storages for n in prof.nodes if n.op == "aten.topk.default")
    torch.manual_seed(0)
    predicted, measured = simulate(prof).peak_bytes, measure(model, x, repeats=1).peak_bytes
    assert abs(predicted - measured) <= 64, (predicted, measured)


class _NormedAdapter(nn.Module):
    """DoRA's pattern (`peft`'s `DoraLinearLayer`): the adapter's weight is built by running its
    layers on an identity matrix, and only a detached copy of it feeds the weight norm that
    scales the output. The identity and what the first layer made are saved by a graph that
    nothing reaches: it dies with the weight, at the end of the call; the division that runs
    backward reads the norm, which holds no edge to it."""

    def __init__(self, d: int = 256, r: int = 8):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.a, self.b = nn.Linear(d, r, bias=False), nn.Linear(r, d, bias=False)
        self.magnitude = nn.Parameter(torch.ones(d))

    def forward(self, x):
        weight = self.b(self.a(torch.eye(self.a.in_features))).T
        norm = (self.base.weight + weight.detach()).norm(dim=1)
        return self.base(x) * (self.magnitude / norm) + self.b(self.a(x))


def test_a_read_through_a_detached_copy_does_not_keep_a_dead_graph_alive():
    torch.manual_seed(0)
    model, x = nn.Sequential(_NormedAdapter(), _NormedAdapter()).train(), torch.randn(4, 256)
    prof = profile(model, x, repeats=1)
    eye = [s for n in prof.nodes if n.op == "aten.eye.default" for s in n.new_storages]
    assert len(eye) == 2 and all(any(s in n.saves for n in prof.nodes) for s in eye)
    assert any(n.detached_reads for n in prof.nodes if n.op == "aten.add.Tensor")
    torch.manual_seed(0)
    predicted, measured = simulate(prof).peak_bytes, measure(model, x, repeats=1).peak_bytes
    assert abs(predicted - measured) <= 64, (predicted, measured)
    # without the field (a profile saved before it), each identity is held to backward
    old = dataclasses.replace(prof, nodes=[dataclasses.replace(n, detached_reads=())
                                           for n in prof.nodes])
    assert simulate(old).peak_bytes >= measured + sum(prof.storage_bytes[s] for s in eye)


def _region_peaks(prof, model, x, modules):
    """Simulated step (`Simulation`) and measured peak of `model` on `x` with each of
    `modules`' calls a region."""
    calls = {c.call.module: c for c in candidate_calls(prof) if c.segment is None}
    regions = bind(prof, tuple(region(prof, calls[m].a, calls[m].b) for m in modules))
    apply_schedule(model, Schedule(regions=regions))
    try:
        torch.manual_seed(0)
        measured = measure(model, x, repeats=1).peak_bytes
    finally:
        remove(model)
    return simulate(prof, regions), measured


class _SampledMax(_ProbSparse):
    """A top-query pick from the column maxima of the scores (`max` saves its int64 indices);
    its output does not reach the loss, so `max`'s autograd node never runs backward and holds
    the indices while `m`, a local, lives: until the call returns, in forward and in a replay."""

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(1, 2)
        m = scores.max(0)[0].sum(-1)
        idx = m.topk(self.top)[1].expand(x.shape[0], -1)
        rows = torch.arange(x.shape[0])[:, None]
        att = (q[rows, idx] @ k.transpose(1, 2)).softmax(-1) @ v
        out = v * 2
        out[rows, idx] = att
        return self.o(out)


def test_a_replayed_node_that_never_runs_backward_keeps_what_it_saved_while_it_lives():
    """The replay's pack hook hands each saved tensor back to the replayed autograd node, so a
    node whose backward never runs keeps its saves as long as in forward (Informer's sampled
    scores); counted as dying after their last replayed reader, the replay was predicted low."""
    torch.manual_seed(0)
    model = nn.Sequential(_SampledMax(), _SampledMax()).train()
    x = torch.randn(8, 256, 32)
    prof = profile(model, x, repeats=1)
    sim, measured = _region_peaks(prof, model, x, ("0", "1"))
    assert sim.peak_at.startswith("replay:")  # the peak is where the rule matters
    assert abs(sim.peak_bytes - measured) <= 64, (sim.peak_bytes, measured)


class _TopKRouter(nn.Module):
    """An MoE router that normalises its top-k weights in place, as HunYuan, Qwen3-MoE, GLM-4-MoE
    and Ernie-4.5 do: `div_` needs the weights it overwrites for backward, so autograd clones
    them (a node of its own) after making div_'s node and before div_ itself runs."""

    def __init__(self, d: int = 64, experts: int = 4):
        super().__init__()
        self.gate, self.up, self.d = nn.Linear(d, experts, bias=False), nn.Linear(d, d), d

    def forward(self, x):
        w = self.gate(x.reshape(-1, self.d)).softmax(-1)
        w, _ = torch.topk(w, 2, dim=-1)
        w /= w.sum(dim=-1, keepdim=True)
        return x + (self.up(x).reshape(-1, self.d) * w.sum(-1, keepdim=True)).reshape(x.shape)


def test_an_in_place_op_owns_the_node_it_made_before_its_clone_of_the_original():
    """div_'s backward ops belong to div_, and what its node saves (the clone of the weights and
    the sum) to div_ too: unowned, they were missing from the region's replay accounting and
    the region was predicted above its measured peak."""
    torch.manual_seed(0)
    model = nn.Sequential(_TopKRouter(), _TopKRouter()).train()
    x = torch.randn(4, 64, 64)
    prof = profile(model, x, repeats=1)
    div = next(i for i, n in enumerate(prof.nodes) if n.op == "aten.div_.Tensor")
    clone = next(n for n in prof.nodes[:div][::-1] if n.op == "aten.clone.default")
    assert prof.nodes[div].saves
    assert any(n.phase == "backward" and n.grad_of == prof.nodes[div].name for n in prof.nodes)
    sim, measured = _region_peaks(prof, model, x, ("0",))
    assert sim.peak_bytes == measured, (sim.peak_bytes, measured)
    # the clone is div_'s saved tensor, held until div_'s backward: not the clone's own
    assert set(clone.new_storages) <= set(prof.nodes[div].saves) and not clone.saves


def test_a_replay_keeps_an_in_place_ops_clone_of_the_original_until_its_backward():
    """Mixtral's router normalises its top-2 weights in place. A region over the whole model
    replays every layer's router at the first unpack, before the loss's backward, where the
    step peaks; each replayed clone of the weights lives until its layer's div_ backward. The
    clone was attributed to the clone op (whose node saves nothing), so the replay freed it at
    once: predicted under the measured peak by one clone per layer."""
    case = CASES["mixtral"]()
    model, x = case.model, case.inputs
    prof = profile(model, x, loss_fn=case.loss_fn, repeats=1)
    whole = next(c for c in candidate_calls(prof) if c.call.module == "" and c.segment is None)
    regions = bind(prof, (region(prof, whole.a, whole.b),))
    apply_schedule(model, Schedule(regions=regions))
    try:
        measured = measure(model, x, case.loss_fn, repeats=1).peak_bytes
    finally:
        remove(model)
    assert abs(simulate(prof, regions).peak_bytes - measured) <= 256


class _KVStore(collections.UserDict):
    """Not a dict (HF's `KVSharingDict`): no pytree node, so a checkpoint keeps it whole."""


class _KVLayer(nn.Module):
    def __init__(self, slot: str, shared: bool, d: int = 32):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.slot, self.shared = slot, shared

    def forward(self, x, store):
        q = self.q(x)
        if self.shared:
            k, v = store[self.slot]
        else:
            k, v = self.k(x) * 0.5, self.v(x) * 0.5  # saved by nothing
            store[self.slot] = (k, v)
        att = (q @ k.clone().transpose(1, 2)).softmax(-1) @ v.clone()
        return x + self.o(att)


class _SharedKV(nn.Module):
    """HF Gemma3n's KV sharing, reduced: the first two layers put their keys and values in a
    store the model's forward makes and drops, each in its own slot; the last two attend with
    them. Only the store holds them, so they die as forward returns, unless a checkpointed
    layer took the store: its frame keeps it, and the slot it never reads, until its backward."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_KVLayer(slot, shared)
                                    for shared in (False, True) for slot in ("a", "b"))

    def forward(self, x):
        store = _KVStore()
        for layer in self.layers:
            x = layer(x, store)
        return x


def test_a_region_keeps_what_an_argument_dropped_before_forward_ended_held():
    """What the objects among a region's arguments hold lives until its backward; the store
    died before forward ended, and what it had held was not counted. A layer that puts what
    it makes into the store is no region."""
    torch.manual_seed(0)
    model, x = _SharedKV().train(), torch.randn(8, 128, 32)
    prof = profile(model, x, repeats=1)
    assert {c.module for c in prof.calls if c.blocker}.issuperset({"layers.0", "layers.1"})
    assert next(c for c in prof.calls if c.module == "layers.2").holds
    sim, measured = _region_peaks(prof, model, x, ("layers.2",))
    assert abs(sim.peak_bytes - measured) <= 64, (sim.peak_bytes, measured)


class _ScaledInPlace(nn.Module):
    """HF Longformer's attention, reduced: the query projection is divided in place, and the
    band of scores is written into a matmul's output."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.q, self.k, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        q = self.q(x)
        q /= 4.0
        scores = q @ self.k(x).transpose(1, 2)
        scores[:, :, :2] = 0.0
        return x + self.o(scores.softmax(-1) @ x)


def test_a_matmul_output_written_in_place_is_not_kept_by_a_selective_region():
    """Selective checkpointing refuses a kept output written since ("Tensor cached during
    selective activation checkpoint has been mutated"): such outputs are recomputed."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_ScaledInPlace(), _ScaledInPlace()).train(), torch.randn(4, 64, 32)
    prof = profile(model, x, repeats=1)
    calls = {c.call.module: c for c in candidate_calls(prof) if c.segment is None}
    regions = bind(prof, tuple(selective_region(prof, calls[m].a, calls[m].b) for m in "01"))
    op = {n.name: n.op for n in prof.nodes}
    for r in regions:  # of q, k, scores, attention, o: q and the scores are written in place
        assert [op[n] for n in r.saved] == ["aten.addmm.default", "aten.bmm.default",
                                            "aten.addmm.default"]
    model.zero_grad()
    torch.manual_seed(0)
    model(x).float().mean().backward()
    want = [p.grad.clone() for p in model.parameters()]
    apply_schedule(model, Schedule(regions=regions))
    try:
        model.zero_grad()
        torch.manual_seed(0)
        model(x).float().mean().backward()
        assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want, strict=True))
    finally:
        remove(model)


def test_a_router_node_held_by_a_reader_that_ran_backward_is_kept_until_then():
    """HF PhiMoE's router (sparsemixer): nodes whose backward never runs, read by nodes that
    did run backward, stay alive (and what they saved with them) until those ran; counted as
    dying with their last reader instead, the step was predicted low."""
    transformers = pytest.importorskip("transformers")
    from tests.zoo import _hf, _lm_inputs

    torch.manual_seed(0)
    config = transformers.PhimoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128, attention_dropout=0.1,
        router_jitter_noise=0.01, input_jitter_noise=0.01, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, sliding_window=None)
    model = _hf(transformers.PhimoeForCausalLM, config)
    inputs = _lm_inputs(512, 4, 64, [64, 40, 64, 30])
    prof = profile(model, inputs, repeats=1)
    predicted, measured = simulate(prof).peak_bytes, measure(model, inputs, repeats=1).peak_bytes
    assert abs(predicted - measured) <= 64, (predicted, measured)


class _Standardise(nn.Module):
    """Normalises by per-channel statistics written in the code (``torch.as_tensor(MEAN)``,
    as VideoMAE's pre-training loss and image processors do): made afresh on every call, and
    `std` saved by the division for backward."""

    def __init__(self, channels: int = 2048):
        super().__init__()
        self.proj = nn.Linear(channels, channels)
        self.mean = [0.1 * (i % 7) for i in range(channels)]
        self.std = [1.0 + 0.01 * (i % 5) for i in range(channels)]

    def forward(self, x):
        mean, std = torch.as_tensor(self.mean), torch.as_tensor(self.std)
        return (self.proj(x) - mean) / std


def test_a_tensor_made_from_python_data_in_the_step_is_step_memory():
    # ``torch.tensor(data)`` reaches the recorder only as ``lift_fresh`` of a tensor it never
    # saw made: it is memory of this step (the warm-up step would have made a kept one known),
    # not a constant held before the step, whose bytes `measure` adds to fixed memory
    torch.manual_seed(0)
    model = nn.Sequential(*[_Standardise() for _ in range(4)]).train()
    x = torch.randn(2, 2048)
    prof = profile(model, x, repeats=1)
    assert prof.held_bytes == 0
    made = [n for n in prof.nodes if n.op == "aten.lift_fresh.default"]
    assert len(made) == 8 and all(prof.storage_bytes[n.storage] == 2048 * 4 for n in made)
    predicted, measured = simulate(prof).peak_bytes, measure(model, x, repeats=1).peak_bytes
    assert abs(predicted - measured) <= 64, (predicted, measured)
    sim, measured = _region_peaks(prof, model, x, ["1", "2"])
    assert abs(sim.peak_bytes - measured) <= 64, (sim.peak_bytes, measured)
    fake = profile(model, x, mode="estimate", device=cpu_spec(measure=False))  # same storages
    assert [n.op for n in fake.nodes] == [n.op for n in prof.nodes]
    assert fake.held_bytes == 0 and simulate(fake).peak_bytes == simulate(prof).peak_bytes


class _ScaledAdapter(nn.Module):
    """A frozen projection with a trainable low-rank branch scaled by a Python number, as
    PEFT's LoRA adds it (``base(x) + up(down(x)) * scaling``), then divided by a Python
    number, as diffusers' blocks do (``/ output_scale_factor``)."""

    def __init__(self, width: int = 32, rank: int = 4):
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.down, self.up = nn.Linear(width, rank, bias=False), nn.Linear(rank, width, bias=False)

    def forward(self, x):
        return (self.base(x) + self.up(self.down(x)) * 2.0) / 1.5


def test_numbers_autograd_saves_without_the_pack_hook_are_counted():
    # `h * 2.0` and `h / 1.5` save the numbers as 8-byte CPU tensors for h's backward, and
    # wrapped numbers bypass saved-tensor hooks: the recorder sees neither a tensor nor a pack.
    torch.manual_seed(0)
    # (the recorder's own dispatch wraps the numbers again while the op runs, which a plain
    # step does not: kept out of the ops' measured workspace)
    model = nn.Sequential(*[_ScaledAdapter() for _ in range(48)]).train()
    x = torch.randn(256, 32)
    prof = profile(model, x, repeats=1)
    torch.manual_seed(0)
    predicted, measured = simulate(prof).peak_bytes, measure(model, x, repeats=1).peak_bytes
    assert abs(predicted - measured) <= 64, (predicted, measured)
    wrapped = [s for n in prof.nodes for s in n.new_storages
               if s != n.storage and n.op in ("aten.mul.Tensor", "aten.div.Tensor")]
    assert len(wrapped) == 96 and {prof.storage_bytes[s] for s in wrapped} == {8}
    # checkpointed, the nodes inside a region save them too; a replay saves them again
    sim, measured = _region_peaks(prof, model, x, [str(i) for i in range(0, 48, 2)])
    assert abs(sim.peak_bytes - measured) <= 64, (sim.peak_bytes, measured)
    # a product that takes no gradient (the branch frozen, the base trained) saves nothing
    flipped = _ScaledAdapter().requires_grad_(False)
    flipped.base.requires_grad_(True)
    prof = profile(flipped, x, repeats=1)
    assert [n.op for n in prof.nodes for s in n.new_storages
            if s != n.storage and n.op in ("aten.mul.Tensor", "aten.div.Tensor")] == ["aten.div.Tensor"]


class _SinHead(nn.Module):
    """Work on the input before the first parameter: only the input's own gradient needs it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 8)

    def forward(self, x):
        return self.fc(torch.sin(x))


def test_an_input_that_requires_grad_gets_its_gradient_in_the_recorded_backward():
    """``loss.backward()`` writes the gradient of every leaf that requires grad, an input too
    (adversarial training, a gradient penalty, forces by positions). The recording took the
    parameters' gradients only, so the backward of the sine (and the gradients it makes) was
    missing from the prediction. Measuring a step leaves the input's gradient as it was."""
    torch.manual_seed(0)
    model = _SinHead().train()
    x = torch.randn(4096, 256).requires_grad_()
    prof = profile(model, (x,), repeats=1)
    assert any(n.phase == "backward" and n.op == "aten.cos.default" for n in prof.nodes)
    m = measure(model, (x,), repeats=1)
    assert x.grad is None
    assert simulate(prof, ()).peak_bytes == m.peak_bytes


class _ForcesPotential(nn.Module):
    """An energy model trained on forces, minus the energy's gradient by positions taken in
    forward with ``create_graph=True``, beside a head on the same positions that is not
    differentiated there."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                                  nn.Linear(256, 1))
        self.head = nn.Sequential(nn.Linear(3, 256), nn.Tanh(), nn.Linear(256, 1))

    def forward(self, pos):
        pos = pos.requires_grad_(True) if not pos.requires_grad else pos
        energy = self.body(pos).sum()
        forces = -torch.autograd.grad(energy, pos, create_graph=True)[0]
        return energy, forces, self.head(pos.detach())


def test_calls_differentiated_inside_forward_are_not_regions():
    """A checkpoint on a call that ``torch.autograd.grad`` differentiates inside forward
    replays it there, and the double-backward nodes keep what it recomputed: predicted without
    that, such a region measured above its prediction by a hidden activation. Those calls are
    blocked; a region on the rest of the model holds its prediction."""
    torch.manual_seed(0)
    model = _ForcesPotential().train()
    x = torch.randn(2048, 3)

    def loss_fn(out):
        energy, forces, extra = out
        return energy.square() + forces.square().mean() + extra.square().mean()

    p = plan(model, None, example_inputs=x, loss_fn=loss_fn)
    remove(model)
    blocked = {c.module for c in p.profile.calls if "differentiated inside" in c.blocker}
    assert {"body", "body.0", "body.2", "body.4"} <= blocked
    assert not blocked & {"head", "head.0", "head.2"}
    head = next(s for s in candidate_calls(p.profile) if s.call.module == "head"
                and s.segment is None)
    regions = bind(p.profile, (region(p.profile, head.a, head.b),))
    apply_schedule(model, Schedule(regions=regions, method="test", status="feasible"))
    try:
        assert simulate(p.profile, regions).peak_bytes == measure(
            model, (x,), loss_fn, repeats=1).peak_bytes
    finally:
        remove(model)


class _Attention(nn.Module):
    """Takes keyword arguments it does not use, as HF attention modules do (``**kwargs``)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(32, 32)

    def forward(self, x, **kwargs):
        return torch.softmax(self.q(x), -1) * x


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Attention()
        self.mlp = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 32))

    def forward(self, x, **kwargs):
        x = x + self.attn(x, **kwargs)
        return x + self.mlp(x)


class _Encoder(nn.Module):
    """Passes its keyword arguments on to every layer (BERT's ``**kwargs``)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.layers = nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, ids, **kwargs):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, **kwargs)
        return x


class _WritesFeatures(nn.Module):
    """sentence-transformers' `Transformer` module: calls the encoder with every key of the
    ``features`` dict it is given and writes its output into that dict."""

    def __init__(self):
        super().__init__()
        self.encoder = _Encoder()

    def forward(self, features):
        features["token_embeddings"] = self.encoder(**features)
        return features


class _BiEncoder(nn.Module):
    """Both columns of a pair through the same module (MultipleNegativesRankingLoss)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = _WritesFeatures()

    def forward(self, anchors, positives):
        a = self.body(anchors)["token_embeddings"].mean(1)
        p = self.body(positives)["token_embeddings"].mean(1)
        return a @ p.T


def _pairs(n: int, length: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(n * length)
    return ({"ids": torch.randint(0, 100, (n, length), generator=g)},
            {"ids": torch.randint(0, 100, (n, length), generator=g)})


def _ranking_loss(scores):
    return F.cross_entropy(scores, torch.arange(len(scores)))


def test_steps_the_planner_runs_leave_the_dicts_they_are_given_as_they_were():
    """Found on sentence-transformers: its modules write their outputs into the ``features``
    dict they are called with, and the model passes that dict's keys on to BERT. The planner's
    warm-up step left its outputs in the user's example dicts, the recorded step then carried
    them (counted as held tensors), and `measure` counted them twice: once among the inputs,
    once as held. Every step the planner runs now starts from the inputs as given."""
    model, inputs = _BiEncoder().train(), _pairs(64, 48)
    p = plan(model, None, example_inputs=inputs, loss_fn=_ranking_loss, repeats=1)
    remove(model)
    assert [list(d) for d in inputs] == [["ids"], ["ids"]]
    assert p.profile.held_bytes == 0
    m = measure(model, inputs, _ranking_loss, repeats=1)
    assert [list(d) for d in inputs] == [["ids"], ["ids"]]
    assert simulate(p.profile).peak_bytes == m.peak_bytes


def test_a_replay_starts_from_the_dicts_its_region_was_given():
    """The same model, its shared module checkpointed on both calls with an attention region
    nested inside: the outer region's replay ran on the ``features`` dict as forward left it,
    so the encoder passed the forward's ``token_embeddings`` on as a keyword argument, the
    nested region took it as one more input, and torch's check of the replay raised
    CheckpointError. The replay now starts from the dict's contents as forward found them and
    gives the dict back what forward left in it."""
    model, inputs = _BiEncoder().train(), _pairs(64, 48)
    prof = profile(model, inputs, loss_fn=_ranking_loss, repeats=1)
    want = {"body", "body.encoder.layers.1.attn"}
    spans = [s for group in shared_calls(prof) for s in group if s.call.module in want]
    assert len(spans) == 4
    regions = bind(prof, tuple(region(prof, s.a, s.b)
                               for s in sorted(spans, key=lambda s: (s.a, -s.b))))
    def step(batch):
        for q in model.parameters():
            q.grad = None
        loss = _ranking_loss(model(*batch))
        after_forward = [d["token_embeddings"] for d in batch]
        loss.backward()
        # forward's embeddings stay in the dicts, not the replay's (which hold its graph)
        assert all(d["token_embeddings"] is t for d, t in zip(batch, after_forward))
        return loss.detach(), {k: q.grad.clone() for k, q in model.named_parameters()}

    want_loss, want_grads = step(_pairs(32, 20))  # another shape, on fresh dicts, as training
    apply_schedule(model, Schedule(regions=regions))
    try:
        loss, grads = step(_pairs(32, 20))
        torch.testing.assert_close(loss, want_loss)
        for name, g in want_grads.items():
            torch.testing.assert_close(grads[name], g)
        m = measure(model, inputs, _ranking_loss, repeats=1)
        assert simulate(prof, regions).peak_bytes == m.peak_bytes
    finally:
        remove(model)


def test_a_model_that_pops_its_labels_from_the_batch_is_planned():
    """A forward that takes its labels out of the batch dict it is given (``batch.pop("labels")``,
    as many training loops' loss code does): the planner's warm-up step took them, and the
    recorded step raised KeyError, reported as the model's own error. Each step the planner
    runs now gets the batch as the user gave it, and leaves it so."""

    class PopsLabels(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 10))

        def forward(self, batch):
            labels = batch.pop("labels")
            return F.cross_entropy(self.body(batch["x"]), labels)

    torch.manual_seed(0)
    model = PopsLabels()
    batch = {"x": torch.randn(64, 32), "labels": torch.randint(0, 10, (64,))}
    p = plan(model, None, example_inputs=(batch,), loss_fn=lambda loss: loss, repeats=1)
    try:
        assert set(batch) == {"x", "labels"}
        v = p.verify(repeats=1)
        assert v.max_grad_rel_err == 0 and v.measured_peak_bytes == v.predicted_peak_bytes
        assert set(batch) == {"x", "labels"}
    finally:
        remove(model)


class _NetworkOutsideTheTree(nn.Module):
    """torchrl's loss modules: the network the loss runs is not a submodule (kept in the
    instance's ``__dict__``), so no region can be placed on it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.__dict__["net"] = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512),
                                             nn.ReLU())
        self.head = nn.Linear(512, 1)

    def forward(self, x):
        return self.head(self.net(x)).square().mean()


def test_the_report_names_the_modules_the_step_runs_from_outside_the_model():
    """Found on torchrl's ClipPPOLoss: its actor and critic are not submodules of the loss
    module, the plan had no regions, and nothing said why. The recording notes the modules
    with parameters forward runs from outside the model's tree; the report names them, and so
    does the error for a budget below what the rest can reach. A plan's repr is one line (it
    printed the whole profile, every op of the step)."""
    model, x = _NetworkOutsideTheTree().train(), torch.randn(256, 32)
    p = plan(model, None, example_inputs=x, loss_fn=lambda loss: loss, repeats=1)
    try:
        (outside,) = p.profile.meta.outside_modules
        assert outside.startswith("Sequential (1 call, ") and not outside.endswith(" 0 ops)")
        assert "not submodules of the model" in p.report() and outside in p.report()
        assert "\n" not in repr(p) and len(repr(p)) < 300 and "regions" in repr(p)
        # the profile keeps them through a save and a load
        assert Profile.from_dict(json.loads(json.dumps(p.profile.to_dict()))).meta.outside_modules == [outside]
    finally:
        remove(model)
    with pytest.raises(InfeasibleBudgetError, match="Sequential"):
        plan(model, budget_bytes=p.profile.fixed_bytes, example_inputs=x,
             loss_fn=lambda loss: loss, repeats=1)
    remove(model)


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(),
                                                    nn.Linear(256, 64)) for _ in range(4)])
        self.head = nn.Linear(64, 10)


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    y: torch.Tensor


class _GraphLike:
    """PyG's `Data`: tensors in a mapping among its attributes, and callable."""

    def __init__(self, **tensors):
        self._store = dict(tensors)

    def __getattr__(self, name):
        try:
            return self.__dict__["_store"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __call__(self, *keys):
        return [self._store[k] for k in keys]


class _TakesABatchObject(_Blocks):
    def forward(self, batch):
        return F.cross_entropy(self.head(self.blocks(batch.x)), batch.y)


class _ScalesItsInputInPlace(_Blocks):
    def forward(self, x, y):
        x.mul_(2.0)  # normalizes the batch it is given, in place
        return F.cross_entropy(self.head(self.blocks(x)), y)


@pytest.mark.parametrize("kind", ["dataclass", "object"])
def test_a_batch_object_is_planned_with_its_tensors_as_inputs(kind):
    """A batch passed as one object (a dataclass, PyG's `Data`) was refused: "example_inputs
    holds no tensor", pytree seeing one leaf. The tensors its fields and attributes hold are
    the step's inputs now: counted as inputs, their shapes in the plan's `made_for`."""
    x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    batch = _Batch(x, y) if kind == "dataclass" else _GraphLike(x=x, y=y)
    model = _TakesABatchObject().train()
    p = plan(model, None, example_inputs=(batch,), loss_fn=lambda loss: loss, repeats=1)
    try:
        assert p.schedule.regions
        assert p.profile.input_bytes == x.nbytes + y.nbytes and p.profile.held_bytes == 0
        assert sorted(p.profile.meta.input_shapes.values()) == [[512], [512, 64]]
        v = p.verify(repeats=1)
        assert v.max_grad_rel_err == 0 and v.measured_peak_bytes == v.predicted_peak_bytes
    finally:
        remove(model)


def test_a_forward_that_writes_its_input_in_place_is_planned_on_the_batch_as_given():
    """A forward that scales its input tensor in place: each step the planner ran saw the
    batch the step before left, and `verify` compared the unplanned model's step with the
    planned one's on other inputs, then blamed the model's randomness (NotReproducibleError).
    Each step the planner runs now writes back the input values it changed."""
    x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    given = x.clone()
    model = _ScalesItsInputInPlace().train()
    p = plan(model, None, example_inputs=(x, y), loss_fn=lambda loss: loss, repeats=1)
    try:
        assert torch.equal(x, given)
        v = p.verify(repeats=1)
        assert v.loss_original == v.loss_planned and v.max_grad_rel_err == 0
        assert v.measured_peak_bytes == v.predicted_peak_bytes
        assert torch.equal(x, given)
    finally:
        remove(model)


def test_what_a_tokenizer_returns_is_passed_as_keyword_arguments():
    """`tokenizer(texts, return_tensors="pt")` returns a `BatchEncoding` (a `UserDict`, not a
    dict), which training code passes as ``model(**batch)``. Given as example_inputs it was
    taken as one positional argument, and the model raised inside its embeddings (an
    AttributeError with an empty message). It is keyword arguments now, as a dict is."""
    transformers = pytest.importorskip("transformers")
    case = CASES["gpt2_padded"]()
    model, given = case.model, case.inputs
    batch = transformers.BatchEncoding(dict(given))
    p = plan(model, None, example_inputs=batch, loss_fn=case.loss_fn, repeats=1)
    try:
        assert p.schedule.regions and "input_ids" in str(p.profile.meta.input_shapes)
        v = p.verify(repeats=1)
        assert v.max_grad_rel_err == 0 and v.measured_peak_bytes == v.predicted_peak_bytes
    finally:
        remove(model)


def test_a_loss_that_is_not_finite_is_named_not_blamed_on_randomness():
    """SimCSE's mean pooling on a batch with a row of padding only: the loss is nan, and
    `verify` said the model's step "does not depend on torch's RNG state alone" (nan differs
    from nan). Planning now warns that the example step's loss is not finite, and `verify`
    says so and what to check."""

    class MaskedMean(_Blocks):
        def forward(self, x, mask):
            h = self.blocks(x) * mask.unsqueeze(-1)
            return self.head(h.sum(1) / mask.sum(1, keepdim=True)).square().mean()

    x, mask = torch.randn(8, 16, 64), torch.ones(8, 16)
    mask[3] = 0  # a row that is all padding
    model = MaskedMean().train()
    with pytest.warns(UserWarning, match="loss is nan"):
        p = plan(model, None, example_inputs=(x, mask), loss_fn=lambda loss: loss, repeats=1)
    try:
        with pytest.raises(ModelRunError, match="loss is nan on the example inputs"):
            p.verify(repeats=1)
    finally:
        remove(model)
