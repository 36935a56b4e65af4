"""GPU benchmark (issue 13, item 4): ours against the anchors on two transformers, measured on CUDA.

Run through ``bash benchmarks/gpu/run.sh`` (it installs what is missing, then calls this), or
directly from the repository root:

    python benchmarks/gpu/bench.py [--dry-run] [--out DIR] [--no-compile] ...

For each model (random weights from a config, bf16 parameters by default):

1. an estimate-mode profile of the same model built on the meta device (``--est-device``, h200);
2. a measure-mode profile on the GPU (`planner.profile`, small `repeats`);
3. ``none``: the measured no-checkpoint peak N; F is the profile's fixed bytes (parameters,
   buffers, inputs); the budget at fraction f is ``F + f * (N - F)``;
4. the anchors, each solved with `solvers.solve.solve`, applied with `planner.inplace.applying`
   and measured: ``per_block``, ``sqrt_n`` (where its segments are module calls, else noted),
   ``selective_matmul``;
5. ours: `planner.plan_from_profile` at every fraction, at 20% below per_block's measured peak
   (``pb-20%``) and at the smallest achievable peak (``min``), measured with `planner.measure`
   and taken off again with `planner.remove` (`Plan.verify` at one fraction with ``--verify``).
   Order: per_block, ours at the fractions, the other anchors, pb-20%, min: what matters most
   first, in case the time guard stops the rest;
6. after every model's eager rows: ``torch.compile`` with ``activation_memory_budget`` at each of
   ``--compile-budgets`` (as `planner.compare` does it), the budgets interleaved across models, so
   that a time guard that stops early leaves each model some compile rows.

Beside every measured row: the peak and extra time the measure-mode profile predicts for that
schedule, and what the estimate-mode profile predicts for the same schedule (its regions carried
over by module path). Every strategy runs in its own try/except; an error is a row's status, not
the end of the run. A time guard (``--time-limit-s``) skips what would not finish in time and says
so, and a hard alarm at the limit stops whatever runs then. Results are written after every row
(``results.json``), the table at the end (``table.md``, also printed last).

``--dry-run``: the same code on the CPU at tiny sizes, fp32, ``aot_eager`` instead of inductor.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `python benchmarks/gpu/bench.py` from anywhere
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import planner  # noqa: E402
from planner.compiled import compile_backend  # noqa: E402
from planner.inplace import applying  # noqa: E402
from solvers.chain import candidate_calls  # noqa: E402
from solvers.graph import graph_index  # noqa: E402
from solvers.profile import Profile  # noqa: E402
from solvers.schedule import Schedule, policy_op  # noqa: E402
from solvers.solve import applicable, finish, solve  # noqa: E402

GiB = 2**30
ANCHORS = ("per_block", "sqrt_n", "selective_matmul")


# -- models -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "gpt2" or "llama"
    config: dict[str, Any]
    batch: int
    seq: int

    def describe(self) -> str:
        c = self.config
        if self.family == "gpt2":
            return (f"HF GPT2LMHeadModel: {c['n_layer']} layers, n_embd {c['n_embd']}, "
                    f"{c['n_head']} heads, vocab {c.get('vocab_size', 50257)}, "
                    f"batch {self.batch} x seq {self.seq}")
        return (f"HF LlamaForCausalLM: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
                f"MLP {c['intermediate_size']}, {c['num_attention_heads']}/"
                f"{c['num_key_value_heads']} heads (GQA), vocab {c['vocab_size']}, "
                f"batch {self.batch} x seq {self.seq}")


GPU_MODELS = {
    # GPT-2 medium (354.8 M parameters), its default dropout 0.1.
    "gpt2m": ModelSpec("gpt2m", "gpt2", dict(n_layer=24, n_embd=1024, n_head=16,
                                             n_positions=1024), batch=16, seq=1024),
    # Llama-3.2-1B's shape with a 32000 vocabulary, untied head (1.10 B parameters).
    "llama1b": ModelSpec("llama1b", "llama", dict(
        vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
        tie_word_embeddings=False), batch=8, seq=2048),
}
DRY_MODELS = {
    "gpt2m": ModelSpec("gpt2m", "gpt2", dict(n_layer=2, n_embd=64, n_head=4, n_positions=64,
                                             vocab_size=512), batch=4, seq=64),
    "llama1b": ModelSpec("llama1b", "llama", dict(
        vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False), batch=4, seq=64),
}


def build(spec: ModelSpec, device: str | torch.device, dtype: torch.dtype):
    """(model in training mode, example inputs): random weights from the config, SDPA attention,
    input_ids with labels, use_cache False."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if spec.family == "gpt2":
        config, cls = GPT2Config(**spec.config, use_cache=False), GPT2LMHeadModel
    else:
        config, cls = LlamaConfig(**spec.config, use_cache=False), LlamaForCausalLM
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = cls(config).to(dtype)
        if str(device) == "meta":
            ids = torch.zeros(spec.batch, spec.seq, dtype=torch.long)
        else:
            ids = torch.randint(0, config.vocab_size, (spec.batch, spec.seq))
    model.train()
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}


