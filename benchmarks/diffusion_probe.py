"""Diffusion models people train: the image and video transformers and U-Nets of diffusers,
in fp32 and under bf16 autocast (the seventeenth probe).

    HF_HUB_OFFLINE=1 python benchmarks/diffusion_probe.py [model ...] [-n 6] [--fp32-only]

The zoos hold three diffusers models (Stable Diffusion's U-Net, Flux, the KL autoencoder).
Diffusion training differs from language modelling in what a step carries: latents patched
into tokens, a timestep embedding that modulates every block (adaLN), text states concatenated
with the image tokens (MMDiT: SD3, AuraFlow, Flux 2, Chroma, Qwen-Image) or read by cross
attention (PixArt, Sana's linear attention, Lumina 2's refiners), routed experts (HiDream),
a control branch whose residuals feed another model (ControlNet, Wan VACE), video latents
(CogVideoX, Wan, HunyuanVideo, LTX-Video, Mochi, Stable Video Diffusion, AnimateDiff) and LoRA
adapters added through diffusers' own ``add_adapter``. Each model is a small config with random weights, dropout 0.1 where the
config has one, padded text where the model takes a mask, and the noise-prediction MSE as its
loss; then as `families_probe.py` does: planned at its smallest peak and half way, each plan
verified and run on a smaller batch, and `-n` schedules near the smallest-peak one measured.
Not part of the test suite (minutes of CI).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import families_probe  # noqa: E402
from benchmarks.outside_zoo import _noise_mse  # noqa: E402
from tests.zoo import Case, P  # noqa: E402


def _text(rows: int, tokens: int, dim: int) -> torch.Tensor:
    return torch.randn(rows, tokens, dim)


def _mask(rows: int, tokens: int, lengths: list[int]) -> torch.Tensor:
    """A right-padded text mask, 1 on real tokens (long, as tokenizers return it)."""
    return (torch.arange(tokens) < torch.tensor(lengths)[:, None]).long()


def _text_mask(rows: int, tokens: int) -> torch.Tensor:
    """Row i has 3 i padding tokens at its end."""
    return _mask(rows, tokens, [tokens - 3 * i for i in range(rows)])


def _case(model: torch.nn.Module, batch: Callable[..., dict[str, Any]], big: tuple, small: tuple,
          field: str = "sample") -> Case:
    return Case(model.train(), batch(*big), _noise_mse(field), batch(*small), "diffusion")


def _sd3() -> Case:
    """SD3's MMDiT: image and text tokens in one joint attention, adaLN from the timestep and
    pooled text, a dual-attention (SD3.5) first layer and RMS query-key norm."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
        pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16,
        dual_attention_layers=(0,), qk_norm="rms_norm")

    def batch(rows: int, side: int, tokens: int) -> dict[str, Any]:
        return {"hidden_states": torch.randn(rows, 4, side, side),
                "encoder_hidden_states": _text(rows, tokens, 32),
                "pooled_projections": torch.randn(rows, 16), "timestep": torch.randint(0, 1000, (rows,))}

    return _case(model, batch, (2, 16, 9), (1, 8, 5))


def _pixart() -> Case:
    """PixArt-alpha/sigma: adaLN-single, cross attention to padded T5 states with their mask."""
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    model = PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
        dropout=P, cross_attention_dim=32, sample_size=8, patch_size=2, caption_channels=24,
        norm_num_groups=8)

    def batch(rows: int, side: int, tokens: int) -> dict[str, Any]:
        return {"hidden_states": torch.randn(rows, 4, side, side),
                "encoder_hidden_states": _text(rows, tokens, 24),
                "encoder_attention_mask": _text_mask(rows, tokens),
                "timestep": torch.randint(0, 1000, (rows,)),
                "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}

    noise_mse = _noise_mse("sample")

    def loss(out: Any) -> torch.Tensor:  # PixArt predicts noise and variance: the noise half
        return noise_mse(SimpleNamespace(sample=out.sample[:, :4]))

    return Case(model.train(), batch(2, 16, 9), loss, batch(1, 8, 5), "diffusion")


def _dit() -> Case:
    """DiT: class-conditioned, adaLN-zero."""
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                  out_channels=4, num_layers=2, dropout=P, sample_size=8,
                                  patch_size=2, num_embeds_ada_norm=10)

    def batch(rows: int, side: int) -> dict[str, Any]:
        return {"hidden_states": torch.randn(rows, 4, side, side),
                "timestep": torch.randint(0, 1000, (rows,)),
                "class_labels": torch.randint(0, 10, (rows,))}

    return _case(model, batch, (2, 16), (1, 8))


