"""mixprec.compat.apex: Apex's amp namespace and FP16_Optimizer, tested the way Apex's own L0
amp suite tests Apex, on CPU, plus the documented differences."""

from __future__ import annotations

import io
import itertools
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.compat import apex as mp_apex
from mixprec.compat.apex import FP16_Optimizer, amp
from mixprec.compat.fp16_optimizer import network_to_half

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
HALF, FLOAT, MATCH = "half", "float", "match"
h, b, c, k = 16, 4, 4, 3


@pytest.fixture(autouse=True)
def _clean_amp():
    amp.reset()
    yield
    amp.reset()


class Probe(nn.Module):
    """Runs ``fn`` inside an amp-initialized forward and records each result's dtype."""

    def __init__(self, fn, **children):
        super().__init__()
        self.fn = fn
        self.seen: list[torch.dtype] = []
        for name, child in children.items():
            setattr(self, name, child)

    def forward(self, *xs):
        out = self.fn(self, *xs)
        for o in out if isinstance(out, (list, tuple)) else [out]:
            self.seen.append(o.dtype)
        return out


def _o1(module: nn.Module) -> nn.Module:
    return amp.initialize(module, opt_level="O1", verbosity=0)


# -- 4.1 basic casts -----------------------------------------------------------------------
_W = nn.Parameter(torch.randn(h, h))
BASIC = {
    "nn.Linear": (lambda m, x: m.lin(x), dict(lin=nn.Linear(h, h)), (b, h), HALF),
    "F.linear": (lambda m, x: F.linear(x, m.w), dict(), (b, h), HALF),
    "nn.Conv2d": (lambda m, x: m.conv(x), dict(conv=nn.Conv2d(c, c, k)), (b, c, 8, 8), HALF),
    "F.conv2d": (lambda m, x: F.conv2d(x, m.w4), dict(), (b, c, 8, 8), HALF),
    "nn.Softmax": (lambda m, x: m.sm(x), dict(sm=nn.Softmax(dim=1)), (b, h), FLOAT),
    "F.softmax": (lambda m, x: F.softmax(x, dim=1), dict(), (b, h), FLOAT),
    "nn.GroupNorm": (lambda m, x: m.gn(x), dict(gn=nn.GroupNorm(2, c)), (b, c, 8, 8), FLOAT),
    "nn.MSELoss": (lambda m, x: nn.MSELoss()(x, torch.zeros(b, h)), dict(), (b, h), FLOAT),
    "nn.ReLU": (lambda m, x: m.relu(x), dict(relu=nn.ReLU()), (b, h), MATCH),
    "F.relu": (lambda m, x: F.relu(x), dict(), (b, h), MATCH),
    "nn.BatchNorm2d": (lambda m, x: m.bn(x), dict(bn=nn.BatchNorm2d(c)), (b, c, 8, 8), MATCH),
    "x.matmul(W)": (lambda m, x: x.matmul(m.w), dict(), (b, h), HALF),
    "W.matmul(x)": (lambda m, x: m.w.matmul(x.t()), dict(), (b, h), HALF),
    "x @ W": (lambda m, x: x @ m.w, dict(), (b, h), HALF),
    "x.pow(2.)": (lambda m, x: x.pow(2.0), dict(), (b, h), FLOAT),
    "x ** 2.": (lambda m, x: x**2.0, dict(), (b, h), FLOAT),
    "x.sum()": (lambda m, x: x.sum(), dict(), (b, h), FLOAT),
    # Apex bans binary_cross_entropy on fp16 (NotImplementedError); mixprec runs it in fp32.
    "F.binary_cross_entropy": (
        lambda m, x: F.binary_cross_entropy(torch.sigmoid(x), torch.rand(b, h)),
        dict(),
        (b, h),
        FLOAT,
    ),
}


@pytest.mark.parametrize("in_dtype", [torch.float16, torch.float32], ids=["half", "float"])
@pytest.mark.parametrize("name", list(BASIC))
def test_basic_casts(name, in_dtype):
    fn, children, shape, expect = BASIC[name]
    probe = Probe(fn, **children)
    probe.w = nn.Parameter(torch.randn(h, h) * 0.1)
    probe.w4 = nn.Parameter(torch.randn(c, c, k, k) * 0.1)
    probe = _o1(probe)
    x = torch.randn(*shape, dtype=in_dtype).requires_grad_()
    out = probe(x)
    want = {HALF: torch.float16, FLOAT: torch.float32, MATCH: in_dtype}[expect]
    assert probe.seen == [want]
    assert out.dtype == want  # O1, as Apex: the output keeps the dtype of the op that made it
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == in_dtype


