"""The fused update (core/update/fused.py): one compiled pass per parameter, numerically the
chunk path up to fp32 rounding order. Each test runs both ways a CPU can step: the C loops of
core/update/c_loop.py (the default) and torch.compile's (inductor's C++ here, the source
a GPU's Triton comes from), picked by spec.CPU_BACKEND. The compiling tests are few and use
tiny tensors (each compiled kind of step costs seconds on a 2-core CPU)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from training_helpers import assert_bitwise

import mixprec
from mixprec._core.update import c_loop, compiled_step, fused, spec
from mixprec._core.update.rounding import keyed_bits_, round_keys

BF16, FP16 = torch.bfloat16, torch.float16
#: the largest difference after 100 steps, in ulps of the 16-bit weight (measured on an AVX-512
#: EPYC, torch 2.13: inductor's 2, on 0.04% of the elements, AdamW + Kahan, 0 for stochastic
#: rounding and SGD; the C loop 0 for all, also AdamW + nearest)
ULP_BOUND = 4


@pytest.fixture(params=["c", "compiled"])
def backend(request, monkeypatch):
    """What steps a parameter in one pass on this CPU: the C loop or torch.compile's."""
    if request.param == "c" and not c_loop.available():
        pytest.skip("no C compiler on this machine")
    monkeypatch.setattr(spec, "CPU_BACKEND", request.param)
    return request.param


@pytest.fixture
def fused_on(monkeypatch, backend):
    """Every size in one pass (the compiled loop otherwise leaves small parameters out)."""
    monkeypatch.setattr(spec, "MIN_NUMEL", 0)
    return backend


def _reference(monkeypatch, on: bool, backend: str) -> None:
    """Step on ``backend`` at every size (``on``), or on the reference (the chunk path)."""
    monkeypatch.setattr(spec, "MIN_NUMEL", 0)
    monkeypatch.setattr(spec, "CPU_BACKEND", backend if on else "chunk")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _opt(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)


def _build(kind, update, dtype=BF16, model=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model if model is not None else _model()
        return mixprec.initialize(
            model, _opt(kind, model.parameters()), mixprec.Recipe("O3", dtype, update=update)
        )


def _train(model, opt, steps, start=0, sched=None):
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 96, generator=g), torch.randn(16, 8, generator=g)
        opt.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def ulps(a, b):
    """|a - b| in ulps of the 16-bit value of larger magnitude."""
    a, b = a.detach().float(), b.detach().float()
    big = torch.maximum(a.abs(), b.abs())
    return (a - b).abs() / torch.where(big > 0, 2.0 ** (torch.floor(torch.log2(big)) - 7), 1.0)


@pytest.mark.parametrize(
    ("kind", "update"), [("adamw", "kahan"), ("adamw", "stochastic"), ("sgd", "nearest")]
)
def test_fused_differs_from_the_chunk_path_by_fp32_rounding_order_only(
    kind, update, monkeypatch, backend
):
    """100 steps, an lr schedule, four parameter sizes: no recompile (no new C library) after
    the first fused step, and the weights within ULP_BOUND ulps of the chunk path's (torch's
    fused fp32 kernel on temporaries)."""
    runs = {}
    for mode in ("off", "on"):
        _reference(monkeypatch, mode == "on", backend)
        model, opt = _build(kind, update)
        sched = torch.optim.lr_scheduler.StepLR(opt, 10, gamma=0.8)
        _train(model, opt, 3, sched=sched)  # states made, then the graphs compiled
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        libraries = len(c_loop._LOADED)
        _train(model, opt, 97, start=3, sched=sched)
        runs[mode] = model, opt
    model, opt = runs["on"]
    assert opt.updater.fused.fused_steps == 100 * 4  # the first step included
    # no recompile for a new step count, lr or parameter size
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert len(c_loop._LOADED) == libraries
    diff = torch.cat([ulps(p, q).flatten() for p, q in zip(runs["off"][0].parameters(),
                                                           model.parameters())])  # fmt: skip
    assert diff.max() <= ULP_BOUND, diff.max()
    assert (diff > 0).float().mean() < 0.01


