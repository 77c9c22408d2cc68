"""The all-reduce fused with the residual add and RMSNorm (``all_reduce_norm_op``): the
measured threshold against brute force, what the kernel takes, and the kernel's
protocol under Triton's CPU interpreter with two and three ranks as processes over
shared memory (with Triton installed; the GPU test runs it on two H200s)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from dist_workers import cpu_plan_key
from interpreted import interpreted, needs_triton

from ostinato.distributed.all_reduce_plan import AllReduceAlgo, AllReducePlan
from ostinato.engine.api import startup
from ostinato.engine.model.all_reduce_norm_op import FusedReduceNorm, rows_faster
from ostinato.engine.worker.compile_cache import CompileCache


def test_the_threshold_is_the_longest_prefix_of_counts_measured_faster():
    g = torch.Generator().manual_seed(0)
    ladder = [1, 2, 4, 8, 16, 32, 64]
    for _ in range(500):
        fused = (torch.rand(7, generator=g) * 10).tolist()
        apart = (torch.rand(7, generator=g) * 10).tolist()
        want = 0
        for k in range(len(ladder) + 1):  # brute force: every prefix all faster
            if all(fused[i] < apart[i] for i in range(k)):
                want = ladder[k - 1] if k else 0
        assert rows_faster(ladder, fused, apart) == want
    assert rows_faster(ladder, [1.0] * 7, [1.0] * 7) == 0  # a tie keeps the two ops


def test_the_kernel_takes_its_dtype_and_width_up_to_its_rows_only():
    fused = object.__new__(FusedReduceNorm)  # (no symmetric memory on the CPU)
    fused.dtype, fused.hidden, fused.max_rows = torch.bfloat16, 64, 16
    x = torch.zeros(16, 64, dtype=torch.bfloat16)
    assert fused.serves(x, x)
    assert not fused.serves(torch.zeros(17, 64, dtype=torch.bfloat16), torch.zeros(17, 64))
    assert not fused.serves(torch.zeros(17, 64, dtype=torch.bfloat16), x)
    assert not fused.serves(x.float(), x.float())
    assert not fused.serves(x[:, :32], x[:, :32])
    assert not fused.serves(x[:0], x[:0])
    fused.max_rows = 0
    assert not fused.serves(x[:1], x[:1])


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_start_up_measures_the_fused_rows_once_then_reads_them(tmp_path, monkeypatch, one_rank):
    monkeypatch.setattr(CompileCache, "plan_key", cpu_plan_key)
    asked = []

    def setup(group, device, dtype, hidden, max_rows=None):
        asked.append(max_rows)
        return SimpleNamespace(max_rows=16 if max_rows is None else max_rows)

    monkeypatch.setattr(startup, "setup_fused_reduce_norm", setup)
    plan = AllReducePlan.only(AllReduceAlgo.ONE_SHOT, 1 << 20)
    reducer = SimpleNamespace(group=one_rank, group_name="g", dtype=torch.bfloat16, plan=plan)
    cache, cpu = CompileCache(tmp_path), torch.device("cpu")
    assert startup.fused_reduce_norm(reducer, cpu, 64, cache).max_rows == 16
    assert startup.fused_reduce_norm(reducer, cpu, 64, cache).max_rows == 16
    assert asked == [None, 16]  # measured once, then read
    startup.fused_reduce_norm(reducer, cpu, 128, cache)  # another width: measured
    reducer.plan = AllReducePlan.nccl()  # the two ops it is timed against changed
    startup.fused_reduce_norm(reducer, cpu, 64, cache)
    startup.fused_reduce_norm(reducer, cpu, 64, None)  # no cache: measured, nothing kept
    assert asked == [None, 16, None, None, None]


_RANKS = """
import os, sys, torch, multiprocessing as mp
from ostinato.engine.kernels.all_reduce_norm import (
    PROGRAMS, SENTINEL, SLOTS, all_reduce_add_norm_rows, buffer_elements)
from ostinato.engine.model.norm_op import add_rms_norm_reference

world, hidden, dtype = int(sys.argv[1]), 64, torch.float16
segment = 8 * hidden
# Shared before the fork: every rank sees every buffer at the same address.
size = buffer_elements(8, hidden, world)
bufs = [torch.full((size,), SENTINEL, dtype=dtype).share_memory_() for _ in range(world)]
table = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.int64)
steps = [1, 5, 8, 3, 8]  # not a multiple of SLOTS: the slot count wraps unevenly
g = torch.Generator().manual_seed(0)
xs = [[torch.randn(n, hidden, generator=g).to(dtype) for _ in range(world)] for n in steps]
xs[0][0][0, :4] = -0.0  # the sentinel's value, sent: summed as +0.0
rs = [torch.randn(n, hidden, generator=g).to(dtype) for n in steps]
w = torch.rand(hidden, generator=g).to(dtype) + 0.5

def rank(k, q):
    slots = torch.full((PROGRAMS,), SLOTS - 2, dtype=torch.int32)
    bad = []
    for i, n in enumerate(steps):
        out, total = torch.empty(n, hidden, dtype=dtype), torch.empty(n, hidden, dtype=dtype)
        all_reduce_add_norm_rows(xs[i][k], rs[i], w, 1e-5, out, total, table, slots,
                                 segment, k, world)
        s = sum(x.float() for x in xs[i]).to(dtype)
        want = add_rms_norm_reference(s, rs[i], w, 1e-5)
        if not (torch.equal(out, want[0]) and torch.equal(total, want[1])):
            bad.append(i)
    q.put((k, bad, slots.tolist()))

ctx = mp.get_context("fork")
q = ctx.Queue()
procs = [ctx.Process(target=rank, args=(k, q)) for k in range(world)]
[p.start() for p in procs]
got = sorted(q.get(timeout=240) for _ in range(world))
[p.join() for p in procs]
assert all(not bad for _, bad, _ in got), got
assert all(c == [(SLOTS - 2 + len(steps)) % SLOTS] * PROGRAMS for _, _, c in got), got
sign = torch.tensor([SENTINEL], dtype=dtype).view(torch.int16)
assert all(torch.equal(b.view(torch.int16), sign.expand(size)) for b in bufs), "a row left"
print("ok", world)
"""


@needs_triton
@pytest.mark.parametrize("world", [2, 3])
def test_the_protocol_under_the_interpreter_equals_the_two_ops(world):
    assert interpreted(_RANKS, str(world), timeout=300).strip().endswith(f"ok {world}")
