"""Accuracy and speed of inference variants against fp32: ``mixprec infer-bench``.

Design (the benchmark rules of ``benchmarks/NOTES.md``: one process, interleaved rounds, ratios):
every variant (fp32, bf16, fp16, int8-mixed; in PyTorch and, optionally, ONNX Runtime) is built
once, then timed round-robin -- each round runs every variant once -- so host drift hits all of
them alike. Latency is the median and 90th percentile over rounds; the speed-up is the median of
per-round ratios against fp32 in the same backend. Errors (max/mean abs, cosine similarity) are
against the fp32 PyTorch model on the same inputs; a task metric is computed when the caller
gives one. Size is the bytes of the saved state dict (PyTorch) or of the ONNX file. The CLI's
workloads (models, data, metrics) live in :mod:`mixprec.inference.bench_workloads`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from mixprec.bench.report import speed_words
from mixprec.inference.bench_workloads import WORKLOADS, _workload
from mixprec.inference.inputs import call_model
from mixprec.inference.prepare import for_inference

__all__ = ["VARIANTS", "VariantResult", "add_parser", "compare_variants", "to_json", "to_markdown"]

VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": dict(policy=torch.float32),
    "bf16": dict(policy=torch.bfloat16),
    "fp16": dict(policy=torch.float16),
    "int8-mixed": dict(policy=torch.bfloat16, int8="dynamic"),
    "int8-wo": dict(policy=torch.bfloat16, int8="weight_only"),
}


@dataclass
class VariantResult:
    """One row of the report (errors are against the fp32 PyTorch model)."""

    variant: str
    backend: str
    max_abs: float
    mean_abs: float
    cosine: float
    metric: float | None
    latency_ms: float
    p90_ms: float
    speedup: float
    size_mb: float
    note: str = ""
    vs_torch_fp32: float | None = None  # median per-round ratio against fp32 in PyTorch


def _flat(out: Any) -> torch.Tensor:
    from mixprec.inference.export import _flat_outputs

    return torch.cat([t.detach().double().flatten() for t in _flat_outputs(out)])


def _size_mb(model: nn.Module) -> float:
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.tell() / 2**20


def compare_variants(
    model: nn.Module,
    inputs: Any,
    *,
    variants: Sequence[str] = ("fp32", "bf16", "fp16", "int8-mixed"),
    backends: Sequence[str] = ("torch",),
    metric: Callable[[Callable[[Any], Any]], float] | None = None,
    rounds: int = 7,
    iters: int = 3,
    int8_tolerance: float = 1e-3,
    workdir: str | None = None,
) -> list[VariantResult]:
    """Build each variant of an fp32 ``model`` and compare it with fp32 on ``inputs``.

    Args:
        model: the fp32 model (or an ``initialize``d one).
        inputs: one batch (tensor, tuple or dict), used for errors, int8 selection and timing.
        variants: names from :data:`VARIANTS`.
        backends: ``"torch"`` and/or ``"onnxruntime"`` (CPU provider; int8 dynamic is skipped
            there, bf16 runs as bf16 storage + fp32 compute, see :mod:`mixprec.inference.export`).
        metric: ``metric(forward) -> float``, with ``forward(inputs) -> output``; e.g. test
            accuracy or perplexity evaluated through that variant.
        rounds / iters: timing rounds, and calls per variant per round.
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"Unknown variant(s) {unknown}; choose from {list(VARIANTS)}.")
    bad = [b for b in backends if b not in ("torch", "onnxruntime")]
    if bad:
        raise ValueError(f"Unknown backend(s) {bad}; choose 'torch' and/or 'onnxruntime'.")
    tmp = workdir or tempfile.mkdtemp(prefix="mixprec_infer_")
    built = _build(model, inputs, variants, backends, int8_tolerance, tmp)
    with torch.no_grad():
        ref = _flat(call_model(for_inference(model, torch.float32), inputs))
        outs = {k: _flat(v[0]()) for k, v in built.items()}
        times = _time_interleaved(built, rounds, iters)
        return [
            _result(name, backend, built, outs[(name, backend)], ref, times, metric)
            for name, backend in built
        ]


# (variant, backend) -> (call on the timing batch, forward(inputs), size in MB, note)
_Built = dict[tuple[str, str], tuple[Callable[[], Any], Callable[[Any], Any], float, str]]


