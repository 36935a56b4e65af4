"""Small models built the way people train them: the planner meets code we did not write.

`tests/models.py` holds models written for the planner; this module holds the other kind: Hugging
Face models as their users call them (keyword inputs, ``labels`` so the output carries ``.loss``,
padded attention masks, dropout on), plain PyTorch models with the habits of training scripts (a
loss that closes over targets, Python control flow on tensor values, ``.item()``, data-dependent
mixture-of-experts routing), and a PEFT LoRA model whose base weights are frozen.

Every entry of `CASES` is a builder with no required arguments that returns a `Case`: the model in
``train()`` mode (float32, CPU, random weights from ``torch.manual_seed(0)``; configs are built
locally, nothing is downloaded), example inputs, how to turn the output into a scalar loss, a second
set of inputs smaller in both batch and sequence/spatial size (for "plan once, run on any input
shape"), and a family tag. Dropout is 0.1 wherever a config has one (hidden, attention, embedding,
classifier, LoRA, drop-path), so replaying a forward needs the RNG state. A training step of any
case takes a few to a few tens of milliseconds on an idle 2-core CPU.

Run a case with::

    case = CASES["llama_padded"]()
    out = call(case.model, case.inputs)
    loss = case.loss_fn(out) if case.loss_fn is not None else out.loss
    loss.backward()

What these models do that a planner has to live with (transformers 5.24, torch 2.13):

- HF mask code reads tensor values on the host: every decoder without a mask checks its
  ``position_ids`` for packed sequences, and with a padding mask it checks ``mask.all()`` to decide
  between SDPA's ``is_causal`` and a materialised 4-D mask (BERT and T5 do the same for their
  bidirectional masks). Which path runs depends on the values, not the shapes.
- The first forward of a ``*ForSequenceClassification``/``*ForImageClassification`` model sets
  ``config.problem_type`` from the labels' dtype; later forwards read it.
- BatchNorm (``resnet_hf``) updates its running statistics in place without bumping their version
  counters, so a replayed forward updates them twice.
- The same module or parameter is used more than once per step: T5's stack-level dropout (twice per
  stack), ViT's per-layer dropout (twice per layer), tied input/output embeddings (GPT-2, Qwen2, T5,
  where one parameter serves three modules).
- HF decoder layers are called with keyword arguments (``attention_mask``, ``position_ids``, the
  RoPE ``position_embeddings`` computed once and shared by all layers), which reentrant
  ``torch.utils.checkpoint`` does not accept.
- `T5ForConditionalGeneration` builds ``decoder_input_ids`` from ``labels`` with in-place ops on a
  fresh tensor; no case mutates its inputs, and none returns a cache (``use_cache=False``).

Adaptations to transformers 5.x: models take ``attn_implementation`` through their config (the
model constructors no longer accept it), and `ViTForImageClassification` rejects an image size other
than its config's unless called with ``interpolate_pos_encoding=True``, so both input sets pass it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "CASES",
    "Case",
    "albert",
    "bart",
    "bert",
    "bloom_padded",
    "call",
    "convnext",
    "deberta_v2",
    "gpt2_eager",
    "gpt2_padded",
    "gpt2_sdpa",
    "llama",
    "llama_padded",
    "mistral",
    "mixtral",
    "mlp_targets",
    "moe_top2",
    "peft_lora_llama",
    "qwen2",
    "resnet_hf",
    "t5",
    "value_branch",
    "vit",
    "whisper",
]

P = 0.1
"""Every dropout probability in the zoo."""


@dataclass(frozen=True, eq=False)
class Case:
    """One model with everything needed to run a training step on it.

    ``eq=False``: fields hold tensors and modules, so cases compare (and hash) by identity.
    """

    model: nn.Module
    """In ``train()`` mode, float32, on CPU."""
    inputs: Any
    """A dict of keyword arguments (HF), a tuple of positional arguments, or a tensor."""
    loss_fn: Callable[[Any], torch.Tensor] | None
    """Model output -> scalar loss; None when the output has ``.loss``."""
    small_inputs: Any
    """Same structure and dtypes as `inputs`, smaller in batch and in sequence/spatial size."""
    family: str
    """One of "decoder", "encoder", "encoder-decoder", "vision", "moe", "plain"."""


def call(model: nn.Module, inputs: Any) -> Any:
    """Run `model` on inputs of any of the forms `plan` takes (`split_inputs`)."""
    from planner.capture.record import split_inputs

    args, kwargs = split_inputs(inputs)
    return model(*args, **kwargs)


# -- helpers -----------------------------------------------------------------------------------



def loss_and_grads(module: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                   owner: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step of `module` (the model or a compiled wrapper of it) on `inputs` under seed 0:
    the loss and `owner`'s gradients, which are cleared before and after."""
    from planner.capture.record import default_loss

    for p in owner.parameters():
        p.grad = None
    with torch.random.fork_rng():
        torch.manual_seed(0)
        loss = (loss_fn or default_loss)(call(module, inputs))
        loss.backward()
    grads = {k: p.grad.clone() for k, p in owner.named_parameters() if p.grad is not None}
    for p in owner.parameters():
        p.grad = None
    return loss.detach(), grads


