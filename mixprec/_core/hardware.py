"""Hardware check: which 16-bit float dtypes are supported, and fast, on a device.

Design (``docs/design.md``, "The Recipe"): "fast" means matmul expected faster than float32.
The rules are data (:data:`_CPU_RULES`) and small pure functions over CPU flags (read from
/proc/cpuinfo, less what ``ONEDNN_MAX_CPU_ISA`` forbids) or a CUDA compute capability, so they
are tested with faked inputs. Nothing touches CUDA at import; reports are cached per resolved
device, and :func:`warn_if_slow` warns once per (dtype, device).

Where a dtype's compute is slow the report and the warning say what storage-only precision
gives instead, in bytes per parameter from the recipe's own table: :mod:`mixprec.recipe` hands
that table over (:func:`set_storage_bytes`) when it loads, since the core imports nothing above
it. Step time is measured, never stated here: ``mixprec demo`` races it against fp32.
"""

from __future__ import annotations

import functools
import os
import platform
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mixprec._core._warnings import MixprecPerformanceWarning, user_stacklevel

__all__ = [
    "DtypeSupport",
    "HardwareReport",
    "MixprecPerformanceWarning",
    "check",
    "default_dtype",
    "fp8_support",
    "set_storage_bytes",
    "storage_only",
    "warn_if_slow",
]

#: CPU ISA flags worth reporting, in /proc/cpuinfo spelling.
_CPU_FEATURES: tuple[str, ...] = (
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
)

#: Per dtype, ordered ``(flag or None, fast, reason)`` rules; the first whose flag is present
#: (``None`` always matches) decides. Every CPU dtype is supported: torch has kernels for both.
_CPU_RULES: dict[str, tuple[tuple[str | None, bool, str], ...]] = {
    "bfloat16": (
        ("amx_bf16", True, "AMX-BF16 tiles: bf16 matmul ~4x fp32"),
        ("avx512_bf16", True, "AVX512_BF16: bf16 matmul faster than fp32 (AMX-BF16 gains more)"),
        (None, False, "no AVX512_BF16/AMX-BF16: bf16 matmul is emulated, slower than fp32"),
    ),
    "float16": (
        ("amx_fp16", True, "AMX-FP16 tiles (oneDNN): fp16 matmul faster than fp32"),
        (
            "avx512_fp16",
            False,
            "AVX512_FP16 present but torch's fp16 matmul does not use it; "
            "measured about fp32 speed",
        ),
        (
            None,
            False,
            "no AVX512_FP16/AMX-FP16: fp16 matmul runs reference loops, slower than fp32",
        ),
    ),
}

_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES: dict[torch.dtype, str] = {dt: key for key, dt in _DTYPES.items()}
_CUDA_FP16_TENSOR_CORES: tuple[int, int] = (7, 0)
_CUDA_BF16_TENSOR_CORES: tuple[int, int] = (8, 0)
_CUDA_FP8_TENSOR_CORES: tuple[int, int] = (8, 9)
#: what a host where 16-bit compute is slow still gets: 16-bit storage with fp32 compute
STORAGE_ONLY = (
    "storage-only precision keeps the memory: Recipe('lean', {dtype}, compute='fp32') stores "
    "{short} weights and 8-bit optimizer states and runs every matmul in float32"
)
#: its bytes per parameter with AdamW against fp32's, from the recipe's table
STORAGE_BYTES = (
    ": {plain:.1f} B/param of training state with AdamW ({clip:.1f} where the loop clips or "
    "accumulates) against fp32's {fp32:.1f}; `mixprec demo` measures its step time here"
)
#: ``"table"``: dtype -> the recipe table's bytes per parameter (:func:`set_storage_bytes`)
_STORAGE_TABLE: dict[str, Callable[[torch.dtype], dict[str, float]]] = {}
_DEVICE_HELP = "None, a torch.device, or a device string like 'cpu', 'cuda', 'cuda:1', 'mps'"


@dataclass(frozen=True)
class DtypeSupport:
    """How well a device handles one 16-bit dtype.

    Attributes:
        dtype: The dtype described.
        supported: Whether torch can run matmuls in it on the device.
        fast: Whether its matmul is expected to be faster than float32.
        reason: Human-readable justification of ``supported``/``fast``.
    """

    dtype: torch.dtype
    supported: bool
    fast: bool
    reason: str


