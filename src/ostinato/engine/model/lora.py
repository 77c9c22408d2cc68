"""LoRA slots on the device: every adapter a step may use, in fixed buffers graphs read.

Each projection group of a layer (QKV, O, gate/up, down: the model's fused projections)
holds ``max_loras`` slots of ``max_rank`` rows per member projection. ``a`` stacks every
slot's A matrices (``[slots * members * rank, in]``); ``b`` their B matrices, transposed
and scaled, each in the output columns of its member and zero elsewhere
(``[slots * members * rank, out]``). A step's delta is then two GEMMs whatever the mix
of adapters: ``s = x @ a.T``, each row's columns of other slots zeroed by a per-row mask,
``y += s @ b``. The mask comes from ``row_slots``, a per-token input written before each
step (-1: no adapter, so padding and base rows add exactly zero), so one captured graph
serves every mix of adapters and loading one into a slot needs no recapture.

Guarantees: a slot holds exactly what ``load`` last wrote (rows past an adapter's rank
are zero); ``row_slots`` never moves; nothing here synchronises with the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ostinato.context import current_forward_context
from ostinato.engine.kernels.gemm_launch import (
    CONFIGS,
    counters_needed,
    fits,
    pick_config,
    rope_config,
)
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.linear import Linear, plan_entry

# The projection groups of a decoder layer and the checkpoint projections in each, in
# the order of the fused projection's output columns.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
MODULES: tuple[str, ...] = tuple(m for members in GROUPS.values() for m in members)

# The step's per-row slot mask, an op opaque to torch.compile: the slice of ``row_slots``
# by the step's token count happens inside it (Inductor on torch 2.11 failed to compile
# that slice of a buffer by the compiled graph's unbacked token count).
_lib = torch.library.Library("ostinato", "FRAGMENT")
_lib.define("lora_mask(Tensor x, Tensor row_slots, Tensor slot_ids) -> Tensor")


def _lora_mask(x: torch.Tensor, row_slots: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    return (row_slots[: x.shape[0], None] == slot_ids).to(x.dtype)


_lib.impl("lora_mask", _lora_mask, "CompositeExplicitAutograd")


@torch.library.register_fake("ostinato::lora_mask", lib=_lib)
def _(x: torch.Tensor, row_slots: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], slot_ids.shape[0]))


@dataclass(frozen=True)
class RowDelta:
    """A few rows' LoRA expand, left for the norm after the projection to add in its own
    kernel (``ostinato::lora_add_rms_norm``): row ``i`` adds ``s[i, W * slots[i] : W *
    (slots[i] + 1)] @ b[those rows]``, ``W = b.shape[0] // max_loras``, nothing where its
    slot is -1; ``s`` is every slot's shrink (``[rows, b's rows]``)."""

    s: torch.Tensor
    b: torch.Tensor
    slots: torch.Tensor
    max_loras: int


@dataclass(frozen=True)
class LoraShape:
    """How many adapters the device holds at once (``max_loras``), their largest rank,
    and the most token rows a step has (the ``row_slots`` input)."""

    max_loras: int
    max_rank: int
    max_tokens: int

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_rank", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")


def slot_bytes(config: ModelConfig, shape: LoraShape, dtype: torch.dtype) -> int:
    """Device bytes of ``LoraWeights(config, shape)`` in ``dtype`` (the slots' ``a`` and
    ``b``; the per-token input is negligible)."""
    per_layer = 0
    for fan_in, outs in group_shapes(config).values():
        per_layer += shape.max_loras * len(outs) * shape.max_rank * (fan_in + sum(outs))
    return per_layer * config.num_layers * dtype.itemsize


def group_shapes(config: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each projection group's input features and its members' output features: the
    layout of its slots (``LoraProjection``)."""
    sizes = projection_shapes(config)
    return {
        group: (sizes[members[0]][0], tuple(sizes[m][1] for m in members))
        for group, members in GROUPS.items()
    }


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA target projection of one layer (one GPU)."""
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv, inter = config.num_kv_heads * config.head_dim, config.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
    }  # fmt: skip


Pair = tuple[torch.Tensor, torch.Tensor]  # a projection's (A, B), or a slot's (a, b) rows

# One adapter in the slots' layout, per layer and group: (A rows, B rows), float32 on
# the host (``LoraWeights.pack``); ``load`` copies them into a slot.
Packed = list[dict[str, Pair]]


class LoraProjection(nn.Module):
    """The slots of one projection group (see the module docstring)."""

    def __init__(self, in_features: int, outs: tuple[int, ...], shape: LoraShape) -> None:
        super().__init__()
        self.outs, self.shape = outs, shape
        width = shape.max_loras * len(outs) * shape.max_rank
        # Not persistent: no checkpoint has them; zeroed by ``clear`` once on the device.
        self.register_buffer("a", torch.zeros(width, in_features), persistent=False)
        self.register_buffer("b", torch.zeros(width, sum(outs)), persistent=False)
        # The projection's weight and ``a`` in one buffer, once ``join`` made it.
        self.joint: torch.Tensor | None = None
        # The joint GEMM's split-K counters where it runs the projection's plan.
        self.register_buffer("counters", torch.zeros(0, dtype=torch.int32), persistent=False)

    def join(self, linear: nn.Linear) -> None:
        """Puts ``linear``'s weight and ``a`` in one buffer (``[out + width, in]``, the
        weight in its first rows), their values kept: one GEMM then yields the projection
        and every slot's shrink. ``linear.weight`` (a parameter still) and ``a`` become
        views of it; call again after anything that makes them anew (``Module._apply``)."""
        weight = linear.weight
        rows = weight.shape[0]
        joint = weight.new_empty((rows + self.a.shape[0], weight.shape[1]))
        if joint.device.type != "meta":
            with torch.no_grad():
                joint[:rows].copy_(weight)
                joint[rows:].copy_(self.a)
        linear.weight = nn.Parameter(joint[:rows], requires_grad=weight.requires_grad)
        self.a = joint[rows:]
        self.joint = joint
        # Zero, as the small GEMM leaves them after every call.
        self.counters = torch.zeros(
            counters_needed(joint.shape[0]), dtype=torch.int32, device=joint.device
        )

    def pack(self, parts: list[Pair | None], scaling: float) -> Pair:
        """One slot's rows (``[members * rank, in]``, ``[members * rank, out]``, float32)
        from each member's ``(A [r, in], B [out, r])`` (None: not adapted)."""
        rank, widths = self.shape.max_rank, self.outs
        a = torch.zeros(len(widths) * rank, self.a.shape[1])
        b = torch.zeros(len(widths) * rank, sum(widths))
        start = 0
        for i, (part, width) in enumerate(zip(parts, widths, strict=True)):
            if part is not None:
                lora_a, lora_b = part
                r = lora_a.shape[0]
                a[i * rank : i * rank + r] = lora_a.float()
                b[i * rank : i * rank + r, start : start + width] = lora_b.float().t() * scaling
            start += width
        return a, b

    def load(self, slot: int, rows: Pair) -> None:
        """Writes one slot (``pack``'s rows) in place."""
        span = slice(slot * rows[0].shape[0], (slot + 1) * rows[0].shape[0])
        self.a[span].copy_(rows[0], non_blocking=True)
        self.b[span].copy_(rows[1], non_blocking=True)

    def project(
        self,
        linear: nn.Linear,
        x: torch.Tensor,
        mask: torch.Tensor,
        slots: torch.Tensor,
        swiglu_pdl: bool | None = None,
    ) -> torch.Tensor:
        """``linear(x)`` plus each row's adapter delta, a new contiguous tensor (``join``
        first); ``mask`` ``[n, max_loras]``: 1 in the row's slot, else 0; ``slots``: the
        rows' slots (``row_slots``). With ``swiglu_pdl`` (not None: the gate/up group),
        SiLU·mul of that sum instead (``ostinato::silu_mul``, with PDL as it says).
        One GEMM over the joint weight gives the projection and every slot's shrink; a
        few rows on CUDA, eagerly (the decode graphs), then expand in one kernel that
        gathers each row's slot of B (``lora_expand``, SiLU·mul included) instead of a
        mask multiply and a GEMM over every slot."""
        y, s = self._joint(linear, x)
        swiglu = swiglu_pdl is not None
        if expands_in_kernel(x):
            from ostinato.engine.kernels import lora_expand  # (Triton: CUDA only)

            max_loras, pdl = self.shape.max_loras, bool(swiglu_pdl) or _pdl(linear)
            return lora_expand.lora_expand(y, s, self.b, slots, max_loras, swiglu, False, pdl)
        # No reshape or broadcast names the row count: compiled, it is an unbacked size,
        # on which torch 2.11 would guard.
        s = (s.unflatten(1, (self.shape.max_loras, -1)) * mask.unsqueeze(-1)).flatten(1)
        total = y + torch.mm(s, self.b)
        return total if not swiglu else torch.ops.ostinato.silu_mul(total, swiglu_pdl)

    def project_rope_kv(
        self, linear: nn.Linear, x: torch.Tensor, slots: torch.Tensor, rope: Any, out: torch.Tensor
    ) -> torch.Tensor:
        """The QKV group where the expand runs as a kernel (``expands_in_kernel``): the
        joint GEMM, then ``lora_expand.lora_expand_qkv`` (``rope``: a
        ``small_gemm.RopeKV``): the query heads into ``out``, the keys and values into
        the cache, as ``norm_qkv``'s kernel leaves them; returns ``out``."""
        from ostinato.engine.kernels.lora_expand import lora_expand_qkv  # (Triton: CUDA only)

        y, s = self._joint(linear, x)
        return lora_expand_qkv(y, s, self.b, slots, self.shape.max_loras, rope, out, _pdl(linear))

    def project_for_norm(
        self, linear: nn.Linear, x: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, RowDelta | None]:
        """``project``'s sum, left for the norm after it to finish where the expand would
        run as a kernel (``expands_in_kernel``): ``linear(x)`` (a strided view) and the
        rows' delta, which ``ostinato::lora_add_rms_norm`` adds in the norm's own kernel
        (one launch less a layer); elsewhere ``project``'s sum and None."""
        if not expands_in_kernel(x):
            return self.project(linear, x, mask, slots), None
        y, s = self._joint(linear, x)
        return y, RowDelta(s, self.b, slots, self.shape.max_loras)

    def segment_rope_kv(
        self, linear: nn.Linear, h: torch.Tensor, s: torch.Tensor, slots: torch.Tensor,
        rope: Any, out: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The QKV group where the norm before it shrank the rows (``shrinks_in_norm``;
        ``s`` ``[rows, W]``, each row's by its slot): one kernel, the projection's GEMM
        with each row's expand added before its ROPE_KV epilogue (``small_gemm``'s LoRA
        segment), as ``project_rope_kv`` leaves the query heads, keys and values."""
        from ostinato.engine.kernels.launch import num_sms  # (Triton: CUDA only)
        from ostinato.engine.kernels.small_gemm import qkv_rope_kv

        d, heads = rope.k_cache.shape[-1], rope.q_heads + 2 * rope.kv_heads
        shape = (heads, d, h.shape[1], num_sms(h.device), h.shape[0])
        weight_bytes = linear.weight.numel() * linear.weight.element_size()
        config = rope_config(*shape, rope.q_norm is not None, weight_bytes)
        if config.smem:  # (takes no segment: the K loop's launch instead)
            config = rope_config(*shape, True, weight_bytes)
        segment = self._segment(s, slots)
        return qkv_rope_kv(
            h, linear.weight, linear.bias, self.counters, config, rope, None, _pdl(linear),
            out=out, lora=segment,
        )  # fmt: skip

    def segment_swiglu(
        self, linear: nn.Linear, h: torch.Tensor, s: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """The gate/up group where the norm before it shrank the rows (``s`` as in
        ``segment_rope_kv``): one kernel, the GEMM with each row's expand added before
        its SiLU·mul epilogue, on the projection's plan for these rows where that is a
        K-loop launch, else on the rule's (``gemm_launch.pick_config``)."""
        from ostinato.engine.kernels.launch import num_sms  # (Triton: CUDA only)
        from ostinato.engine.kernels.small_gemm import small_gemm

        rows, k = h.shape
        entry = plan_entry(linear.plan, rows) if isinstance(linear, Linear) else 0
        if not entry or CONFIGS[entry - 1].smem or not fits(CONFIGS[entry - 1], rows, k, 2):
            entry = pick_config(linear.weight.shape[0] // 2, k, num_sms(h.device), swiglu=True)
        return small_gemm(
            h, linear.weight, None, self.counters, CONFIGS[entry - 1], True, _pdl(linear),
            lora=self._segment(s, slots),
        )  # fmt: skip

    def _segment(self, s: torch.Tensor, slots: torch.Tensor) -> Any:
        """The small GEMM's ``LoraSegment`` of these rows' shrink ``s``."""
        from ostinato.engine.kernels.lora_segment import LoraSegment  # (Triton: CUDA only)

        return LoraSegment(s, self.b, slots, self.shape.max_loras)

    def _joint(self, linear: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``linear(x)`` and every slot's shrink, from one GEMM over the joint weight, run
        as ``linear``'s small-row plan says for these rows (the tuned Triton GEMM, with
        its PDL) where it has one, else cuBLAS's product as before: the rows' LoRA step
        keeps the kernels the base step measured fastest for the projection's shape."""
        assert self.joint is not None, "LoraProjection.project before join"
        rows = linear.weight.shape[0]
        plan = list(linear.plan) if isinstance(linear, Linear) else []
        full = torch.ops.ostinato.linear(
            x, self.joint, None, self.counters, plan, False, _pdl(linear)
        )
        y, s = full[:, :rows], full[:, rows:]
        if linear.bias is not None:
            y = y + linear.bias
        return y, s


def _pdl(linear: nn.Linear) -> bool:
    """Whether ``linear``'s launches use PDL (its plan's flag; none without a plan)."""
    return isinstance(linear, Linear) and linear.pdl


def shrinks_in_norm(x: torch.Tensor) -> bool:
    """Whether a LoRA step's QKV and gate/up groups take each row's shrink from the norm
    before them (``kernels.rms_norm``'s ``Shrink``) and add its expand inside their GEMM
    (``kernels.lora_segment``): one kernel a group, no joint GEMM's shrink and no expand
    kernel. Where the expand runs as a kernel (``expands_in_kernel``), on 16-bit rows
    (the small GEMM's; float32 keeps the cuBLAS product)."""
    return x.dtype in (torch.float16, torch.bfloat16) and expands_in_kernel(x)


def expands_in_kernel(x: torch.Tensor) -> bool:
    """Whether the expand of ``x``'s rows gathers each row's slot of B in a kernel: on
    CUDA, eagerly (the decode graphs record the eager model), at most
    ``lora_expand.MAX_ROWS`` rows; else the dense path (a mask multiply and a GEMM)."""
    if not x.is_cuda or torch.compiler.is_compiling():
        return False
    from ostinato.engine.kernels.lora_expand import MAX_ROWS  # (Triton: CUDA only)

    return x.shape[0] <= MAX_ROWS


class LoraWeights(nn.Module):
    """Every layer's LoRA slots and the per-token slot input (see the module docstring)."""

    def __init__(self, config: ModelConfig, shape: LoraShape) -> None:
        super().__init__()
        self.shape = shape
        groups = group_shapes(config)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    group: LoraProjection(fan_in, outs, shape)
                    for group, (fan_in, outs) in groups.items()
                }
            )
            for _ in range(config.num_layers)
        )
        self.register_buffer(
            "row_slots", torch.full((shape.max_tokens,), -1, dtype=torch.long), persistent=False
        )
        self.register_buffer("slot_ids", torch.arange(shape.max_loras), persistent=False)

    def clear(self) -> None:
        """Empties every slot and marks every row adapter-free (after ``to_empty``)."""
        with torch.no_grad():
            for projection in self.modules():
                if isinstance(projection, LoraProjection):
                    projection.a.zero_()
                    projection.b.zero_()
            self.row_slots.fill_(-1)
            self.slot_ids.copy_(torch.arange(self.shape.max_loras))

    def reset_parameters(self) -> None:
        """``clear`` (a model drawn anew holds no adapter)."""
        self.clear()

    def pack(self, weights: dict[tuple[int, str], Pair], scaling: float) -> Packed:
        """An adapter's ``(layer, module) -> (A, B)`` in the slots' layout (``load``),
        pinned on the host where the slots are on CUDA."""
        pin = self.slot_ids.device.type == "cuda"
        packed: Packed = []
        for i, layer in enumerate(self.layers):
            groups = {}
            for group, members in GROUPS.items():
                parts = [weights.get((i, m)) for m in members]
                a, b = layer[group].pack(parts, scaling)
                dtype = layer[group].a.dtype
                a, b = a.to(dtype), b.to(dtype)
                groups[group] = (a.pin_memory(), b.pin_memory()) if pin else (a, b)
            packed.append(groups)
        return packed

    @torch.no_grad()
    def load(self, slot: int, packed: Packed) -> None:
        """Writes an adapter (``pack``'s value) into ``slot``."""
        if not 0 <= slot < self.shape.max_loras:
            raise ValueError(f"LoRA slot {slot} outside [0, {self.shape.max_loras})")
        for i, layer in enumerate(self.layers):
            for group in GROUPS:
                layer[group].load(slot, packed[i][group])

    def rows(self, x: torch.Tensor) -> LoraRows:
        """The slots of ``x``'s rows (the step's first rows) as the layers apply them."""
        return LoraRows(torch.ops.ostinato.lora_mask(x, self.row_slots, self.slot_ids), self)


