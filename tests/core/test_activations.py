"""activations=: what the forward saves for backward, stored in FP8 or 16-bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec._core import activations
from mixprec._core.activations import ActivationConfig, SavedTensorStorage
from mixprec.fp8 import quantization

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

BF16 = torch.bfloat16


class Block(nn.Module):
    """A small pre-norm MLP block with a residual: Linear / GELU / LayerNorm saves."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        x = x + self.proj(F.gelu(self.fc(self.ln(x))))
        return self.head(x)


def _data(seed: int = 0, n: int = 200, d: int = 64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, 10, (n,), generator=g)


def _pair(level: str, act, seed: int = 0, dtype=BF16, **kw):
    torch.manual_seed(seed)
    dtype = None if level == "O0" else dtype
    model = Block()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return mixprec.initialize(model, opt, mixprec.Recipe(level, dtype, activations=act, **kw))


class Census:
    """Saved-tensor hooks outermost in the stack see what the inner hooks packed."""

    def __init__(self) -> None:
        self.items: list = []

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda p: p)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def _pack(self, t):
        self.items.append(t)
        return t


def _saved(model, x) -> list:
    """What the model's own hooks stored, per saved tensor (seen from the forward's saves)."""
    seen = []
    original = SavedTensorStorage._pack

    def spy(self, t):
        out = original(self, t)
        seen.append((t, out))
        return out

    SavedTensorStorage._pack = spy
    try:
        model(x)
    finally:
        SavedTensorStorage._pack = original
    return seen


# ---------------------------------------------------------------------------------- config


def test_config_spellings_and_errors():
    assert activations.as_activation_config(None) is None
    assert activations.as_activation_config("fp8") == ActivationConfig("fp8")
    assert activations.as_activation_config("recompute") == ActivationConfig(storage=None)
    cfg = ActivationConfig("16-bit", min_numel=8)
    assert activations.as_activation_config(cfg) is cfg
    with pytest.raises(ValueError, match=r"storage='int4'.*\('fp8', '16-bit', None\)"):
        ActivationConfig("int4")
    with pytest.raises(ValueError, match="min_numel=0"):
        ActivationConfig(min_numel=0)
    with pytest.raises(ValueError, match="changes nothing; pass activations=None"):
        ActivationConfig(storage=None, recompute=False)
    with pytest.raises(TypeError, match="activations= takes None.*'recompute'.*received int 8"):
        activations.as_activation_config(8)
    with pytest.raises(TypeError, match="received str 'int4'"):
        activations.as_activation_config("int4")
    with pytest.raises(ValueError, match=r"Recipe\(activations=.*'16-bit' .* computes in fp32"):
        mixprec.Recipe("O0", activations="16-bit")
    with pytest.raises(TypeError, match="unexpected keyword argument 'activation'"):
        mixprec.Recipe("O2", activation="fp8")


# ---------------------------------------------------------------------------- what is stored


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_fp8_stores_activations_and_leaves_weights_and_inputs(level):
    model, _ = _pair(level, ActivationConfig("fp8", recompute=False, min_numel=1024))
    x, _ = _data()
    saved = _saved(model, x)
    packed = [(t, out) for t, out in saved if out is not t]
    kept = [t for t, out in saved if out is t]
    assert packed, "nothing was stored in FP8"
    assert not any(_is_weight_like(t, model) for t, _ in packed)
    for t, out in packed:
        assert out.data.data.dtype == quantization.E4M3 and out.data.power_of_2
        assert out.dtype == t.dtype and out.shape == t.shape
        assert t.numel() >= 1024 and t.dtype.is_floating_point
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for t, _ in packed:  # no weight, no cast of a weight (O1's bf16 copies), no input batch
        assert t.untyped_storage().data_ptr() not in weights
        assert t.grad_fn is not None
    assert any(t.shape == (200, 256) for t, _ in packed)  # fc's output, saved by GELU
    assert any(_is_weight_like(t, model) for t in kept)  # the weights were seen, and kept


def _is_weight_like(t, model) -> bool:
    return any(t.shape in (p.shape, p.t().shape) for p in model.parameters() if p.dim() == 2)


def test_sixteen_bit_storage_narrows_fp32_saves_only():
    model, _ = _pair("O1", ActivationConfig("16-bit", recompute=False, min_numel=1024))
    x, _ = _data()
    saved = _saved(model, x)
    packed = [(t, out) for t, out in saved if out is not t]
    assert packed
    for t, out in packed:
        assert t.dtype == torch.float32 and out.data.dtype == BF16
    assert all(out is t for t, out in saved if t.dtype == BF16)


