"""mixprec.convert on real models: dtypes, training parity with eager, dynamic batch, errors."""

from __future__ import annotations

import contextlib
import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from extras import need
from torch import nn

import mixprec
from mixprec.bench.models import GPT, GPTConfig, SeedMLP
from mixprec.bench.workloads import MNIST1DCNN
from mixprec.graph import convert
from mixprec.graph.compare import compare_with_eager

SMALL_GPT = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)
INSIDE = mixprec.Recipe("O1", fp32_inside=True)  # norms and softmax on 16-bit inputs


def gpt_batch(batch: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 96, (batch, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def train(model: nn.Module, batches, loss_fn, steps: int, lr: float = 3e-3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    assert logits.dtype == torch.float32  # mixed policy: float32 outputs
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def test_gpt_trains_to_the_same_loss_as_eager_mixprec():
    torch.manual_seed(0)
    base = GPT(SMALL_GPT)
    eager_model, graph_model = copy.deepcopy(base), copy.deepcopy(base)
    batches = [gpt_batch(4, s) for s in range(4)]
    graph = convert(graph_model, (batches[0][0],), "mixed_bfloat16")

    def eager_forward(x):
        with mixprec.autocast(torch.bfloat16):
            return eager_model(x).float()

    eager_forward.parameters = eager_model.parameters  # type: ignore[attr-defined]
    graph_losses = train(graph, batches, lm_loss, 30)
    eager_losses = train(_Fn(eager_forward, eager_model), batches, lm_loss, 30)
    assert all(torch.isfinite(torch.tensor(graph_losses)))
    assert graph_losses[-1] < graph_losses[0] - 1.0
    assert abs(graph_losses[-1] - eager_losses[-1]) < 0.05 * eager_losses[-1]


class _Fn(nn.Module):
    def __init__(self, fn, model):
        super().__init__()
        self.fn, self.model = fn, model

    def forward(self, x):
        return self.fn(x)


def test_per_op_dtypes_match_the_eager_engine():
    torch.manual_seed(0)
    model = GPT(SMALL_GPT).eval()
    x, _ = gpt_batch()
    graph = convert(model, (x,), "mixed_bfloat16")
    assert compare_with_eager(model, graph, x) == []
    mlp = SeedMLP(40, 64, 10)
    assert compare_with_eager(mlp, convert(mlp, torch.randn(8, 40)), torch.randn(8, 40)) == []


def test_differences_from_eager_are_explained():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)) * 2.0)

    m = Scaled()
    x = torch.randn(4, 8)
    diffs = compare_with_eager(m, convert(m, x), x)
    assert diffs == []  # tanh and mul sit between allow ops: 16-bit in both
    diffs = compare_with_eager(m, convert(m, x, ops={"tanh": "deny"}), x)
    tanh = next(d for d in diffs if d["op"] == "tanh")
    assert tanh["eager"] == {"bfloat16": 1} and tanh["graph"] == {"float32": 1}
    assert "deny list" in tanh["why"][0]


def test_cnn_and_mlp_train_and_report_their_casts():
    torch.manual_seed(0)
    cnn = MNIST1DCNN()
    x = torch.randn(32, 40)
    y = torch.randint(0, 10, (32,))
    graph = convert(cnn, x)
    losses = train(graph, [(x, y)], F.cross_entropy, 25)
    assert losses[-1] < losses[0] * 0.7 and all(not math.isnan(v) for v in losses)
    report = graph.precision_report()
    convs = [r for r in report.nodes if r.op == "conv1d"]
    assert len(convs) == 3 and {r.dtype for r in convs} == {"bf16"}
    assert report.summary.startswith("Converted ")
    assert "using 2 cast(s)" in report.summary  # the input in, the logits out
    data = json.loads(report.to_json())
    assert data["by_op"]["conv1d"] == {"bf16": 3}
    assert data["bytes"]["16-bit"] > 0 and data["bytes"]["32-bit"] == 0  # all ops in bf16
    text = str(report)
    assert "conv1d" in text and "MiB in 16-bit" in text


def test_dynamic_batch_reuses_one_graph_and_modes_get_their_own():
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2, self.drop = nn.Linear(8, 16), nn.Linear(16, 4), nn.Dropout(0.5)

        def forward(self, x):
            return self.l2(self.drop(F.relu(self.l1(x))))

    m = convert(Drop().train(), torch.randn(4, 8))
    for b in (1, 3, 17):
        assert m(torch.randn(b, 8)).shape == (b, 4)
    assert len(m._captured) == 1
    m.eval()
    x = torch.randn(5, 8)
    torch.testing.assert_close(m(x), m(x))  # eval graph: no dropout
    assert len(m._captured) == 2
    assert all(r.dtype == "bf16" for r in m.precision_report().nodes if r.op == "linear")


