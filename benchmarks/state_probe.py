"""State a block keeps, and code around and inside blocks, planned and verified (the eleventh
probe): buffers read then updated (an EMA codebook, a memory bank its parent fills, QAT's
fused observers), a generator of the model's own, a recurrent memory in an attribute
(Transformer-XL), a tensor left on the module (an MoE auxiliary loss, an attention map), a
scripted submodule, tensor hooks, module hooks, ``torch.autograd.grad`` inside forward
(a force field), complex parameters, in-place writes to a block's input or output, a
siamese pair of calls.

    python benchmarks/state_probe.py        # a Markdown table, about 2 minutes

Each model is planned at its smallest peak and half way from there to no checkpointing;
`Plan.verify` measures the planned step's peak and compares loss and gradients with the
unplanned step's (where the model's randomness is its own generator's, which verify cannot
reseed, that column says so and the peak is measured alone). Then the planned model and an unplanned copy train 3 SGD steps
from the same state (generators reseeded alike), and their parameters and buffers are compared.
"""

from __future__ import annotations

import copy
import itertools
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
from benchmarks._probe import floor_and_half_way, max_rel_diff, train  # noqa: E402
from planner.measurement import measure  # noqa: E402
from solvers.errors import CkptPlannerError  # noqa: E402

D = 64


class EMACodebook(nn.Module):
    """VQ with codes that follow an exponential moving average of their vectors."""

    def __init__(self, n: int = 64, d: int = D):
        super().__init__()
        self.register_buffer("embed", torch.randn(n, d))
        self.register_buffer("embed_avg", self.embed.clone())
        self.register_buffer("size", torch.ones(n))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        idx = torch.cdist(flat, self.embed).argmin(-1)
        q = F.embedding(idx, self.embed).view_as(x)
        if self.training:
            with torch.no_grad():
                hot = F.one_hot(idx, self.embed.shape[0]).to(flat.dtype)
                self.size.mul_(0.9).add_(hot.sum(0), alpha=0.1)
                self.embed_avg.mul_(0.9).add_(hot.t() @ flat, alpha=0.1)
                self.embed.copy_(self.embed_avg / (self.size.unsqueeze(1) + 1e-5))
        return x + (q - x).detach() + 0.25 * (q.detach() - x).square().mean()


def _clamp_grad(module: nn.Module, args: Any, out: torch.Tensor) -> None:
    """A forward hook putting a gradient hook on the output (activation-gradient clipping)."""
    out.register_hook(lambda g: g.clamp(-1e-3, 1e-3))


