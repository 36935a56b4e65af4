"""Vision transformers from lucidrains' vit-pytorch, in fp32 and under bf16 autocast (the
twenty-first probe).

    python benchmarks/vit_probe.py [model ...] [-n 6] [--fp32-only]

vit-pytorch is one author's reading of some thirty papers, each a file of plain torch and
einops, written nothing like transformers' layers: CaiT's layer scale, class-attention layers
and layers dropped at random; CrossViT's two patch sizes exchanging class tokens; DeepViT's
re-attention mixing heads; T2T's soft split by ``nn.Unfold``; Twins' local and global
attention; MaxViT's MBConv (BatchNorm, squeeze-excitation, stochastic depth) with block and
grid attention; NaViT's variable-size images packed into one sequence with value-dependent
masks and token dropout; MobileViT's convolutions around unfolded transformers; CvT's
convolutional projections; PiT's pooling by depthwise convolution; LeViT's attention biases
indexed by relative position; CrossFormer's cross-scale embeddings; XCiT's cross-covariance
attention; a ViT whose patches are merged half way; a simple ViT that keeps a random subset of
its patches in training. Each model is a small configuration with random weights and dropout
where it has one, trained under cross entropy against labels; then as
`families_probe.py` does: planned at its smallest peak and half way, each plan verified and
run on a smaller batch, and `-n` schedules near the smallest-peak one measured. Needs ``pip
install --no-deps vit-pytorch`` (and einops): its package ``__init__`` imports DINO's
augmentations from torchvision, which does not import beside this CPU torch, so the probe
stands a stub in for it (no model here uses it). Not part of the test suite (minutes of CI).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import families_probe  # noqa: E402
from benchmarks.libraries_probe import _labels_loss  # noqa: E402
from tests.zoo import Case  # noqa: E402


def _vit_pytorch(module: str) -> types.ModuleType:
    """``vit_pytorch.<module>``, with a stub for torchvision if it is not importable."""
    import importlib

    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or a build that does not match torch
        stub = types.ModuleType("torchvision")
        stub.transforms = types.ModuleType("torchvision.transforms")
        sys.modules["torchvision"] = stub
        sys.modules["torchvision.transforms"] = stub.transforms
    return importlib.import_module(f"vit_pytorch.{module}")


def _images(model: nn.Module, size: int, batch: int = 4, small: int | None = None,
            classes: int = 10) -> Case:
    """Images of `size` (a smaller batch at `small`), cross entropy against random labels."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, size, size, generator=g)
    xs = torch.randn(2, 3, small or size, small or size, generator=g)
    labels = torch.randint(0, classes, (batch,), generator=g)
    return Case(model.train(), (x,), _labels_loss(labels), (xs,), "vision")


def _build(module: str, cls: str, size: int, small: int | None = None,
           **kw: Any) -> Callable[[], Case]:
    def build() -> Case:
        torch.manual_seed(0)
        return _images(getattr(_vit_pytorch(module), cls)(num_classes=10, **kw), size,
                       small=small)

    return build


def _na_vit() -> Case:
    """NaViT: a list of lists of images of different sizes, packed into sequences by the model
    (masks built from the sizes, tokens dropped at random per image)."""
    torch.manual_seed(0)
    model = _vit_pytorch("na_vit").NaViT(
        image_size=64, patch_size=8, num_classes=10, dim=64, depth=3, heads=4, mlp_dim=128,
        dropout=0.1, emb_dropout=0.1, token_dropout_prob=0.1)
    g = torch.Generator().manual_seed(1)

    def images(sizes: list[list[tuple[int, int]]]) -> list[list[torch.Tensor]]:
        return [[torch.randn(3, h, w, generator=g) for h, w in group] for group in sizes]

    batch = images([[(64, 64), (32, 48)], [(48, 64)], [(32, 32), (24, 56), (16, 64)]])
    small = images([[(32, 32)], [(16, 48), (32, 16)]])
    labels = torch.randint(0, 10, (6,), generator=g)
    return Case(model.train(), (batch,), _labels_loss(labels), (small,), "vision")