def _sana() -> Case:
    """Sana: linear attention over image tokens (ReLU kernels, no softmax), cross attention to
    masked text, a Mix-FFN with a depthwise convolution."""
    from diffusers import SanaTransformer2DModel

    torch.manual_seed(0)
    model = SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32,
        caption_channels=24, dropout=P, sample_size=8, patch_size=1, qk_norm="rms_norm_across_heads")

    def batch(rows: int, side: int, tokens: int) -> dict[str, Any]:
        return {"hidden_states": torch.randn(rows, 4, side, side),
                "encoder_hidden_states": _text(rows, tokens, 24),
                "encoder_attention_mask": _text_mask(rows, tokens),
                "timestep": torch.randint(0, 1000, (rows,))}

    return _case(model, batch, (2, 12, 9), (1, 6, 5))


def _auraflow() -> Case:
    """AuraFlow: MMDiT layers, then single-stream layers; register tokens."""
    from diffusers import AuraFlowTransformer2DModel

    torch.manual_seed(0)
    model = AuraFlowTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        caption_projection_dim=32, out_channels=4, pos_embed_max_size=64)

    def batch(rows: int, side: int, tokens: int) -> dict[str, Any]:
        return {"hidden_states": torch.randn(rows, 4, side, side),
                "encoder_hidden_states": _text(rows, tokens, 32),
                "timestep": torch.rand(rows)}

    return _case(model, batch, (2, 16, 9), (1, 8, 5))


def _lumina2() -> Case:
    """Lumina-Image 2.0: noise and context refiners, then joint layers over the concatenated
    tokens, with a padded caption mask, grouped-query attention and 3-axis RoPE."""
    from diffusers import Lumina2Transformer2DModel

    torch.manual_seed(0)
    model = Lumina2Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2,
        num_refiner_layers=1, num_attention_heads=4, num_kv_heads=2, multiple_of=16,
        axes_dim_rope=(4, 2, 2), axes_lens=(64, 32, 32), cap_feat_dim=24)

    def batch(rows: int, side: int, tokens: int) -> dict[str, Any]:
        return {"hidden_states": torch.randn(rows, 4, side, side), "timestep": torch.rand(rows),
                "encoder_hidden_states": _text(rows, tokens, 24),
                "encoder_attention_mask": _text_mask(rows, tokens).bool()}

    return _case(model, batch, (2, 16, 9), (1, 8, 5))


def _qwen_image() -> Case:
    """Qwen-Image: MMDiT with a padded text mask and RoPE laid out from `img_shapes`."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))

    def batch(rows: int, side: int, tokens: int) -> dict[str, Any]:
        return {"hidden_states": torch.randn(rows, side * side, 16),
                "encoder_hidden_states": _text(rows, tokens, 32),
                "encoder_hidden_states_mask": _text_mask(rows, tokens),
                "timestep": torch.rand(rows), "img_shapes": [(1, side, side)] * rows}

    return _case(model, batch, (2, 8, 9), (1, 4, 5))


def _flux2() -> Case:
    """Flux 2: double- then single-stream blocks with modulation shared across blocks, 4-axis
    RoPE, guidance embedding."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)

    def batch(rows: int, side: int, tokens: int) -> dict[str, Any]:
        img = torch.zeros(side, side, 4)
        img[..., 1] = torch.arange(side)[:, None]
        img[..., 2] = torch.arange(side)[None, :]
        txt = torch.zeros(tokens, 4)
        txt[:, 3] = torch.arange(tokens)
        return {"hidden_states": torch.randn(rows, side * side, 16),
                "encoder_hidden_states": _text(rows, tokens, 32), "timestep": torch.rand(rows),
                "img_ids": img.reshape(-1, 4), "txt_ids": txt, "guidance": torch.full((rows,), 3.5)}

    return _case(model, batch, (2, 8, 9), (1, 4, 5))


