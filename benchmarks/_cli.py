"""What the measuring benchmark scripts share on the command line: the model names they accept
and the allocator they warn about."""

from __future__ import annotations

import argparse
import sys

from planner.comparison import host_allocator


def check_models_and_allocator(ap: argparse.ArgumentParser, models: list[str],
                               known: tuple[str, ...], script: str) -> None:
    """Exit with a usage error on a model name not in `known`; warn when step times would be
    taken under glibc malloc, which inflates checkpointed step times on CPU."""
    unknown = sorted(set(models) - set(known))
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {list(known)}")
    if host_allocator() == "glibc":
        print(f"{script}: glibc malloc inflates checkpointed step times on CPU; run under "
              "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", file=sys.stderr)
