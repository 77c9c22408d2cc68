"""The ``ostinato`` command line (``demo``, ``generate``) over the engine."""