def _chroma() -> Case:
    """Chroma: Flux without the pooled-text path, modulation from a small approximator MLP,
    with an attention mask over padded text."""
    from diffusers import ChromaTransformer2DModel

    torch.manual_seed(0)
    model = ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
        approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=1)

    def batch(rows: int, side: int, tokens: int) -> dict[str, Any]:
        ids = torch.zeros(side, side, 3)
        ids[..., 1] = torch.arange(side)[:, None]
        ids[..., 2] = torch.arange(side)[None, :]
        mask = torch.cat([_text_mask(rows, tokens), torch.ones(rows, side * side, dtype=torch.long)], 1).bool()
        return {"hidden_states": torch.randn(rows, side * side, 16),
                "encoder_hidden_states": _text(rows, tokens, 32), "timestep": torch.rand(rows),
                "img_ids": ids.reshape(-1, 3), "txt_ids": torch.zeros(tokens, 3),
                "attention_mask": mask}

    return _case(model, batch, (2, 8, 9), (1, 4, 5))


def _hidream() -> Case:
    """HiDream-I1: double- and single-stream blocks whose feed-forwards are routed experts
    (top-2 of 4 plus a shared expert), text from two encoders and several Llama layers."""
    from diffusers import HiDreamImageTransformer2DModel

    torch.manual_seed(0)
    model = HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_channels=[32, 16], text_emb_dim=24, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(32, 32),
        llama_layers=[0, 1])

    def batch(rows: int, side: int, tokens: int) -> dict[str, Any]:
        return {"hidden_states": torch.randn(rows, 4, side, side),
                "timesteps": torch.randint(0, 1000, (rows,)),
                "encoder_hidden_states_t5": _text(rows, tokens, 32),
                "encoder_hidden_states_llama3": torch.randn(2, rows, tokens, 16),
                "pooled_embeds": torch.randn(rows, 24)}

    return _case(model, batch, (2, 16, 9), (1, 8, 5))


def _ddpm_unet() -> Case:
    """The DDPM U-Net (`UNet2DModel`): self-attention down and up blocks, class-conditional."""
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    model = UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(16, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=8, norm_num_groups=8,
        dropout=P, num_class_embeds=10)

    def batch(rows: int, size: int) -> dict[str, Any]:
        return {"sample": torch.randn(rows, 3, size, size),
                "timestep": torch.randint(0, 1000, (rows,)),
                "class_labels": torch.randint(0, 10, (rows,))}

    return _case(model, batch, (4, 32), (2, 16))


def _tiny_sd_unet_kwargs() -> dict[str, Any]:
    return dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                block_out_channels=(32, 64),
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                attention_head_dim=8, norm_num_groups=8)


