"""More model families beside the test zoo: what `benchmarks/zoo_table.py --outside` plans.

Built the way a new user would try the planner on the model they train: small configs with random
weights, dropout 0.1, padded attention masks and ``use_cache=False`` where they apply, labels so
the output carries ``.loss``. Each builder returns a `tests.zoo.Case`; `tests/planner/test_zoo.py`
asserts the same checks on these as on the zoo's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tests.zoo import Case, P, _hf, _images, _lm_inputs

__all__ = ["CASES"]


def _decoder(config_cls: str, model_cls: str, **config: Any) -> Callable[[], Case]:
    """An HF causal LM, 2 rows of 32 tokens, the second right-padded to 20."""

    def build() -> Case:
        import transformers

        torch.manual_seed(0)
        model = _hf(getattr(transformers, model_cls), getattr(transformers, config_cls)(**config))
        return Case(model, _lm_inputs(512, 2, 32, [32, 20]), None, _lm_inputs(512, 1, 16),
                    "decoder")

    return build


def _classifier(config_cls: str, model_cls: str, **config: Any) -> Callable[[], Case]:
    """An HF sequence classifier (2 classes), the second row right-padded."""

    def batch(rows: int, seq: int, lengths: list[int]) -> dict[str, torch.Tensor]:
        real = (torch.arange(seq) < torch.tensor(lengths)[:, None]).long()
        return {"input_ids": torch.randint(1, 512, (rows, seq)) * real, "attention_mask": real,
                "labels": torch.randint(0, 2, (rows,))}

    def build() -> Case:
        import transformers

        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
        return Case(model.train(), batch(2, 32, [32, 17]), None, batch(1, 16, [16]), "encoder")

    return build


def _swin() -> Case:
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(0)
    config = SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                        window_size=4, hidden_dropout_prob=P, attention_probs_dropout_prob=P,
                        drop_path_rate=P, num_labels=10)
    return Case(SwinForImageClassification(config).train(), _images(2, 32), None, _images(1, 16),
                "vision")


def _beit() -> Case:
    """Relative position bias from an index the model builds on first use and keeps in an
    `lru_cache`, layer scale, drop path; 16x16 images resample the bias table."""
    from transformers import BeitConfig, BeitForImageClassification

    torch.manual_seed(0)
    config = BeitConfig(image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=3,
                        num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=P,
                        attention_probs_dropout_prob=P, drop_path_rate=P,
                        use_relative_position_bias=True, num_labels=10)
    return Case(BeitForImageClassification(config).train(), _images(2, 32), None,
                _images(1, 16, interpolate_pos_encoding=True), "vision")


def _led() -> Case:
    """Longformer's local attention in an encoder-decoder (the source padded to its window)."""
    from transformers import LEDConfig, LEDForConditionalGeneration

    torch.manual_seed(0)
    config = LEDConfig(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                       decoder_ffn_dim=128, max_encoder_position_embeddings=64,
                       max_decoder_position_embeddings=64, attention_window=[8, 8], dropout=P)

    def batch(rows: int, src: int, tgt: int) -> dict[str, Any]:
        real = torch.arange(src) < torch.tensor([src - 5 * i for i in range(rows)])[:, None]
        return {"input_ids": torch.randint(3, 512, (rows, src)).masked_fill(~real, 1),
                "attention_mask": real.long(), "labels": torch.randint(3, 512, (rows, tgt)),
                "use_cache": False}

    return Case(LEDForConditionalGeneration(config).train(), batch(2, 32, 16), None,
                batch(1, 16, 8), "encoder-decoder")