def _build(
    model: nn.Module,
    inputs: Any,
    variants: Sequence[str],
    backends: Sequence[str],
    int8_tolerance: float,
    tmp: str,
) -> _Built:
    """Each variant through :func:`mixprec.for_inference`, in PyTorch and/or as an ONNX file in
    ``tmp`` run by ONNX Runtime (not int8 dynamic, which does not export)."""
    built: _Built = {}
    for name in variants:
        opts = dict(VARIANTS[name])
        pol = opts.pop("policy")
        if opts.get("int8"):
            opts.update(int8_modules="auto", int8_tolerance=int8_tolerance)
        m = for_inference(model, pol, inputs, **opts)
        if "torch" in backends:
            built[(name, "torch")] = (
                lambda m=m: call_model(m, inputs),
                lambda x, m=m: call_model(m, x),
                _size_mb(m),
                _int8_note(m),
            )
        if "onnxruntime" in backends and opts.get("int8") != "dynamic":
            built[(name, "onnxruntime")] = _onnx_variant(
                m, inputs, os.path.join(tmp, f"{name}.onnx")
            )
    return built


def _time_interleaved(built: _Built, rounds: int, iters: int) -> dict[tuple[str, str], list[float]]:
    """Milliseconds per call of each variant per round, after one warm-up call each; every
    round runs every variant, so drift of the host hits them alike."""
    times: dict[tuple[str, str], list[float]] = {k: [] for k in built}
    for fn in built.values():  # warm-up
        fn[0]()
    for _ in range(rounds):
        for k, fn in built.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                fn[0]()
            times[k].append((time.perf_counter() - t0) / iters * 1e3)
    return times


def _result(
    name: str,
    backend: str,
    built: _Built,
    out: torch.Tensor,
    ref: torch.Tensor,
    times: dict[tuple[str, str], list[float]],
    metric: Callable[[Callable[[Any], Any]], float] | None,
) -> VariantResult:
    """One row: errors against fp32 PyTorch, the metric, latency and per-round speed ratios."""
    _, fwd, size, note = built[(name, backend)]
    own = times[(name, backend)]
    base = times.get(("fp32", backend), own)
    torch_base = times.get(("fp32", "torch"))
    diff = (out - ref).abs()
    ts = sorted(own)
    return VariantResult(
        name,
        backend,
        float(diff.max()),
        float(diff.mean()),
        float(torch.nn.functional.cosine_similarity(out, ref, dim=0)),
        None if metric is None else float(metric(fwd)),
        statistics.median(ts),
        ts[min(len(ts) - 1, round(0.9 * (len(ts) - 1)))],
        statistics.median(b / t for b, t in zip(base, own)),
        size,
        note,
        None if torch_base is None else statistics.median(b / t for b, t in zip(torch_base, own)),
    )


def _int8_note(model: nn.Module) -> str:
    from mixprec.inference.prepare import inference_info

    info = inference_info(model)
    if info is None or not info.int8:
        return ""
    total = sum(
        1
        for n, m in model.named_modules()
        if n and isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))
    ) + len(info.int8)
    return f"{len(info.int8)}/{total} Linear/Conv int8"


def _onnx_variant(
    model: nn.Module, inputs: Any, path: str
) -> tuple[Callable[[], Any], Callable[[Any], Any], float, str]:
    from mixprec.inference.export import _as_args, _feeds, export, ort_session

    result = export(model, inputs, path, check=False)
    sess = ort_session(path, threads=torch.get_num_threads(), spin=False)  # fair interleaving
    args, kwargs = _as_args(inputs)
    feeds = _feeds(sess, args, kwargs)

    def fwd(x: Any) -> Any:  # one output -> a tensor, as the PyTorch model returns
        a, k = _as_args(x)
        outs = [torch.from_numpy(o) for o in sess.run(None, _feeds(sess, a, k))]
        return outs[0] if len(outs) == 1 else outs

    notes = [f"compute={result.compute}"]
    if result.notes:
        notes.append(result.notes[0].split(":")[0])
    if _int8_note(model):
        n8 = sum(v == "int8" for v in result.weight_dtypes.values())
        notes.append(f"{_int8_note(model)} in torch; {n8} int8 initializers in the file")
    return (
        lambda: [torch.from_numpy(o) for o in sess.run(None, feeds)],
        fwd,
        os.path.getsize(path) / 2**20,
        ", ".join(notes),
    )


