"""Families beside the zoos that are not decoders: encoder-decoders with routed experts, speech,
long-document and character encoders, vision backbones, time series, recurrent and state-space
language models; in fp32 and under bf16 autocast (the fifteenth probe).

    HF_HUB_OFFLINE=1 python benchmarks/families_probe.py [family ...] [-n 6]

Each family is a small config with random weights, dropout 0.1 where the config has one, padded
inputs where the model takes a mask, labels (or targets through ``loss_fn``) so a step has a
loss. As `decoder_families_probe.py` does: planned at its smallest peak and half way from there
to no checkpointing, each plan verified (predicted against measured peak, gradients against the
unplanned model) and run on a smaller batch (its measured peak against the budget, its
gradients against the unplanned model's on that batch); then `schedule_fuzz.fuzz` measures
`-n` schedules near the smallest-peak one. Not part of the test suite (minutes of CI).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import planner  # noqa: E402
from benchmarks import schedule_fuzz  # noqa: E402
from benchmarks.decoder_families_probe import floor_and_half_way_autocast  # noqa: E402
from benchmarks.outside_zoo import CASES as OUTSIDE  # noqa: E402
from benchmarks.outside_zoo import _decoder  # noqa: E402
from benchmarks.zoo_table import _smaller_batch  # noqa: E402
from tests.zoo import Case, P, _images  # noqa: E402

V = 512


def _seq2seq_batch(rows: int, src: int, tgt: int, pad: int = 1) -> dict[str, Any]:
    """Source right-padded (row i loses 5 i tokens), labels, no cache."""
    real = torch.arange(src) < torch.tensor([src - 5 * i for i in range(rows)])[:, None]
    return {"input_ids": torch.randint(3, V, (rows, src)).masked_fill(~real, pad),
            "attention_mask": real.long(), "labels": torch.randint(3, V, (rows, tgt)),
            "use_cache": False}


def _mlm_batch(rows: int, seq: int, pad: int = 1) -> dict[str, Any]:
    """Masked-LM inputs, the second row right-padded; labels -100 except on every third token."""
    real = torch.arange(seq) < torch.tensor([seq - 7 * i for i in range(rows)])[:, None]
    ids = torch.randint(4, V, (rows, seq)).masked_fill(~real, pad)
    labels = ids.masked_fill(~real | (torch.arange(seq) % 3 != 0), -100)
    return {"input_ids": ids, "attention_mask": real.long(), "labels": labels}


def _hf_case(model, inputs, small, family: str, loss_fn=None) -> Case:
    return Case(model.train(), inputs, loss_fn, small, family)


def _switch() -> Case:
    """Switch Transformer: top-1 routed experts with a capacity (tokens over it are dropped,
    which depends on the routing) and router jitter noise drawn in every training forward."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    torch.manual_seed(0)
    config = SwitchTransformersConfig(
        vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=4, num_experts=4, expert_capacity=12, router_jitter_noise=0.01,
        encoder_sparse_step=1, decoder_sparse_step=1, dropout_rate=P, pad_token_id=0,
        decoder_start_token_id=0, eos_token_id=1)
    return _hf_case(SwitchTransformersForConditionalGeneration(config), _seq2seq_batch(2, 24, 12, 0),
                    _seq2seq_batch(1, 12, 6, 0), "moe")


def _nllb_moe() -> Case:
    """NLLB-MoE: top-2 routing with expert capacity in encoder and decoder, sinusoidal
    positions, MoE token dropout."""
    from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration

    torch.manual_seed(0)
    config = NllbMoeConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_experts=4,
        expert_capacity=12, encoder_sparse_step=1, decoder_sparse_step=1, dropout=P,
        attention_dropout=P, activation_dropout=P, moe_token_dropout=0.2, max_position_embeddings=64,
        router_dtype="float32", pad_token_id=1, decoder_start_token_id=2)
    return _hf_case(NllbMoeForConditionalGeneration(config), _seq2seq_batch(2, 24, 12),
                    _seq2seq_batch(1, 12, 6), "moe")


