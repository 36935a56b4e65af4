"""`planner.profiler.profile` against the truth: measured memory, FlopCounterMode, eager autograd.

Every TINY model is profiled once in measure mode (``repeats=1``) and the result is shared by the
tests below; the whole file runs in well under a minute on a 2-core CPU.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from planner.devices import cpu_spec
from planner.measure import measure
from planner.profiler import profile, profile_with_trace
from planner.trace import TraceError, default_loss, split_inputs
from solvers.errors import CkptPlannerError

try:
    from tests.models import TINY, hf_llama, mlp_dropout
except ImportError:  # pytest run from another directory: tests/ itself is on sys.path
    from models import TINY, hf_llama, mlp_dropout

NAMES = list(TINY)

# Ops FlopCounterMode has a formula for (plus the CPU SDPA kernel the profiler registers).
MATMUL_OPS = (
    "aten.mm.",
    "aten.addmm.",
    "aten.bmm.",
    "aten.baddbmm.",
    "aten.convolution.",
    "aten._scaled_dot_product_flash_attention_for_cpu.",
)


@functools.cache
def _profiled(name: str):
    """(model, inputs, ProfiledTrace, wall seconds of profile) for a TINY model, built once."""
    model, inputs = TINY[name]()
    t0 = time.perf_counter()
    pt = profile_with_trace(model, inputs, repeats=1)
    return model, inputs, pt, time.perf_counter() - t0


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **{f"p:{k}": v.detach().clone() for k, v in model.named_parameters()},
        **{f"b:{k}": v.detach().clone() for k, v in model.named_buffers()},
    }


# -- memory ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_saved_bytes_match_measured_retained(name):
    model, inputs, pt, _ = _profiled(name)
    saved = pt.profile.saved_bytes
    retained = measure(model, inputs, repeats=1).retained_bytes
    assert saved > 0
    assert abs(saved - retained) / retained < 0.02, (saved, retained)


# -- FLOPs ----------------------------------------------------------------------------------------
def test_cpu_sdpa_flop_formula_is_registered():
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        pytest.skip("this torch has no CPU flash-attention kernel")
    assert op.default in flop_registry or op in flop_registry


@pytest.mark.parametrize("name", NAMES)
def test_forward_flops_match_flop_counter(name):
    model, inputs, pt, _ = _profiled(name)
    forward = [n for n in pt.profile.nodes if n.phase == "forward"]
    ours = sum(n.flops for n in forward if n.op.startswith(MATMUL_OPS))
    assert ours == sum(n.flops for n in forward), "FLOPs on an op that is not a matmul/conv"
    buffers = {k: v.clone() for k, v in model.named_buffers()}  # BatchNorm stats stay put
    args, kwargs = split_inputs(inputs)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        torch.func.functional_call(
            model, {**dict(model.named_parameters()), **buffers}, args, kwargs
        )
    assert ours == counter.get_total_flops() > 0
    if name.startswith("hf_"):  # the SDPA kernel is counted, with the standard formula
        sdpa = [n for n in forward if "scaled_dot_product" in n.op]
        assert sdpa and all(n.flops > 0 for n in sdpa)


# -- the joint graph ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_joint_graph_reproduces_eager_loss_and_grads(name):
    model, inputs, pt, _ = _profiled(name)
    trace = pt.trace
    named_p = dict(model.named_parameters())
    named_b = dict(model.named_buffers())
    params = [named_p[k].detach() for k in trace.param_names]
    ins = [x for x in pytree.tree_leaves(split_inputs(inputs)) if isinstance(x, torch.Tensor)]
    with torch.random.fork_rng():
        torch.manual_seed(1)
        loss, grads, _outs = trace.gm(params, [named_b[k].clone() for k in trace.buffer_names], ins)

    args, kwargs = split_inputs(inputs)
    eager_p = {k: v.detach().requires_grad_(v.requires_grad) for k, v in named_p.items()}
    with torch.random.fork_rng():
        torch.manual_seed(1)
        out = torch.func.functional_call(
            model, {**eager_p, **{k: v.clone() for k, v in named_b.items()}}, args, kwargs
        )
        eager_loss = default_loss(out)
    wrt = [eager_p[k] for k, tr in zip(trace.param_names, trace.trainable) if tr]
    eager_grads = torch.autograd.grad(eager_loss, wrt)
    torch.testing.assert_close(loss, eager_loss)
    assert len(grads) == len(eager_grads)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)


# -- profiling has no side effects ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp_dropout", "resnet_bn", "hf_gpt2"])
def test_profile_does_not_change_model_or_rng(name):
    model, inputs = TINY[name]()
    model.train()
    before = _state(model)
    torch.manual_seed(1234)
    rng = torch.random.get_rng_state()
    profile(model, inputs, repeats=1)
    assert torch.equal(torch.random.get_rng_state(), rng)
    after = _state(model)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert model.training


# -- estimate mode --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp_dropout", "hf_llama", "resnet_bn"])
def test_estimate_mode_matches_measure_mode_memory(name):
    model, inputs, pt, _ = _profiled(name)
    measured = pt.profile
    # a CPU spec: the same kernels as the measured run (a GPU spec resizes dropout masks, below)
    est = profile(model, inputs, mode="estimate", device=cpu_spec(measure=False))
    assert est.storage_bytes == measured.storage_bytes
    assert est.saved_bytes == measured.saved_bytes
    assert [n.name for n in est.nodes] == [n.name for n in measured.nodes]
    assert [n.flops for n in est.nodes] == [n.flops for n in measured.nodes]
    assert est.meta.mode == "estimate" and est.meta.step_ms_measured is None
    assert est.step_ms > 0
    compute = [n for n in est.nodes if n.phase == "forward" and n.op.startswith(MATMUL_OPS)]
    assert compute and all(n.time_ms > 0 for n in compute)


def test_estimate_for_gpu_keeps_dropout_masks_as_bool():
    """On CUDA/ROCm dropout saves a 1-byte mask (native_dropout); the CPU decomposition's mask has
    the input's dtype (4 bytes here). Everything else is the same."""
    model, inputs, pt, _ = _profiled("mlp_dropout")
    measured = pt.profile
    gpu = profile(model, inputs, mode="estimate", device="h100")
    changed = [s for s, (a, b) in enumerate(zip(gpu.storage_bytes, measured.storage_bytes,
                                                strict=True)) if a != b]
    assert changed, "no dropout mask was resized"
    for s in changed:
        assert gpu.storage_bytes[s] * 4 == measured.storage_bytes[s]
        producer = next(n for n in gpu.nodes if s in n.new_storages)
        assert producer.op == "aten.empty_like.default"
    assert gpu.saved_bytes < measured.saved_bytes


