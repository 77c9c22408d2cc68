"""Where a benchmark result came from: device, software versions, commit and date."""

from __future__ import annotations

import datetime as dt
import os
import platform as pyplatform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Provenance:
    """Recorded with every committed result so numbers can be compared honestly."""

    device: str
    torch: str
    cuda: str | None
    python: str
    commit: str
    dirty: bool
    date: str

    @classmethod
    def collect(cls, repo: Path | None = None) -> Provenance:
        """Reads the current machine and the git checkout at ``repo`` (default: cwd)."""
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        commit, dirty = _git_state(repo or Path.cwd())
        return cls(
            device=device,
            torch=torch.__version__,
            cuda=torch.version.cuda,
            python=pyplatform.python_version(),
            commit=commit,
            dirty=dirty,
            date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        )


def _git_state(repo: Path) -> tuple[str, bool]:
    # A copy of the tree without .git (e.g. on a remote GPU host) is told its commit.
    if os.environ.get("OSTINATO_COMMIT"):
        return os.environ["OSTINATO_COMMIT"], os.environ.get("OSTINATO_DIRTY", "0") == "1"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True
    return commit, bool(status)