def _pegasus() -> Case:
    """Pegasus: sinusoidal positions, pre-norm encoder-decoder, tied embeddings."""
    from transformers import PegasusConfig, PegasusForConditionalGeneration

    torch.manual_seed(0)
    config = PegasusConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, dropout=P,
        attention_dropout=P, activation_dropout=P, max_position_embeddings=64, pad_token_id=0,
        decoder_start_token_id=0)
    return _hf_case(PegasusForConditionalGeneration(config), _seq2seq_batch(2, 32, 16, 0),
                    _seq2seq_batch(1, 16, 8, 0), "encoder-decoder")


def _speech2text() -> Case:
    """Speech-to-text: a 1-D convolutional subsampler over filter-bank frames, then an
    encoder-decoder; the second row's frames are padded (its mask subsampled too)."""
    from transformers import Speech2TextConfig, Speech2TextForConditionalGeneration

    torch.manual_seed(0)
    config = Speech2TextConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, dropout=P,
        attention_dropout=P, activation_dropout=P, max_source_positions=256,
        max_target_positions=64, num_conv_layers=2, conv_channels=64, input_feat_per_channel=16,
        input_channels=1, pad_token_id=1, decoder_start_token_id=2)

    def batch(rows: int, frames: int, tgt: int) -> dict[str, Any]:
        real = torch.arange(frames) < torch.tensor([frames - 16 * i for i in range(rows)])[:, None]
        return {"input_features": torch.randn(rows, frames, 16) * real[..., None],
                "attention_mask": real.long(), "labels": torch.randint(3, V, (rows, tgt)),
                "use_cache": False}

    return _hf_case(Speech2TextForConditionalGeneration(config), batch(2, 96, 16), batch(1, 48, 8),
                    "audio")


def _longformer() -> Case:
    """Longformer masked LM: sliding-window attention (the sequence padded to its window by the
    model) plus global attention on the first token."""
    from transformers import LongformerConfig, LongformerForMaskedLM

    torch.manual_seed(0)
    config = LongformerConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, attention_window=8, max_position_embeddings=80,
        hidden_dropout_prob=P, attention_probs_dropout_prob=P, pad_token_id=1)

    def batch(rows: int, seq: int) -> dict[str, Any]:
        b = _mlm_batch(rows, seq)
        b["global_attention_mask"] = (torch.arange(seq) == 0).long().expand(rows, seq).clone()
        return b

    return _hf_case(LongformerForMaskedLM(config), batch(2, 40), batch(1, 20), "encoder")


def _reformer() -> Case:
    """Reformer: reversible residual layers (a custom autograd Function that rebuilds each
    layer's input in backward from its output, replaying dropout from saved RNG states), local
    and LSH attention (random rotations drawn each forward)."""
    from transformers import ReformerConfig, ReformerModelWithLMHead

    torch.manual_seed(0)
    config = ReformerConfig(
        vocab_size=V, hidden_size=64, num_attention_heads=2, attention_head_size=16,
        attn_layers=["local", "lsh", "local", "lsh"], feed_forward_size=128,
        axial_pos_embds=False, max_position_embeddings=64, local_attn_chunk_length=8,
        lsh_attn_chunk_length=8, num_buckets=4, num_hashes=1, is_decoder=True,
        hidden_dropout_prob=P, local_attention_probs_dropout_prob=P,
        lsh_attention_probs_dropout_prob=P, pad_token_id=0, eos_token_id=2)

    def batch(rows: int, seq: int) -> dict[str, Any]:
        ids = torch.randint(3, V, (rows, seq))
        return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}

    return _hf_case(ReformerModelWithLMHead(config), batch(2, 32), batch(1, 16), "decoder")


