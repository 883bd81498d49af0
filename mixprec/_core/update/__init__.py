"""The update path: how a step writes 16-bit weights whose fp32 values exist only for a moment.

Read this package on its own. Its modules, in the order a step meets them: :mod:`.choice` (one
``UpdatePlan`` per optimizer, from the Recipe), :mod:`.step` (the optimizer wrapper's
hand-over), :mod:`.release` (gradients stepped and freed in backward), :mod:`.modes` (the update
modes, and their reference: the chunked fp32 step and its write-back), :mod:`.spec` (a kind of
one-pass step, and which backend runs it), :mod:`.fused` (the one pass per parameter; on a CPU
a C loop, :mod:`.c_loop`), :mod:`.fp32_step` (torch's fused
Adam/AdamW/SGD kernels for fp32 steps, O2's masters included), :mod:`.rounding` (stochastic
rounding by keyed random bits), :mod:`.state_codes` (8- and 4-bit optimizer states) and
:mod:`.heap` (freed heap pages handed back). It imports from the rest of the core only
``_warnings``, ``clipping`` (where released parameters are registered) and ``resume`` (the
checkpoint's layout); the optimizer wrapper (:mod:`mixprec._core.optimizer`) imports it, never
the other way round.

**One bf16 weight ``p`` of a Linear layer, AdamW, one step, under the "lean" recipe**
(O3, ``update="stochastic"``, ``optimizer_states="8-bit"``, ``gradients="auto"``, no loss
scale; ``p`` large enough that its states are coded, see :data:`.state_codes.MIN_NUMEL`):

1. ``initialize`` asks :func:`.choice.update_plans` for the plan; the optimizer wrapper's
   constructor calls :func:`.step.make_updater`, which builds a :class:`.modes.ModeUpdater` and
   registers ``p`` with :mod:`mixprec._core.clipping` as released (the plan does not hold it).
2. The backward's gradient of ``p`` is bf16. On the first step ``"auto"`` codes it in 8 bits
   (:mod:`.coded`) until ``step()`` and watches for a clip or a second backward
   (:mod:`.release`); seeing either, it keeps coding them; seeing neither, from
   the next backward on ``p``'s post-accumulate-grad hook (:class:`.release.ReleasedGradients`,
   the base of ``ModeUpdater``) steps ``p`` alone and frees the gradient at once, so the
   gradients never exist all at once.
3. The step: :func:`.spec.choose` picks the backend for ``p`` -- on a CPU the C loop of
   :mod:`.c_loop`, on a GPU :func:`torch.compile` of :mod:`.compiled_step`, the reference
   (:mod:`.modes`'s chunks of fp32 temporaries, the optimizer's own ``step()``) for what neither
   takes -- and :mod:`.fused` runs it: ``p``, its gradient and its codes (:class:`.state_codes.
   QuantizedState`; on the first step, zeros) are read once, AdamW's fp32 math runs per element,
   and everything is written back once.
4. The rounding: ``p = SR(w32)``, stochastic, with random bits hashed from (seed, step,
   parameter, element index) (:mod:`.rounding`), so chunks, released hooks and FSDP shards
   round alike.
5. The coded states: ``exp_avg`` goes back as sign + E4M3 codes and ``exp_avg_sq`` as the
   square root in E4M4, one fp32 scale per 256 elements of a row (:mod:`.state_codes`,
   chosen per key by :class:`.state_codes.StatePolicy`).
6. A non-finite gradient: released gradients cannot skip the whole step (earlier parameters
   already moved), so :mod:`.release` leaves ``p`` and its states as they were and the step
   warns with the count of such parameters.

**The same weight under O3 with ``update="kahan"``** (``optimizer_states="auto"``,
``gradients="held"``: the default, and what a loss scale's whole-step skips need): the
gradient stays on ``p.grad`` until ``step()``, where the wrapper's verdict comes first
(:mod:`mixprec._core._gradients`). Then :mod:`.modes` widens ``w32 = p + c`` (``c`` the bf16
compensation buffer), ``exp_avg`` from bf16 and ``exp_avg_sq`` as the fp32 it is kept in
(``"auto"`` of :class:`.state_codes.StatePolicy`), steps, and writes back ``p = round(w32)``
and ``c = round16(w32 - p)``: the reference; :mod:`.fused` does the same in one pass. A
skipped step never reaches :func:`.step.inner_step`: ``p``, ``c``, the states and the
rounding step count stay untouched.

**What a checkpoint stores.** :meth:`.modes.ModeUpdater.export_states` turns each coded state
into plain tensors and integers (:meth:`.state_codes.QuantizedState.to_dict`), and
:meth:`.modes.ModeUpdater.state_dict` adds the compensation buffers, the seed and the rounding
step count (:mod:`mixprec._core._optimizer_state` packs them under mixprec's entry). Nothing
saved names a class of this package, so ``torch.load(weights_only=True)`` reads it and a
resume is bit-exact; :func:`.state_codes.fp32_optimizer_state_dict` decodes it for a plain
torch optimizer.

**Not here.** :mod:`mixprec._core.memory` (``PeakMemory``) measures memory for benchmarks and
:mod:`mixprec._core.footprint` counts bytes per parameter for :mod:`mixprec.numerics`: both
observe a configuration rather than run a step, so they stay beside the core's other facts;
only ``trim_heap``, which the update calls, moved here (:mod:`.heap`). The loss scale and the
finite check that decide a skip live in :mod:`mixprec._core.loss_scale` and
:mod:`mixprec._core._gradients`.
"""
