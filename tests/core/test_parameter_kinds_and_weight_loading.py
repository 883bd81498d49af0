"""Habits of real training code that mixprec must get right: sparse embeddings, complex
parameters, frozen parameters, buffers, loading weights after initialize, clipping."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from extras import need
from torch import nn

import mixprec

LEVELS = [
    ("O0", None),
    ("O1", torch.bfloat16),
    ("O2", torch.bfloat16),
    ("O3", torch.bfloat16),
    ("O2", torch.float16),
]
pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")


def _train(model, opts, batches, loss_fn):
    losses = []
    for batch in batches:
        loss = loss_fn(model, *batch)
        with mixprec.scale_loss(loss, opts) as scaled:
            scaled.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("level", "dtype"), LEVELS, ids=[f"{lv}-{d}" for lv, d in LEVELS])
def test_sparse_embedding_with_sparse_adam_trains_at_every_level(level, dtype):
    torch.manual_seed(0)
    emb, head = nn.Embedding(50, 8, sparse=True), nn.Linear(8, 1)
    model = nn.Sequential(emb, head)
    opts = [
        torch.optim.SparseAdam(list(emb.parameters()), lr=0.05),
        torch.optim.Adam(head.parameters(), lr=0.05),
    ]
    model, opts = mixprec.initialize(model, opts, level, dtype)
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 50, (16, 4), generator=g), torch.randn(16, 4, 1, generator=g)
    losses = _train(model, opts, [(ids, y)] * 30, lambda m, i, t: (m(i).float() - t).pow(2).mean())
    assert losses[-1] < 0.5 * losses[0]
    assert opts[0].skipped_steps == 0


def test_sparse_gradient_with_an_inf_is_skipped():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1)
    emb, opt = mixprec.initialize(emb, opt, "O2", torch.bfloat16)
    before = emb.weight.detach().clone()
    out = emb(torch.tensor([1, 2])).float().sum() * float("inf")
    opt.backward(out)
    opt.step()
    assert opt.step_skipped and torch.equal(emb.weight.detach(), before)


class _Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.phase = nn.Parameter(torch.randn(8, dtype=torch.complex64))

    def forward(self, x):
        h = self.lin(x).float()
        return (h * self.phase).abs()


@pytest.mark.parametrize(("level", "dtype"), LEVELS[:3], ids=[f"{lv}-{d}" for lv, d in LEVELS[:3]])
def test_complex_parameters_train_and_stay_complex(level, dtype):
    torch.manual_seed(0)
    model = _Complex()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    model, opt = mixprec.initialize(model, opt, level, dtype)
    assert model.phase.dtype == torch.complex64
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    losses = _train(model, [opt], [(x,)] * 25, lambda m, a: (m(a) - 1).pow(2).mean())
    assert losses[-1] < 0.5 * losses[0] and opt.skipped_steps == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model.phase.grad is None or model.phase.grad.dtype == torch.complex64


def test_fp16_o3_with_adamw_and_no_update_mode_trains():
    """The default used to step AdamW in fp16: NaN weights on step 1, then every step skipped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = mixprec.initialize(model, opt, "O3", torch.float16)
    assert opt.updater is not None  # the update runs in fp32 temporaries
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    losses = _train(model, [opt], [(x, y)] * 30, lambda m, a, b: (m(a).float() - b).pow(2).mean())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0] and opt.skipped_steps <= 3


# --------------------------------------------------------------------------- norms


def _hf(name):
    transformers = need("transformers")
    common = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 64,
        "vocab_size": 64,
        "max_position_embeddings": 32,
    }
    if name == "gemma":
        common["head_dim"] = 16
    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "gemma": "Gemma"}[name]
    cfg = getattr(transformers, f"{prefix}Config")
    model_cls = f"{prefix}ForCausalLM"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(cfg(**common))


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gemma"])
def test_hand_written_rmsnorms_stay_fp32_at_o2_and_train(name):
    model = _hf(name)
    fp32_twin = _hf(name)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = mixprec.initialize(model, opt, "O2", torch.bfloat16)
    norms = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 2 * 2 + 1  # two per layer and the final one
    assert all(m.weight.dtype == torch.float32 for _, m in norms)
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(12):
        loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    fp32_twin.load_state_dict(mixprec.fp32_state_dict(model, opt), strict=True)
    assert all(p.dtype == torch.float32 for p in fp32_twin.parameters())


