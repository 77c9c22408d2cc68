"""The engine's user API: the ``LLM`` facade, its grouped arguments, prompt checks and outputs."""