def test_lean_with_8bit_codes_and_released_gradients(monkeypatch, backend):
    """ "lean" (gradients released in backward, stochastic rounding, 8-bit codes decoded and
    re-coded in the same compiled function): one fused step against the chunk path's. The codes
    differ only where an fp32 value differs in its last bits (inductor's vectorized sqrt is
    within 0.5001 ulp, not always correctly rounded; torch's fused AdamW orders its operations
    its own way) and that moves a block's largest value."""
    runs = {}
    for mode in ("off", "on"):
        _reference(monkeypatch, mode == "on", backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _model()
            runs[mode] = mixprec.initialize(
                model, _opt("adamw", model.parameters()), mixprec.Recipe("lean", BF16)
            )
        _train(*runs[mode], 2)
    (a, aopt), (b, bopt) = runs["off"], runs["on"]
    assert bopt.updater.gradients == "released" and bopt.updater.fused.fused_steps == 2 * 4
    diff = torch.cat([ulps(p, q).flatten() for p, q in zip(a.parameters(), b.parameters())])
    # a code that rounds the other way (its fp32 value an ulp apart) moves an element's step by
    # up to an eighth of itself: 2 ulps of the weight at most here
    assert diff.max() <= 2 and (diff > 0).float().mean() < 0.01, (diff.max(), (diff > 0).sum())
    w, v = a[0].weight, b[0].weight
    for k in ("exp_avg", "exp_avg_sq"):
        ca, cb = aopt.state[w][k].codes, bopt.state[v][k].codes
        assert (ca != cb).float().mean() < 0.01, k


def test_keyed_bits_are_the_rounding_modules(fused_on):
    """The fused kernel's int64 hash gives the bits of rounding's int32 one, eager and
    compiled: stochastic rounding stays keyed by (seed, step, parameter, global index)."""
    n, offset = 5000, 123456
    key, mix = round_keys(7, 3, 2)
    h, tmp = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
    want = keyed_bits_(h, tmp, [(n, offset, key)], mix, 16)
    base = torch.tensor((offset + key) & 0xFFFFFFFF)
    mixt = torch.tensor(mix & 0xFFFFFFFF)
    eager = compiled_step._random_bits(n, base, mixt, h.device, 16)
    compiled = torch.compile(compiled_step._random_bits, dynamic=True, fullgraph=True)
    assert torch.equal(eager.to(torch.int32), want)
    assert torch.equal(compiled(n, base, mixt, h.device, 16).to(torch.int32), want)


def test_fused_resume_is_bit_for_bit(fused_on):
    model, opt = _build("adamw", "kahan")
    _train(model, opt, 4)
    half, hopt = _build("adamw", "kahan")
    _train(half, hopt, 2)
    sd, weights = copy.deepcopy(hopt.state_dict()), copy.deepcopy(half.state_dict())
    again, aopt = _build("adamw", "kahan", model=_model(seed=1))
    again.load_state_dict(weights)
    aopt.load_state_dict(sd)
    _train(again, aopt, 2, start=2)
    assert aopt.updater.fused.fused_steps > 0
    for p, q in zip(model.parameters(), again.parameters()):
        assert_bitwise(p.detach(), q.detach())
        assert_bitwise(opt.updater.compensation[p], aopt.updater.compensation[q])
        for k, v in opt.state[p].items():
            assert_bitwise(v, aopt.state[q][k])


def test_skipped_fp16_step_leaves_everything_bit_identical(fused_on):
    model, opt = _build("adamw", "kahan", dtype=FP16)
    _train(model, opt, 2)
    assert opt.updater.fused.fused_steps > 0
    params = list(model.parameters())

    def snapshot():
        return (
            [p.detach().clone() for p in params],
            [opt.updater.compensation[p].clone() for p in params],
            [{k: v.clone() for k, v in opt.state[p].items()} for p in params],
            opt.updater.steps,
        )

    before = snapshot()
    opt.backward(model(torch.randn(16, 96)).float().sum() * float("inf"))
    opt.step()
    assert opt.step_skipped
    after = snapshot()
    assert before[3] == after[3]
    for a, b in zip(before[:2], after[:2]):
        for x, y in zip(a, b):
            assert_bitwise(x, y)
    for x, y in zip(before[2], after[2]):
        assert set(x) == set(y)
        for k in x:
            assert_bitwise(x[k], y[k])


def test_no_compiler_falls_back_to_the_chunk_path_saying_so_once(fused_on, monkeypatch):
    def broken(fn, **kw):
        def run(*args):
            raise RuntimeError("no C++ compiler found")

        return run

    def no_compiler():
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")

    monkeypatch.setattr(fused, "_COMPILED", {})
    monkeypatch.setattr(fused, "_FAILED", set())
    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(c_loop, "_LOADED", {})
    monkeypatch.setattr(c_loop, "_STEPS", {})
    monkeypatch.setattr(c_loop, "_compiler", no_compiler)
    ref, ropt = _build("adamw", "nearest")
    _reference(monkeypatch, False, fused_on)
    _train(ref, ropt, 3)
    _reference(monkeypatch, True, fused_on)
    model, opt = _build("adamw", "nearest")
    with pytest.warns(UserWarning, match="could not be compiled") as record:
        _train(model, opt, 3)
    assert sum("could not be compiled" in str(w.message) for w in record) == 1
    assert opt.updater.fused.fused_steps == 0
    for p, q in zip(ref.parameters(), model.parameters()):
        assert_bitwise(p.detach(), q.detach())


def test_a_recipe_with_torchs_kernels_never_compiles_an_update(monkeypatch):
    """``kernels='torch'`` leaves every parameter to the chunk path, bit for bit."""
    runs = []
    for kernels, mode in (("auto", "on"), ("torch", "on"), ("auto", "off")):
        _reference(monkeypatch, mode == "on", "c")
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        recipe = mixprec.Recipe("O3", BF16, update="nearest", kernels=kernels)
        model, opt = mixprec.initialize(model, opt, recipe)
        _train(model, opt, 3)
        runs.append(
            (opt.updater.fused.fused_steps, [p.detach().clone() for p in model.parameters()])
        )
    assert runs[0][0] > 0 and runs[1][0] == 0 == runs[2][0]
    for a, b in zip(runs[1][1], runs[2][1]):
        assert_bitwise(a, b)


@pytest.mark.parametrize("choice", [{"fused": False}, {"foreach": False}, {"foreach": True}])
def test_a_users_explicit_choice_of_torchs_loop_is_respected(choice, fused_on):
    """``fused=False`` / ``foreach=False`` keep torch's own loop (the chunk path); an explicit
    wish for speed (``foreach=True``) takes the fused pass."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **choice)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = mixprec.initialize(model, opt, mixprec.Recipe("O3", BF16))
    _train(model, opt, 3)
    assert (opt.updater.fused.fused_steps > 0) == (False not in choice.values())
