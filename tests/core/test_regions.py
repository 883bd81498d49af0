"""The engine as torch sees it: torch.autocast's own op lists, torch.compile, torch.export,
activation checkpointing, and the kernel registry."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec._core import _autocast_rules, traced
from mixprec._core.cast_table import DEFAULT_TABLE, cast_rules
from mixprec._core.torch_lists import TORCH_AUTOCAST

BF16 = torch.bfloat16


# --------------------------------------------------------------------------- torch's lists

_TORCH_KERNELS = """
import json, torch
names = torch._C._dispatch_get_all_op_names()
print(json.dumps({key: sorted({n[6:].split(".")[0] for n in names if n.startswith("aten::")
                               and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)})
                  for key in ("AutocastCPU", "AutocastCUDA")}))
"""


@pytest.mark.skipif(
    not torch.__version__.startswith("2.13"), reason="the lists are recorded from torch 2.13"
)
def test_torch_lists_match_the_running_torch():
    """The data table names exactly the ops torch registers autocast kernels for (asked in a
    fresh process: here mixprec's own kernels are registered on the same keys)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _TORCH_KERNELS], capture_output=True, text=True, check=True
    ).stdout
    have = json.loads(out)
    assert set(have["AutocastCPU"]) == set(TORCH_AUTOCAST["cpu"])
    assert set(have["AutocastCUDA"]) == set(TORCH_AUTOCAST["cuda"])


def _autocast_list_cases():
    pytest.importorskip("expecttest")
    from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists

    lists = AutocastCPUTestLists(torch.device("cpu"))
    cases = []
    for attr, namespace in (
        ("torch_16", torch),
        ("nn_16", torch._C._nn),
        ("torch_fp32", torch),
        ("nn_fp32", torch._C._nn),
        ("torch_need_autocast_promote", torch),
    ):
        for entry in getattr(lists, attr):
            name, args = entry[0], entry[1]
            kwargs = next((e for e in entry[2:] if isinstance(e, dict)), {})
            cases.append((f"{attr}.{name}", getattr(namespace, name), args, kwargs))
    return cases


def _dtypes(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o.dtype for o in outs if isinstance(o, torch.Tensor)]


def test_ops_follow_torch_autocast_where_the_table_agrees():
    """Every op of torch's own CPU autocast test lists gets torch's dtypes in a mixprec region
    (the table either does not list it -- then torch's device rule applies -- or agrees)."""
    for label, fn, args, kwargs in _autocast_list_cases():
        with torch.autocast("cpu", BF16):
            ref = fn(*args, **kwargs)
        with mixprec.autocast(BF16):
            got = fn(*args, **kwargs)
        assert _dtypes(got) == _dtypes(ref), label


@pytest.mark.parametrize(
    ("name", "call", "want"),
    [
        ("reflection_pad1d", lambda x: F.pad(x, (1, 1), mode="reflect"), torch.float32),
        ("replication_pad1d", lambda x: F.pad(x, (1, 1), mode="replicate"), torch.float32),
        ("max_pool3d", lambda x: F.max_pool3d(x[None], 1), torch.float32),
        ("adaptive_avg_pool3d", lambda x: F.adaptive_avg_pool3d(x[None], 1), torch.float32),
        ("linalg_vecdot", lambda x: torch.linalg.vecdot(x, x), BF16),
        ("gelu (no rule anywhere)", F.gelu, BF16),
    ],
)
def test_unlisted_ops_follow_torch_autocasts_cpu_rule(name, call, want):
    """Ops the cast table does not list run as torch.autocast runs them on the device."""
    x = torch.randn(2, 3, 4, dtype=BF16)
    assert name.split()[0] not in DEFAULT_TABLE
    with torch.autocast("cpu", BF16):
        ref = call(x)
    with mixprec.autocast(BF16):
        got = call(x)
    assert got.dtype == ref.dtype == want


def test_kernels_leave_a_plain_torch_autocast_region_as_torch_has_it():
    x = torch.randn(3, 4)
    with mixprec.autocast(BF16):  # registers mixprec's kernels
        assert torch.softmax(x.to(BF16), -1).dtype == torch.float32
    assert ("cpu", "softmax.int") in _autocast_rules.registered()
    with torch.autocast("cpu", BF16):
        y = torch.mm(x, x.t())
        assert y.dtype == BF16
        assert torch.softmax(y, -1).dtype == BF16  # torch's CPU rule: no fp32 for softmax
        assert F.layer_norm(y, (3,)).dtype == BF16
        with pytest.raises(RuntimeError):  # torch's promotion rejects a second 16-bit dtype
            torch.cat([y, y.half()])


