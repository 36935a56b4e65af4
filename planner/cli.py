"""The `ckpt-planner` command line: profile a model, show a profile, plan and compare schedules.

Importing this module does not import torch: `profile` imports the profiler inside its handler, and
`show`, `plan` and `compare` read saved profiles, so they work where torch is not installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["main"]

_MIB = 2**20
_GIB = 2**30


def fmt_bytes(n: int) -> str:
    """Bytes for people: MiB below 1 GiB, GiB above, 2 decimals."""
    if abs(n) >= _GIB:
        return f"{n / _GIB:.2f} GiB"
    return f"{n / _MIB:.2f} MiB"


# -- profile --------------------------------------------------------------------------------------
class SpecError(Exception):
    """A `module:function` model spec that cannot be turned into (model, example_inputs)."""


def load_spec(spec: str) -> tuple[Any, Any]:
    """Call the function named by ``module:function`` and return its ``(model, example_inputs)``."""
    expected = (
        "expected SPEC as 'module:function', where module is importable from the current "
        "directory and function() returns (model, example_inputs), e.g. tests.models:hf_gpt2"
    )
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise SpecError(f"model spec {spec!r} has no 'module:function' form; {expected}")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise SpecError(
            f"cannot import module {module_name!r} from {cwd} ({e}); {expected}"
        ) from None
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        raise SpecError(f"module {module_name!r} has no function {func_name!r}; {expected}")
    result = func()
    if not (isinstance(result, tuple) and len(result) == 2):
        found = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        raise SpecError(f"{spec}() returned {found}; {expected}")
    return result


def _cmd_profile(args: argparse.Namespace) -> int:
    try:
        model, example_inputs = load_spec(args.spec)
    except SpecError as e:
        print(f"ckpt-planner profile: {e}", file=sys.stderr)
        return 2
    from planner.profiling import profile  # imports torch
    from solvers.errors import CkptPlannerError

    mp_policy = None
    if args.fsdp_param_dtype or args.fsdp_reduce_dtype:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp_policy = MixedPrecisionPolicy(
            param_dtype=getattr(torch, args.fsdp_param_dtype) if args.fsdp_param_dtype else None,
            reduce_dtype=getattr(torch, args.fsdp_reduce_dtype) if args.fsdp_reduce_dtype
            else None)
    try:
        prof = profile(
            model,
            example_inputs,
            mode=args.mode,
            device=args.device,
            repeats=args.repeats,
            progress=True,
            mp_policy=mp_policy,
        )
    except CkptPlannerError as e:
        print(f"ckpt-planner profile: {e}", file=sys.stderr)
        return 2
    path = prof.save(args.output)
    n_fwd = sum(n.phase == "forward" for n in prof.nodes)
    print(
        f"wrote {path}: {prof.meta.model_class or 'model'}, {len(prof.nodes)} nodes "
        f"({n_fwd} forward), fixed {fmt_bytes(prof.fixed_bytes)}, "
        f"saved activations {fmt_bytes(prof.saved_bytes)}, step {prof.step_ms:.2f} ms "
        f"({prof.meta.mode} on {prof.meta.device_name or prof.meta.device})"
    )
    return 0


# -- show -----------------------------------------------------------------------------------------
def _cmd_show(args: argparse.Namespace) -> int:
    from solvers import Profile, ProfileError

    try:
        p = Profile.load(args.profile)
    except ProfileError as e:
        print(f"ckpt-planner show: {e}", file=sys.stderr)
        return 2
    m = p.meta
    counts = {ph: 0 for ph in ("param", "buffer", "input", "forward", "loss", "backward")}
    for n in p.nodes:
        counts[n.phase] = counts.get(n.phase, 0) + 1
    shapes = ", ".join(f"{k}={list(v)}" for k, v in m.input_shapes.items()) or "(none recorded)"
    lines = [
        f"profile:        {args.profile}",
        f"model:          {m.model_class or '(unknown)'}",
        f"device:         {m.device}" + (f" ({m.device_name})" if m.device_name else ""),
        f"mode:           {m.mode}",
        f"dtype:          {m.dtype}" + (
            " (recorded for FSDP2 mixed precision: parameters cast from {orig_dtype} to "
            "{param_dtype}, gradients reduced in {reduce_dtype})".format(**m.fsdp_mixed_precision)
            if m.fsdp_mixed_precision else ""),
        f"torch:          {m.torch_version or '(unknown)'}",
        f"inputs:         {shapes}",
        "nodes:          "
        + ", ".join(f"{ph} {c}" for ph, c in counts.items())
        + f" (total {len(p.nodes)})",
        f"fixed memory:   {fmt_bytes(p.fixed_bytes)} (params {fmt_bytes(p.param_bytes)}, "
        f"buffers {fmt_bytes(p.buffer_bytes)}, inputs {fmt_bytes(p.input_bytes)}, "
        f"optimizer state {fmt_bytes(p.optimizer_state_bytes)})",
        f"saved activations: {fmt_bytes(p.saved_bytes)}",
        f"step time:      {p.step_ms:.3f} ms (sum of op times)",
    ]
    by_module = sorted(
        ((m or "(top level)", b) for m, b in p.saved_bytes_by_module().items()),
        key=lambda kv: (-kv[1], kv[0]),
    )
    if by_module:
        lines.append(f"top {min(args.top, len(by_module))} modules by saved bytes:")
        width = max(len(k) for k, _ in by_module[: args.top])
        for mod, b in by_module[: args.top]:
            lines.append(f"  {mod:<{width}}  {fmt_bytes(b)}")
    print("\n".join(lines))
    return 0


# -- parser ---------------------------------------------------------------------------------------
def _add_optional_subcommand(
    sub: argparse._SubParsersAction, name: str, module_name: str, help_text: str
) -> None:
    """Register `name` from `module_name` (add_arguments/run) if that module is installed."""
    if importlib.util.find_spec(module_name) is None:
        return
    module = importlib.import_module(module_name)
    p = sub.add_parser(name, help=help_text)
    module.add_arguments(p)
    run: Callable[[argparse.Namespace], int] = module.run
    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt-planner",
        description="Automatic activation-checkpoint planner for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("profile", help="record one training step of a model; save the profile")
    p.add_argument(
        "spec",
        metavar="SPEC",
        help="module:function returning (model, example_inputs), e.g. tests.models:hf_gpt2",
    )
    p.add_argument("-o", "--output", required=True, help="output path (.json or .json.gz)")
    p.add_argument(
        "--mode",
        choices=("measure", "estimate"),
        default="measure",
        help="measure op times by running them, or estimate them with a roofline model",
    )
    p.add_argument("--device", default=None, help="device to run on or estimate for (e.g. h100)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per op (median)")
    dtypes = ("float32", "bfloat16", "float16")
    p.add_argument("--fsdp-param-dtype", choices=dtypes, default=None,
                   help="FSDP2 MixedPrecisionPolicy.param_dtype you will shard with: the step is "
                        "recorded with parameters and inputs cast to it (then plan with --fsdp)")
    p.add_argument("--fsdp-reduce-dtype", choices=dtypes, default=None,
                   help="FSDP2 MixedPrecisionPolicy.reduce_dtype (default: the param dtype)")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("show", help="summarise a saved profile")
    p.add_argument("profile", metavar="PROFILE", help="profile file (.json or .json.gz)")
    p.add_argument("--top", type=int, default=10, help="modules to list by saved bytes")
    p.set_defaults(func=_cmd_show)

    _add_optional_subcommand(
        sub, "plan", "planner.cli_plan", "plan a checkpoint schedule for a memory budget"
    )
    _add_optional_subcommand(
        sub, "compare", "planner.cli_compare", "compare solvers and baselines on a profile"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ckpt-planner` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
