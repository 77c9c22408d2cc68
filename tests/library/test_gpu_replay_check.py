"""GPU tests of graphs you can budget and trust: per-bucket pool bytes against the pool's
growth, planted bugs (a padding leak, a frozen Python number) caught and demoted with the
right bucket named, checked serving equal to unchecked, the adaptive ladder's moves."""

import random

import pytest
import torch

from ostinato import (
    AdaptiveLadder,
    AdaptivePolicy,
    BatchDescriptor,
    Dispatcher,
    GraphConfig,
    GraphDemotedWarning,
    GraphManager,
    GraphMode,
    ReplayCheck,
)
from ostinato.capture_planner import device_costs
from ostinato.platform.cuda import CudaPlatform

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")


class Step:
    """Two bf16 layers over a persistent input; ``leak`` mixes rows, ``scale`` is a Python
    number a graph freezes."""

    def __init__(self, leak=False):
        torch.manual_seed(0)
        self.x = torch.randn(256, 512, device=DEVICE, dtype=torch.bfloat16)  # [tokens, 512]
        self.w1 = torch.randn(512, 1024, device=DEVICE, dtype=torch.bfloat16) / 20
        self.w2 = torch.randn(1024, 512, device=DEVICE, dtype=torch.bfloat16) / 30
        self.leak = leak
        self.scale = 1.0

    def __call__(self, d):
        x = self.x[: d.num_tokens]
        if self.leak:
            x = x - x.mean(0, keepdim=True)
        return (torch.relu(x @ self.w1) @ self.w2) * self.scale

    def perturb(self, d, real):
        self.x[real : d.num_tokens].normal_()


def manager(step, check=None, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), pool=None):
    return GraphManager(
        step,
        Dispatcher(GraphConfig(mode=GraphMode.FULL, capture_sizes=sizes)),
        check=check,
        perturb_padding=step.perturb,
        platform=CudaPlatform(),
        pool=pool or torch.cuda.graph_pool_handle(),  # its own: measured alone
        progress=False,
    )


def test_per_bucket_pool_bytes_add_up_to_the_pools_total():
    pool = torch.cuda.graph_pool_handle()
    m = manager(Step(), pool=pool)
    m.capture()
    buckets = m.stats().buckets
    total = CudaPlatform().pool_bytes(pool)  # the allocator's segments of that pool
    assert total > 0 and sum(b.pool_bytes for b in buckets) == total
    assert buckets[0].pool_bytes == max(b.pool_bytes for b in buckets)  # largest first


def test_a_planted_padding_leak_is_demoted_naming_its_buckets():
    step = Step(leak=True)
    with pytest.warns(GraphDemotedWarning, match=r"num_tokens=256.*changes its first 128 rows"):
        manager(step, ReplayCheck("capture")).capture()


def test_a_frozen_python_number_is_caught_by_sampling_and_the_eager_output_served():
    step = Step()
    m = manager(step, ReplayCheck("sample", every=2))
    m.capture()
    step.scale = 2.0
    n = 24
    first = m.run(m.dispatcher.dispatch(n), n).clone()  # unchecked: stale
    with pytest.warns(GraphDemotedWarning, match=r"num_tokens=32.*sampled step"):
        second = m.run(m.dispatcher.dispatch(n), n)
    want = step(BatchDescriptor(32))[:n]
    assert not torch.allclose(first, want) and torch.equal(second, want)
    assert m.stats().demoted == (BatchDescriptor(32),)


def test_checked_serving_equals_unchecked_and_costs_one_eager_step_in_every():
    plain, checked = Step(), Step()
    a = manager(plain)
    b = manager(checked, ReplayCheck("sample", every=4))
    a.capture()
    b.capture()
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(1, 256)
        x = torch.randn(n, 512, device=DEVICE, dtype=torch.bfloat16)
        for s in (plain, checked):
            s.x[:n] = x
        assert torch.equal(a.run(a.dispatcher.dispatch(n), n), b.run(b.dispatcher.dispatch(n), n))
    assert b.stats().checked_replays == 10 and not b.stats().demoted


def test_the_adaptive_ladder_moves_within_budget_on_the_gpu():
    step = Step()
    m = manager(step)
    report = m.capture()
    cost = device_costs(list(report.records))  # as charged before the move
    # Room for the largest graph (always kept) and half of what the others took.
    held = sum(cost(n) for n in m.dispatcher.sizes)
    budget = cost(256) + (held - cost(256)) // 2
    ladder = AdaptiveLadder(m, AdaptivePolicy(budget, every=100, granule=1 << 12))
    rng = random.Random(1)
    for _ in range(100):
        n = rng.choice([rng.randint(1, 4), rng.randint(20, 40)])
        step.x[:n].normal_()
        out = m.run(m.dispatcher.dispatch(n), n)
        torch.testing.assert_close(out, step(BatchDescriptor(n)), rtol=1.6e-2, atol=1e-2)
        ladder.between_steps()
    (change,) = ladder.changes
    assert change.padded_after < change.padded_before
    charged = sum(cost(n) for n in m.dispatcher.sizes)
    assert charged <= budget and m.num_graphs == len(m.dispatcher.sizes)
