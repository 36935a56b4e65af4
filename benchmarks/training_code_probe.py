"""Training code people write, planned and verified: layers and training loops the test zoo's
models do not have (spectral and weight norm, old-style and parametrized; RReLU and other
random or in-place activations; a VQ-VAE's straight-through estimator; a gradient-reversal
Function; channels-last convolutions; packed LSTM sequences; a diffusion denoiser's random
label dropping), and steps that backpropagate twice (``retain_graph=True``, a gradient
penalty).

    python benchmarks/training_code_probe.py            # a Markdown table, about 2 minutes
    python benchmarks/training_code_probe.py --autocast bfloat16   # forward under autocast

Each model is planned at its smallest peak and at 0.75 and 0.5 of the way from there to no
checkpointing; `Plan.verify` measures the planned step's peak and compares its loss and
gradients with the unplanned step's. The second table runs each backward-twice step on the
plan at the smallest peak and compares gradients (and buffers) with the unplanned model's.
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import planner  # noqa: E402

P = nn.utils.parametrizations


class SpectralDisc(nn.Module):
    """A GAN discriminator with spectral norm on every layer (`old`: the hook-based API, whose
    power iteration runs in a forward pre-hook): `depth` blocks of a conv and a LeakyReLU."""

    def __init__(self, old: bool = False, channels: int = 32, depth: int = 4):
        super().__init__()
        sn = nn.utils.spectral_norm if old else P.spectral_norm
        self.body = nn.Sequential(*[
            nn.Sequential(sn(nn.Conv2d(3 if i == 0 else channels, channels, 3, padding=1)),
                          nn.LeakyReLU(0.2))
            for i in range(depth)])
        self.head = sn(nn.Linear(channels, 1))

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


class WeightNormAudio(nn.Module):
    """A HiFi-GAN-like residual stack of dilated weight-normed convolutions."""

    def __init__(self, old: bool = False):
        super().__init__()
        wn = nn.utils.weight_norm if old else P.weight_norm
        self.pre = wn(nn.Conv1d(8, 32, 7, padding=3))
        self.blocks = nn.ModuleList(nn.Sequential(
            nn.LeakyReLU(0.1), wn(nn.Conv1d(32, 32, 3, padding=d, dilation=d)), nn.LeakyReLU(0.1),
            wn(nn.Conv1d(32, 32, 3, padding=1))) for d in (1, 3, 5, 1))
        self.post = wn(nn.Conv1d(32, 1, 7, padding=3))

    def forward(self, x):
        x = self.pre(x)
        for b in self.blocks:
            x = x + b(x)
        return torch.tanh(self.post(x))


class VQVAE(nn.Module):
    """Nearest-code lookup (argmin over distances), straight-through estimator, commitment
    loss; in-place ReLUs."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 32, 4, 2, 1), nn.ReLU(inplace=True),
                                 nn.Conv2d(32, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                 nn.Conv2d(32, 16, 1))
        self.codebook = nn.Embedding(64, 16)
        self.dec = nn.Sequential(nn.Conv2d(16, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                 nn.ConvTranspose2d(32, 32, 4, 2, 1), nn.ReLU(inplace=True),
                                 nn.Conv2d(32, 3, 3, 1, 1))

    def forward(self, x):
        z = self.enc(x)
        flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        idx = torch.cdist(flat, self.codebook.weight).argmin(1)
        q = self.codebook(idx).view(z.shape[0], z.shape[2], z.shape[3], -1).permute(0, 3, 1, 2)
        vq = F.mse_loss(q, z.detach()) + 0.25 * F.mse_loss(z, q.detach())
        return F.mse_loss(self.dec(z + (q - z).detach()), x) + vq


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.alpha * g, None


class DANN(nn.Module):
    """Domain-adversarial training: one dict argument in, a dict out, a gradient-reversal
    Function before the domain head."""

    def __init__(self):
        super().__init__()
        self.feat = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1),
                                                  nn.Linear(256, 64)) for _ in range(4)])
        self.cls = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.dom = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 2))

    def forward(self, batch):
        h = self.feat(batch["x"])
        return {"logits": self.cls(h), "domain": self.dom(GradReverse.apply(h, 0.5))}