def _wav2vec2() -> Case:
    """CTC on raw audio: a convolutional front end, a weight-normed positional convolution."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    config = Wav2Vec2Config(
        vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, hidden_dropout=P,
        attention_dropout=P, activation_dropout=P, feat_proj_dropout=P, layerdrop=0.0,
        mask_time_prob=0.0, ctc_loss_reduction="mean", pad_token_id=0)

    def batch(rows: int, samples: int, labels: int) -> dict[str, torch.Tensor]:
        return {"input_values": torch.randn(rows, samples),
                "labels": torch.randint(1, 32, (rows, labels))}

    return Case(Wav2Vec2ForCTC(config).train(), batch(2, 4000, 20), None, batch(1, 2000, 10),
                "audio")


IMAGE = 500
"""The image placeholder token of the vision-language models below (their vocabulary is 512)."""


def _vlm_text(rows: int, images: int, text: int, before: tuple[int, ...] = (1,),
              after: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Token ids, mask and labels of `rows` rows: `before`, `images` placeholders, `after`, then
    `text` tokens; with more than one row, the last 5 of the second are padding. The labels leave
    out the placeholders and the padding, as the processors' collators do."""
    seq = [*before, *[IMAGE] * images, *after, *range(2, 2 + text)]
    ids = torch.tensor([seq] * rows)
    mask = torch.ones_like(ids)
    if rows > 1:
        mask[1, -5:] = 0
    labels = ids.masked_fill((ids == IMAGE) | (mask == 0), -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _llama_text(**extra: Any) -> dict[str, Any]:
    return dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                attention_dropout=P, **extra)


def _llava() -> Case:
    """LLaVA: a CLIP vision tower (features of its second-to-last layer), a projector, and a
    Llama whose input embeddings get the image features where the placeholders are
    (``masked_scatter``, after checking their count against the features')."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    torch.manual_seed(0)
    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2, dropout=P,
                              attention_dropout=P)
    config = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_llama_text()),
                         image_token_index=IMAGE, vision_feature_layer=-2)

    def batch(rows: int, text: int) -> dict[str, Any]:  # 16 patches per 32x32 image
        return {**_vlm_text(rows, 16, text), "pixel_values": torch.randn(rows, 3, 32, 32)}

    return Case(LlavaForConditionalGeneration(config).train(), batch(2, 40), None, batch(1, 8),
                "multimodal")


def _qwen2_vl() -> Case:
    """Qwen2-VL: a vision transformer over a variable grid of patches (``image_grid_thw``),
    merged 2x2, and multimodal RoPE, whose 3-D positions the model computes from the token ids
    and grids in a Python loop over rows and images."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    text = _llama_text(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    config = Qwen2VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE,
                           vision_start_token_id=501, vision_end_token_id=502)

    def batch(rows: int, side: int, text: int) -> dict[str, Any]:
        """One image of side x side patches per row (side**2 / 4 tokens after merging)."""
        out = _vlm_text(rows, side * side // 4, text, before=(1, 501), after=(502,))
        return {**out, "pixel_values": torch.randn(rows * side * side, 3 * 2 * 4 * 4),
                "image_grid_thw": torch.tensor([[1, side, side]] * rows),
                "mm_token_type_ids": (out["input_ids"] == IMAGE).long()}

    return Case(Qwen2VLForConditionalGeneration(config).train(), batch(2, 4, 40), None,
                batch(1, 2, 8), "multimodal")


def _paligemma() -> Case:
    """PaliGemma: SigLIP image tokens as a prefix that attends both ways (``token_type_ids``
    mark the suffix, which is causal), Gemma's decoder."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    torch.manual_seed(0)
    config = PaliGemmaConfig(
        vision_config=dict(model_type="siglip_vision_model", image_size=32, patch_size=8,
                           hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, attention_dropout=P),
        text_config=dict(model_type="gemma", vocab_size=512, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=16, attention_dropout=P),
        image_token_index=IMAGE, projection_dim=64)

    def batch(rows: int, text: int) -> dict[str, Any]:
        out = _vlm_text(rows, 16, text, before=(), after=(2,))
        suffix = torch.zeros_like(out["input_ids"])
        suffix[:, 17 + text // 2:] = 1  # the second half of the text is the answer
        return {**out, "pixel_values": torch.randn(rows, 3, 32, 32), "token_type_ids": suffix}

    return Case(PaliGemmaForConditionalGeneration(config).train(), batch(2, 40), None,
                batch(1, 8), "multimodal")


def _clip() -> Case:
    """Two towers and a contrastive loss (``return_loss=True``)."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64, dropout=P, attention_dropout=P)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, image_size=32, patch_size=8, dropout=P,
                  attention_dropout=P)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32))

    def batch(rows: int, seq: int) -> dict[str, Any]:
        ids = torch.randint(1, 512, (rows, seq))
        mask = torch.ones_like(ids)
        mask[-1, seq // 2:] = 0
        return {"input_ids": ids, "attention_mask": mask,
                "pixel_values": torch.randn(rows, 3, 32, 32), "return_loss": True}

    return Case(model.train(), batch(4, 32), None, batch(2, 16), "multimodal")


def _lstm() -> Case:
    """A 2-layer `nn.LSTM` language model: one module, so one region at most."""

    class LSTMLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 32)
            self.rnn = nn.LSTM(32, 64, 2, batch_first=True, dropout=P)
            self.head = nn.Linear(64, 100)

        def forward(self, x):
            return self.head(self.rnn(self.emb(x))[0])

    torch.manual_seed(0)
    x, y = torch.randint(0, 100, (4, 40)), torch.randint(0, 100, (4, 40))
    return Case(LSTMLM().train(), (x,),
                lambda out: F.cross_entropy(out.flatten(0, 1),
                                            y[:out.shape[0], :out.shape[1]].flatten()),
                (x[:2, :20],), "plain")


