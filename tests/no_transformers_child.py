"""A stand-in for the GGUF tokenizer child where transformers is not installed: it exits
with the status that says so, writing nothing."""

import sys

from ostinato.engine.loading.gguf_tokenizer import NO_TRANSFORMERS

sys.exit(NO_TRANSFORMERS)
