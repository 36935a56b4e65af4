"""ckpt-planner: automatic activation checkpointing for PyTorch.

`planner` is the torch side: tracing and profiling models, rewriting them, measuring them. Heavy
modules are imported on first use, so `ckpt-planner plan` works where torch is not installed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "InfeasibleBudgetError",
    "Measurement",
    "Plan",
    "PlanNotEffectiveError",
    "TraceError",
    "apply",
    "compare",
    "measure",
    "plan",
    "profile",
]

_LAZY = {
    "profile": "planner.profiler",
    "plan": "planner.api",
    "apply": "planner.api",
    "Plan": "planner.api",
    "InfeasibleBudgetError": "planner.api",
    "PlanNotEffectiveError": "planner.api",
    "measure": "planner.measure",
    "compare": "planner.comparison",
    "Measurement": "planner.measure",
    "TraceError": "planner.trace",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
