"""Run in an environment where only the graph runtime is installed (``pip install .``, no
extras): the engine's dependencies are absent, importing ostinato works, and the
README's two library examples run as written. CI calls it from a fresh virtual
environment."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
HEADINGS = (
    "## The library on your own model: FULL graphs",
    "## The library on your own model: PIECEWISE graphs",
)


def main() -> int:
    present = [m for m in ("transformers", "gguf", "safetensors") if importlib.util.find_spec(m)]
    if present:
        print(f"not a library-only environment: {present} installed", file=sys.stderr)
        return 1
    import ostinato

    print(f"ostinato {ostinato.__file__} imports without the engine's dependencies")
    text = README.read_text()
    for heading in HEADINGS:
        code = re.search(r"```python\n(.*?)```", text[text.index(heading) :], re.S).group(1)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        print(f"{heading[3:]}: {'ran' if done.returncode == 0 else 'FAILED'}")
        if done.returncode:
            print(done.stdout + done.stderr, file=sys.stderr)
            return 1
        print(done.stdout, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
