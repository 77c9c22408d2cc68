"""The sampling kernels (``kernels.sampling``) against torch's sampler and log-softmax.

A row's draws come from its key alone, so the kernel and the torch path of ``sample``
with every row seeded by the same keys take the same tokens: the same hash, the same
nucleus. They can part only where float32 arithmetic in another order moves a token
across the nucleus's edge or a near-tie of the race, so the checks allow a few rows in a
thousand. On GPUs (marker ``gpu``); under Triton's CPU interpreter
(``TRITON_INTERPRET=1``, with Triton installed) the same checks run on the CPU.
"""

import os

import pytest
import torch

from ostinato.engine.sample.sampler import Seeds, sample

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Under the interpreter the checks are CPU tests; else they need a GPU.
GPU = pytest.mark.skipif(False, reason="") if INTERPRETED else pytest.mark.gpu


def _device() -> torch.device:
    return torch.device("cpu") if INTERPRETED else torch.device("cuda")


def _rows(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row temperatures (a quarter greedy) and top-p (a third uncut)."""
    t = torch.rand(n, generator=g) * 1.5 + 0.2
    t[torch.rand(n, generator=g) < 0.25] = 0.0
    p = torch.rand(n, generator=g) * 0.9 + 0.05
    p[torch.rand(n, generator=g) < 0.33] = 1.0
    return t, p


def _reference(logits: torch.Tensor, t, p, keys) -> torch.Tensor:
    """``sample``'s torch path on the CPU, every row seeded by ``keys``."""
    cpu = logits.float().cpu()
    seeds = Seeds(keys.cpu(), torch.ones(len(keys), dtype=torch.bool))
    return sample(cpu, t, p, None, False, seeds)


def _check(vocab: int, dtype: torch.dtype, rows: int) -> tuple[int, int]:
    from ostinato.engine.kernels.sampling import sample_rows

    device = _device()
    g = torch.Generator().manual_seed(vocab + rows)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    t, p = _rows(rows, g)
    keys = torch.randint(0, 1 << 32, (rows,), generator=g)
    got = sample_rows(logits.to(device), t.to(device), p.to(device), keys.to(device))
    want = _reference(logits, t, p, keys)
    greedy = t <= 0
    assert torch.equal(got.cpu()[greedy], want[greedy])  # the argmax: no arithmetic to part
    return int((got.cpu() == want).sum()), rows


@GPU
@pytest.mark.parametrize("vocab", [1000, 4097, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rounds", [0, 2])
def test_kernel_draws_equal_torchs_from_the_same_keys(vocab, dtype, rounds, monkeypatch):
    # rounds 0: every top-p row finishes in one program; 2: the default spread checks
    from ostinato.engine.kernels import sampling

    monkeypatch.setattr(sampling, "ROUNDS", rounds)
    same, n = _check(vocab, dtype, 64 if not INTERPRETED else 8)
    assert same >= n - max(1, n // 100), f"{same} of {n} rows equal"


@GPU
def test_kernel_draws_written_into_a_given_buffer_are_the_same_draws():
    # A sampling graph's tokens go where its log probabilities' graph reads them.
    from ostinato.engine.kernels.sampling import sample_rows

    device = _device()
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 3000, generator=g) * 4).to(device)
    t, p = (x.to(device) for x in _rows(6, g))
    keys = torch.randint(0, 1 << 32, (6,), generator=g).to(device)
    home = torch.full((10,), -1, dtype=torch.long, device=device)
    got = sample_rows(logits, t, p, keys, out=home[:6])
    assert got.data_ptr() == home.data_ptr()
    assert torch.equal(got, sample_rows(logits, t, p, keys)) and (home[6:] == -1).all()
    with pytest.raises(ValueError, match="out must be contiguous int64"):
        sample_rows(logits, t, p, keys, out=home[:5])


@GPU
def test_kernel_draws_follow_the_nucleus_distribution():
    # 20000 rows of one 8-token distribution, each its own key: top_p 0.7 keeps the three
    # most likely tokens (0.3 + 0.2 + 0.15 reaches 0.65 < 0.7, so the fourth too), and
    # each kept token's share is within 4 sigma of its renormalised probability.
    from ostinato.engine.kernels.sampling import sample_rows

    device, n = _device(), 20000 if not INTERPRETED else 2000
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    logits = probs.log().expand(n, 8).contiguous().to(device)
    ones = torch.ones(n, device=device)
    keys = torch.randperm(1 << 20)[:n].to(device) * 4099
    tokens = sample_rows(logits, ones, ones * 0.7, keys).cpu()
    # the fourth and fifth tie at 0.1: the mass above both is 0.65 < 0.7, so both stay
    kept = probs.clone()
    kept[5:] = 0
    kept /= kept.sum()
    share = torch.bincount(tokens, minlength=8) / n
    sigma = (kept * (1 - kept) / n).sqrt()
    assert ((share - kept).abs() <= 4 * sigma + 1e-9).all(), share


@GPU
@pytest.mark.parametrize("vocab", [1000, 151936])
def test_row_logprobs_equal_log_softmax_and_topk(vocab):
    from ostinato.engine.kernels.sampling import row_logprobs

    device = _device()
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(16, vocab, generator=g) * 3
    tokens = torch.randint(0, vocab, (16,), generator=g)
    chosen, ids, values = row_logprobs(logits.to(device), tokens.to(device), 5)
    logp = torch.log_softmax(logits, dim=-1)
    top = logp.topk(5, dim=-1)
    torch.testing.assert_close(chosen.cpu(), logp.gather(1, tokens[:, None]).squeeze(1))
    assert torch.equal(ids.cpu(), top.indices)  # (random floats: no ties)
    torch.testing.assert_close(values.cpu(), top.values)
    none = row_logprobs(logits.to(device), tokens.to(device), 0)
    assert none[1].shape == (16, 0)


@GPU
def test_row_logprobs_break_ties_by_the_smaller_id_and_never_repeat_one():
    # Logits of few distinct values (ties within and across chunks), rows masked by
    # -inf (as a logit bias does) down to fewer finite columns than the alternatives
    # asked for, and -0.0 beside +0.0. The alternatives are the stable order (value,
    # then the smaller id): no id twice, -inf columns last in id order.
    from ostinato.engine.kernels.sampling import CHUNK, row_logprobs

    device = _device()
    g = torch.Generator().manual_seed(3)
    vocab, k = 2 * CHUNK + 37, 6
    logits = torch.randint(-2, 3, (6, vocab), generator=g).float()
    logits[1, :] = float("-inf")
    logits[1, [5, CHUNK + 3]] = 1.0  # two finite columns, in two chunks
    logits[2, :] = float("-inf")
    logits[2, 2 * CHUNK + 1] = 0.5  # one, in the last chunk
    logits[3, :] = torch.where(logits[3] == 0, -0.0, logits[3])
    tokens = torch.randint(0, vocab, (6,), generator=g)
    tokens[1], tokens[2] = 5, 2 * CHUNK + 1
    chosen, ids, values = row_logprobs(logits.to(device), tokens.to(device), k)
    logp = torch.log_softmax(logits, dim=-1)
    order = torch.sort(-logp, dim=-1, stable=True).indices[:, :k]
    assert torch.equal(ids.cpu(), order), (ids.cpu(), order)
    torch.testing.assert_close(values.cpu(), logp.gather(1, order))
    torch.testing.assert_close(chosen.cpu(), logp.gather(1, tokens[:, None]).squeeze(1))


@GPU
def test_row_logprobs_find_the_alternatives_however_the_chunks_hold_them():
    # The kernels walk only the k chunks of largest maxima: alternatives all in one
    # chunk (the other walked chunks then give none), one in each of k chunks, and in
    # the last, partial chunk must all come out as torch's topk has them.
    from ostinato.engine.kernels.sampling import CHUNK, row_logprobs

    device = _device()
    g = torch.Generator().manual_seed(5)
    vocab, k = 9 * CHUNK + 11, 20
    logits = torch.randn(3, vocab, generator=g)
    logits[0, 3 * CHUNK + 7 : 3 * CHUNK + 7 + k] += 40 + torch.arange(k).float()
    logits[1, torch.arange(k) % 9 * CHUNK + torch.arange(k)] += 40 + torch.arange(k).float()
    logits[2, -k:] += 40 + torch.arange(k).float()
    tokens = torch.tensor([0, 1, vocab - 1])
    chosen, ids, values = row_logprobs(logits.to(device), tokens.to(device), k)
    top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    assert torch.equal(ids.cpu(), top.indices)
    torch.testing.assert_close(values.cpu(), top.values)


@GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_penalize_kernel_equals_the_torch_arithmetic(dtype, with_bias):
    # Rows read the table through their indices (two rows share one; the scratch row
    # with no penalty); float32 within an ulp of torch's (the kernel's penalty is an fma).
    from ostinato.engine.kernels.penalize import penalize_rows

    device = _device()
    g = torch.Generator().manual_seed(11)
    n, vocab = 5, 5003
    logits = (torch.randn(n, vocab, generator=g) * 4).to(dtype)
    bias = torch.randn(n, vocab, generator=g) if with_bias else None
    table = torch.randint(0, 4, (4, vocab), generator=g).float()
    rows = torch.tensor([0, 2, 2, 3, 1])
    presence = torch.tensor([0.5, -1.0, 0.0, 2.0, 0.0])
    frequency = torch.tensor([0.25, 0.4, -1.5, 0.0, 0.0])
    want = logits.float() + (bias if with_bias else 0.0)
    counts = table[rows]
    want = want - (presence[:, None] * (counts > 0) + frequency[:, None] * counts)
    on = [t.to(device) if t is not None else None for t in (logits, bias, presence, frequency)]
    got = penalize_rows(*on, table.to(device), rows.to(device))
    torch.testing.assert_close(got.cpu(), want, rtol=2e-7, atol=2e-6)


@GPU
@pytest.mark.parametrize("with_bias", [False, True])
def test_penalties_inside_the_first_kernel_draw_what_penalized_logits_draw(with_bias):
    # ``sample_rows(..., penalties)`` applies ``penalize_rows``' arithmetic in its first
    # kernel: the same float32 values, so the very same tokens, greedy rows and top-p too.
    from ostinato.engine.kernels.penalize import penalize_rows
    from ostinato.engine.kernels.sampling import sample_rows

    device = _device()
    g = torch.Generator().manual_seed(13)
    n, vocab = 24, 5003
    logits = (torch.randn(n, vocab, generator=g) * 4).to(torch.bfloat16)
    bias = torch.randn(n, vocab, generator=g) if with_bias else None
    table = torch.randint(0, 4, (6, vocab), generator=g).float()
    rows = torch.randint(0, 6, (n,), generator=g)
    presence, frequency = torch.rand(n, generator=g) * 2, torch.rand(n, generator=g)
    t, p = _rows(n, g)
    keys = torch.randint(0, 1 << 32, (n,), generator=g)
    on = [x.to(device) if x is not None else None for x in (bias, presence, frequency, table, rows)]
    x, t, p, keys = logits.to(device), t.to(device), p.to(device), keys.to(device)
    want = sample_rows(penalize_rows(x, *on), t, p, keys)
    before = on[3].clone()
    got = sample_rows(x, t, p, keys, tuple(on))
    assert torch.equal(got.cpu(), want.cpu())
    # ... and counts each row's token in its row of the table, once a row, rows that
    # share a table row (as padding rows share the scratch row) adding up.
    added = torch.zeros_like(table).index_put_((rows, got.cpu()), torch.ones(n), accumulate=True)
    assert torch.equal((on[3] - before).cpu(), added)


@pytest.mark.gpu
def test_row_logprobs_write_the_alternatives_a_device_count_asks_for_inside_a_graph():
    # A graph captured for 20 alternatives computes as many as ``live_k`` holds at each
    # replay (clamped to 20); the columns after them keep what was there.
    from ostinato.engine.kernels.sampling import row_logprobs

    device = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(8, 151936, generator=g) * 3).to(device)
    tokens = torch.randint(0, 151936, (8,), generator=g).to(device)
    live = torch.full((1,), 20, dtype=torch.long, device=device)
    row_logprobs(logits, tokens, 20, live)  # warm-up: compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chosen, ids, values = row_logprobs(logits, tokens, 20, live)
    logp = torch.log_softmax(logits.float(), dim=-1)
    for k in (5, 0, 20, 64):
        ids.fill_(-7)
        live.fill_(k)
        graph.replay()
        top = logp.topk(min(k, 20), dim=-1)
        torch.testing.assert_close(chosen, logp.gather(1, tokens[:, None]).squeeze(1))
        assert torch.equal(ids[:, : min(k, 20)], top.indices)  # (random floats: no ties)
        torch.testing.assert_close(values[:, : min(k, 20)], top.values)
        assert (ids[:, min(k, 20) :] == -7).all()


@pytest.mark.gpu
def test_a_replayed_sampling_graph_takes_the_eager_calls_tokens():
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(3)
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(8, 32000, generator=g) * 3).to(device)
    t, p = (v.to(device) for v in _rows(8, g))
    t[0] = 1.0  # (at least one sampled row)
    sample(logits, t, p, gen, False)  # warm-up: compile outside the capture
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(gen)
    state = gen.get_state()
    with torch.cuda.graph(graph):
        out = sample(logits, t, p, gen, False)
    gen.set_state(state)
    for _ in range(3):
        before = gen.get_state()
        graph.replay()
        replayed = out.clone()
        after = gen.get_state()
        gen.set_state(before)
        eager = sample(logits, t, p, gen, False)
        assert torch.equal(replayed, eager)
        assert torch.equal(gen.get_state(), after)  # both advance it alike