@dataclass(frozen=True)
class HardwareReport:
    """Result of :func:`check` for one device. Shared via a cache: do not mutate ``dtypes``.

    Attributes:
        device: Resolved device string, e.g. ``"cpu"`` or ``"cuda:0"``.
        name: CPU model name or GPU name.
        features: Relevant CPU ISA flags, or ``("sm_XY",)`` on CUDA.
        dtypes: ``"bfloat16"`` and ``"float16"`` mapped to their :class:`DtypeSupport`.
        fp8: FP8 matmuls (``torch._scaled_mm``), as a :class:`DtypeSupport` of e4m3.
    """

    device: str
    name: str
    features: tuple[str, ...]
    dtypes: dict[str, DtypeSupport] = field(hash=False)
    fp8: DtypeSupport | None = field(default=None, hash=False)

    def is_fast(self, dtype: torch.dtype) -> bool:
        """True when ``dtype`` is supported and fast on this device."""
        support = self.dtypes.get(str(dtype).replace("torch.", ""))
        return bool(support is not None and support.supported and support.fast)

    @property
    def best_dtype(self) -> torch.dtype:
        """The best fast 16-bit dtype (bf16 preferred: fp32 range, no loss scaling), else fp32."""
        for key in ("bfloat16", "float16"):
            support = self.dtypes.get(key)
            if support is not None and support.supported and support.fast:
                return support.dtype
        return torch.float32

    def __str__(self) -> str:
        lines = [
            f"mixprec hardware check: {self.device} ({self.name})",
            f"features: {' '.join(self.features) or '(none detected)'}",
            f"{'dtype':<10}{'supported':<11}{'fast':<6}reason",
        ]
        yes = {True: "yes", False: "no"}
        for key, s in self.dtypes.items():
            lines.append(f"{key:<10}{yes[s.supported]:<11}{yes[s.fast]:<6}{s.reason}")
        if self.fp8 is not None:
            f = self.fp8
            lines.append(f"{'float8':<10}{yes[f.supported]:<11}{yes[f.fast]:<6}{f.reason}")
        lines.append(f"best dtype: {self.best_dtype}")
        slow = [s.dtype for s in self.dtypes.values() if s.supported and not s.fast]
        if self.device == "cpu" and torch.bfloat16 in slow:
            lines.append(f"bfloat16 compute is slow here; {storage_only(torch.bfloat16)}.")
        return "\n".join(lines)


def storage_only(dtype: torch.dtype) -> str:
    """The sentence that says what storage-only precision gives in ``dtype``: what it keeps in
    16 bits and, once :mod:`mixprec.recipe` has loaded, its bytes per parameter."""
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    text = STORAGE_ONLY.format(dtype=f"torch.{_NAMES.get(dtype, 'bfloat16')}", short=short)
    table = _STORAGE_TABLE.get("table")
    return text if table is None else text + STORAGE_BYTES.format(**table(dtype))


def set_storage_bytes(table: Callable[[torch.dtype], dict[str, float]]) -> None:
    """Lets :func:`storage_only` quote ``table(dtype)``: the storage-only recipe's bytes per
    parameter (``plain``, ``clip``) and fp32's (``fp32``) with AdamW, from
    :meth:`mixprec.Recipe.loop_bytes` (the core cannot import the recipe)."""
    _STORAGE_TABLE["table"] = table


def _cpu_support(flags: frozenset[str]) -> dict[str, DtypeSupport]:
    """Applies :data:`_CPU_RULES` to a set of CPU flags (pure)."""
    result = {}
    for key, rules in _CPU_RULES.items():
        fast, reason = next((f, r) for flag, f, r in rules if flag is None or flag in flags)
        result[key] = DtypeSupport(_DTYPES[key], supported=True, fast=fast, reason=reason)
    return result


def _cuda_support(capability: tuple[int, int], bf16_supported: bool) -> dict[str, DtypeSupport]:
    """CUDA dtype support from compute capability and ``torch.cuda.is_bf16_supported()`` (pure)."""
    cap, cc = tuple(capability), f"compute capability {capability[0]}.{capability[1]}"

    def reason(name: str, threshold: tuple[int, int]) -> str:
        has = cap >= threshold
        return (
            f"{cc} {'>=' if has else '<'} {threshold[0]}.{threshold[1]}: "
            f"{'' if has else 'no '}{name} tensor cores"
        )

    bf16_reason = reason("bf16", _CUDA_BF16_TENSOR_CORES)
    if not bf16_supported:
        bf16_reason += "; torch.cuda.is_bf16_supported() is False"
    bf16_fast = bf16_supported and cap >= _CUDA_BF16_TENSOR_CORES
    return {
        "bfloat16": DtypeSupport(torch.bfloat16, bf16_supported, bf16_fast, bf16_reason),
        "float16": DtypeSupport(
            torch.float16,
            True,
            cap >= _CUDA_FP16_TENSOR_CORES,
            reason("fp16", _CUDA_FP16_TENSOR_CORES),
        ),
    }


