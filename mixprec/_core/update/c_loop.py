"""The one-pass update on a CPU: ``c_loop.c``, built per kind of step by the machine's C
compiler and called through :mod:`ctypes` (which releases the GIL).

One source, specialised by a :class:`.spec.StepKind`'s defines, compiled with ``-O3
-march=native -ffp-contract=off`` (no FMA: each fp32 operation rounds on its own, as the
compiled loop's do) into a private per-user cache keyed by all the library depends on: source,
defines, flags, compiler, the CPU's feature flags. A large parameter runs on torch's intra-op
threads (libgomp, which torch loaded), split by rows (codes) or runs of elements, bit for bit.
Why a C loop and not inductor's C++: ``docs/design.md``, "Lean 16-bit updates".
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "PER_THREAD",
    "all_finite",
    "available",
    "code_grad",
    "count_step",
    "decode_grad",
    "kernel",
    "run",
]

_SOURCE = Path(__file__).with_name("c_loop.c")
#: -ffp-contract=off: no FMA, so the fp32 math rounds as torch's eager ops do;
#: -fno-math-errno / -fno-trapping-math: sqrt and the selects vectorize (no errno, no traps)
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
          "-ffp-contract=off", "-std=gnu11", "-shared", "-fPIC")  # fmt: skip
#: what a build leaves out when the full flags fail: OpenMP (one thread), then -march=native
_FALLBACKS = (("-fopenmp",), ("-fopenmp", "-march=native"))
_LOADED: dict[tuple, ctypes.CDLL] = {}
_STEPS: dict[tuple, Callable[..., None]] = {}
_LOCK = threading.Lock()
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = name and shutil.which(name)
        if path:
            return path
    raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")


def available() -> bool:
    """Whether a C compiler is on this machine (the kernels may still fail to build)."""
    try:
        _compiler()
    except RuntimeError:
        return False
    return True


def _cpu_flags() -> str:
    """What ``-march=native`` depends on: the CPU's feature flags (else its model)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    return platform.processor() + platform.machine()


_NOT_PRIVATE = (
    "{} belongs to another user or others may write into it; remove it (mixprec makes it "
    "again, private) to build the fused update's kernels"
)


