"""Inference benchmark: train with mixprec, then compare inference variants to fp32.

Workloads (bounded so the whole run takes ~5-10 minutes on a shared 2-core CPU):

* ``mnist1d-cnn``: the MNIST-1D paper CNN trained with mixprec O2 bf16 (500 steps, batch 400)
  on 10,000 generated MNIST-1D samples (8000 train / 2000 test, so 0.5 points = 10 samples);
  the metric is test accuracy.
* ``char-gpt``: a 2-layer, 192-wide char-GPT (context 256) trained with mixprec O2 bf16 (150
  steps, batch 16) on the quick stdlib-source corpus; the metric is validation perplexity.
* ``minilm``: all-MiniLM-L6-v2 as a mean-pooled sentence embedder on 16 sentences: its
  pretrained weights from a local Hugging Face directory (``--minilm-weights DIR``; nothing is
  downloaded), else its architecture with random weights; the metric is the worst sentence's
  embedding cosine similarity to fp32.

Every variant (fp32, bf16, fp16, int8-mixed = bf16 + torch.ao dynamic int8 Linear chosen by the
accuracy-driven pass, int8-wo = bf16 + weight-only int8) runs in PyTorch; every exportable one
also as an ONNX file in ONNX Runtime (CPU). Errors are against the fp32 PyTorch model; timings
are interleaved rounds, speed-ups the median of per-round ratios (mixprec/infer_bench.py).

    python benchmarks/bench_inference.py --json benchmarks/results_inference.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mixprec.inference.bench import compare_variants, to_json, to_markdown
from mixprec.inference.bench_workloads import _workload

VARIANTS = ["fp32", "bf16", "fp16", "int8-mixed", "int8-wo"]
# workload -> (timing batch, train steps, train batch, timing iters per round)
SETTINGS = {"mnist1d-cnn": (256, 500, 400, 3), "char-gpt": (4, 150, 16, 1), "minilm": (16, 0, 0, 1)}
MNIST_SAMPLES = 10_000
GPT_CONFIG = "2x192"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cnn-steps", type=int, default=SETTINGS["mnist1d-cnn"][1])
    p.add_argument("--gpt-steps", type=int, default=SETTINGS["char-gpt"][1])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default="benchmarks/results_inference.json")
    p.add_argument("--workloads", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument(
        "--minilm-weights",
        default=None,
        metavar="DIR",
        help="a local Hugging Face directory of all-MiniLM-L6-v2 (default: random weights)",
    )
    args = p.parse_args()
    out = {
        "command": "python benchmarks/bench_inference.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
        ),
        "threads": torch.get_num_threads(),
    }
    start = time.time()
    for name in args.workloads:
        t0 = time.time()
        batch, _, train_batch, iters = SETTINGS[name]
        steps = {"mnist1d-cnn": args.cnn_steps, "char-gpt": args.gpt_steps}.get(name, 0)
        model, inputs, metric, metric_name = _workload(
            name,
            batch,
            steps,
            0,
            train_batch=train_batch,
            mnist_samples=MNIST_SAMPLES,
            gpt_config=GPT_CONFIG,
            weights=args.minilm_weights,
        )
        trained = time.time() - t0
        rows = compare_variants(
            model,
            inputs,
            variants=VARIANTS,
            backends=["torch", "onnxruntime"],
            metric=metric,
            rounds=args.rounds,
            iters=iters,
        )
        what = (
            f"trained {steps} steps (batch {train_batch}) with mixprec O2 bf16 in {trained:.0f} s"
            if steps
            else f"pretrained weights from {args.minilm_weights}"
            if args.minilm_weights
            else "random weights (no --minilm-weights)"
        )
        print(f"\n{name}: {what}; timing batch {batch}; {time.time() - t0:.0f} s total")
        print(to_markdown(rows, metric_name), flush=True)
        out[name] = to_json(
            rows,
            metric=metric_name,
            train_steps=steps,
            train_batch=train_batch,
            timing_batch=batch,
            iters=iters,
            rounds=args.rounds,
            seconds=round(time.time() - t0),
            model=(f"GPT {GPT_CONFIG}" if name == "char-gpt" else None),
            data=(
                f"{MNIST_SAMPLES} generated MNIST-1D samples, 80/20 split"
                if name == "mnist1d-cnn"
                else None
            ),
        )
    out["seconds"] = round(time.time() - start)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {args.json} ({out['seconds']} s)")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