_CPU_FP8 = DtypeSupport(
    torch.float8_e4m3fn,
    True,
    False,
    "emulated: torch's reference _scaled_mm on CPU, slower than bf16 (for tests "
    "and development; layers are chosen for an H100)",
)


def _fp8_support_for(
    device_type: str, capability: tuple[int, int] | None, name: str, best: torch.dtype
) -> DtypeSupport:
    """FP8 GEMM support from the device type and CUDA compute capability (pure)."""
    e4m3 = torch.float8_e4m3fn
    if device_type == "cpu":
        return _CPU_FP8
    if device_type == "cuda" and capability is not None:
        cap = tuple(capability)
        cc = f"compute capability {cap[0]}.{cap[1]}"
        if cap >= _CUDA_FP8_TENSOR_CORES:
            return DtypeSupport(e4m3, True, True, f"{cc} >= 8.9: FP8 tensor cores")
        return DtypeSupport(
            e4m3,
            False,
            False,
            f"{name} ({cc}) has no FP8 tensor cores (they need compute capability >= 8.9: "
            f"Ada, Hopper, Blackwell); train in {best} instead (drop fp8=)",
        )
    return DtypeSupport(
        e4m3,
        False,
        False,
        f"{device_type}: torch has no FP8 GEMM for this device; use a CUDA GPU with "
        "compute capability >= 8.9, or a CPU (emulated)",
    )


def _other_support(device_type: str) -> dict[str, DtypeSupport]:
    """Devices mixprec has no rules for: supported, not known to be fast (pure)."""
    reason = f"{device_type}: not characterised by mixprec"
    return {key: DtypeSupport(dt, True, False, reason) for key, dt in _DTYPES.items()}


def _parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """The first ``model name`` and ``flags`` of /proc/cpuinfo text ("" / empty if absent)."""
    name, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return name, flags


def _read_cpu() -> tuple[str, frozenset[str]]:
    """CPU name and flags of this machine; falls back to torch's CPU capability off x86 Linux."""
    cpuinfo = Path("/proc/cpuinfo")
    name, flags = _parse_cpuinfo(cpuinfo.read_text(errors="replace") if cpuinfo.is_file() else "")
    if not flags:  # no x86 flags line: torch only tells the vector width, never bf16/fp16 units
        capability = str(torch.backends.cpu.get_cpu_capability())
        flags = frozenset({"avx512f"}) if capability.startswith("AVX512") else frozenset()
    return (
        name or platform.processor() or platform.machine() or "unknown CPU",
        _usable_flags(flags, os.environ.get("ONEDNN_MAX_CPU_ISA", "")),
    )


_ONEDNN_16BIT = frozenset({"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8", "avx512_fp16"})


def _usable_flags(flags: frozenset[str], max_isa: str) -> frozenset[str]:
    """``flags`` less the 16-bit units oneDNN may not use under ``ONEDNN_MAX_CPU_ISA`` (pure)."""
    isa = max_isa.strip().upper()
    if not isa or isa in ("ALL", "DEFAULT") or "BF16" in isa or "AMX" in isa or "AVX10" in isa:
        return flags
    return flags - _ONEDNN_16BIT


def _resolve_device(device: str | torch.device | None) -> str:
    """Normalises ``device`` to a cache key: ``"cpu"``, ``"cuda:<index>"`` or ``str(device)``."""
    if not isinstance(device, torch.device):
        device = _as_device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"{str(device)!r} requested but torch.cuda.is_available() is False")
        return f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"
    return str(device)


