"""Models from research code people fine-tune, in fp32 and under bf16 autocast (the
twenty-fourth probe).

    python benchmarks/research_probe.py [model ...] [-n 6] [--fp32-only]

Each package is written by its own authors, nothing like transformers: ESM-2 (fair-esm), the
protein language model, trained by masked-token prediction on padded sequences (its token
dropout rescales embeddings by the count of masked tokens per sequence), and fine-tuned as
people do, a head on its mean-pooled last representation; nnU-Net's networks
(dynamic_network_architectures): a 3-D U-Net with instance norm and in-place LeakyReLU, a
residual-encoder one, and a 2-D one with batch norm, each trained with deep supervision (a loss
on every decoder stage against a downsampled target, weighted as nnU-Net weights them); Segment
Anything (segment_anything) fine-tuned on box prompts as MedSAM does it, the image encoder's
windowed and global attention with relative positions and the two-way mask decoder, one image
at a time in a Python loop; the Reformer (reformer_pytorch): reversible layers (a custom
autograd function that rebuilds activations in backward under saved RNG states), LSH attention
with dropout, layer dropout, and a product-key memory, and an irreversible one; the Perceiver
and Perceiver IO (perceiver_pytorch); and the FT-Transformer (rtdl_revisiting_models) on
numerical and categorical features; and lucidrains' mixtures of experts and codebooks: a
language model with ST-MoE layers (top-2 routing by threshold with capacity, its balance and
router z-losses added to the loss), a ViT with Soft MoE layers, a VQ-VAE whose codebook is
initialised by k-means on its first batch and updated by EMA in forward (dead codes replaced
from the batch), and the Routing Transformer (online k-means routing, its centroids updated by
a backward hook, and a mixture-of-experts layer with its auxiliary loss). Then as `families_probe.py` does: planned at its smallest
peak and half way, each plan verified and run on a smaller batch, and `-n` schedules near the
smallest-peak one measured.

Needs ``pip install --no-deps fair-esm dynamic-network-architectures segment-anything
reformer-pytorch axial-positional-embedding local-attention product-key-memory colt5-attention
hyper-connections torch-einops-utils perceiver-pytorch rtdl_revisiting_models st-moe-pytorch
soft-moe-pytorch vector-quantize-pytorch routing-transformer mixture-of-experts beartype
loguru`` (and timm, einops and einx). segment_anything imports torchvision's transforms, which do not import beside this CPU
torch: the timm probe's stub stands in (no model here uses it). Not part of the test suite.
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
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import families_probe  # noqa: E402
from benchmarks.libraries_probe import _labels_loss  # noqa: E402
from tests.zoo import Case  # noqa: E402

# -- ESM-2 -------------------------------------------------------------------------------------


def _esm_tokens(alphabet: Any, batch: int, length: int, g: torch.Generator,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random protein sequences of varying length, padded: tokens with 15% of the residues
    masked, and the labels of the masked ones (-100 elsewhere)."""
    residues = torch.randint(4, 24, (batch, length), generator=g)
    lengths = torch.randint(length // 2, length - 1, (batch,), generator=g)
    lengths[0] = length - 2
    tokens = torch.full((batch, length), alphabet.padding_idx)
    labels = torch.full((batch, length), -100)
    for i, n in enumerate(lengths.tolist()):
        tokens[i, 0] = alphabet.cls_idx
        tokens[i, 1:n + 1] = residues[i, :n]
        tokens[i, n + 1] = alphabet.eos_idx
        masked = torch.rand(n, generator=g) < 0.15
        masked[0] = True
        labels[i, 1:n + 1][masked] = residues[i, :n][masked]
        tokens[i, 1:n + 1][masked] = alphabet.mask_idx
    return tokens, labels


def _esm2(layers: int = 3) -> Any:
    import esm

    alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
    torch.manual_seed(0)
    return esm.model.esm2.ESM2(num_layers=layers, embed_dim=64, attention_heads=4,
                               alphabet=alphabet, token_dropout=True), alphabet


def _esm2_mlm() -> Case:
    """ESM-2 trained as it was: masked-token cross entropy on padded sequences."""
    model, alphabet = _esm2()
    g = torch.Generator().manual_seed(1)
    tokens, labels = _esm_tokens(alphabet, 8, 96, g)
    small, _ = _esm_tokens(alphabet, 2, 48, g)

    def loss_fn(out: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = out["logits"]
        return F.cross_entropy(logits.float().flatten(0, 1),
                               labels[: logits.shape[0], : logits.shape[1]].flatten())

    return Case(model.train(), (tokens,), loss_fn, (small,), "encoder")


class _EsmRegressor(nn.Module):
    """A property head on ESM-2's mean-pooled last layer, padding left out of the mean."""

    def __init__(self) -> None:
        super().__init__()
        self.esm, alphabet = _esm2()
        self.padding_idx = alphabet.padding_idx
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(64, 1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        layers = self.esm.num_layers
        reps = self.esm(tokens, repr_layers=[layers])["representations"][layers]
        keep = (tokens != self.padding_idx).unsqueeze(-1).to(reps.dtype)
        pooled = (reps * keep).sum(1) / keep.sum(1)
        return self.head(pooled).squeeze(-1)


def _esm2_regression() -> Case:
    model = _EsmRegressor()
    g = torch.Generator().manual_seed(1)
    import esm

    alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
    tokens, _ = _esm_tokens(alphabet, 8, 96, g)
    small, _ = _esm_tokens(alphabet, 2, 48, g)
    target = torch.randn(8, generator=g)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.float(), target[: out.shape[0]])

    return Case(model.train(), (tokens,), loss_fn, (small,), "encoder")


# -- nnU-Net -----------------------------------------------------------------------------------


def _deep_supervision_loss(target: torch.Tensor, classes: int) -> Callable[[Any], torch.Tensor]:
    """nnU-Net's loss: cross entropy plus soft Dice on each output, the target max-pooled to its
    size, weighted 1, 1/2, 1/4, ... (the lowest-resolution output gets no weight), normalised."""
    def loss_fn(outs: Any) -> torch.Tensor:
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        weights = [1 / 2 ** i for i in range(len(outs))]
        if len(outs) > 1:
            weights[-1] = 0.0
        total = sum(weights)
        loss = outs[0].new_zeros((), dtype=torch.float32)
        for w, out in zip(weights, outs):
            if w == 0:
                continue
            t = target[: out.shape[0]].float()
            while t.shape[2:] != out.shape[2:]:
                t = (F.max_pool3d if t.dim() == 5 else F.max_pool2d)(t, 2)
            t = t.squeeze(1).long()
            logits = out.float()
            ce = F.cross_entropy(logits, t)
            probs = logits.softmax(1)
            onehot = F.one_hot(t, classes).movedim(-1, 1).float()
            dims = tuple(range(2, logits.dim()))
            dice = (2 * (probs * onehot).sum(dims) + 1e-5) / (probs.sum(dims) + onehot.sum(dims) + 1e-5)
            loss = loss + w / total * (ce + 1 - dice[:, 1:].mean())
        return loss

    return loss_fn


def _nnunet(kind: str) -> Callable[[], Case]:
    def build() -> Case:
        from dynamic_network_architectures.architectures.unet import (
            PlainConvUNet,
            ResidualEncoderUNet,
        )

        torch.manual_seed(0)
        classes = 3
        if kind == "2d_bn":
            conv, norm, size, small = nn.Conv2d, nn.BatchNorm2d, (64, 64), (32, 32)
        else:
            conv, norm, size, small = nn.Conv3d, nn.InstanceNorm3d, (24, 24, 24), (16, 16, 16)
        common = dict(input_channels=1, num_classes=classes, n_stages=4,
                      features_per_stage=(8, 16, 32, 64), conv_op=conv, kernel_sizes=3,
                      strides=(1, 2, 2, 2), conv_bias=True, norm_op=norm,
                      norm_op_kwargs={"eps": 1e-5, "affine": True}, dropout_op=None,
                      nonlin=nn.LeakyReLU, nonlin_kwargs={"inplace": True},
                      deep_supervision=True)
        if kind == "resenc":
            model = ResidualEncoderUNet(n_blocks_per_stage=(1, 2, 2, 2),
                                        n_conv_per_stage_decoder=(1, 1, 1), **common)
        else:
            model = PlainConvUNet(n_conv_per_stage=2, n_conv_per_stage_decoder=2, **common)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 1, *size, generator=g)
        xs = torch.randn(1, 1, *small, generator=g)
        target = torch.randint(0, classes, (2, 1, *size), generator=g)

        def loss_fn(outs: Any) -> torch.Tensor:  # a smaller batch: the target's corner
            corner = tuple(slice(0, n) for n in outs[0].shape[2:])
            return _deep_supervision_loss(target[(slice(None), slice(None), *corner)], classes)(outs)

        return Case(model.train(), (x,), loss_fn, (xs,), "vision")

    return build


# -- Segment Anything --------------------------------------------------------------------------


class _SamBoxes(nn.Module):
    """SAM fine-tuned on box prompts (MedSAM's loop): each image's embedding decoded against its
    boxes, one image at a time, as ``Sam.forward`` does (which runs under ``no_grad``)."""

    def __init__(self) -> None:
        super().__init__()
        from functools import partial

        from benchmarks.timm_probe import _timm

        _timm()  # installs the torchvision stub where torchvision does not import
        from segment_anything.modeling import (
            ImageEncoderViT,
            MaskDecoder,
            PromptEncoder,
            TwoWayTransformer,
        )

        torch.manual_seed(0)
        self.image_encoder = ImageEncoderViT(
            img_size=64, patch_size=8, embed_dim=64, depth=4, num_heads=4, out_chans=32,
            norm_layer=partial(nn.LayerNorm, eps=1e-6), window_size=4, global_attn_indexes=(1, 3),
            use_rel_pos=True, qkv_bias=True)
        self.prompt_encoder = PromptEncoder(embed_dim=32, image_embedding_size=(8, 8),
                                            input_image_size=(64, 64), mask_in_chans=8)
        self.mask_decoder = MaskDecoder(
            num_multimask_outputs=3, transformer_dim=32, iou_head_depth=3, iou_head_hidden_dim=32,
            transformer=TwoWayTransformer(depth=2, embedding_dim=32, mlp_dim=64, num_heads=2))

    def forward(self, images: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        embeddings = self.image_encoder(images)
        masks = []
        for embedding, box in zip(embeddings, boxes):
            sparse, dense = self.prompt_encoder(points=None, boxes=box, masks=None)
            low_res, _ = self.mask_decoder(
                image_embeddings=embedding.unsqueeze(0), image_pe=self.prompt_encoder.get_dense_pe(),
                sparse_prompt_embeddings=sparse, dense_prompt_embeddings=dense,
                multimask_output=False)
            masks.append(low_res)
        return torch.stack(masks)


def _sam() -> Case:
    model = _SamBoxes()
    g = torch.Generator().manual_seed(1)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` images, two boxes each (x0, y0, x1, y1), 24 pixels a side."""
        corners = torch.randint(0, 32, (n, 2, 2), generator=g).float()
        return torch.randn(n, 3, 64, 64, generator=g), torch.cat([corners, corners + 24], -1)

    images, boxes = batch(4)
    small = batch(2)
    target = (torch.rand(4, 2, 1, 32, 32, generator=g) > 0.5).float()

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        logits = out.float()
        t = target[: out.shape[0]]
        probs = logits.sigmoid()
        dice = 1 - (2 * (probs * t).sum((-1, -2)) + 1) / (probs.sum((-1, -2)) + t.sum((-1, -2)) + 1)
        return F.binary_cross_entropy_with_logits(logits, t) + dice.mean()

    return Case(model.train(), (images, boxes), loss_fn, small, "vision")


# -- Reformer, Perceiver, FT-Transformer -------------------------------------------------------


def _lm_loss(tokens: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        t = tokens[: logits.shape[0], 1: logits.shape[1]]
        return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), t.flatten())

    return loss_fn


def _reformer(reversible: bool) -> Callable[[], Case]:
    def build() -> Case:
        from reformer_pytorch import ReformerLM

        torch.manual_seed(0)
        kw: dict[str, Any] = dict(num_tokens=256, dim=64, depth=3, max_seq_len=256, heads=4,
                                  dim_head=16, bucket_size=16, n_hashes=2, causal=True,
                                  lsh_dropout=0.1, ff_dropout=0.1, post_attn_dropout=0.1,
                                  ff_chunks=2)
        if reversible:
            kw.update(layer_dropout=0.1, pkm_layers=(1,), pkm_num_keys=64)
        else:
            kw.update(reverse_thres=1024, n_local_attn_heads=2)
        model = ReformerLM(**kw)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 256, (4, 256), generator=g)
        small = torch.randint(0, 256, (2, 128), generator=g)
        return Case(model.train(), (tokens,), _lm_loss(tokens), (small,), "decoder")

    return build


def _perceiver() -> Case:
    from perceiver_pytorch import Perceiver

    torch.manual_seed(0)
    model = Perceiver(input_channels=3, input_axis=2, num_freq_bands=6, max_freq=10.0, depth=3,
                      num_latents=32, latent_dim=64, cross_heads=1, latent_heads=4,
                      cross_dim_head=32, latent_dim_head=16, num_classes=10, attn_dropout=0.1,
                      ff_dropout=0.1, weight_tie_layers=False, self_per_cross_attn=2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, 32, 3, generator=g)
    xs = torch.randn(2, 16, 16, 3, generator=g)
    labels = torch.randint(0, 10, (4,), generator=g)
    return Case(model.train(), (x,), _labels_loss(labels), (xs,), "vision")


class _PerceiverIOLM(nn.Module):
    """Perceiver IO as a masked language model: token embeddings in, one query per position out,
    a padding mask on the inputs."""

    def __init__(self) -> None:
        super().__init__()
        from perceiver_pytorch import PerceiverIO

        torch.manual_seed(0)
        self.embed = nn.Embedding(256, 64)
        self.pos = nn.Embedding(128, 64)
        self.io = PerceiverIO(depth=3, dim=64, queries_dim=64, logits_dim=256, num_latents=32,
                              latent_dim=64, cross_heads=1, latent_heads=4, cross_dim_head=32,
                              latent_dim_head=16, decoder_ff=True, seq_dropout_prob=0.1)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pos = self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        x = self.embed(tokens) + pos
        queries = pos.unsqueeze(0).expand(tokens.shape[0], -1, -1)
        return self.io(x, mask=mask, queries=queries)


def _perceiver_io() -> Case:
    model = _PerceiverIOLM()
    g = torch.Generator().manual_seed(1)

    def batch(n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 256, (n, length), generator=g)
        mask = torch.ones(n, length, dtype=torch.bool)
        mask[-1, length // 2:] = False
        return tokens, mask

    tokens, mask = batch(4, 128)
    labels = tokens.masked_fill(~mask, -100)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        t = labels[: logits.shape[0], : logits.shape[1]]
        return F.cross_entropy(logits.float().flatten(0, 1), t.flatten())

    return Case(model.train(), (tokens, mask), loss_fn, batch(2, 64), "encoder")


def _ft_transformer() -> Case:
    import rtdl_revisiting_models as rtdl

    torch.manual_seed(0)
    kw = rtdl.FTTransformer.get_default_kwargs(n_blocks=3)
    kw.update(d_block=64, attention_n_heads=4, ffn_d_hidden_multiplier=2.0)
    model = rtdl.FTTransformer(n_cont_features=12, cat_cardinalities=[5, 7, 3], d_out=1, **kw)
    g = torch.Generator().manual_seed(1)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        cats = torch.stack([torch.randint(0, c, (n,), generator=g) for c in (5, 7, 3)], 1)
        return torch.randn(n, 12, generator=g), cats

    x = batch(256)
    y = torch.randn(256, generator=g)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.float().squeeze(-1), y[: out.shape[0]])

    return Case(model.train(), x, loss_fn, batch(32), "encoder")


class _MoELM(nn.Module):
    """A decoder whose feed-forward layers are ST-MoE blocks; returns the logits and the sum of
    the routers' auxiliary losses, which the loss adds."""

    def __init__(self) -> None:
        super().__init__()
        from st_moe_pytorch import MoE, SparseMoEBlock

        torch.manual_seed(0)
        self.embed = nn.Embedding(256, 64)
        self.attn = nn.ModuleList(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1,
                                                             batch_first=True) for _ in range(2))
        self.moe = nn.ModuleList(SparseMoEBlock(MoE(dim=64, num_experts=4, gating_top_n=2),
                                                add_ff_before=True, add_ff_after=True)
                                 for _ in range(2))
        self.head = nn.Linear(64, 256)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = tokens.shape[1]
        causal = torch.triu(torch.full((n, n), float("-inf"), device=tokens.device), 1)
        x, aux = self.embed(tokens), tokens.new_zeros((), dtype=torch.float32)
        for attn, moe in zip(self.attn, self.moe):
            x = attn(x, src_mask=causal, is_causal=True)
            out = moe(x)
            x, aux = out.outputs, aux + out.total_aux_loss
        return self.head(x), aux


def _lm_aux_loss(tokens: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    lm = _lm_loss(tokens)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return lm(out[0]) + out[1].float().sum()

    return loss_fn


def _st_moe() -> Case:
    model = _MoELM()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4, 128), generator=g)
    small = torch.randint(0, 256, (2, 64), generator=g)
    return Case(model.train(), (tokens,), _lm_aux_loss(tokens), (small,), "moe")


class _SoftMoEViT(nn.Module):
    """Patches, attention, and Soft MoE feed-forward layers (slots per expert from the fixed
    sequence length), mean-pooled to classes."""

    def __init__(self) -> None:
        super().__init__()
        from soft_moe_pytorch import SoftMoE

        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, 64, 8, 8)
        self.pos = nn.Parameter(torch.randn(1, 64, 64) * 0.02)
        self.attn = nn.ModuleList(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1,
                                                             batch_first=True) for _ in range(2))
        self.moe = nn.ModuleList(SoftMoE(dim=64, seq_len=64, num_experts=4, dropout=0.1)
                                 for _ in range(2))
        self.head = nn.Linear(64, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2) + self.pos
        for attn, moe in zip(self.attn, self.moe):
            x = attn(x)
            x = x + moe(x)
        return self.head(x.mean(1))


def _soft_moe() -> Case:
    model = _SoftMoEViT()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 64, 64, generator=g)
    labels = torch.randint(0, 10, (4,), generator=g)
    return Case(model.train(), (x,), _labels_loss(labels), (x[:2],), "moe")


class _VQVAE(nn.Module):
    """A VQ-VAE: conv encoder, a codebook initialised by k-means on the first batch and updated
    by EMA in forward, dead codes replaced; returns the reconstruction and the commitment loss."""

    def __init__(self) -> None:
        super().__init__()
        from vector_quantize_pytorch import VectorQuantize

        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Conv2d(3, 32, 4, 2, 1), nn.GELU(), nn.Conv2d(32, 32, 4, 2, 1),
                                 nn.GELU(), nn.Conv2d(32, 32, 3, 1, 1))
        self.vq = VectorQuantize(dim=32, codebook_size=64, decay=0.9, kmeans_init=True,
                                 kmeans_iters=3, threshold_ema_dead_code=2, commitment_weight=0.25,
                                 accept_image_fmap=True)
        self.dec = nn.Sequential(nn.ConvTranspose2d(32, 32, 4, 2, 1), nn.GELU(),
                                 nn.ConvTranspose2d(32, 3, 4, 2, 1))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        quantized, _, commit = self.vq(self.enc(images))
        return self.dec(quantized), commit


def _vq_vae() -> Case:
    model = _VQVAE()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 32, 32, generator=g)
    xs = torch.randn(2, 3, 16, 16, generator=g)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        recon, commit = out
        target = x if recon.shape == x.shape else xs
        return F.mse_loss(recon.float(), target) + commit.float().sum()

    return Case(model.train(), (x,), loss_fn, (xs,), "plain")


def _routing_transformer() -> Case:
    from routing_transformer import RoutingTransformerLM

    torch.manual_seed(0)
    model = RoutingTransformerLM(num_tokens=256, dim=64, depth=2, max_seq_len=128, heads=4,
                                 dim_head=16, window_size=32, causal=True, attn_dropout=0.1,
                                 ff_dropout=0.1, n_local_attn_heads=2, moe_layers=(1,),
                                 moe_num_experts=4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4, 128), generator=g)
    small = torch.randint(0, 256, (2, 64), generator=g)
    return Case(model.train(), (tokens,), _lm_aux_loss(tokens), (small,), "decoder")


MODELS: dict[str, Callable[[], Case]] = {
    "esm2_mlm": _esm2_mlm,
    "esm2_regression": _esm2_regression,
    "nnunet_3d": _nnunet("3d"),
    "nnunet_resenc_3d": _nnunet("resenc"),
    "nnunet_2d_bn": _nnunet("2d_bn"),
    "sam_boxes": _sam,
    "reformer_reversible": _reformer(True),
    "reformer": _reformer(False),
    "perceiver": _perceiver,
    "perceiver_io": _perceiver_io,
    "ft_transformer": _ft_transformer,
    "st_moe": _st_moe,
    "soft_moe_vit": _soft_moe,
    "vq_vae": _vq_vae,
    "routing_transformer": _routing_transformer,
}


def main(argv: list[str] | None = None) -> int:
    return families_probe.main(argv, MODELS, "model", __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