# -- the time guard ---------------------------------------------------------------------------
class TimeUp(BaseException):
    """The hard alarm at the time limit went off. Not an Exception, so that no `except Exception`
    in library code swallows it."""


class Guard:
    """Skips work that would not finish before the deadline; a SIGALRM at the deadline stops work
    in progress (raising TimeUp in the main thread)."""

    def __init__(self, limit_s: float):
        self.t0 = time.perf_counter()
        self.limit_s = limit_s
        self.expired = False
        self.events: list[str] = []
        if hasattr(signal, "SIGALRM"):
            signal.signal(signal.SIGALRM, self._alarm)
            signal.setitimer(signal.ITIMER_REAL, max(1.0, limit_s))

    def _alarm(self, *_):
        self.expired = True
        raise TimeUp(f"time limit {self.limit_s:.0f} s reached")

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.limit_s - self.elapsed()

    def allows(self, need_s: float, what: str) -> bool:
        if self.expired or self.left() < need_s:
            self.events.append(f"at {self.elapsed():.0f} s skipped {what} (needs ~{need_s:.0f} s, "
                               f"{max(0.0, self.left()):.0f} s left)")
            return False
        return True

    def disarm(self) -> None:
        if hasattr(signal, "SIGALRM"):
            signal.setitimer(signal.ITIMER_REAL, 0)