def _cache() -> Path:
    """This user's library folder: created private, and refused where another user could
    have written into it (a library loaded from there runs as this process)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    root = Path(tempfile.gettempdir()) / f"mixprec-{uid if uid is not None else 'user'}"
    folder = root / "kernels"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for path in (root, folder):
        st = path.stat()
        if uid is not None and (st.st_uid != uid or st.st_mode & 0o022):
            raise RuntimeError(_NOT_PRIVATE.format(path))
    return folder


def _build(defines: list[str]) -> Path:
    """The library of ``defines``: from the cache, or compiled into it on first use."""
    cc = _compiler()
    parts = [_SOURCE.read_bytes(), *(" ".join(x).encode() for x in (defines, _FLAGS)),
             cc.encode(), _cpu_flags().encode()]  # fmt: skip
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]
    lib = _cache() / f"step-{digest}.so"
    if not lib.exists():
        _compile(cc, defines, lib)
    return lib


def _compile(cc: str, defines: list[str], lib: Path) -> None:
    """Compile ``lib`` with the full flags, else with fewer (:data:`_FALLBACKS`); raises where
    none builds."""
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    errors = []
    for flags in (_FLAGS, *(tuple(f for f in _FLAGS if f not in out) for out in _FALLBACKS)):
        cmd = [cc, *flags, *defines, str(_SOURCE), "-o", str(tmp), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if not done.returncode:
            os.replace(tmp, lib)  # atomic: a concurrent process sees the whole library or none
            return
        errors.append(f"{' '.join(cmd)}: {done.stderr.strip()[:300]}")
    raise RuntimeError("building the fused update failed: " + " | ".join(errors))


def _library(key: Any) -> ctypes.CDLL:
    """The library of a :class:`.spec.StepKind` (``("finite",)``: the finite check alone),
    built on first use (raises if it cannot be); its functions are kept, so this runs once."""
    with _LOCK:
        if key not in _LOADED:
            defines = ["-DFINITE_ONLY"] if key == ("finite",) else key.defines()
            _LOADED[key] = ctypes.CDLL(str(_build(defines)))
        return _LOADED[key]


def kernel(key: Any) -> Callable[..., None]:
    """The compiled step of a :class:`.spec.StepKind` (see :func:`_library`)."""
    fn = _STEPS.get(key)
    if fn is None:
        fn = _library(key).mixprec_step
        fn.restype = None
        fn.argtypes = [_I64, _I64, *[_P] * 10, ctypes.c_uint32, ctypes.c_uint32, _I]
        _STEPS[key] = fn
    return fn


_FINITE_KINDS = {torch.bfloat16: 2, torch.float16: 3, torch.float32: 4}


def all_finite(g: Tensor) -> bool | None:
    """Whether every element of the contiguous CPU tensor ``g`` is finite (one pass, no
    temporary), or None where this cannot tell (another dtype or layout, no compiler)."""
    kind = _FINITE_KINDS.get(g.dtype)
    if kind is None or g.device.type != "cpu" or not g.is_contiguous():
        return None
    fn = _finite_lib_fn("mixprec_finite", ctypes.c_int, [_I64, _P, _I])
    return None if fn is None else bool(fn(g.numel(), g.data_ptr(), kind))


def _finite_lib_fn(name: str, restype: Any, argtypes: list) -> Callable[..., Any] | None:
    """A function of the library built with FINITE_ONLY (no step kind), or None without one."""
    fn = _STEPS.get((name,))
    if fn is None:
        try:
            fn = getattr(_library(("finite",)), name)
        except Exception:  # noqa: BLE001 -- no compiler: the caller uses torch ops
            return None
        fn.restype, fn.argtypes = restype, argtypes
        _STEPS[name,] = fn
    return fn


def code_grad(g: Tensor, codes: Tensor, scales: Tensor) -> bool | None:
    """Code the contiguous CPU gradient ``g`` into ``codes`` (E4M3) and ``scales`` in one pass
    (:func:`.coded.code`'s arithmetic); returns whether every element was finite, or None where
    this cannot (the caller uses torch ops)."""
    kind = _FINITE_KINDS.get(g.dtype)
    if kind is None or g.device.type != "cpu" or not g.is_contiguous():
        return None
    fn = _finite_lib_fn("mixprec_code_grad", ctypes.c_int, [_I64, _P, _I, _P, _P])
    if fn is None:
        return None
    return bool(fn(g.numel(), g.data_ptr(), kind, codes.data_ptr(), scales.data_ptr()))


def decode_grad(codes: Tensor, scales: Tensor, coef: float | None, out: Tensor) -> bool:
    """Decode E4M3 ``codes`` with their block ``scales`` into the contiguous 16-bit CPU tensor
    ``out`` (times ``coef``) in one pass; False where this cannot."""
    kind = _FINITE_KINDS.get(out.dtype)
    if kind not in (2, 3) or out.device.type != "cpu" or not out.is_contiguous():
        return False
    args = [_I64, _P, _P, ctypes.c_float, _I, _P, _I]
    fn = _finite_lib_fn("mixprec_decode_grad", None, args)
    if fn is None:
        return False
    c = 1.0 if coef is None else coef
    fn(out.numel(), codes.data_ptr(), scales.data_ptr(), c, coef is not None, out.data_ptr(), kind)
    return True


_SCALAR = {torch.float32: ctypes.c_float, torch.float64: ctypes.c_double}


def count_step(step: Tensor) -> None:
    """``step += 1`` for an optimizer's step count held in a CPU float tensor, without a torch
    op (a dispatch per parameter costs more than the C loop of a small one)."""
    kind = _SCALAR.get(step.dtype) if step.device.type == "cpu" else None
    if kind is None:
        step.add_(1)
    else:
        kind.from_address(step.data_ptr()).value += 1


def _ptr(t: Any) -> int | None:
    return None if t is None else t.data_ptr()


def run(key: Any, tensors: tuple, states: list, scalars: Tensor, base: int, mix: int) -> None:
    """One step of ``key`` on torch's intra-op threads (:data:`PER_THREAD` elements each at
    least): ``tensors``, ``states`` and ``scalars`` as :meth:`.fused.FusedUpdates._run` makes
    them (a state: a tensor, (codes, scales), or (fp32 values read this once, codes, scales))."""
    fn = kernel(key)
    w, c, g = tensors
    coded = any(isinstance(st, tuple) for st in states)
    rows, cols = w.shape if coded else (1, w.numel())
    most = rows if coded else cols  # threads split rows of codes, or one run of elements
    threads = max(1, min(torch.get_num_threads(), rows * cols // PER_THREAD, most))
    ptrs: list[int | None] = [_ptr(w), _ptr(c), _ptr(g)]
    for st in (*states, None, None)[:2]:
        if isinstance(st, tuple):
            *src, codes, scale = st
            ptrs += [_ptr(codes), _ptr(scale), _ptr(src[0]) if src else None]
        else:
            ptrs += [_ptr(st), None, None]
    fn(rows, cols, *ptrs, _ptr(scalars), base & 0xFFFFFFFF, mix & 0xFFFFFFFF, threads)


#: the fewest elements worth a thread of their own
PER_THREAD = 2**16
