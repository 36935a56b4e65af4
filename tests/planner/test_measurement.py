"""How a measured peak is read from `torch.profiler`'s memory events."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch._C._profiler import _EventType

from planner.measurement import _peak_and_retained, peak_of


def _recording(*events: tuple[int, int, int] | str):
    """A stand-in for a profiler run: allocation events (time, signed bytes, address) in a flat
    tree, and named events (a marker) at their position in the list."""
    nodes = []
    for t, e in enumerate(events):
        if isinstance(e, str):
            nodes.append(SimpleNamespace(tag=None, name=e, start_time_ns=10 * t, children=[]))
        else:
            _, size, ptr = e
            nodes.append(SimpleNamespace(
                tag=_EventType.Allocation, name="[memory]", start_time_ns=10 * t, children=[],
                extra_fields=SimpleNamespace(alloc_size=size, ptr=ptr)))
    return SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(
        experimental_event_tree=lambda: [SimpleNamespace(tag=None, name="step", start_time_ns=0,
                                                         children=nodes)])))


def test_running_sum_of_allocations_and_frees():
    prof = _recording((0, 100, 1), (0, 50, 2), "mark", (0, -100, 1), (0, 30, 3), (0, -30, 3))
    assert _peak_and_retained(prof, "mark") == (150, 150)
    assert peak_of(prof) == 150


def test_a_free_the_profiler_missed_is_taken_where_its_address_is_reused():
    """A block freed on a thread the profiler does not follow (gloo's workers free collectives'
    buffers there) leaves no event; the next allocation at its address proves it was freed."""
    missed = _recording((0, 100, 1), (0, 50, 2), (0, 100, 1), (0, -100, 1), (0, 20, 4))
    assert peak_of(missed) == 150  # not 250: the first block was gone when its address came back
    recorded = _recording((0, 100, 1), (0, 50, 2), (0, -100, 1), (0, 100, 1), (0, -100, 1),
                          (0, 20, 4))
    assert peak_of(recorded) == peak_of(missed)


def test_a_real_step_reads_its_own_allocations():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(1 << 19, dtype=torch.uint8)
        del a
        c = torch.empty(1 << 18, dtype=torch.uint8)
        del b, c
    assert peak_of(prof) == (1 << 20) + (1 << 19)