def test_each_tensor_is_stored_once_however_many_ops_save_it():
    x = torch.randn(64, 128, requires_grad=True)
    w1, w2 = torch.randn(128, requires_grad=True), torch.randn(128, requires_grad=True)
    h = x * 2  # saved by both multiplications below (for the gradients of w1 and w2)
    stored = []
    original = SavedTensorStorage._pack

    def spy(self, t):
        out = original(self, t)
        stored.append(out)
        return out

    SavedTensorStorage._pack = spy
    try:
        with SavedTensorStorage(ActivationConfig(min_numel=1), BF16):
            y = (h * w1).sum() + (h * w2).sum()
    finally:
        SavedTensorStorage._pack = original
    ids = [id(s) for s in stored if isinstance(s, activations._Packed)]
    assert len(ids) == 2 and len(set(ids)) == 1  # h was packed once and shared
    y.backward()
    assert torch.equal(x.grad, 2 * (w1 + w2).detach().expand(64, 128))  # exact: w kept


def test_expanded_and_fp8_tensors_are_left_alone():
    base = torch.randn(1, 128, requires_grad=True)
    wide = base.expand(512, 128)
    fp8 = torch.randn(512, 128).to(quantization.E4M3)
    hooks = SavedTensorStorage(ActivationConfig(min_numel=1), BF16)
    assert not hooks._wanted(wide)
    assert not hooks._wanted(fp8)
    assert hooks._wanted(torch.randn(512, 128, requires_grad=True) * 1)


@pytest.mark.parametrize("level", ["O0", "O2", "O3"])
def test_recompute_is_exact_and_stores_no_activation_output(level):
    x, y = _data()
    runs = []
    for act in (None, ActivationConfig(storage=None, min_numel=1024)):
        model, opt = _pair(level, act)
        if act is not None:
            saved = _saved(model, x)
            rebuilt = [t for t, out in saved if isinstance(out, activations._Recomputed)]
            assert [t.shape for t in rebuilt] == [(200, 256)]  # GELU's output, saved by proj
            assert all(out is t for t, out in saved if not isinstance(out, activations._Recomputed))
        for _ in range(3):
            opt.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)  # bitwise: recomputation changes nothing


