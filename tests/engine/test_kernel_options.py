"""KernelOptions on the CPU: the launch options resolve to off, the planned projections compute
exactly what nn.Linear computes, and the engine and the benchmark take the options."""

import contextlib
import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from fakes import FlaggedTurn

from ostinato.engine import LLM, KernelOptions, SamplingParams
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.model.linear import Linear
from ostinato.engine.model.presets import shape
from ostinato.engine.worker.gemm_tuning import (
    GemmShape,
    GemmTiming,
    plan_small_gemms,
    triton_chosen,
)


@pytest.mark.parametrize("field", ["pdl", "small_gemm", "compile_ahead", "fused_layers"])
def test_options_refuse_what_is_not_a_bool(field):
    either = "True or False" if field == "fused_layers" else "True, False or None"
    with pytest.raises(TypeError, match=f"KernelOptions.{field}: expected {either}, got 'yes'"):
        KernelOptions(**{field: "yes"})
    if field == "fused_layers":  # (its ops run everywhere: nothing to leave to the device)
        with pytest.raises(TypeError, match="expected True or False, got None"):
            KernelOptions(fused_layers=None)


def test_launch_options_left_unset_resolve_to_off_without_cuda_and_the_fused_layers_stay():
    off = KernelOptions(pdl=False, small_gemm=False, compile_ahead=False)
    assert KernelOptions().resolved(torch.device("cpu")) == off
    assert off.resolved(torch.device("cpu")) == off
    assert off.fused_layers  # ops with a CPU implementation: the same model everywhere
    unfused = KernelOptions(fused_layers=False).resolved(torch.device("cpu"))
    assert not unfused.fused_layers


@pytest.mark.parametrize("field", ["pdl", "small_gemm", "compile_ahead"])
def test_an_option_asked_for_where_the_device_lacks_it_is_refused(field, monkeypatch):
    from ostinato.engine.kernels import options

    flag = "--no-" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"KernelOptions.{field}=True: .*Triton.* not on cpu"):
        KernelOptions(**{field: True}).resolved(torch.device("cpu"))
    with pytest.raises(ValueError, match=f"leave it unset .* or give {field}=False \\({flag}\\)"):
        LLM("tiny", progress=False, **{field: True})  # refused before the model is opened
    # A GPU before Hopper lacks PDL alone: asked for, it is refused; unset, it is off.
    monkeypatch.setattr(options, "triton_runs_on", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    ampere = torch.device("cuda")
    asked = KernelOptions(**{field: True})
    if field == "pdl":
        with pytest.raises(ValueError, match="needs compute capability 9.0 .* cuda has 8.0"):
            asked.resolved(ampere)
    else:
        assert asked.resolved(ampere) == KernelOptions(
            pdl=False, small_gemm=True, compile_ahead=True
        )
    assert KernelOptions().resolved(ampere) == KernelOptions(False, True, True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert asked.resolved(ampere) == KernelOptions(True, True, True)


def test_a_model_holds_unset_options_on_and_a_runner_turns_off_what_the_device_lacks():
    built = KernelOptions(small_gemm=False).as_built()
    assert built == KernelOptions(pdl=True, small_gemm=False, compile_ahead=True)
    assert built.as_built() is built
    cpu = built.available_on(torch.device("cpu"))  # (what was asked for, turned off)
    assert cpu == KernelOptions(pdl=False, small_gemm=False, compile_ahead=False)


def test_the_summary_names_the_options_on_and_off_where_triton_runs(monkeypatch):
    from ostinato.engine.kernels import options

    cuda = torch.device("cuda")
    assert KernelOptions().summary(torch.device("cpu")).startswith("Triton kernels: none on cpu")
    monkeypatch.setattr(options, "triton_runs_on", lambda device: True)
    assert KernelOptions(True, True, True).summary(cuda) == (  # (as resolved on a Hopper)
        "Triton kernels: pdl, small_gemm, compile_ahead, fused_layers"
    )
    assert KernelOptions(False, True, True, fused_layers=False).summary(cuda) == (
        "Triton kernels: small_gemm, compile_ahead; off: pdl, fused_layers"
    )
    none = KernelOptions(pdl=False, small_gemm=False, compile_ahead=False, fused_layers=False)
    assert none.summary(cuda).startswith("Triton kernels: no option on; off: pdl,")


@pytest.mark.parametrize("bias", [False, True])
def test_planned_linear_computes_what_nn_linear_computes(bias):
    torch.manual_seed(0)
    linear = Linear(24, 10, bias=bias)
    plain = torch.nn.Linear(24, 10, bias=bias)
    plain.load_state_dict(linear.state_dict())
    x = torch.randn(5, 24)
    want = plain(x)
    want_swiglu = F.silu(want[:, :5]) * want[:, 5:]
    assert torch.equal(linear(x), want)
    assert torch.equal(linear.forward_swiglu(x), want_swiglu)
    linear.use_plan((0, 1, 2, 3, 4, 1, 2), 4, pdl=True)  # through ostinato::linear
    assert torch.equal(linear(x), want)
    assert torch.equal(linear.forward_swiglu(x), want_swiglu)
    assert "counters" not in linear.state_dict()  # scratch, not state


def test_a_linear_writes_its_rows_where_asked_with_forward_bits():
    torch.manual_seed(0)
    linear = Linear(24, 10, bias=False)
    x = torch.randn(5, 24)
    buf = torch.full((8, 10), float("nan"))  # [rows, out_features]
    with torch.inference_mode():
        got = linear.forward_into(x, buf[:5])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, linear(x))
    assert buf[5:].isnan().all()
    # Elsewhere ``forward``'s own tensor, the buffer untouched: a bias, the wrong rows,
    # columns or layout, or a weight to differentiate.
    biased = Linear(24, 10)
    cases = ((biased, buf[:5]), (linear, buf[:4]), (linear, buf[:5, :5]), (linear, buf.t()[:5]))
    buf.fill_(float("nan"))
    for lin, out in cases:
        with torch.inference_mode():
            got = lin.forward_into(x, out)
        assert got.data_ptr() != buf.data_ptr() and torch.equal(got, lin(x))
    got = linear.forward_into(x, buf[:5])
    assert got.requires_grad and torch.equal(got, linear(x))
    assert buf.isnan().all()


def test_greedy_tokens_go_where_asked():
    from ostinato.engine.sample.greedy import greedy_tokens

    logits = torch.randn(3, 50)
    buf = torch.full((4,), -1, dtype=torch.int64)  # [rows]
    got = greedy_tokens(logits, out=buf[:3])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, logits.argmax(-1))
    assert buf[3] == -1


