"""The first-inf/NaN locator: planted faults in forward and backward, steps, the optimizer."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec
from tests.training_helpers import INF, assert_tree_bitwise, make_model, mse, poisoned

warnings.filterwarnings("ignore", category=Warning, module="mixprec._core.hardware")


class Blowup(nn.Module):
    """A Linear whose output overflows float16 once ``armed`` (a planted forward inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        nn.init.constant_(self.lin.weight, 0.5)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # |x| <= 3 after the clamp, so x * 2e4 still fits fp16 (max 65504) but the matmul,
        # summing 16 positive products of size ~1e4, does not
        x = x.clamp(0, 3)
        return self.lin(x * 2e4 if self.armed else x)


class _ZeroOverZero(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 0 / 0  # the planted backward NaN: 0/0


class Trap(nn.Module):
    """Identity forward; once ``armed`` its backward produces NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ZeroOverZero.apply(x) if self.armed else x


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Sequential(Blowup(), nn.Tanh()), Trap(), nn.Linear(16, 4)
    )


def _train(model, steps, arm_at, which, dtype=None, raise_on=None):
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with mixprec.numerics.locate_nonfinite(model, raise_on=raise_on) as loc:
        for step in range(steps):
            which.armed = step == arm_at
            with mixprec.autocast(dtype or torch.float32, enabled=dtype is not None):
                loss = mse(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return loc


def test_planted_forward_inf_is_found_in_its_module_and_step():
    model = _net()
    loc = _train(model, 4, arm_at=2, which=model[2][0], dtype=torch.float16)
    assert len(loc.events) >= 1
    e = loc.first
    assert (e.step, e.phase, e.module, e.dtype, e.kind) == (
        2,
        "forward",
        "2.0.lin",
        "float16",
        "inf",
    )
    assert e.op.startswith("aten.addmm")
    assert e.severity == "error" and "float32" in e.reason
    # the op's inputs were finite and large: the stats show it
    assert all(s.num_inf == 0 and s.num_nan == 0 for s in e.inputs)
    assert max(s.absmax for s in e.inputs) > 1e3
    assert "2.0.lin" in loc.report() and "step 2" in loc.report()


def test_planted_backward_nan_is_found_in_its_module_and_step():
    model = _net()
    loc = _train(model, 4, arm_at=1, which=model[3])
    e = loc.first
    assert (e.step, e.phase, e.module, e.kind, e.dtype) == (1, "backward", "3", "nan", "float32")
    assert e.op.startswith("aten.div") and "ZeroOverZeroBackward" in e.node
    assert e.severity == "error" and "numerical bug" in e.reason
    assert [ev.step for ev in loc.events] == [1]  # later steps are clean again


def test_raise_on_error_raises_at_the_op_with_the_event():
    model = _net()
    with pytest.raises(mixprec.numerics.NonFiniteError) as info:
        _train(model, 4, arm_at=2, which=model[2][0], dtype=torch.float16, raise_on="error")
    assert info.value.event.module == "2.0.lin" and info.value.event.step == 2
    assert any("forward" in line for line in info.value.event.stack)


def test_parameter_gradient_poison_is_attributed_to_its_owner():
    model = make_model()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    with mixprec.numerics.locate_nonfinite(model) as loc, poisoned(model[3].weight, INF):
        mse(model, x, y).backward()
    e = loc.first
    assert (e.phase, e.module, e.kind) == ("backward", "3", "inf")
    assert "3.weight" in e.node


def test_overflow_skipped_by_the_scaler_is_expected_and_steps_match_the_optimizer():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = mixprec.initialize(
        model,
        opt,
        mixprec.Recipe(
            "O2", torch.float16, loss_scale=mixprec.LossScaling(init_scale=2.0**24, hysteresis=1)
        ),
    )
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    with mixprec.numerics.locate_nonfinite(model, opt, raise_on="error") as loc:
        for _ in range(12):
            opt.backward(mse(model, x, y))
            opt.step()
            opt.zero_grad()
    assert opt.skipped_steps >= 1
    assert len(loc.events) == opt.skipped_steps
    assert [e.step for e in loc.events] == list(range(opt.skipped_steps))
    for e in loc.events:
        assert (e.severity, e.phase, e.kind, e.dtype) == ("expected", "backward", "inf", "float16")
        assert e.step_skipped is True and e.loss_scale > 65504


def test_nonfinite_input_data_is_reported_as_input():
    model = make_model()
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    with mixprec.numerics.locate_nonfinite(model) as loc:
        model(x)
    assert loc.first.op == "<model input>" and loc.first.kind == "nan"


def test_causal_attention_masks_are_not_reported():
    from mixprec.bench.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32))
    idx = torch.randint(0, 32, (2, 16))
    with mixprec.numerics.locate_nonfinite(model, raise_on="any") as loc:
        with mixprec.autocast(torch.bfloat16):
            out = model(idx)
        out.float().sum().backward()
    assert loc.events == []


def test_the_locator_does_not_change_numerics():
    def run(watch: bool):
        model = make_model()
        x, y = torch.randn(8, 8), torch.randn(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loc = mixprec.numerics.locate_nonfinite(model) if watch else None
        if loc:
            loc.__enter__()
        for _ in range(3):
            with mixprec.autocast(torch.bfloat16):
                loss = mse(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        if loc:
            loc.__exit__(None, None, None)
        return model.state_dict()

    assert_tree_bitwise(dict(run(False)), dict(run(True)))


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="raise_on"):
        mixprec.numerics.locate_nonfinite(make_model(), raise_on="always")
    with pytest.raises(TypeError, match="nn.Module"):
        mixprec.numerics.locate_nonfinite("model")


def test_uninitialized_buffers_are_not_reported():
    """``torch.empty`` may hold garbage NaNs (the optimizer's grad buffers do): its output is
    not judged, while an op that writes NaN into such a buffer still is."""
    from mixprec.numerics.nonfinite_ops import _op_info

    for op in (
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
    ):
        assert _op_info(op)[0], op
    assert not _op_info(torch.ops.aten.fill_.Scalar)[0]
    assert not _op_info(torch.ops.aten.zeros.default)[0]