def _esm() -> Case:
    """ESM protein masked LM: rotary positions, token dropout (embeddings rescaled by the share
    of masked tokens in each row, read from the input's values)."""
    from transformers import EsmConfig, EsmForMaskedLM

    torch.manual_seed(0)
    config = EsmConfig(
        vocab_size=33, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, hidden_dropout_prob=P, attention_probs_dropout_prob=P,
        position_embedding_type="rotary", token_dropout=True, mask_token_id=32, pad_token_id=1,
        max_position_embeddings=64)

    def batch(rows: int, seq: int) -> dict[str, Any]:
        real = torch.arange(seq) < torch.tensor([seq - 7 * i for i in range(rows)])[:, None]
        ids = torch.randint(4, 30, (rows, seq))
        labels = ids.masked_fill(~real | (torch.arange(seq) % 5 != 0), -100)
        ids = ids.masked_fill(torch.arange(seq) % 5 == 0, 32).masked_fill(~real, 1)
        return {"input_ids": ids, "attention_mask": real.long(), "labels": labels}

    return _hf_case(EsmForMaskedLM(config), batch(2, 32), batch(1, 16), "encoder")


def _canine() -> Case:
    """CANINE: characters hashed into buckets, a strided convolution down to molecules, a deep
    transformer on them, upsampled back; a sequence classifier on padded rows."""
    from transformers import CanineConfig, CanineForSequenceClassification

    torch.manual_seed(0)
    config = CanineConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        hidden_dropout_prob=P, attention_probs_dropout_prob=P, num_hash_functions=4,
        num_hash_buckets=256, downsampling_rate=4, local_transformer_stride=16,
        max_position_embeddings=128, num_labels=3)

    def batch(rows: int, seq: int) -> dict[str, Any]:
        real = torch.arange(seq) < torch.tensor([seq - 9 * i for i in range(rows)])[:, None]
        return {"input_ids": torch.randint(32, 1000, (rows, seq)).masked_fill(~real, 0),
                "attention_mask": real.long(), "labels": torch.randint(0, 3, (rows,))}

    return _hf_case(CanineForSequenceClassification(config), batch(2, 48), batch(1, 24),
                    "encoder")


def _dinov2() -> Case:
    """DINOv2: layer scale, drop path, a CLS and mean-patch classifier head; 16x16 images
    interpolate the position embeddings (the model always resamples them)."""
    from transformers import Dinov2Config, Dinov2ForImageClassification

    torch.manual_seed(0)
    config = Dinov2Config(
        image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        mlp_ratio=2, hidden_dropout_prob=P, attention_probs_dropout_prob=P, drop_path_rate=P,
        layerscale_value=0.1, num_labels=10)
    return _hf_case(Dinov2ForImageClassification(config), _images(2, 32), _images(1, 16),
                    "vision")


def _segformer() -> Case:
    """SegFormer semantic segmentation: overlapping patch merges, efficient attention with a
    strided reduction, an all-MLP decoder; logits upsampled to the labels' size inside the loss
    (ignore index 255 on a border)."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    torch.manual_seed(0)
    config = SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
        hidden_dropout_prob=P, attention_probs_dropout_prob=P, classifier_dropout_prob=P,
        drop_path_rate=P, decoder_hidden_size=32, num_labels=5, semantic_loss_ignore_index=255)

    def batch(rows: int, size: int) -> dict[str, Any]:
        labels = torch.randint(0, 5, (rows, size, size))
        labels[:, :2] = 255
        return {"pixel_values": torch.randn(rows, 3, size, size), "labels": labels}

    return _hf_case(SegformerForSemanticSegmentation(config), batch(2, 64), batch(1, 32),
                    "vision")


def _efficientnet() -> Case:
    """EfficientNet: depthwise convolutions, squeeze-and-excitation, batch norm, dropout and
    stochastic depth on the blocks."""
    from transformers import EfficientNetConfig, EfficientNetForImageClassification

    torch.manual_seed(0)
    config = EfficientNetConfig(
        image_size=64, width_coefficient=0.25, depth_coefficient=0.3, hidden_dim=320,
        dropout_rate=P, drop_connect_rate=P, num_labels=10)
    # smaller in batch only: a smaller image ends at 1x1 before a batch norm
    return _hf_case(EfficientNetForImageClassification(config), _images(2, 64), _images(1, 64),
                    "vision")


def _mobilenet_v2() -> Case:
    """MobileNetV2: inverted residuals, ReLU6, batch norm; a classifier with dropout."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    torch.manual_seed(0)
    config = MobileNetV2Config(image_size=64, depth_multiplier=0.35, classifier_dropout_prob=P,
                               num_labels=10)
    # one 32x32 image ends at 1x1 before the last batch norm, which refuses one value a channel
    return _hf_case(MobileNetV2ForImageClassification(config), _images(2, 64), _images(1, 48),
                    "vision")


