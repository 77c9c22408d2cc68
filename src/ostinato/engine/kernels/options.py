"""How the engine's own CUDA kernels are launched inside a step: one small dataclass the
model is built with and every module that launches a kernel reads (its norms, its MLPs,
the attention backend made by ``default_backend``); the runner follows the model's for
the compiled pieces, the small-GEMM plans and compile-ahead."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads where a device is asked about: ``--help`` needs none
    import torch


def triton_runs_on(device: torch.device) -> bool:
    """Whether the engine's Triton kernels can run on ``device``: a CUDA device, with
    Triton installed."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class KernelOptions:
    """Launch choices for the engine's kernels.

    ``fused_layers`` (on by default): each decoder layer's two norm-then-projection pairs
    are the ops of ``model.fused_ops``; on CUDA at most ``small_gemm.MAX_ROWS`` (16) rows
    (decode) make each one kernel, the QKV one also writing the keys (rotated) and values
    to the cache, and every projection of such a step runs the Triton GEMM: a layer is
    five kernels and attention's split-KV merge. Larger batches, and other devices, run
    the unfused kernels, the same arithmetic.

    ``pdl``, ``small_gemm`` and ``compile_ahead`` default to None: on where the device
    has it, off elsewhere (``resolved``). True asks for it: ``resolved`` refuses it,
    naming the option and the device, where the device lacks it; False turns it off.

    ``pdl`` (None: on where the device has it): programmatic dependent launch
    (Hopper and newer). ostinato's Triton kernels (norms, K/V write, attention, small
    GEMMs) of steps of at most 16 rows (``launch.pdl_for``) are launched so that each
    may start while its predecessor drains; each waits (``griddepcontrol.wait``) before
    touching memory, so results are unchanged.

    ``small_gemm`` (None: on where Triton runs): projections whose row count is at
    most ``small_gemm.MAX_ROWS`` (16) use a Triton GEMM (gate/up with SiLU·mul in its
    epilogue) wherever a start-up measurement on this device chose it over cuBLAS for
    that shape and row count (``gemm_tuning.triton_chosen``: unless cuBLAS measured
    faster by the noise margin), in the config that measured fastest; elsewhere
    cuBLAS (or, for a fused layer's small projection, the Triton GEMM by rule). The
    plans are kept in the compile cache, so only a first start measures. On by default
    because it measured fastest: on an H200 the 8 B shape's FULL decode step took 4.46 /
    4.94 ms at B = 1 / 8 with it against 5.05 / 5.74 without, the 1.5 B shape's 0.957 /
    1.014 against 0.950 / 1.065 (one run).

    ``compile_ahead`` (None: on where Triton runs): at start-up, before the first
    forward pass, eager passes at every kernel layout (each row count up to 16, a
    prefill at the largest size) queue the compilation of every ostinato Triton kernel
    they would launch (``launch.compile_ahead``), running none; so do the layer plan's timings
    (every size, fused and unfused) and the sampling graphs' captures. They compile
    together, in worker processes on a host of 4 cores or more (``compile_pool``), else
    on a thread pool beside Dynamo's trace and Inductor, instead of one by one at their
    first launches. Outputs are unchanged; it only moves compile time. A start
    whose plans all come from the compile cache skips it (``KernelPlan.plan``): an
    earlier start compiled the kernels. On by default because it measured faster where
    there is anything to compile and level elsewhere: on an H200, with every cache
    empty, ``LLM("llama-1.5b")`` returned in 28.2 / 35.3 / 35.7 s with it against 40.7 /
    42.1 / 42.4 s without (three runs); warm starts answered in 1.68 / 2.00 s against
    1.76 / 1.82.
    """

    pdl: bool | None = field(
        default=None,
        metadata={
            "switch": True,
            "help": "launch the engine's Triton kernels of steps of <= 16 rows with "
            "programmatic dependent launch (default: on where the GPU has it, Hopper "
            "and newer)",
        },
    )
    small_gemm: bool | None = field(
        default=None,
        metadata={
            "switch": True,
            "help": "measure cuBLAS against a Triton GEMM for projections of <= 16 rows at "
            "a first start (plans cached) and use the faster (default: on with CUDA and "
            "Triton; 16-bit weights)",
        },
    )
    compile_ahead: bool | None = field(
        default=None,
        metadata={
            "switch": True,
            "help": "compile the engine's Triton kernels together (worker processes, or "
            "threads under 4 cores) at start-up, before their first launches, where the "
            "start measures its kernel plans (default: on with CUDA and Triton)",
        },
    )
    fused_layers: bool = field(
        default=True,
        metadata={
            "help": "run each decoder layer's norm and projection pairs as one kernel each "
            "at <= 16 rows (CUDA, small projections)"
        },
    )

    def __post_init__(self) -> None:
        for name in (f.name for f in fields(self)):
            value = getattr(self, name)
            if isinstance(value, bool) or (value is None and name in DEVICE_OPTIONS):
                continue
            either = "True, False or None" if name in DEVICE_OPTIONS else "True or False"
            raise TypeError(f"KernelOptions.{name}: expected {either}, got {value!r}")

    def summary(self, device: torch.device) -> str:
        """What the engine's kernels run with on ``device`` (these options resolved for
        it), for the start-up line: the options on and those off, or that no Triton
        kernel runs there."""
        if not triton_runs_on(device):
            return f"Triton kernels: none on {device.type} (each op runs its torch arithmetic)"
        on = [f.name for f in fields(self) if getattr(self, f.name)]
        off = [f.name for f in fields(self) if not getattr(self, f.name)]
        text = "Triton kernels: " + (", ".join(on) or "no option on")
        return text + (f"; off: {', '.join(off)}" if off else "")

    def resolved(self, device: torch.device) -> KernelOptions:
        """The options in force on ``device``, every one True or False: each left unset
        (None) on where the device has it, off elsewhere. An option asked for (True)
        that the device lacks is refused (``ValueError`` naming it, the device and why),
        never turned off unsaid. ``fused_layers`` stays as given: its ops run
        everywhere, unfused where the kernel cannot."""
        for name, why in _lacking(device).items():
            if getattr(self, name) is True:
                flag = "--no-" + name.replace("_", "-")
                raise ValueError(
                    f"KernelOptions.{name}=True: {why}; leave it unset (on where the device "
                    f"has it) or give {name}=False ({flag})"
                )
        return self.available_on(device)

    def available_on(self, device: torch.device) -> KernelOptions:
        """These options, every one True or False, as a model built with them launches
        on ``device``: what the device lacks off, whatever was asked (the runner's view
        of a model built directly; an engine's options go through ``resolved``)."""
        lacking = _lacking(device)
        on = {n: n not in lacking and getattr(self, n) is not False for n in DEVICE_OPTIONS}
        return replace(self, **on)

    def as_built(self) -> KernelOptions:
        """These options as a model built with them holds (its modules read them at each
        launch): each left unset on. A runner turns off what its device lacks where no
        Triton kernel runs, and refuses the model on a GPU that lacks one (build it with
        ``resolved``)."""
        if all(getattr(self, n) is not None for n in DEVICE_OPTIONS):
            return self  # (the same object: every module of a model holds one)
        return replace(self, **{n: getattr(self, n) is not False for n in DEVICE_OPTIONS})


# The options a device may lack (``fused_layers``' ops run everywhere).
DEVICE_OPTIONS = ("pdl", "small_gemm", "compile_ahead")


def _lacking(device: torch.device) -> dict[str, str]:
    """Each option of ``DEVICE_OPTIONS`` that ``device`` lacks, with why."""
    if not triton_runs_on(device):
        why = "the engine's Triton kernels run on CUDA with Triton installed" + (
            ", which is not" if device.type == "cuda" else f", not on {device.type}"
        )
        return dict.fromkeys(DEVICE_OPTIONS, why)
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    if major >= 9:
        return {}
    return {
        "pdl": "programmatic dependent launch needs compute capability 9.0 (Hopper) or "
        f"newer; {device} has {major}.{minor}"
    }
