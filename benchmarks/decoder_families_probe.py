"""Decoder families beside the zoo and `outside_zoo.py`, in fp32 and under bf16 autocast.

    HF_HUB_OFFLINE=1 python benchmarks/decoder_families_probe.py [family ...] [-n 6]

Each family is built as `outside_zoo._decoder` builds one (a small config with random weights,
dropout 0.1, a right-padded row, labels), planned at its smallest peak and half way from there
to no checkpointing, each plan verified (predicted against measured peak, gradients against the
unplanned model); then `schedule_fuzz.fuzz` measures `-n` schedules near the smallest-peak one.
Prints one Markdown table, then the schedule harness's rows and any schedule it found off.
Not part of the test suite (that would add minutes to CI): a probe of what a new user would try.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import planner  # noqa: E402
from benchmarks import schedule_fuzz  # noqa: E402
from benchmarks._probe import floor_and_half_way  # noqa: E402
from benchmarks.outside_zoo import CASES as OUTSIDE  # noqa: E402
from benchmarks.outside_zoo import _decoder  # noqa: E402
from tests.zoo import P  # noqa: E402

_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=P)

FAMILIES = {
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _COMMON),
    "cohere": ("CohereConfig", "CohereForCausalLM", _COMMON),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {**_COMMON, "hidden_dropout": P}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", _COMMON),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM",
                   {**_COMMON, "residual_dropout": P, "embedding_dropout": P}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_COMMON, "resid_pdrop": P}),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",  # multi-query attention
                    dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                         multi_query=True, resid_pdrop=P, attn_pdrop=P, embd_pdrop=P,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",  # local and global attention layers
               {**_COMMON, "head_dim": 16, "sliding_window": 8}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {**_COMMON, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 64, "head_dim": 16}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              {**_COMMON, "num_experts": 4, "num_experts_per_tok": 2}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", _COMMON),
    "glm": ("GlmConfig", "GlmForCausalLM", {**_COMMON, "head_dim": 16}),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {**_COMMON, "head_dim": 16}),
}


def probe(name: str, amp: torch.dtype | None) -> str:
    t0 = time.perf_counter()
    case = OUTSIDE[name]()
    cells, staged = [], 0
    try:
        for label, p, _ in floor_and_half_way_autocast(case, amp):
            staged = staged or sum(1 for c in p.profile.calls if c.stages)
            v = p.verify(repeats=1)
            planner.remove(case.model)
            cells.append(f"{label}: {len(p.schedule.regions)} regions, predicted - measured "
                         f"{v.predicted_peak_bytes - v.measured_peak_bytes:+d} B, "
                         f"{'fits' if v.measured_peak_bytes <= p.budget_bytes else 'OVER'}, "
                         f"grads {v.max_grad_rel_err:.0e}")
    except planner.CkptPlannerError as e:
        cells.append(f"does not plan: {str(e).splitlines()[0][:120]}")
    return (f"| {name} | {'bf16' if amp else 'fp32'} | {staged} | {' | '.join(cells)} | "
            f"{time.perf_counter() - t0:.0f} |")


def floor_and_half_way_autocast(case, amp):
    """`_probe.floor_and_half_way` with `autocast=` passed to both plans."""
    if amp is None:
        yield from floor_and_half_way(case.model, case.inputs, case.loss_fn)
        return
    low = planner.plan(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn,
                       autocast=amp)
    none = low.baselines()["none"].predicted_peak_bytes
    yield "smallest peak", low, none
    half = low.predicted_peak_bytes + (none - low.predicted_peak_bytes) // 2
    yield "half way", planner.plan(case.model, budget_bytes=half, example_inputs=case.inputs,
                                   loss_fn=case.loss_fn, autocast=amp), none


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", default=list(FAMILIES))
    ap.add_argument("-n", "--trials", type=int, default=6, help="schedules per model and dtype")
    args = ap.parse_args(argv)
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {list(FAMILIES)}")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    for name in args.families:
        config_cls, model_cls, config = FAMILIES[name]
        OUTSIDE.setdefault(name, _decoder(config_cls, model_cls, **config))
    print("| family | dtype | traced calls | smallest peak | half way | s |")
    print("|---|---|---|---|---|---|")
    rows, details = [], []
    for name in args.families:
        for amp in (None, torch.bfloat16):
            print(probe(name, amp), flush=True)
            rows.append(schedule_fuzz.dtype_row(name, args.trials, details, amp))
    print("\n" + schedule_fuzz.HEADER)
    print("\n".join(rows))
    if details:
        print("\n" + "\n".join(details))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