class _ControlledUNet(torch.nn.Module):
    """ControlNet training: a control branch reads the conditioning image and hands its
    residuals to a frozen U-Net; only the branch trains (as diffusers' train_controlnet.py)."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import ControlNetModel, UNet2DConditionModel

        self.unet = UNet2DConditionModel(**_tiny_sd_unet_kwargs(), dropout=P).requires_grad_(False)
        kwargs = _tiny_sd_unet_kwargs()
        for key in ("sample_size", "out_channels", "up_block_types"):
            kwargs.pop(key)
        self.controlnet = ControlNetModel(**kwargs, conditioning_embedding_out_channels=(8, 16, 16, 16))

    def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond):
        down, mid = self.controlnet(sample, timestep, encoder_hidden_states=encoder_hidden_states,
                                    controlnet_cond=controlnet_cond, return_dict=False)
        return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states,
                         down_block_additional_residuals=down, mid_block_additional_residual=mid)


def _controlnet() -> Case:
    torch.manual_seed(0)
    model = _ControlledUNet()

    def batch(rows: int, size: int, tokens: int) -> dict[str, Any]:
        return {"sample": torch.randn(rows, 4, size, size),
                "timestep": torch.randint(0, 1000, (rows,)),
                "encoder_hidden_states": _text(rows, tokens, 32),
                "controlnet_cond": torch.rand(rows, 3, 8 * size, 8 * size)}

    return _case(model, batch, (2, 16, 9), (1, 8, 5))


def _sdxl_lora() -> Case:
    """SDXL-style U-Net (text-time added conditions) fine-tuned with LoRA through diffusers'
    ``add_adapter``, as train_dreambooth_lora_sdxl.py does: the base frozen."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    torch.manual_seed(0)
    kwargs = _tiny_sd_unet_kwargs()
    kwargs.update(addition_embed_type="text_time", addition_time_embed_dim=8,
                  projection_class_embeddings_input_dim=6 * 8 + 16, transformer_layers_per_block=(1, 2),
                  down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"))
    model = UNet2DConditionModel(**kwargs, dropout=P).requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                 target_modules=["to_k", "to_q", "to_v", "to_out.0"]))

    def batch(rows: int, size: int, tokens: int) -> dict[str, Any]:
        return {"sample": torch.randn(rows, 4, size, size),
                "timestep": torch.randint(0, 1000, (rows,)),
                "encoder_hidden_states": _text(rows, tokens, 32),
                "added_cond_kwargs": {"text_embeds": torch.randn(rows, 16),
                                      "time_ids": torch.tensor([[size * 8.0, size * 8, 0, 0, size * 8, size * 8]] * rows)}}

    return _case(model, batch, (2, 16, 9), (1, 8, 5))


def _cogvideox() -> Case:
    """`CogVideoXTransformer3DModel` (CogVideoX-2b layout): text and video tokens in one
    sequence, 3D sin-cos positions (recomputed on the fly when the size differs from the
    config's sample size), AdaLN from the timestep. Latents are (B, F, C, H, W), frames
    before channels. No text mask: the pipeline always pads T5 to ``max_text_seq_length`` and
    the sin-cos table has exactly that many text slots, so both batches keep 8 text tokens.
    DDPM timesteps (integers)."""
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        time_embed_dim=32, text_embed_dim=32, num_layers=2, dropout=P, sample_width=8,
        sample_height=8, sample_frames=9, patch_size=2, temporal_compression_ratio=4,
        max_text_seq_length=8)

    def batch(rows: int, frames: int, side: int) -> dict[str, Any]:
        return {"hidden_states": torch.randn(rows, frames, 4, side, side),
                "encoder_hidden_states": torch.randn(rows, 8, 32),
                "timestep": torch.randint(0, 1000, (rows,))}

    return Case(model.train(), batch(2, 3, 8), _noise_mse("sample"), batch(1, 2, 4), "diffusion")


def _wan() -> Case:
    """`WanTransformer3DModel` (Wan 2.1 T2V layout): 3D RoPE, self-attention over video
    tokens, cross-attention to T5 states, AdaLN from the timestep. No text mask in the forward:
    the pipeline zeroes the T5 states past each prompt's length, as done here. No dropout in
    the config. Flow-matching timesteps (floats in [0, 1000))."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
        rope_max_seq_len=32)

    def batch(rows: int, frames: int, side: int, tokens: int, lengths: list[int]) -> dict[str, Any]:
        text = torch.randn(rows, tokens, 32) * _mask(rows, tokens, lengths)[..., None]
        return {"hidden_states": torch.randn(rows, 4, frames, side, side),
                "timestep": torch.rand(rows) * 1000, "encoder_hidden_states": text}

    return Case(model.train(), batch(2, 3, 8, 7, [7, 4]), _noise_mse("sample"),
                batch(1, 2, 4, 5, [5]), "diffusion")


def _wan_vace() -> Case:
    """`WanVACETransformer3DModel`: Wan plus a control branch (VACE blocks at layers 0 and 1)
    whose hints are added to the main blocks' outputs; control latents in, per-layer scale left
    at its default (ones)."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(0)
    model = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
        rope_max_seq_len=32, vace_layers=[0, 1], vace_in_channels=8)

    def batch(rows: int, frames: int, side: int, tokens: int, lengths: list[int]) -> dict[str, Any]:
        text = torch.randn(rows, tokens, 32) * _mask(rows, tokens, lengths)[..., None]
        return {"hidden_states": torch.randn(rows, 4, frames, side, side),
                "timestep": torch.rand(rows) * 1000, "encoder_hidden_states": text,
                "control_hidden_states": torch.randn(rows, 8, frames, side, side)}

    return Case(model.train(), batch(2, 3, 8, 7, [7, 4]), _noise_mse("sample"),
                batch(1, 2, 4, 5, [5]), "diffusion")


