"""One vocabulary under the Recipe: the steps read the Recipe's fields, and each optimizer gets
an ``UpdatePlan`` named in the Recipe's words, never a dict of the pre-Recipe keywords."""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec._core.optimizer import MixedPrecisionOptimizer
from mixprec._core.storage import restore_fp32
from mixprec._core.update.choice import UpdatePlan, update_plans
from mixprec._initialize import RECIPE_ATTR

BF16, FP16 = torch.bfloat16, torch.float16
PKG = pathlib.Path(mixprec.__file__).resolve().parent
#: the names of the dict the Recipe used to be flattened into
OLD = {
    "cast_params",
    "master_weights",
    "keep_norm_fp32",
    "keep_frozen_fp32",
    "cast_model_outputs",
    "lean_kwargs",
}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))


def test_each_optimizer_gets_a_plan_in_the_recipes_words():
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "e": nn.Embedding(5, 4, sparse=True)})
    adam = torch.optim.AdamW(model["a"].parameters(), lr=1e-3)
    sparse = torch.optim.SGD(model["e"].parameters(), lr=1e-3)
    plans = update_plans(mixprec.Recipe("O3", FP16), [adam, sparse], [model], FP16)
    auto = (("exp_avg", FP16), ("momentum_buffer", FP16))  # "auto": first moments 16-bit
    kahan = UpdatePlan(masters=False, update="kahan", optimizer_states=auto)
    assert plans == [kahan, UpdatePlan(masters=False)]
    lean = mixprec.Recipe("lean", BF16, update_seed=3)
    (plan,) = update_plans(lean, [adam], [model], BF16)
    assert plan == UpdatePlan(
        masters=False,
        update="stochastic",
        optimizer_states="8-bit",
        update_seed=3,
        gradients="auto",  # the loop decides: held where it clips or accumulates
    )
    explicit = update_plans(lean.replace(gradients="released"), [adam], [model], BF16)
    assert explicit[0].gradients == "released"
    assert update_plans(mixprec.Recipe("O2", BF16), [adam], [model], BF16) == [UpdatePlan()]


def test_initialize_hands_each_wrapper_its_plan():
    model = _model()
    _, opt = mixprec.initialize(
        model, torch.optim.AdamW(model.parameters()), mixprec.Recipe("O3", BF16, update="nearest")
    )
    auto = (("exp_avg", BF16), ("momentum_buffer", BF16))
    assert opt.plan == UpdatePlan(masters=False, update="nearest", optimizer_states=auto)
    assert opt.updater is not None and not opt.updater.compensation  # nearest: no Kahan buffers


@pytest.mark.parametrize(
    ("recipe", "dtype", "optimizer", "expected"),
    [
        ("O2", BF16, "adamw", "O2 bf16 update=none reduce_dtype=bf16 loss_scale=none"),
        ("O2", FP16, "adamw", "O2 fp16 update=none reduce_dtype=fp16 loss_scale=dynamic"),
        (
            "O3",
            FP16,
            "adamw",
            "O3 fp16 update=kahan optimizer_states=exp_avg:fp16,momentum_buffer:fp16 "
            "update_seed=0 reduce_dtype=fp16 loss_scale=dynamic",
        ),
        ("O3", FP16, "sgd", "O3 fp16 update=none reduce_dtype=fp16 loss_scale=dynamic"),
        (
            "lean",
            FP16,
            "adamw",
            "lean fp16 update_seed=0 gradients=held reduce_dtype=fp16 loss_scale=dynamic",
        ),
    ],
)
def test_each_auto_is_resolved_once_into_the_recipe_the_optimizer_prints(
    recipe, dtype, optimizer, expected
):
    model = _model()
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-3)
        if optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on a CPU without fast fp16
        model, opt = mixprec.initialize(model, opt, recipe, dtype)
    assert str(opt.recipe) == expected
    assert mixprec.Recipe(str(opt.recipe)) == opt.recipe  # the printed line is the recipe
    assert model.__dict__[RECIPE_ATTR][0] == mixprec.Recipe(recipe, dtype).resolve()


def test_lean_gradients_auto_resolves_at_the_end_of_the_first_step():
    model = _model()
    model, opt = mixprec.initialize(model, torch.optim.AdamW(model.parameters()), "lean", BF16)
    assert opt.recipe.gradients == "auto"  # the first step decides
    for _ in range(2):
        opt.backward(model(torch.randn(3, 4)).float().square().mean())
        opt.step()
        opt.zero_grad()
    assert opt.recipe.gradients == "released"
    model = _model()
    model, opt = mixprec.initialize(model, torch.optim.AdamW(model.parameters()), "lean", BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "auto" says once that it codes them
        opt.backward(model(torch.randn(3, 4)).float().square().mean())
        opt.clip_grad_norm_(1.0)
        opt.step()
    assert opt.recipe.gradients == "coded"


def test_the_wrapper_takes_a_plan_not_a_dict_of_keywords():
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="plan is an UpdatePlan"):
        MixedPrecisionOptimizer(opt, [], {"master_weights": False})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        MixedPrecisionOptimizer(opt, [], master_weights=False)  # type: ignore[call-arg]


def test_restore_fp32_reads_the_recipe():
    """A model that arrives in 16 bits gets back what the recipe keeps in fp32: the norms at
    O2; every parameter where the weights are stored in fp32 (FSDP's shards)."""
    model = _model().to(BF16)
    with pytest.warns(UserWarning, match="keeps norm layers and master weights in float32"):
        restore_fp32(model, mixprec.Recipe("O2", BF16), BF16)
    assert [p.dtype for p in model.parameters()] == [BF16] * 2 + [torch.float32] * 2 + [BF16] * 2
    model = _model().to(BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        restore_fp32(model, mixprec.Recipe("O2", BF16), BF16, weights="fp32")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def _old_names_used(path: pathlib.Path) -> list[str]:
    """Where ``path`` keys, subscripts or passes one of the old names, a table from an old name
    to its Recipe field included: no keyword moved from a released API, so none is mapped."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in OLD:
            found.append(f"{path.name}:{node.lineno} {node.value!r}")
        elif isinstance(node, ast.keyword) and node.arg in OLD:
            found.append(f"{path.name}:{node.lineno} {node.arg}=")
        elif isinstance(node, ast.arg) and node.arg in OLD:
            found.append(f"{path.name}:{node.lineno} parameter {node.arg}")
    return found


def test_no_dict_of_the_old_names_between_the_recipe_and_the_machinery():
    assert not hasattr(mixprec._initialize, "recipe_props")
    # every module but the Apex layer, whose amp.initialize takes Apex's own keywords
    files = [f for f in PKG.rglob("*.py") if "compat" not in f.relative_to(PKG).parts]
    found = [hit for f in files for hit in _old_names_used(f)]
    assert not found, found


def test_the_scan_sees_an_old_dict(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        'MOVED = {"master_weights": "masters"}\n'
        'props = dict(cast_params=True)\nprops["keep_norm_fp32"]\n'
    )
    assert _old_names_used(src) == [
        "m.py:1 'master_weights'",
        "m.py:2 cast_params=",
        "m.py:3 'keep_norm_fp32'",
    ]
