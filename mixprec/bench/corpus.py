"""A reproducible character-level corpus built from the Python standard library's own source.

Design choices:

* **No download, no data files.** Every CPython install ships its standard library as source, so
  the text is present on every machine that can run mixprec. The directory is located with
  ``sysconfig.get_paths()["stdlib"]``.
* **A fixed, explicit, sorted file list** (:data:`FILES`) rather than a glob: a glob would pick up
  whatever the local install happens to contain (site-specific files, tests, newer modules), so
  the corpus would silently change size and content between machines. Every listed file is a
  pure-Python module that exists as the same path in CPython 3.10 through 3.13 (``pathlib`` and
  ``zipfile``, which became packages in 3.13 / 3.12, are deliberately not listed). A file that is
  missing anyway is skipped and left out of :attr:`CharCorpus.files`.
* **A fixed vocabulary** (:data:`VOCAB`): ``"\\n"`` plus the 95 printable ASCII characters, 96
  symbols in a fixed order. The model's vocabulary size (``GPTConfig.vocab_size == 96``) never
  depends on the data, ids mean the same character everywhere, and a checkpoint trained on one
  machine decodes on another. Tabs become four spaces; every other character (non-ASCII,
  control characters) becomes ``"?"``.
* **A fingerprint** (:attr:`CharCorpus.sha256`, over the encoded id bytes): the stdlib source
  differs between Python versions (and occasionally patch releases), so two benchmark results
  are only comparable on the same corpus. Equal fingerprints mean identical training data; a
  different fingerprint is the honest signal that they are not.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["FILES", "VAL_FRACTION", "VOCAB", "CharCorpus", "build_corpus", "decode", "encode"]

#: The 96-symbol vocabulary: id 0 is ``"\n"``, ids 1..95 are ASCII 32 (space) .. 126 (``~``).
VOCAB: str = "\n" + "".join(chr(c) for c in range(32, 127))

#: Standard-library files (relative to the stdlib directory), in concatenation order.
FILES: tuple[str, ...] = (
    "abc.py",
    "argparse.py",
    "ast.py",
    "bisect.py",
    "calendar.py",
    "collections/__init__.py",
    "configparser.py",
    "contextlib.py",
    "copy.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "glob.py",
    "gzip.py",
    "heapq.py",
    "inspect.py",
    "ipaddress.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "os.py",
    "pickle.py",
    "pprint.py",
    "queue.py",
    "random.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "tokenize.py",
    "traceback.py",
    "typing.py",
    "uuid.py",
    "warnings.py",
    "weakref.py",
)

#: Fraction of the corpus (the contiguous tail) held out for validation.
VAL_FRACTION = 0.1

_UNKNOWN = VOCAB.index("?")
# Byte -> id table used by bytes.translate: ASCII characters in the vocabulary map to their id,
# every other byte value to the id of "?".
_TABLE = bytes(VOCAB.index(chr(b)) if chr(b) in VOCAB else _UNKNOWN for b in range(256))


@dataclass(frozen=True)
class CharCorpus:
    """An encoded corpus split into contiguous train / validation id tensors.

    Attributes:
        train: int64 ids, the first 90% of the corpus.
        val: int64 ids, the last 10% of the corpus.
        files: the files of :data:`FILES` that were found and used, in order.
        sha256: hex digest of the encoded ids (one byte per id, before the split).
    """

    train: torch.Tensor
    val: torch.Tensor
    files: tuple[str, ...]
    sha256: str

    def __len__(self) -> int:
        return len(self.train) + len(self.val)


def _encode_bytes(text: str) -> bytes:
    """Encode ``text`` to one byte per character, each byte an id into :data:`VOCAB`."""
    ascii_bytes = text.replace("\t", "    ").encode("ascii", errors="replace")
    return ascii_bytes.translate(_TABLE)


def encode(text: str) -> torch.Tensor:
    """Map text to an int64 tensor of vocabulary ids.

    Args:
        text: any string; tabs become four spaces and characters outside :data:`VOCAB` become
            ``"?"`` (one ``"?"`` per code point).

    Returns:
        A 1-D ``torch.int64`` tensor of ids in ``[0, 96)``.
    """
    data = _encode_bytes(text)
    if not data:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def decode(ids: torch.Tensor | Iterable[int]) -> str:
    """Map vocabulary ids (a tensor or any iterable of ints) back to text."""
    if isinstance(ids, torch.Tensor):
        ids = ids.reshape(-1).tolist()
    return "".join(VOCAB[int(i)] for i in ids)


def stdlib_dir() -> Path:
    """The directory holding this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=8)
def build_corpus(max_chars: int | None = None) -> CharCorpus:
    """Build (once per ``max_chars``) the standard-library character corpus.

    The listed files are read as UTF-8 (with universal newlines), joined in :data:`FILES` order
    with ``"\\n"``, encoded with :func:`encode`, optionally truncated, and split contiguously:
    the first 90% is ``train``, the rest ``val``.

    Args:
        max_chars: keep only the first ``max_chars`` encoded characters (after tab expansion),
            for quick runs and tests; None keeps the whole corpus.

    Returns:
        The :class:`CharCorpus`; the result is cached, so treat its tensors as read-only.

    Raises:
        ValueError: if ``max_chars`` is not positive.
        FileNotFoundError: if none of the listed files exist.
    """
    if max_chars is not None and max_chars <= 0:
        raise ValueError(f"max_chars must be positive or None, got {max_chars}")
    root = stdlib_dir()
    texts, used = [], []
    for name in FILES:
        path = root / name
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
            used.append(name)
    if not used:
        raise FileNotFoundError(f"none of the corpus files were found under {root}")
    data = _encode_bytes("\n".join(texts))
    if max_chars is not None:
        data = data[:max_chars]
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    n_train = len(ids) - round(len(ids) * VAL_FRACTION)
    return CharCorpus(
        train=ids[:n_train].clone(),
        val=ids[n_train:].clone(),
        files=tuple(used),
        sha256=hashlib.sha256(data).hexdigest(),
    )