def _lm_inputs(vocab: int, batch: int, seq: int, lengths: list[int] | None = None, side="right"):
    """Causal-LM keyword inputs. With `lengths`, row i has `lengths[i]` real tokens and padding
    (token 0) after them (``side="right"``) or before them (``side="left"``): ``attention_mask`` is
    0 and the labels are -100 on the padding."""
    input_ids = torch.randint(1, vocab, (batch, seq))
    if lengths is None:
        return {"input_ids": input_ids, "labels": input_ids.clone(), "use_cache": False}
    pos = torch.arange(seq)
    n = torch.tensor(lengths)[:, None]
    real = pos < n if side == "right" else pos >= seq - n
    input_ids = input_ids.masked_fill(~real, 0)  # token 0 is the pad token
    return {
        "input_ids": input_ids,
        "attention_mask": real.long(),
        "labels": input_ids.masked_fill(~real, -100),
        "use_cache": False,
    }


def _hf(model_cls, config) -> nn.Module:
    """Construct an HF model from `config` (random weights) in train mode."""
    model = model_cls(config)
    if getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"  # what transformers falls back to, minus its warning
    return model.train()


def _gpt2(attn_implementation: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=512,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=P,
        embd_pdrop=P,
        attn_pdrop=P,
        summary_first_dropout=P,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation=attn_implementation,
    )
    return _hf(GPT2LMHeadModel, config)


def _llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_dropout=P,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


# -- decoders ----------------------------------------------------------------------------------


def gpt2_eager() -> Case:
    """`GPT2LMHeadModel` with eager attention (explicit softmax and attention dropout), no mask:
    tied input/output embeddings, Conv1D projections, dropout on embeddings/attention/residuals."""
    torch.manual_seed(0)
    model = _gpt2("eager")
    return Case(model, _lm_inputs(512, 2, 64), None, _lm_inputs(512, 1, 40), "decoder")


def gpt2_sdpa() -> Case:
    """`GPT2LMHeadModel` with SDPA attention (attention dropout passed to
    ``F.scaled_dot_product_attention``), no mask."""
    torch.manual_seed(0)
    model = _gpt2("sdpa")
    return Case(model, _lm_inputs(512, 2, 64), None, _lm_inputs(512, 1, 40), "decoder")


def gpt2_padded() -> Case:
    """GPT-2 (SDPA) on a right-padded batch: the attention mask has trailing zeros on some rows and
    the labels are -100 there, so the mask code builds a real 4-D mask instead of ``is_causal``."""
    torch.manual_seed(0)
    model = _gpt2("sdpa")
    inputs = _lm_inputs(512, 3, 64, lengths=[64, 50, 33])
    small = _lm_inputs(512, 1, 40, lengths=[29])
    return Case(model, inputs, None, small, "decoder")


def llama() -> Case:
    """`LlamaForCausalLM` with grouped-query attention (4 heads, 2 KV heads), RoPE, RMSNorm,
    SwiGLU, attention dropout, no mask."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = _hf(LlamaForCausalLM, _llama_config())
    return Case(model, _lm_inputs(512, 2, 64), None, _lm_inputs(512, 1, 40), "decoder")


def llama_padded() -> Case:
    """Llama on a left-padded batch: HF's mask code reads the mask values to decide whether it may
    skip the mask, and the padding positions of a left-padded row have no key to attend to (fully
    masked rows, which must not turn into NaN)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = _hf(LlamaForCausalLM, _llama_config())
    inputs = _lm_inputs(512, 2, 64, lengths=[64, 45], side="left")
    small = _lm_inputs(512, 1, 40, lengths=[31], side="left")
    return Case(model, inputs, None, small, "decoder")


