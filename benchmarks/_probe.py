"""What the probes share: each model planned at its smallest peak, then half way from there to
no checkpointing, and trained a few SGD steps beside an unplanned copy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

import planner


def floor_and_half_way(model: torch.nn.Module, inputs: Any, loss_fn: Callable
                       ) -> Iterator[tuple[str, Any, int]]:
    """(label, plan, predicted no-checkpoint peak): the model planned in place at its smallest
    peak, then re-planned half way from that peak to no checkpointing. The first `next` raises
    `CkptPlannerError` where the model does not plan."""
    low = planner.plan(model, None, example_inputs=inputs, loss_fn=loss_fn)
    none = low.baselines()["none"].predicted_peak_bytes
    yield "smallest peak", low, none
    planner.remove(model)
    half = low.predicted_peak_bytes + (none - low.predicted_peak_bytes) // 2
    yield "half way", planner.plan(model, budget_bytes=half, example_inputs=inputs,
                                   loss_fn=loss_fn), none


def train(model: torch.nn.Module, inputs: Any, loss_fn: Callable, steps: int = 3) -> None:
    """`steps` SGD steps from torch's seed 1 (the RNG restored after)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(*args)).backward()
            opt.step()


def max_rel_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest |got - want| / max |want| over the non-empty tensors of two states (integer and
    boolean ones, counters and masks, compared as floats)."""
    def num(t: torch.Tensor) -> torch.Tensor:
        return t if t.is_floating_point() or t.is_complex() else t.double()

    return max(((num(g) - num(w)).abs().max() / num(w).abs().max().clamp_min(1e-12)).item()
               for g, w in zip(got, want, strict=True) if w.numel())