def _as_device(device: object) -> torch.device:
    """A device given as None (CUDA where available, else the CPU) or a string, checked."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"unknown device {device!r}; expected {_DEVICE_HELP}") from e
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be {_DEVICE_HELP}; got {type(device).__name__} {device!r}")
    return device


@functools.cache
def _report(device: str) -> HardwareReport:
    """Builds the (cached) report for a resolved device string."""
    if device == "cpu":
        name, flags = _read_cpu()
        features = tuple(f for f in _CPU_FEATURES if f in flags)
        return HardwareReport(device, name, features, _cpu_support(flags), _CPU_FP8)
    return _cuda_report(device) if device.startswith("cuda:") else _other_report(device)


def _cuda_report(device: str) -> HardwareReport:
    index = int(device.split(":")[1])
    capability = torch.cuda.get_device_capability(index)
    with torch.cuda.device(index):
        bf16 = torch.cuda.is_bf16_supported()
    features = (f"sm_{capability[0]}{capability[1]}",)
    name = torch.cuda.get_device_name(index)
    dtypes = _cuda_support(capability, bf16)
    best = HardwareReport(device, name, features, dtypes).best_dtype
    fp8 = _fp8_support_for("cuda", capability, name, best)
    return HardwareReport(device, name, features, dtypes, fp8)


def _other_report(device: str) -> HardwareReport:
    kind = device.split(":")[0]
    fp8 = _fp8_support_for(kind, None, device, torch.float32)
    return HardwareReport(device, device, (), _other_support(kind), fp8)


def check(device: str | torch.device | None = None, *, verbose: bool = True) -> HardwareReport:
    """Reports which 16-bit dtypes are supported and fast on ``device``.

    Args:
        device: ``None`` (``"cuda"`` if available, else ``"cpu"``), a string or torch.device.
        verbose: Print the report as a table.

    Returns:
        The (cached) :class:`HardwareReport`.

    Raises:
        ValueError: ``device`` is not a valid device string (TypeError: not a str/device).
        RuntimeError: A CUDA device is requested but CUDA is unavailable.
    """
    report = _report(_resolve_device(device))
    if verbose:
        print(report)
    return report


def default_dtype(device: str | torch.device | None = None) -> torch.dtype:
    """The 16-bit dtype (bf16 or fp16) mixprec should use on ``device`` (as for :func:`check`).

    CUDA: bfloat16 where fast (capability >= 8.0), else float16 (the only option below). CPU
    and other devices: bfloat16 (fp32 range, no loss scaling), even where it is not fast.
    """
    report = _report(_resolve_device(device))
    if report.device.startswith("cuda:") and not report.dtypes["bfloat16"].fast:
        return torch.float16
    return torch.bfloat16


def fp8_support(device: str | torch.device | None = None) -> DtypeSupport:
    """Whether ``device`` runs FP8 matmuls (``torch._scaled_mm``), and fast (as for :func:`check`).

    CUDA: from compute capability 8.9. CPU: supported but emulated (not fast).
    """
    report = _report(_resolve_device(device))
    if report.fp8 is None:  # pragma: no cover - every report sets it
        raise AssertionError(f"no FP8 entry in the hardware report of {report.device}")
    return report.fp8


_warned: set[tuple[torch.dtype, str]] = set()


def warn_if_slow(
    dtype: torch.dtype, device: str | torch.device | None = None, *, stacklevel: int | None = None
) -> None:
    """Warns (once per dtype and device per process) if 16-bit ``dtype`` is not fast on
    ``device`` (as for :func:`check`); ``stacklevel`` None points at the first caller outside
    mixprec."""
    if dtype not in _NAMES:
        return
    report = _report(_resolve_device(device))
    support = report.dtypes[_NAMES[dtype]]
    if not support.fast and (dtype, report.device) not in _warned:
        _warn_slow(dtype, report, user_stacklevel() if stacklevel is None else stacklevel)


def _warn_slow(dtype: torch.dtype, report: HardwareReport, stacklevel: int) -> None:
    support = report.dtypes[_NAMES[dtype]]
    _warned.add((dtype, report.device))
    alternative = default_dtype(report.device)
    if alternative == dtype or not report.dtypes[_NAMES[alternative]].fast:
        alternative = report.best_dtype  # a fast 16-bit dtype, or plain float32
    what = "is not expected to be faster than float32" if support.supported else "is unsupported"
    instead = f" Or, where memory is the aim, {storage_only(dtype)}." if support.supported else ""
    warnings.warn(
        f"{dtype} {what} on {report.device} ({report.name}): {support.reason}. "
        f"Suggested alternative: {alternative}.{instead}",
        category=MixprecPerformanceWarning,
        stacklevel=stacklevel + 1,  # as seen from warn_if_slow
    )


def _reset_warnings() -> None:
    """Forgets which (dtype, device) pairs have been warned about (for tests)."""
    _warned.clear()