def mistral() -> Case:
    """`MistralForCausalLM` with a sliding window (16) shorter than the sequence, so the mask is a
    banded causal mask built by HF rather than SDPA's ``is_causal``."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        sliding_window=16,
        attention_dropout=P,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = _hf(MistralForCausalLM, config)
    return Case(model, _lm_inputs(512, 2, 64), None, _lm_inputs(512, 1, 40), "decoder")


def qwen2() -> Case:
    """`Qwen2ForCausalLM`: Llama-like with biased q/k/v projections and tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_dropout=P,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = _hf(Qwen2ForCausalLM, config)
    return Case(model, _lm_inputs(512, 2, 64), None, _lm_inputs(512, 1, 40), "decoder")


PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every linear layer of a Llama block: where LoRA goes."""


def peft_lora_llama() -> Case:
    """A tiny Llama wrapped by `peft.get_peft_model` with LoRA (r=4, dropout 0.1) on every attention
    and MLP projection. The base is frozen, so no activation entering a block requires grad
    (``enable_input_require_grads()`` is deliberately not called): wrapping the decoder layers in
    reentrant ``torch.utils.checkpoint`` leaves the loss without a ``grad_fn`` (with only a "None of
    the inputs have requires_grad=True" warning); non-reentrant checkpointing trains the LoRA
    weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = _hf(LlamaForCausalLM, _llama_config())
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=P,
        target_modules=PROJECTIONS,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora).train()
    return Case(model, _lm_inputs(512, 2, 64), None, _lm_inputs(512, 1, 40), "decoder")


def bloom_padded() -> Case:
    """`BloomForCausalLM` on a left-padded batch: ALiBi position biases built from the mask, and
    a tanh-GELU that is a custom `autograd.Function` with its backward written in Python (whose
    temporaries Python frees at their last use, unlike a C++ formula's)."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    config = BloomConfig(vocab_size=512, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=P,
                         attention_dropout=P, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = _hf(BloomForCausalLM, config)
    return Case(model, _lm_inputs(512, 2, 64, [64, 45], side="left"), None,
                _lm_inputs(512, 1, 40, [31], side="left"), "decoder")


def mixtral() -> Case:
    """`MixtralForCausalLM`: HF's sparse MoE block (4 experts, top-2 routing, each expert run on
    the tokens routed to it: shapes that depend on values) and the router's auxiliary loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128, num_local_experts=4,
                           num_experts_per_tok=2, attention_dropout=P, output_router_logits=True,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = _hf(MixtralForCausalLM, config)
    return Case(model, _lm_inputs(512, 2, 64), None, _lm_inputs(512, 1, 40), "moe")


# -- encoders and encoder-decoders -------------------------------------------------------------


