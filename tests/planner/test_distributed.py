"""Plans under data parallelism, on real processes: 2 gloo ranks on 127.0.0.1 (CPU), spawned with
`torch.multiprocessing`, each bounded in time.

`plan(DDP(model))` plans the module inside the wrapper in place, so DDP's gradient hooks are
untouched: the ranks stay in sync and train exactly like one process on the whole batch. Per-rank
plans (`plan(..., fsdp=True)` before `fully_shard`, `plan(DDP(model), ...)`) hold their budget on
every rank, as measured there, and train like one process.
"""

from __future__ import annotations

import contextlib
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
    while not ctx.join(timeout=0.5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"distributed workers did not finish in {TIMEOUT_S} s")


@contextlib.contextmanager
def _group(rank: int, port: int):
    """This worker's gloo process group on 127.0.0.1 (one thread), destroyed afterwards."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        yield
        dist.barrier()  # else gloo's teardown at times aborts a rank ("terminate called ...")
    finally:
        dist.destroy_process_group()


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
    with _group(rank, port):
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


# -- per-rank budgets ------------------------------------------------------------------------------

PEAK_TOLERANCE = 0.05
"""Predicted per-rank peak against the one measured on that rank, relative."""


def _llama_and_batches(lora: bool = False):
    from tests.models import hf_llama

    model, inputs = hf_llama(batch=2 * WORLD, seq=64, layers=3, hidden=64, heads=4, kv_heads=2,
                             intermediate=192, vocab=512)
    if lora:  # PEFT adapters on a frozen base: FSDP2 shards both, gradients only for adapters
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj", "down_proj"]))
    ids = [torch.randint(0, 512, inputs["input_ids"].shape,
                         generator=torch.Generator().manual_seed(k)) for k in range(STEPS)]
    return model, inputs, ids


def _micro(ids: torch.Tensor, rank: int) -> dict:
    half = ids.shape[0] // WORLD
    mb = ids[rank * half:(rank + 1) * half]
    return {"input_ids": mb, "labels": mb, "use_cache": False}


def _budget_between(model, inputs, sharding: str, accumulation: bool = False,
                    mp_policy=None) -> int:
    """A budget halfway between the smallest achievable per-rank peak and no checkpointing (of
    a micro-batch after the first under gradient accumulation, with `accumulation`; as FSDP2
    runs the step under `mp_policy`)."""
    import planner
    from solvers.accumulation import holding_grads
    from solvers.distributed import per_rank
    from solvers.simulate import simulate
    from solvers.solve import smallest_peak

    local = planner.profile(model, inputs, repeats=1, mp_policy=mp_policy)
    if sharding == "fsdp":  # FSDP2 holds each rank's sharded gradients
        q = per_rank(local, world_size=WORLD, sharding=sharding)
        q = holding_grads(q) if accumulation else q
    else:
        q = per_rank(holding_grads(local) if accumulation else local, world_size=WORLD,
                     sharding=sharding)
    return (simulate(q).peak_bytes + smallest_peak(q)) // 2


def _per_rank_worker(rank: int, port: int, out_dir: str, sharding: str) -> None:
    with _group(rank, port):
        import planner

        sharding, *options = sharding.split("+")
        lora, accumulation = "lora" in options, "accumulation" in options
        mp_policy = _MP_POLICY() if "bf16" in options else None
        model, inputs, ids = _llama_and_batches(lora)
        mb = _micro(inputs["input_ids"], rank)
        # One budget for every rank, as a user passes one: rank 0's (the smallest peak comes
        # from a time-limited solve, which two ranks sharing the CPU may end at different places)
        box = [_budget_between(model, mb, sharding, accumulation, mp_policy)]
        dist.broadcast_object_list(box, src=0)
        budget = box[0]
        if sharding == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            p = planner.plan(model, budget_bytes=budget, example_inputs=mb, fsdp=True, repeats=1,
                             mp_policy=mp_policy, grad_accumulation=accumulation)
            mesh = init_device_mesh("cpu", (WORLD,))
            sharded = {"mp_policy": mp_policy} if mp_policy is not None else {}

            def shard(m):
                for layer in (m.base_model.model if lora else m).model.layers:
                    fully_shard(layer, mesh=mesh, **sharded)  # the units the plan assumed
                fully_shard(m, mesh=mesh, **sharded)  # then the root

            shard(model)
            trained = model
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            trained = DDP(model)
            p = planner.plan(trained, budget_bytes=budget, example_inputs=mb, repeats=1,
                             grad_accumulation=accumulation)
        assert p.profile.meta.sharding == sharding and p.profile.meta.world_size == WORLD
        assert p.profile.meta.grads_held == accumulation
        assert p.schedule.regions, "the budget should need checkpointing"
        m = p.measure(repeats=1)  # with accumulation: every gradient held, DDP synchronizing

        def train(module):
            opt = torch.optim.SGD(module.parameters(), lr=0.1)
            for b in ids:
                opt.zero_grad(set_to_none=True)
                if accumulation:  # each rank's micro-batch in two halves
                    quarter = WORLD * (b.shape[0] // WORLD // 2)
                    # DDP skips the first half's all-reduce; FSDP2 reduce-scatters both (its
                    # default)
                    with module.no_sync() if sharding == "ddp" else contextlib.nullcontext():
                        (module(**_micro(b[:quarter], rank)).loss / 2).backward()
                    (module(**_micro(b[quarter:], rank)).loss / 2).backward()
                else:
                    module(**_micro(b, rank)).loss.backward()
                opt.step()

        train(trained)

        def full_state(m):
            return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
                    for k, v in m.state_dict().items()}

        state = full_state(model)
        twin = None
        if mp_policy is not None:  # the same FSDP2 mixed-precision training, unplanned
            unplanned, _, _ = _llama_and_batches(lora)
            shard(unplanned)
            train(unplanned)
            twin = full_state(unplanned)
        torch.save({"state": state, "twin": twin, "budget": budget, "measured": m.peak_bytes,
                    "predicted": p.predicted_peak_bytes_now(),
                    "regions": [r.module for r in p.schedule.regions]},
                   Path(out_dir) / f"rank{rank}.pt")


def _MP_POLICY():
    """torchtitan's FSDP2 mixed precision: compute in bfloat16, reduce in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.mark.parametrize("sharding", ["fsdp", "ddp", "fsdp+lora", "ddp+accumulation",
                                      "fsdp+bf16", "fsdp+accumulation",
                                      "fsdp+bf16+accumulation"])
