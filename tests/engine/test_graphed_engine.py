"""The engine in graph modes on the CPU: ``FakePlatform`` graphs (replay re-runs the
recorded ops on whatever the captured tensors hold, no Python) with a capturable dense
attention, so the padding, the uniform decode graphs (LM head and argmax inside) and the
speculative verify graphs are exercised end to end without a GPU."""

import random
import threading
import warnings
from dataclasses import replace

import pytest
import torch
from collector import walked
from fakes import DenseGraphAttention, copies_into
from workloads import preempting_mix, sync_and_async_outputs

from benchmarks.spec import OracleProposer
from ostinato.engine import LLM, SamplingParams
from ostinato.engine.model.attention import TorchAttention
from ostinato.engine.sample.graph_sampler import GREEDY
from ostinato.engine.sample.graph_sampler import VARIANTS as GRAPH_VARIANTS
from ostinato.engine.spec.speculative import SpeculativeConfig
from ostinato.modes import GraphMode
from ostinato.replay_check import GraphDemotedWarning
from ostinato.replay_stats import EagerReason
from ostinato.resolution import AttentionGraphSupport


def engine(mode, **kw):
    base = dict(
        model="tiny",
        device="cpu",
        dtype=torch.float32,
        max_model_len=128,
        max_num_seqs=8,
        max_capture_size=64,
        backend=DenseGraphAttention(),
        progress=False,
        seed=3,
        # (the default, "auto", captures FULL graphs on a thread: the tests of the
        # graphs capture first, and the background's own tests say so)
        capture="blocking",
    )
    return LLM(mode=mode, **{**base, **kw})


def workload(n=8, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(3, 30))] for _ in range(n)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    return prompts, params


def tokens(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_fake_graphs_replay_decode_steps_and_match_eager(fake_graphs):
    prompts, params = workload()
    want = tokens(engine("none", backend=None), prompts, params)
    llm = engine("full_decode_only")
    assert llm.mode.name == "FULL_DECODE_ONLY" and llm.capture_report.num_graphs > 0
    assert tokens(llm, prompts, params) == want
    assert sum(g.replays for g in fake_graphs.graphs) > 0, "decode steps replayed graphs"


def test_decode_graphs_write_their_logits_and_tokens_where_replays_read_them(fake_graphs):
    llm = engine("full_decode_only", max_capture_size=8)
    manager = llm.engine.runner.manager
    logits, greedy = manager.outputs.buffers  # [rows, vocab], [rows]
    graphs = [manager.graph(r.descriptor) for r in llm.capture_report.records]
    assert len(graphs) == 4 and all(g.ops for g in graphs)
    for graph in graphs:  # written by the LM head and the argmax, never copied
        assert copies_into(graph, logits) == [] and copies_into(graph, greedy) == []
    prompts, params = workload()
    assert tokens(llm, prompts, params) == tokens(engine("none", backend=None), prompts, params)


# Not the piecewise modes: Dynamo cannot trace under the fake graph's recorder.
@pytest.mark.parametrize("mode", ["full_decode_only", "full"])
@pytest.mark.parametrize("method", ["oracle", "ngram", "self:2"])
def test_speculative_verify_graphs_equal_plain_decoding_at_several_batch_sizes(
    fake_graphs, method, mode
):
    prompts, params = workload()
    plain = tokens(engine("none", backend=None), prompts, params)
    known = {tuple(p): t for p, t in zip(prompts, plain, strict=True)}
    spec = (
        SpeculativeConfig("custom", 4, proposer=OracleProposer(known))
        if method == "oracle"
        else SpeculativeConfig.parse(method, 4)
    )
    llm = engine(mode, speculative=spec)
    assert llm.mode.name == mode.upper()
    for b in (1, 3, 8):
        before = sum(g.replays for g in fake_graphs.graphs)
        assert tokens(llm, prompts[:b], params) == plain[:b], b
        assert sum(g.replays for g in fake_graphs.graphs) > before
    if method == "oracle":
        assert llm.spec_stats.acceptance_rate == 1.0
    if method.startswith("self"):  # the draft's k-step loop replayed from its own graphs
        assert llm.draft_report is not None and llm.draft_report.num_graphs > 0


@pytest.mark.parametrize("mode", ["full_decode_only", "full"])
def test_async_scheduling_with_graphs_and_preemption_equals_sync(fake_graphs, mode):
    outs = sync_and_async_outputs(lambda a: engine(mode, num_blocks=10, async_scheduling=a))
    assert outs[True] == outs[False]
    prompts, params = preempting_mix()
    eager = engine("none", backend=None, num_blocks=10)
    assert [(o.token_ids, o.finish_reason) for o in eager.generate(prompts, params)] == outs[True]


def sampled_tokens(llm, b, temperature=0.8, top_p=0.9):
    prompts, _ = workload(n=b, seed=5)
    params = SamplingParams(max_tokens=12, temperature=temperature, top_p=top_p, ignore_eos=True)
    return tokens(llm, prompts, params)


@pytest.mark.parametrize("mode", ["full_decode_only", "full"])
def test_sampling_runs_in_a_graph_of_its_own_and_equals_eager_at_captured_sizes(fake_graphs, mode):
    # FULL_DECODE_ONLY's decode graphs write the logits the sampling graphs read
    # (FULL_AND_PIECEWISE has the same decode graphs; the fake graph's recorder cannot
    # run under Dynamo); in FULL a decode replays the mixed graph of its size and the LM
    # head after it writes them, for the sizes up to max_num_seqs.
    eager = sampled_tokens(engine("none", seed=11), 8)
    llm = engine(mode, seed=11)
    sampler = llm.engine.sampler.graph_sampler
    # each size: (adjusted, cut, seeded): with the top-p sort, without it for steps whose
    # top_p are all 1, adjusted (bias, penalties) with and without seeds, greedy too
    # FULL's steps end before the LM head: its sizes also have the argmax alone
    variants = (*GRAPH_VARIANTS, GREEDY) if mode == "full" else GRAPH_VARIANTS
    assert sampler is not None and set(sampler.graphs) == {
        (n, *v) for n in (1, 2, 4, 8) for v in variants
    }
    # 8 requests fill the captured size 8: the graph draws what the eager sampler draws.
    assert sampled_tokens(llm, 8) == eager
    assert sampler.graphs[8, False, True, False][0].replays == 11  # each decode after the prefill
    assert sampler.graphs[8, False, False, False][0].replays == 0
    uncut = sampled_tokens(engine("none", seed=11), 8, top_p=1.0)
    assert sampled_tokens(engine(mode, seed=11), 8, top_p=1.0) == uncut
    # 3 requests replay size 4: the padding row draws too, and the CPU generator draws in
    # sequence, so the real rows' later draws differ from an eager run at 3 rows (same
    # distribution, other tokens; on CUDA, Philox can leave them equal).
    eager3 = sampled_tokens(engine("none", seed=11), 3)
    graphed3 = sampled_tokens(engine(mode, seed=11), 3)
    assert graphed3 != eager3
    assert all(0 <= t < llm.config.vocab_size for out in graphed3 for t in out)


def test_greedy_decode_steps_in_full_mode_take_the_argmax_in_a_graph(fake_graphs):
    # FULL's decodes replay the mixed graph, then the LM head writes the logits: the
    # argmax of a full size-8 step comes from the greedy graph of size 8, the eager one's.
    prompts, _ = workload(n=8, seed=4)
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * 8
    want = tokens(engine("none", seed=11), prompts, params)
    llm = engine("full", seed=11)
    assert tokens(llm, prompts, params) == want
    assert llm.engine.sampler.graph_sampler.graphs[(8, *GREEDY)][0].replays == 11


@pytest.mark.parametrize("mode", ["full_decode_only", "full"])
def test_biased_penalized_and_seeded_steps_sample_in_graphs_as_eager_does(fake_graphs, mode):
    # 8 requests fill the captured size 8, each with some of a logit bias, penalties, a
    # seed and top-p, two greedy with a penalty: every decode step replays an adjusted
    # variant and takes eager's tokens (the same generator draws, the same arithmetic);
    # an all-greedy penalized batch replays the greedy variant, which draws nothing.
    prompts, _ = workload(n=8, seed=5)
    options = [
        dict(temperature=0.9, logit_bias={7: 3.0, 11: -2.0}),
        dict(temperature=0.8, top_p=0.9, seed=5),
        dict(frequency_penalty=1.5),
        dict(temperature=1.0, presence_penalty=0.7, seed=9),
        dict(temperature=0.7, frequency_penalty=-0.5, logit_bias={3: 1.0}),
        dict(presence_penalty=-1.0),
        dict(temperature=0.9, top_p=0.8, logit_bias={42: 100.0}),  # (42 every time)
        dict(temperature=1.1, seed=3, frequency_penalty=0.4),
    ]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, **o) for o in options]
    want = tokens(engine("none", seed=11), prompts, params)
    llm = engine(mode, seed=11)
    graphs = llm.engine.sampler.graph_sampler.graphs
    assert tokens(llm, prompts, params) == want
    assert want[6] == [42] * 12
    assert graphs[8, True, True, True][0].replays == 11  # every decode step after the prefill
    greedy = [SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=1.0)] * 8
    assert tokens(llm, prompts, greedy) == tokens(engine("none", seed=11), prompts, greedy)
    assert graphs[8, True, None, False][0].replays == 11
    # sampled with penalties and no seed: the variant without the seeds' hash
    unseeded, fresh = [replace(p, seed=None) for p in params], engine(mode, seed=11)
    want = tokens(engine("none", seed=11), prompts, unseeded)
    assert tokens(fresh, prompts, unseeded) == want
    assert fresh.engine.sampler.graph_sampler.graphs[8, True, True, False][0].replays == 11