def _bert_inputs(batch: int, seq: int, lengths: list[int]) -> dict[str, torch.Tensor]:
    """A right-padded batch of sentence pairs: token type 0 on the first half of each row's real
    tokens, 1 on the rest (0 on padding), one class label per row."""
    input_ids = torch.randint(1, 512, (batch, seq))
    pos = torch.arange(seq)
    n = torch.tensor(lengths)[:, None]
    real = pos < n
    return {
        "input_ids": input_ids.masked_fill(~real, 0),
        "attention_mask": real.long(),
        "token_type_ids": ((pos >= n // 2) & real).long(),
        "labels": torch.randint(0, 3, (batch,)),
    }


def bert() -> Case:
    """`BertForSequenceClassification` (3 classes, labels given) on padded sentence pairs: a
    bidirectional padding mask, token type ids, a pooler, and classifier dropout."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        hidden_dropout_prob=P,
        attention_probs_dropout_prob=P,
        classifier_dropout=P,
        num_labels=3,
        pad_token_id=0,
    )
    model = _hf(BertForSequenceClassification, config)
    inputs = _bert_inputs(4, 64, [64, 50, 40, 20])
    small = _bert_inputs(2, 32, [32, 17])
    return Case(model, inputs, None, small, "encoder")


def deberta_v2() -> Case:
    """`DebertaV2ForSequenceClassification` (2 classes) on padded sentence pairs: disentangled
    relative attention, which gathers content-to-position and position-to-content scores with
    `torch.gather` (its backward fills a zero buffer of the gathered tensor's size), and
    relative position embeddings shared by every layer."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    torch.manual_seed(0)
    config = DebertaV2Config(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        hidden_dropout_prob=P,
        attention_probs_dropout_prob=P,
        num_labels=2,
        pad_token_id=0,
    )
    model = _hf(DebertaV2ForSequenceClassification, config)
    inputs = {**_bert_inputs(2, 48, [48, 30]), "labels": torch.tensor([0, 1])}
    small = {**_bert_inputs(1, 24, [20]), "labels": torch.tensor([1])}
    return Case(model, inputs, None, small, "encoder")


def _mlm_inputs(batch: int, seq: int, lengths: list[int]) -> dict[str, torch.Tensor]:
    """A right-padded batch for masked-LM training: labels on about a quarter of the real
    tokens, -100 elsewhere."""
    g = torch.Generator().manual_seed(batch * 1000 + seq)
    real = torch.arange(seq) < torch.tensor(lengths)[:, None]
    input_ids = torch.randint(1, 512, (batch, seq), generator=g).masked_fill(~real, 0)
    chosen = (torch.rand(batch, seq, generator=g) < 0.25) & real
    return {"input_ids": input_ids, "attention_mask": real.long(),
            "labels": input_ids.masked_fill(~chosen, -100)}


def albert() -> Case:
    """`AlbertForMaskedLM`: one transformer layer whose weights are shared across all four
    depths, so the same module is called four times in a step; wrapping it checkpoints every
    call, and a plan may only take all four together."""
    from transformers import AlbertConfig, AlbertForMaskedLM

    torch.manual_seed(0)
    config = AlbertConfig(vocab_size=512, embedding_size=32, hidden_size=64,
                          num_hidden_layers=4, num_hidden_groups=1, inner_group_num=1,
                          num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=P,
                          attention_probs_dropout_prob=P, classifier_dropout_prob=P,
                          max_position_embeddings=128, pad_token_id=0)
    model = _hf(AlbertForMaskedLM, config)
    return Case(model, _mlm_inputs(4, 64, [64, 50, 40, 20]), None, _mlm_inputs(2, 32, [32, 17]),
                "encoder")


def _t5_inputs(batch: int, src: int, tgt: int, tgt_lengths: list[int]) -> dict[str, Any]:
    """Source ids with a right-padded mask; labels padded with -100, which T5 replaces by the pad
    token when it shifts labels right into ``decoder_input_ids``."""
    src_real = torch.arange(src) < torch.tensor([src - 3 * i for i in range(batch)])[:, None]
    tgt_real = torch.arange(tgt) < torch.tensor(tgt_lengths)[:, None]
    return {
        "input_ids": torch.randint(1, 512, (batch, src)).masked_fill(~src_real, 0),
        "attention_mask": src_real.long(),
        "labels": torch.randint(1, 512, (batch, tgt)).masked_fill(~tgt_real, -100),
        "use_cache": False,
    }


def t5() -> Case:
    """`T5ForConditionalGeneration`: encoder embedding, decoder embedding and LM head sharing one
    weight, relative position bias computed by the first layer and passed to the others,
    cross-attention, and decoder inputs derived from the labels inside the model."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=512,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=P,
        classifier_dropout=P,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    model = _hf(T5ForConditionalGeneration, config)
    inputs = _t5_inputs(2, 64, 32, [32, 25])
    small = _t5_inputs(1, 40, 24, [20])
    return Case(model, inputs, None, small, "encoder-decoder")


def _bart_inputs(batch: int, src: int, tgt: int, src_lengths: list[int]) -> dict[str, Any]:
    src_real = torch.arange(src) < torch.tensor(src_lengths)[:, None]
    return {"input_ids": torch.randint(3, 512, (batch, src)).masked_fill(~src_real, 1),
            "attention_mask": src_real.long(),
            "labels": torch.randint(3, 512, (batch, tgt)),
            "use_cache": False}


def bart() -> Case:
    """`BartForConditionalGeneration`: learned positions, encoder and decoder embeddings and LM
    head sharing one weight, a padded source, decoder inputs shifted from the labels inside the
    model, and activation dropout inside the feed-forward blocks."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=128, dropout=P, attention_dropout=P,
        activation_dropout=P, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2,
    )
    model = _hf(BartForConditionalGeneration, config)
    inputs = _bart_inputs(2, 48, 32, [48, 33])
    small = _bart_inputs(1, 24, 16, [20])
    return Case(model, inputs, None, small, "encoder-decoder")


def _whisper_inputs(batch: int, tgt: int, lengths: list[int]) -> dict[str, Any]:
    real = torch.arange(tgt) < torch.tensor(lengths)[:, None]
    return {"input_features": torch.randn(batch, 16, 64),
            "labels": torch.randint(3, 512, (batch, tgt)).masked_fill(~real, -100),
            "use_cache": False}


def whisper() -> Case:
    """`WhisperForConditionalGeneration`: a convolutional audio front end (log-mel features in),
    an encoder, and a decoder whose labels are padded with -100 (shifted right into decoder
    inputs by the model)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=512, num_mel_bins=16, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, d_model=64,
                           encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=32,
                           max_target_positions=64, dropout=P, attention_dropout=P,
                           activation_dropout=P, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           decoder_start_token_id=1, suppress_tokens=None,
                           begin_suppress_tokens=None)
    model = _hf(WhisperForConditionalGeneration, config)
    # The encoder's positions are fixed at 2 x max_source_positions frames: the smaller batch
    # is smaller in batch and in target length.
    return Case(model, _whisper_inputs(2, 32, [32, 25]), None, _whisper_inputs(1, 20, [17]),
                "encoder-decoder")


# -- vision ------------------------------------------------------------------------------------


def _images(batch: int, size: int, classes: int = 10, **extra: Any) -> dict[str, Any]:
    return {
        "pixel_values": torch.randn(batch, 3, size, size),
        "labels": torch.randint(0, classes, (batch,)),
        **extra,
    }


def vit() -> Case:
    """`ViTForImageClassification` on 32x32 images in 8x8 patches, with hidden and attention
    dropout; ``interpolate_pos_encoding=True`` (needed for the 24x24 small inputs) resamples the
    position embeddings only when the patch grid differs from the config's."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_dropout_prob=P,
        attention_probs_dropout_prob=P,
        num_labels=10,
    )
    model = _hf(ViTForImageClassification, config)
    inputs = _images(4, 32, interpolate_pos_encoding=True)
    small = _images(2, 24, interpolate_pos_encoding=True)
    return Case(model, inputs, None, small, "vision")


def resnet_hf() -> Case:
    """HF `ResNetForImageClassification` (basic blocks, BatchNorm in train mode, so every forward
    updates running statistics in place, and a replayed forward updates them again)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="basic",
        num_labels=10,
    )
    model = _hf(ResNetForImageClassification, config)
    return Case(model, _images(4, 32), None, _images(2, 24), "vision")


def convnext() -> Case:
    """HF `ConvNextForImageClassification`: depthwise 7x7 convs, channels-first LayerNorm, layer
    scale, and stochastic depth (drop path up to 0.1, random per sample: replay needs the RNG)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    config = ConvNextConfig(
        num_channels=3,
        patch_size=4,
        num_stages=2,
        hidden_sizes=[16, 32],
        depths=[2, 2],
        drop_path_rate=P,
        image_size=32,
        num_labels=10,
    )
    model = _hf(ConvNextForImageClassification, config)
    return Case(model, _images(4, 32), None, _images(2, 16), "vision")


# -- plain PyTorch -----------------------------------------------------------------------------


def mlp_targets() -> Case:
    """A Linear/GELU/Dropout MLP whose loss closes over a targets tensor, the usual way a
    ``loss_fn`` gets targets: ``lambda out: F.cross_entropy(out, targets)``. The small inputs are
    the first rows of the inputs, so the loss slices its targets to the output's batch."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128),
        nn.GELU(),
        nn.Dropout(P),
        nn.Linear(128, 128),
        nn.GELU(),
        nn.Dropout(P),
        nn.Linear(128, 10),
    ).train()
    x = torch.randn(32, 64)
    targets = torch.randint(0, 10, (32,))
    return Case(
        model,
        x,
        lambda out: F.cross_entropy(out, targets[: out.shape[0]]),
        x[:8].clone(),
        "plain",
    )


class Gate(nn.Module):
    """Normalises by a Python float read with ``.item()``, then takes one of two MLP branches
    depending on the sign of the input's sum."""

    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.down = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim))
        self.drop = nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().max().item()
        x = x / max(scale, 1e-6)
        if x.sum() > 0:
            y = self.up(x)
        else:
            y = -self.down(-x)
        return self.drop(y)


