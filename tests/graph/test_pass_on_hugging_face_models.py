"""The graph pass on Hugging Face models, and on the patterns in them that broke it.

* An op on the allow list computes in one dtype: every floating input has to reach it in that
  dtype. RoPE computes cos/sin in float32 under ``torch.autocast(enabled=False)``; captured, that
  region is one opaque node whose outputs are read through ``getitem``, and those outputs must be
  cast before they meet 16-bit q/k. The checks here run the rewritten graph node by node and
  look at the real dtypes, then compare them with the pass's own record (what its report shows).
* Decoders return a key/value cache by default, which torch.export cannot flatten; training
  needs none, so the pass captures with the cache off.

Every model is a tiny config built offline; 16-bit shapes stay tiny (no native bf16 on this CPU).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from extras import need
from torch import fx, nn

import mixprec
from mixprec._core.cast_table import LOWER, current_table
from mixprec.graph import convert
from mixprec.graph.compile import backend
from mixprec.graph.paint import node_op
from mixprec.graph.report import PrecisionReport
from mixprec.graph.rewrite import auto_attention

BF16, FP32 = torch.bfloat16, torch.float32


# --- checks on what really runs ----------------------------------------------------------------


def _allow_op(n: fx.Node) -> str | None:
    """The op name of an allow-list (cast table ``lower``) node, else None."""
    if n.op not in ("call_function", "call_method"):
        return None
    if n.target is auto_attention:
        return "scaled_dot_product_attention"
    name = node_op(n)
    return name if name and current_table().get(name) == LOWER else None


class RealDtypes(fx.Interpreter):
    """Run a rewritten graph and record real dtypes: the floating inputs of every allow-list
    node, and each node whose output dtype differs from the pass's record of it."""

    def __init__(self, gm: fx.GraphModule, recorded: dict[str, torch.dtype | None]):
        super().__init__(gm)
        self.recorded = recorded
        self.allow: list[tuple[str, list[torch.dtype]]] = []
        self.wrong: list[tuple[str, torch.dtype | None, torch.dtype]] = []

    def run_node(self, n: fx.Node):
        name = _allow_op(n)
        if name is not None:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            ins = [
                t.dtype
                for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            ]
            self.allow.append((name, ins))
        out = super().run_node(n)
        recorded = self.recorded.get(n.name)
        if isinstance(out, torch.Tensor) and out.is_floating_point() and recorded != out.dtype:
            self.wrong.append((n.name, recorded, out.dtype))
        return out


def check_real_dtypes(gm: fx.GraphModule, result, *inputs, fp32: int = 0) -> RealDtypes:
    """Each allow node got one dtype on all its floating inputs, bf16 but for ``fp32`` nodes the
    model itself keeps float32 (a disabled-autocast region); every node's real output dtype is
    the one the pass recorded (its report shows)."""
    real = RealDtypes(gm, result.rewrite.dtypes)
    with torch.no_grad():
        real.run(*inputs)
    assert real.allow, "no allow-list op ran"
    mixed = [(name, ins) for name, ins in real.allow if len(set(ins)) != 1]
    assert not mixed, f"allow ops with mixed input dtypes: {mixed[:5]}"
    wide = [(name, ins) for name, ins in real.allow if ins[0] != BF16]
    assert len(wide) == fp32, f"allow ops not in bf16: {wide[:5]}"
    assert not real.wrong, f"(node, recorded, real): {real.wrong[:5]}"
    return real


# --- the RoPE pattern and other multi-input allow ops on hand-written modules ------------------


def rotate_half(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), -1)


