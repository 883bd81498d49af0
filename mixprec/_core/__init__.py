"""The core: everything a mixed-precision training step needs, and nothing above it.

Data flows down this list (see ``docs/design.md``):

* :mod:`~mixprec._core.names` -- the words of the Recipe's fields (levels, update modes), once;
* :mod:`~mixprec._core.policy` -- dtype policies (``mixed_bfloat16`` ...) and the global policy;
* :mod:`~mixprec._core.cast_table` -- the op rules (16-bit / fp32 / promote), as data that the
  engine, the graph pass and the docs all read; :mod:`~mixprec._core.torch_lists` holds torch's
  own autocast lists, so the differences are known;
* :mod:`~mixprec._core.engine` and :mod:`~mixprec._core.regions` -- the eager engine:
  ``autocast`` regions, module boundaries and ``set_policy``; a region's push and pop of torch's
  Autocast dispatch state, and the registrations at first use;
  :mod:`~mixprec._core.traced` -- the engine's frames under ``torch.compile``;
  :mod:`~mixprec._core.attention` -- faster 16-bit formulations of a few ops;
* :mod:`~mixprec._core.loss_scale` -- static and dynamic loss scaling;
* :mod:`~mixprec._core.optimizer` -- fp32 master weights, unscale and finite check, skipped steps,
  ``scale_loss`` (its gradient machinery in ``_gradients``, its checkpoint in
  ``_optimizer_state``); :mod:`~mixprec._core.clipping` plugs into it;
  :mod:`~mixprec._core.optimizer_view` gives optimizer wrappers (``LARC(SGD(...))``) a
  ``torch.optim.Optimizer`` face; :mod:`~mixprec._core.resume` -- where its checkpoint state
  lives, and resumes in either load order;
* :mod:`~mixprec._core.update` -- the update path, a package to read on its own: the update
  plans, the update modes (pure 16-bit updates and their rounding), released gradients, the
  8- and 4-bit state codes and the fused kernels; the optimizer hands each step to it;
* :mod:`~mixprec._core.activations` -- saved-for-backward tensors stored in FP8 or 16-bit, or
  recomputed (``activations=``), with the FP8 quantization of :mod:`mixprec.fp8`;
* :mod:`~mixprec._initialize` -- the O0-O3 levels that wire all of the above to a model;
* :mod:`~mixprec._core.hardware`, :mod:`~mixprec._core.memory`, :mod:`~mixprec._core.footprint`,
  :mod:`~mixprec._core.norms` -- facts about the device, memory and layers that the rest consult.

FP8 lives in its own package, :mod:`mixprec.fp8` (quantization, GEMM, Linear, layer choice),
which the engine and ``initialize`` call and which imports only the leaf modules here (policy,
hardware). Nothing here imports the tools (graph pass, numerics, inference, distributed, compat,
CLI);
they build on the core and register with it where they must. Public names are re-exported from
:mod:`mixprec`.
"""