def test_state_dict_is_the_models_own_and_float32():
    torch.manual_seed(0)
    mlp = SeedMLP(40, 64, 10)
    graph = convert(mlp, torch.randn(2, 40))
    sd = graph.state_dict()
    assert list(sd) == list(mlp.state_dict())
    assert {t.dtype for t in sd.values()} == {torch.float32}
    assert [id(p) for p in graph.parameters()] == [id(p) for p in mlp.parameters()]
    fresh = SeedMLP(40, 64, 10)
    fresh.load_state_dict(sd)
    graph.load_state_dict(fresh.state_dict())


def test_initialize_o2_stores_16bit_weights_and_drops_weight_casts():
    torch.manual_seed(0)
    model = GPT(SMALL_GPT)
    x, y = gpt_batch()
    graph = convert(model, (x,))
    assert "excluding 0 weight" not in graph.precision_report().summary
    graph, opt = mixprec.initialize(
        graph, torch.optim.AdamW(graph.parameters(), lr=3e-3), "O2", torch.bfloat16
    )
    assert graph.blocks[0].fc.weight.dtype == torch.bfloat16
    assert graph.blocks[0].ln1.weight.dtype == torch.float32  # norms stay fp32 at O2
    losses = []
    for _ in range(15):
        loss = lm_loss(graph(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    report = graph.precision_report()
    weight_casts = [c for c in report.casts if c["kind"] == "weight"]
    assert weight_casts == []
    assert losses[-1] < losses[0] - 0.5


def test_convert_errors_say_how_to_fix():
    with pytest.raises(TypeError, match="nn.Module"):
        convert(lambda x: x, torch.randn(2))
    m = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="16-bit compute dtype"):
        convert(m, torch.randn(2, 4), "float32")
    mixprec.initialize(m, recipe="O1", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="before mixprec.initialize"):
        convert(m, torch.randn(2, 4))

    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x

    with pytest.raises(RuntimeError, match="could not capture DataDependent"):
        convert(DataDependent(), torch.randn(2, 4))
    with pytest.raises(ValueError, match="Unknown list"):
        convert(nn.Linear(4, 4), torch.randn(2, 4), ops={"linear": "gray"})


def test_fp32_modules_stay_fp32():
    torch.manual_seed(0)
    model = GPT(SMALL_GPT)
    x, _ = gpt_batch()
    graph = convert(model, (x,), fp32_modules=["blocks.1"])
    rows = graph.precision_report().nodes
    assert {r.dtype for r in rows if r.module.startswith("blocks.1") and r.op == "linear"} == {
        "fp32"
    }
    assert {r.dtype for r in rows if r.module.startswith("blocks.0") and r.op == "linear"} == {
        "bf16"
    }


def test_compile_backend_applies_the_pass_under_dynamo():
    from mixprec.graph.compile import backend

    torch.manual_seed(0)
    mlp = SeedMLP(40, 64, 10)
    be = backend("mixed_bfloat16", compiler="eager")
    compiled = torch.compile(mlp, backend=be)
    x = torch.randn(8, 40)
    out = compiled(x)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert mlp.dense1.weight.grad.dtype == torch.float32
    result = be.results[0]
    lowered = {n for n, dt in result.rewrite.dtypes.items() if dt == torch.bfloat16}
    assert sum(1 for n in lowered if n.startswith("linear")) == 3
    torch.testing.assert_close(out, mlp(x), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_hugging_face_models_convert_and_train(kind, monkeypatch):
    transformers = need("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    x = torch.randint(0, 128, (4, 16))
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=128,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        model, y = transformers.GPT2LMHeadModel(cfg), x
    else:
        cfg = transformers.BertConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            num_labels=3,
        )
        model, y = transformers.BertForSequenceClassification(cfg), torch.tensor([0, 1, 2, 1])
    graph = convert(model, (x,))
    report = graph.precision_report()
    assert any(r.dtype == "bf16" and r.op in ("linear", "addmm") for r in report.nodes)

    def loss_fn(out, target):
        logits = out.logits
        assert logits.dtype == torch.float32
        return F.cross_entropy(logits.flatten(0, -2), target.flatten())

    losses = train(graph, [(x, y)], loss_fn, 8, lr=3e-3)
    assert all(not math.isnan(v) for v in losses) and losses[-1] < losses[0]


def test_cnn_per_op_dtypes_match_eager_and_fp32_inside_lowers_norms():
    torch.manual_seed(0)
    cnn = MNIST1DCNN().eval()
    x = torch.randn(8, 40)
    diffs = compare_with_eager(cnn, convert(cnn, x), x)
    # by design: the input's view is a clear op next to conv1, so the cast moves before it
    assert [(d["op"], d["eager"], d["graph"]) for d in diffs] == [
        ("view", {"bfloat16": 1, "float32": 1}, {"bfloat16": 2})
    ]
    assert "clear op next to allow op conv1d" in diffs[0]["why"][0]
    model = GPT(SMALL_GPT)
    ids, _ = gpt_batch()
    plain = convert(model, (ids,)).precision_report()
    inside = convert(model, (ids,), INSIDE).precision_report()
    assert plain.by_op()["layer_norm"] == {"fp32": 5}
    assert inside.by_op()["layer_norm"] == {"bf16": 4, "fp32": 1}  # the last one feeds the head
    count = lambda r: sum(1 for c in r.casts if c["kind"] in ("activation", "input"))  # noqa
    assert count(inside) < count(plain)
    with pytest.raises(ValueError, match="fp32_inside"):
        compare_with_eager(model, convert(model, (ids,), INSIDE), ids)


def test_o2_storage_with_fp32_inside_leaves_only_the_output_cast():
    """With 16-bit tables and weights the embeddings seed the 16-bit region; norms take 16-bit
    data with their fp32 weights uncast, as the eager engine passes them: one cast is left."""
    torch.manual_seed(0)
    model = GPT(SMALL_GPT)
    ids, y = gpt_batch()
    graph = convert(model, (ids,), INSIDE)
    graph, opt = mixprec.initialize(
        graph, torch.optim.AdamW(graph.parameters()), "O2", torch.bfloat16
    )
    report = graph.precision_report()
    assert [(c["producer"], c["kind"]) for c in report.casts] == [("linear_8", "activation")]
    emb = [r for r in report.nodes if r.op == "embedding"]
    assert {r.dtype for r in emb} == {"bf16"} and "16-bit table" in emb[0].reason
    assert report.by_op()["layer_norm"] == {"bf16": 5}
    assert graph.ln_f.weight.dtype == torch.float32
    loss = lm_loss(graph(ids), y)
    opt.backward(loss)
    opt.step()
    assert torch.isfinite(loss)


def test_compile_backend_keeps_fp32_ops_fp32_on_16bit_weights():
    from mixprec.graph.compile import backend

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            return torch.log_softmax(self.b(torch.relu(self.a(x))), -1)

    m = Net().to(torch.bfloat16)  # traced with 16-bit weights, as after initialize(..., "O2")
    be = backend("mixed_bfloat16", compiler="eager")
    out = torch.compile(m, backend=be)(torch.randn(4, 8))
    dtypes = be.results[0].rewrite.dtypes
    assert dtypes["log_softmax"] == torch.float32 and dtypes["linear_1"] == torch.bfloat16
    assert out.dtype == torch.float32


def test_compiled_training_with_mixprec_attention_under_aot_autograd():
    """The pass's graph, with mixprec's attention kernel, traced forward and backward by
    AOTAutograd (what inductor compiles), at O2: trains, and no cached tensor leaks in."""
    torch.manual_seed(0)
    model = GPT(SMALL_GPT)
    ids, y = gpt_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    compiled = mixprec.graph.compile(
        model, mixprec.Recipe("O1", torch.bfloat16, fp32_inside=True), compiler="aot_eager"
    )
    compiled, opt = mixprec.initialize(compiled, opt, "O2", torch.bfloat16)
    losses = []
    for _ in range(6):
        loss = lm_loss(compiled(ids), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="'inductor', 'aot_eager' or 'eager'"):
        mixprec.graph.backend(compiler="tvm")


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 4, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(1)


@pytest.mark.parametrize(
    "spec",
    [None, "mixed_bfloat16", mixprec.Recipe("O1", torch.bfloat16)],
    ids=["default", "policy", "recipe"],
)
def test_the_compiler_path_picks_kernels_as_convert_does_whatever_names_the_precision(spec):
    """``kernels`` has one default: a policy (or nothing) reads as a Recipe's ``"auto"``, so
    attention takes mixprec's measured rule under ``graph.backend`` as under ``convert``."""
    from mixprec.graph.rewrite import auto_attention

    with mixprec.policy_scope("mixed_bfloat16") if spec is None else contextlib.nullcontext():
        be = mixprec.graph.backend(spec, compiler="eager")
        torch.compile(_Attention(), backend=be)(torch.randn(2, 4, 16))
    targets = [n.target for n in be.results[0].graph.nodes]
    assert auto_attention in targets
    assert F.scaled_dot_product_attention not in targets