def _torch_transformer() -> Case:
    """`nn.TransformerEncoder` with a key padding mask (`nn.MultiheadAttention(x, x, x)`)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=P, batch_first=True)
    model = nn.TransformerEncoder(layer, 3).train()
    x = torch.randn(4, 32, 64)
    mask = torch.zeros(4, 32, dtype=torch.bool)
    mask[1, 20:] = True
    return Case(model, {"src": x, "src_key_padding_mask": mask}, lambda out: out.pow(2).mean(),
                {"src": x[:2, :16], "src_key_padding_mask": mask[:2, :16]}, "plain")


def _encoder_batch(rows: int, seq: int, lengths: list[int]) -> dict[str, torch.Tensor]:
    """Sequence-classification inputs, row i real for its first `lengths[i]` tokens."""
    real = (torch.arange(seq) < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": torch.randint(1, 512, (rows, seq)) * real, "attention_mask": real,
            "labels": torch.randint(0, 2, (rows,))}


def _encoder(config_cls: str, model_cls: str, **config: Any) -> Callable[[], Case]:
    """An HF sequence classifier at 4 rows of 64 tokens, two of them right-padded: at the
    classifiers' 2 x 32, some families' step peaks after backward (gradients of the weights),
    where no checkpointing changes anything."""

    def build() -> Case:
        import transformers

        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
        return Case(model.train(), _encoder_batch(4, 64, [64, 40, 64, 30]), None,
                    _encoder_batch(2, 32, [32, 20]), "encoder")

    return build


def _bigbird() -> Case:
    """Block-sparse attention, its random blocks drawn with numpy (seeded in training). The
    smaller batch keeps 48 tokens: at 36 or fewer BigBird replaces its attention modules by
    full attention for good (a warned, permanent change of the model, whose new modules'
    initialisation also draws from torch's RNG), after which no step compares with the one
    before."""
    from transformers import BigBirdConfig, BigBirdForSequenceClassification

    torch.manual_seed(0)
    config = BigBirdConfig(vocab_size=512, hidden_size=64, num_hidden_layers=3,
                           intermediate_size=128, num_attention_heads=4, hidden_dropout_prob=P,
                           attention_probs_dropout_prob=P, attention_type="block_sparse",
                           block_size=4, num_random_blocks=2, max_position_embeddings=128)
    return Case(BigBirdForSequenceClassification(config).train(),
                _encoder_batch(4, 64, [64, 40, 64, 30]), None, _encoder_batch(2, 48, [48, 20]),
                "encoder")


def _mpt() -> Case:
    """ALiBi attention biases instead of positions; 4 rows of 96 tokens (at 2 x 32 the step
    peaks after backward, on the weights' gradients)."""
    from transformers import MptConfig, MptForCausalLM

    torch.manual_seed(0)
    model = _hf(MptForCausalLM, MptConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=3,
                                          expansion_ratio=2, max_seq_len=128))
    return Case(model, _lm_inputs(512, 4, 96, [96, 60, 96, 80]), None, _lm_inputs(512, 2, 40),
                "decoder")


def _umt5() -> Case:
    """T5 with a relative attention bias of its own in every layer (not shared from the first)."""
    from transformers import UMT5Config, UMT5ForConditionalGeneration

    torch.manual_seed(0)
    config = UMT5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                        dropout_rate=P, pad_token_id=0, decoder_start_token_id=0)

    def batch(rows: int, src: int, tgt: int, lengths: list[int]) -> dict[str, Any]:
        real = (torch.arange(src) < torch.tensor(lengths)[:, None]).long()
        return {"input_ids": torch.randint(3, 512, (rows, src)) * real, "attention_mask": real,
                "labels": torch.randint(3, 512, (rows, tgt)), "use_cache": False}

    return Case(UMT5ForConditionalGeneration(config).train(), batch(4, 64, 48, [64, 40, 64, 50]),
                None, batch(2, 24, 16, [24, 15]), "encoder-decoder")