@pytest.mark.parametrize("in_dtype", [torch.float16, torch.float32])
def test_batchnorm_eval_matches_input(in_dtype):
    probe = _o1(Probe(lambda m, x: m.bn(x), bn=nn.BatchNorm2d(c)).eval())
    with torch.no_grad():
        probe(torch.randn(b, c, 8, 8, dtype=in_dtype))
    assert probe.seen == [in_dtype]


# -- 4.2 promotion -------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["atan2", "mul"])
@pytest.mark.parametrize(
    ("xt", "yt"), list(itertools.product([torch.float16, torch.float32], repeat=2))
)
@pytest.mark.parametrize("method", [False, True])
def test_binary_promotion(op, xt, yt, method):
    fn = (
        (lambda m, x, y: getattr(x, op)(y))
        if method
        else (lambda m, x, y: getattr(torch, op)(x, y))
    )
    probe = _o1(Probe(fn))
    x = torch.rand(h, dtype=xt).add_(0.1).requires_grad_()
    y = torch.rand(h, dtype=yt).add_(0.1)
    probe(x, y).float().sum().backward()
    expect = torch.float32 if torch.float32 in (xt, yt) else torch.float16
    assert probe.seen == [expect] and x.grad.dtype == xt


def test_cat_promotion_and_inplace_ops():
    probe = _o1(Probe(lambda m, *xs: torch.cat(xs)))
    probe(*[torch.ones(2, dtype=torch.float16)] * 5, torch.ones(2))
    probe(*[torch.ones(2, dtype=torch.float16)] * 6)
    assert probe.seen == [torch.float32, torch.float16]
    # In-place ops are never downcast: x.exp_() keeps x's dtype (Apex raises on fp16 instead),
    # and x.add_(y) returns x's dtype for every y dtype.
    for xt, yt in itertools.product([torch.float16, torch.float32], repeat=2):
        probe = _o1(Probe(lambda m, x, y: (x.clone().exp_(), x.clone().add_(y))))
        x = torch.rand(h, dtype=xt).requires_grad_()
        outs = probe(x, torch.rand(h, dtype=yt))
        assert probe.seen == [xt, xt]
        sum(o.float().sum() for o in outs).backward()
        assert x.grad.dtype == xt


# -- 4.3 the cast cache --------------------------------------------------------------------
CACHE_FNS = {
    "whitelist": lambda x, w: x.mm(w).mm(w).sum(),
    "blacklist": lambda x, w: (x + w**2 + w**2).sum(),
    "promote": lambda x, w: ((x * w) * w).sum(),
}


@pytest.mark.parametrize("wdtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kind", list(CACHE_FNS))
def test_cache_never_serves_stale_weights(kind, wdtype):
    fn = CACHE_FNS[kind]
    torch.manual_seed(0)
    probe = Probe(lambda m, x: fn(x, m.weight))
    probe.weight = nn.Parameter(torch.rand(h, h, dtype=wdtype) * 0.5)
    opt = torch.optim.SGD(probe.parameters(), lr=0.0)
    amp._amp_state.allow_incoming_model_not_fp32 = True  # as Apex's test: fp16 weights as given
    probe, opt = amp.initialize(probe, opt, opt_level="O1", loss_scale=4.0, verbosity=0)
    amp._amp_state.allow_incoming_model_not_fp32 = False
    x = torch.rand(h, h) * 0.5
    for phase in ("train", "eval", "train"):
        if phase == "eval":
            with torch.no_grad():
                probe(x)
            continue
        probe.weight.grad = None
        with amp.scale_loss(probe(x), opt) as scaled:
            assert float(scaled) == pytest.approx(4.0 * float(probe(x)), rel=1e-3)
            scaled.backward()
        grads = [p for p in probe.parameters() if p.grad is not None]
        assert len(grads) == 1 and probe.weight.grad.dtype == wdtype
        ref_w = probe.weight.detach().clone().requires_grad_()  # not a Parameter: no cache hit
        with mixprec.autocast(torch.float16):
            ref = fn(x, ref_w)
        ref.float().backward()
        torch.testing.assert_close(probe.weight.grad, ref_w.grad)
        with torch.no_grad():
            probe.weight -= 1  # in place: the next train step must not see the old cast