class PackedTagger(nn.Module):
    """Embedding, a BiLSTM over packed sequences (lengths), a transformer layer with a padding
    mask, a tag head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(500, 64)
        self.lstm = nn.LSTM(64, 64, batch_first=True, bidirectional=True)
        self.tf = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.1, batch_first=True)
        self.out = nn.Linear(128, 9)

    def forward(self, ids, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths, batch_first=True,
                                                   enforce_sorted=False)
        y, _ = self.lstm(packed)
        y, _ = nn.utils.rnn.pad_packed_sequence(y, batch_first=True, total_length=ids.shape[1])
        mask = torch.arange(ids.shape[1])[None] >= lengths[:, None]
        return self.out(self.tf(y, src_key_padding_mask=mask))


class Denoiser(nn.Module):
    """A diffusion denoiser: sinusoidal timestep embedding, class labels dropped at random
    (classifier-free guidance), GroupNorm/SiLU residual conv blocks with dropout."""

    def __init__(self):
        super().__init__()
        self.t = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 64))
        self.lab = nn.Embedding(11, 64)
        self.inp = nn.Conv2d(3, 64, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(
            nn.GroupNorm(8, 64), nn.SiLU(), nn.Conv2d(64, 64, 3, padding=1), nn.GroupNorm(8, 64),
            nn.SiLU(), nn.Dropout(0.1), nn.Conv2d(64, 64, 3, padding=1)) for _ in range(4))
        self.proj = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.out = nn.Conv2d(64, 3, 3, padding=1)

    def forward(self, x, t, y):
        freqs = torch.exp(-torch.arange(16) * (9.21 / 16))
        te = torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], 1)
        y = torch.where(torch.rand(y.shape[0]) < 0.2, torch.full_like(y, 10), y)
        e = self.t(te) + self.lab(y)
        h = self.inp(x)
        for b, p in zip(self.blocks, self.proj, strict=True):
            h = h + b(h + p(e)[:, :, None, None])
        return self.out(h)


def _drop_path(x: torch.Tensor, p: float) -> torch.Tensor:
    """timm's stochastic depth: a per-sample Bernoulli mask drawn into a new tensor in place."""
    keep = 1 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "rrelu": nn.RReLU,
    "relu_inplace": lambda: nn.ReLU(inplace=True),
    "dropout_inplace": lambda: nn.Sequential(nn.GELU(), nn.Dropout(0.2, inplace=True)),
    "alpha_dropout": lambda: nn.Sequential(nn.SELU(), nn.AlphaDropout(0.2)),
    "feature_alpha_dropout": lambda: nn.Sequential(nn.SELU(), nn.FeatureAlphaDropout(0.2)),
    "dropout1d": lambda: nn.Sequential(nn.ReLU(), nn.Dropout1d(0.2)),
    "glu": lambda: nn.Sequential(nn.Linear(256, 512), nn.GLU()),
}


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)
        self.act = ACTIVATIONS.get(kind, nn.GELU)()

    def forward(self, x):
        h = self.act(self.fc1(x))
        if self.kind == "gumbel_softmax":
            h = F.gumbel_softmax(h, tau=0.5, hard=True) * h
        elif self.kind == "multinomial":
            idx = torch.multinomial(h.softmax(-1).flatten(0, -2), 1)
            h = h + torch.gather(h.flatten(0, -2), 1, idx).view(*h.shape[:-1], 1)
        out = self.fc2(h)
        return x + (_drop_path(out, 0.3) if self.kind == "drop_path" else out)


class TokenNet(nn.Module):
    """Embedding, four residual MLP blocks of one kind, a norm, an LM head: tokens (8, 32)."""

    def __init__(self, kind: str):
        super().__init__()
        self.emb = nn.Embedding(200, 64, max_norm=1.0 if kind == "embedding_max_norm" else None)
        self.blocks = nn.ModuleList(Block(kind) for _ in range(4))
        self.norm = (nn.InstanceNorm1d(64, track_running_stats=True, affine=True)
                     if kind == "instance_norm_stats" else nn.LayerNorm(64))
        self.out = nn.Linear(64, 200)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        if isinstance(self.norm, nn.InstanceNorm1d):
            x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        else:
            x = self.norm(x)
        return self.out(x)


class ChannelsLastCNN(nn.Module):
    def __init__(self):
        super().__init__()
        layers: list[nn.Module] = []
        c = 3
        for o in (32, 32, 64, 64):
            layers += [nn.Conv2d(c, o, 3, padding=1, bias=False), nn.BatchNorm2d(o),
                       nn.ReLU(inplace=True)]
            c = o
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        return self.fc(self.body(x).mean((2, 3)))


Case = tuple[nn.Module, Any, Callable[[Any], torch.Tensor] | None]


