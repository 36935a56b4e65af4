"""Models from libraries other than transformers: x-transformers, PyTorch Geometric, torchdiffeq,
MONAI, normflows, e3nn and neuraloperator; in fp32 and under bf16 autocast (the twentieth probe).

    HF_HUB_OFFLINE=1 python benchmarks/libraries_probe.py [model ...] [-n 6] [--fp32-only]

Every earlier probe built its models from transformers or diffusers, whose layers share one
style. These libraries write a step differently: x-transformers rearranges with einops and
einx, carries attention scores from layer to layer and drops whole layers at random; PyTorch
Geometric gathers node features along an edge list and scatters messages back, with a softmax
per destination node; torchdiffeq integrates a neural ODE with an adaptive solver, whose
number of steps depends on the values it meets (and its adjoint solves a second ODE in
backward); MONAI segments 3-D volumes with residual units, Swin windows and deep supervision
under a Dice loss; normflows trains flows on exact log-likelihoods through coupling layers,
rational-quadratic splines (``searchsorted`` on knots) and an ActNorm that initialises itself
from the first batch; e3nn builds equivariant tensor products from generated code and trains an
interatomic potential on forces taken by ``autograd.grad(create_graph=True)`` in the forward;
neuraloperator's Fourier neural operators multiply truncated complex spectra. Each model is a
small configuration with random weights, dropout where the library offers it, and its loss
(its own, or one through ``loss_fn``); then as `families_probe.py` does: planned at its
smallest peak and half way, each plan verified and run on a smaller batch, and `-n` schedules
near the smallest-peak one measured. Needs ``pip install x-transformers torch-geometric
torchdiffeq monai normflows e3nn neuraloperator`` (none is a dependency of the planner; for
neuraloperator, ``--no-deps`` with tensorly, tensorly-torch, opt_einsum, zencfg and configmypy
avoids its logging stack). Not part of the test suite (minutes of CI).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from benchmarks import families_probe  # noqa: E402
from tests.zoo import Case  # noqa: E402


def _labels_loss(labels: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """Cross entropy against `labels`, kept on the side as a training script keeps its batch
    (on a smaller batch, the labels of its first rows)."""

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float(), labels[: out.shape[0]])

    return loss_fn


# -- x-transformers ----------------------------------------------------------------------------


def _xt_decoder() -> Case:
    """A language model trained by x-transformers' own AutoregressiveWrapper (it shifts and
    takes the loss): rotary positions, GLU feed-forwards, residual attention (each layer adds
    the previous layer's pre-softmax scores), memory key-values and layer dropout."""
    from x_transformers import AutoregressiveWrapper, Decoder, TransformerWrapper

    torch.manual_seed(0)
    net = TransformerWrapper(
        num_tokens=256, max_seq_len=128, emb_dropout=0.1,
        attn_layers=Decoder(dim=64, depth=4, heads=4, rotary_pos_emb=True, ff_glu=True,
                            residual_attn=True, attn_num_mem_kv=4, attn_dropout=0.1,
                            ff_dropout=0.1, layer_dropout=0.1))
    return Case(AutoregressiveWrapper(net).train(), (torch.randint(0, 256, (4, 97)),),
                lambda loss: loss, (torch.randint(0, 256, (2, 49)),), "decoder")


def _xt_seq2seq() -> Case:
    """x-transformers' encoder-decoder with a padded source mask, tied embeddings, token shift,
    sandwich norms and gated attention values; it returns its own loss."""
    from x_transformers import XTransformer

    torch.manual_seed(0)
    model = XTransformer(
        dim=64, tie_token_emb=True, enc_num_tokens=256, enc_depth=2, enc_heads=4,
        enc_max_seq_len=64, enc_shift_tokens=1, enc_sandwich_norm=True, enc_attn_dropout=0.1,
        enc_ff_dropout=0.1, dec_num_tokens=256, dec_depth=2, dec_heads=4, dec_max_seq_len=64,
        dec_attn_gate_values=True, dec_attn_dropout=0.1, dec_ff_dropout=0.1)

    def batch(rows: int, src: int, tgt: int) -> tuple[torch.Tensor, ...]:
        mask = torch.arange(src) < torch.tensor([src - 5 * i for i in range(rows)])[:, None]
        return (torch.randint(0, 256, (rows, src)), torch.randint(0, 256, (rows, tgt)), mask)

    return Case(model.train(), batch(4, 48, 40), lambda loss: loss, batch(2, 24, 20),
                "encoder-decoder")


def _xt_vit() -> Case:
    """x-transformers' ViT wrapper: patches rearranged by einops, an encoder with talking heads
    before the softmax, query-key norms and RMS norms, classification through ``loss_fn``."""
    from x_transformers import Encoder, ViTransformerWrapper

    torch.manual_seed(0)
    model = ViTransformerWrapper(
        image_size=32, patch_size=4, num_classes=10, post_emb_norm=True,
        attn_layers=Encoder(dim=64, depth=3, heads=4, attn_pre_talking_heads=True,
                            attn_qk_norm=True, use_rmsnorm=True,
                            attn_dropout=0.1, ff_dropout=0.1))
    labels = torch.randint(0, 10, (4,))
    return Case(model.train(), (torch.randn(4, 3, 32, 32),), _labels_loss(labels),
                (torch.randn(2, 3, 32, 32),), "vision")


# -- PyTorch Geometric -------------------------------------------------------------------------


def _graph(nodes: int, edges: int, seed: int, graphs: int = 1) -> dict[str, torch.Tensor]:
    """Random directed edges within each of `graphs` equal parts of `nodes` (no self loops)."""
    g = torch.Generator().manual_seed(seed)
    per = nodes // graphs
    src = torch.randint(0, per, (edges,), generator=g)
    dst = (src + torch.randint(1, per, (edges,), generator=g)) % per
    part = torch.randint(0, graphs, (edges,), generator=g) * per
    return {"x": torch.randn(nodes, 16, generator=g),
            "edge_index": torch.stack([src + part, dst + part]),
            "batch": torch.arange(nodes) // per}


def _gat() -> Case:
    """PyG's GAT: node classification, attention coefficients soft-maxed per destination node
    by scatter, attention and feature dropout."""
    from torch_geometric.nn.models import GAT

    torch.manual_seed(0)
    model = GAT(16, 32, num_layers=3, out_channels=5, heads=4, dropout=0.1, norm="layer_norm",
                jk="cat")
    big, small = _graph(600, 4000, 1), _graph(300, 1500, 2)
    labels = torch.randint(0, 5, (600,))
    return Case(model.train(), (big["x"], big["edge_index"]), _labels_loss(labels),
                (small["x"], small["edge_index"]), "plain")


class _GraphClassifier(nn.Module):
    """GIN layers with batch norm, summed per graph by its batch vector (global_add_pool), and
    a TransformerConv layer; classification of whole graphs."""

    def __init__(self) -> None:
        super().__init__()
        from torch_geometric.nn import TransformerConv
        from torch_geometric.nn.models import GIN

        self.gin = GIN(16, 48, num_layers=3, dropout=0.1, norm="batch_norm")
        self.attn = TransformerConv(48, 12, heads=4, dropout=0.1)
        self.head = nn.Linear(48, 3)

    def forward(self, x, edge_index, batch):
        from torch_geometric.nn import global_add_pool

        h = self.gin(x, edge_index)
        h = F.gelu(self.attn(h, edge_index))
        return self.head(global_add_pool(h, batch))


def _gin_graphs() -> Case:
    torch.manual_seed(0)
    big, small = _graph(800, 4800, 3, graphs=8), _graph(400, 2400, 4, graphs=4)
    labels = torch.randint(0, 3, (8,))
    return Case(_GraphClassifier().train(), (big["x"], big["edge_index"], big["batch"]),
                _labels_loss(labels), (small["x"], small["edge_index"], small["batch"]), "plain")


# -- torchdiffeq -------------------------------------------------------------------------------


class _ODEFunc(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim + 1, 128), nn.Tanh(), nn.Linear(128, dim))

    def forward(self, t, y):
        return self.net(torch.cat([y, t.expand(y.shape[0], 1)], dim=1))


class _NeuralODE(nn.Module):
    """Encoder, an ODE block integrated from t=0 to 1 by torchdiffeq, classifier head."""

    def __init__(self, method: str, adjoint: bool) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.1))
        self.func = _ODEFunc(64)
        self.head = nn.Linear(64, 4)
        self.method, self.adjoint = method, adjoint

    def forward(self, x):
        from torchdiffeq import odeint, odeint_adjoint

        solve = odeint_adjoint if self.adjoint else odeint
        options = {"step_size": 0.1} if self.method == "rk4" else None
        h = self.enc(x)
        t = torch.tensor([0.0, 1.0])
        h = solve(self.func, h, t, rtol=1e-3, atol=1e-4, method=self.method, options=options)[-1]
        return self.head(h)