def test_model_through_planned_projections_is_unchanged():
    torch.manual_seed(0)
    model = DecoderModel(ModelConfig.from_hf(shape("tiny"))).eval()
    linears = model.linears()
    assert len(linears) == 4 * model.config.num_layers + 1
    assert [s for _, s in linears].count(True) == model.config.num_layers
    outs = []
    for linear, swiglu in linears:
        inp = torch.randn(3, linear.in_features)
        outs.append((linear, swiglu, inp, linear.forward_swiglu(inp) if swiglu else linear(inp)))
    for linear, _ in linears:
        linear.use_plan((0, 1, 1, 1), 8, pdl=False)
    for linear, swiglu, inp, want in outs:
        assert torch.equal(linear.forward_swiglu(inp) if swiglu else linear(inp), want)


def test_plan_on_cpu_is_empty_and_measures_nothing():
    linear = Linear(16, 16)
    linear.use_plan((0, 1), 4, pdl=False)
    assert plan_small_gemms([(linear, False)], [1, 2, 4], pdl=True) == []
    assert linear.plan == ()


def _timing(cublas_us: float, triton_us: float, config: int = 3) -> GemmTiming:
    return GemmTiming(GemmShape(64, 64, "bfloat16", False, False), 8, cublas_us, triton_us, config)


def test_cublas_needs_the_margin_to_take_a_gemm_from_triton():
    assert triton_chosen(_timing(10.0, 9.7), min_gain=0.03)
    # A near tie either way stays on Triton (a GEMM alone mispredicts the step).
    assert triton_chosen(_timing(10.0, 9.9), min_gain=0.03)
    assert triton_chosen(_timing(10.0, 10.25), min_gain=0.03)
    # cuBLAS faster by the margin, or no Triton config fits the shape: cuBLAS.
    assert not triton_chosen(_timing(10.0, 10.35), min_gain=0.03)
    assert not triton_chosen(_timing(10.0, float("inf"), 0), min_gain=0.03)
    assert not triton_chosen(_timing(10.0, 5.0, 0), min_gain=0.03)


