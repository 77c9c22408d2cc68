"""GPU tests of the split merge asking L2 for the next weight (``l2_prefetch``): the
attention output is the same bits with it and without, in and out of graphs, for
weights of any size and start, and nothing is written to the weight."""

from unittest import mock

import pytest
import torch

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
MiB = 1 << 20


def _case(n: int = 3, kv_heads: int = 3, heads: int = 9, head_dim: int = 64):
    bs, blocks = 16, 64
    k_cache = torch.randn(blocks, bs, kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(blocks - 1, device=DEVICE)[: n * 8].view(n, 8) + 1).int()
    pos = torch.tensor([5, 100, 127][:n], device=DEVICE)
    q = torch.randn(n, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    req = torch.arange(n, device=DEVICE, dtype=torch.int32)
    return q, k_cache, v_cache, pos, req, tables


def _weights() -> dict[str, torch.Tensor]:
    """Weights the merge may be asked to warm: large (several loop steps of the
    prefetch), a chunk and a bit, under a chunk, and starting 16 bytes into a tensor."""
    big = torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16)  # 32 MiB
    return {
        "32 MiB": big,
        "a chunk and 2 bytes": torch.randn(2049, device=DEVICE, dtype=torch.bfloat16),
        "under a chunk": torch.randn(100, device=DEVICE, dtype=torch.bfloat16),
        "16 bytes in": big.view(-1)[8:],
    }


def test_warm_chunks_never_reach_past_the_tensor_or_a_start_the_instruction_refuses():
    from ostinato.engine.kernels.l2_prefetch import CHUNK_BYTES, warm_chunks

    w = torch.empty(3 * CHUNK_BYTES // 2 + 50, device=DEVICE, dtype=torch.bfloat16)
    assert warm_chunks(w, 1 << 30) == 3  # the last partial chunk is left out
    assert warm_chunks(w, 2 * CHUNK_BYTES + 5) == 2
    assert warm_chunks(w, -1) == 0
    assert warm_chunks(None, 1 << 30) == 0
    assert warm_chunks(w[1:], 1 << 30) == 0  # 2 bytes in: not 16-byte aligned
    assert warm_chunks(w[8:], 1 << 30) == 2
    assert warm_chunks(w[: 2 * 2048].view(2, 2048).t(), 1 << 30) == 0  # not contiguous
    assert warm_chunks(w[:0], 1 << 30) == 0


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("splits", [2, 16])
def test_warming_leaves_the_output_and_the_weight_as_they_were(splits, pdl):
    from ostinato.engine.kernels import attention_launch
    from ostinato.engine.kernels.paged_attention import paged_attention

    q, kc, vc, pos, req, tables = _case()
    want = paged_attention(q, kc, vc, pos, req, tables, 0.125, splits=splits, pdl=pdl)
    for name, w in _weights().items():
        before = w.clone()
        for warm_bytes in (8 * MiB, 64 * MiB):  # one loop step a program, and several
            with mock.patch.object(attention_launch, "WARM_BYTES", warm_bytes):
                got = paged_attention(
                    q, kc, vc, pos, req, tables, 0.125, splits=splits, pdl=pdl, warm=w
                )
            torch.cuda.synchronize()
            assert torch.equal(got, want), name
        assert torch.equal(w, before), name


def test_a_graph_of_attention_with_warm_replays_on_new_queries():
    from ostinato.engine.kernels.paged_attention import paged_attention

    q, kc, vc, pos, req, tables = _case()
    w = torch.randn(2048, 2048, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    args = (q, kc, vc, pos, req, tables, 0.125)
    paged_attention(*args, splits=8, out=out, pdl=True, warm=w)  # compiles outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*args, splits=8, out=out, pdl=True, warm=w)
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        graph.replay()
        want = paged_attention(*args, splits=8)
        assert torch.equal(out, want)
