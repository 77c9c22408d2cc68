"""Where a model comes from: presets, Hugging Face folders, GGUF files, safetensors."""
