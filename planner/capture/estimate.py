"""Estimate mode: record a step with fake tensors for a device one does not have.

The model's own code runs on `FakeTensorMode` tensors (shapes, dtypes and aliasing, no data and no
memory), so a 70B model profiles on a laptop. What cannot run is code that reads tensor values
(`.item()`, a branch on `x.sum() > 0`): the recorder names the module where that happens.

Times come from a roofline (`planner.devices`). Two kernels differ between a CPU and a GPU in what
they keep for backward, and are routed here to what the GPU runs:
- dropout: CUDA and ROCm run ``native_dropout``, which keeps a bool mask (1 byte per element),
  where the CPU decomposes dropout into ``bernoulli_`` with a mask of the input's dtype;
- SDPA with dropout: CUDA's flash and memory-efficient kernels apply dropout inside the kernel and
  keep only the output and log-sum-exp, where a CPU tensor takes the math path, which keeps the
  (seq x seq) probabilities. Not where the mask is trained (a relative position bias, as Swin
  adds): the CPU's flash kernel takes no gradient for it, so that call keeps the math path (a
  GPU's memory-efficient kernel also returns a mask gradient of the same (seq x seq) size).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from planner.devices import DeviceSpec, roofline_ms

__all__ = ["Faker", "gpu_kernels", "roofline_times"]

aten = torch.ops.aten


class Faker:
    """Real or meta tensors -> fake tensors of the same shape, dtype and requires_grad."""

    def __init__(self, mode: FakeTensorMode):
        self.mode = mode
        self._done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """The fake of `t`; the same tensor given twice (labels = input_ids) gets one fake."""
        hit = self._done.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        f = self._fake(t)
        self._done[id(t)] = (t, f)
        return f

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            with self.mode:
                f = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        else:
            f = self.mode.from_tensor(t)
        if t.requires_grad and (t.is_floating_point() or t.is_complex()):
            f = f.detach().requires_grad_(True)
        return f


@contextlib.contextmanager
def gpu_kernels() -> Iterator[None]:
    """Route dropout and SDPA-with-dropout to the kernels a GPU runs (see the module docstring)."""
    sdpa = F.scaled_dot_product_attention
    dropout = F.dropout

    def gpu_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        if (dropout_p > 0 and not enable_gqa and query.dim() == 4 and key.shape == value.shape
                and (attn_mask is None or not attn_mask.requires_grad)):
            out, _lse = aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )
            return out
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    def gpu_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
                    inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0 or inplace:
            return dropout(input, p, training, inplace)
        out, _mask = torch.native_dropout(input, p, True)
        return out

    F.scaled_dot_product_attention = gpu_sdpa
    F.dropout = gpu_dropout
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
        F.dropout = dropout


def roofline_times(ops: list[Any], spec: DeviceSpec, dtype: str) -> None:
    """Set every recorded op's time to its roofline estimate on `spec`, at the dtype the op
    computes in (a bf16 matmul under autocast at the bf16 peak), `dtype` where it has none
    (placeholders, getitem and views, which only relabel memory: 0)."""
    for r in ops:
        if r.phase in ("param", "buffer", "input") or r.op == "getitem" or r.view:
            r.time_ms = 0.0
        else:
            at = r.dtype if r.dtype in spec.peak_flops else dtype
            r.time_ms = round(roofline_ms(spec, r.flops, r.bytes_moved, at), 6)