def test_a_gemm_measurement_holds_the_turn_per_timed_replay_and_picks_the_fastest(monkeypatch):
    # A background start times the candidates beside steps: each candidate's warm-up
    # call beside them too (its host time in a turn held them), its timing handed the
    # turn (graph_call_us holds it per timed replay), and the choice the fastest
    # candidate (the first of a tie).
    from ostinato.engine.worker import gemm_tuning

    us = {"cublas": 10.0, 1: 12.0, 2: 7.0, 3: 7.0, 4: 9.0}
    turn, timed, warmed = FlaggedTurn(), [], []
    calls = {name: (lambda name=name: warmed.append((name, turn.held))) for name in us}
    names = {fn: name for name, fn in calls.items()}
    fitting = [(i, calls[i]) for i in (1, 2, 3, 4)]

    def graph_call_us(fn, calls, turn):
        assert not turn.held  # (the capture runs beside steps)
        timed.append(turn)
        return us[names[fn]]

    monkeypatch.setattr(gemm_tuning, "_candidates", lambda *a: (calls["cublas"], fitting))
    monkeypatch.setattr(gemm_tuning, "graph_call_us", graph_call_us)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    t = gemm_tuning._measure(Linear(8, 4), False, 2, False, torch.device("cpu"), turn)
    assert timed == [turn] * 5
    assert warmed == [(name, False) for name in us]  # each warmed once, outside the turn
    assert (t.cublas_us, t.triton_us, t.config) == (10.0, 7.0, 2)


def as_on_a_gpu(monkeypatch):
    """The engine on the CPU takes and keeps its kernel options as a GPU would (nothing
    launches with them there): the runner's parts that follow them run."""
    monkeypatch.setattr(KernelOptions, "resolved", lambda self, device: self)
    monkeypatch.setattr(KernelOptions, "available_on", lambda self, device: self)


def test_engine_refuses_kernels_of_the_wrong_type():
    with pytest.raises(TypeError, match="kernels: expected a KernelOptions"):
        LLM("tiny", kernels={"pdl": True}, progress=False)


def test_engine_on_cpu_turns_the_options_left_unset_off_and_says_so():
    llm = LLM("tiny", kernels=KernelOptions(small_gemm=False), progress=False)
    off = KernelOptions(pdl=False, small_gemm=False, compile_ahead=False)
    assert llm.engine.runner.kernels == off
    assert "; Triton kernels: none on cpu (" in llm.describe()  # said, not silent
    assert llm.engine.runner.kernel_plan.timings == []
    assert all(linear.plan == () for linear, _ in llm.engine.model.linears())


