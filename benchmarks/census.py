"""How many device kernels one step launches and how long the device is busy in them:
a graph removes launch cost, not the per-kernel minimum, so the count is what a decode
graph's length comes down to."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class KernelLaunches:
    """One kernel name's launches and device µs per step."""

    name: str
    per_step: float
    us_per_step: float


@dataclass(frozen=True)
class KernelCensus:
    """Per step: device kernels (copies and fills included) and their summed time, µs;
    ``by_name`` the same per kernel name, most launched first."""

    kernels: float
    busy_us: float
    by_name: tuple[KernelLaunches, ...] = ()

    def per_layer(self, layers: int) -> float:
        """Kernels per decoder layer (the step's kernels over ``layers``, so the
        embedding, RoPE tables, final norm, LM head and sampling are spread over them)."""
        return self.kernels / layers

    def in_layer(self, layers: int) -> int:
        """Kernels inside one decoder layer: each name's whole multiples of ``layers``
        launches per step (a name launched 2L + 1 times, the norms with the final one,
        counts 2); what runs once per step outside the layers is left out."""
        return sum(int(k.per_step + 1e-6) // layers for k in self.by_name)


def census(averages: Iterable[Any], steps: int) -> KernelCensus:
    """From a device-only profile's ``key_averages()`` over ``steps`` steps: every entry
    with device time is one kernel name, ``count`` launches of it."""
    kernels = [e for e in averages if e.device_time_total > 0]
    count = sum(e.count for e in kernels)
    busy = sum(e.device_time_total for e in kernels)
    names = sorted(
        (
            KernelLaunches(e.key[:120], e.count / steps, e.device_time_total / steps)
            for e in kernels
        ),
        key=lambda k: (-k.per_step, -k.us_per_step),
    )
    return KernelCensus(count / steps, busy / steps, tuple(names))


def difference(more: KernelCensus, fewer: KernelCensus, steps: int) -> KernelCensus:
    """Per step of the ``steps`` that ``more`` ran beyond ``fewer`` (each a census of one
    call, ``steps=1``: a generate of more tokens and one of fewer), so what both calls
    share (prefill, start, finish) cancels; a name whose count differs by a fraction of
    a step is kept as measured."""
    fewer_by = {k.name: k for k in fewer.by_name}
    names = []
    for k in more.by_name:
        f = fewer_by.get(k.name, KernelLaunches(k.name, 0.0, 0.0))
        per_step = (k.per_step - f.per_step) / steps
        if per_step > 0:
            names.append(KernelLaunches(k.name, per_step, (k.us_per_step - f.us_per_step) / steps))
    names.sort(key=lambda k: (-k.per_step, -k.us_per_step))
    kernels = (more.kernels - fewer.kernels) / steps
    return KernelCensus(kernels, (more.busy_us - fewer.busy_us) / steps, tuple(names))


def kernel_census(step: Callable[[], Any], steps: int = 5) -> KernelCensus:
    """Profiles ``steps`` calls of ``step`` on the device (CUDA, kernels inside graph
    replays included) and counts their kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return census(prof.key_averages(), steps)
