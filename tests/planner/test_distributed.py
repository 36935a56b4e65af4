"""Plans under data parallelism, on real processes: 2 gloo ranks on 127.0.0.1 (CPU), spawned with
`torch.multiprocessing`, each bounded in time.

`plan(DDP(model))` plans the module inside the wrapper in place, so DDP's gradient hooks are
untouched: the ranks stay in sync and train exactly like one process on the whole batch.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow

WORLD = 2
STEPS = 3


TIMEOUT_S = 240


def _spawn(fn, *args) -> None:
    """Run fn(rank, *args) on WORLD processes; fail (and kill them) after TIMEOUT_S."""
    import time

    ctx = mp.start_processes(fn, args=args, nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"distributed workers did not finish in {TIMEOUT_S} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_and_batches():
    from tests.models import gpt_eager

    torch.manual_seed(0)
    model, x = gpt_eager(batch=4, seq=32, dim=64, heads=4, layers=3, vocab=128, dropout=0.0)
    batches = [torch.randint(0, 128, x.shape, generator=torch.Generator().manual_seed(k))
               for k in range(STEPS)]
    return model, x, batches


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        from torch.nn.parallel import DistributedDataParallel as DDP

        import planner
        from planner.capture.record import default_loss

        model, x, batches = _model_and_batches()
        ddp = DDP(model)
        half = x.shape[0] // WORLD
        p = planner.plan(ddp, budget_gb="1GiB", example_inputs=x[:half], method="per_block",
                         repeats=1)
        assert p.module is ddp and p.schedule.regions
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for b in batches:
            opt.zero_grad(set_to_none=True)
            default_loss(ddp(b[rank * half:(rank + 1) * half])).backward()
            opt.step()
        torch.save({k: v.detach() for k, v in model.state_dict().items()},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_plan_of_a_ddp_model_keeps_gradients_in_sync():
    with tempfile.TemporaryDirectory() as out:
        _spawn(_ddp_worker, _free_port(), out)
        states = [torch.load(Path(out) / f"rank{r}.pt") for r in range(WORLD)]
    # the single-process reference: the whole batch, no plan (mean loss = DDP's averaged grads)
    from planner.capture.record import default_loss

    model, _, batches = _model_and_batches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for b in batches:
        opt.zero_grad(set_to_none=True)
        half = b.shape[0] // WORLD
        loss = sum(default_loss(model(b[r * half:(r + 1) * half])) for r in range(WORLD)) / WORLD
        loss.backward()
        opt.step()
    ref = model.state_dict()
    for k in ref:
        torch.testing.assert_close(states[0][k], states[1][k], rtol=0, atol=0, msg=k)
        torch.testing.assert_close(states[0][k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
