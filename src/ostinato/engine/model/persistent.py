"""A decoder's layers as one persistent kernel for small steps (``KernelOptions(
persistent_layers=True)``, opt-in): ``PersistentLayers.forward`` has the model's
signature and output, and ``can_run(n)`` says which steps it takes (1 to ``MAX_ROWS``
rows); the runner sends those to it and every other step to the model.

The kernel (``kernels.persistent_decode``) reads the layers' weights and the KV cache
through tables of their addresses, made here once: the model's parameters and the cache
must stay where they are afterwards (as captured graphs already require).
"""

from __future__ import annotations

import torch

from ostinato.context import get_forward_context
from ostinato.engine.core.kv_cache import KVCache
from ostinato.engine.kernels.gemm_launch import MAX_ROWS, rope_head_dim
from ostinato.engine.model.attention import TritonAttention
from ostinato.engine.model.decoder import DecoderModel


def unsupported(
    model: DecoderModel, cache: KVCache, device: torch.device, backend: object
) -> list[str]:
    """Why the persistent kernel cannot run ``model`` over ``cache`` with attention
    ``backend`` (empty when it can)."""
    config, why = model.config, []
    if not (isinstance(backend, TritonAttention) and backend.applies_rope):
        why.append(
            "the attention backend must be TritonAttention(fused=True) (its cache "
            f"layout, RoPE at the cache write), got {type(backend).__name__}"
        )
    if device.type != "cuda":
        why.append(f"it runs on CUDA only (device {device})")
    if model.tp.group is not None:
        why.append("tensor parallelism (its all-reduces are not in the kernel)")
    dtype = model.embed_tokens.weight.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        why.append(f"16-bit weights only (got {dtype})")
    if not rope_head_dim(config.head_dim):
        why.append(f"head dim {config.head_dim} (a power of two >= 32 only)")
    if config.o_bias:
        why.append("an output-projection bias")
    if not cache.k[0].is_contiguous():
        why.append("a non-contiguous KV cache")
    return why


def _addresses(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


def layer_tables(model: DecoderModel, cache: KVCache, device: torch.device) -> object:
    """The kernel's per-layer address tables (``LayerTables``) for ``model`` and ``cache``
    (missing biases and head norms point at the QKV weight: never read)."""
    from ostinato.engine.kernels.persistent_decode import LayerTables

    attn = [layer.self_attn for layer in model.layers]
    mlp = [layer.mlp for layer in model.layers]
    qkv = [a.qkv_proj.weight for a in attn]

    def table(tensors: list[torch.Tensor | None]) -> torch.Tensor:
        return _addresses(
            [t if t is not None else w for t, w in zip(tensors, qkv, strict=True)], device
        )

    return LayerTables(
        ln1=table([layer.input_layernorm.weight for layer in model.layers]),
        qkv=table(qkv),
        qkv_bias=table([a.qkv_proj.bias for a in attn]),
        q_norm=table([a.q_norm.weight if a.q_norm is not None else None for a in attn]),
        k_norm=table([a.k_norm.weight if a.k_norm is not None else None for a in attn]),
        o=table([a.o_proj.weight for a in attn]),
        ln2=table([layer.post_attention_layernorm.weight for layer in model.layers]),
        gate_up=table([m.gate_up_proj.weight for m in mlp]),
        down=table([m.down_proj.weight for m in mlp]),
        k_cache=_addresses(cache.k, device),
        v_cache=_addresses(cache.v, device),
    )


def stack_shape(model: DecoderModel, cache: KVCache) -> object:
    """What the kernel is compiled for (``StackShape``)."""
    from ostinato.engine.kernels.persistent_decode import StackShape

    c = model.config
    return StackShape(
        layers=c.num_layers, hidden=c.hidden_size, inter=c.intermediate_size,
        q_heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        block_size=cache.block_size, eps=c.rms_norm_eps, qkv_bias=c.qkv_bias,
        qk_norm=c.qk_norm,
    )  # fmt: skip


class PersistentLayers:
    """``model``'s layers as one kernel for steps of 1 to ``MAX_ROWS`` rows, over
    ``cache``, with attention ``backend`` (``TritonAttention(fused=True)``: refused
    otherwise, as is anything else ``unsupported`` names). The output is the model's
    (final-norm hidden states) to rounding: the kernel runs the fused per-layer kernels'
    arithmetic, but attention merges its key splits in another order."""

    def __init__(
        self, model: DecoderModel, cache: KVCache, device: torch.device, backend: object
    ) -> None:
        why = unsupported(model, cache, device, backend)
        if why:
            raise ValueError(
                "KernelOptions.persistent_layers: this model cannot run as one kernel: "
                + "; ".join(why)
                + ". Build it without persistent_layers."
            )
        from ostinato.engine.kernels.launch import num_sms
        from ostinato.engine.kernels.persistent_decode import DecodeScratch

        self.model = model
        self.shape = stack_shape(model, cache)
        self.tables = layer_tables(model, cache, device)
        self.scratch = DecodeScratch(self.shape, model.embed_tokens.weight.dtype, device)
        self.programs = num_sms(device)

    @staticmethod
    def can_run(n: int) -> bool:
        """Whether a step of ``n`` rows runs here (any mix of prefill and decode rows)."""
        return 0 < n <= MAX_ROWS

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's ``forward(input_ids, positions)`` (1 to ``MAX_ROWS`` rows), in the
        forward context of a step over the cache and backend it was made for."""
        from ostinato.engine.kernels.persistent_decode import decode_layers

        step = get_forward_context().attn_metadata
        n, s, meta = input_ids.shape[0], self.scratch, step.metadata
        torch.index_select(self.model.embed_tokens.weight, 0, input_ids, out=s.res[1][:n])
        cos, sin = self.model.rope(positions, s.res.dtype)
        decode_layers(
            n, cos, sin, meta.positions, meta.token_req, meta.slot_mapping, meta.block_tables,
            self.shape, self.tables, s, self.programs,
        )  # fmt: skip
        return self.model.norm.add(s.mlp[:n], s.res[0][:n])[0]
