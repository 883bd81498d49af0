"""mixprec.LossScaleOptimizer: Keras' loss-scale optimizer semantics, and the seed-002 loop."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
from torch import nn

import mixprec
from mixprec.compat.keras import LossScaleOptimizer

INF, NAN = float("inf"), float("nan")
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "keras_custom_loop.py"


def _vars() -> tuple[torch.Tensor, LossScaleOptimizer]:
    v = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    return v, LossScaleOptimizer(torch.optim.SGD([v], lr=0.5))


def test_finite_step_unscales_by_initial_scale():  # Keras 3 test_finite_step
    v, opt = _vars()
    grads = opt.get_unscaled_gradients([torch.tensor([1.0, 6.0, 7.0, 2.0]) * 2**15])
    assert opt.apply_gradients(zip(grads, [v])) is True
    torch.testing.assert_close(v.detach(), torch.tensor([0.5, -1.0, -0.5, 3.0]))
    assert opt.iterations == 1 and opt.loss_scale == 2**15 and opt.dynamic_counter == 1


@pytest.mark.parametrize("bad", [INF, NAN])
def test_non_finite_step_leaves_vars_and_state_unchanged(bad):
    v = torch.tensor([1.0, 2.0], requires_grad=True)
    opt = LossScaleOptimizer(torch.optim.Adam([v], lr=0.1))
    opt.get_scaled_loss(torch.tensor(1.0))
    assert (
        opt.apply_gradients(zip(opt.get_unscaled_gradients([torch.tensor([1.0, bad])]), [v]))
        is False
    )
    assert torch.equal(v.detach(), torch.tensor([1.0, 2.0])) and not opt.state
    assert opt.loss_scale == 2**14 and opt.iterations == 0 and opt.skipped_steps == 1


def test_downscaling_and_floor():  # Keras 3 test_downscaling; tf-keras floor of 1
    v = torch.zeros(2, requires_grad=True)
    opt = LossScaleOptimizer(torch.optim.SGD([v], lr=1.0), initial_scale=400)
    for _ in range(4):
        opt.apply_gradients([(torch.tensor([INF, 0.0]), v)])
    assert float(opt.get_scaled_loss(torch.tensor(1.0))) == 25
    for _ in range(10):
        opt.apply_gradients([(torch.tensor([NAN, 0.0]), v)])
    assert opt.loss_scale == 1.0


def test_upscaling_trajectory():  # Keras: (scale, counter) with initial 2 and 3 growth steps
    v = torch.zeros(1, requires_grad=True)
    opt = LossScaleOptimizer(torch.optim.SGD([v], lr=0.0), initial_scale=2, dynamic_growth_steps=3)
    seen = []
    for _ in range(7):
        opt.apply_gradients([(torch.ones(1), v)])
        seen.append((opt.loss_scale, opt.dynamic_counter))
    assert seen == [(2, 1), (2, 2), (4, 0), (4, 1), (4, 2), (8, 0), (8, 1)]
    opt2 = LossScaleOptimizer(torch.optim.SGD([v], lr=0.0), initial_scale=2, dynamic_growth_steps=2)
    for _ in range(8):
        opt2.apply_gradients([(torch.ones(1), v)])
    assert float(opt2.get_scaled_loss(torch.tensor(1.0))) == 32  # Keras 3 test_upscaling


def test_static_scale_never_changes_but_still_skips():
    v = torch.zeros(1, requires_grad=True)
    opt = LossScaleOptimizer(torch.optim.SGD([v], lr=1.0), dynamic=False, initial_scale=128)
    assert opt.apply_gradients([(torch.tensor([INF]), v)]) is False
    assert opt.apply_gradients([(torch.ones(1), v)]) is True
    assert opt.loss_scale == 128 and float(v.detach()) == -1.0


def test_fp16_loss_is_scaled_in_fp32():  # Keras 3: a 2.0 fp16 loss -> fp32 65536.0
    _, opt = _vars()
    out = opt.get_scaled_loss(torch.tensor(2.0, dtype=torch.float16))
    assert out.dtype == torch.float32 and float(out) == 65536.0
    assert opt.get_scaled_loss(lambda: torch.tensor(1.0)).item() == 2**15
    g = opt.get_unscaled_gradients([torch.tensor([2.0**15], dtype=torch.float16), None])
    assert g[1] is None and g[0].dtype == torch.float32 and float(g[0]) == 1.0


def test_constructor_errors():
    v = torch.zeros(1, requires_grad=True)
    sgd = torch.optim.SGD([v], lr=1.0)
    with pytest.raises(TypeError, match="must be a bool"):
        LossScaleOptimizer(sgd, "dynamic")
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        LossScaleOptimizer(object())
    lso = LossScaleOptimizer(sgd)
    with pytest.raises(TypeError, match="cannot wrap another"):
        LossScaleOptimizer(lso)
    with pytest.raises(ValueError, match="already wrapped"):
        LossScaleOptimizer(sgd)
    assert lso.get_config() == {
        "inner_optimizer": "SGD",
        "dynamic": True,
        "initial_scale": 2.0**15,
        "dynamic_growth_steps": 2000,
    }


def test_forgot_to_scale_warning():
    v = torch.zeros(1, requires_grad=True)
    opt = LossScaleOptimizer(torch.optim.SGD([v], lr=1.0))
    with pytest.warns(UserWarning, match="You forgot to call"):
        opt.apply_gradients([(torch.ones(1), v)])


def test_pytorch_style_step_matches_apply_gradients():
    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    results = []
    for style in ("apply", "step"):
        torch.manual_seed(1)
        model = nn.Linear(4, 2)
        opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), initial_scale=64)
        params = list(model.parameters())
        for _ in range(3):
            loss = ((model(x) - y) ** 2).mean()
            if style == "apply":
                grads = torch.autograd.grad(opt.get_scaled_loss(loss), params)
                opt.apply_gradients(zip(opt.get_unscaled_gradients(grads), params))
            else:
                opt.zero_grad()
                opt.get_scaled_loss(loss).backward()
                opt.step()
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_state_dict_round_trip():
    v = torch.zeros(2, requires_grad=True)
    opt = LossScaleOptimizer(torch.optim.Adam([v], lr=0.1), initial_scale=8, dynamic_growth_steps=2)
    for g in ([1.0, 1.0], [INF, 0.0], [1.0, 2.0]):
        opt.apply_gradients([(torch.tensor(g), v)])
    sd = opt.state_dict()
    w = torch.zeros(2, requires_grad=True)
    opt2 = LossScaleOptimizer(torch.optim.Adam([w], lr=0.1))
    opt2.load_state_dict(sd)
    assert (opt2.loss_scale, opt2.dynamic_counter, opt2.iterations) == (4.0, 1, 2)
    assert opt2.state_dict()["inner_optimizer"]["state"][0]["step"] == 2


def _load_example():
    spec = importlib.util.spec_from_file_location("keras_custom_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_seed_002_custom_loop_trains_in_float16():
    """The guide's loop, ported: fp16 hidden layers, fp32 softmax output, loss goes down."""
    ex = _load_example()
    data = ex.synthetic_digits(n_train=4096, n_test=1024)
    seen = {}
    model_ref = {}
    original = ex.build_model

    def build(features):
        model = original(features)

        def record(name):
            def hook(module, args, out):
                seen.setdefault(name, out.dtype)

            return hook

        model.dense_1.register_forward_hook(record("dense_1"))
        model.predictions.register_forward_hook(record("out"))
        model_ref["m"] = model
        return model

    ex.build_model = build
    hist = ex.run(epochs=3, batch_size=1024, data=data, verbose=False)
    assert seen == {"dense_1": torch.float16, "out": torch.float32}
    assert model_ref["m"].dense_1.weight.dtype == torch.float32  # float32 variables
    assert all(torch.isfinite(torch.tensor(hist["loss"])))
    assert hist["loss"][-1] < hist["loss"][0] * 0.9
    assert hist["test_accuracy"][-1] > 0.5  # chance is 0.1
    assert mixprec.global_policy() == mixprec.Policy("float32")  # the example restores it