def test_the_norm_rule_and_register_norm():
    from mixprec._core.norms import is_norm, register_norm

    class ScaleNorm(nn.Module):  # hand-written, by the naming convention
        def __init__(self):
            super().__init__()
            self.g = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x / x.norm(dim=-1, keepdim=True) * self.g

    class PreNorm(nn.Module):  # a container named ...Norm: not a norm
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

    class Scaler(nn.Module):  # a norm under another name
        def __init__(self):
            super().__init__()
            self.g = nn.Parameter(torch.ones(4))

    assert is_norm(ScaleNorm()) and is_norm(nn.LayerNorm(4)) and is_norm(nn.BatchNorm1d(4))
    assert not is_norm(PreNorm()) and not is_norm(Scaler()) and not is_norm(nn.Linear(4, 4))
    register_norm(Scaler)
    register_norm(ScaleNorm, False)
    try:
        assert is_norm(Scaler()) and not is_norm(ScaleNorm())
        model = nn.Sequential(nn.Linear(4, 4), Scaler(), ScaleNorm())
        model, _ = mixprec.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", torch.bfloat16
        )
        assert model[1].g.dtype == torch.float32 and model[2].g.dtype == torch.bfloat16
    finally:
        from mixprec._core import norms

        norms._registered.pop(Scaler, None)
        norms._registered.pop(ScaleNorm, None)
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_norm(int)


# --------------------------------------------------------------------------- buffers


class _Scaled(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), scale))
        self.register_buffer("shift", torch.full((4,), 0.5))

    def forward(self, x):
        return self.lin(x) / self.scale + self.shift


def test_buffers_that_overflow_16bit_stay_fp32_with_a_warning():
    model = _Scaled(1e5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match=r"_Scaled.scale holds values outside torch.float16"):
        model, opt = mixprec.initialize(model, opt, "O2", torch.float16)
    assert model.scale.dtype == torch.float32 and model.shift.dtype == torch.float16
    x = torch.randn(3, 4)
    loss = model(x).float().pow(2).mean()
    assert torch.isfinite(loss)
    opt.backward(loss)
    opt.step()
    assert not opt.step_skipped


# --------------------------------------------------------------------------- loading weights


@pytest.mark.parametrize(
    ("level", "update"), [("O1", None), ("O2", None), ("O3", None), ("O3", "kahan")]
)
def test_load_state_dict_after_initialize_is_not_undone_by_the_next_step(level, update):
    torch.manual_seed(0)
    pretrained = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: a step must not move anything
    recipe = mixprec.Recipe(level, torch.bfloat16)
    if level == "O3":  # O3: None explicitly (bf16 default: kahan)
        recipe = recipe.replace(update=update)
    model, opt = mixprec.initialize(model, opt, recipe)
    model.load_state_dict(pretrained.state_dict())  # build, initialize, load pretrained
    opt.backward(model(torch.randn(4, 8)).float().sum())
    opt.step()
    state = mixprec.fp32_state_dict(model, opt)
    for key, ref in pretrained.state_dict().items():
        if level in ("O1", "O2") or "1." in key:  # fp32 params and masters: exact
            assert torch.equal(state[key], ref), key
        elif update == "kahan":  # weight + compensation: the rounding residual is kept
            assert ((state[key] - ref).abs() <= ref.abs() * 2**-15).all(), key
        else:  # O3 stores 16-bit weights: the loaded values, rounded once
            assert torch.equal(state[key], ref.to(torch.bfloat16).float()), key


def test_loading_a_submodule_or_writing_a_weight_in_place_reaches_the_masters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # a step that must not move anything
    model, opt = mixprec.initialize(model, opt, "O2", torch.bfloat16)
    fresh = nn.Linear(8, 2)
    model[1].load_state_dict(fresh.state_dict())  # a submodule on its own
    with torch.no_grad():
        model[0].weight.fill_(0.25)  # an in-place write
    opt.backward(model(torch.randn(4, 8)).float().sum())
    opt.step()
    state = mixprec.fp32_state_dict(model, opt)
    assert torch.equal(state["1.weight"], fresh.weight.detach())  # exact: fp32 load
    assert torch.equal(state["0.weight"], torch.full((8, 8), 0.25))


