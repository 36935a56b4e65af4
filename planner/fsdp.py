"""FSDP2's mixed precision, as the planner records a step for it.

With ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, ...))``
(torchtitan's default), FSDP2 all-gathers each unit's parameters cast to ``param_dtype``, casts
the floating-point inputs of every sharded module's forward to it (``cast_forward_inputs``), and
computes gradients in it, while the shards, the sharded gradients and the optimizer stay in the
parameters' own dtype and gradients are reduce-scattered in ``reduce_dtype``. A step recorded in
float32 holds about twice the activations the sharded step does.

`fsdp_cast` runs the model so for the recording, in one process, before it is sharded: the
parameters' data cast in place (the same `Parameter` objects, so hooks and the optimizer still
see them) and the inputs of the root and of the units cast by forward pre-hooks; everything is
put back afterwards. `mixed_precision` is what the profile records of the policy
(`ProfileMeta.fsdp_mixed_precision`), from which `solvers.distributed.per_rank` sizes the shards
in the parameters' dtype and the reduce-scatter in ``reduce_dtype``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from solvers.errors import CkptPlannerError
from solvers.profile import DTYPE_BYTES

__all__ = ["fsdp_cast", "mixed_precision"]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _orig_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The one floating dtype of the model's floating parameters (FSDP2 requires one per unit;
    the planner, one for the model); None without any."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) > 1:
        raise CkptPlannerError(
            f"the model's parameters have several floating dtypes ({', '.join(sorted(map(_name, dtypes)))}); "
            "planning for FSDP2's mixed precision needs one (FSDP2 requires it per unit): convert "
            "the model to one dtype (e.g. model.float()) before planning, or plan without "
            "mp_policy (the peak is then that of the step in the parameters' own dtypes)")
    return next(iter(dtypes), None)


def _check_policy(policy: Any) -> None:
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # torch built without distributed
        raise CkptPlannerError("mp_policy needs torch.distributed (FSDP2)") from None
    if not isinstance(policy, MixedPrecisionPolicy):
        raise CkptPlannerError(
            f"mp_policy is a {type(policy).__name__}; pass the "
            "torch.distributed.fsdp.MixedPrecisionPolicy you give fully_shard, e.g. "
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        d = getattr(policy, field)
        if d is not None and _name(d) not in DTYPE_BYTES:
            raise CkptPlannerError(
                f"mp_policy.{field} is {d}; the planner models {', '.join(sorted(DTYPE_BYTES))}")


def mixed_precision(model: torch.nn.Module, policy: Any) -> dict[str, str]:
    """What a profile records of `policy` for `model` (`ProfileMeta.fsdp_mixed_precision`): {}
    where it changes nothing (no dtype differs from the parameters'), as FSDP2 clamps it."""
    _check_policy(policy)
    orig = _orig_dtype(model)
    if orig is None:
        return {}
    param = policy.param_dtype or orig  # FSDP2: None, or the parameters' own dtype, casts nothing
    reduce = policy.reduce_dtype or param
    if param == orig and reduce == param:
        return {}
    return {"param_dtype": _name(param), "orig_dtype": _name(orig), "reduce_dtype": _name(reduce)}


@contextlib.contextmanager
def fsdp_cast(model: torch.nn.Module, policy: Any, units: Sequence[str] = (),
              uncast: set[str] | None = None, casted: set[str] | None = None
              ) -> Iterator[None]:
    """Run `model` as FSDP2 runs it under `policy` for the duration of the block: floating
    parameters cast to ``param_dtype`` in place, the floating inputs of the root's and each of
    `units`' forward cast to it (``cast_forward_inputs``), their outputs to ``output_dtype``
    where set. Parameters, gradients and forwards are put back afterwards, also on error.
    `uncast`, where given, collects the modules whose forward received a floating tensor of
    another dtype than ``param_dtype``: had FSDP2 sharded one of them, it would have cast it;
    `casted`, the ones of `units` whose inputs the cast changed."""
    mp = mixed_precision(model, policy)
    if not mp:
        yield
        return
    param = getattr(torch, mp["param_dtype"])
    modules = dict(model.named_modules())
    missing = [u for u in units if u not in modules]
    if missing:
        raise CkptPlannerError(f"fsdp_units {missing[:3]} are not modules of the model")
    params = [p for p in model.parameters() if p.is_floating_point()]
    grads = [p.grad for p in params]
    data = [p.data for p in params]
    hooks = []

    from torch.distributed.utils import _apply_to_tensors  # what FSDP2 casts with

    def cast_to(dtype: torch.dtype):
        def cast(x: torch.Tensor) -> torch.Tensor:
            return x.to(dtype) if x.is_floating_point() else x
        return cast

    def pre_of(name: str):
        def pre(_m: torch.nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
            if casted is not None:
                _apply_to_tensors(lambda x: casted.add(name) if x.is_floating_point()
                                  and x.dtype != param else None, (args, kwargs))
            return (_apply_to_tensors(cast_to(param), args),
                    _apply_to_tensors(cast_to(param), kwargs))
        return pre

    def post(_m: torch.nn.Module, _args: Any, output: Any) -> Any:
        return _apply_to_tensors(cast_to(policy.output_dtype), output)

    def watch(name: str):
        def check(_m: torch.nn.Module, args: Any, kwargs: Any) -> None:
            if name not in uncast:
                _apply_to_tensors(lambda x: uncast.add(name) if x.is_floating_point()
                                  and x.dtype != param else None, (args, kwargs))
        return check

    try:
        for p in params:
            p.grad = None
            p.data = p.data.to(param)
        for name in ["", *units]:
            m = modules[name]
            if policy.cast_forward_inputs:
                hooks.append(m.register_forward_pre_hook(pre_of(name), with_kwargs=True,
                                                         prepend=True))
            if policy.output_dtype is not None:
                hooks.append(m.register_forward_hook(post))
        if uncast is not None and policy.cast_forward_inputs:
            for name, m in modules.items():
                if name and name not in units:
                    hooks.append(m.register_forward_pre_hook(watch(name), with_kwargs=True))
        yield
    finally:
        for h in hooks:
            h.remove()
        for p, d, g in zip(params, data, grads, strict=True):
            p.grad = None
            p.data = d
            p.grad = g
