"""The graph pass on hand-built graphs, mirroring grappler's own test cases.

Each test builds a small graph (fx.symbolic_trace + ShapeProp), runs the pass, and asserts every
node's dtype and the exact number of casts of each kind, then checks the numbers against fp32.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from mixprec.graph import rewrite
from mixprec.graph.paint import build_lists

BF16, FP32 = torch.bfloat16, torch.float32


def opaque(x: torch.Tensor) -> torch.Tensor:
    """An op in no list (grappler's SparseMatMul): a float32 boundary."""
    return x * 1.0


fx.wrap("opaque")


def run(module: nn.Module, *inputs: torch.Tensor, atol: float = 0.05, **opts):
    gm = fx.symbolic_trace(module)
    ShapeProp(gm).propagate(*inputs)
    ref = gm(*inputs)
    result = rewrite(gm, BF16, **opts)
    out = gm(*inputs)
    for r, o in zip(
        ref if isinstance(ref, tuple) else (ref,), out if isinstance(out, tuple) else (out,)
    ):
        assert o.dtype == r.dtype
        torch.testing.assert_close(o, r, atol=atol, rtol=0.05)
    return gm, result


def dtypes(result, *names: str) -> list[torch.dtype]:
    return [result.rewrite.dtypes[n] for n in names]


def counts(result) -> dict[str, int]:
    kinds = ("activation", "input", "weight", "folded", "retargeted", "removed", "implicit")
    return {k: result.rewrite.count(k) for k in kinds if result.rewrite.count(k)}


class Weighted(nn.Module):
    def __init__(self, n: int = 2, d: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.ParameterList(nn.Parameter(torch.randn(d, d) / d**0.5) for _ in range(n))


def test_no_allow_op_leaves_graph_unchanged():
    class M(nn.Module):
        def forward(self, x):
            return torch.relu(torch.sqrt(torch.relu(torch.exp(x))))

    _gm, r = run(M(), torch.rand(4, 8))
    assert counts(r) == {}
    assert set(r.rewrite.dtypes.values()) == {FP32}
    assert not r.colouring.allow


def test_simple_matches_grappler():
    """grappler ``Simple``: exp(deny) relu sqrt(infer) relu MatMul relu tanh relu opaque relu."""

    class M(Weighted):
        def forward(self, x):
            a = torch.relu(torch.exp(x))
            b = torch.relu(torch.sqrt(a))
            c = torch.relu(torch.matmul(b, self.w[0]))
            d = torch.relu(torch.tanh(c))
            return torch.relu(opaque(d))

    gm, r = run(M(n=1), torch.rand(4, 8))
    assert dtypes(r, "exp", "relu", "sqrt") == [FP32] * 3  # deny, then deny-propagated
    assert dtypes(r, "relu_1", "matmul", "relu_2") == [BF16] * 3
    assert dtypes(r, "tanh", "relu_3", "opaque", "relu_4") == [FP32] * 4
    assert "deny propagates from exp" in r.colouring.reason[_node(gm, "sqrt")]
    assert counts(r) == {"activation": 2, "weight": 1}


def test_deny_propagation_stops_before_allow():
    """grappler's comment: deny infer clear infer clear allow infer -> D D D D clear allow infer."""

    class M(Weighted):
        def forward(self, x):
            a = torch.sigmoid(torch.relu(torch.tanh(torch.exp(x))))
            b = torch.matmul(torch.relu(a), self.w[0])
            return torch.tanh(b)

    gm, r = run(M(n=1), torch.rand(4, 8))
    assert dtypes(r, "exp", "tanh", "relu", "sigmoid") == [FP32] * 4
    assert {_node(gm, n) for n in ("tanh", "relu", "sigmoid")} <= r.colouring.deny
    assert dtypes(r, "relu_1", "matmul") == [BF16, BF16]
    assert dtypes(r, "tanh_1") == [FP32]  # infer after the last allow op: not sandwiched
    assert counts(r) == {"activation": 2, "weight": 1}


def test_allow_infer_allow_chain_is_all_16bit():
    class M(Weighted):
        def forward(self, x):
            return torch.matmul(torch.nn.functional.gelu(torch.matmul(x, self.w[0])), self.w[1])

    _gm, r = run(M(), torch.randn(4, 8))
    assert dtypes(r, "matmul", "gelu", "matmul_1") == [BF16] * 3
    assert counts(r) == {"input": 1, "activation": 1, "weight": 2}  # x in, result out


def test_clear_chain_between_allow_ops_needs_no_cast():
    class M(Weighted):
        def forward(self, x):
            h = torch.matmul(x, self.w[0])
            h = torch.relu(h.transpose(0, 1).reshape(4, 8))
            return torch.matmul(h, self.w[1])

    _gm, r = run(M(), torch.randn(4, 8))
    assert dtypes(r, "matmul", "transpose", "reshape", "relu", "matmul_1") == [BF16] * 5
    assert counts(r) == {"input": 1, "activation": 1, "weight": 2}


def test_existing_cast_is_retargeted_to_16bit():
    """grappler ``ExistingCast``: bool -> float feeding only allow ops becomes bool -> half."""

    class M(Weighted):
        def forward(self, mask):
            return torch.matmul(mask.float(), self.w[0])

    _gm, r = run(M(n=1), torch.rand(4, 8) > 0.5)
    assert dtypes(r, "float_1", "matmul") == [BF16, BF16]
    assert counts(r) == {"retargeted": 1, "activation": 1, "weight": 1}


def test_existing_noop_cast_is_removed_and_needed_one_kept():
    class M(Weighted):
        def forward(self, x):
            a = torch.exp(x.float())  # x is float32 already: the cast goes
            b = torch.matmul(a, self.w[0]).float()  # bf16 -> fp32 before softmax: it stays
            return torch.softmax(b, -1)

    gm, r = run(M(n=1), torch.rand(4, 8))
    assert "float_1" not in [n.name for n in gm.graph.nodes]
    assert dtypes(r, "float_2", "softmax") == [FP32, FP32]
    assert counts(r) == {"removed": 1, "activation": 1, "weight": 1}


def test_unrolled_recurrence_keeps_state_16bit_between_steps():
    """A loop is unrolled by capture (no back edge): the state is 16-bit wherever it flows
    from one step's matmuls into the next step's, and float32 where it leaves the loop."""

    class RNN(Weighted):
        def forward(self, x, h):
            for t in range(3):
                h = torch.tanh(torch.matmul(x[t], self.w[0]) + torch.matmul(h, self.w[1]))
            return h

    _gm, r = run(RNN(), torch.randn(3, 4, 8), torch.zeros(4, 8))
    assert dtypes(r, "tanh", "tanh_1") == [BF16, BF16]
    assert dtypes(r, "tanh_2") == [FP32]
    assert dtypes(r, "add_2") == [FP32]  # sum of the last step, not followed by an allow op


def test_multi_output_node_and_getitems_share_one_colour():
    class M(Weighted):
        def forward(self, x):
            a, b = torch.matmul(x, self.w[0]).split(4, dim=-1)
            return torch.matmul(torch.cat([b, a], -1), self.w[1]), a.exp()

    _gm, r = run(M(), torch.randn(4, 8))
    split_group = ["split", "getitem", "getitem_1"]
    assert len(set(dtypes(r, *split_group))) == 1


def test_zero_dim_constant_is_not_cast_and_buffer_is_folded():
    class M(Weighted):
        def __init__(self):
            super().__init__(n=1)
            self.register_buffer("table", torch.randn(8, 8))

        def forward(self, x):
            h = torch.matmul(x, self.w[0]) * torch.tensor(0.5)
            return torch.matmul(h, self.table)

    _gm, r = run(M(), torch.randn(4, 8))
    assert dtypes(r, "mul", "matmul_1") == [BF16, BF16]
    assert counts(r) == {"input": 1, "activation": 1, "weight": 1, "folded": 1}


def test_promote_op_with_float32_input_uses_type_promotion_not_a_cast():
    class M(Weighted):
        def forward(self, x):
            return torch.exp(x + torch.matmul(x, self.w[0]))

    _gm, r = run(M(n=1), torch.randn(4, 8))
    assert dtypes(r, "matmul", "add") == [BF16, FP32]
    assert counts(r) == {"input": 1, "weight": 1, "implicit": 1}


def test_batch_norm_casts_only_its_data_input():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn, self.conv2 = (
                nn.Conv1d(2, 4, 3),
                nn.BatchNorm1d(4),
                nn.Conv1d(4, 4, 3),
            )

        def forward(self, x):
            return self.conv2(self.bn(self.conv1(x)))

    m = M().eval()
    m.bn.running_mean.uniform_(-0.5, 0.5)
    gm = fx.symbolic_trace(m, concrete_args=None)
    # symbolic_trace keeps leaf modules; inline them as functional calls for the pass
    gm = fx.symbolic_trace(_Functional(m))
    x = torch.randn(3, 2, 16)
    ShapeProp(gm).propagate(x)
    ref = gm(x)
    r = rewrite(gm, BF16)
    assert dtypes(r, "batch_norm") == [BF16]
    bn = _node(gm, "batch_norm")
    assert all(a.op == "get_attr" for a in bn.args[1:5] if isinstance(a, fx.Node))  # uncast
    torch.testing.assert_close(gm(x), ref, atol=0.1, rtol=0.05)


class _Functional(nn.Module):
    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, x):
        F = torch.nn.functional
        m = self.m
        h = F.conv1d(x, m.conv1.weight, m.conv1.bias)
        h = F.batch_norm(
            h, m.bn.running_mean, m.bn.running_var, m.bn.weight, m.bn.bias, False, 0.1, 1e-5
        )
        return F.conv1d(h, m.conv2.weight, m.conv2.bias)


def test_overrides_move_ops_and_force_modules():
    class M(Weighted):
        def forward(self, x):
            return torch.matmul(torch.tanh(torch.matmul(x, self.w[0])), self.w[1])

    _, r = run(M(), torch.randn(4, 8), ops={"tanh": "deny"})
    assert dtypes(r, "matmul", "tanh", "matmul_1") == [BF16, FP32, BF16]
    _, r = run(M(), torch.randn(4, 8), ops={"matmul": None})
    assert set(r.rewrite.dtypes.values()) == {FP32}
    assert "in no list" in next(iter(r.colouring.fixed.values()))


def test_lists_follow_the_cast_table_and_validate_overrides():
    lists = build_lists()
    assert "linear" in lists.allow and "softmax" in lists.deny and "add" in lists.infer
    assert "view" in lists.clear
    assert "softmax" in build_lists(fp32_inside=True).infer
    from mixprec.numerics import cast_rules

    with cast_rules({"softmax": "lower"}):
        assert "softmax" in build_lists().allow
    with pytest.raises(ValueError, match="Unknown list 'white'"):
        build_lists(ops={"gelu": "white"})
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        rewrite(fx.symbolic_trace(nn.Identity()), torch.float64)


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)
