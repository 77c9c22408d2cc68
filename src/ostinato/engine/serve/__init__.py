"""Serving: one engine loop that many callers share (``loop``), and the OpenAI-compatible
HTTP server on top of it (``app``, the ``serve`` extra)."""
