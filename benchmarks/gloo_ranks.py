"""Run a benchmark's worker on gloo ranks on 127.0.0.1 and collect the row rank 0 writes."""

from __future__ import annotations

import json
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def run_ranks(worker: Callable[..., None], args: tuple[Any, ...], world: int, name: str,
              timeout_s: float = 600) -> dict:
    """`worker(rank, port, *args, out)` on `world` spawned processes; the JSON object rank 0
    wrote to `out`. The workers are killed after `timeout_s`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "row.json")
        ctx = mp.start_processes(worker, args=(port, *args, out), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise TimeoutError(f"{name}: workers did not finish in {timeout_s} s")
        return json.loads(Path(out).read_text())
