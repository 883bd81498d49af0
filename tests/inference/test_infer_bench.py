"""The inference report (mixprec.inference.bench) and its sentence-embedding workload: a model of
all-MiniLM-L6-v2's architecture whose weights the tests make (random from a fixed seed)."""

from __future__ import annotations

import json

import pytest
import torch
from extras import need
from torch import nn

import mixprec
from mixprec.cli import main
from mixprec.inference.bench import compare_variants, to_json, to_markdown


def test_compare_variants_rows_are_measured() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.LayerNorm(128), nn.Linear(128, 10))
    x = torch.randn(64, 32)
    calls = []

    def metric(forward) -> float:
        calls.append(1)
        return float(forward(x).argmax(-1).eq(net(x).argmax(-1)).float().mean())

    rows = compare_variants(
        net,
        x,
        variants=["fp32", "bf16", "int8-mixed"],
        metric=metric,
        rounds=3,
        iters=1,
        int8_tolerance=1e-2,
    )
    by = {r.variant: r for r in rows}
    assert by["fp32"].max_abs == 0 and by["fp32"].speedup == 1.0 and by["fp32"].metric == 1.0
    assert 0 < by["bf16"].max_abs < 0.1 and by["bf16"].cosine > 0.999
    assert by["bf16"].size_mb < 0.6 * by["fp32"].size_mb  # 16-bit storage
    assert by["int8-mixed"].size_mb < by["bf16"].size_mb and "int8" in by["int8-mixed"].note
    assert len(calls) == 3 and all(r.latency_ms > 0 and r.p90_ms >= r.latency_ms for r in rows)
    table = to_markdown(rows, "agreement")
    assert table.count("\n") == 4 and "| agreement |" in table
    assert json.loads(json.dumps(to_json(rows, workload="t")))["results"][1]["variant"] == "bf16"
    with pytest.raises(ValueError, match="Unknown variant"):
        compare_variants(net, x, variants=["int4"])


def test_cli_rejects_unknown_workload(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["infer-bench", "imagenet"])
    assert "invalid choice" in capsys.readouterr().err


def test_onnxruntime_rows_run_the_file(tmp_path) -> None:
    need("onnxruntime")
    need("onnxscript")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)).eval()
    x = torch.randn(32, 16)
    rows = compare_variants(
        net,
        x,
        variants=["bf16"],
        backends=["onnxruntime"],
        rounds=2,
        iters=1,
        metric=lambda fwd: float(fwd(x[:5]).shape[0]),
        workdir=str(tmp_path),
    )
    (row,) = rows
    assert row.backend == "onnxruntime" and row.cosine > 0.999 and 0 < row.max_abs < 0.05
    assert row.metric == 5.0  # the ONNX forward returns one tensor, at another batch size
    assert row.note.startswith("compute=") and (tmp_path / "bf16.onnx").stat().st_size > 0
    assert row.vs_torch_fp32 is None  # no PyTorch fp32 row to compare with


@pytest.fixture(scope="module")
def minilm():
    """all-MiniLM-L6-v2's architecture with random weights from a fixed seed (the tests make
    their weights; nothing is downloaded or shipped) on byte-level tokens."""
    need("transformers")
    from mixprec.inference.bench_workloads import SENTENCES, load_minilm

    model, encode = load_minilm(seed=0)
    inputs = encode(SENTENCES[:4])
    with torch.no_grad():
        ref = model(*inputs)
    return model, inputs, ref


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def test_minilm_shaped_encoder_in_bf16_keeps_norms_fp32_and_matches_fp32(minilm) -> None:
    model, inputs, ref = minilm
    assert sum(p.numel() for p in model.parameters()) > 22e6  # all-MiniLM-L6-v2's size
    assert ref.dtype == torch.float32 and torch.allclose(ref.norm(dim=-1), torch.ones(4))
    assert _cos(ref[0], ref[1]) < 0.9999  # sentences give different embeddings
    fast = mixprec.for_inference(model, torch.bfloat16, inputs)
    assert fast.bert.encoder.layer[0].attention.self.query.weight.dtype == torch.bfloat16
    assert fast.bert.embeddings.LayerNorm.weight.dtype == torch.float32
    with torch.no_grad():
        out = fast(*inputs)
    assert out.dtype == torch.float32 and _cos(out, ref).min() >= 0.999, _cos(out, ref)


def test_minilm_shaped_encoder_onnx_export_matches_fp32(minilm, tmp_path) -> None:
    """The same model exported to ONNX in bf16 (bf16 storage; fp32 compute where ONNX Runtime's
    CPU provider has no bf16 kernels), run in ONNX Runtime: cosine to fp32 >= 0.999."""
    need("onnxruntime")
    need("onnxscript")
    from mixprec.inference.export import ort_can_run, ort_session

    model, inputs, ref = minilm
    fast = mixprec.for_inference(model, torch.bfloat16, inputs)
    res = mixprec.inference.export(fast, inputs, tmp_path / "minilm.onnx")
    assert res.compute == ("16bit" if ort_can_run(torch.bfloat16) else "fp32")
    n16 = sum(v == "bfloat16" for v in res.weight_dtypes.values())
    assert n16 >= 36, res.weight_dtypes  # 6 layers x (q, k, v, out, ffn in, ffn out) at least
    sess = ort_session(str(tmp_path / "minilm.onnx"))
    names = [i.name for i in sess.get_inputs()]
    got = torch.from_numpy(sess.run(None, dict(zip(names, (t.numpy() for t in inputs))))[0])
    assert _cos(got, ref).min() >= 0.999, _cos(got, ref)
    assert (tmp_path / "minilm.onnx").stat().st_size < 0.6 * 4 * 22.7e6  # 16-bit storage


def test_minilm_loads_a_local_checkpoint_and_its_tokenizer(tmp_path) -> None:
    """``--weights DIR``: the model and tokenizer come from a local Hugging Face directory (here
    a small BERT and a word-piece vocabulary the test writes), not from the seed."""
    transformers = need("transformers")
    from mixprec.inference.bench_workloads import load_minilm

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "mixed", "precision", "keeps", "norms"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    transformers.BertTokenizer(str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    cfg = transformers.BertConfig(
        vocab_size=len(words),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    torch.manual_seed(1)
    saved = transformers.BertModel(cfg).eval()
    saved.save_pretrained(tmp_path)
    model, encode = load_minilm(str(tmp_path))
    ids, mask = encode(["mixed precision keeps norms", "precision"])
    assert ids[0].tolist() == [2, 5, 6, 7, 8, 3] and ids[1].tolist() == [2, 6, 3, 0, 0, 0]
    assert mask.sum(1).tolist() == [6, 3]
    for (name, a), b in zip(model.bert.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        assert model(ids, mask).shape == (2, 32)


def test_byte_tokens_frame_each_sentence_and_pad() -> None:
    from mixprec.inference.bench_workloads import byte_tokens

    ids, mask = byte_tokens(["ab", "é"])
    assert ids.tolist() == [[101, 1097, 1098, 102], [101, 1195, 1169, 102]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    ids, mask = byte_tokens(["a", "abc"], max_len=4)
    assert ids.tolist() == [[101, 1097, 102, 0], [101, 1097, 1098, 102]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


def test_weights_apply_to_minilm_only(capsys) -> None:
    with pytest.raises(SystemExit, match="--weights loads all-MiniLM-L6-v2"):
        main(["infer-bench", "char-gpt", "--weights", "somewhere"])
