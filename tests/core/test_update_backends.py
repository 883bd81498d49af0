"""Every backend of the one-pass 16-bit update against the chunk path, the reference: the C
loop (core/update/c_loop.py, a CPU's default) and torch.compile of
core/update/compiled_step.py (inductor's C++ here, the source of a GPU's Triton loop), picked by
``spec.CPU_BACKEND``, as torch's test_optim checks its foreach and fused kernels against its
for-loop. One parametrized test steps the same parameters with the same gradients both ways
and compares weights, compensation and states after every step, over the options torch's
Adam, AdamW and SGD accept, the update modes, the 16-bit dtypes, every way a state is held
(fp32, 16-bit, 8- and 4-bit codes, and codes held decoded in fp32 after a resume) and one or
two threads. The cases are chosen pairwise, not as a product: each kind of step compiles once
(seconds for inductor, about one for a C library, both cached on disk across runs)."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.optim import SGD, Adam, AdamW

import mixprec
from mixprec._core.update import c_loop, fused, spec
from mixprec._core.update.release import all_finite
from mixprec._core.update.spec import Held, StepKind
from mixprec._core.update.state_codes import QuantizedState, _layout

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
OPTIMIZERS = {"adam": Adam, "adamw": AdamW, "sgd": SGD}
#: steps per run (a first step makes the states: in one pass too, but for SGD's dampening)
STEPS = 4
#: a weight of 16 rows of 300: two blocks of codes per row, the second partial, two runs of
#: the C loop's elements; the bias (16) is too small for codes and is held in fp32
SHAPE = (16, 300)


@dataclasses.dataclass(frozen=True)
class Case:
    """One run against the reference. ``states``: the recipe's ``optimizer_states``;
    ``resumed``: its codes held decoded in fp32 after the first step, as a checkpoint that
    saved them decoded loads them; ``backend``: ``spec.CPU_BACKEND``'s "c" (the C loop) or
    "compiled" (inductor's C++, the GPU's compiled loop); ``fuses``: whether the backend takes
    the kind (False: the chunk path steps it, bit for bit)."""

    optimizer: str
    options: tuple[tuple[str, Any], ...] = ()
    update: str = "kahan"
    dtype: torch.dtype = BF16
    states: Any = "auto"
    resumed: bool = False
    threads: int = 1
    backend: str = "c"
    fuses: bool = True

    def __str__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        states = str(self.states).replace("torch.", "") + ("-resumed" if self.resumed else "")
        return (f"{self.backend}-{self.optimizer}[{opts}]-{self.update}-"
                f"{str(self.dtype)[6:]}-{states}-t{self.threads}")  # fmt: skip


def _c(*args, **kw):
    return Case(*args, **kw, backend="c")


def _compiled(*args, **kw):
    return Case(*args, **kw, backend="compiled")


# fmt: off
CASES = [
    # -- the C loop: every option, update mode, dtype and state source
    _c("adamw", (("weight_decay", 0.1),), "kahan", BF16, "auto"),
    _c("adamw", (("maximize", True), ("weight_decay", 0.1)), "nearest", BF16, "8-bit"),
    _c("adamw", (("maximize", True), ("betas", (0.3, 0.99))), "stochastic", BF16, BF16,
       threads=2),
    _c("adamw", (("betas", (0.3, 0.99)), ("eps", 1e-4)), "kahan", FP16, FP32),
    _c("adamw", (("weight_decay", 0.1),), "stochastic", BF16, "4-bit", resumed=True),
    _c("adam", (("weight_decay", 0.1),), "nearest", BF16, FP32, threads=2),
    _c("adam", (("weight_decay", 0.1), ("maximize", True)), "kahan", BF16, "8-bit",
       resumed=True, threads=2),
    _c("adam", (("weight_decay", 0.1), ("betas", (0.3, 0.99))), "stochastic", BF16, "4-bit"),
    _c("adam", (("maximize", True), ("eps", 1e-4)), "kahan", FP16, "auto"),
    _c("adam", (("decoupled_weight_decay", True), ("weight_decay", 0.1)), "kahan", BF16,
       "8-bit"),
    _c("adam", (("amsgrad", True),), "kahan", BF16, "auto", fuses=False),
    _c("adamw", (("foreach", False),), "kahan", BF16, "8-bit", fuses=False),
    _c("adam", (("fused", False),), "nearest", FP16, "auto", fuses=False),
    _c("adamw", (), "stochastic", FP16, "auto", fuses=False),  # fp16 has no stochastic loop
    _c("sgd", (), "kahan", BF16, "auto", threads=2),
    _c("sgd", (("weight_decay", 0.01), ("maximize", True)), "stochastic", BF16, "auto",
       threads=2),
    _c("sgd", (("momentum", 0.9), ("dampening", 0.3), ("weight_decay", 0.01)), "kahan", BF16,
       BF16),
    _c("sgd", (("momentum", 0.9), ("dampening", 0.3), ("maximize", True)), "nearest", FP16,
       FP32, threads=2),
    _c("sgd", (("momentum", 0.9), ("nesterov", True), ("weight_decay", 0.01)), "stochastic",
       BF16, "8-bit", threads=2),
    _c("sgd", (("momentum", 0.9), ("nesterov", True), ("maximize", True)), "kahan", FP16,
       "4-bit", resumed=True),
    _c("sgd", (("momentum", 0.9), ("dampening", 0.3)), "stochastic", BF16, "8-bit",
       resumed=True),
    _c("sgd", (("momentum", 0.9), ("foreach", False)), "kahan", BF16, "auto", fuses=False),
    _c("sgd", (("momentum", 0.9), ("fused", False)), "kahan", BF16, "4-bit", fuses=False),
    # -- compiled: each option, mode, dtype and state source once more (a compile per kind)
    _compiled("adamw", (("maximize", True), ("weight_decay", 0.1)), "kahan", BF16, "8-bit",
              resumed=True),
    _compiled("adam", (("weight_decay", 0.1), ("betas", (0.3, 0.99)), ("eps", 1e-4)),
              "nearest", FP16, "auto", threads=2),
    _compiled("adamw", (), "stochastic", BF16, BF16),
    _compiled("adam", (("amsgrad", True), ("decoupled_weight_decay", True)), "nearest", BF16,
              FP32, fuses=False),
    _compiled("adamw", (("fused", False),), "kahan", BF16, "auto", fuses=False),
    _compiled("adamw", (), "stochastic", FP16, "auto", fuses=False),
    _compiled("sgd", (("momentum", 0.9), ("dampening", 0.3), ("maximize", True)),
              "stochastic", BF16, "4-bit", resumed=True),
    _compiled("sgd", (("momentum", 0.9), ("nesterov", True), ("weight_decay", 0.01)), "kahan",
              FP16, FP32, threads=2),
    _compiled("sgd", (("weight_decay", 0.01),), "nearest", BF16, "auto"),
    _compiled("sgd", (("momentum", 0.9), ("foreach", False)), "kahan", BF16, "auto",
              fuses=False),
]
# fmt: on


# --------------------------------------------------------------------------- the runs


def _build(case: Case) -> tuple[torch.nn.Module, Any]:
    """A 16-bit Linear and its optimizer under ``case``'s update mode (no loss scaling: both
    runs get the same gradients, set directly)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(SHAPE[1], SHAPE[0])
    options = dict(case.options)
    options.setdefault("lr", 0.05 if case.optimizer == "sgd" else 1e-2)
    opt = OPTIMIZERS[case.optimizer](model.parameters(), **options)
    recipe = mixprec.Recipe("O3", case.dtype, update=case.update,
                            optimizer_states=case.states, loss_scale=None)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mixprec.initialize(model, opt, recipe)


