"""PEFT adapters beside LoRA: the methods `peft` offers, on the models people fine-tune with
them, in fp32 and under bf16 autocast (the sixteenth probe).

    HF_HUB_OFFLINE=1 python benchmarks/peft_probe.py [adapter ...] [-n 6] [--fp32-only]

The test zoo has one PEFT model, LoRA on a Llama. Adapters differ in what a step does beside
the frozen base: DoRA normalises the adapted weight every forward, OFT and BOFT build an
orthogonal matrix (a solve, butterfly products), FourierFT and C3A run FFTs, VeRA and VB-LoRA
read shared buffers, prefix tuning hands every layer a cache of virtual keys and values,
prompt tuning and P-tuning prepend embeddings (P-tuning through an LSTM), AdaLoRA adds an
orthogonality term to the loss, trainable tokens and ``modules_to_save`` train copies of base
modules. Each adapter wraps a small config with random weights, dropout 0.1 where the adapter
or the config has one, padded inputs and labels; then as `families_probe.py` does: planned at
its smallest peak and half way, each plan verified and run on a smaller batch, and `-n`
schedules near the smallest-peak one measured. Not part of the test suite (minutes of CI).
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

from benchmarks import families_probe  # noqa: E402
from tests.zoo import PROJECTIONS, Case, P, _bert_inputs, _hf, _images, _llama_config, _lm_inputs  # noqa: E402


def _llama_lm(lengths=(64, 50), seq=64):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = _hf(LlamaForCausalLM, _llama_config())
    return base, _lm_inputs(512, 2, seq, list(lengths)), _lm_inputs(512, 1, 40, [33])


def _peft(base, config, inputs, small, family: str) -> Case:
    from peft import get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(base, config).train()
    return Case(model, inputs, None, small, family)


def _on_llama(config_cls, **kwargs):
    """An adapter of `config_cls` on every projection of a padded Llama."""
    def build() -> Case:
        base, inputs, small = _llama_lm()
        kwargs.setdefault("target_modules", PROJECTIONS)
        return _peft(base, config_cls(task_type="CAUSAL_LM", **kwargs), inputs, small, "decoder")
    return build


def _dora() -> Case:
    """LoRA with weight decomposition (DoRA): every forward normalises base weight plus adapter
    per output row, and rsLoRA's scaling."""
    from peft import LoraConfig

    return _on_llama(LoraConfig, r=4, lora_alpha=8, lora_dropout=P, use_dora=True,
                     use_rslora=True)()


def _prefix_gpt2() -> Case:
    """Prefix tuning on GPT-2: an MLP turns virtual-token embeddings into every layer's past
    keys and values, handed to the model as a cache; the mask is widened by the prefix."""
    from peft import PrefixTuningConfig
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=96, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=P, embd_pdrop=P, attn_pdrop=P)
    base = _hf(GPT2LMHeadModel, config)
    inputs, small = _lm_inputs(512, 2, 64, [64, 50]), _lm_inputs(512, 1, 40, [33])
    for batch in (inputs, small):
        batch.pop("use_cache")
    adapter = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=8, prefix_projection=True,
                                 encoder_hidden_size=64)
    return _peft(base, adapter, inputs, small, "decoder")


def _prompt_tuning() -> Case:
    """Prompt tuning on a Llama: learned virtual-token embeddings concatenated before the
    input's, the mask and labels widened to match."""
    from peft import PromptTuningConfig

    base, inputs, small = _llama_lm()
    return _peft(base, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=10),
                 inputs, small, "decoder")


def _p_tuning() -> Case:
    """P-tuning: the virtual tokens come out of an LSTM prompt encoder every forward."""
    from peft import PromptEncoderConfig

    base, inputs, small = _llama_lm()
    adapter = PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=8,
                                  encoder_hidden_size=32, encoder_reparameterization_type="LSTM",
                                  encoder_dropout=P)
    return _peft(base, adapter, inputs, small, "decoder")


def _adalora() -> Case:
    """AdaLoRA: SVD-shaped adapters (P, Lambda, Q); in training its forward adds an
    orthogonality penalty over every adapter's P and Q to the loss."""
    from peft import AdaLoraConfig

    return _on_llama(AdaLoraConfig, init_r=6, target_r=3, lora_alpha=8, lora_dropout=P,
                     total_step=100, tinit=10, tfinal=20)()


def _bert_seq_cls(config_factory) -> Callable[[], Case]:
    def build() -> Case:
        from transformers import BertConfig, BertForSequenceClassification

        torch.manual_seed(0)
        config = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=128,
                            max_position_embeddings=128, hidden_dropout_prob=P,
                            attention_probs_dropout_prob=P, num_labels=3, pad_token_id=0)
        base = _hf(BertForSequenceClassification, config)
        return _peft(base, config_factory(), _bert_inputs(4, 64, [64, 50, 40, 20]),
                     _bert_inputs(2, 32, [32, 17]), "encoder")
    return build


def _ia3_bert():
    """IA3 on a BERT classifier: learned vectors scale keys, values and the FFN's output
    (feedforward modules scale their input); the classifier is trained as a copy
    (``modules_to_save``)."""
    from peft import IA3Config

    return IA3Config(task_type="SEQ_CLS", target_modules=["key", "value", "output.dense"],
                     feedforward_modules=["output.dense"])


def _lora_bert_saved():
    """LoRA on a BERT classifier's attention, the pooler and classifier trained as copies."""
    from peft import LoraConfig

    return LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=P,
                      target_modules=["query", "value"], modules_to_save=["pooler"])


def _ln_tuning_bert():
    """LayerNorm tuning: copies of every LayerNorm trained, the rest frozen."""
    from peft import LNTuningConfig

    return LNTuningConfig(task_type="SEQ_CLS", target_modules=["LayerNorm"])


