"""Memory-lean 16-bit updates: the optimizer's fp32 step, written back to 16-bit weights by
nearest rounding, Kahan compensation or stochastic rounding (Zamirai et al. 2020, Collage 2024).

:class:`ModeUpdater` steps each 16-bit parameter in one pass where a backend takes it
(:mod:`.fused`); the rest, of any per-parameter optimizer, are the reference: widened with their
gradients and states (stored per key as the recipe says) into fp32 temporaries a chunk at a
time, stepped by the optimizer's own ``step()``, narrowed and rounded back (keyed: every layout
rounds alike, a resume is bit-exact). ``docs/design.md``, "Lean 16-bit updates".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from mixprec._core.clipping import register_released
from mixprec._core.update.choice import UpdatePlan
from mixprec._core.update.coded import CodedGradients
from mixprec._core.update.fp32_step import fused_by_default
from mixprec._core.update.fused import FusedUpdates
from mixprec._core.update.heap import first_on_cpu, trim_heap
from mixprec._core.update.release import SPARSE, ReleasedGradients
from mixprec._core.update.rounding import keyed_round_, round_keys, shard_offset
from mixprec._core.update.state_codes import (
    QuantizedState,
    StateDtype,
    StatePolicy,
    quantizable,
    store_state,
)

__all__ = ["UPDATES", "ModeUpdater", "StateDtype"]

UPDATES = ("nearest", "kahan", "stochastic")
_LOW = (torch.float16, torch.bfloat16)


def _local(t: Tensor) -> Tensor:
    """A DTensor's shard on this rank (FSDP2 parameters and gradients); any other tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


# --------------------------------------------------------------------------- the updater


