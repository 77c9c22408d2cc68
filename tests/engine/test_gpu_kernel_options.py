"""GPU tests of KernelOptions: the small Triton GEMM (split-K, SiLU·mul, in graphs), the
start-up plan, programmatic dependent launch (bitwise the same results), and the engine
with both on against the engine with both off."""

import pytest
import torch
from gpu_harness import lockstep, tiny_engine

from ostinato.engine import KernelOptions
from ostinato.engine.model.linear import Linear
from ostinato.engine.worker.gemm_tuning import plan_small_gemms, triton_chosen

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def needs_pdl():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("swiglu, bias", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_small_gemm_every_config_as_close_to_float32_as_cublas(rows, swiglu, bias, pdl):
    from ostinato.engine.kernels import small_gemm as tg

    if pdl:
        needs_pdl()
    torch.manual_seed(rows)
    n, k = 1000, 1536  # n/2 and n not multiples of any tile, k not of BLOCK_K * split
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device=DEVICE, dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)

    from ostinato.engine.kernels.silu_mul import silu_mul

    def act(y):  # the unfused model: GEMM rounded to bf16, then SiLU·mul
        return silu_mul(y.bfloat16()) if swiglu else y

    want = x.float() @ w.float().T + (b.float() if bias else 0)
    if swiglu:
        g, u = want.bfloat16().float().chunk(2, dim=-1)
        want = torch.nn.functional.silu(g) * u
    cublas = rel_err(act(torch.nn.functional.linear(x, w, b)), want)
    counters = torch.zeros(tg.counters_needed(n), dtype=torch.int32, device=DEVICE)
    for config in tg.CONFIGS:
        if not tg.fits(config, rows, k, 2 if swiglu else 1):
            with pytest.raises(ValueError, match="does not take"):
                tg.small_gemm(x, w, b, counters, config, swiglu, pdl)
            continue
        got = tg.small_gemm(x, w, b, counters, config, swiglu, pdl)
        assert got.shape == (rows, n // 2 if swiglu else n) and got.dtype == torch.bfloat16
        assert rel_err(got, want) < max(2 * cublas, 4e-3), config
        assert int(counters.abs().sum()) == 0, config  # the last program reset them


def test_split_k_gemm_replays_in_a_graph_on_new_inputs():
    from ostinato.engine.kernels import small_gemm as tg

    n, k = 576, 1536
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(4, k, device=DEVICE, dtype=torch.bfloat16)
    counters = torch.zeros(tg.counters_needed(n), dtype=torch.int32, device=DEVICE)
    config = tg.GemmConfig(32, 4)
    tg.small_gemm(x, w, None, counters, config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tg.small_gemm(x, w, None, counters, config, pdl=False)
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, tg.small_gemm(x, w, None, counters, config))
        assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("trigger_first", [False, True])
def test_pdl_chain_in_a_graph_is_bitwise_the_plain_chain(trigger_first):
    # A decode-like chain of our kernels launched with PDL inside one graph: each waits
    # for its predecessor, so the results are the plain launches' bit for bit, whether
    # a kernel lets the next launch before its wait or after.
    needs_pdl()
    from ostinato.engine.kernels.launch_rules import LaunchRules, rules_in_force

    with rules_in_force(LaunchRules(trigger_first=trigger_first)):
        _pdl_chain_is_bitwise_the_plain_chain()


def _pdl_chain_is_bitwise_the_plain_chain() -> None:
    from ostinato.engine.kernels import small_gemm as tg
    from ostinato.engine.kernels.paged_attention import paged_attention, write_kv_fused
    from ostinato.engine.kernels.rms_norm import rms_norm_rows

    torch.manual_seed(0)
    bf = dict(device=DEVICE, dtype=torch.bfloat16)
    rows, hidden, heads, kv_heads, d, bs = 8, 512, 8, 2, 64, 16
    x = torch.randn(rows, hidden, **bf)
    norm_w = torch.randn(hidden, **bf)
    w_qkv = torch.randn((heads + 2 * kv_heads) * d, hidden, **bf) / hidden**0.5
    w_o = torch.randn(hidden, heads * d, **bf) / hidden**0.5
    w_gu = torch.randn(2 * 1024, hidden, **bf) / hidden**0.5
    w_down = torch.randn(hidden, 1024, **bf) / 1024**0.5
    pos = torch.arange(rows, device=DEVICE) * 37 + 5  # up to 264: 17 blocks
    per_seq = 20
    k_cache = torch.randn(rows * per_seq + 1, bs, kv_heads, d, **bf)
    req = torch.arange(rows, device=DEVICE, dtype=torch.int32)
    tables = torch.arange(rows * per_seq, device=DEVICE, dtype=torch.int32).view(rows, -1) + 1
    slots = tables[req, pos // bs].long() * bs + pos % bs
    angle = pos[:, None, None].float() * torch.linspace(0, 1, d, device=DEVICE)
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    counters = torch.zeros(tg.counters_needed(2048), dtype=torch.int32, device=DEVICE)
    config = tg.GemmConfig(32, 2)

    def chain(pdl, kc, vc):
        h = torch.empty_like(x)
        rms_norm_rows(x, None, norm_w, 1e-6, h, None, pdl)
        qkv = tg.small_gemm(h, w_qkv, None, counters, config, pdl=pdl)
        q, k, v = qkv.view(rows, -1, d).split([heads, kv_heads, kv_heads], dim=1)
        write_kv_fused(k, v, kc, vc, slots, (cos, sin), pdl=pdl)
        att = paged_attention(q, kc, vc, pos, req, tables, d**-0.5, rope=(cos, sin), pdl=pdl)
        o = tg.small_gemm(att.view(rows, -1), w_o, None, counters, config, pdl=pdl)
        h2, total = torch.empty_like(o), torch.empty_like(o)
        rms_norm_rows(o, x, norm_w, 1e-6, h2, total, pdl)
        act = tg.small_gemm(h2, w_gu, None, counters, config, swiglu=True, pdl=pdl)
        return tg.small_gemm(act, w_down, None, counters, config, pdl=pdl), kc

    plain, kc_plain = chain(False, k_cache.clone(), k_cache.clone())
    kc, vc = k_cache.clone(), k_cache.clone()
    chain(True, kc.clone(), vc.clone())  # compiles the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, kc_out = chain(True, kc, vc)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)
        assert torch.equal(kc_out, kc_plain)


def test_plan_picks_triton_where_the_rule_says_from_its_measurements():
    linear = Linear(1536, 1000, bias=False).to(DEVICE, torch.bfloat16)
    gate_up = Linear(576, 3072, bias=False).to(DEVICE, torch.bfloat16)
    fp32 = Linear(64, 64).to(DEVICE)
    timings = plan_small_gemms([(linear, False), (gate_up, True), (fp32, False)], [1, 8, 64], True)
    assert {(t.shape.n, t.rows) for t in timings} == {(1000, 1), (1000, 8), (3072, 1), (3072, 8)}
    for t in timings:
        assert t.cublas_us > 0 and t.triton_us > 0
        owner = linear if t.shape.n == 1000 else gate_up
        choice = owner.plan[t.rows] if owner.plan else 0
        assert (choice > 0) == triton_chosen(t, min_gain=0.03), t  # (plan_small_gemms' margin)
        if choice:
            assert choice == t.config
    assert fp32.plan == ()  # 32-bit weights stay on cuBLAS
    print([(t.shape.n, t.shape.swiglu, t.rows, t.cublas_us, t.triton_us) for t in timings])


def test_plans_measured_once_are_read_from_the_compile_cache(tmp_path):
    from ostinato.engine.worker.compile_cache import CompileCache

    cache = CompileCache(tmp_path)
    first = Linear(1536, 1000, bias=False).to(DEVICE, torch.bfloat16)
    timings = plan_small_gemms([(first, False)], [1, 8], True, cache=cache)
    assert timings and len(cache.load_plans()) == 1
    second = Linear(1536, 1000, bias=False).to(DEVICE, torch.bfloat16)
    assert plan_small_gemms([(second, False)], [1, 8], True, cache=cache) == []  # no timing
    assert second.plan == first.plan
    other_rows = Linear(1536, 1000, bias=False).to(DEVICE, torch.bfloat16)
    assert plan_small_gemms([(other_rows, False)], [1, 4], True, cache=cache)  # new key


def test_model_projections_with_forced_triton_plans_match_float32():
    # Every projection of a model through the Triton GEMM (SiLU·mul fused into the
    # gate/up projection), whatever the timing says: as close to float32 as cuBLAS.
    from ostinato.engine.kernels import small_gemm as tg
    from ostinato.engine.model.config import ModelConfig
    from ostinato.engine.model.decoder import DecoderModel
    from ostinato.engine.model.presets import shape

    torch.manual_seed(0)
    config = ModelConfig.from_hf(shape("tiny"))
    model32 = DecoderModel(config).to(DEVICE).eval()
    model = DecoderModel(config).to(DEVICE, torch.bfloat16).eval()
    model.load_state_dict(model32.state_dict())
    pairs = list(zip(model.linears(), model32.linears(), strict=True))
    assert sum(swiglu for (_, swiglu), _ in pairs) == config.num_layers
    with torch.no_grad():
        for (linear, swiglu), (ref32, _) in pairs:
            x = torch.randn(4, linear.in_features, device=DEVICE)
            want = ref32.forward_swiglu(x) if swiglu else ref32(x)
            xb = x.bfloat16()
            base = linear.forward_swiglu(xb) if swiglu else linear(xb)
            linear.use_plan((0, 2, 2, 2, 4), tg.counters_needed(linear.out_features), True)
            got = linear.forward_swiglu(xb) if swiglu else linear(xb)
            assert rel_err(got, want) < max(2 * rel_err(base, want), 4e-3), swiglu


def test_engine_with_pdl_and_small_gemm_follows_the_plain_engine():
    # bf16: the GEMM kernels differ, so logits agree to rounding, not bitwise.
    plain = tiny_engine(
        "full_and_piecewise", torch.bfloat16, kernels=KernelOptions(pdl=False, fused_layers=False)
    )
    tuned = tiny_engine(
        "full_and_piecewise", torch.bfloat16, kernels=KernelOptions(pdl=True, small_gemm=True)
    )
    # Plans measured now, or read from the compile cache a previous run filled.
    assert tuned.engine.runner.kernels.small_gemm and any(
        any(x.plan) for x, _ in tuned.engine.model.linears()
    )
    # One options object reaches every module that launches a kernel, and the backend.
    from ostinato.engine.model.decoder import Attention, Mlp, RMSNorm

    launching = [
        m for m in tuned.engine.model.modules() if isinstance(m, (Attention, RMSNorm, Mlp))
    ]
    assert tuned.engine.model.kernels.pdl and all(
        m.kernels is tuned.engine.model.kernels for m in launching
    )
    assert tuned.engine.runner.backend.pdl and not plain.engine.runner.backend.pdl
    assert lockstep(plain, tuned, tolerance=2e-2) >= {"FULL", "PIECEWISE"}


_AHEAD_CHILD = """
import json, sys
import torch, triton
from gpu_harness import greedy_tokens, tiny_engine
from ostinato.engine import KernelOptions

compiled = []  # (kernel, compiled by a warm-up rather than at a launch)

def hook(*, fn, is_manual_warmup, **_):
    if str(getattr(fn.module, "__name__", fn.module)).startswith("ostinato"):
        compiled.append((fn.name, is_manual_warmup))
    return None  # compile as usual

triton.knobs.runtime.jit_cache_hook = hook
mode, dtype, capture = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3]
llm = tiny_engine(mode, dtype, kernels=KernelOptions(compile_ahead=True), capture=capture)
assert llm.wait_for_graphs(300), llm.background.summary()  # (plans measured, graphs again)
tokens = greedy_tokens(llm, 16)
print(json.dumps({"compiled": compiled, "tokens": tokens}))
"""


@pytest.mark.parametrize(
    "mode,dtype,capture",
    [
        ("full_and_piecewise", "float32", "blocking"),
        ("full", "bfloat16", "blocking"),
        ("full", "bfloat16", "background"),
    ],
)
def test_compile_ahead_compiles_every_kernel_before_its_first_launch(
    tmp_path, mode, dtype, capture
):
    # A fresh process and Triton cache: nothing of ours is compiled yet. In bf16 the
    # small GEMM runs, whose launches specialise on the row count (resident rows). A
    # background start measures its plans after its graphs and captures again the sizes
    # they change: their kernels compile ahead too, not at those captures' launches.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton
    from gpu_harness import greedy_tokens

    if not hasattr(triton, "knobs") or not hasattr(triton, "AsyncCompileMode"):
        pytest.skip("needs Triton's knobs and AsyncCompileMode (3.4 or newer)")
    tests = str(Path(__file__).resolve().parents[1])  # the helpers (gpu_harness) live there
    env = {
        **os.environ,
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        # Plans found in the compile cache turn compile-ahead off (an earlier start
        # compiled the kernels): this start measures its own.
        "OSTINATO_CACHE_DIR": str(tmp_path / "ostinato"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.run(
        [sys.executable, "-c", _AHEAD_CHILD, mode, dtype, capture], env=env, capture_output=True,
        text=True,
        timeout=240, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    doc = json.loads(child.stdout.strip().splitlines()[-1])
    ahead = {name for name, warm in doc["compiled"] if warm}
    at_launch = sorted({name for name, warm in doc["compiled"] if not warm})
    # The norms, SiLU·mul, the K/V write, attention and its split merge, the greedy
    # argmax, all ahead.
    assert {"_rms_norm_kernel", "_silu_mul_kernel", "_write_kv_kernel"} <= ahead
    assert {"_paged_attention_kernel", "_merge_splits_kernel"} <= ahead
    assert {"_chunk_best_kernel", "_row_best_kernel"} <= ahead
    assert at_launch == [], f"compiled at a launch, not ahead (specialisation missed): {at_launch}"
    if dtype == "float32":  # (bf16 plans are timings: another process may pick others)
        plain = tiny_engine(mode, torch.float32)
        assert doc["tokens"] == greedy_tokens(plain, 16)


_FIRST_STEPS_CHILD = """
import json, threading
import torch, triton
from gpu_harness import greedy_tokens, tiny_engine
from ostinato.engine import KernelOptions
from ostinato.engine.worker import runner

plan, at_launch, passes = [], [], []

def hook(*, fn, is_manual_warmup, **_):
    module = str(getattr(fn.module, "__name__", fn.module))
    on_steps = threading.current_thread() is threading.main_thread()
    if module.startswith("ostinato") and on_steps and not is_manual_warmup:
        if plan and plan[0].steps_meanwhile:
            at_launch.append((module, fn.name))
    return None  # compile as usual

def counted(self, *args):
    passes.append(1)
    return eager(self, *args)

eager, runner._eager_pass = runner._eager_pass, counted
triton.knobs.runtime.jit_cache_hook = hook
ahead = KernelOptions(compile_ahead=True)
llm = tiny_engine("full", torch.float32, kernels=ahead, capture="background")
plan.append(llm.engine.runner.kernel_plan)
meanwhile = plan[0].steps_meanwhile
tokens = greedy_tokens(llm, 16)
assert llm.wait_for_graphs(300), llm.background.summary()
doc = {"at_launch": at_launch, "passes": len(passes), "meanwhile": meanwhile, "tokens": tokens}
print(json.dumps(doc))
"""


def test_a_background_start_s_eager_steps_compile_their_kernels_before_launching(tmp_path):
    # A fresh process and Triton cache: the steps run while the start's thread compiles
    # every kernel ahead. Each eager step of a new size first compiles its own kernels
    # together (``KernelPlan.compile_first``): none of the model's compiles at a launch
    # on the steps' thread (the sampler's may: not the runner's). Tokens as blocking.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton
    from gpu_harness import greedy_tokens

    if not hasattr(triton, "knobs") or not hasattr(triton, "AsyncCompileMode"):
        pytest.skip("needs Triton's knobs and AsyncCompileMode (3.4 or newer)")
    tests = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "OSTINATO_CACHE_DIR": str(tmp_path / "ostinato"),  # (no plans: compiles ahead)
        "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.run(
        [sys.executable, "-c", _FIRST_STEPS_CHILD], env=env, capture_output=True, text=True,
        timeout=240, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    doc = json.loads(child.stdout.strip().splitlines()[-1])
    assert doc["meanwhile"] and doc["passes"] > 0, doc
    sampler = ("ostinato.engine.kernels.argmax", "ostinato.engine.kernels.sampling")
    model = sorted({name for module, name in doc["at_launch"] if module not in sampler})
    assert model == [], f"compiled at a step's launch while the start compiled: {model}"
    plain = tiny_engine("full", torch.float32)
    assert doc["tokens"] == greedy_tokens(plain, 16)


def test_fused_layers_are_measured_per_size_and_the_choice_read_back(tmp_path):
    # FULL graphs, fused layers (the defaults): each captured size of at most 16 rows
    # timed fused and unfused, with PDL and without, in a graph, the fastest kept, but
    # where the rules' graph of a size replayed faster than the measured plans' (the
    # start takes the rules' kernels back there: KernelPlan.keep_rules_at); the next
    # engine on the same cache reads the choice; the engine with it follows eager.
    from ostinato.engine.worker.deferred_plans import rules_won

    llm = tiny_engine("full", torch.bfloat16, cache_dir=str(tmp_path))
    runner = llm.engine.runner
    plan, model = runner.kernel_plan, llm.engine.model
    sizes = sorted({s for s in plan.layer_rows if s <= 16})
    timings = plan.layer_timings
    assert sizes and [t.rows for t in timings] == sizes
    assert all(t.fused_us > 0 and t.unfused_us > 0 for t in timings)
    rules = rules_won(runner.deferred_plans.recaptured)
    assert model.unfused_rows == {t.rows for t in timings if t.unfused_wins} - rules
    # Both layerings timed again without PDL (where the device has it).
    pdl = llm.engine.runner.kernels.pdl
    off = [(t.fused_no_pdl_us, t.unfused_no_pdl_us) for t in timings]
    assert all((f is not None and u is not None and min(f, u) > 0) is pdl for f, u in off)
    assert model.no_pdl_rows == {t.rows for t in timings if t.no_pdl_wins} - rules
    print(
        [
            (t.rows, round(t.fused_us, 1), round(t.unfused_us, 1), *off[i])
            for i, t in enumerate(timings)
        ]
    )
    again = tiny_engine("full", torch.bfloat16, cache_dir=str(tmp_path))
    assert again.engine.runner.kernel_plan.layer_timings == []
    assert again.engine.model.unfused_rows == model.unfused_rows
    assert again.engine.model.no_pdl_rows == model.no_pdl_rows
    eager = tiny_engine("none", torch.bfloat16)
    assert "FULL" in lockstep(eager, llm, tolerance=2e-2)


def test_sizes_planned_without_pdl_launch_every_step_kernel_without_it_same_logits(
    monkeypatch, tmp_path
):
    # The plan is a timing: pinned here, PDL off at 2 and 8 rows. Every launch of a step
    # (eager, captured, compiled ahead) at those sizes then goes without PDL, at the
    # others with it; PDL changes no arithmetic, so the logits are bitwise the engine's
    # with PDL everywhere (the same GEMM plans: one compile cache). Neither start defers
    # its plans past its graphs: a deferred start captures the rules' graphs first (PDL
    # at every size) and then keeps, per size, whichever graph replays faster, a timing
    # that can take the pinned sizes back (on an H100 it took both).
    needs_pdl()
    import sys

    from ostinato.context import current_forward_context
    from ostinato.engine.worker import kernel_plan
    from ostinato.engine.worker.runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "_defers_plans", lambda self: False)

    def pinned(off):
        def plan_layers(model, *args, **kwargs):
            model.unfused_rows, model.no_pdl_rows = frozenset(), frozenset(off)
            return []

        return plan_layers

    monkeypatch.setattr(kernel_plan, "plan_layers", pinned(()))
    everywhere = tiny_engine("full", torch.bfloat16, cache_dir=str(tmp_path))
    # (rows, with PDL) of each launch that asked for PDL inside a step of the second
    # engine's start: its captures, and the warm-ups and compile-ahead passes before them
    launched = []
    for name, module in list(sys.modules.items()):
        real = getattr(module, "pdl_for", None) if name.startswith("ostinato.engine") else None
        if real is None:
            continue

        def recording(pdl, rows, real=real):
            got = real(pdl, rows)
            if pdl and current_forward_context() is not None and launched is not None:
                launched.append((rows, got))
            return got

        monkeypatch.setattr(module, "pdl_for", recording)
    monkeypatch.setattr(kernel_plan, "plan_layers", pinned({2, 8}))
    some_off = tiny_engine("full", torch.bfloat16, cache_dir=str(tmp_path))
    assert some_off.engine.model.no_pdl_rows == {2, 8}
    sizes = {rows for rows, _ in launched}
    assert {1, 2, 4, 8} <= sizes, sizes
    assert all(not on for rows, on in launched if rows in (2, 8))
    assert all(on for rows, on in launched if rows in (1, 4))
    launched = None  # (the steps below: both engines')
    assert "FULL" in lockstep(everywhere, some_off, tolerance=1e-12)
