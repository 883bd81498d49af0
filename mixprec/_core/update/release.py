"""Gradients released in backward: each 16-bit parameter stepped in its post-accumulate-grad
hook and its gradient freed (``Recipe(gradients="released")``), so they never exist all at once.

What needs every gradient -- a whole-step skip, clipping, accumulation, DDP -- is refused with
the fix, not done wrong; a non-finite gradient leaves its own parameter unchanged and the step
warns. ``gradients="auto"``'s first step codes the gradients in 8 bits as they complete
(:mod:`.coded`: a byte per parameter, where holding them would cost two) and watches for a clip
or a second gradient; seeing either, it keeps coding them (held in 16 bits where the clip needs
the values themselves: by value, or another norm than 2), seeing neither, it releases them
from the next backward on. ``docs/design.md``, "Optimizer states in fewer bits", its
subsection on released gradients.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import Tensor

from mixprec._core._warnings import MixprecNumericsWarning, MixprecWarning, user_stacklevel
from mixprec._core.update.heap import first_on_cpu, trim_heap

__all__ = ["RELEASED", "SPARSE", "ReleasedGradients"]

#: why an update mode refuses a sparse gradient
SPARSE = (
    "update modes need dense gradients; a parameter has a sparse gradient (use update=None "
    "for this optimizer)."
)

#: why a clip of released gradients is refused (``gradients="released"``)
RELEASED = (
    "These parameters' gradients are released in backward (Recipe gradients='released'): each "
    "was stepped and freed as soon as it was computed, so there is no gradient left to clip, "
    "and a norm over all of them never exists at once. Use gradients='auto' (the 'lean' "
    "default: held where the loop clips) or gradients='held' to clip, e.g. "
    "Recipe('lean', gradients='held')."
)
_AUTO_RELEASED = (
    "These parameters' gradients are released in backward: Recipe gradients='auto' released "
    "them after a first step that neither clipped nor accumulated, and each is now stepped and "
    "freed as soon as it is computed, so there is nothing left to {what}. A loop that clips or "
    "accumulates from its first step keeps them held; one that starts later must say so: use "
    "gradients='held', e.g. Recipe('lean', gradients='held')."
)
_CODED_CLIP = (
    "gradients='coded' keeps each gradient's 2-norm as it codes it: a clip by value or by "
    "another norm needs the gradients themselves. Use gradients='held' (e.g. "
    "Recipe('lean', gradients='held')) for such a clip."
)
#: what "auto" says where its first step keeps the gradients: how, why, the setting
_KEPT = (
    "Recipe gradients='auto' {}: {}. Pass gradients='{}' to say so; gradients='released' saves "
    "those bytes in a loop that neither clips nor accumulates."
)
_HOW = {
    "coded": "codes the gradients in 8 bits as they complete (1 byte per parameter until the "
    "step, see gradients='coded')",
    "held": "holds the gradients until zero_grad (16 bits, 2 bytes per parameter)",
}
_NEEDS = {
    "clipping": "this training loop clips them (a global norm needs every gradient at once)",
    "accumulation": "this training loop accumulates them over several backward passes",
}


#: float dtype -> (integer view, exponent bits): a value is finite unless its exponent bits
#: are all ones
_EXPONENT = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
}


def all_finite(g: Tensor) -> bool:
    """Whether every element of gradient ``g`` is finite: the exponent bits of its integer
    view, whose largest must be below all ones (one masking pass and one reduction; 3x faster
    than ``isfinite(g.abs().amax())`` on a CPU for bf16)."""
    view = _EXPONENT.get(g.dtype)
    if g.numel() == 0:
        return True
    if view is None:
        return bool(torch.isfinite(g.abs().amax()))  # amax keeps NaN
    itype, exponent = view
    return bool(torch.bitwise_and(g.view(itype), exponent).amax() < exponent)


class ReleasedGradients:
    """The release half of :class:`~mixprec._core.update.modes.ModeUpdater` (a mixin: it reads the
    updater's ``optimizer``, ``fused``, ``_step_params``, ``_free_scratch``, ``_ordinal`` and
    ``add_params``)."""

    optimizer: torch.optim.Optimizer
    fused: Any  # the updater's .fused.FusedUpdates
    gradients: str  # how they are kept now: held, released or coded
    _ordinal: dict[int, int]  # id(param) -> its position, a key of the stochastic rounding

    def __deepcopy__(self, memo: dict) -> ReleasedGradients:
        """``copy.deepcopy((model, opt))``: the copy's parameters are new objects, so the
        rounding keys (by parameter identity) are re-keyed to them, and the release hooks,
        which a copied parameter does not carry, are registered on them."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        rest = {k: v for k, v in self.__dict__.items() if k not in ("_ordinal", "_groups_table")}
        new.__dict__.update(copy.deepcopy(rest, memo))  # the optimizer, its parameters too
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        new._ordinal = {
            id(copy.deepcopy(p, memo)): self._ordinal[id(p)]
            for p in params
            if id(p) in self._ordinal
        }
        # the copied parameters' release hooks and clipping guard, as the updater gives its
        # own (released, or "auto" until its first step; nothing else is new for them)
        new.add_params([p for g in new.optimizer.param_groups for p in g["params"]])
        return new

    def _init_release(self, asked: str) -> None:
        """``asked``: the recipe's ``gradients``, ``"held"``, ``"released"``, ``"auto"`` or
        ``"coded"``. ``gradients`` is how they are kept now: ``"auto"`` codes them while its
        first step decides (``deciding``), then holds, codes or releases them."""
        self.asked = asked
        self.gradients = "coded" if asked == "auto" else asked  # held, released or coded
        self.deciding = asked == "auto"  # "auto" before the end of its first step
        self.held_for: str | None = None  # what "auto"'s first step did that needs them held
        self.nonfinite = 0  # released parameters left unchanged for a non-finite gradient
        self._released: set[int] = set()  # ids of the parameters with a gradient in this step

    @torch.no_grad()
    def _step_released(self, p: Tensor) -> None:
        """The post-accumulate-grad hook: step ``p`` alone and free its gradient, or code it;
        while "auto" decides, only watch (a second gradient before the step accumulates)."""
        if self.gradients == "released":
            self._step_one(p)
            return
        if self.deciding:
            if id(p) in self._released:
                self.held_for = self.held_for or "accumulation"
            self._released.add(id(p))
        g = p.grad
        if self.gradients == "coded" and g is not None and not (self.deciding and g.is_sparse):
            self._code_grad(p)  # mixprec._core.update.coded (a sparse one "auto" leaves held)

    def _step_one(self, p: Tensor) -> None:
        """:meth:`_step_released` once gradients are released."""
        if id(p) in self._released:
            raise RuntimeError(self._second_gradient())
        if not self._released:  # the first of this backward: free the scratch at its end
            torch.autograd.Variable._execution_engine.queue_callback(self._free_scratch)
        self._released.add(id(p))
        if p.grad is None:
            return
        if p.grad.is_sparse:
            raise RuntimeError(SPARSE)
        if not self.fused.finite(p.grad):
            self.nonfinite += 1
            p.grad = None
            return
        fresh = first_on_cpu(self.optimizer.state, [p])
        self._step_params(self._group_of(p), [p], False)
        p.grad = None
        if fresh:  # its first state was made, narrowed and freed: holes that stay resident
            trim_heap()  # (see trim_heap); later steps reuse their own holes, and trimming
            # each one would hand pages back that the next parameter faults in again

    def _second_gradient(self) -> str:
        """Why a second gradient of a released parameter before the step is refused."""
        if self.asked == "auto":
            return "A parameter received a second gradient before optimizer.step(). " + (
                _AUTO_RELEASED.format(what="accumulate into")
            )
        return (
            "A parameter received a second gradient before optimizer.step(): with "
            "gradients='released' each parameter is stepped in backward, so gradients "
            "cannot be accumulated over several backward passes. Use a recipe with "
            "gradients='auto' or 'held' (e.g. Recipe('lean', gradients='held')) to accumulate."
        )

    def _group_of(self, p: Tensor) -> int:
        """The index of ``p``'s group, from a table of each parameter's (group, position) made
        again when ``p`` is not where it says (a scan per parameter would cost the square of
        their number in host time each step)."""
        groups = self.optimizer.param_groups
        table = self.__dict__.get("_groups_table", {})
        i, k = table.get(id(p), (len(groups), 0))
        plist = groups[i]["params"] if i < len(groups) else ()
        if k >= len(plist) or plist[k] is not p:  # new, moved, or the groups changed
            table = {id(q): (i, k) for i, g in enumerate(groups) for k, q in enumerate(g["params"])}
            self.__dict__["_groups_table"] = table
            i = table[id(p)][0]
        return i

    def _clip_refusal(self, coded_clip: bool = True) -> str | None:
        """Why a clip of these gradients cannot be done, or None (held, or coded and
        ``coded_clip``: a 2-norm clip). "auto"'s first step keeps them; for a clip that cannot
        read codes it decodes them into held ones, ``gradients="coded"`` refuses it."""
        if self.gradients == "released":
            return _AUTO_RELEASED.format(what="clip") if self.asked == "auto" else RELEASED
        if self.deciding:
            self.held_for = self.held_for or "clipping"
        if self.gradients == "coded" and not coded_clip:
            if not self.deciding:
                return _CODED_CLIP
            self._hold_decoded()
        return None

    def _hold_decoded(self) -> None:
        """ "auto"'s first step met a clip that needs the gradients themselves: each coded one
        decoded into a held gradient of its dtype (its coding's error stays in it, said once),
        and the gradients held from here on."""
        params = [p for g in self.optimizer.param_groups for p in g["params"] if self.has_codes(p)]
        for p in params:
            p.grad = self.coded_grad(p).clone()
        self._drop_codes()
        self.gradients = "held"
        if params:
            warnings.warn(
                "Recipe gradients='auto' coded this first step's gradients in 8 bits as they "
                "completed; this clip needs them whole (by value, or a norm other than 2), so "
                "they are decoded into held gradients (each within 2**-4 of its value, this "
                "step only) and held from now on. Pass gradients='held' for exact gradients "
                "from the first step.",
                MixprecNumericsWarning,
                stacklevel=user_stacklevel(),
            )

    def _settle_release(self) -> bool:
        """End "auto"'s first step (one with a backward): hold the gradients for good if it
        clipped or accumulated (saying so), else release them and return True (freed as used)."""
        if not self.deciding or not self._released:
            return False
        self.deciding = False
        if self.held_for is None:
            self.gradients = "released"
            return True
        kind = self.gradients
        warnings.warn(_KEPT.format(_HOW[kind], _NEEDS[self.held_for], kind), MixprecWarning,
                      stacklevel=user_stacklevel())  # fmt: skip
        return False

    def release_state(self) -> dict[str, Any]:
        """What "auto"'s first step decided, for a checkpoint: a resumed run goes on as the
        saved one did, instead of deciding again (its first step would code the gradients)."""
        decided = self.gradients if self.asked == "auto" and not self.deciding else None
        return {"mode": self.asked, "decided": decided, "held_for": self.held_for}

    def load_release_state(self, saved: dict[str, Any] | None) -> None:
        """Take the saved run's decision where both this recipe and the saved one are "auto"."""
        if not saved or saved.get("decided") is None or self.asked != "auto":
            return
        if saved.get("mode") != "auto":
            return
        self.deciding = False
        self.held_for = saved.get("held_for")
        self.gradients = saved["decided"]
        self._drop_codes()  # no buffers kept where they are no longer coded

    def _zero_released(self) -> None:
        """``zero_grad`` while "auto" decides: the next backward starts a new step, not an
        accumulation."""
        if self.deciding:
            self._released.clear()
        self._drop_codes()

    def _end_released(self) -> None:
        """Close a step whose gradients were released: say what a non-finite gradient left."""
        self._settle_release()  # a skipped first step of "auto" decides as well
        self._released.clear()
        self._drop_codes()  # stepped, or skipped with the step
        if self.nonfinite:
            self._warn_nonfinite()

    def _warn_nonfinite(self) -> None:
        """Say how many released parameters a non-finite gradient left unchanged this step."""
        count, self.nonfinite = self.nonfinite, 0
        warnings.warn(
            f"{count} parameter(s) received a non-finite gradient with gradients="
            "'released': those parameters and their optimizer states were left unchanged, "
            "but the others had already been stepped in backward (a step cannot be skipped "
            "as a whole once gradients are released). Use gradients='held' to skip whole "
            "steps.",
            MixprecNumericsWarning,
            stacklevel=user_stacklevel(),
        )