def test_estimate_for_gpu_fuses_attention_with_dropout():
    """With attention dropout, a CPU trace takes SDPA's math path (seq x seq probabilities and
    mask); a GPU estimate keeps the fused kernel instead, as CUDA does, and so saves what the same
    model without attention dropout saves."""
    softmax = ("aten._softmax.default", "aten._safe_softmax.default")

    def build(p_drop):
        model, x = TINY["hf_gpt2"](layers=1)
        for mod in model.modules():
            if hasattr(mod, "attn_dropout"):
                mod.attn_dropout.p = p_drop
        return model, x

    model, x = build(0.1)
    cpu = profile(model, x, mode="estimate", device=cpu_spec(measure=False))
    assert any(n.op in softmax for n in cpu.nodes)  # the math path, so the check below can fail
    saved = {}
    for p_drop in (0.0, 0.1):
        model, x = build(p_drop)
        prof = profile(model, x, mode="estimate", device="h100")
        assert any("_scaled_dot_product_flash_attention" in n.op for n in prof.nodes)
        assert not any(n.op in softmax for n in prof.nodes)
        saved[p_drop] = prof.saved_bytes
    assert saved[0.1] == saved[0.0] < cpu.saved_bytes


def test_estimate_mode_bf16_param_bytes():
    model, x = mlp_dropout(batch=64, dim=64, depth=2)
    model = model.to(torch.bfloat16)
    x = x.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    p = profile(model, x, mode="estimate", device="h100")
    assert p.param_bytes == 2 * n_params
    assert p.grad_bytes == 2 * n_params
    assert p.meta.dtype == "bfloat16"
    assert p.step_ms > 0


def test_estimate_meta_device_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in model.parameters())
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    n_params = sum(p.numel() for p in model.parameters())
    p = profile(model, {"input_ids": ids, "labels": ids}, mode="estimate", device="h100")
    assert p.param_bytes == 2 * n_params
    assert p.input_bytes == 2 * ids.numel() * 8  # input_ids and labels: separate leaves
    assert p.saved_bytes > 0 and p.step_ms > 0
    # Same architecture on real weights: identical memory picture.
    real, inputs = hf_llama(
        batch=2, seq=64, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=172, vocab=512
    )
    real = real.to(torch.bfloat16)
    inputs = {"input_ids": inputs["input_ids"], "labels": inputs["input_ids"].clone()}
    q = profile(real, inputs, mode="estimate", device="h100")
    assert q.saved_bytes == p.saved_bytes


# -- errors ---------------------------------------------------------------------------------------
class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # data-dependent Python control flow
            return self.b(h)
        return h


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Branchy()

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("mode", ["measure", "estimate"])
def test_untraceable_model_raises_trace_error_naming_module(mode):
    with pytest.raises(TraceError, match="'inner'") as info:
        profile(_Outer(), torch.randn(4, 8), mode=mode, repeats=1)
    assert "_Outer" in str(info.value)


def test_measure_mode_on_meta_model_raises():
    with torch.device("meta"):
        model = nn.Linear(8, 8)
    with pytest.raises(CkptPlannerError, match="meta device.*estimate"):
        profile(model, torch.randn(4, 8, device="meta"), repeats=1)


# -- cost of profiling ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_profile_records_eager_step_time(name):
    _, _, pt, wall = _profiled(name)
    step_ms = pt.profile.meta.step_ms_measured
    assert step_ms is not None and step_ms > 0
    assert pt.profile.meta.mode == "measure"
    # One warm-up and one timed op-by-op run, a traced and an analysed run, and eager steps:
    # profiling a tiny model costs at most a few hundred eager steps.
    assert wall * 1e3 < 500 * step_ms + 5000, (wall, step_ms)
