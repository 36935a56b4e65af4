"""A planned HF model trains under `transformers.Trainer` unchanged: the LoRA example of
`notebooks/lora_trainer_example.py`, 5 steps."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.slow


def test_planned_lora_llama_trains_under_trainer():
    from notebooks.lora_trainer_example import train
    from planner.inplace import applied

    p, result = train(steps=5, fraction=0.5, batch=4, seq=64)
    assert result.global_step == 5 and math.isfinite(result.training_loss)
    assert p.schedule.regions and applied(p.module) is not None
    trainable = {k for k, q in p.module.named_parameters() if q.requires_grad}
    assert trainable and all("lora_" in k for k in trainable)