def test_o3_kahan_resume_optimizer_first_is_bit_exact():
    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        return mixprec.initialize(m, o, mixprec.Recipe("O3", torch.bfloat16, update="kahan"))

    g = torch.Generator().manual_seed(4)
    data = [torch.randn(4, 8, generator=g) for _ in range(6)]

    def train(m, o, xs):
        for x in xs:
            o.backward(m(x).float().pow(2).mean())
            o.step()
            o.zero_grad()

    straight, s_opt = build()
    train(straight, s_opt, data)
    model, opt = build()
    train(model, opt, data[:3])
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    model, opt = build()
    opt.load_state_dict(ckpt["opt"])  # optimizer first, then the model
    model.load_state_dict(ckpt["model"])
    train(model, opt, data[3:])
    for a, b in zip(model.parameters(), straight.parameters()):
        assert torch.equal(a, b)


def _o2_pair(seed: int, steps: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = mixprec.initialize(model, opt, "O2", torch.bfloat16)
    for _ in range(steps):
        opt.backward(model(torch.randn(4, 8)).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    return model, opt


def test_fp32_state_dict_round_trips_into_an_o2_model():
    model, opt = _o2_pair(0, 3)
    saved = mixprec.fp32_state_dict(model, opt)
    other, other_opt = _o2_pair(5, 0)
    other.load_state_dict(saved)
    again = mixprec.fp32_state_dict(other, other_opt)
    assert all(torch.equal(again[k], v) for k, v in saved.items())  # exact, through masters


def test_resuming_optimizer_first_then_model_keeps_the_exact_masters():
    model, opt = _o2_pair(0, 3)
    ckpt = {"model": model.state_dict(), "opt": opt.state_dict()}
    truth = mixprec.fp32_state_dict(model, opt)
    other, other_opt = _o2_pair(5, 0)
    other_opt.load_state_dict(ckpt["opt"])
    other.load_state_dict(ckpt["model"])  # 16-bit copies of the masters: no new information
    again = mixprec.fp32_state_dict(other, other_opt)
    assert all(torch.equal(again[k], v) for k, v in truth.items())


# --------------------------------------------------------------------------- clipping


def test_torch_clip_grad_norm_on_model_parameters_clips_the_masters():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    x = torch.randn(8, 8)
    loss = ref(x).pow(2).mean()
    loss.backward()
    true_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    model, opt = mixprec.initialize(
        net, torch.optim.SGD(net.parameters(), lr=0.1), "O2", torch.bfloat16
    )
    opt.backward(model(x).float().pow(2).mean())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    torch.testing.assert_close(norm, true_norm, rtol=0.05, atol=0)  # all six, not the 2 fp32
    clipped = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(m.grad) for m in opt.master_params()])
    )
    torch.testing.assert_close(clipped, torch.tensor(0.1), rtol=1e-3, atol=0)


# --------------------------------------------------------------------------- frozen parameters


@pytest.mark.parametrize("keep", [False, True])
def test_frozen_parameters_at_o2(keep):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    model[0].requires_grad_(False)  # a frozen backbone
    exact = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model, opt = mixprec.initialize(
        model, opt, mixprec.Recipe("O2", torch.bfloat16, frozen_masters=keep)
    )
    assert model[0].weight.dtype == torch.bfloat16  # stored 16-bit either way
    state = mixprec.fp32_state_dict(model, opt)
    rounded = exact["0.weight"].to(torch.bfloat16).float()
    assert torch.equal(state["0.weight"], exact["0.weight"] if keep else rounded)
    if keep:  # loading new frozen weights refreshes the fp32 copy too
        new = {k: v + 1 for k, v in exact.items()}
        model.load_state_dict(new)
        assert torch.equal(mixprec.fp32_state_dict(model, opt)["0.weight"], new["0.weight"])


def test_clip_grad_value_on_model_parameters_reaches_the_masters():
    model, opt = _o2_pair(0, 0)
    opt.backward(model(torch.randn(4, 8) * 100).float().pow(2).mean())
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
    assert all(m.grad.abs().max() <= 1e-3 for m in opt.master_params())


def test_a_buffer_that_would_flush_to_zero_stays_fp32():
    model = _Scaled(1e-9)  # 1e-9 is below fp16's smallest subnormal
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="flush to 0"):
        model, opt = mixprec.initialize(model, opt, "O2", torch.float16)
    assert model.scale.dtype == torch.float32


def test_a_model_with_frozen_fp32_copies_pickles_and_keeps_them(tmp_path):
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    exact = model[0].weight.detach().clone()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model, opt = mixprec.initialize(
        model, opt, mixprec.Recipe("O2", torch.bfloat16, frozen_masters=True)
    )
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copy_ = torch.load(buf, weights_only=False)
    assert torch.equal(mixprec.fp32_state_dict(copy_)["0.weight"], exact)