class Block(nn.Module):
    """A pre-norm residual MLP block, with one of the behaviours this probe is about."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.act = torch.jit.script(nn.GELU()) if kind == "scripted activation" else nn.GELU()
        self.gen = torch.Generator().manual_seed(5)
        self.mems: torch.Tensor | None = None
        self.stash: torch.Tensor | None = None
        self.vq = EMACodebook() if kind == "EMA codebook" else None
        self.register_buffer("bank", torch.randn(128, D))
        if kind == "complex filter":
            self.filt = nn.Parameter(0.1 * torch.randn(D // 2 + 1, dtype=torch.cfloat))
        if kind == "tensor hook":
            self.fc1.register_forward_hook(_clamp_grad)
        if kind == "module hooks":
            self.register_forward_pre_hook(lambda m, args: (args[0] * 1.1,))
            self.register_full_backward_hook(lambda m, gi, go: tuple(
                None if g is None else 0.5 * g for g in gi))

    def forward(self, x):
        k = self.kind
        if k == "in-place on input":
            x.mul_(0.9)
        h = self.norm(x)
        if k == "recurrent memory":  # Transformer-XL: attend over [memory; x], keep the end
            ctx = h if self.mems is None else torch.cat([self.mems, h], 1)
            h = h + torch.softmax(h @ ctx.transpose(1, 2) / 8, -1) @ ctx
        if k == "own generator":
            h = h * torch.empty_like(h).bernoulli_(0.8, generator=self.gen) / 0.8
        if k == "complex filter":
            h = torch.fft.irfft(torch.fft.rfft(h, dim=-1) * self.filt, n=D, dim=-1)
        if k == "memory bank":
            h = h + torch.softmax(h @ self.bank.clone().t(), -1) @ self.bank.clone()
        h = self.fc2(self.act(self.fc1(h)))
        if k == "EMA codebook":
            h = self.vq(h)
        if k in ("aux loss on module", "attention map on module"):
            self.stash = h.square().mean() if k == "aux loss on module" else \
                torch.softmax(h @ h.transpose(1, 2), -1)
        out = x + h
        if k == "recurrent memory":
            self.mems = out[:, -16:].detach()
        return out


class TokenNet(nn.Module):
    """Embedding, four blocks of one kind, a norm, an LM head: tokens (8, 32)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(200, D)
        self.blocks = nn.ModuleList(Block(kind) for _ in range(4))
        self.norm, self.out = nn.LayerNorm(D), nn.Linear(D, 200)
        self.ptr = 0

    def encode(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
            if self.kind == "in-place on output":
                x.mul_(0.9)
            if self.kind == "memory bank":  # the parent fills the bank after the block read it
                with torch.no_grad():
                    b.bank[self.ptr:self.ptr + 8] = x.detach().reshape(-1, D)[:8]
        if self.kind == "memory bank":
            self.ptr = (self.ptr + 8) % 128
        return self.norm(x)

    def forward(self, ids):
        if self.kind == "siamese pair":
            a, b = self.encode(ids[0]), self.encode(ids[1])
            return (a.mean(1) * b.mean(1)).sum(-1)
        if self.kind == "aux loss on module":  # the blocks' losses, read off the modules
            logits = self.out(self.encode(ids))
            return logits, sum(b.stash for b in self.blocks)
        return self.out(self.encode(ids))


class ForceField(nn.Module):
    """An energy MLP over positions; forces are -dE/dpos with create_graph (MD potentials)."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(3, D), nn.Linear(D, 1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, 4 * D), nn.SiLU(),
                                                  nn.Linear(4 * D, D)) for _ in range(4))

    def forward(self, pos):
        pos = pos if pos.requires_grad else pos.requires_grad_()
        h = self.inp(pos)
        for b in self.blocks:
            h = h + b(h)
        e = self.head(h).sum()
        (g,) = torch.autograd.grad(e, pos, create_graph=True)
        return e, -g


def qat_cnn(channels: int = 16, layers: int = 4, image: int = 16) -> nn.Module:
    """Eager-mode QAT: fused conv-BN-ReLU with fused fake-quant observers, whose statistics
    start empty and take their shape on the first call."""
    import torch.ao.quantization as q
    c = channels
    m = nn.Sequential(q.QuantStub(), *[nn.Sequential(nn.Conv2d(c if i else 3, c, 3, padding=1),
                                                     nn.BatchNorm2d(c), nn.ReLU())
                                       for i in range(layers)],
                      q.DeQuantStub(), nn.Flatten(), nn.Linear(c * image * image, 10)).train()
    for i in range(1, layers + 1):
        q.fuse_modules_qat(m[i], ["0", "1", "2"], inplace=True)
    m.qconfig = q.get_default_qat_qconfig("fbgemm")
    return q.prepare_qat(m)


KINDS = ["EMA codebook", "memory bank", "own generator", "recurrent memory",
         "aux loss on module", "attention map on module", "scripted activation",
         "tensor hook", "module hooks", "complex filter", "in-place on input",
         "in-place on output", "siamese pair"]

Case = tuple[nn.Module, Any, Callable[[Any], torch.Tensor]]


def cases() -> Iterator[tuple[str, Callable[[], Case]]]:
    for kind in KINDS:
        def token_net(kind: str = kind) -> Case:
            torch.manual_seed(0)
            model, tgt = TokenNet(kind), torch.randint(0, 200, (8, 32))
            if kind == "siamese pair":
                return model, (torch.randint(0, 200, (2, 8, 32)),), lambda o: -o.mean()
            if kind == "aux loss on module":
                return model, torch.randint(0, 200, (8, 32)), lambda o: F.cross_entropy(
                    o[0].flatten(0, 1), tgt.flatten()) + 0.01 * o[1]
            if kind == "recurrent memory":
                model(torch.randint(0, 200, (8, 32)))  # a first segment: memories exist
            return model, torch.randint(0, 200, (8, 32)), \
                lambda o: F.cross_entropy(o.flatten(0, 1), tgt.flatten())
        yield kind, token_net

    def force_field() -> Case:
        torch.manual_seed(0)
        ref = torch.randn(512, 3)
        return ForceField(), torch.randn(512, 3), \
            lambda o: 1e-3 * o[0] + (o[1] - ref).square().mean()
    yield "autograd.grad in forward", force_field

    def qat() -> Case:
        torch.manual_seed(0)
        y = torch.randint(0, 10, (8,))
        return qat_cnn(), torch.randn(8, 3, 16, 16), lambda o: F.cross_entropy(o, y)
    yield "QAT (fused observers)", qat


def _train(model: nn.Module, inputs: Any, loss_fn) -> list[torch.Tensor]:
    """3 SGD steps from seed 1, the model's own generators reseeded; its state after them."""
    for m in model.modules():
        if isinstance(getattr(m, "gen", None), torch.Generator):
            m.gen.manual_seed(5)
    train(model, inputs, loss_fn)
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def main() -> int:
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    print("| model | budget | plan | predicted - measured peak B | verify | 3 steps against "
          "the unplanned model (max rel diff) |")
    print("|---|---|---|---|---|---|")
    for name, build in cases():
        model, inputs, loss_fn = build()
        twin = copy.deepcopy(model)
        runs = floor_and_half_way(model, inputs, loss_fn)
        try:
            first = next(runs)
        except CkptPlannerError as e:
            print(f"| {name} | | does not plan: {str(e).splitlines()[0][:160]} | | | |")
            continue
        for label, p, none in itertools.chain([first], runs):
            blocked = sum(1 for c in p.profile.calls if c.blocker)
            plan = (f"{p.schedule.method}, {len(p.schedule.regions)} regions, "
                    f"{p.predicted_peak_bytes / none:.0%} of none"
                    + (f" ({blocked} calls blocked)" if blocked else ""))
            try:
                v = p.verify(repeats=1)
                diff, ok = f"{v.predicted_peak_bytes - v.measured_peak_bytes:+d}", \
                    f"gradients {v.max_grad_rel_err:.0e}"
            except planner.NotReproducibleError:  # its peak, measured without the comparison
                m = measure(model, inputs, loss_fn, repeats=1)
                diff, ok = f"{p.predicted_peak_bytes - m.peak_bytes:+d}", \
                    "no comparison: not reproducible from torch's seed (own generator)"
            except planner.PlanNotEffectiveError as e:
                diff, ok = "", f"not effective: {str(e).split(': ')[1]}"
            a, b = copy.deepcopy(twin), copy.deepcopy(model)
            err = max_rel_diff(_train(b, inputs, loss_fn), _train(a, inputs, loss_fn))
            print(f"| {name} | {label} | {plan} | {diff} | {ok} | {err:.0e} |", flush=True)
        planner.remove(model)
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