def _gradients(step: int, dtype: torch.dtype) -> list[Tensor]:
    """The weight's and the bias's gradients of ``step``: rows of scales 2**-6 .. 2 apart
    (each block of codes its own scale), a zero row, and exact zeros."""
    gen = torch.Generator().manual_seed(step)
    w = torch.randn(SHAPE, generator=gen) * 2.0 ** torch.randint(-6, 2, (SHAPE[0], 1),
                                                                 generator=gen)  # fmt: skip
    w[0] = 0.0
    w[3, ::5] = 0.0
    b = torch.randn(SHAPE[0], generator=gen)
    return [(w * 1e-2).to(dtype), (b * 1e-2).to(dtype)]


def _decode_states(opt: Any) -> None:
    """Hold every coded state as its fp32 values, as a checkpoint that saved them decoded
    loads them (the codes are wanted again: the next step writes them)."""
    for st in opt.state.values():
        for k, v in list(st.items()):
            if isinstance(v, QuantizedState):
                st[k] = v.dequantize()


def _snapshot(model: torch.nn.Module, opt: Any) -> list[tuple[str, Any, Any]]:
    """(name, value, kind) of every weight, compensation and state: kind a dtype, a format of
    codes (value: a copy of the QuantizedState), ``"kahan"`` (``w + c`` in fp32, ``c``) or
    ``"step"``."""
    out = []
    for i, p in enumerate(model.parameters()):
        w = p.detach()
        out.append((f"p{i}", w.clone(), w.dtype))
        comp = opt.updater.compensation.get(p)
        if comp is not None:
            out.append((f"p{i}+c", (w.float() + comp.float(), comp.clone()), "kahan"))
        for k, v in sorted(opt.state[p].items()):
            if k == "step":
                out.append((f"p{i}.step", v.clone(), "step"))
            elif isinstance(v, QuantizedState):
                out.append((f"p{i}.{k}", copy.deepcopy(v), v.fmt))
            else:
                out.append((f"p{i}.{k}", v.clone(), v.dtype))
    return out


