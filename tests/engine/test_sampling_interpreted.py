"""The sampling kernels' checks (test_gpu_sampling_kernel.py: draws against torch's from
the same keys, the nucleus's distribution, penalties inside the first kernel, rows of
NaNs, the log probabilities) on the CPU, through Triton's interpreter, at the vocabulary
sizes that run in under a minute there (151936 columns only on the GPU)."""

import os
import subprocess
import sys

from interpreted import TESTS, needs_triton


@needs_triton
def test_the_sampling_kernels_checks_pass_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(TESTS.parent / "src")}
    run = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not 151936",
        str(TESTS / "engine" / "test_gpu_sampling_kernel.py"),
    ]  # fmt: skip
    out = subprocess.run(
        run, capture_output=True, text=True, env=env, timeout=600, cwd=TESTS.parent
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout, out.stdout[-1000:]
