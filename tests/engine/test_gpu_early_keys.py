"""GPU tests of the attention kernel reading a step's older keys before its PDL wait:
never a key the kernel before it is still writing, and the same outputs as waiting."""

import pytest
import torch

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def _case(new: int, kv_heads: int = 3, heads: int = 9, head_dim: int = 64):
    """Decode-like tokens (the last two padding) whose last ``new`` keys a slow PDL
    writer stores while attention runs: the cache holds other ("stale") values there."""
    bs, blocks, n = 16, 80, 6
    k_cache = torch.randn(blocks, bs, kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(blocks - 1, device=DEVICE)[: n * 5].view(n, 5) + 1).int()
    pos = torch.tensor([5, 17, 63, 64, 40, 33], device=DEVICE)
    pos[-2:] = -1
    q = torch.randn(n, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    real = pos >= 0
    keys = (pos[real, None] - torch.arange(new, device=DEVICE)[None, :]).flatten()
    rows = torch.arange(n, device=DEVICE)[real].repeat_interleave(new)
    slots = (tables[rows, keys // bs].long() * bs + keys % bs).contiguous()
    fresh_k = 4 * torch.randn(len(slots), kv_heads, head_dim, device=DEVICE, dtype=k_cache.dtype)
    fresh_v = 4 * torch.randn_like(fresh_k)
    req = torch.arange(n, device=DEVICE, dtype=torch.int32)
    return q, k_cache, v_cache, pos, req, tables, slots, fresh_k, fresh_v


@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("splits", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (3, 1)])
def test_early_keys_never_read_a_key_still_being_written(new, splits, heads, kv_heads):
    from pdl_writer import slow_write_kv

    from ostinato.engine.kernels.attention_launch import launch_for
    from ostinato.engine.kernels.paged_attention import paged_attention

    q, kc, vc, pos, req, tables, slots, fk, fv = _case(new, kv_heads, heads)
    scale = 64**-0.5
    flat_k, flat_v = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])
    stale_k, stale_v = kc.clone(), vc.clone()
    # the launch the early read takes by default (at 6 tokens of one KV head, 16 splits:
    # the widest tile), pinned for the launches compared with it, which read nothing early
    config = launch_for(splits, len(pos) * kv_heads, early=True, head_dim=64)

    def attend(new_keys: int) -> torch.Tensor:
        kc.copy_(stale_k)
        vc.copy_(stale_v)
        slow_write_kv(fk, fv, flat_k, flat_v, slots)
        pinned = config if new_keys == 0 else None
        return paged_attention(
            q, kc, vc, pos, req, tables, scale, splits=splits, pdl=True, new_keys=new_keys,
            config=pinned,
        )  # fmt: skip

    got = attend(new)
    want = paged_attention(q, kc, vc, pos, req, tables, scale, splits=splits, config=config)
    assert torch.equal(got, want)
    waiting = attend(0)  # reads nothing before its wait
    assert torch.equal(waiting, want)
    if new > 1:
        # The control: a bound one key short reads the key two before the position
        # early, while the writer still holds it back, so the test can tell.
        short = attend(new - 1)
        assert not torch.equal(short, want), "the early read raced nothing: no test"


def test_a_negative_bound_is_refused():
    from ostinato.engine.kernels.paged_attention import paged_attention

    q, kc, vc, pos, req, tables, *_ = _case(1)
    with pytest.raises(ValueError, match="new_keys must be >= 0"):
        paged_attention(q, kc, vc, pos, req, tables, 0.125, new_keys=-1)
