"""Image models from timm (PyTorch Image Models), in fp32 and under bf16 autocast (the
twenty-second probe).

    python benchmarks/timm_probe.py [model ...] [-n 6] [--fp32-only]

timm is where most people who train an image backbone get it, and its layers are written
nothing like transformers' or vit-pytorch's: ``create_model`` with ``drop_rate`` and
``drop_path_rate`` (stochastic depth drawn per sample), its own ``test_*`` configurations (a
ResNet, EfficientNets with batch, group and layer norm, ConvNeXt, a BYOB net, an NFNet with
scaled weight standardisation in forward, CoAtNet and MaxViT, MambaOut, ViTs with and without
relative positions), a ViT whose blocks timm itself checkpoints (``set_grad_checkpointing``, as
its train script's ``--grad-checkpointing`` does), and small configurations of Swin, BEiT
(relative position bias, layer scale), EVA (rotary embeddings, SwiGLU), MLP-Mixer, DenseNet
with its own per-layer checkpoints (``memory_efficient``), Hiera (mask units unrolled and
rerolled), LeViT, PoolFormer, FastViT (re-parameterisable branches), TinyViT, RegNet, Res2Net,
MobileNetV3 and V4, GhostNetV2, NesT, VOLO (outlook attention by fold and unfold) and
ConvMixer. Each is trained under cross entropy against labels on 64 x 64 images; then as
`families_probe.py` does: planned at its smallest peak and half way, each plan verified and run
on a smaller batch, and `-n` schedules near the smallest-peak one measured. Needs ``pip install
--no-deps timm``: timm imports torchvision (transforms, ``FrozenBatchNorm2d``), which does not
import beside this CPU torch, so the probe stands a stub in for it (no model here uses it).
Not part of the test suite (minutes of CI).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
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
from benchmarks.vit_probe import _images  # noqa: E402
from tests.zoo import Case  # noqa: E402

SIZE = 64


class _StubType(type):
    """Any attribute of a stub class is another stub class, one per name (timm keys dicts by
    torchvision's interpolation modes at import time, so the names must differ)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _StubType(name, (cls,), {})
        setattr(cls, name, sub)
        return sub


class _Stub(metaclass=_StubType):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchvision is a stub in this probe")


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _StubType(name, (_Stub,), {})
        setattr(self, name, sub)
        return sub


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``torchvision`` and its submodules get stub modules."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _timm() -> types.ModuleType:
    """``timm``, with a stub for torchvision if it is not importable."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or a build that does not match torch
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _StubFinder())
    import timm

    return timm


def _case(make: Callable[[Any], nn.Module], small: int | None = None) -> Callable[[], Case]:
    """A model made by `make(timm)`; its smaller batch has `small` x `small` images where the
    model takes other sizes (a convolutional net), else images of the same size."""
    def build() -> Case:
        timm = _timm()
        torch.manual_seed(0)
        return _images(make(timm), SIZE, small=small)

    return build


def _named(name: str, small: int | None = 48, **kw: Any) -> Callable[[], Case]:
    """``timm.create_model(name)``: no pretrained weights, 10 classes, dropout and drop path."""
    kw = {"num_classes": 10, "drop_rate": 0.1, "drop_path_rate": 0.1, **kw}
    kw = {k: v for k, v in kw.items() if v is not None}  # None: a model without that option
    return _case(lambda timm: timm.create_model(name, pretrained=False, **kw), small)


def _checkpointed_vit(timm: Any) -> nn.Module:
    model = timm.create_model("test_vit", pretrained=False, num_classes=10, img_size=SIZE, patch_size=8,
                              drop_rate=0.1, drop_path_rate=0.1)
    model.set_grad_checkpointing(True)
    return model


def _cls(module: str, cls: str, small: int | None = None, **kw: Any) -> Callable[[], Case]:
    """``timm.models.<module>.<cls>(**kw)`` with 10 classes."""
    kw = {"num_classes": 10, **kw}
    return _case(lambda timm: getattr(getattr(timm.models, module), cls)(**kw), small)


_DP = {"drop_rate": 0.1, "drop_path_rate": 0.1}

MODELS: dict[str, Callable[[], Case]] = {
    "test_resnet": _named("test_resnet"),
    "test_efficientnet": _named("test_efficientnet"),
    "test_efficientnet_gn": _named("test_efficientnet_gn"),
    "test_efficientnet_ln": _named("test_efficientnet_ln"),
    "test_convnext": _named("test_convnext"),
    "test_byobnet": _named("test_byobnet"),
    "test_nfnet": _named("test_nfnet"),
    "test_coatnet": _named("test_coatnet", None, img_size=SIZE),
    "test_maxvit": _named("test_maxvit", None, img_size=SIZE),
    "test_mambaout": _named("test_mambaout"),
    "test_vit": _named("test_vit", None, img_size=SIZE, patch_size=8),
    "test_vit_relpos": _named("test_vit_relpos", None, img_size=SIZE, patch_size=8),
    "vit_grad_checkpointing": _case(_checkpointed_vit),
    "swin": _cls("swin_transformer", "SwinTransformer", img_size=SIZE, patch_size=4,
                 window_size=4, embed_dim=32, depths=(1, 1, 2, 1), num_heads=(1, 2, 4, 8),
                 **_DP),
    "beit": _cls("beit", "Beit", img_size=SIZE, patch_size=8, embed_dim=64, depth=3,
                 num_heads=4, use_rel_pos_bias=True, use_abs_pos_emb=False, init_values=0.1,
                 **_DP),
    "eva": _cls("eva", "Eva", img_size=SIZE, patch_size=8, embed_dim=64, depth=3, num_heads=4,
                use_rot_pos_emb=True, swiglu_mlp=True, mlp_ratio=2.0, **_DP),
    "mixer": _cls("mlp_mixer", "MlpMixer", img_size=SIZE, patch_size=8, num_blocks=3,
                  embed_dim=64, **_DP),
    "densenet_memory_efficient": _cls("densenet", "DenseNet", 48, growth_rate=8,
                                      block_config=(2, 2, 2, 2), memory_efficient=True,
                                      drop_rate=0.1),
    "hiera": _cls("hiera", "Hiera", img_size=(SIZE, SIZE), embed_dim=32, num_heads=1,
                  stages=(1, 1, 2, 1), drop_path_rate=0.1),
    "levit": _cls("levit", "Levit", img_size=SIZE, embed_dim=(32, 48, 64), key_dim=16,
                  num_heads=(2, 3, 4), depth=(1, 1, 1), **_DP),
    "poolformer": _cls("metaformer", "MetaFormer", 48, depths=(1, 1, 2, 1), dims=(16, 32, 48, 64),
                       drop_path_rate=0.1),
    "fastvit": _cls("fastvit", "FastVit", 48, layers=(1, 1, 1, 1), embed_dims=(16, 32, 64, 64),
                    mlp_ratios=(2, 2, 2, 2),
                    token_mixers=("repmixer", "repmixer", "repmixer", "attention"), **_DP),
    "tiny_vit": _cls("tiny_vit", "TinyVit", embed_dims=(16, 32, 48, 64), depths=(1, 1, 2, 1),
                     num_heads=(1, 2, 3, 4), window_sizes=(4, 4, 4, 2), **_DP),
    "regnet": _named("regnetx_002", drop_path_rate=0.0),
    "res2net": _case(lambda timm: timm.models.resnet.ResNet(
        block=timm.models.res2net.Bottle2neck, layers=[1, 1, 1, 1], base_width=13,
        block_args={"scale": 4}, num_classes=10, **_DP), 48),
    "mobilenetv3": _named("mobilenetv3_small_050"),
    "mobilenetv4": _named("mobilenetv4_conv_small_035"),
    "ghostnetv2": _named("ghostnetv2_100", drop_path_rate=None),
    "nest": _cls("nest", "Nest", img_size=SIZE, patch_size=4, num_levels=3,
                 embed_dims=(32, 48, 64), num_heads=(1, 2, 4), depths=(1, 1, 1), **_DP),
    "volo": _cls("volo", "VOLO", layers=(1, 1, 1, 1), img_size=SIZE,
                 embed_dims=(32, 48, 48, 48), num_heads=(1, 2, 2, 2), **_DP),
    "convmixer": _cls("convmixer", "ConvMixer", 48, dim=64, depth=3, kernel_size=5, patch_size=4),
}


def main(argv: list[str] | None = None) -> int:
    return families_probe.main(argv, MODELS, "model", __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