def _tensors(value: Any) -> tuple[Tensor, ...]:
    """The tensors of a snapshot's value (see :func:`_snapshot`)."""
    if isinstance(value, QuantizedState):
        return value.codes, value.scale
    return value if isinstance(value, tuple) else (value,)


@torch.no_grad()
def _sync(ref: tuple, run: tuple) -> None:
    """Copy ``ref``'s weights, compensation and states into ``run``'s (in place; the same
    structure, checked by :func:`_assert_close`), so that each step is compared from the same
    inputs: a step's difference alone, not one compounded over the steps before it."""
    (a, aopt), (b, bopt) = ref, run
    for p, q in zip(a.parameters(), b.parameters()):
        q.copy_(p)
        if p in aopt.updater.compensation:
            bopt.updater.compensation[q].copy_(aopt.updater.compensation[p])
        for k, v in aopt.state[p].items():
            w = bopt.state[q][k]
            if isinstance(v, QuantizedState):
                w.codes.copy_(v.codes)
                w.scale.copy_(v.scale)
            else:
                w.copy_(v)


# --------------------------------------------------------------------------- the comparisons

#: what one step of the two paths may differ by, from the same inputs (see :func:`_sync`),
#: measured on an AVX-512 EPYC (torch 2.13, gcc 12): torch's CPU kernels contract into FMA
#: (lerp, addcmul, ``add_(alpha=)``); the C loop and inductor round each operation on its
#: own. In ulps of the value's dtype: a 16-bit weight or state one (on a small fraction of
#: the elements), an fp32 state two (inductor's first step, ``(1 - beta2) * g * g`` from
#: zeros; the C loop's one), ``w + c`` under Kahan one of the 16-bit compensation, each above
#: a floor of one fp32 ulp of the row's largest value (a result of cancellation, m or
#: w - lr * g near 0, is off by an ulp of the operands, not of itself) and one ulp of the
#: dtype's smallest normal (fp16's subnormal compensation holds no finer step); a block scale
#: two, without a floor.
ULPS = {BF16: 1, FP16: 1, FP32: 2}
#: the fraction of a 16-bit tensor that may differ by its one ulp (fp32 states: any)
FRACTION = 0.005
#: the fraction of codes that may round the other way (a first step's values, from zeros,
#: land on E4M3's rounding boundaries: a few in a thousand)
CODES_FRACTION = 0.002


def _ulp(x: Tensor, dtype: torch.dtype) -> Tensor:
    """One ulp of ``dtype`` at ``x`` (subnormals: the smallest normal's)."""
    mant = {BF16: 7, FP16: 10, FP32: 23}[dtype]
    x = x.abs().clamp(min=torch.finfo(dtype).tiny)
    return 2.0 ** (torch.floor(torch.log2(x)) - mant)


def _far(
    a: Tensor, b: Tensor, allowed: Tensor, dtype: torch.dtype, floor: bool = True
) -> tuple[Tensor, Tensor]:
    """Per element: whether ``a`` and ``b`` differ, and whether by more than ``allowed`` above
    the floor (see :data:`ULPS`; none for values that are no result of cancellation)."""
    a, b = a.double(), b.double()
    big = torch.maximum(a.abs(), b.abs())
    row = big.amax(dim=-1, keepdim=True) if big.dim() > 1 else big.amax()
    floor = (_ulp(row, FP32) + _ulp(torch.tensor(0.0), dtype)) * floor
    differ = (a != b) & ~(a.isnan() & b.isnan())
    return differ, differ & ((a - b).abs() > allowed + floor)


