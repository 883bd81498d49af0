"""docs/ops.md and the README say what runs: checked against the cast table and the engine.

The "What runs" table of docs/ops.md states, per op and level, which dtypes the forward kernels
receive and return. This file runs every row: a small module (a Linear or Conv1d that makes a
16-bit activation, then the op) under ``mixprec.autocast`` and ``mixprec.initialize`` at O1, O2
and O3, in bfloat16 and float16, on CPU. A ``TorchDispatchMode`` sits below torch.autocast and
mixprec's kernels, so it records the aten kernels that really ran, with the dtypes they got and
returned. "fp32 inside" is checked by running the same kernel again on the same inputs in
float32: the 16-bit result must be that result rounded (within 4 units in the last place); the
page's other two notes on precision have their own checks (``check_cell``).
The page's rows and this file's probes must match one to one, so neither goes unchecked; the
README's sentences about dtypes are checked against the page's cells.
"""

from __future__ import annotations

import contextlib
import functools
import math
import pathlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec._core import _autocast_rules, cast_table
from mixprec._core.cast_table import FP32, PYTHON_FUNCTIONS, rule_for
from mixprec._core.torch_lists import torch_rule

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPS = ROOT / "docs" / "ops.md"
README = ROOT / "README.md"

BF16, FP16, F32 = torch.bfloat16, torch.float16, torch.float32
LOW = (BF16, FP16)
# the page's level columns, and the runs each one stands for
COLUMNS = {"`mixprec.autocast`, O1": ("autocast", "O1"), "O2": ("O2",), "O3": ("O3",)}

# -------------------------------------------------------------------------- recording kernels