def test_a_steps_biases_follow_its_rows_as_requests_end(fake_graphs):
    # Requests end at different steps, so the rows under each bias move; the sampling
    # graph's bias buffer is rewritten only when a step's rows' biases differ from the
    # last step's. A bias of 100 makes its token certain: a stale row would show. (Seeded:
    # padded steps would otherwise draw other numbers than eager's on the CPU.)
    prompts, _ = workload(n=8, seed=6)
    params = [
        SamplingParams(
            max_tokens=3 + 2 * i,
            ignore_eos=True,
            temperature=0.9,
            seed=i,
            logit_bias={5 * i: 100.0} if i % 2 else {},
        )
        for i in range(8)
    ]
    want = tokens(engine("none", seed=11), prompts, params)
    assert tokens(engine("full", seed=11), prompts, params) == want
    for i in range(1, 8, 2):
        assert want[i] == [5 * i] * len(want[i])
    assert all(5 * j not in want[i] for i in range(0, 8, 2) for j in range(1, 8, 2))


def test_every_sampled_step_has_a_graph_among_the_cuda_variants():
    # On CUDA one graph serves top-p and seeds or not (the kernels cost the same): every
    # key a step can ask for maps to one of CUDA_VARIANTS; elsewhere to VARIANTS itself.
    from ostinato.engine.sample.graph_sampler import CUDA_VARIANTS, GraphSampler

    asked = [(False, cut, False) for cut in (True, False)]
    asked += [(True, cut, seeded) for cut in (True, False) for seeded in (True, False)]
    asked += [(True, None, False)]
    sampler = object.__new__(GraphSampler)
    for keyed, variants in ((True, CUDA_VARIANTS), (False, GRAPH_VARIANTS)):
        sampler.keyed = keyed
        keys = {sampler._key(8, *a)[1:] for a in asked}
        assert keys == set(variants), keyed


