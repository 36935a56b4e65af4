"""Memory budgets as people write them: numbers of GiB, or strings with a unit.

``GB`` is 10**9 bytes and ``GiB`` 2**30 (likewise MB/MiB, KB/KiB, TB/TiB); a bare number is GiB,
as `torch.cuda.max_memory_allocated` users count. Anything that is not a finite positive amount
is refused with a message that shows an accepted form.
"""

from __future__ import annotations

import math
import re
from numbers import Real

from solvers.errors import CkptPlannerError

__all__ = ["BudgetError", "GiB", "format_bytes", "parse_budget"]

GiB = 2**30

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_FORM = "a number of GiB (8, 7.5) or a string with a unit ('8GiB', '500MiB', '16GB')"
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


class BudgetError(CkptPlannerError, ValueError):
    """A memory budget that is not a finite positive amount of memory."""


def parse_budget(value: object, *, name: str = "budget_gb", unit: int = GiB) -> int:
    """Bytes of a budget given as a number of `unit` (GiB by default) or a string with a unit.

    >>> parse_budget(1.5)
    1610612736
    >>> parse_budget("8GB"), parse_budget("500MiB")
    (8000000000, 524288000)
    """
    if isinstance(value, bool):
        raise BudgetError(f"{name}={value!r} is a bool, not an amount of memory; give {_FORM}")
    if isinstance(value, str):
        if len(value) > 64:
            raise BudgetError(f"{name} is a {len(value)}-character string; give {_FORM}")
        m = _PATTERN.match(value)
        if m is None or m.group(2).lower() not in ("", *_UNITS):
            raise BudgetError(f"{name}={value!r} is not an amount of memory; give {_FORM}")
        number, suffix = float(m.group(1)), m.group(2).lower()
        nbytes = number * (_UNITS[suffix] if suffix else unit)
    elif isinstance(value, Real):
        number = float(value)
        if not math.isfinite(number):
            raise BudgetError(f"{name}={value!r} is not finite; give {_FORM}")
        nbytes = number * unit
    else:
        raise BudgetError(f"{name} is a {type(value).__name__}; give {_FORM}")
    if not math.isfinite(nbytes) or nbytes < 1:
        raise BudgetError(f"{name}={value!r} is not a positive amount of memory; give {_FORM}")
    if nbytes > 2**62:
        raise BudgetError(f"{name}={value!r} is larger than any device; give {_FORM}")
    return int(nbytes)


def format_bytes(n: float) -> str:
    """Bytes for people: MiB below 0.1 GiB, GiB above (2**20 and 2**30 bytes)."""
    return f"{n / GiB:.3f} GiB" if abs(n) >= 0.1 * GiB else f"{n / 2**20:.2f} MiB"