MODELS: dict[str, Callable[[], Case]] = {
    "vit": _build("vit", "ViT", 32, image_size=32, patch_size=4, dim=64, depth=4, heads=4,
                  mlp_dim=128, dropout=0.1, emb_dropout=0.1),
    "cait": _build("cait", "CaiT", 32, image_size=32, patch_size=4, dim=64, depth=4,
                   cls_depth=2, heads=4, mlp_dim=128, dropout=0.1, emb_dropout=0.1,
                   layer_dropout=0.1),
    "cross_vit": _build("cross_vit", "CrossViT", 32, image_size=32, sm_dim=48, lg_dim=64,
                        sm_patch_size=4, sm_enc_depth=1, sm_enc_heads=4, sm_enc_mlp_dim=96,
                        lg_patch_size=8, lg_enc_depth=2, lg_enc_heads=4, lg_enc_mlp_dim=128,
                        cross_attn_depth=1, cross_attn_heads=4, depth=2, dropout=0.1,
                        emb_dropout=0.1),
    "deepvit": _build("deepvit", "DeepViT", 32, image_size=32, patch_size=4, dim=64, depth=4,
                      heads=4, mlp_dim=128, dropout=0.1, emb_dropout=0.1),
    "t2t": _build("t2t", "T2TViT", 32, image_size=32, dim=64, depth=3, heads=4, mlp_dim=128,
                  dropout=0.1, t2t_layers=((7, 4), (3, 2))),
    "max_vit": _build("max_vit", "MaxViT", 32, dim=32, depth=(1, 2), dim_head=16,
                      dim_conv_stem=32, window_size=4, dropout=0.1),
    "na_vit": _na_vit,
    "mobile_vit": _build("mobile_vit", "MobileViT", 64, image_size=(64, 64),
                         dims=[48, 64, 80], channels=[8, 16, 24, 24, 32, 32, 40, 40, 48, 48,
                                                      160]),
    "cvt": _build("cvt", "CvT", 64, s1_emb_dim=32, s2_emb_dim=48, s2_heads=2, s2_depth=1,
                  s3_emb_dim=64, s3_heads=2, s3_depth=2, dropout=0.1),
    "pit": _build("pit", "PiT", 32, image_size=32, patch_size=4, dim=32, depth=(1, 1, 1),
                  heads=2, mlp_dim=64, dropout=0.1, emb_dropout=0.1),
    "levit": _build("levit", "LeViT", 64, image_size=64, dim=(32, 48, 64), depth=2,
                    heads=(2, 3, 4), mlp_mult=2, dropout=0.1),
    "crossformer": _build("crossformer", "CrossFormer", 64, dim=(32, 64, 96, 128),
                          depth=(1, 1, 2, 1), global_window_size=(4, 2, 1, 1),
                          local_window_size=2, attn_dropout=0.1, ff_dropout=0.1),
    "xcit": _build("xcit", "XCiT", 32, image_size=32, patch_size=4, dim=64, depth=3,
                   cls_depth=1, heads=4, mlp_dim=128, dropout=0.1, emb_dropout=0.1,
                   layer_dropout=0.1),
    "patch_merger": _build("vit_with_patch_merger", "ViT", 32, image_size=32, patch_size=4,
                           dim=64, depth=4, heads=4, mlp_dim=128, patch_merge_layer=2,
                           patch_merge_num_tokens=8, dropout=0.1, emb_dropout=0.1),
    "patch_dropout": _build("simple_vit_with_patch_dropout", "SimpleViT", 32, image_size=32,
                            patch_size=4, dim=64, depth=4, heads=4, mlp_dim=128,
                            patch_dropout=0.25),
}


def main(argv: list[str] | None = None) -> int:
    return families_probe.main(argv, MODELS, "model", __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
