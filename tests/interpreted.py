"""Triton kernels on the CPU: a script run in a fresh Python with Triton's interpreter on
(``TRITON_INTERPRET=1``, read when Triton is imported, so never in the test's own process)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def interpreted(script: str, *args: str, timeout: int) -> str:
    """``script``'s standard output, run with ``args`` as its arguments and the
    repository's ``src`` on its path; it must exit 0 (else its error's end is shown)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(TESTS.parent / "src")}
    run = [sys.executable, "-c", script, *args]
    out = subprocess.run(run, capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