class RopeAttention(nn.Module):
    """Attention with rotary embeddings computed as Hugging Face's Llama did: positions times
    inverse frequencies as a matmul in float32, with autocast disabled; cos/sin then meet the
    16-bit q and k, while v goes to attention straight from its linear."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        inv = 1.0 / 10000 ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        split = lambda t: t.view(b, s, self.heads, self.hd).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        pos = torch.arange(s, device=x.device, dtype=torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            freqs = (self.inv_freq[:, None].float() @ pos[None, :].float()).transpose(0, 1)
            emb = torch.cat((freqs, freqs), -1)
            cos, sin = emb.cos(), emb.sin()
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(att.transpose(1, 2).reshape(b, s, d))


def test_rope_branch_under_disabled_autocast_reaches_attention_in_one_dtype():
    """Before the fix: q and k reached attention in float32 and v in bf16 ("Expected query,
    key, and value to have the same dtype"): the getitems reading the float32 region were
    painted 16-bit without a cast."""
    torch.manual_seed(0)
    model = RopeAttention()
    x = torch.randn(2, 8, 16)
    ref = model(x)
    graph = convert(model, (x,), "mixed_bfloat16")
    out = graph(x)
    assert out.dtype == FP32
    torch.testing.assert_close(out, ref, atol=0.05, rtol=0.05)
    real = check_real_dtypes(*graph._graph(*graph._example), x)
    assert ("scaled_dot_product_attention", [BF16, BF16, BF16]) in real.allow
    report = graph.precision_report()
    reads = [r for r in report.nodes if r.op == "getitem" and r.list == "fixed"]
    assert len(reads) == 2 and all(r.dtype == "fp32" for r in reads)  # cos, sin stay float32
    assert "reads an output of" in reads[0].reason
    assert report.by_op()["scaled_dot_product_attention"] == {"bf16": 1}
    assert report.by_op()["linear"] == {"bf16": 4}
    out.sum().backward()
    assert model.q.weight.grad.dtype == FP32 and torch.isfinite(model.q.weight.grad).all()


def spy(be):
    """Wrap a backend to keep each rewritten graph with its example inputs, to run them."""
    seen: list[tuple[fx.GraphModule, list]] = []

    def wrapped(gm: fx.GraphModule, example_inputs: list):
        compiled = be(gm, example_inputs)
        seen.append((gm, list(example_inputs)))
        return compiled

    wrapped.results, wrapped.seen = be.results, seen  # type: ignore[attr-defined]
    return wrapped


def test_rope_region_stays_float32_under_dynamo():
    """dynamo inlines the disabled-autocast region: its matmul is on the allow list, but the
    model asked for float32 there, so the pass keeps it (as convert does, where the region is
    one opaque node). Before: the matmul ran in bf16 and its ``.float()`` casts were
    retargeted to bf16."""
    torch.manual_seed(0)
    model = RopeAttention()
    x = torch.randn(2, 8, 16)
    be = spy(backend("mixed_bfloat16", compiler="eager"))
    out = torch.compile(model, backend=be)(x)
    assert out.dtype == FP32
    torch.testing.assert_close(out, model(x), atol=0.05, rtol=0.05)
    result = be.results[0]
    rope_matmul = [n for n in result.graph.nodes if node_op(n) == "matmul"]
    assert len(rope_matmul) == 1
    assert result.rewrite.dtypes[rope_matmul[0].name] == FP32
    assert "autocast" in result.colouring.fixed[rope_matmul[0]]
    gm, inputs = be.seen[0]
    real = check_real_dtypes(gm, result, *inputs, fp32=1)
    assert ("matmul", [FP32, FP32]) in real.allow
    assert ("scaled_dot_product_attention", [BF16, BF16, BF16]) in real.allow


class BiasedScores(nn.Module):
    """Two more multi-input allow ops: ``baddbmm`` whose bias (ALiBi-style distances) comes from
    a float32 region, and ``addmm`` with a learnable 0-dim shift as its ``input``."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.shift = nn.Parameter(torch.tensor(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        pos = torch.arange(s, device=x.device, dtype=torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            bias = -(pos[None, :] - pos[:, None]).abs()[None] * 0.5
        scores = torch.baddbmm(bias.expand(x.shape[0], s, s), self.q(x), self.k(x).transpose(1, 2))
        h = scores.softmax(-1) @ x
        return torch.addmm(self.shift, h.flatten(0, 1), self.w)


def test_baddbmm_bias_and_addmm_scalar_input_get_the_16bit_dtype():
    """Before the fix: baddbmm got a float32 bias ("Input dtypes must be the same") and addmm a
    float32 0-dim input, which the pass skipped as a scalar that type promotion absorbs; the
    matmul kernels accept no mix."""
    torch.manual_seed(0)
    model = BiasedScores()
    x = torch.randn(2, 8, 16)
    ref = model(x)
    graph = convert(model, (x,), "mixed_bfloat16")
    out = graph(x)
    assert out.dtype == FP32
    torch.testing.assert_close(out, ref, atol=0.1, rtol=0.05)
    real = check_real_dtypes(*graph._graph(*graph._example), x)
    assert ("baddbmm", [BF16] * 3) in real.allow and ("addmm", [BF16] * 3) in real.allow
    by_op = graph.precision_report().by_op()
    assert by_op["baddbmm"] == {"bf16": 1} and by_op["addmm"] == {"bf16": 1}
    assert by_op["softmax"] == {"fp32": 1}
    out.sum().backward()
    assert model.shift.grad is not None and model.shift.grad.dtype == FP32


class ConstantProjection(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) @ torch.full((8, 8), 0.1, device=x.device)


def test_a_factory_moved_into_a_list_keeps_its_traced_dtype():
    """``torch.full`` has no floating input to cast, so it cannot follow a 16-bit colour.
    Before: moved to the clear list, it was painted bf16 next to the matmul, which then got a
    float32 operand ("expected m1 and m2 to have the same dtype")."""
    model, x = ConstantProjection(), torch.randn(4, 8)
    graph = convert(model, (x,), "mixed_bfloat16", ops={"full": "clear"})
    torch.testing.assert_close(graph(x), model(x), atol=0.05, rtol=0.05)
    full = next(r for r in graph.precision_report().nodes if r.op == "full")
    assert (full.list, full.dtype) == ("fixed", "fp32") and "no floating input" in full.reason
    real = check_real_dtypes(*graph._graph(*graph._example), x)
    assert ("matmul", [BF16, BF16]) in real.allow


class ScaledSlice(nn.Module):
    """An RMSNorm-style weight multiply, then dynamo's ``x[:, -k:]`` (HF's ``logits_to_keep``)
    into the head: the slice is a getitem on a tensor, not a read of a multi-output node."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x * self.scale)[:, -2:])


def test_a_tensor_slice_does_not_pull_its_producer_into_16bit():
    """Before: the multi-output rule (a node and its getitem readers share one colour) took the
    slice for such a reader, painted the multiply bf16 and cast its float32 weight."""
    be = spy(backend("mixed_bfloat16", compiler="eager"))
    x = torch.randn(3, 5, 8)
    assert torch.compile(ScaledSlice(), backend=be)(x).dtype == FP32
    result = be.results[0]
    dtypes = {node_op(n): result.rewrite.dtypes[n.name] for n in result.graph.nodes}
    assert (dtypes["mul"], dtypes["getitem"], dtypes["linear"]) == (FP32, BF16, BF16)
    assert (
        "not between allow ops"
        in result.colouring.reason[next(n for n in result.graph.nodes if node_op(n) == "mul")]
    )
    assert result.rewrite.count("weight") == 2  # the head's weight and bias, not the scale
    gm, inputs = be.seen[0]
    check_real_dtypes(gm, result, *inputs)


# --- Hugging Face models, with their default use_cache ------------------------------------------

VOCAB = 100
HF_MODELS = ["llama", "mistral", "qwen2", "gemma", "gpt2", "bert", "t5"]


def hf_model(kind: str) -> tuple[nn.Module, torch.Tensor, dict]:
    """A tiny model built from its config (no download), a batch of ids and extra kwargs."""
    transformers = need("transformers")
    torch.manual_seed(0)
    decoder = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**decoder))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**decoder))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**decoder))
    elif kind == "gemma":
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**decoder, head_dim=16))
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0
        )
        cfg.eos_token_id = 0
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "bert":
        cfg = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )
        model = transformers.BertForMaskedLM(cfg)
    else:
        cfg = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2
        )
        model = transformers.T5ForConditionalGeneration(cfg)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    return model, ids, ({"decoder_input_ids": ids} if kind == "t5" else {})


def lm_loss(out, ids: torch.Tensor) -> torch.Tensor:
    assert out.logits.dtype == FP32  # the mixed policy's float32 outputs
    return F.cross_entropy(out.logits.flatten(0, 1), ids.flatten())


def train_o2(model: nn.Module, ids: torch.Tensor, kwargs: dict, steps: int = 10) -> list[float]:
    """``steps`` AdamW steps at O2, as the docs show; finite losses that fall."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = mixprec.initialize(model, opt, "O2", BF16)
    losses = []
    for _ in range(steps):
        out = model(ids, **kwargs)
        assert getattr(out, "past_key_values", None) is None  # the cache is off
        loss = lm_loss(out, ids)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 0.5, losses
    return losses


def assert_report_follows_cast_table(report) -> None:
    """Every op the cast table lowers ran in bf16, every op it keeps float32 in float32."""
    rules = current_table()
    for op, dtypes in report.by_op().items():
        if rules.get(op) == LOWER:
            assert set(dtypes) == {"bf16"}, (op, dtypes)
        elif rules.get(op) == "fp32":
            assert set(dtypes) <= {"fp32", "-"}, (op, dtypes)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("kind", HF_MODELS)
def test_hugging_face_model_converts_and_trains_at_o2(kind):
    """Before: every decoder and T5 failed to capture (their DynamicCache/EncoderDecoderCache
    output is not a pytree); with use_cache=False, the Llama family failed in attention on
    float32 q/k and bf16 v."""
    model, ids, kwargs = hf_model(kind)
    assert model.config.use_cache  # the default is left as it is
    graph = convert(model, (ids,), "mixed_bfloat16", example_kwargs=kwargs)
    assert model.config.use_cache  # captured with the cache off, then restored
    assert graph.dynamic_batch  # one graph for every batch size
    report = graph.precision_report()
    by_op = report.by_op()
    assert by_op.get("linear", {}).get("bf16", 0) + by_op.get("addmm", {}).get("bf16", 0) >= 9
    assert by_op["scaled_dot_product_attention"] == {"bf16": 6 if kind == "t5" else 2}
    assert_report_follows_cast_table(report)
    check_real_dtypes(*graph._graph(*graph._example), ids, *kwargs.values())

    train_o2(graph, ids, kwargs)
    report = graph.precision_report()  # the O2 graph: 16-bit weights, no weight casts
    assert [c for c in report.casts if c["kind"] == "weight"] == []
    assert_report_follows_cast_table(report)
    check_real_dtypes(*graph._graph(*graph._example), ids, *kwargs.values())


# inductor compiles C++ for each graph (about 30 s cold here): one model takes that path
COMPILERS = {"llama": "inductor"}


@pytest.mark.parametrize("kind", HF_MODELS)
def test_hugging_face_model_compiles_and_trains_at_o2(kind, monkeypatch):
    """Before: T5 failed while dynamo traced it with 16-bit weights (its float32 query met the
    bf16 position bias in attention's fake-tensor check)."""
    model, ids, kwargs = hf_model(kind)
    module = importlib.import_module("mixprec.graph.compile")
    made = []

    def spying_backend(*args, **options):
        made.append(spy(backend(*args, **options)))
        return made[-1]

    monkeypatch.setattr(module, "backend", spying_backend)
    compiled = mixprec.graph.compile(
        model, "mixed_bfloat16", compiler=COMPILERS.get(kind, "aot_eager")
    )
    train_o2(compiled, ids, kwargs)
    assert model.config.use_cache
    (be,) = made
    assert len(be.results) == 1  # one graph: no graph break, no recompile
    (result,), ((gm, inputs),) = be.results, be.seen
    report = PrecisionReport.build(gm, result)
    assert [c for c in report.casts if c["kind"] == "weight"] == []  # traced with 16-bit weights
    assert report.by_op()["scaled_dot_product_attention"] == {"bf16": 6 if kind == "t5" else 2}
    assert_report_follows_cast_table(report)
    check_real_dtypes(gm, result, *inputs)


def test_the_cache_is_off_in_graphs_and_asking_for_it_says_why_not():
    model, ids, _ = hf_model("llama")
    graph = convert(model, (ids,), "mixed_bfloat16")
    out = graph(ids)
    assert out.past_key_values is None and model.config.use_cache
    torch.testing.assert_close(graph(ids, use_cache=False).logits, out.logits)
    with pytest.raises(ValueError, match="without its key/value cache.*use_cache=True"):
        graph(ids, use_cache=True)
    with pytest.raises(ValueError, match="Call the original model for generation"):
        convert(model, (ids,), example_kwargs={"use_cache": True})
    assert model(ids).past_key_values is not None  # the model itself is untouched

    compiled = mixprec.graph.compile(model, "mixed_bfloat16", compiler="eager")
    assert compiled(ids).past_key_values is None
    assert compiled(ids, use_cache=True).past_key_values is not None  # asked for: returned
