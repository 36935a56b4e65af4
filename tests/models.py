"""A zoo of small models for tests and benchmarks.

Every builder takes keyword sizes with small defaults and returns ``(model, example_inputs)``, where
``example_inputs`` is a tensor, a tuple of positional arguments, or a dict of keyword arguments.
Weights are random (``torch.manual_seed(0)`` inside each builder), float32, on CPU. The defaults are
sized so that one training step takes roughly 20-150 ms on a 2-core CPU and activation memory is
several times parameter memory, which is the regime activation checkpointing is for.

The planner's default loss is ``output.loss`` when the output has one (the HF models, which get
``labels``), else ``output.float().mean()``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "TINY",
    "deep_narrow_cnn",
    "gpt_eager",
    "hf_gpt2",
    "hf_llama",
    "ln_linear_stack",
    "mlp_dropout",
    "resnet_bn",
    "unet",
]


# -- MLP ---------------------------------------------------------------------------------------


def mlp_dropout(batch: int = 2048, dim: int = 256, depth: int = 4, p: float = 0.1):
    """A Linear/GELU/Dropout stack; the dropout makes replay need the RNG state."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(dim, dim), nn.GELU(), nn.Dropout(p)]
    layers.append(nn.Linear(dim, dim))
    model = nn.Sequential(*layers)
    return model, torch.randn(batch, dim)


# -- nanoGPT-style GPT with eager attention ----------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, block_size: int, dropout: float = 0.0):
        super().__init__()
        assert dim % heads == 0
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hs = C // self.heads
        q = q.view(B, T, self.heads, hs).transpose(1, 2)
        k = k.view(B, T, self.heads, hs).transpose(1, 2)
        v = v.view(B, T, self.heads, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_drop(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class GPTMLP(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, block_size: int, dropout: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, block_size, dropout)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = GPTMLP(dim, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab: int,
        block_size: int,
        dim: int,
        heads: int,
        layers: int,
        dropout: float = 0.0,
        tie_weights: bool = True,
    ):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            GPTBlock(dim, heads, block_size, dropout) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_eager(
    batch: int = 8,
    seq: int = 128,
    dim: int = 128,
    heads: int = 4,
    layers: int = 4,
    vocab: int = 512,
    dropout: float = 0.0,
    tie_weights: bool = True,
):
    """A plain-torch nanoGPT with eager attention (q@k^T, masked_fill, softmax, dropout, @v)."""
    torch.manual_seed(0)
    model = GPT(vocab, seq, dim, heads, layers, dropout, tie_weights)
    idx = torch.randint(0, vocab, (batch, seq))
    return model, idx


# -- Hugging Face models -----------------------------------------------------------------------


def _hf_build(model_cls, config, attn_implementation: str | None):
    """Construct an HF model with the requested attention implementation where supported."""
    model = None
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
        try:
            model = model_cls(config, attn_implementation=attn_implementation)
        except TypeError:
            model = None
    if model is None:
        model = model_cls(config)
    if getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"  # what transformers falls back to, minus its warning
    return model


def hf_gpt2(
    batch: int = 8,
    seq: int = 128,
    layers: int = 2,
    n_embd: int = 128,
    n_head: int = 4,
    vocab: int = 1024,
    attn_implementation: str | None = "sdpa",
):
    """`transformers.GPT2LMHeadModel` with dropout off; inputs carry labels so `.loss` exists."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=max(seq, 128),
        n_embd=n_embd,
        n_layer=layers,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )
    model = _hf_build(GPT2LMHeadModel, config, attn_implementation)
    input_ids = torch.randint(0, vocab, (batch, seq))
    return model, {"input_ids": input_ids, "labels": input_ids, "use_cache": False}


def hf_llama(
    batch: int = 8,
    seq: int = 128,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 344,
    vocab: int = 1024,
    attn_implementation: str | None = "sdpa",
):
    """`transformers.LlamaForCausalLM` (grouped-query attention); inputs carry labels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max(seq, 128),
        attention_dropout=0.0,
    )
    model = _hf_build(LlamaForCausalLM, config, attn_implementation)
    input_ids = torch.randint(0, vocab, (batch, seq))
    return model, {"input_ids": input_ids, "labels": input_ids, "use_cache": False}


# -- CNNs --------------------------------------------------------------------------------------


def _conv_bn_relu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=False),
    )


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int, blocks: tuple[int, ...], classes: int):
        super().__init__()
        self.stem = _conv_bn_relu(3, width)
        stages = []
        cin = width
        for i, n in enumerate(blocks):
            cout = width * 2**i
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                stages.append(BasicBlock(cin, cout, stride))
                cin = cout
        self.blocks = nn.ModuleList(stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))