# -- 4.4 RNNs ------------------------------------------------------------------------------
@pytest.mark.parametrize("cell_type", [nn.RNNCell, nn.GRUCell, nn.LSTMCell])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rnn_cells_unrolled(cell_type, dtype):
    def unroll(m, xs, hx):
        outs = []
        state = (hx, hx.clone()) if cell_type is nn.LSTMCell else hx
        for t in range(xs.shape[0]):
            state = m.cell(xs[t], state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return outs

    probe = _o1(Probe(unroll, cell=cell_type(h, h)))
    xs = torch.randn(10, b, h, dtype=dtype).requires_grad_()
    outs = probe(xs, torch.zeros(b, h, dtype=dtype))
    assert probe.seen == [torch.float16] * 10
    outs[-1].float().sum().backward()
    assert xs.grad.dtype == dtype


@pytest.mark.parametrize(
    "rnn_type",
    [lambda *a, **kw: nn.RNN(*a, nonlinearity="relu", **kw), nn.GRU, nn.LSTM],
    ids=["RNN", "GRU", "LSTM"],
)
@pytest.mark.parametrize(("layers", "bidir"), [(1, False), (2, False), (2, True)])
def test_rnn_layers(rnn_type, layers, bidir):
    probe = _o1(
        Probe(lambda m, x: m.rnn(x)[0], rnn=rnn_type(h, h, num_layers=layers, bidirectional=bidir))
    )
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(6, b, h, dtype=dtype).requires_grad_()
        probe(x).float().sum().backward()
        assert x.grad.dtype == dtype
    assert probe.seen == [torch.float16, torch.float16]


def test_packed_sequence_rnn():
    from torch.nn.utils.rnn import pack_padded_sequence

    probe = _o1(
        Probe(
            lambda m, x: m.rnn(pack_padded_sequence(x, [6, 5, 3, 2]))[0].data,
            rnn=nn.RNN(h, h, num_layers=2),
        )
    )
    x = torch.randn(6, 4, h).requires_grad_()
    probe(x).float().sum().backward()
    assert probe.seen == [torch.float16] and x.grad.dtype == torch.float32


# -- 4.5 multiple models, optimizers and losses, with injected overflows ----------------------
class MyModel(nn.Module):
    def __init__(self, unique: int, ref: bool = False):
        super().__init__()
        self.weight0 = nn.Parameter(torch.tensor([1.0, 2.0]) + unique)
        w1 = torch.tensor([0.5, 1.5]) + unique
        self.weight1 = nn.Parameter(w1 if ref else w1.half())

    def forward(self, x):
        return (x * self.weight0.float() * self.weight1.float()).sum()


LRS = (0.25, 0.5, 0.125)
TOPOLOGIES = {  # models, optimizer -> models, losses as (models summed, optimizers passed)
    "2m2l1o": (2, [[0, 1]], [([0], [0]), ([1], [0])]),
    "3m2l1o": (3, [[0, 1, 2]], [([0, 2], [0]), ([1, 2], [0])]),
    "2m2l2o": (2, [[0], [1]], [([0], [0]), ([1], [1])]),
    "3m2l2o": (3, [[0, 1], [2]], [([0, 1], [0]), ([2, 1], [0, 1])]),
}


def _sgd(models, idx):
    return torch.optim.SGD(
        [{"params": list(models[i].parameters()), "lr": LRS[i]} for i in idx],
        lr=0.1,
        momentum=0.125,
    )


def _zero(style, models, opts):
    if style == "none":
        for m in models:
            for p in m.parameters():
                p.grad = None
    elif style == "model":
        for m in models:
            m.zero_grad()
    else:
        for o in opts:
            o.zero_grad()


def _run_topology(level, topo, num_losses, inject, zero_style):
    n, groups, losses = TOPOLOGIES[topo]
    iters = 3 if inject else 2
    models = [MyModel(i) for i in range(n)]
    refs = [MyModel(i, ref=True) for i in range(n)]
    opts = [_sgd(models, g) for g in groups]
    ref_opts = [_sgd(refs, g) for g in groups]
    models, opts = amp.initialize(
        models, opts, opt_level=level, cast_model_type=False, num_losses=num_losses, verbosity=0
    )
    if level in ("O1", "O2"):  # Apex forces the initial scales 4 and 16
        amp.load_state_dict(
            {
                f"loss_scaler{i}": {"loss_scale": 4.0 * 4**i, "unskipped": 0}
                for i in range(num_losses)
            }
        )
    x = torch.ones(2)
    for it in range(iters):
        _zero(zero_style, models, opts)
        for o in ref_opts:
            o.zero_grad()
        skip = set()
        for li, (midx, oidx) in enumerate(losses):
            loss = sum(models[i](x) for i in midx)
            with amp.scale_loss(
                loss, [opts[j] for j in oidx], loss_id=li if num_losses == 2 else 0
            ) as scaled:
                scaled.backward()
                if inject and inject[:2] == (it, li):
                    target, pname = inject[2:]
                    getattr(models[midx[target]], pname).grad[0] = float("inf")
                    skip.update(oidx)
            sum(refs[i](x) for i in midx).backward()
        for j, (o, ro) in enumerate(zip(opts, ref_opts)):
            if j in skip:
                continue
            for p, rp in zip(amp.master_params(o), amp.master_params(ro)):
                torch.testing.assert_close(p.grad.float(), rp.grad, rtol=2e-3, atol=1e-3)
        for j, (o, ro) in enumerate(zip(opts, ref_opts)):
            o.step()
            assert o.step_skipped == (j in skip)
            if j not in skip:
                ro.step()
    for m, r in zip(models, refs):
        torch.testing.assert_close(m.weight0, r.weight0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.weight1.float(), r.weight1, rtol=2e-3, atol=2e-3)
    for o in opts:
        for p, master in zip(o.model_params(), o.master_params()):
            assert torch.equal(p.detach(), master.detach().to(p.dtype))


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_multiple_models_optimizers_losses(level, topo):
    _n, _, losses = TOPOLOGIES[topo]
    injections = [None] + [
        (it, li, t, p)
        for it in (0, 1)
        for li in (0, 1)
        for t in range(len(losses[li][0]))
        for p in ("weight0", "weight1")
    ]
    styles = itertools.cycle(["none", "model", "optimizer"])
    for num_losses in (1, 2):
        for inject in injections:
            amp.reset()
            _run_topology(level, topo, num_losses, inject, next(styles))


# -- 4.7 add_param_group -------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_add_param_group(level):
    styles = itertools.cycle(["none", "model", "optimizer"])
    for zero_before_add, accumulate in itertools.product([True, False], repeat=2):
        amp.reset()
        models = [MyModel(0), MyModel(1)]
        refs = [MyModel(0, ref=True), MyModel(1, ref=True)]
        opt = torch.optim.SGD(models[0].parameters(), lr=0.25, momentum=0.125)
        ref_opt = torch.optim.SGD(refs[0].parameters(), lr=0.25, momentum=0.125)
        models, opt = amp.initialize(
            models, opt, opt_level=level, cast_model_type=False, verbosity=0
        )
        if level in ("O1", "O2"):
            amp.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}})
        x = torch.ones(2)
        for it in range(3):
            style = next(styles)
            if it == 1:
                if zero_before_add:
                    _zero(style, models, [opt])
                    _zero(style, refs, [ref_opt])
                opt.add_param_group({"params": list(models[1].parameters()), "lr": 0.5})
                ref_opt.add_param_group({"params": list(refs[1].parameters()), "lr": 0.5})
            if not (it == 1 and zero_before_add):
                _zero(style, models, [opt])
                _zero(style, refs, [ref_opt])
            loss = models[0](x) + models[1](x)
            ref = refs[0](x) + refs[1](x)
            for _ in range(2 if accumulate else 1):
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward(retain_graph=True)
                ref.backward(retain_graph=True)
            opt.step()
            ref_opt.step()
        for m, r in zip(models, refs):
            torch.testing.assert_close(m.weight0, r.weight0, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(m.weight1.float(), r.weight1, rtol=2e-3, atol=2e-3)


# -- 4.8 checkpointing ---------------------------------------------------------------------
class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.param = nn.Parameter(torch.ones(1))
        self.conv = nn.Conv2d(3, 6, 3)
        self.relu = nn.ReLU()
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x):
        return self.bn(self.relu(self.conv(x * self.param)))


