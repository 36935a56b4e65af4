"""Device specs for roofline time estimates: peak FLOP/s, memory bandwidth, memory size.

Pure data and arithmetic; torch is imported only by `cpu_spec(measure=True)`, so the registry can be
used where torch is not installed (offline planning, estimate-mode profiles for a GPU one lacks).

Peak numbers are vendor datasheet figures for dense math (no 2:4 structured sparsity). A roofline
estimate (Williams et al. 2009, "Roofline: an insightful visual performance model") is a lower bound
on an op's time: real kernels reach a fraction of either roof.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DeviceSpec", "DEVICES", "get_device", "cpu_spec", "roofline_ms"]

DTYPES = ("float32", "bfloat16", "float16")

_TERA = 1e12
_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or CPU) as the roofline model sees it."""

    name: str
    """Human name, e.g. ``NVIDIA H100 SXM5``."""
    kind: str
    """``cpu``, ``cuda`` or ``rocm``."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by dtype name (``float32``, ``bfloat16``, ``float16``)."""
    mem_bandwidth_bytes_per_s: float
    """Peak device-memory bandwidth in bytes/s."""
    memory_bytes: int
    """Device memory capacity in bytes."""
    launch_overhead_ms: float
    """Fixed cost added to every op (kernel launch / dispatch), in ms."""


# GPU launch overhead: a few microseconds per kernel is typical of CUDA and HIP launches.
_GPU_LAUNCH_MS = 0.005

DEVICES: dict[str, DeviceSpec] = {
    # Source: NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column).
    # fp32 19.5 TF (non-tensor-core), bf16/fp16 tensor core 312 TF dense, 2,039 GB/s HBM2e, 80 GB.
    "a100": DeviceSpec(
        name="NVIDIA A100 SXM4 80GB",
        kind="cuda",
        peak_flops={"float32": 19.5 * _TERA, "bfloat16": 312 * _TERA, "float16": 312 * _TERA},
        mem_bandwidth_bytes_per_s=2.039e12,
        memory_bytes=80 * _GIB,
        launch_overhead_ms=_GPU_LAUNCH_MS,
    ),
    # Source: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column).
    # fp32 67 TF, bf16/fp16 tensor core 989 TF dense (1,979 TF is with sparsity), 3.35 TB/s, 80 GB.
    "h100": DeviceSpec(
        name="NVIDIA H100 SXM5 80GB",
        kind="cuda",
        peak_flops={"float32": 67 * _TERA, "bfloat16": 989 * _TERA, "float16": 989 * _TERA},
        mem_bandwidth_bytes_per_s=3.35e12,
        memory_bytes=80 * 10**9,
        launch_overhead_ms=_GPU_LAUNCH_MS,
    ),
    # Source: NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column).
    # Same compute as H100 SXM; HBM3e 4.8 TB/s, 141 GB.
    "h200": DeviceSpec(
        name="NVIDIA H200 SXM 141GB",
        kind="cuda",
        peak_flops={"float32": 67 * _TERA, "bfloat16": 989 * _TERA, "float16": 989 * _TERA},
        mem_bandwidth_bytes_per_s=4.8e12,
        memory_bytes=141 * 10**9,
        launch_overhead_ms=_GPU_LAUNCH_MS,
    ),
    # Source: AMD Instinct MI250X accelerator datasheet (gfx90a).
    # fp32 vector 47.9 TF is used as the fp32 peak (the fp32 matrix-core rate is 95.7 TF),
    # bf16/fp16 matrix 383 TF dense, 3.2 TB/s HBM2e, 128 GB.
    "mi250x": DeviceSpec(
        name="AMD Instinct MI250X",
        kind="rocm",
        peak_flops={"float32": 47.9 * _TERA, "bfloat16": 383 * _TERA, "float16": 383 * _TERA},
        mem_bandwidth_bytes_per_s=3.2e12,
        memory_bytes=128 * 10**9,
        launch_overhead_ms=_GPU_LAUNCH_MS,
    ),
    # Source: AMD Instinct MI300X accelerator datasheet (gfx942).
    # fp32 matrix 163.4 TF (vector 81.7 TF), bf16/fp16 1,307.4 TF dense (2,614.9 TF with sparsity), 5.3 TB/s, 192 GB.
    "mi300x": DeviceSpec(
        name="AMD Instinct MI300X",
        kind="rocm",
        peak_flops={
            "float32": 163.4 * _TERA,
            "bfloat16": 1307.4 * _TERA,
            "float16": 1307.4 * _TERA,
        },
        mem_bandwidth_bytes_per_s=5.3e12,
        memory_bytes=192 * 10**9,
        launch_overhead_ms=_GPU_LAUNCH_MS,
    ),
}