def _swinv2() -> Case:
    """Swin V2: cosine attention with a learned log-scale, a continuous relative position bias
    from an MLP, post-norm residuals, shifted windows, drop path."""
    from transformers import Swinv2Config, Swinv2ForImageClassification

    torch.manual_seed(0)
    config = Swinv2Config(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2],
                          num_heads=[2, 4], window_size=4, hidden_dropout_prob=P,
                          attention_probs_dropout_prob=P, drop_path_rate=P, num_labels=10)
    return _hf_case(Swinv2ForImageClassification(config), _images(2, 32), _images(1, 16),
                    "vision")


def _levit() -> Case:
    """LeViT: convolutional stem, attention with batch-normed projections and a learned
    attention bias indexed by position offsets, shrinking attention between stages (no dropout:
    this transformers' config takes `drop_path_rate` as an int)."""
    from transformers import LevitConfig, LevitForImageClassification

    torch.manual_seed(0)
    config = LevitConfig(image_size=64, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2],
                         depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=10)
    # its attention biases fix the image size, and its head batch-normalises over the batch
    return _hf_case(LevitForImageClassification(config), _images(4, 64), _images(2, 64),
                    "vision")


def _wavlm() -> Case:
    """WavLM CTC: gated relative position bias computed in the first layer and passed on, a
    convolutional front end, a positional convolution."""
    from transformers import WavLMConfig, WavLMForCTC

    torch.manual_seed(0)
    config = WavLMConfig(
        vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, hidden_dropout=P,
        attention_dropout=P, activation_dropout=P, feat_proj_dropout=P, layerdrop=0.0,
        mask_time_prob=0.0, num_buckets=32, max_bucket_distance=64, ctc_loss_reduction="mean",
        pad_token_id=0)

    def batch(rows: int, samples: int, labels: int) -> dict[str, torch.Tensor]:
        return {"input_values": torch.randn(rows, samples),
                "labels": torch.randint(1, 32, (rows, labels))}

    return _hf_case(WavLMForCTC(config), batch(2, 4000, 20), batch(1, 2000, 10), "audio")


def _ast() -> Case:
    """Audio Spectrogram Transformer: a ViT over overlapping spectrogram patches, two tokens
    (CLS and distillation) averaged for the classifier."""
    from transformers import ASTConfig, ASTForAudioClassification

    torch.manual_seed(0)
    config = ASTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, hidden_dropout_prob=P,
                       attention_probs_dropout_prob=P, patch_size=8, frequency_stride=8,
                       time_stride=8, max_length=64, num_mel_bins=32, num_labels=5)

    def batch(rows: int) -> dict[str, torch.Tensor]:
        return {"input_values": torch.randn(rows, 64, 32), "labels": torch.randint(0, 5, (rows,))}

    return _hf_case(ASTForAudioClassification(config), batch(2), batch(1), "audio")