def _train(model, opt, steps, seed, scale=1.0, loss_ids=(0,)):
    g = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(steps):
        x = torch.randn(4, 3, 8, 8, generator=g)
        opt.zero_grad()
        for loss_id in loss_ids:
            out = model(x * scale)
            with amp.scale_loss(out.float().pow(2).mean(), opt, loss_id=loss_id) as s:
                s.backward()
        opt.step()
        outs.append(out.detach())
    return outs


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("num_losses", [1, 2])
def test_checkpoint_restore_is_bitwise(level, num_losses):
    def build():
        torch.manual_seed(0)
        model = ConvNet()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        return amp.initialize(model, opt, opt_level=level, num_losses=num_losses, verbosity=0)

    ids = tuple(range(num_losses))
    model, opt = build()
    _train(model, opt, 5, seed=1, loss_ids=ids)
    buf = io.BytesIO()  # through torch.save, as a real checkpoint (and no aliasing)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model_sd, opt_sd, amp_sd = ckpt["model"], ckpt["opt"], ckpt["amp"]
    for key, value in model_sd.items():
        if "num_batches_tracked" not in key:
            assert value.dtype == torch.float32, key
    model2, opt2 = build()
    model2.load_state_dict(model_sd)
    opt2.load_state_dict(opt_sd)
    amp.load_state_dict(amp_sd)
    out1 = _train(model, opt, 5, seed=2, loss_ids=ids)
    out2 = _train(model2, opt2, 5, seed=2, loss_ids=ids)
    for a, b_ in zip(out1, out2):
        assert torch.equal(a, b_)
    for (k1, v1), (k2, v2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2), k1
    assert opt.loss_scale == opt2.loss_scale


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_loss_scale_decrease_per_loss(level):
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, num_losses=3, verbosity=0)
    init = opt.loss_scale
    for t in range(2):
        x = torch.randn(4, 3, 8, 8)
        opt.zero_grad()
        for loss_id in range(3):  # loss i overflows (fp16 activations) in its first i steps
            out = model(x * (2.0**17 if t < loss_id else 1.0))
            with amp.scale_loss(out.float().pow(2).mean(), opt, loss_id=loss_id) as s:
                s.backward()
        opt.step()
    sd = amp.state_dict()
    for i in range(3):
        assert opt.slot(i).scaler.scale == init / 2**i
        assert (sd[f"loss_scaler{i}"]["loss_scale"], sd[f"loss_scaler{i}"]["unskipped"]) == (
            init / 2**i,
            2 - i,
        )


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_state_dict_fp32_and_trainable(level):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert all(v.dtype != torch.float16 for v in model.state_dict().values())
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    losses, skipped = [], []
    for _ in range(11):
        loss = F.mse_loss(model(x), y)
        losses.append(float(loss))
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as s:
            s.backward()
        opt.step()
        skipped.append(opt.step_skipped)  # fp16 at O1/O2 may skip while the scale settles
    assert sum(skipped) <= 2
    for i in range(10):
        assert losses[i + 1] == losses[i] if skipped[i] else losses[i + 1] < losses[i], losses