@pytest.mark.parametrize("biased", [False, True])
def test_keyed_steps_take_eager_tokens_in_graphs_padded_or_not(biased):
    # On CUDA (``keyed``) each sampled row draws from a key the host takes, a seeded
    # row's from its seed: a graph reads the staged keys and holds no generator, and an
    # eager step takes the same keys, so 3 rows replayed at the captured size 4 take an
    # eager step's tokens, step after step (the generator's draws shifted them before).
    from fakes import FakePlatform

    from ostinato.engine.sample.adjust import OutputCounts
    from ostinato.engine.sample.graph_sampler import CUDA_VARIANTS, GraphSampler
    from ostinato.engine.sample.step_sampler import StepOutput, StepSampler

    rows, vocab, cpu = 8, 50, torch.device("cpu")
    static = torch.zeros(rows, vocab)
    counts = OutputCounts(vocab, rows, cpu)
    drawn = torch.Generator().manual_seed(1)
    graphs = GraphSampler(FakePlatform(), None, drawn, lambda n: static[:n], rows, cpu, counts)
    graphs.keyed, graphs.variants = True, CUDA_VARIANTS
    graphs.capture([4, 8])
    graphed = StepSampler(torch.Generator().manual_seed(7), cpu, counts, graphs)
    eager = StepSampler(torch.Generator().manual_seed(7), cpu, OutputCounts(vocab, rows, cpu))
    graphed.keyed = eager.keyed = True
    bias = {5: 2.0} if biased else {}
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, logit_bias=bias),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(),
    ]
    state, g, got, want = drawn.get_state(), torch.Generator().manual_seed(0), [], []
    for step in range(6):
        static.copy_(torch.randn(rows, vocab, generator=g))
        indices = [step + 5] * 3
        graphed.prepare(params, indices)
        got.append(graphed.tokens(params, StepOutput(static[:3], graph_size=4), indices).tolist())
        want.append(eager.tokens(params, StepOutput(static[:3].clone()), indices).tolist())
    assert got == want
    assert graphs.graphs[4, biased, True, False][0].replays == 6
    assert torch.equal(drawn.get_state(), state)  # (no draw from the generator)
    # one key a row a step from each stream, so both streams stand at the same place
    assert graphed.key_stream.integers(1 << 32) == eager.key_stream.integers(1 << 32)


def test_compile_ahead_queues_every_sampling_graphs_kernels_in_one_pass(monkeypatch):
    # KernelOptions.compile_ahead: before the captures, one pass inside compile_ahead()
    # over every variant of every size and each size's log probabilities (what each
    # capture's warm-up would otherwise compile, one after the other).
    import contextlib

    from ostinato.engine.sample import graph_sampler
    from ostinato.engine.sample.graph_sampler import CUDA_VARIANTS, GraphSampler

    depth = []

    @contextlib.contextmanager
    def ahead():
        depth.append(1)
        yield
        depth.pop()

    monkeypatch.setattr(graph_sampler, "compile_ahead", ahead)
    sampler = object.__new__(GraphSampler)
    sampler.variants = CUDA_VARIANTS
    calls = []
    sampler._sample = lambda n, *variant: calls.append((n, variant, len(depth)))
    sampler._logprobs_of = lambda n: lambda: calls.append((n, "logprobs", len(depth)))
    sampler._compile_ahead([1, 8])
    want = [(n, v) for n in (1, 8) for v in (*CUDA_VARIANTS, "logprobs")]
    assert [(n, v) for n, v, _ in calls] == want
    assert all(inside == 1 for _, _, inside in calls) and not depth


def test_a_penalized_greedy_sample_counts_its_tokens_in_the_table():
    # (On CUDA the argmax's second kernel counts, so inside compile_ahead(), where the
    # kernels only compile and the tokens are unwritten memory, nothing is counted: an
    # index_add_ of those tokens once indexed the table out of bounds on an H200.
    # test_gpu_argmax checks that; here the torch path's count.)
    from ostinato.engine.sample.graph_sampler import GraphSampler

    sampler = object.__new__(GraphSampler)
    rows, vocab = 4, 11
    sampler.floats = torch.ones(4, rows)
    sampler.ints = torch.tensor([[0] * rows, [0] * rows, [2, 0, 3, 3]])  # 3: padding's row
    sampler.bias = torch.zeros(rows, vocab)
    sampler.table = torch.zeros(rows, vocab)
    sampler.floats[2:] = 0.0  # no penalty: the logits' own argmax
    logits = torch.randn(rows, vocab)
    sampler.logits = lambda n: logits[:n]
    tokens = sampler._sample(3, True, None, False)
    assert tokens.tolist() == logits[:3].argmax(-1).tolist()
    want = torch.zeros(rows, vocab)
    for row, token in zip([2, 0, 3], tokens.tolist(), strict=True):
        want[row, token] += 1
    assert torch.equal(sampler.table, want)


def test_a_steps_values_reach_the_graphs_buffers_in_one_copy_and_pad_the_rest():
    # The floats (temperature, top-p, penalties) and ints (seed keys, seeded, counts'
    # rows) share one buffer: an adjusted step writes both, padding rows greedy, top-p 1,
    # unseeded, counted in the scratch row; a plain sampled step writes only the floats.
    from fakes import FakePlatform

    from ostinato.engine.sample.adjust import OutputCounts
    from ostinato.engine.sample.graph_sampler import GraphSampler

    rows, vocab = 8, 11
    counts = OutputCounts(vocab, rows, torch.device("cpu"))
    sampler = GraphSampler(
        FakePlatform(), None, torch.Generator(), lambda n: torch.zeros(n, vocab), rows,
        torch.device("cpu"), counts,
    )  # fmt: skip
    floats = [[0.7, 0.9], [0.95, 1.0], [0.5, 0.0], [0.25, 0.1]]
    sampler._stage(4, floats, ([11, 0], [1, 0], [3, counts.scratch]))
    assert sampler.floats[:, :4].tolist() == [
        [0.699999988079071, 0.8999999761581421, 0.0, 0.0],
        [0.949999988079071, 1.0, 1.0, 1.0],
        [0.5, 0.0, 0.0, 0.0],
        [0.25, 0.10000000149011612, 0.0, 0.0],
    ]
    assert sampler.ints[:, :4].tolist() == [[11, 0, 0, 0], [1, 0, 0, 0], [3, 8, 8, 8]]
    sampler._stage(2, [[0.3], [0.8]])
    assert sampler.floats[:2, :2].tolist() == [[0.30000001192092896, 0.0], [0.800000011920929, 1.0]]
    assert sampler.ints[:, :4].tolist() == [[11, 0, 0, 0], [1, 0, 0, 0], [3, 8, 8, 8]]