def _vit_mae() -> Case:
    """Masked-autoencoder pretraining: each forward masks half the patches at random
    (`torch.rand` noise, `argsort`, `gather`), so a replay must draw the same mask."""
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    torch.manual_seed(0)
    config = ViTMAEConfig(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=3,
                          num_attention_heads=4, intermediate_size=128, decoder_hidden_size=32,
                          decoder_num_hidden_layers=2, decoder_num_attention_heads=4,
                          decoder_intermediate_size=64, hidden_dropout_prob=P,
                          attention_probs_dropout_prob=P, mask_ratio=0.5)
    return Case(ViTMAEForPreTraining(config).train(), {"pixel_values": torch.randn(4, 3, 64, 64)},
                None, {"pixel_values": torch.randn(2, 3, 32, 32),
                       "interpolate_pos_encoding": True}, "vision")


def _mobilevit() -> Case:
    """Convolutions around transformer blocks that run on unfolded patches."""
    from transformers import MobileViTConfig, MobileViTForImageClassification

    torch.manual_seed(0)
    config = MobileViTConfig(image_size=64, hidden_sizes=[32, 48, 64],
                             neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 96], num_attention_heads=2,
                             hidden_dropout_prob=P, attention_probs_dropout_prob=P, num_labels=10)
    return Case(MobileViTForImageClassification(config).train(), _images(4, 64), None,
                _images(2, 32), "vision")


def _noise_mse(field: str) -> Callable[[Any], torch.Tensor]:
    """Diffusion training's loss: MSE of the prediction against the step's noise, one fixed draw
    per batch shape (the step draws its noise outside the model)."""
    noise: dict[torch.Size, torch.Tensor] = {}

    def loss(out: Any) -> torch.Tensor:
        pred = getattr(out, field)
        if pred.shape not in noise:
            noise[pred.shape] = torch.randn(pred.shape, generator=torch.Generator().manual_seed(1))
        return F.mse_loss(pred, noise[pred.shape])

    return loss