def test_per_rank_plan_holds_its_budget_on_every_rank(sharding):
    with tempfile.TemporaryDirectory() as out:
        _spawn(_per_rank_worker, _free_port(), out, sharding)
        res = [torch.load(Path(out) / f"rank{r}.pt") for r in range(WORLD)]
    assert res[0]["regions"] == res[1]["regions"], "every rank applies the same plan"
    for r in res:
        assert r["measured"] <= r["budget"], (r["measured"], r["budget"], r["predicted"], r["regions"])
        err = abs(r["predicted"] - r["measured"]) / r["measured"]
        assert err <= PEAK_TOLERANCE, (sharding, r["predicted"], r["measured"])
    if "+bf16" in sharding:  # trains as the same FSDP2 mixed precision does unplanned
        for r in res:
            for k, ref in r["twin"].items():
                torch.testing.assert_close(r["state"][k], ref, rtol=1e-5, atol=1e-6, msg=k)
        return
    # one process on the whole batch, unplanned: the mean of the ranks' losses
    model, inputs, ids = _llama_and_batches("+lora" in sharding)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for b in ids:
        opt.zero_grad(set_to_none=True)
        if "+accumulation" in sharding:  # the halves the ranks accumulated
            quarter = WORLD * (b.shape[0] // WORLD // 2)
            loss = sum(model(**_micro(h, r)).loss for h in (b[:quarter], b[quarter:])
                       for r in range(WORLD)) / (2 * WORLD)
        else:
            loss = sum(model(**_micro(b, r)).loss for r in range(WORLD)) / WORLD
        loss.backward()
        opt.step()
    for k, ref in model.state_dict().items():
        for r in res:
            torch.testing.assert_close(r["state"][k], ref, rtol=1e-4, atol=1e-5, msg=k)


def _mp_mismatch_worker(rank: int, port: int, out_dir: str) -> None:
    with _group(rank, port):
        import warnings

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        import planner
        from planner.inplace import PlanOutdatedWarning

        mesh = init_device_mesh("cpu", (WORLD,))
        seen = {}
        # (planned for, sharded with, gradient sync): only a policy the plan was not made
        # for warns, and gradient sync turned off
        for case, planned, sharded, sync in [
                ("same", _MP_POLICY(), _MP_POLICY(), True),
                ("fp32 plan, bf16 run", None, _MP_POLICY(), True),
                ("bf16 plan, fp32 run", _MP_POLICY(), MixedPrecisionPolicy(), True),
                ("sync off", None, MixedPrecisionPolicy(), False)]:
            model, inputs, _ = _llama_and_batches()
            mb = _micro(inputs["input_ids"], rank)
            planner.plan(model, budget_gb=1, example_inputs=mb, fsdp=True, repeats=1,
                         method="per_block", mp_policy=planned)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=sharded)
            fully_shard(model, mesh=mesh, mp_policy=sharded)
            model.set_requires_gradient_sync(sync)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                for _ in range(2):
                    model(**mb).loss.backward()
            seen[case] = [str(x.message) for x in w
                          if isinstance(x.message, PlanOutdatedWarning)]
        torch.save(seen, Path(out_dir) / f"rank{rank}.pt")


