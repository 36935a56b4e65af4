"""Training techniques beside plain supervised steps, in fp32 and under bf16 autocast (the
twenty-seventh probe).

    HF_HUB_OFFLINE=1 python benchmarks/techniques_probe.py [model ...] [-n 6] [--fp32-only]

Knowledge distillation (a frozen HF GPT-2 teacher run under ``torch.no_grad()`` inside the
wrapper the user trains, a smaller student, a temperature-scaled KL loss plus cross-entropy);
a GAN's generator step (a DCGAN generator with batch norm, a discriminator with parametrized
spectral norm whose parameters the step freezes, the non-saturating loss); BYOL (an online
CNN encoder, projector and predictor on two augmented views, a target network under
``no_grad``); early-exit training as in LayerSkip (an HF GPT-2 called with
``output_hidden_states=True``, the LM head's loss on every layer's hidden state). Then as
`families_probe.py` does: planned at its smallest peak and half way, each plan verified and
run on a smaller batch, and `-n` schedules near the smallest-peak one measured.

Needs transformers. Not part of the test suite.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.utils.parametrizations import spectral_norm  # noqa: E402

from benchmarks import families_probe  # noqa: E402
from tests.zoo import Case  # noqa: E402

V = 1000


def _gpt2(layers: int, width: int, **kw: Any) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(vocab_size=V, n_positions=128, n_embd=width,
                                     n_layer=layers, n_head=4, use_cache=False, **kw)
    return transformers.GPT2LMHeadModel(config)


class _Distill(nn.Module):
    """A student GPT-2 learning from a frozen, wider and deeper teacher: loss = T^2 KL(student
    / T, teacher / T) + cross-entropy on the next token. The teacher stays in eval mode and
    runs under ``torch.no_grad()``, as distillation code runs it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.teacher = _gpt2(4, 256).eval().requires_grad_(False)
        self.student = _gpt2(3, 128)

    def train(self, mode: bool = True) -> _Distill:
        super().train(mode)
        self.teacher.eval()
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                temperature: float = 2.0) -> torch.Tensor:
        with torch.no_grad():
            t = self.teacher(input_ids=input_ids, attention_mask=attention_mask).logits
        s = self.student(input_ids=input_ids, attention_mask=attention_mask).logits
        kl = F.kl_div(F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1),
                      log_target=True, reduction="none").sum(-1)
        keep = attention_mask.to(kl.dtype)
        kd = (kl * keep).sum() / keep.sum() * temperature ** 2
        labels = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
        ce = F.cross_entropy(s[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)
        return 0.5 * kd + 0.5 * ce


def _padded(rows: int, seq: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Token ids and a mask, row i right-padded by 3 i tokens (modulo half the length)."""
    real = torch.arange(seq) < torch.tensor([seq - 3 * i % (seq // 2)
                                             for i in range(rows)])[:, None]
    ids = torch.randint(5, V, (rows, seq), generator=g).masked_fill(~real, 0)
    return {"input_ids": ids, "attention_mask": real.long()}


def _distill() -> Case:
    g = torch.Generator().manual_seed(1)
    return Case(_Distill().train(), _padded(16, 96, g), lambda loss: loss, _padded(4, 40, g),
                "decoder")


class _GeneratorStep(nn.Module):
    """A DCGAN generator (transposed convolutions, batch norm) and a discriminator with
    parametrized spectral norm; the generator's step freezes the discriminator's parameters
    and returns its logits on the fakes (the loss is the non-saturating one)."""

    def __init__(self, z: int = 64, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)

        def up(i: int, o: int) -> list[nn.Module]:
            return [nn.ConvTranspose2d(i, o, 4, 2, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]

        self.generator = nn.Sequential(
            nn.ConvTranspose2d(z, 4 * width, 4, 1, 0, bias=False), nn.BatchNorm2d(4 * width),
            nn.ReLU(), *up(4 * width, 2 * width), *up(2 * width, width),
            nn.ConvTranspose2d(width, 3, 4, 2, 1), nn.Tanh())

        def down(i: int, o: int) -> list[nn.Module]:
            return [spectral_norm(nn.Conv2d(i, o, 4, 2, 1)), nn.LeakyReLU(0.2)]

        self.discriminator = nn.Sequential(
            *down(3, width), *down(width, 2 * width), *down(2 * width, 4 * width),
            spectral_norm(nn.Conv2d(4 * width, 1, 4, 1, 0)), nn.Flatten())
        self.discriminator.requires_grad_(False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.discriminator(self.generator(z))


def _gan() -> Case:
    g = torch.Generator().manual_seed(1)

    def noise(rows: int) -> tuple[torch.Tensor]:
        return (torch.randn(rows, 64, 1, 1, generator=g),)

    return Case(_GeneratorStep().train(), noise(64), lambda d: F.softplus(-d).mean(),
                noise(16), "vision")


def _encoder(width: int = 32) -> nn.Module:
    layers: list[nn.Module] = []
    c = 3
    for w in (width, 2 * width, 4 * width, 4 * width):
        layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                   nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                   nn.MaxPool2d(2)]
        c = w
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())


def _mlp(i: int, hidden: int, o: int) -> nn.Module:
    return nn.Sequential(nn.Linear(i, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                         nn.Linear(hidden, o))


class _BYOL(nn.Module):
    """BYOL: online encoder, projector and predictor on two views; a target encoder and
    projector (a copy the optimizer does not step, moved by EMA between steps) under
    ``torch.no_grad()``; the symmetric normalized-MSE loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.projector = _encoder(), _mlp(128, 256, 64)
        self.predictor = _mlp(64, 256, 64)
        self.target_encoder = copy.deepcopy(self.encoder).requires_grad_(False)
        self.target_projector = copy.deepcopy(self.projector).requires_grad_(False)

    def forward(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        p1 = self.predictor(self.projector(self.encoder(view1)))
        p2 = self.predictor(self.projector(self.encoder(view2)))
        with torch.no_grad():
            t1 = self.target_projector(self.target_encoder(view1))
            t2 = self.target_projector(self.target_encoder(view2))

        def d(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return 2 - 2 * F.cosine_similarity(p, t, dim=-1).mean()

        return d(p1, t2) + d(p2, t1)


def _byol() -> Case:
    g = torch.Generator().manual_seed(1)

    def views(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.rand(rows, 3, 48, 48, generator=g)
        return (x + 0.1 * torch.randn(x.shape, generator=g)).clamp(0, 1), x.flip(-1)

    return Case(_BYOL().train(), views(32), lambda loss: loss, views(8), "vision")


class _EarlyExit(nn.Module):
    """Early-exit training as LayerSkip trains it: GPT-2 called with ``output_hidden_states``,
    the final norm and LM head applied to every layer's hidden state, the next-token losses
    weighted by depth."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lm = _gpt2(4, 128, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask,
                      output_hidden_states=True)
        labels = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100).flatten()
        hidden = out.hidden_states[1:]
        total = out.logits.new_zeros(())
        for depth, h in enumerate(hidden[:-1], 1):
            logits = self.lm.lm_head(self.lm.transformer.ln_f(h))
            total = total + depth * F.cross_entropy(logits[:, :-1].flatten(0, 1), labels,
                                                    ignore_index=-100)
        last = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels, ignore_index=-100)
        return (total + len(hidden) * last) / sum(range(1, len(hidden) + 1))


def _early_exit() -> Case:
    g = torch.Generator().manual_seed(1)
    return Case(_EarlyExit().train(), _padded(16, 96, g), lambda loss: loss,
                _padded(4, 40, g), "decoder")


MODELS: dict[str, Callable[[], Case]] = {
    "distill": _distill,
    "gan_generator": _gan,
    "byol": _byol,
    "early_exit": _early_exit,
}


def main(argv: list[str] | None = None) -> int:
    return families_probe.main(argv, MODELS, "model", __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
