"""A GGUF file's tokenizer, built by transformers in a child process.

transformers builds it from the file's metadata (SmolLM2's: 442k parts) in seconds of
Python. On a thread beside the start, that work holds the GIL, and every torch call of the
start that gives the GIL up then waits up to a switch interval to take it back: on an
H200, SmolLM2's first start spent 17.3 s in its layer plan beside it, against 5.4 s with
the tokenizer built before. The child holds no lock of ours. It writes the tokenizer's
files (``save_pretrained``), which the parent reads back as a cache hit does
(``tokenizer_file``, a fraction of a second).

    python -m ostinato.engine.loading.gguf_tokenizer FILE.gguf OUT_FOLDER

The command line starts it before it imports torch (``start_early``), so that the
child's imports (torch and transformers: seconds) overlap the parent's; the engine then
takes that child up (``TokenizerChild.for_file``). One nobody takes up is ended at exit.

Exit status 0: the files are in OUT_FOLDER; ``NO_TRANSFORMERS``: transformers is not
installed, nothing written; anything else: failed, the error on stderr.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NO_TRANSFORMERS = 3
_TAIL = 2000  # characters of a failed child's stderr kept in the error


class TokenizerChildError(RuntimeError):
    """The child could not build the tokenizer (its message ends with the child's stderr)."""


class TokenizerChild:
    """The child building ``path``'s tokenizer into a folder of its own, started at once.
    ``wait`` returns that folder; ``close`` ends the child if it still runs and removes the
    folder (safe more than once)."""

    module = __name__  # what the child runs (``python -m``)

    def __init__(self, path: Path) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="ostinato-tokenizer-"))
        # A file, not a pipe: transformers' warnings never fill a buffer nobody reads.
        self._stderr = tempfile.TemporaryFile(mode="w+")
        # The parent's import path, so the child imports the same ostinato; no GPU.
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", self.module, str(path), str(self.folder)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            env=env,
        )

    @classmethod
    def for_file(cls, path: Path) -> TokenizerChild:
        """The child ``start_early`` started for ``path``, else a new one."""
        return _EARLY.pop(path.resolve(), None) or cls(path)

    def wait(self) -> Path | None:
        """Waits for the child: the folder holding the tokenizer's files, or None where
        transformers is not installed. Raises ``TokenizerChildError`` if it failed."""
        code = self._proc.wait()
        if code == 0:
            return self.folder
        if code == NO_TRANSFORMERS:
            return None
        self._stderr.seek(0)
        tail = self._stderr.read()[-_TAIL:].strip()
        raise TokenizerChildError(
            f"the child process building the GGUF tokenizer exited with status {code}: "
            f"{tail or '(no output)'}"
        )

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_EARLY: dict[Path, TokenizerChild] = {}  # started before they were asked for, by file


def start_early(path: Path) -> None:
    """Starts the child for ``path`` now, for ``TokenizerChild.for_file`` to take up
    (once per file); it is ended at exit if nobody does."""
    key = path.resolve()
    if key not in _EARLY:
        child = _EARLY[key] = TokenizerChild(path)
        atexit.register(child.close)


def main() -> None:
    from ostinato.engine.loading.gguf_file import GGUFCheckpoint

    path, out = Path(sys.argv[1]), Path(sys.argv[2])
    tokenizer = GGUFCheckpoint(path).tokenizer()
    if tokenizer is None:
        sys.exit(NO_TRANSFORMERS)
    tokenizer.save_pretrained(str(out))


if __name__ == "__main__":
    main()
