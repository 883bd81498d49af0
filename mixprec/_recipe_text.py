"""A :class:`~mixprec.Recipe` as text: the one-line grammar and the bytes-per-parameter table.

Grammar (jmp's policy strings, extended to every field): the preset's name, the dtype, then
``field=value`` for each field that differs from the preset, separated by spaces::

    O3 bf16 update=none optimizer_states=bf16
    O2 fp16 loss_scale=dynamic(init_scale=1048576.0,growth_interval=2) fp8=rowwise(layers=all)

Values are ``none``, ``true`` / ``false``, dtype names, numbers, names, or ``name(k=v,...)``
for the settings of a config (loss scaling, FP8, activations). :func:`word` writes a value,
:func:`parse` reads a line back into field values; ``Recipe(str(r)) == r`` for every recipe
whose FP8 layers are not a Python predicate.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from mixprec._core.activations import ActivationConfig
from mixprec._core.loss_scale import LossScaling
from mixprec._core.names import FLAGS
from mixprec._core.policy import _dtype
from mixprec._core.update.state_codes import BLOCK, FORMATS
from mixprec.fp8.config import FP8Config

__all__ = ["SHORT", "parse", "render_table", "word"]

SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_CALL = re.compile(r"^([\w.+-]+)\((.*)\)$")
_DTYPES = ("outputs", "reduce_dtype")


def word(value: Any) -> str:
    """One field value as a word of the grammar (no spaces)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, torch.dtype):
        return SHORT.get(value, str(value).removeprefix("torch."))
    if isinstance(value, FP8Config):
        if callable(value.layers):
            return "<FP8Config with a layer predicate: not expressible as text>"
        return _call(value.recipe, value, FP8Config(value.recipe), skip=("recipe",))
    if isinstance(value, ActivationConfig):
        head = "recompute" if value.storage is None else value.storage
        return _call(head, value, ActivationConfig(value.storage), skip=("storage",))
    if isinstance(value, tuple):  # optimizer_states as (name, dtype) pairs
        return ",".join(f"{k}:{word(v)}" for k, v in value)
    return str(value)


def _call(head: str, value: Any, base: Any, skip: tuple[str, ...]) -> str:
    moved = [
        f"{f.name}={word(getattr(value, f.name))}"
        for f in dataclasses.fields(value)
        if f.name not in skip and getattr(value, f.name) != getattr(base, f.name)
    ]
    return head + (f"({','.join(moved)})" if moved else "")


def _scalar(text: str) -> Any:
    low = text.lower()
    if low in ("none", "true", "false"):
        return {"none": None, "true": True, "false": False}[low]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _settings(text: str) -> tuple[str, dict[str, Any]]:
    match = _CALL.match(text)
    if match is None:
        return text, {}
    head, body = match.groups()
    pairs = [item.split("=", 1) for item in body.split(",") if item]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"Cannot read {text!r}: expected name(key=value,...).")
    return head, {k: _scalar(v) for k, v in pairs}


def _value(field: str, text: str) -> Any:
    """Read the word ``text`` as the value of ``field``."""
    if field in ("keep_fp32", "compute", "weights", "kernels"):  # choices, "none" among them
        return text
    if text.lower() == "none":
        return None
    if field in FLAGS:
        return _scalar(text)
    if field in _DTYPES:
        return text if text == "auto" else _dtype(text, field)
    if field in ("num_losses", "update_seed"):
        return int(text)
    if field == "optimizer_states":
        if ":" in text:
            return {k: _state_word(v, k) for k, v in (p.split(":") for p in text.split(","))}
        return text if text == "auto" else _state_word(text, field)
    if field == "loss_scale":
        head, kw = _settings(text)
        if head not in ("auto", "dynamic"):
            return float(head)
        return LossScaling(**kw) if kw else head
    if field == "fp8":
        head, kw = _settings(text)
        return FP8Config(recipe=head, **kw)
    if field == "activations":
        head, kw = _settings(text)
        return ActivationConfig(storage=None if head == "recompute" else head, **kw)
    return text


def _state_word(text: str, field: str) -> Any:
    return text if text in FORMATS else _dtype(text, field)


