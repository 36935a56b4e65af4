"""`ckpt-planner compare SPEC`: measure our plans against the baselines and torch.compile's budget.

Writes ``table.md``, ``results.json`` and ``pareto.png`` into the output folder and prints the
table and the targets' checks. Imports torch (inside `run`): this command runs the model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from planner.compiled import MEMORY_BUDGETS

__all__ = ["add_arguments", "run"]


def _floats(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not 0 <= v <= 1 for v in vals):
        raise argparse.ArgumentTypeError(f"fractions must lie in [0, 1], got {text!r}")
    return vals


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated backend names such as aot_eager,inductor, got {text!r} "
            "(use --no-compile to skip torch.compile)")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "spec", metavar="SPEC",
        help="module:function returning (model, example_inputs), e.g. tests.models:gpt_eager",
    )
    parser.add_argument("--fractions", type=_floats, default=(0.75, 0.5, 0.3),
                        help="activation-budget fractions for our sweep (default 0.75,0.5,0.3)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="round-robin rounds over all strategies (default 3)")
    parser.add_argument("--compile-budgets", type=_floats, default=(1.0, 0.8, 0.5, 0.2, 0.0),
                        help="torch.compile activation_memory_budget values (1: the backend "
                             "without extra recomputation, the reference of the compiled rows)")
    parser.add_argument("--compile-memory-budgets", type=_floats, default=MEMORY_BUDGETS,
                        help="activation_memory_budget values 'ours + backend' searches beside "
                             "its regions, as plan(compile=) does")
    parser.add_argument("--compile-backend", type=_names, default=("aot_eager",),
                        help="torch.compile backend(s), comma-separated: aot_eager (default), "
                             "inductor (needs a C++ compiler on CPU), or aot_eager,inductor")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile entries")
    parser.add_argument("--graph", action="store_true",
                        help="also measure make_fx graph plans (op-granular regions) where the "
                             "model traces, and baselines that cannot be applied in place")
    parser.add_argument("--name", default=None, help="model name in the table and plot")
    parser.add_argument("-o", "--output", default="compare_out", help="output folder")


def run(args: argparse.Namespace) -> int:
    from planner.cli import SpecError, load_spec

    try:
        model, example_inputs = load_spec(args.spec)
    except SpecError as e:
        print(f"ckpt-planner compare: {e}", file=sys.stderr)
        return 2
    from planner.comparison import CompareOptions, compare, host_allocator  # imports torch

    if host_allocator() == "glibc":
        print("ckpt-planner compare: this process allocates with glibc's malloc, which returns "
              "large freed blocks to the OS; on CPU, page faults then inflate every strategy's "
              "step time, checkpointing's most. For steadier figures run under tcmalloc or "
              "jemalloc, e.g. LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "
              "(Debian: apt install libtcmalloc-minimal4).", file=sys.stderr)
    model.train()
    options = CompareOptions(
        fractions=args.fractions,
        repeats=max(1, args.repeats),
        compile_budgets=args.compile_budgets,
        compile_memory_budgets=args.compile_memory_budgets,
        include_compile=not args.no_compile,
        compile_backend=args.compile_backend,
        graph=args.graph,
    )
    res = compare(model, example_inputs, options=options, progress=True,
                  name=args.name or args.spec.partition(":")[2] or None)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(res.table() + "\n\n" + res.checks_text() + "\n")
    res.to_json(out / "results.json")
    try:
        res.plot(out / "pareto.png")
    except ImportError:
        print("ckpt-planner compare: pareto.png needs matplotlib (pip install matplotlib)",
              file=sys.stderr)
    print(res.table())
    print()
    print(res.checks_text())
    print(f"\nwrote {out / 'table.md'}, {out / 'results.json'}, {out / 'pareto.png'}")
    return 0
