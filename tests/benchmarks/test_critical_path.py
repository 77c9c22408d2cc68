"""The critical-path charge: each kernel's exposed time plus the idle gaps is the step's
span, checked against a brute-force sweep of the timeline; roles follow a layer's order."""

import random

import pytest

from benchmarks.critical_path import (
    PROJECTIONS,
    Kernel,
    charge,
    exposed,
    largest_gap,
    layer_timeline,
    roles,
)


def covered(kernels: list[Kernel], first: float, last: float, tick: float) -> float:
    """Time in ``first..last`` during which at least one of ``kernels`` runs, by ticks."""
    n = round((last - first) / tick)
    mids = (first + (i + 0.5) * tick for i in range(n))
    return tick * sum(any(k.start <= m < k.end for k in kernels) for m in mids)


def brute_force(kernels: list[Kernel], tick: float = 0.25) -> tuple[list[float], float]:
    """By definition: a kernel's exposed time is what it adds to the time covered by the
    kernels started before it; idle is the span that no kernel covers."""
    first, last = kernels[0].start, max(k.end for k in kernels)
    cover = [covered(kernels[:i], first, last, tick) for i in range(len(kernels) + 1)]
    times = [cover[i + 1] - cover[i] for i in range(len(kernels))]
    return times, (last - first) - cover[-1]


def timeline(seed: int) -> list[Kernel]:
    rng = random.Random(seed)
    kernels, t = [], 0.0
    for i in range(12):
        t += rng.choice([-3.0, -1.0, 0.0, 0.5, 2.0])  # overlap (PDL), back to back, or a gap
        t = max(t, 0.0)
        length = rng.choice([1.0, 2.0, 4.0, 8.0])
        kernels.append(Kernel(f"k{i}", t, t + length))
        t += length
    return sorted(kernels, key=lambda k: k.start)


@pytest.mark.parametrize("seed", range(20))
def test_exposed_times_and_idle_gaps_add_up_to_the_span_as_brute_force_finds(seed):
    kernels = timeline(seed)
    times, idle = exposed(kernels)
    want_times, want_idle = brute_force(kernels)
    span = max(k.end for k in kernels) - kernels[0].start
    assert sum(times) + idle == pytest.approx(span)
    assert times == pytest.approx(want_times)
    assert idle == pytest.approx(want_idle)


def test_a_kernel_hidden_under_its_predecessor_is_charged_nothing():
    kernels = [Kernel("a", 0.0, 10.0), Kernel("b", 2.0, 6.0), Kernel("c", 5.0, 12.0)]
    times, idle = exposed(kernels)
    assert times == [10.0, 0.0, 2.0] and idle == 0.0


LAYER = ["_gemm_kernel", "_paged_attention_kernel", "_merge_splits_kernel"] + ["_gemm_kernel"] * 3


def test_roles_follow_each_layers_order():
    names = ["Memcpy HtoD", "indexSelect"] + LAYER + LAYER
    names += ["_rms_norm_kernel", "nvjet_sm90_tst_256x8", "_chunk_best_kernel", "_row_best_kernel"]
    kernels = [Kernel(n, float(i), i + 1.0) for i, n in enumerate(names)]
    got = roles(kernels, layers=2)
    layer_roles = ["qkv", "attention", "merge", "o", "gate_up", "down"]
    assert got == ["other", "other", *layer_roles, *layer_roles] + [
        "other",
        "lm_head",
        "argmax",
        "argmax",
    ]
    # a Triton LM head: the one GEMM after the layers' four each
    triton_head = [Kernel(n, float(i), i + 1.0) for i, n in enumerate(LAYER + ["_gemm_kernel"])]
    assert roles(triton_head, layers=1)[-1] == "lm_head"
    # another count of GEMMs than four a layer (or one more): they are not guessed at
    assert roles(kernels[:-4], layers=3).count("gemm") == 2 * len(PROJECTIONS)


def test_charge_averages_over_steps_and_gives_a_projection_its_bandwidth():
    step = [
        Kernel("_gemm_kernel", 0.0, 4.0),
        Kernel("_paged_attention_kernel", 3.0, 6.0),
        Kernel("_merge_splits_kernel", 7.0, 8.0),
        Kernel("_gemm_kernel", 7.5, 10.0),
        Kernel("_gemm_kernel", 9.0, 20.0),
        Kernel("_gemm_kernel", 19.0, 25.0),
    ]
    later = [Kernel(k.name, k.start + 100.0, k.end + 100.0) for k in step]
    by_role, span, idle = charge([step, later], layers=1, weight_bytes={"gate_up": 10_000})
    assert span == 25.0 and idle == 1.0
    got = {r.role: r for r in by_role}
    assert got["gate_up"].exposed_us == 10.0 and got["gate_up"].duration_us == 11.0
    assert got["gate_up"].exposed_gbps == pytest.approx(10_000 / (10.0 * 1e3))
    assert got["qkv"].per_step == 1 and got["qkv"].exposed_gbps == 0.0
    assert sum(r.exposed_us for r in by_role) + idle == pytest.approx(span)
    assert by_role[0].role == "gate_up"  # the largest share first


def test_the_largest_gap_is_found_with_the_kernel_that_ends_it():
    kernels = [Kernel("a", 0.0, 2.0), Kernel("b", 1.0, 5.0), Kernel("c", 6.0, 7.0)]
    kernels += [Kernel("d", 10.0, 11.0)]
    assert largest_gap(kernels) == (3.0, 3)
    assert largest_gap(kernels[:2]) == (0.0, 0)


def test_a_layers_timeline_runs_from_the_down_projection_before_it():
    names = ["Memcpy HtoD"] + LAYER + LAYER + ["nvjet_sm90"]
    kernels = [Kernel(n, 2.0 * i, 2.0 * i + 3.0) for i, n in enumerate(names)]
    got = layer_timeline(kernels, layers=2, layer=1)
    assert [r for r, _, _ in got] == ["down", "qkv", "attention", "merge", "o", "gate_up", "down"]
    assert got[0] == ("down", -3.0, 0.0) and got[1] == ("qkv", -1.0, 2.0)
    assert layer_timeline(kernels, layers=2, layer=0) == []