def _sd_unet() -> Case:
    """diffusers' `UNet2DConditionModel` as Stable Diffusion fine-tuning trains it: latents,
    timesteps and text embeddings in, cross-attention blocks, GroupNorm, SiLU, noise MSE."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=8, dropout=P)

    def batch(rows: int, size: int, tokens: int) -> dict[str, Any]:
        return {"sample": torch.randn(rows, 4, size, size),
                "timestep": torch.randint(0, 1000, (rows,)),
                "encoder_hidden_states": torch.randn(rows, tokens, 32)}

    return Case(model.train(), batch(4, 16, 7), _noise_mse("sample"), batch(2, 8, 5), "diffusion")


def _flux() -> Case:
    """diffusers' `FluxTransformer2DModel`: double-stream blocks (image and text tokens
    attended jointly), then single-stream blocks, RoPE from position ids, AdaLN modulation from
    the timestep and pooled text."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
        guidance_embeds=False, axes_dims_rope=(4, 6, 6))

    def batch(rows: int, side: int, tokens: int) -> dict[str, Any]:
        ids = torch.zeros(side, side, 3)
        ids[..., 1] = torch.arange(side)[:, None]
        ids[..., 2] = torch.arange(side)[None, :]
        return {"hidden_states": torch.randn(rows, side * side, 16),
                "encoder_hidden_states": torch.randn(rows, tokens, 32),
                "pooled_projections": torch.randn(rows, 16), "timestep": torch.rand(rows),
                "img_ids": ids.reshape(-1, 3), "txt_ids": torch.zeros(tokens, 3)}

    return Case(model.train(), batch(4, 8, 7), _noise_mse("sample"), batch(2, 4, 5), "diffusion")


