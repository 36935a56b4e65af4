"""Decoders from Lightning's LitGPT, trained as its scripts train them, in fp32 and under bf16
autocast (the twenty-third probe).

    python benchmarks/litgpt_probe.py [model ...] [-n 6] [--fp32-only]

LitGPT writes every decoder as one ``GPT`` class of plain torch driven by a ``Config``: a
rotary cache held as buffers and sliced by the sequence length, grouped-query attention through
SDPA with masks built per call, sliding windows and logit soft-capping (Gemma 2 and 3),
parallel residuals (Pythia, Falcon), QK norms (Qwen 3, OLMo 2), routed experts written as a
Python loop over the experts a batch picks (Mixtral, Qwen 3 MoE: value-dependent shapes), and
its own LoRA and adapter-v2 fine-tuning models (``litgpt.lora``, ``litgpt.adapter_v2``) with
everything but the adapters frozen, as ``litgpt finetune`` runs them. Each model is a small
configuration of the named checkpoint's architecture with random weights, trained on next-token
targets through ``litgpt.utils.chunked_cross_entropy`` (the loss LitGPT's scripts use), the
targets padded with -100 on a second row shorter than the first. Then as `families_probe.py`
does: planned at its smallest peak and half way, each plan verified and run on a smaller batch,
and `-n` schedules near the smallest-peak one measured. Needs ``pip install --no-deps litgpt
lightning lightning-utilities torchmetrics`` (litgpt's package imports Lightning). Not part of
the test suite (minutes of CI).
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
from tests.zoo import Case  # noqa: E402

V = 512
SMALL = dict(n_layer=2, n_embd=64, n_head=4, n_query_groups=2, intermediate_size=128,
             padded_vocab_size=V, vocab_size=V, block_size=64)


def _batch(rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets; row i is 6 i tokens shorter (its tail padded with
    token 0 in the input and -100 in the targets, which the loss ignores)."""
    g = torch.Generator().manual_seed(rows * 1000 + seq)
    ids = torch.randint(1, V, (rows, seq + 1), generator=g)
    real = torch.arange(seq + 1) < torch.tensor([seq + 1 - 6 * i for i in range(rows)])[:, None]
    ids = ids.masked_fill(~real, 0)
    targets = ids[:, 1:].masked_fill(~real[:, 1:], -100)
    return ids[:, :-1].contiguous(), targets.contiguous()


def _loss(targets: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        from litgpt.utils import chunked_cross_entropy

        return chunked_cross_entropy(logits, targets, chunk_size=16)

    return loss_fn


def _case(name: str, kind: str = "", **kw: Any) -> Callable[[], Case]:
    """`name`'s architecture at `SMALL` size (plus `kw`); `kind` "lora" or "adapter_v2" builds
    that fine-tuning model with only its adapters trainable."""

    def build() -> Case:
        from litgpt.config import name_to_config

        base = name_to_config[name]
        extra = dict(SMALL)
        if base.get("n_expert"):
            extra.update(n_expert=4, n_expert_per_token=2, moe_intermediate_size=64)
        if base.get("head_size"):
            extra.update(head_size=16)
        extra.update(kw)
        torch.manual_seed(0)
        if kind == "lora":
            from litgpt import lora

            model = lora.GPT(lora.Config.from_name(
                name, lora_r=4, lora_alpha=8, lora_dropout=0.1, lora_query=True,
                lora_value=True, lora_mlp=True, **extra))
            lora.mark_only_lora_as_trainable(model)
        elif kind == "adapter_v2":
            from litgpt import adapter_v2

            model = adapter_v2.GPT(adapter_v2.Config.from_name(
                name, adapter_start_layer=0, adapter_prompt_length=4, **extra))
            adapter_v2.mark_only_adapter_v2_as_trainable(model)
        else:
            from litgpt.config import Config
            from litgpt.model import GPT

            model = GPT(Config.from_name(name, **extra))
        model.max_seq_length = SMALL["block_size"]
        ids, targets = _batch(4, 64)
        small, _ = _batch(2, 32)
        return Case(model.train(), (ids,), _loss(targets), (small,), "decoder")

    return build


MODELS: dict[str, Callable[[], Case]] = {
    "llama3.2": _case("Llama-3.2-1B"),
    "gemma2": _case("Gemma-2-2b", sliding_window_size=16),
    "gemma3": _case("Gemma-3-1b-it", sliding_window_size=16),
    "phi3": _case("Phi-3-mini-4k-instruct"),
    "phi4_mini": _case("Phi-4-mini-instruct"),
    "qwen2.5": _case("Qwen2.5-0.5B"),
    "qwen3": _case("Qwen3-0.6B"),
    "qwen3_moe": _case("Qwen3-30B-A3B"),
    "mixtral": _case("Mixtral-8x7B-v0.1"),
    "pythia": _case("pythia-14m"),
    "falcon": _case("falcon-7b"),
    "olmo": _case("OLMo-1B-hf"),
    "olmo2": _case("OLMo-2-1124-7B"),
    "stablelm": _case("stablelm-3b-4e1t"),
    "llama3.2_lora": _case("Llama-3.2-1B", "lora"),
    "llama3.2_adapter_v2": _case("Llama-3.2-1B", "adapter_v2"),
}


def main(argv: list[str] | None = None) -> int:
    return families_probe.main(argv, MODELS, "model", __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