def _assert_codes_close(a: QuantizedState, b: QuantizedState, what: tuple) -> None:
    """Codes equal but on :data:`CODES_FRACTION` of them, each of those one code step apart (an
    fp32 value at a code's rounding boundary); block scales within two ulps (a block's largest
    value, an ulp apart, over E4M3's 448)."""
    differ = (a.codes != b.codes).double().mean().item()
    assert differ <= CODES_FRACTION, (*what, differ)
    scale = 2 * _ulp(torch.maximum(a.scale, b.scale), FP32)
    _, far = _far(a.scale, b.scale, scale, FP32, floor=False)
    assert not far.any(), (*what, a.scale[far][:4], b.scale[far][:4])
    x, y = a.dequantize(), b.dequantize()
    if a.kind == "sqrt":  # the codes hold the square root
        x, y = x.sqrt(), y.sqrt()
    step = 2.0 ** -_layout(a.fmt, a.kind)[2] * torch.maximum(x.abs(), y.abs()).amax(-1, True)
    far = (x - y).abs() > step
    assert not far.any(), (*what, x[far][:4], y[far][:4])


def _assert_close(ref: list, got: list, where: str) -> None:
    """Every weight and state of ``got`` within the bounds above of ``ref``'s (the names,
    dtypes and formats alike); codes equal."""
    assert [(n, k) for n, _, k in ref] == [(n, k) for n, _, k in got], where
    for (name, a, kind), (_, b, _) in zip(ref, got):
        what = (where, name)
        if kind == "step":
            assert torch.equal(a, b), what
        elif kind in ("8-bit", "4-bit"):
            _assert_codes_close(a, b, what)
        elif kind == "kahan":  # (w + c in fp32, c)
            c = torch.maximum(a[1].abs(), b[1].abs())
            _, far = _far(a[0], b[0], _ulp(c.double(), a[1].dtype), a[1].dtype)
            assert not far.any(), (*what, a[0][far][:4], b[0][far][:4])
        else:
            assert a.dtype == b.dtype == kind, what
            big = torch.maximum(a.abs(), b.abs()).double()
            differ, far = _far(a, b, ULPS[kind] * _ulp(big, kind), kind)
            frac = differ.double().mean().item()
            assert not far.any(), (*what, a[far][:4], b[far][:4])
            assert kind == FP32 or frac <= FRACTION, (*what, frac)


def _run_pair(case: Case, monkeypatch: pytest.MonkeyPatch) -> tuple[int, list[list]]:
    """``case`` stepped by the chunk path and by its backend in lockstep (the same gradients
    each step), compared after every step (:func:`_assert_close`) and then made equal
    (:func:`_sync`); returns the backend's fused step count and both runs' snapshots after
    each step."""
    if case.backend == "c" and not c_loop.available():
        pytest.skip("no C compiler on this machine")
    monkeypatch.setattr(spec, "MIN_NUMEL", 0)  # the compiled loop at every size
    monkeypatch.setattr(c_loop, "PER_THREAD", 256)  # a thread per 256 elements at most
    ref, run = _build(case), _build(case)
    seen = []
    threads = torch.get_num_threads()
    torch.set_num_threads(case.threads)
    try:
        for step in range(STEPS):
            grads = _gradients(step, case.dtype)
            for (model, opt), backend in ((ref, "chunk"), (run, case.backend)):
                monkeypatch.setattr(spec, "CPU_BACKEND", backend)
                for p, g in zip(model.parameters(), grads):
                    p.grad = g.clone()
                opt.step()
                opt.zero_grad()
            pair = _snapshot(*ref), _snapshot(*run)
            _assert_close(*pair, f"{case} step {step}")
            seen.append(pair)
            _sync(ref, run)
            if case.resumed and step == 0:
                for _, opt in (ref, run):
                    _decode_states(opt)
    finally:
        torch.set_num_threads(threads)
    return run[1].updater.fused.fused_steps, seen


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_backend_steps_as_the_chunk_path(case, monkeypatch):
    """The backend's weights, compensation and states after each step equal the chunk path's
    up to fp32 rounding order (bit for bit where the backend leaves the kind to the chunk path:
    an option or dtype it does not take); codes held decoded after a resume are read as fp32
    and written back as the chunk path's codes."""
    steps, seen = _run_pair(case, monkeypatch)
    if not case.fuses:
        assert steps == 0
        for ref, got in seen:
            for (name, a, _), (_, b, _) in zip(ref, got):
                for x, y in zip(_tensors(a), _tensors(b)):
                    assert torch.equal(x, y), name
        return
    # every step in one pass; SGD's first with dampening on the reference (torch's buffer
    # starts as the gradient itself)
    first = int(bool(dict(case.options).get("dampening")))
    assert steps == 2 * (STEPS - first)


