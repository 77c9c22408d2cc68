"""GPU tests of the greedy choice's argmax kernels: torch's ``argmax(dim=-1)`` index on
ties, NaN, signed zeros and infinities, in both float dtypes, eagerly and replayed."""

import pytest
import torch

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def _pdl_options() -> list[bool]:
    return [False, True] if torch.cuda.get_device_capability()[0] >= 9 else [False]


def _cases(vocab: int, g: torch.Generator) -> list[torch.Tensor]:
    few = torch.randint(0, 5, (9, vocab), generator=g, device=DEVICE).float()  # many ties
    few[3] = 0.0  # every token tied: the first wins
    few[4, -1] = 7.0  # the maximum in the last chunk, which may be partial
    smooth = torch.randn(9, vocab, generator=g, device=DEVICE)
    negative = -torch.rand(5, vocab, generator=g, device=DEVICE) - 1  # floats whose bits flip
    special = torch.zeros(6, vocab, device=DEVICE)
    special[0] = -0.0
    special[0, vocab // 2] = 0.0  # -0.0 ties +0.0: the first wins
    special[1] = float("-inf")
    special[2, vocab - 1] = float("inf")
    special[3, vocab // 3] = float("nan")  # NaN is the maximum, the first NaN wins
    special[3, vocab - 1] = float("nan")
    special[4, vocab - 1] = float("-nan")
    special[5] = float("-inf")
    special[5, vocab - 1] = -1e30
    return [few, smooth, negative, special]


@pytest.mark.parametrize("vocab", [1, 1000, 1024, 1025, 49152, 128256, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_equals_torch(vocab, dtype):
    from ostinato.engine.kernels.argmax import argmax_rows

    g = torch.Generator(device=DEVICE).manual_seed(vocab)
    for pdl in _pdl_options():
        for logits in _cases(vocab, g):
            x = logits.to(dtype)
            assert torch.equal(argmax_rows(x, pdl), x.argmax(dim=-1)), (pdl, x)


def test_strided_rows_and_no_rows():
    from ostinato.engine.kernels.argmax import argmax_rows

    x = torch.randn(4, 3000, device=DEVICE)
    assert torch.equal(argmax_rows(x[:, :2500]), x[:, :2500].argmax(dim=-1))
    assert torch.equal(argmax_rows(x.t().contiguous().t()), x.argmax(dim=-1))  # column-major
    assert argmax_rows(x[:0]).shape == (0,)


def test_the_tokens_go_where_asked():
    from ostinato.engine.kernels.argmax import argmax_rows

    x = torch.randn(5, 49152, device=DEVICE, dtype=torch.bfloat16)
    buf = torch.full((8,), -1, dtype=torch.int64, device=DEVICE)  # [rows]
    for pdl in _pdl_options():
        got = argmax_rows(x, pdl, out=buf[:5])
        assert got.data_ptr() == buf.data_ptr() and torch.equal(got, x.argmax(dim=-1))
        assert (buf[5:] == -1).all()
    strided = torch.empty(10, dtype=torch.int64, device=DEVICE)[::2]
    for wrong in (buf[:4], buf[:5].int(), strided, torch.empty(5, dtype=torch.int64)):
        with pytest.raises(ValueError, match="out must be contiguous int64"):
            argmax_rows(x, out=wrong)


def test_bad_inputs_are_refused():
    from ostinato.engine.kernels.argmax import MAX_VOCAB, argmax_rows

    with pytest.raises(ValueError, match="2-D floats"):
        argmax_rows(torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="2-D floats"):
        argmax_rows(torch.zeros(2, 3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="columns"):
        argmax_rows(torch.zeros(2, 0, device=DEVICE))
    with pytest.raises(ValueError, match="columns"):
        argmax_rows(torch.empty(1, MAX_VOCAB + 1, device=DEVICE))


def test_replays_on_new_logits_without_reset():
    """Captured once, a graph of the kernels gives each replay's own argmax: nothing of
    an earlier replay's maxima survives into the next (a larger earlier maximum would
    win otherwise)."""
    from ostinato.engine.sample.greedy import greedy_tokens

    vocab = 128256
    logits = torch.randn(8, vocab, device=DEVICE)
    pdl = _pdl_options()[-1]
    greedy_tokens(logits, pdl)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = greedy_tokens(logits, pdl)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    for scale in (100.0, 1.0, 0.01):
        logits.copy_(scale * torch.randn(8, vocab, generator=g, device=DEVICE))
        graph.replay()
        assert torch.equal(out, logits.argmax(dim=-1))


def test_counts_each_token_as_count_tokens_does_and_nothing_while_compiling_ahead():
    """With ``counts`` the second kernel adds one at ``table[rows[i], token]``: the table
    ``adjust.count_tokens`` makes, padding rows sharing one row counted atomically, int32
    and int64 rows; replayed, each replay counts once; inside ``compile_ahead()`` the
    kernels only compile, so nothing is counted (the tokens are not written)."""
    from ostinato.engine.kernels.argmax import argmax_rows
    from ostinato.engine.kernels.launch import compile_ahead
    from ostinato.engine.sample.adjust import count_tokens

    vocab = 49152
    g = torch.Generator(device=DEVICE).manual_seed(3)
    logits = torch.randint(0, 4, (6, vocab), generator=g, device=DEVICE).bfloat16()
    for dtype in (torch.int64, torch.int32):
        rows = torch.tensor([2, 0, 3, 3, 3, 1], dtype=dtype, device=DEVICE)  # 3: padding's
        table = torch.rand(4, vocab, generator=g, device=DEVICE).round()
        want = table.clone()
        tokens = argmax_rows(logits, counts=(table, rows))
        count_tokens(want, rows, logits.argmax(dim=-1))
        assert torch.equal(tokens, logits.argmax(dim=-1)) and torch.equal(table, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax_rows(logits, _pdl_options()[-1], counts=(table, rows))
    before = table.clone()
    graph.replay()
    graph.replay()
    count_tokens(before, rows, logits.argmax(dim=-1))
    count_tokens(before, rows, logits.argmax(dim=-1))
    assert torch.equal(table, before)
    with compile_ahead():
        argmax_rows(logits[:5], counts=(table, rows[:5]))
    torch.cuda.synchronize()
    assert torch.equal(table, before)


def test_bad_counts_are_refused():
    from ostinato.engine.kernels.argmax import argmax_rows

    x = torch.randn(3, 1000, device=DEVICE)
    rows = torch.zeros(3, dtype=torch.long, device=DEVICE)
    table = torch.zeros(2, 1000, device=DEVICE)
    for wrong in (table[:, :999], table.double(), table.cpu(), table.t().contiguous().t()):
        with pytest.raises(ValueError, match="counts' table"):
            argmax_rows(x, counts=(wrong, rows))
    for wrong in (rows[:2], rows.float(), rows.cpu()):
        with pytest.raises(ValueError, match="counts' rows"):
            argmax_rows(x, counts=(table, wrong))
