"""The fused update on a CPU: a C loop per kind of step, built once by the machine's compiler.

Design. :mod:`.fused_ops` writes each kind of step once, in torch ops, and lets
:func:`torch.compile` turn it into one loop; on a GPU that loop (Triton) runs at the memory's
speed. On a CPU inductor's C++ for the same loop was compute-bound: 1.8 ms per million bf16
elements for AdamW + Kahan on a Zen 4 EPYC, one thread, against 0.46 ms for torch's fused fp32
AdamW, which moves more bytes; with 8-bit states decoded and re-coded inside, 27 ms. The same
expressions written as plain C and vectorized by the compiler (``-O3 -march=native``) took
0.66 ms. So on a CPU the kinds of step run ``cpu_kernel.c``: one source, specialised per kind
with preprocessor defines (optimizer, update mode, the dtype of the weight, the gradient and
each state, the states' code layouts), compiled into a shared library in a per-user cache
directory keyed by the source, the defines, the compiler and the CPU's feature flags, and
called through :mod:`ctypes` (which releases the GIL).

Threads: a step of a large parameter runs on torch's intra-op thread count through OpenMP,
built with ``-fopenmp``: the library needs ``libgomp.so.1``, which the dynamic loader resolves
to the one torch already loaded, so the kernel's team is the one torch's parallel regions keep
warm. A first version split the step with a Python thread pool instead; inside a backward
(released gradients, stepped between the backward's GEMMs) torch's OpenMP workers spin-waited
on the cores the pool needed, and the split gained nothing on 2 cores. A compiler without
OpenMP builds the one-thread loop.

Numerics: the C expressions are :mod:`.fused_ops`' and :mod:`.state_codes`' term for term (the
same lerp, the same reciprocal-then-multiply of a block's scale, torch's E4M3 rounding, the
same keyed random bits), in fp32 without contraction into FMA (``-ffp-contract=off``), so a
step differs from the eager chunk path by fp32 rounding order only.

What it needs: a C compiler (``$CC``, ``cc``, ``gcc`` or ``clang`` on the PATH) for C11; fp16
is converted by bit arithmetic, so no ``_Float16`` support is needed. Without one,
:func:`kernel` raises and :mod:`.fused` falls back to the chunk path with one warning, as it
does when :func:`torch.compile` fails.
"""

from __future__ import annotations

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

from mixprec._core.update.state_codes import _largest, _layout

__all__ = ["PER_THREAD", "all_finite", "available", "count_step", "kernel", "run"]

_SOURCE = Path(__file__).with_name("cpu_kernel.c")
#: -ffp-contract=off: no FMA, so the fp32 math rounds as torch's eager ops do;
#: -fno-math-errno / -fno-trapping-math: sqrt and the selects vectorize (no errno, no traps)
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
          "-ffp-contract=off", "-std=gnu11", "-shared", "-fPIC")  # fmt: skip