def _traits(case: Case) -> set[str]:
    """What ``case`` exercises, as :func:`test_the_cases_cover_every_option_with_each_backend`
    counts it: options always, the rest only where the backend steps the kind."""
    opts = dict(case.options)
    adam = case.optimizer != "sgd"
    out = {k for k in ("maximize", "amsgrad", "dampening", "nesterov") if opts.get(k)}
    out |= {f"{k}=False" for k in ("foreach", "fused") if opts.get(k) is False}
    if opts.get("weight_decay"):
        decoupled = case.optimizer == "adamw" or opts.get("decoupled_weight_decay")
        out.add(f"{case.optimizer if not adam else 'decoupled' if decoupled else 'coupled'} wd")
    if adam:
        out.add("1 - beta1 >= 0.5" if 1 - opts.get("betas", (0.9,))[0] >= 0.5 else "below")
    else:
        out.add("momentum" if opts.get("momentum") else "plain sgd")
    if case.fuses:
        out |= {case.update, str(case.dtype), f"threads {case.threads}", f"{case.states} held"}
        out |= {f"{case.states} resumed"} if case.resumed else set()
    return out


def test_the_cases_cover_every_option_with_each_backend():
    """Each backend meets every option of torch's Adam, AdamW and SGD, every update mode and
    dtype, every way a state is held (resumed codes too) and one and two threads."""
    want = {"maximize", "amsgrad", "dampening", "nesterov", "foreach=False", "fused=False",
            "coupled wd", "decoupled wd", "sgd wd", "1 - beta1 >= 0.5", "below", "momentum",
            "plain sgd", "nearest", "kahan", "stochastic", str(BF16), str(FP16), "threads 1",
            "threads 2", "auto held", f"{FP32} held", f"{BF16} held", "8-bit held",
            "4-bit held", "8-bit resumed", "4-bit resumed"}  # fmt: skip
    for backend in ("c", "compiled"):
        have = set().union(*(_traits(c) for c in CASES if c.backend == backend))
        assert want <= have, (backend, want - have)