def _node(method: str, adjoint: bool) -> Callable[[], Case]:
    def build() -> Case:
        torch.manual_seed(0)
        labels = torch.randint(0, 4, (256,))
        return Case(_NeuralODE(method, adjoint).train(), (torch.randn(256, 32),),
                    _labels_loss(labels), (torch.randn(96, 32),), "plain")

    build.__doc__ = (f"A neural ODE classifier, {method}"
                     f"{' with the adjoint method' if adjoint else ''}.")
    return build


# -- MONAI -------------------------------------------------------------------------------------


def _dice_ce(labels: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """MONAI's Dice + cross-entropy loss against a label volume; with deep supervision (a
    stacked output), the mean over the heads."""
    from monai.losses import DiceCELoss

    loss = DiceCELoss(to_onehot_y=True, softmax=True)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        d, h, w = out.shape[-3:]
        target = labels[: out.shape[0], :, :d, :h, :w]
        if out.dim() == target.dim() + 1:   # (B, heads, C, D, H, W)
            return sum(loss(out[:, i].float(), target) for i in range(out.shape[1])) / out.shape[1]
        return loss(out.float(), target)

    return loss_fn


def _volume_case(model: nn.Module, size: int, small: int, rows: int = 2) -> Case:
    torch.manual_seed(1)
    labels = torch.randint(0, 2, (rows, 1, size, size, size))
    return Case(model.train(), (torch.randn(rows, 1, size, size, size),), _dice_ce(labels),
                (torch.randn(1, 1, small, small, small),), "vision")


def _monai_unet() -> Case:
    """MONAI's 3-D U-Net with residual units, instance norm and dropout, Dice + CE loss."""
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    return _volume_case(UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(8, 16, 32),
                             strides=(2, 2), num_res_units=2, dropout=0.1), 24, 16)