def test_sampling_graphs_captured_a_graph_per_unit_leave_the_steps_state_between():
    # A background start captures one graph per hold of the step turn, and steps sample
    # between: each capture must leave the generator where the steps left it and count
    # its draws only in the scratch row, whatever a step wrote before.
    import contextlib

    from fakes import FakePlatform

    from ostinato.engine.sample.adjust import OutputCounts
    from ostinato.engine.sample.graph_sampler import GraphSampler

    rows, vocab = 4, 11
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab)
    counts = OutputCounts(vocab, rows, torch.device("cpu"))
    sampler = GraphSampler(
        FakePlatform(), None, generator, lambda n: logits[:n], rows, torch.device("cpu"), counts
    )
    seen = []

    @contextlib.contextmanager
    def unit():
        state = generator.get_state()
        yield
        assert torch.equal(generator.get_state(), state)  # the captures drew, then reset
        seen.append((len(sampler.graphs), sorted(sampler.logprob_graphs)))
        torch.rand(3, generator=generator)  # a step between two units draws ...
        sampler.ints[2].fill_(0)  # ... and writes its request's row of the counts

    sampler.capture([1, 2, 4], unit=unit)
    v = len(sampler.variants)
    want = [(0, [])]  # the buffers first, then each variant's graph, then log probabilities
    for i, n in enumerate([1, 2, 4]):
        done = sorted([1, 2, 4][:i])
        want += [(v * i + j, done) for j in range(1, v + 1)] + [(v * (i + 1), [*done, n])]
    assert seen == want, seen
    assert sorted(sampler.logprob_graphs) == [1, 2, 4]
    table = counts.table
    assert table[: counts.scratch].sum() == 0 and table[counts.scratch].sum() > 0


class Recording(torch.Tensor):
    """A tensor whose slices' ``copy_`` calls are recorded (in ``copies``)."""

    @staticmethod
    def __new__(cls, base, copies):
        out = base.as_subclass(cls)
        out.copies = copies
        return out

    def __getitem__(self, index):
        view = super().__getitem__(index).as_subclass(Recording)
        view.copies = self.copies
        return view

    def copy_(self, src, *args, **kwargs):
        self.copies.append(src.shape)
        return super().copy_(src, *args, **kwargs)


def test_log_probabilities_come_from_a_graph_and_equal_eager_ones(fake_graphs):
    # 8 requests asking for log probabilities (greedy and sampled, 0 to 20 alternatives)
    # fill the captured size 8: each decode step's come from the logprob graph, equal
    # to eager steps' (the same tokens, log probabilities and alternatives).
    prompts, _ = workload(n=8, seed=6)
    ks = [0, 1, 5, 20, 3, 0, 20, 7]
    params = [
        SamplingParams(max_tokens=10, ignore_eos=True, logprobs=k, temperature=0.9 * (i % 2))
        for i, k in enumerate(ks)
    ]
    want = engine("none", seed=11).generate(prompts, params)
    llm = engine("full", seed=11)
    sampler = llm.engine.sampler.graph_sampler
    graph, _ = sampler.logprob_graphs[8]
    copies = []
    chosen = sampler.chosen
    sampler.chosen = Recording(chosen, copies)
    got = llm.generate(prompts, params)
    assert graph.replays == 9  # every decode step after the prefill
    # The sampling graphs write their tokens where the logprob graph reads them: no copy.
    assert copies == [] and all(out.data_ptr() == chosen.data_ptr() for out in (
        entry[1] for key, entry in sampler.graphs.items() if key[2] is not None
    ))  # fmt: skip
    for w, g, k in zip(want, got, ks, strict=True):
        assert w.token_ids == g.token_ids and len(g.logprobs) == 10
        for a, b in zip(w.logprobs, g.logprobs, strict=True):
            assert a.token_id == b.token_id and len(b.top) == k
            assert abs(a.logprob - b.logprob) < 1e-5
            assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_greedy_steps_and_speculative_engines_take_no_sampling_graph(fake_graphs):
    llm = engine("full_decode_only")
    prompts, params = workload(n=4)
    tokens(llm, prompts, params)  # greedy: the decode graph's argmax, no second replay
    assert all(g.replays == 0 for g, _ in llm.engine.sampler.graph_sampler.graphs.values())
    spec = engine("full_decode_only", speculative=SpeculativeConfig.parse("ngram", 2))
    assert spec.engine.sampler.graph_sampler is None  # verification samples its 1 + k rows
    full = engine("full")  # (sampling graphs over the logits the LM head writes)
    tokens(full, prompts, params)  # greedy: the greedy graph's argmax, no sampling graph
    replayed = {k for k, (g, _) in full.engine.sampler.graph_sampler.graphs.items() if g.replays}
    assert replayed and all(k[1:] == GREEDY for k in replayed)


def test_greedy_rows_of_sampled_steps_under_async_scheduling_stay_greedy(fake_graphs):
    # Half the requests sample, half are greedy rows of the same steps, so every decode
    # step runs the sampling graph with per-row temperatures staged through two pinned
    # sets in turn while asynchronous scheduling stages step N+1 during step N. A row
    # given another row's temperature would sample: the greedy requests must come out as
    # they do alone in an eager engine. (Sampled outputs themselves differ between sync
    # and async scheduling, graphs or not: the two schedule different steps around
    # preemption, so the draws fall to other rows; only the distribution is the same.)
    prompts, params = preempting_mix()
    sampled = [replace(p, temperature=0.9, top_p=0.8) for p in params]
    mixed = [s if i % 2 else p for i, (p, s) in enumerate(zip(params, sampled, strict=True))]
    greedy = [i for i in range(len(params)) if i % 2 == 0]
    alone = engine("none", backend=None, num_blocks=10, seed=4)  # (the seed draws weights)
    want = [alone.generate([prompts[i]], [params[i]])[0].token_ids for i in greedy]
    for mode, asyn in (("full_decode_only", False), ("full_decode_only", True), ("full", True)):
        llm = engine(mode, num_blocks=10, async_scheduling=asyn, seed=4)
        outs = llm.generate(prompts, mixed)
        assert llm.num_preemptions > 0
        assert sum(g.replays for g, _ in llm.engine.sampler.graph_sampler.graphs.values()) > 0
        assert [outs[i].token_ids for i in greedy] == want


