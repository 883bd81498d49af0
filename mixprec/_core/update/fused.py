"""The one-pass update: each parameter's step in one loop over its memory, no temporaries.

For torch's ``Adam``, ``AdamW`` and ``SGD``, one 16-bit parameter's step -- widen ``w (+ c)``,
the fp32 math, the write-back (nearest, Kahan or stochastic), states decoded and re-coded -- is
one pass of the backend :func:`.spec.choose` picks. Hyperparameters and the step count are
inputs, so a schedule never recompiles; every size is one shape class (1-D, or rows of blocks
for codes). Numerics: the reference's formula on the same fp32 operands, each operation rounded
on its own. A failed build (no C compiler, a dtype the backend lacks) leaves that kind to the
reference, saying so once. Why each backend: ``docs/design.md``, "Lean 16-bit updates".
"""

from __future__ import annotations

import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import _get_scalar_dtype

from mixprec._core._warnings import MixprecPerformanceWarning, user_stacklevel
from mixprec._core.update import c_loop, spec
from mixprec._core.update.compiled_step import OPTIONS, build
from mixprec._core.update.heap import first_on_cpu, trim_heap
from mixprec._core.update.release import all_finite
from mixprec._core.update.rounding import round_keys, shard_offset
from mixprec._core.update.spec import Choice, StepKind
from mixprec._core.update.state_codes import QuantizedState

__all__ = ["FusedUpdates"]

_MASK = 0xFFFFFFFF
#: kind -> compiled step, shared by every updater of the process
_COMPILED: dict[StepKind, Callable[..., None]] = {}
#: kinds whose build failed here: the reference steps them
_FAILED: set[StepKind] = set()


def _operand(st: Any, held: spec.Held, view: tuple[int, ...]) -> tuple[Any, Any]:
    """A state as the backends take it -- viewed as ``view``, (codes, scale), or (fp32 values,
    codes, scale) where it becomes codes now -- and the state to keep (None: ``st``)."""
    if isinstance(st, QuantizedState):
        return (st.codes, st.scale), None
    if held.from_fp32:
        q = QuantizedState.empty(st.shape, held.fmt, held.kind, st.device)
        return (st.view(view), q.codes, q.scale), q
    return st.view(view), None


def _first_state(kind: StepKind, state: dict, local: Tensor) -> None:
    """The state torch's optimizer makes on a first step, in the recipe's storage: zeros (codes
    of zero, not fp32 zeros coded: the C heap would keep their freed blocks), Adam's count."""
    if kind.optimizer == "adam":
        state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
    for k, held in zip(kind.names, kind.states):
        if held.fmt is not None:
            state[k] = QuantizedState.zeros(local.shape, held.fmt, held.kind, local.device)
        else:
            state[k] = torch.zeros(local.shape, dtype=held.dtype, device=local.device)