def test_runner_compiles_kernels_ahead_once_around_its_first_pass(monkeypatch):
    # On the CPU the ops run their torch arithmetic, so nothing is launched; what runs is
    # the runner's part: the eager passes and the compiled first pass inside
    # compile_ahead, once, with the engine's outputs unchanged.
    from ostinato.engine.worker import kernel_plan

    entered = []

    @contextlib.contextmanager
    def recording_ahead():
        entered.append(True)
        yield

    monkeypatch.setattr(kernel_plan, "compile_ahead", recording_ahead)
    as_on_a_gpu(monkeypatch)
    prompts = [[5, 6, 7, 8, 9], [3, 1]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(mode="none", compiler="eager", progress=False, seed=1)
    ahead = LLM("tiny", kernels=KernelOptions(compile_ahead=True), **kw)
    assert entered == [True] and ahead.engine.runner.compile_seconds > 0
    assert ahead.engine.runner.compile() == 0.0 and entered == [True]  # once per runner
    plain = LLM("tiny", kernels=KernelOptions(compile_ahead=False), **kw)
    assert entered == [True]
    assert [o.token_ids for o in ahead.generate(prompts, params)] == [
        o.token_ids for o in plain.generate(prompts, params)
    ]


def test_an_eager_step_beside_a_compiling_start_compiles_its_own_kernels_first(
    fake_graphs, monkeypatch
):
    # A background start's thread compiles every kernel ahead; until it is done, the first
    # eager step of each size first passes its own work inside compile_ahead, on threads
    # of this process (a first step's dozen kernels compiled one by one at their launches
    # took 7.4 s on an H200). Once per size, on the steps' thread, tokens unchanged; none
    # once the thread's compile has ended.
    import threading

    from test_graphed_engine import engine, tokens, workload

    from ostinato.engine.sample import graph_sampler
    from ostinato.engine.worker import kernel_plan
    from ostinato.engine.worker import runner as runner_module
    from ostinato.manager import GraphManager

    release, entered, passed, eager = threading.Event(), [], [], []

    @contextlib.contextmanager
    def recording_ahead(workers=None, first=False):
        entered.append((threading.current_thread() is threading.main_thread(), first))
        if threading.current_thread() is not threading.main_thread():
            assert release.wait(60)  # (the capture thread's compile: still under way)
        yield

    def recorded_pass(runner, dispatch, meta, rows):
        passed.append(dispatch.descriptor)
        return eager_pass(runner, dispatch, meta, rows)

    def recorded_run(self, dispatch, num_tokens, *args, **kwargs):
        if not release.is_set():  # (no graph yet: every step eager, large ones NONE)
            eager.append(dispatch.descriptor)
        return run(self, dispatch, num_tokens, *args, **kwargs)

    eager_pass, run = runner_module._eager_pass, GraphManager.run
    monkeypatch.setattr(kernel_plan, "compile_ahead", recording_ahead)
    monkeypatch.setattr(graph_sampler, "compile_ahead", recording_ahead)
    as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(runner_module, "_eager_pass", recorded_pass)
    monkeypatch.setattr(GraphManager, "run", recorded_run)
    prompts, params = workload(n=6, seed=5)
    # (no small-GEMM plans: on the CPU they measure nothing, read as cached plans)
    ahead = KernelOptions(compile_ahead=True, small_gemm=False)
    kw = dict(kernels=ahead, async_scheduling=False)
    blocking = engine("full", **kw)
    want = tokens(blocking, prompts, params)
    blocking.close()
    entered.clear()
    llm = engine("full", capture="background", **kw)
    assert tokens(llm, prompts, params) == want
    steps = [e for e in entered if e[0]]
    assert eager and passed == list(dict.fromkeys(eager))  # each size once, in step order
    assert steps == [(True, True)] * len(passed)  # ahead of the worker pool's queue
    release.set()
    assert llm.wait_for_graphs(timeout=60)
    assert tokens(llm, prompts, params) == want
    llm.generate([list(range(1, 101))], params)  # (a new size, eager: above the ladder)
    assert [e for e in entered if e[0]] == steps  # the thread's compile ended: none since
    llm.close()


def test_compile_ahead_passes_every_row_count_to_16_as_decode_and_as_mixed_steps(monkeypatch):
    # Below 16 rows a launch's layout follows its row count (resident GEMM rows, per-row
    # plans): each count is passed both as a decode graph runs the model (its logits) and
    # as a mixed step does (its hidden states); above, the PDL and split edges.
    from ostinato.engine.kernels.gemm_launch import MAX_ROWS
    from ostinato.engine.model.decoder import DecoderModel
    from ostinato.engine.worker import kernel_plan

    inside, passes, calling = [], [], []

    @contextlib.contextmanager
    def recording_ahead():
        inside.append(True)
        yield
        inside.clear()

    def recorded(kind, real):
        def call(self, input_ids, *args, **kwargs):
            if inside and not calling:  # (the passes' own calls, not those inside them)
                passes.append((kind, input_ids.shape[0]))
            calling.append(kind)
            try:
                return real(self, input_ids, *args, **kwargs)
            finally:
                calling.pop()

        return call

    monkeypatch.setattr(kernel_plan, "compile_ahead", recording_ahead)
    as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(DecoderModel, "forward", recorded("mixed", DecoderModel.forward))
    monkeypatch.setattr(DecoderModel, "logits", recorded("decode", DecoderModel.logits))
    head = recorded("mixed logits", DecoderModel.compute_logits)
    monkeypatch.setattr(DecoderModel, "compute_logits", head)
    kw = dict(mode="none", compiler="eager", progress=False, max_num_batched_tokens=64)
    LLM("tiny", kernels=KernelOptions(compile_ahead=True), **kw)
    small = set(range(1, MAX_ROWS + 1))
    assert {n for kind, n in passes if kind == "decode"} == small
    assert {n for kind, n in passes if kind == "mixed"} >= small | {17, 64}
    # A mixed step's logits: the LM head alone (the decode graphs fuse the final norm
    # into it), at every row count a plan covers.
    assert {n for kind, n in passes if kind == "mixed logits"} >= small


def test_the_model_carries_one_kernel_options_object_to_every_launching_module():
    from ostinato.engine.model.config import ModelConfig
    from ostinato.engine.model.decoder import DecoderModel, Mlp, RMSNorm
    from ostinato.engine.model.presets import shape

    options = KernelOptions(pdl=True, small_gemm=False)
    model = DecoderModel(ModelConfig.from_hf(shape("tiny")), kernels=options)
    assert model.kernels == KernelOptions(True, False, True)  # (unset: held on)
    launching = [m for m in model.modules() if isinstance(m, (RMSNorm, Mlp))]
    assert launching and all(m.kernels is model.kernels for m in launching)


def test_a_runner_refuses_a_model_built_for_kernels_this_device_lacks(monkeypatch):
    from ostinato.engine.kernels import options
    from ostinato.engine.worker.runner import runner_kernels

    built = KernelOptions(pdl=True)
    # Without Triton (as on CI; pinned here, where Triton may be installed) a CUDA device
    # resolves PDL off: the model's kernels would launch with an option it cannot run.
    monkeypatch.setattr(options, "triton_runs_on", lambda device: False)
    with pytest.raises(ValueError, match="build it with KernelOptions.resolved"):
        runner_kernels(built, torch.device("cuda"))
    # Off CUDA nothing launches with it: the runner follows what the device has.
    off = KernelOptions(pdl=False, small_gemm=False, compile_ahead=False)
    assert runner_kernels(built, torch.device("cpu")) == off


def test_pdl_applies_to_decode_sized_launches_only():
    from ostinato.engine.kernels.launch import pdl_for
    from ostinato.engine.kernels.launch_rules import LaunchRules, rules, rules_in_force

    assert rules().pdl_max_rows == 16
    assert [pdl_for(True, rows) for rows in (1, 16, 17, 128)] == [True, True, False, False]
    assert not pdl_for(False, 1)
    with rules_in_force(LaunchRules(pdl_max_rows=0)):
        assert not pdl_for(True, 1)
    assert pdl_for(True, 16)  # restored


def test_pdl_arg_says_no_pdl_or_the_order_of_wait_and_launch():
    from ostinato.engine.kernels import launch
    from ostinato.engine.kernels.launch_rules import LaunchRules, rules_in_force

    assert launch.pdl_arg(False) == 0
    for first, order in ((False, launch.WAIT_THEN_TRIGGER), (True, launch.TRIGGER_THEN_WAIT)):
        with rules_in_force(LaunchRules(trigger_first=first)):
            assert launch.pdl_arg(True) == order and launch.pdl_arg(False) == 0


def test_layout_rows_take_every_pdl_and_split_layout_brute_force():
    # compile_ahead's passes: every (PDL, attention splits) pair a step of 1..max rows
    # launches is launched by one of layout_rows(max), checked against every size.
    from ostinato.engine.kernels.attention_launch import splits_for
    from ostinato.engine.kernels.launch import layout_rows, pdl_for

    def layout(n: int, kv_heads: int, sms: int) -> tuple[bool, bool]:
        return pdl_for(True, n), splits_for(n, kv_heads, sms) > 1

    for sms in (8, 78, 132):
        for kv_heads in (1, 2, 3, 8, 32):
            for max_rows in range(1, 300, 7):
                rows = layout_rows(max_rows)
                assert all(1 <= n <= max_rows for n in rows)
                want = {layout(n, kv_heads, sms) for n in range(1, max_rows + 1)}
                got = {layout(n, kv_heads, sms) for n in rows}
                assert got == want, (sms, kv_heads, max_rows, rows)
                assert set(layout_rows(max_rows, 16)) >= set(rows)


def test_layout_rows_take_every_small_gemm_row_layout_brute_force():
    # Below MAX_ROWS a projection's launch follows its plan entry at that row count (any
    # plan: measured ones differ row by row) and, resident, the row count itself (its
    # tile's rows, its row statistics' granule): a step of 2 rows once compiled five
    # GEMMs in a capture, holding the steps' turn 1.9 s, when only 1 and 16 were passed.
    from ostinato.engine.kernels.gemm_launch import MAX_ROWS, stats_granule
    from ostinato.engine.kernels.launch import layout_rows
    from ostinato.engine.kernels.launch_rules import rules
    from ostinato.engine.model.linear import plan_entry

    draw = random.Random(0)

    def layout(n: int, plan: tuple[int, ...]) -> tuple[int, int, int]:
        resident = n <= rules().resident_max_rows
        block_m = 1 << (n - 1).bit_length() if resident else MAX_ROWS
        return plan_entry(plan, n), block_m, stats_granule(n)

    for max_rows in range(1, 80, 3):
        for _ in range(20):
            plan = tuple(draw.randrange(23) for _ in range(MAX_ROWS + 1))
            rows = layout_rows(max_rows, MAX_ROWS)
            want = {layout(n, plan) for n in range(1, max_rows + 1)}
            assert {layout(n, plan) for n in rows} == want, (max_rows, plan, rows)


def test_attention_splits_are_powers_of_two_that_never_grow_with_tokens():
    from ostinato.engine.kernels.attention_launch import MAX_SPLITS, splits_for

    for sms in (1, 132):
        got = [splits_for(n, 2, sms) for n in range(1, 200)]
        assert all(s & (s - 1) == 0 and 1 <= s <= MAX_SPLITS for s in got)
        assert got == sorted(got, reverse=True)
    # SmolLM2's 3 KV heads on 132 SMs: 528 programs wanted (four waves), shared by the
    # tokens' heads, rounded up to a power of two.
    assert [splits_for(n, 3, 132) for n in (1, 8, 16, 32, 64, 128)] == [16, 16, 16, 8, 2, 1]
    # The 1.5 B shape's 8: the counts the H200 sweep found best at 512 keys.
    assert [splits_for(n, 8, 132) for n in (1, 8, 16, 32, 64)] == [16, 8, 4, 2, 1]


def test_attention_launches_by_split_layout():
    from ostinato.engine.kernels.attention_launch import BLOCK_N, launch_for

    assert (launch_for(1).num_warps, launch_for(1).num_stages) == (2, 3)
    split = {(launch_for(s).num_warps, launch_for(s).num_stages) for s in (2, 4, 8, 16)}
    assert split == {(4, 2)}
    assert {launch_for(s).block_n for s in (1, 16)} == {BLOCK_N}
    # without early keys, or heads of unknown width, every split launch keeps BLOCK_N
    every = itertools.product((2, 8, 16), (1, 3, 64), (False, True), (0, 64))
    for splits, pairs, early, d in every:
        if not (early and d):
            assert launch_for(splits, pairs, early, d) == launch_for(splits)


def test_early_attention_widens_its_first_tile_where_it_fits():
    from ostinato.engine.kernels.attention_launch import AttentionLaunch, launch_for

    def tile(splits: int, pairs: int, d: int = 64) -> tuple[int, int]:
        c = launch_for(splits, pairs, early=True, head_dim=d)
        return c.block_n, c.num_warps

    # SmolLM2 (3 KV heads) at 1 and 2 rows; the 1.5 B shape (8) at 1, 8 and 16 rows
    assert [tile(16, 3), tile(16, 6), tile(16, 8), tile(8, 64), tile(4, 128)] == [
        (256, 8), (256, 8), (64, 4), (128, 4), (128, 4),
    ]  # fmt: skip
    # SmolLM2 at 8 and 16 rows keep 64 at 16 splits; unsplit launches never change
    assert tile(16, 24) == tile(16, 48) == (64, 4)
    assert launch_for(1, 3, early=True, head_dim=64) == AttentionLaunch(num_warps=2)
    # 128-dim heads: the wider tiles would hold twice the registers, so they keep 64
    assert tile(16, 3, 128) == tile(8, 64, 128) == (64, 4)


def test_float32_attention_keeps_the_narrow_tile():
    """The wide tiles are sized in bytes: float32 keys and values are twice a 16-bit
    tile's, so a float32 early launch keeps ``BLOCK_N`` where bf16 widens."""
    from ostinato.engine.kernels.attention_launch import BLOCK_N, launch_for

    for splits, pairs in ((16, 3), (16, 6), (8, 64), (4, 128)):
        wide = launch_for(splits, pairs, early=True, head_dim=64, itemsize=2)
        narrow = launch_for(splits, pairs, early=True, head_dim=64, itemsize=4)
        assert wide.block_n > BLOCK_N
        assert narrow == launch_for(splits)
    # 32-dim float32 heads hold what 64-dim 16-bit ones hold, and widen alike
    assert launch_for(16, 3, early=True, head_dim=32, itemsize=4).block_n == 256


def test_rope_epilogue_takes_power_of_two_heads_of_at_least_32_dims():
    from ostinato.engine.kernels.gemm_launch import rope_head_dim

    assert [d for d in range(1, 300) if rope_head_dim(d)] == [32, 64, 128, 256]