@pytest.mark.parametrize("mode", ["full_decode_only", "full", "piecewise"])
def test_background_capture_gives_the_tokens_of_a_blocking_capture(fake_graphs, mode):
    """Steps start before any graph is ready (eager), go on while the thread captures,
    and end replaying; greedy tokens equal the blocking engine's. One step at a time:
    the test double's capture runs the ops it records (a real one runs nothing), so it
    overwrites static outputs that an asynchronous step in flight still reads; the GPU
    test covers asynchronous scheduling."""
    compiler = "eager" if mode == "piecewise" else None
    prompts, params = workload(n=6, seed=5)
    blocking = engine(mode, compiler=compiler)
    want = tokens(blocking, prompts, params)
    blocking.close()
    llm = engine(mode, compiler=compiler, capture="background", async_scheduling=False)
    assert llm.background is not None
    assert tokens(llm, prompts, params) == want
    assert llm.wait_for_graphs(timeout=60), llm.background.summary()
    assert llm.capture_report.num_graphs == blocking.capture_report.num_graphs
    replays = sum(g.replays for g in fake_graphs.graphs)
    assert tokens(llm, prompts, params) == want
    assert sum(g.replays for g in fake_graphs.graphs) > replays  # now they replay
    llm.close()


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_background_start_loads_the_sampling_kernels_before_its_first_graph(
    fake_graphs, monkeypatch, mode
):
    """On the capture thread, while steps still run eagerly: after the compile where
    the start compiles (the steps need that first), before any graph is captured (the
    load's parse held graph replays where it ran later, on an H100)."""
    from ostinato.engine.worker import sampling_graphs

    seen = []

    def load(runner):
        compiled = runner.forward is not runner.model
        seen.append((threading.current_thread().name, len(fake_graphs.graphs), compiled))

    monkeypatch.setattr(sampling_graphs, "load_kernels", load)
    compiler = "eager" if mode == "piecewise" else None
    llm = engine(mode, compiler=compiler, capture="background", async_scheduling=False)
    assert llm.wait_for_graphs(timeout=60), llm.background.summary()
    assert seen == [("ostinato-capture", 0, mode == "piecewise")]
    llm.close()


def test_a_background_start_freezes_what_its_thread_made_before_it_is_done(fake_graphs):
    """What the capture thread made (the graphs here) lives as long as the engine: frozen
    (``heap.freeze_heap``) before ``wait_for_graphs`` returns, as a blocking start's is,
    no later full collection walks it. The collector stays on."""
    import gc

    llm = engine("full", capture="background", async_scheduling=False)
    assert llm.wait_for_graphs(timeout=60), llm.background.summary()
    made = list(fake_graphs.graphs)
    assert made and not walked(made)
    assert gc.isenabled()
    llm.close()


def test_a_background_starts_line_names_the_kernel_plans_it_waited_for(fake_graphs, monkeypatch):
    # With compiled pieces the plans are made before the thread starts (a first start
    # measures them for tens of seconds on a GPU; graphs of the eager model defer them,
    # test_deferred_plans): the start-up line says so, and counts none of the thread's
    # compile as its own.
    import time

    from ostinato.engine.worker.runner import ModelRunner

    plan = ModelRunner.plan_kernels

    def slow_plan(self, defer=False):
        time.sleep(0.3)
        return plan(self, defer)

    monkeypatch.setattr(ModelRunner, "plan_kernels", slow_plan)
    llm = engine("piecewise", compiler="eager", capture="background", async_scheduling=False)
    startup = llm.engine.parts.startup
    assert startup.background and startup.kernels_s >= 0.3 and startup.compile_s == 0.0
    assert f"kernel plans {startup.kernels_s:.1f}; compile and capture in the background" in (
        llm.describe()
    )
    assert llm.wait_for_graphs(timeout=60)
    llm.close()


@pytest.mark.parametrize("mode", ["full", "full_decode_only", "none", "piecewise"])
def test_the_default_capture_is_background_for_graphs_that_compile_nothing(fake_graphs, mode):
    """``capture="auto"``: FULL graphs of the eager model are captured on a thread, the
    sampling graphs last (then a sampled decode step replays one); modes with compiled
    pieces, or none, capture before the engine returns. Tokens equal a blocking
    capture's; a finished background capture lets the ladder be replanned."""
    compiler = "eager" if mode == "piecewise" else None
    prompts, params = workload(n=6, seed=5)
    want = tokens(engine(mode, compiler=compiler), prompts, params)
    llm = engine(mode, compiler=compiler, capture="auto", async_scheduling=False)
    background = mode in ("full", "full_decode_only")
    assert (llm.background is not None) == background
    assert tokens(llm, prompts, params) == want
    assert llm.wait_for_graphs(timeout=60)
    sampler = llm.engine.sampler.graph_sampler
    assert (sampler is not None) == background
    if background:
        sampled = SamplingParams(max_tokens=6, temperature=0.9, ignore_eos=True)
        replays = sum(g.replays for g in fake_graphs.graphs)
        llm.generate([[5, 6, 7], [8, 9]], sampled)
        assert sum(g.replays for g in fake_graphs.graphs) > replays
        assert "graphs: background" not in llm.describe()
    if mode == "full":
        llm.replan_graphs(4 * 1024, granule=1024)  # refused while a capture runs
    llm.close()