def _own_code(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` with a code object of its own: dynamo keeps at most ``recompile_limit`` (8)
    graphs per code object, and every kind built by :func:`.compiled_step.build` shares its code."""
    code = fn.__code__
    own = code.replace(co_name=f"{code.co_name}_{len(_COMPILED) + len(_FAILED)}")
    return types.FunctionType(own, fn.__globals__, own.co_name, fn.__defaults__, fn.__closure__)


class FusedUpdates:
    """Steps the parameters a backend takes in one pass each; :meth:`step` returns the ones
    left to the reference. ``choices``: each parameter's last :class:`.spec.Choice`."""

    def __init__(self, kernels: str = "auto") -> None:
        self.kernels = kernels  # the recipe's: "torch" leaves every parameter to the chunks
        self.broken: str | None = None  # why a build failed
        self.compile_seconds = 0.0  # first calls of each kind (builds), for benchmarks
        self.fused_steps = 0  # parameters stepped in one pass, for tests and benchmarks
        self.choices: dict[int, Choice] = {}

    def finite(self, g: Tensor) -> bool:
        """Whether every element of gradient ``g`` is finite: one C pass where a CPU parameter
        is stepped by the C loop, torch ops otherwise."""
        if self.kernels != "torch" and spec.CPU_BACKEND == "c":
            done = c_loop.all_finite(g)
            if done is not None:
                return done
        return all_finite(g)

    @torch.no_grad()
    def step(self, updater: Any, group: dict, params: list[Tensor], drop: bool = False) -> list:
        """Step what a backend takes of ``params`` (of ``group`` of the ModeUpdater ``updater``),
        freeing each one's gradient where ``drop``; return those left to the reference."""
        rest = []
        for p in params:
            local = p.to_local() if hasattr(p, "to_local") else p
            choice = self.choices[id(p)] = spec.choose(updater, group, p, local, _FAILED)
            fresh = drop and first_on_cpu(updater.optimizer.state, [p])
            if choice.kind is None or not self._run(choice, updater, group, p, local):
                rest.append(p)
            elif drop:
                p.grad = None
                if fresh:  # a freed gradient beside new states: the next parameter's states
                    trim_heap()  # reuse only part of its hole, and it stays resident
        return rest

    def _run(self, choice: Choice, updater: Any, group: dict, p: Tensor, local: Tensor) -> bool:
        """``p``'s step in one pass on ``choice``'s backend, its first states made here; False
        where the backend cannot be built (the reference makes them)."""
        kind, state = choice.kind, updater.optimizer.state[p]
        first = not state and bool(kind.states)
        if first:
            _first_state(kind, state, local)
        if kind.optimizer == "adam" and state["step"].device.type != "cpu":
            # torch's fused kernel keeps the count on a GPU: the host reads it, so it moves once
            state["step"] = state["step"].to("cpu", torch.float32)
        view = (local.shape[0], local.numel() // local.shape[0]) if kind.coded else (-1,)
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        operands = [_operand(state[k], h, view) for k, h in zip(kind.names, kind.states)]
        sc = torch.tensor(spec.scalars(kind, group, state), dtype=torch.float32,
                          device=local.device)  # fmt: skip
        keys = (0, 0)
        if kind.update == "stochastic":
            key, mix = round_keys(updater.seed, updater.steps, updater._ordinal[id(p)])
            keys = ((shard_offset(p) + key) & _MASK, mix)
        comp = updater.compensation.get(p)
        tensors = (local.view(view), None if comp is None else comp.view(view), g.view(view))
        run = self._run_c if choice.backend == "c" else self._run_compiled
        if not run(kind, tensors, [x for x, _ in operands], sc, keys):
            if first:
                state.clear()
            return False
        for k, (_, coded_now) in zip(kind.names, operands):
            if coded_now is not None:
                state[k] = coded_now
        if kind.optimizer == "adam":
            c_loop.count_step(state["step"])
        self.fused_steps += 1
        return True

    def _run_c(self, kind: StepKind, tensors: tuple, states: list, sc: Tensor, keys: tuple) -> bool:
        """The step through :mod:`.c_loop` (a C loop); False where it cannot be built."""
        if kind not in c_loop._STEPS:  # its library is built (or loaded) now
            t0 = time.perf_counter()
            try:
                c_loop.kernel(kind)
            except Exception as exc:  # noqa: BLE001 -- no C compiler, a failed build, ...
                return self._failed(kind, exc)
            self.compile_seconds += time.perf_counter() - t0
        c_loop.run(kind, tensors, states, sc, *keys)
        return True

    def _run_compiled(
        self, kind: StepKind, tensors: tuple, states: list, sc: Tensor, keys: tuple
    ) -> bool:
        """The step through :func:`torch.compile` (Triton on a GPU, C++ on a CPU)."""
        device = tensors[0].device
        base, mix = (torch.tensor(k, dtype=torch.int64, device=device) for k in keys)
        fn = _COMPILED.get(kind)
        first = fn is None
        if first:
            fn = torch.compile(_own_code(build(kind)), dynamic=True, fullgraph=True,
                               options=OPTIONS)  # fmt: skip
        t0 = time.perf_counter()
        try:
            fn(*tensors, *(states or [None]), sc, base, mix)
        except Exception as exc:  # no compiler, an unsupported dtype on this backend, ...
            if not first:
                raise
            return self._failed(kind, exc)
        if first:
            _COMPILED[kind] = fn
            self.compile_seconds += time.perf_counter() - t0
        return True

    def _failed(self, kind: StepKind, exc: Exception) -> bool:
        """Leave ``kind`` to the reference from now on, and say so once."""
        _FAILED.add(kind)
        if self.broken is None:
            self.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            warnings.warn(
                "mixprec's one-pass update could not be compiled here "
                f"({self.broken}); update modes use the chunked eager path "
                "(correct, slower). A recipe with kernels='torch' skips the attempt.",
                MixprecPerformanceWarning,
                stacklevel=user_stacklevel(),
            )
        return False