def _swin_unetr() -> Case:
    """MONAI's SwinUNETR: 3-D shifted-window attention with its masks, a convolutional
    decoder, Dice + CE loss."""
    from monai.networks.nets import SwinUNETR

    torch.manual_seed(0)
    return _volume_case(SwinUNETR(in_channels=1, out_channels=2, feature_size=12,
                                  depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), window_size=4,
                                  drop_rate=0.1, attn_drop_rate=0.1, dropout_path_rate=0.1),
                        64, 64)


def _dynunet() -> Case:
    """MONAI's DynUNet (nnU-Net's network) with deep supervision: in training it returns its
    full-size output stacked with upsampled coarser heads."""
    from monai.networks.nets import DynUNet

    torch.manual_seed(0)
    return _volume_case(DynUNet(spatial_dims=3, in_channels=1, out_channels=2,
                                kernel_size=[3, 3, 3, 3], strides=[1, 2, 2, 2],
                                upsample_kernel_size=[2, 2, 2], filters=[8, 16, 24, 32],
                                dropout=0.1, deep_supervision=True, deep_supr_num=2,
                                res_block=True), 24, 16)


# -- normflows ---------------------------------------------------------------------------------


class _FlowNLL(nn.Module):
    """The flow's negative log-likelihood (normflows' ``forward_kld``) as a module's forward."""

    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, x):
        return self.flow.forward_kld(x)


