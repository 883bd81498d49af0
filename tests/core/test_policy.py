"""Tests for mixprec._core.policy: every spelling, round trips, errors, value semantics, scoping."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec._core import engine
from mixprec._core import policy as policy_mod
from mixprec._core.engine import set_policy
from mixprec._core.policy import Policy, get_policy, global_policy, policy_scope, set_global_policy

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


@pytest.fixture(autouse=True)
def _reset_global_policy():
    set_global_policy(None)
    yield
    set_global_policy(None)


def triple(p: Policy) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    return (p.param_dtype, p.compute_dtype, p.output_dtype)


# (spelling, (param, compute, output))
SPELLINGS = [
    # Keras
    ("float32", (F32, F32, F32)),
    ("float16", (F16, F16, F16)),
    ("bfloat16", (BF16, BF16, BF16)),
    ("mixed_float16", (F32, F16, F32)),
    ("mixed_bfloat16", (F32, BF16, F32)),
    ("float64", (F64, F64, F64)),
    # jmp, long and short keys, dtype aliases, any order, partial (missing keys are float32)
    ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ("params=float32,compute=float16,output=float16", (F32, F16, F16)),
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("p=full,c=half,o=full", (F32, F16, F32)),
    ("p=bf16,c=bf16,o=bf16", (BF16, BF16, BF16)),
    ("p=f16,c=f16,o=f32", (F16, F16, F32)),
    ("output=half,params=full,compute=bf16", (F32, BF16, F16)),
    ("c=bf16", (F32, BF16, F32)),
    ("params=bfloat16", (BF16, F32, F32)),
    (" P = F32 , C = BF16 , O = F32 ", (F32, BF16, F32)),
    # Lightning / Fabric / Accelerate
    ("bf16-mixed", (F32, BF16, F32)),
    ("16-mixed", (F32, F16, F32)),
    ("bf16-true", (BF16, BF16, BF16)),
    ("16-true", (F16, F16, F16)),
    ("32-true", (F32, F32, F32)),
    ("64-true", (F64, F64, F64)),
    ("bf16", (F32, BF16, F32)),
    ("fp16", (F32, F16, F32)),
    ("no", (F32, F32, F32)),
    ("32", (F32, F32, F32)),
    ("16", (F32, F16, F32)),
    ("64", (F64, F64, F64)),
    ("half", (F16, F16, F16)),
    ("full", (F32, F32, F32)),
    # case and surrounding whitespace do not matter
    ("Mixed_BFloat16", (F32, BF16, F32)),
    ("  BF16-Mixed  ", (F32, BF16, F32)),
]

# Non-string specs: Lightning integers and torch dtypes.
OBJECT_SPECS = [
    (16, (F32, F16, F32)),
    (32, (F32, F32, F32)),
    (64, (F64, F64, F64)),
    (torch.float32, (F32, F32, F32)),
    (torch.float16, (F16, F16, F16)),
    (torch.bfloat16, (BF16, BF16, BF16)),
    (torch.float64, (F64, F64, F64)),
]

KEYWORDS = [
    (dict(compute_dtype=torch.bfloat16), (F32, BF16, F32)),
    (dict(compute_dtype="f16"), (F32, F16, F32)),
    (dict(compute_dtype="half", param_dtype="bf16", output_dtype=torch.float16), (BF16, F16, F16)),
    (dict(param_dtype=torch.bfloat16), (BF16, F32, F32)),
    (dict(output_dtype="bfloat16"), (F32, F32, BF16)),
    (
        dict(compute_dtype=torch.float64, param_dtype=torch.float64, output_dtype=torch.float64),
        (F64, F64, F64),
    ),
]


# Every construction above as (id, args, kwargs); built inside the tests, so that one bad
# spelling fails its own test instead of the collection of the whole module.
ALL_SPECS = [(repr(s), (s,), {}) for s, _ in SPELLINGS + OBJECT_SPECS] + [
    (str(kw), (), kw) for kw, _ in KEYWORDS
]


# --------------------------------------------------------------------------- spellings


@pytest.mark.parametrize(("spec", "expected"), SPELLINGS, ids=[s for s, _ in SPELLINGS])
def test_string_spellings(spec, expected):
    p = Policy(spec)
    assert triple(p) == expected
    assert p.name == spec.strip()
    assert str(p) == spec.strip()


@pytest.mark.parametrize(("spec", "expected"), OBJECT_SPECS, ids=[str(s) for s, _ in OBJECT_SPECS])
def test_object_specs(spec, expected):
    assert triple(Policy(spec)) == expected


def test_dtype_spec_names_are_canonical():
    assert Policy(torch.bfloat16).name == "bfloat16"
    assert Policy(torch.float16).name == "float16"
    assert Policy(torch.float32).name == "float32"


@pytest.mark.parametrize(("kwargs", "expected"), KEYWORDS, ids=[str(k) for k, _ in KEYWORDS])
def test_keyword_construction(kwargs, expected):
    p = Policy(**kwargs)
    assert triple(p) == expected


def test_keyword_name_is_jmp_string():
    p = Policy(compute_dtype=torch.bfloat16)
    assert p.name == "params=float32,compute=bfloat16,output=float32"


def test_equal_across_spelling_families():
    group = [
        Policy("mixed_bfloat16"),
        Policy("bf16-mixed"),
        Policy("bf16"),
        Policy("p=f32,c=bf16,o=f32"),
        Policy("params=float32,compute=bfloat16,output=float32"),
        Policy(compute_dtype=torch.bfloat16),
    ]
    assert all(p == group[0] for p in group)
    assert len({hash(p) for p in group}) == 1
    assert Policy("mixed_float16") != Policy("mixed_bfloat16")
    assert Policy("bf16-true") != Policy("bf16-mixed")
    assert Policy("float32") != "float32"


def test_policy_of_policy_keeps_name():
    p = Policy("bf16-mixed")
    q = Policy(p)
    assert q == p and q.name == "bf16-mixed"
    assert policy_mod.as_policy(p) is p


def test_properties():
    assert Policy("mixed_bfloat16").is_mixed and Policy("mixed_bfloat16").is_lower
    assert not Policy("bf16-true").is_mixed and Policy("bf16-true").is_lower
    assert not Policy("float32").is_mixed and not Policy("float32").is_lower
    assert not Policy("float64").is_lower
    assert Policy("p=bf16,c=f32").is_mixed


def test_repr_shows_all_three_dtypes():
    r = repr(Policy("p=f32,c=bf16,o=f16"))
    assert "params=float32" in r and "compute=bfloat16" in r and "output=float16" in r
    assert "'p=f32,c=bf16,o=f16'" in r


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(("ident", "args", "kwargs"), ALL_SPECS, ids=[c[0] for c in ALL_SPECS])
def test_str_round_trips_through_parser(ident, args, kwargs):
    p = Policy(*args, **kwargs)
    q = Policy(str(p))
    assert q == p
    assert triple(q) == triple(p)
    assert str(q) == str(p)


@pytest.mark.parametrize(("ident", "args", "kwargs"), ALL_SPECS, ids=[c[0] for c in ALL_SPECS])
def test_pickle_copy_deepcopy(ident, args, kwargs):
    p = Policy(*args, **kwargs)
    for q in (pickle.loads(pickle.dumps(p)), copy.copy(p), copy.deepcopy(p)):
        assert type(q) is Policy
        assert q == p and hash(q) == hash(p)
        assert q.name == p.name
        assert triple(q) == triple(p)


_KEY_ALIASES = {"param": ["params", "p"], "compute": ["compute", "c"], "output": ["output", "o"]}
_DTYPE_ALIASES = {
    F32: ["float32", "f32", "fp32", "full", "float"],
    BF16: ["bfloat16", "bf16"],
    F16: ["float16", "f16", "fp16", "half"],
    F64: ["float64", "f64", "double"],
}


@st.composite
def jmp_strings(draw):
    roles = draw(
        st.lists(
            st.sampled_from(["param", "compute", "output"]), min_size=1, max_size=3, unique=True
        )
    )
    chosen, parts = {}, []
    for role in roles:
        dtype = draw(st.sampled_from(list(_DTYPE_ALIASES)))
        chosen[role] = dtype
        key = draw(st.sampled_from(_KEY_ALIASES[role]))
        value = draw(st.sampled_from(_DTYPE_ALIASES[dtype]))
        if draw(st.booleans()):
            key, value = key.upper(), value.upper()
        pad = draw(st.sampled_from(["", " "]))
        parts.append(f"{pad}{key}{pad}={pad}{value}{pad}")
    expected = tuple(chosen.get(r, F32) for r in ("param", "compute", "output"))
    return ",".join(parts), expected


@settings(max_examples=60, deadline=None)
@given(jmp_strings())
def test_jmp_strings_any_order_and_alias(case):
    text, expected = case
    p = Policy(text)
    assert triple(p) == expected
    assert Policy(str(p)) == p


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", ["mixed_bfloat", "bf32", "float8", "", "fp16-mixed-x", "mixed"])
def test_unknown_name_value_error_names_value_and_accepted(bad):
    with pytest.raises(ValueError) as info:
        Policy(bad)
    msg = str(info.value)
    assert repr(bad) in msg
    for accepted in (
        "mixed_bfloat16",
        "mixed_float16",
        "bf16-mixed",
        "16-mixed",
        "32-true",
        "p=f32,c=bf16,o=f32",
    ):
        assert accepted in msg


@pytest.mark.parametrize("bad", [1.5, [torch.bfloat16], b"bf16", True, object(), {"c": "bf16"}])
def test_non_string_type_error(bad):
    with pytest.raises(TypeError) as info:
        Policy(bad)
    assert type(bad).__name__ in str(info.value)


def test_unsupported_integer_spec():
    with pytest.raises(ValueError, match="8"):
        Policy(8)


def test_spec_and_keywords_conflict():
    with pytest.raises(ValueError, match="not both"):
        Policy("bf16-mixed", compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        Policy(torch.bfloat16, output_dtype=torch.float32)


def test_no_arguments():
    with pytest.raises(ValueError):
        Policy()


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint8]
)
def test_non_floating_dtypes_rejected(dtype):
    with pytest.raises(ValueError, match="floating"):
        Policy(dtype)
    with pytest.raises(ValueError):
        Policy(compute_dtype=dtype)
    with pytest.raises(ValueError):
        Policy(param_dtype=dtype)
    with pytest.raises(ValueError):
        Policy(output_dtype=dtype)


def test_unsupported_floating_dtype_rejected():
    # float8 is "floating" for torch but no policy dtype: must be a clear ValueError, and never
    # an object that cannot even be printed.
    with pytest.raises(ValueError):
        Policy(torch.float8_e4m3fn)
    with pytest.raises(ValueError):
        Policy(compute_dtype=torch.float8_e5m2)


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        ("q=f32,c=bf16", "'q=f32'"),
        ("params=f32,compute", "'compute'"),
        ("p=f32,,c=bf16", "''"),
        ("param=f32", "'param=f32'"),
    ],
)
def test_jmp_bad_key(bad, fragment):
    with pytest.raises(ValueError) as info:
        Policy(bad)
    assert fragment in str(info.value)
    assert "params/compute/output" in str(info.value)


@pytest.mark.parametrize(
    "bad", ["p=f32,p=bf16", "params=f32,p=bf16", "c=bf16,compute=f16", "o=f32,output=f32"]
)
def test_jmp_duplicated_key(bad):
    with pytest.raises(ValueError, match="twice"):
        Policy(bad)


@pytest.mark.parametrize("bad", ["p=f33", "c=int8", "o=", "c=bf16;o=f32"])
def test_jmp_bad_dtype(bad):
    with pytest.raises(ValueError, match="floating dtype"):
        Policy(bad)


# --------------------------------------------------------------------------- value semantics


def test_immutable():
    p = Policy("bf16-mixed")
    for attr in ("compute_dtype", "param_dtype", "output_dtype", "name", "other"):
        with pytest.raises(AttributeError):
            setattr(p, attr, torch.float16)
    with pytest.raises(AttributeError):
        del p.name
    assert triple(p) == (F32, BF16, F32) and p.name == "bf16-mixed"


def test_hashable_dict_key():
    table = {Policy("bf16-mixed"): "a", Policy("16-mixed"): "b"}
    assert table[Policy("mixed_bfloat16")] == "a"
    assert table[Policy("p=f32,c=f16,o=f32")] == "b"
    assert len({Policy("float32"), Policy("no"), Policy("32-true"), Policy(torch.float32)}) == 1


# --------------------------------------------------------------------------- global policy


def test_global_default_is_float32():
    assert global_policy() == Policy("float32")
    assert triple(global_policy()) == (F32, F32, F32)


def test_set_global_policy_and_reset():
    set_global_policy("mixed_bfloat16")
    assert global_policy() == Policy("bf16-mixed")
    assert global_policy().name == "mixed_bfloat16"
    set_global_policy(Policy("16-mixed"))
    assert global_policy().compute_dtype == F16
    set_global_policy(torch.bfloat16)
    assert global_policy() == Policy("bf16-true")
    set_global_policy(None)
    assert global_policy() == Policy("float32")


def test_set_global_policy_bad_value_keeps_previous():
    set_global_policy("bf16-mixed")
    with pytest.raises(ValueError):
        set_global_policy("nonsense")
    with pytest.raises(TypeError):
        set_global_policy(2.5)
    assert global_policy() == Policy("bf16-mixed")


def test_policy_scope_sets_and_restores():
    set_global_policy("16-mixed")
    with policy_scope("bf16-mixed") as p:
        assert p == Policy("bf16-mixed") and global_policy() is p
        with policy_scope("float32"):
            assert global_policy() == Policy("float32")
        assert global_policy() == Policy("bf16-mixed")
    assert global_policy() == Policy("16-mixed")


def test_policy_scope_restores_on_exception():
    with pytest.raises(KeyError), policy_scope("mixed_bfloat16"):
        assert global_policy().compute_dtype == BF16
        raise KeyError("boom")
    assert global_policy() == Policy("float32")


def test_policy_scope_bad_policy_leaves_global_alone():
    with pytest.raises(ValueError), policy_scope("nope"):
        pass  # pragma: no cover
    assert global_policy() == Policy("float32")


def test_autocast_without_argument_uses_global_policy():
    lin, x = nn.Linear(4, 3), torch.randn(2, 4)
    with policy_scope("mixed_bfloat16"), mixprec.autocast():
        assert lin(x).dtype == BF16
    with mixprec.autocast():  # global float32: a pass-through region
        assert lin(x).dtype == F32


# --------------------------------------------------------------------------- module policies


def test_set_get_policy_and_remove():
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    assert get_policy(m) is None
    assert set_policy(m, "bf16-mixed") is m
    assert get_policy(m) == Policy("bf16-mixed") and get_policy(m).name == "bf16-mixed"
    assert get_policy(m[0]) is None  # attached to the module, not copied to children
    assert engine.has_boundary(m) and not m._forward_pre_hooks and not m._forward_hooks
    set_policy(m, Policy("16-mixed"))  # replacing does not stack boundaries
    assert get_policy(m) == Policy("16-mixed")
    assert engine.has_boundary(m) and (m.__dict__["forward"].inner is None)
    assert "_mixprec_policy" not in m.state_dict()
    assert set_policy(m, None) is m
    assert get_policy(m) is None
    assert not engine.has_boundary(m) and "forward" not in m.__dict__
    set_policy(m, None)  # removing twice is fine
    assert get_policy(m) is None
    x = torch.randn(2, 3)
    assert m(x).dtype == F32


def test_set_policy_type_errors():
    for bad in (torch.randn(2), lambda x: x, "model", None):
        with pytest.raises(TypeError, match="nn.Module"):
            set_policy(bad, "bf16-mixed")
    m = nn.Linear(2, 2)
    with pytest.raises(ValueError):
        set_policy(m, "bogus")
    assert get_policy(m) is None and not engine.has_boundary(m)


def test_module_with_policy_pickles():
    m = set_policy(nn.Linear(2, 2), "bf16-mixed")
    m2 = pickle.loads(pickle.dumps(m))
    assert get_policy(m2) == Policy("bf16-mixed")
    x = torch.randn(3, 2)
    y = m2(x)  # the boundary hooks survive: bf16 compute, float32 output
    ref = torch.nn.functional.linear(x.bfloat16(), m2.weight.bfloat16(), m2.bias.bfloat16())
    assert y.dtype == F32 and torch.equal(y, ref.float())