def test_a_rule_set_back_gives_the_op_back_to_torch():
    x = torch.randn(2, 3)
    with cast_rules({torch.mm: "fp32"}):
        with mixprec.autocast(BF16):
            assert torch.mm(x, x.t()).dtype == torch.float32
        assert ("cpu", "mm") in _autocast_rules.registered()
    with mixprec.autocast(BF16):
        assert torch.mm(x, x.t()).dtype == BF16  # torch's own kernel again
    assert ("cpu", "mm") not in _autocast_rules.registered()


# --------------------------------------------------------------------------- compile / export


class _Net(nn.Module):
    def __init__(self, ckpt: bool | None = None):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_Block(16) for _ in range(2))
        self.head = nn.Linear(16, 4)
        self.ckpt = ckpt  # None: no checkpointing; else use_reentrant

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h) if self.ckpt is None else checkpoint(block, h, use_reentrant=self.ckpt)
        return self.head(h)


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.ln(x)))).softmax(-1)


def _init(level: str, model: nn.Module | None = None, dtype=BF16, **kw):
    torch.manual_seed(0)
    model = model or _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return mixprec.initialize(model, opt, mixprec.Recipe(level, dtype, **kw))


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_compile_has_no_graph_breaks_and_matches_eager(level):
    torch._dynamo.reset()
    model, _ = _init(level)
    explained = torch._dynamo.explain(model)(X)
    if traced.dynamo_traces_autocast_setters():  # torch >= 2.13
        assert explained.graph_break_count == 0 and explained.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    assert torch.equal(compiled(X), model(X))  # the compiled graph has the engine's casts


def test_compile_does_not_recompile_when_the_loss_scale_changes():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model, opt = _init("O2", dtype=torch.float16, loss_scale="dynamic")
    scaler = opt.slot(0).scaler
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def scaled_loss(x):
        return scaler.scale_loss(model(x).float().pow(2).mean())

    scales, compiled = [], []
    for _step in range(3):
        loss = scaled_loss(X)
        assert torch.equal(loss, model(X).float().pow(2).mean() * scaler.scale)
        scales.append(scaler.scale)
        compiled.append(counter.frame_count)
        scaler.update(found_inf=True)  # an overflow: the scale halves
    assert scales == [scales[0], scales[0] / 2, scales[0] / 4]
    assert compiled == [compiled[0]] * 3  # compiled once, never again
    if traced.dynamo_traces_autocast_setters():
        assert compiled[0] == 1


def test_export_records_the_engine_casts():
    model = mixprec.for_inference(_Net().eval(), BF16, X)
    program = torch.export.export(model, (X,))
    targets = [str(n.target) for n in program.graph.nodes]
    assert any("_to_copy" in t or t.endswith(".to") or "to.dtype" in t for t in targets)
    with torch.no_grad():
        assert torch.equal(program.module()(X), model(X))


# --------------------------------------------------------------------------- checkpointing


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_activation_checkpointing_gives_bitwise_equal_gradients(level, reentrant):
    base = _Net()
    grads = []
    for ckpt in (None, reentrant):
        model = copy.deepcopy(base)
        model.ckpt = ckpt
        model, opt = _init(level, model)
        opt.backward(model(X).float().pow(2).mean())
        # the fp32 gradients the optimizer steps (masters at O2, the weights' own otherwise)
        grads.append([p.grad for group in opt.param_groups for p in group["params"]])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_checkpointing_inside_a_plain_region():
    torch.manual_seed(0)
    block = _Block(8)
    x = torch.randn(3, 8, requires_grad=True)
    grads = []
    for use_ckpt in (False, True):
        x.grad = None
        block.zero_grad()
        with mixprec.autocast(BF16):
            y = checkpoint(block, x, use_reentrant=False) if use_ckpt else block(x)
        y.float().sum().backward()
        grads.append([x.grad.clone(), *(p.grad.clone() for p in block.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_graph_compile_many_models_in_one_process():
    """Each graph.compile has its own dynamo cache: the tenth model is compiled like the first
    (a shared cache hits dynamo's recompile limit and runs 16-bit weights uncast in eager)."""
    from mixprec import graph

    policy = mixprec.Policy(
        compute_dtype=BF16, param_dtype=torch.float32, output_dtype=torch.float32
    )
    limit = torch._dynamo.config.recompile_limit
    for _ in range(limit + 2):
        model = _Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled, opt = mixprec.initialize(
            graph.compile(model, policy, compiler="aot_eager"), opt, "O2", BF16
        )
        out = compiled(X)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert set(compiled.state_dict()) == {f"_orig_mod.{k}" for k in model.state_dict()}