def test_auto_capture_stays_blocking_where_background_is_refused():
    from ostinato.engine.api.arguments import auto_capture
    from ostinato.engine.api.engine_args import GraphArgs, ParallelArgs
    from ostinato.engine.spec.speculative import SpeculativeConfig
    from ostinato.modes import GraphMode

    graphs, one = GraphArgs(), ParallelArgs()
    full = GraphMode.FULL
    assert auto_capture(graphs, one, None, full, True) == "background"
    assert auto_capture(graphs, one, None, GraphMode.FULL_DECODE_ONLY, True) == "background"
    assert auto_capture(graphs, one, None, full, False) == "blocking"  # no graphs here
    for mode in (None, GraphMode.NONE, GraphMode.PIECEWISE, GraphMode.FULL_AND_PIECEWISE):
        assert auto_capture(graphs, one, None, mode, True) == "blocking"  # compiles
    assert auto_capture(GraphArgs(verify="capture"), one, None, full, True) == "blocking"
    two = ParallelArgs(tensor_parallel_size=2)
    assert auto_capture(graphs, two, None, full, True) == "blocking"
    split = ParallelArgs(micro_batching=True)
    assert auto_capture(graphs, split, None, full, True) == "blocking"
    spec = SpeculativeConfig("self", 2, 1)
    assert auto_capture(graphs, one, spec, full, True) == "blocking"
    assert auto_capture(graphs, one, SpeculativeConfig("ngram", 2), full, True) == "blocking"


@pytest.mark.parametrize(
    "to, faster",
    [("piecewise", True), ("piecewise", False), ("full_and_piecewise", True)],
)
def test_staged_capture_serves_at_once_and_upgrades_where_faster(
    fake_graphs, to, faster, monkeypatch
):
    """FULL graphs of the eager model before the engine returns; the compiled stage's
    graphs captured on a thread, and a bucket moved to them only where measured faster
    (the test double's timer says which); greedy tokens equal the blocking engine's
    before, during and after. One step at a time (see the background test). Upgraded to
    FULL_AND_PIECEWISE, the decodes move to its decode graphs (whose steps compute
    their own argmax) and the mixed steps to its pieces."""
    from ostinato import staged

    def timer(runtime, dispatch, rows, meta):
        runtime.manager.run(dispatch, rows, meta)
        first = runtime.mode is GraphMode.FULL  # (the upgrade's is piecewise or FAP)
        return 1.0 if first else (0.5 if faster else 2.0)

    monkeypatch.setattr(staged, "wall_timer", timer)
    prompts, params = workload(n=6, seed=5)
    want = tokens(engine("full", compiler=None), prompts, params)
    llm = engine(to, compiler="eager", capture="staged", async_scheduling=False)
    assert llm.mode is GraphMode.FULL and llm.engine.runner.piecewise is None
    assert llm.capture_report.num_graphs > 0  # the first stage, before it returned
    assert tokens(llm, prompts, params) == want  # while the upgrade proceeds
    assert llm.wait_for_graphs(timeout=120), llm.background.summary()
    upgrade = llm.background
    assert upgrade.decisions and all(d.upgraded == faster for d in upgrade.decisions.values())
    assert bool(upgrade.upgraded) == faster
    # (the upgrade's buckets moved: FULL_AND_PIECEWISE's decode graphs and pieces)
    kinds = {d.uniform_decode for d in upgrade.upgraded}
    assert kinds == ({True, False} if to == "full_and_piecewise" else {False} if faster else set())
    assert tokens(llm, prompts, params) == want
    assert "graph upgrade done" in llm.background.summary()
    llm.close()


def test_a_staged_start_freezes_what_its_upgrade_made_before_it_is_done(fake_graphs, monkeypatch):
    """The upgrade's graphs live as long as the engine: frozen before ``wait_for_graphs``
    returns, as a background start's are. The collector stays on."""
    import gc

    from ostinato import staged

    def timer(runtime, dispatch, rows, meta):
        runtime.manager.run(dispatch, rows, meta)
        return 1.0 if runtime.mode is GraphMode.FULL else 0.5

    monkeypatch.setattr(staged, "wall_timer", timer)
    llm = engine("piecewise", compiler="eager", capture="staged", async_scheduling=False)
    first = len(fake_graphs.graphs)
    assert llm.wait_for_graphs(timeout=120), llm.background.summary()
    made = fake_graphs.graphs[first:]  # (the upgrade's)
    assert made and llm.background.upgraded and not walked(made) and gc.isenabled()
    llm.close()


def test_a_staged_start_s_line_names_its_first_stage_s_capture(fake_graphs):
    # Its first stage's graphs are captured before the engine returns (only the upgrade is
    # on a thread): the line splits that time as a blocking start's does.
    llm = engine("piecewise", compiler="eager", capture="staged", async_scheduling=False)
    startup = llm.engine.parts.startup
    assert not startup.background and startup.capture_s > 0
    assert f"capture {startup.capture_s:.1f}; kernels" in startup.summary()
    assert "in the background" not in startup.summary()
    llm.close()


def test_staged_capture_refuses_what_it_cannot_upgrade():
    with pytest.raises(ValueError, match="capture='staged': upgrades to compiled pieces"):
        engine("full", capture="staged")
    with pytest.raises(ValueError, match="capture='staged': needs a compiler"):
        engine("piecewise", capture="staged", compiler=None)
    with pytest.raises(ValueError, match="capture='staged': not with verify='capture'"):
        engine("piecewise", capture="staged", verify="capture")
    with pytest.raises(ValueError, match="capture='staged': upgrades graphs, which cpu"):
        engine("piecewise", capture="staged")  # (no fake platform here: the CPU's own)


def test_background_capture_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="capture: one of auto, blocking, background, staged"):
        engine("full", capture="lazy")
    with pytest.raises(ValueError, match="speculative='self'"):
        engine("full", capture="background", speculative="self:1")
    # (no fake platform here: the CPU's own, which has no graphs to capture on a thread)
    with pytest.raises(ValueError, match="capture='background': captures graphs on a thread"):
        engine("full", capture="background")


class StaleAttention(TorchAttention):
    """Planted bug: the torch backend (host lengths) claimed capturable, so a replay runs
    the lengths of its capture."""

    graph_support = AttentionGraphSupport.ALWAYS