def test_sharding_with_another_mixed_precision_than_planned_or_sync_off_warns():
    with tempfile.TemporaryDirectory() as out:
        _spawn(_mp_mismatch_worker, _free_port(), out)
        res = [torch.load(Path(out) / f"rank{r}.pt") for r in range(WORLD)]
    for seen in res:
        assert seen["same"] == []
        assert len(seen["fp32 plan, bf16 run"]) == 1, seen
        assert "recomputes more than it needs" in seen["fp32 plan, bf16 run"][0]
        assert len(seen["bf16 plan, fp32 run"]) == 1, seen
        assert "peak can pass the budget" in seen["bf16 plan, fp32 run"][0]
        assert len(seen["sync off"]) == 1, seen
        assert "set_requires_gradient_sync(False)" in seen["sync off"][0]


def test_a_mixed_precision_plan_verifies_before_sharding():
    """Before `fully_shard`, `verify` and `measure` run the step with FSDP2's casts: the step the
    local profile recorded, whose peak the plan predicts for this process."""
    import warnings

    import planner
    from planner.inplace import PlanOutdatedWarning
    from solvers.simulate import simulate
    from solvers.solve import smallest_peak

    model, inputs, _ = _llama_and_batches()
    mb = _micro(inputs["input_ids"], 0)
    local = planner.profile(model, mb, repeats=1, mp_policy=_MP_POLICY())
    budget = (simulate(local).peak_bytes + smallest_peak(local)) // 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanOutdatedWarning)
        p = planner.plan(model, budget_bytes=budget, example_inputs=mb, fsdp=True,
                         world_size=WORLD, repeats=1, mp_policy=_MP_POLICY())
        assert p.schedule.regions
        v = p.verify(repeats=1)
        model(**mb).loss.backward()  # a float32 step of the unsharded model: no false warning
    assert v.measured_peak_bytes == p.predicted_peak_bytes_now() == \
        simulate(p.local_profile, p.schedule.regions).peak_bytes
    assert v.max_grad_rel_err == 0.0
    assert all(q.dtype == torch.float32 for q in model.parameters())