def _flow_case(flows: list[nn.Module], dim: int) -> Case:
    import normflows as nf

    model = _FlowNLL(nf.NormalizingFlow(nf.distributions.DiagGaussian(dim), flows))
    g = torch.Generator().manual_seed(1)
    return Case(model.train(), (torch.randn(512, dim, generator=g) * 2 + 1,), lambda loss: loss,
                (torch.randn(128, dim, generator=g) * 2 + 1,), "plain")


def _realnvp() -> Case:
    """RealNVP: affine couplings with MLPs, ActNorm (initialised from its first batch) and
    swaps."""
    import normflows as nf

    torch.manual_seed(0)
    flows: list[nn.Module] = []
    for _ in range(6):
        flows.append(nf.flows.AffineCouplingBlock(nf.nets.MLP([8, 128, 128, 16],
                                                              init_zeros=True)))
        flows.append(nf.flows.Permute(16, mode="swap"))
        flows.append(nf.flows.ActNorm(16))
    return _flow_case(flows, 16)


def _spline_flow() -> Case:
    """A neural spline flow: autoregressive rational-quadratic splines (bins found by
    ``searchsorted``, identity tails outside the knots) and LU-decomposed linear permutations."""
    import normflows as nf

    torch.manual_seed(0)
    flows: list[nn.Module] = []
    for _ in range(4):
        flows.append(nf.flows.AutoregressiveRationalQuadraticSpline(8, 2, 64, dropout_probability=0.1))
        flows.append(nf.flows.LULinearPermute(8))
    return _flow_case(flows, 8)


# -- e3nn --------------------------------------------------------------------------------------


class _Interaction(nn.Module):
    """One equivariant convolution: a tensor product of neighbour features with the edge's
    spherical harmonics, weighted per edge by an MLP of its length, summed into each atom,
    then a gated nonlinearity."""

    def __init__(self, irreps_in, irreps_hidden, irreps_sh) -> None:
        super().__init__()
        from e3nn import o3
        from e3nn.nn import FullyConnectedNet, Gate

        self.gate = Gate("16x0e", [F.silu], "8x0e", [torch.sigmoid], "8x1o")
        self.tp = o3.FullyConnectedTensorProduct(irreps_in, irreps_sh, self.gate.irreps_in,
                                                 shared_weights=False)
        self.fc = FullyConnectedNet([10, 32, self.tp.weight_numel], F.silu)
        self.lin = o3.Linear(irreps_in, self.gate.irreps_out)

    def forward(self, x, src, dst, sh, emb):
        msg = self.tp(x[src], sh, self.fc(emb))
        out = torch.zeros(x.shape[0], msg.shape[1], dtype=msg.dtype).index_add(0, dst, msg)
        return self.gate(out / 4.0) + self.lin(x)


class _Potential(nn.Module):
    """An interatomic potential (NequIP's shape, made of e3nn's parts): atoms within a cutoff
    become edges (found from positions each step, so the edge count depends on values), three
    interactions, per-atom energies summed per molecule, and forces as minus the gradient of
    the energy with respect to positions, taken in the forward with ``create_graph=True`` so
    the loss trains on them. Returns energies and forces."""

    def __init__(self) -> None:
        super().__init__()
        from e3nn import o3

        self.irreps_sh = o3.Irreps.spherical_harmonics(2)
        self.embed = nn.Embedding(4, 16)
        irreps = o3.Irreps("16x0e")
        layers = []
        for _ in range(3):
            layers.append(_Interaction(irreps, "16x0e + 8x1o", self.irreps_sh))
            irreps = layers[-1].gate.irreps_out
        self.layers = nn.ModuleList(layers)
        self.out = o3.Linear(irreps, "1x0e")

    def forward(self, species, pos, batch):
        from e3nn import o3
        from e3nn.math import soft_one_hot_linspace

        pos = pos.requires_grad_(True) if not pos.requires_grad else pos
        d = torch.cdist(pos, pos)
        same = batch[:, None] == batch[None, :]
        src, dst = torch.nonzero(same & (d < 2.5) & (d > 0), as_tuple=True)
        vec = pos[src] - pos[dst]
        length = vec.norm(dim=1)
        sh = o3.spherical_harmonics(self.irreps_sh, vec, normalize=True, normalization="component")
        emb = soft_one_hot_linspace(length, 0.0, 2.5, 10, basis="smooth_finite", cutoff=True)
        x = self.embed(species)
        for layer in self.layers:
            x = layer(x, src, dst, sh, emb)
        per_atom = self.out(x)[:, 0]
        energy = torch.zeros(int(batch.max()) + 1, dtype=per_atom.dtype).index_add(
            0, batch, per_atom)
        forces = -torch.autograd.grad(energy.sum(), pos, create_graph=True)[0]
        return energy, forces