def _floats(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _floats(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _floats(x)]
    return []


def _upcast(obj: Any) -> Any:
    """Fresh copies, floating ones in float32: re-running a kernel must not touch the module."""
    if isinstance(obj, torch.Tensor):
        wide = obj.is_floating_point() and obj.dtype != torch.float64
        return obj.detach().to(F32 if wide else obj.dtype, copy=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_upcast(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _upcast(v) for k, v in obj.items()}
    return obj


def ulp_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest ``|out - ref|`` in units in the last place of ``out``'s dtype at ``ref``.

    Results far below the tensor's largest one are measured at 1/64 of it: where a result
    cancels to near 0 (a normalized value, a tiny probability), no 16-bit kernel keeps its
    relative precision, and none is claimed.
    """
    o, r = out.double(), ref.double()
    finfo = torch.finfo(out.dtype)
    mantissa = round(-math.log2(finfo.eps))
    at = r.abs().clamp_min(r.abs().max() / 64 if r.numel() else 0).clamp_min(finfo.tiny)
    ulp = torch.exp2(torch.floor(torch.log2(at)) - mantissa)
    diff = torch.where(o == r, 0.0, (o - r).abs())  # equal infinities are exact
    return (diff / ulp).max().item() if diff.numel() else 0.0


@dataclass
class Call:
    name: str
    ins: list[torch.dtype]
    outs: list[torch.dtype]
    ulps: float | None = None  # a 16-bit result against the same kernel run in float32
    out: torch.Tensor | None = None  # that 16-bit result
    wide: tuple = ()  # (args, kwargs) of that float32 run


class KernelLog(TorchDispatchMode):
    """Records every aten kernel call: floating input and output dtypes, and how far a 16-bit
    result is from the float32 run of the same kernel on the same inputs."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        ins, outs = _floats((args, kwargs)), _floats(out)
        call = Call(name, [t.dtype for t in ins], [t.dtype for t in outs])
        if ins and outs and outs[0].dtype in LOW and not func.is_view and name != "_to_copy":
            call.wide = (_upcast(args), _upcast(kwargs))
            call.out = outs[0].detach().clone()
            call.ulps = ulp_error(call.out, _floats(func(*_upcast(args), **_upcast(kwargs)))[0])
        self.calls.append(call)
        return out


# -------------------------------------------------------------------------- probes


class Then(nn.Module):
    """``op(first(x))``: ``first`` makes the 16-bit activation the op receives."""

    def __init__(self, first: nn.Module, op: nn.Module | Callable) -> None:
        super().__init__()
        self.first = first
        self.op = op

    def forward(self, x):
        return self.op(self.first(x))


def linear(n_in: int, n_out: int, std: float, mean: float = 0.0) -> nn.Linear:
    """A Linear whose outputs are about ``N(mean, std)`` for ``N(0, 1)`` inputs."""
    lin = nn.Linear(n_in, n_out)
    with torch.no_grad():
        lin.weight.normal_(0.0, std / math.sqrt(n_in))
        lin.bias.fill_(mean)
    return lin


def offset_activation() -> nn.Linear:
    # mean 32, spread 1: a norm that computed its statistics in 16-bit would be far off
    return linear(16, 16, std=1.0, mean=32.0)


class Attention(nn.Module):
    def __init__(self, mask: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv = linear(16, 48, std=2.0)
        self.mask, self.dropout = mask, dropout

    def forward(self, x):  # x: (batch, time, 16)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        if self.mask:
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)


@dataclass(frozen=True)
class Probe:
    build: Callable[[], nn.Module]
    shape: tuple[int, ...] = (8, 16)
    grad: bool = True  # run the forward with gradients enabled
    train: bool = True  # module.train(train)
    dtypes: tuple[torch.dtype, ...] = LOW
    kernels: str = "auto"  # for mixprec.autocast and initialize


def _tensor_op(fn: Callable) -> Callable[[], nn.Module]:
    return lambda: Then(linear(16, 16, std=3.0), fn)


TARGET = torch.tensor([0, 3, 5, 7, 1, 2, 4, 6])

# the first column of each row of the page's "What runs" table -> the probes that run it
PROBES: dict[str, list[Probe]] = {
    "`nn.Linear`": [Probe(lambda: linear(16, 16, std=1.0, mean=4.0))],
    "`nn.Conv1d`": [Probe(lambda: nn.Conv1d(4, 8, 3), shape=(2, 4, 10))],
    # 2 x 2 heads x 256 x 256 x head size 8 = 2**21 multiply-adds: the smallest that decomposes
    "`F.scaled_dot_product_attention`: bfloat16, training, large": [
        Probe(Attention, shape=(2, 256, 16), dtypes=(BF16,)),
    ],
    '`F.scaled_dot_product_attention`: float16, no gradient, a mask, small, `kernels="torch"`': [
        Probe(Attention, shape=(2, 8, 16), dtypes=(FP16,)),
        Probe(Attention, shape=(2, 8, 16), dtypes=(BF16,)),
        Probe(Attention, shape=(2, 8, 16), grad=False),
        Probe(lambda: Attention(mask=True), shape=(2, 8, 16), dtypes=(BF16,)),
        Probe(Attention, shape=(2, 8, 16), dtypes=(BF16,), kernels="torch"),
    ],
    "`F.scaled_dot_product_attention`: dropout": [
        Probe(lambda: Attention(dropout=0.1), shape=(2, 8, 16)),
    ],
    "`F.softmax`, `F.log_softmax`": [
        Probe(_tensor_op(lambda h: F.softmax(h, -1))),
        Probe(_tensor_op(lambda h: F.log_softmax(h, -1))),
    ],
    "`nn.LayerNorm`, `nn.GroupNorm`": [
        Probe(lambda: Then(offset_activation(), nn.LayerNorm(16))),
        Probe(lambda: Then(offset_activation(), nn.GroupNorm(4, 16))),
    ],
    "`nn.RMSNorm`": [Probe(lambda: Then(offset_activation(), nn.RMSNorm(16)))],
    "`nn.BatchNorm1d`, `nn.InstanceNorm1d`, training": [
        Probe(lambda: Then(offset_activation(), nn.BatchNorm1d(16))),
        Probe(lambda: Then(offset_activation(), nn.InstanceNorm1d(4, affine=True)), (2, 4, 16)),
    ],
    "`nn.BatchNorm1d`, eval": [
        Probe(lambda: Then(offset_activation(), nn.BatchNorm1d(16)), train=False),
    ],
    "`torch.sum`, `torch.mean`": [Probe(_tensor_op(lambda h: h.sum(-1) + h.mean(-1)))],
    "`torch.exp`, `torch.log`": [Probe(_tensor_op(lambda h: h.exp() + h.abs().log()))],
    "`F.cross_entropy`, `F.mse_loss`": [
        Probe(_tensor_op(lambda h: F.cross_entropy(h, TARGET))),
        Probe(_tensor_op(lambda h: F.mse_loss(h, torch.ones(8, 16)))),
    ],
}


@functools.cache
def run(probe: Probe, level: str, dtype: torch.dtype) -> tuple[Call, ...]:
    """The kernels ``probe``'s forward runs at ``level`` ("autocast" or O1-O3) in ``dtype``."""
    torch.manual_seed(0)
    model = probe.build()
    x = torch.randn(probe.shape, generator=torch.Generator().manual_seed(1))
    if level == "autocast":
        region = mixprec.autocast(mixprec.Recipe("O1", dtype, kernels=probe.kernels))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, _ = mixprec.initialize(
            model, opt, mixprec.Recipe(level, dtype, kernels=probe.kernels)
        )
        region = contextlib.nullcontext()
    model.train(probe.train)
    log = KernelLog()
    with torch.set_grad_enabled(probe.grad), region, log:
        model(x)
    return tuple(log.calls)


# -------------------------------------------------------------------------- the page


def _table(text: str, name: str) -> list[list[str]]:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    assert begin in text and end in text, f"docs/ops.md has no {begin} ... {end} table"
    body = text.split(begin, 1)[1].split(end, 1)[0]
    rows = [ln.strip() for ln in body.strip().splitlines() if ln.strip().startswith("|")]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows]


def what_runs() -> tuple[list[str], dict[str, dict[str, str]]]:
    """(header, {first cell: {column: cell}}) of the page's "What runs" table."""
    header, _, *rows = _table(OPS.read_text(), "what-runs")
    return header, {r[0]: dict(zip(header, r)) for r in rows}


def _kernels(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


CELL = re.compile(
    r"^(?P<dtypes>16-bit|fp32|16-bit, fp32 weights)"
    r"(?: \((?P<inside>fp32 inside|16-bit probabilities|16-bit statistics)\))?$"
)
INSIDE_ULPS = 4  # the page's legend: "(fp32 inside)" is within 4 ulps of the float32 run
STATISTICS_ULPS = 32  # ... and "(16-bit statistics)" more than 32 off it, on this file's data


def flash_attention_reference(call: Call) -> torch.Tensor:
    """What the page says torch's fused CPU kernel computes: scores, their row max and the sum
    of exponentials in float32, the exponentials rounded to 16-bit before they multiply V
    (valid while the keys fit in one of the kernel's blocks, as here)."""
    (q, k, v, *rest), kwargs = call.wide
    causal = bool(rest[1]) if len(rest) > 1 else kwargs.get("is_causal", False)
    mask, scale = kwargs.get("attn_mask"), kwargs.get("scale")
    scores = (q @ k.transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores + mask
    e = (scores - scores.amax(-1, keepdim=True)).exp()
    return (e.to(call.out.dtype).float() @ v) / e.sum(-1, keepdim=True)


def check_cell(cell: str, call: Call, dtype: torch.dtype) -> str | None:
    """Why ``call`` contradicts ``cell`` (None when it agrees)."""
    m = CELL.match(cell)
    if m is None:
        return f"cell {cell!r} is not one of the phrases the page's legend defines"
    first, rest, out = call.ins[0], call.ins[1:], call.outs[0]
    kind, inside = m["dtypes"], m["inside"]
    if kind == "fp32":
        ok = all(d == F32 for d in call.ins) and out == F32
    elif kind == "16-bit":
        ok = all(d == dtype for d in call.ins) and out == dtype
    else:
        ok = first == dtype and bool(rest) and all(d == F32 for d in rest) and out == dtype
    if not ok:
        return f"{call.name} received {call.ins} and returned {call.outs}, not {kind}"
    if inside == "fp32 inside" and not call.ulps <= INSIDE_ULPS:
        return f"{call.name} is {call.ulps:.2f} ulps from its float32 run, not fp32 inside"
    if inside == "16-bit probabilities":
        ulps = ulp_error(call.out, flash_attention_reference(call))
        if not (ulps <= 2 and call.outs[1:2] == [F32]):
            return f"{call.name} is {ulps:.2f} ulps from the page's description"
    if inside == "16-bit statistics" and not (
        all(d == dtype for d in call.outs) and call.ulps > STATISTICS_ULPS
    ):
        return (
            f"{call.name} returned {call.outs}, {call.ulps:.2f} ulps from its float32 run: "
            "the page says 16-bit statistics, far off the float32 result"
        )
    return None


# -------------------------------------------------------------------------- the tests


def test_the_norm_probes_would_expose_a_kernel_that_sums_in_16bit():
    """ "(fp32 inside)" can fail: on the norm probes' activation (mean 32, spread 1), a layer norm
    whose mean and variance were summed in 16-bit is far outside the page's 4 ulps."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    h32 = offset_activation()(x).detach()
    for dtype in LOW:
        h = h32.to(dtype)

        def sum16(t):  # left to right, each partial sum rounded to 16-bit
            total = torch.zeros(t.shape[:-1], dtype=t.dtype)
            for i in range(t.shape[-1]):
                total = total + t[..., i]
            return total

        mean = (sum16(h) / 16)[..., None]
        var = (sum16((h - mean) ** 2) / 16)[..., None]
        summed_in_16bit = (h - mean) / (var + 1e-5).sqrt()
        assert ulp_error(summed_in_16bit, F.layer_norm(h.float(), (16,))) > 8 * INSIDE_ULPS


def test_every_row_of_the_page_has_a_probe_and_every_probe_a_row():
    header, rows = what_runs()
    assert header[2:] == list(COLUMNS), f"the level columns are {header[2:]}"
    assert set(rows) == set(PROBES), (
        f"rows without a probe here: {sorted(set(rows) - set(PROBES))}; "
        f"probes without a row on the page: {sorted(set(PROBES) - set(rows))}"
    )


CASES = [
    (row, column, dtype)
    for row, probes in PROBES.items()
    for column in COLUMNS
    for dtype in LOW
    if any(dtype in p.dtypes for p in probes)
]


@pytest.mark.parametrize(
    ("row", "column", "dtype"),
    CASES,
    ids=[f"{re.sub(r'[^a-zA-Z0-9]+', '_', r)[:40]}-{c[-2:]}-{d}" for r, c, d in CASES],
)
def test_the_page_says_what_the_kernels_receive(row, column, dtype):
    _, rows = what_runs()
    cells = rows[row]
    kernels = _kernels(cells["CPU kernel"])
    assert kernels, f"row {row!r} names no kernel"
    seen: set[str] = set()
    for level in COLUMNS[column]:
        for probe in (p for p in PROBES[row] if dtype in p.dtypes):
            for call in run(probe, level, dtype):
                if call.name in kernels:
                    seen.add(call.name)
                    why = check_cell(cells[column], call, dtype)
                    assert why is None, f"{row}, {level}, {dtype}: {why}"
    assert seen == set(kernels), f"{row}: kernels {sorted(set(kernels) - seen)} never ran"


def _row(part: str) -> str:
    (row,) = [r for r in PROBES if part in r]
    return row


def test_the_decomposed_attention_rounds_the_scores_and_loses_to_the_fused_kernel():
    """The page: the scores reach the softmax in bfloat16, so with large scores the decomposed
    path's output is further from float32 attention than the fused kernel's."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 2, 256, 16, generator=g) * 8).to(BF16).requires_grad_()
    k, v = (torch.randn(2, 2, 256, 16, generator=g).to(BF16) for _ in range(2))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)

    def error(out):
        return ((out.double() - exact).norm() / exact.norm()).item()

    log = KernelLog()
    with mixprec.autocast(BF16), log:
        decomposed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (softmax,) = [c for c in log.calls if c.name == "_softmax"]
    assert softmax.ins == [BF16] and softmax.outs == [BF16]
    with mixprec.autocast(BF16), torch.no_grad():
        fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert error(decomposed) > 2 * error(fused)


def test_attention_with_dropout_runs_in_fp32_as_under_torch_autocast():
    """The page: with dropout, torch's math backend computes on float32 copies of the 16-bit
    query, key and value and returns 16-bit, under mixprec.autocast as under torch.autocast."""
    for dtype in LOW:
        kernels = {}
        for name in ("mixprec", "torch"):
            torch.manual_seed(0)
            model = Attention(dropout=0.1)
            x = torch.randn(2, 8, 16)
            region = mixprec.autocast(dtype) if name == "mixprec" else torch.autocast("cpu", dtype)
            log = KernelLog()
            with region, log:
                out = model(x)
            assert out.dtype == dtype
            kernels[name] = [(c.name, c.ins, c.outs) for c in log.calls]
        assert kernels["mixprec"] == kernels["torch"]
        assert ("_to_copy", [dtype], [F32]) in kernels["torch"]


# -------------------------------------------------------------------------- batch norm


def test_batch_norm_has_no_rule_and_an_fp32_rule_would_freeze_16bit_running_stats():
    """Why the cast table leaves batch_norm unlisted (the page, "Batch norm"): with an fp32
    rule, O3's bfloat16 running statistics are cast to copies that the kernel updates, and the
    module's own statistics never move."""
    assert rule_for(F.batch_norm) is None and rule_for(torch.ops.aten.native_batch_norm) is None
    moved = {}
    for rule in (None, FP32):
        torch.manual_seed(0)
        model = Then(offset_activation(), nn.BatchNorm1d(16))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, _ = mixprec.initialize(model, opt, "O3", BF16)
        before = model.op.running_mean.clone()
        with mixprec.numerics.cast_rules({"batch_norm": rule}):
            model(torch.randn(8, 16))
        moved[rule] = not torch.equal(before, model.op.running_mean)
    assert moved == {None: True, FP32: False}


def test_batch_norm_at_o3_with_keep_norm_fp32_runs_as_at_o2():
    for dtype in LOW:
        torch.manual_seed(0)
        model = Then(offset_activation(), nn.BatchNorm1d(16))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, _ = mixprec.initialize(model, opt, mixprec.Recipe("O3", dtype, keep_fp32="norms"))
        log = KernelLog()
        with log:
            model(torch.randn(8, 16))
        (bn,) = [c for c in log.calls if c.name == "native_batch_norm"]
        assert check_cell("16-bit, fp32 weights (fp32 inside)", bn, dtype) is None


def test_o3_bfloat16_running_mean_stops_moving_within_a_few_percent():
    """The page: at O3 a bfloat16 running mean does not move while the batch means stay within
    2-4% of it (momentum 0.1); keep_norm_fp32=True keeps it moving."""
    means = {}
    for keep in (False, True):
        model = nn.BatchNorm1d(4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, _ = mixprec.initialize(
            model, opt, mixprec.Recipe("O3", BF16, keep_fp32="norms" if keep else "none")
        )
        model.running_mean.fill_(10.0)
        for _ in range(5):
            model(torch.full((8, 4), 10.25))  # 2.5% above the running mean
        means[keep] = model.running_mean.float()
    assert torch.equal(means[False], torch.full((4,), 10.0))
    assert (means[True] > 10.1).all()


# -------------------------------------------------------------------------- Python functions


def _has_aten_op(name: str) -> bool:
    return bool(_autocast_rules._overloads(name))


def test_python_functions_are_exactly_the_entries_without_an_aten_op():
    assert {n for n in cast_table.DEFAULT_TABLE if not _has_aten_op(n)} == PYTHON_FUNCTIONS


PYTHON_CALLS: dict[str, Callable] = {
    "F.softmin": lambda h: F.softmin(h, -1),
    "F.normalize": F.normalize,
    # an image batch (N, C, H, W): the page's row
    "F.local_response_norm": lambda h: F.local_response_norm(h.unflatten(-1, (4, 2, 2)), 2),
    "F.cross_entropy": lambda h: F.cross_entropy(h, TARGET),
    "F.gaussian_nll_loss": lambda h: F.gaussian_nll_loss(h, torch.zeros(8, 16), torch.ones(8, 16)),
    "F.multilabel_soft_margin_loss": lambda h: F.multilabel_soft_margin_loss(h, torch.ones(8, 16)),
}


def _sixteen_bit_kernels(fn: Callable, level: str, dtype: torch.dtype) -> set[str]:
    calls = run(Probe(_tensor_op(fn)), level, dtype)
    first = next(i for i, c in enumerate(calls) if c.name == "addmm")
    return {
        c.name
        for c in calls[first + 1 :]
        if c.outs and c.outs[0] == dtype and c.ulps is not None  # not views, not casts
    }


def test_the_page_names_the_16bit_kernels_of_each_python_function():
    header, _, *rows = _table(OPS.read_text(), "python-functions")
    assert header == ["function", "kernels that return 16-bit: O1", "O2, O3"]
    named = {r[0].strip("`"): r for r in rows}
    assert {n.removeprefix("F.") for n in named} == PYTHON_FUNCTIONS
    assert set(named) == set(PYTHON_CALLS)
    for name, (_, at_o1, at_o23) in named.items():
        for dtype in LOW:
            for level, cell in (
                ("autocast", at_o1),
                ("O1", at_o1),
                ("O2", at_o23),
                ("O3", at_o23),
            ):
                expected = set(_kernels(cell)) if cell != "none" else set()
                got = _sixteen_bit_kernels(PYTHON_CALLS[name], level, dtype)
                assert got == expected, f"{name} at {level} in {dtype}: 16-bit kernels {got}"
    # the page: with a 3-D input the pooling is avg_pool2d, which torch.autocast leaves in 16-bit
    three_d = _sixteen_bit_kernels(
        lambda h: F.local_response_norm(h.unflatten(-1, (4, 4)), 2), "O1", BF16
    )
    assert three_d == {"mul", "constant_pad_nd", "avg_pool2d", "add"}
    assert torch_rule("cpu", "avg_pool3d") == FP32 and torch_rule("cuda", "avg_pool3d") is None


def test_torch_export_of_a_region_applies_a_python_function_entry_whole():
    """The page: torch.export sees F.multilabel_soft_margin_loss whole, so its logsigmoid gets
    float32 input there, where eager mode runs it in 16-bit."""

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x, y):
            with mixprec.autocast(BF16):
                return F.multilabel_soft_margin_loss(self.lin(x), y)

    program = torch.export.export(Loss(), (torch.randn(8, 16), torch.ones(8, 16)))
    log_sigmoid = [
        n
        for n in program.graph.nodes
        if n.op == "call_function" and n.target == torch.ops.aten.log_sigmoid.default
    ]
    assert log_sigmoid and all(n.meta["val"].dtype == F32 for n in log_sigmoid)
    assert all(n.args[0].meta["val"].dtype == F32 for n in log_sigmoid)


# -------------------------------------------------------------------------- CUDA statements


def test_the_cuda_statements_follow_torch_lists_and_torch_defaults():
    """The page's "On CUDA" section cites torch.autocast's CUDA lists and torch's defaults."""
    for name in ("softmax", "log_softmax", "layer_norm", "group_norm", "sum", "exp", "log"):
        assert torch_rule("cuda", name) == "fp32", name
    assert torch_rule("cuda", "batch_norm") is None
    assert torch_rule("cuda", "native_batch_norm") is None
    assert torch_rule("cuda", "scaled_dot_product_attention") == "lower"
    assert torch_rule("cuda", "binary_cross_entropy") == "banned"
    # mixprec's fp32_inside kernels sit on the CUDA key as on the CPU one
    with mixprec.autocast(BF16):
        pass
    registered = _autocast_rules.registered()
    for qualname in ("_softmax", "_log_softmax", "native_layer_norm", "group_norm"):
        assert ("cuda", qualname) in registered and ("cpu", qualname) in registered
    # torch's defaults the page quotes
    assert torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()


def test_attention_decomposes_on_cpu_only():
    q = torch.empty(2, 2, 4, 8, dtype=BF16, device="meta", requires_grad=True)
    from mixprec._core.attention import can_decompose_attention

    assert not can_decompose_attention(q, q, q)
    cpu = torch.zeros(2, 2, 256, 16, dtype=BF16, requires_grad=True)
    assert can_decompose_attention(cpu, cpu, cpu)
    assert not can_decompose_attention(cpu[..., :8, :], cpu[..., :8, :], cpu[..., :8, :])


# -------------------------------------------------------------------------- README

# Each README sentence about dtypes, and the cells of the page it summarizes:
# (phrase in the README's first paragraph, [(row, columns, the cell)]).
ALL = tuple(COLUMNS)
README_CLAIMS: list[tuple[str, list[tuple[str, tuple[str, ...], str]]]] = [
    (
        "runs the compute-bound ops (matmuls, convolutions, attention) in 16-bit",
        [
            ("`nn.Linear`", ALL, "16-bit (fp32 inside)"),
            ("`nn.Conv1d`", ALL, "16-bit (fp32 inside)"),
            (_row("bfloat16, training, large"), ALL, "16-bit (fp32 inside)"),
            (_row("no gradient"), ALL, "16-bit*"),
        ],
    ),
    (
        "reductions, exp/log and losses such as cross-entropy take float32 inputs at every level",
        [
            ("`torch.sum`, `torch.mean`", ALL, "fp32"),
            ("`torch.exp`, `torch.log`", ALL, "fp32"),
            ("`F.cross_entropy`, `F.mse_loss`", ALL, "fp32"),
        ],
    ),
    (
        "softmax and layer/group norms do at O1, and at O2/O3 take 16-bit inputs to kernels "
        "that compute in float32",
        [
            ("`F.softmax`, `F.log_softmax`", ALL[:1], "fp32"),
            ("`nn.LayerNorm`, `nn.GroupNorm`", ALL[:1], "fp32"),
            ("`F.softmax`, `F.log_softmax`", ALL[1:], "16-bit (fp32 inside)"),
            ("`nn.LayerNorm`, `nn.GroupNorm`", ALL[1:], "16-bit (fp32 inside)"),
        ],
    ),
    (
        "batch norm and the softmax inside attention take 16-bit inputs at every level",
        [
            ("`nn.BatchNorm1d`, `nn.InstanceNorm1d`, training", ALL, "16-bit*"),
            ("`nn.BatchNorm1d`, eval", ALL, "16-bit*"),
            (_row("bfloat16, training, large"), ALL, "16-bit (fp32 inside)"),
            (_row("no gradient"), ALL, "16-bit*"),
        ],
    ),
]


def _first_paragraph(text: str) -> str:
    body = text.split("\n\n")[1]
    return " ".join(body.split())


@pytest.mark.parametrize("phrase", [c[0] for c in README_CLAIMS], ids=lambda p: p[:30])
def test_the_readme_says_what_the_page_says(phrase):
    assert phrase in _first_paragraph(README.read_text()), (
        f"the README's first paragraph no longer says {phrase!r}: update README_CLAIMS here "
        "with the new sentence and the page cells it summarizes"
    )
    _, rows = what_runs()
    for row, columns, cell in dict(README_CLAIMS)[phrase]:
        for column in columns:
            actual = rows[row][column]
            if cell.endswith("*"):
                assert actual.startswith(cell[:-1]), (row, column, actual)
            else:
                assert actual == cell, (row, column, actual)


def test_what_the_readme_says_torch_autocast_leaves_in_16bit_on_cpu():
    phrase = "float32 reductions and exp/log on CPU too (and softmax and layer norms at O1)"
    assert phrase in _first_paragraph(README.read_text())
    for name in ("sum", "mean", "exp", "log", "softmax", "layer_norm"):
        assert torch_rule("cpu", name) is None, name  # torch.autocast: the input's dtype
        assert rule_for(name) == FP32, name
    _, rows = what_runs()
    assert rows["`torch.sum`, `torch.mean`"]["O3"] == "fp32"
    assert rows["`nn.LayerNorm`, `nn.GroupNorm`"]["`mixprec.autocast`, O1"] == "fp32"


def test_the_readme_no_longer_claims_fp32_on_every_device():
    assert "in float32 on every device" not in _first_paragraph(README.read_text())