@GPU
@pytest.mark.parametrize("rounds", [0, 2])
def test_rows_with_nan_logits_still_name_one_of_their_columns(rounds, monkeypatch):
    # A broken model's NaN must not send an index past the vocabulary to the next step's
    # embedding: a greedy row takes its first NaN (torch.argmax's answer), a sampled one
    # a column of its own. Nor may a row of -inf (nothing above its candidate, a zero
    # total): its top-p checks once sent it past the vocabulary and the last one then
    # looped for ever.
    from ostinato.engine.kernels import sampling

    monkeypatch.setattr(sampling, "ROUNDS", rounds)
    device, vocab = _device(), 5000
    logits = torch.randn(5, vocab)
    logits[0, 100] = float("nan")
    logits[1, 17] = float("nan")
    logits[2] = float("nan")
    logits[4] = float("-inf")
    t, p = torch.tensor([0.0, 1.0, 0.7, 0.9, 0.8]), torch.tensor([1.0, 0.9, 0.5, 0.3, 0.5])
    keys = torch.randint(0, 1 << 32, (5,))
    got = sampling.sample_rows(logits.to(device), t.to(device), p.to(device), keys.to(device))
    got = got.cpu()
    assert bool(((got >= 0) & (got < vocab)).all()), got
    assert int(got[0]) == int(torch.argmax(logits[0])) == 100