def _e3nn_potential() -> Case:
    torch.manual_seed(0)

    def batch(molecules: int, atoms: int, seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        n = molecules * atoms
        return (torch.randint(0, 4, (n,), generator=g), torch.randn(n, 3, generator=g) * 1.5,
                torch.arange(n) // atoms)

    g = torch.Generator().manual_seed(9)
    e_target, f_target = torch.randn(8, generator=g), torch.randn(8 * 24, 3, generator=g)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        energy, forces = out
        return (F.mse_loss(energy.float(), e_target[: energy.shape[0]])
                + F.mse_loss(forces.float(), f_target[: forces.shape[0]]))

    return Case(_Potential().train(), batch(8, 24, 1), loss_fn, batch(4, 24, 2), "plain")


# -- neuraloperator ----------------------------------------------------------------------------


def _operator_case(model: nn.Module, size: int, small: int) -> Case:
    g = torch.Generator().manual_seed(1)
    target = torch.randn(8, 1, size, size, generator=g)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.float(), target[: out.shape[0], :, : out.shape[2], : out.shape[3]])

    return Case(model.train(), (torch.randn(8, 1, size, size, generator=g),), loss_fn,
                (torch.randn(4, 1, small, small, generator=g),), "vision")


def _fno() -> Case:
    """A Fourier neural operator (2-D): truncated rfft2 spectra multiplied by complex weights,
    a positional grid concatenated to the input, channel MLPs with soft gating."""
    from neuralop.models import FNO

    torch.manual_seed(0)
    return _operator_case(FNO(n_modes=(12, 12), in_channels=1, out_channels=1,
                              hidden_channels=24, n_layers=4, channel_mlp_dropout=0.1), 48, 32)


def _tfno() -> Case:
    """The Tucker-factorised FNO: spectral weights rebuilt from a Tucker core and factors
    (tensorly-torch) in each forward, with domain padding."""
    from neuralop.models import TFNO

    torch.manual_seed(0)
    return _operator_case(TFNO(n_modes=(12, 12), in_channels=1, out_channels=1,
                               hidden_channels=24, n_layers=4, factorization="tucker", rank=0.4,
                               domain_padding=0.25), 48, 32)


MODELS: dict[str, Callable[[], Case]] = {
    "xt_decoder": _xt_decoder,
    "xt_seq2seq": _xt_seq2seq,
    "xt_vit": _xt_vit,
    "pyg_gat": _gat,
    "pyg_gin_graphs": _gin_graphs,
    "node_dopri5": _node("dopri5", False),
    "node_rk4": _node("rk4", False),
    "node_adjoint": _node("dopri5", True),
    "monai_unet": _monai_unet,
    "swin_unetr": _swin_unetr,
    "dynunet": _dynunet,
    "realnvp": _realnvp,
    "spline_flow": _spline_flow,
    "e3nn_potential": _e3nn_potential,
    "fno": _fno,
    "tfno": _tfno,
}


def main(argv: list[str] | None = None) -> int:
    return families_probe.main(argv, MODELS, "model", __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