class LeakyAttention(DenseGraphAttention):
    """Planted bug: every row's output moves with the mean query of all rows, padding
    included."""

    def __call__(self, q, k_cache, v_cache, meta, scale, out, rope=None):
        super().__call__(q, k_cache, v_cache, meta, scale, out, rope)
        out.add_(q.mean(0, keepdim=True))


def test_checked_graphs_pass_and_say_so_in_the_start_up_line(fake_graphs):
    prompts, params = workload(n=4)
    want = tokens(engine("none", backend=None), prompts, params)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphDemotedWarning)
        llm = engine("full_decode_only", verify="capture")
        assert tokens(llm, prompts, params) == want
    assert "verify: capture, 0 demoted" in llm.describe()


def test_a_padding_leak_is_demoted_at_capture_naming_each_bucket(fake_graphs):
    with pytest.warns(GraphDemotedWarning, match=r"num_tokens=8.*uniform_decode=True.*first 4"):
        llm = engine("full_decode_only", verify="capture", backend=LeakyAttention())
    stats = llm.graph_stats()
    assert {d.num_tokens for d in stats.demoted} == {2, 4, 8}  # 1 row: nothing to perturb
    assert "3 demoted" in llm.describe()


def test_sampled_checks_demote_stale_graphs_and_serve_the_eager_tokens(fake_graphs):
    prompts, params = workload(n=5)
    want = tokens(engine("none", backend=None), prompts, params)
    with pytest.warns(GraphDemotedWarning, match="sampled step"):
        llm = engine("full_decode_only", verify="sample", verify_every=1, backend=StaleAttention())
        assert tokens(llm, prompts, params) == want  # nothing wrong left the engine
    stats = llm.graph_stats()
    assert stats.demoted and stats.checked_replays >= len(stats.demoted)
    assert stats.eager_steps[EagerReason.DEMOTED] > 0


def test_verify_is_checked_before_the_model_loads():
    with pytest.raises(ValueError, match="verify: 'often'"):
        engine("full_decode_only", verify="often")
    with pytest.raises(ValueError, match="not with verify='capture'"):
        engine("full_decode_only", verify="capture", capture="background")


def test_replanned_graphs_pad_less_within_budget_and_keep_the_tokens(fake_graphs):
    # FakePlatform charges each capture 1 KiB of pool; a skewed load of 1 to 3 requests.
    prompts, params = workload(n=3)
    want = tokens(engine("none", backend=None), prompts, params)
    llm = engine("full", max_capture_size=16)
    before = llm.engine.runner.manager.dispatcher.sizes
    for b in (1, 3, 3, 1):
        assert tokens(llm, prompts[:b], params) == want[:b]
    change = llm.replan_graphs(4 * 1024, granule=1024)
    sizes = llm.engine.runner.manager.dispatcher.sizes
    assert change is not None and change.padded_after <= change.padded_before
    assert len(sizes) <= 4 < len(before) and sizes[-1] == before[-1] == 16
    assert tokens(llm, prompts, params) == want  # (a prefill of 3 prompts is above 16)
    with pytest.raises(ValueError, match="needs graph mode FULL"):
        engine("full_decode_only").replan_graphs(1 << 30)


@pytest.mark.parametrize("ahead", [True, False])
def test_sampling_graphs_prepared_beside_steps_draw_and_count_nowhere_a_step_reads(ahead):
    # prepare runs on the capture thread without the step turn (outside the epilogue's
    # units): its pass (the kernels compiled ahead, or every graph's work run once) must
    # use a generator and a counts table of its own, and leave the sampler's own in
    # place for the captures.
    from fakes import FakePlatform

    from ostinato.engine.sample.adjust import OutputCounts
    from ostinato.engine.sample.graph_sampler import GraphSampler

    live = torch.Generator().manual_seed(5)
    state = live.get_state()
    counts = OutputCounts(vocab=50, capacity=4, device=torch.device("cpu"))
    logits = torch.zeros(8, 50)
    sampler = GraphSampler(
        FakePlatform(), None, live, lambda n: logits[:n], 8, torch.device("cpu"), counts
    )
    seen = []

    def pass_(sizes):
        seen.append((sampler.generator, sampler.table, tuple(sizes)))
        sampler.generator.manual_seed(1)  # (a draw: moves the generator it was given)

    run_once = sampler._every_graphs_work

    def once(n):
        seen.append((sampler.generator, sampler.table, (n,)))
        run_once(n)  # (the real pass: draws, and counts the penalized variants' tokens)

    sampler._compile_ahead, sampler._every_graphs_work = pass_, once
    sampler.prepare([1, 2, 8], ahead=ahead)
    once_each = [(1,), (2,), (8,)]  # (after a compile ahead too: each kernel loaded)
    assert [s for _, _, s in seen] == ([(1, 2, 8)] if ahead else []) + once_each
    generator, table, _ = seen[0]
    assert all(g is generator and t is table for g, t, _ in seen)
    assert generator is not live and torch.equal(live.get_state(), state)
    assert counts._table is None and table.shape == (5, 50)  # the steps' table not made
    assert sampler.generator is live and sampler.compiled == ahead
    assert sampler.bias.shape == (8, 50)
    assert table.sum() > 0  # (the pass's own table counted its draws)