def _hunyuan_video() -> Case:
    """`HunyuanVideoTransformer3DModel`: a token refiner on the text states (masked), then
    double-stream and single-stream blocks over video + text tokens with 3D RoPE, the text mask
    turned into a joint attention mask from its row sums (so it must be right-padded), AdaLN from
    timestep, pooled CLIP text and distilled guidance (``guidance = scale * 1000`` as the pipeline
    passes it). No dropout in the config. Flow-matching timesteps."""
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
        num_layers=2, num_single_layers=2, num_refiner_layers=2, mlp_ratio=2.0, patch_size=2,
        patch_size_t=1, guidance_embeds=True, text_embed_dim=32, pooled_projection_dim=16,
        rope_axes_dim=(4, 6, 6))

    def batch(rows: int, frames: int, side: int, tokens: int, lengths: list[int]) -> dict[str, Any]:
        return {"hidden_states": torch.randn(rows, 4, frames, side, side),
                "timestep": torch.rand(rows) * 1000,
                "encoder_hidden_states": torch.randn(rows, tokens, 32),
                "encoder_attention_mask": _mask(rows, tokens, lengths),
                "pooled_projections": torch.randn(rows, 16),
                "guidance": torch.full((rows,), 6000.0)}

    return Case(model.train(), batch(2, 3, 8, 7, [7, 4]), _noise_mse("sample"),
                batch(1, 2, 4, 5, [5]), "diffusion")


