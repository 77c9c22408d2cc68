"""The decoder (Llama family) and its layers: attention, linear projections, RoPE, norms,
the custom ops they call, the model config and the presets."""
