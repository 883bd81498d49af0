"""The fused update's C loops (core/update/c_loop.py): codes written as state_codes.py
writes them, bit for bit; the same result split over threads; and "auto" on a CPU fusing what
it can, coded states and small parameters included."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import mixprec
from mixprec._core.update import c_loop, spec
from mixprec._core.update.spec import Held, StepKind
from mixprec._core.update.state_codes import QuantizedState

pytestmark = pytest.mark.skipif(not c_loop.available(), reason="no C compiler here")

BF16 = torch.bfloat16


def _rows(rows, cols, seed):
    """Values over a wide range with the awkward blocks: a zero row, a row below 2**-100, an
    all-negative row, exact zeros, and a partial last block per row (cols % 256 != 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 2.0 ** torch.randint(-30, 10, (rows, cols),
                                                                   generator=g)  # fmt: skip
    x[0] = 0.0
    x[1] *= 2.0**-110
    x[2] = -x[2].abs()
    x[3, ::7] = 0.0
    return x


def _adam(update, grad, *states):
    """An AdamW kind of step on bf16 weights."""
    return StepKind("adam", update, BF16, grad, states, decoupled=True)


def _scalars(beta1, beta2):
    """AdamW's scalars (spec.SCALARS) with lr 0: the weight does not move."""
    return torch.tensor([1.0, 0.0, 1.0, 1 - beta1, beta2, 1 - beta2, -0.0, 1.0, 1e-8, 0.0, 0.0])


@pytest.mark.parametrize("fmt", ["8-bit", "4-bit"])
def test_codes_are_state_codes_bit_for_bit(fmt):
    """With beta1 = beta2 = 0 a step stores the gradient as the first moment and its square as
    the second: the codes and block scales must be QuantizedState.quantize's of the same fp32
    values. With beta1 = beta2 = 1 a step re-codes the decoded states: quantize(dequantize())."""
    rows, cols = 6, 300
    key = _adam("nearest", torch.float32, Held(fmt=fmt, kind="signed"), Held(fmt=fmt, kind="sqrt"))
    w = torch.zeros(rows, cols, dtype=BF16)
    g = _rows(rows, cols, 0).to(BF16).float() + 0.0  # no -0.0: lerp's (g - m) * 0 gives +0
    m = QuantizedState.quantize(torch.randn(rows, cols), fmt, "signed")
    v = QuantizedState.quantize(torch.rand(rows, cols), fmt, "sqrt")
    states = [(m.codes, m.scale), (v.codes, v.scale)]
    c_loop.run(key, (w, None, g), states, _scalars(0.0, 0.0), 0, 0)
    want_m = QuantizedState.quantize(g.clone(), fmt, "signed")
    want_v = QuantizedState.quantize(g * g, fmt, "sqrt")
    for got, want in ((m, want_m), (v, want_v)):
        assert torch.equal(got.codes, want.codes)
        assert torch.equal(got.scale, want.scale)
    assert not w.any()  # lr 0

    before = [QuantizedState.quantize(s.dequantize(), fmt, s.kind) for s in (m, v)]
    c_loop.run(key, (w, None, g), states, _scalars(1.0, 1.0), 0, 0)
    for got, want in zip((m, v), before):
        assert torch.equal(got.codes, want.codes)
        assert torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("fmt", ["8-bit", "4-bit", None])
def test_threads_split_the_step_without_changing_a_bit(fmt, monkeypatch):
    """Rows (coded states) or runs of elements on several threads, stochastic rounding keyed by
    each element's index: the result of one thread, bit for bit."""
    rows, cols = 40, 700
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(rows, cols, generator=gen).to(BF16)
    g = (torch.randn(rows, cols, generator=gen) * 1e-2).to(BF16)
    if fmt is None:
        key = _adam("stochastic", BF16, Held(dtype=BF16), Held(dtype=torch.float32))
        states0 = [torch.randn(rows, cols, generator=gen).to(BF16), torch.rand(rows, cols)]
    else:
        key = _adam("stochastic", BF16, Held(fmt=fmt, kind="signed"), Held(fmt=fmt, kind="sqrt"))
        m = QuantizedState.quantize(torch.randn(rows, cols, generator=gen), fmt, "signed")
        v = QuantizedState.quantize(torch.rand(rows, cols, generator=gen), fmt, "sqrt")
        states0 = [(m.codes, m.scale), (v.codes, v.scale)]
    sc = torch.tensor([0.99, 0, 1, 0.1, 0.999, 0.001, -1e-2, 0.3, 1e-8, 0, 0])
    outs = []
    threads = torch.get_num_threads()
    monkeypatch.setattr(c_loop, "PER_THREAD", 1000)
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            w, states = w0.clone(), copy.deepcopy(states0)
            c_loop.run(key, (w, None, g), states, sc, 123, 456)
            flat = [t for s in states for t in (s if isinstance(s, tuple) else (s,))]
            outs.append([w, *flat])
    finally:
        torch.set_num_threads(threads)
    assert (outs[0][0] != w0).any()
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_auto_on_a_cpu_fuses_coded_states_and_small_parameters(monkeypatch):
    """ "auto" (the recipes' default kernels) on a CPU steps every parameter of "lean" with the C
    loop from its first step, biases and 8-bit states included, and the result stays within
    2 ulps of the chunk path's."""
    runs = {}
    for mode in ("off", "auto"):
        monkeypatch.setattr(spec, "CPU_BACKEND", "chunk" if mode == "off" else "c")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 8))  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt = mixprec.initialize(model, opt, mixprec.Recipe("lean", BF16))
        for i in range(3):
            gen = torch.Generator().manual_seed(i)
            x, y = torch.randn(16, 96, generator=gen), torch.randn(16, 8, generator=gen)
            torch.nn.functional.mse_loss(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
        runs[mode] = model, opt
    model, opt = runs["auto"]
    assert opt.updater.fused.fused_steps == 3 * 4  # every step, all four parameters
    assert isinstance(opt.state[model[0].weight]["exp_avg"], QuantizedState)
    for p, q in zip(runs["off"][0].parameters(), model.parameters()):
        a, b = p.detach().float(), q.detach().float()
        ulp = 2.0 ** (torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()))) - 7)
        # 2 ulps: a code rounding the other way moves a step by up to an eighth of itself
        assert ((a - b).abs() <= 2 * ulp).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_finite_check_sees_every_inf_and_nan(dtype):
    """One C pass over a gradient's exponent bits: any inf or NaN anywhere (the vector body and
    the tail), and nothing else, makes it non-finite; the largest finite value is finite."""
    g = torch.randn(1000).to(dtype)
    g[3] = torch.finfo(dtype).max
    g[4] = -torch.finfo(dtype).max
    assert c_loop.all_finite(g) is True
    for at in (0, 17, 999):
        for bad in (float("inf"), float("-inf"), float("nan")):
            h = g.clone()
            h[at] = bad
            assert c_loop.all_finite(h) is False, (at, bad)
    assert c_loop.all_finite(g[::2]) is None  # not contiguous: torch ops decide