@pytest.mark.parametrize(
    "act", [F.silu, F.mish, F.hardswish, lambda t: F.gelu(t, approximate="tanh")]
)
def test_recompute_covers_the_elementwise_activations(act):
    w1 = torch.randn(64, 128, requires_grad=True)
    w2 = torch.randn(128, 32, requires_grad=True)
    x = torch.randn(256, 64)
    grads = []
    for hooks in (None, SavedTensorStorage(ActivationConfig(storage=None, min_numel=1), BF16)):
        w1.grad = w2.grad = None
        if hooks is None:
            out = act(x @ w1) @ w2
        else:
            with hooks:
                out = act(x @ w1) @ w2
        out.square().sum().backward()
        grads.append((w1.grad.clone(), w2.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_an_activation_output_changed_in_place_is_stored_not_recomputed():
    w1 = torch.randn(64, 128, requires_grad=True)
    w2 = torch.randn(128, 32, requires_grad=True)
    x = torch.randn(256, 64)
    grads = []
    for hooks in (None, SavedTensorStorage(ActivationConfig(storage=None, min_numel=1), BF16)):
        w1.grad = w2.grad = None
        with hooks or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            h = F.gelu(x @ w1)
            with torch.no_grad():  # h keeps GELU as its grad_fn; only its version tells
                h.mul_(2.0)
            out = h @ w2  # saves h after the change: recomputing GELU would lose the 2
        out.sum().backward()
        grads.append(w2.grad.clone())
    assert torch.equal(*grads)


# ------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_fp8_gradients_stay_close_to_the_level_without_it(level):
    x, y = _data()
    grads = []
    for act in (None, ActivationConfig("fp8", min_numel=1024)):
        model, opt = _pair(level, act)
        opt.backward(F.cross_entropy(model(x), y))
        grads.append([opt.grad_of(p).clone() for p in model.parameters()])
    for ref, got in zip(*grads):
        assert quantization.sqnr(ref, got) > 20  # e4m3: about 3 significant bits per element


def test_a_row_overflowing_in_forward_skips_the_step_with_fp8_storage():
    model, opt = _pair("O2", ActivationConfig("fp8", min_numel=1024), dtype=torch.float16)
    x, y = _data()
    before = [p.detach().clone() for p in model.parameters()]
    x[3, 0] = 1e30  # inf in fp16 after the input cast
    opt.backward(F.cross_entropy(model(x), y))
    opt.step()
    assert opt.step_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_training_with_fp8_storage_tracks_the_level(level):
    x, y = _data(n=400)
    curves = []
    for act in (None, "fp8"):
        model, opt = _pair(level, ActivationConfig(act, min_numel=1024) if act else None)
        losses = []
        for _ in range(60):
            loss = F.cross_entropy(model(x), y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        curves.append(losses)
    plain, fp8 = curves
    assert fp8[-1] < 0.5 * fp8[0]  # it learns
    assert abs(fp8[-1] - plain[-1]) <= 0.05 * plain[0]


def test_resume_is_bit_exact_with_fp8_storage():
    x, y = _data()

    def run(steps, state=None):
        model, opt = _pair("O2", "fp8")
        if state is not None:
            model.load_state_dict(state[0])
            opt.load_state_dict(state[1])
        for _ in range(steps):
            opt.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        return model, opt

    straight, _ = run(6)
    m, o = run(3)
    resumed, _ = run(3, (m.state_dict(), o.state_dict()))
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_graph_models_get_the_storage_too():
    torch.manual_seed(0)
    x, y = _data()
    graph = mixprec.convert(Block(), (x,), "mixed_bfloat16")
    opt = torch.optim.SGD(graph.parameters(), lr=0.1)
    graph, opt = mixprec.initialize(
        graph, opt, mixprec.Recipe("O2", BF16, activations=ActivationConfig(min_numel=1024))
    )
    saved = _saved(graph, x)
    assert any(out is not t for t, out in saved)
    opt.backward(F.cross_entropy(graph(x).float(), y))
    opt.step()
    assert not opt.step_skipped


def test_compiled_model_is_one_graph_and_its_saves_are_stored():
    graphs = []

    def backend(gm, inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    model, opt = _pair("O2", ActivationConfig("fp8", min_numel=1024))
    x, y = _data()
    compiled = torch.compile(model, backend=backend)
    eager_model, eager_opt = _pair("O2", ActivationConfig("fp8", min_numel=1024))
    stored = _saved(compiled, x)
    assert any(out is not t for t, out in stored)  # the hooks ran around the compiled forward
    # the model's forward is one graph (the hooks are entered in Python around it)
    assert sum(F.gelu in g for g in graphs) == 1
    model_graph = next(g for g in graphs if F.gelu in g)
    assert sum(t is F.linear for t in model_graph) == 4 and F.layer_norm in model_graph
    loss_c = F.cross_entropy(compiled(x), y)
    loss_e = F.cross_entropy(eager_model(x), y)
    opt.backward(loss_c)
    eager_opt.backward(loss_e)
    assert torch.equal(loss_c, loss_e)
    for a, b in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(opt.grad_of(a), eager_opt.grad_of(b))


def test_plain_torch_is_untouched_outside_the_model():
    model, _ = _pair("O2", "fp8")
    x, _ = _data()
    other = nn.Linear(64, 64)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        other(x.requires_grad_()).sum()
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in seen)
    model(x)  # the model's hooks are scoped to its forward
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        other(x).sum()
    assert all(isinstance(t, torch.Tensor) for t in seen)


@pytest.mark.parametrize("shape", [(3, 1000, 96), (70000,), (5, 40, 8, 8), (2, 3)])
def test_fp8_chunks_round_trip_any_shape(shape, monkeypatch):
    monkeypatch.setattr(quantization, "_CHUNK", 4096)  # several slices, a partial last one
    ranges = torch.rand(shape[0], *([1] * (len(shape) - 1))) * 100
    t = (torch.randn(*shape) * ranges).to(BF16)
    packed = activations._Packed(activations._to_fp8(t), t)
    back = packed.unpack()
    assert back.shape == t.shape and back.dtype == BF16
    assert quantization.sqnr(t, back) > 25
    width = 1
    for d in activations._row_dims(t.shape):
        width *= t.shape[d]
    assert width >= min(activations._ROW, t.numel())
    whole = quantization.quantize(t.reshape(-1, width), axis=-1, power_of_2=True)
    # chunking: exact
    assert torch.equal(back.reshape(-1, width), quantization.dequantize(whole, BF16))


def test_caller_hooks_around_the_model_win_with_a_warning():
    from torch.utils.checkpoint import checkpoint

    x, y = _data()
    plain, plain_opt = _pair("O2", None)
    plain_opt.backward(F.cross_entropy(plain(x), y))
    model, opt = _pair("O2", ActivationConfig(min_numel=1024))
    with pytest.warns(UserWarning, match="activations= is not applied to this forward"):
        out = checkpoint(model, x, use_reentrant=False)  # checkpointing still works
    opt.backward(F.cross_entropy(out, y))
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(plain_opt.grad_of(a), opt.grad_of(b))  # exact: no FP8 underneath
    seen = []
    with pytest.warns(UserWarning, match="save_on_cpu"):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            model(x)
    assert any(t.shape == (200, 256) for t in seen)  # the caller's hooks saw GELU's output


class Checkpointed(nn.Module):
    """A model that checkpoints its own MLP: checkpointing inside, storage outside."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mlp, self.head = nn.Linear(64, 256), Block(256), nn.Linear(10, 10)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.mlp, F.gelu(self.inp(x)), use_reentrant=False))


def test_checkpointing_inside_the_model_composes_with_the_storage():
    x, y = _data()
    grads = []
    for act in (None, ActivationConfig(min_numel=1024)):
        torch.manual_seed(0)
        model = Checkpointed()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = mixprec.initialize(model, opt, mixprec.Recipe("O2", BF16, activations=act))
        opt.backward(F.cross_entropy(model(x), y))
        grads.append([opt.grad_of(p) for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.isfinite(b).all() and quantization.sqnr(a, b) > 20
