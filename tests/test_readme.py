"""The README's library examples run as written (CPU here; the GPU suite runs them on
CUDA), and the README stays a five-minute read."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def example(heading: str) -> str:
    """The first Python block under ``heading``."""
    text = README.read_text()
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def full_example() -> str:
    return example("## The library on your own model: FULL graphs")


def run_piecewise_example() -> str:
    # In a process of its own: the example registers a custom op, once per process.
    code = example("## The library on your own model: PIECEWISE graphs")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def one_call_example() -> str:
    return example("## Any model in one call")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the example captures graphs")
def test_one_call_example_runs_on_cpu(capsys):
    with pytest.warns(UserWarning, match="every call runs eagerly"):
        exec(compile(one_call_example(), "README.md", "exec"), {})
    assert "calls from graphs" in capsys.readouterr().out


@pytest.mark.gpu
def test_one_call_example_runs_on_gpu(capsys):
    exec(compile(one_call_example(), "README.md", "exec"), {})
    assert "1 calls from graphs" in capsys.readouterr().out


def test_full_example_runs_on_cpu(capsys):
    exec(compile(full_example(), "README.md", "exec"), {})
    out = capsys.readouterr().out
    expected = "FULL" if torch.cuda.is_available() else "NONE"
    assert out.startswith(expected)


def test_piecewise_example_runs_on_cpu():
    expected = "PIECEWISE" if torch.cuda.is_available() else "NONE"
    assert run_piecewise_example().startswith(expected + " ")


@pytest.mark.gpu
def test_full_example_runs_on_gpu(capsys):
    exec(compile(full_example(), "README.md", "exec"), {})
    assert capsys.readouterr().out.startswith("FULL ")


@pytest.mark.gpu
def test_piecewise_example_runs_on_gpu():
    out = run_piecewise_example()
    assert out.startswith("PIECEWISE ") and " 0 graphs captured" not in out, out


def test_the_readme_is_short_and_names_no_commit_or_issue():
    text = README.read_text()
    assert len(text.splitlines()) < 200
    assert not re.search(r"\b[0-9a-f]{7,40}\b", text), "a commit hash"
    assert not re.search(r"\b[Ii]ssues? \d+|#\d+", text), "an issue number"
