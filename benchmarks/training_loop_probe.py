"""Training loops people write, around a planned model: test-zoo models planned at their
smallest peak, then trained three steps by a loop idiom beside an unplanned copy under the same
seeds; the table gives the largest relative difference of their parameters and buffers after.

    HF_HUB_OFFLINE=1 python benchmarks/training_loop_probe.py            # a Markdown table
    HF_HUB_OFFLINE=1 python benchmarks/training_loop_probe.py gpt2_sdpa,vit fp16_scaler
    HF_HUB_OFFLINE=1 python benchmarks/training_loop_probe.py --ddp     # DDP's options, 2 ranks

Idioms (each a function below): fp16 autocast with a `GradScaler` (planned with
``autocast=torch.float16``); an eval pass under `torch.inference_mode` and a no-grad pass in
train mode between steps; unfreezing a frozen backbone after the plan was made; gradients with
respect to the input (adversarial training, saliency); a forward hook whose output feeds the loss
(perceptual or feature losses); an EMA teacher deep-copied from the planned student and run
without gradients; the same batch twice with different dropout (R-Drop); pure bf16 weights;
`torch.func.functional_call` with tensors other than the module's own (MAML, stateless training).
With ``--ddp``: DistributedDataParallel with ``find_unused_parameters``, ``static_graph`` and
``gradient_as_bucket_view``, 2 gloo ranks, `plan(DDP(model), None, ...)`.
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import planner  # noqa: E402
from planner.capture.record import default_loss  # noqa: E402
from tests.zoo import CASES, Case, call  # noqa: E402

MODELS = ("gpt2_sdpa", "llama", "mixtral", "t5", "bert", "vit", "resnet_hf", "convnext",
          "peft_lora_llama", "whisper")
STEPS = 3


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _steps(model: torch.nn.Module, case: Case, step: Callable[[int, torch.optim.Optimizer], None],
           params: Callable[[], list[torch.nn.Parameter]] | None = None) -> None:
    opt = torch.optim.SGD(params() if params else
                          [p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for s in range(STEPS):
        torch.manual_seed(100 + s)
        opt.zero_grad(set_to_none=True)
        step(s, opt)


def plain(model, case, loss):
    _steps(model, case, lambda s, opt: plain_step(model, case, loss, opt))


def fp16_scaler(model, case, loss):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)

    def step(s, opt):
        with torch.autocast("cpu", dtype=torch.float16):
            out = loss(call(model, case.inputs))
        scaler.scale(out).backward()
        scaler.step(opt)
        scaler.update()
    _steps(model, case, step)


def eval_between(model, case, loss):
    def step(s, opt):
        model.eval()
        with torch.inference_mode():
            call(model, case.small_inputs)
        model.train()
        with torch.no_grad():
            call(model, case.small_inputs)
        torch.manual_seed(100 + s)
        plain_step(model, case, loss, opt)
    _steps(model, case, step)


def plain_step(model, case, loss, opt):
    loss(call(model, case.inputs)).backward()
    opt.step()


def unfreeze(model, case, loss):
    """Planned with the first two thirds of the parameters frozen; all train from step 1."""
    def step(s, opt):
        if s == 1:
            for p in model.parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": [p for p in model.parameters()
                                            if all(p is not q for g in opt.param_groups
                                                   for q in g["params"])]})
        plain_step(model, case, loss, opt)
    _steps(model, case, step)


def input_grad(model, case, loss):
    def step(s, opt):
        x = dict(case.inputs)
        if "pixel_values" in x:
            x["pixel_values"] = x["pixel_values"].clone().requires_grad_()
            leaf = x["pixel_values"]
        else:
            leaf = model.get_input_embeddings()(x.pop("input_ids")).detach().requires_grad_()
            x["inputs_embeds"] = leaf
        loss(call(model, x)).backward()
        opt.step()
        model._probe_input_grads.append(leaf.grad.clone())
    model._probe_input_grads = []
    _steps(model, case, step)


def forward_hook(model, case, loss):
    deep = [m for n, m in model.named_modules() if n.count(".") >= 2]
    feats: list[torch.Tensor] = []
    handle = deep[len(deep) // 2].register_forward_hook(
        lambda m, a, o: feats.append(o[0] if isinstance(o, tuple) else o))

    def step(s, opt):
        feats.clear()
        out = loss(call(model, case.inputs))
        (out + feats[0].float().pow(2).mean()).backward()
        opt.step()
    try:
        _steps(model, case, step)
    finally:
        handle.remove()


def ema_teacher(model, case, loss):
    teacher = copy.deepcopy(model).requires_grad_(False)

    def step(s, opt):
        with torch.no_grad():
            target = _logits(call(teacher, case.inputs))
        torch.manual_seed(200 + s)
        out = call(model, case.inputs)
        (loss(out) + F.mse_loss(_logits(out), target)).backward()
        opt.step()
        with torch.no_grad():
            for t, p in zip(teacher.parameters(), model.parameters()):
                t.lerp_(p, 0.1)
    _steps(model, case, step)


def r_drop(model, case, loss):
    def step(s, opt):
        a, b = call(model, case.inputs), call(model, case.inputs)
        kl = F.kl_div(_logits(a).log_softmax(-1), _logits(b).log_softmax(-1), log_target=True,
                      reduction="batchmean")
        (loss(a) + loss(b) + kl).backward()
        opt.step()
    _steps(model, case, step)


def functional_call(model, case, loss):
    """Each step runs on tensors 1.1 x the module's parameters (and copies of its buffers) and
    steps the module's parameters by the gradients of those."""
    args, kwargs = ((), case.inputs) if isinstance(case.inputs, dict) else (
        case.inputs if isinstance(case.inputs, tuple) else (case.inputs,), {})

    def step(s, opt):
        given = {k: (v.detach() * 1.1).requires_grad_() for k, v in model.named_parameters()}
        given.update({k: v.clone() for k, v in model.named_buffers()})
        loss(torch.func.functional_call(model, given, args, kwargs)).backward()
        for k, p in model.named_parameters():
            p.grad = given[k].grad
        opt.step()
    _steps(model, case, step)


