"""A slow K/V writer for GPU tests of kernels that read before their PDL wait: it lets
the next kernel launch at once, walks a chain of dependent loads (``rounds`` of them,
each a round trip), then writes rows of K and V at their slots. A kernel launched after
it with PDL that reads those slots before its wait sees the old values."""

import torch
import triton
import triton.language as tl


@triton.jit
def _slow_write_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, chain_ptr, rounds, ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):  # fmt: skip
    tl.extra.cuda.gdc_launch_dependents()
    at = tl.zeros([1], tl.int32)
    for _ in range(rounds):  # each load's address is the one before's value (all 0)
        at = tl.load(chain_ptr + at)
    r = tl.program_id(0)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    e = tl.arange(0, ROW_PAD)
    # The stores wait for the chain: their mask reads its end (always 0, which the
    # compiler cannot know, so it keeps the loop).
    row = (e < ROW) & (at == 0)
    k = tl.load(k_ptr + r * ROW + e, mask=row)
    v = tl.load(v_ptr + r * ROW + e, mask=row)
    tl.store(kc_ptr + slot * ROW + e, k, mask=row)
    tl.store(vc_ptr + slot * ROW + e, v, mask=row)


def slow_write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slots: torch.Tensor, rounds: int = 20000,
) -> None:  # fmt: skip
    """Writes ``k, v`` (``[n, kv_heads, head_dim]``, contiguous) at flat ``slots`` of the
    caches after about ``rounds`` dependent loads, launched with PDL (it triggers first)."""
    chain = torch.zeros(1, dtype=torch.int32, device=k.device)
    row = k.shape[1] * k.shape[2]
    _slow_write_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slots, chain, rounds, ROW=row,
        ROW_PAD=triton.next_power_of_2(row), num_warps=1, launch_pdl=True,
    )  # fmt: skip