def test_a_library_folder_others_may_write_into_is_refused(tmp_path, monkeypatch):
    """A library is loaded into the process: a cache folder that another user could have
    written into is refused with the fix, and nothing is built there."""
    monkeypatch.setattr(c_loop.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(c_loop, "_LOADED", {})
    monkeypatch.setattr(c_loop, "_STEPS", {})
    folder = c_loop._cache()
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    folder.chmod(0o777)
    with pytest.raises(RuntimeError, match="others may write into it; remove it"):
        c_loop.kernel(_adam("nearest", BF16, Held(dtype=BF16), Held(dtype=torch.float32)))
    assert not list(folder.iterdir())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rounding_is_torchs_bit_for_bit(dtype):
    """SGD, lr -1, a zero weight: the step writes round16(fp32 gradient), which must be torch's
    ``.to(dtype)`` for every kind of value (normal, subnormal in 16 bits and in fp32, the
    largest, past the largest, halfway ties, inf, NaN); a zero gradient leaves every 16-bit
    value as it was (the widening is exact)."""
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(4096, generator=gen) * 2.0 ** torch.randint(-150, 128, (4096,), generator=gen)
    info = torch.finfo(dtype)
    special = [0.0, -0.0, info.max, -info.max, info.tiny, info.tiny / 3, 2.0**-149,
               float("inf"), float("-inf"), float("nan"), 65512.0, 65519.0, 65520.0,
               1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8]  # fmt: skip
    g = torch.cat([g, torch.tensor(special)])
    key = StepKind("sgd", "nearest", dtype, torch.float32, ())
    sc = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # +g, no decay, -lr = 1
    w = torch.zeros(g.numel(), dtype=dtype)
    c_loop.run(key, (w, None, g), [], sc, 0, 0)
    want = (torch.zeros_like(g) + g).to(dtype)  # the step's w + g: -0.0 becomes +0.0
    same = (w.view(torch.int16) == want.view(torch.int16)) | (w.isnan() & want.isnan())
    assert same.all(), (g[~same][:5], w[~same][:5], want[~same][:5])

    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    w = every.clone()
    c_loop.run(key, (w, None, torch.zeros(w.numel())), [], sc, 0, 0)
    want = (every.float() + torch.zeros(w.numel())).to(dtype)  # -0.0 + 0 is +0.0
    kept = (w.view(torch.int16) == want.view(torch.int16)) | (w.isnan() & want.isnan())
    assert kept.all()