def parse(line: str, fields: set[str]) -> dict[str, Any]:
    """The field values a recipe line states (``name``, ``dtype`` and the changed fields of
    ``fields``)."""
    words = line.split()
    out: dict[str, Any] = {"name": words[0]}
    rest = words[1:]
    if rest and "=" not in rest[0]:
        out["dtype"] = None if rest[0] == "auto" else _dtype(rest[0], "dtype")
        rest = rest[1:]
    for item in rest:
        key, sep, text = item.partition("=")
        if not sep or key not in fields - {"name", "dtype"}:
            raise ValueError(
                f"Cannot read {item!r} in recipe {line!r}: expected field=value with a Recipe "
                f"field ({', '.join(sorted(fields - {'name', 'dtype'}))})."
            )
        out[key] = _value(key, text)
    return out


# -- the table -----------------------------------------------------------------------------------


def _bytes(dtype: torch.dtype | str) -> float:
    """Bytes per element of a dtype, or of a state format (its codes and block scales)."""
    if isinstance(dtype, str):
        return FORMATS[dtype][0] / 8 + 4 / BLOCK
    return dtype.itemsize


def _rows(r: Any, states: int, low: torch.dtype) -> list[tuple[str, str, float]]:
    """(tensor class, how it is held, bytes per parameter) for a recipe in ``low``."""
    weight = low if r.weights == "16-bit" else torch.float32
    update = r.update
    if update == "auto" and r.weights == "16-bit" and not r.masters:
        update = "kahan (auto)"  # bf16, and fp16 with an Adam-family optimizer
    elif r.masters:
        update = "fp32 masters, rounded to nearest"
    elif r.weights == "fp32":
        update = "the optimizer's own, fp32"
    rows = [("weights", word(weight), _bytes(weight))]
    rows.append(("master weights", "fp32" if r.masters else "none", 4 if r.masters else 0))
    kahan = isinstance(update, str) and update.startswith("kahan")
    rows.append(("update", word(update), _bytes(low) if kahan else 0))
    if r.masters:  # computed in 16 bits in backward, then held in fp32 on the masters
        rows.append(("gradients", f"{word(weight)}, then fp32 on the masters", _bytes(weight) + 4))
    elif r.gradients == "coded":  # FP8 E4M3 codes with a float32 scale per block
        rows.append(("gradients", "8-bit codes (E4M3, a scale per 256) from backward to step",
                     1 + 4 / BLOCK))  # fmt: skip
    elif r.releases_gradients(low):  # one parameter's at a time
        auto = r.gradients == "auto"
        held = "; 8-bit codes (+1 B) where the loop clips or accumulates" if auto else ""
        rows.append(("gradients", f"{word(weight)}, released in backward{held}", 0))
    else:
        rows.append(("gradients", word(weight), _bytes(weight)))
    own = r.update is None or r.masters or r.weights == "fp32"  # the optimizer's own step
    rows.append(("optimizer states", *_states(r, own, weight, states)))
    reduce = r.reduced_in(low)
    rows.append(
        ("reduced across ranks", "as the wrapper's default" if reduce is None else word(reduce), 0)
    )
    rows.append(("saved for backward", _activations(r, low), 0))
    rows.append(("FP8 GEMMs", "none" if r.fp8 is None else word(r.fp8), 0))
    scaling = r.scaling(low)
    rows.append(("loss scaling", "off" if scaling is None else str(scaling), 0))
    return rows


def _states(r: Any, own: bool, weight: torch.dtype, states: int) -> tuple[str, float]:
    if own:  # the optimizer's own step: states as the weights it steps
        held = torch.float32 if r.masters else weight
        return f"{states} x {word(held)}", states * _bytes(held)
    if r.optimizer_states == "auto":  # first moment 16-bit, the others fp32
        first = weight if states else torch.float32
        rest = max(states - 1, 0)
        return f"1 x {word(first)} + {rest} x fp32", _bytes(first) + 4 * rest if states else 0
    if isinstance(r.optimizer_states, (torch.dtype, str)):
        return f"{states} x {word(r.optimizer_states)}", states * _bytes(r.optimizer_states)
    table = dict(r.optimizer_states)  # {state name: kind}, the unnamed ones fp32
    names = _STATE_NAMES.get(states)
    if names is None:  # an optimizer whose state names the table does not know
        return word(r.optimizer_states), float(sum(_bytes(d) for d in table.values()))
    kinds = [table.get(n, torch.float32) for n in names]
    return " + ".join(f"{n} {word(k)}" for n, k in zip(names, kinds)), sum(map(_bytes, kinds))