class ValueBranch(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 3):
        super().__init__()
        self.embed = nn.Linear(16, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.gates = nn.ModuleList(Gate(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for norm, gate in zip(self.norms, self.gates, strict=True):
            h = h + gate(norm(h) + x.mean())
        return self.head(h)


def value_branch() -> Case:
    """Python control flow on tensor values inside submodules (`Gate`: ``if x.sum() > 0`` between
    two MLPs, and a scale read with ``.item()``). Each gate sees its input shifted by the mean of
    the raw input, so the inputs (mean > 0) take the ``up`` branches and the small inputs
    (mean < 0) the ``down`` branches: a plan recorded on one set meets the other branch."""
    torch.manual_seed(0)
    model = ValueBranch().train()
    x = torch.randn(4, 64, 16) + 1.0
    small = torch.randn(2, 40, 16) - 1.0
    return Case(model, x, lambda out: out.float().pow(2).mean(), small, "plain")


class Expert(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class MoE(nn.Module):
    """Top-k routing: each token goes to the k experts with the highest router probability, the
    experts run on the tokens routed to them (a count known only from the values), and their
    outputs, weighted by the renormalised probabilities, are added back with ``index_add_``."""

    def __init__(self, dim: int, experts: int = 4, k: int = 2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(flat), dim=-1)
        weights, selected = torch.topk(probs, self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (selected == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            y = expert(flat[token]) * weights[token, slot].unsqueeze(-1)
            out.index_add_(0, token, y)
        return out.view_as(x)


class MoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.moe = MoE(dim)
        self.drop = nn.Dropout(P)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        p = P if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.drop(self.moe(self.ln2(x)))


class MoELM(nn.Module):
    """nanoGPT-style: ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, vocab: int = 512, dim: int = 64, heads: int = 4, depth: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(128, dim)
        self.drop = nn.Dropout(P)
        self.blocks = nn.ModuleList(MoEBlock(dim, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def moe_top2() -> Case:
    """A tiny mixture-of-experts transformer in plain PyTorch: causal SDPA attention, then a top-2
    of 4 experts MoE layer whose routing makes intermediate shapes depend on values (``nonzero``,
    boolean gathers, ``index_add_``). Inputs are ``(idx, targets)``; the loss is ``out[1]``."""
    torch.manual_seed(0)
    model = MoELM().train()

    def batch(b: int, t: int):
        ids = torch.randint(0, 512, (b, t + 1))
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return Case(model, batch(4, 32), lambda out: out[1], batch(2, 20), "moe")


CASES: dict[str, Callable[[], Case]] = {
    "gpt2_eager": gpt2_eager,
    "gpt2_sdpa": gpt2_sdpa,
    "gpt2_padded": gpt2_padded,
    "llama": llama,
    "llama_padded": llama_padded,
    "mistral": mistral,
    "qwen2": qwen2,
    "bert": bert,
    "t5": t5,
    "vit": vit,
    "resnet_hf": resnet_hf,
    "convnext": convnext,
    "mlp_targets": mlp_targets,
    "value_branch": value_branch,
    "moe_top2": moe_top2,
    "peft_lora_llama": peft_lora_llama,
    "albert": albert,
    "bloom_padded": bloom_padded,
    "mixtral": mixtral,
    "whisper": whisper,
    "deberta_v2": deberta_v2,
    "bart": bart,
}
"""Every builder, by name."""