# -- rows -------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Row:
    model: str
    strategy: str
    kind: str  # none | anchor | compile | ours
    fraction: str = "-"  # "0.75" ..., "pb-20%", "min" for ours; "-" otherwise
    method: str | None = None
    regions: int | None = None
    budget_bytes: int | None = None
    measured_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    est_peak_bytes: int | None = None
    step_ms: float | None = None
    step_ms_all: list[float] = field(default_factory=list)
    extra_pct: float | None = None
    pred_extra_pct: float | None = None
    est_extra_pct: float | None = None
    fits: bool | None = None
    fits_fractions: list[str] = field(default_factory=list)
    status: str = "ok"
    seconds: float | None = None
    """Wall time of this row's work (planning, measuring; compiling for compile rows)."""
    note: str = ""


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dry = args.dry_run
        self.device = torch.device("cpu") if self.dry else torch.device("cuda")
        self.dtype = {"bf16": torch.bfloat16, "amp": torch.float32,
                      "fp32": torch.float32}[args.precision]
        self.amp = torch.bfloat16 if args.precision == "amp" else None
        self.unit, self.unit_bytes = ("MiB", 2**20) if self.dry else ("GiB", GiB)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.guard = Guard(args.time_limit_s)
        self.rows: list[Row] = []
        self.models: dict[str, dict[str, Any]] = {}
        self.live: dict[str, tuple[torch.nn.Module, Any]] = {}
        self.errors: list[str] = []
        self.meta = self._meta()

    # -- bookkeeping --------------------------------------------------------------------------
    def size(self, n: int) -> str:
        """Bytes in the table's unit: GiB, MiB in a dry run (tiny sizes)."""
        return f"{n / self.unit_bytes:.2f} {self.unit}"

    def say(self, msg: str) -> None:
        print(f"[bench {self.guard.elapsed():6.1f}s] {msg}", file=sys.stderr, flush=True)

    def _meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dry_run": self.dry,
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "python": platform.python_version(),
            "cpu": _cpu_name(),
            "precision": self.args.precision,
            "args": vars(self.args),
        }
        try:
            import transformers

            meta["transformers"] = transformers.__version__
        except Exception as ex:  # noqa: BLE001
            meta["transformers"] = f"unavailable: {ex}"
        for name in ("pulp", "highspy"):
            try:
                mod = __import__(name)
                meta[name] = getattr(mod, "__version__", "installed")
            except Exception:  # noqa: BLE001 - without PuLP the ILP is left out of `auto`
                meta[name] = None
        if self.device.type == "cuda":
            p = torch.cuda.get_device_properties(self.device)
            meta["device"] = torch.cuda.get_device_name(self.device)
            meta["device_memory_bytes"] = p.total_memory
            meta["device_capability"] = f"{p.major}.{p.minor}"
            meta["device_count"] = torch.cuda.device_count()
            meta["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                                       "clocks.max.sm", "--format=csv,noheader"])
        else:
            meta["device"] = f"cpu ({_cpu_name()}), dry run"
        meta["git_commit"] = _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
        return meta

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        self.save()
        return row

    def save(self) -> None:
        data = {
            "meta": {**self.meta, "seconds": round(self.guard.elapsed(), 1),
                     "time_guard": self.guard.events, "time_limit_s": self.args.time_limit_s},
            "models": self.models,
            "rows": [asdict(r) for r in self.rows],
            "errors": self.errors,
        }
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.out / "results.json")

    def _fail(self, row: Row, ex: BaseException) -> None:
        if isinstance(ex, TimeUp):
            row.status = f"stopped by the time guard ({ex})"
        else:
            msg = f"{type(ex).__name__}: {ex}".replace("\n", " ").replace("|", "/")
            row.status = "error: " + msg[:300]
            self.errors.append(f"{row.model} {row.strategy}: {traceback.format_exc()}")
        self.say(f"{row.model} {row.strategy}: {row.status}")
        if self.device.type == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()

    @contextlib.contextmanager
    def attempt(self, row: Row) -> Iterator[Row]:
        t0 = time.perf_counter()
        try:
            yield row
        except (Exception, TimeUp) as ex:  # noqa: BLE001 - an error is the row's status
            self._fail(row, ex)
        finally:
            row.seconds = round(time.perf_counter() - t0, 2)
            self.save()

    def measure(self, module: torch.nn.Module, inputs: Any) -> planner.Measurement:
        m = planner.measure(module, inputs, repeats=self.args.repeats, autocast=self.amp)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return m

    def _fill(self, row: Row, m: planner.Measurement, info: dict[str, Any]) -> None:
        row.measured_peak_bytes = m.peak_bytes
        row.step_ms = round(m.step_ms, 3)
        row.step_ms_all = list(m.step_ms_all)
        base = info.get("none_step_ms")
        if base:
            row.extra_pct = round(100 * (m.step_ms / base - 1), 2)
        if row.budget_bytes is not None and row.kind == "ours":
            row.fits = m.peak_bytes <= row.budget_bytes

    def _predict(self, row: Row, s: Schedule, info: dict[str, Any]) -> None:
        """Measure-mode and estimate-mode predictions of schedule `s` on this row."""
        prof: Profile = info["profile"]
        row.predicted_peak_bytes = s.predicted_peak_bytes
        row.pred_extra_pct = round(100 * s.predicted_recompute_ms / max(prof.step_ms, 1e-9), 2)
        row.regions = len(s.regions)
        est: Profile | None = info.get("estimate")
        if est is None or not applicable(s):
            return
        try:
            es = carry_over(s, prof, est)
            row.est_peak_bytes = es.predicted_peak_bytes
            row.est_extra_pct = round(100 * es.predicted_recompute_ms / max(est.step_ms, 1e-9), 2)
        except Exception as ex:  # noqa: BLE001 - a prediction we could not make
            row.note = (row.note + f" estimate-mode prediction n/a: {ex}")[:300].strip()

    # -- one model, eager rows ----------------------------------------------------------------
    def eager_rows(self, spec: ModelSpec, share_s: float) -> None:
        a = self.args
        name = spec.name
        t_model = time.perf_counter()
        deadline = self.guard.elapsed() + share_s
        info: dict[str, Any] = {"description": spec.describe(), "batch": spec.batch,
                                "seq": spec.seq, "config": spec.config}
        self.models[name] = info_public = {k: v for k, v in info.items()}
        self.say(f"{name}: {spec.describe()}")

        # estimate mode, on the meta device
        if a.est_device != "none":
            try:
                t0 = time.perf_counter()
                meta_model, meta_inputs = build(spec, "meta", self.dtype)
                est = planner.profile(meta_model, meta_inputs, mode="estimate",
                                      device=a.est_device, autocast=self.amp)
                info["estimate"] = est
                none_e = solve(est, 2**62, "none")
                info_public["estimate"] = {
                    "device": est.meta.device_name, "fixed_bytes": est.fixed_bytes,
                    "none_peak_bytes": none_e.predicted_peak_bytes,
                    "step_ms": round(est.step_ms, 3), "ops": len(est.nodes),
                    "seconds": round(time.perf_counter() - t0, 2)}
                del meta_model, meta_inputs
                self.save_profile(est, f"{name}.estimate.profile.json.gz")
            except Exception as ex:  # noqa: BLE001
                info_public["estimate"] = {"error": f"{type(ex).__name__}: {ex}"[:300]}
                self.errors.append(f"{name} estimate: {traceback.format_exc()}")
                self.say(f"{name}: estimate mode failed: {ex}")

        # the model and a measure-mode profile
        t0 = time.perf_counter()
        model, inputs = build(spec, self.device, self.dtype)
        self.live[name] = (model, inputs)
        info_public["parameters"] = sum(p.numel() for p in model.parameters())
        self.say(f"{name}: {info_public['parameters'] / 1e6:.1f} M parameters; profiling")
        prof = planner.profile(model, inputs, repeats=a.profile_repeats, autocast=self.amp)
        info["profile"] = prof
        info_public["profile"] = {
            "seconds": round(time.perf_counter() - t0, 2), "fixed_bytes": prof.fixed_bytes,
            "saved_bytes": prof.saved_bytes, "step_ms": round(prof.step_ms, 3),
            "ops": len(prof.nodes), "device": prof.meta.device_name,
            "checkpoint_region_ms": prof.meta.checkpoint_region_ms,
            "checkpoint_saved_tensor_ms": prof.meta.checkpoint_saved_tensor_ms,
            "checkpoint_selective_op_ms": prof.meta.checkpoint_selective_op_ms}
        self.save_profile(prof, f"{name}.profile.json.gz")
        self.say(f"{name}: profiled in {info_public['profile']['seconds']} s")

        # none: N and F, the budgets
        none = self.add(Row(model=name, strategy="none", kind="none", method="none", regions=0))
        with self.attempt(none):
            t0 = time.perf_counter()
            m = self.measure(model, inputs)
            info["none_step_ms"] = m.step_ms
            info["step_s"] = (time.perf_counter() - t0) / (self.args.repeats + 2)
            self._fill(none, m, info)
            self._predict(none, solve(prof, 2**62, "none"), info)
        if none.measured_peak_bytes is None:
            info_public["error"] = "no measured no-checkpoint peak: nothing else measured"
            return
        N, F = none.measured_peak_bytes, prof.fixed_bytes
        budgets = {f"{f:g}": int(F + f * (N - F)) for f in a.fractions}
        info_public.update(none_peak_bytes=N, fixed_bytes=F, activation_bytes=N - F,
                           budgets=budgets, none_step_ms=round(m.step_ms, 3))
        self.say(f"{name}: N = {self.size(N)}, F = {self.size(F)}, step {m.step_ms:.1f} ms")
        per_measure = max(1.0, 2.5 * info["step_s"] * (self.args.repeats + 2))

        def time_left(what: str, need: float) -> bool:
            if self.guard.elapsed() + need > deadline and not self.dry:
                self.guard.events.append(f"{name}: skipped {what} (past this model's share)")
                return False
            return self.guard.allows(need, f"{name} {what}")

        measured: dict[str, Row] = {}

        def anchor(method: str) -> None:
            row = self.add(Row(model=name, strategy=method, kind="anchor", method=method))
            if not time_left(method, per_measure):
                row.status = "skipped: time guard"
                return
            with self.attempt(row):
                s = solve(prof, 2**62, method)
                self._predict(row, s, info)
                if not applicable(s):
                    row.status = "not applicable in place (segments span several module calls)"
                    return
                with applying(model, s):
                    self._fill(row, self.measure(model, inputs), info)
                measured[method] = row

        def ours(label: str, budget: int | None) -> None:
            """Our plan at `budget` (None: the smallest achievable peak), measured."""
            row = self.add(Row(model=name, strategy=f"ours@{label}", kind="ours", fraction=label,
                               budget_bytes=budget))
            if not time_left(f"ours@{label}", per_measure + min(3.0, a.solve_time_limit_s)):
                row.status = "skipped: time guard"
                return
            with self.attempt(row):
                try:
                    p = planner.plan_from_profile(model, prof, budget_bytes=budget,
                                                  time_limit_s=a.solve_time_limit_s)
                except planner.InfeasibleBudgetError as ex:
                    row.status = "does not fit: " + str(ex).replace("\n", " ")[:1000]
                    row.fits = False
                    return
                try:
                    row.method = p.schedule.method
                    if budget is None:  # the smallest achievable peak: no budget to fit
                        info_public["smallest_peak_bytes"] = p.schedule.predicted_peak_bytes
                    self._predict(row, p.schedule, info)
                    p.example_inputs = inputs
                    self._fill(row, self.measure(model, inputs), info)
                    # --verify-at, or the smallest-peak plan (last) when that one did not fit
                    if a.verify and (label == a.verify_at or (label == "min" and not any(
                            r.note.startswith("verified") for r in self.rows if r.model == name))):
                        v = p.verify(rtol=a.verify_rtol, atol=a.verify_atol, repeats=1)
                        row.note = (f"verified: loss {v.loss_original:.5g} vs {v.loss_planned:.5g}"
                                    f", max grad rel err {v.max_grad_rel_err:.2g}")
                finally:
                    planner.remove(model)

        # the most telling first, in case the time guard stops the rest
        anchor("per_block")
        for label, budget in budgets.items():
            ours(label, budget)
        for method in ANCHORS:
            if method != "per_block":
                anchor(method)
        pb = measured.get("per_block")
        if pb is not None and pb.measured_peak_bytes:
            ours("pb-20%", int(0.8 * pb.measured_peak_bytes))
        ours("min", None)

        for r in self.rows:
            if r.model == name and r.kind in ("none", "anchor") and r.measured_peak_bytes:
                r.fits_fractions = [k for k, b in budgets.items() if r.measured_peak_bytes <= b]
        info_public["eager_seconds"] = round(time.perf_counter() - t_model, 1)
        self.save()

    def save_profile(self, prof: Profile, filename: str) -> None:
        if self.args.save_profiles:
            try:
                prof.save(self.out / filename)
            except Exception as ex:  # noqa: BLE001
                self.errors.append(f"saving {filename}: {type(ex).__name__}: {ex}")

    # -- torch.compile rows -------------------------------------------------------------------
    def compile_rows(self) -> None:
        a = self.args
        _caches_off()
        import torch._functorch.config as fc

        order = sorted(a.compile_budgets, key=lambda b: (b != 0.5, -b))  # 0.5 first, then high->low
        last_cost: dict[str, float] = {}
        for b in order:
            for name, (model, inputs) in self.live.items():
                info = self.models[name]
                if "none_peak_bytes" not in info:
                    continue
                row = self.add(Row(model=name, strategy=f"{a.compile_backend}({b:g})",
                                   kind="compile", method=a.compile_backend))
                if not hasattr(fc, "activation_memory_budget"):
                    row.status = "skipped: this torch has no activation_memory_budget"
                    continue
                need = 1.2 * last_cost.get(name, a.first_compile_s)
                if not self.guard.allows(need, f"{name} compile({b:g})"):
                    why = (f"the last compile of {name} took {last_cost[name]:.0f} s"
                           if name in last_cost else f"--first-compile-s {a.first_compile_s:g}")
                    row.status = f"skipped: time guard ({why}; {max(0, self.guard.left()):.0f} s left)"
                    continue
                t0 = time.perf_counter()
                with self.attempt(row):
                    torch._dynamo.reset()  # no reuse of another budget's graphs
                    backend = compile_backend(a.compile_backend, b)
                    if a.compile_scope == "model":
                        cm = torch.compile(model, backend=backend)
                    else:
                        cm = model
                        for blk in _blocks(model):
                            blk.compile(backend=backend)
                    try:
                        m = self.measure(cm, inputs)
                    finally:
                        for blk in _blocks(model):
                            blk._compiled_call_impl = None  # what nn.Module.compile set
                    self._fill(row, m, {"none_step_ms": info.get("none_step_ms")})
                    budgets = info.get("budgets", {})
                    row.fits_fractions = [k for k, v in budgets.items() if m.peak_bytes <= v]
                last_cost[name] = time.perf_counter() - t0
                if row.measured_peak_bytes is not None:
                    row.note = f"compile + {a.repeats + 2} steps in {last_cost[name]:.0f} s"
                self.save()
        torch._dynamo.reset()

    # -- run ----------------------------------------------------------------------------------
    def _work(self) -> None:
        a = self.args
        specs = [(DRY_MODELS if self.dry else GPU_MODELS)[n] for n in a.models]
        specs = [dataclasses.replace(s, batch=a.batch.get(s.name, s.batch)) for s in specs]
        compile_on = bool(a.compile_budgets) and not a.no_compile
        eager_total = a.time_limit_s * (1.0 if not compile_on else a.eager_share)
        for i, spec in enumerate(specs):
            share = (eager_total - self.guard.elapsed()) / (len(specs) - i)
            if not self.guard.allows(5 if self.dry else 45, f"{spec.name} (all of it)"):
                self.models[spec.name] = {"skipped": "time guard"}
                continue
            try:
                self.eager_rows(spec, share)
            except (Exception, TimeUp) as ex:  # noqa: BLE001 - the next model still runs
                self.models.setdefault(spec.name, {})["error"] = \
                    f"{type(ex).__name__}: {ex}"[:300]
                self.errors.append(f"{spec.name}: {traceback.format_exc()}")
                self.say(f"{spec.name}: failed: {type(ex).__name__}: {ex}")
                self.live.pop(spec.name, None)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        if compile_on:
            try:
                self.compile_rows()
            except (Exception, TimeUp) as ex:  # noqa: BLE001
                self.errors.append(f"compile: {traceback.format_exc()}")
                self.say(f"compile rows stopped: {type(ex).__name__}: {ex}")

    def run(self) -> int:
        try:
            self._work()
        except TimeUp as ex:  # the alarm between two guarded pieces of work
            self.say(f"stopped: {ex}")
            self.guard.events.append(f"stopped at {self.guard.elapsed():.0f} s: {ex}")
        finally:
            self.guard.disarm()
        self.meta["seconds"] = round(self.guard.elapsed(), 1)
        table = self.table()
        (self.out / "table.md").write_text(table + "\n")
        self.save()
        print(table, flush=True)
        return self.exit_code()

    def exit_code(self) -> int:
        """1 when a model has no measured no-checkpoint peak (nothing else could be measured);
        in a dry run also when any path of the benchmark did not run through (`dry_problems`)."""
        missing = [n for n in self.args.models if "none_peak_bytes" not in self.models.get(n, {})]
        if self.dry:
            problems = self.dry_problems()
            for p in problems:
                print(f"dry run: FAILED: {p}", file=sys.stderr)
            if not problems:
                print("dry run: every path ran", file=sys.stderr)
            return 1 if problems else 0
        return 1 if missing else 0

    def dry_problems(self) -> list[str]:
        """What a dry run must have done: every strategy's path ran, without error or skip."""
        a = self.args
        out = [f"{r.model} {r.strategy}: {r.status}" for r in self.rows
               if r.status.startswith(("error", "stopped", "skipped"))]
        out += [e.strip().splitlines()[-1] for e in self.errors]
        out += [f"time guard: {e}" for e in self.guard.events]
        for name in a.models:
            info = self.models.get(name, {})
            rows = [r for r in self.rows if r.model == name]

            def measured(kind: str, rows=rows) -> list[Row]:
                return [r for r in rows if r.kind == kind and r.measured_peak_bytes is not None]

            if "none_peak_bytes" not in info:
                out.append(f"{name}: no measured no-checkpoint peak")
                continue
            if a.est_device != "none" and "none_peak_bytes" not in info.get("estimate", {}):
                out.append(f"{name}: no estimate-mode profile")
            if not measured("anchor"):
                out.append(f"{name}: no anchor measured")
            ours = measured("ours")
            if not any(r.fraction == "min" for r in ours):
                out.append(f"{name}: the smallest-peak plan was not measured")
            if not any(r.fraction.replace(".", "").isdigit() for r in ours):
                out.append(f"{name}: no plan of ours measured at a budget fraction")
            if a.est_device != "none" and not any(r.est_peak_bytes for r in ours):
                out.append(f"{name}: no estimate-mode prediction for a plan of ours")
            if a.verify and not any(r.note.startswith("verified") for r in ours):
                out.append(f"{name}: Plan.verify did not run (--verify-at {a.verify_at})")
            if a.compile_budgets and not a.no_compile and not measured("compile"):
                out.append(f"{name}: no torch.compile row measured")
        return out

    def table(self) -> str:
        lines = []
        for name, info in self.models.items():
            if "none_peak_bytes" in info:
                est = info.get("estimate", {})
                est_txt = (f"; estimate mode ({est.get('device')}): no-checkpoint peak "
                           f"{self.size(est['none_peak_bytes'])}, step {est['step_ms']:.1f} ms"
                           if "none_peak_bytes" in est else "")
                sp = info.get("smallest_peak_bytes")
                lines.append(
                    f"- **{name}**: {info['description']}; N = {self.size(info['none_peak_bytes'])}"
                    f", F = {self.size(info['fixed_bytes'])}, no-checkpoint step "
                    f"{info['none_step_ms']:.1f} ms; budgets "
                    + ", ".join(f"{k}x {self.size(v)}" for k, v in info["budgets"].items())
                    + (f"; smallest achievable peak {self.size(sp)}" if sp else "") + est_txt)
            else:
                lines.append(f"- **{name}**: {info.get('error') or info.get('skipped') or '?'}")
        m = self.meta
        lines.insert(0, f"{m['device']}; torch {m['torch']}; {m['date']}; precision "
                        f"{m['precision']}; {m['seconds']} s")
        u = self.unit
        cols = ["model", "budget fraction", "strategy", f"budget {u}", f"measured peak {u}",
                f"predicted peak {u}", f"estimate-mode peak {u}", "step ms", "extra %",
                "pred extra %", "est extra %", "fits", "status"]
        lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        order = {"none": 0, "anchor": 1, "compile": 2, "ours": 3}
        frac_order = {"min": 9.0, "pb-20%": 8.0}

        def key(r: Row):
            return (list(self.models).index(r.model) if r.model in self.models else 99,
                    order[r.kind], -float(r.fraction) if r.fraction.replace(".", "").isdigit()
                    else frac_order.get(r.fraction, 0.0))

        def g(x):
            return "" if x is None else f"{x / self.unit_bytes:.2f}"

        def pct(x):
            return "" if x is None else f"{x:+.1f}"

        for r in sorted(self.rows, key=key):
            if r.kind == "ours":
                fits = "" if r.fits is None else ("yes" if r.fits else "**no**")
            elif r.measured_peak_bytes is not None and r.kind != "none":
                fits = ", ".join(r.fits_fractions) or "none"
            else:
                fits = ""
            strategy = r.strategy + (f" ({r.method})" if r.kind == "ours" and r.method else "")
            status = r.status + (f"; {r.note}" if r.note else "")
            if len(status) > 240:  # the whole text is in results.json
                status = status[:240].rsplit(" ", 1)[0] + " ..."
            cells = [r.model, r.fraction, strategy, g(r.budget_bytes), g(r.measured_peak_bytes),
                     g(r.predicted_peak_bytes), g(r.est_peak_bytes),
                     "" if r.step_ms is None else f"{r.step_ms:.1f}", pct(r.extra_pct),
                     pct(r.pred_extra_pct), pct(r.est_extra_pct), fits,
                     status.replace("|", "/")]
            lines.append("| " + " | ".join(cells) + " |")
        if self.guard.events:
            lines += ["", "Time guard: " + "; ".join(self.guard.events)]
        return "\n".join(lines)