def _vit(config_factory, family="vision"):
    def build() -> Case:
        from transformers import ViTConfig, ViTForImageClassification

        torch.manual_seed(0)
        config = ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=128, num_labels=10,
                           hidden_dropout_prob=P, attention_probs_dropout_prob=P)
        base = _hf(ViTForImageClassification, config)
        return _peft(base, config_factory(), _images(8, 32), _images(4, 32), family)
    return build


def _loha_vit():
    """LoHa (Hadamard product of two low-rank pairs, a custom autograd Function) on a ViT."""
    from peft import LoHaConfig

    return LoHaConfig(r=4, alpha=8, module_dropout=P, rank_dropout=P,
                      target_modules=["q_proj", "v_proj", "fc1"],
                      modules_to_save=["classifier"])


def _lokr_vit():
    """LoKr (Kronecker product of a small and a low-rank factor) on a ViT."""
    from peft import LoKrConfig

    return LoKrConfig(r=4, alpha=8, rank_dropout=P, target_modules=["q_proj", "v_proj"],
                      modules_to_save=["classifier"])


def _oft_vit():
    """OFT: each adapted weight multiplied by a block-diagonal orthogonal matrix, the Cayley
    transform of a learned skew matrix (a linear solve every forward)."""
    from peft import OFTConfig

    return OFTConfig(r=0, oft_block_size=16, module_dropout=P, target_modules=["q_proj", "v_proj"],
                     modules_to_save=["classifier"])


def _boft_vit():
    """BOFT: the orthogonal matrix as a product of butterfly factors."""
    from peft import BOFTConfig

    return BOFTConfig(boft_block_size=8, boft_n_butterfly_factor=2, boft_dropout=P,
                      target_modules=["q_proj", "v_proj"], modules_to_save=["classifier"])


def _fourierft() -> Case:
    """FourierFT: a weight update from learned spectral coefficients by an inverse 2-D FFT."""
    from peft import FourierFTConfig

    return _on_llama(FourierFTConfig, n_frequency=200, scaling=10.0,
                     target_modules=["q_proj", "v_proj"])()


def _vera() -> Case:
    """VeRA: frozen random projections shared by all layers (buffers), learned scaling vectors."""
    from peft import VeraConfig

    return _on_llama(VeraConfig, r=16, vera_dropout=P, target_modules=["q_proj", "v_proj"])()


def _vblora() -> Case:
    """VB-LoRA: adapters composed from a shared vector bank by top-k mixing logits."""
    from peft import VBLoRAConfig

    return _on_llama(VBLoRAConfig, r=4, num_vectors=32, vector_length=4, topk=2,
                     vblora_dropout=P, target_modules=["q_proj", "v_proj"])()


def _c3a() -> Case:
    """C3A: circular-convolution adapters computed by FFT."""
    from peft import C3AConfig

    return _on_llama(C3AConfig, block_size=16, target_modules=["q_proj", "v_proj"])()


def _trainable_tokens() -> Case:
    """Trainable tokens: a few rows of the embedding trained as a delta, beside LoRA."""
    from peft import LoraConfig

    return _on_llama(LoraConfig, r=4, lora_alpha=8, lora_dropout=P,
                     trainable_token_indices={"embed_tokens": [3, 5, 7]})()


def _lora_whisper() -> Case:
    """LoRA on Whisper's attention: an encoder-decoder on log-mel features, labels shifted
    into decoder inputs."""
    from peft import LoraConfig
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                           max_source_positions=32, max_target_positions=32, dropout=P,
                           attention_dropout=P, pad_token_id=0, decoder_start_token_id=1,
                           eos_token_id=2, bos_token_id=1)
    base = _hf(WhisperForConditionalGeneration, config)

    def batch(rows: int) -> dict[str, Any]:
        return {"input_features": torch.randn(rows, 16, 64),
                "labels": torch.randint(3, 512, (rows, 12)), "use_cache": False}

    adapter = LoraConfig(r=4, lora_alpha=8, lora_dropout=P, target_modules=["q_proj", "v_proj"])
    return _peft(base, adapter, batch(2), batch(1), "speech")


def _lora_resnet() -> Case:
    """LoRA on the convolutions of an HF ResNet (Conv2d adapters), the classifier as a copy."""
    from peft import LoraConfig
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                          layer_type="bottleneck", num_labels=10)
    base = _hf(ResNetForImageClassification, config)
    adapter = LoraConfig(r=4, lora_alpha=8, lora_dropout=P, target_modules=r".*convolution",
                         modules_to_save=["classifier"])
    return _peft(base, adapter, _images(8, 32), _images(4, 24), "vision")


ADAPTERS: dict[str, Callable[[], Case]] = {
    "dora": _dora,
    "adalora": _adalora,
    "prefix_gpt2": _prefix_gpt2,
    "prompt_tuning": _prompt_tuning,
    "p_tuning": _p_tuning,
    "ia3_bert": _bert_seq_cls(_ia3_bert),
    "lora_bert_saved": _bert_seq_cls(_lora_bert_saved),
    "ln_tuning_bert": _bert_seq_cls(_ln_tuning_bert),
    "loha_vit": _vit(_loha_vit),
    "lokr_vit": _vit(_lokr_vit),
    "oft_vit": _vit(_oft_vit),
    "boft_vit": _vit(_boft_vit),
    "fourierft": _fourierft,
    "vera": _vera,
    "vblora": _vblora,
    "c3a": _c3a,
    "trainable_tokens": _trainable_tokens,
    "lora_whisper": _lora_whisper,
    "lora_resnet": _lora_resnet,
}


def main(argv: list[str] | None = None) -> int:
    return families_probe.main(argv, ADAPTERS, "adapter", __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
