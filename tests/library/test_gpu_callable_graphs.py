"""``ostinato.graphed`` on the GPU: real CUDA graphs for a random size stream, equal to
eager (FULL; and PIECEWISE split at a custom op), the statistics counting every replay,
and transformers' GPT-2 forward (random weights) through it."""

import random

import pytest
import torch

import ostinato

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@torch.library.custom_op("ostinato_test::mix", mutates_args=("out",))
def mix(x: torch.Tensor, out: torch.Tensor) -> None:  # runs eagerly between pieces
    torch.softmax(x, -1, out=out)


class Mix(torch.nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        mix(x, out)
        return out


def stream(fast, model, shape, sizes, atol):
    for n in sizes:
        x = torch.randn(n, *shape, device="cuda")
        with torch.inference_mode():
            want = model(x)
        torch.testing.assert_close(fast(x), want, atol=atol, rtol=1e-3)


def test_full_graphs_on_a_random_size_stream():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    model = model.cuda().eval()
    fast = ostinato.graphed(model, max_batch_size=32, mode="full")
    sizes = [random.Random(3).randint(1, 40) for _ in range(30)]
    stream(fast, model, (64,), sizes, atol=1e-5)
    stats = fast.stats()
    assert stats.replays == sum(n <= 32 for n in sizes) and stats.eager == sum(
        n > 32 for n in sizes
    )


@pytest.mark.parametrize("mode", ["piecewise", "auto"])
def test_piecewise_graphs_split_at_a_custom_op(mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), Mix(), torch.nn.Linear(128, 64))
    model = model.cuda().eval()
    fast = ostinato.graphed(
        model, max_batch_size=16, mode=mode, splitting_ops=("ostinato_test::mix",)
    )
    stream(fast, model, (64,), [3, 16, 1, 9, 5], atol=1e-5)
    assert fast.stats().replays == 5


def test_gpt2_forward_through_graphed():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).cuda().eval()

    def logits(ids):
        return model(input_ids=ids, use_cache=False).logits

    fast = ostinato.graphed(logits, max_batch_size=8, seq_buckets=(16, 32))
    rng = random.Random(4)
    for _ in range(8):
        n, length = rng.randint(1, 8), rng.randint(2, 32)
        ids = torch.randint(0, 1000, (n, length), device="cuda")
        with torch.inference_mode():
            want = logits(ids)
        # Causal attention: padding after the real positions does not reach them.
        torch.testing.assert_close(fast(ids), want, atol=1e-4, rtol=1e-3)
    assert fast.stats().replays == 8
