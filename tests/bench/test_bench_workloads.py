"""Tests for the benchmark corpus and workloads (quick data only; no timing assertions)."""

from __future__ import annotations

import hashlib
import itertools
import math

import pytest
import torch

from mixprec.bench import corpus
from mixprec.bench.corpus import FILES, VOCAB, build_corpus, decode, encode
from mixprec.bench.workloads import MNIST1DCNN, WORKLOADS, cross_entropy

SMALL = 50_000


# ----------------------------------------------------------------------------------- corpus


def test_vocab_is_fixed_96_symbols():
    assert len(VOCAB) == 96 and len(set(VOCAB)) == 96
    assert VOCAB[0] == "\n" and VOCAB[1:] == "".join(chr(c) for c in range(32, 127))


def test_file_list_is_sorted_and_unique():
    assert list(FILES) == sorted(FILES) and len(set(FILES)) == len(FILES)
    assert 35 <= len(FILES) <= 45


def test_encode_decode_round_trip():
    text = "def f(x):\n    return {'a': [1, 2.5e-3]} ~ `@#$%^&*|\\\"<>?/\n"
    ids = encode(text)
    assert ids.dtype == torch.int64 and ids.shape == (len(text),)
    assert int(ids.min()) >= 0 and int(ids.max()) < 96
    assert decode(ids) == text
    assert decode(ids.tolist()) == text
    assert decode(encode("")) == ""


def test_tabs_expand_and_unknown_chars_become_question_marks():
    assert decode(encode("\tx\t")) == "    x    "
    assert decode(encode("é€\x0c\r🙂a")) == "?????a"


def test_build_is_deterministic_and_fingerprinted():
    a = build_corpus(SMALL)
    b = build_corpus.__wrapped__(SMALL)  # bypass the cache: really rebuild
    assert a is build_corpus(SMALL)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.sha256 == b.sha256 and a.files == b.files
    ids = torch.cat([a.train, a.val])
    assert a.sha256 == hashlib.sha256(ids.to(torch.uint8).numpy().tobytes()).hexdigest()
    assert a.train.dtype == torch.int64 and a.val.dtype == torch.int64


def test_files_are_an_ordered_subset_of_the_list():
    c = build_corpus(SMALL)
    assert c.files and set(c.files) <= set(FILES)
    assert list(c.files) == [f for f in FILES if f in c.files]
    assert len(c.files) == len(FILES)  # all present on the test interpreter (3.10-3.13)


def test_split_is_90_10_and_max_chars_truncates():
    c = build_corpus(SMALL)
    assert len(c.train) + len(c.val) == len(c) == SMALL
    assert len(c.val) == SMALL // 10 and len(c.train) == SMALL - SMALL // 10
    tiny = build_corpus(1000)
    assert len(tiny) == 1000 and len(tiny.val) == 100
    assert torch.equal(torch.cat([tiny.train, tiny.val]), c.train[:1000])
    assert tiny.sha256 != c.sha256
    assert decode(c.train[:10_000]).startswith(
        (corpus.stdlib_dir() / FILES[0]).read_text()[:1000].replace("\t", "    ")
    )


def test_bad_max_chars():
    with pytest.raises(ValueError):
        build_corpus(0)


# -------------------------------------------------------------------------------- workloads


def test_registry_has_exactly_four_consistent_workloads():
    assert set(WORKLOADS) == {"seed-mlp", "mnist1d-cnn", "char-gpt", "char-gpt-small"}
    for name, w in WORKLOADS.items():
        assert w.name == name and w.description
        assert w.higher_is_better == (w.metric == "accuracy")
        assert w.metric in ("accuracy", "val_loss")
        assert 0 < w.quick_steps < w.steps and 0 < w.eval_every <= w.steps
    assert WORKLOADS["seed-mlp"].reached(0.7) and not WORKLOADS["seed-mlp"].reached(0.1)
    assert WORKLOADS["char-gpt"].reached(0.5) and not WORKLOADS["char-gpt"].reached(4.0)
    small = WORKLOADS["char-gpt-small"].make_model(None)
    assert sum(p.numel() for p in small.parameters()) < 10**6  # a long run that fits a CPU


