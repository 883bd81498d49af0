"""A Policy where a recipe is expected has one meaning: its three dtypes, as
``Recipe.from_policy`` reads them. ``Recipe(policy)``, ``as_recipe(policy)`` and
``initialize(model, opt, policy)`` agree; a policy spelled with a recipe's name that its dtypes
do not read as is refused, and the string keeps the named recipe."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec._core.policy import _NAMED
from mixprec._initialize import RECIPE_ATTR
from mixprec.recipe import NAMES, Recipe, as_recipe

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
#: the names that spell both a recipe and a policy
SHARED = sorted(n for n in NAMES if n.lower() in _NAMED)
AGREE = ["bf16-mixed", "16-mixed"]
TWO_MEANINGS = ["bf16-true"]


def _model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def _initialized(recipe) -> Recipe:
    m, _ = mixprec.initialize(*_model_and_opt(), recipe)
    return m.__dict__[RECIPE_ATTR][0]


def test_the_shared_names_are_the_ones_this_file_covers():
    assert sorted(AGREE + TWO_MEANINGS) == SHARED


@pytest.mark.parametrize("name", AGREE)
@pytest.mark.parametrize("fold", [str, str.upper])
def test_a_policy_named_as_a_recipe_is_that_recipe(name, fold):
    policy = mixprec.Policy(fold(name))
    assert Recipe(policy) == Recipe(name)
    assert as_recipe(policy) == Recipe(name) == as_recipe(fold(name))
    assert _initialized(policy) == _initialized(name) == Recipe(name).resolve()


@pytest.mark.parametrize("name", TWO_MEANINGS)
@pytest.mark.parametrize("fold", [str, str.upper])
def test_a_policy_with_two_meanings_is_refused_everywhere(name, fold):
    policy = mixprec.Policy(fold(name))
    for attempt in (
        lambda: Recipe(policy),
        lambda: as_recipe(policy),
        lambda: mixprec.initialize(*_model_and_opt(), policy),
    ):
        with pytest.raises(ValueError) as info:
            attempt()
        text = str(info.value)
        assert f"Received {policy!r}" in text and "means two recipes" in text
        assert "Allowed: a Policy whose name is no recipe's" in text
        assert "(bf16-mixed, 16-mixed)" in text
        assert f"Write the name {name!r}" in text
        assert f"Recipe.from_policy({fold(name)!r})" in text


def test_bf16_true_error_names_both_readings():
    with pytest.raises(ValueError) as info:
        Recipe(mixprec.Policy("bf16-true"))
    text = str(info.value)
    assert "the recipe named 'bf16-true' (update=none outputs=fp32)" in text
    assert "'O3 bf16 outputs=bf16' (update=auto outputs=bf16)" in text


def test_the_string_keeps_the_named_recipe_and_upper_case_is_refused():
    expected = Recipe("O3", BF16, update=None)
    assert as_recipe("bf16-true") == expected and _initialized("bf16-true") == expected.resolve()
    assert _initialized("bf16-true").outputs == FP32
    with pytest.raises(ValueError, match=r"Write the name 'bf16-true'"):
        as_recipe("BF16-TRUE")


def test_from_policy_is_the_explicit_dtype_reading():
    read = Recipe.from_policy(mixprec.Policy("bf16-true"))
    assert read == Recipe("O3", BF16, outputs=BF16) == Recipe.from_policy("bf16-true")
    assert read != Recipe("bf16-true")
    assert Recipe(str(read)) == read  # the line the error suggests


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [
        ("float32", Recipe("O0")),
        ("mixed_bfloat16", Recipe("O1", BF16)),
        ("p=f32,c=f16,o=f32", Recipe("O1", FP16)),
        ("bfloat16", Recipe("O3", BF16, outputs=BF16)),
        ("16-true", Recipe("O3", FP16, outputs=FP16)),
        (BF16, Recipe("O3", BF16, outputs=BF16)),
    ],
    ids=str,
)
def test_recipe_of_a_policy_is_its_dtypes_everywhere(spelling, expected):
    policy = mixprec.Policy(spelling)
    assert Recipe(policy) == as_recipe(policy) == Recipe.from_policy(policy) == expected
    assert _initialized(policy) == expected.resolve()


def test_recipe_of_a_policy_takes_field_overrides_and_its_own_dtype_only():
    policy = mixprec.Policy("bfloat16")
    assert Recipe(policy, update=None) == Recipe("O3", BF16, update=None, outputs=BF16)
    assert Recipe(policy, BF16, outputs=FP32) == Recipe("O3", BF16)
    with pytest.raises(ValueError, match=r"dtype=torch.float16\): the policy carries its dtype"):
        Recipe(policy, FP16)


@pytest.mark.parametrize("bad", [BF16, 2, None])
def test_a_name_that_is_no_string_or_policy_is_a_type_error(bad):
    with pytest.raises(TypeError) as info:
        Recipe(bad)
    text = str(info.value)
    assert f"received {bad!r} (of type {type(bad).__name__})" in text
    assert "'bf16-true'" in text and "or a mixprec.Policy" in text
    assert "Recipe('O2', torch.bfloat16)" in text