_HEADERS = [
    "variant",
    "backend",
    "max abs err",
    "mean abs err",
    "cosine",
    "metric",
    "median ms",
    "p90 ms",
    "vs fp32",
    "vs torch fp32",
    "size MB",
    "note",
]


def to_markdown(results: Sequence[VariantResult], metric_name: str = "metric") -> str:
    """The report as a Markdown table."""
    head = [metric_name if h == "metric" else h for h in _HEADERS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        metric = "-" if r.metric is None else f"{r.metric:.6g}"
        vs = speed_words(r.vs_torch_fp32)
        lines.append(
            f"| {r.variant} | {r.backend} | {r.max_abs:.3g} | {r.mean_abs:.3g} | "
            f"{r.cosine:.6f} | {metric} | {r.latency_ms:.2f} | {r.p90_ms:.2f} | "
            f"{speed_words(r.speedup)} | {vs} | {r.size_mb:.2f} | {r.note} |"
        )
    return "\n".join(lines)


def to_json(results: Sequence[VariantResult], **meta: Any) -> dict[str, Any]:
    """The report as a JSON-ready dict (``meta`` adds fields such as the command)."""
    return {
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        **meta,
        "results": [asdict(r) for r in results],
    }


# ------------------------------------------------------------------------------- CLI


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``infer-bench`` subcommand to the ``mixprec`` CLI's subparsers."""
    p = sub.add_parser(
        "infer-bench",
        help="inference variants (fp32/bf16/fp16/int8) vs fp32: errors, task metric, latency, size",
    )
    p.add_argument("workload", choices=WORKLOADS)
    p.add_argument(
        "--variants",
        nargs="+",
        default=["fp32", "bf16", "fp16", "int8-mixed"],
        choices=list(VARIANTS),
    )
    p.add_argument(
        "--backends", nargs="+", default=["torch", "onnxruntime"], choices=["torch", "onnxruntime"]
    )
    p.add_argument("--batch", type=int, default=32)
    p.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="train the workload's model with mixprec O2 bf16 first (not minilm)",
    )
    p.add_argument(
        "--train-batch",
        type=int,
        default=None,
        help="training batch size (default: the workload's)",
    )
    p.add_argument(
        "--mnist-samples",
        type=int,
        default=None,
        help="mnist1d-cnn: generate this many samples (80/20 split) instead of the "
        "standard 4000/1000 set",
    )
    p.add_argument(
        "--gpt-config",
        default=None,
        help="char-gpt: LAYERSxWIDTH, e.g. 2x192 (default: the bench's 4x384)",
    )
    p.add_argument(
        "--weights",
        default=None,
        metavar="DIR",
        help="minilm: a local Hugging Face directory of all-MiniLM-L6-v2 (model and tokenizer; "
        "nothing is downloaded); default: random weights from --seed",
    )
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=3, help="calls per variant per timing round")
    p.add_argument("--int8-tolerance", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``mixprec infer-bench`` (prints a Markdown table, optionally writes JSON)."""
    if args.batch < 1 or args.rounds < 1 or args.iters < 1 or args.train_steps < 0:
        raise SystemExit(
            f"--batch, --rounds and --iters must be >= 1 and --train-steps >= 0, "
            f"received {args.batch}, {args.rounds}, {args.iters}, "
            f"{args.train_steps}."
        )
    if args.weights is not None and args.workload != "minilm":
        raise SystemExit(
            f"--weights loads all-MiniLM-L6-v2 for the minilm workload; {args.workload} builds "
            "and trains its own model (drop --weights, or choose minilm)."
        )
    model, inputs, metric, metric_name = _workload(
        args.workload,
        args.batch,
        args.train_steps,
        args.seed,
        train_batch=args.train_batch,
        mnist_samples=args.mnist_samples,
        gpt_config=args.gpt_config,
        weights=args.weights,
    )
    results = compare_variants(
        model,
        inputs,
        variants=args.variants,
        backends=args.backends,
        metric=metric,
        rounds=args.rounds,
        iters=args.iters,
        int8_tolerance=args.int8_tolerance,
    )
    print(
        f"mixprec infer-bench {args.workload} (batch {args.batch}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads)"
    )
    print(to_markdown(results, metric_name))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                to_json(
                    results,
                    workload=args.workload,
                    metric=metric_name,
                    args=vars(args) | {"run": None},
                ),
                f,
                indent=1,
                default=str,
            )
        print(f"wrote {args.json}")
    return 0
