"""Write the committed estimate-mode profiles into profiles/ (gzip JSON).

    python benchmarks/make_profiles.py [--device h100] [--out profiles] [NAME ...]

Every model is built on the meta device, so nothing is materialised: the profiles are what an H100
would see, estimated by roofline (`planner.devices`), with exact storage sizes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks import zoo  # noqa: E402

MODELS = {
    "gpt2_small": zoo.gpt2_small,  # batch 8, seq 1024
    "llama7b": zoo.llama7b,  # batch 1, seq 4096
    "resnet50": zoo.resnet50,  # batch 64, 224x224
    "unet": zoo.unet,  # batch 8, 256x256, base 64, depth 4
}
"""Profiled for --device (default h100)."""

LLAMA3_70B = {
    # (name, builder kwargs, device, AdamW implementation): the offline 70B study
    # (benchmarks/llama70b.py, notebooks/llama70b.ipynb)
    "llama3_70b_lora16_seq4096": (dict(seq=4096, lora_rank=16), "mi300x", "foreach"),
    "llama3_70b_lora16_seq8192": (dict(seq=8192, lora_rank=16), "mi300x", "foreach"),
    "llama3_70b_seq4096_mi300x": (dict(seq=4096), "mi300x", "foreach"),
    "llama3_70b_seq4096_h100": (dict(seq=4096), "h100", "foreach"),
    "llama3_70b_seq4096_h100_fused": (dict(seq=4096), "h100", "fused"),
    "llama3_70b_seq2048_h100_fused": (dict(seq=2048), "h100", "fused"),
    # torchtitan's FSDP2 mixed precision: float32 weights, computed in bf16 (mp_policy)
    "llama3_70b_seq4096_mi300x_mp": (dict(seq=4096, dtype="float32"), "mi300x", "foreach"),
}
"""Llama-3-70B, batch 1: LoRA r=16 on one MI300X, and full fine-tuning (planned per rank under
FSDP2 from the same profile) on MI300X and H100, with AdamW's default (foreach) step on a GPU or
its fused one, which allocates no temporaries beyond its state. The ``_mp`` one keeps float32
weights and is recorded under FSDP2's `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`, as torchtitan trains."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"models, of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--device", default="h100", help="device spec for the roofline (default h100)")
    ap.add_argument("--out", default=str(ROOT / "profiles"), help="output folder")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in MODELS and n not in LLAMA3_70B]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from "
                 f"{', '.join([*MODELS, *LLAMA3_70B])}")

    import torch

    from planner.profiling import profile

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.names or [*MODELS, *LLAMA3_70B]:
        t0 = time.perf_counter()
        if name in LLAMA3_70B:
            kw, device, implementation = LLAMA3_70B[name]
            kw = {**kw, "dtype": getattr(torch, kw.get("dtype", "bfloat16"))}
            model, inputs = zoo.llama3_70b(**kw)
            filename = f"{name}.json.gz"
        else:
            model, inputs = MODELS[name]()
            device, filename = args.device, f"{name}_{args.device}.json.gz"
        n_params = sum(p.numel() for p in model.parameters())
        optimizer = None
        if name in LLAMA3_70B:  # AdamW on what trains: its state is in every budget
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
            if implementation == "fused":
                # AdamW(fused=True) refuses meta parameters (it checks their device); the
                # profile only reads which implementation the step will run.
                for group in optimizer.param_groups:
                    group.update(foreach=False, fused=True)
        mp_policy = None
        if name.endswith("_mp"):
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                             reduce_dtype=torch.float32)
        prof = profile(model, inputs, mode="estimate", device=device, optimizer=optimizer,
                       mp_policy=mp_policy)
        path = prof.save(out / filename)
        secs = time.perf_counter() - t0
        print(
            f"{path.name}: {n_params / 1e6:.1f} M params, {len(prof.nodes)} nodes, "
            f"saved {prof.saved_bytes / 2**30:.2f} GiB, fixed {prof.fixed_bytes / 2**30:.2f} GiB, "
            f"step {prof.step_ms:.1f} ms; {path.stat().st_size / 2**20:.2f} MiB on disk; "
            f"{secs:.1f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
