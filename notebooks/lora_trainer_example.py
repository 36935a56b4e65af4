"""Train a tiny Llama with LoRA under Hugging Face `Trainer`, checkpointed by ckpt-planner.

    HF_HUB_OFFLINE=1 python notebooks/lora_trainer_example.py [--steps 20] [--budget-fraction 0.5]

The model is built from a config (random weights, nothing downloaded), wrapped with PEFT LoRA on
the attention and MLP projections, planned for a budget of half its activation memory, and handed
to `Trainer` unchanged: the plan lives on the model's own modules, so `Trainer` sees the PEFT model
it was given. No `enable_input_require_grads()` is needed (non-reentrant checkpointing trains
adapters behind a frozen embedding). The data is a few hundred synthetic tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import planner  # noqa: E402
from solvers.simulate import simulate  # noqa: E402


def build(seq: int = 64, vocab: int = 512):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=seq, attention_dropout=0.1)
    config._attn_implementation = "sdpa"
    base = LlamaForCausalLM(config)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"])
    model = get_peft_model(base, lora)
    model.train()
    return model


class Tokens(torch.utils.data.Dataset):
    """`n` sequences of `seq` random tokens (a few hundred tokens in all)."""

    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(steps: int = 20, fraction: float = 0.5, batch: int = 4, seq: int = 64,
          out_dir: str | None = None):
    """Plan the LoRA model at `fraction` of its activation memory and train it under Trainer;
    returns (plan, Trainer's training output)."""
    from transformers import Trainer, TrainingArguments

    model = build(seq)
    data = Tokens(n=max(8, steps * batch // 4), seq=seq, vocab=model.config.vocab_size)
    example = {"input_ids": data.ids[:batch], "labels": data.ids[:batch], "use_cache": False}
    prof = planner.profile(model, example, repeats=1)
    n, f = simulate(prof).peak_bytes, prof.fixed_bytes
    budget = int(f + fraction * (n - f))
    p = planner.plan_from_profile(model, prof, budget_bytes=budget)
    p.example_inputs = example
    model.config.use_cache = False
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=out_dir or tmp, per_device_train_batch_size=batch,
                                 max_steps=steps, learning_rate=1e-3, logging_steps=max(1, steps // 4),
                                 report_to=[], use_cpu=True, save_strategy="no",
                                 dataloader_num_workers=0, disable_tqdm=True)
        result = Trainer(model=model, args=args, train_dataset=data).train()
    return p, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--budget-fraction", type=float, default=0.5)
    a = ap.parse_args()
    p, result = train(a.steps, a.budget_fraction)
    print(p.report())
    print(f"trained {result.global_step} steps, final train loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
