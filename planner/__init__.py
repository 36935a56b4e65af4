"""ckpt-planner: automatic activation checkpointing for PyTorch.

`planner` is the torch side: recording a training step (`profile`), planning and applying a
schedule to the model in place (`plan`, `apply`, `remove`), measuring (`measure`, `compare`).
Heavy modules are imported on first use, so `ckpt-planner plan` works where torch is not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.api import (
        InfeasibleBudgetError,
        NotReproducibleError,
        Plan,
        PlanNotEffectiveError,
        Verification,
        apply,
        plan,
        plan_from_profile,
        remove,
    )
    from planner.capture.record import ModelRunError
    from planner.comparison import CompareOptions, CompareResult, compare
    from planner.measurement import Measurement, measure
    from planner.profiling import profile
    from solvers.errors import CkptPlannerError

__all__ = [
    "CkptPlannerError",
    "CompareOptions",
    "CompareResult",
    "InfeasibleBudgetError",
    "Measurement",
    "ModelRunError",
    "NotReproducibleError",
    "Plan",
    "PlanNotEffectiveError",
    "Verification",
    "apply",
    "compare",
    "measure",
    "plan",
    "plan_from_profile",
    "profile",
    "remove",
]

_LAZY = {
    "profile": "planner.profiling",
    "plan": "planner.api",
    "plan_from_profile": "planner.api",
    "apply": "planner.api",
    "remove": "planner.api",
    "Plan": "planner.api",
    "Verification": "planner.api",
    "InfeasibleBudgetError": "planner.api",
    "PlanNotEffectiveError": "planner.api",
    "NotReproducibleError": "planner.api",
    "ModelRunError": "planner.capture.record",
    "CkptPlannerError": "solvers.errors",
    "measure": "planner.measurement",
    "Measurement": "planner.measurement",
    "compare": "planner.comparison",
    "CompareOptions": "planner.comparison",
    "CompareResult": "planner.comparison",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
