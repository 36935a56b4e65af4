"""Device registry and roofline arithmetic (no torch needed)."""

from __future__ import annotations

import doctest
import subprocess
import sys
from pathlib import Path

import pytest

import planner.devices as devices
from planner.devices import DEVICES, DeviceSpec, get_device, roofline_ms

TOY = DeviceSpec(
    name="toy",
    kind="cuda",
    peak_flops={"float32": 1e12, "bfloat16": 4e12},  # 1 TF/s fp32, 4 TF/s bf16
    mem_bandwidth_bytes_per_s=1e11,  # 100 GB/s
    memory_bytes=2**30,
    launch_overhead_ms=0.01,
)


def test_roofline_compute_bound() -> None:
    # 4e9 FLOPs / 1e12 FLOP/s = 4 ms; 1e8 B / 1e11 B/s = 1 ms -> 4 ms + 0.01 ms launch.
    assert roofline_ms(TOY, 4 * 10**9, 10**8, "float32") == pytest.approx(4.01)
    # bf16 is 4x faster: 1 ms compute ties 1 ms memory.
    assert roofline_ms(TOY, 4 * 10**9, 10**8, "bfloat16") == pytest.approx(1.01)


def test_roofline_memory_bound() -> None:
    # 1e6 FLOPs -> 0.001 ms; 5e8 B / 1e11 B/s = 5 ms -> 5 ms + 0.01 ms launch.
    assert roofline_ms(TOY, 10**6, 5 * 10**8, "float32") == pytest.approx(5.01)


def test_roofline_zero_work_costs_nothing() -> None:
    assert roofline_ms(TOY, 0, 0, "float32") == 0.0


def test_roofline_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="float16"):
        roofline_ms(TOY, 1, 1, "float16")


def test_get_device_unknown_lists_known_names() -> None:
    with pytest.raises(ValueError) as e:
        get_device("tpu-v9")
    msg = str(e.value)
    assert "'tpu-v9'" in msg
    for name in DEVICES:
        assert name in msg


def test_get_device_case_insensitive() -> None:
    assert get_device("H100") is DEVICES["h100"]


@pytest.mark.parametrize("key", sorted(DEVICES))
def test_registry_entries_positive(key: str) -> None:
    spec = DEVICES[key]
    assert spec.kind in ("cuda", "rocm")
    assert set(spec.peak_flops) == {"float32", "bfloat16", "float16"}
    assert all(v > 0 for v in spec.peak_flops.values())
    # Half precision is never slower than fp32 on these parts.
    assert spec.peak_flops["bfloat16"] >= spec.peak_flops["float32"]
    assert spec.mem_bandwidth_bytes_per_s > 0
    assert spec.memory_bytes > 0
    assert spec.launch_overhead_ms > 0


def test_registry_values() -> None:
    assert DEVICES["h100"].peak_flops["bfloat16"] == pytest.approx(989e12)
    assert DEVICES["a100"].mem_bandwidth_bytes_per_s == pytest.approx(2.039e12)
    assert DEVICES["mi300x"].memory_bytes == 192 * 10**9


def test_cpu_spec_without_measuring() -> None:
    spec = devices.cpu_spec(measure=False)
    assert spec.kind == "cpu"
    assert spec.peak_flops["bfloat16"] == spec.peak_flops["float32"]


def test_doctests() -> None:
    result = doctest.testmod(devices)
    assert result.attempted > 0 and result.failed == 0


def test_import_does_not_load_torch() -> None:
    root = Path(__file__).resolve().parents[2]
    code = "import sys, planner.devices, planner.cli; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
