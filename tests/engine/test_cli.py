"""Every bad command-line input: exit status 2, one line on stderr, no traceback."""

import json
from types import SimpleNamespace

import pytest

from ostinato.engine.api.engine_args import ParallelArgs
from ostinato.engine.cli.main import main


def run(args, capsys, entry=main):
    try:
        code = entry(args)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


GEN = ["generate", "--model", "tiny", "--quiet", "--max-model-len", "64"]


@pytest.fixture
def bad_folders(tmp_path):
    from hf_models import SMALL

    empty = tmp_path / "empty"
    empty.mkdir()
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({**SMALL, "architectures": ["GPT2LMHeadModel"]}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text(
        json.dumps({**SMALL, "architectures": ["LlamaForCausalLM"]})
    )
    (corrupt / "model.safetensors").write_bytes(b"junk" * 8)
    return tmp_path


BAD = [
    (["--max-tokens", "0"], "--max-tokens: must be >= 1"),
    (["--max-tokens", "-1"], "--max-tokens: must be >= 1"),
    (["--max-tokens", "x"], "--max-tokens: 'x' is not an integer"),
    (["--temperature", "-1"], "--temperature: must be in [0.0"),
    (["--top-p", "0"], "--top-p: must be in (0.0, 1.0]"),
    (["--top-p", "2"], "--top-p: must be in (0.0, 1.0]"),
    (["--top-p", "nan"], "--top-p: must be in (0.0, 1.0]"),
    (["--mode", "bogus"], "--mode: unknown graph mode 'bogus'"),
    (["--device", "tpu"], "--device: 'tpu' is not a device the engine runs on"),
    (["--device", "cuda:x"], "--device: 'cuda:x' is not a device the engine runs on"),
    (["--device", "cuda"], "device: 'cuda' asked for, but CUDA is not available"),
    (["--max-model-len", "0"], "--max-model-len: must be >= 1"),
    (["--max-model-len", "4096"], "max_model_len: 4096 exceeds the 2048 positions"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: must be in"),
    (["--prompt-ids", "1,a"], "--prompt-ids: '1,a' is not a list of integers"),
    (["--prompt-ids", "1,5000"], "token ids [5000] outside the vocabulary"),
    (["--prompt", "hi"], "text given but the model has no tokenizer"),
    (["--prompt", "hi", "--prompt-ids", "1"], "give --prompt-ids or --prompt, not both"),
    (["--chat"], "--chat: the model has no chat template"),
    (["--prompt-ids", "1", "--no-chat"], "--chat/--no-chat: formats text prompts"),
    (["--prompt-ids", ",".join(["1"] * 70)], "--prompt-ids 0: 70 tokens leave no room"),
    (["--speculative", "medusa"], "--speculative: method 'medusa' is not one of"),
    (["--speculative", "self:x"], "--speculative: 'self:x': write self:N"),
    (["--num-speculative-tokens", "17"], "--num-speculative-tokens: must be in [1, 16]"),
    (["--speculative", "self:9"], "self:9 must use fewer layers than the model's 4"),
    (["--speculative", "oracle"], "--speculative: method 'oracle' is not one of"),
    (["--verify", "always"], "--verify: invalid choice: 'always'"),
    (["--verify-every", "0"], "--verify-every: must be >= 1"),
    (["--verify", "capture", "--capture", "background"], "not with verify='capture'"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size: must be >= 1"),
    (["--tensor-parallel-size", "3"], "tensor_parallel_size: 3 does not divide vocab_size"),
]


@pytest.mark.parametrize("extra, message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_generate_options(extra, message, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, out, err = run(GEN + extra, capsys)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert message in err, err


@pytest.mark.parametrize(
    "folder, message",
    [
        ("absent", "no such file or folder"),
        ("empty", "no config.json and no .gguf file"),
        ("gpt2", "GPT2LMHeadModel"),
        ("broken", "config.json: not valid JSON"),
        ("corrupt", "model.safetensors: cannot be read"),
    ],
)
def test_bad_model_folders(folder, message, bad_folders, capsys):
    code, out, err = run(["generate", "--quiet", "--model", str(bad_folders / folder)], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert message in err, err


def test_options_are_checked_before_the_model_loads(bad_folders, capsys):
    # A bad option wins over a model that would fail to load (and is never opened).
    code, _, err = run(
        ["generate", "--model", str(bad_folders / "corrupt"), "--top-p", "2"], capsys
    )
    assert code == 2 and "--top-p" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "--batch-sizes", "abc"], "--batch-sizes: 'abc' is not a list of integers"),
        (["bench", "--batch-sizes", "0,1"], "--batch-sizes: sizes must be >= 1"),
        (["bench", "--plot-from", "/no/such.json", "--plot", "x.png"], "--plot-from"),
        (["bench", "--kv-len", "-3"], "--kv-len: must be >= 1"),
        (["frobnicate"], "invalid choice"),
        (["bench"], "invalid choice: 'bench'"),  # benchmarks are not part of the package
        (["serve", "--data-parallel-size", "2"], "serve: --data-parallel-size is not served"),
    ],
)
def test_bad_bench_and_command_options(args, message, capsys):
    from benchmarks.cli import main as bench_main

    entry = main
    if args[:1] == ["bench"] and len(args) > 1:
        args, entry = args[1:], bench_main  # python -m benchmarks ...
    code, _, err = run(args, capsys, entry)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert message in err, err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "absent"], "no such file or folder"),
        (["--model", "tiny", "--max-model-len", "4096"], "4096 exceeds the 2048 positions"),
    ],
)
def test_serve_names_an_error_of_its_engine_process_in_one_line(extra, message, capsys):
    # serve builds its engine in a process of its own; what fails there comes back as
    # the engine's own error, said as generate says it (no child traceback).
    code, _, err = run(["serve", "--device", "cpu", "--quiet", *extra], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err


def test_generate_with_token_ids(capsys):
    code, out, err = run(
        GEN + ["--prompt-ids", "1,2,3", "--prompt-ids", "7 8", "--max-tokens", "5", "--ignore-eos"],
        capsys,
    )
    assert code == 0, err
    assert "graph mode: NONE" in out and "prompt [1, 2, 3] -> [" in out
    assert out.count("[5 tokens, finish: length]") == 2 and "tokens/s" in out


def test_generate_takes_the_kernel_options(capsys, monkeypatch):
    # On the CPU they resolve to off: the same tokens as without them.
    from ostinato.engine import LLM

    seen = []
    build = LLM.__init__

    def spy(self, *args, **kw):
        seen.append(kw["args"].kernels)
        build(self, *args, **kw)

    monkeypatch.setattr(LLM, "__init__", spy)
    args = ["--prompt-ids", "1,2,3", "--max-tokens", "4", "--ignore-eos"]
    code, plain, err = run(GEN + args, capsys)
    assert code == 0, err
    code, out, err = run(GEN + args + ["--no-pdl", "--no-small-gemm", "--no-fused-layers"], capsys)
    assert code == 0, err
    options = [(k.pdl, k.small_gemm, k.fused_layers) for k in seen]
    # The defaults (the launch options left to the device), then not.
    assert options == [(None, None, True), (False, False, False)]
    result = [line for line in out.splitlines() if line.startswith("prompt ")]
    assert result == [line for line in plain.splitlines() if line.startswith("prompt ")]
    code, out, err = run(GEN + args + ["--pdl"], capsys)  # the CPU has none: refused
    assert code != 0 and "KernelOptions.pdl=True" in err and "(--no-pdl)" in err


@pytest.mark.parametrize("method", ["ngram", "self:2"])
def test_generate_with_speculation_reports_acceptance(method, capsys):
    args = ["--prompt-ids", "1,2,3,1,2,3", "--max-tokens", "12", "--ignore-eos"]
    code, plain, err = run(GEN + args, capsys)
    assert code == 0, err
    code, out, err = run(
        GEN + args + ["--speculative", method, "--num-speculative-tokens", "3"], capsys
    )
    assert code == 0, err
    result = [line for line in out.splitlines() if line.startswith("prompt ")]
    assert result == [line for line in plain.splitlines() if line.startswith("prompt ")]
    assert f"speculative {method}, k=3: acceptance" in out


def test_every_option_has_help_and_shows_its_default(capsys):
    from ostinato.engine.api.engine_args import cli_fields

    code, out, _ = run(["generate", "--help"], capsys)
    assert code == 0
    for option in ("--max-tokens", "--temperature", "--top-p", "--mode", "--max-model-len"):
        assert option in out
    assert out.count("(default:") >= 8
    # The engine's flags are its configuration's fields, each with the field's help.
    for f in cli_fields():
        assert "--" + f.name.replace("_", "-") in out and f.metadata.get("help")
    assert "(default: None)" not in out  # (where the help itself says the default)


def test_serve_help_never_prints_the_api_key_it_read(capsys, monkeypatch):
    monkeypatch.setenv("OSTINATO_API_KEY", "a-secret-key")
    code, out, _ = run(["serve", "--help"], capsys)
    assert code == 0 and "--api-key" in out and "a-secret-key" not in out


def run_python(code: str) -> str:
    """``code``'s standard output, run in a fresh interpreter (which must exit 0)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_help_imports_neither_torch_nor_transformers():
    out = run_python(
        "import sys\n"
        "from ostinato.engine.cli.main import main\n"
        "try:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'triton') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    assert "--capture" in out and "--no-cache" in out


def test_serve_starts_the_engine_process_before_it_imports_torch():
    # `ostinato serve` parses and checks its flags, then begins the engine's process
    # with nothing heavy imported (the child imports torch and builds the engine while
    # this process imports the server). A flag checked through torch would make the
    # child wait for this process's import of it (1.7 s on the CPU).
    out = run_python(
        "import sys\n"
        "from ostinato.engine.serve.engine_process import EngineProcess\n"
        "def begin(cls, kwargs, describe=True):\n"
        "    heavy = ('torch', 'fastapi', 'transformers', 'ostinato.engine.api.llm')\n"
        "    print(sorted(m for m in heavy if m in sys.modules), kwargs['args'].device)\n"
        "    sys.exit(0)\n"
        "EngineProcess.begin = classmethod(begin)\n"
        "from ostinato.engine.cli.main import main\n"
        "main(['serve', '--model', 'tiny', '--device', 'cuda:1', '--dtype', 'float32',\n"
        "      '--mode', 'full', '--max-model-len', '64', '--max-num-seqs', '4',\n"
        "      '--capture', 'blocking', '--speculative', 'self:1'])\n"
    )
    assert out.strip() == "[] cuda:1", out


@pytest.mark.parametrize("device", ["cuda:1", "cpu", None])
def test_generate_starts_its_early_work_before_it_imports_torch(device):
    # The CUDA context and Triton's set-up of the device generate will run on are made
    # while torch imports (api.early_start); serve's engine process does the same.
    flags = f"'--device', '{device}', " if device else ""
    out = run_python(
        "import sys\n"
        "from ostinato.engine.api import early_start\n"
        "def start(device, world_size, cache_dir):\n"
        "    print('torch' in sys.modules, device, world_size, cache_dir)\n"
        "    sys.exit(0)\n"
        "early_start.start_early = start\n"
        "from ostinato.engine.cli.main import main\n"
        f"main(['generate', '--model', 'tiny', '--random-weights', {flags}'--max-tokens', '2',"
        " '--cache-dir', '/c'])\n"
    )
    assert out.strip() == f"False {device} 1 /c", out


COUNTING = (
    "import gc, os\n"
    "auto = []\n"
    "def count():\n"
    "    gc.callbacks.append(lambda p, i: p == 'stop' and i['generation'] < 2 and auto.append(1))\n"
    "def report():\n"
    "    print(len(auto), gc.isenabled(), gc.get_freeze_count() > 0, flush=True)\n"
    "    os._exit(0)\n"
)


def collections_until_report(code: str) -> tuple[int, bool, bool]:
    """In a fresh interpreter running ``code``: the automatic collections from its call of
    ``count()`` to its call of ``report()`` (younger generations: ``gc.collect`` runs a
    full one), whether the collector is on then, whether anything is frozen."""
    collections, enabled, frozen = run_python(COUNTING + code).splitlines()[-1].split()
    return int(collections), enabled == "True", frozen == "True"


def test_generate_imports_and_builds_without_collections_until_its_graphs_are_captured():
    # From the command's start to its engine's capture, the cyclic collector is held off
    # (each collection on the way walked everything imported so far again; core.heap),
    # and on again once the capture begins (a capture pauses and resumes it itself): at
    # most the few before the command reaches its imports, against 386 without.
    got = collections_until_report(
        "import ostinato.engine.cli.main as cli\n"
        "early = cli.start_early\n"
        "def start_early(*args):\n"
        "    early(*args)\n"
        "    from ostinato.engine.api import startup\n"
        "    startup.capture = lambda *args: report()\n"
        "cli.start_early = start_early\n"
        "count()\n"
        "cli.main(['generate', '--model', 'tiny', '--random-weights', '--device', 'cpu',"
        " '--max-tokens', '2', '--no-cache'])\n"
    )
    assert got[0] <= 3 and got[1:] == (True, True), got


def test_serve_imports_its_modules_without_collections_and_serves_them_frozen():
    # The serving process's imports (the web framework, torch) run without collections
    # and are frozen before it serves: a full collection of them held every stream for
    # 116-123 ms on the development machine (benchmarks/RESULTS.md); 431 without.
    pytest.importorskip("fastapi")
    got = collections_until_report(
        "from types import SimpleNamespace\n"
        "from ostinato.engine.serve import engine_process\n"
        "import ostinato.engine.cli.main as cli\n"
        "building = SimpleNamespace(ready=report)\n"
        "engine_process.EngineProcess.begin = classmethod(lambda cls, kw: building)\n"
        "count()\n"
        "cli.main(['serve', '--model', 'tiny', '--random-weights', '--device', 'cpu'])\n"
    )
    assert got[0] <= 3 and got[1:] == (True, True), got


@pytest.mark.parametrize(
    "kwargs, placement",
    [
        ({"args": SimpleNamespace(device="cuda:1", cache_dir=False, parallel=ParallelArgs(
            tensor_parallel_size=2, data_parallel_size=3))}, ("cuda:1", 6, False)),
        ({"device": "cpu", "cache_dir": "/c"}, ("cpu", 1, "/c")),
        ({"tensor_parallel_size": 2}, (None, 2, None)),
        ({"tensor_parallel_size": "2", "device": object}, (object, 1, None)),  # (LLM refuses it)
    ],
)  # fmt: skip
def test_the_engine_process_starts_early_work_where_its_engine_runs(kwargs, placement):
    from ostinato.engine.serve.engine_process import _placement

    assert _placement(kwargs) == placement


def test_bytecode_is_kept_in_the_cache_only_where_torch_cannot_keep_it(tmp_path, monkeypatch):
    import os
    import sys

    import ostinato.engine.cli.main as cli

    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    assert cli.keep_bytecode(str(tmp_path)) is None  # this venv's torch keeps its own
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False)
    monkeypatch.setattr(cli.Path, "is_dir", lambda self: False)
    assert cli.keep_bytecode(str(tmp_path)) == str(tmp_path / "bytecode")
    assert sys.pycache_prefix == os.environ["PYTHONPYCACHEPREFIX"] == str(tmp_path / "bytecode")


def test_no_cache_and_cache_dir_together_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--no-cache", "--cache-dir", "/tmp/x", "--random-weights"])
    assert exc.value.code == 2
    assert "--cache-dir or --no-cache" in capsys.readouterr().err


def test_ctrl_c_exits_130_after_one_line(capsys, monkeypatch):
    import ostinato.engine.cli.main as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_generate", interrupted)
    assert main(["generate", "--random-weights", "--model", "tiny"]) == 130
    assert capsys.readouterr().err.strip() == "ostinato: interrupted"


@pytest.mark.parametrize("value, on", [("0", False), ("", False), ("off", False), ("1", True)])
def test_ostinato_traceback_zero_means_off(value, on, monkeypatch):
    from ostinato.engine.cli.main import tracebacks_on

    monkeypatch.setenv("OSTINATO_TRACEBACK", value)
    assert tracebacks_on() is on


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt", "  "], "--prompt 0: empty"),
        (["--prompt-ids", "1,-2,3"], "--prompt-ids 0: token ids must be >= 0"),
        (["--prompt-ids", "1,2,3,4", "--max-model-len", "4"], "leave no room to generate"),
    ],
)
def test_prompt_checks_that_need_no_model_come_first(extra, message, capsys, monkeypatch):
    import ostinato.engine.cli.main as cli

    monkeypatch.setattr(cli, "_generate", lambda args: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", "tiny", *extra])
    assert exc.value.code == 2 and message in capsys.readouterr().err