@pytest.mark.parametrize("prepared", [True, False])
def test_sampling_graphs_prepared_beside_steps_capture_without_a_warm_up_in_the_turn(prepared):
    # A background start prepares the sampling graphs beside the steps (each size's work
    # run once): inside the step turn each capture then only records (the warm-up and
    # its drain there were a tenth of those holds on an H200); unprepared, it warms up.
    from fakes import FakePlatform, FlaggedTurn

    from ostinato.engine.sample.adjust import OutputCounts
    from ostinato.engine.sample.graph_sampler import GraphSampler

    counts = OutputCounts(vocab=50, capacity=4, device=torch.device("cpu"))
    logits = torch.randn(4, 50)
    platform = FakePlatform()
    sampler = GraphSampler(
        platform, None, torch.Generator(), lambda n: logits[:n], 4, torch.device("cpu"), counts
    )
    if prepared:
        sampler.prepare([2, 4], ahead=False)
    turn, runs, drains = FlaggedTurn(), [], []
    sample, logprobs_of = sampler._sample, sampler._logprobs_of

    def seen(kind):
        runs.append((kind, turn.held, platform.capturing is not None))

    def counted(*args):
        seen("sample")
        return sample(*args)

    def counted_logprobs(n):
        fn = logprobs_of(n)
        return lambda: (seen("logprobs"), fn())[1]

    sampler._sample, sampler._logprobs_of = counted, counted_logprobs
    sampler.platform.synchronize_outside_capture = lambda: drains.append(turn.held)
    sampler.capture([2, 4], unit=turn)
    graphs = 2 * (len(sampler.variants) + 1)
    recorded = [r for r in runs if r[2]]
    warm_ups = [r for r in runs if not r[2]]
    assert len(recorded) == graphs and all(held for _, held, _ in recorded)
    assert len(warm_ups) == (0 if prepared else graphs)
    assert drains == ([] if prepared else [True] * graphs)
    assert len(sampler.graphs) == 2 * len(sampler.variants)
    assert sorted(sampler.logprob_graphs) == [2, 4]


@pytest.mark.parametrize("keyed", [True, False])
@pytest.mark.parametrize("records_apart", [True, False])
def test_sampling_graphs_that_draw_nothing_record_with_the_turn_let_go(keyed, records_apart):
    # CUDA's sampling graphs draw from staged keys, no generator: inside a background
    # start's epilogue unit (which sets ``recording_apart``) they record with the step
    # turn let go, as FULL graphs do, so a step waits for no recording; their warm-ups
    # stay in the turn. A graph with the generator registered records in the turn.
    import contextlib

    from fakes import FakePlatform, FlaggedTurn

    from ostinato.engine.sample.adjust import OutputCounts
    from ostinato.engine.sample.graph_sampler import GraphSampler
    from ostinato.graph import recording_apart

    counts = OutputCounts(vocab=50, capacity=4, device=torch.device("cpu"))
    logits = torch.randn(4, 50)
    platform = FakePlatform()
    platform.records_apart = records_apart
    generator = torch.Generator().manual_seed(3)
    sampler = GraphSampler(
        platform, None, generator, lambda n: logits[:n], 4, torch.device("cpu"), counts
    )
    sampler.keyed = keyed  # (on CUDA it is; the CPU's torch path takes the keys too)
    turn, runs = FlaggedTurn(), []

    @contextlib.contextmanager
    def apart():
        turn.held = False  # (the background capture's ``_apart``: the turn let go)
        try:
            yield
        finally:
            turn.held = True

    @contextlib.contextmanager
    def unit():
        with turn(), recording_apart(apart):
            yield

    sample = sampler._sample

    def counted(*args):
        runs.append((turn.held, platform.capturing is not None))
        return sample(*args)

    sampler._sample = counted
    state = generator.get_state()
    sampler.capture([2, 4], unit=unit)
    recorded = [held for held, capturing in runs if capturing]
    warm_ups = [held for held, capturing in runs if not capturing]
    assert len(recorded) == len(warm_ups) == 2 * len(sampler.variants)
    assert all(warm_ups)  # (each warm-up in the turn: it runs the kernels)
    assert recorded == [not (keyed and records_apart)] * len(recorded), recorded
    assert torch.equal(generator.get_state(), state)
    assert len(sampler.graphs) == 2 * len(sampler.variants)
    assert sorted(sampler.logprob_graphs) == [2, 4]


def test_a_warm_up_beside_the_steps_touches_nothing_a_step_reads(fake_graphs):
    # On CUDA a background capture warms each FULL graph up beside the steps, outside
    # their turn (``_warm_step``): on inputs of its own, its K/V in the null block only,
    # so a step's inputs and its requests' cache stay as the step left them.
    llm = engine("full", max_capture_size=16)
    prompts, params = workload(4)
    tokens(llm, prompts, params)  # (the inputs and the cache hold real steps')
    runner = llm.engine.runner
    buffers = vars(runner.inputs).values()
    inputs = [t.clone() for t in buffers if isinstance(t, torch.Tensor)]
    cache = [t[1:].clone() for t in (*runner.cache.k, *runner.cache.v)]  # (block 0: null)
    assert any(t.count_nonzero() > 0 for t in cache)
    for d in runner.manager.dispatcher.keys(GraphMode.FULL):
        with torch.inference_mode():  # (as on the capture thread)
            out = runner._warm_step(d)
        rows = [t.shape[0] for t in (out if isinstance(out, tuple) else (out,))]
        assert rows == [d.num_tokens] * len(rows), (d, rows)
    now = [t for t in vars(runner.inputs).values() if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(inputs, now, strict=True))
    after = [t[1:] for t in (*runner.cache.k, *runner.cache.v)]
    assert all(torch.equal(a, b) for a, b in zip(cache, after, strict=True))
    assert runner._scratch is not None and runner._scratch is not runner.inputs
    assert tokens(llm, prompts, params) == tokens(engine("none", backend=None), prompts, params)


def test_a_sampled_steps_values_reach_the_device_before_its_graphs_run(fake_graphs):
    # Each seeded row's key changes every step (it mixes in the token's index): when the
    # step's graphs are queued, the sampling graph's buffers already hold this step's
    # keys, so no copy waits between the step's graph and its sampling graph.
    from ostinato.engine.sample.rows import StepRows

    llm = engine("full_decode_only", seed=11)
    runner, graph_sampler = llm.engine.runner, llm.engine.sampler.graph_sampler
    seen = []
    execute = runner.execute

    def recording(step, *args, **kwargs):
        params = [s.request.params for s in step.scheduled]
        if step.uniform_decode and all(p.seed is not None for p in params):
            want = StepRows.of(params).keys([s.start + len(s.tokens) for s in step.scheduled])
            seen.append(graph_sampler.ints[0, : len(params)].tolist() == want.tolist())
        return execute(step, *args, **kwargs)

    runner.execute = recording
    prompts, _ = workload(n=8, seed=7)
    params = [
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=s) for s in range(8)
    ]
    tokens(llm, prompts, params)
    assert len(seen) == 7 and all(seen)