#: what a build leaves out when the full flags fail: OpenMP (one thread), then -march=native
_FALLBACKS = (("-fopenmp",), ("-fopenmp", "-march=native"))
_LOW = {torch.bfloat16: 1, torch.float16: 2}
_GRAD = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_STATE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_UPDATE = {"nearest": 0, "kahan": 1, "stochastic": 2}
_LOADED: dict[tuple, ctypes.CDLL] = {}
_STEPS: dict[tuple, Callable[..., None]] = {}
_LOCK = threading.Lock()


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
    """What ``-march=native`` depends on: the CPU's feature flags (the model where the kernel
    does not list them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _state_defines(name: str, kind: Any) -> list[str]:
    """-D flags of one state: a dtype, or a (format, kind) of codes, with a third item where
    the state is read from fp32 values this once (see :mod:`.fused`)."""
    if not isinstance(kind, tuple):
        return [f"-D{name}={_STATE[kind]}"]
    fmt, k = kind[:2]
    bits, mag, m, emin = _layout(fmt, k)
    e4m3 = int(fmt == "8-bit" and k == "signed")
    return [f"-D{name}={bits}", f"-D{name}K={int(k == 'sqrt')}", f"-D{name}MAG={mag}",
            f"-D{name}MB={m}", f"-D{name}EMIN={emin}", f"-D{name}E4M3={e4m3}",
            f"-D{name}LARGEST={_largest(mag, m, emin)!r}f",
            f"-D{name}SRC={int(len(kind) == 3)}"]  # fmt: skip


def _defines(key: tuple) -> list[str]:
    """The -D flags of a compile key of :class:`.fused.FusedUpdates` (see its ``_kind``)."""
    if key[0] == "adam":
        _, update, decoupled, low, grad, s1, s2 = key
        out = ["-DADAM", *(["-DDECOUPLED"] if decoupled else [])]
        states = _state_defines("S1", s1) + _state_defines("S2", s2)
    else:
        _, update, momentum, nesterov, low, grad, *rest = key
        out = [*(["-DMOMENTUM"] if momentum else []), *(["-DNESTEROV"] if nesterov else [])]
        states = _state_defines("S1", rest[0]) if rest else []
    return [*out, f"-DUPDATE={_UPDATE[update]}", f"-DW16={_LOW[low]}",
            f"-DG={_GRAD[grad]}", *states]  # fmt: skip


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
            raise RuntimeError(
                f"{path} belongs to another user or others may write into it; remove it "
                "(mixprec makes it again, private) to build the fused update's kernels"
            )
    return folder


def _build(defines: list[str]) -> Path:
    cc = _compiler()
    source = _SOURCE.read_bytes()
    parts = [source, *(" ".join(x).encode() for x in (defines, _FLAGS)), cc.encode(),
             _cpu_flags().encode()]  # fmt: skip
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]
    lib = _cache() / f"step-{digest}.so"
    if lib.exists():
        return lib
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    errors = []
    for flags in (_FLAGS, *(tuple(f for f in _FLAGS if f not in out) for out in _FALLBACKS)):
        cmd = [cc, *flags, *defines, str(_SOURCE), "-o", str(tmp), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if not done.returncode:
            os.replace(tmp, lib)  # atomic: a concurrent process sees the whole library or none
            return lib
        errors.append(f"{' '.join(cmd)}: {done.stderr.strip()[:300]}")
    raise RuntimeError("building the fused update failed: " + " | ".join(errors))


def _library(key: tuple) -> ctypes.CDLL:
    """The library of compile key ``key`` (``("finite",)``: the finite check alone), built on
    first use (raises if it cannot be)."""
    lib = _LOADED.get(key)
    if lib is None:
        with _LOCK:
            lib = _LOADED.get(key)
            if lib is None:
                defines = ["-DFINITE_ONLY"] if key == ("finite",) else _defines(key)
                lib = _LOADED[key] = ctypes.CDLL(str(_build(defines)))
    return lib


def kernel(key: tuple) -> Callable[..., None]:
    """The compiled step of compile key ``key`` (see :func:`_library`)."""
    fn = _STEPS.get(key)
    if fn is None:
        fn = _library(key).mixprec_step
        fn.restype = None
        fn.argtypes = [ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 10,
                       ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int]  # fmt: skip
        _STEPS[key] = fn
    return fn


_FINITE_KINDS = {torch.bfloat16: 2, torch.float16: 3, torch.float32: 4}


def all_finite(g: Tensor) -> bool | None:
    """Whether every element of the contiguous CPU tensor ``g`` is finite (one pass, no
    temporary), or None where this cannot tell (another dtype or layout, no compiler)."""
    kind = _FINITE_KINDS.get(g.dtype)
    if kind is None or g.device.type != "cpu" or not g.is_contiguous():
        return None
    fn = _STEPS.get(("finite",))
    if fn is None:
        try:
            fn = _library(("finite",)).mixprec_finite
        except Exception:  # noqa: BLE001 -- no compiler: the caller checks with torch ops
            return None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        _STEPS["finite",] = fn
    return bool(fn(g.numel(), g.data_ptr(), kind))


_SCALAR = {torch.float32: ctypes.c_float, torch.float64: ctypes.c_double}


def count_step(step: Tensor) -> None:
    """``step += 1`` for an optimizer's step count held in a CPU float tensor, without a torch
    op (a dispatch per parameter costs more than the C loop of a small one)."""
    kind = _SCALAR.get(step.dtype)
    if kind is None or step.device.type != "cpu" or step.numel() != 1:
        step.add_(1)
        return
    kind.from_address(step.data_ptr()).value += 1


def _ptr(t: Any) -> int | None:
    return None if t is None else t.data_ptr()


def run(
    key: tuple,
    rows: int,
    cols: int,
    tensors: tuple[Tensor, Tensor | None, Tensor],
    states: list[Any],
    scalars: Tensor,
    base: int,
    mix: int,
) -> None:
    """One step of ``rows`` x ``cols`` elements: ``tensors`` = (weight, compensation or None,
    gradient), ``states`` = up to two states (a tensor, or (codes, scales[, fp32 values to read
    instead of the codes]) of coded states), ``scalars`` = the fp32 scalars of :mod:`.fused`'s
    step of this kind. On torch's intra-op thread count (:func:`torch.get_num_threads`) where
    each thread gets at least :data:`PER_THREAD` elements: by rows for coded states (their
    blocks lie in one row), by runs of elements otherwise."""
    fn = kernel(key)
    coded = any(isinstance(st, tuple) for st in states)
    if not coded:
        rows, cols = 1, rows * cols
    threads = max(1, min(torch.get_num_threads(), rows * cols // PER_THREAD, rows if coded else
                         rows * cols))  # fmt: skip
    w, c, g = tensors
    ptrs: list[int | None] = [_ptr(w), _ptr(c), _ptr(g)]
    for st in (*states, None, None)[:2]:
        if isinstance(st, tuple):
            codes, scale, *src = st
            ptrs += [_ptr(codes), _ptr(scale), _ptr(src[0]) if src else None]
        else:
            ptrs += [_ptr(st), None, None]
    fn(rows, cols, *ptrs, _ptr(scalars), base & 0xFFFFFFFF, mix & 0xFFFFFFFF, threads)


#: the fewest elements worth a thread of their own
PER_THREAD = 2**16
