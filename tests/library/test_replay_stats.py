"""Live statistics per bucket: a random stream of step sizes through a manager, checked
against counts made by brute force from the capture ladder."""

import random
import threading
from collections import Counter

import torch
from fakes import FakePlatform

from ostinato import Dispatcher, EagerReason, GraphConfig, GraphManager, GraphMode
from ostinato.capture_planner import padded_rows, plan_capture_sizes

SIZES = (1, 2, 4, 8, 16)


def build(mode, **dispatcher_kwargs):
    p = FakePlatform()
    x = torch.zeros(64, 3)  # [max_tokens, 3]
    w = torch.randn(3, 2)
    d = Dispatcher(GraphConfig(mode=mode, capture_sizes=SIZES), **dispatcher_kwargs)
    m = GraphManager(lambda b: x[: b.num_tokens] @ w, d, platform=p, progress=False)
    return m, d


def run_stream(m, d, steps, seed, uniform=lambda n: False):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 40) for _ in range(steps)]
    for n in sizes:
        m.run(d.dispatch(n, uniform(n)), n)
    return sizes


def test_replays_and_padding_per_bucket_match_brute_force():
    m, d = build(GraphMode.FULL)
    m.capture()
    sizes = run_stream(m, d, 500, seed=1)
    stats = m.stats()
    for bucket in stats.buckets:
        size = bucket.descriptor.num_tokens
        mine = [n for n in sizes if n <= 16 and min(s for s in SIZES if s >= n) == size]
        assert bucket.replays == len(mine)
        assert bucket.real_rows == sum(mine)
        assert bucket.padded_rows == size * len(mine)
        assert bucket.capture_seconds > 0 and bucket.mode is GraphMode.FULL
    above = [n for n in sizes if n > 16]
    assert stats.eager_steps[EagerReason.ABOVE_LARGEST] == len(above)
    assert stats.eager == len(above) and stats.eager_rows == sum(above)
    replayed = [n for n in sizes if n <= 16]
    padded = sum(min(s for s in SIZES if s >= n) for n in replayed)
    assert stats.replays == len(replayed)
    assert abs(stats.padding_fraction - (1 - sum(replayed) / padded)) < 1e-12
    line = stats.summary()
    assert f"{len(sizes)} steps" in line and f"{len(above)} above the largest" in line
    assert stats.step_sizes == Counter(replayed)  # the histogram the planner reads


def test_the_planner_plans_from_the_live_histogram():
    m, d = build(GraphMode.FULL)
    m.capture()
    run_stream(m, d, 300, seed=2)
    stats = m.stats()
    graph_bytes = {b.descriptor.num_tokens: b.pool_bytes for b in stats.buckets}
    plan = plan_capture_sizes(stats.step_sizes, 16, 3 * 1024, graph_bytes, granule=1)
    assert plan.bytes <= 3 * 1024 and plan.sizes[-1] == 16 and len(plan.sizes) <= 3
    assert plan.real_rows == sum(n * c for n, c in stats.step_sizes.items())
    assert plan.padded_rows == padded_rows(stats.step_sizes, plan.sizes)


def test_every_capturable_size_is_listed_before_it_runs():
    m, d = build(GraphMode.FULL_AND_PIECEWISE)
    stats = m.stats()
    listed = [(b.mode, b.descriptor.num_tokens) for b in stats.buckets]
    assert listed == [(GraphMode.FULL, s) for s in (16, 8, 4, 2, 1)] + [
        (GraphMode.PIECEWISE, s) for s in (16, 8, 4, 2, 1)
    ]
    assert stats.replays == stats.eager == 0 and stats.padding_fraction == 0.0
    assert "0 steps" in stats.summary()


def test_a_batch_kind_without_graphs_is_counted_with_its_reason():
    m, d = build(GraphMode.FULL_DECODE_ONLY)
    m.capture()
    # Mixed batches have no graph in this mode; uniform decodes replay.
    sizes = run_stream(m, d, 200, seed=2, uniform=lambda n: n % 2 == 0)
    stats = m.stats()
    mixed_small = [n for n in sizes if n % 2 and n <= 16]
    assert stats.eager_steps[EagerReason.NO_GRAPH_FOR_BATCH] == len(mixed_small)
    assert stats.replays == len([n for n in sizes if n % 2 == 0 and n <= 16])


def test_stats_read_from_another_thread_while_steps_run():
    m, d = build(GraphMode.FULL)
    m.capture()
    stop, seen = threading.Event(), []

    def read():
        while not stop.wait(0.0005):  # (a reader spinning without pause starves the steps)
            seen.append(m.stats().replays)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        run_stream(m, d, 2000, seed=3)
    finally:
        stop.set()
        reader.join()
    assert len(seen) > 10 and seen == sorted(seen)  # counts only grow
    assert m.stats().replays + m.stats().eager == 2000


def test_specialised_lora_graphs_are_counted_apart():
    x, w = torch.zeros(64, 3), torch.randn(3, 2)
    config = GraphConfig(mode=GraphMode.FULL, capture_sizes=SIZES, specialize_lora=True)
    d = Dispatcher(config, lora_enabled=True)
    m = GraphManager(lambda b: x[: b.num_tokens] @ w, d, platform=FakePlatform(), progress=False)
    report = m.capture()
    assert report.num_graphs == 2 * len(SIZES) and report.lora_graphs == len(SIZES)
    assert f"({len(SIZES)} with LoRA)" in report.summary()
    rng = random.Random(3)
    lora = [rng.random() < 0.5 for _ in range(200)]
    for has_lora in lora:
        n = rng.randint(1, 16)
        m.run(d.dispatch(n, False, has_lora), n)
    stats = m.stats()
    assert stats.lora_replays == sum(lora) and stats.replays == len(lora)
    assert f"{len(lora)} ({sum(lora)} with LoRA) from graphs" in stats.summary()