def _padding_worker(rank: int, port: int, out_dir: str) -> None:
    with _group(rank, port):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        import planner
        from solvers.distributed import per_rank
        from solvers.simulate import simulate
        from solvers.solve import smallest_peak
        from tests import zoo

        mesh = init_device_mesh("cpu", (WORLD,))
        res = {}
        for name, make, policy, low in (
                ("float32", zoo.vit, None, False),  # one-row class token, position embeddings
                ("bf16 policy", zoo.vit, _MP_POLICY(), False),
                ("t5, bf16 policy, low budget", zoo.t5, _MP_POLICY(), True)):
            case = make()
            kw = dict(example_inputs=case.inputs, loss_fn=case.loss_fn, fsdp=True, repeats=1,
                      mp_policy=policy)
            if low:  # near the smallest peak, which lies at the root's reduce-scatter
                local = planner.profile(case.model, case.inputs, loss_fn=case.loss_fn,
                                        repeats=1, mp_policy=policy)
                q = per_rank(local, world_size=WORLD, sharding="fsdp", gloo=True)
                box = [smallest_peak(q) + (simulate(q).peak_bytes - smallest_peak(q)) // 10]
                dist.broadcast_object_list(box, src=0)
                p = planner.plan(case.model, budget_bytes=box[0], **kw)
            else:
                p = planner.plan(case.model, budget_gb=1, method="none", **kw)
            mods = dict(case.model.named_modules())
            sharded = policy if policy is not None else MixedPrecisionPolicy()
            for u in p.profile.meta.shard_units:
                fully_shard(mods[u], mesh=mesh, mp_policy=sharded)
            fully_shard(case.model, mesh=mesh, mp_policy=sharded)
            res[name] = {"predicted": p.predicted_peak_bytes_now(),
                         "measured": p.measure(repeats=1).peak_bytes,
                         "budget": p.budget_bytes}
        torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def test_fsdp_padding_and_gloo_temporaries_are_counted():
    """FSDP2 pads each parameter to a multiple of the ranks along its first dimension: a ViT's
    one-row class token and position embeddings are held whole on both ranks, with their
    gradients; and gloo's all-gather copies through a temporary of its output's size, where
    this ViT's float32 step peaks. Under the bf16 policy each all-gather also copies the shards
    into one bf16 input first, and gloo's reduce-scatter reduces a copy of its input, where
    T5's step peaks near its smallest peak. The per-rank prediction counts all of it (as
    measured, in float32 and under FSDP2's bf16 mixed precision)."""
    with tempfile.TemporaryDirectory() as out:
        _spawn(_padding_worker, _free_port(), out)
        res = [torch.load(Path(out) / f"rank{r}.pt") for r in range(WORLD)]
    for r in res:
        for name, m in r.items():
            if name.startswith("t5"):  # a planned step: within 64 B, inside its budget
                assert abs(m["measured"] - m["predicted"]) <= 64, (name, m)
                assert m["measured"] <= m["budget"], (name, m)
            else:
                assert m["predicted"] == m["measured"], (name, m)


def test_a_mixed_precision_plan_fitted_to_a_compiled_step():
    """With compile=, the compiled copies are measured as FSDP2 runs the step (in bf16): the
    compiled step under the casts peaks as the plan measured, below the float32 one."""
    import planner
    from planner.fsdp import fsdp_cast
    from planner.measurement import measure
    from solvers.simulate import simulate

    torch._dynamo.reset()
    model, inputs, _ = _llama_and_batches()
    mb = _micro(inputs["input_ids"], 0)
    local = planner.profile(model, mb, repeats=1, mp_policy=_MP_POLICY())
    p = planner.plan(model, budget_bytes=simulate(local).peak_bytes, example_inputs=mb,
                     fsdp=True, world_size=WORLD, repeats=1, mp_policy=_MP_POLICY(),
                     compile="aot_eager", compile_memory_budgets=(1.0,))
    try:
        assert p.compiled_peak_bytes is not None
        assert all(q.dtype == torch.float32 for q in model.parameters())
        with fsdp_cast(model, _MP_POLICY()):
            cast = measure(torch.compile(model, backend=p.compile_backend), mb, repeats=0)
        torch._dynamo.reset()
        full = measure(torch.compile(model, backend=p.compile_backend), mb, repeats=0)
        assert cast.peak_bytes == p.compiled_peak_bytes < full.peak_bytes
    finally:
        planner.remove(model)
        torch._dynamo.reset()


class _FedLayer(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, h, pe):
        return self.mlp(h + pe)


class _BufferFedLayers(torch.nn.Module):
    """Each layer takes a float32 buffer beside its input: FSDP2 casts it to bf16 at every
    sharded layer; left uncast, the layer's bf16 Linear refuses `h + pe` (float32)."""

    def __init__(self, dim: int = 32, n: int = 3):
        super().__init__()
        self.inp = torch.nn.Linear(dim, dim)
        self.layers = torch.nn.ModuleList(_FedLayer(dim) for _ in range(n))
        self.register_buffer("pe", torch.randn(16, dim))

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, self.pe)
        return h.float().pow(2).mean()


