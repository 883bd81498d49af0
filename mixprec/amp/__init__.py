"""A drop-in for ``torch.amp``: ``import mixprec.amp as amp``, then ``amp.autocast`` and
``amp.GradScaler`` where the code said ``torch.autocast`` / ``torch.amp.*``.

Design choice: the classes *are* torch's (subclasses), not re-implementations. Their
arguments, defaults, errors, private attributes (which trainers and PyTorch's own tests read),
``state_dict`` and pickles are torch's, and by default they compute bit for bit what torch
computes. What they add is opt-in or invisible to code that does not ask:

* ``autocast(..., cast_rules="mixprec")``: mixprec's cast table on every device;
* ``GradScaler(..., hysteresis=, min_scale=, max_scale=)``: the scale rule of
  :class:`mixprec._core.loss_scale.LossScaler`; ``skipped_steps`` / ``step_skipped``;
  ``locate_nonfinite=`` for a
  report naming the non-finite gradients of a skipped step;
* with more than one rank, every rank skips the same steps and keeps the same scale (DDP, and
  FSDP2 through torch's own DTensor reduction), with no separate sharded scaler.

And torch's traps are fixed: a closure passed to ``step()`` (LBFGS) steps on unscaled
gradients, a disabled scaler's getters answer, a scaler used with bfloat16 says once that it
does nothing useful, and ``is_autocast_available("foo")`` answers False.
"""

from mixprec.amp.autocast_mode import autocast, custom_bwd, custom_fwd, is_autocast_available
from mixprec.amp.grad_scaler import GradScaler

__all__ = ["GradScaler", "autocast", "custom_bwd", "custom_fwd", "is_autocast_available"]
