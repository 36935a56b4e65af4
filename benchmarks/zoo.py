"""Full-size benchmark models: ResNet-50, U-Net, GPT-2 small, Llama-7B.

Every builder returns ``(model, example_inputs)`` and takes ``device`` (default ``"meta"``: nothing
is materialised, for estimate-mode profiles) and ``dtype`` (default bfloat16), plus the sizes, so
the same definitions serve small real-tensor runs too. The CNNs are plain torch; the transformers
come from Hugging Face `transformers` with SDPA attention.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tests.models import UNet as _TestUNet

__all__ = ["Bottleneck", "ResNet50", "UNet", "resnet50", "unet", "gpt2_small", "llama7b"]


# -- ResNet-50 (He et al. 2016, torchvision layout) -------------------------------------------------
class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand (x4), BatchNorm after each; residual."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    def __init__(
        self,
        layers: tuple[int, ...] = (3, 4, 6, 3),
        widths: tuple[int, ...] = (64, 128, 256, 512),
        classes: int = 1000,
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages = []
        cin = 64
        for i, (n, w) in enumerate(zip(layers, widths, strict=True)):
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, w, stride=2 if (i > 0 and j == 0) else 1))
                cin = w * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet50(
    batch: int = 64,
    image: int = 224,
    *,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.bfloat16,
    layers: tuple[int, ...] = (3, 4, 6, 3),
    widths: tuple[int, ...] = (64, 128, 256, 512),
    classes: int = 1000,
):
    """ResNet-50 (25.6 M parameters at the defaults) on a batch of images; loss: mean logit."""
    torch.manual_seed(0)
    with torch.device(device):
        model = ResNet50(tuple(layers), tuple(widths), classes).to(dtype)
        x = torch.randn(batch, 3, image, image, dtype=dtype)
    return model, x


# -- U-Net (Ronneberger et al. 2015, padded convolutions, BatchNorm) ----------------------------------
class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class UNet(_TestUNet):
    """The test zoo's U-Net with in-place ReLUs in its double convolutions."""

    block = DoubleConv


def unet(
    batch: int = 8,
    image: int = 256,
    *,
    base: int = 64,
    depth: int = 4,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.bfloat16,
):
    """U-Net (31 M parameters at base 64, depth 4) on a batch of RGB images; loss: mean output."""
    if image % 2**depth:
        raise ValueError(f"image size {image} must be divisible by 2**depth = {2**depth}")
    torch.manual_seed(0)
    with torch.device(device):
        model = UNet(base, depth).to(dtype)
        x = torch.randn(batch, 3, image, image, dtype=dtype)
    return model, x


# -- Hugging Face transformers ----------------------------------------------------------------------
def _token_batch(batch: int, seq: int, vocab: int, device) -> dict[str, torch.Tensor]:
    with torch.device(device):
        ids = (
            torch.randint(0, vocab, (batch, seq))
            if str(device) != "meta"
            else torch.zeros(batch, seq, dtype=torch.long)
        )
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def gpt2_small(
    batch: int = 8,
    seq: int = 1024,
    *,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.bfloat16,
    **config_overrides,
):
    """`GPT2LMHeadModel(GPT2Config())` (124 M parameters), SDPA attention, input_ids + labels.

    The config's defaults, dropout 0.1 included. Estimate-mode profiles for a GPU route attention
    with dropout to the fused kernel, as CUDA's flash/memory-efficient kernels do (a CPU trace would
    otherwise take SDPA's math path and store the (seq x seq) probabilities and mask).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(**config_overrides)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = GPT2LMHeadModel(config).to(dtype)
    return model, _token_batch(batch, seq, config.vocab_size, device)


def llama7b(
    batch: int = 1,
    seq: int = 4096,
    *,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.bfloat16,
    **config_overrides,
):
    """A Llama-style 7B (hidden 4096, MLP 11008, 32 layers, 32 heads, vocab 32000; 6.74 B
    parameters), SDPA attention, input_ids + labels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kw = dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=max(4096, seq),
    )
    kw.update(config_overrides)
    config = LlamaConfig(**kw)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model, _token_batch(batch, seq, config.vocab_size, device)


LLAMA3_70B = dict(
    vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
    num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0,
)
"""Llama-3-70B's shape (80 layers, hidden 8192, GQA 64/8, vocab 128256)."""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama3_70b(
    batch: int = 1,
    seq: int = 4096,
    *,
    lora_rank: int | None = None,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.bfloat16,
    **config_overrides,
):
    """Llama-3-70B from its config (random or meta weights), SDPA attention, bf16, input_ids +
    labels, use_cache=False. With `lora_rank`, PEFT LoRA of that rank on every attention and MLP
    projection, adapters kept in the base's bf16 (``autocast_adapter_dtype=False``: PEFT's
    default upcasts them to fp32, which makes every projection's output fp32), base frozen."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kw = dict(LLAMA3_70B, max_position_embeddings=max(8192, seq))
    kw.update(config_overrides)
    config = LlamaConfig(**kw)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    if lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=list(LORA_TARGETS))
        model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    model.train()
    return model, _token_batch(batch, seq, config.vocab_size, device)
