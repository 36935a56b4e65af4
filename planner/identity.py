"""What a plan was made for, and whether a model is still that.

A schedule names module paths and the k-th op of each overload inside them; its memory promise
holds for the model, input shapes, dtype and torch version it was profiled with. `made_for`
records them in the schedule; `differences` says how a model differs before `planner.apply`
puts the schedule onto it.
"""

from __future__ import annotations

from typing import Any

import torch

from solvers.profile import Profile

__all__ = ["differences", "larger_inputs", "made_for"]


def _parameters(model: torch.nn.Module) -> list[str]:
    return [f"{name} {list(p.shape)} {str(p.dtype).removeprefix('torch.')}"
            for name, p in model.named_parameters()]


def made_for(model: torch.nn.Module, profile: Profile) -> dict[str, Any]:
    """The identity a schedule planned from `profile` for `model` carries."""
    return {
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "modules": [name for name, _ in model.named_modules()],
        "parameters": _parameters(model),
        "input_shapes": dict(profile.meta.input_shapes),
        "dtype": profile.meta.dtype,
        "autocast": profile.meta.autocast,
        "torch": profile.meta.torch_version,
        # what FSDP2 computes in ("": the parameters' dtype), for the run-time check
        **({"fsdp_param_dtype": profile.meta.fsdp_mixed_precision.get("param_dtype", "")}
           if profile.meta.sharding == "fsdp" else {}),
    }


def differences(identity: dict[str, Any], model: torch.nn.Module) -> list[str]:
    """How `model` differs from the model a schedule was made for (empty: it does not), in the
    words an error message needs: which modules and parameters are missing, extra or changed."""
    if not identity:
        return []
    out = []
    cls = f"{type(model).__module__}.{type(model).__qualname__}"
    if identity.get("model_class") and identity["model_class"] != cls:
        out.append(f"the plan was made for a {identity['model_class']}, this is a {cls}")
    planned = identity.get("modules")
    if planned is not None:
        here = [name for name, _ in model.named_modules()]
        missing = [m for m in planned if m not in set(here)]
        extra = [m for m in here if m not in set(planned)]
        if missing:
            out.append(f"modules {_few(missing)} are not in this model")
        if extra:
            out.append(f"this model has modules the plan does not know: {_few(extra)}")
    params = identity.get("parameters")
    if params is not None:
        was = dict(p.split(" ", 1) for p in params)
        now = dict(p.split(" ", 1) for p in _parameters(model))
        changed = [f"{k} ({was[k]} in the plan, {now[k]} here)" for k in was
                   if k in now and was[k] != now[k]]
        if changed:
            out.append(f"parameters differ: {_few(changed)}")
        gone = [k for k in was if k not in now]
        new = [k for k in now if k not in was]
        if gone or new:
            out.append("parameters " + ", ".join(
                ([f"missing here: {_few(gone)}"] if gone else [])
                + ([f"new here: {_few(new)}"] if new else [])))
    if identity.get("torch") and identity["torch"] != torch.__version__:
        out.append(f"the plan was made with torch {identity['torch']}, this is "
                   f"{torch.__version__} (op sequences can differ between versions)")
    return out


def larger_inputs(identity: dict[str, Any], shapes: dict[str, list[int]]) -> list[str]:
    """Inputs of `shapes` larger in some dimension than the example the plan was made for (the
    budget holds for batches no larger than that)."""
    planned = identity.get("input_shapes") or {}
    out = []
    for key, shape in shapes.items():
        want = planned.get(key)
        if want is not None and (len(want) != len(shape) or any(a > b for a, b in
                                                                  zip(shape, want))):
            out.append(f"{key} {list(shape)} (planned for {list(want)})")
    return out


def _few(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")