def get_device(name: str) -> DeviceSpec:
    """The registered spec called `name` (case-insensitive), e.g. ``get_device("h100")``.

    >>> get_device("H100").kind
    'cuda'
    """
    key = name.strip().lower()
    if key not in DEVICES:
        known = ", ".join(sorted(DEVICES))
        raise ValueError(
            f"unknown device {name!r}; known devices are: {known} "
            "(or use cpu_spec() to measure this machine's CPU)"
        )
    return DEVICES[key]


def roofline_ms(spec: DeviceSpec, flops: int, bytes_moved: int, dtype: str) -> float:
    """Roofline time of one op in ms: the slower of compute and memory traffic, plus launch cost.

    time = max(flops / peak_flops[dtype], bytes_moved / bandwidth) + launch_overhead, and 0 for an
    op that neither computes nor moves bytes (views, getitem).

    >>> spec = DeviceSpec(name="toy", kind="cuda", peak_flops={"float32": 1e12},
    ...                   mem_bandwidth_bytes_per_s=1e11, memory_bytes=2**30,
    ...                   launch_overhead_ms=0.01)
    >>> round(roofline_ms(spec, 2 * 10**9, 10**6, "float32"), 6)  # compute-bound: 2 ms
    2.01
    >>> round(roofline_ms(spec, 10**6, 10**9, "float32"), 6)  # memory-bound: 10 ms
    10.01
    >>> roofline_ms(spec, 0, 0, "float32")
    0.0
    """
    if flops <= 0 and bytes_moved <= 0:
        return 0.0
    try:
        peak = spec.peak_flops[dtype]
    except KeyError:
        raise ValueError(
            f"device {spec.name!r} has no peak FLOP/s for dtype {dtype!r}; "
            f"it has {sorted(spec.peak_flops)}"
        ) from None
    compute_s = flops / peak
    memory_s = bytes_moved / spec.mem_bandwidth_bytes_per_s
    return max(compute_s, memory_s) * 1e3 + spec.launch_overhead_ms


def _cpu_model_name() -> str:
    """The CPU's "model name" from /proc/cpuinfo, or a generic name where that is unavailable."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_spec(measure: bool = True) -> DeviceSpec:
    """A spec for this machine's CPU, measured with torch when `measure` is True.

    FLOP/s: a 1024x1024 fp32 matmul (2 * 1024**3 FLOPs), median of several runs after warm-up.
    Bandwidth: a 256 MiB tensor copy (reads and writes it: 2 * 256 MiB moved), median.
    With `measure=False` no torch is needed and the numbers are placeholders (1 TF/s, 10 GB/s).
    """
    name = _cpu_model_name()
    try:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory_bytes = 0
    if measure:
        import torch

        n = 1024
        a = torch.randn(n, n, dtype=torch.float32)
        b = torch.randn(n, n, dtype=torch.float32)
        for _ in range(2):  # warm-up: thread pool start, page faults
            torch.mm(a, b)
        fp32 = 2 * n**3 / _median_s(lambda: torch.mm(a, b), 7)

        src = torch.empty(64 * 2**20, dtype=torch.float32)  # 256 MiB
        dst = torch.empty_like(src)
        src.fill_(1.0)
        dst.copy_(src)
        bandwidth = 2 * src.numel() * src.element_size() / _median_s(lambda: dst.copy_(src), 5)
    else:
        fp32 = 1e12
        bandwidth = 1e10
    # Assumption: most CPUs have no bf16/fp16 matmul units faster than fp32 (or torch does not use
    # them), so the half-precision peaks are taken equal to the measured fp32 rate.
    return DeviceSpec(
        name=name,
        kind="cpu",
        peak_flops={"float32": fp32, "bfloat16": fp32, "float16": fp32},
        mem_bandwidth_bytes_per_s=bandwidth,
        memory_bytes=memory_bytes,
        # Eager dispatch of one aten op on CPU costs a few microseconds.
        launch_overhead_ms=0.005,
    )
