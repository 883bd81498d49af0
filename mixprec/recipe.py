"""``Recipe``: how every tensor of a training step is held and computed, in one frozen value.

Named recipes (:data:`NAMES`: Apex's levels, Lightning's names, the FP8 recipes) are presets of
its fields, changed one field at a time (``Recipe("O3", torch.bfloat16).replace(update=None)``);
"16-bit" fields mean the recipe's ``dtype``. The rules on the fields are checked at construction
(:mod:`mixprec._recipe_rules`), so entry points trust a recipe, and ``str(recipe)`` parses back
(:mod:`mixprec._recipe_text`). Design: ``docs/design.md``, "The Recipe".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from mixprec._core.activations import as_activation_config
from mixprec._core.loss_scale import LossScaling
from mixprec._core.names import LEVELS
from mixprec._core.policy import Policy, _dtype, as_policy
from mixprec._recipe_rules import check_fields, refuse_name
from mixprec._recipe_text import SHORT, loop_bytes, parse, render_table, word
from mixprec.fp8.config import as_fp8_config

__all__ = ["DEFAULTS", "NAMES", "LossScaling", "Recipe", "as_recipe", "level_recipe"]

#: The presets: for each name, the fields it sets (the others keep the dataclass defaults).
_LEVELS: dict[str, dict[str, Any]] = dict(
    zip(
        LEVELS,  # O0, O1, O2, O3
        (
            dict(compute="fp32", weights="fp32", masters=False, cast_inputs=False),
            dict(compute="16-bit", weights="fp32", masters=False, cast_inputs=False),
            dict(compute="16-bit", weights="16-bit", masters=True, fp32_inside=True),
            dict(
                compute="16-bit",
                weights="16-bit",
                masters=False,
                keep_fp32="none",
                fp32_inside=True,
            ),
        ),
        strict=True,
    )
)
#: name -> (preset it starts from, the dtype it implies or None, fields it changes)
NAMES: dict[str, tuple[str, torch.dtype | None, dict[str, Any]]] = {
    **{level: (level, None, {}) for level in _LEVELS},
    "bf16-mixed": ("O1", torch.bfloat16, {}),
    "16-mixed": ("O1", torch.float16, {}),
    "bf16-true": ("O3", torch.bfloat16, {"update": None}),
    "lean": (
        "O3",
        None,
        {"update": "stochastic", "optimizer_states": "8-bit", "gradients": "auto"},
    ),
    "fp8-tensorwise": ("O2", None, {"fp8": "tensorwise"}),
    "fp8-rowwise": ("O2", None, {"fp8": "rowwise"}),
}
_PRESET = object()  # a field left to the preset named by ``name``
#: the value of each field that a preset leaves alone
DEFAULTS: dict[str, Any] = dict(
    dtype=None,
    keep_fp32="norms",
    frozen_masters=False,
    update="auto",
    optimizer_states="auto",
    update_seed=None,
    gradients="held",
    reduce_dtype="auto",
    activations=None,
    fp8=None,
    loss_scale="auto",
    outputs=torch.float32,
    cast_inputs=True,
    fp32_inside=False,
    kernels="auto",
    num_losses=1,
)


def _preset(name: Any) -> tuple[str, dict[str, Any]]:
    """The level a name starts from and the fields it sets (names fold case: "o2" is "O2")."""
    key = name.upper() if isinstance(name, str) and name.upper() in _LEVELS else name
    if not isinstance(name, str) or key not in NAMES:
        refuse_name(name, list(NAMES))
    level, _, extra = NAMES[key]
    return key, {**_LEVELS[level], **extra}


@dataclasses.dataclass(frozen=True, eq=False)
class Recipe:
    """How every tensor of a training step is held and computed.

    ``Recipe(name, dtype)`` is a named recipe (:data:`NAMES`); any field given as well
    overrides the preset. ``Recipe("O2 bf16 update=kahan")`` parses :meth:`__str__`'s form.

    Args:
        name: the preset the other fields start from: ``"O0"``-``"O3"`` (any case),
            ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"fp8-tensorwise"``,
            ``"fp8-rowwise"``; or a :class:`~mixprec.Policy`, read as
            :meth:`from_policy` does (refused where its name is a recipe's that its dtypes
            do not read as: ``Policy("bf16-true")``).
        dtype: the 16-bit dtype (``torch.bfloat16`` or ``torch.float16``); None: chosen for
            the device when the recipe is applied (:func:`mixprec.default_dtype`).
        compute: ``"16-bit"`` (matmuls and convolutions in ``dtype``, by the cast table) or
            ``"fp32"`` (with 16-bit weights: storage-only, :mod:`mixprec._core.widening`).
        weights: the model's parameters as stored: ``"fp32"`` or ``"16-bit"``.
        keep_fp32: modules whose parameters stay float32 when weights are 16-bit:
            ``"norms"`` (normalization layers) or ``"none"``.
        masters: keep float32 master weights that the optimizer steps (16-bit weights only).
        frozen_masters: keep float32 copies of frozen (``requires_grad=False``) 16-bit weights,
            so :func:`mixprec.fp32_state_dict` saves them exactly (+4 bytes each).
        update: without masters, how the optimizer's fp32 result is written into 16-bit
            weights: ``"kahan"`` (with a compensation buffer), ``"stochastic"``,
            ``"nearest"``, None (the optimizer's own 16-bit step) or ``"auto"`` (``"kahan"`` in
            bf16 and for Adam-family optimizers in fp16, None for sparse gradients).
        optimizer_states: how optimizer states are held under an update mode: ``"auto"``
            (first moments 16-bit, second moments fp32), a dtype, ``"8-bit"`` or ``"4-bit"``
            (block-wise codes with an fp32 scale per 256 elements; second moments as square
            roots), or ``{state name: one of these}`` (unnamed states fp32).
        update_seed: the seed of ``update="stochastic"``'s rounding (None: 0).
        gradients: ``"held"`` (until ``zero_grad``), ``"released"`` (each parameter is stepped
            in backward as soon as its gradient is complete, and the gradient freed: no
            gradient memory, but no clipping, no accumulation over several backward passes, and
            a non-finite gradient leaves only its own parameter unchanged; update modes without
            loss scaling) or ``"auto"`` (released where that holds, held with loss scaling,
            and coded where the training loop clips or accumulates: seen in the first step,
            which codes them, or told up front by an integration; see
            :mod:`mixprec._core.update.release`), or ``"coded"`` (each gradient coded in 8 bits,
            FP8 E4M3 with a scale per 256 elements, as its backward completes it, and the
            16-bit one freed: 1 byte per parameter where clipping and accumulation work, the
            clip's norm taken from the 16-bit values; update modes without loss scaling; see
            :mod:`mixprec._core.update.coded`).
        reduce_dtype: the dtype gradients are reduced in across ranks (DDP, FSDP):
            ``"auto"`` (the 16-bit compute dtype; float32 at O0), a dtype, or None (the
            wrapper's own default: DDP's fp32 all-reduce hook).
        activations: how tensors saved for backward are stored: None, ``"fp8"``, ``"16-bit"``,
            ``"recompute"`` or a :class:`~mixprec.ActivationConfig`.
        fp8: FP8 GEMMs for chosen Linears: None, True, ``"tensorwise"``, ``"rowwise"`` or a
            :class:`~mixprec.fp8.FP8Config`.
        loss_scale: ``"auto"`` (dynamic in float16, off otherwise), ``"dynamic"``, a number
            (static), None (off) or a :class:`LossScaling`.
        outputs: the dtype the model's outputs are cast to; None leaves them as computed.
        cast_inputs: cast floating inputs to ``dtype`` where the model is entered.
        fp32_inside: memory-bound ops with fp32-accumulating kernels (layer_norm, softmax) keep
            16-bit inputs and outputs.
        kernels: ``"auto"`` (mixprec's kernels where measured faster: attention, and an update
            mode's step as one pass per parameter, a C loop built by the machine's compiler on
            a CPU, ``torch.compile`` on a GPU) or ``"torch"`` (torch's kernels only).
        num_losses: losses backpropagated per step, each with its own loss scaler.
    """

    name: str = "O2"
    dtype: torch.dtype | None = _PRESET  # type: ignore[assignment]
    compute: str = _PRESET  # type: ignore[assignment]
    weights: str = _PRESET  # type: ignore[assignment]
    keep_fp32: str = _PRESET  # type: ignore[assignment]
    masters: bool = _PRESET  # type: ignore[assignment]
    frozen_masters: bool = _PRESET  # type: ignore[assignment]
    update: str | None = _PRESET  # type: ignore[assignment]
    optimizer_states: Any = _PRESET
    update_seed: int | None = _PRESET  # type: ignore[assignment]
    gradients: str = _PRESET  # type: ignore[assignment]
    reduce_dtype: torch.dtype | None = _PRESET  # type: ignore[assignment]
    activations: Any = _PRESET
    fp8: Any = _PRESET
    loss_scale: Any = _PRESET
    outputs: torch.dtype | None = _PRESET  # type: ignore[assignment]
    cast_inputs: bool = _PRESET  # type: ignore[assignment]
    fp32_inside: bool = _PRESET  # type: ignore[assignment]
    kernels: str = _PRESET  # type: ignore[assignment]
    num_losses: int = _PRESET  # type: ignore[assignment]

    def __post_init__(self) -> None:
        given = _given(self)
        if isinstance(self.name, Policy):  # its three dtypes, then the fields given
            rest = {k: v for k, v in given.items() if k not in ("name", "dtype")}
            given = {**_policy_fields(self.name, given.get("dtype"), one_meaning=True), **rest}
        elif isinstance(self.name, str) and (" " in self.name.strip() or "=" in self.name):
            given = {
                **parse(self.name, {f.name for f in dataclasses.fields(self)}),
                **{k: v for k, v in given.items() if k != "name"},
            }
        for key, value in _filled(given).items():
            object.__setattr__(self, key, value)
        check_fields(self)

    def _key(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name")

    def __eq__(self, other: object) -> bool:
        """Recipes are equal when they train the same way, whatever preset they were named
        from: ``Recipe("O3", torch.bfloat16, update=None) == Recipe("bf16-true")``."""
        return isinstance(other, Recipe) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def from_name(cls, name: str, dtype: Any = None) -> Recipe:
        """The named recipe ``name`` (:data:`NAMES`) in ``dtype``."""
        return cls(name, dtype)

    @classmethod
    def from_policy(cls, policy: Any) -> Recipe:
        """The level that trains a model under ``policy`` (any policy spelling): O0 for a
        float32 policy, O1 for float32 parameters, O3 for 16-bit ones; outputs as it says.
        Always by the dtypes: ``from_policy("bf16-true")`` is ``"O3 bf16 outputs=bf16"``,
        not the recipe ``"bf16-true"``."""
        return cls(**_policy_fields(as_policy(policy)))

    def replace(self, **changes: Any) -> Recipe:
        """This recipe with ``changes`` (field names) applied and checked again."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(
                f"Recipe has no field(s) {unknown}; fields: "
                f"{[f.name for f in dataclasses.fields(self)]}."
            )
        if "name" in changes:  # a new preset: the fields not given come from it
            return Recipe(**{**_given_only(self, changes), **changes})
        return dataclasses.replace(self, **changes)

    # -- what the recipe means ---------------------------------------------------------------

    @property
    def level(self) -> str:
        """The Apex level this recipe is a variant of."""
        return NAMES[_preset(self.name)[0]][0]

    def resolved_dtype(self, device: Any = None) -> torch.dtype:
        """The 16-bit dtype applied on ``device`` (float32 where nothing is 16-bit)."""
        if self.compute == "fp32" and self.weights == "fp32":
            return torch.float32
        if self.dtype is not None:
            return self.dtype
        from mixprec._core.hardware import default_dtype

        return default_dtype(device)

    def releases_gradients(self, dtype: torch.dtype) -> bool:
        """Whether gradients are released in backward when the recipe runs in ``dtype``."""
        if self.gradients == "auto":
            modes = self.weights == "16-bit" and not self.masters and self.update is not None
            return modes and self.scaling(dtype) is None
        return self.gradients == "released"

    def scaling(self, dtype: torch.dtype) -> LossScaling | None:
        """The loss scaling applied when the recipe runs in ``dtype``."""
        if self.loss_scale == "auto":  # fp16 gradients: 16-bit compute or 16-bit weights
            sixteen = self.compute != "fp32" or self.weights == "16-bit"
            return LossScaling() if dtype == torch.float16 and sixteen else None
        return self.loss_scale

    def reduced_in(self, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype gradients are reduced in across ranks when the recipe runs in ``dtype``
        (None: the wrapper's own default)."""
        if self.reduce_dtype == "auto":
            return dtype if self.compute == "16-bit" else torch.float32
        return self.reduce_dtype

    def resolve(self, device: Any = None) -> Recipe:
        """This recipe as it runs on ``device``: every ``"auto"`` that the device decides made
        concrete -- ``dtype``, ``loss_scale``, ``reduce_dtype``, ``update`` where no update mode
        can run, ``gradients`` where they cannot be released -- so ``print(recipe.resolve())``
        shows what "auto" became. What an optimizer decides (``update``, ``optimizer_states``)
        is resolved per optimizer (``opt.recipe``); a ``gradients="auto"`` that can release
        stays ``"auto"`` until the loop's first step decides (``opt.recipe`` after it)."""
        low = self.resolved_dtype(device)
        modes = self.weights == "16-bit" and not self.masters
        fields: dict[str, Any] = dict(
            dtype=None if low == torch.float32 else low,
            loss_scale=self.scaling(low),
            reduce_dtype=self.reduced_in(low),
        )
        if self.update == "auto" and not modes:
            fields["update"] = None
        if self.gradients == "auto" and not self.releases_gradients(low):
            fields["gradients"] = "held"
        return dataclasses.replace(self, **fields)

    def policy(self, dtype: torch.dtype | None = None) -> Policy:
        """The root module's :class:`~mixprec.Policy`: parameter, compute and output dtype."""
        low = dtype or self.resolved_dtype()
        return Policy(
            param_dtype=low if self.weights == "16-bit" else torch.float32,
            compute_dtype=low if self.compute == "16-bit" else torch.float32,
            output_dtype=self.outputs or torch.float32,
        )

    def region_settings(self) -> tuple[Policy, str, Any]:
        """What a :class:`mixprec.autocast` region applies: the policy, the kernels, FP8."""
        return self.policy(), self.kernels, self.fp8

    def __str__(self) -> str:
        base = Recipe(self.name, self.dtype)
        skip = ("fp32_inside", base.fp32_inside and self.compute == base.compute)  # implied
        implied = self.dtype is None or self.dtype == NAMES[self.name][1]
        words = [self.name] + ([] if implied else [SHORT[self.dtype]])
        words += [f"{k}={word(v)}" for k, v in _changed(self, base) if (k, v) != skip]
        return " ".join(words)

    def table(self, states: int = 2, dtype: torch.dtype | None = None) -> str:
        """Each tensor class with its dtype and bytes per parameter, for an optimizer with
        ``states`` states per parameter (AdamW: 2, SGD with momentum: 1)."""
        return render_table(self, states, dtype or self.resolved_dtype())

    def loop_bytes(self, states: int = 2, dtype: torch.dtype | None = None) -> dict[str, float]:
        """Bytes per parameter of the training state in each loop shape users have: ``plain``,
        ``clip`` (global-norm clipping), ``accumulate`` (several backward passes a step) and
        ``fsdp2`` (per rank, of its shard), and ``first_step`` (the plain loop's first step), as
        the last line of :meth:`table` states them."""
        return loop_bytes(self, states, dtype or self.resolved_dtype())


def as_recipe(spec: Any, dtype: Any = None) -> Recipe:
    """A :class:`Recipe` from a Recipe, a name or recipe string, or any policy spelling, in
    ``dtype`` when given (a Recipe that already names another dtype is an error)."""
    low = None if dtype is None else _dtype_arg(dtype)
    if isinstance(spec, Recipe):
        if low is None or spec.dtype == low:
            return spec
        if spec.dtype is not None:
            raise ValueError(
                f"The recipe says dtype={spec.dtype} and dtype={low} was given as well; give "
                f"it once: recipe.replace(dtype={low})."
            )
        return dataclasses.replace(spec, dtype=low)  # checked again, as any new recipe
    if isinstance(spec, str) and _names_a_recipe(spec):
        return as_recipe(Recipe(spec), low)
    if isinstance(spec, (str, Policy, torch.dtype)):
        return _policy_recipe(spec, low)
    raise TypeError(
        f"Expected a mixprec.Recipe, a recipe name ({', '.join(NAMES)}) or a Policy; received "
        f"{type(spec).__name__}."
    )


def _names_a_recipe(line: str) -> bool:
    """Whether ``line`` starts with a recipe's name (else it may spell a policy)."""
    words = line.split()
    return bool(words) and (words[0].upper() in _LEVELS or words[0] in NAMES)


def _policy_recipe(spec: Any, low: torch.dtype | None) -> Recipe:
    """:func:`as_recipe` of a policy spelling: the recipe its three dtypes read as."""
    try:
        policy = as_policy(spec)
    except ValueError:
        others = [n for n in NAMES if n not in _LEVELS]
        raise ValueError(
            f"Cannot read {spec!r} as a recipe or a policy: expected 'O0', 'O1', 'O2' or "
            f"'O3' (the letter O, not zero; any case), a named recipe ({', '.join(others)}), "
            "a Recipe, or a policy spelling ('mixed_bfloat16', 'p=f32,c=bf16,o=f32')."
        ) from None
    if low is not None:
        raise ValueError(
            f"The policy {spec!r} carries its dtype; give the policy or a dtype, not both."
        )
    return Recipe(policy)


def level_recipe(spec: Any) -> Recipe | None:
    """``spec`` as a Recipe where it is one, or a line that starts with a level (``"O2"``,
    ``"o3 bf16 update=none"``); None for anything else -- a policy spelling, which the tools
    that take "a recipe or a policy" (``convert``, ``for_inference``, ``tune``) read as one."""
    if isinstance(spec, Recipe):
        return spec
    words = spec.split() if isinstance(spec, str) else []
    return Recipe(spec) if words and words[0].upper() in _LEVELS else None


# -- construction helpers ----------------------------------------------------------------------


def _dtype_arg(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype) and not value.is_floating_point:
        raise TypeError(
            f"dtype must be a floating dtype (torch.bfloat16 or torch.float16), received {value}."
        )
    return _dtype(value, "dtype")


def _policy_fields(policy: Policy, dtype: Any = None, one_meaning: bool = False) -> dict[str, Any]:
    """The fields ``policy``'s three dtypes say: the level, the dtype and the outputs. With
    ``one_meaning``, a policy spelled with a recipe's name (any case) that reads as another
    recipe is refused."""
    if not policy.is_lower:
        fields: dict[str, Any] = {"name": "O0", "outputs": policy.output_dtype}
    else:
        level = "O1" if policy.param_dtype == torch.float32 else "O3"
        fields = {"name": level, "dtype": policy.compute_dtype, "outputs": policy.output_dtype}
    if dtype is not None and _dtype_arg(dtype) != fields.get("dtype"):
        raise ValueError(
            f"Recipe({policy!r}, dtype={dtype}): the policy carries its dtype; give the policy "
            "or a dtype, not both."
        )
    named = next((n for n in NAMES if n.lower() == policy.name.strip().lower()), None)
    if one_meaning and named is not None and Recipe(**fields) != Recipe(named):
        _refuse_two_meanings(policy, named, Recipe(**fields))
    return fields


def _refuse_two_meanings(policy: Policy, named: str, read: Recipe) -> None:
    differ = [k for k, _ in _changed(read, Recipe(named))]
    as_name = " ".join(f"{k}={word(getattr(Recipe(named), k))}" for k in differ)
    as_dtypes = " ".join(f"{k}={word(getattr(read, k))}" for k in differ)
    agree = [n for n in NAMES if _policy_reads_as(n)]
    raise ValueError(
        f"Received {policy!r} where a recipe is expected, and {policy.name!r} means two "
        f"recipes: the recipe named {named!r} ({as_name}) and, read by the policy's three "
        f"dtypes, {str(read)!r} ({as_dtypes}). Allowed: a Policy whose name is no recipe's, "
        f"or whose dtypes read as the recipe of its name ({', '.join(agree)}). Write the "
        f"name {named!r} (or Recipe({named!r})) for the named recipe, or "
        f"Recipe.from_policy({policy.name!r}) (or {str(read)!r}) for the policy's dtypes."
    )


def _policy_reads_as(name: str) -> bool:
    """Whether ``name`` spells a policy whose dtypes read as the recipe ``name``."""
    try:
        policy = Policy(name)
    except ValueError:
        return False
    return Recipe(**_policy_fields(policy)) == Recipe(name)


def _given(r: Recipe) -> dict[str, Any]:
    names = [f.name for f in dataclasses.fields(r)]
    return {k: getattr(r, k) for k in names if getattr(r, k) is not _PRESET}


def _given_only(r: Recipe, changes: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``r`` that differ from its own preset (kept across a change of name)."""
    base = Recipe(r.name, r.dtype)
    kept = {k: v for k, v in _changed(r, base) if k not in changes}
    return {"dtype": r.dtype, **kept}


def _filled(given: dict[str, Any]) -> dict[str, Any]:
    """Every field: the given ones, normalised; the rest from the preset, then the defaults."""
    name, preset = _preset(given["name"])
    out = {**DEFAULTS, **preset, **given, "name": name}
    if out["compute"] == "fp32" and "fp32_inside" not in given:
        out["fp32_inside"] = False  # a preset's 16-bit compute option: nothing to apply
    if out["dtype"] is None:
        out["dtype"] = NAMES[name][1]  # the dtype the name implies, if any
    if out["dtype"] is not None:
        out["dtype"] = _dtype_arg(out["dtype"])
    for key, normalise in _SPELLINGS.items():  # the defaults are in their one spelling
        if out[key] != DEFAULTS[key]:
            out[key] = normalise(out[key])
    if isinstance(out["optimizer_states"], Mapping):
        out["optimizer_states"] = tuple(sorted(out["optimizer_states"].items()))
    return out


def _loss_scaling(spec: Any) -> Any:
    if spec is None or spec == "auto" or isinstance(spec, LossScaling):
        return spec
    if spec == "dynamic":
        return LossScaling()
    number = isinstance(spec, (int, float)) and not isinstance(spec, bool)
    if number and math.isfinite(spec) and spec > 0:
        return LossScaling(dynamic=False, init_scale=float(spec))
    raise ValueError(
        f"Recipe(loss_scale={spec!r}): expected 'auto', 'dynamic', a finite number > 0 (a "
        "static scale, e.g. loss_scale=128.0), None (off) or mixprec.LossScaling(...)."
    )


#: the fields given in several spellings, and how each is brought to its one
_SPELLINGS = {
    "fp8": as_fp8_config,
    "activations": as_activation_config,
    "loss_scale": _loss_scaling,
}


def _changed(a: Any, b: Any) -> list[tuple[str, Any]]:
    return [
        (f.name, getattr(a, f.name))
        for f in dataclasses.fields(a)
        if f.name not in ("name", "dtype") and getattr(a, f.name) != getattr(b, f.name)
    ]
