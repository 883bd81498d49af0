"""nanoGPT's own ``train.py`` with mixprec's ``initialize`` line added: does each recipe run the
loop as nanoGPT writes it (``grad_clip=1.0``, gradient accumulation, its LR schedule), and how
long is an iteration next to torch.autocast and fp32?

    python benchmarks/bench_nanogpt.py --nanogpt PATH [--modes fp32 torch-autocast O2 lean]

``PATH`` is a checkout of karpathy/nanoGPT (not shipped here). Its ``train.py`` and ``model.py``
are copied to a temporary folder; the copy of ``train.py`` gets two edits, each applied only for
its mode: ``ctx`` becomes ``torch.autocast("cpu", torch.bfloat16)`` for ``torch-autocast``
(nanoGPT leaves CPU runs in fp32), and ``model, optimizer = mixprec.initialize(model, optimizer,
RECIPE, torch.bfloat16)`` follows ``configure_optimizers`` for a mixprec recipe. The data is a
character corpus made from Python's standard-library sources (nothing is downloaded). Modes run
as separate processes, round by round in turn; the figure per mode is the median of the logged
iteration times after the first ``--skip`` iterations, pooled over rounds, and the ratio to
torch.autocast is taken from the same rounds.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch

MODES = ("fp32", "torch-autocast", "O2", "O3", "lean", "lean gradients=coded")
#: nanoGPT's configuration for the run (a small character model on a CPU, one thread)
CONFIG = dict(
    device="cpu",
    compile=False,
    dtype="bfloat16",
    dataset="stdlib_char",
    batch_size=12,
    block_size=64,
    n_layer=4,
    n_head=4,
    n_embd=128,
    dropout=0.0,
    eval_interval=100000,
    eval_iters=1,
    log_interval=1,
    always_save_checkpoint=False,
    gradient_accumulation_steps=2,
    learning_rate=1e-3,
    warmup_iters=10,
    lr_decay_iters=1000,
    min_lr=1e-4,
)


def corpus(folder: Path, chars: int) -> None:
    """nanoGPT's ``data/<dataset>`` layout (train.bin, val.bin, meta.pkl) from stdlib text."""
    text = ""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_text(errors="ignore")
        if len(text) >= chars:
            break
    text = text[:chars]
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    ids = np.array([index[c] for c in text], dtype=np.uint16)
    split = int(0.9 * len(ids))
    folder.mkdir(parents=True, exist_ok=True)
    ids[:split].tofile(folder / "train.bin")
    ids[split:].tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(vocab), "itos": dict(enumerate(vocab)), "stoi": index}, f)


def patched(train_py: str, mode: str) -> str:
    """``train.py`` with this mode's edit (none for fp32)."""
    if mode == "torch-autocast":
        old = "ctx = nullcontext() if device_type == 'cpu' else"
        if old not in train_py:
            raise SystemExit("train.py changed: its ctx line was not found")
        return train_py.replace(old, "ctx = torch.autocast('cpu', torch.bfloat16) if True else")
    if mode == "fp32":
        return train_py
    anchor = re.search(r"^optimizer = model\.configure_optimizers\(.*\)$", train_py, re.MULTILINE)
    if anchor is None:
        raise SystemExit("train.py changed: its configure_optimizers line was not found")
    line = (
        "\nimport mixprec; model, optimizer = mixprec.initialize("
        f"model, optimizer, {mode!r}, torch.bfloat16)"
    )
    return train_py[: anchor.end()] + line + train_py[anchor.end() :]


def run(folder: Path, mode: str, iters: int) -> list[tuple[float, float]]:
    """(loss, ms) of every logged iteration of one nanoGPT run."""
    (folder / "train.py").write_text(patched((folder / "train.orig.py").read_text(), mode))
    args = [f"--{k}={v}" for k, v in {**CONFIG, "max_iters": iters}.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{mode}: train.py failed\n{out.stderr[-3000:]}")
    found = re.findall(r"iter (\d+): loss ([\d.]+), time ([\d.]+)ms", out.stdout)
    return [(float(loss), float(ms)) for _, loss, ms in found]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nanogpt", required=True, help="a checkout of karpathy/nanoGPT")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--iters", type=int, default=150)
    ap.add_argument("--skip", type=int, default=20, help="iterations left out of the timing")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    src = Path(args.nanogpt)
    with tempfile.TemporaryDirectory(prefix="mixprec_nanogpt_") as tmp:
        folder = Path(tmp)
        for name in ("model.py", "configurator.py"):
            shutil.copy(src / name, folder / name)
        shutil.copy(src / "train.py", folder / "train.orig.py")
        corpus(folder / "data" / CONFIG["dataset"], 400_000)
        times: dict[str, list[float]] = {m: [] for m in args.modes}
        final: dict[str, float] = {}
        for _ in range(args.rounds):
            for mode in args.modes:
                logged = run(folder, mode, args.iters)
                times[mode] += [ms for _, ms in logged[args.skip :]]
                final[mode] = statistics.mean(loss for loss, _ in logged[-10:])
    base = statistics.median(times["torch-autocast"]) if "torch-autocast" in times else None
    print(
        f"nanoGPT train.py, {CONFIG['n_layer']}x{CONFIG['n_embd']} char model, grad_clip=1.0, "
        f"accumulation {CONFIG['gradient_accumulation_steps']}, 1 thread, torch "
        f"{torch.__version__}, {args.rounds} rounds x {args.iters} iterations\n"
    )
    print("| mode | median ms/iter | x torch.autocast | train loss (last 10 iters) |")
    print("|---|---|---|---|")
    for mode in args.modes:
        ms = statistics.median(times[mode])
        ratio = f"{ms / base:.2f}x" if base else "-"
        print(f"| {mode} | {ms:.1f} | {ratio} | {final[mode]:.4f} |")


if __name__ == "__main__":
    main()