def resnet_bn(
    batch: int = 8,
    width: int = 32,
    blocks: tuple[int, ...] = (2, 2, 2),
    image: int = 48,
    classes: int = 10,
):
    """A ResNet-like CNN of basic residual blocks with BatchNorm2d."""
    torch.manual_seed(0)
    model = ResNet(width, tuple(blocks), classes)
    return model, torch.randn(batch, 3, image, image)


class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.body = nn.Sequential(_conv_bn_relu(cin, cout), _conv_bn_relu(cout, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class UNet(nn.Module):
    """`depth` down steps (max-pool), a bottleneck, `depth` up steps (transposed conv + skip).
    `block` is the double convolution (benchmarks/zoo.py swaps in one with in-place ReLUs)."""

    block: type[nn.Module] = DoubleConv

    def __init__(self, base: int, depth: int, in_channels: int = 3, out_channels: int = 1):
        super().__init__()
        DoubleConv = self.block  # noqa: N806
        chans = [base * 2**i for i in range(depth + 1)]
        self.downs = nn.ModuleList()
        cin = in_channels
        for c in chans[:-1]:
            self.downs.append(DoubleConv(cin, c))
            cin = c
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = DoubleConv(chans[-2], chans[-1])
        self.ups = nn.ModuleList()
        self.up_convs = nn.ModuleList()
        for c_hi, c_lo in zip(reversed(chans[1:]), reversed(chans[:-1]), strict=True):
            self.ups.append(nn.ConvTranspose2d(c_hi, c_lo, 2, stride=2))
            self.up_convs.append(DoubleConv(2 * c_lo, c_lo))
        self.head = nn.Conv2d(chans[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, conv, skip in zip(self.ups, self.up_convs, reversed(skips), strict=True):
            x = conv(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def unet(batch: int = 4, base: int = 16, depth: int = 3, image: int = 64):
    """A small U-Net: double convs, max-pool down, transposed-conv up, skip concatenation."""
    torch.manual_seed(0)
    assert image % 2**depth == 0, "image size must be divisible by 2**depth"
    model = UNet(base, depth)
    return model, torch.randn(batch, 3, image, image)


def deep_narrow_cnn(batch: int = 4, channels: int = 16, depth: int = 32, image: int = 64):
    """A deep plain conv-BN-ReLU stack at constant resolution and width."""
    torch.manual_seed(0)
    layers = [_conv_bn_relu(3, channels)]
    layers += [_conv_bn_relu(channels, channels) for _ in range(depth - 1)]
    model = nn.Sequential(*layers, nn.Conv2d(channels, 1, 1))
    return model, torch.randn(batch, 3, image, image)


# -- the user's block --------------------------------------------------------------------------


class LNLinear(nn.Module):
    """``x = x + Linear(LayerNorm(x))``."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.norm(x))


class LNLinearStack(nn.Module):
    def __init__(self, dim: int, n: int):
        super().__init__()
        self.blocks = nn.ModuleList(LNLinear(dim) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def ln_linear_stack(batch: int = 64, seq: int = 64, dim: int = 256, n: int = 8):
    """The residual ``x + Linear(LayerNorm(x))`` block stacked `n` times in an nn.ModuleList."""
    torch.manual_seed(0)
    model = LNLinearStack(dim, n)
    return model, torch.randn(batch, seq, dim)


TINY = {
    "mlp_dropout": mlp_dropout,
    "gpt_eager": gpt_eager,
    "hf_gpt2": hf_gpt2,
    "hf_llama": hf_llama,
    "resnet_bn": resnet_bn,
    "unet": unet,
    "ln_linear_stack": ln_linear_stack,
    "deep_narrow_cnn": deep_narrow_cnn,
}
"""Every builder, by name."""


def call(model: nn.Module, inputs):
    """Run `model` on example inputs of any of the three forms."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def accumulated_loop_peak(model: nn.Module, inputs, loss_fn=None, micro_batches: int = 3) -> int:
    """The peak of a training loop that accumulates gradients over `micro_batches` steps from
    none: the running sum of the allocator's events under `torch.profiler`, plus the parameters,
    buffers and inputs held before. It shares no code with `planner.measure`'s held gradients,
    so it can check them."""
    from planner.capture.record import default_loss
    from planner.measurement import fixed_bytes, peak_of

    loss_fn = loss_fn or default_loss
    model.zero_grad(set_to_none=True)
    held = fixed_bytes(model, inputs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        for _ in range(micro_batches):
            loss = loss_fn(call(model, inputs))
            loss.backward()
            del loss
    model.zero_grad(set_to_none=True)
    return held + peak_of(prof)