def test_mixed_precision_casts_the_inputs_of_the_default_units():
    """Without units named, the inputs of the default units (each repeated layer) are cast as
    FSDP2 casts them: the profile equals one made with the units named. (Sharding only the
    root, a layer gets the float32 buffer, and its bf16 Linear refuses it, under FSDP2 too.)"""
    import planner
    from solvers.simulate import simulate

    torch.manual_seed(0)
    model = _BufferFedLayers()
    x = torch.randn(8, 16, 32)
    units = [f"layers.{i}" for i in range(3)]
    default = planner.profile(model, x, repeats=1, mp_policy=_MP_POLICY())
    named = planner.profile(model, x, repeats=1, mp_policy=_MP_POLICY(), fsdp_units=units)
    assert default.saved_bytes == named.saved_bytes
    assert simulate(default).peak_bytes == simulate(named).peak_bytes
    with pytest.raises(planner.ModelRunError, match="Float and BFloat16"):  # uncast, as FSDP2
        planner.profile(model, x, repeats=1, mp_policy=_MP_POLICY(), fsdp_units=["inp"])



@pytest.mark.parametrize("fsdp", [True, False])
def test_a_per_rank_plan_report_checks_the_recording_it_was_made_from(fsdp):
    """The report's check of the recording (simulated against measured, unplanned) compares
    this process's step with its own measurement, not one rank's derived profile with it."""
    import planner
    from tests.models import gpt_eager

    torch.manual_seed(0)
    model, x = gpt_eager(batch=2, seq=16, dim=32, heads=2, layers=2, vocab=64)
    p = planner.plan(model, budget_gb=1, example_inputs=x, fsdp=fsdp, world_size=WORLD,
                     repeats=1)
    assert p.profile.meta.sharding == ("fsdp" if fsdp else "ddp")
    assert p.local_profile.meta.measured_peak_bytes is not None
    assert "WARNING" not in p.report()


def _compiled_worker(rank: int, port: int, out_dir: str) -> None:
    with _group(rank, port):
        from torch._dynamo.utils import counters
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import planner
        from planner.capture.record import default_loss
        from tests import zoo
        from tests.zoo import call

        mesh = init_device_mesh("cpu", (WORLD,))
        res = {}
        for compiled in (False, True):
            case = zoo.llama_padded()
            model = case.model
            p = planner.plan(model, budget_gb=1, example_inputs=case.inputs,
                             loss_fn=case.loss_fn, fsdp=True, repeats=1, method="per_block")
            units = p.profile.meta.shard_units
            assert {r.module for r in p.schedule.regions} == set(units)  # regions = the units
            mods = dict(model.named_modules())
            torch._dynamo.reset()
            counters.clear()
            if compiled:  # torchtitan's order: checkpointing, compile per block, then FSDP2
                for u in units:
                    mods[u].compile(backend="aot_eager", fullgraph=True)
            for u in units:
                fully_shard(mods[u], mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            graphs = []
            for step in range(2 * STEPS):
                torch.manual_seed(step)
                opt.zero_grad(set_to_none=True)
                (case.loss_fn or default_loss)(call(model, case.inputs)).backward()
                opt.step()
                graphs.append(counters["stats"]["unique_graphs"])
            res[compiled] = {
                "weights": {n: q.full_tensor().detach().clone()
                            for n, q in model.named_parameters()},
                "graphs": graphs, "breaks": sum(counters["graph_break"].values())}
        torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def test_a_plan_compiled_per_block_trains_under_fsdp2():
    """Regions on the FSDP2 units, each unit compiled with ``fullgraph=True`` before
    `fully_shard` (torchtitan's order): no graph break, each step reuses the first step's
    graphs, and 6 steps on 2 ranks train as the uncompiled plan does (aot_eager)."""
    with tempfile.TemporaryDirectory() as out:
        _spawn(_compiled_worker, _free_port(), out)
        res = [torch.load(Path(out) / f"rank{r}.pt") for r in range(WORLD)]
    for r in res:
        eager, compiled = r[False], r[True]
        assert compiled["breaks"] == 0
        assert compiled["graphs"][0] > 0 and len(set(compiled["graphs"])) == 1
        for name, w in eager["weights"].items():
            torch.testing.assert_close(compiled["weights"][name], w, rtol=1e-5, atol=1e-6,
                                       msg=name)
