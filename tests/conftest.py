"""Shared test setup.

Lanes: ``pytest tests/solvers -m "not slow"`` is torch-free and quick (its slow tests replay
the committed 7B and U-Net profiles); ``pytest -m "not slow"`` is the quick lane (everything
but whole-model sweeps, notebooks, distributed runs and compiled loops); ``pytest -n 2`` runs
everything in two worker processes, as CI does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests.models`, `tests.zoo`, `tests.solver_cases` importable
    sys.path.insert(0, str(ROOT))

# Tests never reach the network for Hugging Face models or tokenizers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers of `pytest -n N` share the machine's cores: one thread each (OpenMP threads that
    # spin-wait for a core another worker holds make every op slower), and inductor compiles
    # in the worker itself, not in a pool of its own.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(scope="session")
def solver_cases():
    """The hand-built profiles of `tests.solver_cases`, built once per session.

    Tests share these objects, and with them what the solvers keep per profile (the simulator's
    index, dp's verified plans): an assertion must hold whatever ran on the profile before.
    A test that changes a profile makes its own copy (`dataclasses.replace`).
    """
    from tests.solver_cases import CASES

    return {name: build() for name, build in CASES.items()}