@dataclass(frozen=True)
class LoraRows:
    """One step's adapters: each row's slot as a mask (``[n, max_loras]``) and the slots."""

    mask: torch.Tensor
    weights: LoraWeights

    def project(self, layer: int, group: str, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s ``group`` projection (``linear``) of ``x``, plus each row's
        delta."""
        projection = self.weights.layers[layer][group]
        return projection.project(linear, x, self.mask, self.weights.row_slots)

    def project_for_norm(
        self, layer: int, group: str, linear: nn.Linear, x: torch.Tensor
    ) -> tuple[torch.Tensor, RowDelta | None]:
        """``project`` with the delta left for the norm after it where it can add it
        (``LoraProjection.project_for_norm``)."""
        projection = self.weights.layers[layer][group]
        return projection.project_for_norm(linear, x, self.mask, self.weights.row_slots)

    def project_rope_kv(
        self, layer: int, linear: nn.Linear, x: torch.Tensor, rope: Any, out: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``layer``'s QKV projection (``linear``) of ``x`` with each row's delta, its
        K/V written to the cache (``LoraProjection.project_rope_kv``); the query heads."""
        projection = self.weights.layers[layer]["qkv"]
        return projection.project_rope_kv(linear, x, self.weights.row_slots, rope, out)

    def shrink(self, layer: int, group: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """What the norm before layer ``layer``'s ``group`` needs to shrink its rows by
        their slots (``shrinks_in_norm``): every slot's A, the slots, ``max_loras``."""
        a = self.weights.layers[layer][group].a
        return a, self.weights.row_slots, self.weights.shape.max_loras

    def segment_rope_kv(
        self, layer: int, linear: nn.Linear, h: torch.Tensor, s: torch.Tensor, rope: Any,
        out: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """``project_rope_kv`` of rows the norm shrank (``s``; ``LoraProjection
        .segment_rope_kv``)."""
        projection = self.weights.layers[layer]["qkv"]
        return projection.segment_rope_kv(linear, h, s, self.weights.row_slots, rope, out)

    def segment_swiglu(
        self, layer: int, linear: nn.Linear, h: torch.Tensor, s: torch.Tensor
    ) -> torch.Tensor:
        """``swiglu`` of rows the norm shrank (``s``; ``LoraProjection.segment_swiglu``)."""
        projection = self.weights.layers[layer]["gate_up"]
        return projection.segment_swiglu(linear, h, s, self.weights.row_slots)

    def swiglu(self, layer: int, linear: nn.Linear, x: torch.Tensor, pdl: bool) -> torch.Tensor:
        """SiLU·mul of layer ``layer``'s gate/up projection (``linear``) of ``x`` plus each
        row's delta (``ostinato::silu_mul``'s ``pdl`` where that op runs)."""
        projection = self.weights.layers[layer]["gate_up"]
        return projection.project(linear, x, self.mask, self.weights.row_slots, swiglu_pdl=pdl)


def lora_step() -> bool:
    """Whether the step being run applies LoRA: always where it is traced (compiled
    pieces serve every step), and otherwise unless its batch descriptor says it has no
    LoRA row (graphs specialised by ``GraphConfig.specialize_lora`` skip the GEMMs)."""
    if torch.compiler.is_compiling():
        return True
    context = current_forward_context()
    descriptor = context.batch_descriptor if context is not None else None
    return descriptor is None or descriptor.has_lora
