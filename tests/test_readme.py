"""The README's usage example runs as written (CPU here; the GPU suite runs it on CUDA)."""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def usage_example() -> str:
    text = README.read_text()
    section = text[text.index("## Usage") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_usage_example_runs_on_cpu(capsys):
    exec(compile(usage_example(), "README.md", "exec"), {})
    out = capsys.readouterr().out
    expected = "FULL" if torch.cuda.is_available() else "NONE"
    assert out.startswith(expected)


@pytest.mark.gpu
def test_usage_example_runs_on_gpu(capsys):
    exec(compile(usage_example(), "README.md", "exec"), {})
    assert capsys.readouterr().out.startswith("FULL ")