def test_o2_state_dict_holds_exact_masters_and_old_checkpoints_load():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    model, opt = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=1e-3), opt_level="O2", verbosity=0
    )
    with amp.scale_loss(model(torch.randn(8, 4)).pow(2).mean(), opt) as s:
        s.backward()
    opt.step()
    master = opt.master_params()[0]
    assert model.weight.dtype == torch.float16
    assert torch.equal(model.state_dict()["weight"], master.detach())  # not fp16-rounded
    assert not torch.equal(master.detach(), model.weight.detach().float())
    # an Apex-era checkpoint: fp32 model values and a plain torch optimizer state dict. The
    # model's values reach the masters; the optimizer's state dict leaves them alone.
    fp32_model = nn.Linear(4, 4)
    model.load_state_dict(fp32_model.state_dict())
    opt.load_state_dict(torch.optim.SGD(fp32_model.parameters(), lr=5e-3).state_dict())
    assert opt.param_groups[0]["lr"] == 5e-3
    assert torch.equal(opt.master_params()[0].detach(), fp32_model.weight.detach())


# -- initialize semantics, registration, FP16_Optimizer --------------------------------------
def test_initialize_errors_match_apex():
    m = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="letter O, not the number zero"):
        amp.initialize(m, opt_level="01", verbosity=0)
    with pytest.raises(RuntimeError, match="O1 inserts casts"):
        amp.initialize(m, opt_level="O1", cast_model_type=torch.float16, verbosity=0)
    with pytest.raises(RuntimeError, match="keep_batchnorm_fp32 should be None"):
        amp.initialize(m, opt_level="O1", keep_batchnorm_fp32=True, verbosity=0)
    with pytest.raises(RuntimeError, match="patch_torch_functions=True"):
        amp.initialize(m, opt_level="O2", patch_torch_functions=True, verbosity=0)
    with pytest.raises(RuntimeError, match="AFTER"):
        amp.initialize(nn.DataParallel(m), opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="must be called before"):
        with amp.scale_loss(torch.ones(()), None):
            pass