def _patchtst() -> Case:
    """PatchTST forecasting: patches of a multivariate series, channel-independent attention,
    per-series scaling from the input's statistics, an MSE loss on the future values."""
    from transformers import PatchTSTConfig, PatchTSTForPrediction

    torch.manual_seed(0)
    config = PatchTSTConfig(num_input_channels=4, context_length=64, patch_length=8,
                            patch_stride=8, prediction_length=16, d_model=32,
                            num_attention_heads=4, num_hidden_layers=2, ffn_dim=64, dropout=P,
                            attention_dropout=P, ff_dropout=P, positional_dropout=P,
                            path_dropout=P, head_dropout=P)

    def batch(rows: int) -> dict[str, torch.Tensor]:
        return {"past_values": torch.randn(rows, 64, 4), "future_values": torch.randn(rows, 16, 4)}

    return _hf_case(PatchTSTForPrediction(config), batch(4), batch(1), "time series")


def _informer() -> Case:
    """Informer: ProbSparse attention (keys sampled at random, the top queries by a sparsity
    measure of the values), distilling convolutions between encoder layers, a Student-t
    distribution head whose negative log-likelihood is the loss."""
    from transformers import InformerConfig, InformerForPrediction

    torch.manual_seed(0)
    config = InformerConfig(prediction_length=8, context_length=24, lags_sequence=[1, 2, 3],
                            num_time_features=2, d_model=32, encoder_layers=2, decoder_layers=1,
                            encoder_attention_heads=4, decoder_attention_heads=4,
                            encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=P,
                            attention_dropout=P, activation_dropout=P, encoder_layerdrop=0.0,
                            decoder_layerdrop=0.0, sampling_factor=2, distil=True)

    def batch(rows: int) -> dict[str, torch.Tensor]:
        past = 24 + 3
        return {"past_values": torch.randn(rows, past),
                "past_time_features": torch.randn(rows, past, 2),
                "past_observed_mask": torch.ones(rows, past),
                "future_values": torch.randn(rows, 8),
                "future_time_features": torch.randn(rows, 8, 2)}

    return _hf_case(InformerForPrediction(config), batch(4), batch(1), "time series")


def _rwkv() -> Case:
    """RWKV: a recurrent WKV kernel run as a Python loop over time on CPU (no custom kernel),
    token shift by zero padding, a state per layer."""
    return _decoder("RwkvConfig", "RwkvForCausalLM", vocab_size=V, hidden_size=64,
                    num_hidden_layers=2, attention_hidden_size=64, intermediate_size=128,
                    context_length=64)()


def _mamba2() -> Case:
    """Mamba-2: the chunked state-space scan in PyTorch (no kernels on CPU), a gated RMS norm."""
    return _decoder("Mamba2Config", "Mamba2ForCausalLM", vocab_size=V, hidden_size=64,
                    num_hidden_layers=2, state_size=16, num_heads=8, head_dim=16, n_groups=1,
                    expand=2, chunk_size=16)()


def _recurrent_gemma() -> Case:
    """RecurrentGemma: RG-LRU recurrent blocks (a scan in Python) between local attention
    blocks, a temporal convolution, logits soft-capped."""
    return _decoder("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", vocab_size=V,
                    hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=1, lru_width=64,
                    attention_window_size=16, conv1d_width=4, block_types=["recurrent",
                                                                           "attention"],
                    pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=P)()


def _siglip_targets() -> Case:
    """SigLIP vision tower classifying through a loss that closes over targets (the way a
    fine-tuning script calls it): ``loss_fn=lambda out: F.cross_entropy(out.logits, y)``."""
    from transformers import SiglipConfig, SiglipForImageClassification

    torch.manual_seed(0)
    config = SiglipConfig(
        vision_config=dict(image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=128, attention_dropout=P),
        text_config=dict(vocab_size=V, hidden_size=64, num_hidden_layers=1,
                         num_attention_heads=4, intermediate_size=128), num_labels=10)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    return Case(SiglipForImageClassification(config).train(), {"pixel_values": x},
                lambda out: F.cross_entropy(out.logits, y[: out.logits.shape[0]]),
                {"pixel_values": x[:1].clone()}, "vision")


