"""The errors ostinato raises. Each message names the cause and the fix."""

from __future__ import annotations


class OstinatoError(RuntimeError):
    """Base class of ostinato's runtime errors."""


class CaptureNotAllowedError(OstinatoError):
    """A graph would be captured outside the capture phase without lazy capture."""


class GraphCaptureError(OstinatoError):
    """A callable could not be captured; the message names the op and source line."""


class InputAddressChangedError(OstinatoError):
    """A graph was replayed with an input at a different address than at capture."""


class PlatformError(OstinatoError):
    """The requested platform is unavailable, or cannot do what was asked."""
