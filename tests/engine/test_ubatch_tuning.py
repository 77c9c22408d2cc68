"""The capture-time micro-batch measurement of the engine's worker: a split is kept only
where it measured faster, and every rank of every replica agrees."""

import pytest
import torch

from ostinato.batch import BatchDescriptor


def test_a_split_is_kept_only_where_measured_faster_by_the_margin():
    from ostinato.engine.worker.ubatch_tuning import UbatchTiming, chosen, measure

    sizes = [BatchDescriptor(n) for n in (512, 2048, 8192)]
    own = {512: (15.6, 18.4), 2048: (44.2, 43.9), 8192: (160.7, 154.0)}
    calls = []

    def time_ms(d, ubatched):
        calls.append((d.num_tokens, ubatched))
        return own[d.num_tokens][ubatched]

    timings = measure(sizes, time_ms)
    # Each size timed plainly, then split, in the given order (collectives pair up).
    assert calls == [(n, ub) for n in (512, 2048, 8192) for ub in (False, True)]
    assert [t.descriptor.num_tokens for t in timings] == [512, 2048, 8192]
    assert chosen(timings, 1.03) == {BatchDescriptor(8192)}  # 1.04x: kept
    assert chosen(timings, 1.0) == {BatchDescriptor(2048), BatchDescriptor(8192)}
    assert chosen(timings, 1.05) == frozenset()
    assert UbatchTiming(sizes[0], 10.0, 8.0).speedup == pytest.approx(1.25)


def test_ranks_agree_on_the_slower_ranks_times(tmp_path):
    from dist_workers import ubatch_timings_agree
    from test_distributed import run_two_ranks

    run_two_ranks(ubatch_timings_agree, str(tmp_path), timeout_s=60)
    t0, c0 = torch.load(tmp_path / "timings0.pt", weights_only=False)
    t1, c1 = torch.load(tmp_path / "timings1.pt", weights_only=False)
    assert t0 == t1 and c0 == c1
    assert [(t.plain_ms, t.ubatched_ms) for t in t0] == [(11.0, 12.0), (20.0, 15.0)]
    # Rank 0 alone would have split 64 (10 vs 9); the slower rank says no.
    assert [d.num_tokens for d in c0] == [128]


def test_data_parallel_replicas_agree_on_the_measured_split(tmp_path):
    # DP=2 × TP=2 on the CPU with fake graphs: replica 0 measures the split faster, replica
    # 1 slower; every rank takes the slowest times, so no replica splits any size (with a
    # TP-only agreement replica 0 would split and replica 1 not).
    import torch.multiprocessing as mp
    from dist_workers import free_port, ubatch_measure_agreement
    from hf_models import write_checkpoint

    write_checkpoint("LlamaForCausalLM", tmp_path / "llama", rope_theta=500000.0)
    ctx, port = mp.get_context("spawn"), free_port()
    args = (4, port, str(tmp_path / "llama"), str(tmp_path))
    procs = [ctx.Process(target=ubatch_measure_agreement, args=(r, *args)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = [torch.load(tmp_path / f"agree{r}.pt", weights_only=False) for r in range(4)]
    assert results[0]["candidates"], "the thresholds select some captured sizes"
    for r in results:
        assert r["timings"] == results[0]["timings"]
        assert [(p, u) for _, p, u in r["timings"]] == [(1.0, 2.0)] * len(r["candidates"])
        assert r["chosen"] == frozenset()
