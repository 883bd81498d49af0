"""Real training habits mixprec was not written against (second part): tune by a user metric,
plain DDP after initialize, fp16 O3 with eps-based optimizers, sparse and complex gradients
under overflow.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec

BF16, FP16 = torch.bfloat16, torch.float16
pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.MixprecPerformanceWarning")


# -- tune with a user metric -----------------------------------------------------------------------
def _accuracy_calls():
    calls = []

    def accuracy(logits, y):
        calls.append(torch.is_grad_enabled())
        return (logits.argmax(-1) == y).float().mean()

    return accuracy, calls


def test_tune_by_a_user_metric_keeps_the_planted_layer():
    from tests.test_tune import Net, _data

    accuracy, calls = _accuracy_calls()
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = mixprec.tune(model, _data(), metric=accuracy, dtype=FP16, tolerance=0.01)
    assert plan.fp32_modules == ["amp"] and plan.passed
    assert plan.before.metric_drop > 0.05  # all-fp16: non-finite logits, accuracy falls
    assert plan.after.metric == plan.after.metric_ref  # tuned: the fp32 accuracy
    assert calls and not any(calls)  # the metric always ran under no_grad
    assert all(p.grad is None for p in model.parameters())  # no backward in metric mode
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert "metric" in plan.explain() and plan.as_dict()["after"]["loss"] is None
    # bf16 keeps the fp32 accuracy with everything in 16-bit: an empty plan
    assert mixprec.tune(Net(), _data(), metric=accuracy, dtype=BF16, tolerance=0.01).policies == {}


def test_tune_explains_how_to_pass_an_accuracy_metric():
    # before: an accuracy passed as loss_fn died in backward with
    # "element 0 of tensors does not require grad"
    from tests.test_tune import Net, _data

    accuracy, _ = _accuracy_calls()
    with pytest.raises(ValueError, match="does not require grad.*pass it as metric=fn"):
        mixprec.tune(Net(), _data(), accuracy, FP16)
    with pytest.raises(ValueError, match="one of them; received both"):
        mixprec.tune(Net(), _data(), nn.functional.cross_entropy, FP16, metric=accuracy)
    with pytest.raises(ValueError, match="one of them; received neither"):
        mixprec.tune(Net(), _data(), dtype=FP16)
    with pytest.raises(TypeError, match="metric must return a number"):
        mixprec.tune(Net(), _data(), metric=lambda out, y: "high", dtype=FP16)


# -- plain DDP detection (the 2-rank runs are in tests/test_distributed.py) ------------------------
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _train_losses(model, opt, steps=15):
    torch.manual_seed(1)
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    losses = []
    for _ in range(steps):
        loss = (model(x).float() - y).pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_ddp_watch_hook_is_inert_without_ddp_and_copies_do_not_report():
    import copy
    import io

    model = _mlp()
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2",
                                    BF16)
    losses = _train_losses(model, opt, steps=3)
    assert opt.reduce_flags is None and opt._plain_ddp is None  # no DDP ran: nothing adopted
    assert losses[-1] < losses[0]
    hook = next(h for h in model._forward_pre_hooks.values() if type(h).__name__ == "_DDPWatch")
    assert [r() for r in hook.refs] == [opt]
    torch.save(hook, io.BytesIO())  # a class, not a closure: it pickles (without its refs)
    clone = copy.deepcopy(hook)
    assert clone.refs == []  # a copied model has other parameters: it reports to no one


# -- fp16 O3 with optimizers whose eps vanishes in fp16 --------------------------------------------
@pytest.mark.parametrize("optim", [torch.optim.RMSprop, torch.optim.AdamW, torch.optim.NAdam])
def test_fp16_o3_default_update_is_fp32_math_when_eps_vanishes(optim):
    # before (RMSprop, no betas): 16-bit arithmetic, NaN weights, 14 of 15 steps skipped
    model = _mlp()
    model, opt = mixprec.initialize(model, optim(model.parameters(), lr=1e-3), "O3", FP16)
    assert opt.lean is not None and opt.lean.update == "kahan"
    losses = _train_losses(model, opt)
    assert opt.skipped_steps == 0
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert losses[-1] < 0.9 * losses[0]


def test_fp16_o3_explicit_update_none_still_warns_for_rmsprop():
    model = _mlp()
    with pytest.warns(RuntimeWarning, match="eps=1e-08, which rounds to 0 in torch.float16"):
        _, opt = mixprec.initialize(model, torch.optim.RMSprop(model.parameters()), "O3", FP16,
                                    update=None)
    assert opt.lean is None
