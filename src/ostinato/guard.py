"""The capture phase, and diagnostics for a capture that failed."""

from __future__ import annotations

import contextlib
import gc
import os
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from ostinato.errors import CaptureNotAllowedError
from ostinato.platform import Platform

_in_capture_phase: ContextVar[bool] = ContextVar("ostinato_capture_phase", default=False)


@contextlib.contextmanager
def capture_phase(collect: bool = True, pause_collector: bool = True) -> Iterator[None]:
    """Inside this block graphs may be captured; garbage collection is paused.

    With ``collect``, one full collection runs on entry (memory freed before the
    captures); the collector is re-enabled on exit (only if it was enabled before).
    Pausing it matters because a capture may be triggered once per piece per size, and
    a collection between captures costs far more than the capture. A phase of one
    capture between a caller's steps skips the entry collection for the same reason.

    Without ``pause_collector`` the collector runs on between captures (each capture
    still pauses it: the platform's ``capture``). That is for a phase beside steps: the
    pause is process-wide, so over a background start's minute every thread's garbage
    piles up, and the first collection after it takes all of it at once (67 thousand
    objects, 17-35 ms with the GIL held, every step waiting, on an H200 host).
    """
    if collect:
        gc.collect()
    was_enabled = gc.isenabled()
    if pause_collector:
        gc.disable()
    token = _in_capture_phase.set(True)
    try:
        yield
    finally:
        _in_capture_phase.reset(token)
        if was_enabled:
            gc.enable()


def in_capture_phase() -> bool:
    """True inside ``capture_phase()``."""
    return _in_capture_phase.get()


def check_capture_allowed(what: str, lazy_capture: bool) -> None:
    """Raises ``CaptureNotAllowedError`` unless capture is allowed now."""
    if lazy_capture or _in_capture_phase.get():
        return
    raise CaptureNotAllowedError(
        f"{what} has no graph yet and would be captured in the middle of serving. "
        "Capture every size at start-up (GraphManager.capture, or run a step of each "
        "size inside `with ostinato.capture_phase():`), or pass lazy_capture=True to "
        "allow capture on first use."
    )


# Frames in these folders are never the user's op: torch, the stdlib, and ostinato.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(f)) + os.sep
    for f in (torch.__file__, contextlib.__file__, __file__)
)


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame of ``exc`` outside torch, ostinato and the stdlib."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_LIBRARY_DIRS):
            return frame
    return frames[-1] if frames else None


@dataclass(frozen=True)
class IllegalOp:
    """Where a host-device synchronisation happened: ``where`` is ``file:line in func``."""

    where: str
    source: str
    error: str


def locate_illegal_op(
    platform: Platform, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> IllegalOp | None:
    """Re-runs ``fn`` eagerly with host-device syncs made errors; names the first one.

    Returns None if the eager run raised nothing (the capture failed for another
    reason). The re-run is eager, so it has the same side effects as a warm-up run.
    """
    try:
        with warnings.catch_warnings():
            # torch calls its sync debug mode a prototype; the warning is noise here.
            warnings.simplefilter("ignore", UserWarning)
            with platform.sync_errors():
                fn(*args, **kwargs)
    except Exception as exc:  # any error is the diagnosis we want
        frame = user_frame(exc)
        message = str(exc).splitlines()[0] if str(exc) else ""
        error = f"{type(exc).__name__}: {message}"
        if frame is None:
            return IllegalOp("an unknown place", "?", error)
        return IllegalOp(
            f"{frame.filename}:{frame.lineno} in {frame.name}", frame.line or "?", error
        )
    finally:
        platform.synchronize()
    return None