# -- helpers ----------------------------------------------------------------------------------
def carry_over(s: Schedule, src: Profile, dst: Profile) -> Schedule:
    """Schedule `s` (regions bound to module calls of `src`) re-expressed on profile `dst` of the
    same model (another capture, e.g. estimate mode), simulated there. Regions are matched by
    module path and Sequential segment, saved ops by `<op>#k` within the call."""
    del src  # regions carry their module path and save_ops
    fwd = graph_index(dst).forward_names
    spans = {(c.call.module, c.segment): c for c in candidate_calls(dst)}
    regions = []
    for r in s.regions:
        if r.module is None:
            raise ValueError("a region that is no module call cannot be carried over")
        span = spans.get((r.module, r.segment))
        if span is None:
            raise ValueError(f"module {r.module!r} is no candidate region in the other profile")
        names: dict[str, str] = {}
        counts: dict[str, int] = {}
        for i in range(span.a, span.b + 1):
            nd = dst.nodes[graph_index(dst).name_to_i[fwd[i]]]
            if nd.op == "getitem":
                continue
            op = policy_op(nd.op)
            k = counts.get(op, 0)
            counts[op] = k + 1
            names[f"{op}#{k}"] = nd.name
        missing = [k for k in r.save_ops if k not in names]
        if missing:
            raise ValueError(f"{r.module}: saved ops {missing[:3]} not in the other profile")
        regions.append(dataclasses.replace(r, start=fwd[span.a], end=fwd[span.b],
                                           saved=tuple(names[k] for k in r.save_ops)))
    return finish(dst, Schedule(regions=tuple(regions), method=s.method), 2**62)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: GPT-2's transformer.h, Llama's model.layers."""
    inner = getattr(model, "transformer", None) or getattr(model, "model", None)
    return list(getattr(inner, "h", None) or getattr(inner, "layers", None) or [])


def _caches_off() -> None:
    """As `planner.compare` does: no FX-graph or AOTAutograd cache hit from another budget."""
    with contextlib.suppress(Exception):
        import torch._inductor.config as ic

        if hasattr(ic, "fx_graph_cache"):
            ic.fx_graph_cache = False
    import torch._functorch.config as fc

    if hasattr(fc, "enable_autograd_cache"):
        fc.enable_autograd_cache = False


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except Exception:  # noqa: BLE001
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _batches(text: str) -> dict[str, int]:
    out = {}
    for part in filter(None, text.split(",")):
        k, _, v = part.partition("=")
        out[k.strip()] = int(v)
    return out


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny sizes, fp32, aot_eager: every path that needs no CUDA")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu" / "out"),
                   help="where results.json, table.md, the profiles go (default: %(default)s)")
    p.add_argument("--models", default="gpt2m,llama1b", type=lambda s: s.split(","),
                   help="comma-separated, of gpt2m, llama1b (default: both)")
    p.add_argument("--batch", default="", type=_batches, help="e.g. gpt2m=16,llama1b=8")
    p.add_argument("--precision", choices=("bf16", "amp", "fp32"), default=None,
                   help="bf16: parameters in bf16, no autocast; amp: fp32 parameters, forward "
                        "and loss under bf16 autocast (default: bf16; fp32 in a dry run)")
    p.add_argument("--fractions", default="0.75,0.5,0.3", type=_floats,
                   help="activation-budget fractions f: budget F + f (N - F) (0.75,0.5,0.3)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed steps per measurement, after a warm-up and a peak step (3)")
    p.add_argument("--profile-repeats", type=int, default=2, help="planner.profile repeats (2)")
    p.add_argument("--solve-time-limit-s", type=float, default=10.0,
                   help="time limit of each solve of ours (10)")
    p.add_argument("--compile-budgets", default=None, type=_floats,
                   help="activation_memory_budget values (default 0.8,0.5,0.2; 0.5 in a dry run)")
    p.add_argument("--compile-backend", default=None,
                   help="default inductor (aot_eager in a dry run)")
    p.add_argument("--compile-scope", choices=("model", "blocks"), default="model",
                   help="model: torch.compile(model), as planner.compare; blocks: each "
                        "transformer block compiled (compiles once, far faster)")
    p.add_argument("--no-compile", action="store_true", help="no torch.compile rows")
    p.add_argument("--first-compile-s", type=float, default=None,
                   help="time to allow for the first compile of a model (default 90; 5 dry)")
    p.add_argument("--est-device", default="h200",
                   help="estimate-mode device spec (planner.devices), or 'none'")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                   help="Plan.verify (loss, gradients) at --verify-at, else at min (default: on in "
                        "a dry run)")
    p.add_argument("--verify-at", default="0.5", help="the fraction label to verify at (0.5)")
    p.add_argument("--verify-rtol", type=float, default=None,
                   help="default 1e-4 in fp32, 5e-2 in bf16 or amp")
    p.add_argument("--verify-atol", type=float, default=None,
                   help="default 1e-5 in fp32, 5e-2 in bf16 or amp")
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="stop and write results by then (default 420; 110 in a dry run)")
    p.add_argument("--eager-share", type=float, default=0.6,
                   help="part of the time limit the eager rows of all models may take (0.6)")
    p.add_argument("--save-profiles", action=argparse.BooleanOptionalAction, default=True,
                   help="write <model>[.estimate].profile.json.gz to --out (on)")
    a = p.parse_args(argv)
    dry = a.dry_run
    a.precision = a.precision or ("fp32" if dry else "bf16")
    a.compile_backend = a.compile_backend or ("aot_eager" if dry else "inductor")
    if a.compile_budgets is None:
        a.compile_budgets = [0.5] if dry else [0.8, 0.5, 0.2]
    a.first_compile_s = a.first_compile_s if a.first_compile_s is not None else (5 if dry else 90)
    a.verify = dry if a.verify is None else a.verify
    low = a.precision != "fp32"
    a.verify_rtol = a.verify_rtol if a.verify_rtol is not None else (5e-2 if low else 1e-4)
    a.verify_atol = a.verify_atol if a.verify_atol is not None else (5e-2 if low else 1e-5)
    a.time_limit_s = a.time_limit_s if a.time_limit_s is not None else (110 if dry else 420)
    known = DRY_MODELS if dry else GPU_MODELS
    for n in a.models:
        if n not in known:
            p.error(f"unknown model {n!r}; known: {', '.join(known)}")
    return a


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    a = parse_args(argv)
    if not a.dry_run and not torch.cuda.is_available():
        print("bench: torch.cuda.is_available() is False; run with --dry-run on a CPU",
              file=sys.stderr)
        return 2
    if a.dry_run:
        torch.set_num_threads(1)  # tiny ops; no OpenMP spinning against other processes
    bench = Bench(a)
    bench.say(f"device {bench.meta['device']}; torch {torch.__version__}; out {bench.out}")
    code = bench.run()
    bench.say(f"done in {bench.guard.elapsed():.0f} s; exit {code}; results in {bench.out}")
    return code


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # no wait on compile workers or atexit handlers after a time-guard stop