# --------------------------------------------------------------------------- non-finite gradients

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    ("dtype", "recipe", "at", "bad"),
    [
        (BF16, {}, 0, INF),  # "lean": released, stochastic, 8-bit codes
        (BF16, {}, -1, NAN),
        (FP16, {"update": "kahan", "loss_scale": None}, SHAPE[0] * SHAPE[1] // 2 + 7, -INF),
        (FP16, {"update": "kahan"}, -1, INF),  # loss scaling: held, the step skipped whole
    ],
    ids=["bf16-first-inf", "bf16-last-nan", "fp16-middle-neg-inf", "fp16-loss-scaled"],
)
def test_a_non_finite_gradient_under_lean_leaves_its_parameter_bit_identical(
    dtype, recipe, at, bad, monkeypatch
):
    """ "lean" on the default backend (the C loop, whose finite check reads released
    gradients): one inf or NaN anywhere in a gradient does what the chunk path does -- that
    parameter left alone and the user told, or the whole step skipped -- and its weight,
    compensation, states and codes stay bit for bit as they were."""
    if not c_loop.available():
        pytest.skip("no C compiler on this machine")
    runs = {}
    for backend in ("chunk", "c"):
        monkeypatch.setattr(spec, "CPU_BACKEND", backend)
        torch.manual_seed(0)
        model = torch.nn.Linear(SHAPE[1], SHAPE[0])
        opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt = mixprec.initialize(model, opt, mixprec.Recipe("lean", dtype, **recipe))
        told = []
        for step in range(3):
            x = torch.randn(8, SHAPE[1], generator=torch.Generator().manual_seed(step))
            hook = None
            if step == 2:
                before = _snapshot(model, opt)

                def poison(g):
                    g = g.clone()
                    g.view(-1)[at] = bad
                    return g

                hook = model.weight.register_hook(poison)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.backward(model(x).float().pow(2).mean())
                opt.step()
                opt.zero_grad()
            if hook is not None:
                hook.remove()
            told.append([(w.category, str(w.message)) for w in caught])
        runs[backend] = before, _snapshot(model, opt), told, opt.step_skipped, opt.updater
    ref, got = runs["chunk"], runs["c"]
    assert got[4].fused.fused_steps > 0  # the fused path stepped the finite steps
    assert got[2] == ref[2] and got[3] == ref[3]  # told alike, skipped alike
    assert ref[3] or any("non-finite gradient" in m for _, m in ref[2][2])
    for (name, a, _), (_, b, _) in zip(got[0], got[1]):
        unchanged = name.startswith("p0") or ref[3]  # the weight (or all of a skipped step)
        for x, y in zip(_tensors(a), _tensors(b)):
            assert torch.equal(x, y) == unchanged, name
        if not unchanged:
            assert all(v.isfinite().all() for v in _tensors(b))


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_the_fused_finite_check_sees_one_inf_or_nan_anywhere(dtype, monkeypatch):
    """The C pass over a gradient's exponent bits (what "lean" checks a released gradient with)
    and the updater's check built on it: an inf or NaN at the first element, in the middle,
    at the end of the vector body, in the tail or last makes it non-finite, at every size;
    the largest finite value, subnormals and -0.0 do not."""
    if not c_loop.available():
        pytest.skip("no C compiler on this machine")
    monkeypatch.setattr(spec, "CPU_BACKEND", "c")
    check = fused.FusedUpdates()
    info = torch.finfo(dtype)
    for n in (1, 31, 64, 257, 4099):
        g = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
        special = torch.tensor([info.max, -info.max, info.tiny / 2, -0.0]).to(dtype)
        g[torch.linspace(0, n - 1, min(n, 4)).long()] = special[: min(n, 4)]
        assert c_loop.all_finite(g) is True and check.finite(g) and all_finite(g), n
        body = n - n % 64
        for at in sorted({0, n // 2, max(body - 1, 0), min(body, n - 1), n - 1}):
            for bad in (INF, -INF, NAN):
                h = g.clone()
                h[at] = bad
                assert c_loop.all_finite(h) is False, (n, at, bad)
                assert not check.finite(h) and not all_finite(h), (n, at, bad)


# --------------------------------------------------------------------------- the library cache


def test_the_library_cache_key_covers_everything_a_build_depends_on(tmp_path, monkeypatch):
    """A C library is built for the source, the defines of its kind of step, the flags, the
    compiler and the CPU it runs on (``-march=native``): a change of any of them picks another
    library path, not the one built for something else; the same inputs pick the same one."""
    monkeypatch.setattr(c_loop.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(
        c_loop.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0)
    )
    monkeypatch.setattr(c_loop.os, "replace", lambda src, dst: None)  # nothing is built
    monkeypatch.setattr(c_loop, "_compiler", lambda: "/usr/bin/cc")
    monkeypatch.setattr(c_loop, "_cpu_flags", lambda: "flags : avx2")
    m, v = Held(fmt="8-bit", kind="signed"), Held(fmt="8-bit", kind="sqrt")
    codes = StepKind("adam", "kahan", BF16, BF16, (m, v), decoupled=True)
    defines = codes.defines()
    first = c_loop._build(defines)
    assert c_loop._build(list(defines)) == first
    source = tmp_path / "c_loop.c"
    source.write_bytes(c_loop._SOURCE.read_bytes() + b"\n")
    resumed = codes._replace(states=(m, v._replace(from_fp32=True)))  # one define: S2SRC
    changes = {
        "the defines": (None, None, resumed.defines()),
        "the CPU": ("_cpu_flags", lambda: "flags : avx2 avx512f", defines),
        "the compiler": ("_compiler", lambda: "/usr/bin/clang", defines),
        "the flags": ("_FLAGS", (*c_loop._FLAGS, "-mno-avx512f"), defines),
        "the source": ("_SOURCE", source, defines),
    }
    paths = {first}
    for what, (name, value, given) in changes.items():
        with monkeypatch.context() as m:
            if value is not None:
                m.setattr(c_loop, name, value)
            lib = c_loop._build(given)
        assert lib.parent == first.parent and lib not in paths, what
        paths.add(lib)