def test_samples_per_batch():
    assert WORKLOADS["seed-mlp"].samples_per_batch(512) == 512
    assert WORKLOADS["mnist1d-cnn"].samples_per_batch(100) == 100
    assert WORKLOADS["char-gpt"].samples_per_batch(16) == 16 * 256


def _first(w, data, batch, seed, n=3):
    return list(itertools.islice(w.batches(data, batch, seed), n))


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_batches_are_deterministic_per_seed(name):
    w = WORKLOADS[name]
    data = w.prepare(True, 0)
    a, b, c = _first(w, data, 4, 0), _first(w, data, 4, 0), _first(w, data, 4, 1)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
    assert not torch.equal(a[0][0], a[1][0])  # successive batches differ


def test_mnist_batches_are_epochs_of_permutations():
    w = WORKLOADS["mnist1d-cnn"]
    data = w.prepare(True, 0)
    n = len(data["y"])
    ys = torch.cat([y for _, y in _first(w, data, 300, 7, n=7)])  # 2100 labels > 2 epochs
    assert torch.equal(
        torch.bincount(ys[:n], minlength=10), torch.bincount(data["y"], minlength=10)
    )
    assert torch.equal(
        torch.bincount(ys[n : 2 * n], minlength=10), torch.bincount(data["y"], minlength=10)
    )


@pytest.mark.parametrize("name", ["seed-mlp", "mnist1d-cnn"])
def test_mnist_workloads_shapes_loss_and_accuracy(name):
    w = WORKLOADS[name]
    data = w.prepare(True, 0)
    assert w.prepare(True, 3) is data  # cached, seed-independent
    x, y = next(w.batches(data, 5, 0))
    assert x.shape == (5, 40) and x.dtype == torch.float32
    assert y.shape == (5,) and y.dtype == torch.int64
    torch.manual_seed(0)
    model = w.make_model(data)
    out = model(x)
    assert out.shape == (5, 10) and out.dtype == torch.float32
    loss = w.loss(out, y)
    assert loss.dim() == 0 and loss.dtype == torch.float32 and math.isfinite(loss.item())
    acc = w.evaluate(model, data)
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0
    big_x, _ = w.example_batch(data, len(data["x"]) + 3)  # wraps around the train set
    assert big_x.shape == (len(data["x"]) + 3, 40) and torch.equal(big_x[-3:], data["x"][:3])
    assert isinstance(w.make_optimizer(model.parameters()), torch.optim.Optimizer)


def test_cnn_architecture():
    m = MNIST1DCNN()
    assert m.linear.in_features == 125
    assert sum(p.numel() for p in m.parameters()) == 5210
    assert m(torch.randn(3, 40)).shape == (3, 10)


def test_char_gpt_shapes_loss_and_untrained_val_loss():
    w = WORKLOADS["char-gpt"]
    data = w.prepare(True, 0)
    assert len(data) == 400_000
    x, y = next(w.batches(data, 2, 0))
    assert x.shape == y.shape == (2, 256) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one character
    ex, _ = w.example_batch(data, 3)
    assert ex.shape == (3, 256) and torch.equal(ex[0], data.train[:256])
    torch.manual_seed(0)
    model = w.make_model(data)
    out = model(x)
    assert out.shape == (2, 256, 96)
    assert abs(w.loss(out, y).item() - math.log(96)) < 0.3
    val = w.evaluate(model, data)
    assert isinstance(val, float) and abs(val - math.log(96)) < 0.3
    opt = w.make_optimizer(model.parameters())
    grouped = [p for g in opt.param_groups for p in g["params"]]
    assert len(grouped) == len(list(model.parameters()))
    assert {g["weight_decay"] for g in opt.param_groups} == {0.0, 0.1}


def test_loss_is_float32_for_half_logits():
    logits = torch.randn(2, 7, 96).bfloat16()
    loss = cross_entropy(logits, torch.randint(96, (2, 7)))
    assert loss.dtype == torch.float32 and loss.dim() == 0
