"""The start-up benchmark's plan and its serve runs (on the CPU, the tiny model)."""

import argparse
import os
import sys

import pytest

from benchmarks.startup import PORT, planned, served

pytest.importorskip("fastapi")
pytest.importorskip("httpx")


def test_later_rounds_repeat_every_chosen_run_but_those_with_empty_caches():
    args = argparse.Namespace(
        device="cuda",
        max_tokens=8,
        only=["llama-1.5b default", "llama-1.5b blocking"],
        skip=[],
        rounds=2,
        root=None,
    )
    names = [name for name, _, _ in planned(args)]
    first = [n for n in names if "#" not in n]
    assert first[0] == "llama-1.5b default, caches empty"
    assert all(n.startswith(("llama-1.5b default", "llama-1.5b blocking")) for n in first)
    assert [n for n in names if "#" in n] == [f"{n} #2" for n in first if "empty" not in n]


def test_a_run_on_filled_caches_comes_after_the_run_that_fills_its_folder():
    args = argparse.Namespace(
        device="cuda",
        max_tokens=8,
        only=["filled"],
        skip=["no bytecode"],
        rounds=2,
        root=None,
    )
    plan = planned(args)
    for i, (name, _, key) in enumerate(plan):
        earlier = [n for n, _, k in plan[:i] if k == key]
        assert "filled" not in name or earlier, name
    names = [name for name, _, _ in plan]
    assert names[:2] == ["smollm2 default, caches empty", "smollm2 default, caches filled"]
    assert "llama-1.5b default, caches empty" in names
    assert not [n for n in names if "#" in n and "empty" in n]
    # (a folder given with --root holds what an earlier invocation filled)
    args.root = "somewhere"
    assert planned(args)[0][0] == "smollm2 default, caches filled"


def test_a_chosen_name_may_hold_commas():
    args = argparse.Namespace(
        device="cuda",
        max_tokens=8,
        only=["smollm2 default, caches empty"],
        skip=[],
        rounds=1,
        root=None,
    )
    assert [name for name, _, _ in planned(args)] == [
        "smollm2 default, caches empty",
        "smollm2 default, caches empty, bytecode as installed",
    ]


def test_skip_leaves_out_the_runs_it_names_among_those_chosen():
    args = argparse.Namespace(
        device="cuda", max_tokens=8, only=["smollm2 default, caches"], skip=["installed", "no "],
        rounds=1, root=None,
    )  # fmt: skip
    assert [name for name, _, _ in planned(args)] == [
        "smollm2 default, caches empty",
        "smollm2 default, caches filled",
    ]


def test_the_start_up_line_s_phases_are_read_with_names_of_several_words():
    from benchmarks.startup import _phases

    line = "start-up 19.9 s (open 0.0, weights 0.2, kernel plans 19.0, gemm plan 12.1; x y)"
    assert _phases(line) == {
        "total": 19.9, "open": 0.0, "weights": 0.2, "kernel_plans": 19.0, "gemm_plan": 12.1,
    }  # fmt: skip


def test_a_serve_run_is_timed_to_its_first_streamed_completion():
    command = [sys.executable, "-m", "ostinato.engine", "serve", "--quiet", "--device", "cpu"]
    command += ["--port", PORT, "--model", "tiny"]
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    run = served("tiny serve", command, env, timeout_s=120, tokens=8)
    assert run.returncode == 0, run.tail  # stopped by SIGINT, cleanly
    assert 0 < run.first_token_s <= run.answer_s <= run.exit_s
    # The start-up line parsed into its phases (printed to a tenth of a second, so a tiny
    # CPU server's total may read 0.0: bounded, not required positive).
    assert {"total", "open", "weights"} <= set(run.phases), run.tail
    assert 0 <= run.phases["total"] <= run.exit_s and PORT not in run.command


def test_bytecode_as_installed_is_compiled_into_the_run_s_prefix(tmp_path, monkeypatch):
    import sysconfig

    import benchmarks.startup as startup

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "mod.py").write_text("x = 1\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(lib)})
    monkeypatch.setattr(startup, "PACKAGES", ("ostinato", "no_such_package_here"))
    prefix = tmp_path / "bytecode"
    startup.compile_installed(dict(os.environ, PYTHONPYCACHEPREFIX=str(prefix)))
    compiled = {p.name.split(".")[0] for p in prefix.rglob("*.pyc")}
    assert {"mod", "graph", "dispatcher"} <= compiled
    args = argparse.Namespace(device="cuda", max_tokens=8)
    names = [name for name, _, _ in startup.scenarios(args)]
    assert f"smollm2 default, caches empty, {startup.INSTALLED}" in names


def test_a_run_keeps_its_caches_and_bytecode_where_it_is_told(tmp_path, monkeypatch):
    from benchmarks.startup import run_environment

    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    env = run_environment(tmp_path / "c", tmp_path / "b")
    assert env["OSTINATO_CACHE_DIR"] == str(tmp_path / "c") and "TRITON_CACHE_DIR" not in env
    assert env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "b")
    assert "PYTHONDONTWRITEBYTECODE" not in env
    env = run_environment(tmp_path / "c", None)
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and "PYTHONPYCACHEPREFIX" not in env