def _ltx_video() -> Case:
    """`LTXVideoTransformer3DModel`: packed latents (B, F*H*W, C) in, the latent grid's size as
    Python ints, RoPE scaled by ``rope_interpolation_scale`` (VAE compression / frame rate as
    the pipeline passes it), cross-attention to T5 states with the text mask turned into an
    additive bias. No dropout in the config. Flow-matching timesteps."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=16, cross_attention_dim=32, num_layers=2, caption_channels=32)

    def batch(rows: int, frames: int, side: int, tokens: int, lengths: list[int]) -> dict[str, Any]:
        return {"hidden_states": torch.randn(rows, frames * side * side, 8),
                "encoder_hidden_states": torch.randn(rows, tokens, 32),
                "timestep": torch.rand(rows) * 1000,
                "encoder_attention_mask": _mask(rows, tokens, lengths),
                "num_frames": frames, "height": side, "width": side,
                "rope_interpolation_scale": (8 / 25, 32.0, 32.0)}

    return Case(model.train(), batch(2, 3, 8, 7, [7, 4]), _noise_mse("sample"),
                batch(1, 2, 4, 5, [5]), "diffusion")


def _mochi() -> Case:
    """`MochiTransformer3DModel`: asymmetric joint attention (a narrower text stream), the
    text states attention-pooled under the mask into the AdaLN conditioning, learned 3D RoPE
    frequencies. Its attention processor loops over rows and keeps each row's real text tokens
    with `torch.nonzero` on the mask. No dropout in the config. Flow-matching timesteps."""
    from diffusers import MochiTransformer3DModel

    torch.manual_seed(0)
    model = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        pooled_projection_dim=16, in_channels=4, text_embed_dim=32, time_embed_dim=16,
        max_sequence_length=16)

    def batch(rows: int, frames: int, side: int, tokens: int, lengths: list[int]) -> dict[str, Any]:
        return {"hidden_states": torch.randn(rows, 4, frames, side, side),
                "encoder_hidden_states": torch.randn(rows, tokens, 32),
                "timestep": torch.rand(rows) * 1000,
                "encoder_attention_mask": _mask(rows, tokens, lengths)}

    return Case(model.train(), batch(2, 3, 8, 7, [7, 4]), _noise_mse("sample"),
                batch(1, 2, 4, 5, [5]), "diffusion")


def _svd_unet() -> Case:
    """`UNetSpatioTemporalConditionModel` (Stable Video Diffusion): latents (B, F, C, H, W) with
    the conditioning image's latent concatenated on channels (8 in), one CLIP image token as
    the cross-attention states, ``added_time_ids`` (fps, motion bucket, noise augmentation),
    EDM ``c_noise`` timesteps (floats); spatial and temporal ResNet / transformer blocks mixed
    by a learned blend. No dropout in the config."""
    from diffusers import UNetSpatioTemporalConditionModel

    torch.manual_seed(0)
    model = UNetSpatioTemporalConditionModel(
        sample_size=8, in_channels=8, out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        block_out_channels=(32, 64), addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=24, layers_per_block=2, cross_attention_dim=32,
        num_attention_heads=(2, 4), num_frames=3)

    def batch(rows: int, frames: int, side: int) -> dict[str, Any]:
        return {"sample": torch.randn(rows, frames, 8, side, side),
                "timestep": torch.randn(rows) * 0.5,
                "encoder_hidden_states": torch.randn(rows, 1, 32),
                "added_time_ids": torch.tensor([[6.0, 127.0, 0.02]]).repeat(rows, 1)}

    # 3 frames in the smaller batch too: under bf16 autocast, torch 2.13's CPU Conv3d (oneDNN)
    # gives weight gradients that differ from run to run for the temporal (3, 1, 1) kernels
    # at 2 frames, planned or not (cf. pytorch/pytorch#169688)
    return Case(model.train(), batch(2, 3, 8), _noise_mse("sample"), batch(1, 3, 4), "diffusion")


def _animatediff_unet() -> Case:
    """`UNetMotionModel` (AnimateDiff): an SD UNet with a temporal transformer (motion module)
    after every spatial block. Latents are (B, C, F, H, W) (its docstring says (B, F, C, H, W)),
    while the text states must come already repeated per frame, (B * F, tokens, dim), as the
    AnimateDiff pipeline passes them. Its ``attention_mask`` is not passed: the forward routes it
    to the spatial self-attention, not to the text (SD's CLIP states carry no mask anyway). No
    dropout in the config. DDPM timesteps."""
    from diffusers import UNetMotionModel

    torch.manual_seed(0)
    model = UNetMotionModel(
        sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
        up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion"),
        block_out_channels=(32, 64), layers_per_block=2, norm_num_groups=8,
        cross_attention_dim=32, num_attention_heads=2, motion_max_seq_length=8,
        motion_num_attention_heads=2)

    def batch(rows: int, frames: int, side: int, tokens: int) -> dict[str, Any]:
        text = torch.randn(rows, tokens, 32).repeat_interleave(frames, dim=0)
        return {"sample": torch.randn(rows, 4, frames, side, side),
                "timestep": torch.randint(0, 1000, (rows,)), "encoder_hidden_states": text}

    return Case(model.train(), batch(2, 3, 8, 7), _noise_mse("sample"), batch(1, 2, 4, 5),
                "diffusion")


CASES: dict[str, Callable[[], Case]] = {
    "sd3": _sd3, "pixart": _pixart, "dit": _dit, "sana": _sana, "auraflow": _auraflow,
    "lumina2": _lumina2, "qwen_image": _qwen_image, "flux2": _flux2, "chroma": _chroma,
    "hidream": _hidream, "ddpm_unet": _ddpm_unet, "controlnet": _controlnet,
    "sdxl_lora": _sdxl_lora, "cogvideox": _cogvideox, "wan": _wan, "wan_vace": _wan_vace,
    "hunyuan_video": _hunyuan_video, "ltx_video": _ltx_video, "mochi": _mochi,
    "svd_unet": _svd_unet, "animatediff_unet": _animatediff_unet,
}


if __name__ == "__main__":
    raise SystemExit(families_probe.main(None, CASES, "model", __doc__))
