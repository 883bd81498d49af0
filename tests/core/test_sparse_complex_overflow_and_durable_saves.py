"""Real training habits mixprec was not written against (second part): tune by a user metric,
plain DDP after initialize, fp16 O3 with eps-based optimizers, sparse and complex gradients
under overflow.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec._core.loss_scale import unscale_and_check_

BF16, FP16 = torch.bfloat16, torch.float16
pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")


# -- tune with a user metric -----------------------------------------------------------------------
def _accuracy_calls():
    calls = []

    def accuracy(logits, y):
        calls.append(torch.is_grad_enabled())
        return (logits.argmax(-1) == y).float().mean()

    return accuracy, calls


def test_tune_by_a_user_metric_keeps_the_planted_layer():
    from tests.numerics.test_tune import Net, _data

    accuracy, calls = _accuracy_calls()
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = mixprec.numerics.tune(model, _data(), metric=accuracy, recipe=FP16, tolerance=0.01)
    assert plan.fp32_modules == ["amp"] and plan.passed
    assert plan.before.metric_drop > 0.05  # all-fp16: non-finite logits, accuracy falls
    assert plan.after.metric == plan.after.metric_ref  # tuned: the fp32 accuracy
    assert calls and not any(calls)  # the metric always ran under no_grad
    assert all(p.grad is None for p in model.parameters())  # no backward in metric mode
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert "metric" in plan.explain() and plan.as_dict()["after"]["loss"] is None
    # bf16 keeps the fp32 accuracy with everything in 16-bit: an empty plan
    assert (
        mixprec.numerics.tune(Net(), _data(), metric=accuracy, recipe=BF16, tolerance=0.01).policies
        == {}
    )


def test_tune_explains_how_to_pass_an_accuracy_metric():
    # before: an accuracy passed as loss_fn died in backward with
    # "element 0 of tensors does not require grad"
    from tests.numerics.test_tune import Net, _data

    accuracy, _ = _accuracy_calls()
    with pytest.raises(ValueError, match="does not require grad.*pass it as metric=fn"):
        mixprec.numerics.tune(Net(), _data(), accuracy, FP16)
    with pytest.raises(ValueError, match="one of them; received both"):
        mixprec.numerics.tune(Net(), _data(), nn.functional.cross_entropy, FP16, metric=accuracy)
    with pytest.raises(ValueError, match="one of them; received neither"):
        mixprec.numerics.tune(Net(), _data(), recipe=FP16)
    with pytest.raises(TypeError, match="metric must return a number"):
        mixprec.numerics.tune(Net(), _data(), metric=lambda out, y: "high", recipe=FP16)


# -- plain DDP detection (the 2-rank runs are in tests/distributed/test_distributed.py) ----------
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
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", BF16)
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
    assert opt.updater is not None and opt.updater.update == "kahan"
    losses = _train_losses(model, opt)
    assert opt.skipped_steps == 0
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert losses[-1] < 0.9 * losses[0]


def test_fp16_o3_explicit_update_none_still_warns_for_rmsprop():
    model = _mlp()
    with pytest.warns(RuntimeWarning, match="eps=1e-08, which rounds to 0 in torch.float16"):
        _, opt = mixprec.initialize(
            model, torch.optim.RMSprop(model.parameters()), mixprec.Recipe("O3", FP16, update=None)
        )
    assert opt.updater is None


# -- sparse and complex gradients under overflow ------------------------------------------------
# (their training at every level: test_parameter_kinds_and_weight_loading.py)
def _init(model, opt, level, dtype):
    return mixprec.initialize(model, opt, level, dtype)


class Bag(nn.Module):
    """Embedding with sparse gradients (SparseAdam's use case) and a target per row."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4, sparse=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx)


def _sparse_run(level, dtype, steps=12, overflow_at=None):
    torch.manual_seed(0)
    model = Bag()
    opt = torch.optim.SparseAdam(model.parameters(), lr=0.05)
    model, opt = _init(model, opt, level, dtype)
    idx, target = torch.tensor([1, 3, 3, 7]), torch.ones(4, 4)
    losses, skipped = [], []
    for i in range(steps):
        loss = (model(idx).float() - target).pow(2).mean()
        if i == overflow_at:
            loss = loss * float("inf")
            before = (
                [p.detach().clone() for p in opt.master_params()],
                {
                    k: {n: torch.as_tensor(v).clone() for n, v in st.items()}
                    for k, st in opt.state.items()
                },
            )
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        skipped.append(opt.step_skipped)
        if i == overflow_at:
            masters, state = before
            for a, b in zip(opt.master_params(), masters):
                assert torch.equal(a.detach(), b)
            for k, st in opt.state.items():
                for n, v in st.items():
                    assert torch.equal(torch.as_tensor(v), state[k][n])
    return model, opt, losses, skipped


@pytest.mark.parametrize(("level", "dtype"), [("O0", None), ("O2", FP16)])
def test_sparse_overflow_still_skips_and_leaves_weights_and_state(level, dtype):
    _, opt, losses, skipped = _sparse_run(level, dtype, steps=6, overflow_at=3)
    assert skipped == [False, False, False, True, False, False]
    assert opt.skipped_steps == 1
    assert losses[5] < losses[0]


def test_unscale_and_check_scales_sparse_values_and_flags_nonfinite_ones():
    i = torch.tensor([[0, 2]])
    g = torch.sparse_coo_tensor(i, torch.tensor([4.0, 8.0]), (3,), check_invariants=True)
    found = torch.zeros(1)
    unscale_and_check_([g], 0.25, found)
    assert found.item() == 0 and g.to_dense().tolist() == [1.0, 0.0, 2.0]
    bad = torch.sparse_coo_tensor(i, torch.tensor([1.0, float("nan")]), (3,), check_invariants=True)
    unscale_and_check_([bad], 1.0, found)
    assert found.item() == 1
    with pytest.raises(TypeError, match=r"tensors\[0\] must be a floating .*received torch.int64"):
        unscale_and_check_([torch.ones(2, dtype=torch.int64)], 1.0, torch.zeros(1))


class Phase(nn.Module):
    """A real layer followed by a complex (phase/amplitude) parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x).float().to(torch.complex64) * self.w).abs()


@pytest.mark.parametrize(("level", "dtype"), [("O2", FP16), ("O3", BF16), ("O0", None)])
def test_complex_parameters_train_skip_an_overflow_and_stay_complex64(level, dtype):
    torch.manual_seed(0)
    model = Phase()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    model, opt = _init(model, opt, level, dtype)
    x = torch.randn(8, 4)
    losses = []
    for i in range(10):
        loss = (model(x).float() - 1).pow(2).mean()
        if i == 4:  # an overflow: the complex parameter must not move either
            w = model.w.detach().clone()
            opt.backward(loss * float("inf"))
            opt.step()
            assert opt.step_skipped and torch.equal(model.w.detach(), w)
            opt.zero_grad()
            continue
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert model.w.dtype == torch.complex64
    assert opt.skipped_steps == 1
    assert losses[-1] < 0.6 * losses[0]


def test_complex_gradient_checked_on_both_parts():
    g = torch.tensor([1 + 2j, complex(3, float("inf"))], dtype=torch.complex64)
    found = torch.zeros(1)
    unscale_and_check_([g[:1]], 0.5, found)
    assert found.item() == 0 and g[0].item() == complex(0.5, 1.0)
    unscale_and_check_([g], 1.0, found)
    assert found.item() == 1


# -- durable checkpoints ---------------------------------------------------------------------------
def _ckpt_pair():
    model = _mlp()
    return mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", BF16)


def test_save_checkpoint_fsyncs_the_file_before_the_rename_and_the_directory_after(
    tmp_path, monkeypatch
):
    import os
    import stat

    from mixprec import distributed as mpd

    model, opt = _ckpt_pair()
    path = tmp_path / "ckpt.pt"
    (tmp_path / "ckpt.pt.tmp").write_bytes(b"left by a save that was killed")
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        size = os.fstat(fd).st_size
        events.append(("fsync", kind, size))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(src), os.path.basename(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    mpd.save_checkpoint(path, model, opt)
    assert [e[:2] for e in events] == [
        ("fsync", "file"),
        ("replace", "ckpt.pt.tmp"),
        ("fsync", "dir"),
    ]
    assert events[0][2] == path.stat().st_size  # the whole new file was on disk before the rename
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # the stale .tmp is gone


def test_a_failed_save_keeps_the_old_checkpoint_and_leaves_no_tmp(tmp_path, monkeypatch):
    from mixprec import distributed as mpd

    model, opt = _ckpt_pair()
    path = tmp_path / "ckpt.pt"
    mpd.save_checkpoint(path, model, opt)
    old = path.read_bytes()

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        mpd.save_checkpoint(path, model, opt)
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


# -- bad input -------------------------------------------------------------------------------------
def test_a_model_partly_on_the_meta_device_is_refused_naming_the_tensor():
    # before: only the first parameter's device was checked; a meta submodule got through
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    with pytest.raises(
        ValueError,
        match=r"'meta' device \('1.weight' is a meta tensor\).*"
        r"to_empty",
    ):
        mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", BF16)
    assert model[0].weight.dtype == torch.float32  # refused before anything was cast


def test_an_initialized_model_still_pickles_whole(tmp_path):
    # before: the load_state_dict refresh hooks held weakrefs, so torch.save(model) raised
    # "cannot pickle 'weakref.ReferenceType' object"
    model, opt = _ckpt_pair()
    _train_losses(model, opt, steps=2)
    torch.save(model, tmp_path / "model.pt")
    copy = torch.load(tmp_path / "model.pt", weights_only=False)
    for a, b in zip(copy.parameters(), model.parameters()):
        assert torch.equal(a, b) and a.dtype == b.dtype
    masters = [m.detach().clone() for m in opt.master_params()]
    copy.load_state_dict({k: torch.zeros_like(v) for k, v in copy.state_dict().items()})
    for m, before in zip(opt.master_params(), masters):  # the copy's hooks reach no optimizer
        assert torch.equal(m.detach(), before)
