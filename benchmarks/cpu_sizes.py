"""The comparison's benchmark models at the sizes issue 5 asks for: a training step takes 0.1-1 s
on the 2-core CPU this project is developed on (float32, one eager step, no checkpointing).

Same definitions as the test zoo (`tests/models.py`), larger sizes. Use as a model spec:

    ckpt-planner compare benchmarks.cpu_sizes:gpt_eager -o benchmarks/compare/gpt_eager

The eager step time of each (`none` in benchmarks/compare/<model>/results.json, tcmalloc, 2
threads) is in benchmarks/RESULTS.md's summary table.
"""

from __future__ import annotations

from tests import models as _m

__all__ = ["gpt_eager", "hf_gpt2", "hf_llama", "resnet_bn", "unet", "deep_narrow_cnn", "SIZES"]

SIZES: dict[str, dict] = {
    "gpt_eager": dict(batch=8, seq=256, dim=256, heads=8, layers=6, vocab=2048),
    "hf_gpt2": dict(batch=8, seq=256, layers=6, n_embd=256, n_head=8, vocab=2048),
    "hf_llama": dict(
        batch=8, seq=256, layers=6, hidden=256, heads=8, kv_heads=4, intermediate=688, vocab=2048
    ),
    "resnet_bn": dict(batch=16, width=32, blocks=(2, 2, 2), image=64),
    "unet": dict(batch=8, base=16, depth=3, image=112),
    "deep_narrow_cnn": dict(batch=8, channels=16, depth=32, image=64),
}
"""Keyword sizes per test-zoo builder."""


def gpt_eager():
    """nanoGPT with eager attention: 6 layers, dim 256, 8 heads, seq 256, batch 8 (5.3 M params)."""
    return _m.gpt_eager(**SIZES["gpt_eager"])


def hf_gpt2():
    """HF GPT-2 (SDPA): 6 layers, 256 wide, 8 heads, seq 256, batch 8 (5.3 M params)."""
    return _m.hf_gpt2(**SIZES["hf_gpt2"])


def hf_llama():
    """HF Llama (SDPA, GQA 8/4 heads): 6 layers, hidden 256, MLP 688, seq 256, batch 8."""
    return _m.hf_llama(**SIZES["hf_llama"])


def resnet_bn():
    """ResNet-like CNN with BatchNorm: width 32, blocks (2, 2, 2), 16 images of 64x64."""
    return _m.resnet_bn(**SIZES["resnet_bn"])


def unet():
    """U-Net: base 16, depth 3, 8 images of 112x112."""
    return _m.unet(**SIZES["unet"])


def deep_narrow_cnn():
    """32 conv-BN-ReLU layers of 16 channels, 8 images of 64x64."""
    return _m.deep_narrow_cnn(**SIZES["deep_narrow_cnn"])
