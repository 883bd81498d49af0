"""mixprec.inference.export: ONNX and torch.export round trips, weight dtypes against the table,
errors."""

from __future__ import annotations

import pytest
import torch
from extras import need
from torch import nn

import mixprec
from mixprec.bench.models import GPT, GPTConfig
from mixprec.inference.export import ExportError, onnx_rule, ort_can_run, ort_session


def need_onnx():
    """onnx, or the test skipped naming the extra (which also brings onnxruntime, and
    onnxscript, which torch.onnx.export(dynamo=True) needs); torch.export tests need neither."""
    need("onnxscript")
    need("onnxruntime")
    return need("onnx")


X = torch.randint(0, 96, (2, 16))


@pytest.fixture(scope="module")
def gpt() -> nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_embd=32, n_head=2)).eval()
    with torch.no_grad():  # distinct norm parameters, so the exporter cannot merge them
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    return model


def test_onnx_fp16_round_trip_and_weight_dtypes(gpt: nn.Module, tmp_path) -> None:
    onnx = need_onnx()
    fast = mixprec.for_inference(gpt, torch.float16, X)
    res = mixprec.inference.export(fast, X, tmp_path / "m.onnx")
    assert res.compute == "16bit" and res.cosine > 0.9999 and res.max_abs_error < 1e-2
    proto = onnx.load(tmp_path / "m.onnx")
    inferred = onnx.shape_inference.infer_shapes(proto)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output)
    }
    types.update({t.name: t.data_type for t in proto.graph.initializer})
    F, H = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    kinds = {"lower": 0, "fp32": 0, "follows": 0}
    for t in proto.graph.initializer:  # every float weight's dtype follows the cast table
        if t.data_type not in (F, H):
            continue
        for n in [n for n in proto.graph.node if t.name in n.input]:
            rule = onnx_rule(n.op_type)
            if rule in ("lower", "fp32"):  # MatMul/Gemm weights 16-bit; LayerNorm's fp32
                want = H if rule == "lower" else F
            else:  # promote / no rule: the dtype of the node's activations (16-bit if none)
                rule = "follows"
                others = {types.get(i) for i in n.input if i and i != t.name} & {F, H}
                want = others.pop() if len(others) == 1 else H
            assert t.data_type == want, (t.name, n.op_type, rule)
            kinds[rule] += 1
    assert kinds["lower"] >= 5 and kinds["fp32"] >= 6 and kinds["follows"] >= 4, kinds  # 4+head
    assert {t.data_type for t in proto.graph.initializer if "ln" in t.name} == {F}
    # casts only at rule boundaries: into/out of each LayerNorm and Softmax, plus the output
    casts = [n for n in proto.graph.node if n.op_type == "Cast"]
    assert len(casts) == res.casts == 2 * 3 + 2 * 1 + 1
    assert proto.graph.output[0].type.tensor_type.elem_type == F
    assert onnx_rule("MatMul") == "lower" and onnx_rule("Softmax") == "fp32"
    # dynamic batch: the file runs a batch size it was not exported with
    sess = ort_session(str(tmp_path / "m.onnx"))
    x5 = torch.randint(0, 96, (5, 16))
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x5.numpy()})[0])
    with torch.no_grad():
        assert (
            torch.nn.functional.cosine_similarity(
                got.flatten().double(), gpt(x5).flatten().double(), dim=0
            )
            > 0.999
        )


def test_onnx_bf16_falls_back_to_storage_and_16bit_compute_errors(gpt, tmp_path) -> None:
    onnx = need_onnx()
    fast = mixprec.for_inference(gpt, torch.bfloat16, X)
    if ort_can_run(torch.bfloat16):
        pytest.skip("this ONNX Runtime build runs bf16 MatMul: no fallback to test")
    with pytest.raises(ExportError, match="no torch.bfloat16 MatMul kernel.*compute='fp32'"):
        mixprec.inference.export(
            fast, X, tmp_path / "c.onnx", compute="16bit"
        )  # fails before exporting
    assert not (tmp_path / "c.onnx").exists()
    res = mixprec.inference.export(fast, X, tmp_path / "b.onnx")  # compute="auto"
    assert res.compute == "fp32" and "no torch.bfloat16 MatMul kernel" in res.notes[0]
    assert res.cosine > 0.9999
    proto = onnx.load(tmp_path / "b.onnx")
    bf16 = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.BFLOAT16]
    assert len(bf16) >= 4 and all(t.name.endswith("__low") for t in bf16)
    from onnx import numpy_helper

    w = fast.blocks[0].attn.qkv.weight.float().numpy()  # the torch model's bf16 values, exactly
    arrays = [numpy_helper.to_array(t).astype("float32") for t in bf16]
    assert any(
        (a.shape == w.shape and (a == w).all()) or (a.shape == w.T.shape and (a == w.T).all())
        for a in arrays
    )


def test_torch_export_round_trip_keeps_plan(gpt: nn.Module, tmp_path) -> None:
    fast = mixprec.for_inference(gpt, torch.bfloat16, X)
    res = mixprec.inference.export(fast, X, tmp_path / "m.pt2", format="torch")
    assert res.cosine > 0.99999
    plan = mixprec.inference.prepare.inference_info(fast).storage
    for key, dtype in plan.items():
        assert res.weight_dtypes[key] == str(dtype).replace("torch.", ""), key
    loaded = torch.export.load(tmp_path / "m.pt2").module()
    with torch.no_grad():
        assert loaded(X).dtype == torch.float32


def test_int8_dynamic_refuses_with_fix(tmp_path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)).eval()
    x = torch.randn(8, 16)
    dyn = mixprec.for_inference(net, torch.bfloat16, x, int8="dynamic", int8_modules=["0"])
    for fmt in ("onnx", "torch"):
        with pytest.raises(ExportError, match="cannot trace.*int8='weight_only'"):
            mixprec.inference.export(dyn, x, tmp_path / "d.bin", format=fmt)
    wo = mixprec.for_inference(net, torch.bfloat16, x, int8="weight_only", int8_modules=["0"])
    res = mixprec.inference.export(wo, x, tmp_path / "q.pt2", format="torch")
    assert res.weight_dtypes["0.weight_int8"] == "int8" and res.cosine > 0.9999


class Eigen(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.eigh(x @ x.mT).eigenvalues


def test_unsupported_op_and_bad_arguments(tmp_path) -> None:
    need_onnx()
    x = torch.randn(2, 4, 4)
    with pytest.raises(ExportError, match="cannot export Eigen.*format='torch'"):
        mixprec.inference.export(Eigen(), x, tmp_path / "e.onnx", policy=torch.float16)
    with pytest.raises(ValueError, match="format must be"):
        mixprec.inference.export(Eigen(), x, tmp_path / "e.x", format="tflite")
    with pytest.raises(ValueError, match="compute must be"):
        mixprec.inference.export(Eigen(), x, tmp_path / "e.onnx", compute="int4")