def cases() -> Iterator[tuple[str, Callable[[], Case]]]:
    def seeded(build: Callable[[], Case]) -> Callable[[], Case]:
        def go() -> Case:
            torch.manual_seed(0)
            return build()
        return go

    img = lambda: torch.randn(16, 3, 32, 32)  # noqa: E731
    yield "spectral_norm", seeded(lambda: (SpectralDisc(), img(), lambda o: F.softplus(-o).mean()))
    yield "spectral_norm (old API)", seeded(
        lambda: (SpectralDisc(old=True), img(), lambda o: F.softplus(-o).mean()))
    yield "weight_norm", seeded(
        lambda: (WeightNormAudio(), torch.randn(4, 8, 2048), lambda o: o.abs().mean()))
    yield "weight_norm (old API)", seeded(
        lambda: (WeightNormAudio(old=True), torch.randn(4, 8, 2048), lambda o: o.abs().mean()))
    yield "vq_vae", seeded(lambda: (VQVAE(), img(), None))

    def dann() -> Case:
        lab, dom = torch.randint(0, 10, (64,)), torch.randint(0, 2, (64,))
        return DANN(), ({"x": torch.randn(64, 64)},), lambda o: (
            F.cross_entropy(o["logits"], lab) + F.cross_entropy(o["domain"], dom))
    yield "dann (dict in, dict out)", seeded(dann)

    def cnn() -> Case:
        return (ChannelsLastCNN().to(memory_format=torch.channels_last),
                img().contiguous(memory_format=torch.channels_last),
                lambda o: o.logsumexp(1).mean())
    yield "channels_last cnn", seeded(cnn)

    def tagger() -> Case:
        tags = torch.randint(0, 9, (8, 48))
        lengths = torch.tensor([48, 40, 33, 48, 12, 20, 47, 5])
        return PackedTagger(), (torch.randint(1, 500, (8, 48)), lengths), \
            lambda o: F.cross_entropy(o.flatten(0, 1), tags.flatten())
    yield "packed lstm tagger", seeded(tagger)

    def denoiser() -> Case:
        return Denoiser(), (img(), torch.rand(16) * 1000, torch.randint(0, 10, (16,))), \
            lambda o: o.square().mean()
    yield "diffusion denoiser", seeded(denoiser)

    for kind in [*ACTIVATIONS, "gumbel_softmax", "multinomial", "drop_path",
                 "embedding_max_norm", "instance_norm_stats"]:
        def token_net(kind: str = kind) -> Case:
            tgt = torch.randint(0, 200, (8, 32))
            return TokenNet(kind), torch.randint(0, 200, (8, 32)), \
                lambda o: F.cross_entropy(o.flatten(0, 1), tgt.flatten())
        yield f"blocks: {kind}", seeded(token_net)


def _twice(model: nn.Module, inputs: Any, loss_fn, how: str) -> dict[str, torch.Tensor]:
    """One step that backpropagates twice, under seed 1: the gradients and buffers after it."""
    for p in model.parameters():
        p.grad = None
    with torch.random.fork_rng():
        torch.manual_seed(1)
        if how == "retain_graph":
            loss = loss_fn(model(inputs))
            loss.backward(retain_graph=True)
            loss.backward()
        else:  # a gradient penalty on the input
            x = inputs.clone().requires_grad_()
            loss = loss_fn(model(x))
            (g,) = torch.autograd.grad(loss, x, create_graph=True)
            (loss + g.square().sum()).backward()
    return {**{k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None},
            **{k: b.clone() for k, b in model.named_buffers()}}


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--autocast", default=None, choices=["bfloat16", "float16"],
                    help="plan and verify with forward and loss under torch.autocast")
    args = ap.parse_args()
    amp = getattr(torch, args.autocast) if args.autocast else None
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    print("| model | budget | plan | predicted peak B | measured peak B | predicted - measured "
          "| max grad rel err |")
    print("|---|---|---|---|---|---|---|")
    for name, build in cases():
        model, inputs, loss_fn = build()
        model.train()
        try:
            low = planner.plan(model, None, example_inputs=inputs, loss_fn=loss_fn, autocast=amp)
        except planner.CkptPlannerError as e:  # a model that cannot run so: say why
            print(f"| {name} | | does not plan: {str(e).splitlines()[0][:160]} | | | | |")
            continue
        none = low.baselines()["none"].predicted_peak_bytes
        smallest = low.predicted_peak_bytes
        for f in (None, 0.75, 0.5):
            if f is None:
                p, label = low, "smallest peak"
            else:
                planner.remove(model)
                p = planner.plan(model, budget_bytes=int(smallest + f * (none - smallest)),
                                 example_inputs=inputs, loss_fn=loss_fn, autocast=amp)
                label = f"{f:g} of the way"
            v = p.verify(repeats=1)
            print(f"| {name} | {label} | {p.schedule.method}, {len(p.schedule.regions)} regions "
                  f"| {v.predicted_peak_bytes} | {v.measured_peak_bytes} "
                  f"| {v.predicted_peak_bytes - v.measured_peak_bytes:+d} "
                  f"| {v.max_grad_rel_err:.1e} |", flush=True)
        planner.remove(model)
    print("\n| model | step | regions | max rel err against the unplanned step |")
    print("|---|---|---|---|")
    for name, build in cases() if amp is None else ():
        if not name.startswith(("spectral_norm", "channels_last", "blocks: dropout_inplace")):
            continue
        for how in ("retain_graph", "gradient_penalty"):
            model, inputs, loss_fn = build()
            if not isinstance(inputs, torch.Tensor) or inputs.dtype != torch.float32:
                continue
            model.train()
            twin = copy.deepcopy(model)
            p = planner.plan(model, None, example_inputs=inputs, loss_fn=loss_fn)
            want, got = _twice(twin, inputs, loss_fn, how), _twice(model, inputs, loss_fn, how)
            err = max(((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12))
                      .item() for k in want)
            print(f"| {name} | {how} | {len(p.schedule.regions)} | {err:.1e} |", flush=True)
            planner.remove(model)
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