IDIOMS: dict[str, Callable] = {
    "plain": plain, "fp16_scaler": fp16_scaler, "eval_between": eval_between,
    "unfreeze": unfreeze, "input_grad": input_grad, "forward_hook": forward_hook,
    "ema_teacher": ema_teacher, "r_drop": r_drop, "pure_bf16": plain,
    "functional_call": functional_call,
}


def _applies(idiom: str, case: Case) -> str | None:
    """Why `idiom` does not apply to `case`, or None."""
    if idiom in ("r_drop", "ema_teacher") and case.family not in ("decoder", "encoder",
                                                                    "encoder-decoder", "vision"):
        return "no logits"
    if idiom == "input_grad" and not (isinstance(case.inputs, dict) and (
            "pixel_values" in case.inputs or "input_ids" in case.inputs)):
        return "no input_ids or pixel_values"
    if idiom == "pure_bf16" and isinstance(case.inputs, dict) and any(
            v.is_floating_point() for v in case.inputs.values() if isinstance(v, torch.Tensor)):
        return "float inputs"
    return None


def run(name: str, idiom: str) -> str:
    t0 = time.perf_counter()
    case = CASES[name]()
    why = _applies(idiom, case)
    if why:
        return f"| {name} | {idiom} | - | - | n/a: {why} |"
    model = case.model
    if idiom == "pure_bf16":
        model.to(torch.bfloat16)
    if idiom == "unfreeze":
        ps = list(model.parameters())
        for p in ps[: len(ps) * 2 // 3]:
            p.requires_grad_(False)
    twin = copy.deepcopy(model)
    loss = case.loss_fn or default_loss
    p = planner.plan(model, None, example_inputs=case.inputs, loss_fn=case.loss_fn, repeats=1,
                     autocast=torch.float16 if idiom == "fp16_scaler" else None)
    IDIOMS[idiom](model, case, loss)
    IDIOMS[idiom](twin, case, loss)
    pairs = list(zip(model.parameters(), twin.parameters()))
    pairs += [(a, b) for a, b in zip(model.buffers(), twin.buffers()) if a.is_floating_point()]
    pairs += list(zip(getattr(model, "_probe_input_grads", []),
                      getattr(twin, "_probe_input_grads", [])))
    err = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
              for a, b in pairs)
    return (f"| {name} | {idiom} | {len(p.schedule.regions)} | {err:.1e} | "
            f"{'equal' if err == 0 else 'DIFFERENT'} ({time.perf_counter() - t0:.0f} s) |")


DDP_MODELS = ("gpt2_sdpa", "mixtral", "moe_top2", "resnet_hf", "value_branch", "peft_lora_llama")
DDP_OPTIONS = {"find_unused_parameters": dict(find_unused_parameters=True),
               "static_graph": dict(static_graph=True),
               "gradient_as_bucket_view": dict(gradient_as_bucket_view=True)}


def _ddp_train(m: torch.nn.Module, case: Case, rank: int) -> None:
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    for s in range(STEPS):
        torch.manual_seed(10 * s + rank)  # each rank its own dropout
        opt.zero_grad()
        (case.loss_fn or default_loss)(call(m, case.inputs)).backward()
        opt.step()


def _ddp_worker(rank: int, port: int, out: str) -> None:
    import json
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    warnings.filterwarnings("ignore")
    rows = []
    try:
        for name in DDP_MODELS:
            for option, kw in DDP_OPTIONS.items():
                case = CASES[name]()
                twin = copy.deepcopy(case.model)
                planned, unplanned = DDP(case.model, **kw), DDP(twin, **kw)

                try:
                    _ddp_train(unplanned, case, rank)
                except RuntimeError as e:  # the option does not suit the model, plan or not
                    rows.append(f"| {name} | {option} | - | - | unplanned DDP raises too: "
                                f"{str(e).splitlines()[0][:100]} |")
                    continue
                p = planner.plan(planned, None, example_inputs=case.inputs,
                                 loss_fn=case.loss_fn, repeats=1)
                _ddp_train(planned, case, rank)
                err = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                          for a, b in zip(case.model.parameters(), twin.parameters()))
                rows.append(f"| {name} | {option} | {len(p.schedule.regions)} | {err:.1e} | "
                            f"{'equal' if err == 0 else 'DIFFERENT'} |")
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
        dist.destroy_process_group()


def main() -> int:
    warnings.filterwarnings("ignore")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    if "--ddp" in sys.argv[1:]:
        from benchmarks.gloo_ranks import run_ranks

        rows = run_ranks(_ddp_worker, (), 2, "training_loop_probe --ddp", timeout_s=1800)
        print("| model | DDP option | regions | max rel diff after 3 steps | |")
        print("|---|---|---|---|---|")
        print("\n".join(rows))
        return 1 if any("DIFFERENT" in r for r in rows) else 0
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else MODELS
    idioms = sys.argv[2].split(",") if len(sys.argv) > 2 else list(IDIOMS)
    print("| model | idiom | regions | max rel diff after 3 steps | |")
    print("|---|---|---|---|---|")
    bad = 0
    for name in names:
        for idiom in idioms:
            row = run(name, idiom)
            bad += "DIFFERENT" in row
            print(row, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