def test_initialize_options_and_disabled():
    m = nn.Linear(2, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m2, o2 = amp.initialize(m, o, enabled=False, verbosity=0)
    assert m2 is m and o2 is o
    loss = torch.ones((), requires_grad=True)
    with amp.scale_loss(loss, o2) as s:
        assert s is loss
    amp.reset()
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m, o = amp.initialize(
        m, o, opt_level="O2", loss_scale="128.0", keep_batchnorm_fp32="False", verbosity=0
    )
    assert o.loss_scale == 128.0 and m[1].weight.dtype == torch.float16
    sched = torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)  # a real torch Optimizer
    with amp.scale_loss(m(torch.randn(4, 2)).sum(), o.optimizer) as s:  # the original one
        s.backward()
    o.step()
    sched.step()
    assert o.param_groups[0]["lr"] == 0.05 and not o.step_skipped
    with pytest.raises(RuntimeError, match="only be passed through amp.initialize once"):
        amp.initialize(nn.Linear(2, 2), o, verbosity=0)


def test_bfloat16_hint_and_dtype_extension(capsys):
    amp.initialize(nn.Linear(2, 2), opt_level="O1", verbosity=1)
    hint = "bfloat16 is the better choice" in capsys.readouterr().out
    assert hint == (mixprec.default_dtype("cpu") == torch.bfloat16)
    amp.reset()
    m = amp.initialize(nn.Linear(2, 2), opt_level="O2", dtype=torch.bfloat16, verbosity=1)
    assert m.weight.dtype == torch.bfloat16 and "better choice" not in capsys.readouterr().out


def test_register_functions_decorators_and_disable_casts():
    ns = types.SimpleNamespace(custom=lambda x, y: (x.dtype, y.dtype))
    amp.register_half_function(ns, "custom")
    amp.register_float_function(torch, "sigmoid")
    with pytest.raises(ValueError, match="No function named"):
        amp.register_promote_function(torch, "no_such_fn")

    @amp.float_function
    def fp32_body(x):
        return x @ x.t()  # runs with casts off: stays fp32

    @amp.promote_function
    def promoted(x, y):
        return x.dtype, y.dtype

    def fn(m, x):
        dtypes = ns.custom(x, x.float())
        assert dtypes == (torch.float16, torch.float16)
        assert fp32_body(x.half()).dtype == torch.float32
        assert promoted(x.half(), x) == (torch.float32, torch.float32)
        assert promoted(x.half(), x.half()) == (torch.float16, torch.float16)
        with amp.disable_casts():
            assert m.lin(x).dtype == torch.float32
        return torch.sigmoid(m.lin(x))

    probe = _o1(Probe(fn, lin=nn.Linear(h, h)))
    probe(torch.randn(b, h))
    assert probe.seen == [torch.float32]  # sigmoid registered as a float function
    # O1 casts every op of this thread, as Apex's patches did, until the handle is deactivated
    assert ns.custom(torch.ones(1), torch.ones(1)) == (torch.float16, torch.float16)
    amp._amp_state.handle._deactivate()
    assert ns.custom(torch.ones(1), torch.ones(1)) == (torch.float32, torch.float32)
    assert probe.lin(torch.ones(1, h)).dtype == torch.float32
    amp.reset()
    assert mixprec._core.cast_table.rule_for(torch.sigmoid) is None
    assert ns.custom.__name__ == "<lambda>" and not hasattr(ns.custom, "__wrapped__")