class ModeUpdater(ReleasedGradients, CodedGradients):
    """Steps ``optimizer``'s 16-bit parameters (its ``param_groups`` hold the model's own, no
    fp32 masters; fp32 ones are stepped as they are) as ``plan`` says, an
    :class:`.choice.UpdatePlan` whose recipe checked every field: its ``update``
    (``"nearest"``, ``"kahan"`` or ``"stochastic"``, seeded by ``update_seed``), states held as
    ``optimizer_states`` says (:class:`.state_codes.StatePolicy`), ``gradients`` and ``kernels``."""

    def __init__(self, optimizer: Optimizer, plan: UpdatePlan):
        self.optimizer, self.plan = optimizer, plan
        self.update, self.seed = plan.update, plan.update_seed
        self._dtype_for = StatePolicy(plan.optimizer_states)
        self.compensation: dict[Tensor, Tensor] = {}
        self.steps = 0  # steps taken (not skipped): a key of the stochastic rounding
        self._ordinal: dict[int, int] = {}  # id(param) -> its position, a rounding key
        self._scratch: dict[tuple[str, torch.device], Tensor] = {}
        self._init_release(plan.gradients)  # (.release)
        self._init_codes()  # (.coded)
        self.fused = FusedUpdates(plan.kernels)  # one compiled pass per parameter
        self.add_params(p for g in optimizer.param_groups for p in g["params"])

    def add_params(self, params: Iterable[Tensor]) -> None:
        """Give new 16-bit parameters their zero Kahan compensation, and their release hook
        where gradients may be released (and to the clipping guard, which refuses their clip)."""
        params = list(params)
        hooks = self.asked != "held"  # released, or "auto" until its first step decides
        for p in params:
            self._ordinal.setdefault(id(p), len(self._ordinal))
            if p.dtype not in _LOW:
                continue
            if self.update == "kahan" and p not in self.compensation:
                self.compensation[p] = torch.zeros_like(
                    _local(p), memory_format=torch.contiguous_format
                )
            if hooks and p.requires_grad:
                p.register_post_accumulate_grad_hook(self._step_released)
        if hooks:
            register_released(params, self)

    def explain(self) -> str:
        """Which backend stepped each parameter at its last step, and why
        (:func:`~mixprec._core.update.spec.choose`), a line per parameter."""
        rows = []
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                choice = self.fused.choices.get(id(p))
                if p.dtype not in _LOW:
                    what = "the optimizer's own step (an fp32 parameter)"
                else:
                    what = (
                        "not stepped yet"
                        if choice is None
                        else f"{choice.backend}: {choice.reason}"
                    )
                dtype = str(p.dtype).removeprefix("torch.")
                rows.append(f"group {gi}, parameter {pi} {tuple(p.shape)} {dtype}: {what}")
        return "\n".join(rows)

    def params(self) -> list[Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    # -- the step --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> Any:
        """One optimizer step over every parameter with a gradient; returns the last result."""
        result = None
        drop = self._settle_release()  # "auto"'s first step, releasing: free grads as used
        try:
            for gi, group in enumerate(self.optimizer.param_groups):
                ready = [p for p in group["params"] if p.grad is not None]
                if any(p.grad.is_sparse for p in ready):
                    raise RuntimeError(SPARSE)
                own = [p for p in ready if p.dtype not in _LOW]
                low = [p for p in ready if p.dtype in _LOW]
                result = self._inner_step(gi, own) if own else result
                result = self._step_params(gi, low, drop) if low else result
                if self._codes:
                    result = self._step_coded(gi, group["params"], result)
            self.steps += 1
        finally:
            self._free_scratch()
            self._end_released()
        return result

    def _step_coded(self, index: int, plist: list[Tensor], result: Any) -> Any:
        """Step the parameters of group ``index`` whose gradients are codes: one at a time,
        decoded (and clipped) into a kept buffer, stepped, and freed."""
        for p in [p for p in plist if self.has_codes(p)]:
            p.grad = self.coded_grad(p)
            result = self._step_params(index, [p], True)
        return result

    def _buffer(self, name: str, numel: int, device: torch.device) -> Tensor:
        """The first ``numel`` elements of this step's fp32 scratch buffer ``name``."""
        buf = self._scratch.get((name, device))
        if buf is None or buf.numel() < numel:
            size = max(numel, self._chunk_size(device))
            buf = self._scratch[(name, device)] = torch.empty(
                size, dtype=torch.float32, device=device
            )
        return buf[:numel]

    def _free_scratch(self) -> None:
        """Free this step's (or backward's) scratch; on a CPU trim the C heap too, where the
        freed buffers would otherwise stay resident (see trim_heap)."""
        on_cpu = any(device.type == "cpu" for _, device in self._scratch)
        self._scratch = {}
        if on_cpu:
            trim_heap()

    def gradients_freed(self) -> None:
        """``zero_grad`` freed held 16-bit gradients: on a CPU, hand their pages back, or the
        next backward's land in fresh pages between the step's small tensors while these stay
        resident (measured: 6.8 -> 8.2 B/param and growing in a clipping loop)."""
        first = next((p for g in self.optimizer.param_groups for p in g["params"]), None)
        if self.gradients == "held" and first is not None and first.device.type == "cpu":  # held
            trim_heap()

    def _free_buffer(self, numel: int, device: torch.device) -> Tensor:
        """A scratch buffer of at least ``numel`` elements that the chunk no longer reads."""
        for (name, dev), buf in self._scratch.items():
            if name.startswith("state:") and dev == device and buf.numel() >= numel:
                return buf[:numel]
        return self._buffer("bits", numel, device)

    def _inner_step(self, index: int, params: list[Tensor]) -> Any:
        """The wrapped optimizer's own step of ``params`` alone, as group ``index``'s."""
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        for j, g in enumerate(groups):
            g["params"] = params if j == index else []
        try:
            with fused_by_default(self.optimizer):  # the fp32 temporaries: torch's fused kernel
                return self.optimizer.step()
        finally:
            for g, plist in zip(groups, saved):
                g["params"] = plist

    def _chunk_size(self, device: torch.device) -> int:
        """Elements per fp32 temporary chunk (a larger parameter is a chunk of its own)."""
        return 2**20 if device.type == "cpu" else 2**24

    def _chunks(self, params: list[Tensor]) -> list[list[Tensor]]:
        by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for p in params:
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        chunks: list[list[Tensor]] = []
        for plist in by_kind.values():
            current: list[Tensor] = []
            size = 0
            limit = self._chunk_size(plist[0].device)
            for p in plist:
                if current and size + p.numel() > limit:
                    chunks.append(current)
                    current, size = [], 0
                current.append(p)
                size += p.numel()
            if current:
                chunks.append(current)
        return chunks

    def _step_params(self, index: int, params: list[Tensor], drop: bool) -> Any:
        """Step 16-bit ``params`` of group ``index``: in one pass each where a backend takes
        them (:mod:`.fused`), the rest by the reference; ``drop``: free each gradient once used."""
        fresh = first_on_cpu(self.optimizer.state, params)
        rest = self.fused.step(self, self.optimizer.param_groups[index], params, drop)
        if fresh and len(rest) < len(params):  # first states made: the blocks freed beside
            trim_heap()  # them would stay resident (see trim_heap)
        return self._step_reference(index, rest, drop) if rest else None

    def _step_reference(self, index: int, params: list[Tensor], drop: bool) -> Any:
        """The reference step of ``params``: chunk by chunk on fp32 temporaries."""
        result = None
        for chunk in self._chunks(params):
            fresh = first_on_cpu(self.optimizer.state, chunk)
            result = self._step_chunk(index, chunk)
            for p in chunk if drop else ():
                p.grad = None
            if fresh:  # its fp32 state was made, narrowed and freed: see trim_heap
                trim_heap()
        return result

    def _step_chunk(self, index: int, chunk: list[Tensor]) -> Any:
        device, low = chunk[0].device, chunk[0].dtype
        locs = [_local(p) for p in chunk]  # the weights this rank steps (its shard under FSDP)
        numels = [p.numel() for p in locs]
        flat = self._buffer("weights", sum(numels), device)
        w32 = [v.view(p.shape) for v, p in zip(flat.split(numels), locs)]
        gflat = self._buffer("grads", sum(numels), device)
        g32 = [v.view(p.shape) for v, p in zip(gflat.split(numels), locs)]
        torch._foreach_copy_(w32, locs)
        comps = [self.compensation[p] for p in chunk] if self.update == "kahan" else []
        if comps:  # widen into the grads' scratch, then one flat fp32 add (a mixed-dtype
            # foreach add falls back to a per-tensor loop with a conversion copy each)
            torch._foreach_copy_(g32, comps)
            flat.add_(gflat)
        torch._foreach_copy_(g32, [_local(p.grad) for p in chunk])
        for t, g in zip(w32, g32):
            t.grad = g
        state = self.optimizer.state
        originals = [state.pop(p, None) for p in chunk]
        try:
            for t, st in zip(w32, self._widen_states(originals, device)):
                if st is not None:
                    state[t] = st
            result = self._inner_step(index, w32)
        except BaseException:
            for t, p, st in zip(w32, chunk, originals):
                state.pop(t, None)
                if st is not None:
                    state[p] = st
            raise
        scratch = {flat.untyped_storage().data_ptr(), gflat.untyped_storage().data_ptr()}
        scratch |= {
            v.untyped_storage().data_ptr()
            for t in w32
            for v in (state.get(t) or {}).values()
            if isinstance(v, Tensor) and v.dtype == torch.float32 and v._base is not None
        }
        copies: tuple[list[Tensor], list[Tensor]] = ([], [])  # (16-bit state, fp32 value)
        for t, p, st in zip(w32, chunk, originals):
            new = state.pop(t, None)
            t.grad = None
            if new is not None:
                state[p] = self._narrow_state(new, st or {}, low, scratch, copies)
        if copies[0]:
            torch._foreach_copy_(*copies)  # one launch set, not one copy per tensor and key
        self._write_back(chunk, locs, w32, flat, comps, low, g32, gflat)
        return result

    def _widen_states(self, states: list[dict | None], device: torch.device) -> list[dict | None]:
        """Copies of ``states`` with 16-bit tensors widened, one flat fp32 buffer per key."""
        out = [None if not st else dict(st) for st in states]
        by_key: dict[str, list[tuple[dict, Tensor]]] = {}
        for st in out:
            for k, v in (st or {}).items():
                if isinstance(v, QuantizedState) or (isinstance(v, Tensor) and v.dtype in _LOW):
                    by_key.setdefault(k, []).append((st, v))
        for k, items in by_key.items():
            sizes = [v.numel() for _, v in items]
            buf = self._buffer("state:" + k, sum(sizes), device)
            wide = [b.view(v.shape) for b, (_, v) in zip(buf.split(sizes), items)]
            low = [(w, v) for w, (_, v) in zip(wide, items) if isinstance(v, Tensor)]
            if low:
                torch._foreach_copy_(*map(list, zip(*low)))
            for w, (_, v) in zip(wide, items):
                if isinstance(v, QuantizedState):
                    v.dequantize(w)
            for (st, _), w in zip(items, wide):
                st[k] = w
        return out

    def _narrow_state(
        self,
        new: dict[str, Any],
        old: dict[str, Any],
        low: torch.dtype,
        scratch: set[int],
        copies: tuple[list[Tensor], list[Tensor]],
    ) -> dict[str, Any]:
        """The stepped state in its storage dtypes; copies into existing tensors are queued in
        ``copies`` (the caller runs them as one foreach copy)."""
        out: dict[str, Any] = {}
        for k, v in new.items():
            if (
                not isinstance(v, Tensor)
                or not v.is_floating_point()
                or k == "step"
                or v.dim() == 0
            ):
                out[k] = v
                continue
            want = self._dtype_for(k, low)
            prev = old.get(k)
            if isinstance(want, str):
                if quantizable(v):
                    out[k] = store_state(k, v, want, prev)
                    continue
                want = torch.float32  # too small for codes: kept exact
            if (
                isinstance(prev, Tensor)
                and prev.dtype == want
                and prev.shape == v.shape
                and prev is not v
            ):
                copies[0].append(prev)
                copies[1].append(v)
                out[k] = prev
            elif v.dtype != want or v.untyped_storage().data_ptr() in scratch:
                out[k] = v.to(want, copy=True)
            else:
                out[k] = v
        return out

    def _write_back(
        self,
        params: list[Tensor],
        chunk: list[Tensor],
        w32: list[Tensor],
        flat: Tensor,
        comps: list[Tensor],
        low: torch.dtype,
        tmp32: list[Tensor],
        tmp_flat: Tensor,
    ) -> None:
        """Round ``w32`` into ``chunk`` (the local tensors of ``params``)."""
        if self.update == "stochastic":
            segments = []
            for p, t in zip(params, chunk):  # (length, global offset, key) of each parameter
                key, mix = round_keys(self.seed, self.steps, self._ordinal[id(p)])
                segments.append((t.numel(), shard_offset(p), key))
            # the grads' scratch is free again, and so is a state's once the states are stored:
            # they hold the random bits (a buffer of its own only where no state was widened)
            bits = (tmp_flat, self._free_buffer(flat.numel(), flat.device))
            rounded = keyed_round_(flat, low, segments, mix, bits)
            if low == torch.bfloat16:  # rounded in place to bf16 values: the copy is lossless
                torch._foreach_copy_(chunk, w32)
            else:
                torch._foreach_copy_(
                    chunk,
                    [
                        v.view(p.shape)
                        for v, p in zip(rounded.split([p.numel() for p in chunk]), chunk)
                    ],
                )
            return
        torch._foreach_copy_(chunk, w32)  # round to nearest
        if comps:  # the exact residual w32 - round(w32), all in fp32 scratch (flat)
            torch._foreach_copy_(tmp32, chunk)
            flat.sub_(tmp_flat)
            torch._foreach_copy_(comps, w32)

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Compensation buffers (in parameter order), the step count and what "auto" decided."""
        return {
            "update": self.update,
            "seed": self.seed,
            "compensation": [
                None if (c := self.compensation.get(p)) is None else c.detach().clone()
                for p in self.params()
            ],
            "steps": self.steps,
            "gradients": self.release_state(),
        }

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any] | None) -> None:
        """Restore compensation and the step count; None (an older checkpoint) resets them."""
        if sd is None:
            for c in self.compensation.values():
                c.zero_()
            self.steps = 0
            return
        if sd.get("update") != self.update:
            raise ValueError(
                f"The checkpoint was saved with update={sd.get('update')!r}, this "
                f"optimizer uses update={self.update!r}; initialize with the same "
                "update mode to resume."
            )
        params = self.params()
        comps = sd["compensation"]
        if len(comps) != len(params):
            raise ValueError(
                f"The checkpoint has {len(comps)} compensation entries, this "
                f"optimizer has {len(params)} parameters."
            )
        for p, saved in zip(params, comps):
            mine = self.compensation.get(p)
            if (mine is None) != (saved is None):
                raise ValueError(
                    "The checkpoint's compensation buffers do not match this "
                    "optimizer's 16-bit parameters (another model or level?)."
                )
            if mine is not None:
                mine.copy_(saved)
        self.seed = int(sd.get("seed", self.seed))
        self.steps = int(sd["steps"])
        self.load_release_state(sd.get("gradients"))

    def export_states(self, sd: dict[str, Any]) -> dict[str, Any]:
        """``sd`` (the inner optimizer's state dict) with each quantized state as plain tensors
        and strings (:meth:`QuantizedState.to_dict`), which ``torch.load(weights_only=True)``
        reads; the optimizer's own per-parameter dicts are not modified."""
        state = {
            i: {k: v.to_dict() if isinstance(v, QuantizedState) else v for k, v in st.items()}
            if any(isinstance(v, QuantizedState) for v in st.values())
            else st
            for i, st in sd["state"].items()
        }
        return {**sd, "state": state}

    def restore_state_dtypes(self, saved: dict[str, Any]) -> None:
        """Undo ``Optimizer.load_state_dict``'s cast of every state tensor to the parameter's
        dtype: put back the saved tensors (fp32 second moments stay fp32, bit for bit). A saved
        value its storage dtype (``state_dtype``) holds exactly is stored in it, as a step
        stores it (a 16-bit first moment that a plain optimizer widened to fp32 before
        ``initialize``); a more precise one stays as saved until the next step narrows it.
        Quantized states are rebuilt from the saved codes and scales."""
        ids = [i for g in saved["param_groups"] for i in g["params"]]
        for p, i in zip(self.params(), ids):
            st, src = self.optimizer.state.get(p), saved["state"].get(i)
            if not st or not src:
                continue
            for k, v in src.items():
                have = st.get(k)
                if QuantizedState.is_dict(v):  # exact from the saved codes and fp32 scales
                    st[k] = QuantizedState.from_dict(v, device=p.device)
                elif isinstance(v, Tensor) and isinstance(have, Tensor):
                    want = self._restored_dtype(p, k, v)
                    if have.dtype != want:
                        st[k] = v.detach().to(device=have.device, dtype=want, copy=True)

    def _restored_dtype(self, p: Tensor, key: str, saved: Tensor) -> torch.dtype:
        """The dtype to keep saved state ``key`` of ``p`` in (see restore_state_dtypes)."""
        if p.dtype in _LOW and saved.is_floating_point() and key != "step" and saved.dim() > 0:
            stored = self._dtype_for(key, p.dtype)
            if isinstance(stored, str):  # codes (built at the next step), or fp32 if too small
                return saved.dtype if quantizable(saved) else torch.float32
            if torch.equal(saved.to(stored).to(saved.dtype), saved):
                return stored
        return saved.dtype