FAMILIES: dict[str, Callable[[], Case]] = {
    "switch_transformers": _switch,
    "nllb_moe": _nllb_moe,
    "pegasus": _pegasus,
    "speech2text": _speech2text,
    "longformer": _longformer,
    "reformer": _reformer,
    "esm": _esm,
    "canine": _canine,
    "dinov2": _dinov2,
    "segformer": _segformer,
    "efficientnet": _efficientnet,
    "mobilenet_v2": _mobilenet_v2,
    "swinv2": _swinv2,
    "levit": _levit,
    "wavlm": _wavlm,
    "ast": _ast,
    "patchtst": _patchtst,
    "informer": _informer,
    "rwkv": _rwkv,
    "mamba2": _mamba2,
    "recurrent_gemma": _recurrent_gemma,
    "siglip_targets": _siglip_targets,
}


def probe(name: str, amp: torch.dtype | None) -> str:
    t0 = time.perf_counter()
    try:
        case = OUTSIDE[name]()
    except Exception as e:  # noqa: BLE001 - a config this transformers refuses is a row
        return f"| {name} | | does not build: {type(e).__name__}: {str(e)[:100]} | | | |"
    cells = []
    try:
        for label, p, _ in floor_and_half_way_autocast(case, amp):
            v = p.verify(repeats=1)
            small = _smaller_batch(case, amp, p.budget_bytes)
            planner.remove(case.model)
            small = small if isinstance(small, str) else small()
            cells.append(f"{label}: {len(p.schedule.regions)} regions, predicted - measured "
                         f"{v.predicted_peak_bytes - v.measured_peak_bytes:+d} B, "
                         f"{'fits' if v.measured_peak_bytes <= p.budget_bytes else 'OVER'}, "
                         f"grads {v.max_grad_rel_err:.0e}; smaller batch {small}")
    except planner.NotReproducibleError as e:  # planned, but verify cannot compare
        cells.append(f"cannot verify: {str(e).splitlines()[0][:160]}")
    except planner.CkptPlannerError as e:
        cells.append(f"does not plan: {str(e).splitlines()[0][:160]}")
    except Exception as e:  # noqa: BLE001 - the model's own step, or ours, raised
        cells.append(f"RAISES {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    cells += [""] * (2 - len(cells))
    return (f"| {name} | {case.family} | {'bf16' if amp else 'fp32'} | {' | '.join(cells)} | "
            f"{time.perf_counter() - t0:.0f} |")


def main(argv: list[str] | None = None, cases: dict[str, Callable[[], Case]] | None = None,
         what: str = "family", doc: str = __doc__) -> int:
    """Probe `cases` (the families above by default; `peft_probe.py` passes its adapters)."""
    cases = FAMILIES if cases is None else cases
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("names", nargs="*", default=list(cases), metavar=what)
    ap.add_argument("-n", "--trials", type=int, default=6, help="schedules per model and dtype")
    ap.add_argument("--fp32-only", action="store_true", help="leave bf16 autocast out")
    args = ap.parse_args(argv)
    unknown = [f for f in args.names if f not in cases]
    if unknown:
        ap.error(f"unknown {what} {unknown}; known: {list(cases)}")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    for name in args.names:
        OUTSIDE.setdefault(name, cases[name])
    print(f"| {what} | kind | dtype | smallest peak | half way | s |")
    print("|---|---|---|---|---|---|")
    rows, details = [], []
    for name in args.names:
        for amp in (None,) if args.fp32_only else (None, torch.bfloat16):
            print(probe(name, amp), flush=True)
            if args.trials:
                rows.append(schedule_fuzz.dtype_row(name, args.trials, details, amp))
    if rows:
        print("\n" + schedule_fuzz.HEADER)
        print("\n".join(rows))
    if details:
        print("\n" + "\n".join(details))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