def _vae() -> Case:
    """diffusers' `AutoencoderKL` run as its training runs it, ``sample_posterior=True``: the
    latent is drawn with `torch.randn` inside the forward, so a replay must draw it again. The
    loss, MSE of the decoded image against a fixed draw, stands in for the reconstruction loss
    (the loss function does not see the input)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    model = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(32, 64),
        norm_num_groups=8)

    def batch(rows: int, size: int) -> dict[str, Any]:
        return {"sample": torch.randn(rows, 3, size, size), "sample_posterior": True}

    return Case(model.train(), batch(4, 32), _noise_mse("sample"), batch(2, 16), "diffusion")


_LM = dict(vocab_size=512, max_position_embeddings=128)
CASES: dict[str, Callable[[], Case]] = {
    "opt": _decoder("OPTConfig", "OPTForCausalLM", **_LM, hidden_size=64, num_hidden_layers=3,
                    ffn_dim=128, num_attention_heads=4, dropout=P, attention_dropout=P,
                    word_embed_proj_dim=64),
    "gpt_neox": _decoder("GPTNeoXConfig", "GPTNeoXForCausalLM", **_LM, hidden_size=64,
                         num_hidden_layers=3, intermediate_size=128, num_attention_heads=4,
                         hidden_dropout=P, attention_dropout=P),
    "phi": _decoder("PhiConfig", "PhiForCausalLM", **_LM, hidden_size=64, num_hidden_layers=3,
                    intermediate_size=128, num_attention_heads=4, resid_pdrop=P, embd_pdrop=P,
                    attention_dropout=P),
    "gemma": _decoder("GemmaConfig", "GemmaForCausalLM", **_LM, hidden_size=64,
                      num_hidden_layers=3, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, attention_dropout=P),
    "gemma2": _decoder("Gemma2Config", "Gemma2ForCausalLM", **_LM, hidden_size=64,
                       num_hidden_layers=3, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, attention_dropout=P, sliding_window=16),
    "falcon": _decoder("FalconConfig", "FalconForCausalLM", vocab_size=512, hidden_size=64,
                       num_hidden_layers=3, num_attention_heads=4, hidden_dropout=P,
                       attention_dropout=P),
    "gptj": _decoder("GPTJConfig", "GPTJForCausalLM", vocab_size=512, n_embd=64, n_layer=3,
                     n_head=4, rotary_dim=8, resid_pdrop=P, embd_pdrop=P, attn_pdrop=P,
                     n_positions=128),
    "qwen3": _decoder("Qwen3Config", "Qwen3ForCausalLM", **_LM, hidden_size=64,
                      num_hidden_layers=3, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, attention_dropout=P),
    "qwen2_moe": _decoder("Qwen2MoeConfig", "Qwen2MoeForCausalLM", **_LM, hidden_size=64,
                          num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32,
                          shared_expert_intermediate_size=64, num_experts=4,
                          num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                          attention_dropout=P),
    "roberta": _classifier("RobertaConfig", "RobertaForSequenceClassification", vocab_size=512,
                           hidden_size=64, num_hidden_layers=3, intermediate_size=128,
                           num_attention_heads=4, hidden_dropout_prob=P,
                           attention_probs_dropout_prob=P, max_position_embeddings=130),
    "distilbert": _classifier("DistilBertConfig", "DistilBertForSequenceClassification",
                              vocab_size=512, dim=64, n_layers=3, hidden_dim=128, n_heads=4,
                              dropout=P, attention_dropout=P, seq_classif_dropout=P),
    "electra": _classifier("ElectraConfig", "ElectraForSequenceClassification", vocab_size=512,
                           embedding_size=32, hidden_size=64, num_hidden_layers=3,
                           intermediate_size=128, num_attention_heads=4, hidden_dropout_prob=P,
                           attention_probs_dropout_prob=P),
    "deberta": _classifier("DebertaConfig", "DebertaForSequenceClassification", vocab_size=512,
                           hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                           intermediate_size=128, hidden_dropout_prob=P,
                           attention_probs_dropout_prob=P, max_position_embeddings=64),
    "modernbert": _classifier("ModernBertConfig", "ModernBertForSequenceClassification",
                              vocab_size=512, hidden_size=64, num_hidden_layers=3,
                              num_attention_heads=4, intermediate_size=128, pad_token_id=0,
                              max_position_embeddings=64, attention_dropout=P, mlp_dropout=P,
                              embedding_dropout=P),
    "jamba": _decoder("JambaConfig", "JambaForCausalLM", vocab_size=512, hidden_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                      attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                      expert_layer_offset=1, mamba_d_state=8, mamba_expand=2,
                      use_mamba_kernels=False, attention_dropout=P),
    "mpt": _mpt,
    "fnet": _encoder("FNetConfig", "FNetForSequenceClassification", vocab_size=512,
                     hidden_size=64, num_hidden_layers=3, intermediate_size=128,
                     hidden_dropout_prob=P, max_position_embeddings=128),
    "xlnet": _encoder("XLNetConfig", "XLNetForSequenceClassification", vocab_size=512,
                      d_model=64, n_layer=3, n_head=4, d_inner=128, dropout=P),
    "bigbird": _bigbird,
    "funnel": _encoder("FunnelConfig", "FunnelForSequenceClassification", vocab_size=512,
                       block_sizes=[1, 1], d_model=64, n_head=4, d_head=16, d_inner=128,
                       hidden_dropout=P, attention_dropout=P),
    "umt5": _umt5,
    "vit_mae": _vit_mae,
    "mobilevit": _mobilevit,
    "swin": _swin,
    "beit": _beit,
    "led": _led,
    "wav2vec2": _wav2vec2,
    "clip": _clip,
    "llava": _llava,
    "qwen2_vl": _qwen2_vl,
    "paligemma": _paligemma,
    "mamba": _decoder("MambaConfig", "MambaForCausalLM", vocab_size=512, hidden_size=64,
                      state_size=8, num_hidden_layers=3),
    "lstm": _lstm,
    "torch_transformer": _torch_transformer,
    "sd_unet": _sd_unet,
    "flux": _flux,
    "vae_kl": _vae,
}
"""Every builder, by name."""