#: the states of the optimizer ``table(states=...)`` stands for: AdamW's two, SGD's momentum
_STATE_NAMES = {2: ("exp_avg", "exp_avg_sq"), 1: ("momentum_buffer",), 0: ()}


def _activations(r: Any, low: torch.dtype) -> str:
    a = r.activations
    if a is None:
        return f"as computed ({word(low) if r.compute == '16-bit' else 'fp32'})"
    return word(a)


def loop_bytes(r: Any, states: int, low: torch.dtype) -> dict[str, float]:
    """Bytes per parameter of the training state in each loop shape: ``plain`` (forward,
    backward, step), ``clip`` (a global-norm clip before the step), ``accumulate`` (several
    backward passes per step) and ``fsdp2`` (per rank, per parameter of its shard); and
    ``first_step``, the plain loop's first step (``gradients="auto"`` codes them while it
    decides, before the step makes the states).

    Gradients released in backward are coded in 8 bits where the loop clips or accumulates.
    Under FSDP2 an update mode the recipe names (``"lean"``; not ``update="auto"``) shards the
    16-bit weights, their states and the held gradients; otherwise the fp32 shards are the
    master weights, stepped by the optimizer's own fp32 step."""
    rows = _rows(r, states, low)
    plain = float(sum(b for _, _, b in rows))
    weight = low if r.weights == "16-bit" else torch.float32
    released = not r.masters and r.releases_gradients(low)
    auto = released and r.gradients == "auto"  # coded where the loop clips or accumulates
    codes = 1 + 4 / BLOCK
    held = plain + (codes if auto else _bytes(weight) if released else 0.0)
    named = r.weights == "16-bit" and not r.masters and r.update not in ("auto", None)
    bare = plain - (codes if r.gradients == "coded" else 0.0)  # FSDP2 holds them 16-bit
    held_fsdp = bare + (_bytes(weight) if released or r.gradients == "coded" else 0.0)
    fsdp = held_fsdp if named else 4.0 + 4.0 + 4.0 * states  # fp32 shards unless one is named
    # "auto" codes the first step's gradients while it decides; the states are made by that
    # step, each parameter's as its codes are freed: the larger of the two at a time
    state_b = next((b for name, _, b in rows if name == "optimizer states"), 0.0)
    first = plain - state_b + max(state_b, codes) if auto else plain
    return dict(plain=plain, first_step=first, clip=held, accumulate=held, fsdp2=fsdp)


def render_table(r: Any, states: int, low: torch.dtype) -> str:
    """The table of :meth:`mixprec.Recipe.table`."""
    rows = _rows(r, states, low)
    width = max(len(name) for name, _, _ in rows)
    held_width = max(len(held) for _, held, b in rows if b)
    lines = [f"{r}  ({states} optimizer state(s) per parameter)"]
    lines += [
        f"  {name:<{width}}  {held:<{held_width}} {b:>5.1f} B/param" for name, held, b in rows if b
    ]
    lines += [f"  {name:<{width}}  {held}" for name, held, b in rows if not b]
    total = sum(b for _, _, b in rows)
    lines.append(f"  {'total':<{width}}  {'':<{held_width}} {total:>5.1f} B/param")
    loops = loop_bytes(r, states, low)
    first = (
        ""
        if loops["first_step"] == loops["plain"]
        else f" (its first step {loops['first_step']:.1f})"
    )
    lines.append(
        f"  by loop shape: plain {loops['plain']:.1f}{first}, clip {loops['clip']:.1f}, "
        f"accumulate {loops['accumulate']:.1f}, FSDP2 {loops['fsdp2']:.1f} B/param (per rank, "
        "of its shard)"
    )
    return "\n".join(lines)
