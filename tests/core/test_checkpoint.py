"""Checkpoints: bitwise resume at every level (with the loss-scaler state), fp32_state_dict, and
MixedPrecisionOptimizer.load_state_dict validation."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from training_helpers import assert_bitwise, assert_tree_bitwise, make_model, mse, poisoned

import mixprec
from mixprec import fp32_state_dict, initialize

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


_g = torch.Generator().manual_seed(123)
DATA = [(torch.randn(8, 8, generator=_g), torch.randn(8, 4, generator=_g)) for _ in range(12)]
POISON_AT = {1, 6}  # steps whose gradient gets an inf (one before and one after the checkpoint)
K = 5  # checkpoint after this many steps


def build(level: str, dtype):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)  # eps: see test_optimizer
    scaling = mixprec.LossScaling(init_scale=2.0**4, growth_interval=2)
    return initialize(model, opt, mixprec.Recipe(level, dtype, loss_scale=scaling))


def train(model, opt, steps) -> list[bool]:
    skipped = []
    for t in steps:
        x, y = DATA[t]
        with poisoned(model[0].weight if t in POISON_AT else None):
            opt.backward(mse(model, x, y))
        opt.step()
        opt.zero_grad()
        skipped.append(opt.step_skipped)
    return skipped


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
@pytest.mark.parametrize(
    ("level", "dtype"),
    [
        ("O0", None),
        ("O1", FP16),
        ("O2", FP16),
        ("O3", FP16),
        ("O1", BF16),
        ("O2", BF16),
        ("O3", BF16),
    ],
)
def test_resume_is_bitwise_identical(level, dtype, how):
    n = len(DATA)
    straight_model, straight_opt = build(level, dtype)
    straight_skips = train(straight_model, straight_opt, range(n))
    assert straight_skips == [t in POISON_AT for t in range(n)]

    model, opt = build(level, dtype)
    train(model, opt, range(K))
    # the scaler moved before the checkpoint: 16 -> 8 (overflow at step 1) -> 16 (2 clean), and
    # is mid-way to the next growth (growth_tracker 1): resuming must keep that too
    assert opt.loss_scale == 16.0 and opt.slots[0].scaler.steps == K
    assert opt.slots[0].scaler.growth_tracker == 1 and opt.skipped_steps == 1
    ckpt = {"model": model.state_dict(), "opt": opt.state_dict()}
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)
    else:
        ckpt = copy.deepcopy(ckpt)
    del model, opt

    model, opt = build(level, dtype)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    assert opt.loss_scale == 16.0 and opt.skipped_steps == 1
    skips = train(model, opt, range(K, n))
    assert skips == straight_skips[K:]

    for (name, a), b in zip(model.named_parameters(), straight_model.parameters()):
        assert_bitwise(a.detach(), b.detach()), name
    for (_, a), (_, b) in zip(opt._pairs, straight_opt._pairs):
        assert_bitwise(a, b)
    assert_tree_bitwise(opt.state_dict(), straight_opt.state_dict())
    assert opt.slots[0].scaler.state_dict() == straight_opt.slots[0].scaler.state_dict()
    x, _ = DATA[0]
    with torch.no_grad():
        assert_bitwise(model(x), straight_model(x))


def test_load_order_does_not_matter_at_o2():
    model, opt = build("O2", FP16)
    train(model, opt, range(K))
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    a_model, a_opt = build("O2", FP16)
    a_model.load_state_dict(ckpt["model"])
    a_opt.load_state_dict(ckpt["opt"])
    b_model, b_opt = build("O2", FP16)
    b_opt.load_state_dict(ckpt["opt"])
    b_model.load_state_dict(ckpt["model"])
    for p, q, r in zip(a_model.parameters(), b_model.parameters(), model.parameters()):
        assert_bitwise(p.detach(), r.detach())
        assert_bitwise(q.detach(), r.detach())


def test_load_state_dict_rejects_mismatched_checkpoints():
    model, opt = build("O2", FP16)
    train(model, opt, range(2))
    sd = copy.deepcopy(opt.state_dict())
    _, o3 = build("O3", FP16)
    other = copy.deepcopy(sd)  # another level's masters are carried; these fit no weight here
    other["param_groups"][0]["mixprec"]["masters"][0] = torch.zeros(3, 5)
    with pytest.raises(
        ValueError,
        match="The checkpoint has 4 master weights, this optimizer has "
        "0: was it saved at another level or model",
    ):
        o3.load_state_dict(other)
    _, plain = build("O2", FP16)
    with pytest.raises(KeyError, match=r"Not an optimizer state dict.*received keys \['model'\]"):
        plain.load_state_dict({"model": sd})
    model2 = make_model()
    _, two = initialize(
        model2,
        torch.optim.AdamW(model2.parameters(), eps=1e-4),
        mixprec.Recipe("O2", FP16, num_losses=2),
    )
    with pytest.raises(
        ValueError,
        match=r"The checkpoint has 1 loss scalers, this optimizer has "
        r"2 \(num_losses\)",
    ):
        two.load_state_dict(sd)


# ------------------------------------------------------------------ 5. fp32_state_dict


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_fp32_state_dict_at_o2(dtype):
    model, opt = build("O2", dtype)
    train(model, opt, range(5))
    sd = fp32_state_dict(model, opt)
    assert list(sd) == list(model.state_dict())
    assert all(t.dtype == FP32 for t in sd.values())
    masters = {id(p): m for p, m in opt._pairs}
    n_from_masters = 0
    for name, p in model.named_parameters():
        if id(p) in masters:
            assert_bitwise(sd[name], masters[id(p)].detach())
            n_from_masters += 1
            # the master is more precise than the 16-bit copy, and rounds to it
            assert_bitwise(sd[name].to(dtype), p.detach())
        else:  # LayerNorm params are fp32 already
            assert p.dtype == FP32
            assert_bitwise(sd[name], p.detach())
        assert sd[name].data_ptr() != p.data_ptr()  # copies, not views
    assert n_from_masters == 4

    plain = make_model(5)
    plain.load_state_dict(sd, strict=True)
    x, _ = DATA[0]
    with torch.no_grad():
        ref = plain(x)
        out = model(x)
    assert out.dtype == FP32 and ref.dtype == FP32
    # same weights (up to 16-bit rounding), plain fp32 compute vs 16-bit compute
    tol = 5e-2 if dtype == BF16 else 1e-2
    torch.testing.assert_close(ref, out, rtol=tol, atol=tol)


def test_fp32_state_dict_without_optimizer_and_with_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    model, _ = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O3", BF16)
    sd = fp32_state_dict(model)
    assert list(sd) == list(model.state_dict())
    assert sd["1.num_batches_tracked"].dtype == torch.int64
    for k, v in sd.items():
        if k != "1.num_batches_tracked":
            assert v.dtype == FP32, k
            assert_bitwise(v.to(BF16), model.state_dict()[k])
    torch.manual_seed(1)
    plain = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    plain.load_state_dict(sd, strict=True)


def test_save_checkpoint_is_durable_and_replaces_a_stale_temporary_file(tmp_path, monkeypatch):
    import os

    from mixprec import distributed as mpd

    model, opt = build("O2", BF16)
    train(model, opt, range(2))
    path = tmp_path / "ckpt.pt"
    (tmp_path / "ckpt.pt.tmp").write_bytes(b"left by a save that was killed")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    mpd.save_checkpoint(path, model, opt)
    assert len(synced) == 2  # the file before the rename, the directory after it
    assert not (tmp_path / "ckpt.pt.tmp").exists()
    fresh, fresh_opt = build("O2", BF16)
    mpd.load_checkpoint(path, fresh, fresh_opt)
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert_bitwise(a.detach(), b.detach())


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_the_optimizer_pickles_whole_after_training_or_says_why_not(level):
    """``pickle`` of (model, optimizer) after steps (a skipped one included): the copy trains on
    bit for bit as the original. O3's update mode keys its state by parameter identity, which
    pickling does not keep: refused with what to do instead, and that (deepcopy) works."""
    import pickle

    model, opt = build(level, BF16)
    train(model, opt, range(K))
    if opt.updater is not None:
        with pytest.raises(TypeError, match=r"update='kahan'.*copy\.deepcopy\(\(model, optim"):
            pickle.dumps((model, opt))
        other, other_opt = copy.deepcopy((model, opt))
    else:
        other, other_opt = pickle.loads(pickle.dumps((model, opt)))
    assert train(model, opt, range(K, 12)) == train(other, other_opt, range(K, 12))
    for p, q in zip(model.parameters(), other.parameters()):
        assert_bitwise(p.detach(), q.detach())