def test_install_makes_apex_imports_resolve():
    assert "apex" not in sys.modules
    mp_apex.install()
    try:
        from apex import amp as apex_amp
        from apex.fp16_utils import FP16_Optimizer as Fp16Opt

        assert apex_amp is amp and Fp16Opt is FP16_Optimizer
    finally:
        mp_apex.uninstall()
    assert "apex" not in sys.modules


def test_fp16_optimizer_dynamic_trajectory_and_skips():
    torch.manual_seed(0)
    model = network_to_half(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    assert model[1][0].weight.dtype == torch.float16 and model[1][1].weight.dtype == torch.float32
    lin = nn.Linear(4, 4).half()
    opt = FP16_Optimizer(
        torch.optim.SGD(lin.parameters(), lr=0.1),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**10, "scale_window": 2},
        verbose=False,
    )
    x = torch.randn(8, 4).half()
    scales = []
    for i in range(5):
        opt.zero_grad()
        opt.backward(lin(x * (1e5 if i == 2 else 1.0)).float().pow(2).mean())  # fp16 overflow
        if i == 2:
            before = [p.detach().clone() for p in lin.parameters()]
            assert opt.clip_master_grads(1.0) == -1
        else:
            assert opt.clip_master_grads(100.0) > 0
        opt.step()
        if i == 2:
            assert opt.overflow and all(torch.equal(a, p) for a, p in zip(before, lin.parameters()))
        scales.append(opt.loss_scale)
    assert scales == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11]


def test_fp16_optimizer_checkpoint_is_exact_and_static_default():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).half()
    opt = FP16_Optimizer(torch.optim.Adam(lin.parameters(), lr=1e-3), verbose=False)
    assert opt.loss_scale == 1.0 and not opt.dynamic_loss_scale
    x = torch.randn(8, 4).half()
    for _ in range(3):
        opt.zero_grad()
        opt.backward(lin(x).float().pow(2).mean())
        opt.step()
    sd = opt.state_dict()
    lin2 = nn.Linear(4, 4).half()
    opt2 = FP16_Optimizer(torch.optim.Adam(lin2.parameters(), lr=1e-3), verbose=False)
    opt2.load_state_dict(sd)
    for a, b_ in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"]):
        assert a.dtype == torch.float32 and torch.equal(a.detach(), b_.detach())
    assert torch.equal(lin.weight.detach(), lin2.weight.detach())


@pytest.mark.parametrize("convert", ["network_to_half", "FP16Model"])
def test_fp16_optimizer_masters_start_from_the_fp32_weights(convert):
    """Apex's order: load pretrained fp32 weights, convert the network, build FP16_Optimizer.
    The masters hold the fp32 values, not their fp16 rounding (Apex copies the rounding)."""
    from mixprec.compat.fp16_optimizer import FP16Model, _fp32_before

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    want = [p.detach().clone() for p in net.parameters()]
    model = network_to_half(net) if convert == "network_to_half" else FP16Model(net)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    masters = opt.mixed.master_params()
    assert all(torch.equal(m, w) for m, w in zip(masters, want))
    assert not any(torch.equal(m, w.half().float()) for m, w in zip(masters, want))
    assert not _fp32_before  # handed over: nothing kept twice
    model(torch.randn(2, 8))


def test_converted_network_run_without_fp16_optimizer_keeps_no_fp32_copy():
    from mixprec.compat.fp16_optimizer import _fp32_before

    net = network_to_half(nn.Linear(8, 8))
    assert len(_fp32_before) == 2
    net(torch.randn(2, 8))  # inference only: the fp32 values are released at the first forward
    assert not _fp32_before
    opt = FP16_Optimizer(torch.optim.SGD(net.parameters(), lr=0.1), verbose=False)
    assert all(
        torch.equal(m, p.float()) for m, p in zip(opt.mixed.master_params(), net.parameters())
    )
